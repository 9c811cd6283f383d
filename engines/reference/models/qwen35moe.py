"""qwen35moe's forward pass (Qwen3.5-35B-A3B family): Gated DeltaNet layers with a recurrent state, gated
full-attention layers with a KV cache, a routed + gated shared MoE in every layer; MTP blocks are never run.

Semantics follow llama.cpp (src/models/qwen35moe.cpp, src/models/delta-net-base.cpp of the llama.cpp that
llama-cpp-python vendors; tests/test_arch_qwen35moe.py holds them to a float64 oracle):

  x = token_embd[tokens]
  per trunk layer:  h = rms_norm(x) * attn_norm
                    x = x + (deltanet(h) if recurrent else gated_attention(h))
                    h = rms_norm(x) * post_attention_norm
                    x = x + experts(h) + sigmoid(h . ffn_gate_inp_shexp) * shared_expert(h)
  logits = output (rms_norm(x) * output_norm)

DeltaNet (per v head j, reading q/k head j % n_k_heads: the converter stores v heads tiled):
  [q|k|v] = silu(causal depthwise conv_K([conv state | h W_qkv])), q, k l2-normalized (eps = rms eps),
  beta = sigmoid(h W_beta), g = softplus(h W_alpha + dt_bias) * ssm_a (ssm_a = -exp(A_log): g <= 0),
      S <- e^g S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q / sqrt(d_k)        S: (d_k, d_v)
  out = W_out (rms_norm(o) * ssm_norm * silu(h W_gate)).
Prefill runs the chunked (WY) form of that recurrence, decode the one-token step; both give the same
numbers up to rounding (llama.cpp 0.3.36 itself runs the per-token recurrence for both). The recurrent
state (conv rows + S) is f32, like llama.cpp's, and constant in size.

Gated attention: the q projection holds per head [query | gate]; q and k are RMS-normed per head, RoPE'd
(IMROPE for text positions = NEOX on the first n_rot dims, the pairs of the 4th section unrotated), the
attention output is multiplied by sigmoid(gate) before attn_output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.reference.models.transformer import Transformer, apply_rope, kv_window, route, shared_expert

CHUNK = 64   # llama.cpp's DeltaNet chunk for a per-head gate (delta-net-base.cpp:61); the result does not depend on it


def imrope_tables(cfg, n_ctx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n_ctx, n_rot) f32 for apply_rope (NEOX) on the first n_rot dims of a head. IMROPE (ggml
    ops.cpp ggml_mrope_cache_init) gives rotary pair i the position component of sector s = i % sum(sections):
    h if s % 3 == 1 and s < 3 sec[1], w if s % 3 == 2 and s < 3 sec[2], t if s % 3 == 0 and s < 3 sec[0],
    else e. Text tokens have t = h = w = the position and e = 0, so those pairs rotate by pos * base^(-2i/n_rot)
    and the e pairs not at all (none with the real sections [11, 11, 10, 0])."""
    sec, half = cfg.rope_sections, cfg.n_rot // 2
    s = torch.arange(half) % sum(sec)
    used = (((s % 3 == 1) & (s < 3 * sec[1])) | ((s % 3 == 2) & (s < 3 * sec[2]))
            | ((s % 3 == 0) & (s < 3 * sec[0])))
    inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half) * used
    ang = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv[None, :]            # (n_ctx, n_rot/2)
    c, s = ang.cos().float(), ang.sin().float()
    return torch.cat((c, c), -1).to(device), torch.cat((-s, s), -1).to(device)


