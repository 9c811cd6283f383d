"""Hardware profile: the few figures the roofline needs, measured in a few seconds.

Host: memory read and copy bandwidth (torch over 256 MiB, larger than any L3), CPU matmul
throughput in fp32 and bf16 at the thread count used (on a CPU with AMX oneDNN runs the bf16 one on its
tiles: the AMX peak the roofline takes for the reference engine, whose CPU compute dtype there is bf16), and
the widest reference kernel variant the CPU runs (cpu_kernels: amx, avx512, avx2; "" without AVX2). CUDA
(when torch sees a device): host->device bandwidth from pageable and from page-locked memory, device memory
bandwidth, device matmul throughput (bf16, fp32), total/free VRAM. Every figure is repeated and summarized with
harness.stats.stats (median, min, max, cv). Stored as JSON in
<cache>/hardware/<hostname>.json (MOEBENCH_CACHE moves <cache>) and embedded in each run.json.
"""
from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable


SCHEMA = 1
# figure -> unit; the roofline reads these names
UNITS = {"host_read_gbps": "GB/s", "host_copy_gbps": "GB/s", "cpu_matmul_fp32_gflops": "GFLOP/s",
         "cpu_matmul_bf16_gflops": "GFLOP/s", "h2d_pageable_gbps": "GB/s", "h2d_pinned_gbps": "GB/s",
         "gpu_mem_gbps": "GB/s", "gpu_matmul_bf16_gflops": "GFLOP/s", "gpu_matmul_fp32_gflops": "GFLOP/s"}


def _timed(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of each of `reps` calls after one untimed warm-up."""
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _summary(values: list[float], unit: str) -> dict:
    from harness.stats import stats
    return stats(values) | {"unit": unit, "values": [round(v, 3) for v in values]}


def steadiness(mib: int = 128, reps: int = 5) -> dict:
    """The machine's memory read bandwidth right now, one thread, from numpy (no engine, no torch): the fixed probe
    a sweep times at the start of every round, so a report can tell the machine's drift from the engines'.
    128 MiB is larger than any L3 here and takes about 0.1 s in all; the best of `reps` reads."""
    import numpy as np

    x = np.ones(mib * 2**20 // 8)           # written: untouched pages would all map the zero page
    best = min(_timed(x.sum, reps))
    return {"at": datetime.now(timezone.utc).isoformat(), "read_gbps": round(x.nbytes / best / 1e9, 3)}


def _matmul_gflops(torch, dtype, device: str, n: int, reps: int, sync) -> list[float]:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return [2 * n**3 / t / 1e9 for t in _timed(lambda: a @ b, reps, sync)]


def measure(threads: int | None = None, quick: bool = False) -> dict:
    """Run every measurement that this machine supports; returns the profile dict."""
    import psutil
    import torch

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    reps = 3 if quick else 5
    size = (64 if quick else 256) * 2**20
    figs: dict[str, list[float]] = {}

    x = torch.empty(size // 4, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    figs["host_read_gbps"] = [size / t / 1e9 for t in _timed(lambda: x.sum(), reps)]
    figs["host_copy_gbps"] = [2 * size / t / 1e9 for t in _timed(lambda: y.copy_(x), reps)]   # read + write
    y = None                 # frees the 256 MiB before the matmuls
    n = 512 if quick else 1024
    figs["cpu_matmul_fp32_gflops"] = _matmul_gflops(torch, torch.float32, "cpu", n, reps, lambda: None)
    figs["cpu_matmul_bf16_gflops"] = _matmul_gflops(torch, torch.bfloat16, "cpu", n, reps, lambda: None)

    gpu: dict = {}
    if torch.cuda.is_available():
        sync = torch.cuda.synchronize
        pageable = torch.ones(size, dtype=torch.uint8)     # written: untouched pages all map the zero page
        pinned = pageable.pin_memory()
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        dev2 = torch.empty_like(dev)
        figs["h2d_pageable_gbps"] = [size / t / 1e9 for t in _timed(lambda: dev.copy_(pageable), reps, sync)]
        figs["h2d_pinned_gbps"] = [size / t / 1e9 for t in _timed(lambda: dev.copy_(pinned, non_blocking=True), reps,
                                                                  sync)]
        figs["gpu_mem_gbps"] = [2 * size / t / 1e9 for t in _timed(lambda: dev2.copy_(dev), reps, sync)]
        del dev, dev2, pinned
        figs["gpu_matmul_bf16_gflops"] = _matmul_gflops(torch, torch.bfloat16, "cuda", 4096, reps, sync)
        figs["gpu_matmul_fp32_gflops"] = _matmul_gflops(torch, torch.float32, "cuda", 4096, reps, sync)
        free, total = torch.cuda.mem_get_info()
        gpu = {"gpu_name": torch.cuda.get_device_name(0), "vram_total_mib": total / 2**20,
               "vram_free_mib": free / 2**20}
    from engines.devices import widest_isa
    return {"schema_version": SCHEMA, "hostname": socket.gethostname(), "threads": threads, "cpu_kernels": widest_isa(),
            "cores_physical": psutil.cpu_count(logical=False), "quick": quick,
            "created": datetime.now(timezone.utc).isoformat(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), **gpu,
            "figures": {k: _summary(v, UNITS[k]) for k, v in figs.items()}}


def profile_path(hostname: str | None = None) -> Path:
    from engines.paths import cache_dir
    return cache_dir() / "hardware" / f"{hostname or socket.gethostname()}.json"


def save_profile(profile: dict) -> Path:
    path = profile_path(profile["hostname"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(path)      # atomic: concurrent sweeps never read half a file
    return path


def load_profile(hostname: str | None = None) -> dict | None:
    """The stored profile of this (or the named) host, or None."""
    try:
        p = json.loads(profile_path(hostname).read_text())
    except (OSError, ValueError):
        return None
    return p if p.get("schema_version") == SCHEMA else None


def stored_or_quick() -> dict:
    """For run.json: the stored profile, else a full one (a few seconds) that is stored for the next sweep."""
    p = load_profile()
    if p is None:
        p = measure()
        save_profile(p)
    return p


def figure(profile: dict | None, name: str) -> float:
    """The best repetition of one figure (a ceiling: other load only ever slows a repetition down),
    NaN when the profile lacks it."""
    try:
        return float(profile["figures"][name]["max"])
    except (KeyError, TypeError):
        return float("nan")
