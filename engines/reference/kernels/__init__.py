"""CPU kernels on GGUF weights as stored (QTensor): matvec, matmul, dequant, one token's routed experts,
and the fused one-token steps of the common transformer block.

quant.cpp (products, pybind), quant_types.h (per ggml type a bit-exact dequant_row and a dot against
1..NX activation rows), quant_act.h (x converted to the weight type's ggml vec_dot_type: f32, f16,
bf16, Q8_0, Q8_1 or Q8_K, with ggml's own rounding), quant_simd.h (SIMD helpers), decode.h (attention
and routing of one token, one call each), quant_x8.h / quant_x8_q6.h / quant_x8_mx.h / quant_x8_signed.h (Q4_K,
Q6_K, MXFP4, Q8_0, IQ4_NL, IQ4_XS and F16 with 8 rows interleaved: QTensor layout "x8", made at load by
weights.Holder through repack, QuantKernels.host_layout says where).
Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS. A product
multiplies exactly the int8 values and scales ggml's x86 dots multiply (only the order of the float
additions differs), so the engine's logits follow llama.cpp's to ~1e-5 on quantized files.

Built once per ISA variant (engines.devices.CPU_ISAS; MOEBENCH_ISA=auto|avx2|avx512|amx picks one per
process), each in its own directory and under its own extension name: "avx2" (AVX2 + FMA + F16C, what
CI machines and most users have), "avx512" (+ AVX512 F/BW/VL/DQ/VNNI/BF16: vpdpbusd/vpdpwssd dots,
16-lane float kernels, bf16 scratch for oneDNN's bf16 GEMM) and "amx" (+ AMX tile/int8/bf16: quant_amx.h's
tile products of many x rows with Q4_K, IQ4_XS and IQ4_NL weights; oneDNN's bf16 GEMM runs on tiles by itself).
A variant is never loaded on a CPU without its flags, so a forced avx512 on an AVX2 machine is a message, not a SIGILL.
Compiled by torch.utils.cpp_extension.load (g++ and ninja, ~1 min) into cache_dir()/kernels/torch-VERSION/quant-ISA;
ninja rebuilds when a source changes. -fopenmp makes at::parallel_for parallel in the extension (the .so
then needs libgomp.so.1, which resolves to the copy torch already loaded: one OpenMP pool).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from engines import devices
from engines.reference.qtensor import LAYOUT_TYPES, LAYOUTS, QTensor

SOURCE = Path(__file__).with_name("quant.cpp")
# -ffp-contract=off: no mul + add fused behind our back, so dequant rounds exactly as ggml and gguf-py do
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c"]
AVX512_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"]
ISA_CFLAGS = {"avx2": [], "avx512": AVX512_CFLAGS, "amx": [*AVX512_CFLAGS, "-mamx-tile", "-mamx-int8", "-mamx-bf16"]}

# The architecture features (engines.reference.archs.FEATURES) the fused decode steps (decode.h,
# FusedDecode) implement; a model with any other feature runs its decode through the model's own ops.
FUSED_FEATURES = frozenset({"rope_neox", "qk_norm_head", "qk_norm_full", "qkv_bias", "norm_topk",
                            "shared_expert_gated"})

ACTIVATIONS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
X_FORMATS = ("F32", "F16", "BF16", "Q8_0", "Q8_1", "Q8_K")    # quant_act.h XFmt, for quantize_x
# matmul: the most x rows that go to the rows kernel (every weight row read once for all of them, x in
# the type's int8 format); more rows go to dequantized tiles and ATen's GEMM. Crossovers measured on
# 2 Zen 5 threads, 4096 x 4096 (benchmarks/kernels.py): avx2's int8 rows kernel beats dequant + f32
# GEMM at every n up to 512; on avx512 oneDNN's bf16 GEMM overtakes the rows kernel past n = 32, and
# already at n = 3..4 for F16 and BF16 weights (nothing to gain from int8 there); F32's f32 rows kernel
# loses to the f32 GEMM past n = 32. With an f32 GEMM forced on avx512 (bf16=False) its quantized rows
# kernel stays ahead, as on avx2.
# The x8 layout's rows kernel (8 weight rows per load, vpdpbusd over 16 rows on avx512) keeps ahead of
# oneDNN's bf16 GEMM up to ~128 rows (2 threads of a Xeon with AMX, 1536 x 2048 Q4_K: 450 against 540
# GFLOP/s at n = 128, 410 against 240 at n = 32).
ROWS_MAX_N = {"avx2": {"F32": 32, "F16": 32, "BF16": 32, "quant": 1 << 62},
              "avx512": {"F32": 32, "F16": 3, "BF16": 2, "quant": 32, "x8": 128}}
# amx: Q4_K's tiles (quant_amx.h) keep ahead of dequantized tiles and oneDNN's bf16 GEMM (on AMX tiles too) up to
# ~256 rows (2 threads of a Xeon with AMX, 4096 x 2048: 806 against 410 GFLOP/s at n = 128, 775 against 758 at 256);
# IQ4_XS's and IQ4_NL's up to x8's 128 (2112 x 2816 IQ4_XS: 832 against 701 at 128, 995 against 999 at 256)
ROWS_MAX_N["amx"] = {**ROWS_MAX_N["avx512"], "x8/Q4_K": 256}
ROWS_MAX_N_F32_GEMM = {"F32": 32, "F16": 32, "BF16": 32, "quant": 1 << 62}


# Types whose x8 layout a bf16 GEMM does not want: on avx512 with dtype=bf16, oneDNN's bf16 GEMM takes F16 past 3
# rows (ROWS_MAX_N) from dequantized tiles, which the file layout gives fastest. In f32 (the default) every variant
# keeps them on the x8 rows kernel, as avx2 does: dequantized tiles and the f32 GEMM ran a 512-token F16 prefill at
# half its speed on an AVX-512 EPYC.
X8_NOT_FOR_BF16_GEMM = ("F16",)


def missing_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags variant `isa` needs that `flags` (default: this CPU's) lacks."""
    have = devices.cpu_flags() if flags is None else flags
    return [f for f in devices.CPU_ISAS[isa] if f not in have]


