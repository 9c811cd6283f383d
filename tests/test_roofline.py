"""Roofline bounds, computed by hand for the tiny preset (see harness/roofline.py for the formulas)."""
import math

import pytest

from engines.gguf_meta import read_meta
from harness.planning.roofline import CellShape, bound

EXPERTS = 4 * 3 * 8 * 64 * 128 * 4          # tiny: routed-expert bytes (f32), 4 layers
W_READ = 1857024 - 1024 * 128 * 4           # non-expert bytes minus the embedding table (a row lookup)
KV_CELL = 4 * 2 * (32 + 32) * 2             # llama.cpp f16 K+V of one cell over 4 layers
FLOPS_PER_TOKEN = 2 * (4 * (128 * 128 * 2 + 64 * 128 * 2 + 8 * 128) + 4 * 3 * 8 * 64 * 128 * 2 / 8)


def profile(**figs):
    return {"threads": 2, "cores_physical": 2, "figures": {k: {"max": v} for k, v in figs.items()}}


@pytest.fixture(scope="module")
def meta(tiny):
    return read_meta(tiny)


def test_decode_cpu_only_reads_everything_from_host_ram(meta):
    p = profile(host_read_gbps=10.0)
    for n in (0, 2, 4):        # without a GPU the depth moves no bytes off the memory bus
        b, kind = bound(meta, CellShape("llama-cpp", n, threads=2), 0, 1, 0, p)
        assert kind == "mem"
        assert b == pytest.approx(10e9 / (EXPERTS / 4 + W_READ + KV_CELL * 0.5))


def test_decode_with_gpu_splits_host_and_device_reads(meta):
    p = profile(host_read_gbps=10.0, gpu_mem_gbps=1000.0)
    b0, k0 = bound(meta, CellShape("llama-cpp", 0, gpu=True), 0, 1, 0, p)
    b2, k2 = bound(meta, CellShape("llama-cpp", 2, gpu=True), 0, 1, 0, p)
    assert b0 == pytest.approx(1e12 / (EXPERTS / 4 + W_READ + KV_CELL * 0.5)) and k0 == "accel-mem"
    t = (EXPERTS / 2 / 4) / 10e9 + (EXPERTS / 2 / 4 + W_READ + KV_CELL * 0.5) / 1e12
    assert b2 == pytest.approx(1 / t) and k2 == "host-mem" and b2 < b0


def test_prefill_compute_bound_and_stream_bound(meta):
    cpu = profile(cpu_matmul_fp32_gflops=100.0)
    b, kind = bound(meta, CellShape("llama-cpp", 4, threads=2), 512, 0, 0, cpu)
    f = FLOPS_PER_TOKEN + 4 * 4 * 4 * 32 * 256
    assert kind == "compute" and b == pytest.approx(100e9 / f)
    # CPU figures scale with the cell's threads against the profile's
    assert bound(meta, CellShape("llama-cpp", 4, threads=1), 512, 0, 0, cpu)[0] == pytest.approx(b / 2)
    # GPU: each ubatch of 512 copies (nearly) all experts of the offloaded layers over pageable memory
    slow_bus = profile(gpu_matmul_bf16_gflops=1e6, h2d_pageable_gbps=1.0, cpu_matmul_fp32_gflops=100.0)
    b, kind = bound(meta, CellShape("llama-cpp", 4, n_ubatch=512, gpu=True), 512, 0, 0, slow_bus)
    crossing = EXPERTS * (1 - (1 - 2 / 8) ** 512)
    assert kind == "h2d" and b == pytest.approx(512 / (crossing / 1e9))
    b0, kind0 = bound(meta, CellShape("llama-cpp", 0, n_ubatch=512, gpu=True), 512, 0, 0, slow_bus)
    assert kind0 == "compute" and b0 == pytest.approx(1e15 / f)         # nothing offloaded: nothing crosses


def test_no_profile_gives_nan_not_a_guess(meta):
    b, kind = bound(meta, CellShape("llama-cpp", 0), 0, 1, 0, None)
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
    assert run["hardware_profile"]["figures"]["host_read_gbps"]["median"] > 0   # probed once, stored
    a = annotate(cells, results.summarize(cells, meas), run["hardware_profile"])
    assert len(a) == 4 and (a["bound_tps"] > 0).all()
    assert set(a["bound_kind"]) == {"mem", "compute"}
    assert (a["fraction"] == a["tps_median"] / a["bound_tps"]).all()


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
            "n_cpu_moe": 0, "n_ubatch": 512, "effective_settings": "{}", "bytes_by_device": "{}"}
    cells = pd.DataFrame([base | {"cell_id": "A/llama-cpp/x/ncmoe0", "threads": 2},
                          base | {"cell_id": "B/llama-cpp/x/ncmoe0", "threads": 1}])
    meas = pd.DataFrame([{"cell_id": c, "workload": "pp64", "tokens_per_s": 100.0} for c in cells["cell_id"]])
    cells["label"] = [results.CellKey.of(c).label() for c in cells.to_dict("records")]
    for col in ("depth", "status", "peak_rss_mib", "peak_vram_mib", "error"):
        cells[col] = ""
    a = annotate(cells, results.summarize(cells, meas), profile).set_index("cell_id")["bound_tps"]
    assert a["A/llama-cpp/x/ncmoe0"] == pytest.approx(2 * a["B/llama-cpp/x/ncmoe0"])   # compute-bound: x threads


def test_a_file_without_key_length_gets_attention_flops(meta):
    """llama/Mixtral-style files often lack attention.key_length: a head is then n_embd / n_head wide (the
    bound once dropped the attention FLOPs, 4 * layers * heads * head_dim * ctx, to zero)."""
    import dataclasses

    lean = dataclasses.replace(meta, fields={k: v for k, v in meta.fields.items() if not k.endswith("_length")
                                             or k.endswith(("embedding_length", "expert_feed_forward_length"))})
    assert lean.get("attention.key_length") is None and meta.get("attention.key_length") == 32 == 128 // 4
    p = profile(cpu_matmul_fp32_gflops=100.0)
    with_len, without = (bound(m, CellShape("llama-cpp", 0, threads=2), 4096, 0, 8192, p)[0] for m in (meta, lean))
    assert without == pytest.approx(with_len)
    attn = 4 * 4 * 4 * 32 * (8192 + 2048)
    assert with_len == pytest.approx(100e9 / (FLOPS_PER_TOKEN + attn), rel=1e-6)
