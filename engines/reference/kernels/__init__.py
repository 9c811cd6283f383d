"""AVX512-BF16 matrix-vector kernels for single-token CPU decode (bf16 weights, fp32 accumulation).

Why: ATen's bf16 GEMV (oneDNN off) is compute-bound at ~20 GB/s a Zen4 core. `vdpbf16ps` multiplies
32 bf16 pairs per instruction into 16 fp32 lanes, which makes the product memory-bound: measured on
2 Zen4 threads, weights in DRAM, ~45 GB/s with weights on huge pages (hugepage_copy; ~29 GB/s on
4 KiB pages, where ATen also reaches ~30). `small` preset decode, interleaved A/B on a busy shared
machine: +14% over ATen on 4 KiB pages (118 -> 135 tok/s), +8-10% over ATen on huge pages. The routed
experts of a layer also run as one call (gate_up, SiLU-gating, down, weighted sum), which removes
~8 Python/ATen ops per layer; a layer's one-token attention block (attn_decode, ~35 ops) and its
ffn norm + routing (route_decode, ~8 ops) are one call each too (DecodeKernels): decode on `small`
went from ~6.2 to ~4.2-5 ms a token. Batched products (prefill) never use these (oneDNN's GEMM is faster);
the one single-row product of a prefill, its last position's output head, does.

Layout: every weight is an (N, K) row-major CONTIGUOUS bf16 matrix (y = W x, what F.linear does
with W): attention wqkv (q+2kv, D), wo (D, q), output (V, D), expert stacks gate_up (E, 2*ff, D)
and down (E, D, ff). Rows are split over torch's intra-op threads (at::parallel_for).
Compiled once (g++ and ninja needed, ~30 s) by torch.utils.cpp_extension.load_inline into
cache_dir()/kernels/torch-VERSION; load_inline rebuilds when the source
(bf16_decode.cpp, beside this file) changes.

Quantized weights (quant.cpp, quant_types.h, quant_simd.h; quant_kernels()): matvec, matmul, dequant and the
fused routed-expert step straight from GGUF bytes (QTensor) for F32, F16, BF16, Q8_0, Q4_0, MXFP4,
Q4_K, Q5_K, Q6_K and IQ4_XS. Built once per ISA variant, each in its own directory and under its own
extension name: "avx2" (AVX2 + FMA + F16C, the baseline) and "avx512" (+ AVX512 F/BW/VL/DQ/VNNI/BF16:
vpdpbusd dots, 16-lane float kernels, bf16 scratch for oneDNN's bf16 GEMM). pick_isa() chooses one per
process (MOEBENCH_ISA=auto|avx2|avx512); a variant is never loaded on a CPU without its flags, so a
forced avx512 on an AVX2 machine is a message, not a SIGILL.
"""
from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.reference.qtensor import TYPES, QTensor, expected_bytes

SOURCE = Path(__file__).with_name("bf16_decode.cpp")
FUNCTIONS = ["matvec", "moe_decode", "rms_norm", "attn_decode", "route_decode"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split())


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