@functools.cache
def load_quant(isa: str):
    """The compiled extension of variant `isa`, or the reason it is unavailable (str). Compiles once
    (~1 min; ninja rebuilds when quant.cpp or the headers beside it change)."""
    if missing := missing_flags(isa):
        return f"the CPU lacks {', '.join(missing)}, which the {isa} kernels need"
    from torch.utils.cpp_extension import load

    from engines.paths import cache_dir
    build = cache_dir() / "kernels" / f"torch-{torch.__version__}" / f"quant-{isa}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load(f"moebench_quant_{isa}", [str(SOURCE)], extra_cflags=CFLAGS + ISA_CFLAGS[isa],
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(SOURCE.parent)],
                    build_directory=str(build))
    except Exception as e:   # no compiler, no ninja, ...
        return f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def quant_kernels(isa: str | None = None) -> "QuantKernels | str":
    """The kernels of `isa` (default engines.devices.cpu_isa(): MOEBENCH_ISA or the widest this CPU
    runs), or why there are none (str)."""
    if isa is None:
        try:
            isa = devices.cpu_isa()
        except ValueError as e:
            return str(e)
    ext = load_quant(isa)
    return ext if isinstance(ext, str) else QuantKernels(ext, isa)


def _arg(qt: QTensor, what: str) -> tuple:
    """A checked 2-D weight as the extension takes it: (raw, offset, ggml type, n_rows, k)."""
    qt.validate(what)
    if len(qt.shape) != 2:
        raise ValueError(f"{what}: a (N, K) matrix, got {qt.shape}")
    return qt.raw, 0, qt.code, qt.shape[0], qt.k


