import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

from engines.base import EngineInfo, EngineSettings

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ",".join(f"{n}=tests.fault_engines:{c}" for n, c in
                  [("crash", "CrashEngine"), ("hang", "HangEngine"), ("hog", "HogEngine"), ("stamp", "StampEngine"),
                   ("unavailable", "Unavailable"), ("amx-crash", "AmxCrashEngine"),
                   ("paced", "PacedEngine"), ("paced2", "PacedEngine"), ("jitter", "JitterEngine")])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny preset (f32, 4 layers, 8 experts), synthesized once per test session."""
    from workloads.synth import synthesize
    return synthesize("tiny", tmp_path_factory.mktemp("models") / "tiny.gguf")


def moebench(*args, env: dict | None = None, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (exit codes, stderr messages), from the project root or `cwd`."""
    e = {k: v for k, v in os.environ.items() if k != "FAULT"} | {"MOEBENCH_ENGINES": FAULTS,
                                                                 "PYTHONPATH": str(ROOT)} | (env or {})
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=timeout)


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


# --- llama.cpp in a child process ---------------------------------------------------------------------------------

def _child(conn, fn, args, kwargs) -> None:
    faulthandler.enable()       # a crash prints the Python stack it happened under (pytest shows the child's stderr)
    try:
        conn.send((True, fn(*args, **kwargs)))
    except BaseException:
        conn.send((False, traceback.format_exc()))


def isolated(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a fresh process, its result returned: how tests run llama.cpp, so that a crash inside
    it (e.g. a miscompiled build) fails the calling test with the signal and its known cause instead of killing
    pytest. fn: a module-level function; its arguments and result: picklable. "spawn", not fork: a forked copy
    of a process running torch's threads can hang."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, args, kwargs))
    child.start()
    send.close()                # our copy of the write end: closed, so that a dead child means EOF, not a hang
    try:
        ok, value = receive.recv()
    except EOFError:            # it died before answering
        ok = value = None
    child.join()
    if ok:
        return value
    what = " ".join(getattr(f, "__qualname__", repr(f)) for f in (fn, *args) if callable(f))   # for_each's fn too
    if ok is False:
        pytest.fail(f"{what} raised in its child process:\n{value.rstrip()}", pytrace=False)
    if child.exitcode >= 0:
        pytest.fail(f"{what}: its child process exited with code {child.exitcode} before returning", pytrace=False)
    from engines.llama_cpp import LlamaCppEngine
    name = signal.Signals(-child.exitcode).name
    settings = next((a for a in (*args, *kwargs.values()) if isinstance(a, EngineSettings)), EngineSettings())
    cause = LlamaCppEngine.crash_cause(name, settings, {"settings": {"system_info": _llama_system_info()}})
    pytest.fail(" ".join(filter(None, [f"{what} died by {name} in its child process.", cause])), pytrace=False)


def _llama_system_info() -> str:
    """llama.cpp's system info (crash_cause: is AMX compiled in?), from another fresh process: a build for another
    CPU can die as it loads."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout


def for_each(fn, calls: dict, **kwargs) -> dict:
    """{key: fn(*args, **kwargs)} for each key's args: several llama.cpp runs in one isolated() child (a child costs
    a second or more of imports)."""
    return {key: fn(*args, **kwargs) for key, args in calls.items()}


def llama_cpp_logits(path, tokens: list[int], repack: bool = True, last_only: bool = False, **params) -> np.ndarray:
    """llama.cpp's logits at every position of tokens, (n, V) float32; params: llama_cpp.Llama's; repack=False: without
    its extra buffer types (AMX, CPU_REPACK), so its products run ggml's generic CPU kernels. last_only: the last
    token's only, (V,), as a benchmark's prefill asks for them (its graph then keeps only that row from the last
    layer's attention on: inp_out_ids). Run it isolated()."""
    import llama_cpp

    if not repack:      # Llama() has no knob for it; its model params start from this function (in this child only)
        default = llama_cpp.llama_cpp.llama_model_default_params

        def plain():
            p = default()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama_cpp.llama_model_default_params = plain

    llm = llama_cpp.Llama(model_path=str(path), logits_all=not last_only, verbose=False, **params)
    llm.eval(tokens)
    out = (np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy() if last_only
           else np.array(llm.scores[:len(tokens)], dtype=np.float32))
    llm.close()
    return out


def llama_cpp_load(path, settings: EngineSettings) -> tuple[EngineInfo, str]:
    """LlamaCppEngine's info() after loading path, and llama.cpp's load log. Run it isolated()."""
    from engines.llama_cpp import LlamaCppEngine

    e = LlamaCppEngine()
    e.load(path, settings)
    info, log = e.info(), e._load_log
    e.close()
    return info, log
