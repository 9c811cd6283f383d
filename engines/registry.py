"""Engines by name. Modules are imported only when an engine is used, so `moebench --help` stays fast."""
from __future__ import annotations

import importlib
import os

from engines.base import Engine
from engines.errors import UserError

ENGINES: dict[str, str] = {
    "reference": "engines.reference.engine:ReferenceEngine",
    "llama-cpp": "engines.llama_cpp:LlamaCppEngine",
    "llama-bench": "engines.llama_bench:LlamaBenchEngine",
    "tensorsharp": "engines.tensorsharp:TensorSharpEngine",
    "ik-llama-cpp": "engines.ik_llama_cpp:IkLlamaCppEngine",
}


def known_engines() -> dict[str, str]:
    """Built-in engines plus plugins from MOEBENCH_ENGINES="name=module:Class,..." (inherited by cells)."""
    extra = (item.split("=", 1) for item in os.environ.get("MOEBENCH_ENGINES", "").split(",") if "=" in item)
    return ENGINES | {k.strip(): v.strip() for k, v in extra}


def engine_class(name: str) -> type[Engine]:
    engines = known_engines()
    if name not in engines:
        raise UserError(f"Unknown engine {name!r}; choose from: {', '.join(engines)}.")
    module, cls = engines[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:   # a broken optional engine is reported, not a crash
        raise UserError(f"Engine {name!r} cannot be imported ({e}); "
                        "reinstall moebench with its dependencies.") from None


def check_available(name: str) -> type[Engine]:
    """The engine class, or a UserError saying why it cannot run here."""
    cls = engine_class(name)
    why = cls.available()
    if why:
        raise UserError(f"Engine {name!r} is not available here: {why}")
    return cls
