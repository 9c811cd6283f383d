"""A normal (non-editable) install: the wheel carries its data files and the installed commands find them."""
import shutil
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_wheel_ships_the_published_tables_and_the_kernel_sources(tmp_path):
    # build from a copy: setuptools writes build/ and *.egg-info beside the sources it builds
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "results", "reports",
                                                             "__pycache__", "*.egg-info", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("moebench-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "harness/analysis/data/tensorsharp_moe_cpu_offload.csv" in names
    assert any(n.startswith("engines/reference/kernels/") and n.endswith(".cpp") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    # run from elsewhere with only the installed copy on the path: the source tree must not be what is found
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c", "import harness; print(harness.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site))
    r = subprocess.run([sys.executable, "-m", "harness", "published", "--model", "gpt-oss-20b", "--format", "csv"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") > 3 and "TensorSharp" in r.stdout