def delta_step(q, k, v, g, beta, S: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule, S (H, dk, dv) f32 updated in place. q (scaled by 1/sqrt(dk)), k (H, dk);
    v (H, dv); g, beta (H,) -> o (H, dv)."""
    S.mul_(g.exp()[:, None, None])
    d = (v - (k[:, None, :] @ S)[:, 0]) * beta[:, None]                       # (H, dv): beta (v - S^T k)
    S.baddbmm_(k[:, :, None], d[:, None, :])                                  # S += k d^T
    return (q[:, None, :] @ S)[:, 0]


def delta_chunked(q, k, v, g, beta, S: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over n tokens in chunks of C = min(CHUNK, n) (delta-net-base.cpp:16-287,
    build_delta_net_chunking); S (H, dk, dv) f32 updated in place. q (n, H, dk) scaled by 1/sqrt(dk), k (n, H, dk);
    v (n, H, dv); g, beta (n, H) -> o (n, H, dv). The tail is zero-padded (g = beta = k = 0 there: it changes
    neither the outputs nor the state). Per chunk, with c = cumsum(g) and D_ij = e^(c_i - c_j) for j <= i:
        A = strict_lower((beta k) k^T * D);  [U | W] = (I + A)^-1 [beta v | beta k e^c]   (the WY form)
        then chunk by chunk: v' = U - W S;  o = (q e^c) S + lower(q k^T * D) v';
                             S = e^c_last S + (k e^(c_last - c))^T v'
    All exponents are <= 0 (g <= 0) except the masked upper triangle."""
    n, H, dk = k.shape
    dv = v.shape[-1]
    C = min(CHUNK, n)
    pad = (-n) % C
    N = (n + pad) // C

    def chunks(x):                                            # (n, H, ...) -> (H, N, C, ...)
        x = x.movedim(0, 1)
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad)) if pad else x
        return x.reshape(H, N, C, *x.shape[2:])

    q, k, v, g, b = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    c = g.cumsum(-1)                                                        # (H, N, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()    # (H, N, C, C)
    kb = k * b[..., None]
    A = ((kb @ k.transpose(-1, -2)) * D).tril(-1)
    UW = torch.linalg.solve_triangular(A, torch.cat((v * b[..., None], kb * c.exp()[..., None]), -1),
                                       upper=False, unitriangular=True)     # unit diagonal: solves (I + A) X = rhs
    U, W = UW.split((dv, dk), -1)
    KQ = (q @ k.transpose(-1, -2)) * D                                      # (H, N, C, C), j <= i
    qc = q * c.exp()[..., None]
    kc = (k * (c[..., -1:] - c).exp()[..., None]).transpose(-1, -2)         # (H, N, dk, C)
    last = c[..., -1].exp()                                                 # (H, N)
    out = torch.empty(H, N, C, dv, dtype=q.dtype, device=q.device)
    for i in range(N):                                                      # the only sequential part
        vn = U[:, i] - W[:, i] @ S                                          # (H, C, dv)
        out[:, i] = qc[:, i] @ S + KQ[:, i] @ vn
        S.mul_(last[:, i, None, None]).baddbmm_(kc[:, i], vn)
    return out.reshape(H, N * C, dv)[:, :n].movedim(0, 1)


