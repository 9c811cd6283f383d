"""The tensorsharp engine: its parser on TensorSharp's documented line formats, and whole sweeps
against tests/stand_ins/TensorSharp.Cli, a script that prints those lines. No real TensorSharp runs
here (it needs .NET and a native build); the stand-in makes up its numbers."""
import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest

from engines.external import ExternalError
from engines.tensorsharp import max_context, parse_output, plan, run_ns
from harness.run.sweep import run_sweep
from harness.run.spec import SweepSpec
from workloads.grammar import parse_workload

from .conftest import moebench

STAND_IN = Path(__file__).parent / "stand_ins" / "TensorSharp.Cli"

# as TensorSharp.Cli's RunBenchmark logs them (F0 ms, F1 tok/s), behind a .NET console-logger prefix
DOCUMENTED = """\
info: TensorSharp.Cli[1500]
      inference benchmark starting: prefillTokens=4096 decodeTokens=128 runs=2
info: TensorSharp.Cli[1500]
      benchmark run 1/2: prefillMs=1873 prefillTps=2186.9 decodeMs=2311 decodeTps=55.4 msPerTok=18.1
2026-08-05 10:00:01 [INF] benchmark run 2/2: prefillMs=1702 prefillTps=2406.6 decodeMs=2290 decodeTps=55.9 msPerTok=17.9
info: TensorSharp.Cli[1500]
      benchmark summary: bestPrefillMs=1702 bestPrefillTps=2406.6 bestDecodeMs=2290 bestDecodeTps=55.9 bestDecodeMsPerTok=17.89 avgPrefillTps=2296.8 avgDecodeTps=55.7
"""


def test_parser_reads_runs_and_summary_by_key():
    out = parse_output(DOCUMENTED)
    assert out.total == 2 and [r["run"] for r in out.runs] == [1, 2]
    assert out.runs[0] == {"run": 1, "prefillMs": 1873, "prefillTps": 2186.9, "decodeMs": 2311, "decodeTps": 55.4,
                           "msPerTok": 18.1}
    assert out.summary["bestPrefillTps"] == 2406.6 and out.summary["avgDecodeTps"] == 55.7


def test_parser_nan_infinity_and_missing_lines():
    out = parse_output("benchmark run 1/1: prefillMs=12 prefillTps=42.5 decodeMs=0 decodeTps=NaN msPerTok=∞\n"
                       "benchmark summary: bestDecodeTps=NaN bestPrefillTps=42.5")
    assert math.isnan(out.runs[0]["decodeTps"]) and out.runs[0]["msPerTok"] == math.inf
    assert math.isnan(out.summary["bestDecodeTps"])
    empty = parse_output("Model file not found: x.gguf\nUsage: TensorSharp.Cli --model <path.gguf>")
    assert empty.runs == [] and empty.total is None and empty.summary == {}


def test_run_time_uses_the_more_precise_printed_figure():
    # 128-token decode: "ms" (±0.5 of 2311 = 2e-4) beats tok/s (±0.05 of 55.4 = 9e-4)
    assert run_ns({"decodeMs": 2311, "decodeTps": 55.4}, "decode", 128) == 2311 * 10**6
    # 4096-token prefill: tok/s (±0.05 of 2186.9 = 2e-5) beats ms (±0.5 of 1873 = 3e-4)
    assert run_ns({"prefillMs": 1873, "prefillTps": 2186.9}, "prefill", 4096) == round(4096 / 2186.9 * 1e9)
    # 3 ms prefill of 64 tokens: ms=3 is ±17 %, tok/s=21333.3 is exact to 2e-6
    assert run_ns({"prefillMs": 3, "prefillTps": 21333.3}, "prefill", 64) == round(64 / 21333.3 * 1e9)
    assert run_ns({"decodeMs": 250, "decodeTps": math.nan}, "decode", 16) == 250 * 10**6
    with pytest.raises(ExternalError, match="no decode time"):
        run_ns({"run": 1, "decodeMs": 0, "decodeTps": math.nan}, "decode", 16)


def test_workload_mapping_and_context_as_its_comparisons_did():
    assert plan(parse_workload("pp4096")) == (4096, 0, "prefill", 4096)          # prefill-only runs
    assert plan(parse_workload("tg128@d8192")) == (8192, 128, "decode", 128)     # decode after an 8K prefill
    assert plan(parse_workload("tg128")) == (1, 128, "decode", 128)              # a decode follows >= 1 token
    with pytest.raises(ExternalError, match="cannot time pp512@d1024"):
        plan(parse_workload("pp512@d1024"))
    # the published MAX_CONTEXT values: 4096+128 -> 4352, 8192+128 -> 8448, 512+128 -> 768
    assert [max_context(4096, 128), max_context(8192, 128), max_context(512, 128), max_context(256, 0)] == \
        [4352, 8448, 768, 256]


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    monkeypatch.setenv("MOEBENCH_TENSORSHARP", "")      # restored after each test


