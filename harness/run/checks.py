"""The model checks every engine needs, run once per model file before any cell starts (spec.expand).

llama.cpp asserts on inconsistent metadata (SIGABRT and a C backtrace in the error column); the reference
engine and the external binaries would each need the same checks again. So the harness checks what every
architecture llama.cpp supports has in common, once, and says one sentence (exit 2). Rules, each from
llama.cpp's loader (src/llama-model.cpp, llama-hparams.h):

- counts are whole numbers: block_count 1..512 (LLAMA_MAX_LAYERS), embedding_length >= 1, expert_count
  1..1024 (LLAMA_MAX_EXPERTS); expert_used_count (a number or one per layer) 1..expert_count at its largest;
  expert groups, when present, divide the experts.
- attention heads (optional: recurrent-only layers have none): head_count and head_count_kv are a positive
  number or one per layer (>= 0: 0 = a layer without attention, as Gated-DeltaNet or conv layers); in
  every layer with both, head_count is a multiple of head_count_kv (deepseek4: head_count_kv 1).
- layer_norm(_rms)_epsilon and rope.freq_base(_swa), when present, are finite and positive.
- tensor shapes agree with the metadata: token_embd is embedding_length wide; every routed-expert tensor
  and router has expert_count as its last dimension; no block index reaches block_count.
- the architecture name is a short identifier. Free-text strings (general.name, ...) are cut and cleaned
  where they are read (engines.gguf_meta.clean_text), not refused.
Byte sizes, offsets and tensor names are read_meta's (a header that lies about sizes never gets this far).
"""
from __future__ import annotations

import math
import re

from engines.errors import UserError
from engines.gguf_meta import ModelMeta, clean_text, read_meta

MAX_LAYERS, MAX_EXPERTS = 512, 1024        # llama-hparams.h: LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS
MAX_COUNT = (1 << 31) - 1
ARCH_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
BLOCK = re.compile(r"^blk\.(\d+)\.")
ROUTER = re.compile(r"^blk\.\d+\.ffn_gate_inp\.weight$")


def read_checked(path) -> ModelMeta:
    """read_meta(path), after check_model: what every command that takes a model file reads it with."""
    meta = read_meta(path)
    check_model(meta)
    return meta


def check_model(meta: ModelMeta) -> None:
    """Raise UserError with one sentence naming the first problem of the file, if it has one."""
    problems = model_problems(meta)
    if problems:
        raise UserError(f"{clean_text(meta.path.name, 120)}: {problems[0]}; the file is inconsistent and no engine "
                        "can run it: re-download or re-create it.")


def model_problems(meta: ModelMeta) -> list[str]:
    """Every rule of this module the file breaks, as short phrases (empty: the file is consistent)."""
    out: list[str] = []
    arch = meta.arch
    if not ARCH_NAME.fullmatch(arch):
        return [f"general.architecture {clean_text(repr(arch), 80)} is not an architecture name"]

    def key(k: str) -> str:
        return f"{arch}.{k}"

    def whole(k: str, lo: int, hi: int = MAX_COUNT, required: bool = True) -> int | None:
        v = meta.get(k)
        if v is None:
            if required:
                out.append(f"metadata {key(k)} is missing")
            return None
        if not _is_int(v) or not lo <= v <= hi:
            out.append(f"metadata {key(k)} = {_show(v)} must be a whole number in {lo}..{hi}")
            return None
        return v

    def per_layer(k: str, scalar_lo: int) -> list[int] | None:
        """A count that is one number (>= scalar_lo) or one number >= 0 per layer; None when absent or bad."""
        v = meta.get(k)
        if v is None:
            return None
        if isinstance(v, list):
            if len(v) != meta.n_layers or not all(_is_int(x) and 0 <= x <= MAX_COUNT for x in v):
                out.append(f"metadata {key(k)} = {_show(v)} must be {meta.n_layers} whole numbers >= 0 (one per "
                           "layer)")
                return None
            return v
        if not _is_int(v) or not scalar_lo <= v <= MAX_COUNT:
            out.append(f"metadata {key(k)} = {_show(v)} must be a whole number >= {scalar_lo} or one per layer")
            return None
        return [v] * meta.n_layers

    def positive_real(k: str) -> None:
        v = meta.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v <= 0):
            out.append(f"metadata {key(k)} = {_show(v)} must be a finite number > 0")

    whole("block_count", 1, MAX_LAYERS)
    n_embd = whole("embedding_length", 1)
    n_expert = whole("expert_count", 1, MAX_EXPERTS)
    used = per_layer("expert_used_count", 1)
    if meta.get("expert_used_count") is None:
        out.append(f"metadata {key('expert_used_count')} is missing")
    elif used is not None and n_expert is not None and not 1 <= max(used) <= n_expert:
        out.append(f"expert_used_count {max(used)} must be 1..{n_expert} (expert_count)")
    groups = whole("expert_group_count", 0, required=False)
    if groups and n_expert is not None:
        g_used = whole("expert_group_used_count", 0, required=False) or 0
        if groups >= n_expert or (groups > 1 and (n_expert % groups or not 0 < g_used < groups)):
            out.append(f"expert_group_count {groups} (used {g_used}) must divide expert_count {n_expert} and "
                       "exceed the groups used")

    heads, heads_kv = per_layer("attention.head_count", 1), per_layer("attention.head_count_kv", 1)
    if heads is not None and not any(heads):
        out.append(f"metadata {key('attention.head_count')} has no layer with attention heads")
    if heads is not None and heads_kv is not None:
        bad = next((i for i, (h, kv) in enumerate(zip(heads, heads_kv)) if h and kv and h % kv), None)
        if bad is not None:
            out.append(f"attention.head_count {heads[bad]} is not a multiple of head_count_kv {heads_kv[bad]} "
                       f"(layer {bad})")
    for k in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
              "rope.freq_base_swa"):
        positive_real(k)

    for t in meta.tensors:
        block = BLOCK.match(t.name)
        if block and int(block.group(1)) >= meta.n_layers:
            out.append(f"tensor {t.name} belongs to block {block.group(1)}, beyond block_count {meta.n_layers}")
        elif t.name == "token_embd.weight" and n_embd is not None and t.ne[0] != n_embd:
            out.append(f"tensor token_embd.weight is {t.ne[0]} wide but embedding_length is {n_embd}")
        elif n_expert is not None and ((t.layer is not None and "_chexps" not in t.name) or ROUTER.match(t.name)) \
                and t.ne[-1] != n_expert:
            out.append(f"tensor {t.name} holds {t.ne[-1]} experts but expert_count is {n_expert}")
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v) -> str:
    """A metadata value in a message: repr, short, clean (it came from the file)."""
    return clean_text(repr(v), 60)
