"""The common MoE transformer: qwen3moe, qwen2moe, olmoe and Mixtral-style llama (llama.cpp's
src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp share this block), and their synthesizer presets."""
from __future__ import annotations

from functools import partial

from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.reference.archs.common import Arch, Hparams, Preset, common_hparams, positive, rule, write_common

TENSORS = (    # in file order (the synthesizer writes them so; same preset + seed = same bytes)
    rule("token_embd.weight", "embed", lambda h: (h.n_vocab, h.n_embd)),
    rule("blk.{i}.attn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.attn_q.weight", "matrix", lambda h: (h.q_dim, h.n_embd)),
    rule("blk.{i}.attn_k.weight", "matrix", lambda h: (h.kv_dim, h.n_embd)),
    rule("blk.{i}.attn_v.weight", "matrix", lambda h: (h.kv_dim, h.n_embd)),
    rule("blk.{i}.attn_output.weight", "matrix", lambda h: (h.n_embd, h.q_dim)),
    rule("blk.{i}.ffn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.ffn_gate_inp.weight", "router", lambda h: (h.n_expert, h.n_embd)),
    rule("blk.{i}.ffn_gate_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_up_exps.weight", "expert", lambda h: (h.n_expert, h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_down_exps.weight", "expert", lambda h: (h.n_expert, h.n_embd, h.n_ff_exp)),
    rule("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.head_dim,), "qk_norm_head"),
    rule("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.head_dim,), "qk_norm_head"),
    rule("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.q_dim,), "qk_norm_full"),
    rule("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.kv_dim,), "qk_norm_full"),
    rule("blk.{i}.attn_q.bias", "bias", lambda h: (h.q_dim,), "qkv_bias"),
    rule("blk.{i}.attn_k.bias", "bias", lambda h: (h.kv_dim,), "qkv_bias"),
    rule("blk.{i}.attn_v.bias", "bias", lambda h: (h.kv_dim,), "qkv_bias"),
    rule("blk.{i}.ffn_gate_inp_shexp.weight", "vector", lambda h: (h.n_embd,), "shared_expert_gated"),
    rule("blk.{i}.ffn_gate_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd), "shared_expert_gated"),
    rule("blk.{i}.ffn_up_shexp.weight", "matrix", lambda h: (h.n_ff_shexp, h.n_embd), "shared_expert_gated"),
    rule("blk.{i}.ffn_down_shexp.weight", "matrix", lambda h: (h.n_embd, h.n_ff_shexp), "shared_expert_gated"),
    rule("output_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("output.weight", "output", lambda h: (h.n_vocab, h.n_embd), optional=True),
)


def parse(meta: ModelMeta, features: frozenset[str]) -> Hparams:
    h = Hparams(**common_hparams(meta, "shared_expert_gated" in features))
    if positive(meta, "attention.value_length", h.head_dim) != h.head_dim or \
            positive(meta, "rope.dimension_count", h.head_dim) != h.head_dim:
        raise UserError(f"{meta.path.name}: key/value lengths and rope dimensions differ; "
                        "the reference engine needs them equal.")
    if h.head_dim % 2 or h.n_head % h.n_head_kv or h.n_vocab <= 0:
        raise UserError(f"{meta.path.name}: odd head size {h.head_dim}, head_count {h.n_head} not a multiple of "
                        f"head_count_kv {h.n_head_kv}, or an empty vocabulary; the file is corrupt.")
    if "qk_norm_full" in features and not h.q_dim == h.kv_dim == h.n_embd:
        raise UserError(f"{meta.path.name}: olmoe needs head_count_kv == head_count and head_count*key_length == "
                        "embedding_length (llama.cpp sizes its q/k norms n_embd).")
    return h


def _arch(name: str, *features: str) -> Arch:
    f = frozenset(features)
    return Arch(name, f, TENSORS, partial(parse, features=f), write_common)


ARCHS = [
    _arch("qwen3moe", "rope_neox", "qk_norm_head", "norm_topk"),
    _arch("qwen2moe", "rope_neox", "qkv_bias", "shared_expert_gated"),
    _arch("olmoe", "rope_neox", "qk_norm_full"),
    _arch("llama", "norm_topk"),          # Mixtral-style: llama with routed experts
]

PRESETS = {
    # a few MB: unit and integration tests
    "tiny": Preset(Hparams("qwen3moe", 4, 128, 4, 2, 32, 8, 2, 64, 1024), dtype="f32"),
    # ~0.9 GB: `make bench`'s model; a decoded token reads ~100 MB of experts, far beyond the CPU caches
    "small": Preset(Hparams("qwen3moe", 8, 1024, 16, 4, 64, 32, 4, 512, 4096)),
    # Qwen3-30B-A3B layer shapes (n_embd 2048, 128 experts, top-8, expert ff 768, 32/4 heads x 128)
    # with 4 of its 48 layers and a 32K vocab: ~5 GB in f16
    "qwen3-30b-a3b-4l": Preset(Hparams("qwen3moe", 4, 2048, 32, 4, 128, 128, 8, 768, 32768)),
}
