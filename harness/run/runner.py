"""The parent side of a sweep: one child process per cell, memory sampling, incremental results.

A crash, timeout or out-of-memory of a cell becomes a row with its status and the sweep goes on.
Rows are appended as each cell finishes (a cell of several rounds: after its last round; its earlier rounds
wait in rounds/); --resume skips cells whose status is ok, continues unfinished cells with their next round
and runs failed ones again. Ctrl-C stops the running cell and keeps everything finished so far.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from engines.errors import UserError
from engines.registry import engine_class
from harness.hw import host
from harness.store import results
from engines.devices import Nvml
from harness.run.sampler import NAN, Peaks, Sampler, peaks
from harness.run.spec import Cell, SweepSpec
from workloads.grammar import parse_workloads

ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL = 2000


def new_run_dir(results_dir: Path, spec: SweepSpec) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    digest = hashlib.sha1(json.dumps(spec.to_dict(), sort_keys=True).encode() + os.urandom(4)).hexdigest()[:6]
    return results_dir / f"{stamp}-{digest}"


def prepare_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"Cannot write results to {str(run_dir)!r} ({e.strerror}); "
                        "pass a writable --results-dir.") from None


def log_path(run_dir: Path, cell_id: str) -> Path:
    return run_dir / "logs" / (cell_id.replace("/", "_") + ".log")


def trace_path(run_dir: Path, cell_id: str) -> Path:
    """Where a cell's routing trace goes (--trace-routing): <run_dir>/traces/<cell file stem>.npz."""
    return run_dir / "traces" / (cell_id.replace("/", "_") + ".npz")


def _job(cell: Cell, spec: SweepSpec, gate: dict | None, run_dir: Path) -> dict:
    settings = cell.settings.to_dict()
    if spec.trace_routing and engine_class(cell.engine).routing_traces:
        settings["extra"] = settings["extra"] | {"trace_routing": str(trace_path(run_dir, cell.cell_id).absolute())}
    return {"gate": gate, "engine": cell.engine, "model": str(cell.model), "settings": settings,
            "workloads": spec.workloads, "repetitions": spec.repetitions, "warmup": spec.warmup,
            "seed": spec.seed, "n_vocab": cell.meta.n_vocab}


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-LOG_TAIL:].decode(errors="replace").strip()
    except OSError:
        return ""


def cell_row(cell: Cell, run_id: str, status: str, error: str, loaded: dict | None = None, wall_s: float = NAN,
             peak: Peaks = Peaks(), floor: dict | None = None) -> dict:
    """The cells.csv row of a cell; `loaded` is the worker's "loaded" record (empty when it never loaded); `floor`
    the worker's "floor" record: its RSS and anonymous RSS before load() with the engine's runtime imported (NaN
    when it died first)."""
    loaded, floor = loaded or {}, floor or {}
    info = loaded.get("info", {})
    s, meta = cell.settings, cell.meta
    rss_floor, anon_floor = floor.get("rss_mib", NAN), floor.get("rss_anon_mib", NAN)
    return {
        "run_id": run_id, "cell_id": cell.cell_id, "engine": cell.engine, "engine_version": loaded.get("version", ""),
        "model": str(cell.model), "model_name": meta.name, "model_fingerprint": meta.fingerprint, "arch": meta.arch,
        "n_layers": meta.n_layers, "n_moe_layers": len(meta.moe_layers), "depth": cell.depth, "n_cpu_moe": s.n_cpu_moe,
        "expert_host_fraction": info.get("expert_host_fraction", meta.expert_bytes(s.n_cpu_moe) / meta.expert_bytes()),
        "expert_bytes_host": info.get("expert_bytes_host", meta.expert_bytes(s.n_cpu_moe)),
        "expert_bytes_total": info.get("expert_bytes_total", meta.expert_bytes()),
        "n_overridden_tensors": info.get("n_overridden_tensors"),
        "cpu_moe_layers": results.layer_text(info.get("cpu_moe_layers")), "n_ctx": s.n_ctx, "n_batch": s.n_batch,
        "n_ubatch": s.n_ubatch, "threads": s.threads, "flash_attn": s.flash_attn, "device": s.device,
        "dtype": s.dtype, "mmap": s.mmap, "extra": s.extra, "effective_settings": info.get("settings", {}),
        "bytes_by_device": info.get("bytes_by_device", {}), "status": status, "error": error,
        "load_s": loaded.get("load_s", NAN), "wall_s": wall_s, **peak.columns(),
        "rss_floor_mib": rss_floor, "peak_rss_above_floor_mib": peak.rss_mib - rss_floor,
        "rss_anon_floor_mib": anon_floor, "peak_rss_anon_above_floor_mib": peak.rss_anon_mib - anon_floor,
        "host": os.uname().nodename, "arm": cell.arm,
    }


