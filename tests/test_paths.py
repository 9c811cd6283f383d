"""Every path a user gives works relative to the directory the user is in, not the project root (where the
cell workers run): the README's "Everyday commands", run from a directory of the user's."""
import csv
import json
import shutil
import subprocess
from pathlib import Path

from tests.conftest import moebench, run_dir_of


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.args, r.stdout[-2000:], r.stderr[-3000:])
    return r


def test_relative_paths_work_from_the_users_directory(tmp_path):
    home = tmp_path
    ok(moebench("model", "synth", "--preset", "tiny", "-o", "tiny.gguf", cwd=home))
    assert (home / "tiny.gguf").is_file()
    assert "moebench-synth-tiny" in ok(moebench("model", "info", "tiny.gguf", cwd=home)).stdout
    r = ok(moebench("sweep", "-m", "tiny.gguf", "-e", "llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16,tg4",
                       "-r", "1", "--threads", "2", "--sample-ms", "0", "--results-dir", "res", "--format", "json",
                       "-o", "out.json", cwd=home))
    run = run_dir_of(r)                         # as the user would type it: res/<run_id>
    assert run.parent == Path("res") and (home / run / "cells.csv").is_file()
    recs = json.loads((home / "out.json").read_text())
    assert sorted((x["n_cpu_moe"], x["n_prompt"], x["n_gen"]) for x in recs) == [(0, 0, 4), (0, 16, 0), (4, 0, 4),
                                                                                (4, 16, 0)]
    spec = json.loads((home / run / "run.json").read_text())["spec"]
    assert spec["models"] == [str(home / "tiny.gguf")]     # absolute: --resume works from anywhere

    ok(moebench("report", run, "-o", "rep", cwd=home))
    assert (home / "rep" / "report.html").is_file()
    ok(moebench("compare", run, run, cwd=home))
    ok(moebench("plan", "-m", "tiny.gguf", "--results", run, "--format", "csv", "-o", "plan.csv", cwd=home))
    assert (home / "plan.csv").is_file()
    ok(moebench("history", "--results-dir", "res", "-o", "hist.png", cwd=home))
    assert (home / "hist.png").is_file()

    # an interrupted sweep (its last cell has no row yet), continued from another directory: that cell runs again
    cells_csv = home / run / "cells.csv"
    rows = list(csv.DictReader(cells_csv.open(newline="")))
    with cells_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows[:-1])
    elsewhere = home / "elsewhere"
    elsewhere.mkdir()
    ok(moebench("sweep", "--resume", Path("..") / run, "--format", "json", "-o", "again.json", cwd=elsewhere))
    statuses = [c["status"] for c in csv.DictReader(cells_csv.open(newline=""))]
    assert statuses == ["ok", "ok"] and len(json.loads((elsewhere / "again.json").read_text())) == 4


def test_reproduce_takes_relative_paths_and_fails_when_every_cell_failed(tiny, tmp_path):
    shutil.copy(tiny, tmp_path / "tiny.gguf")
    r = moebench("reproduce", "--published-model", "gpt-oss-20b", "--model-file", "tiny.gguf", "--clamp",
                    "-e", "crash,hog", "-w", "pp16", "-r", "1", "--threads", "2", "--results-dir", "res",
                    "--reports-dir", "reps", env={"FAULT": "crash"}, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (run,) = [d.name for d in (tmp_path / "res").iterdir() if d.is_dir()]
    assert f"error: every cell of this sweep failed (4 cells); see each cell's error in res/{run}/cells.csv" \
        in r.stderr.splitlines()
    assert (tmp_path / "reps" / run / "report.html").is_file()      # the report is written all the same
