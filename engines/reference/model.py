"""The MoE transformer in one readable file (gpt-fast style): weights, static KV cache, and separate
prefill / decode functions. Hyperparameters and per-architecture features come from archs.py.

Semantics follow llama.cpp's graphs (src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp):
RMSNorm everywhere, attention scale 1/sqrt(head_dim), router = softmax over all experts then top-k
(build_moe_ffn with GATING_FUNC_SOFTMAX), SiLU-gated experts; the features (archs.FEATURES) add
NEOX RoPE, q/k norms per head or over the whole projection, qkv biases, renormalized top-k weights and
a sigmoid-gated shared expert.

The residual stream and every norm/softmax are f32 (as in ggml); matmuls run in the compute dtype.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.reference.archs import Hparams


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor                 # (D,) f32
    wqkv: torch.Tensor                      # (q_dim + 2*kv_dim, D)  q, k, v projections stacked
    bqkv: torch.Tensor | None               # (q_dim + 2*kv_dim,)    qwen2moe
    q_norm: torch.Tensor | None             # (head_dim,) qwen3moe | (D,) olmoe, f32
    k_norm: torch.Tensor | None             # (head_dim,) | (D,), f32
    wo: torch.Tensor                        # (D, q_dim)
    ffn_norm: torch.Tensor                  # (D,) f32
    router: torch.Tensor                    # (E, D) f32: routing decisions as exact as ggml's
    shexp_gate_inp: torch.Tensor | None     # (D,) f32, qwen2moe: sigmoid gate of the shared expert
    shexp_gate_up: torch.Tensor | None      # (2*ff_sh, D)
    shexp_down: torch.Tensor | None         # (D, ff_sh)


@dataclass
class ModelWeights:
    token_embd: torch.Tensor                # (V, D)
    output_norm: torch.Tensor               # (D,) f32
    output: torch.Tensor                    # (V, D), the embedding itself when tied
    layers: list[LayerWeights]


def rope_tables(cfg: Hparams, n_ctx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (n_ctx, head_dim) f32 such that rope(x) = x*cos + rotate(x)*sin, with
    theta_i = pos * base^(-2i/head_dim) (ggml_rope_ext, no scaling). NEOX pairs value i with i+hd/2,
    NORM pairs 2i with 2i+1; the sign of the rotation is folded into sin."""
    inv = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    ang = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv[None, :]      # (n_ctx, hd/2)
    c, s = ang.cos().float(), ang.sin().float()
    if cfg.has("rope_neox"):
        cos, sin = torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)
    else:
        cos, sin = torch.stack((c, c), dim=-1).flatten(-2), torch.stack((-s, s), dim=-1).flatten(-2)
    return cos.to(device), sin.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x: (n, heads, hd) f32; cos/sin: (n, 1, hd) from rope_tables. rotate(x) swaps the two values of
    each pair: (x[i+hd/2], x[i]) for NEOX, (x[2i+1], x[2i]) for NORM; one flip, one multiply-add."""
    n, h, hd = x.shape
    pairs = x.reshape(n, h, 2, hd // 2) if neox else x.reshape(n, h, hd // 2, 2)
    rotated = pairs.flip(2 if neox else 3).view(n, h, hd)
    return torch.addcmul(x * cos, rotated, sin)


def attention(cfg: Hparams, lw: LayerWeights, qk_norm: torch.Tensor | None, Kc: torch.Tensor, Vc: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, pos: int, dtype: torch.dtype,
              linear=F.linear, norm=F.rms_norm) -> torch.Tensor:
    """x: (n, D) f32 residual -> attention output (n, D) f32, writing K/V into the layer's cache
    Kc, Vc (Hkv, n_ctx, hd) at pos..pos+n-1. cos/sin: rope_tables; qk_norm: Transformer.qk_norm;
    linear, norm: F.linear and F.rms_norm, or the decode kernels' drop-ins (kernels.DecodeKernels)."""
    n, H, Hkv, hd = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
    h = norm(x, (cfg.n_embd,), lw.attn_norm, cfg.rms_eps).to(dtype)
    qkv = linear(h, lw.wqkv, lw.bqkv).float()                             # (n, q + 2kv)
    if cfg.has("qk_norm_full"):                                         # olmoe: over the whole projection
        q, k, v = qkv.split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
        qk = torch.cat((norm(q, (cfg.q_dim,), lw.q_norm, cfg.rms_eps),
                        norm(k, (cfg.kv_dim,), lw.k_norm, cfg.rms_eps)), dim=-1)
    else:
        qk, v = qkv.split((cfg.q_dim + cfg.kv_dim, cfg.kv_dim), dim=-1)
    qk = qk.view(n, H + Hkv, hd)                                           # q heads, then k heads
    if cfg.has("qk_norm_head"):                                         # qwen3moe: per head
        qk = norm(qk, (hd,), None, cfg.rms_eps) * qk_norm
    qk = apply_rope(qk, cos[pos:pos + n, None, :], sin[pos:pos + n, None, :], cfg.has("rope_neox")).to(Kc.dtype)
    q, k = qk[:, :H], qk[:, H:]                                            # (n, H, hd), (n, Hkv, hd)
    end = pos + n
    Kc[:, pos:end] = k.transpose(0, 1)
    Vc[:, pos:end] = v.view(n, Hkv, hd).transpose(0, 1)
    K, V = Kc[:, :end], Vc[:, :end]                                        # (Hkv, end, hd)
    if n == 1:   # decode: plain batched matmuls; on CPU 10x faster than SDPA for one query at 4K context
        qg = q.view(Hkv, H // Hkv, hd)                                     # head h reads kv head h // (H/Hkv)
        att = torch.softmax((qg @ K.transpose(1, 2)).float() * hd ** -0.5, dim=-1)   # (Hkv, G, end)
        o = (att.to(Kc.dtype) @ V).reshape(1, cfg.q_dim)                  # (1, H*hd)
        return linear(o.to(dtype), lw.wo).float()
    q, K, V = q.transpose(0, 1)[None], K[None], V[None]                    # (1, H, n, hd), (1, Hkv, end, hd)
    if pos == 0:
        o = F.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True)
    else:   # a later ubatch: query i sits at pos+i and sees keys 0..pos+i
        mask = torch.ones(n, end, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)
    o = o[0].transpose(0, 1).reshape(n, cfg.q_dim)                        # (n, H*hd)
    return F.linear(o.to(dtype), lw.wo).float()


