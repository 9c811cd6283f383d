"""DeepSeek-V4-Flash (GGUF arch `deepseek4`, llama.cpp src/models/deepseek4.cpp): in the table so that the
synthesizer writes files llama.cpp loads and runs and `moebench plan` sizes them; the reference engine does
not run it (see UNSUPPORTED). The tensor list and metadata follow the loader (load_arch_hparams /
load_arch_tensors); per-layer attention differs by the layer's compress ratio: 0 = sliding window only,
4 = CSA (compressed KV with overlapping windows, plus the Lightning indexer), 128 = HCA."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from engines.gguf_meta import ModelMeta
from engines.reference.archs.common import Arch, Hparams, Preset, common_hparams, positive, rule

CSA, HCA = 4, 128          # the only compress ratios llama.cpp supports (DSV4_CSA_RATIO / DSV4_HCA_RATIO)
UNSUPPORTED = ("its attention (a shared 512-wide KV vector per token, compressed KV blocks with the Lightning "
               "indexer, grouped low-rank output projection, attention sinks), the 4-stream hyper-connection "
               "residual (Sinkhorn-normalized mixing) and its routing (sqrt-softplus scores, hash-routed layers) "
               "are not implemented")


@dataclass(frozen=True)
class DeepSeek4Hparams(Hparams):
    n_rot: int = 64                   # rope.dimension_count: RoPE on the last n_rot dims of each head
    q_lora_rank: int = 1024
    o_groups: int = 8                 # attention.output_group_count
    o_lora_rank: int = 1024
    n_expert_shared: int = 1
    compress_ratios: tuple[int, ...] = field(default_factory=tuple)   # one per layer: 0, 4 or 128
    hash_layers: int = 3              # layers [0, hash_layers) route by a token -> experts table
    n_swa: int = 128
    idx_heads: int = 64
    idx_head_dim: int = 128           # a multiple of 64 (llama.cpp rotates the indexer cache by a Hadamard)
    idx_top_k: int = 512
    hc: int = 4                       # hyper_connection.count (llama.cpp asserts 4)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    compress_rope_base: float = 160000.0
    rope_factor: float = 16.0
    rope_orig_ctx: int = 65536
    swiglu_limit: float = 10.0


def _ratio(r: int):
    return lambda h, i: h.compress_ratios[i] == r


def _compressed(h, i) -> bool:
    return h.compress_ratios[i] != 0


TENSORS = (
    rule("token_embd.weight", "embed", lambda h: (h.n_vocab, h.n_embd)),
    rule("blk.{i}.attn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.attn_sinks.weight", "vector", lambda h: (h.n_head,)),
    rule("blk.{i}.attn_q_a.weight", "matrix", lambda h: (h.q_lora_rank, h.n_embd)),
    rule("blk.{i}.attn_q_a_norm.weight", "norm", lambda h: (h.q_lora_rank,)),
    rule("blk.{i}.attn_q_b.weight", "matrix", lambda h: (h.n_head * h.head_dim, h.q_lora_rank)),
    rule("blk.{i}.attn_kv.weight", "matrix", lambda h: (h.head_dim, h.n_embd)),
    rule("blk.{i}.attn_kv_a_norm.weight", "norm", lambda h: (h.head_dim,)),
    # llama.cpp views attn_output_a as {group_dim, o_lora, o_groups}
    rule("blk.{i}.attn_output_a.weight", "matrix",
         lambda h: (h.o_lora_rank * h.o_groups, h.n_head * h.head_dim // h.o_groups)),
    rule("blk.{i}.attn_output_b.weight", "matrix", lambda h: (h.n_embd, h.o_groups * h.o_lora_rank)),
    rule("blk.{i}.hc_attn_fn.weight", "vector", lambda h: ((2 + h.hc) * h.hc, h.hc * h.n_embd)),
    rule("blk.{i}.hc_attn_base.weight", "vector", lambda h: ((2 + h.hc) * h.hc,)),
    rule("blk.{i}.hc_attn_scale.weight", "vector", lambda h: (3,)),
    rule("blk.{i}.hc_ffn_fn.weight", "vector", lambda h: ((2 + h.hc) * h.hc, h.hc * h.n_embd)),
    rule("blk.{i}.hc_ffn_base.weight", "vector", lambda h: ((2 + h.hc) * h.hc,)),
    rule("blk.{i}.hc_ffn_scale.weight", "vector", lambda h: (3,)),
    rule("blk.{i}.attn_compressor_kv.weight", "matrix",
         lambda h: (h.head_dim, h.n_embd), layers=_ratio(HCA)),
    rule("blk.{i}.attn_compressor_kv.weight", "matrix",          # CSA: overlapping windows, twice as wide
         lambda h: (2 * h.head_dim, h.n_embd), layers=_ratio(CSA)),
    rule("blk.{i}.attn_compressor_gate.weight", "matrix", lambda h: (h.head_dim, h.n_embd), layers=_ratio(HCA)),
    rule("blk.{i}.attn_compressor_gate.weight", "matrix", lambda h: (2 * h.head_dim, h.n_embd), layers=_ratio(CSA)),
    rule("blk.{i}.attn_compressor_ape.weight", "vector", lambda h: (HCA, h.head_dim), layers=_ratio(HCA)),
    rule("blk.{i}.attn_compressor_ape.weight", "vector", lambda h: (CSA, 2 * h.head_dim), layers=_ratio(CSA)),
    rule("blk.{i}.attn_compressor_norm.weight", "norm", lambda h: (h.head_dim,), layers=_compressed),
    rule("blk.{i}.indexer.proj.weight", "matrix", lambda h: (h.idx_heads, h.n_embd), layers=_ratio(CSA)),
    rule("blk.{i}.indexer.attn_q_b.weight", "matrix",
         lambda h: (h.idx_heads * h.idx_head_dim, h.q_lora_rank), layers=_ratio(CSA)),
    rule("blk.{i}.indexer_compressor_kv.weight", "matrix", lambda h: (2 * h.idx_head_dim, h.n_embd),
         layers=_ratio(CSA)),
    rule("blk.{i}.indexer_compressor_gate.weight", "matrix", lambda h: (2 * h.idx_head_dim, h.n_embd),
         layers=_ratio(CSA)),
    rule("blk.{i}.indexer_compressor_ape.weight", "vector", lambda h: (CSA, 2 * h.idx_head_dim), layers=_ratio(CSA)),
    rule("blk.{i}.indexer_compressor_norm.weight", "norm", lambda h: (h.idx_head_dim,), layers=_ratio(CSA)),
    rule("blk.{i}.ffn_gate_inp.weight", "router", lambda h: (h.n_expert, h.n_embd)),
    rule("blk.{i}.ffn_gate_tid2eid.weight", "vector", lambda h: (h.n_vocab, h.n_expert_used),
         layers=lambda h, i: i < h.hash_layers),
    rule("blk.{i}.exp_probs_b.bias", "bias", lambda h: (h.n_expert,), layers=lambda h, i: i >= h.hash_layers),
    rule("blk.{i}.ffn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.ffn_gate_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_down_exps.weight", "expert", lambda h: (h.n_expert, h.n_embd, h.n_ff_exp)),
    rule("blk.{i}.ffn_up_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_gate_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd)),
    rule("blk.{i}.ffn_down_shexp.weight", "matrix", lambda h: (h.n_embd, h.n_ff_shexp)),
    rule("blk.{i}.ffn_up_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd)),
    rule("output_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("output.weight", "output", lambda h: (h.n_vocab, h.n_embd)),
    rule("output_hc_fn.weight", "vector", lambda h: (h.hc, h.hc * h.n_embd)),
    rule("output_hc_base.weight", "vector", lambda h: (h.hc,)),
    rule("output_hc_scale.weight", "vector", lambda h: (1,)),
)


def parse(meta: ModelMeta) -> DeepSeek4Hparams:
    ratios = meta.get("attention.compress_ratios") or []
    f = common_hparams(meta, shared=False)
    shared = positive(meta, "expert_shared_count", 1)
    return DeepSeek4Hparams(
        **f | {"n_ff_shexp": f["n_ff_exp"] * shared}, n_rot=positive(meta, "rope.dimension_count"),
        q_lora_rank=positive(meta, "attention.q_lora_rank"), o_groups=positive(meta, "attention.output_group_count"),
        o_lora_rank=positive(meta, "attention.output_lora_rank"), n_expert_shared=shared,
        compress_ratios=tuple(int(r) for r in ratios[:meta.n_layers]),
        hash_layers=int(meta.get("hash_layer_count", 0)),
        n_swa=positive(meta, "attention.sliding_window"), idx_heads=positive(meta, "attention.indexer.head_count"),
        idx_head_dim=positive(meta, "attention.indexer.key_length"),
        idx_top_k=positive(meta, "attention.indexer.top_k"))


def write_metadata(w, h: DeepSeek4Hparams) -> None:
    a = "deepseek4."
    w.add_uint32(a + "block_count", h.n_layers)
    w.add_uint32(a + "context_length", h.n_ctx_train)
    w.add_uint32(a + "embedding_length", h.n_embd)
    w.add_uint32(a + "embedding_length_out", h.hc * h.n_embd)
    w.add_uint32(a + "attention.head_count", h.n_head)
    w.add_uint32(a + "attention.head_count_kv", 1)
    w.add_uint32(a + "attention.key_length", h.head_dim)
    w.add_uint32(a + "attention.value_length", h.head_dim)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", h.rms_eps)
    w.add_uint32(a + "attention.q_lora_rank", h.q_lora_rank)
    w.add_uint32(a + "attention.sliding_window", h.n_swa)
    w.add_uint32(a + "attention.indexer.head_count", h.idx_heads)
    w.add_uint32(a + "attention.indexer.key_length", h.idx_head_dim)
    w.add_uint32(a + "attention.indexer.top_k", h.idx_top_k)
    w.add_uint32(a + "attention.output_group_count", h.o_groups)
    w.add_uint32(a + "attention.output_lora_rank", h.o_lora_rank)
    # llama.cpp reads one ratio per block, MTP included: real files carry one more entry (the MTP layer's)
    w.add_array(a + "attention.compress_ratios", [int(r) for r in h.compress_ratios] + [0])
    w.add_float32(a + "attention.compress_rope_freq_base", h.compress_rope_base)
    w.add_uint32(a + "rope.dimension_count", h.n_rot)
    w.add_float32(a + "rope.freq_base", h.rope_base)
    w.add_string(a + "rope.scaling.type", "yarn")
    w.add_float32(a + "rope.scaling.factor", h.rope_factor)
    w.add_uint32(a + "rope.scaling.original_context_length", h.rope_orig_ctx)
    w.add_uint32(a + "leading_dense_block_count", 0)
    w.add_uint32(a + "expert_count", h.n_expert)
    w.add_uint32(a + "expert_used_count", h.n_expert_used)
    w.add_uint32(a + "expert_feed_forward_length", h.n_ff_exp)
    w.add_uint32(a + "expert_shared_count", h.n_expert_shared)
    w.add_float32(a + "expert_weights_scale", h.expert_weights_scale)
    w.add_bool(a + "expert_weights_norm", True)
    w.add_uint32(a + "expert_gating_func", 4)                   # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
    w.add_array(a + "swiglu_clamp_exp", [float(h.swiglu_limit)] * h.n_layers)
    w.add_array(a + "swiglu_clamp_shexp", [float(h.swiglu_limit)] * h.n_layers)
    w.add_uint32(a + "hyper_connection.count", h.hc)
    w.add_uint32(a + "hyper_connection.sinkhorn_iterations", h.hc_sinkhorn_iters)
    w.add_float32(a + "hyper_connection.epsilon", h.hc_eps)
    w.add_uint32(a + "hash_layer_count", h.hash_layers)
    w.add_uint32(a + "vocab_size", h.n_vocab)
    w.add_tokenizer_model("no_vocab")


def synth_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, h: DeepSeek4Hparams):
    """The index table (I32), and the small parameters the fused ggml_dsv4_* ops need in F32, with values that
    keep the mixing well conditioned (hyper-connection scales positive)."""
    if name.endswith("ffn_gate_tid2eid.weight"):           # token -> n_expert_used distinct experts
        return np.argsort(rng.random((shape[0], h.n_expert)), axis=1)[:, :shape[1]].astype(np.int32), "I32"
    if "hc_" in name and name.endswith("fn.weight"):
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32), "F32"
    if "hc_" in name and name.endswith("base.weight"):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32), "F32"
    if "hc_" in name and name.endswith("scale.weight"):
        return (0.5 + rng.random(shape)).astype(np.float32), "F32"
    if name.endswith(("_ape.weight", "attn_sinks.weight")):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32), "F32"
    return None


ARCHS = [Arch("deepseek4", frozenset(), TENSORS, parse, write_metadata, unsupported=UNSUPPORTED,
              synth_tensor=synth_tensor)]

REAL = (0, 0) + (CSA, HCA) * 20 + (CSA,)          # DeepSeek-V4-Flash: 43 layers
_FLASH = DeepSeek4Hparams("deepseek4", 43, 4096, 64, 1, 512, 256, 6, 2048, 129280, n_ff_shexp=2048, rope_base=10000.0,
                          expert_weights_scale=1.5, n_ctx_train=1048576, compress_ratios=REAL)
PRESETS = {
    # 6 small layers: 2 sliding-window-only (hash-routed), 2 CSA (one hashed), 2 HCA; window 16, indexer top-8
    "deepseek4-tiny": Preset(DeepSeek4Hparams(
        "deepseek4", 6, 64, 4, 1, 128, 8, 3, 64, 1024, n_ff_shexp=64, rope_base=10000.0, expert_weights_scale=1.5,
        n_ctx_train=65536, n_rot=32, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        compress_ratios=(0, 0, CSA, HCA, CSA, HCA), hash_layers=3, n_swa=16, idx_heads=4, idx_head_dim=64, idx_top_k=8,
        rope_factor=4.0, rope_orig_ctx=2048, swiglu_limit=2.5), dtype="f32"),
    # the real layer shapes of the two layer types 41 of its 43 layers have (CSA, HCA); layer 0 hash-routed
    "deepseek-v4-flash-2l": Preset(replace(_FLASH, n_layers=2, compress_ratios=(CSA, HCA), hash_layers=1),
                                   dtype="mxfp4"),
    "deepseek-v4-flash": Preset(_FLASH, dtype="mxfp4"),
}
