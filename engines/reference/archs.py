"""The architectures the reference engine runs and the synthesizer writes, as data (torch-free).

Per architecture: its features (what its forward pass does beyond the common MoE transformer), how its
hyperparameters are read from GGUF metadata, and its tensors: GGUF name -> role and shape rule. The
reference model and its loader, the synthesizer (workloads.synth) and `moebench plan` all read this
table, so an architecture's tensors are spelled once. Adding an architecture = one entry here, its
forward-pass differences (engines/reference/model.py), a synth preset.

The source of truth for every rule is llama.cpp (src/models/<arch>.cpp, src/llama-model.cpp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engines.errors import UserError
from engines.gguf_meta import ModelMeta

# Feature -> meaning. A forward pass (and a fused kernel) declares which of these it implements; an
# architecture whose features are not all implemented by a fused kernel never runs that kernel.
FEATURES = {
    "rope_neox": "RoPE pairs value i with i + head_dim/2 (GGML_ROPE_TYPE_NEOX), else 2i with 2i+1",
    "qk_norm_head": "RMSNorm of q and k per head (weights of head_dim)",
    "qk_norm_full": "RMSNorm of q and k over the whole projection (weights of q_dim / kv_dim; olmoe)",
    "qkv_bias": "biases on the q, k, v projections",
    "norm_topk": "router: softmax over all experts, top-k, weights renormalized",
    "shared_expert_gated": "a shared expert beside the routed ones, scaled by sigmoid(ffn_gate_inp_shexp . x)",
}

# Roles: how a tensor is placed (expert: host RAM at depth > its layer), drawn by the synthesizer, stored.
ROLES = ("embed", "output", "matrix", "router", "expert", "norm", "bias")


@dataclass(frozen=True)
class Hparams:
    """The numbers a forward pass needs, validated. Shapes below are numpy order (reverse of ggml ne)."""
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_vocab: int
    rope_base: float
    rms_eps: float
    expert_weights_scale: float
    tied_output: bool
    features: frozenset[str]

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def has(self, feature: str) -> bool:
        return feature in self.features


Shape = Callable[[Hparams], tuple[int, ...]]


@dataclass(frozen=True)
class TensorRule:
    name: str                    # GGUF name; "{i}" = block index for per-layer tensors
    role: str                    # one of ROLES
    shape: Shape                 # numpy shape
    feature: str | None = None   # present only when the architecture has this feature
    optional: bool = False       # may be absent (output.weight: then the head is tied to token_embd)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    def key(self) -> str:
        """The name inside a layer (`attn_q.weight`), as the model reads a layer's tensors."""
        return self.name.removeprefix("blk.{i}.")


def _t(name, role, shape, feature=None, optional=False) -> TensorRule:
    return TensorRule(name, role, shape, feature, optional)


