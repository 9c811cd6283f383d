"""Roofline bounds: computed by hand for the tiny preset (harness/planning/roofline.py has the formulas), and held
against real kernels timed here (a streaming read, a matrix-vector product, int8 / bf16 / f32 GEMMs): a bound
that a kernel beats is no bound."""
import math
import os
import statistics
import time

import pytest

from engines.gguf_meta import read_meta
from harness.planning.roofline import CellShape, bound

EXPERTS = 4 * 3 * 8 * 64 * 128 * 4          # tiny: routed-expert bytes (f32), 4 layers
W_READ = 1857024 - 1024 * 128 * 4           # non-expert bytes minus the embedding table (a row lookup)
KV_CELL = 4 * 2 * (32 + 32) * 2             # llama.cpp f16 K+V of one cell over 4 layers
FLOPS_PER_TOKEN = 2 * (4 * (128 * 128 * 2 + 64 * 128 * 2 + 8 * 128) + 4 * 3 * 8 * 64 * 128 * 2 / 8)
THREADS = sorted({1, min(2, os.cpu_count() or 1)})      # the thread counts the kernel checks run at


def profile(bandwidth: dict | None = None, cache_mib: float | None = None, **figs):
    """A hardware(run) dict: profile figures, the run's read bandwidth by thread count, the host's CPU caches."""
    return {"threads": 2, "cores_physical": 2, "cpu_fp16_arith": False,
            "figures": {k: {"max": v} for k, v in figs.items()},
            "bandwidth": {"threads": {str(k): v for k, v in (bandwidth or {}).items()}}, "cache_mib": cache_mib}


@pytest.fixture(scope="module")
def meta(tiny):
    return read_meta(tiny)


def test_decode_cpu_only_reads_everything_from_host_ram(meta):
    p = profile(bandwidth={2: 10.0, 1: 6.0}, host_read_gbps=3.0)
    for n in (0, 2, 4):        # without a GPU the depth moves no bytes off the memory bus
        b, kind, inputs = bound(meta, CellShape("llama-cpp", n, threads=2), 0, 1, 0, p)
        assert kind == "mem" and "10.0 GB/s" in inputs and "2 threads, the best of this run" in inputs
        assert b == pytest.approx(10e9 / (EXPERTS / 4 + W_READ + KV_CELL * 0.5))
    # each cell divides by the bandwidth measured at its own thread count, not the host profile's
    assert bound(meta, CellShape("llama-cpp", 0, threads=1), 0, 1, 0, p).tps == pytest.approx(b * 0.6)


def test_decode_divides_by_the_best_bandwidth_this_host_gave(meta, tmp_path, monkeypatch):
    """A VM's bandwidth moves with its neighbours: the bound takes the best probe the host ever gave at the cell's
    thread count (kept across runs), not this run's alone, so a cell measured in a faster minute stays under it."""
    from harness.hw.probe import with_host_best

    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path))
    first = with_host_best({"threads": {"2": 20.0}}, hostname="h")
    later = with_host_best({"threads": {"2": 12.0, "1": 9.0}}, hostname="h")
    assert first["best"] == {"2": 20.0} and later["best"] == {"2": 20.0, "1": 9.0}
    p = profile(bandwidth={2: 12.0}) | {"bandwidth": later}
    assert bound(meta, CellShape("llama-cpp", 0, threads=2), 0, 1, 0, p).tps == pytest.approx(
        bound(meta, CellShape("llama-cpp", 0, threads=2), 0, 1, 0, profile(bandwidth={2: 20.0})).tps)


def test_decode_falls_back_to_the_host_profile_and_says_so(meta):
    """A run without its own bandwidth probe (older runs): the profile's figure, with the bound's kind marked."""
    b, kind, inputs = bound(meta, CellShape("llama-cpp", 0, threads=2), 0, 1, 0, profile(host_read_gbps=3.0))
    assert kind == "mem (host profile)" and "not measured in this run" in inputs
    assert b == pytest.approx(3e9 / (EXPERTS / 4 + W_READ + KV_CELL * 0.5))


