"""gpt-oss (GGUF arch "gpt-oss", llama.cpp LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp): tensors,
hyperparameters, metadata and presets. The forward pass is engines/reference/models/gpt_oss.py.

What differs from the common MoE transformer: sliding-window attention on some layers (even ones by default)
with a window that counts the query itself, one learned sink logit per head in every attention softmax, YaRN
RoPE (NEOX), biases on q/k/v/o, on the router and on every expert, top-k of the raw router logits with a
softmax over those k, gpt-oss's clamped SwiGLU, and `post_attention_norm` as the FFN's input norm.
Variants llama.cpp also loads but no gpt-oss release uses, refused with a UserError: a fused attn_qkv tensor,
per-layer head counts or expert widths, longrope scaling, head sizes that differ between q/k/v/rope.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.reference.archs.common import Arch, Hparams, Preset, common_hparams, positive, rule, write_common

ARCH = "gpt-oss"
SCALINGS = ("none", "linear", "yarn")         # llama.cpp also knows longrope, which gpt-oss never uses


@dataclass(frozen=True)
class GptOssHparams(Hparams):
    n_swa: int = 128                 # attention.sliding_window: a query sees n_swa positions, itself included
    swa_layers: tuple[bool, ...] = ()    # per layer: sliding window? () = llama.cpp's default, even layers
    rope_base_swa: float = 0.0       # rope.freq_base_swa of the sliding layers; 0 = rope_base
    rope_scaling: str = "yarn"       # rope.scaling.type: none | linear | yarn
    rope_factor: float = 32.0        # rope.scaling.factor (freq_scale = 1/factor); 0 = no scaling
    n_ctx_orig: int = 4096           # rope.scaling.original_context_length: YaRN's correction dims
    rope_attn_factor: float = 1.0    # rope.scaling.attn_factor

    def is_swa(self, il: int) -> bool:
        """set_swa_pattern(2, dense_first=false) (llama-hparams.cpp): il % 2 < 1, unless the file lists them."""
        return self.swa_layers[il] if self.swa_layers else il % 2 == 0

    def base(self, il: int) -> float:
        return (self.rope_base_swa or self.rope_base) if self.is_swa(il) else self.rope_base


T = (
    rule("token_embd.weight", "embed", lambda h: (h.n_vocab, h.n_embd)),
    rule("blk.{i}.attn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.attn_q.weight", "matrix", lambda h: (h.q_dim, h.n_embd)),
    rule("blk.{i}.attn_q.bias", "bias", lambda h: (h.q_dim,), optional=True),      # TENSOR_NOT_REQUIRED
    rule("blk.{i}.attn_k.weight", "matrix", lambda h: (h.kv_dim, h.n_embd)),
    rule("blk.{i}.attn_k.bias", "bias", lambda h: (h.kv_dim,), optional=True),
    rule("blk.{i}.attn_v.weight", "matrix", lambda h: (h.kv_dim, h.n_embd)),
    rule("blk.{i}.attn_v.bias", "bias", lambda h: (h.kv_dim,), optional=True),
    rule("blk.{i}.attn_output.weight", "matrix", lambda h: (h.n_embd, h.q_dim)),
    rule("blk.{i}.attn_output.bias", "bias", lambda h: (h.n_embd,)),
    rule("blk.{i}.attn_sinks.weight", "vector", lambda h: (h.n_head,)),               # one logit per q head
    rule("blk.{i}.post_attention_norm.weight", "norm", lambda h: (h.n_embd,)),        # the FFN's input norm
    rule("blk.{i}.ffn_gate_inp.weight", "router", lambda h: (h.n_expert, h.n_embd)),
    rule("blk.{i}.ffn_gate_inp.bias", "bias", lambda h: (h.n_expert,)),
    # expert biases are "expert": --n-cpu-moe's pattern moves them to host RAM with their matrices
    rule("blk.{i}.ffn_gate_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_gate_exps.bias", "expert", lambda h: (h.n_expert, h.n_ff_exp)),
    rule("blk.{i}.ffn_up_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_up_exps.bias", "expert", lambda h: (h.n_expert, h.n_ff_exp)),
    rule("blk.{i}.ffn_down_exps.weight", "expert", lambda h: (h.n_expert, h.n_embd, h.n_ff_exp)),
    rule("blk.{i}.ffn_down_exps.bias", "expert", lambda h: (h.n_expert, h.n_embd)),
    rule("output_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("output.weight", "output", lambda h: (h.n_vocab, h.n_embd)),               # untied: required
)


def parse(meta: ModelMeta) -> GptOssHparams:
    """The keys llama.cpp reads for gpt-oss (llama-model.cpp load_hparams, openai-moe.cpp:3-20), validated."""
    name = meta.path.name
    c = common_hparams(meta, shared=False)
    c["n_ff_exp"] = positive(meta, "expert_feed_forward_length")         # required here, no fallback
    positive(meta, "context_length")                                     # required by llama.cpp
    hd = c["head_dim"]
    for key in ("attention.value_length", "rope.dimension_count", "attention.key_length_swa",
                "attention.value_length_swa", "rope.dimension_count_swa"):
        if positive(meta, key, hd) != hd:    # llama.cpp uses one n_rot as head size, rotary dims and KV row size
            raise UserError(f"{name}: {ARCH}.{key} differs from key_length {hd}; gpt-oss needs one head size.")
    if hd % 2 or c["n_head"] % c["n_head_kv"] or c["n_vocab"] <= 0:
        raise UserError(f"{name}: odd head size {hd}, head_count {c['n_head']} not a multiple of head_count_kv "
                        f"{c['n_head_kv']}, or an empty vocabulary; the file is corrupt.")
    n = c["n_layers"]
    pattern = meta.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) < n or not all(isinstance(b, bool) for b in pattern):
            raise UserError(f"{name}: {ARCH}.attention.sliding_window_pattern must be one bool per layer ({n}).")
        swa = tuple(pattern[:n])
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        swa = tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n))     # set_swa_pattern
    else:
        raise UserError(f"{name}: {ARCH}.attention.sliding_window_pattern = {pattern!r} is neither a period nor "
                        "a list of bools.")
    scaling = meta.get("rope.scaling.type", "linear")
    if scaling not in SCALINGS:
        raise UserError(f"{name}: rope scaling {scaling!r} is not supported for gpt-oss; use one of "
                        f"{', '.join(SCALINGS)}.")
    factor = meta.get("rope.scaling.factor", meta.get("rope.scale_linear", 0.0))     # 0: no scaling
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor < 1e6:
        raise UserError(f"{name}: {ARCH}.rope.scaling.factor = {factor!r} is not a valid scaling factor.")
    return GptOssHparams(
        **c, n_swa=positive(meta, "attention.sliding_window"),
        swa_layers=swa, rope_base_swa=positive(meta, "rope.freq_base_swa", c["rope_base"], float),
        rope_scaling=scaling, rope_factor=float(factor),
        n_ctx_orig=positive(meta, "rope.scaling.original_context_length", c["n_ctx_train"]),
        rope_attn_factor=positive(meta, "rope.scaling.attn_factor", 1.0, float))


def write_metadata(w, h: GptOssHparams) -> None:
    """The keys the HF converter writes (conversion/gpt_oss.py), which are what llama.cpp reads."""
    import gguf

    write_common(w, h)
    w.add_sliding_window(h.n_swa)
    if h.swa_layers and any(h.swa_layers[il] != (il % 2 == 0) for il in range(h.n_layers)):
        w.add_sliding_window_pattern(list(h.swa_layers))
    if h.rope_base_swa and h.rope_base_swa != h.rope_base:
        w.add_rope_freq_base_swa(h.rope_base_swa)
    w.add_rope_scaling_type(gguf.RopeScalingType(h.rope_scaling))
    if h.rope_factor:
        w.add_rope_scaling_factor(h.rope_factor)
    w.add_rope_scaling_orig_ctx_len(h.n_ctx_orig)
    if h.rope_attn_factor != 1.0:
        w.add_rope_scaling_attn_factors(h.rope_attn_factor)


def synth_tensor(name: str, shape: tuple[int, ...], rng, h: GptOssHparams):
    """Values for the tensors that are F32 in every file type (1-D ones and the expert biases) which make a
    random gpt-oss use what the real one does: sink logits N(0, 1) (a sink then takes a visible share of
    each softmax), biases with std 0.1, and the FFN input norm (post_attention_norm) near 3, which makes the
    experts' gate/up products std ~3 so that ~2% of them pass SwiGLU-OAI's clamp at 7 (plain std-1 products
    would never reach it, and a forward pass without the clamp would go unnoticed)."""
    if name.endswith("attn_sinks.weight"):
        return rng.standard_normal(shape).astype(np.float32), "F32"
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32), "F32"
    if name.endswith("post_attention_norm.weight"):
        return (3.0 * (1.0 + 0.1 * rng.standard_normal(shape))).astype(np.float32), "F32"
    return None


FEATURES = frozenset({"rope_neox", "yarn", "qkv_bias", "attn_out_bias", "attn_sinks", "sliding_window",
                      "router_bias", "softmax_weight", "expert_bias", "swiglu_oai"})
ARCHS = [Arch(ARCH, FEATURES, T, parse, write_metadata, model="engines.reference.models.gpt_oss:GptOss",
              activation="swiglu_oai", synth_tensor=synth_tensor)]


def _h(n_layers: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_expert: int, n_used: int,
       n_ff: int, n_vocab: int, n_swa: int) -> GptOssHparams:
    """gpt-oss-20b's constants (rope base 150000, YaRN x32 from 4096, eps 1e-5, context 131072) around a shape."""
    return GptOssHparams(ARCH, n_layers, n_embd, n_head, n_head_kv, head_dim, n_expert, n_used, n_ff, n_vocab,
                         rope_base=150000.0, rms_eps=1e-5, n_ctx_train=131072, n_swa=n_swa)


PRESETS = {
    # tests: 4 layers (sliding 0, 2; full 1, 3), window 24 (crossed by a ~100-token prompt and by 16-token
    # ubatches), q width 256 != n_embd 128 as in the real model, head 32 puts the YaRN ramp at pairs 4..9
    "gpt-oss-tiny": Preset(_h(4, 128, 8, 2, 32, 16, 4, 96, 1024, 24), dtype="f32"),
    # gpt-oss-20b's layer shapes (model_shapes.md section 1) with 4 of its 24 layers and a 32K vocab (its
    # 201088-row head alone would outweigh 4 layers' active experts in decode): ~2 GB in mxfp4
    "gpt-oss-20b-4l": Preset(_h(4, 2880, 64, 8, 64, 32, 4, 2880, 32768, 128), dtype="mxfp4"),
    # the whole gpt-oss-20b (24 layers, vocab 201088): for `moebench plan` on a header-only file
    "gpt-oss-20b": Preset(_h(24, 2880, 64, 8, 64, 32, 4, 2880, 201088, 128), dtype="mxfp4"),
}
