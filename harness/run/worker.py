"""The child process of one cell: load the engine once, run every workload, stream records back.

Started by the runner as `python -m harness.run.worker` with the job as JSON on stdin. Records go out
as JSON lines on the file descriptor named by MOEBENCH_FD (stdout/stderr are the engine's log).
The harness owns the clock: perf_counter_ns around the engine's synchronized calls.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from engines.base import EngineSettings
from engines.registry import engine_class
from harness.run.sampler import NAN, proc_kib
from workloads.grammar import parse_workload
from workloads.tokens import stream_source, workload_tokens


class Channel:
    def __init__(self, fd: int):
        self.f = os.fdopen(fd, "w", buffering=1)

    def emit(self, type: str, **kw) -> None:
        self.f.write(json.dumps({"type": type, **kw}) + "\n")
        self.f.flush()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


def _delta(after: dict, before: dict) -> float:
    key = "engine_ms"
    return after[key] - before.get(key, 0.0) if key in after else float("nan")


class Turns:
    """The worker's side of taking turns (no-op outside --interleave; the gate is
    two named pipes from harness/run/interleave.py): wait() before a step, post() after."""

    def __init__(self, gate: dict | None):
        # O_RDWR: opening never blocks and a write never fails, even when the other arm is gone
        self.r = os.open(gate["wait"], os.O_RDWR) if gate else None
        self.w = os.open(gate["post"], os.O_RDWR) if gate else None

    def wait(self) -> None:
        if self.r is not None:
            os.read(self.r, 1)

    def post(self) -> None:
        if self.w is not None:
            os.write(self.w, b".")


def run_job(job: dict, ch: Channel) -> None:
    engine = engine_class(job["engine"])()
    settings = EngineSettings(**job["settings"])
    turn = Turns(job.get("gate"))     # --interleave: each step waits for the other arm's worker
    # The RSS floor: this process with the engine's runtime (torch, a shared library) and no model yet. Only this
    # process, not its tree: an external engine's binary has not started yet, so its runtime counts above the floor.
    engine.runtime()
    floor = proc_kib(os.getpid(), "status", ("VmRSS", "RssAnon")) or {}
    ch.emit("floor", rss_mib=floor.get("VmRSS", NAN) / 1024, rss_anon_mib=floor.get("RssAnon", NAN) / 1024)
    ch.emit("phase", phase="load")
    turn.wait()
    t0 = time.perf_counter_ns()
    engine.load(Path(job["model"]), settings)
    load_s = (time.perf_counter_ns() - t0) / 1e9
    turn.post()
    info = engine.info()
    ch.emit("loaded", load_s=load_s, version=info.version, info=info.to_dict())
    for name in job["workloads"]:
        w = parse_workload(name)
        ch.emit("phase", phase=name)
        timed = engine.measure(w, job["repetitions"], job["warmup"], job["seed"])
        if timed is not None:      # an external binary timed itself; there is no second clock to compare
            for rep, ns in enumerate(timed):
                ch.emit("rep", workload=name, rep=rep, ns=ns, engine_ms=float("nan"), stream="random")
            continue
        depth_tokens, tokens = workload_tokens(w, job["n_vocab"], job["seed"], job["model"])
        source = stream_source(w, job["model"])      # random | text | repeats: what each row records
        for rep in range(-job["warmup"], job["repetitions"]):
            ch.emit("phase", phase=name if rep >= 0 else f"warmup:{name}")
            turn.wait()
            first = rep == -job["warmup"]       # a routing trace keeps each workload's first run (the same
            if first:                            # tokens route the same way in every run)
                engine.trace_segment(name, depth_tokens + tokens, getattr(w, "stream", "random"))
            engine.reset()
            if depth_tokens:
                engine.prefill(depth_tokens)   # untimed: brings the cache to depth D
            before = engine.counters()
            start = time.perf_counter_ns()
            if w.n_prompt:
                engine.prefill(tokens)
            else:
                for t in tokens:
                    engine.decode(t)
            ns = time.perf_counter_ns() - start
            turn.post()
            if first:
                engine.trace_segment(None)
            if rep >= 0:
                ch.emit("rep", workload=name, rep=rep, ns=ns, engine_ms=_delta(engine.counters(), before),
                        stream=source)
    try:              # after the workloads: what the engine did, its counters too (expert cache); optional
        ch.emit("info", info=engine.info().to_dict())
    except Exception:
        pass
    ch.emit("phase", phase="close")
    turn.wait()
    engine.close()
    turn.post()
    ch.emit("done")


def main() -> None:
    ch = Channel(int(os.environ["MOEBENCH_FD"]))
    job = json.loads(sys.stdin.read())
    try:
        run_job(job, ch)
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit non-zero
        ch.emit("error", status="oom" if _is_oom(e) else "failed", error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc())
        sys.exit(1)


if __name__ == "__main__":
    main()
