"""Engines that misbehave on purpose, loaded as real plugins (MOEBENCH_ENGINES) in real worker
processes, to exercise the runner's crash, timeout, out-of-memory and resume paths."""
from __future__ import annotations

import ctypes
import os
import resource
import time

from engines.base import Engine, EngineInfo
from engines.llama_cpp import LlamaCppEngine


class _Base(Engine):
    @classmethod
    def available(cls):
        return None

    def load(self, model, s):
        self.s = s

    def reset(self):
        pass

    def prefill(self, tokens):
        self.fault()

    def decode(self, token):
        self.fault()

    def info(self):
        return EngineInfo(self.name, "test", {}, {})

    def fault(self):
        time.sleep(0.001)


class CrashEngine(_Base):
    """Segfaults in prefill while FAULT=crash is set (so --resume without it succeeds)."""
    name = "crash"

    def fault(self):
        if os.environ.get("FAULT") == "crash":
            ctypes.string_at(0)
        super().fault()


class HangEngine(_Base):
    """Never returns from prefill while FAULT=hang is set."""
    name = "hang"

    def fault(self):
        if os.environ.get("FAULT") == "hang":
            time.sleep(3600)
        super().fault()


class StampEngine(_Base):
    """Appends `label start_ns end_ns pid` for every prefill to extra['stamp_file'] (or
    $MOEBENCH_STAMP_FILE), so a test can see from outside which process worked when."""
    name = "stamp"

    def fault(self):
        start = time.time_ns()
        time.sleep(0.01)
        with open(self.s.extra.get("stamp_file") or os.environ["MOEBENCH_STAMP_FILE"], "a") as f:
            f.write(f"{self.s.extra.get('label', '-')} {start} {time.time_ns()} {os.getpid()}\n")


class PacedEngine(_Base):
    """Takes a fixed time per prefill (MOEBENCH_PACE_MS, default 20) times a factor drawn once per process from
    N(1, spread): a machine whose processes differ by `spread` and whose repetitions do not."""
    name = "paced"
    spread = 0.002

    def load(self, model, s):
        super().load(model, s)
        import random
        spread = self.spread if s.n_cpu_moe else PacedEngine.spread
        self.pace = float(os.environ.get("MOEBENCH_PACE_MS", 20)) / 1e3 * random.gauss(1, spread)

    def fault(self):
        time.sleep(self.pace)


class JitterEngine(PacedEngine):
    """PacedEngine whose processes differ by 20 % at depths above 0."""
    name = "jitter"
    spread = 0.2


class HogEngine(_Base):
    """Allocates without bound under a 1 GiB address-space limit: MemoryError -> status oom."""
    name = "hog"

    def fault(self):
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))


class Unavailable(_Base):
    name = "unavailable"

    @classmethod
    def available(cls):
        return "its runtime is not installed on this machine (install it to use this engine)."


class AmxCrashEngine(LlamaCppEngine):
    """The real llama.cpp, reporting GCC 12 as the compiler of its libggml (faked compiler detection, nothing else)
    and dying with SIGSEGV at its first batch of 2+ tokens, as such a build does on an AMX CPU."""
    name = "amx-crash"

    def load(self, model, s):
        super().load(model, s)
        self.compiler = "gcc 12.2.0"

    def prefill(self, tokens):
        import signal
        os.kill(os.getpid(), signal.SIGSEGV)
