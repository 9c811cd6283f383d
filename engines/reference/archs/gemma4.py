"""gemma4 (gemma-4-26B-A4B; GGUF arch "gemma4", llama.cpp src/models/gemma4.cpp): tensors, hyperparameters,
metadata and presets. The forward pass is engines/reference/models/gemma4.py.

What differs from the common MoE transformer: two kinds of layers (sliding_window_pattern) with their own head
size, kv heads and RoPE (sliding: base rope.freq_base_swa, full rotary; full: rope.freq_base with the
rope_freqs factors, and no attn_v: V is the K projection); q/k RMSNorm per head and a weightless V RMSNorm;
attention scale 1; embeddings times sqrt(n_embd); sandwich norms; a dense GELU MLP beside GELU experts (fused
gate_up, gate rows first) with their own post-norms; a router fed rms(x) * n_embd^-0.5 * ffn_gate_inp.scale;
a per-expert output scale; a per-layer output scalar; final logit softcapping; tied embeddings.

Only the 26B-A4B layout is in the table (every layer MoE, K = V on the full layers, fused expert gate_up, no
per-layer embeddings, no KV sharing): llama.cpp also loads fused attn_qkv, split gate/up experts, expert-less
layers and KV sharing, which no MoE gemma4 file has; parse and the tensor check refuse those in one sentence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.reference.archs.common import Arch, Hparams, Preset, positive, rule

ARCH = "gemma4"
PARTIAL_ROTARY = 0.25      # gemma-4's full layers rotate a quarter of each head (conversion/gemma.py rope_freqs)


@dataclass(frozen=True)
class Gemma4Hparams(Hparams):
    """Base fields n_head_kv, head_dim: the sliding-window layers' (layer 0's in every gemma4 file, so the
    synthesizer's n_gqa is llama-quantize's n_gqa(0)); rope_base: rope.freq_base, the full layers' base.
    n_ff_exp: expert width; n_ff: the dense MLP's width."""
    swa_layers: tuple[bool, ...] = ()    # sliding_window_pattern: True = sliding window
    n_swa: int = 1024                    # attention.sliding_window: a query sees n_swa positions, itself included
    n_head_kv_full: int = 2              # head_count_kv of the full layers
    head_dim_full: int = 512             # attention.key_length (= value_length) of the full layers
    n_rot: int = 0                       # rope.dimension_count_swa: rotary dims of sliding layers (0: head_dim)
    n_rot_full: int = 0                  # rope.dimension_count (0: head_dim_full; rope_freqs masks pairs)
    rope_base_swa: float = 10000.0       # rope.freq_base_swa
    rope_scale: float = 1.0              # full layers' freq_scale: 1/rope.scaling.factor (linear); sliding: 1
    n_ff: int = 2112                     # feed_forward_length: the dense MLP beside the experts
    softcap: float = 30.0                # final_logit_softcapping (llama.cpp's default when absent); 0 = none

    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def rot(self, il: int) -> int:
        return (self.n_rot or self.head_dim) if self.is_swa(il) else (self.n_rot_full or self.head_dim_full)


def _swa(h, i) -> bool:
    return h.is_swa(i)


def _full(h, i) -> bool:
    return not h.is_swa(i)