def test_decode_counts_only_the_bytes_the_caches_cannot_hold(meta):
    per_token = EXPERTS / 4 + W_READ + KV_CELL * 0.5          # about 2.1 MB
    b, kind, _ = bound(meta, CellShape("llama-cpp", 0, threads=2), 0, 1, 0, profile({2: 10.0}, cache_mib=0.5))
    assert kind == "mem" and b == pytest.approx(10e9 / (per_token - 0.5 * 2**20))
    b, kind, inputs = bound(meta, CellShape("llama-cpp", 0, threads=2), 0, 1, 0, profile({2: 10.0}, cache_mib=32))
    assert math.isnan(b) and kind == "none" and "fit in the 32 MiB of CPU caches" in inputs


def test_decode_with_gpu_splits_host_and_device_reads(meta):
    p = profile({1: 10.0}, gpu_mem_gbps=1000.0)
    b0, k0, _ = bound(meta, CellShape("llama-cpp", 0, gpu=True), 0, 1, 0, p)
    b2, k2, _ = bound(meta, CellShape("llama-cpp", 2, gpu=True), 0, 1, 0, p)
    assert b0 == pytest.approx(1e12 / (EXPERTS / 4 + W_READ + KV_CELL * 0.5)) and k0 == "accel-mem"
    t = (EXPERTS / 2 / 4) / 10e9 + (EXPERTS / 2 / 4 + W_READ + KV_CELL * 0.5) / 1e12
    assert b2 == pytest.approx(1 / t) and k2 == "host-mem" and b2 < b0


def test_prefill_compute_bound_and_stream_bound(meta):
    cpu = profile(cpu_matmul_fp32_gflops=100.0)
    b, kind, inputs = bound(meta, CellShape("llama-cpp", 4, threads=2, compute_dtype="f32"), 512, 0, 0, cpu)
    f = FLOPS_PER_TOKEN + 4 * 4 * 4 * 32 * 256
    assert kind == "compute" and b == pytest.approx(100e9 / f) and "cpu_matmul_fp32_gflops (f32)" in inputs
    # CPU figures scale with the cell's threads against the profile's
    one = bound(meta, CellShape("llama-cpp", 4, threads=1, compute_dtype="f32"), 512, 0, 0, cpu).tps
    assert one == pytest.approx(b / 2)
    # GPU: each ubatch of 512 copies (nearly) all experts of the offloaded layers over pageable memory
    slow_bus = profile(gpu_matmul_bf16_gflops=1e6, h2d_pageable_gbps=1.0, cpu_matmul_fp32_gflops=100.0)
    shape = CellShape("llama-cpp", 4, n_ubatch=512, gpu=True, compute_dtype="bf16")
    b, kind, _ = bound(meta, shape, 512, 0, 0, slow_bus)
    crossing = EXPERTS * (1 - (1 - 2 / 8) ** 512)
    assert kind == "h2d" and b == pytest.approx(512 / (crossing / 1e9))
    b0, kind0, _ = bound(meta, CellShape("llama-cpp", 0, n_ubatch=512, gpu=True, compute_dtype="bf16"), 512, 0, 0,
                         slow_bus)
    assert kind0 == "compute" and b0 == pytest.approx(1e15 / f)         # nothing offloaded: nothing crosses


@pytest.mark.parametrize("dtype, peak", [("f32", 100.0), ("bf16", 200.0), ("q8-activations", 400.0),
                                         ("bf16+q8-activations", 400.0), ("f16", 100.0), ("f16+f32", 100.0)])
def test_prefill_peak_is_that_of_the_arithmetic_the_engine_uses(meta, dtype, peak):
    """compute_dtype["prefill"] picks the peak: int8 dot products for Q8 activations, bf16, f32; f16 multiplies in
    f32 lanes on a CPU without fp16 arithmetic; several kinds: the largest (none runs above its own peak)."""
    p = profile(cpu_matmul_fp32_gflops=100.0, cpu_matmul_bf16_gflops=200.0, cpu_matmul_int8_gops=400.0)
    f = FLOPS_PER_TOKEN + 4 * 4 * 4 * 32 * 256
    b = bound(meta, CellShape("llama-cpp", 0, threads=2, compute_dtype=dtype), 512, 0, 0, p).tps
    assert b == pytest.approx(peak * 1e9 / f)


