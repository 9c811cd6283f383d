"""The GPU check's plan: what runs, with which flags, in what time (pure functions; run.py runs them).

Time budget (seconds of wall time on the lent H200, 16 cores; the issue allows 540 in all). Estimates come
from compile steps timed here (CPU seconds per translation unit, benchmarks/gpu_check.sh's header) and
from the model sizes; run.py records each step's real time in steps.json so the next session can tune them.

  env + setup                 20   unpack the trimmed sources, pip install the carried wheels (--no-index)
  build | synth | kernels    230   llama-cpp-python with CUDA (-j all cores), in parallel with synthesizing
                                   the sweep's model (numpy, one core) and compiling the reference engine's
                                   CPU kernels (one core); the build is killed at BUILD_DEADLINE
  probe                       20   moebench probe (stored, so the sweep's run.json embeds it; capped at 30)
  GPU tests                   80   pytest -m gpu tests/test_gpu.py (capped at 130)
  sweep                  60..210   the largest SWEEPS entry that fits what is left, minus REPORT_RESERVE
  report + pack               30
Worst case (build killed at its deadline, probe and tests at their caps, no sweep): 330 + 30 + 130 + 45 = 535,
plus at most 13 s per killed step (SIGINT, SIGTERM, SIGKILL); every wait also stops at the budget's end, and
the packing always runs, so the device call's timeout_s=600 is never reached.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BUDGET_S = 540                 # the whole run, start to packed results (the issue: under 9 minutes)
BUILD_DEADLINE_S = 330         # the build is killed if it has not finished this long after the start
PROBE_CAP_S = 30
TESTS_CAP_S = 130
REPORT_RESERVE_S = 45          # kept free after the sweep for the report and the packing
PRESET = "qwen3-30b-a3b-4l"    # Qwen3-30B-A3B's layer shapes, 4 layers, f16: ~5 GB, synthesized on the machine
DRY_PRESET = "tiny"            # the dry run's stand-in (f32, 4 layers, a few MB)
ENGINES = "llama-cpp,reference"


@dataclass(frozen=True)
class Sweep:
    depths: tuple[str, ...]    # "half" = n_layers // 2
    workloads: tuple[str, ...]
    repetitions: int
    estimate_s: int            # on the H200 with PRESET (6 cells: process start, load, warm-up + reps)
    cell_timeout_s: int = 150


# largest first; run.py takes the first whose estimate fits the time left
SWEEPS = (
    Sweep(("0", "half", "all"), ("pp4096", "pp8192", "tg128"), 3, 210),
    Sweep(("0", "half", "all"), ("pp4096", "pp8192", "tg128"), 2, 160),
    Sweep(("0", "half", "all"), ("pp4096", "pp8192", "tg128"), 1, 115),
    Sweep(("0", "all"), ("pp4096", "tg128"), 1, 60, cell_timeout_s=60),
)
DRY_SWEEP = Sweep(("all",), ("pp32", "tg4"), 1, 30, cell_timeout_s=120)     # 2 cells: ~25 s on 2 CPU cores

# The reference engine's expert cache at two sizes on the accelerator (issue 23's GPU terms): decode and prefill at
# depth all with routing traces, then `moebench cache` on them: the counted hits beside the simulated ones, and the
# time model's link term fitted on GPU cells with its held-out error. Runs only in the time the main sweep leaves.
CACHE_SWEEP = Sweep(("all",), ("pp512", "tg64+corr"), 2, 70, cell_timeout_s=90)
DRY_CACHE_SWEEP = Sweep(("all",), ("pp32", "tg8+corr"), 1, 30, cell_timeout_s=120)
CACHE_MIB = (0, 1024)          # of ~4.7 GiB of experts at f16: about a fifth of them


def cache_sweep_cmd(py: str, preset: str, sweep: Sweep, results: Path, threads: int) -> list[str]:
    return harness(py, "sweep", "-m", f"preset:{preset}", "-e", "reference", "--n-cpu-moe", "all",
                   "--cache-mib", ",".join(map(str, CACHE_MIB)), "--cache-policy", "lru", "--trace-routing",
                   "-w", ",".join(sweep.workloads), "-r", str(sweep.repetitions), "--threads", str(threads),
                   "--timeout", str(sweep.cell_timeout_s), "--results-dir", str(results))


def cache_cmd(py: str, run_dir: Path, out_md: Path, report: Path) -> list[str]:
    return harness(py, "cache", str(run_dir), "--vram", ",".join(f"{m}MiB" for m in CACHE_MIB if m), "--policy",
                   "none,lru,classlru", "--format", "md", "-o", str(out_md), "--report", str(report))


# planned seconds per step (the table above); the dry run prints them and checks they add up
PLANNED = {"env": 5, "setup": 15, "build": 230, "probe": 20, "tests": 80, "sweep": SWEEPS[1].estimate_s,
           "report": 20, "pack": 10}


def choose_sweep(left_s: float) -> Sweep | None:
    """The largest sweep whose estimate fits `left_s` seconds (already net of REPORT_RESERVE_S), or None."""
    return next((s for s in SWEEPS if s.estimate_s <= left_s), None)


def depths_for(sweep: Sweep, n_layers: int) -> list[str]:
    out = [str(n_layers // 2) if d == "half" else d for d in sweep.depths]
    return list(dict.fromkeys(out))


def preset_layers(name: str) -> int:
    from engines.reference.archs import PRESETS
    return PRESETS[name].h.n_layers


# --- the CUDA toolchain on the machine ----------------------------------------------------------------

@dataclass
class Toolchain:
    nvcc: str | None
    toolkit: Path | None
    cublas_include: Path | None      # where cublas_v2.h is, when it is not in the toolkit
    cublas_libs: tuple[Path, ...]    # libcublas.so.N, libcublasLt.so.N (pip's nvidia-cublas)
    cublas_in_toolkit: bool
    arch: str                        # CMAKE_CUDA_ARCHITECTURES
    cores: int

    @property
    def cublas_source(self) -> str:
        if self.cublas_in_toolkit:
            return f"the CUDA toolkit ({self.toolkit})"
        if self.cublas_libs:
            return f"pip nvidia-cublas ({self.cublas_libs[0].parent})"
        return "not found (the build will fail)"

    @property
    def lib_dirs(self) -> list[str]:
        dirs = [str(p.parent) for p in self.cublas_libs]
        if self.toolkit:
            dirs += [str(self.toolkit / d) for d in ("lib64", "targets/x86_64-linux/lib")
                     if (self.toolkit / d).is_dir()]
        return list(dict.fromkeys(dirs))


def _first(paths) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def find_toolchain(site_dirs: list[str], arch: str | None = None) -> Toolchain:
    """nvcc on PATH (or /usr/local/cuda); cuBLAS from the toolkit, else from pip's nvidia-cublas in site_dirs.
    The toolkit is the first of $CUDA_HOME, nvcc's grandparent, /usr/local/cuda that has cuda_runtime.h (nvcc on
    PATH may be a wrapper script elsewhere)."""
    import shutil

    nvcc = shutil.which("nvcc") or (str(p) if (p := Path("/usr/local/cuda/bin/nvcc")).exists() else None)
    roots = [Path(os.environ["CUDA_HOME"])] if os.environ.get("CUDA_HOME") else []
    roots += [Path(nvcc).resolve().parent.parent] if nvcc else []
    roots += [Path("/usr/local/cuda")]
    toolkit = next((r for r in roots if (r / "include" / "cuda_runtime.h").is_file()
                    or (r / "targets/x86_64-linux/include/cuda_runtime.h").is_file()), None) if nvcc else None
    inc_dirs = [toolkit / "include", toolkit / "targets/x86_64-linux/include"] if toolkit else []
    lib_dirs = [toolkit / "lib64", toolkit / "targets/x86_64-linux/lib"] if toolkit else []
    in_toolkit = bool(_first(d / "cublas_v2.h" for d in inc_dirs) and _first(d / "libcublas.so" for d in lib_dirs))
    include, libs = None, ()
    if not in_toolkit:
        for sp in site_dirs:
            for sub in ("nvidia/cu13", "nvidia/cublas", "nvidia/cu12"):
                base = Path(sp) / sub
                if (base / "include" / "cublas_v2.h").is_file():
                    blas = sorted((base / "lib").glob("libcublas.so.*"))
                    lt = sorted((base / "lib").glob("libcublasLt.so.*"))
                    if blas and lt:
                        include, libs = base / "include", (blas[0], lt[0])
                        break
            if libs:
                break
    return Toolchain(nvcc, toolkit, include, libs, in_toolkit, arch or "90-real", os.cpu_count() or 1)


def cmake_args(tc: Toolchain, flash_attn: bool = False) -> list[str]:
    """CMAKE_ARGS of the CUDA build. One architecture (the GPU's own, real code only); flash-attention
    kernels off by default (a third of the CUDA compile time; see gpu_check.sh); no CUDA VMM pool (nothing to
    link against libcuda, and a sandboxed driver may lack the VMM calls: the legacy cudaMalloc pool always
    works); the CPU backend -march=native (GGML_NATIVE's default: it runs where it is built)."""
    args = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={tc.arch}",
            f"-DGGML_CUDA_FA={'ON' if flash_attn else 'OFF'}", "-DGGML_CUDA_FA_QUANTS=f16-f16",
            "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_NO_VMM=ON", "-DLLAVA_BUILD=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if tc.nvcc:
        args.append(f"-DCMAKE_CUDA_COMPILER={tc.nvcc}")
    if tc.cublas_libs:
        blas, lt = tc.cublas_libs
        inc = f"-I{tc.cublas_include}"
        args += [f"-DCUDA_cublas_LIBRARY={blas}", f"-DCUDA_cublasLt_LIBRARY={lt}", f"-DCMAKE_CUDA_FLAGS={inc}",
                 f"-DCMAKE_CXX_FLAGS={inc}", f"-DCMAKE_C_FLAGS={inc}"]
    return args


# --- the commands -------------------------------------------------------------------------------------

def build_cmd(py: str, src: Path, site: Path, build_dir: Path) -> list[str]:
    """pip builds the wheel with scikit-build-core from the image (no isolation: nothing to download) into site."""
    return [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "--no-cache-dir",
            "--no-compile", "--target", str(site), "-v", f"--config-settings=build-dir={build_dir}", str(src)]


def wheels_cmd(py: str, wheels: list[Path], site: Path) -> list[str]:
    return [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--no-compile", "--target",
            str(site), *map(str, wheels)]


def harness(py: str, *args: str) -> list[str]:
    return [py, "-m", "harness", *args]


def sweep_cmd(py: str, preset: str, sweep: Sweep, results: Path, threads: int, out_md: Path) -> list[str]:
    return harness(py, "sweep", "-m", f"preset:{preset}", "-e", ENGINES,
                   "--n-cpu-moe", ",".join(depths_for(sweep, preset_layers(preset))),
                   "-w", ",".join(sweep.workloads), "-r", str(sweep.repetitions), "--threads", str(threads),
                   "--timeout", str(sweep.cell_timeout_s), "--results-dir", str(results), "--format", "md",
                   "-o", str(out_md))


def tests_cmd(py: str, junit: Path) -> list[str]:
    return [py, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-rA", "-v", "-p", "no:cacheprovider",
            f"--junitxml={junit}"]