TENSORS = (   # gemma4.cpp:37-142 in its order; the 26B: sliding layers 22 tensors, full layers 21 (no attn_v)
    rule("token_embd.weight", "embed", lambda h: (h.n_vocab, h.n_embd)),
    rule("blk.{i}.attn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.attn_q.weight", "matrix", lambda h: (h.n_head * h.head_dim, h.n_embd), layers=_swa),
    rule("blk.{i}.attn_q.weight", "matrix", lambda h: (h.n_head * h.head_dim_full, h.n_embd), layers=_full),
    rule("blk.{i}.attn_k.weight", "matrix", lambda h: (h.n_head_kv * h.head_dim, h.n_embd), layers=_swa),
    rule("blk.{i}.attn_k.weight", "matrix", lambda h: (h.n_head_kv_full * h.head_dim_full, h.n_embd), layers=_full),
    rule("blk.{i}.attn_v.weight", "matrix", lambda h: (h.n_head_kv * h.head_dim, h.n_embd), layers=_swa),
    rule("blk.{i}.attn_output.weight", "matrix", lambda h: (h.n_embd, h.n_head * h.head_dim), layers=_swa),
    rule("blk.{i}.attn_output.weight", "matrix", lambda h: (h.n_embd, h.n_head * h.head_dim_full), layers=_full),
    rule("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.head_dim,), layers=_swa),
    rule("blk.{i}.attn_q_norm.weight", "norm", lambda h: (h.head_dim_full,), layers=_full),
    rule("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.head_dim,), layers=_swa),
    rule("blk.{i}.attn_k_norm.weight", "norm", lambda h: (h.head_dim_full,), layers=_full),
    rule("blk.{i}.post_attention_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.layer_output_scale.weight", "vector", lambda h: (1,), optional=True),
    rule("blk.{i}.ffn_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.ffn_gate.weight", "matrix", lambda h: (h.n_ff, h.n_embd)),
    rule("blk.{i}.ffn_up.weight", "matrix", lambda h: (h.n_ff, h.n_embd)),
    rule("blk.{i}.ffn_down.weight", "matrix", lambda h: (h.n_embd, h.n_ff)),
    rule("blk.{i}.post_ffw_norm.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.ffn_gate_inp.weight", "router", lambda h: (h.n_expert, h.n_embd)),
    rule("blk.{i}.ffn_gate_inp.scale", "vector", lambda h: (h.n_embd,)),
    rule("blk.{i}.pre_ffw_norm_2.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.post_ffw_norm_1.weight", "norm", lambda h: (h.n_embd,)),
    rule("blk.{i}.post_ffw_norm_2.weight", "norm", lambda h: (h.n_embd,)),
    # rows [0, f) of each expert are the gate, [f, 2f) the up projection (llama-graph.cpp build_moe_ffn)
    rule("blk.{i}.ffn_gate_up_exps.weight", "expert", lambda h: (h.n_expert, 2 * h.n_ff_exp, h.n_embd)),
    rule("blk.{i}.ffn_down_exps.weight", "expert", lambda h: (h.n_expert, h.n_embd, h.n_ff_exp)),
    # --n-cpu-moe's pattern matches it too (a substring search), so it lives with its layer's experts
    rule("blk.{i}.ffn_down_exps.scale", "expert", lambda h: (h.n_expert,), optional=True),
    rule("output_norm.weight", "norm", lambda h: (h.n_embd,)),
    # created with the first full layer (gemma4.cpp:94-98); required whenever there is one (parse checks)
    rule("rope_freqs.weight", "vector", lambda h: (h.head_dim_full // 2,), optional=True),
)


def _per_layer(meta: ModelMeta, key: str, n: int, default: int | None = None) -> list[int]:
    """A count given as one number or one per layer (llama.cpp's get_key_or_arr), as n numbers."""
    v = meta.get(key, default)
    if not isinstance(v, list):
        return [positive(meta, key, default)] * n
    if len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 1 << 30 for x in v):
        raise UserError(f"{meta.path.name}: {ARCH}.{key} = {v} is not {n} positive numbers (one per layer); "
                        "the file is corrupt.")
    return v


def _one_per_kind(meta: ModelMeta, key: str, values: list[int], swa: tuple[bool, ...]) -> tuple[int, int]:
    """(sliding, full) value of a per-layer count that must be one number per layer kind."""
    kinds = [{v for v, s in zip(values, swa) if s == kind} for kind in (True, False)]
    if any(len(k) > 1 for k in kinds):
        raise UserError(f"{meta.path.name}: {ARCH}.{key} = {values} differs within sliding or full layers; "
                        "the reference engine needs one value per layer kind.")
    return tuple(next(iter(k), 0) for k in kinds)


def parse(meta: ModelMeta) -> Gemma4Hparams:
    """The keys llama.cpp reads for gemma4 (llama-model.cpp load_hparams, gemma4.cpp:4-35), validated."""
    name, n = meta.path.name, meta.n_layers
    pattern = meta.get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or not all(isinstance(b, (bool, int)) for b in pattern):
        raise UserError(f"{name}: {ARCH}.attention.sliding_window_pattern must be an array of bools (one per layer), "
                        f"not {pattern!r}.")
    swa = tuple(bool(b) for b in pattern[:n]) + (False,) * (n - len(pattern))   # missing entries: full layers
    n_embd = positive(meta, "embedding_length")
    heads = set(_per_layer(meta, "attention.head_count", n))
    if len(heads) != 1:
        raise UserError(f"{name}: {ARCH}.attention.head_count differs between layers; the reference engine "
                        "needs one q head count.")
    n_head = heads.pop()
    kv = _per_layer(meta, "attention.head_count_kv", n, n_head)
    kv_swa, kv_full = _one_per_kind(meta, "attention.head_count_kv", kv, swa)
    hd_full = positive(meta, "attention.key_length", n_embd // n_head)
    hd_swa = positive(meta, "attention.key_length_swa")                    # required (gemma4.cpp:19)
    if positive(meta, "attention.value_length", hd_full) != hd_full or \
            positive(meta, "attention.value_length_swa") != hd_swa:
        raise UserError(f"{name}: gemma4 needs value_length == key_length for both layer kinds (gemma4.cpp:43-48).")
    rot_full = positive(meta, "rope.dimension_count", hd_full)
    rot_swa = positive(meta, "rope.dimension_count_swa", rot_full)         # default: the full layers' value
    n_expert, n_used = positive(meta, "expert_count"), positive(meta, "expert_used_count")
    if any(n_head % k for k in kv) or n_used > n_expert or meta.n_vocab <= 0:
        raise UserError(f"{name}: head_count {n_head} is not a multiple of head_count_kv {kv}, expert_used_count "
                        f"{n_used} > expert_count {n_expert}, or the vocabulary is empty; the file is corrupt.")
    if rot_full > hd_full or rot_swa > hd_swa or rot_full % 2 or rot_swa % 2 or hd_full % 2 or hd_swa % 2:
        raise UserError(f"{name}: RoPE dimensions {rot_swa} / {rot_full} must be even and at most the head sizes "
                        f"{hd_swa} / {hd_full} (llama.cpp asserts n_dims <= ne0).")
    if meta.get("embedding_length_per_layer_input") is None:
        raise UserError(f"{name}: metadata key {ARCH}.embedding_length_per_layer_input is missing; llama.cpp "
                        "requires it (0 for gemma-4-26B-A4B).")
    if meta.get("embedding_length_per_layer_input") != 0 or meta.get("attention.shared_kv_layers", 0) != 0:
        raise UserError(f"{name}: per-layer embeddings or shared KV layers (gemma-4 E2B/E4B features) are not "
                        "supported by the reference engine; it runs gemma-4-26B-A4B's layout.")
    scaling = meta.get("rope.scaling.type", "linear")
    factor = meta.get("rope.scaling.factor", 0.0)
    if scaling not in ("none", "linear") or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not 0 <= factor < 1e6:
        raise UserError(f"{name}: rope scaling {scaling!r} with factor {factor!r} is not supported for gemma4 "
                        "(none or linear).")
    softcap = meta.get("final_logit_softcapping", 30.0)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < 1e6:
        raise UserError(f"{name}: {ARCH}.final_logit_softcapping = {softcap!r} is not a valid cap.")
    if not all(swa) and "rope_freqs.weight" not in {t.name for t in meta.tensors}:
        raise UserError(f"{name}: the file has full-attention layers but no rope_freqs.weight, which llama.cpp "
                        "requires; the file is corrupt.")
    return Gemma4Hparams(
        arch=ARCH, n_layers=n, n_embd=n_embd, n_head=n_head, n_head_kv=kv_swa or kv_full, head_dim=hd_swa,
        n_expert=n_expert, n_expert_used=n_used, n_ff_exp=positive(meta, "expert_feed_forward_length"),
        n_vocab=meta.n_vocab, rope_base=positive(meta, "rope.freq_base", 10000.0, float),
        rms_eps=positive(meta, "attention.layer_norm_rms_epsilon", kind=float), tied_output=True,
        n_ctx_train=positive(meta, "context_length"),
        swa_layers=swa, n_swa=positive(meta, "attention.sliding_window"), n_head_kv_full=kv_full or kv_swa,
        head_dim_full=hd_full, n_rot=rot_swa, n_rot_full=rot_full,
        rope_base_swa=positive(meta, "rope.freq_base_swa", 10000.0, float),
        rope_scale=1.0 / factor if factor and scaling == "linear" else 1.0,
        n_ff=positive(meta, "feed_forward_length"), softcap=float(softcap))


def write_metadata(w, h: Gemma4Hparams) -> None:
    """Every key llama.cpp reads for gemma4, as conversion/gemma.py writes them (arrays as lists)."""
    n = h.n_layers
    w.add_block_count(n)
    w.add_context_length(h.n_ctx_train)
    w.add_embedding_length(h.n_embd)
    w.add_feed_forward_length(h.n_ff)
    w.add_head_count(h.n_head)
    w.add_head_count_kv([h.n_head_kv if h.is_swa(il) else h.n_head_kv_full for il in range(n)])
    w.add_key_length(h.head_dim_full)
    w.add_value_length(h.head_dim_full)
    w.add_key_length_swa(h.head_dim)
    w.add_value_length_swa(h.head_dim)
    w.add_rope_dimension_count(h.n_rot_full or h.head_dim_full)
    w.add_rope_dimension_count_swa(h.n_rot or h.head_dim)    # its default is the full layers' value: always write
    w.add_rope_freq_base(h.rope_base)
    w.add_rope_freq_base_swa(h.rope_base_swa)
    w.add_sliding_window(h.n_swa)
    w.add_sliding_window_pattern(list(h.swa_layers))         # get_arr: must be an array
    w.add_layer_norm_rms_eps(h.rms_eps)
    w.add_expert_count(h.n_expert)
    w.add_expert_used_count(h.n_expert_used)
    w.add_expert_feed_forward_length(h.n_ff_exp)
    w.add_embedding_length_per_layer_input(0)                # required; 0 = no per-layer embeddings
    w.add_shared_kv_layers(0)
    w.add_final_logit_softcapping(h.softcap)
    w.add_vocab_size(h.n_vocab)
    w.add_tokenizer_model("no_vocab")


def synth_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, h: Gemma4Hparams):
    """The 1-D tensors (F32 in every file type) with values that keep a random gemma4 well conditioned. The
    synthesizer's token_embd has std 1, so the embedding (times sqrt(n_embd)) has RMS sqrt(D) and, through
    the tied head, would give its own token a logit ~sqrt(D) times the others' spread: the post-norms give
    each branch RMS D/4, which shrinks that bonus to ~1.4 sigma (4 layers), and output_norm brings the
    logits to std ~3. Attention has scale 1 (q.k of two RMS-1 heads has std sqrt(hd)): q/k norms (4/hd)^(1/4) give
    scores std ~2. The router sees rms(x) * D^-0.5 * scale: a scale of 2 sqrt(D) gives logits std ~2, so
    top-k choices are rarely near ties. rope_freqs: the proportional RoPE of the real file, 1 for the first
    quarter of the pairs and 1e30 (no rotation) for the rest."""
    if len(shape) != 1:
        return None
    noisy = lambda scale: ((scale * (1.0 + 0.1 * rng.standard_normal(shape))).astype(np.float32), "F32")
    d = h.n_embd
    if name == "rope_freqs.weight":
        rotated = int(shape[0] * PARTIAL_ROTARY)
        return np.array([1.0] * rotated + [1e30] * (shape[0] - rotated), dtype=np.float32), "F32"
    if name == "output_norm.weight":
        return noisy(3.0 / math.sqrt(d))
    if name.endswith(("post_attention_norm.weight", "post_ffw_norm.weight")):
        return noisy(d / 4)
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return noisy((4.0 / shape[0]) ** 0.25)
    if name.endswith("ffn_gate_inp.scale"):
        return noisy(2.0 * math.sqrt(d))
    if name.endswith(("layer_output_scale.weight", "ffn_down_exps.scale")):
        return rng.uniform(0.6, 1.3, shape).astype(np.float32), "F32"
    return None


FEATURES = frozenset({"rope_neox", "qk_norm_head", "norm_topk", "sliding_window", "gelu_experts", "dense_ffn",
                      "sandwich_norms", "logit_softcap", "embed_scale", "partial_rope", "v_norm", "k_eq_v",
                      "rope_freq_factors", "attn_scale_one", "swa_layer_shapes", "router_input_scale",
                      "expert_out_scale", "layer_output_scale"})
def kv_layout(h: Gemma4Hparams) -> list[tuple[int, int, int]]:
    """Sliding layers: n_head_kv x head_dim; full layers: n_head_kv_full x head_dim_full (their V is K, but
    llama.cpp still writes it to its own V cache)."""
    return [(h.n_head_kv, h.head_dim, h.head_dim) if h.is_swa(i) else (h.n_head_kv_full, h.head_dim_full,
                                                                        h.head_dim_full) for i in range(h.n_layers)]


ARCHS = [Arch(ARCH, FEATURES, TENSORS, parse, write_metadata, model="engines.reference.models.gemma4:Gemma4",
              activation="gelu", synth_tensor=synth_tensor, kv_layout=kv_layout)]


def _h(n_layers: int, n_embd: int, n_head: int, kv_swa: int, hd_swa: int, kv_full: int, hd_full: int,
       n_expert: int, n_used: int, n_ff_exp: int, n_ff: int, n_vocab: int, n_swa: int, swa: tuple[bool, ...],
       softcap: float = 30.0, n_ctx_train: int = 262144) -> Gemma4Hparams:
    """gemma-4-26B-A4B's constants (RoPE bases 1e6 / 1e4, eps 1e-6) around a shape."""
    return Gemma4Hparams(ARCH, n_layers, n_embd, n_head, kv_swa, hd_swa, n_expert, n_used, n_ff_exp, n_vocab,
                         rope_base=1e6, rms_eps=1e-6, tied_output=True, n_ctx_train=n_ctx_train, swa_layers=swa,
                         n_swa=n_swa, n_head_kv_full=kv_full, head_dim_full=hd_full, rope_base_swa=1e4, n_ff=n_ff,
                         softcap=softcap)


REAL_PATTERN = tuple(il % 6 != 5 for il in range(30))     # 5 sliding + 1 full, repeating (model_shapes.md s.3)

PRESETS = {
    # tests: sliding, full, sliding, full; window 24 (a ~100-token prompt and 16-token ubatches cross it);
    # every row a multiple of 256 so the iq4_xs file keeps IQ4_XS experts; 16 experts (llama-quantize bumps
    # attn_k/v with exactly 8); softcap 10 so the tanh bends logits of O(3)
    "gemma4-tiny": Preset(_h(4, 256, 4, 2, 64, 1, 128, 16, 4, 256, 256, 512, 24, (True, False, True, False),
                             softcap=10.0, n_ctx_train=4096), dtype="f32"),
    # gemma-4-26B-A4B's layer shapes (model_shapes.md section 3) with 4 of its 30 layers (3 sliding + its full
    # layer) and a 32K vocab (the 262144-row tied head alone would outweigh 4 layers' active experts). Its
    # published format is IQ4_XS, whose 704- and 2112-wide rows (ffn_down_exps, ffn_down) llama-quantize stores
    # as IQ4_NL (Q5_1 in the first eighth); both engines compute with those types
    "gemma-4-26b-a4b-4l": Preset(_h(4, 2816, 16, 8, 256, 2, 512, 128, 8, 704, 2112, 32768, 1024,
                                    (True, True, True, False)), dtype="iq4_xs"),
    # the whole gemma-4-26B-A4B: for `moebench plan` on a header-only file
    "gemma-4-26b-a4b": Preset(_h(30, 2816, 16, 8, 256, 2, 512, 128, 8, 704, 2112, 262144, 1024, REAL_PATTERN),
                              dtype="iq4_xs"),
}
