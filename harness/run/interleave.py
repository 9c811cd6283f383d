"""`moebench sweep --interleave`: two configurations measured turn by turn (A B A B ...).

Each arm is an engine spec, `NAME[@KEY=VALUE]...` (e.g. `llama-cpp`, `llama-cpp@threads=1`,
`llama-cpp@n_ubatch=64@op_offload=0`); KEY is a sweep setting (threads, n_ctx, n_batch, n_ubatch,
flash_attn) or else an engine-specific knob that goes to EngineSettings.extra. Two builds of one
engine are two engine names (register the second with MOEBENCH_ENGINES=name=module:Class).

For every model x depth, both arms are loaded in their own worker processes (the normal runner
code: sampler, timeout, logs, status) and then take turns: each step (load, every warm-up and timed
repetition, close) waits for a token from the other arm and passes it on when done. So only one
process works at a time and any drift of the machine falls on both arms equally. The token is one
byte through a named pipe per arm; when an arm ends (or dies), the parent hands the other one enough
tokens to finish alone. The result is one normal run directory; cell ids carry the arm (`A/...`,
`B/...`) and run.json["interleave"] names the arms, so `moebench compare RUN:A RUN:B` splits it.
--timeout applies to each arm as usual, time spent waiting for its turn included.

Interleaving removes machine drift but not the difference between two processes: on a 2-core VM one
process ran the same work 3-4 % faster than another, which alone can look like a regression. So the
repetitions are split over `rounds` (default min(5, repetitions)): every round starts both arms in fresh
processes, and the arm that goes first alternates. Each arm still yields one cell (reps numbered
across rounds, samples on one time axis, the cell row's status the first failure, peaks the maximum).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
from pathlib import Path

from engines.base import Engine
from engines.errors import UserError
from engines.registry import engine_class
from harness.run.spec import Cell, EngineSpec, SweepSpec, expand, parse_engine_spec

ARMS = ("A", "B")
def arm_spec(spec: SweepSpec, es: EngineSpec) -> SweepSpec:
    return dataclasses.replace(spec, engines=[es.engine], extra=spec.extra | es.extra, **es.overrides)


def _steps(spec: SweepSpec) -> int:
    return 2 + len(spec.workloads) * (spec.warmup + spec.repetitions)     # load, each warm-up/rep, close


def _flood(fd: int, n: int) -> None:
    """Let an arm run alone to the end (its partner finished or died): one token per remaining step."""
    os.set_blocking(fd, False)
    try:
        os.write(fd, b"." * n)
    except BlockingIOError:     # pipe full: far more tokens queued than any arm has steps left
        pass


def run_pair(cells: dict[str, Cell], specs: dict[str, SweepSpec], run_dir: Path, first: str = "A") -> dict[str, tuple]:
    """Run arms A and B of one model x depth turn by turn, `first` starting; returns
    {arm: (cell row, measurements, samples)}."""
    from harness.run.runner import run_cell

    out: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="moebench-turns-") as tmp:
        fifo = {a: os.path.join(tmp, a) for a in ARMS}
        for path in fifo.values():
            os.mkfifo(path)
        # the parent keeps both pipes open, so a queued token survives until its arm reads it
        fds = {a: os.open(p, os.O_RDWR) for a, p in fifo.items()}
        os.write(fds[first], b".")
        other = {"A": "B", "B": "A"}

        def arm(a: str) -> None:
            try:
                out[a] = run_cell(cells[a], specs[a], run_dir, run_dir.name, gate={"wait": fifo[a],
                                                                                   "post": fifo[other[a]]})
            finally:
                _flood(fds[other[a]], _steps(specs[other[a]]))

        threads = [threading.Thread(target=arm, args=(a,), daemon=True) for a in ARMS]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.5)            # short joins keep Ctrl-C responsive
        except KeyboardInterrupt:
            _stop_workers()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
    for a in ARMS:
        if a not in out:
            raise RuntimeError(f"arm {a} ended without a result")
    return out


def _stop_workers() -> None:
    """Ctrl-C: kill the worker processes this sweep started (they run in their own sessions)."""
    import psutil
    import signal

    for child in psutil.Process().children():
        if "harness.run.worker" in " ".join(child.cmdline()):
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _differs(a: Cell, b: Cell) -> list[str]:
    """Key fields in which the two arms differ (compare matches A with B across these)."""
    sa, sb = a.settings, b.settings
    fields = [f for f in ("n_ctx", "n_batch", "n_ubatch", "threads", "flash_attn") if getattr(sa, f) != getattr(sb, f)]
    return (["engine"] if a.engine != b.engine else []) + fields + (["extra"] if sa.extra != sb.extra else [])


def run_interleaved(spec: SweepSpec, results_dir: Path, resume: Path | None = None) -> tuple[Path, int]:
    """The --interleave sweep: spec.engines holds exactly two engine specs. Returns (run dir, failed cells)."""
    from harness.store import results
    from harness.store.history import index_run
    from harness.run.runner import join_rounds, new_run_dir, prepare_run_dir, round_sizes, write_run_json
    from harness.hw.probe import read_bandwidth, with_host_best

    if resume:
        raise UserError("--resume cannot continue an interleaved sweep (both arms must run side by side); "
                        "run the sweep again.")
    if len(spec.engines) != 2:
        raise UserError(f"--interleave needs exactly two engine specs, got {len(spec.engines)}; "
                        "pass e.g. -e llama-cpp,llama-cpp@threads=1.")
    sizes = round_sizes(spec.repetitions, spec.rounds or 5)
    if spec.ray or spec.per_node or spec.ray_nodes:
        raise UserError("--interleave runs both arms on this machine, side by side; "
                        "drop --ray/--per-node/--ray-nodes.")
    es = dict(zip(ARMS, (parse_engine_spec(e) for e in spec.engines)))
    for e in es.values():
        if engine_class(e.engine).measure is not Engine.measure:
            raise UserError(f"Engine {e.engine!r} times all repetitions itself in one call, so it cannot take turns; "
                            "--interleave works with in-process engines (llama-cpp, reference).")
        engine_class(e.engine).prepare()     # here, once: run_cell's call would run in both arms' threads at once
    specs = {a: arm_spec(spec, es[a]) for a in ARMS}
    cells = {a: expand(specs[a]) for a in ARMS}       # validates both arms before anything runs
    run_dir = new_run_dir(results_dir, spec)
    prepare_run_dir(run_dir)
    differs = _differs(cells["A"][0], cells["B"][0])
    write_run_json(run_dir, spec, interleave={"A": es["A"].text, "B": es["B"].text, "differs": differs,
                                              "rounds": sizes},
                   # the decode bounds' bandwidth
                   bandwidth=with_host_best(read_bandwidth({c.settings.threads for a in ARMS for c in cells[a]})))
    failed = 0
    pairs = list(zip(cells["A"], cells["B"]))
    for i, (ca, cb) in enumerate(pairs):
        arm_cells = {a: dataclasses.replace(c, arm=a) for a, c in (("A", ca), ("B", cb))}
        parts: dict[str, list] = {a: [] for a in ARMS}
        for k, reps in enumerate(sizes):
            out = run_pair(arm_cells, {a: dataclasses.replace(specs[a], repetitions=reps) for a in ARMS}, run_dir,
                           first=ARMS[k % 2])
            for a in ARMS:
                parts[a].append(out[a])
            if any(out[a][0]["status"] != "ok" for a in ARMS):
                break
        out = {a: join_rounds(parts[a]) for a in ARMS}
        for a in ARMS:
            results.append_cell(run_dir, *out[a])
        status = {a: out[a][0]["status"] for a in ARMS}
        failed += sum(s != "ok" for s in status.values())
        print(f"[{i + 1}/{len(pairs)}] n_cpu_moe={ca.settings.n_cpu_moe} A {es['A'].text}: {status['A']}, "
              f"B {es['B'].text}: {status['B']}", file=sys.stderr)
    index_run(run_dir)
    print(f"compare the arms: moebench compare {run_dir}:A {run_dir}:B", file=sys.stderr)
    return run_dir, failed
