"""--rounds: the sweep K times over, every cell's round r before any cell's round r+1 (asv's rounds), through the
real CLI and real worker processes; the order within a round; resume per round; external engines; how the spread
splits between rounds and within a process, in files old and new."""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from harness.run.sweep import round_plan
from harness.store import results
from tests.conftest import FAULTS, ROOT, moebench, run_dir_of, sigint_default
from tests.fault_engines import StampEngine

# stamp engines that label every prefill with their engine and depth, so the test sees which cell worked when
ENGINES = FAULTS + ",x=tests.test_rounds:StampX,y=tests.test_rounds:StampY"
STAND_IN = Path(__file__).parent / "stand_ins" / "llama-bench"


class _CellStamp(StampEngine):
    tag = ""

    def load(self, model, s):
        super().load(model, dataclasses.replace(s, extra=s.extra | {"label": f"{self.tag}:{s.n_cpu_moe}"}))


class StampX(_CellStamp):
    tag = "x"


class StampY(_CellStamp):
    tag = "y"


def processes(stamps: Path) -> list[tuple[str, str]]:
    """(label, pid) of every worker process that stamped, in the order they started."""
    seen: dict[str, tuple[int, str]] = {}
    for label, start, _, pid in (line.split() for line in stamps.read_text().splitlines()):
        seen.setdefault(pid, (int(start), label))
    return [(label, pid) for pid, (_, label) in sorted(seen.items(), key=lambda kv: kv[1][0])]