def _sweep(tiny, tmp_path, workloads, **kw):
    # what `moebench sweep --tensorsharp PATH` does: the path in the spec and in the environment
    # (the environment is what the availability check before any cell can see)
    os.environ["MOEBENCH_TENSORSHARP"] = str(STAND_IN)
    spec = SweepSpec(models=[str(tiny)], engines=["tensorsharp"], workloads=workloads, repetitions=3, threads=2,
                     extra={"tensorsharp": str(STAND_IN)}, **kw)
    run = run_sweep(spec, tmp_path)
    return run, pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv")


def test_sweep_end_to_end_against_the_stand_in(tiny, tmp_path, monkeypatch):
    record = tmp_path / "argv.jsonl"
    monkeypatch.setenv("STANDIN_RECORD", str(record))
    monkeypatch.setenv("STANDIN_ALLOC_MB", "300")
    monkeypatch.setenv("TS_CPU_MOE", "1")                 # inherited TS_* must not reach the binary
    run, cells, meas = _sweep(tiny, tmp_path, ["pp64", "tg16@d200"], depths=["2"], sample_ms=10)
    assert cells["status"].tolist() == ["ok"], cells["error"].tolist()
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [c["argv"][c["argv"].index("--bench-prefill") + 1:] for c in calls] == [
        ["64", "--bench-decode", "0", "--bench-runs", "4", "--bench-fixed-tokens"],      # 1 warm-up + 3 reps
        ["200", "--bench-decode", "16", "--bench-runs", "4", "--bench-fixed-tokens"]]
    assert all(c["argv"][c["argv"].index("--n-cpu-moe") + 1] == "2" for c in calls)
    assert [c["env"]["MAX_CONTEXT"] for c in calls] == ["256", "256"]
    assert not [k for c in calls for k in c["env"] if k.startswith("TS_")]
    # the warm-up run (1.5x slower in the stand-in) is dropped; rates are the printed ones
    pp = meas[meas["workload"] == "pp64"]["tokens_per_s"].tolist()
    assert pp == pytest.approx([2000 / 1.2 / (1 + 0.01 * r) for r in (1, 2, 3)], rel=1e-3)
    tg = meas[meas["workload"] == "tg16@d200"]["tokens_per_s"].tolist()
    assert tg == pytest.approx([80 / 1.2 / (1 + 0.01 * r) for r in (1, 2, 3)], rel=1e-2)
    assert meas["rep"].tolist() == [0, 1, 2, 0, 1, 2]
    # the binary is a child of the worker, so its 300 MiB count in the cell's peak RSS
    assert cells["peak_rss_mib"].iloc[0] > 300
    assert meas[meas["workload"] == "pp64"]["peak_rss_mib"].iloc[0] > 300
    assert "benchmark run 4/4" in next((run / "logs").iterdir()).read_text()


@pytest.mark.parametrize("mode, reason, shown", [
    ("fail", "TensorSharp.Cli exited with code 134", "DllNotFoundException"),
    ("garbage", "printed 0 'benchmark run' lines, expected 4", "nothing to benchmark"),
    ("short", "printed 3 'benchmark run' lines, expected 4", "benchmark run 3/4"),
    ("nosummary", "no 'benchmark summary' line", "benchmark run 4/4"),
])
def test_bad_binary_runs_give_a_failed_cell_with_reason_and_output_tail(tiny, tmp_path, monkeypatch, mode, reason,
                                                                        shown):
    monkeypatch.setenv("STANDIN_MODE", mode)
    _, cells, meas = _sweep(tiny, tmp_path, ["pp32"])
    assert cells["status"].tolist() == ["failed"]
    assert reason in cells["error"].iloc[0] and shown in cells["error"].iloc[0]
    assert meas.empty


def test_missing_binary_and_unsupported_workload_fail_cells_and_the_sweep_goes_on(tiny, tmp_path):
    r = moebench("sweep", "-m", tiny, "-e", "tensorsharp,llama-cpp", "--tensorsharp",
                 tmp_path / "nope" / "TensorSharp.Cli",
                 "-w", "pp16", "-r", "1", "--threads", "2", "--results-dir", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    cells = pd.read_csv(next(d for d in (tmp_path / "a").iterdir() if d.is_dir()) / "cells.csv").set_index("engine")
    assert cells.loc["llama-cpp", "status"] == "ok" and cells.loc["tensorsharp", "status"] == "failed"
    assert "TensorSharp.Cli binary" in cells.loc["tensorsharp",
                                                 "error"] and "does not exist" in cells.loc["tensorsharp", "error"]
    _, cells, _ = _sweep(tiny, tmp_path / "b", ["pp16@d32"])
    assert cells["status"].tolist() == ["failed"] and "cannot time pp16@d32" in cells["error"].iloc[0]


def test_engines_command_says_how_to_get_it():
    r = moebench("engines", env={"PATH": "/usr/bin:/bin", "MOEBENCH_TENSORSHARP": "", "COLUMNS": "1000"})
    row = next(line for line in r.stdout.splitlines() if "tensorsharp" in line)    # one line at this width
    assert "│ no " in row and "github.com/zhongkaifu/TensorSharp" in row and "--tensorsharp PATH" in row
