"""qwen35moe (Qwen3.5-35B-A3B family): a hybrid of Gated DeltaNet linear-attention layers and gated
full-attention layers (every full_attention_interval-th layer), MoE with a gated shared expert in every
layer, and optional MTP blocks at the end of the file that the main graph never runs.

Source of truth: llama.cpp src/models/qwen35moe.cpp (hparams :4-34, tensors :36-147), create_tensor_qkv and
create_tensor_gate_up_exps (src/llama-model.cpp:3379-3436); the math is in engines/reference/models/qwen35moe.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.reference.archs.common import Arch, Hparams, Preset, common_hparams, positive, rule


@dataclass(frozen=True)
class Qwen35Hparams(Hparams):
    """n_layers is block_count: the trunk plus n_nextn MTP blocks (their tensors are in the file and checked;
    llama.cpp loads them with TENSOR_SKIP and never runs them). DeltaNet: ssm_state = d_k = d_v per head,
    ssm_k_heads q/k heads (ssm.group_count), ssm_v_heads v heads (ssm.time_step_rank)."""
    n_nextn: int = 0
    n_rot: int = 64                                    # rope.dimension_count: RoPE on the first n_rot dims of a head
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)   # IMROPE (t, h, w, e) sections, in rotary pairs
    ssm_conv_kernel: int = 4
    ssm_state: int = 128
    ssm_k_heads: int = 16
    ssm_v_heads: int = 32
    attn_interval: int = 4                             # full_attention_interval
    recurrent_layers: tuple[bool, ...] | None = None   # attention.recurrent_layers (per block), beats the interval
    fused_qkv: bool = False        # attention layers hold attn_qkv (rows [q+gate | k | v]), not attn_q/k/v
    fused_gate_up: bool = False    # ffn_gate_up_exps (rows [gate | up]) instead of ffn_gate_exps + ffn_up_exps
    attn_bias: bool = False        # biases on the attention layers' q/k/v (or qkv) projections

    @property
    def n_trunk(self) -> int:
        return self.n_layers - self.n_nextn

    def recurrent(self, il: int) -> bool:
        """A DeltaNet layer (qwen35moe.cpp:20-25); MTP blocks never are."""
        if il >= self.n_trunk:
            return False
        if self.recurrent_layers is not None:
            return self.recurrent_layers[il]
        return (il + 1) % self.attn_interval != 0

    @property
    def key_dim(self) -> int:        # q (and k) channels of a DeltaNet layer
        return self.ssm_state * self.ssm_k_heads

    @property
    def value_dim(self) -> int:      # v (and z) channels = ssm.inner_size
        return self.ssm_state * self.ssm_v_heads

    @property
    def conv_dim(self) -> int:       # channels of the causal conv: [q | k | v]
        return 2 * self.key_dim + self.value_dim


def _gdn(h, i):
    return h.recurrent(i)


def _attn(h, i):                     # gated attention: trunk attention layers and MTP blocks
    return not h.recurrent(i)


def _attn_split(h, i):
    return _attn(h, i) and not h.fused_qkv


def _attn_fused(h, i):
    return _attn(h, i) and h.fused_qkv


def _split_bias(h, i):
    return _attn_split(h, i) and h.attn_bias


def _fused_bias(h, i):
    return _attn_fused(h, i) and h.attn_bias


def _mtp(h, i):
    return i >= h.n_trunk


TENSORS = (    # in file order (the synthesizer writes them so)
    rule("token_embd.weight", "embed", lambda h: (h.n_vocab, h.n_embd)),
    rule("blk.{i}.attn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.post_attention_norm.weight", "norm", lambda h: (h.n_embd,)),      # the pre-FFN norm
    # gated attention: per head the q projection holds [query(hd) | gate(hd)]
    rule("blk.{i}.attn_q.weight", "matrix", lambda h: (2 * h.q_dim, h.n_embd), layers=_attn_split),
    rule("blk.{i}.attn_k.weight", "matrix", lambda h: (h.kv_dim, h.n_embd), layers=_attn_split),
    rule("blk.{i}.attn_v.weight", "matrix", lambda h: (h.kv_dim, h.n_embd), layers=_attn_split),
    rule("blk.{i}.attn_q.bias", "bias", lambda h: (2 * h.q_dim,), layers=_split_bias),
    rule("blk.{i}.attn_k.bias", "bias", lambda h: (h.kv_dim,), layers=_split_bias),
    rule("blk.{i}.attn_v.bias", "bias", lambda h: (h.kv_dim,), layers=_split_bias),
    rule("blk.{i}.attn_qkv.weight", "matrix", lambda h: (2 * h.q_dim + 2 * h.kv_dim, h.n_embd), layers=_attn_fused),
    rule("blk.{i}.attn_qkv.bias", "bias", lambda h: (2 * h.q_dim + 2 * h.kv_dim,), layers=_fused_bias),
    rule("blk.{i}.attn_output.weight", "matrix", lambda h: (h.n_embd, h.q_dim), layers=_attn),
    rule("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.head_dim,), layers=_attn),
    rule("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.head_dim,), layers=_attn),
    # Gated DeltaNet (llama.cpp creates attn_qkv/attn_gate NOT_REQUIRED but its graph uses them: required)
    rule("blk.{i}.attn_qkv.weight", "matrix", lambda h: (h.conv_dim, h.n_embd), layers=_gdn),     # [q | k | v]
    rule("blk.{i}.attn_gate.weight", "matrix", lambda h: (h.value_dim, h.n_embd), layers=_gdn),   # z
    rule("blk.{i}.ssm_conv1d.weight", "matrix", lambda h: (h.conv_dim, h.ssm_conv_kernel), layers=_gdn),
    rule("blk.{i}.ssm_dt.bias", "bias", lambda h: (h.ssm_v_heads,), layers=_gdn),
    rule("blk.{i}.ssm_a", "vector", lambda h: (h.ssm_v_heads,), layers=_gdn),      # -exp(A_log); no .weight
    rule("blk.{i}.ssm_beta.weight", "matrix", lambda h: (h.ssm_v_heads, h.n_embd), layers=_gdn),
    rule("blk.{i}.ssm_alpha.weight", "matrix", lambda h: (h.ssm_v_heads, h.n_embd), layers=_gdn),
    rule("blk.{i}.ssm_norm.weight", "norm", lambda h: (h.ssm_state,), layers=_gdn),
    rule("blk.{i}.ssm_out.weight", "matrix", lambda h: (h.n_embd, h.value_dim), layers=_gdn),
    # MoE in every block
    rule("blk.{i}.ffn_gate_inp.weight", "router", lambda h: (h.n_expert, h.n_embd)),
    rule("blk.{i}.ffn_gate_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd),
         layers=lambda h, i: not h.fused_gate_up),
    rule("blk.{i}.ffn_up_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd),
         layers=lambda h, i: not h.fused_gate_up),
    rule("blk.{i}.ffn_gate_up_exps.weight", "expert", lambda h: (h.n_expert, 2 * h.n_ff_exp, h.n_embd),
         layers=lambda h, i: h.fused_gate_up),
    rule("blk.{i}.ffn_down_exps.weight", "expert", lambda h: (h.n_expert, h.n_embd, h.n_ff_exp)),
    rule("blk.{i}.ffn_gate_inp_shexp.weight", "vector", lambda h: (h.n_embd,)),
    rule("blk.{i}.ffn_gate_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd)),
    rule("blk.{i}.ffn_up_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd)),
    rule("blk.{i}.ffn_down_shexp.weight", "matrix", lambda h: (h.n_embd, h.n_ff_shexp)),
    # MTP blocks (qwen35moe.cpp:106-139): checked, never loaded by llama.cpp, never run
    rule("blk.{i}.nextn.eh_proj.weight", "matrix", lambda h: (h.n_embd, 2 * h.n_embd), layers=_mtp),
    rule("blk.{i}.nextn.enorm.weight", "norm", lambda h: (h.n_embd,), layers=_mtp),
    rule("blk.{i}.nextn.hnorm.weight", "norm", lambda h: (h.n_embd,), layers=_mtp),
    rule("blk.{i}.nextn.embed_tokens.weight", "matrix", lambda h: (h.n_vocab, h.n_embd), optional=True, layers=_mtp),
    rule("blk.{i}.nextn.shared_head_head.weight", "matrix", lambda h: (h.n_vocab, h.n_embd), optional=True,
         layers=_mtp),
    rule("blk.{i}.nextn.shared_head_norm.weight", "norm", lambda h: (h.n_embd,), optional=True, layers=_mtp),
    rule("output_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("output.weight", "output", lambda h: (h.n_vocab, h.n_embd), optional=True),
)


def _bad(meta: ModelMeta, what: str) -> UserError:
    return UserError(f"{meta.path.name}: {what}; the file is not a usable qwen35moe model.")


def _unsupported(meta: ModelMeta, what: str) -> UserError:
    return UserError(f"{meta.path.name}: {what} is not implemented by the reference engine; run the file with "
                     "llama-cpp.")


def _int_list(v) -> list[int] | None:
    """A metadata array (or scalar) as ints, None if it is not one (bools count as ints, as in llama.cpp)."""
    items = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(x, (int, bool)) for x in items):
        return None
    return [int(x) for x in items]


def parse(meta: ModelMeta) -> Qwen35Hparams:
    """The keys llama.cpp reads for qwen35moe (llama-model.cpp:1321-1450, qwen35moe.cpp:4-34), validated."""
    base = common_hparams(meta, shared=True)
    n_all, head_dim, n_head, n_head_kv = base["n_layers"], base["head_dim"], base["n_head"], base["n_head_kv"]
    n_nextn = meta.get("nextn_predict_layers", 0)
    if isinstance(n_nextn, bool) or not isinstance(n_nextn, int) or not 0 <= n_nextn < n_all:
        raise _bad(meta, f"nextn_predict_layers {n_nextn} leaves no trunk layers of block_count {n_all}")
    if positive(meta, "attention.value_length", head_dim) != head_dim:
        raise _bad(meta, "attention.key_length and value_length differ (qwen35moe.cpp:160 needs them equal)")
    n_rot = positive(meta, "rope.dimension_count", head_dim)
    if n_rot % 2 or n_rot > head_dim:
        raise _bad(meta, f"rope.dimension_count {n_rot} is odd or exceeds key_length {head_dim}")
    if n_head % n_head_kv:
        raise _bad(meta, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    sections = meta.get("rope.dimension_sections")
    sections = None if sections is None else _int_list(sections)
    if sections is not None and len(sections) == 1:
        sections = sections * 4                              # a scalar stands for all four (get_key_or_arr)
    if sections is None or len(sections) != 4 or min(sections) < 0 or sum(sections) == 0:
        raise _bad(meta, "rope.dimension_sections must be 4 non-negative counts (llama.cpp requires the key)")
    scaling = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    if scaling not in (None, "none", "linear") or factor not in (None, 0, 0.0, 1, 1.0):
        raise _unsupported(meta, f"RoPE scaling ({scaling} x{factor})")
    if int(meta.get("expert_group_count", 0) or 0) > 1:
        raise _unsupported(meta, "group-limited routing (expert_group_count > 1)")
    k = dict(conv=positive(meta, "ssm.conv_kernel"), inner=positive(meta, "ssm.inner_size"),
             state=positive(meta, "ssm.state_size"), v_heads=positive(meta, "ssm.time_step_rank"),
             k_heads=positive(meta, "ssm.group_count"))
    if k["inner"] != k["state"] * k["v_heads"]:
        raise _bad(meta, f"ssm.inner_size {k['inner']} is not state_size {k['state']} x time_step_rank {k['v_heads']}")
    if k["v_heads"] % k["k_heads"]:
        raise _bad(meta, f"ssm.time_step_rank {k['v_heads']} (v heads) is not a multiple of group_count "
                         f"{k['k_heads']} (q/k heads)")
    rec = meta.get("attention.recurrent_layers")
    if rec is not None:
        rec = _int_list(rec)
        if rec is None or len(rec) not in (1, n_all):
            raise _bad(meta, f"attention.recurrent_layers must hold one flag per block ({n_all})")
        rec = tuple(bool(x) for x in (rec * n_all if len(rec) == 1 else rec))
    names = {t.name for t in meta.tensors}
    conv = [t for t in meta.tensors if t.name.endswith(".ssm_conv1d.weight") and t.ggml_type != "F32"]
    if conv:
        raise _bad(meta, f"{conv[0].name} is stored as {conv[0].ggml_type}, but llama.cpp's ssm_conv needs F32")
    h = Qwen35Hparams(**base, n_nextn=n_nextn, n_rot=n_rot, rope_sections=tuple(sections),
                      ssm_conv_kernel=k["conv"], ssm_state=k["state"], ssm_k_heads=k["k_heads"],
                      ssm_v_heads=k["v_heads"], attn_interval=positive(meta, "full_attention_interval", 4),
                      recurrent_layers=rec, fused_gate_up=any(".ffn_gate_up_exps." in n for n in names))
    attn = [i for i in range(n_all) if not h.recurrent(i)]
    fused = any(f"blk.{i}.attn_qkv.weight" in names for i in attn)
    bias = any(f"blk.{i}.attn_{p}.bias" in names for i in attn for p in ("q", "qkv"))
    return replace(h, fused_qkv=fused, attn_bias=bias)


def write_metadata(w, h: Qwen35Hparams) -> None:
    """Every key llama.cpp needs for a qwen35moe file (gguf.GGUFWriter methods)."""
    w.add_block_count(h.n_layers)
    w.add_context_length(h.n_ctx_train)
    w.add_embedding_length(h.n_embd)
    w.add_head_count(h.n_head)
    w.add_head_count_kv(h.n_head_kv)
    w.add_key_length(h.head_dim)
    w.add_value_length(h.head_dim)
    w.add_rope_dimension_count(h.n_rot)
    w.add_rope_dimension_sections(list(h.rope_sections))
    w.add_rope_freq_base(h.rope_base)
    w.add_layer_norm_rms_eps(h.rms_eps)
    w.add_expert_count(h.n_expert)
    w.add_expert_used_count(h.n_expert_used)
    w.add_expert_feed_forward_length(h.n_ff_exp)
    w.add_expert_shared_feed_forward_length(h.n_ff_shexp)
    w.add_ssm_conv_kernel(h.ssm_conv_kernel)
    w.add_ssm_inner_size(h.value_dim)
    w.add_ssm_state_size(h.ssm_state)
    w.add_ssm_group_count(h.ssm_k_heads)
    w.add_ssm_time_step_rank(h.ssm_v_heads)
    w.add_full_attention_interval(h.attn_interval)
    if h.recurrent_layers is not None:
        w.add_array(f"{h.arch}.attention.recurrent_layers", [bool(x) for x in h.recurrent_layers])
    if h.n_nextn:
        w.add_nextn_predict_layers(h.n_nextn)
    w.add_vocab_size(h.n_vocab)
    w.add_tokenizer_model("no_vocab")


def synth_tensor(name: str, shape: tuple[int, ...], rng, h: Qwen35Hparams):
    """The synthesizer's values for the tensors a generic draw (1-D: ~1) would make wrong: ssm_a = -exp(A_log)
    must be negative, else the log-decay g = softplus(.) * ssm_a is positive and the DeltaNet state grows by
    ~e^0.8 a token (inf after ~100 tokens); the dt bias as HF initializes it (softplus^-1 of dt in [1e-3, 0.1]),
    so exp(g) is ~0.6-0.98 and some heads remember across several 64-token chunks; the shared-expert gate is a
    dot product with x (std 1/sqrt(n_embd)), not a norm, so sigmoid(gate . x) does not saturate."""
    if name.endswith(".ssm_a"):
        return -rng.uniform(1.0, 8.0, shape).astype("float32"), "F32"
    if name.endswith(".ssm_dt.bias"):
        return -rng.uniform(2.5, 5.0, shape).astype("float32"), "F32"
    if name.endswith(".ffn_gate_inp_shexp.weight"):
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype("float32"), "F32"
    return None


def kv_layout(h: Qwen35Hparams) -> list[tuple[int, int, int]]:
    """A KV cache in the trunk's attention layers only (DeltaNet layers keep a state; MTP blocks never run)."""
    return [(0, 0, 0) if h.recurrent(i) or i >= h.n_trunk else (h.n_head_kv, h.head_dim, h.head_dim)
            for i in range(h.n_layers)]