def test_every_cells_round_r_runs_before_any_cells_round_r_plus_1(tiny, tmp_path):
    """2 engines x 2 depths, -r 3 and no --rounds: the default with more than one engine is 3 rounds, said on
    stderr. 12 processes (one per cell and round, each 1 warm-up + 1 repetition); round by round; within a
    round one depth's two engines side by side; as run.json's plan says; each cell still one cell."""
    stamps = tmp_path / "stamps.txt"
    r = moebench("sweep", "-m", tiny, "-e", "x,y", "--n-cpu-moe", "0,2", "-w", "pp8", "-r", "3", "--sample-ms", "0",
                 "--results-dir", tmp_path, env={"MOEBENCH_STAMP_FILE": str(stamps), "MOEBENCH_ENGINES": ENGINES})
    assert r.returncode == 0, r.stderr
    assert "--rounds 3 (the default with more than one engine)" in r.stderr
    procs = processes(stamps)
    assert len(procs) == 12 and len(stamps.read_text().splitlines()) == 24
    round_of, seen = [], {}
    for label, _ in procs:                        # a cell's k-th process is its round k
        seen[label] = seen.get(label, 0) + 1
        round_of.append(seen[label])
    assert round_of == [1] * 4 + [2] * 4 + [3] * 4, procs
    for k in range(0, 12, 2):                    # the cells of one depth (x and y) next to each other
        assert {procs[k][0], procs[k + 1][0]} in ({"x:0", "y:0"}, {"x:2", "y:2"}), procs
    run = run_dir_of(r)
    info = json.loads((run / "run.json").read_text())
    assert info["rounds"]["sizes"] == [1, 1, 1] and info["rounds"]["default"] is True
    assert info["spec"]["rounds"] == 3 and info["spec"]["round_order"] == "interleaved"
    planned = [c.split("/")[0] + ":" + c.rsplit("ncmoe", 1)[1] for p in info["rounds"]["plan"] for c in p]
    assert planned == [label for label, _ in procs]
    cells, meas = pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv")
    assert len(cells) == 4 and (cells["status"] == "ok").all()
    assert meas.groupby("cell_id")["round"].apply(sorted).tolist() == [[1, 2, 3]] * 4
    assert meas.groupby("cell_id")["rep"].apply(sorted).tolist() == [[0, 1, 2]] * 4
    assert not (run / "rounds").exists()                 # no round waits once its cell is written
    assert "rounds: 3 (the default" in r.stderr and "between rounds" in r.stderr
    lines = r.stdout.split("ratios: A / B")[0].splitlines()   # the table in the sweep's order, not the finishing order
    assert [ln.split("│")[1].strip() for ln in lines if "pp8" in ln] == ["x", "x", "y", "y"]
    assert "cv % rounds" in r.stdout


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_back_to_back_order_and_one_engine_default(tiny, tmp_path):
    """--round-order back-to-back keeps the old order (each cell's rounds in a row); one engine: 1 round."""
    stamps = tmp_path / "stamps.txt"
    env = {"MOEBENCH_STAMP_FILE": str(stamps), "MOEBENCH_ENGINES": ENGINES}
    r = moebench("sweep", "-m", tiny, "-e", "x", "--n-cpu-moe", "0,2", "-w", "pp8", "-r", "2", "--rounds", "2",
                 "--round-order", "back-to-back", "--sample-ms", "0", "--results-dir", tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert [label for label, _ in processes(stamps)] == ["x:0", "x:0", "x:2", "x:2"]
    assert "back-to-back: each cell's rounds in a row" in r.stderr
    stamps.unlink()
    r = moebench("sweep", "-m", tiny, "-e", "x", "-w", "pp8", "-r", "2", "--sample-ms", "0",
                 "--results-dir", tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert len(processes(stamps)) == 1 and "note: --rounds" not in r.stderr and "cv % rounds" not in r.stdout


def test_resume_goes_on_with_the_next_round(tiny, tmp_path):
    """Round 1 of x finishes, then the hang cell hangs: Ctrl-C. --resume (FAULT unset) runs hang's rounds 1-2
    and only round 2 of x; x's first round is kept, not run again."""
    stamps = tmp_path / "stamps.txt"
    env = {"MOEBENCH_ENGINES": ENGINES, "PYTHONPATH": str(ROOT), "FAULT": "hang", "MOEBENCH_STAMP_FILE": str(stamps)}
    p = subprocess.Popen([sys.executable, "-m", "harness", "sweep", "-m", str(tiny), "-e", "x,hang", "-w", "pp8",
                          "-r", "2", "--sample-ms", "0", "--results-dir", str(tmp_path / "res")],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_default)
    deadline = time.time() + 60
    while time.time() < deadline and not list((tmp_path / "res").glob("*/rounds/*.json")):
        time.sleep(0.1)
    time.sleep(0.5)                                      # the hang cell's round 1 is running now
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and "finished cells and rounds are kept" in err, err
    run = next((tmp_path / "res").iterdir())
    assert not (run / "cells.csv").exists() and len(list((run / "rounds").glob("*.json"))) == 1
    assert len(processes(stamps)) == 1
    r = moebench("sweep", "--resume", run, env={"MOEBENCH_ENGINES": ENGINES, "MOEBENCH_STAMP_FILE": str(stamps)})
    assert r.returncode == 0, r.stderr
    assert len(processes(stamps)) == 2                   # x ran round 2 only
    cells, meas = pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv")
    assert sorted(cells["engine"]) == ["hang", "x"] and (cells["status"] == "ok").all()
    assert sorted(meas[meas["engine"] == "x"]["round"]) == [1, 2] and sorted(meas["rep"]) == [0, 0, 1, 1]
    assert not (run / "rounds").exists()


def test_external_engine_runs_in_rounds(tiny, tmp_path):
    """llama-bench (the stand-in script) times itself: each round is its own runs of the binary."""
    r = moebench("sweep", "-m", tiny, "-e", "llama-bench", "-w", "pp16,tg4", "-r", "4", "--rounds", "2",
                 "--sample-ms", "0", "--results-dir", tmp_path, env={"MOEBENCH_LLAMA_BENCH": str(STAND_IN)})
    assert r.returncode == 0, r.stderr
    meas = pd.read_csv(run_dir_of(r) / "measurements.csv")
    assert meas.groupby("workload")["round"].apply(list).to_dict() == {"pp16": [1, 1, 2, 2], "tg4": [1, 1, 2, 2]}
    assert meas.groupby("workload")["rep"].apply(list).to_dict() == {"pp16": [0, 1, 2, 3], "tg4": [0, 1, 2, 3]}


def _cell(engine: str, depth: int):
    return SimpleNamespace(engine=engine, model=Path("m.gguf"), node="", settings=SimpleNamespace(n_cpu_moe=depth))


def test_round_plan_groups_rotates_and_shuffles_with_its_seed():
    cells = [_cell(e, d) for e in ("a", "b") for d in range(6)]
    plan = round_plan(cells, 3, seed=7)
    assert plan == round_plan(cells, 3, seed=7) and plan != round_plan(cells, 3, seed=8)
    for cells_r in plan:
        assert sorted(id(c) for c in cells_r) == sorted(id(c) for c in cells)       # every cell once per round
        pairs = [cells_r[i:i + 2] for i in range(0, 12, 2)]
        assert all(p[0].settings.n_cpu_moe == p[1].settings.n_cpu_moe for p in pairs)
    firsts = [[p.engine for p in cells_r[::2]] for cells_r in plan]
    assert all(f.count("a") == 3 for f in firsts)        # within a round each engine starts half the pairs
    depth0 = [next(c.engine for c in cells_r if c.settings.n_cpu_moe == 0) for cells_r in plan]
    assert depth0 == ["a", "b", "a"]                     # and a pair's first engine alternates by round
    assert [[c.settings.n_cpu_moe for c in p[::2]] for p in plan] != [list(range(6))] * 3


def _meas(values: dict[int, list[float]], cell: str = "c", workload: str = "pp8") -> pd.DataFrame:
    return pd.DataFrame([{"cell_id": cell, "workload": workload, "round": k, "tokens_per_s": v}
                         for k, vs in values.items() for v in vs])


def test_spread_splits_between_rounds_and_within_a_process():
    drift = results.round_split(_meas({1: [99, 101], 2: [109, 111], 3: [89, 91]}))
    assert drift["rounds"] == 3 and abs(drift["tps_cv_rounds"] - 0.1) < 1e-9
    assert abs(drift["tps_cv_within"] / (2 ** 0.5 / 100) - 1) < 0.02    # the SD of logs: about the CV
    steady = results.round_split(_meas({1: [90, 110], 2: [91, 109], 3: [90, 110]}))
    assert steady["tps_cv_rounds"] < 0.01 < steady["tps_cv_within"]
    one = results.round_split(_meas({1: [1, 2, 3]}))
    assert one["rounds"] == 1 and pd.isna(one["tps_cv_rounds"])
    old = results.round_split(pd.DataFrame({"tokens_per_s": [1.0, 2.0]}))          # written before rounds
    assert all(pd.isna(v) for v in old.values())
    m = pd.concat([_meas({1: [100], 2: [90], 3: [110]}), _meas({1: [10], 2: [9], 3: [11]}, cell="d")])
    assert results.round_speed(m) == {1: 1.0, 2: 0.9, 3: 1.1}
    assert results.round_speed(pd.DataFrame({"cell_id": ["c"], "tokens_per_s": [1.0]})) == {}


def test_runs_without_a_round_column_still_read_and_resume(tiny, tmp_path):
    """A run written before rounds: no `round` column. The summary, the report and an appended row (--resume
    keeps the file's header) all work."""
    r = moebench("sweep", "-m", tiny, "-e", "x", "-w", "pp8", "-r", "2", "--sample-ms", "0", "--results-dir", tmp_path,
                 env={"MOEBENCH_STAMP_FILE": str(tmp_path / "s"), "MOEBENCH_ENGINES": ENGINES})
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    meas = pd.read_csv(run / "measurements.csv").drop(columns="round")
    meas.to_csv(run / "measurements.csv", index=False)
    results.append_rows(run, "measurements.csv", [meas.iloc[0].to_dict() | {"rep": 2, "round": 1}])
    header = (run / "measurements.csv").read_text().splitlines()[0]
    assert "round" not in header and len(pd.read_csv(run / "measurements.csv")) == 3
    _, cells, m, _ = results.load_frames(run)
    s = results.summarize(cells, m)
    assert s["tps_n"].tolist() == [3] and pd.isna(s["rounds"][0])
    r = moebench("report", run, "-o", tmp_path / "rep", "--format", "md")
    assert r.returncode == 0, r.stderr
    assert "Rounds:" not in (tmp_path / "rep" / "report.md").read_text()
