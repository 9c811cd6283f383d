"""Run history: every sweep indexed into <results-dir>/history.sqlite, `moebench history` table and plot."""
from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
from click.testing import CliRunner

from harness.store import history, results
from harness.cli import cli
from tests.conftest import moebench
from tests.test_compare import make_run, noisy


def test_a_real_sweep_is_indexed(tiny, tmp_path):
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16,tg4", "-r", "3",
                 "--threads", "1", "--sample-ms", "0", "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir = tmp_path / r.stderr.split("results: ")[-1].strip().split("/")[-1]
    con = sqlite3.connect(tmp_path / "history.sqlite")
    assert con.execute("SELECT run_id, path FROM runs").fetchall() == [(run_dir.name, str(run_dir.resolve()))]
    rows = con.execute("SELECT n_cpu_moe, workload, n, tps_median, threads FROM cells ORDER BY n_cpu_moe, workload")
    rows = rows.fetchall()
    _, _, meas, _ = results.load_frames(run_dir)
    assert [(a, b) for a, b, *_ in rows] == [("0", "pp16"), ("0", "tg4"), ("4", "pp16"), ("4", "tg4")]
    for ncm, wl, n, med, threads in rows:
        m = meas[(meas["n_cpu_moe"] == int(ncm)) & (meas["workload"] == wl)]["tokens_per_s"]
        assert n == 3 and threads == "1" and med == pytest.approx(float(np.median(m)), rel=1e-6)


def test_reindex_is_idempotent_and_bad_runs_only_warn(tmp_path, capsys):
    run = make_run(tmp_path, "r1", [{"engine": "e", "n_cpu_moe": 0, "values": {"pp64": noisy(100)}}])
    assert history.index_run(run) and history.index_run(run)
    con = sqlite3.connect(tmp_path / "history.sqlite")
    assert con.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)
    assert con.execute("SELECT COUNT(*) FROM cells").fetchone() == (1,)
    (tmp_path / "broken").mkdir()
    assert history.index_run(tmp_path / "broken") is False          # a sweep's last step must never crash
    assert "could not index" in capsys.readouterr().err


def _trend(tmp_path):
    res = tmp_path / "results"
    for i, (pp, tg) in enumerate([(100, 50), (110, 52), (90, 48)]):
        make_run(res, f"run{i}", [{"engine": "llama-cpp", "n_cpu_moe": 0, "values": {"pp64": noisy(pp, seed=i),
                                                                                     "tg16": noisy(tg, seed=i)}},
                                  {"engine": "reference", "n_cpu_moe": 4, "values": {"pp64": noisy(10, seed=i)}}],
                 started=f"2026-03-0{i + 1}T00:00:00+00:00", index=True)
    return res


def test_history_trend_table_and_plot(tmp_path):
    res = _trend(tmp_path)
    png = tmp_path / "out" / "trend.png"
    r = CliRunner().invoke(cli, ["history", "--results-dir", str(res), "-e", "llama-cpp", "-w", "pp64",
                                 "--format", "json", "-o", str(png)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [x["run"] for x in rows] == ["run0", "run1", "run2"]                      # oldest first
    assert [x["tok/s median"] for x in rows] == pytest.approx([np.median(noisy(c, seed=i))
                                                               for i, c in enumerate((100, 110, 90))])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    r = CliRunner().invoke(cli, ["history", "--results-dir", str(res), "--depth", "4", "--last", "2",
                                 "--format", "json", "-o", str(png)])
    assert [(x["run"], x["engine"]) for x in json.loads(r.stdout)] == [("run1", "reference"), ("run2", "reference")]


def test_history_filters_are_parameters_not_sql(tmp_path):
    res = _trend(tmp_path)
    r = moebench("history", "--results-dir", res, "-e", "x' OR '1'='1", "-o", tmp_path / "p.png")
    assert r.returncode == 2 and "No indexed run" in r.stderr
    r = moebench("history", "--results-dir", res, "-e", "llama-cpp'); DROP TABLE cells; --", "-o", tmp_path / "p.png")
    assert r.returncode == 2
    con = sqlite3.connect(res / "history.sqlite")
    assert con.execute("SELECT COUNT(*) FROM cells").fetchone() == (9,)
    r = moebench("history", "--results-dir", tmp_path / "nothing")
    assert r.returncode == 2 and "No run history" in r.stderr