def run_cell(cell: Cell, spec: SweepSpec, run_dir: Path, run_id: str,
             gate: dict | None = None) -> tuple[dict, list[dict], list[dict]]:
    """Run one cell in its own process; returns (cell row, measurement rows, sample rows). `gate`:
    --interleave's turn-taking pipes (harness.run.worker.Turns)."""
    engine_class(cell.engine).prepare()
    log = log_path(run_dir, cell.cell_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}   # no inherited TS_* settings
    env |= {"TS_N_CPU_MOE": str(cell.settings.n_cpu_moe),
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    nvml = Nvml() if spec.sample_ms > 0 else None          # device baseline before the child exists
    r, w = os.pipe()
    env["MOEBENCH_FD"] = str(w)
    started = time.perf_counter()
    with open(log, "ab") as logf:          # a cell run again (--resume, interleave rounds) keeps the earlier log
        proc = subprocess.Popen([sys.executable, "-m", "harness.run.worker"], stdin=subprocess.PIPE, stdout=logf,
                                stderr=subprocess.STDOUT, pass_fds=(w,), env=env, cwd=ROOT, start_new_session=True)
    os.close(w)
    sampler = Sampler(proc.pid, spec.sample_ms, nvml=nvml) if nvml else None
    if sampler:
        sampler.start()
    msgs: list[dict] = []

    def read() -> None:   # blocks on the pipe; EOF when the child exits or dies
        with os.fdopen(r) as f:
            for line in f:
                msg = json.loads(line)
                if msg["type"] == "phase" and sampler:
                    sampler.phase = msg["phase"]
                msgs.append(msg)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.stdin.write(json.dumps(_job(cell, spec, gate, run_dir)).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        reader.join(spec.timeout_s)          # a lock wait, not a spin
        if reader.is_alive():
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            reader.join()
        proc.wait()
    except BaseException:                    # Ctrl-C: stop the child, keep what is written
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if sampler:
            sampler.stop()
        raise
    samples = sampler.stop() if sampler else []
    wall_s = time.perf_counter() - started

    kinds = {m["type"]: m for m in msgs}
    loaded = kinds.get("loaded", {})
    if "info" in kinds:        # what the engine reported after its last workload (counters) beats the one at load
        loaded = loaded | {"info": kinds["info"]["info"]}
    if "done" in kinds:
        status, error = "ok", ""
    elif timed_out:
        status, error = "timeout", f"no result within --timeout {spec.timeout_s:g} s"
    elif "error" in kinds:
        status, error = kinds["error"]["status"], kinds["error"]["error"]
    elif proc.returncode == -signal.SIGKILL:
        status, error = "oom", "killed by SIGKILL (most likely the kernel's out-of-memory killer)"
    elif proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        cause = engine_class(cell.engine).crash_cause(sig, cell.settings, loaded.get("info", {}))
        status, error = "failed", f"crashed with {sig}" + (f": {cause}" if cause else "")
    else:
        status, error = "failed", f"worker exited with code {proc.returncode} without a result"
    if status != "ok":
        error = f"{error} | log tail: {_tail(log)[-600:]}" if _tail(log) else error

    row = cell_row(cell, run_id, status, error, loaded, wall_s, peaks(samples), kinds.get("floor"))
    s, meta = cell.settings, cell.meta
    workloads = {w.name: w for w in parse_workloads(",".join(spec.workloads))}
    phase_peaks = {name: peaks(samples, name) for name in workloads}    # per workload's timed phase
    rows = []
    for m in (m for m in msgs if m["type"] == "rep"):
        wl = m["workload"]
        w = workloads[wl]
        rows.append({"run_id": run_id, "cell_id": cell.cell_id, "engine": cell.engine, "model_name": meta.name,
                     "model_fingerprint": meta.fingerprint, "n_cpu_moe": s.n_cpu_moe, "workload": wl,
                     "n_prompt": w.n_prompt, "n_gen": w.n_gen, "n_depth": w.n_depth, "rep": m["rep"], "ns": m["ns"],
                     "tokens_per_s": w.n_tokens / (m["ns"] / 1e9), "engine_ms": m.get("engine_ms"),
                     "n_ctx": s.n_ctx, "n_batch": s.n_batch, "n_ubatch": s.n_ubatch, "threads": s.threads,
                     "flash_attn": s.flash_attn, **phase_peaks[wl].columns(), "stream": m.get("stream", "")})
    sample_rows = [{"run_id": run_id, "cell_id": cell.cell_id, **x} for x in samples]
    return row, rows, sample_rows


def round_sizes(repetitions: int, rounds: int) -> list[int]:
    """Repetitions per round: min(rounds, repetitions) nearly equal parts, larger first."""
    k = min(repetitions, rounds)
    return [repetitions // k + (i < repetitions % k) for i in range(k)]


def join_rounds(parts: list[tuple]) -> tuple[dict, list[dict], list[dict]]:
    """A cell's rounds (run_cell results in round order, one fresh process each) -> one cell: each measurement
    keeps its `round` (1, 2, ...), reps numbered on across rounds, samples shifted onto one time axis, the first
    failure's status, the summed wall time, the largest of each peak; the largest RSS (and anonymous RSS) above
    the floor with that round's floor (rounds are separate processes, each with its own floor)."""
    rows, meas, samples = [p[0] for p in parts], [], []
    done, t0 = {}, 0.0
    for k, (_, ms, ss) in enumerate(parts):
        before = dict(done)                   # repetitions per workload in the earlier rounds
        for m in ms:
            meas.append(m | {"rep": before.get(m["workload"], 0) + m["rep"], "round": k + 1})
            done[m["workload"]] = done.get(m["workload"], 0) + 1
        samples += [x | {"t_ms": x["t_ms"] + t0} for x in ss]
        t0 = samples[-1]["t_ms"] if samples else t0
    row = dict(rows[-1])
    bad = next((r for r in rows if r["status"] != "ok"), None)
    if bad:
        row["status"], row["error"] = bad["status"], bad["error"]
    row["wall_s"] = sum(r["wall_s"] for r in rows)
    for col in Peaks().columns():
        row[col] = max((r[col] for r in rows if r.get(col, NAN) == r.get(col, NAN)), default=NAN)
    for floor, above in (("rss_floor_mib", "peak_rss_above_floor_mib"),
                         ("rss_anon_floor_mib", "peak_rss_anon_above_floor_mib")):
        if known := [r for r in rows if r.get(above, NAN) == r.get(above, NAN)]:
            top = max(known, key=lambda r: r[above])
            row[floor], row[above] = top[floor], top[above]
    return row, meas, samples


# A round of a cell that is not finished yet (it has more rounds to run) waits here, one JSON file per cell and
# round, so --resume continues with the next round; the cell's rows go to the CSV files once its last round ends.
ROUNDS_DIR = "rounds"


def _round_path(run_dir: Path, cell_id: str, k: int) -> Path:
    return run_dir / ROUNDS_DIR / f"{cell_id.replace('/', '_')}.{k + 1}.json"


def save_round(run_dir: Path, cell_id: str, k: int, part: tuple) -> None:
    """Keep round k (0-based) of an unfinished cell: (cell row, measurements, samples) as run_cell returned them."""
    path = _round_path(run_dir, cell_id, k)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cell_id": cell_id, "round": k + 1, "part": part}, default=str))
    tmp.replace(path)                         # whole or not at all: Ctrl-C mid-write leaves no half round


def load_rounds(run_dir: Path, cell_id: str) -> list[tuple]:
    """The kept rounds of an unfinished cell, 1, 2, ... up to the first one missing."""
    parts = []
    while (path := _round_path(run_dir, cell_id, len(parts))).exists():
        parts.append(tuple(json.loads(path.read_text())["part"]))
    return parts


def drop_rounds(run_dir: Path, cell_id: str) -> None:
    for path in (run_dir / ROUNDS_DIR).glob(f"{cell_id.replace('/', '_')}.*.json"):
        path.unlink()


def _hardware_profile() -> dict | None:
    """The stored `moebench probe` profile (a ~1 s quick one is measured and stored if none exists)."""
    from harness.hw.probe import stored_or_quick
    try:
        return stored_or_quick()
    except Exception as e:          # the roofline is optional; a sweep never fails for it
        return {"error": f"{type(e).__name__}: {e}"}


def engine_notes(engines: list[str], trace_routing: bool = False) -> list[str]:
    """What the sweep's engines will do differently on this host than asked (Engine.notes, and --trace-routing
    where an engine cannot record routing), each said once here on stderr and kept in run.json["notes"] for the
    summary and the report."""
    names = list(dict.fromkeys(e.split("@")[0] for e in engines))
    notes = [n for e in names for n in engine_class(e).notes()]
    if trace_routing and (no := [e for e in names if not engine_class(e).routing_traces]):
        notes.append(f"{', '.join(no)} cannot record routing traces (--trace-routing); only the reference engine's "
                     f"cells have one, in traces/.")
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    return notes


def write_run_json(run_dir: Path, spec: SweepSpec, **more) -> None:
    """run.json: the spec, host fingerprint, argv and hardware profile (plus `more`), before any cell runs."""
    run = {"schema_version": results.SCHEMA_VERSION, "run_id": run_dir.name, "spec": spec.to_dict(),
           "started": datetime.now(timezone.utc).isoformat(), "host": host.fingerprint(),
           "argv": sys.argv, "hardware_profile": _hardware_profile(),
           "notes": engine_notes(spec.engines, spec.trace_routing)} | more
    (run_dir / "run.json").write_text(json.dumps(run, indent=2, default=str))


def save_run_json(run_dir: Path, run: dict) -> None:
    """Replace run.json whole (rewritten while a sweep runs: one killed mid-write must still --resume)."""
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(run, indent=2, default=str))
    os.replace(tmp, run_dir / "run.json")


def probe_steadiness(run_dir: Path, when: str) -> None:
    """Time the fixed memory-bandwidth probe (harness.hw.probe.steadiness) now and add it to
    run.json["steadiness"] as `when` ("round 1", ..., "end"): the machine's drift, measured without the engines."""
    from harness.hw.probe import steadiness

    run = json.loads((run_dir / "run.json").read_text())
    run.setdefault("steadiness", []).append({"when": when} | steadiness())
    save_run_json(run_dir, run)


def drop_unfinished(run_dir: Path) -> set[str]:
    """For --resume: keep rows of ok cells only; return their cell ids (those are skipped). A cell with a row
    (ok, or failed and to be run again from round 1) has no kept rounds any more."""
    cells = results.read_csv(run_dir, "cells.csv")
    for c in cells:
        drop_rounds(run_dir, c["cell_id"])
    done = {c["cell_id"] for c in cells if c["status"] == "ok"}
    results.write_cells(run_dir, [c for c in cells if c["cell_id"] in done])
    for file in ("measurements.csv", "samples.csv"):
        rows = [r for r in results.read_csv(run_dir, file) if r["cell_id"] in done]
        (run_dir / file).unlink(missing_ok=True)
        if rows:
            results.append_rows(run_dir, file, rows)
    return done
