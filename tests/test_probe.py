"""Hardware probe: positive figures with their spread, stored per host, embedded in run.json."""
import json

import pytest

from harness.hw import probe
from tests.conftest import moebench


def test_measure_returns_positive_figures_with_spread():
    p = probe.measure(threads=1, quick=True)
    assert p["threads"] == 1 and p["quick"] is True
    for name in ("host_read_gbps", "host_copy_gbps", "cpu_matmul_fp32_gflops", "cpu_matmul_bf16_gflops"):
        f = p["figures"][name]
        assert f["n"] == 3 and len(f["values"]) == 3
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


def test_sweep_embeds_the_stored_profile_in_run_json(tiny, tmp_path):
    cache = tmp_path / "cache"
    (cache / "hardware").mkdir(parents=True)
    import socket
    stored = {"schema_version": probe.SCHEMA, "hostname": socket.gethostname(), "threads": 2, "cores_physical": 2,
              "figures": {"host_read_gbps": {"max": 7.0}, "cpu_matmul_fp32_gflops": {"max": 50.0}}}
    (cache / "hardware" / f"{socket.gethostname()}.json").write_text(json.dumps(stored))
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0", "-w", "pp16,tg4", "-r", "1",
                 "--threads", "2", "--results-dir", tmp_path / "res", "--format", "csv",
                 env={"MOEBENCH_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    run = json.loads(next((tmp_path / "res").glob("*/run.json")).read_text())
    assert run["hardware_profile"] == stored
    # the sweep summary carries the roofline: tg4 on the CPU is bound by 7 GB/s over the bytes of a token
    import pandas as pd
    import io
    t = pd.read_csv(io.StringIO(r.stdout))
    tg = t[t["workload"] == "tg4"].iloc[0]
    assert tg["bound tok/s"] == pytest.approx(7e9 / (786432 + 1332736 + 1024 * 2), rel=0.01)
    assert tg["% of bound"] == pytest.approx(100 * tg["tok/s median"] / tg["bound tok/s"], rel=1e-3)