def _stacks(gate: QTensor, up: QTensor | None, down: QTensor, act: str, *biases) -> tuple:
    """The checked expert stacks of moe_decode / moe_prefill: (E, ff, D, the extension's gate, up and down
    stack arguments, each (raw, offset, stride, type))."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act: one of {', '.join(ACTIVATIONS)}, not {act!r}")
    gate.validate("gate")
    down.validate("down")
    if len(gate.shape) != 3 or len(down.shape) != 3:
        raise ValueError(f"expert stacks (E, N, K), got gate {gate.shape}, down {down.shape}")
    E, D = gate.shape[0], gate.shape[2]
    if up is None:                                   # fused gate_up: two views of one stack
        if gate.shape[1] % 2:
            raise ValueError(f"fused gate_up {gate.shape} needs an even row count")
        ff = gate.shape[1] // 2
        urow = (gate.raw, ff * gate.row_bytes, 2 * ff * gate.row_bytes, gate.code)
        grow = (gate.raw, 0, 2 * ff * gate.row_bytes, gate.code)
    else:
        ff = gate.shape[1]
        if up.shape != gate.shape:
            raise ValueError(f"up {up.shape} differs from gate {gate.shape}")
        grow = (gate.raw, 0, ff * gate.row_bytes, gate.code)
        urow = (up.validate("up").raw, 0, ff * up.row_bytes, up.code)
    if down.shape != (E, D, ff):
        raise ValueError(f"down {down.shape}, expected {(E, D, ff)}")
    for b, shape, what in zip(biases, ((E, ff), (E, ff), (E, D)), ("gate_bias", "up_bias", "down_bias")):
        if b is not None and (b.dtype != torch.float32 or tuple(b.shape) != shape):
            raise ValueError(f"{what} must be f32 {shape}, got {b.dtype} {tuple(b.shape)}")
    return E, ff, D, (grow, urow, (down.raw, 0, D * down.row_bytes, down.code))


class QuantKernels:
    """The extension as the engine calls it: products with QTensor weights (N, K) as stored, x f32.
    x is converted per product to the type ggml converts it to (quant_act.h); `isa` is the variant."""

    def __init__(self, ext, isa: str):
        self.ext, self.isa = ext, isa

    def host_layout(self, qt: QTensor, bf16: bool = False) -> str:
        """The layout these kernels want a stored matrix (or expert stack) in, to be made once at load: "x8" for
        the types of LAYOUT_TYPES["x8"] in whole groups of 8 rows and 8 values (quant_x8*.h: 8 or 16 rows per dot
        instruction; X8_NOT_FOR_BF16_GEMM only where the GEMM is not bf16: `bf16`, the engine's compute dtype, and
        avx2 has no bf16 GEMM), else "ggml" (as stored)."""
        for name, types in LAYOUT_TYPES.items():
            if qt.type in types and qt.n_rows % LAYOUTS[name][0] == 0 and qt.k % 8 == 0 and \
                    (self.isa == "avx2" or not bf16 or qt.type not in X8_NOT_FOR_BF16_GEMM):
                return name
        return "ggml"

    def matvec(self, qt: QTensor, x: torch.Tensor) -> torch.Tensor:
        """W x for one activation row: x (K,) or (1, K) f32 -> (N,) or (1, N) f32."""
        raw, _, code, n, k = _arg(qt, "weight")
        return self.ext.matvec(raw, 0, code, n, k, x).reshape(*x.shape[:-1], n)

    def matmul(self, qt: QTensor, x: torch.Tensor, rows_max_n: int | None = None,
               bf16: bool | None = None) -> torch.Tensor:
        """x W^T: x (..., K) f32 -> (..., N) f32. Up to rows_max_n rows (default: ROWS_MAX_N for the
        variant, type and GEMM dtype) every weight row is read once for all of them, x in the type's
        format (as matvec); more rows go through per-tile dequantized scratch and ATen's GEMM with x as
        the rows kernel sees it. bf16: the GEMM's dtype, None = the variant's (bf16 on avx512, f32 on
        avx2); True rounds x, the weights and the results to bf16."""
        raw, _, code, n, k = _arg(qt, "weight")
        rows_max_n = self.rows_max(qt.type, bf16, qt.layout) if rows_max_n is None else rows_max_n
        y = self.ext.matmul(raw, 0, code, n, k, x, rows_max_n, -1 if bf16 is None else int(bf16))
        return y.reshape(*x.shape[:-1], n)

    def repack(self, qt: QTensor, layout: str, out: torch.Tensor | None = None) -> QTensor:
        """qt with its bytes in `layout` ("ggml" or a key of LAYOUTS): a new tensor, written into `out`
        (uint8, qt's size; e.g. huge pages) when given; qt itself when already in that layout. A
        permutation of the bytes: repacking back gives the file's bytes."""
        qt.validate()
        if layout == qt.layout:
            return qt
        new = QTensor(qt.raw, qt.type, qt.shape, layout)
        out = torch.empty_like(qt.raw) if out is None else out
        self.ext.repack(qt.raw, qt.code, new.code, qt.raw.numel() // qt.row_bytes, qt.k, out)
        return new.with_raw(out)

    def rows_max(self, ggml_type: str, bf16: bool | None, layout: str = "ggml") -> int:
        """The most activation rows a product with a weight of this type (and layout) gives the rows kernel
        (ROWS_MAX_N)."""
        limits = ROWS_MAX_N[self.isa] if (self.ext.BF16_GEMM if bf16 is None else bf16) else ROWS_MAX_N_F32_GEMM
        if layout == "ggml":
            return limits.get(ggml_type, limits["quant"])
        return limits.get(f"{layout}/{ggml_type}", limits.get(layout, limits["quant"]))

    def dequant(self, qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of qt (any shape, rows of K) as f32 or bf16: bit-exact ggml/gguf-py dequantization
        (bf16: those f32 values rounded to nearest even)."""
        qt.validate()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequant: dtype float32 or bfloat16, not {dtype}")
        out = torch.empty(qt.shape, dtype=dtype)
        self.ext.dequant(qt.raw, 0, qt.code, out.numel() // qt.k, qt.k, out)
        return out

    def embed(self, qt: QTensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (n,) of a stored (V, D) matrix -> (n, D) f32, bit-exact as dequant."""
        raw, _, code, n, k = _arg(qt, "embedding")
        return self.ext.embed(raw, 0, code, n, k, ids.reshape(-1))

    def quantize_x(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """x (n, K) f32 as the products take it for a weight whose vec_dot_type is fmt (X_FORMATS), in the
        bytes of ggml's blocks of that type (n, row bytes) uint8: what tests compare with ggml's from_float."""
        return self.ext.quantize_x(x, X_FORMATS.index(fmt))

    def act(self, g: torch.Tensor, u: torch.Tensor, act: str = "silu", alpha: float = 1.702,
            limit: float = 7.0) -> torch.Tensor:
        """act(g, u) elementwise (f32, one shape) as moe_decode computes it: silu(g) u with ggml's
        vectorized SiLU, ggml's f16-table GELU(g) u, or gpt-oss's clamped SwiGLU. For tests."""
        return self.ext.act(g, u, ACTIVATIONS[act], alpha, limit)

    def experts(self, gate: QTensor, up: QTensor | None, down: QTensor, act: str = "silu", alpha: float = 1.702,
                limit: float = 7.0, gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None) -> "Experts":
        """An expert stack checked once, for its moe_decode and moe_prefill calls (see those).
        gate, up: (E, ff, D) stacks, or up None and gate the fused (E, 2 ff, D) gate_up (gate rows first);
        down (E, D, ff); biases f32 (E, ff), (E, ff), (E, D). act: silu (silu(g) u), gelu (ggml's f16-table
        GELU(g) u) or swiglu_oai (gpt-oss: g = min(g, limit), u = clamp(u, +-limit), g sigmoid(alpha g) (u + 1))."""
        return Experts(self, gate, up, down, act, alpha, limit, gate_bias, up_bias, down_bias)

    def moe_decode(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate: QTensor, up: QTensor | None,
                   down: QTensor, act: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Experts.decode of the stack (experts())."""
        experts = self.experts(gate, up, down, act, alpha, limit, gate_bias, up_bias, down_bias)
        return experts.decode(x, ids, w, residual)

    def moe_prefill(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate: QTensor, up: QTensor | None,
                    down: QTensor, act: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                    gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, bf16: bool | None = None) -> torch.Tensor:
        """Experts.prefill of the stack (experts())."""
        return self.experts(gate, up, down, act, alpha, limit, gate_bias, up_bias, down_bias).prefill(x, ids, w, bf16)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMS norm over x's last dim (f32) times w (none: no weight), with ggml's arithmetic (decode.h norm_row)
        in one pass: F.rms_norm's ATen ops take ~10x as long on the CPU (23 us for one 2816-value row)."""
        return self.ext.rms_norm(x.contiguous(), w, eps)

    def norm_rope_(self, t: torch.Tensor, norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   pos: int, neox: bool, hd: int) -> torch.Tensor:
        """model.attention's q or k norm and RoPE in place, one pass over t (n, heads * hd) f32 instead of ~10 ATen
        ops and their temporaries: each group of norm's length RMS-normed with it (none: no norm), then each head
        of row i rotated at position pos + i (cos/sin: model.rope_tables). Returns t."""
        self.ext.norm_rope_(t, norm, eps, cos, sin, pos, neox, hd)
        return t

    def attend(self, q: torch.Tensor, Kc: torch.Tensor, Vc: torch.Tensor, lo: int, end: int, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One token's attention over rows lo..end-1 of a layer's KV cache: q (H * hd values) f32, Kc, Vc (Hkv, n_ctx,
        hd) f16 or f32 -> (1, H * hd) f32, per head h softmax(scale q_h K^T [, sinks_h]) V, head h reading kv head
        h // (H / Hkv). sinks (H,) f32: one more score per head that adds no value row (gpt-oss). Reads the f16 cache
        as it is, where ATen's matmuls would first make f32 copies of the window (two of 16 MB a token for a
        4096-row gemma-4 global layer)."""
        return self.ext.attend(q, Kc, Vc, lo, end, scale, sinks)

    def fused(self, features: frozenset[str]) -> "FusedDecode | None":
        """The fused one-token steps for a model with these architecture features, or None when one of
        them is outside FUSED_FEATURES (the model then decodes with its own ops)."""
        return FusedDecode(self) if features <= FUSED_FEATURES else None


class Experts:
    """One layer's routed experts as the extension takes them, checked once (QuantKernels.experts): a decode
    layer's experts take ~200 us, and the checks of every argument would add ~20 us to each call."""

    def __init__(self, qk: QuantKernels, gate: QTensor, up: QTensor | None, down: QTensor, act: str, alpha: float,
                 limit: float, *biases: torch.Tensor | None):
        self.qk, self.gate, self.down = qk, gate, down
        E, ff, self.D, stacks = _stacks(gate, up, down, act, *biases)
        self.args = (E, ff, *stacks, ACTIVATIONS[act], alpha, limit, *biases)

    def decode(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """One token's routed experts: [residual +] sum_j w_j (down_e act(gate_e x + gate_bias_e,
        up_e x + up_bias_e) + down_bias_e), e = ids_j. x (D,) or (1, D) f32 -> the same shape; ids
        (integers in [0, E), checked by the extension), w: k values each, of any shape."""
        if x.numel() != self.D or ids.numel() != w.numel() or ids.numel() < 1 or ids.dtype.is_floating_point:
            raise ValueError(f"moe_decode: one row x, integer ids and w of the same length, got x {tuple(x.shape)}, "
                             f"ids {tuple(ids.shape)}, w {tuple(w.shape)}")
        return self.qk.ext.moe_decode(x, ids, w, *self.args, residual)

    def prefill(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, bf16: bool | None = None) -> torch.Tensor:
        """Many tokens' routed experts, decode's sum for each: x (n, D) f32, ids and w (n, k) -> (n, D) f32. The
        tokens' rows are grouped by expert; an expert with few rows reads its weight rows once for all of them
        (the rows kernel), one with more than rows_max goes through dequantized tiles and the GEMM (bf16: its
        dtype, as QuantKernels.matmul's)."""
        if x.dim() != 2 or x.shape[1] != self.D or ids.dim() != 2 or ids.shape != w.shape \
                or ids.shape[0] != x.shape[0] or ids.dtype.is_floating_point:
            raise ValueError(f"moe_prefill: x (n, {self.D}), integer ids and w (n, k), got x {tuple(x.shape)}, "
                             f"ids {tuple(ids.shape)}, w {tuple(w.shape)}")
        g, d = self.gate, self.down
        return self.qk.ext.moe_prefill(x, ids, w, *self.args, self.qk.rows_max(g.type, bf16, g.layout),
                                       self.qk.rows_max(d.type, bf16, d.layout), -1 if bf16 is None else int(bf16))


class FusedDecode:
    """decode.h as model.Transformer.block calls it for one token on the CPU: attention (model.attention's
    n == 1 branch, ~35 ATen ops a layer) and ffn norm + routing (model.route, ~8 ops) as one call each,
    the shared expert (model.shared_expert) as moe_decode over a one-expert stack. Per layer, the
    checked weight arguments are built once (a layer's tensors never change)."""

    def __init__(self, qk: QuantKernels):
        self.qk, self.ext = qk, qk.ext
        self._args: dict[int, tuple] = {}     # id(layer dict) -> (it, q/k/v args, output, router, shared expert)
        self._zero = torch.zeros(1, dtype=torch.long)      # the shared expert's id in its one-expert stack

    def _layer(self, cfg, lw: dict) -> tuple:
        got = self._args.get(id(lw))
        if got is None or got[0] is not lw:
            def g(name):
                return lw.get(name)
            attn = (_arg(lw["attn_q.weight"], "attn_q"), _arg(lw["attn_k.weight"], "attn_k"),
                    _arg(lw["attn_v.weight"], "attn_v"), g("attn_q.bias"), g("attn_k.bias"), g("attn_v.bias"),
                    g("attn_q_norm.weight"), g("attn_k_norm.weight"))
            shared = None
            if cfg.has("shared_expert_gated"):
                stack = [QTensor(t.raw, t.type, (1, *t.shape), t.layout) for t in
                         (lw["ffn_gate_shexp.weight"], lw["ffn_up_shexp.weight"], lw["ffn_down_shexp.weight"])]
                shared = (lw["ffn_gate_inp_shexp.weight"].contiguous(), self.qk.experts(*stack))
            got = self._args[id(lw)] = (lw, attn, _arg(lw["attn_output.weight"], "attn_output"),
                                        _arg(lw["ffn_gate_inp.weight"], "ffn_gate_inp"), shared)
        return got

    def attention(self, cfg, lw: dict, Kc: torch.Tensor, Vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: (1, D) f32 residual -> x + attention(x) (1, D) f32, writing K/V at pos."""
        _, a, wo, _, _ = self._layer(cfg, lw)
        return self.ext.attn_decode(x, lw["attn_norm.weight"], cfg.rms_eps, *a, Kc, Vc, cos, sin, pos,
                                    cfg.has("rope_neox"), cfg.n_head, wo)

    def route(self, cfg, lw: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (1, D) f32 residual -> h (1, D) f32 normed, w (1, k) f32, ids (1, k), the shared expert's
        sigmoid gate (1,) (empty without one)."""
        _, _, _, router, shared = self._layer(cfg, lw)
        return tuple(self.ext.route_decode(x, lw["ffn_norm.weight"], cfg.rms_eps, router, cfg.n_expert_used,
                                           cfg.has("norm_topk"), cfg.expert_weights_scale,
                                           None if shared is None else shared[0]))

    def shared(self, cfg, lw: dict, h: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + gate * shared_expert(h): h, residual (1, D) f32, gate (1,) from route."""
        _, _, _, _, (_, experts) = self._layer(cfg, lw)
        return experts.decode(h, self._zero, gate, residual)