def route(cfg: Hparams, lw: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h: (n, D) f32 normed -> expert weights (n, k) f32 and ids (n, k)."""
    logits = F.linear(h, lw.router)                                        # (n, E)
    if cfg.has("norm_topk"):   # softmax over all experts, top-k, renormalized == softmax of the top-k logits
        top, ids = logits.topk(cfg.n_expert_used, dim=-1)
        w = torch.softmax(top, dim=-1)
    else:
        w, ids = torch.softmax(logits, dim=-1).topk(cfg.n_expert_used, dim=-1)
    if cfg.expert_weights_scale not in (0.0, 1.0):
        w = w * cfg.expert_weights_scale
    return w, ids


def shared_expert(lw: LayerWeights, h: torch.Tensor, hc: torch.Tensor, linear=F.linear) -> torch.Tensor:
    """qwen2moe's sigmoid-gated shared expert: h (n, D) f32, hc its compute-dtype copy -> (n, D) f32."""
    gate = torch.sigmoid(h @ lw.shexp_gate_inp)[:, None]                   # (n, 1)
    a, b = linear(hc, lw.shexp_gate_up).chunk(2, dim=-1)                  # (n, ff_sh) each
    return gate * linear(F.silu(a) * b, lw.shexp_down).float()


class Transformer:
    """Weights + static KV cache. `moe(il, h, ids, w)` (engines.reference.offload) runs the experts."""

    def __init__(self, cfg: Hparams, weights: ModelWeights, moe, n_ctx: int,
                 device: torch.device, dtype: torch.dtype, kernels=None):
        self.cfg, self.w, self.moe, self.n_ctx, self.device, self.dtype = cfg, weights, moe, n_ctx, device, dtype
        # kernels: None, or kernels.DecodeKernels (bf16 on CPU): single rows of F.linear / F.rms_norm, and
        # the one-token attention and routing fused into one call each (self.fused)
        self.linear = kernels.linear if kernels else F.linear
        self.norm = kernels.norm if kernels else F.rms_norm
        self.fused = kernels
        # KV cache (and attention math) in f32 on CPU: ATen's bf16 batched matmul has no fast kernel
        # (decode at 4K context: 1.6 ms vs 0.26 ms per layer for f32) and f32 SDPA prefill runs as fast
        # as bf16; on CUDA the cache uses the compute dtype.
        self.kv_dtype = torch.float32 if device.type == "cpu" else dtype
        kv_shape = (cfg.n_layers, cfg.n_head_kv, n_ctx, cfg.head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=device)   # (L, Hkv, n_ctx, hd)
        self.v_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=device)
        # Per-layer views and tables made once: single-token decode is bound by per-op overhead.
        self.k_layers, self.v_layers = self.k_cache.unbind(0), self.v_cache.unbind(0)   # (Hkv, n_ctx, hd) each
        self.cos, self.sin = rope_tables(cfg, n_ctx, device)                # (n_ctx, hd)
        # qwen3moe: q and k are normed per head with different weights; one (H + Hkv, hd) weight
        # (q_norm per q head, then k_norm per kv head; 6 KiB a layer) normalizes both in one call.
        H, Hkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.qk_norm = [torch.cat((lw.q_norm.expand(H, hd), lw.k_norm.expand(Hkv, hd)))
                        for lw in weights.layers] if cfg.has("qk_norm_head") else None

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def _attention(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        if self.fused is not None and x.shape[0] == 1:
            return self.fused.attention(self.cfg, self.w.layers[il], self.k_layers[il], self.v_layers[il], self.cos,
                                        self.sin, x, pos)
        qk_norm = self.qk_norm[il] if self.qk_norm else None
        return attention(self.cfg, self.w.layers[il], qk_norm, self.k_layers[il], self.v_layers[il],
                         self.cos, self.sin, x, pos, self.dtype, self.linear, self.norm)

    def _ffn(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """x: (n, D) f32 residual -> MoE output (n, D) f32 (plus qwen2moe's gated shared expert)."""
        cfg, lw = self.cfg, self.w.layers[il]
        if self.fused is not None and x.shape[0] == 1:
            h, w, ids = self.fused.norm_route(cfg, lw, x)
        else:
            h = self.norm(x, (cfg.n_embd,), lw.ffn_norm, cfg.rms_eps)     # (n, D) f32
            w, ids = route(cfg, lw, h)                                     # (n, k) each
        hc = h.to(self.dtype)
        out = self.moe(il, hc, ids, w)                                     # (n, D) f32
        if cfg.has("shared_expert_gated"):
            out = out + shared_expert(lw, h, hc, self.linear)
        return out

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        """tokens: (n,) at positions pos..pos+n-1 -> logits (n, V) or (1, V) f32."""
        x = F.embedding(tokens, self.w.token_embd).float()                 # (n, D)
        self.moe.begin_batch(tokens.shape[0])
        for il in range(self.cfg.n_layers):
            x = x + self._attention(il, x, pos)
            x = x + self._ffn(il, x)
        if not all_logits:
            x = x[-1:]
        x = self.norm(x, (self.cfg.n_embd,), self.w.output_norm, self.cfg.rms_eps).to(self.dtype)
        return self.linear(x, self.w.output).float()                        # (n|1, V)


def prefill(model: Transformer, tokens: torch.Tensor, pos: int, n_ubatch: int, all_logits: bool) -> torch.Tensor:
    """Process tokens (n,) from pos in n_ubatch chunks; logits of every position or of the last."""
    outs = []
    for s in range(0, tokens.shape[0], n_ubatch):
        chunk = tokens[s:s + n_ubatch]
        outs.append(model.forward(chunk, pos + s, all_logits))
    return torch.cat(outs) if all_logits else outs[-1]


def decode(model: Transformer, token: torch.Tensor, pos: int) -> torch.Tensor:
    """One token (1,) at pos -> logits (1, V).

    oneDNN is switched off for decode: for a single row its bf16 GEMV streams weights at ~15 GB/s on
    Zen4, while ATen's own bf16/f16 GEMV kernel reaches ~35 GB/s (measured, 2 threads); for
    prefill-sized batches oneDNN's bf16 GEMM is ~3x faster than ATen's, so prefill keeps it.
    With bf16 compute on an avx512_bf16 CPU, engines.reference.kernels takes over the single-token
    steps: every single-row product (AVX512-BF16 GEMV, weights on huge pages: ~45 GB/s vs ATen's
    compute-bound ~27), the routed experts, and, fused into one call per layer each, the attention
    block (Transformer.fused.attention) and the ffn norm + routing. On `small` (2 Zen4 threads) that
    took decode from ~7 ms a token (ATen: ~5 ms of GEMVs + ~2 ms of per-op overhead) to ~4-5 ms, of
    which ~3.3 ms is reading ~150 MB of weights. torch.compile of a whole decode layer (inductor,
    cpp_wrapper) was measured at 4-8% faster for ~25 s of compile: not used."""
    with onednn(False):
        return model.forward(token, pos, all_logits=True)


@contextmanager
def onednn(enabled: bool):
    """Switch oneDNN (mkldnn) kernels for CPU matmuls on or off for a block, restoring the old state."""
    prev = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = prev
