"""Shared base for engines that drive an external benchmark binary (llama-bench, TensorSharp.Cli).

Such a binary loads the model and times its own repetitions, so these engines implement
Engine.measure() and the worker records the binary's per-repetition samples instead of timing
reset/prefill/decode itself. The binary runs as a child of the cell's worker process, so the
runner's sampler sees its memory like any other cell's, and a cell timeout kills it with the worker
(same process group). A missing binary, a non-zero exit or output that does not parse raises
ExternalError: the cell fails with the reason and the tail of the binary's output, the sweep goes on.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from engines.base import Engine, EngineSettings

TAIL_CHARS = 600


class ExternalError(RuntimeError):
    """The external binary is missing, failed, or printed something we cannot read."""


def tail(text: str, n: int = TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def label_text(text: str) -> str:
    """`text` as a cell id may hold it (a build's name in `engine@bin=<label>`): letters, digits and . _ + - only."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "bin"


@dataclass
class Completed:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + "\n" + self.stderr).strip()


class ExternalEngine(Engine):
    """Subclasses set the binary's name, the settings.extra key and environment variable that name
    its path, and a sentence saying how to get it."""
    binary_name: str = ""
    extra_key: str = ""          # settings.extra[extra_key] = path (from `moebench sweep --<name> PATH`)
    env_var: str = ""            # MOEBENCH_<NAME> = path
    how_to_get: str = ""

    @classmethod
    def discovered(cls) -> list[Path]:
        """Places to look after the explicit ones, best first (subclasses add their cache)."""
        found = shutil.which(cls.binary_name)
        return [Path(found)] if found else []

    @classmethod
    def find(cls, explicit: str | None = None) -> Path | None:
        """The binary to run: an explicit path (flag, then environment) wins even if it is wrong, so
        the cell reports the wrong path instead of silently running another binary."""
        explicit = explicit or os.environ.get(cls.env_var, "").strip() or None
        if explicit:
            return Path(explicit).expanduser()
        return next(iter(cls.discovered()), None)

    @classmethod
    def available(cls) -> str | None:
        if cls.find() is None:
            return f"no {cls.binary_name} binary found; {cls.how_to_get}"
        return None

    @classmethod
    def spec_label(cls, path: str) -> str:
        """How cells name the binary at `path` (an engine spec's bin=PATH): the directory it lies in (label_text).
        Subclasses name the build where they can read it."""
        return label_text(Path(path).resolve().parent.name)

    def locate(self, s: EngineSettings) -> Path:
        path = self.find(s.extra.get(self.extra_key))
        if path is None:
            raise ExternalError(f"no {self.binary_name} binary found; {self.how_to_get}")
        if not path.is_file():
            raise ExternalError(f"{self.binary_name} binary {str(path)!r} does not exist; {self.how_to_get}")
        if not os.access(path, os.X_OK):
            raise ExternalError(f"{self.binary_name} binary {str(path)!r} is not executable; chmod +x it or pass "
                                f"another.")
        return path.resolve()

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None, check: bool = True,
            echo_chars: int | None = None) -> Completed:
        """Run the binary to completion. Its output is copied to our stdout, which is the cell's log (its first and
        last echo_chars // 2 characters where it is longer: a verbose load log can be megabytes)."""
        argv = [str(a) for a in argv]
        print("$ " + " ".join(argv), flush=True)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, errors="replace", env=env)
        except OSError as e:   # e.g. exec format error: a file that is not a program
            raise ExternalError(f"{self.binary_name} could not be started ({e})") from None
        done = Completed(argv, p.returncode, p.stdout, p.stderr)
        text = done.output
        if echo_chars is not None and len(text) > echo_chars:
            half = echo_chars // 2
            text = f"{text[:half]}\n[... {len(text) - 2 * half} characters of output left out ...]\n{text[-half:]}"
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        if check and p.returncode != 0:
            sig = signal.Signals(-p.returncode).name if p.returncode < 0 else ""
            cause = type(self).crash_cause(sig, self.s, {}) if sig and hasattr(self, "s") else ""
            how = (f"was killed by {sig}" + (f" ({cause})" if cause else "") if sig
                   else f"exited with code {p.returncode}")
            raise ExternalError(f"{self.binary_name} {how}; output tail: {tail(done.output) or '(none)'}")
        return done

    # The binary runs whole workloads (measure()); the worker never steps such an engine token by token.
    def _not_stepwise(self) -> None:
        raise RuntimeError(f"{self.name} times whole workloads itself (Engine.measure); it cannot be stepped")

    def reset(self) -> None:
        self._not_stepwise()

    def prefill(self, tokens) -> None:
        self._not_stepwise()

    def decode(self, token: int) -> None:
        self._not_stepwise()
