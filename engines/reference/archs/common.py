"""The shapes of the architecture table: hyperparameters, tensor rules, an architecture, a preset."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
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
    "attn_out_bias": "a bias on the attention output projection",
    "attn_sinks": "one learned logit per head in each attention softmax's denominator",
    "sliding_window": "some layers attend to the last n_swa positions only",
    "yarn": "YaRN-scaled RoPE",
    "router_bias": "a bias on the router logits",
    "softmax_weight": "router: top-k of the logits, softmax over those k",
    "expert_bias": "biases on the routed experts' gate, up and down products",
    "swiglu_oai": "gpt-oss's clamped SwiGLU experts",
    "gelu_experts": "GELU(tanh)-gated experts",
    "dense_ffn": "a dense FFN beside the routed experts",
    "sandwich_norms": "norms after the attention and FFN outputs too",
    "logit_softcap": "final logits = cap * tanh(logits / cap)",
    "embed_scale": "embeddings multiplied by sqrt(n_embd)",
    "deltanet": "Gated DeltaNet linear-attention layers with a recurrent state",
    "gated_attention": "attention output scaled by sigmoid of a per-head gate from the q projection",
    "partial_rope": "RoPE on the first rope_dims of each head only",
    "imrope": "interleaved M-RoPE (rope type 40); for text NEOX pairs, those of the 4th section not rotated",
    "mtp_blocks": "multi-token-prediction blocks after the trunk: in the file, never run",
    "v_norm": "RMSNorm of v per head, without a weight",
    "k_eq_v": "layers without attn_v use the K projection as V (before k's norm and RoPE)",
    "rope_freq_factors": "RoPE frequencies divided by per-pair factors (rope_freqs.weight)",
    "attn_scale_one": "attention scores not scaled by 1/sqrt(head_dim)",
    "swa_layer_shapes": "sliding-window layers have their own head size, kv heads and RoPE base and dims",
    "router_input_scale": "router input rmsnorm(x) * n_embd^-0.5 * ffn_gate_inp.scale, not the experts' input",
    "expert_out_scale": "each routed expert's output times a per-expert scale (ffn_down_exps.scale)",
    "layer_output_scale": "the residual after each layer times a learned scalar (layer_output_scale)",
}

ARCHS: dict[str, "Arch"] = {}       # name -> Arch, filled by the package from its modules

# Roles: how a tensor is placed (expert: host RAM at depth > its layer), drawn by the synthesizer, held.
ROLES = ("embed", "output", "matrix", "router", "expert", "norm", "bias", "vector")


@dataclass(frozen=True)
class Hparams:
    """The numbers a model file's metadata gives, validated: what the forward pass, the tensor shapes and
    the synthesizer need. Architectures with more numbers subclass it. Shapes are numpy order."""
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    n_ff_shexp: int = 0
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    expert_weights_scale: float = 0.0
    tied_output: bool = False
    n_ctx_train: int = 32768

    @property
    def n_trunk(self) -> int:
        """The blocks the forward pass runs; blocks after them (multi-token-prediction heads) are in the file
        but never run, and llama.cpp does not load them."""
        return self.n_layers

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def features(self) -> frozenset[str]:
        return ARCHS[self.arch].features

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
    layers: Callable[[Hparams, int], bool] | None = None    # per-layer tensors: which layers have it (None: all)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name


def rule(name, role, shape, feature=None, optional=False, layers=None) -> TensorRule:
    return TensorRule(name, role, shape, feature, optional, layers)


@dataclass(frozen=True)
class Arch:
    name: str
    features: frozenset[str]
    tensors: tuple[TensorRule, ...]
    parse: Callable[[ModelMeta], Hparams]          # metadata -> validated hyperparameters
    write_metadata: Callable[[object, Hparams], None]   # (gguf.GGUFWriter, h): every key llama.cpp needs
    model: str = "engines.reference.models.transformer:Transformer"  # module:class of its forward pass (torch)
    activation: str = "silu"                       # the routed experts' gated activation (offload.Activation)
    unsupported: str = ""                          # the reference engine does not run it: which part is missing
    # the synthesizer's values and type for tensors that are not plain weights (an index table, a scale that
    # must stay F32): (name, numpy shape, rng, h) -> (array, ggml type) or None for the default
    synth_tensor: Callable[[str, tuple[int, ...], object, Hparams], tuple[object, str] | None] | None = None
    # per layer (kv heads, key length, value length) of its KV cache, (0, 0, 0) for a layer without one;
    # None: every layer (n_head_kv, head_dim, head_dim). What `moebench plan` sizes the caches from.
    kv_layout: Callable[[Hparams], list[tuple[int, int, int]]] | None = None
    state_bytes: Callable[[Hparams], int] | None = None    # f32 bytes of recurrent state per sequence (DeltaNet)

    def cache_layout(self, h: Hparams) -> list[tuple[int, int, int]]:
        return self.kv_layout(h) if self.kv_layout else [(h.n_head_kv, h.head_dim, h.head_dim)] * h.n_layers

    def rules(self) -> list[TensorRule]:
        """The tensor rules of this architecture (those of features it lacks dropped)."""
        return [t for t in self.tensors if t.feature is None or t.feature in self.features]

    def shapes(self, h: Hparams, present: set[str] | None = None) -> dict[str, tuple[int, ...]]:
        """Every tensor a file of this architecture holds, name -> numpy shape, in file order (embedding,
        blocks, head). Optional tensors are included when `present` (the file's names) has them, or always
        when present is None."""
        rules = self.rules()
        first = [t for t in rules if t.role == "embed"]
        blocks = [(t, i) for i in range(h.n_layers) for t in rules
                  if t.per_layer and (t.layers is None or t.layers(h, i))]
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


@dataclass(frozen=True)
class Preset:
    """A synthesized model: hyperparameters (with their architecture) and a llama.cpp file type."""
    h: Hparams
    dtype: str = "f16"           # workloads.quantize.FTYPES: which type each tensor gets


def positive(meta: ModelMeta, key: str, default=None, kind=int):
    """Metadata `key` (arch-relative) as a positive number; one sentence if it is missing or not one."""
    v = meta.get(key, default)
    if v is None:
        raise UserError(f"{meta.path.name}: metadata key {meta.arch}.{key} is missing; "
                        f"the file is not a usable {meta.arch} model.")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v > (1 << 30) or not math.isfinite(v):
        raise UserError(f"{meta.path.name}: metadata {meta.arch}.{key} = {v!r} is not a valid positive number.")
    return kind(v)


def common_hparams(meta: ModelMeta, shared: bool) -> dict:
    """The fields of Hparams every MoE transformer file has, validated (see `positive`)."""
    n_embd, n_head = positive(meta, "embedding_length"), positive(meta, "attention.head_count")
    n_expert, n_used = positive(meta, "expert_count"), positive(meta, "expert_used_count")
    if n_used > n_expert:
        raise UserError(f"{meta.path.name}: expert_used_count {n_used} > expert_count {n_expert}; the file is corrupt.")
    return dict(
        arch=meta.arch, n_layers=meta.n_layers, n_embd=n_embd, n_head=n_head,
        n_head_kv=positive(meta, "attention.head_count_kv", n_head), head_dim=positive(meta, "attention.key_length",
                                                                                       n_embd // n_head),
        n_expert=n_expert, n_expert_used=n_used,
        n_ff_exp=positive(meta, "expert_feed_forward_length", meta.get("feed_forward_length")),
        n_ff_shexp=positive(meta, "expert_shared_feed_forward_length", meta.get("feed_forward_length"))
        if shared else 0,
        n_vocab=meta.n_vocab, rope_base=positive(meta, "rope.freq_base", 10000.0, float),
        rms_eps=positive(meta, "attention.layer_norm_rms_epsilon", kind=float),
        expert_weights_scale=float(meta.get("expert_weights_scale", 0.0) or 0.0),
        tied_output="output.weight" not in {t.name for t in meta.tensors},
        n_ctx_train=int(meta.get("context_length") or 0) or 32768)


def write_common(w, h: Hparams) -> None:
    """The metadata keys every MoE transformer file has (gguf.GGUFWriter methods)."""
    w.add_block_count(h.n_layers)
    w.add_context_length(h.n_ctx_train)
    w.add_embedding_length(h.n_embd)
    w.add_feed_forward_length(h.n_ff_exp)
    w.add_head_count(h.n_head)
    w.add_head_count_kv(h.n_head_kv)
    w.add_key_length(h.head_dim)
    w.add_value_length(h.head_dim)
    w.add_rope_dimension_count(h.head_dim)
    w.add_rope_freq_base(h.rope_base)
    w.add_layer_norm_rms_eps(h.rms_eps)
    w.add_expert_count(h.n_expert)
    w.add_expert_used_count(h.n_expert_used)
    w.add_expert_feed_forward_length(h.n_ff_exp)
    if h.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(h.n_ff_shexp)
    w.add_vocab_size(h.n_vocab)
    w.add_tokenizer_model("no_vocab")


def field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]
