"""gemma4 (gemma-4-26B-A4B) on the common MoE transformer: llama.cpp's src/models/gemma4.cpp graph (build_attn,
build_ffn GELU PAR and build_moe_ffn of src/llama-graph.cpp). Hyperparameters and tensors: archs/gemma4.py.

Per layer (x: the residual (n, D) f32; rms = RMSNorm over the last dim, eps from the file):
    h   = rms(x) * attn_norm
    q   = rope(rms_head(Wq h) * q_norm);  k = rope(rms_head(Wk h) * k_norm);  v = rms_head(Wv h or Wk h)
    a   = x + rms(Wo softmax(q k^T + mask) v) * post_attention_norm      scale 1, window on sliding layers
    u   = rms(a)                                                          shared by the three FFN inputs
    mlp = rms(down(gelu(gate(u * ffn_norm)) * up(u * ffn_norm))) * post_ffw_norm_1
    moe = rms(experts(u * pre_ffw_norm_2; top-k of softmax(router(u * D^-0.5 * ffn_gate_inp.scale)))) * post_ffw_norm_2
    x   = (a + rms(mlp + moe) * post_ffw_norm) * layer_output_scale
Embeddings times sqrtf(D); head: rms(x) * output_norm, tied token_embd, cap * tanh(logits / cap).

Numerics that follow llama.cpp's CPU backend rather than the textbook: the GELU of the dense MLP (and of the
experts) is offload.Activation("gelu"), ggml's f16 lookup table (GGML_GELU_FP16: ~1e-3 relative off the exact
GELU, enough to flip near-tied expert choices downstream); the RoPE angles are ggml's float32 recurrence
theta_i = theta_{i-1} * base^(-2/n) (ggml_rope_cache_init), not base^(-2i/n) in double.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engines.reference.models.transformer import Transformer, apply_rope, kv_window, route
from engines.reference.offload import Activation


def rope_cache(n_ctx: int, n_rot: int, base: float, freq_scale: float = 1.0,
               factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n_ctx, n_rot) f32 in transformer.apply_rope's NEOX layout (cos = [c, c], sin = [-s, s]), the angles
    as ggml computes them (ops.cpp ggml_rope_cache_init / rope_yarn without YaRN): theta_0 = pos, theta_i =
    theta_{i-1} * powf(base, -2/n_rot) in float32, then theta_i / factors[i] * freq_scale. A factor of 1e30
    (gemma4's rope_freqs beyond the rotated quarter) leaves its pair unrotated (cos 1, sin ~0)."""
    half = n_rot // 2
    step = np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot))
    theta = np.empty((n_ctx, half), dtype=np.float32)
    t = np.arange(n_ctx, dtype=np.float32)
    for i in range(half):
        theta[:, i] = t
        t = t * step
    if factors is not None:
        theta /= factors[:half].cpu().numpy().astype(np.float32)
    theta *= np.float32(freq_scale)
    c, s = torch.from_numpy(np.cos(theta)), torch.from_numpy(np.sin(theta))
    return torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX RoPE of the first n_rot = cos.shape[-1] dims of each head, the rest unchanged.
    x: (n, heads, hd); cos, sin: (n, 1, n_rot)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin, neox=True)
    return torch.cat((apply_rope(x[..., :r], cos, sin, neox=True), x[..., r:]), dim=-1)