@pytest.mark.parametrize("dtype, why", [("", "compute_dtype unknown"), ("q8-activations", "no measured peak"),
                                        ("fp8", "no measured peak"), ("f16", "no measured peak")])
def test_prefill_without_a_known_peak_has_no_bound(meta, dtype, why):
    """An engine that does not report its arithmetic (older runs, external engines), a peak the profile lacks, or
    fp16 on a CPU whose fp16 arithmetic is unknown: NaN with the reason, never the f32 guess."""
    p = profile(cpu_matmul_fp32_gflops=100.0) | {"cpu_fp16_arith": None}
    b, kind, inputs = bound(meta, CellShape("llama-cpp", 0, threads=2, compute_dtype=dtype), 512, 0, 0, p)
    assert math.isnan(b) and kind == "none" and why in inputs


def test_no_profile_gives_nan_not_a_guess(meta):
    b, kind, _ = bound(meta, CellShape("llama-cpp", 0), 0, 1, 0, None)
    assert math.isnan(b) and kind == ""


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_annotate_real_sweep(tiny, tmp_path):
    from harness.store import results
    from harness.planning.roofline import annotate
    from tests.conftest import moebench

    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,2", "-w", "pp16,tg4", "-r", "1",
                 "--threads", "2", "--results-dir", tmp_path, env={"MOEBENCH_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    run, cells, meas, _ = results.load_frames(next(tmp_path.glob("2*")))
    assert run["hardware_profile"]["figures"]["cpu_matmul_int8_gops"]["median"] > 0   # probed once, stored
    assert run["bandwidth"]["threads"]["2"] > 0                                       # and the run's own read probe
    a = annotate(cells, results.summarize(cells, meas), run)
    assert len(a) == 4
    pp, tg = a[a["workload"] == "pp16"], a[a["workload"] == "tg4"]
    assert (pp["bound_kind"] == "compute").all() and (pp["bound_tps"] > 0).all()
    assert (pp["fraction"] <= 1).all(), pp[["fraction", "bound_inputs"]]            # a bound is not beaten
    # tiny's 2.1 MB a token stay in any server CPU's caches: no memory bound, and the reason instead
    if (run["host"]["cache_mib"] or 0) > 2.1:
        assert (tg["bound_kind"] == "none").all() and tg["bound_tps"].isna().all()
        assert "no bound for llama-cpp" in r.stderr and "CPU caches: no memory bound" in r.stderr


def test_each_cell_gets_the_bound_of_its_own_settings(tiny, tmp_path):
    """Two cells of one engine, model and depth that differ only in threads (an interleaved A/B): each
    summary row's bound comes from its own cell (it once came from whichever cell was read last)."""
    import pandas as pd

    from harness.planning.roofline import annotate
    from harness.store import results

    meta = read_meta(tiny)
    profile = {"threads": 2, "cores_physical": 2, "figures": {
        "host_read_gbps": {"max": 20.0}, "cpu_matmul_fp32_gflops": {"max": 100.0},
        "cpu_matmul_bf16_gflops": {"max": 100.0}}}
    base = {"engine": "llama-cpp", "model": str(tiny), "model_name": meta.name, "model_fingerprint": meta.fingerprint,
            "n_cpu_moe": 0, "n_ubatch": 512, "bytes_by_device": "{}",
            "effective_settings": '{"compute_dtype": {"prefill": "f32", "decode": "f32"}}'}
    cells = pd.DataFrame([base | {"cell_id": "A/llama-cpp/x/ncmoe0", "threads": 2},
                          base | {"cell_id": "B/llama-cpp/x/ncmoe0", "threads": 1}])
    meas = pd.DataFrame([{"cell_id": c, "workload": "pp64", "tokens_per_s": 100.0} for c in cells["cell_id"]])
    cells["label"] = [results.CellKey.of(c).label() for c in cells.to_dict("records")]
    for col in ("depth", "status", "peak_rss_mib", "peak_vram_mib", "error"):
        cells[col] = ""
    a = annotate(cells, results.summarize(cells, meas), {"hardware_profile": profile})
    a = a.set_index("cell_id")["bound_tps"]
    assert a["A/llama-cpp/x/ncmoe0"] == pytest.approx(2 * a["B/llama-cpp/x/ncmoe0"])   # compute-bound: x threads


def test_a_file_without_key_length_gets_attention_flops(meta):
    """llama/Mixtral-style files often lack attention.key_length: a head is then n_embd / n_head wide (the
    bound once dropped the attention FLOPs, 4 * layers * heads * head_dim * ctx, to zero)."""
    import dataclasses

    lean = dataclasses.replace(meta, fields={k: v for k, v in meta.fields.items() if not k.endswith("_length")
                                             or k.endswith(("embedding_length", "expert_feed_forward_length"))})
    assert lean.get("attention.key_length") is None and meta.get("attention.key_length") == 32 == 128 // 4
    p = profile(cpu_matmul_fp32_gflops=100.0)
    shape = CellShape("llama-cpp", 0, threads=2, compute_dtype="f32")
    with_len, without = (bound(m, shape, 4096, 0, 8192, p)[0] for m in (meta, lean))
    assert without == pytest.approx(with_len)
    attn = 4 * 4 * 4 * 32 * (8192 + 2048)
    assert with_len == pytest.approx(100e9 / (FLOPS_PER_TOKEN + attn), rel=1e-6)


def _seconds(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


@pytest.mark.parametrize("threads", THREADS)
def test_decode_bound_holds_against_real_reads(threads):
    """A matrix-vector product (a decode step's kernel) and torch's sum (the read the probe once was) over f32
    weights far larger than the CPU caches, at the cell's thread count: their tokens/s stay at most the decode bound
    for those bytes, its bandwidth from the run's own probe (harness.hw.probe.read_bandwidth, as a sweep measures
    it). As in a sweep's table, the kernels' median (they run before and after the probe: both see the same machine)
    against the probe's best."""
    import numpy as np
    import torch

    from harness.hw.host import cache_mib
    from harness.hw.probe import read_bandwidth
    from harness.planning.roofline import memory_bound

    cache = (cache_mib() or 0) * 2**20
    # on transparent huge pages (numpy asks for them), as the reference engine's hugepage-copy weights: reads from
    # 4 KiB pages ran a quarter slower here, and a probe on them was beaten by such an engine
    w = torch.from_numpy(np.ones((int(max(256 * 2**20, 8 * cache)) // 4 // 4096, 4096), dtype=np.float32))
    x = torch.ones(4096)
    kernels = {"torch.mv": lambda: torch.mv(w, x), "torch.sum": w.sum}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        first = {k: _seconds(fn, 3) for k, fn in kernels.items()}
        probe = read_bandwidth([threads])
        took = {k: statistics.median(first[k] + _seconds(fn, 3)) for k, fn in kernels.items()}
    finally:
        torch.set_num_threads(before)
    gbps = probe["threads"][str(threads)]
    limit = memory_bound(w.nbytes, gbps, cache)          # tokens/s when a token reads w once
    for k, t in took.items():
        assert 1 / t <= limit, f"{k} read {w.nbytes / t / 1e9:.1f} GB/s, the probe {gbps:.1f} GB/s ({probe})"


@pytest.mark.parametrize("dtype", ["q8-activations", "bf16", "f32"])
def test_prefill_peak_holds_against_real_gemms(dtype):
    """The products of a gpt-oss-20b expert (2880 -> 2880) and of the small preset's (1024 -> 1536: gate and up)
    over a 512-token ubatch, not the probe's own shapes, in the arithmetic compute_dtype names: their median rate
    stays at most the peak the prefill bound divides by, measured as the hardware profile measures it (int8:
    torch._int_mm, the oneDNN VNNI/AMX kernels; a llama.cpp Q4_K prefill once ran at 164 % of the f32 peak it was
    held to). The probe and the kernels take turns, so both see the same machine."""
    import torch

    from harness.hw.probe import matmul_rates, matmul_shapes
    from harness.planning.roofline import CPU_PEAKS, peak

    threads = THREADS[-1]
    kind = {"q8-activations": torch.int8, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]

    def product(m: int, k: int, n: int):
        if kind == torch.int8:
            a, b = (torch.randint(-128, 128, s, dtype=torch.int8) for s in ((m, k), (k, n)))
            return lambda: torch._int_mm(a, b)
        a, b = (torch.randn(*s).to(kind) for s in ((m, k), (k, n)))
        return lambda: a @ b

    kernels = {shape: product(*shape) for shape in ((512, 2880, 2880), (512, 1024, 1536))}
    rates, took = [], {shape: [] for shape in kernels}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(5):          # the profile's five of each shape, a round at a time between the kernels
            rates += matmul_rates(torch, kind, "cpu", matmul_shapes(threads), 1)
            for shape, run in kernels.items():
                took[shape] += _seconds(run, 2)
    finally:
        torch.set_num_threads(before)
    hw = {"threads": threads, "cores_physical": threads, "figures": {CPU_PEAKS[dtype]: {"max": max(rates)}}}
    top, name = peak(hw, dtype)
    for (m, k, n), ts in took.items():
        rate = 2 * m * k * n / statistics.median(ts)
        assert rate <= top, f"{dtype}: {m}x{k}x{n} ran at {rate / 1e9:.0f} G/s, above {name} {top / 1e9:.0f}"


def test_a_cell_above_its_bound_is_a_warning_naming_it_and_the_inputs(tiny):
    """bound_messages: the engine, model, depth and workload, the fraction and what the bound divided (bytes a
    token and GB/s at N threads, or FLOP a token and the peak of its dtype); a cell without a bound: why."""
    import pandas as pd

    from harness.planning.roofline import annotate, bound_messages
    from harness.store import results

    meta = read_meta(tiny)
    run = {"run_id": "r1", "hardware_profile": {"threads": 2, "cores_physical": 2, "figures": {
        "cpu_matmul_fp32_gflops": {"max": 0.001}}}, "bandwidth": {"threads": {"2": 0.001}}, "host": {"cache_mib": 0.5}}
    cell = {"run_id": "r1", "cell_id": "llama-cpp/x/ncmoe2", "engine": "llama-cpp", "model": str(tiny),
            "model_name": meta.name, "model_fingerprint": meta.fingerprint, "n_cpu_moe": 2, "n_ubatch": 512,
            "threads": 2, "bytes_by_device": "{}", "depth": "", "status": "ok", "error": "",
            "effective_settings": '{"compute_dtype": {"prefill": "f32", "decode": "f32"}}'}
    cells = pd.DataFrame([cell, cell | {"cell_id": "llama-bench/x/ncmoe2", "engine": "llama-bench",
                                        "effective_settings": "{}"}])
    cells["label"] = [results.CellKey.of(c).label() for c in cells.to_dict("records")]
    meas = pd.DataFrame([{"cell_id": c, "workload": w, "tokens_per_s": 50.0}
                         for c in cells["cell_id"] for w in ("pp64", "tg8")])
    lines = bound_messages(annotate(cells, results.summarize(cells, meas), run))
    warnings = [x for x in lines if x.startswith("warning:")]
    assert len(warnings) == 3, lines          # llama-cpp pp64 and tg8, llama-bench tg8 (its pp64 has no bound)
    pp = next(x for x in warnings if "llama-cpp" in x and "pp64" in x)
    assert f"llama-cpp {meta.name} n_cpu_moe=2 pp64" in pp and "GFLOP a token at 0 G(FL)OP/s cpu_matmul_fp32" in pp
    tg = next(x for x in warnings if "llama-cpp" in x and "tg8" in x)
    assert ("MB a token (up to 0 MiB of them cached) at 0.0 GB/s read (2 threads, the best of this run's probe and "
            "this host's earlier ones)") in tg
    assert [x for x in lines if x.startswith("note:")] == [
        f"note: no bound for llama-bench {meta.name} pp64: compute_dtype unknown (the engine does not report it): "
        "no prefill bound."]