@functools.cache
def load():
    """The compiled extension, or the reason it is unavailable (str). Compiles once per source
    (~30 s), later loads reuse the build. -fopenmp is what makes at::parallel_for parallel in an
    extension; the .so then needs libgomp.so.1, which resolves to the copy torch already loaded
    (one OpenMP pool: two would make each other's threads spin-wait on 2 cores)."""
    if not cpu_has_avx512_bf16():
        return "the CPU has no avx512_bf16"
    from torch.utils.cpp_extension import load_inline

    from engines.paths import cache_dir
    build = cache_dir() / "kernels" / f"torch-{torch.__version__}"   # a build per torch ABI
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load_inline("moebench_bf16_kernels", cpp_sources=SOURCE.read_text(), functions=FUNCTIONS,
                           build_directory=str(build), extra_ldflags=["-fopenmp"],
                           extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"])
    except Exception as e:   # no compiler, no ninja, ...: decode keeps ATen's GEMV
        return f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


HUGE = 2 << 20   # x86 transparent huge page


def hugepage_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous CPU tensor t in an anonymous mapping advised for 2 MiB transparent huge
    pages (THP is often "madvise"-only). Why: decode streams ~150 MB of weights per token; with 4 KiB
    pages every 4 KiB read walks the page table and the prefetcher stops at each page end (measured,
    2 Zen4 threads: the kernel reads at ~29 GB/s on 4 KiB pages, ~45 on huge pages). Tensors under
    2 MiB, or platforms without MADV_HUGEPAGE, are returned as they are."""
    n = t.numel() * t.element_size()
    if n < HUGE or not hasattr(mmap, "MADV_HUGEPAGE") or t.device.type != "cpu":
        return t
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(m, dtype=torch.uint8)          # holds a reference to m: lives as long as buf
    off = (-buf.data_ptr()) % HUGE                         # huge pages need 2 MiB-aligned addresses
    return buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)


# The architecture features (engines.reference.archs.FEATURES) the fused decode steps implement; a model
# with any other feature runs its decode through the model's own ops.
FUSED_FEATURES = frozenset({"rope_neox", "qk_norm_head", "qk_norm_full", "qkv_bias", "norm_topk",
                            "shared_expert_gated"})


class DecodeKernels:
    """The extension as model.py uses it on a bf16 CPU: drop-ins for F.rms_norm and F.linear that send
    single rows to the kernels (everything else to ATen), and single-token steps fused into one call
    each: attention (model.attention's n == 1 branch; ~35 ATen ops a layer) and the ffn norm + routing
    (model.route; ~8 ops)."""

    def __init__(self, ext):
        self.ext = ext

    def norm(self, x: torch.Tensor, shape: tuple[int, ...], w: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
        """F.rms_norm; single-token f32 rows normed over their last dim: one op instead of ~8."""
        if (x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu" and len(shape) == 1
                and (w is None or w.dtype == torch.float32)):
            return self.ext.rms_norm(x.contiguous(), w, eps)
        return F.rms_norm(x, shape, w, eps)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear; single rows with bf16 weights run the GEMV (f32 output; callers' .float() is then free)."""
        if x.shape[0] == 1 and w.dtype == torch.bfloat16 and x.device.type == "cpu":
            y = self.ext.matvec(x, w)
            return y if b is None else y + b
        return F.linear(x, w, b)

    def attention(self, cfg, lw, Kc: torch.Tensor, Vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: (1, D) f32 residual -> (1, D) f32, writing K/V at pos."""
        return self.ext.attn_decode(x.contiguous(), lw.attn_norm, cfg.rms_eps, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm,
                                    Kc, Vc, cos, sin, pos, cfg.has("rope_neox"), cfg.n_head, lw.wo)

    def norm_route(self, cfg, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (1, D) f32 residual -> h (1, D) f32 normed, w (1, k) f32, ids (1, k)."""
        return tuple(self.ext.route_decode(x.contiguous(), lw.ffn_norm, cfg.rms_eps, lw.router, cfg.n_expert_used,
                                           cfg.has("norm_topk"), cfg.expert_weights_scale))


QUANT_SOURCE = Path(__file__).with_name("quant.cpp")
# -ffp-contract=off: no mul + add fused behind our back, so dequant rounds exactly as ggml and gguf-py do
QUANT_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c"]
# ISA variant -> (the /proc/cpuinfo flags it needs, its extra compiler flags)
ISAS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "avx2": (("avx2", "fma", "f16c"), []),
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"),
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"]),
}


def missing_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags variant `isa` needs that `flags` (default: this CPU's) lacks."""
    have = cpu_flags() if flags is None else flags
    return [f for f in ISAS[isa][0] if f not in have]


def pick_isa(flags: frozenset[str] | None = None) -> str:
    """The quant kernels' variant for this process: MOEBENCH_ISA=avx2|avx512 as asked, or (auto, the
    default) the widest one the CPU runs. Raises ValueError saying what is missing."""
    want = os.environ.get("MOEBENCH_ISA", "auto").strip().lower() or "auto"
    if want != "auto":
        if want not in ISAS:
            raise ValueError(f"MOEBENCH_ISA={want}: expected auto, {', '.join(ISAS)}")
        if missing := missing_flags(want, flags):
            raise ValueError(f"MOEBENCH_ISA={want}, but the CPU lacks {', '.join(missing)}")
        return want
    for isa in ("avx512", "avx2"):
        if not missing_flags(isa, flags):
            return isa
    raise ValueError("the quant kernels need at least AVX2, FMA and F16C; the CPU lacks "
                     + ", ".join(missing_flags("avx2", flags)))


@functools.cache
def load_quant(isa: str):
    """The compiled quant extension of variant `isa`, or the reason it is unavailable (str). Compiles
    once (~1 min; ninja rebuilds when quant.cpp or the headers beside it change)."""
    if missing := missing_flags(isa):
        return f"the CPU lacks {', '.join(missing)}, which the {isa} kernels need"
    from torch.utils.cpp_extension import load

    from engines.paths import cache_dir
    build = cache_dir() / "kernels" / f"torch-{torch.__version__}" / f"quant-{isa}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load(f"moebench_quant_{isa}", [str(QUANT_SOURCE)], extra_cflags=QUANT_CFLAGS + ISAS[isa][1],
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(QUANT_SOURCE.parent)],
                    build_directory=str(build))
    except Exception as e:   # no compiler, no ninja, ...
        return f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def quant_kernels(isa: str | None = None) -> "QuantKernels | str":
    """The quant kernels of `isa` (default pick_isa()), or why there are none (str)."""
    if isa is None:
        try:
            isa = pick_isa()
        except ValueError as e:
            return str(e)
    ext = load_quant(isa)
    return ext if isinstance(ext, str) else QuantKernels(ext, isa)


ACTIVATIONS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
# matmul: the most x rows that go to the rows kernel (every weight row read once for all of them, int8
# dots for quantized types); more rows go to dequantized tiles and ATen's GEMM. Crossovers measured on
# 2 Zen 5 threads, 4096 x 4096 (benchmarks/kernels.py): avx2's int8 rows kernel (~250 GFLOP/s) beats
# dequant + f32 GEMM (~200) at every n up to 512; on avx512 oneDNN's bf16 GEMM (~850 at n = 512)
# overtakes the rows kernel (~430) past n = 32, and already at n = 3..4 for F16 and BF16 weights
# (nothing to gain from int8 there); F32's f32 rows kernel loses to the f32 GEMM past n = 32.
ROWS_MAX_N = {"avx2": {"F32": 32, "F16": 32, "BF16": 32, "quant": 1 << 62},
              "avx512": {"F32": 32, "F16": 3, "BF16": 2, "quant": 32}}


def _raw(qt: QTensor, what: str) -> torch.Tensor:
    """qt's bytes, after checking that they are what its type and shape say (GGUF files are untrusted).
    The extension checks the rest of what it reads (a 1-D contiguous CPU tensor, sizes in bounds, x)."""
    if qt.type not in TYPES:
        raise ValueError(f"{what}: ggml type {qt.type!r} has no kernel ({', '.join(TYPES)})")
    block = TYPES[qt.type][1]
    if len(qt.shape) < 1 or min(qt.shape) < 1 or qt.k % block:
        raise ValueError(f"{what}: shape {qt.shape} is not rows of whole {qt.type} blocks of {block}")
    r = qt.raw
    if r.dtype != torch.uint8 or r.numel() != expected_bytes(qt.type, qt.shape):
        raise ValueError(f"{what}: {r.numel()} {r.dtype} values, but {qt.type} {qt.shape} takes "
                         f"{expected_bytes(qt.type, qt.shape)} bytes")
    return r


class QuantKernels:
    """quant.cpp as the engine calls it: products with QTensor weights (N, K) as stored. Block-quantized
    types take x quantized to int8 per 32 values (scale max|x|/127, like ggml's q8_0, scale kept f32);
    F32/F16/BF16 multiply x in f32. `isa` is the variant in use (the engine's info())."""

    def __init__(self, ext, isa: str):
        self.ext, self.isa = ext, isa

    def matvec(self, qt: QTensor, x: torch.Tensor) -> torch.Tensor:
        """W x for one activation row: x (K,) or (1, K) f32 -> (N,) or (1, N) f32."""
        raw = _raw(qt, "weight")
        if len(qt.shape) != 2:
            raise ValueError(f"matvec: a (N, K) weight, got {qt.shape}")
        return self.ext.matvec(raw, 0, qt.code, qt.n_rows, qt.k, x).reshape(*x.shape[:-1], qt.n_rows)

    def matmul(self, qt: QTensor, x: torch.Tensor, rows_max_n: int | None = None) -> torch.Tensor:
        """x W^T: x (..., K) f32 -> (..., N) f32. Up to rows_max_n rows (default: ROWS_MAX_N for the
        variant and type) every weight row is read once for all of them, with int8 x for quantized
        types (as matvec); more rows go through per-tile dequantized scratch and ATen's GEMM (f32;
        bf16 on the avx512 variant, x and results then rounded to bf16)."""
        raw = _raw(qt, "weight")
        if len(qt.shape) != 2:
            raise ValueError(f"matmul: a (N, K) weight, got {qt.shape}")
        if rows_max_n is None:
            limits = ROWS_MAX_N[self.isa]
            rows_max_n = limits.get(qt.type, limits["quant"])
        y = self.ext.matmul(raw, 0, qt.code, qt.n_rows, qt.k, x, rows_max_n)
        return y.reshape(*x.shape[:-1], qt.n_rows)

    def dequant(self, qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of qt (any shape, rows of K) as f32 or bf16: bit-exact ggml/gguf-py dequantization
        (bf16: those f32 values rounded to nearest even)."""
        raw = _raw(qt, "weight")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequant: dtype float32 or bfloat16, not {dtype}")
        out = torch.empty(qt.shape, dtype=dtype)
        self.ext.dequant(raw, 0, qt.code, out.numel() // qt.k, qt.k, out)
        return out

    def moe_decode(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate: QTensor, up: QTensor | None,
                   down: QTensor, act: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> torch.Tensor:
        """One token's routed experts: sum_j w_j (down_e act(gate_e x + gate_bias_e, up_e x + up_bias_e)
        + down_bias_e), e = ids_j. x (D,) or (1, D) f32 -> the same shape; ids (integers in [0, E),
        checked by the extension), w: k values each.
        gate, up: (E, ff, D) stacks, or up None and gate the fused (E, 2 ff, D) gate_up (gate rows
        first); down (E, D, ff); biases f32 (E, ff), (E, ff), (E, D). act: silu (silu(g) u), gelu
        (ggml's tanh GELU(g) u) or swiglu_oai (gpt-oss: g = min(g, limit), u = clamp(u, +-limit),
        g sigmoid(alpha g) (u + 1))."""
        if act not in ACTIVATIONS:
            raise ValueError(f"act: one of {', '.join(ACTIVATIONS)}, not {act!r}")
        graw, draw = _raw(gate, "gate"), _raw(down, "down")
        if len(gate.shape) != 3 or len(down.shape) != 3:
            raise ValueError(f"moe_decode: expert stacks (E, N, K), got gate {gate.shape}, down {down.shape}")
        E, D = gate.shape[0], gate.shape[2]
        if up is None:                                   # fused gate_up: two views of one stack
            if gate.shape[1] % 2:
                raise ValueError(f"moe_decode: fused gate_up {gate.shape} needs an even row count")
            ff = gate.shape[1] // 2
            urow = (graw, ff * gate.row_bytes, 2 * ff * gate.row_bytes, gate.code)
            grow = (graw, 0, 2 * ff * gate.row_bytes, gate.code)
        else:
            ff = gate.shape[1]
            if up.shape != gate.shape:
                raise ValueError(f"moe_decode: up {up.shape} differs from gate {gate.shape}")
            grow = (graw, 0, ff * gate.row_bytes, gate.code)
            urow = (_raw(up, "up"), 0, ff * up.row_bytes, up.code)
        if down.shape != (E, D, ff):
            raise ValueError(f"moe_decode: down {down.shape}, expected {(E, D, ff)}")
        if x.numel() != D or ids.numel() != w.numel() or ids.numel() < 1 or ids.dtype.is_floating_point:
            raise ValueError(f"moe_decode: one row x, integer ids and w of the same length, got x {tuple(x.shape)}, "
                             f"ids {tuple(ids.shape)}, w {tuple(w.shape)}")
        for b, shape, what in ((gate_bias, (E, ff), "gate_bias"), (up_bias, (E, ff), "up_bias"),
                               (down_bias, (E, D), "down_bias")):
            if b is not None and (b.dtype != torch.float32 or tuple(b.shape) != shape):
                raise ValueError(f"moe_decode: {what} must be f32 {shape}, got {b.dtype} {tuple(b.shape)}")
        y = self.ext.moe_decode(x, ids, w, E, ff, *grow, *urow, draw, 0, D * down.row_bytes, down.code,
                                ACTIVATIONS[act], alpha, limit, gate_bias, up_bias, down_bias)
        return y.reshape(x.shape)
