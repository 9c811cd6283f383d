"""benchmarks/gpu_check.sh on a CPU machine, so the GPU check cannot rot between GPU sessions: the dry run (the CPU
part of every step, the GPU commands and their budget), the preparation's trimming and checks on a fake sdist,
and the GPU tests' helpers (tests/test_gpu.py) against real CPU runs."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from engines.base import EngineSettings
from tests.conftest import ROOT
from tests.test_gpu import (StreamCall, llama_buffers, llama_placement, overlap_fraction, overlap_ms, phase_level,
                            stream_log, stream_problems, streamed_bytes)

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu_check"))
import pack  # noqa: E402
import plan  # noqa: E402
import prepare  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def script(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "OUT"} | (env or {}))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-check")
    r = script("--dry-run", env={"OUT": str(d / "out"), "GPU_CHECK_WORK": str(d / "work")})
    return r, d / "out"


def test_dry_run_passes_and_prints_the_gpu_plan(dry_run):
    r, _ = dry_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for needle in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DGGML_CUDA_FA=OFF", "--no-index",
                   "--no-build-isolation", "pytest -m gpu tests/test_gpu.py",
                   f"sweep -m preset:{plan.PRESET} -e llama-cpp,reference --n-cpu-moe 0,2,all -w pp4096,pp8192,tg128",
                   "harness probe", "harness report"):
        assert needle in out, needle
    budget, planned = map(int, re.search(r"GPU plan \(budget (\d+) s, planned (\d+) s\)", out).groups())
    assert planned <= budget == plan.BUDGET_S <= 540


def test_dry_run_runs_the_cpu_part_of_every_step(dry_run):
    r, out = dry_run
    steps = json.loads((out / "steps.json").read_text())
    status = {s["name"]: s["status"] for s in steps["steps"]}
    assert status["build"] == "skipped"
    assert all(status[n] == "ok" for n in ("env", "synth", "kernels", "probe", "tests", "sweep", "report")), status
    # setup installs the carried wheels offline where .gpu/ is prepared; CI's fresh clone has none
    assert status["setup"] == ("ok" if steps["facts"]["prepared"] else "skipped")
    assert steps["facts"]["missing_on_image"] == []
    assert all(line.startswith("ok:") for line in steps["facts"]["sweep_checks"]), steps["facts"]["sweep_checks"]
    with tarfile.open(out / "gpu-check.tar.gz") as tf:
        names = set(tf.getnames())
        xml = tf.extractfile("gpu-check/pytest-gpu.xml").read().decode()
        run = next(n.rsplit("/", 1)[0] for n in names if n.endswith("/cells.csv") and "/results/" in n)
        cache_run = next(n.rsplit("/", 1)[0] for n in names if n.endswith("/cells.csv") and "/cache-results/" in n)
        cache_cells = list(csv.DictReader(tf.extractfile(f"{cache_run}/cells.csv").read().decode().splitlines()))
        cache_md = tf.extractfile("gpu-check/cache.md").read().decode()
        cells = list(csv.DictReader(tf.extractfile(f"{run}/cells.csv").read().decode().splitlines()))
    assert {"gpu-check/report/report.md", "gpu-check/report/report.html", "gpu-check/probe.json",
            "gpu-check/sweep.md", "gpu-check/summary.md", "gpu-check/logs/sweep.log"} <= names
    assert any(n.endswith(".png") for n in names)
    assert sorted(c["engine"] for c in cells) == ["llama-cpp", "reference"] and {c["status"] for c in cells} == {"ok"}
    # the expert cache at two sizes, traced, and the planner on its traces
    assert status["cache sweep"] == status["cache"] == "ok", status
    assert sorted(c["cell_id"].split("/")[0] for c in cache_cells) == ["reference@cache_mib=0",
                                                                      "reference@cache_mib=1024"]
    assert {c["status"] for c in cache_cells} == {"ok"} and "belady" in cache_md
    assert any("/cache-results/" in n and n.endswith(".npz") for n in names)
    assert 'skipped="' in xml and 'failures="0"' in xml and "no CUDA device" in xml     # test_gpu.py: skipped here


def test_dry_run_output_fits_what_the_device_tool_returns(dry_run):
    _, out = dry_run
    files = list(out.iterdir())
    assert all(f.is_file() and pack.SAFE_NAME.match(f.name) and f.stat().st_size <= pack.MAX_BYTES for f in files)
    assert len(files) <= pack.MAX_FILES and sum(f.stat().st_size for f in files) <= 64 << 20
    assert {"summary.md", "steps.json", "gpu-check.tar.gz", "pytest-gpu.txt", "report.md", "sweep.md",
            "probe.json"} <= {f.name for f in files}
    summary = (out / "summary.md").read_text()
    assert "| sweep | ok |" in summary and "passed 0, failed 0, skipped" in summary


# --- preparation --------------------------------------------------------------------------------------

def fake_sdist(root: Path) -> Path:
    src = root / f"llama_cpp_python-{prepare.LLAMA_VERSION}"
    top = "\n".join(old for f, old, _, _ in prepare.PATCHES if f == "CMakeLists.txt") + "\nadd_subdirectory(vendor)\n"
    files = {f: "x\n" for f in prepare.REQUIRED} | {"CMakeLists.txt": top}
    dropped = [".git/objects/ab", "vendor/llama.cpp/models/m.gguf", "vendor/llama.cpp/docs/a.md",
               "vendor/llama.cpp/tools/mtmd/CMakeLists.txt", "vendor/llama.cpp/common/common.cpp",
               "vendor/llama.cpp/ggml/src/ggml-vulkan/v.cpp", "vendor/llama.cpp/vendor/cpp-httplib/httplib.cpp"]
    for rel, text in files.items() | {d: "drop\n" for d in dropped}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    return src


def fake_wheels(d: Path) -> Path:
    d.mkdir()
    for name in prepare.WHEELS:
        (d / f"{name}-{metadata.version(name)}-py3-none-any.whl").write_bytes(f"a wheel of {name}".encode())
    return d


def test_prepare_trims_patches_and_check_reads_it_back(tmp_path):
    src, wheels, gpu = fake_sdist(tmp_path / "sdist"), fake_wheels(tmp_path / "wheels"), tmp_path / ".gpu"
    m = prepare.prepare(str(src), gpu, str(wheels), verify=False)
    assert (gpu / ".gitignore").read_text() == "*\n"                      # git ignores .gpu/ by itself
    with tarfile.open(gpu / prepare.ARCHIVE) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames()}
        top = tf.extractfile(f"{prepare.PREFIX}/CMakeLists.txt").read().decode()
    assert set(prepare.REQUIRED) <= names and not any(prepare.trimmed(n) for n in names)
    assert "LLAMA_BUILD_COMMON OFF" in top and "python package\" OFF" in top and "COMMON ON" not in top
    assert [w["package"] for w in m["wheels"]] == list(prepare.WHEELS)
    assert prepare.check(gpu) == (m, [])
    first = m["archive"]["sha256"]
    assert prepare.prepare(str(src), gpu, str(wheels), verify=False)["archive"]["sha256"] == first   # deterministic
    r = script("--check", "--gpu-dir", str(gpu))
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_check_finds_a_changed_wheel_and_an_unprepared_folder(tmp_path):
    src, wheels, gpu = fake_sdist(tmp_path / "sdist"), fake_wheels(tmp_path / "wheels"), tmp_path / ".gpu"
    prepare.prepare(str(src), gpu, str(wheels), verify=False)
    next((gpu / "wheels").glob("gguf-*.whl")).write_bytes(b"changed")
    r = script("--check", "--gpu-dir", str(gpu))
    assert r.returncode == 1 and "sha256" in r.stdout and "gguf" in r.stdout
    r = script("--dry-run", "--gpu-dir", str(gpu), env={"OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and "sha256" in r.stderr                   # a broken .gpu/ stops the dry run early
    _, problems = prepare.check(tmp_path / "nothing")
    assert problems and "--prepare" in problems[0]


def test_prepare_refuses_an_sdist_it_cannot_patch(tmp_path):
    src, wheels = fake_sdist(tmp_path / "sdist"), fake_wheels(tmp_path / "wheels")
    (src / "CMakeLists.txt").write_text("project(other)\n")
    with pytest.raises(SystemExit, match="PATCHES"):
        prepare.prepare(str(src), tmp_path / ".gpu", str(wheels), verify=False)


# --- the plan -----------------------------------------------------------------------------------------

def test_the_plan_fits_the_budget_and_the_sweep_shrinks_to_the_time_left():
    assert sum(plan.PLANNED.values()) <= plan.BUDGET_S
    assert [s.estimate_s for s in plan.SWEEPS] == sorted((s.estimate_s for s in plan.SWEEPS), reverse=True)
    assert plan.choose_sweep(10_000) is plan.SWEEPS[0]
    assert plan.choose_sweep(plan.SWEEPS[1].estimate_s) is plan.SWEEPS[1]
    assert plan.choose_sweep(plan.SWEEPS[-1].estimate_s - 1) is None
    # the worst case still ends inside the budget: build to its deadline, tests to their cap, no sweep
    assert plan.BUILD_DEADLINE_S + plan.PROBE_CAP_S + plan.TESTS_CAP_S + plan.REPORT_RESERVE_S <= plan.BUDGET_S
    assert plan.depths_for(plan.SWEEPS[0], plan.preset_layers(plan.PRESET)) == ["0", "2", "all"]
    cmd = plan.sweep_cmd("python3", plan.PRESET, plan.SWEEPS[0], Path("r"), 16, Path("s.md"))
    assert cmd[cmd.index("-w") + 1] == "pp4096,pp8192,tg128" and cmd[cmd.index("-r") + 1] == "3"


def test_cmake_args_take_cublas_from_pip_when_the_toolkit_lacks_it(tmp_path):
    cu = tmp_path / "site" / "nvidia" / "cu13"
    for f in ("include/cublas_v2.h", "lib/libcublas.so.13", "lib/libcublasLt.so.13"):
        (cu / f).parent.mkdir(parents=True, exist_ok=True)
        (cu / f).write_text("")
    tc = plan.find_toolchain([str(tmp_path / "site")], "90-real")
    args = plan.cmake_args(tc)
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90-real" in args and "-DGGML_CUDA_NO_VMM=ON" in args
    if not tc.cublas_in_toolkit:
        assert f"-DCUDA_cublas_LIBRARY={cu}/lib/libcublas.so.13" in args
        assert f"-DCMAKE_CUDA_FLAGS=-I{cu}/include" in args
        assert str(cu / "lib") in tc.lib_dirs                          # LD_LIBRARY_PATH for libggml-cuda at run time


def test_every_module_moebench_imports_is_on_the_gpu_image_or_carried():
    assert pack.missing_on_image() == []


def test_verify_run_flags_cells_that_saw_no_gpu(tmp_path):
    row = {"engine": "llama-cpp", "n_cpu_moe": "2", "n_moe_layers": "4", "expert_host_fraction": "0.5",
           "status": "ok", "error": "", "peak_vram_mib": "", "peak_rss_mib": "100", "load_s": "1",
           "bytes_by_device": '{"model:CPU": 1}', "effective_settings": "{}"}
    with open(tmp_path / "cells.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerow(row)
        w.writerow(row | {"engine": "reference", "peak_vram_mib": "900", "effective_settings": '{"device": "cpu"}'})
    gpu = pack.verify_run(tmp_path, gpu=True)
    assert gpu[0].startswith("FAIL") and "NVML saw no VRAM" in gpu[0] and "no CUDA buffer" in gpu[0]
    assert gpu[1].startswith("FAIL") and "not cuda" in gpu[1]
    cpu = pack.verify_run(tmp_path, gpu=False)
    assert cpu[0].startswith("ok") and cpu[1].startswith("FAIL") and "without a GPU" in cpu[1]


# --- the GPU tests' helpers, on the CPU ---------------------------------------------------------------

def test_stream_log_sees_exactly_the_routed_experts_copied_on_a_cpu_run(tiny):
    """The check test_gpu.py makes on CUDA, on the CPU (no prefetch there): 3 ubatches x 4 layers, each copying
    exactly the experts it routes to, and the engine's byte counter agrees with the log. The last layer runs its
    experts in the last ubatch only (the output row, as llama.cpp's inp_out_ids keeps): 10 calls."""
    from engines.reference.engine import ReferenceEngine

    e = ReferenceEngine()
    e.load(tiny, EngineSettings(n_cpu_moe=4, n_ctx=64, n_ubatch=16, threads=2, device="cpu",
                                extra={"moe_path": "stream"}))
    with stream_log(e.moe) as calls:
        e.prefill([int(t) for t in np.random.default_rng(5).integers(0, 1024, 40)])
    c, sizes = e.counters(), {i: s.expert_bytes for i, s in enumerate(e.moe.layers)}
    e.close()
    assert [x.layer for x in calls] == [0, 1, 2] * 2 + [0, 1, 2, 3]
    assert not any(x.prefetched for x in calls) and stream_problems(calls, 8) == []
    assert c["streamed_bytes"] == streamed_bytes(calls, sizes) > 0 and c["prefetched_layers"] == 0
    assert stream_problems([StreamCall(0, [1, 2], [1, 2, 3])], 8)                  # one expert too many
    assert stream_problems([StreamCall(1, [1], list(range(8)), prefetched=True)], 8) == []


def test_overlap_and_phase_arithmetic():
    assert overlap_ms((0, 10), (5, 20)) == 5 and overlap_ms((0, 1), (2, 3)) == 0
    assert overlap_fraction([((0, 10), (2, 6)), ((10, 20), (20, 30))]) == pytest.approx(4 / 14)
    assert overlap_fraction([((0, 10), (0, 10))]) == 1.0
    samples = [{"phase": p, "v": v} for p, v in [("a", 1.0), ("a", 3.0), ("a", float("nan")), ("b", 10.0)]]
    assert phase_level(samples, "a", "v") == 2.0 and phase_level(samples, "b", "v") == 10.0


def test_llama_buffer_sides_and_placement_rule(tiny):
    from engines.gguf_meta import read_meta

    b = llama_buffers({"model:CUDA0": 10, "model:CPU_Mapped": 5, "compute:CUDA_Host": 1, "compute:CUDA0": 2,
                       "kv:CUDA0": 3})
    assert b == {"model": {"gpu": 10, "host": 5}, "compute": {"gpu": 2, "host": 1}, "kv": {"gpu": 3, "host": 0}}
    meta = read_meta(tiny)
    total, embd = sum(t.n_bytes for t in meta.tensors), next(t.n_bytes for t in meta.tensors
                                                            if t.name == "token_embd.weight")
    assert llama_placement(meta, 0) == (total - embd, embd, embd)
    gpu, host, span = llama_placement(meta, 4)
    assert (gpu, host) == (total - embd - meta.expert_bytes(), embd + meta.expert_bytes())
    assert host < span <= total                   # the span takes in the attention tensors between the layers' experts