def state_bytes(h: Qwen35Hparams) -> int:
    """f32 bytes of every DeltaNet layer's state for one sequence: the conv's last K-1 input rows and S."""
    per = (h.ssm_conv_kernel - 1) * h.conv_dim + h.ssm_v_heads * h.ssm_state * h.ssm_state
    return 4 * per * sum(h.recurrent(i) for i in range(h.n_layers))


ARCHS = [Arch("qwen35moe",
              frozenset({"deltanet", "gated_attention", "partial_rope", "imrope", "rope_neox", "qk_norm_head",
                         "norm_topk", "shared_expert_gated", "mtp_blocks"}),
              TENSORS, parse, write_metadata, model="engines.reference.models.qwen35moe:Qwen35MoE",
              synth_tensor=synth_tensor, kv_layout=kv_layout, state_bytes=state_bytes)]


def _h(**kw) -> Qwen35Hparams:
    return Qwen35Hparams(arch="qwen35moe", rope_base=1e7, **kw)


PRESETS = {
    # ~80 MB in f32: blocks G G A G G A + 1 MTP block (full_attention_interval 3), 2 q/k vs 4 v DeltaNet heads
    # (the tiled head mapping), GQA 4/2, partial IMROPE (16 of 64 dims, sections [3,3,2,0] like the real
    # [11,11,10,0]); every row a multiple of 256 so the file also exists as iq4_xs, the real expert format
    "qwen35moe-tiny": Preset(_h(n_layers=7, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
                                n_expert_used=4, n_ff_exp=256, n_vocab=1024, n_ff_shexp=256, n_ctx_train=4096,
                                n_nextn=1, n_rot=16, rope_sections=(3, 3, 2, 0), ssm_state=64, ssm_k_heads=2,
                                ssm_v_heads=4, attn_interval=3), dtype="f32"),
    # Qwen3.5-35B-A3B's layer shapes (model_shapes.md section 2) with 4 of its 40 layers (G G G A) and, like
    # qwen3-30b-a3b-4l, a 32K vocab (the real 248320 would make the head outweigh 4 layers): ~2.2 GB in iq4_xs
    "qwen3.5-35b-a3b-4l": Preset(_h(n_layers=4, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_expert=256,
                                    n_expert_used=8, n_ff_exp=512, n_vocab=32768, n_ff_shexp=512,
                                    n_ctx_train=262144), dtype="iq4_xs"),
    # the whole model as the published GGUF holds it (block_count 40, no MTP block, vocab 248320): `moebench plan`
    "qwen3.5-35b-a3b": Preset(_h(n_layers=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_expert=256,
                                 n_expert_used=8, n_ff_exp=512, n_vocab=248320, n_ff_shexp=512,
                                 n_ctx_train=262144), dtype="iq4_xs"),
}
