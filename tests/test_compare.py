"""`moebench compare`: verdict statistics on known distributions, verdicts and exit codes on constructed
runs (exact numbers), and an end-to-end check on two real sweeps of the tiny model."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from harness.store import history, results
from harness.cli import cli
from harness.analysis.compare import compare_samples
from tests.conftest import moebench

FP = "f00dfeedf00dfeed"


def make_run(root: Path, run_id: str, cells: list[dict], started: str = "2026-01-01T00:00:00+00:00",
             index: bool = False, workloads: list[str] | None = None, rounds: int = 1) -> Path:
    """A run directory with exact numbers. cells: dicts with engine, n_cpu_moe, workload -> tok/s values
    (`values`), optional threads, status, arm ("A"/"B" makes it an interleaved run). rounds > 1: value i was
    measured in round i % rounds + 1 (one process each); 1: no `round` column, as runs written before rounds."""
    d = root / run_id
    d.mkdir(parents=True)
    arms = {c.get("arm", "") for c in cells} - {""}
    run = {"schema_version": 1, "run_id": run_id, "started": started, "host": {"hostname": "test"},
           "spec": {"workloads": workloads or sorted({w for c in cells for w in c["values"]})}}
    if arms:
        run["interleave"] = {"A": "llama-cpp", "B": "llama-cpp@threads=1", "differs": ["threads"]}
    (d / "run.json").write_text(json.dumps(run))
    cell_rows, meas = [], []
    for c in cells:
        threads = c.get("threads", 2)
        cell_id = (f"{c['arm']}/" if c.get("arm") else "") + f"{c['engine']}/{FP}/ncmoe{c['n_cpu_moe']}"
        common = {"run_id": run_id, "cell_id": cell_id, "engine": c["engine"], "model_name": "m",
                  "model_fingerprint": FP, "n_cpu_moe": c["n_cpu_moe"], "n_ctx": 512, "n_batch": 2048,
                  "n_ubatch": 512, "threads": threads, "flash_attn": "auto"}
        cell_rows.append(common | {"engine_version": "1", "depth": str(c["n_cpu_moe"]), "device": "auto",
                                   "dtype": "auto", "mmap": True, "extra": {}, "status": c.get("status", "ok"),
                                   "error": c.get("error", "")})
        for wl, values in c["values"].items():
            n_tokens = int(wl[2:])
            meas += [common | {"workload": wl, "rep": i, "tokens_per_s": v, "ns": int(n_tokens / v * 1e9)}
                     | ({"round": i % rounds + 1} if rounds > 1 else {}) for i, v in enumerate(values)]
    results.append_rows(d, "cells.csv", cell_rows)
    if meas:
        results.append_rows(d, "measurements.csv", meas)
    if index:
        assert history.index_run(d)
    return d


def noisy(center: float, n: int = 10, seed: int = 0) -> list[float]:
    return [float(x) for x in center * (1 + 0.01 * np.random.default_rng(seed).standard_normal(n))]


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


# --- statistics on synthetic samples with known distributions -----------------------------------------

def procs(values, k: int = 5) -> dict:
    """Samples measured in k processes (rounds of separate runs: the units), value i in process i % k."""
    values = list(values)
    return {f"run/{p + 1}": values[p::k] for p in range(k)}


def sim(rng, center: float, k: int = 5, reps: int = 2, process: float = 0.02, noise: float = 0.03) -> dict:
    """k processes of `reps` repetitions: each process at its own speed (two of one build differ by ~2 %)."""
    return {f"run/{p + 1}": list(center * (1 + rng.normal(0, process)) * (1 + noise * rng.standard_normal(reps)))
            for p in range(k)}


def test_detection_rates_10pct_slowdown_and_identical():
    """5 processes of 2 reps a side (2 % between processes, 3 % within), 200 seeded trials: a 10% slowdown is
    flagged >= 95%, no change <= 2%."""
    rng = np.random.default_rng(20260101)
    trials = 200
    slow = same = 0
    for _ in range(trials):
        base = sim(rng, 100)
        slow += compare_samples(base, sim(rng, 90)).verdict == "regression"
        same += compare_samples(base, sim(rng, 100)).verdict != "no change"
    print(f"\n10% slowdown flagged in {slow}/{trials} = {slow / trials:.1%}; "
          f"identical distributions flagged in {same}/{trials} = {same / trials:.1%} (95% interval, threshold 5%)")
    assert slow / trials >= 0.95
    assert same / trials <= 0.02


def test_small_real_change_is_not_a_regression():
    """Significant but below the threshold (asv rule): 2% slower with tiny noise is 'no change'."""
    rng = np.random.default_rng(3)
    r = compare_samples(procs(100 * (1 + 0.002 * rng.standard_normal(20))),
                        procs(98 * (1 + 0.002 * rng.standard_normal(20))))
    assert r.ci_high < 0.99 and r.verdict == "no change"


def test_time_metric_direction():
    """--metric ns: lower is better, so more time is the regression and less time the improvement."""
    rng = np.random.default_rng(5)
    base = 1e6 * (1 + 0.01 * rng.standard_normal(10))
    assert compare_samples(procs(base), procs(base * 1.2), higher_is_better=False).verdict == "regression"
    assert compare_samples(procs(base), procs(base * 0.8), higher_is_better=False).verdict == "improvement"
    assert compare_samples(procs(base), procs(base * 1.2), higher_is_better=True).verdict == "improvement"


def test_one_process_a_side_is_insufficient_data():
    """One process a side gives no interval, however many repetitions it has (they see none of the difference
    between processes): said, with what would give one, not 'no change'; two processes a side do (a wide one)."""
    for base, cand in (([100], [50]), (noisy(100), noisy(50, seed=1))):
        r = compare_samples(procs(base, 1), procs(cand, 1))
        assert r.verdict == "insufficient data" and r.over == "1 process" and "--rounds 3 or more" in r.note
        assert r.ratio == pytest.approx(math.exp(np.log(cand).mean() - np.log(base).mean()))
    r = compare_samples(procs([100, 101], 2), procs([50, 51], 2))
    assert r.verdict == "regression" and r.over == "2 rounds" and r.ci_low < r.ratio < r.ci_high


def test_rounds_are_the_units_and_pair_within_a_run():
    """Three rounds a side: the rounds are resampled, not the repetitions; paired when the rounds ran together,
    so drift that hit both arms in one round cancels (the unpaired interval of the same numbers is wider)."""
    drift = {"1": 1.0, "2": 0.8, "3": 1.1}
    base = {k: [100 * d, 101 * d] for k, d in drift.items()}
    cand = {k: [90 * d, 91 * d] for k, d in drift.items()}
    paired = compare_samples(base, cand, paired=True)
    unpaired = compare_samples(base, cand)
    assert paired.over == "3 rounds (paired)" and unpaired.over == "3 rounds"
    assert paired.verdict == "regression" and paired.ci_high - paired.ci_low < 0.01
    assert unpaired.verdict == "no change" and unpaired.ci_low < 0.9 < 1 < unpaired.ci_high


def test_interval_is_deterministic_and_centred_on_the_ratio():
    a, b = (compare_samples(procs(noisy(100)), procs(noisy(80, seed=1))) for _ in range(2))
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert a.ratio == pytest.approx(math.sqrt(a.ci_low * a.ci_high)) and 0.75 < a.ci_low and a.ci_high < 0.85
    assert a.median_ratio == pytest.approx(np.median(noisy(80, seed=1)) / np.median(noisy(100)))


# --- verdicts, matching and exit codes on constructed runs -----------------------------------------------

@pytest.fixture
def pair(tmp_path):
    base = make_run(tmp_path, "base", [
        {"engine": "llama-cpp", "n_cpu_moe": 0, "values": {"pp512": noisy(100, seed=1), "tg128": noisy(50, seed=2)}},
        {"engine": "llama-cpp", "n_cpu_moe": 4, "values": {"pp512": noisy(60, seed=3), "tg128": noisy(30, seed=4)}},
        {"engine": "reference", "n_cpu_moe": 0, "values": {"pp512": noisy(10, seed=5)}},
    ], rounds=5)
    cand = make_run(tmp_path, "cand", [
        # depth 0 regresses in prefill, depth 4 does not: two rows, never one average
        {"engine": "llama-cpp", "n_cpu_moe": 0, "values": {"pp512": noisy(80, seed=6), "tg128": noisy(60, seed=7)}},
        {"engine": "llama-cpp", "n_cpu_moe": 4, "values": {"pp512": noisy(60, seed=8), "tg128": noisy(30, seed=9)}},
        {"engine": "llama-cpp", "n_cpu_moe": 8, "values": {"pp512": noisy(40, seed=10)}},     # only in candidate
    ], rounds=5)
    return base, cand


def test_verdicts_per_cell_summary_and_unmatched(pair, tmp_path):
    base, cand = pair
    r = run_cli("compare", base, cand, "--format", "json", "-o", tmp_path / "c.json")
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "c.json").read_text())
    verdicts = {(c["n_cpu_moe"], c["workload"]): c["verdict"] for c in out["cells"]}
    assert verdicts == {("0", "pp512"): "regression", ("0", "tg128"): "improvement",
                        ("4", "pp512"): "no change", ("4", "tg128"): "no change"}
    cell = next(c for c in out["cells"] if c["n_cpu_moe"] == "0" and c["workload"] == "pp512")
    assert cell["median_ratio"] == pytest.approx(np.median(noisy(80, seed=6)) / np.median(noisy(100, seed=1)))
    by_round = lambda v: [np.log(v[r::5]).mean() for r in range(5)]     # make_run: value i in round i % 5 + 1
    assert cell["ratio"] == pytest.approx(math.exp(np.mean(by_round(noisy(80, seed=6)))
                                                   - np.mean(by_round(noisy(100, seed=1)))))
    assert cell["ci_high"] < 0.85 and cell["over"] == "5 rounds" and cell["n_base"] == cell["n_cand"] == 10
    pp = next(s for s in out["summary"] if s["workload"] == "pp512")
    ratios = [c["ratio"] for c in out["cells"] if c["workload"] == "pp512"]
    assert pp["geomean ratio"] == pytest.approx(math.sqrt(ratios[0] * ratios[1])) and pp["regression"] == 1
    assert {(u["only in"], u["engine"], u["n_cpu_moe"]) for u in out["unmatched"]} == {
        ("base", "reference", "0"), ("candidate", "llama-cpp", "8")}
    assert "1 regression" in out["headline"] and "1 improvement" in out["headline"]


def test_exit_codes_and_formats(pair, tmp_path):
    base, cand = pair
    assert run_cli("compare", base, cand).exit_code == 0
    r = run_cli("compare", base, cand, "--fail-on-regression", "--format", "md")
    assert r.exit_code == 1
    assert r.output.startswith("**moebench compare**: 1 regression") and "| regression |" in r.output
    assert "unmatched cells" in r.output
    assert run_cli("compare", base, base, "--fail-on-regression").exit_code == 0      # identical: no change
    r = run_cli("compare", base, cand, "--format", "csv")
    lines = r.stdout.splitlines()
    assert lines[0].startswith("engine,model,n_cpu_moe,workload") and "only in candidate" in r.stdout
    # a regression of 20% passes a 25% threshold
    assert run_cli("compare", base, cand, "--threshold", "25%", "--fail-on-regression").exit_code == 0


def test_failed_candidate_cell_fails_the_check(tmp_path):
    base = make_run(tmp_path, "b", [{"engine": "e", "n_cpu_moe": 0, "values": {"pp64": noisy(100)}}])
    cand = make_run(tmp_path, "c", [{"engine": "e", "n_cpu_moe": 0, "values": {}, "status": "oom",
                                     "error": "killed"}], workloads=["pp64"])
    r = run_cli("compare", base, cand, "--fail-on-regression", "--format", "json")
    assert r.exit_code == 1
    assert json.loads(r.stdout)["cells"][0]["verdict"] == "candidate failed"


def test_insufficient_data_is_said_plainly(tmp_path):
    """Single-process runs (--rounds 1): no verdict, and why; a CI gate that could judge no cell says so (exit 2)
    instead of passing every build."""
    base = make_run(tmp_path, "b", [{"engine": "e", "n_cpu_moe": 0, "values": {"pp64": noisy(100)}}])
    cand = make_run(tmp_path, "c", [{"engine": "e", "n_cpu_moe": 0, "values": {"pp64": noisy(50, seed=1)}}])
    r = moebench("compare", base, cand)
    assert r.returncode == 0 and "insufficient data" in r.stdout and "--rounds 3 or more" in r.stderr
    r = moebench("compare", base, cand, "--fail-on-regression")
    assert r.returncode == 2 and "--fail-on-regression judged no cell" in r.stderr and "--rounds 3" in r.stderr


def test_bad_input_exits_2_with_one_sentence(pair, tmp_path):
    base, cand = pair
    other = make_run(tmp_path, "t1", [{"engine": "llama-cpp", "n_cpu_moe": 0, "threads": 1,
                                       "values": {"pp512": noisy(50)}}])
    cases = [([tmp_path / "nope", cand], "not a moebench run directory"),
             ([base, cand, "--threshold", "5"], "write it as 5% or 0.05"),
             ([base, cand, "--threshold", "5"], "--threshold '5' is not a relative amount"),
             ([base, cand, "--ignore", "colour"], "not a key field"),
             ([base, other], "differ in threads"),
             ([f"{base}:A", cand], "not an interleaved run"),
             ([base, "history:latest", "--results-dir", tmp_path], "pass them as BASE"),
             (["history:latest", cand, "--results-dir", tmp_path / "empty"], "No run history")]
    for args, msg in cases:
        r = moebench("compare", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # the same pair matches once the differing setting is ignored on purpose
    r = run_cli("compare", base, other, "--ignore", "threads", "--format", "json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["cells"][0]["settings"] == "n_ctx=512 n_ubatch=512 threads=2→1 flash_attn=auto"


def test_interleaved_arms_split_and_match_across_what_differs(tmp_path):
    run = make_run(tmp_path, "ab", [
        {"engine": "llama-cpp", "n_cpu_moe": 0, "arm": "A", "values": {"pp64": noisy(100)}},
        {"engine": "llama-cpp", "n_cpu_moe": 0, "arm": "B", "threads": 1, "values": {"pp64": noisy(70, seed=2)}}],
        rounds=5)
    r = run_cli("compare", f"{run}:A", f"{run}:B", "--format", "json", "--fail-on-regression")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    cells = out["cells"]
    assert len(cells) == 1 and cells[0]["verdict"] == "regression" and cells[0]["over"] == "5 rounds (paired)"
    # what a CI job reads: the decision and the interval behind it
    assert out["decision"]["fail"] is True
    (bad,) = out["decision"]["failing_cells"]
    assert bad["ci_high"] < 0.95 and bad["ci_low"] < bad["ratio"] < bad["ci_high"]


def test_history_selectors(tmp_path):
    res = tmp_path / "results"
    # six older runs; the oldest is 10x faster, so it must not be in median-of-last-5
    for i in range(6):
        make_run(res, f"r{i}", [{"engine": "e", "n_cpu_moe": 0,
                                 "values": {"pp64": noisy(1000 if i == 0 else 100 + i, seed=i)}}],
                 started=f"2026-01-0{i + 1}T00:00:00+00:00", index=True, rounds=5)
    cand = make_run(res, "cand", [{"engine": "e", "n_cpu_moe": 0, "values": {"pp64": noisy(80, seed=9)}}],
                    started="2026-02-01T00:00:00+00:00", index=True, rounds=5)
    get = lambda sel: json.loads(run_cli("compare", sel, cand, "--results-dir", res, "--format",
                                         "json").stdout)["cells"][0]
    latest = get("history:latest")                   # r5, not the candidate's own run
    assert latest["n_base"] == 10 and latest["base_median"] == pytest.approx(np.median(noisy(105, seed=5)))
    last5 = get("history:median-of-last-5")          # r1..r5 pooled
    assert last5["n_base"] == 50
    pooled = np.concatenate([noisy(100 + i, seed=i) for i in range(1, 6)])
    assert last5["base_median"] == pytest.approx(np.median(pooled)) and last5["verdict"] == "regression"
    assert get("history:r0")["base_median"] > 900


# --- end to end: real sweeps of the tiny model ------------------------------------------------------------

def test_real_sweeps_slower_candidate_is_flagged(tiny, tmp_path):
    """Baseline n_ubatch 512 vs candidate n_ubatch 16 (prefill in 16-token chunks: a real ~5x slowdown on
    this machine, independent of how loaded it is), 3 rounds each (one process a side gives no verdict).
    n_ubatch is part of the cell key, so the comparison says --ignore n_ubatch on purpose; without it nothing
    matches and compare says why (exit 2)."""
    runs = []
    for ub in (512, 16):
        r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp256", "-r", "8", "--rounds", "3",
                     "--threads", "1", "--n-ubatch", ub, "--sample-ms", "0", "--results-dir", tmp_path)
        assert r.returncode == 0, r.stderr
        runs.append(r.stderr.split("results: ")[-1].strip())
    r = moebench("compare", *runs, "--fail-on-regression", "--format", "json")
    assert r.returncode == 2 and "differ in n_ubatch" in r.stderr
    r = moebench("compare", *runs, "--ignore", "n_ubatch", "--fail-on-regression", "--format", "json")
    assert r.returncode == 1, r.stderr
    cell = json.loads(r.stdout)["cells"][0]
    print(f"\nn_ubatch 512 -> 16, pp256: ratio {cell['ratio']:.3f} (95% CI "
          f"{cell['ci_low']:.3f}-{cell['ci_high']:.3f}), "
          f"over {cell['over']}: {cell['verdict']}")
    assert cell["verdict"] == "regression" and cell["ratio"] < 0.95 and cell["over"] == "3 rounds"
    # both sweeps were indexed on the way: the history baseline finds the first one
    r = moebench("compare", "history:latest", runs[0], "--results-dir", tmp_path, "--ignore", "n_ubatch",
                 "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["cells"][0]["verdict"] == "improvement"


def test_example_ci_script_fails_the_job_on_regression(tiny, tmp_path):
    """examples/ci/perf-check.sh, run for real: baseline and candidate sweeps, compare.md, exit 1."""
    import os
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parent.parent
    workflow = yaml.safe_load((root / "examples/ci/perf-regression.yml").read_text())
    steps = workflow["jobs"]["moebench"]["steps"]
    assert any(s.get("run") == "cand/examples/ci/perf-check.sh" for s in steps)
    env = os.environ | {"PYTHON": sys.executable, "MODEL": str(tiny), "WORKLOADS": "pp256", "REPS": "8",
                        "THREADS": "1", "CAND_ARGS": "--n-ubatch 16", "COMPARE_ARGS": "--ignore n_ubatch",
                        "ROUNDS": "3",
                        "RESULTS": str(tmp_path)}
    r = subprocess.run(["bash", root / "examples/ci/perf-check.sh"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "performance regression" in r.stderr
    assert (tmp_path / "compare.md").read_text().startswith("**moebench compare**: 1 regression")