class Gemma4(Transformer):
    """The gemma4 forward pass on the common transformer's caches, products and experts executor. Every layer
    keeps a whole-context KV cache, as llama.cpp's default (swa_full) does; a sliding layer reads only the
    rows of its window."""

    PRUNE_LAST_LAYER = False    # gemma4.cpp keeps every row through the last layer (its output rows: after it)

    def make_caches(self) -> list:
        """Per layer (K, V) of (Hkv, n_ctx, hd) for its kind, plus what every token reuses (one-token decode is
        bound by per-op overhead): the RoPE tables of both kinds, the embedding scale, each router's input
        scale and each layer's q/k norm weights."""
        cfg, dev = self.cfg, self.device
        caches = []
        for il in range(cfg.n_layers):
            Hkv, hd = (cfg.n_head_kv, cfg.head_dim) if cfg.is_swa(il) else (cfg.n_head_kv_full, cfg.head_dim_full)
            k = torch.zeros(Hkv, self.n_ctx, hd, dtype=self.cache_dtype, device=dev)
            caches.append((k, torch.zeros_like(k)))
        swa = rope_cache(self.n_ctx, cfg.n_rot or cfg.head_dim, cfg.rope_base_swa)      # sliding: freq_scale 1
        full = rope_cache(self.n_ctx, cfg.n_rot_full or cfg.head_dim_full, cfg.rope_base, cfg.rope_scale,
                          self.top.get("rope_freqs.weight"))
        self.rope = {True: [t.to(dev) for t in swa], False: [t.to(dev) for t in full]}
        self.gelu = Activation("gelu")                                            # ggml's f16-table GELU
        self.emb_scale = float(np.sqrt(np.float32(cfg.n_embd)))                    # sqrtf(n_embd)
        inv = float(np.float32(1.0) / np.sqrt(np.float32(cfg.n_embd)))             # 1/sqrtf(n_embd)
        self.router_scale = [lw["ffn_gate_inp.scale"] * inv for lw in self.layers]  # (D,) each
        # q and k heads are normed and rotated as one (n, H + Hkv, hd) tensor: their norm weights stacked
        self.qk_norm = [torch.cat((lw["attn_q_norm.weight"].expand(cfg.n_head, -1),
                                   lw["attn_k_norm.weight"].expand(K.shape[0], -1))) for lw, (K, _) in
                        zip(self.layers, caches)]                                   # (H + Hkv, hd) each
        return caches

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear.embed(self.top["token_embd.weight"], tokens) * self.emb_scale     # (n, D)

    def block(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        x = x + self.attention(il, x, pos)                                        # attn_out
        x = x + self.ffn(il, x)
        s = self.layers[il].get("layer_output_scale.weight")                      # (1,): the whole residual
        return x * s if s is not None else x

    def attention(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: (n, D) residual at positions pos..pos+n-1 -> post_attention_norm'ed output (n, D); writes the
        layer's K/V rows pos..pos+n-1. A query at p sees keys at p' <= p, on sliding layers p - p' < n_swa."""
        cfg, lw, eps = self.cfg, self.layers[il], self.cfg.rms_eps
        K, V = self.caches[il]
        n, H, (Hkv, _, hd), swa = x.shape[0], cfg.n_head, K.shape, cfg.is_swa(il)
        h = self.linear.norm(x, lw["attn_norm.weight"], eps)
        wv = lw.get("attn_v.weight")                                              # absent: V is the K projection
        proj = [self.linear(h, w) for w in (lw["attn_q.weight"], lw["attn_k.weight"], wv) if w is not None]
        r = self.linear.norm(torch.cat(proj, dim=-1).view(n, -1, hd), None, eps)   # (n, H+Hkv[+Hkv], hd) per head
        cos, sin = self.rope[swa]
        c, s = cos[pos:pos + n, None], sin[pos:pos + n, None]                     # (n, 1, n_rot)
        qk = rope(r[:, :H + Hkv] * self.qk_norm[il], c, s)                        # q_norm, k_norm, then RoPE
        v = r[:, H + Hkv:] if wv is not None else r[:, H:]                        # no weight, no RoPE
        end = pos + n
        K[:, pos:end] = qk[:, H:].transpose(0, 1)
        V[:, pos:end] = v.transpose(0, 1)
        lo = max(0, pos - cfg.n_swa + 1) if swa else 0                            # the first query's oldest key
        if n == 1:   # decode: every key of the window is visible
            o = self.linear.attend(qk[:, :H], K, V, lo, end, 1.0)                 # scale 1
        else:
            Kw, Vw = kv_window(K, V, lo, end)                                     # (Hkv, T, hd)
            q = qk[:, :H].to(Kw.dtype)
            qp = torch.arange(pos, end, device=x.device)[:, None]
            kp = torch.arange(lo, end, device=x.device)[None, :]
            mask = (kp <= qp) & (qp - kp < cfg.n_swa) if swa else kp <= qp       # (n, T)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], Kw[None], Vw[None], attn_mask=mask,
                                               scale=1.0, enable_gqa=True)        # (1, H, n, hd)
            o = o[0].transpose(0, 1).reshape(n, H * hd)
        o = self.linear(o.float(), lw["attn_output.weight"])
        return self.linear.norm(o, lw["post_attention_norm.weight"], eps)

    def ffn(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """x: (n, D) attn_out -> post_ffw_norm(post_ffw_norm_1(dense MLP) + post_ffw_norm_2(experts)) (n, D).
        The router reads attn_out itself (normed, scaled), not the experts' pre_ffw_norm_2 input."""
        cfg, lw, eps = self.cfg, self.layers[il], self.cfg.rms_eps
        u = self.linear.norm(x, None, eps)                                        # (n, D)
        h = u * lw["ffn_norm.weight"]
        a = self.gelu(self.linear(h, lw["ffn_gate.weight"]), self.linear(h, lw["ffn_up.weight"]))   # (n, n_ff)
        mlp = self.linear.norm(self.linear(a, lw["ffn_down.weight"]), lw["post_ffw_norm_1.weight"], eps)
        w, ids = route(cfg, lw, self.linear, u * self.router_scale[il])          # (n, k) each
        moe = self.moe(il, u * lw["pre_ffw_norm_2.weight"], ids, w)              # per-expert scale inside
        moe = self.linear.norm(moe, lw["post_ffw_norm_2.weight"], eps)
        return self.linear.norm(mlp + moe, lw["post_ffw_norm.weight"], eps)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(m, D) -> logits (m, V): output_norm, the tied head, cap * tanh(logits / cap)."""
        cfg = self.cfg
        logits = self.linear(self.linear.norm(x, self.top["output_norm.weight"], cfg.rms_eps),
                             self.top["output.weight"])
        return torch.tanh(logits * (1.0 / cfg.softcap)) * cfg.softcap if cfg.softcap else logits
