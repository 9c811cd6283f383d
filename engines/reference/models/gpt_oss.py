"""gpt-oss's forward pass (llama.cpp src/models/openai-moe.cpp), as the common Transformer's subclass.

Per layer il (sliding window when cfg.is_swa(il): even layers by default), x the (n, D) f32 residual:
  h     = rms_norm(x) * attn_norm
  q,k,v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv                     heads of hd = n_rot
  q,k   = NEOX RoPE with YaRN (cos and sin carry ggml's mscale, so q.k carries it squared)
  p     = softmax([q.k / sqrt(hd) masked, sink_h])[:-1]               a sink logit per q head, unscaled;
          masked: causal, and on sliding layers q_pos - k_pos >= n_swa (n_swa keys, the query's own included)
  x     = x + (p V) Wo^T + bo
  h     = rms_norm(x) * post_attention_norm                           the FFN's input norm
  ids   = top-k of r = h Wr^T + br; w = softmax(r[ids])               SOFTMAX_WEIGHT gating
  x     = x + sum_j w_j (swiglu_oai(h Wg^T + bg, h Wu^T + bu) Wd^T + bd)[ids_j]   (MoEExecutor)
logits = rms_norm(x) * output_norm @ output^T                         untied head, no softcap

Sources: openai-moe.cpp (graph), llama-graph.cpp (build_attn_mha, build_moe_ffn), llama-hparams.h
(is_masked_swa), ggml-cpu ops.cpp (rope_yarn, soft_max with sinks, swiglu_oai). KV caches are n_ctx long on
every layer, as llama.cpp's default swa_full keeps them; a sliding layer reads only its window.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engines.reference.archs.gpt_oss import GptOssHparams
from engines.reference.models.transformer import Transformer, apply_rope, kv_window

BETA_FAST, BETA_SLOW = 32.0, 1.0      # llama.cpp's YaRN defaults; gpt-oss's GGUF keys for them are not read


def yarn_tables(h: GptOssHparams, base: float, n_ctx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n_ctx, 1, hd) f32 in transformer.apply_rope's NEOX layout, exactly as ggml's rope cache computes them
    in f32 (ops.cpp ggml_rope_cache_init / rope_yarn, ggml.c ggml_rope_yarn_corr_dims; parameters from
    llama-context.cpp:165-214): theta_i = pos * theta_scale^i by repeated f32 multiplication; YaRN blends
    freq_scale * theta (pairs past `high`) with theta (pairs up to `low`) linearly and multiplies cos and sin
    by mscale = attn_factor * (1 + 0.1 ln(1/freq_scale)), where llama.cpp's attn_factor cancels that term
    (so mscale = 1 + 0.1 ln 32 for gpt-oss: not 1)."""
    f32, nd = np.float32, h.head_dim
    fs = f32(1) if h.rope_scaling == "none" or not h.rope_factor else f32(1) / f32(h.rope_factor)
    ext = h.rope_scaling == "yarn"
    mscale = f32(h.rope_attn_factor)
    if ext:   # attn_factor = get_mscale(factor) * 1/grow (llama-context.cpp; 1 up to rounding), times grow in ggml
        grow = f32(1) + f32(0.1) * np.log(f32(1) / fs)
        mscale = f32(f32((grow if fs < 1 else f32(1)) * (f32(1) / grow)) * mscale) * grow

    def corr(beta: float) -> np.float32:
        return f32(nd * np.log(f32(h.n_ctx_orig) / (f32(beta) * 2 * f32(np.pi))) / (2 * np.log(f32(base))))
    low, high = max(f32(0), np.floor(corr(BETA_FAST))), min(f32(nd - 1), np.ceil(corr(BETA_SLOW)))
    theta_scale = f32(base) ** f32(-2.0 / nd)
    theta = np.arange(n_ctx, dtype=f32)                                    # (n_ctx,) theta_0 = pos
    c, s = np.empty((n_ctx, nd // 2), f32), np.empty((n_ctx, nd // 2), f32)
    for i in range(nd // 2):
        t = fs * theta
        if ext:
            mix = f32(1) - min(f32(1), max(f32(0), (f32(i) - low) / max(f32(0.001), high - low)))
            t = t * (f32(1) - mix) + theta * mix
        c[:, i], s[:, i] = np.cos(t) * mscale, np.sin(t) * mscale
        theta = theta * theta_scale
    c, s = torch.from_numpy(c), torch.from_numpy(s)
    cos, sin = torch.cat((c, c), -1), torch.cat((-s, s), -1)               # rotation sign folded into sin
    return cos[:, None].to(device), sin[:, None].to(device)               # (n_ctx, 1, hd): one slice per use


class GptOss(Transformer):
    """Caches: K, V (Hkv, n_ctx, hd) per layer; RoPE tables per rope base (sliding layers may have their own)."""

    PRUNE_LAST_LAYER = False    # openai-moe.cpp keeps every row through the last layer (its output rows: after it)

    def __init__(self, cfg: GptOssHparams, *args, **kw):
        super().__init__(cfg, *args, **kw)
        self.zero_kv = torch.zeros(cfg.n_head_kv, 1, cfg.head_dim, dtype=self.kv_dtype, device=self.device)

    def make_caches(self) -> list:
        cfg = self.cfg
        kv_shape = (cfg.n_layers, cfg.n_head_kv, self.n_ctx, cfg.head_dim)
        k = torch.zeros(kv_shape, dtype=self.cache_dtype, device=self.device)  # (L, Hkv, n_ctx, hd)
        v = torch.zeros(kv_shape, dtype=self.cache_dtype, device=self.device)
        tables = {b: yarn_tables(cfg, b, self.n_ctx, self.device) for b in {cfg.base(il) for il in range(cfg.n_layers)}}
        self.rope = [tables[cfg.base(il)] for il in range(cfg.n_layers)]      # per layer: cos, sin (n_ctx, 1, hd)
        return list(zip(k.unbind(0), v.unbind(0)))

    def block(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        x = x + self.attention(il, x, pos)
        return x + self.ffn(il, x)

    def attention(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x (n, D) f32 at positions pos..pos+n-1 -> attention output (n, D) f32; writes K/V at those positions."""
        cfg, lw, lin = self.cfg, self.layers[il], self.linear
        n, H, Hkv, hd = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        h = self.linear.norm(x, lw["attn_norm.weight"], cfg.rms_eps)
        q = lin(h, lw["attn_q.weight"], lw.get("attn_q.bias"))                   # (n, H*hd)
        k = lin(h, lw["attn_k.weight"], lw.get("attn_k.bias"))                   # (n, Hkv*hd)
        v = lin(h, lw["attn_v.weight"], lw.get("attn_v.bias"))
        cos, sin = self.rope[il]
        qk = torch.cat((q, k), -1).view(n, H + Hkv, hd)                          # one RoPE for q and k
        qk = apply_rope(qk, cos[pos:pos + n], sin[pos:pos + n], neox=True).to(self.kv_dtype)
        q, k = qk[:, :H], qk[:, H:]                                              # (n, H, hd), (n, Hkv, hd)
        Kc, Vc = self.caches[il]
        end = pos + n
        Kc[:, pos:end] = k.transpose(0, 1)
        Vc[:, pos:end] = v.view(n, Hkv, hd).transpose(0, 1)
        swa = cfg.is_swa(il)
        start = max(0, pos - cfg.n_swa + 1) if swa else 0                        # first key the first query sees
        if n == 1:   # decode: the sink as one more score per head
            o = lin.attend(q, Kc, Vc, start, end, hd ** -0.5, lw["attn_sinks.weight"])    # (1, H*hd)
        else:        # SDPA over the keys plus a zero key/value whose mask entry is the sink logit
            K, V = kv_window(Kc, Vc, start, end)                                 # (Hkv, m, hd)
            qp = torch.arange(pos, end, device=x.device)[:, None]                # (n, 1) query positions
            kp = torch.arange(start, end, device=x.device)[None, :]              # (1, m) key positions
            seen = (kp <= qp) & ((qp - kp < cfg.n_swa) if swa else True)         # (n, m)
            mask = torch.zeros(seen.shape, dtype=self.kv_dtype, device=x.device).masked_fill_(~seen, float("-inf"))
            sink = lw["attn_sinks.weight"].to(self.kv_dtype).view(1, H, 1, 1).expand(1, H, n, 1)
            mask = torch.cat((mask.expand(1, H, n, end - start), sink), -1)      # (1, H, n, m+1)
            K, V = torch.cat((K, self.zero_kv), 1)[None], torch.cat((V, self.zero_kv), 1)[None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K, V, attn_mask=mask, enable_gqa=True)
            o = o[0].transpose(0, 1).reshape(n, cfg.q_dim)                       # (n, H*hd)
        return lin(o.float(), lw["attn_output.weight"], lw["attn_output.bias"])

    def ffn(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """x (n, D) f32 residual -> routed experts' output (n, D) f32."""
        cfg, lw = self.cfg, self.layers[il]
        h = self.linear.norm(x, lw["post_attention_norm.weight"], cfg.rms_eps)
        logits = self.linear(h, lw["ffn_gate_inp.weight"], lw["ffn_gate_inp.bias"])   # (n, E)
        top, ids = logits.topk(cfg.n_expert_used, dim=-1)                           # top-k of the raw logits
        return self.moe(il, h, ids, torch.softmax(top, dim=-1))
