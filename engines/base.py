"""The Engine contract every backend implements, and the offload-depth rules they share.

The harness owns the clock: an engine only does work and returns once that work is finished
(synchronized). The offload rules: docs/design.md, "Offload semantics", and this module's depth functions.
"""
from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from engines.errors import UserError


@dataclass(frozen=True)
class EngineSettings:
    """One settings record shared by every engine. `n_cpu_moe` is already resolved to an int."""
    n_cpu_moe: int = 0
    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    flash_attn: str = "auto"       # on | off | auto
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    dtype: str = "auto"            # compute dtype for engines that choose one (reference)
    mmap: bool = True
    seed: int = 0
    extra: dict = field(default_factory=dict, hash=False)   # engine-specific knobs

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineInfo:
    """What the engine actually did after load(): the report compares this with what was asked."""
    engine: str
    version: str
    settings: dict                                   # effective settings (may differ from asked)
    bytes_by_device: dict[str, int]                  # resident bytes per device/buffer type
    expert_bytes_host: int = 0                       # routed-expert bytes kept in host RAM
    expert_bytes_total: int = 0
    n_overridden_tensors: int | None = None          # tensors placed on host by the depth rule
    # the layers whose routed experts the engine really placed in host memory by its depth rule, as the engine itself
    # tells (its load log, its placement), not as asked; None: the engine cannot tell
    cpu_moe_layers: list[int] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def expert_host_fraction(self) -> float:
        return self.expert_bytes_host / self.expert_bytes_total if self.expert_bytes_total else float("nan")

    def to_dict(self) -> dict:
        return asdict(self) | {"expert_host_fraction": self.expert_host_fraction}


ANY_WHOLE_NUMBER = ("N",)       # Engine.knobs: the knob takes any whole number >= 0 (e.g. cache_mib)


