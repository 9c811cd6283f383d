"""Crash, timeout, out-of-memory, resume and Ctrl-C paths, through the real CLI and real worker processes."""
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from tests.conftest import FAULTS, ROOT, moebench, run_dir_of, sigint_default



def test_failures_become_rows_and_the_sweep_goes_on(tiny, tmp_path):
    r = moebench("sweep", "-m", tiny, "-e", "crash,hang,hog,llama-cpp", "-w", "pp16", "-r", "1", "--threads", "2",
                 "--timeout", "60", "--results-dir", tmp_path, "--strict", env={"FAULT": "crash"})
    assert r.returncode == 1, r.stderr          # --strict: failed cells -> exit 1
    cells = pd.read_csv(f"{run_dir_of(r)}/cells.csv").set_index("engine")
    assert cells.loc["crash", "status"] == "failed" and "SIGSEGV" in cells.loc["crash", "error"]
    assert cells.loc["hang", "status"] == "ok"                 # FAULT=crash only: hang behaves
    assert cells.loc["hog", "status"] == "oom" and "MemoryError" in cells.loc["hog", "error"]
    assert cells.loc["llama-cpp", "status"] == "ok"
    meas = pd.read_csv(f"{run_dir_of(r)}/measurements.csv")
    assert set(meas["engine"]) == {"hang", "llama-cpp"}


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_timeout_then_resume_runs_only_unfinished_cells(tiny, tmp_path):
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp,hang", "--n-cpu-moe", "0,2", "-w", "pp16", "-r", "1",
                 "--threads", "2", "--timeout", "8", "--results-dir", tmp_path, env={"FAULT": "hang"})
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    cells = pd.read_csv(f"{run}/cells.csv")
    assert sorted(zip(cells["engine"], cells["status"])) == [("hang", "timeout")] * 2 + [("llama-cpp", "ok")] * 2
    ok_before = cells[cells["status"] == "ok"][["cell_id", "load_s"]]
    r2 = moebench("sweep", "--resume", run)                     # FAULT unset: the hang engine now works
    assert r2.returncode == 0, r2.stderr
    cells2 = pd.read_csv(f"{run}/cells.csv")
    assert len(cells2) == 4 and (cells2["status"] == "ok").all() and cells2["cell_id"].is_unique
    kept = cells2.merge(ok_before, on="cell_id", suffixes=("", "_before"))
    assert len(kept) == 2 and (kept["load_s"] == kept["load_s_before"]).all()   # not run again
    meas = pd.read_csv(f"{run}/measurements.csv")
    assert len(meas) == 4 and meas.groupby("cell_id").size().eq(1).all()


def test_ctrl_c_keeps_finished_cells(tiny, tmp_path):
    env = {"MOEBENCH_ENGINES": FAULTS, "PYTHONPATH": str(ROOT), "FAULT": "hang"}
    p = subprocess.Popen([sys.executable, "-m", "harness", "sweep", "-m", str(tiny), "-e", "llama-cpp,hang",
                          "-w", "pp16", "-r", "1", "--threads", "2", "--results-dir", str(tmp_path)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_default)
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob("*/cells.csv")):
        time.sleep(0.1)
    time.sleep(0.5)                              # the hang cell is running now
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    run = next(d for d in tmp_path.iterdir() if d.is_dir())
    cells = pd.read_csv(run / "cells.csv")
    assert cells["engine"].tolist() == ["llama-cpp"] and cells["status"].tolist() == ["ok"]
    # the interrupted child is gone: no process still holds this run's cell log open
    import psutil
    holders = [q.pid for q in psutil.process_iter() if _holds(q, str(run))]
    assert holders == []


def _holds(proc, prefix: str) -> bool:
    import psutil
    try:
        return any(f.path.startswith(prefix) for f in proc.open_files())
    except psutil.Error:
        return False