class Qwen35MoE(Transformer):
    """caches[il]: (K, V) (Hkv, n_ctx, hd) for attention layers, (conv rows (K-1, conv_dim), S (Hv, dk, dv)) f32
    for DeltaNet layers, () for MTP blocks."""

    PRUNE_LAST_LAYER = False    # qwen35moe.cpp keeps every row through the last layer (its output rows: after it)

    def __init__(self, cfg, *args, **kw):
        super().__init__(cfg, *args, **kw)
        d = cfg.ssm_state     # l2-normed q also takes the output scale 1/sqrt(d): (2, 1, 1) factors for q, k
        self.qk_scale = torch.tensor([1 / d, d ** -0.5], device=self.device)[:, None, None]
        # the conv kernels (conv_dim, K) as f32 views of their stored bytes (llama.cpp requires F32; parse checks)
        self.conv_w = {il: lw["ssm_conv1d.weight"].raw.view(torch.float32).view(cfg.conv_dim, cfg.ssm_conv_kernel)
                       for il, lw in enumerate(self.layers) if cfg.recurrent(il)}

    def make_caches(self) -> list:
        cfg, dev = self.cfg, self.device
        self.cos, self.sin = imrope_tables(cfg, self.n_ctx, dev)          # (n_ctx, n_rot)
        caches = []
        for il in range(cfg.n_layers):
            if cfg.recurrent(il):
                caches.append((torch.zeros(cfg.ssm_conv_kernel - 1, cfg.conv_dim, device=dev),
                               torch.zeros(cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state, device=dev)))
            elif il < cfg.n_trunk:
                shape = (cfg.n_head_kv, self.n_ctx, cfg.head_dim)
                caches.append((torch.zeros(shape, dtype=self.cache_dtype, device=dev),
                               torch.zeros(shape, dtype=self.cache_dtype, device=dev)))
            else:
                caches.append(())
        return caches

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for il, c in enumerate(self.caches) if self.cfg.recurrent(il)
                   for t in c)

    def reset(self) -> None:
        """A new sequence: zero the DeltaNet states (KV rows past the position are never read)."""
        for il, c in enumerate(self.caches):
            if self.cfg.recurrent(il):
                for t in c:
                    t.zero_()

    def block(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        cfg, lw = self.cfg, self.layers[il]
        if il >= cfg.n_trunk:                                              # MTP block: not in the main graph
            return x
        h = self.linear.norm(x, lw["attn_norm.weight"], cfg.rms_eps)
        x = x + (self.deltanet(il, h) if cfg.recurrent(il) else self.attention(il, h, pos))
        h = self.linear.norm(x, lw["post_attention_norm.weight"], cfg.rms_eps)    # (n, D)
        w, ids = route(cfg, lw, self.linear, h)              # softmax over all, top-k, renormalized
        return x + self.moe(il, h, ids, w) + shared_expert(lw, self.linear, h)

    def deltanet(self, il: int, h: torch.Tensor) -> torch.Tensor:
        """h (n, D) f32 normed -> (n, D); advances the layer's conv rows and state S."""
        cfg, lw, lin = self.cfg, self.layers[il], self.linear
        n, Hk, Hv, d = h.shape[0], cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
        conv, S = self.caches[il]
        z = lin(h, lw["attn_gate.weight"])                                        # (n, Hv*d)
        beta = torch.sigmoid(lin(h, lw["ssm_beta.weight"]))                       # (n, Hv)
        g = F.softplus(lin(h, lw["ssm_alpha.weight"]) + lw["ssm_dt.bias"]) * lw["ssm_a"]   # (n, Hv) log-decay
        rows = torch.cat((conv, lin(h, lw["attn_qkv.weight"])))                   # (K-1+n, conv_dim)
        conv.copy_(rows[n:])                                                      # the last K-1 pre-conv rows
        c = F.silu((rows.unfold(0, cfg.ssm_conv_kernel, 1) * self.conv_w[il]).sum(-1))   # (n, conv_dim)
        qk, v = c.split((2 * cfg.key_dim, cfg.value_dim), -1)
        # l2 norm x / sqrt(sum x^2 + eps) as ggml computes it, rms_norm(x, eps/d) / sqrt(d), with q's output scale
        # 1/sqrt(d) folded in; v head j reads q/k head j % Hk: repeat (tile), not repeat_interleave
        qk = F.rms_norm(qk.view(n, 2, Hk, d), (d,), eps=cfg.rms_eps / d) * self.qk_scale
        q, k = qk.repeat(1, 1, Hv // Hk, 1).unbind(1)                             # (n, Hv, d) each
        v = v.reshape(n, Hv, d)
        if n == 1:
            o = delta_step(q[0], k[0], v[0], g[0], beta[0], S)[None]              # (1, Hv, d)
        else:
            o = delta_chunked(q, k, v, g, beta, S)                                # (n, Hv, d)
        o = F.rms_norm(o, (d,), lw["ssm_norm.weight"], cfg.rms_eps) * F.silu(z.view(n, Hv, d))
        return lin(o.reshape(n, Hv * d), lw["ssm_out.weight"])

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x (n, heads, hd) -> RoPE'd on dims [0, n_rot), the rest as it was."""
        r, n = self.cfg.n_rot, x.shape[0]
        rot = apply_rope(x[..., :r], self.cos[pos:pos + n, None], self.sin[pos:pos + n, None], neox=True)
        return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), -1)

    def attention(self, il: int, h: torch.Tensor, pos: int) -> torch.Tensor:
        """h (n, D) f32 normed at positions pos..pos+n-1 -> (n, D); writes K/V into the layer's cache."""
        cfg, lw, lin = self.cfg, self.layers[il], self.linear
        n, H, Hkv, hd = h.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        if cfg.fused_qkv:
            qg, k, v = lin(h, lw["attn_qkv.weight"], lw.get("attn_qkv.bias")).split(
                (2 * cfg.q_dim, cfg.kv_dim, cfg.kv_dim), -1)
        else:
            qg = lin(h, lw["attn_q.weight"], lw.get("attn_q.bias"))                # (n, 2 H hd)
            k = lin(h, lw["attn_k.weight"], lw.get("attn_k.bias"))                  # (n, Hkv hd)
            v = lin(h, lw["attn_v.weight"], lw.get("attn_v.bias"))
        qg = qg.view(n, H, 2, hd)                                                  # per head [query | gate]
        q = F.rms_norm(qg[:, :, 0], (hd,), lw["attn_q_norm.weight"], cfg.rms_eps)
        k = F.rms_norm(k.reshape(n, Hkv, hd), (hd,), lw["attn_k_norm.weight"], cfg.rms_eps)
        Kc, Vc = self.caches[il]
        q, k = self.rope(q, pos), self.rope(k, pos)
        end = pos + n
        Kc[:, pos:end] = k.transpose(0, 1)
        Vc[:, pos:end] = v.reshape(n, Hkv, hd).transpose(0, 1)
        if n == 1:
            o = lin.attend(q, Kc, Vc, 0, end, hd ** -0.5)                           # (1, H*hd)
        else:        # query i at pos+i sees keys 0..pos+i
            K, V = kv_window(Kc, Vc, 0, end)                                       # (Hkv, end, hd)
            q = q.to(K.dtype)
            mask = None if pos == 0 else torch.ones(n, end, dtype=torch.bool, device=h.device).tril(diagonal=pos)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K[None], V[None], attn_mask=mask,
                                               is_causal=pos == 0, enable_gqa=True)
            o = o[0].transpose(0, 1).reshape(n, cfg.q_dim)                         # (n, H*hd)
        o = o.float() * torch.sigmoid(qg[:, :, 1].reshape(n, cfg.q_dim))          # the per-head output gate
        return lin(o, lw["attn_output.weight"])