# The common MoE transformer block (llama.cpp's qwen3moe/qwen2moe/olmoe/llama graphs share it).
MOE_TRANSFORMER = (    # in file order (the synthesizer writes them so; same preset + seed = same bytes)
    _t("token_embd.weight", "embed", lambda h: (h.n_vocab, h.n_embd)),
    _t("blk.{i}.attn_norm.weight", "norm", lambda h: (h.n_embd,)),
    _t("blk.{i}.attn_q.weight", "matrix", lambda h: (h.q_dim, h.n_embd)),
    _t("blk.{i}.attn_k.weight", "matrix", lambda h: (h.kv_dim, h.n_embd)),
    _t("blk.{i}.attn_v.weight", "matrix", lambda h: (h.kv_dim, h.n_embd)),
    _t("blk.{i}.attn_output.weight", "matrix", lambda h: (h.n_embd, h.q_dim)),
    _t("blk.{i}.ffn_norm.weight", "norm", lambda h: (h.n_embd,)),
    _t("blk.{i}.ffn_gate_inp.weight", "router", lambda h: (h.n_expert, h.n_embd)),
    _t("blk.{i}.ffn_gate_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    _t("blk.{i}.ffn_up_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    _t("blk.{i}.ffn_down_exps.weight", "expert", lambda h: (h.n_expert, h.n_embd, h.n_ff_exp)),
    _t("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.head_dim,), "qk_norm_head"),
    _t("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.head_dim,), "qk_norm_head"),
    _t("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.q_dim,), "qk_norm_full"),
    _t("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.kv_dim,), "qk_norm_full"),
    _t("blk.{i}.attn_q.bias", "bias", lambda h: (h.q_dim,), "qkv_bias"),
    _t("blk.{i}.attn_k.bias", "bias", lambda h: (h.kv_dim,), "qkv_bias"),
    _t("blk.{i}.attn_v.bias", "bias", lambda h: (h.kv_dim,), "qkv_bias"),
    _t("blk.{i}.ffn_gate_inp_shexp.weight", "norm", lambda h: (h.n_embd,), "shared_expert_gated"),
    _t("blk.{i}.ffn_gate_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd), "shared_expert_gated"),
    _t("blk.{i}.ffn_up_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd), "shared_expert_gated"),
    _t("blk.{i}.ffn_down_shexp.weight", "matrix", lambda h: (h.n_embd, h.n_ff_shexp), "shared_expert_gated"),
    _t("output_norm.weight", "norm", lambda h: (h.n_embd,)),
    _t("output.weight", "output", lambda h: (h.n_vocab, h.n_embd), optional=True),
)


@dataclass(frozen=True)
class Arch:
    name: str
    features: frozenset[str]
    tensors: tuple[TensorRule, ...] = MOE_TRANSFORMER

    def rules(self) -> list[TensorRule]:
        """The tensor rules of this architecture (those of features it lacks dropped)."""
        return [t for t in self.tensors if t.feature is None or t.feature in self.features]

    def shapes(self, h: Hparams, present: set[str] | None = None) -> dict[str, tuple[int, ...]]:
        """Every tensor a file of this architecture holds, name -> numpy shape. Optional tensors are
        included when `present` (the file's names) has them, or always when present is None."""
        rules = self.rules()
        first = [t for t in rules if t.role == "embed"]             # file order: embeddings, blocks, head
        blocks = [(t, i) for i in range(h.n_layers) for t in rules if t.per_layer]
        last = [t for t in rules if not t.per_layer and t.role != "embed"]
        out = {}
        for t, i in [(t, None) for t in first] + blocks + [(t, None) for t in last]:
            name = t.name.format(i=i)
            if not t.optional or present is None or name in present:
                out[name] = t.shape(h)
        return out

    def role(self, name: str) -> str | None:
        """The role of a GGUF tensor name in this architecture, None if it has no such tensor."""
        for t in self.rules():
            if t.per_layer:
                head, _, tail = t.name.partition("{i}")
                mid = name[len(head):len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
                if mid.isdigit():
                    return t.role
            elif t.name == name:
                return t.role
        return None


ARCHS: dict[str, Arch] = {a.name: a for a in [
    Arch("qwen3moe", frozenset({"rope_neox", "qk_norm_head", "norm_topk"})),
    Arch("qwen2moe", frozenset({"rope_neox", "qkv_bias", "shared_expert_gated"})),
    Arch("olmoe", frozenset({"rope_neox", "qk_norm_full"})),
    Arch("llama", frozenset({"norm_topk"})),          # Mixtral-style: llama with routed experts
]}


def arch_of(meta: ModelMeta) -> Arch:
    """The table entry of a model file, or one sentence naming the supported architectures."""
    if meta.arch not in ARCHS or not meta.moe_layers:
        what = f"architecture {meta.arch!r}" if meta.arch not in ARCHS else "a model without routed experts"
        raise UserError(f"{meta.path.name} is {what}, which the reference engine does not run; "
                        f"supported: Mixture-of-Experts models of {', '.join(ARCHS)}.")
    return ARCHS[meta.arch]


def hparams(meta: ModelMeta) -> Hparams:
    """Validate the metadata; every number is checked before anything is allocated."""
    arch = arch_of(meta)

    def num(key: str, default=None, kind=int):
        v = meta.get(key, default)
        if v is None:
            raise UserError(f"{meta.path.name}: metadata key {meta.arch}.{key} is missing; "
                            f"the file is not a usable {meta.arch} model.")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v > (1 << 30):
            raise UserError(f"{meta.path.name}: metadata {meta.arch}.{key} = {v!r} is not a valid positive number.")
        return kind(v)

    n_embd, n_head = num("embedding_length"), num("attention.head_count")
    head_dim = num("attention.key_length", n_embd // n_head)
    if num("attention.value_length", head_dim) != head_dim or num("rope.dimension_count", head_dim) != head_dim:
        raise UserError(f"{meta.path.name}: key/value lengths and rope dimensions differ; "
                        "the reference engine needs them equal.")
    n_expert, n_used = num("expert_count"), num("expert_used_count")
    if n_used > n_expert or head_dim % 2:
        raise UserError(f"{meta.path.name}: expert_used_count {n_used} > expert_count {n_expert} or odd head size; "
                        "the file is corrupt.")
    shared = "shared_expert_gated" in arch.features
    h = Hparams(
        arch=meta.arch, n_layers=meta.n_layers, n_embd=n_embd, n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head), head_dim=head_dim, n_expert=n_expert, n_expert_used=n_used,
        n_ff_exp=num("expert_feed_forward_length", meta.get("feed_forward_length")),
        n_ff_shexp=num("expert_shared_feed_forward_length", meta.get("feed_forward_length")) if shared else 0,
        n_vocab=meta.n_vocab, rope_base=num("rope.freq_base", 10000.0, float),
        rms_eps=num("attention.layer_norm_rms_epsilon", kind=float),
        expert_weights_scale=float(meta.get("expert_weights_scale", 0.0) or 0.0),
        tied_output="output.weight" not in {t.name for t in meta.tensors}, features=arch.features)
    if h.n_head % h.n_head_kv or h.n_vocab <= 0:
        raise UserError(f"{meta.path.name}: head_count {n_head} is not a multiple of head_count_kv {h.n_head_kv} "
                        "or the vocabulary is empty.")
    if h.has("qk_norm_full") and not h.q_dim == h.kv_dim == n_embd:
        raise UserError(f"{meta.path.name}: olmoe needs head_count_kv == head_count and head_count*key_length == "
                        "embedding_length (llama.cpp sizes its q/k norms n_embd).")
    return h
