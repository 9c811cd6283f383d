"""`moebench sweep --until`: a pilot of rounds, then the rounds Stein's two-stage rule asks for each compared ratio
(harness.run.until; its coverage is tests/test_coverage.py), through the real CLI and real worker processes,
on engines whose speed is known (tests.fault_engines: `paced` takes a fixed time per step and its processes differ
by 0.2 %, `jitter` differs by 20 % between processes at depths above 0); and the bandwidth probe timed at the start
of every round."""
from __future__ import annotations

import json

import pandas as pd

from tests.conftest import moebench, run_dir_of


def rounds_per_cell(run_dir) -> dict[str, int]:
    m = pd.read_csv(run_dir / "measurements.csv")
    return {c.split("/")[0] + "@" + c.rsplit("ncmoe", 1)[1]: int(g["round"].max()) for c, g in m.groupby("cell_id")}


def test_until_adds_rounds_only_where_a_ratio_is_not_precise(tiny, tmp_path):
    """Depth 0: paced vs jitter agree within 5 % after the pilot (5 rounds); depth 2: jitter's processes differ by
    20 %, so its pilot asks for more rounds than --max-rounds: it gets all 6 and is named as not reached, with its
    achieved width and why. 50 ms steps: a late wake-up of a few ms on a busy machine stays a few %."""
    r = moebench("sweep", "-m", tiny, "-e", "paced,jitter", "--n-cpu-moe", "0,2", "-w", "pp8", "-r", "1",
                 "--rounds", "2", "--until", "5%", "--max-rounds", "6", "--sample-ms", "0", "--results-dir", tmp_path,
                 env={"MOEBENCH_PACE_MS": "50"})
    assert r.returncode == 0, r.stderr
    d = run_dir_of(r)
    run = json.loads((d / "run.json").read_text())
    until = run["until"]
    assert until["target"] == 0.05 and until["rounds"] == 6 and until["stopped_by"] == "max rounds (6)"
    assert until["pilot"] == 5 and until["method"] == "two-stage (Stein)"
    by_depth = {p["a"].rsplit("ncmoe", 1)[1]: p for p in until["pairs"]}
    assert by_depth["0"]["reached"] and by_depth["0"]["half_width"] <= 0.05
    assert not by_depth["2"]["reached"] and by_depth["2"]["half_width"] > 0.05 and by_depth["2"]["needed"] > 6
    assert "the rounds disagree" in by_depth["2"]["why"]
    assert "not reached: jitter" in r.stderr or "not reached: paced" in r.stderr
    rounds = rounds_per_cell(d)
    assert rounds["paced@2"] == rounds["jitter@2"] == 6               # the imprecise pair ran every round
    # the precise one stopped when its pilot said (after it, unless its spread asked for one more)
    assert rounds["paced@0"] == rounds["jitter@0"] == by_depth["0"]["rounds"] == by_depth["0"]["needed"] < 6
    # each cell is still one cell; the probe ran at the start of every round that ran, and at the end
    assert len(pd.read_csv(d / "cells.csv")) == 4 and not (d / "rounds").exists()
    whens = [p["when"] for p in run["steadiness"]]
    assert whens == [f"round {k}" for k in range(1, 7)] + ["end"]
    assert all(p["read_gbps"] > 0.1 for p in run["steadiness"])
    assert "bandwidth moved" in r.stderr


def test_until_stops_when_every_ratio_is_precise(tiny, tmp_path):
    """50 ms steps, as above, and ±5 %: on a 2-core VM busy with other jobs the 100 ms of tg2 spread 3 % from round
    to round (late wake-ups), which needs 9 rounds for ±3 % after a pilot of 5 and 5 for ±5 %."""
    r = moebench("sweep", "-m", tiny, "-e", "paced,paced2", "-w", "pp8,tg2", "-r", "1", "--rounds", "2",
                 "--until", "5%", "--max-rounds", "8", "--sample-ms", "0", "--results-dir", tmp_path,
                 env={"MOEBENCH_PACE_MS": "50"})
    assert r.returncode == 0, r.stderr
    until = json.loads((run_dir_of(r) / "run.json").read_text())["until"]
    assert until["stopped_by"] == "target reached" and until["rounds"] < 8, until
    assert len(until["pairs"]) == 2 and all(p["reached"] and p["half_width"] <= 0.05 for p in until["pairs"])
    # the report says how many rounds it took
    out = tmp_path / "rep"
    rep = moebench("report", run_dir_of(r), "-o", out)
    assert rep.returncode == 0, rep.stderr
    md = (out / "report.md").read_text()
    assert f"{until['rounds']} rounds to bring every compared ratio within ±5.0%; 2 of 2 got there" in md
    assert "Stein's two-stage rule: a pilot of 5 interleaved rounds" in md
    # every reader computes the interval the rule stands for: the report's, from run.json's pilot
    assert "rounds (paired, two-stage)" in md
    assert "Steadiness" in md and "bandwidth moved" in md


def test_until_bad_input_is_one_sentence(tiny, tmp_path):
    cases = [(["-e", "paced,paced2", "--until", "150%"], "--until '150%' is not a relative amount"),
             (["-e", "paced", "--until", "3%"], "compares none"),
             (["-e", "paced,paced2", "--until", "3%", "--interleave"], "drop --interleave"),
             (["-e", "paced,paced2", "--until", "3%", "--round-order", "back-to-back"], "back-to-back rounds do not"),
             (["-e", "paced,paced2", "--until", "3%", "--max-rounds", "4"], "it needs 5 rounds or more")]
    for args, msg in cases:
        r = moebench("sweep", "-m", tiny, "-w", "pp8", "-r", "1", *args, "--results-dir", tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, r.stderr
