"""Building the external binaries the external engines drive.

`build_llama_bench` builds llama-bench from the source distribution of the *installed*
llama-cpp-python, so the llama-bench engine and the llama-cpp engine run the same llama.cpp commit
(the sdist vendors it under vendor/llama.cpp). The result lands in
<cache>/llama-bench/<llama-cpp-python version>/bin/llama-bench, where engines.llama_bench finds it, with the same
commit's scripts/compare-llama-bench.py beside it (it reads `moebench sweep --format json` output too).
`build_llama_bench_source` builds the llama-bench of a user's own checkout (ik_llama.cpp or upstream llama.cpp) into
<cache>/llama-bench/<fork>-<commit>/bin/llama-bench, for engine specs `llama-bench@bin=PATH`.
Both build with -DGGML_NATIVE=ON (for this CPU) and the compiler engines.ggml_build.build_env picks (clang on AMX
hosts, where GCC 11-12 miscompile ggml's AMX code).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from engines.errors import UserError

COMPARE_SCRIPT = "compare-llama-bench.py"     # llama.cpp's table of two builds' (here: two runs') llama-bench results


def llama_cpp_python_version() -> str:
    from engines.llama_bench import installed_llama_cpp_python
    version = installed_llama_cpp_python()
    if version is None:
        raise UserError("llama-cpp-python is not installed, so there is no llama.cpp commit to match; "
                        "install it (`pip install llama-cpp-python`) or pass --version.")
    return version


def llama_bench_dir(label: str) -> Path:
    from engines.llama_bench import cache_root
    return cache_root() / label


def cuda_present() -> bool:
    """nvcc to build with and an NVIDIA GPU to run on (a CUDA build on a GPU-less host is useless)."""
    from engines.devices import gpus
    return bool(shutil.which("nvcc")) and bool(gpus())


def _run(echo: Callable[[str], None], cmd: list[str], log, cwd: Path | None = None, env: dict | None = None,
         git: bool = False) -> None:
    # GIT_DIR: the sdist has no .git; without this, a cache dir inside some other git checkout would
    # stamp that checkout's commit into llama-bench's build_commit. A checkout (git=True) stamps its own.
    echo("$ " + " ".join(cmd))
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    base = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
    r = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                       env=base | ({} if git else {"GIT_DIR": os.devnull}) | (env or {}))
    if r.returncode:
        log.flush()
        tail = Path(log.name).read_bytes()[-1500:].decode(errors="replace")
        raise UserError(f"`{' '.join(cmd[:3])} ...` failed with exit code {r.returncode}; see {log.name} "
                        f"(tail: ...{tail.strip()[-600:]})")


def _vendor_commit(src: Path, version: str) -> str:
    """The llama.cpp commit the sdist vendors. The sdist has no .git (so llama-bench itself reports
    build_commit "unknown"); llama-cpp-python's CHANGELOG names it under the release heading."""
    try:
        text = (src / "CHANGELOG.md").read_text(errors="replace")
    except OSError:
        return ""
    section = text.split(f"## [{version}]", 1)[-1].split("\n## [", 1)[0] if f"## [{version}]" in text else ""
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return m.group(1) if m else ""


def bench_source(root: Path) -> Path | None:
    """llama-bench's source in a llama.cpp-family tree: tools/ (upstream now) or examples/ (older, ik_llama.cpp)."""
    return next((f for f in (root / d / "llama-bench" / "llama-bench.cpp" for d in ("tools", "examples"))
                 if f.is_file()), None)


def cmake_argv(root: Path, build: Path, cuda: bool, ninja: bool) -> list[str]:
    """The configure command for llama-bench of the tree at `root`: a static binary for this CPU."""
    in_tools = bench_source(root).parent.parent.name == "tools"
    which = ["-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=OFF"] if in_tools else ["-DLLAMA_BUILD_EXAMPLES=ON"]
    return (["cmake", "-S", str(root), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", *which,
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
             "-DBUILD_SHARED_LIBS=OFF", f"-DGGML_CUDA={'ON' if cuda else 'OFF'}"] + (["-G", "Ninja"] if ninja else []))


def _compiler(echo: Callable[[str], None]) -> dict[str, str]:
    """CC/CXX for the build: clang where the default compiler miscompiles llama.cpp's AMX code on this CPU."""
    from engines import ggml_build
    cc = ggml_build.build_env()
    if cc is None:
        echo("warning: this CPU has AMX and the default compiler miscompiles llama.cpp's AMX code, and no clang is "
             "installed (`apt-get install clang-19 libomp-19-dev`): llama-bench will run with --repack 0")
    return cc or {}


def _need_cmake() -> None:
    if not shutil.which("cmake"):
        raise UserError("cmake is not on PATH; install it (e.g. `apt-get install cmake` or `pip install cmake`) and "
                        "retry.")