class Engine(ABC):
    """One inference engine behind the harness. Heavy imports belong inside the methods."""
    name: str = ""
    # engine settings (in settings.extra) a sweep may cross as lists -> the values each takes, e.g. repack: 0, 1
    # (ANY_WHOLE_NUMBER: any whole number)
    knobs: Mapping[str, tuple[str, ...]] = {}
    # records routing traces (engines.routing) when settings.extra["trace_routing"] names a file; the harness
    # then tells it each workload's first run through trace_segment
    routing_traces: bool = False

    @classmethod
    def notes(cls) -> list[str]:
        """What this engine will do differently on this host than asked, one sentence each (said once per run:
        run.json["notes"] and the summary). Default: nothing."""
        return []

    @classmethod
    def crash_cause(cls, signal_name: str, settings: "EngineSettings", info: dict) -> str:
        """Why a process running this engine died with this signal here, and the fix, in one sentence ("" when
        no known cause applies). `info` is the cell's EngineInfo.to_dict() when it got as far as loading, else {}."""
        return ""

    @classmethod
    @abstractmethod
    def available(cls) -> str | None:
        """None when the engine can run here, else one sentence saying why not and how to fix it."""

    @classmethod
    def version(cls) -> str:
        return "unknown"

    @classmethod
    def isa(cls) -> str:
        """The CPU instruction set its kernels run here (avx2, avx512, amx...), "" when it cannot tell before a run."""
        return ""

    @classmethod
    def variants(cls) -> dict[str, tuple[str | None, str, str]]:
        """Engine specs of this engine that run other code of their own (`reference@experts=kt`): spec -> (why it
        cannot run here or None, its version, its ISA), for `moebench engines`. Default: none."""
        return {}

    @classmethod
    def prepare(cls) -> None:
        """One-time work on this machine (e.g. compiling kernels), called by the harness before it starts
        a cell of this engine, so that no cell's load time or peak memory includes it. Default: none."""

    @classmethod
    def runtime(cls) -> None:
        """Import what load() needs (its runtime), so that the RSS floor the worker records before load() counts
        the runtime and not the model: a PyTorch engine's runtime alone holds hundreds of MiB that a C++ engine's
        does not, and the fair memory figure is the peak above that floor. Nothing model-specific, and safe to
        run before load() in the same process. Default: nothing (an external binary's runtime then counts above
        the floor)."""

    @abstractmethod
    def load(self, model: Path, s: EngineSettings) -> None: ...

    @abstractmethod
    def reset(self) -> None:
        """Empty the KV cache; the next prefill starts at position 0."""

    @abstractmethod
    def prefill(self, tokens: Sequence[int]) -> None:
        """Process tokens in n_ubatch chunks; synchronized on return."""

    @abstractmethod
    def decode(self, token: int) -> None:
        """Process one token at the next position; synchronized on return."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    def measure(self, workload, repetitions: int, warmup: int, seed: int) -> list[int] | None:
        """Optional, for external engines that time themselves (a benchmark binary that reports
        per-repetition samples): run `workload` (a workloads.grammar.Workload) and return the
        duration in ns of each timed repetition. None (the default) = the worker times
        reset/prefill/decode itself, which is the rule for every in-process engine."""
        return None

    def trace_segment(self, name: str | None, tokens: Sequence[int] = (), stream: str = "random") -> None:
        """Optional (engines with routing_traces): the runs from now on belong to workload `name`, whose token
        stream (depth tokens, then the timed ones) is `tokens`, of kind `stream` (random | correlated); None: the
        segment ends (the trace is written). The worker opens one before each workload's first run and closes it
        after that run. Default: nothing."""

    def counters(self) -> dict[str, float]:
        """Engine-internal timing of the work since the last reset(), as a cross-check (optional)."""
        return {}

    def close(self) -> None:
        pass


# --- what the arithmetic and the weights really were (EngineInfo.settings) -----------------------------------------
# settings["compute_dtype"] = {"prefill": X, "decode": Y}: the arithmetic of the products with weight matrices in that
# phase, one word per kind, several joined by "+" (sorted) when the phase's tensors differ. A word names the format the
# activations are rounded to before they meet the weights: the float formats by name, ggml's 8-bit blocks (Q8_0, Q8_1,
# Q8_K: int8 dot products, AMX int8 tiles included) as "q8-activations". settings["weights"]: one of WEIGHTS.
Q8_ACTIVATIONS = "q8-activations"
ARITHMETIC = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": Q8_ACTIVATIONS, "Q8_1": Q8_ACTIVATIONS,
              "Q8_K": Q8_ACTIVATIONS}
WEIGHTS = ("mapped", "copy", "hugepage-copy", "mapped+repacked-copy", "mapped+copy", "mapped+hugepage-copy")
# mapped+...: some products read the file mapping, the others a copy (llama.cpp's repacked buffers; the reference engine
# whose offloaded experts kt-kernel computes from its own mapping of the file)


def arithmetic(activation_type: str) -> str:
    """The compute_dtype word for products whose activations take ggml type `activation_type` (a weight type's
    vec_dot_type: "F16", "Q8_K", ...)."""
    if activation_type.upper() not in ARITHMETIC:
        raise ValueError(f"no compute_dtype word for activations of type {activation_type!r}")
    return ARITHMETIC[activation_type.upper()]


def weight_arithmetic(weight_type: str) -> str:
    """The word for ggml-cpu's product with a weight of ggml type `weight_type`: F32, F16 and BF16 meet activations in
    their own format, every quantized type's vec_dot_type is one of ggml's 8-bit blocks (tests hold this rule to the
    type traits of the libggml-cpu llama-cpp-python loads)."""
    return arithmetic(weight_type if weight_type in ("F32", "F16", "BF16") else "Q8_0")


def joined(words) -> str:
    """Several compute_dtype words as one value: each once, sorted, joined by "+"."""
    return "+".join(sorted(set(words)))


def switch(value) -> bool:
    """An on/off engine knob as given: 0/1 (sweep lists), true/false/on/off (engine specs), bools (JSON)."""
    return str(value).strip().lower() in ("1", "true", "on", "yes")


# --- offload depth -------------------------------------------------------------------------------

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_(ch|)exps\b")


def expert_layer(tensor_name: str) -> int | None:
    """Layer index of a routed-expert tensor (`blk.3.ffn_up_exps.weight` -> 3), else None.
    Shared experts (`_shexp`) and the router (`ffn_gate_inp`) are not routed experts."""
    m = EXPERT_TENSOR.match(tensor_name)
    return int(m.group(1)) if m else None


def host_layers(placed, moe_layers: list[int], accelerator: bool) -> list[int]:
    """EngineInfo.cpu_moe_layers: the layers whose routed experts an engine placed in host memory (`placed`, as its
    load log or its own placement tells), or every MoE layer when nothing of the model is on an accelerator: host
    memory is then all there is, whatever the depth (the depth may still change the CPU buffer or kernels an engine
    uses, which its settings say)."""
    return sorted(set(placed) - {None}) if accelerator else list(moe_layers)


def parse_depth(value: str | int, n_layers: int, source: str = "--n-cpu-moe") -> int:
    """`N|all` -> number of leading layers whose experts stay in host RAM."""
    text = str(value).strip().lower()
    if text == "all":
        return n_layers
    if not re.fullmatch(r"\d+", text):
        raise UserError(f"{source} value {value!r} is not a layer count; use a whole number 0..{n_layers} or 'all'.")
    n = int(text)
    if n > n_layers:
        raise UserError(f"{source} {n} is larger than the model's {n_layers} layers; use 0..{n_layers} or 'all'.")
    return n


def resolve_depth(flag: str | int | None, n_layers: int, env: Mapping[str, str] | None = None) -> int:
    """TensorSharp's rule: an explicit flag beats TS_N_CPU_MOE=N|all, which beats TS_CPU_MOE (not "0" = all)."""
    env = os.environ if env is None else env
    if flag is not None:
        return parse_depth(flag, n_layers)
    if env.get("TS_N_CPU_MOE", "").strip():
        return parse_depth(env["TS_N_CPU_MOE"], n_layers, "TS_N_CPU_MOE")
    if env.get("TS_CPU_MOE", "").strip() not in ("", "0"):
        return n_layers
    return 0