def test_rounds_run_a_cell_in_fresh_processes(tiny, tmp_path):
    """--rounds 2 -r 5: the cell's prefills (per round 1 warm-up + 3, then + 2 reps) come from two worker
    processes one after the other; it is still one cell with repetitions 0-4 and the wall time of both."""
    stamps = tmp_path / "stamps.txt"
    r = moebench("sweep", "-m", tiny, "-e", "stamp", "-w", "pp8", "-r", "5",
                 "--rounds", "2", "--sample-ms", "20", "--results-dir", tmp_path, "--format", "csv",
                 env={"MOEBENCH_STAMP_FILE": str(stamps)})
    assert r.returncode == 0, r.stderr
    pids = [line.split()[3] for line in stamps.read_text().splitlines()]
    assert len(pids) == 7 and len(set(pids[:4])) == 1 and len(set(pids[4:])) == 1 and pids[0] != pids[4]
    run = run_dir_of(r)
    cells, meas = pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv")
    assert len(cells) == 1 and cells["status"][0] == "ok" and sorted(meas["rep"]) == [0, 1, 2, 3, 4]
    samples = pd.read_csv(run / "samples.csv")
    assert samples["t_ms"].is_monotonic_increasing
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp8", "--rounds", "2", "--ray", "auto",
                 "--results-dir", tmp_path)
    assert r.returncode == 2 and "--rounds does not apply to --ray" in r.stderr