def _compile(echo: Callable[[str], None], root: Path, work: Path, binary: Path, cuda: bool, jobs: int | None, log,
             git: bool = False) -> None:
    """Configure and build llama-bench of `root` in `work`, and copy it to `binary`."""
    build = work / "build"
    _run(echo, cmake_argv(root, build, cuda, bool(shutil.which("ninja"))), log, env=_compiler(echo), git=git)
    _run(echo, ["cmake", "--build", str(build), "--target", "llama-bench", "-j", str(jobs or os.cpu_count() or 1)],
         log, git=git)
    built = next(build.rglob("bin/llama-bench"))
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)


def build_llama_bench(version: str | None, cuda: bool | None, jobs: int | None, force: bool,
                      echo: Callable[[str], None] = print) -> str:
    """Build llama-bench from llama-cpp-python's source distribution into the cache directory; returns what it did.
    `echo` receives each command as it starts."""
    version = version or llama_cpp_python_version()
    dest = llama_bench_dir(version)
    binary = dest / "bin" / "llama-bench"
    compare = binary.parent / COMPARE_SCRIPT      # a build made before the script was kept is built again
    from engines.llama_bench import LlamaBenchEngine
    stale = binary.is_file() and LlamaBenchEngine.amx_fallback(binary)    # built by a compiler that breaks AMX here
    if binary.is_file() and compare.is_file() and not force and not stale:
        return f"already built: {binary} (--force rebuilds)"
    cuda = cuda_present() if cuda is None else cuda
    with _workspace(dest) as (work, log):
        # pip reuses its cache, so a second build downloads nothing
        _run(echo, [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(work)], log)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None) or next(work.glob("*.tar.gz"), None)
        if sdist is None:
            raise UserError(f"pip did not download a source distribution of llama-cpp-python=={version}; "
                            f"check the version and that PyPI is reachable.")
        with tarfile.open(sdist) as tf:
            tf.extractall(work, filter="data")
        src = next(p for p in work.iterdir() if p.is_dir() and (p / "vendor" / "llama.cpp").is_dir())
        llama = src / "vendor" / "llama.cpp"
        _compile(echo, llama, work, binary, cuda, jobs, log)
        shutil.copy2(llama / "scripts" / COMPARE_SCRIPT, compare)
        # what we built from; engines.llama_bench reads it for the version, since the binary says "unknown"
        commit = _vendor_commit(src, version)
        (dest / "build.json").write_text(json.dumps({
            "llama_cpp_python": version, "cuda": cuda, "sdist": sdist.name, "llama_cpp_commit": commit}, indent=2))
    return (f"built {binary} (llama-cpp-python {version}, llama.cpp {commit or 'commit unknown'}, "
            f"cuda={'on' if cuda else 'off'})")


@contextmanager
def _workspace(dest: Path):
    """(a build tree beside dest, dest/build.log open for writing); the tree (1+ GB) goes afterwards, built or not, and
    a failed build keeps only its log."""
    _need_cmake()
    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="llama-bench-", dir=dest.parent))
    try:
        with open(dest / "build.log", "wb") as log:
            yield work, log
    finally:
        shutil.rmtree(work, ignore_errors=True)


def source_checkout(source: str):
    """The llama.cpp-family checkout at `source` (engines.llama_bench_family.Checkout), or a UserError."""
    from engines.llama_bench_family import checkout_of
    root = Path(source).expanduser()
    if not root.is_dir():
        raise UserError(f"--source {source} is not a directory; give the root of an ik_llama.cpp or llama.cpp "
                        f"checkout.")
    c = checkout_of(root)
    if c is None or c.root != root.resolve() or bench_source(c.root) is None:
        raise UserError(f"--source {source} is not the root of a llama.cpp-family checkout (it needs include/llama.h, "
                        f"ggml/ and tools/ or examples/llama-bench/); give the root of an ik_llama.cpp or llama.cpp "
                        f"checkout.")
    return c


def source_label(c) -> str:
    """The cache folder (and engine-spec label) of a checkout's build: fork and commit, or fork and folder name."""
    from engines.external import label_text
    return label_text(f"{c.fork}-{c.commit or c.root.name}")


def build_llama_bench_source(source: str, cuda: bool | None, jobs: int | None, force: bool,
                             echo: Callable[[str], None] = print) -> str:
    """Build the llama-bench of the checkout at `source` into <cache>/llama-bench/<label>/; returns what it did."""
    c = source_checkout(source)
    dest = llama_bench_dir(source_label(c))
    binary = dest / "bin" / "llama-bench"
    from engines.llama_bench import LlamaBenchEngine
    built = LlamaBenchEngine.build_info(binary)
    fresh = c.commit and built.get("commit") == c.commit and built.get("source") == str(c.root)
    if binary.is_file() and fresh and not force and not LlamaBenchEngine.amx_fallback(binary):
        return f"already built: {binary} (--force rebuilds)"
    cuda = cuda_present() if cuda is None else cuda
    with _workspace(dest) as (work, log):
        _compile(echo, c.root, work, binary, cuda, jobs, log, git=True)
        (dest / "build.json").write_text(json.dumps({
            "source": str(c.root), "fork": c.fork, "commit": c.commit, "cuda": cuda, "label": dest.name}, indent=2))
    return f"built {binary} ({c.fork} {c.commit or 'commit unknown'} from {c.root}, cuda={'on' if cuda else 'off'})"
