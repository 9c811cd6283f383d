"""Hardware probe: positive figures with their spread, stored per host, embedded in run.json."""
import json
import time

import pytest

from harness.hw import probe
from tests.conftest import moebench


def test_measure_returns_positive_figures_with_spread():
    p = probe.measure(threads=1, quick=True)
    assert p["threads"] == 1 and p["quick"] is True
    for name in ("host_read_gbps", "host_copy_gbps", "cpu_matmul_fp32_gflops", "cpu_matmul_bf16_gflops",
                 "cpu_matmul_int8_gops"):
        f = p["figures"][name]
        n = 3 * len(probe.matmul_shapes(1, quick=True)) if "matmul" in name else 3     # matmuls: 3 of each shape
        assert f["n"] == n and len(f["values"]) == n
        assert 0 < f["min"] <= f["median"] <= f["max"], (name, f)
        assert f["unit"] == probe.UNITS[name]


def test_profile_is_stored_per_host_under_moebench_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path))
    assert probe.load_profile() is None
    p = {"schema_version": probe.SCHEMA, "hostname": "box1", "threads": 2,
         "figures": {"host_read_gbps": {"max": 12.5}}}
    path = probe.save_profile(p)
    assert path == tmp_path / "hardware" / "box1.json"
    assert probe.load_profile("box1") == p
    assert probe.figure(p, "host_read_gbps") == 12.5
    assert probe.figure(p, "gpu_mem_gbps") != probe.figure(p, "gpu_mem_gbps")      # NaN when absent


def test_probe_cli_prints_json_and_stores_it(tmp_path):
    r = moebench("probe", "--quick", "--threads", "1", "--format", "json", env={"MOEBENCH_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    stored = json.loads(next((tmp_path / "hardware").glob("*.json")).read_text())
    assert printed == stored
    assert printed["figures"]["cpu_matmul_fp32_gflops"]["median"] > 0
    bad = moebench("probe", "--threads", "0")
    assert bad.returncode == 2 and "--threads" in bad.stderr


def test_sweep_embeds_the_stored_profile_and_its_own_bandwidth_in_run_json(tiny, tmp_path):
    """run.json: the stored profile, and the read bandwidth measured at the start of the run at the cells' thread
    count; the summary's bounds divide by them, and say so where a cell beats its bound or has none."""
    import io
    import socket

    import pandas as pd

    from tests.test_roofline import FLOPS_PER_TOKEN

    cache = tmp_path / "cache"
    (cache / "hardware").mkdir(parents=True)
    stored = {"schema_version": probe.SCHEMA, "hostname": socket.gethostname(), "threads": 2, "cores_physical": 2,
              "figures": {"host_read_gbps": {"max": 7.0}, "cpu_matmul_fp32_gflops": {"max": 1e-3}}}
    (cache / "hardware" / f"{socket.gethostname()}.json").write_text(json.dumps(stored))
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0", "-w", "pp16,tg4", "-r", "1",
                 "--threads", "2", "--results-dir", tmp_path / "res", "--format", "csv",
                 env={"MOEBENCH_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    run = json.loads(next((tmp_path / "res").glob("*/run.json")).read_text())
    assert run["hardware_profile"] == stored
    bw = run["bandwidth"]
    assert set(bw["threads"]) == {"2"} and bw["threads"]["2"] > 0.1 and "numpy" in bw["method"]
    assert bw["buffer_mib"] >= min(1024, 16 * run["host"]["cache_mib"]) or "error" in bw
    t = pd.read_csv(io.StringIO(r.stdout)).set_index("workload")
    # pp16: llama.cpp multiplies tiny's f32 weights in f32, held to the profile's (here absurdly low) f32 peak
    assert t.loc["pp16", "bound tok/s"] == pytest.approx(1e6 / (FLOPS_PER_TOKEN + 4 * 4 * 4 * 32 * 8), rel=1e-3)
    assert t.loc["pp16", "% of bound"] == pytest.approx(100 * t.loc["pp16", "tok/s median"] / t.loc["pp16",
                                                                                                   "bound tok/s"])
    assert "pp16: " in r.stderr and "% of its compute bound" in r.stderr and "cpu_matmul_fp32_gflops (f32)" in r.stderr
    # tg4: tiny's 2.1 MB a token stay in any server CPU's caches: no memory bound, and the summary says why
    if (run["host"]["cache_mib"] or 0) > 2.1:
        assert t.loc["tg4", "bound tok/s"] != t.loc["tg4", "bound tok/s"]
        assert "tg4: the" in r.stderr and "CPU caches: no memory bound" in r.stderr


def test_read_bandwidth_is_quick_and_reads_far_more_than_the_caches():
    """The in-run probe: a buffer of max(1 GiB, 16 x the CPU caches) (less only when RAM is short), each thread count
    asked for, in a few seconds."""
    from harness.hw.host import cache_mib

    t0 = time.perf_counter()
    bw = probe.read_bandwidth([1, 2])
    took = time.perf_counter() - t0
    assert set(bw["threads"]) == {"1", "2"} and all(v > 0.1 for v in bw["threads"].values()), bw
    assert bw["buffer_mib"] == probe.read_buffer_bytes() / 2**20 >= min(1024, 16 * (cache_mib() or 0))
    assert took < 10, bw          # a second or two on a quiet machine


def test_cache_size_counts_every_data_cache_once(tmp_path):
    """Two CPUs, each with L1d, L1i and L2, sharing one L3: 2 x (32 KiB + 1 MiB) + 32 MiB; instruction caches
    and the second CPU's view of the shared L3 do not count."""
    from harness.hw.host import cache_mib

    for cpu in (0, 1):
        caches = [(1, "Data", "32K", cpu), (1, "Instruction", "32K", cpu), (2, "Unified", "1024K", cpu),
                  (3, "Unified", "32768K", "0-1")]
        for i, (level, kind, size, shared) in enumerate(caches):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            for name, v in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                (d / name).write_text(f"{v}\n")
    assert cache_mib(tmp_path) == pytest.approx(2 * (32 / 1024 + 1) + 32)
    assert cache_mib(tmp_path / "none") is None