def _idle_rss_mib(code: str) -> float:
    """VmRSS (MiB) of a fresh Python process that ran `code` and now waits on stdin."""
    from harness.run.sampler import proc_kib

    p = subprocess.Popen([sys.executable, "-c", f"{code}\nimport sys; print(flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    try:
        p.stdout.readline()                        # `code` has run
        return proc_kib(p.pid, "status", ("VmRSS",))["VmRSS"] / 1024
    finally:
        p.communicate(b"")


def test_rss_floor_holds_the_engine_runtime(tiny, tmp_path):
    """A reference cell's floor (the worker's RSS before load, Engine.runtime imported) holds torch: it is at least
    most of what importing torch adds to a bare Python; the model and its buffers come on top of it."""
    r = moebench("sweep", "-m", tiny, "-e", "reference", "-w", "pp16", "-r", "1", "--threads", "2",
                 "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    c = pd.read_csv(run_dir_of(r) / "cells.csv").iloc[0]
    floor, peak = c["rss_floor_mib"], c["peak_rss_mib"]
    assert c["status"] == "ok" and 0 < floor < peak
    assert abs(c["peak_rss_above_floor_mib"] - (peak - floor)) < 1e-3
    bare, with_torch = _idle_rss_mib("pass"), _idle_rss_mib("import torch")
    assert floor > bare + 0.9 * (with_torch - bare), (floor, bare, with_torch)


TORCH_CODE = """
import sys
from pathlib import Path
from engines.base import EngineSettings
from engines.reference.engine import ReferenceEngine

def torch_code_kib():             # resident pages of libtorch_cpu.so: the ATen ops' code paged in so far
    kib, name = 0, ""
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and " " in line:
            name = line.split()[-1]
        elif line.startswith("Rss:") and name.endswith("libtorch_cpu.so"):
            kib += int(line.split()[1])
    return kib

if sys.argv[2] == "untouched":    # the same process without the ops' warm-up: what touch_ops saves
    import engines.reference.models.transformer as transformer
    transformer.touch_ops = lambda: None
ReferenceEngine.runtime()
floor = torch_code_kib()
e = ReferenceEngine()
e.load(Path(sys.argv[1]), EngineSettings(n_ctx=64, threads=2))
e.prefill(list(range(1, 33)))
e.decode(7)
print((torch_code_kib() - floor) / 1024)
"""


def test_rss_floor_holds_the_torch_ops_a_forward_runs(tiny):
    """The reference engine's runtime pages in the code of the ATen ops a forward runs (transformer.touch_ops):
    a model's load, prefill and decode then add less than half of the libtorch_cpu.so code above the floor that
    they add without it (~8-10 MiB on a CPU prefill, the same for every model; how much depends on the CPU's
    kernels, hence the ratio)."""
    def growth(mode: str) -> float:
        r = subprocess.run([sys.executable, "-c", TORCH_CODE, str(tiny), mode], cwd=ROOT, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        return float(r.stdout)

    touched, untouched = growth("touched"), growth("untouched")
    assert untouched > 4.0 and touched < 0.5 * untouched, (touched, untouched)


def test_rounds_keep_the_largest_rss_above_floor_with_its_floor():
    """Each round is a process with its own floor: the joined cell keeps the round that grew most above its own
    floor, and that round's floor, not the largest floor or the round with the largest peak; the same for the
    anonymous RSS on its own (another round may hold it); each peak is the largest of its own."""
    from harness.run.runner import join_rounds

    def part(floor: float, peak: float, anon_floor: float, anon: float) -> tuple:
        return ({"status": "ok", "error": "", "wall_s": 1.0, "peak_rss_mib": peak, "peak_vram_mib": float("nan"),
                 "peak_rss_anon_mib": anon, "peak_rss_file_mib": peak - anon,
                 "rss_floor_mib": floor, "peak_rss_above_floor_mib": peak - floor,
                 "rss_anon_floor_mib": anon_floor, "peak_rss_anon_above_floor_mib": anon - anon_floor}, [], [])

    row, _, _ = join_rounds([part(300.0, 1000.0, 50.0, 600.0), part(100.0, 900.0, 90.0, 700.0),
                             part(float("nan"), 950.0, 10.0, 650.0)])
    assert row["peak_rss_mib"] == 1000.0
    assert (row["peak_rss_anon_mib"], row["peak_rss_file_mib"]) == (700.0, 400.0)      # each its own largest
    assert (row["rss_floor_mib"], row["peak_rss_above_floor_mib"]) == (100.0, 800.0)
    assert (row["rss_anon_floor_mib"], row["peak_rss_anon_above_floor_mib"]) == (10.0, 640.0)


def test_memory_columns_are_the_peaks_of_each_series(tiny, tmp_path):
    """cells.csv's peak RSS, anonymous and file-backed RSS are each the largest of their own series in samples.csv
    (over the cell; measurements.csv: over that workload's timed phase), through both engines' real workers. The
    anonymous floor is the worker's before load, a part of its RSS floor."""
    r = moebench("sweep", "-m", tiny, "-e", "reference,llama-cpp", "-w", "pp16,tg4", "-r", "3", "--rounds", "1",
                 "--threads", "2", "--sample-ms", "5", "--results-dir", tmp_path, "--format", "md")
    assert r.returncode == 0, r.stderr
    assert "| RAM MiB (anon) | anon above floor MiB | file-backed MiB |" in r.stdout, r.stdout    # the summary
    run = run_dir_of(r)
    cells, meas, samples = (pd.read_csv(run / f) for f in ("cells.csv", "measurements.csv", "samples.csv"))
    assert len(cells) == 2 and (cells["status"] == "ok").all()
    sampled = 0
    for c in cells.to_dict("records"):
        s = samples[samples["cell_id"] == c["cell_id"]]
        for col in ("rss_mib", "rss_anon_mib", "rss_file_mib"):
            assert c[f"peak_{col}"] == pytest.approx(s[col].max(), abs=1e-3), (c["engine"], col)
        assert 0 < c["peak_rss_anon_mib"] < c["peak_rss_mib"] <= c["peak_rss_anon_mib"] + c["peak_rss_file_mib"] + 1
        assert 0 < c["rss_anon_floor_mib"] < c["rss_floor_mib"] and c["rss_anon_floor_mib"] < c["peak_rss_anon_mib"]
        assert c["peak_rss_anon_above_floor_mib"] == pytest.approx(c["peak_rss_anon_mib"] - c["rss_anon_floor_mib"],
                                                                   abs=1e-3)
        for m in meas[meas["cell_id"] == c["cell_id"]].to_dict("records"):
            phase = s[s["phase"] == m["workload"]]          # none in a phase shorter than a sample: NaN
            for col in ("rss_anon_mib", "rss_file_mib"):
                assert m[f"peak_{col}"] == pytest.approx(phase[col].max(), abs=1e-3, nan_ok=True), \
                    (c["engine"], m["workload"])
                assert phase.empty or m[f"peak_{col}"] <= c[f"peak_{col}"]
            sampled += not phase.empty
    assert sampled > 0
