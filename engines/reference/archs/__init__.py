"""The architectures the reference engine runs and the synthesizer writes, as data (torch-free).

Per architecture (one module here, e.g. `classic.py`, `gpt_oss.py`): its features (what its forward pass
does beyond the common MoE transformer), how its hyperparameters are read from GGUF metadata and written
back, its tensors (GGUF name -> role and shape rule), its synthesizer presets, and the model class that runs
it. The reference model and its loader, the synthesizer (workloads.synth) and `moebench plan` all read this
table, so an architecture's tensors are spelled once. Adding an architecture = one module here (found by
this package on import: every module's ARCHS list), its forward-pass differences (a model class in
engines/reference/models/), a synth preset.

The source of truth for every rule is llama.cpp (src/models/<arch>.cpp, src/llama-model.cpp).
"""
from __future__ import annotations

import importlib
import pkgutil

from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.reference.archs.common import (ARCHS, FEATURES, ROLES, Arch, Hparams, Preset,  # noqa: F401
                                            TensorRule, positive)

PRESETS: dict[str, Preset] = {}
for _m in pkgutil.iter_modules(__path__):
    if _m.name != "common":
        _mod = importlib.import_module(f"{__name__}.{_m.name}")
        ARCHS.update({a.name: a for a in getattr(_mod, "ARCHS", [])})
        PRESETS |= getattr(_mod, "PRESETS", {})


def arch_of(meta: ModelMeta) -> Arch:
    """The table entry of a model file, or one sentence naming the supported architectures."""
    runs = ", ".join(a for a in ARCHS if not ARCHS[a].unsupported)
    if meta.arch not in ARCHS or not meta.moe_layers:
        what = f"architecture {meta.arch!r}" if meta.arch not in ARCHS else "a model without routed experts"
        raise UserError(f"{meta.path.name} is {what}, which the reference engine does not run; "
                        f"supported: Mixture-of-Experts models of {runs}.")
    if ARCHS[meta.arch].unsupported:
        raise UserError(f"{meta.path.name} is a {meta.arch} model, which the reference engine does not run yet: "
                        f"{ARCHS[meta.arch].unsupported}; run it with llama-cpp, or use one of {runs}.")
    return ARCHS[meta.arch]


def hparams(meta: ModelMeta) -> Hparams:
    """The validated hyperparameters of a model file (every number checked before anything is allocated)."""
    return arch_of(meta).parse(meta)
