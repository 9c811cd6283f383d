"""Hardware profile: the figures the roofline needs, measured in a few seconds.

Host: memory read and copy bandwidth (torch over 256 MiB on huge pages), CPU matmul throughput at the thread count
used in each arithmetic an engine's products use (harness.planning.roofline, compute_dtype): fp32 FMA, bf16 (on a
CPU with AMX oneDNN runs it on its tiles), int8 dot products (torch._int_mm: oneDNN's VNNI / AMX int8 kernels), and
fp16 only where the CPU multiplies fp16 natively (elsewhere ggml and oneDNN convert fp16 to fp32 and multiply in
fp32 lanes: the fp32 figure is that peak); the widest reference kernel variant the CPU runs (cpu_kernels: amx,
avx512, avx2; "" without AVX2). CUDA (when torch sees a device): host->device bandwidth from pageable and from
page-locked memory, device memory bandwidth, device matmul throughput (bf16, f16, fp32, int8), total/free VRAM.
Every figure is repeated and summarized with harness.stats.stats (median, min, max, cv). Stored as JSON in
<cache>/hardware/<hostname>.json (MOEBENCH_CACHE moves <cache>) and embedded in each run.json.

The decode bound divides by the read bandwidth of the run itself (read_bandwidth: run.json["bandwidth"]), at each
thread count its cells use, over a buffer far larger than the CPU caches, best of a few passes, or by the best an
earlier run on the host measured (with_host_best): a bound must be an upper bound, so the probe has to read at least
as fast as any engine can, in the machine's fastest minute.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable


SCHEMA = 2          # 2: int8 (and native fp16) matmul peaks; profiles without them are measured again
# figure -> unit; the roofline reads these names
UNITS = {"host_read_gbps": "GB/s", "host_copy_gbps": "GB/s", "cpu_matmul_fp32_gflops": "GFLOP/s",
         "cpu_matmul_bf16_gflops": "GFLOP/s", "cpu_matmul_f16_gflops": "GFLOP/s", "cpu_matmul_int8_gops": "GOP/s",
         "h2d_pageable_gbps": "GB/s", "h2d_pinned_gbps": "GB/s", "gpu_mem_gbps": "GB/s",
         "gpu_matmul_bf16_gflops": "GFLOP/s", "gpu_matmul_f16_gflops": "GFLOP/s", "gpu_matmul_fp32_gflops": "GFLOP/s",
         "gpu_matmul_int8_gops": "GOP/s"}
FP16_ARITH_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})    # x86 instructions that multiply fp16 as fp16
READ_MIN_BYTES, READ_MAX_BYTES = 2**30, 4 * 2**30
READ_PASSES = 4


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


def read_buffer_bytes() -> int:
    """The read probe's buffer: max(1 GiB, 16 x all the host's caches), so a cache serves at most 1/16 of a pass;
    at most 4 GiB (a few seconds to fill) and a quarter of the free RAM."""
    import psutil

    from harness.hw.host import cache_mib

    want = min(max(READ_MIN_BYTES, 16 * (cache_mib() or 0) * 2**20), READ_MAX_BYTES)
    return int(min(want, psutil.virtual_memory().available // 4)) // 2**20 * 2**20


def read_bandwidth(threads: Iterable[int], passes: int = READ_PASSES, nbytes: int | None = None) -> dict:
    """run.json["bandwidth"]: the memory read bandwidth now at each of `threads` thread counts (GB/s, keyed by the
    count as a string), over one buffer of `nbytes` (read_buffer_bytes) split into a contiguous part per thread.
    Each pass reads the whole buffer once with each of two numpy reductions (integer max, float sum: of the
    reductions tried, as fast as torch's sum and amax and faster than a torch matrix-vector product, a decode step's
    kernel; numpy releases the GIL, so a thread pool reads in parallel without importing torch into the sweep). The
    buffer is numpy's, which asks for transparent huge pages, as the reference engine's hugepage-copy weights get
    them: the same reads from 4 KiB pages (torch's allocations) ran a quarter slower on an EPYC VM (26 against 35
    GB/s at one thread), a probe too slow for such an engine. A thread count's figure is its best pass: about a
    second for one count on a 1 GiB buffer. Never raises (a sweep never fails for its roofline): {"error": ...}
    instead."""
    import numpy as np

    try:
        counts = sorted(set(threads))
        nbytes = nbytes or read_buffer_bytes()
        t0 = time.perf_counter()
        x = np.empty(nbytes // 8, dtype=np.int64)
        with ThreadPoolExecutor(max(counts)) as pool:
            # written: untouched pages would all map the zero page
            list(pool.map(lambda c: c.fill(1), np.array_split(x, max(counts))))
            ops = (np.max, lambda c: c.view(np.float64).sum())
            out = {}
            for n in counts:
                chunks = np.array_split(x, n)
                best = float("inf")
                for _ in range(passes):
                    for op in ops:
                        t = time.perf_counter()
                        list(pool.map(op, chunks))
                        best = min(best, time.perf_counter() - t)
                out[str(n)] = round(x.nbytes / best / 1e9, 3)
        return {"threads": out, "buffer_mib": x.nbytes / 2**20, "seconds": round(time.perf_counter() - t0, 2),
                "method": f"numpy max (int64) and sum (float64), one contiguous part per thread, best of {passes} "
                          f"passes each"}
    except Exception as e:          # noqa: BLE001 - memory or threads short: the bound falls back, marked
        return {"error": f"{type(e).__name__}: {e}"}


def with_host_best(measured: dict, hostname: str | None = None) -> dict:
    """measured (read_bandwidth's) plus "best": per thread count, the highest read bandwidth measured on this host so
    far, this probe included, kept in <cache>/hardware/<host>-read.json. A shared or virtual machine's bandwidth moves
    with its neighbours (2 threads on an EPYC VM: 36 GB/s, then 70 GB/s minutes later), so one probe bounds only the
    minute it ran in, and a cell measured in a faster minute beat it; the best this host ever gave bounds every cell.
    Never raises: without a writable cache the best is this probe's."""
    now = measured.get("threads") or {}
    path = profile_path(hostname).with_name(f"{hostname or socket.gethostname()}-read.json")
    try:
        best = {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        best = {}
    best |= {k: max(float(v), best.get(k, 0.0)) for k, v in now.items()}
    try:
        write_atomic(path, json.dumps(best))
    except OSError:
        pass
    return measured | ({"best": best} if best else {})


def fp16_arith() -> bool | None:
    """Whether this CPU multiplies fp16 as fp16 (x86: AVX512-FP16 or AMX-FP16); None where this is not known
    (not x86)."""
    from engines.devices import cpu_flags

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return bool(cpu_flags() & FP16_ARITH_FLAGS)


def matmul_shapes(threads: int, quick: bool = False) -> list[tuple[int, int, int]]:
    """The (m, k, n) products a CPU matmul peak is the best of: large enough that the kernels run at their peak (1024
    fell short of it with int8 at 2 threads); square and prefill-shaped (n/4 rows: a 512-token ubatch, into and out
    of an expert 3n/8 wide, and from a model n/2 wide into one 3n/4 wide: a 1024 -> 1536 product once ran at 100.4 %
    of the other shapes' best f32 rate), as the shapes' rates differ by a few % and a peak must be the best of them."""
    n = 1024 if quick else 2048 if threads <= 16 else 4096
    return [(n, n, n), (n // 4, n, n), (n // 4, n, 3 * n // 8), (n // 4, 3 * n // 8, n), (n // 4, n // 2, 3 * n // 4)]


def matmul_rates(torch, dtype, device: str, shapes: list[tuple[int, int, int]], reps: int,
                 sync: Callable[[], None] = lambda: None) -> list[float]:
    """(m x k) @ (k x n) products of `dtype` per second for each (m, k, n) of `shapes`, `reps` each, in G(FL)OP: 2
    operations a multiply-add. int8: torch._int_mm (int32 results), the kernel oneDNN runs with VNNI / AMX int8
    instructions."""
    out = []
    for m, k, n in shapes:
        if dtype == torch.int8:
            a, b = (torch.randint(-128, 128, s, dtype=torch.int8, device=device) for s in ((m, k), (k, n)))
            run = lambda: torch._int_mm(a, b)     # noqa: E731
        else:
            a, b = (torch.randn(*s, device=device).to(dtype) for s in ((m, k), (k, n)))
            run = lambda: a @ b                   # noqa: E731
        out += [2 * m * k * n / t / 1e9 for t in _timed(run, reps, sync)]
    return out


def measure(threads: int | None = None, quick: bool = False) -> dict:
    """Run every measurement that this machine supports; returns the profile dict."""
    import numpy as np
    import psutil
    import torch

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    reps = 3 if quick else 5
    size = (64 if quick else 256) * 2**20
    figs: dict[str, list[float]] = {}

    # numpy's buffers: on transparent huge pages, as read_bandwidth's (torch's own 4 KiB pages read slower)
    x, y = (torch.from_numpy(np.ones(size // 4, dtype=np.float32)) for _ in range(2))
    figs["host_read_gbps"] = [size / t / 1e9 for t in _timed(lambda: x.sum(), reps)]
    figs["host_copy_gbps"] = [2 * size / t / 1e9 for t in _timed(lambda: y.copy_(x), reps)]   # read + write
    y = None                 # frees the 256 MiB before the matmuls
    shapes = matmul_shapes(threads, quick)
    cpu = {"cpu_matmul_fp32_gflops": torch.float32, "cpu_matmul_bf16_gflops": torch.bfloat16,
           "cpu_matmul_int8_gops": torch.int8} | ({"cpu_matmul_f16_gflops": torch.float16} if fp16_arith() else {})
    for name, dtype in cpu.items():
        try:
            figs[name] = matmul_rates(torch, dtype, "cpu", shapes, reps)
        except RuntimeError:     # a torch without this CPU kernel: the figure is absent, its bound NaN
            pass

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
        for name, dtype in (("gpu_matmul_bf16_gflops", torch.bfloat16), ("gpu_matmul_f16_gflops", torch.float16),
                            ("gpu_matmul_fp32_gflops", torch.float32), ("gpu_matmul_int8_gops", torch.int8)):
            try:
                figs[name] = matmul_rates(torch, dtype, "cuda", [(4096, 4096, 4096)], reps, sync)
            except RuntimeError:
                pass
        free, total = torch.cuda.mem_get_info()
        gpu = {"gpu_name": torch.cuda.get_device_name(0), "vram_total_mib": total / 2**20,
               "vram_free_mib": free / 2**20}
    from engines.devices import widest_isa
    return {"schema_version": SCHEMA, "hostname": socket.gethostname(), "threads": threads, "cpu_kernels": widest_isa(),
            "cores_physical": psutil.cpu_count(logical=False), "quick": quick, "cpu_fp16_arith": fp16_arith(),
            "created": datetime.now(timezone.utc).isoformat(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), **gpu,
            "figures": {k: _summary(v, UNITS[k]) for k, v in figs.items()}}


def profile_path(hostname: str | None = None) -> Path:
    from engines.paths import cache_dir
    return cache_dir() / "hardware" / f"{hostname or socket.gethostname()}.json"


def write_atomic(path: Path, text: str) -> None:
    """path's new contents, whole: concurrent sweeps never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def save_profile(profile: dict) -> Path:
    path = profile_path(profile["hostname"])
    write_atomic(path, json.dumps(profile, indent=2))
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
