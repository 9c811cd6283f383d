"""The MoE transformer in one readable file (gpt-fast style): products with weights as stored, static KV
cache, and separate prefill / decode functions. Hyperparameters and per-architecture features come from
engines/reference/archs/; a layer's tensors are read by their GGUF names inside the layer (`attn_q.weight`).

Semantics follow llama.cpp's graphs (src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp):
RMSNorm everywhere, attention scale 1/sqrt(head_dim), router = softmax over all experts then top-k
(build_moe_ffn with GATING_FUNC_SOFTMAX), SiLU-gated experts; the features (archs.FEATURES) add NEOX
RoPE, q/k norms per head or over the whole projection, qkv biases, renormalized top-k weights and a
sigmoid-gated shared expert.

Output rows (llama.cpp's inp_out_ids): these graphs keep, from the last layer's attention output on, only the
rows whose logits are wanted (the last token of a prompt; none in a prompt's earlier ubatches), so the last
layer's FFN/MoE and the head run on those alone; the layer still writes K/V for every token. Subclasses whose
llama.cpp graph keeps every row to the end of the last layer (gemma4, openai-moe, qwen35moe in llama.cpp
0.3.36: they prune there only for masked next-n embeddings) set PRUNE_LAST_LAYER False and drop rows before the
head.

The residual stream and every norm/softmax are f32 (as in ggml). Products read the stored bytes: on the
CPU through engines.reference.kernels (one token: int8 dot products with the activations quantized per
block, as ggml does; many tokens: the same, past a row limit tiles dequantized into a scratch and a GEMM in
the compute dtype: f32 by default, where quantized weights stay on int8 dots at every size), on CUDA by dequantizing
the matrix into a scratch of the compute dtype for the one product (engines.reference.dequant).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.reference.archs import Hparams
from engines.reference.dequant import dequantize, dequantize_rows
from engines.reference.qtensor import QTensor

Layer = dict[str, "QTensor | torch.Tensor"]      # a layer's tensors by name inside the layer


class Products:
    """y = x W^T (+ b) for a stored matrix W, on the device W's bytes live on: x (n, K) f32 -> (n, N) f32.
    On CUDA W is dequantized into a scratch a tile of rows at a time (dequantization passes through f32
    temporaries of ~6-9 bytes a value: a whole output head would need GBs)."""
    TILE = 1 << 24            # values of W dequantized at once on CUDA (~150 MB of temporaries)

    def __init__(self, kernels, dtype: torch.dtype):
        self.kernels, self.dtype = kernels, dtype        # dtype: of many-row products (CUDA; CPU GEMM bf16 or f32)

    def __call__(self, x: torch.Tensor, w: QTensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.device.type == "cpu":       # many rows: the kernels' GEMM in the compute dtype (bf16 or f32)
            x = x.contiguous()
            y = self.kernels.matvec(w, x) if x.shape[0] == 1 else \
                self.kernels.matmul(w, x, bf16=self.dtype == torch.bfloat16)
        else:
            xc, rows = x.to(self.dtype), max(1, self.TILE // w.k)
            y = torch.cat([F.linear(xc, dequantize(w.rows(r, min(r + rows, w.n_rows)), self.dtype))
                           for r in range(0, w.n_rows, rows)], dim=-1).float()
        return y if b is None else y + b

    def norm(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMS norm over x's last dim times w (None: no weight): the kernels' one pass on the CPU, ATen's
        elsewhere."""
        if x.device.type == "cpu" and self.kernels is not None:
            return self.kernels.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def attend(self, q: torch.Tensor, Kc: torch.Tensor, Vc: torch.Tensor, lo: int, end: int, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One token's attention over rows lo..end-1 of a layer's cache Kc, Vc (Hkv, n_ctx, hd): q (H * hd values)
        -> (1, H * hd) f32, per head h softmax(scale q_h K^T [, sinks_h]) V, head h reading kv head h // (H / Hkv);
        sinks (H,): one more score per head that adds no value row. On the CPU the kernels' one pass over the cache
        as held (QuantKernels.attend), elsewhere batched matmuls (10x faster than SDPA for one query)."""
        if Kc.device.type == "cpu" and self.kernels is not None:
            return self.kernels.attend(q.float(), Kc, Vc, lo, end, scale, sinks)
        K, V = kv_window(Kc, Vc, lo, end)                                     # (Hkv, T, hd)
        Hkv, _, hd = K.shape
        s = (q.to(K.dtype).reshape(Hkv, -1, hd) @ K.transpose(1, 2)).float() * scale      # (Hkv, H / Hkv, T)
        if sinks is not None:
            s = torch.cat((s, sinks.float().view(Hkv, -1, 1)), -1)
        p = torch.softmax(s, dim=-1)
        p = p[..., :-1] if sinks is not None else p
        return (p.to(V.dtype) @ V).reshape(1, -1).float()

    def embed(self, w: QTensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (n,) of a stored (V, D) matrix -> (n, D) f32: only those rows are dequantized (on the CPU by
        the kernels in one call, elsewhere by dequant.py; bit-exact either way)."""
        if w.device.type == "cpu":
            return self.kernels.embed(w, ids)
        rows = w.raw.view(w.shape[0], w.row_bytes)[ids.to(w.device)]      # (n, row_bytes)
        return dequantize_rows(rows, w.type, w.k).to(ids.device)


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


def kv_window(Kc: torch.Tensor, Vc: torch.Tensor, lo: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows lo..end-1 of a layer's K/V cache (Hkv, n_ctx, hd) as the attention computes with them: f32 on the
    CPU, where the cache holds f16 (llama.cpp's default cache type, so both engines hold the same KV bytes) and
    ATen's batched matmuls are fast only in f32; elsewhere as held (the compute dtype)."""
    if Kc.device.type != "cpu":
        return Kc[:, lo:end], Vc[:, lo:end]
    return Kc[:, lo:end].float(), Vc[:, lo:end].float()


def attention(cfg: Hparams, lw: Layer, linear: Products, Kc: torch.Tensor, Vc: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, pos: int) -> torch.Tensor:
    """x: (n, D) f32 residual -> attention output (n, D) f32, writing K/V into the layer's cache
    Kc, Vc (Hkv, n_ctx, hd) at pos..pos+n-1. cos/sin: rope_tables."""
    n, H, Hkv, hd = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
    h = linear.norm(x, lw["attn_norm.weight"], cfg.rms_eps)
    q = linear(h, lw["attn_q.weight"], lw.get("attn_q.bias"))           # (n, H*hd)
    k = linear(h, lw["attn_k.weight"], lw.get("attn_k.bias"))           # (n, Hkv*hd)
    v = linear(h, lw["attn_v.weight"], lw.get("attn_v.bias"))
    del h
    neox, normed = cfg.has("rope_neox"), cfg.has("qk_norm_full") or cfg.has("qk_norm_head")
    if x.device.type == "cpu" and linear.kernels is not None:         # both in one pass, in place
        for t, name in ((q, "attn_q_norm.weight"), (k, "attn_k_norm.weight")):
            linear.kernels.norm_rope_(t, lw[name] if normed else None, cfg.rms_eps, cos, sin, pos, neox, hd)
        q, k = q.view(n, H, hd), k.view(n, Hkv, hd)
    else:
        if cfg.has("qk_norm_full"):                                    # olmoe: over the whole projection
            q = F.rms_norm(q, (cfg.q_dim,), lw["attn_q_norm.weight"], cfg.rms_eps)
            k = F.rms_norm(k, (cfg.kv_dim,), lw["attn_k_norm.weight"], cfg.rms_eps)
        q, k = q.view(n, H, hd), k.view(n, Hkv, hd)
        if cfg.has("qk_norm_head"):                                    # qwen3moe: per head
            q = F.rms_norm(q, (hd,), lw["attn_q_norm.weight"], cfg.rms_eps)
            k = F.rms_norm(k, (hd,), lw["attn_k_norm.weight"], cfg.rms_eps)
        c, s = cos[pos:pos + n, None, :], sin[pos:pos + n, None, :]
        q, k = apply_rope(q, c, s, neox), apply_rope(k, c, s, neox)
    end = pos + n
    Kc[:, pos:end] = k.transpose(0, 1)
    Vc[:, pos:end] = v.view(n, Hkv, hd).transpose(0, 1)
    if n == 1:
        o = linear.attend(q, Kc, Vc, 0, end, hd ** -0.5)                  # (1, H*hd)
    else:
        K, V = kv_window(Kc, Vc, 0, end)                                   # (Hkv, end, hd)
        q, K, V = q.to(K.dtype).transpose(0, 1)[None], K[None], V[None]    # (1, H, n, hd), (1, Hkv, end, hd)
        if pos == 0:
            o = F.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True)
        else:   # a later ubatch: query i sits at pos+i and sees keys 0..pos+i
            mask = torch.ones(n, end, dtype=torch.bool, device=x.device).tril(diagonal=pos)
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)
        o = o[0].transpose(0, 1).reshape(n, cfg.q_dim)                 # (n, H*hd)
    return linear(o.float(), lw["attn_output.weight"])


def route(cfg: Hparams, lw: Layer, linear: Products, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h: (n, D) f32 normed -> expert weights (n, k) f32 and ids (n, k)."""
    logits = linear(h, lw["ffn_gate_inp.weight"])                       # (n, E)
    if cfg.has("norm_topk"):   # softmax over all experts, top-k, renormalized == softmax of the top-k logits
        top, ids = logits.topk(cfg.n_expert_used, dim=-1)
        w = torch.softmax(top, dim=-1)
    else:
        w, ids = torch.softmax(logits, dim=-1).topk(cfg.n_expert_used, dim=-1)
    if cfg.expert_weights_scale not in (0.0, 1.0):
        w = w * cfg.expert_weights_scale
    return w, ids


def shared_expert(lw: Layer, linear: Products, h: torch.Tensor) -> torch.Tensor:
    """qwen2moe's sigmoid-gated shared expert: h (n, D) f32 -> (n, D) f32."""
    gate = torch.sigmoid(h @ lw["ffn_gate_inp_shexp.weight"])[:, None]         # (n, 1)
    a = F.silu(linear(h, lw["ffn_gate_shexp.weight"])) * linear(h, lw["ffn_up_shexp.weight"])   # (n, ff_sh)
    return gate * linear(a, lw["ffn_down_shexp.weight"])


class Transformer:
    """Weights + caches + the forward pass of the common MoE transformer. Another architecture subclasses
    it (archs: Arch.model) and overrides what differs: make_caches, reset, embed, block, head.

    layers[il]: the layer's tensors by name inside the layer, routed experts excepted: `moe(il, h, ids, w)`
    (engines.reference.offload.MoEExecutor) runs those. top: the tensors outside the blocks."""

    PRUNE_LAST_LAYER = True     # llama.cpp's graph keeps only the output rows after the last layer's attention

    def __init__(self, cfg: Hparams, layers: list[Layer], top: Layer, moe, linear: Products, n_ctx: int,
                 device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype = torch.float16):
        self.cfg, self.layers, self.top, self.moe, self.linear = cfg, layers, top, moe, linear
        self.n_ctx, self.device, self.dtype = n_ctx, device, dtype
        # On the CPU the KV cache holds cache_dtype (f16 by default, as llama.cpp's) and attention computes in
        # f32 (kv_window): ATen's bf16/f16 batched matmul has no fast CPU kernel (decode at 4K context: 1.6 ms
        # vs 0.26 ms per layer for f32) and f32 SDPA prefill runs as fast as bf16. On CUDA both are the
        # compute dtype.
        self.cache_dtype = cache_dtype if device.type == "cpu" else dtype
        self.kv_dtype = torch.float32 if device.type == "cpu" else dtype     # attention math
        self.caches = self.make_caches()
        # one token on the CPU: attention and routing as one C++ call each (kernels.FusedDecode), when the
        # kernels implement every feature of the architecture; None: the ops below (engine extra fused_decode)
        cpu = device.type == "cpu" and linear.kernels is not None
        self.fused = linear.kernels.fused(cfg.features) if cpu else None

    def make_caches(self) -> list:
        """Per layer (K, V) cache views (Hkv, n_ctx, hd), and the RoPE tables (made once: single-token
        decode is bound by per-op overhead)."""
        cfg = self.cfg
        kv_shape = (cfg.n_layers, cfg.n_head_kv, self.n_ctx, cfg.head_dim)
        k = torch.zeros(kv_shape, dtype=self.cache_dtype, device=self.device)  # (L, Hkv, n_ctx, hd)
        v = torch.zeros(kv_shape, dtype=self.cache_dtype, device=self.device)
        self.cos, self.sin = rope_tables(cfg, self.n_ctx, self.device)           # (n_ctx, hd)
        return list(zip(k.unbind(0), v.unbind(0)))

    @property
    def cache_bytes(self) -> int:
        """KV caches and recurrent states."""
        return sum(t.numel() * t.element_size() for c in self.caches for t in c)

    @property
    def state_bytes(self) -> int:
        """The recurrent states among cache_bytes (none here)."""
        return 0

    def reset(self) -> None:
        """Empty the caches: stale KV rows past the position are never read (recurrent states override)."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear.embed(self.top["token_embd.weight"], tokens)        # (n, D)

    def block(self, il: int, x: torch.Tensor, pos: int, n_out: int | None = None) -> torch.Tensor:
        """Layer il on the residual x (n, D) f32 at positions pos..pos+n-1 -> the new residual; n_out: only the
        last n_out rows go on past the attention (forward: the last layer's output rows)."""
        k, v = self.caches[il]
        if self.fused is not None and x.shape[0] == 1:
            return self._fused_block(il, x, pos)
        x = x + attention(self.cfg, self.layers[il], self.linear, k, v, self.cos, self.sin, x, pos)
        if n_out is not None:
            x = x[x.shape[0] - n_out:]
            if not n_out:
                return x
        return x + self._ffn(il, x)

    def _fused_block(self, il: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        """block() for one token (1, D) on the CPU: the same math in 3-4 calls instead of ~45 ATen ops."""
        cfg, lw, f = self.cfg, self.layers[il], self.fused
        k, v = self.caches[il]
        x = f.attention(cfg, lw, k, v, self.cos, self.sin, x, pos)          # x + attention(x)
        h, w, ids, gate = f.route(cfg, lw, x)                               # normed h, (1, k) weights and ids
        x = x + self.moe(il, h, ids, w)
        return f.shared(cfg, lw, h, gate, x) if cfg.has("shared_expert_gated") else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final residual rows (m, D) -> logits (m, V) f32."""
        x = self.linear.norm(x, self.top["output_norm.weight"], self.cfg.rms_eps)
        return self.linear(x, self.top["output.weight"])

    def _ffn(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """x: (n, D) f32 residual -> MoE output (n, D) f32 (plus qwen2moe's gated shared expert)."""
        cfg, lw = self.cfg, self.layers[il]
        h = self.linear.norm(x, lw["ffn_norm.weight"], cfg.rms_eps)             # (n, D) f32
        w, ids = route(cfg, lw, self.linear, h)                                # (n, k) each
        out = self.moe(il, h, ids, w)                                          # (n, D) f32
        if cfg.has("shared_expert_gated"):
            out = out + shared_expert(lw, self.linear, h)
        return out

    def forward(self, tokens: torch.Tensor, pos: int, n_out: int) -> torch.Tensor:
        """tokens: (n,) at positions pos..pos+n-1 -> the logits of the last n_out of them (n_out, V) f32. An engine
        that records routing traces (moe.recorder) keeps every row in the last layer too: a trace holds every token's
        routing in every layer (engines.llama_cpp_routing has llama.cpp output every token for the same reason)."""
        n = tokens.shape[0]
        x = self.embed(tokens)                                                 # (n, D)
        self.moe.begin_batch(n)
        last = self.cfg.n_layers - 1 if self.moe.recorder is None and self.PRUNE_LAST_LAYER else None
        for il in range(self.cfg.n_layers):
            x = self.block(il, x, pos, n_out) if il == last else self.block(il, x, pos)
        x = x[x.shape[0] - n_out:]                                             # (n_out, D)
        return self.head(x) if n_out else x.new_empty(0, self.cfg.n_vocab)


def touch_ops() -> None:
    """Run the ATen ops of a CPU forward once on a few values: norms, a GEMM, softmax and top-k, both SDPA masks
    with GQA, f16 KV copies. Their code (~8 MiB of libtorch_cpu.so, paged in on first use) and one-time state are
    the runtime's, the same for every model, so ReferenceEngine.runtime runs this before the RSS floor."""
    x = torch.randn(64, 64)
    q, kv = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    for _ in range(2):                                   # some kernels pick and cache a path on their first call
        torch.softmax(F.rms_norm(x, (64,)) @ x.T, dim=-1).topk(4, dim=-1)
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
        torch.cat([x, x.to(torch.float16).float()]).transpose(0, 1).contiguous().mul_(2).add_(x.T.repeat(1, 2))


def prefill(model: Transformer, tokens: torch.Tensor, pos: int, n_ubatch: int, all_logits: bool) -> torch.Tensor:
    """Process tokens (n,) from pos in n_ubatch chunks; logits of every position (n, V) or of the last (1, V): the
    earlier chunks then output no rows, as llama.cpp's ubatches without a requested logit."""
    outs, n = [], tokens.shape[0]
    for s in range(0, n, n_ubatch):
        chunk = tokens[s:s + n_ubatch]
        outs.append(model.forward(chunk, pos + s, chunk.shape[0] if all_logits else int(s + n_ubatch >= n)))
    return torch.cat(outs)


def decode(model: Transformer, token: torch.Tensor, pos: int) -> torch.Tensor:
    """One token (1,) at pos -> logits (1, V). Its products are matrix-vector kernels over the stored
    bytes (Products, MoEExecutor's fused moe_decode); the rest is a few dozen small ATen ops a layer."""
    return model.forward(token, pos, n_out=1)
