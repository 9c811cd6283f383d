"""conftest.isolated(): a crash or an exception in the child fails the calling test with its reason, and the
pytest process goes on (each test below runs on after its child died)."""
import os
import signal

import pytest

from engines.base import EngineSettings
from engines.llama_cpp import LlamaCppEngine
from tests.conftest import for_each, isolated


def square(x: int) -> int:
    return x * x


def segfault(settings: EngineSettings | None = None) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def bad_value(x: int) -> None:
    raise ValueError(f"no good: {x}")


def test_results_come_back():
    assert isolated(square, 7) == 49
    assert isolated(for_each, square, {"a": (2,), "b": (3,)}) == {"a": 4, "b": 9}


def test_a_segfault_fails_the_test_naming_the_function_and_the_signal():
    with pytest.raises(pytest.fail.Exception, match=r"^segfault died by SIGSEGV in its child process\.") as err:
        isolated(segfault)
    assert "\n" not in str(err.value)            # one message, no traceback of the harness


def test_a_crash_names_its_known_cause_for_the_settings_of_the_run(monkeypatch):
    asked = []

    def cause(cls, signal_name, settings, info):
        asked.append((signal_name, settings))
        return "Rebuild it with clang."

    monkeypatch.setattr(LlamaCppEngine, "crash_cause", classmethod(cause))
    settings = EngineSettings(extra={"repack": 0})
    with pytest.raises(pytest.fail.Exception, match=r"SIGSEGV in its child process\. Rebuild it with clang\.$"):
        isolated(segfault, settings)
    assert asked == [("SIGSEGV", settings)]
    with pytest.raises(pytest.fail.Exception, match="^for_each segfault died by SIGSEGV"):
        isolated(for_each, segfault, {"a": ()})


def test_an_exception_fails_the_test_with_the_childs_traceback():
    with pytest.raises(pytest.fail.Exception, match="^bad_value raised in its child process") as err:
        isolated(bad_value, 3)
    assert "in bad_value" in str(err.value) and str(err.value).endswith("ValueError: no good: 3")
