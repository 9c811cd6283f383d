import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ",".join(f"{n}=tests.fault_engines:{c}" for n, c in
                  [("crash", "CrashEngine"), ("hang", "HangEngine"), ("hog", "HogEngine"), ("stamp", "StampEngine"),
                   ("unavailable", "Unavailable")])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny preset (f32, 4 layers, 8 experts), synthesized once per test session."""
    from workloads.synth import synthesize
    return synthesize("tiny", tmp_path_factory.mktemp("models") / "tiny.gguf")


def moebench(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (exit codes, stderr messages)."""
    e = {k: v for k, v in os.environ.items() if k != "FAULT"} | {"MOEBENCH_ENGINES": FAULTS,
                                                                 "PYTHONPATH": str(ROOT)} | (env or {})
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=timeout)


def sigint_default() -> None:
    """preexec_fn for a child the test will Ctrl-C: SIGINT back to its default. A shell's background
    job (`.ci/run &`) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_dir_of(result: subprocess.CompletedProcess) -> Path:
    """The run directory a `moebench sweep` printed last on stderr ("results: DIR")."""
    return Path(result.stderr.strip().splitlines()[-1].removeprefix("results: "))


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from a loaded in-process engine: prefill the prompt, then decode each argmax."""
    engine.prefill(prompt)
    out = [int(engine.logits()[-1].argmax())]
    for _ in range(n - 1):
        engine.decode(out[-1])
        out.append(int(engine.logits()[-1].argmax()))
    return out


def disjoint(intervals) -> bool:
    """No two (start, end) intervals overlap (an end may equal the next start)."""
    intervals = sorted(intervals)
    return all(b[0] >= a[1] for a, b in zip(intervals, intervals[1:]))
