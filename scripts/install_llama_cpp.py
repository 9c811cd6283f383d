"""Install llama-cpp-python (the version pyproject.toml pins) into this Python, built right for this host.

Run by `make setup` before the project itself (stdlib only). pip builds llama-cpp-python from source with
the default compiler and -march=native and reuses that wheel from its cache on any later install, even
on another CPU or after the compiler changed. So the wheel is built here with pip's cache off, into
<moebench cache>/wheels/llama-cpp-python-<version>/<compiler>-<CPU ISA hash>/, and reused only from there.
On a CPU with AMX whose default compiler is GCC 11-12 (which miscompile llama.cpp's AMX code:
engines/ggml_build.py) it is built with clang, installed from Debian (clang-19, libomp-19-dev for OpenMP)
when we are root with apt-get and NO_APT is unset. Where no clang can be had, the llama-cpp engine turns
llama.cpp's extra buffer types off by itself.

An installed llama-cpp-python of the pinned version is kept (a CUDA build made as docs/getting-started.md says)
unless it is one that crashes here. CMAKE_ARGS passes through to the build.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines import ggml_build  # noqa: E402
from engines.paths import cache_dir  # noqa: E402


def say(msg: str) -> None:
    print(f"install_llama_cpp: {msg}", flush=True)


def pinned_version() -> str:
    m = re.search(r'"llama-cpp-python==([\w.]+)"', (ROOT / "pyproject.toml").read_text())
    if not m:
        sys.exit("install_llama_cpp: pyproject.toml pins no llama-cpp-python version (\"llama-cpp-python==X\").")
    return m.group(1)


def installed_ok(version: str) -> bool:
    try:
        if metadata.version("llama_cpp_python") != version:
            return False
    except metadata.PackageNotFoundError:
        return False
    lib = ggml_build.llama_cpp_lib()
    if lib is None:
        return True
    compiler = ggml_build.compiler_of(lib)
    if not (ggml_build.amx_host() and ggml_build.miscompiles_amx(compiler)):
        return True
    # its system info names the features compiled in (AMX_INT8 = 1); asked in a child: importing loads the library
    ask = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    info = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True).stdout
    if ggml_build.amx_crash_applies(compiler, info):
        say(f"the installed llama-cpp-python {version} was built by {compiler}, which miscompiles AMX on this CPU; "
            "rebuilding it")
        return False
    return True


def apt_clang() -> None:
    if os.environ.get("NO_APT") or os.geteuid() != 0 or not shutil.which("apt-get"):
        say("this CPU has AMX and the default compiler miscompiles llama.cpp's AMX code; install clang "
            "(e.g. `apt-get install clang-19 libomp-19-dev`) and rerun, or llama.cpp runs without its extra "
            "buffer types (no AMX, no repack)")
        return
    say("this CPU has AMX and the default compiler miscompiles llama.cpp's AMX code: installing clang-19 (Debian)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "clang-19", "libomp-19-dev"], env=env,
                   stdout=subprocess.DEVNULL)


def main() -> None:
    version = pinned_version()
    if installed_ok(version):
        say(f"llama-cpp-python {version} is installed and fits this host")
        return
    env = ggml_build.build_env()
    if env is None:
        apt_clang()
        env = ggml_build.build_env() or {}
    compiler = ggml_build.compiler_version(env.get("CC") or os.environ.get("CC") or "cc") or "cc-unknown"
    isa = hashlib.sha256(" ".join(ggml_build.isa_flags()).encode()).hexdigest()[:12]
    cmake = hashlib.sha256(os.environ.get("CMAKE_ARGS", "").encode()).hexdigest()[:8]
    wheels = cache_dir() / "wheels" / f"llama-cpp-python-{version}" / f"{compiler.replace(' ', '-')}-{isa}-{cmake}"
    wheel = next(wheels.glob("llama_cpp_python-*.whl"), None)
    if wheel is None:
        say(f"building llama-cpp-python {version} with {compiler} (~12 minutes on 2 cores) into {wheels}")
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary",
                        "llama-cpp-python", "-w", str(wheels), f"llama-cpp-python=={version}"],
                       env=os.environ | env, check=True)
        wheel = next(wheels.glob("llama_cpp_python-*.whl"))
    else:
        say(f"reusing {wheel} (built with {compiler} for this CPU)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
                   check=True)
    # its own dependencies, from the index as usual
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(wheel)], check=True)
    lib = ggml_build.llama_cpp_lib()
    if lib:
        ggml_build.record_build(lib, compiler)


if __name__ == "__main__":
    main()
