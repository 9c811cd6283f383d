"""The GGUF quant kernels (engines.reference.kernels.quant_kernels) on both ISA variants, against llama.cpp's
own CPU code (libggml-base / libggml-cpu from the llama_cpp package, through ctypes) and gguf-py.

- Weights come from ggml's own quantizer (workloads.quantize: the bytes llama-quantize writes).
- Dequantization is bit-exact (gguf-py's dequantizer, which follows ggml's dequantize_row_*).
- Activations: x converted for a weight type is byte for byte what ggml's from_float of that type's
  vec_dot_type makes (f16, bf16, block_q8_0, block_q8_1, block_q8_K), and the type -> vec_dot_type map
  is ggml's.
- Products: every int8 value and scale equals ggml's, only the order of the float additions differs, so
  a row's result is ggml's vec_dot on the same row and activation within 1e-6 of sum_i |w_i x_i| (x as
  ggml converted it; measured <= 1e-7). The GEMM path (many rows): the f32 GEMM multiplies the dequantized
  weights with x as the rows kernel sees it (quantized, then dequantized), within 1e-5 of sum |w x| of the
  float64 product; the bf16 GEMM rounds x itself, w and the output to bf16 (each <= 2^-9): 2^-7 of sum |w x|.
"""
import ctypes
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from engines import devices
from engines.reference import kernels
from engines.reference.qtensor import COMPUTED, TYPES, QTensor

ALL = list(COMPUTED)
FLOAT = {"F32", "F16", "BF16"}
# the activation format each weight type multiplies (ggml-cpu.c type_traits_cpu vec_dot_type)
VEC_DOT = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_1": "Q8_1", "Q5_1": "Q8_1"} | \
          {t: "Q8_0" for t in ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4")} | \
          {t: "Q8_K" for t in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")}
FORMAT_CODES = {"F32": 0, "F16": 1, "BF16": 30, "Q8_0": 8, "Q8_1": 9, "Q8_K": 15}


class Traits(ctypes.Structure):       # struct ggml_type_traits_cpu, ggml/include/ggml-cpu.h
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                              ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Ggml:
    """llama_cpp's libggml-cpu: from_float, vec_dot and vec_dot_type per type (ggml_get_type_traits_cpu)."""

    def __init__(self, lib: Path):
        self.base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu.ggml_cpu_init()
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
        self.base.ggml_row_size.restype = ctypes.c_size_t
        self.base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

    def traits(self, code: int) -> Traits:
        return self.cpu.ggml_get_type_traits_cpu(code).contents

    def from_float(self, fmt: str, x: np.ndarray) -> np.ndarray:
        """x (n, k) f32 -> (n, row bytes) of ggml's from_float for activation format fmt."""
        code = FORMAT_CODES[fmt]
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty((x.shape[0], self.base.ggml_row_size(code, x.shape[1])), np.uint8)
        f = FROM_FLOAT(self.traits(code).from_float)
        for r in range(x.shape[0]):
            f(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
        return out

    def vec_dot(self, t: str, raw: np.ndarray, n_rows: int, k: int, x: np.ndarray) -> np.ndarray:
        """ggml's vec_dot of each row of raw (type t, n_rows x k) with x (k,) as its from_float converts it."""
        xq = self.from_float(VEC_DOT[t], x[None])[0]
        f, rb, s = VEC_DOT_FN(self.traits(TYPES[t][0]).vec_dot), raw.size // n_rows, ctypes.c_float()
        out = np.empty(n_rows, np.float32)
        for r in range(n_rows):
            f(k, ctypes.byref(s), 0, raw[r * rb:].ctypes.data, 0, xq.ctypes.data, 0, 1)
            out[r] = s.value
        return out


@functools.cache
def _ggml() -> Ggml | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    lib = Path(llama_cpp.__file__).parent / "lib"
    return Ggml(lib) if (lib / "libggml-cpu.so").exists() else None


@pytest.fixture(scope="module")
def ggml() -> Ggml:
    g = _ggml()
    if g is None:
        pytest.skip("llama_cpp's libggml-cpu is not installed")
    return g


@functools.cache
def weights(t: str, shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, their gguf-py dequantization) of a random f32 matrix quantized to t by ggml."""
    import gguf
    from gguf.quants import dequantize

    from workloads.quantize import quantize
    if _ggml() is None:
        pytest.skip("llama_cpp's libggml-base (ggml_quantize_chunk) is not installed")
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    raw = quantize(a, t).reshape(-1)
    ref = raw.view(np.float32) if t == "F32" else dequantize(raw, gguf.GGMLQuantizationType[t])
    return raw, ref.reshape(shape).astype(np.float32)


def qtensor(t: str, shape: tuple[int, ...], seed: int = 0) -> tuple[QTensor, np.ndarray]:
    raw, ref = weights(t, shape, seed)
    return QTensor(torch.from_numpy(raw.copy()), t, shape), ref


def k_of(t: str) -> list[int]:
    """Row lengths to test: 256-value super-blocks for K-quants and IQ4_XS (2816: 11 of them); gpt-oss's
    2880 (90 blocks of 32: 11 units of 8 and a tail of 2) for the 32-value types; float types any (37)."""
    return [512, 2816] if TYPES[t][1] == 256 else [512, 2880] if t not in FLOAT else [512, 2880, 37]


def uneven(g: np.random.Generator, *shape: int) -> np.ndarray:
    """Activations of uneven magnitudes (as after a norm and a product)."""
    return (g.standard_normal(shape) * np.exp(g.standard_normal(shape))).astype(np.float32)


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def qk(request):
    """The variant's kernels, compiled once per session; skipped where this CPU or toolchain can't."""
    isa = request.param
    if missing := kernels.missing_flags(isa):
        pytest.skip(f"{isa}: the CPU lacks {', '.join(missing)}")
    k = kernels.quant_kernels(isa)
    if isinstance(k, str):
        pytest.skip(f"{isa}: {k}")
    return k


def as_ggml_sees(qk, t: str, x: np.ndarray) -> np.ndarray:
    """x (n, k) as the products of type t multiply it (quantized to its vec_dot_type, dequantized), f64."""
    fmt, k = VEC_DOT[t], x.shape[-1]
    b = qk.quantize_x(torch.from_numpy(np.ascontiguousarray(x)), fmt).numpy()
    if fmt in ("F32", "F16", "BF16"):
        dt = {"F32": np.float32, "F16": np.float16}.get(fmt)
        v = b.view(dt) if dt else (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return v.astype(np.float64).reshape(x.shape)
    blk, size, head = (256, 292, 4) if fmt == "Q8_K" else (32, 34 if fmt == "Q8_0" else 36, 2 if fmt == "Q8_0" else 4)
    bl = b.reshape(x.shape[0], k // blk, size)
    d = bl[..., :4].copy().view(np.float32) if fmt == "Q8_K" else bl[..., :2].copy().view(np.float16)
    q = bl[..., head:head + blk].view(np.int8)
    return (d.astype(np.float64) * q).reshape(x.shape)


def check(y: np.ndarray, ref: np.ndarray, tol: np.ndarray, what: str):
    err = np.abs(y.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"{what}: |err| {err[worst]:.3g} > bound {tol[worst]:.3g} at {worst}"


@pytest.mark.parametrize("t", ALL)
def test_dequant_is_bit_exact(qk, t):
    for k in k_of(t):
        q, ref = qtensor(t, (37, k))
        out = qk.dequant(q)
        assert out.dtype == torch.float32 and out.shape == (37, k)
        assert np.array_equal(out.numpy(), ref), f"{t} k={k}: f32 dequant differs from gguf-py"
        assert torch.equal(qk.dequant(q, torch.bfloat16), torch.from_numpy(ref).bfloat16()), f"{t} k={k}: bf16 dequant"
        ids = torch.tensor([36, 0, 5, 5])                    # an embedding lookup: rows in any order, repeated
        assert np.array_equal(qk.embed(q, ids).numpy(), ref[ids.numpy()]), f"{t} k={k}: embed"
    stack, sref = qtensor(t, (3, 5, k_of(t)[0]), seed=1)     # an expert stack, and one expert of it
    assert np.array_equal(qk.dequant(stack).numpy(), sref)
    assert np.array_equal(qk.dequant(stack.expert(2)).numpy(), sref[2])


def test_vec_dot_types_are_ggmls(ggml):
    for t in ALL:
        assert ggml.traits(TYPES[t][0]).vec_dot_type == FORMAT_CODES[VEC_DOT[t]], t


@pytest.mark.parametrize("fmt", list(kernels.X_FORMATS))
def test_activations_equal_ggml_from_float(qk, ggml, fmt):
    """Byte for byte: uneven magnitudes, an all-zero block, a block whose largest |x| is negative, one where
    +a and -a tie for the largest, values on rounding ties of x * 127 / amax, and tiny blocks (f16 d underflows)."""
    g = np.random.default_rng(1)
    x = uneven(g, 7, 2816)
    x[1, :512] = 0
    x[2, 300] = -50.0
    x[3, 256:512] = 0.25
    x[3, 260], x[3, 270] = 127.0, -127.0
    x[3, 0:32] = np.arange(-16, 16) / 2                 # x * 127 / amax = k + 1/2 for some k
    x[4, :256] *= 1e-6
    x[5, :256] *= 1e-9
    ours = qk.quantize_x(torch.from_numpy(x), fmt).numpy()
    ref = ggml.from_float(fmt, x)
    if fmt == "Q8_K":     # ggml leaves the bsums of an all-zero block unwritten (quantize_row_q8_K_ref): ours are 0
        ob, rb = ours.reshape(7, -1, 292), ref.reshape(7, -1, 292)
        zero = rb[..., :4].copy().view(np.float32)[..., 0] == 0
        rb[zero, 260:] = ob[zero, 260:]
        assert (ob[zero, 260:] == 0).all()
    assert ours.shape == ref.shape and np.array_equal(ours, ref), f"{fmt}: {(ours != ref).sum()} bytes differ"


@pytest.mark.parametrize("t", ALL)
def test_matvec_equals_ggml_vec_dot(qk, ggml, t):
    g = np.random.default_rng(5)
    for k in k_of(t):
        q, W = qtensor(t, (37, k))
        raw = q.raw.numpy()
        x = uneven(g, k)
        y = qk.matvec(q, torch.from_numpy(x))
        assert y.shape == (37,) and y.dtype == torch.float32
        assert qk.matvec(q, torch.from_numpy(x)[None]).shape == (1, 37)
        ref = ggml.vec_dot(t, raw, 37, k, x)
        scale = np.abs(W).astype(np.float64) @ np.abs(as_ggml_sees(qk, t, x[None])[0])
        check(y.numpy(), ref, 1e-6 * scale + 1e-30, f"{t} k={k}")
        one = qk.matvec(q.rows(36, 37), torch.from_numpy(x))           # a view at an offset, one row
        check(one.numpy(), ref[36:], 1e-6 * scale[36:] + 1e-30, f"{t} k={k} last row")


@pytest.mark.parametrize("t", ALL)
def test_matmul_rows_kernel_and_gemm(qk, ggml, t):
    g = np.random.default_rng(6)
    for k in k_of(t)[:2]:
        q, W = qtensor(t, (37, k))
        raw = q.raw.numpy()
        for n in (1, 3, 17, 40):
            x = uneven(g, n, k)
            xs = as_ggml_sees(qk, t, x)
            scale = np.abs(xs) @ np.abs(W.astype(np.float64)).T                      # (n, 37)
            rows = qk.matmul(q, torch.from_numpy(x), rows_max_n=n).numpy()
            ref = np.stack([ggml.vec_dot(t, raw, 37, k, x[i]) for i in range(n)])
            check(rows, ref, 1e-6 * scale + 1e-30, f"{t} k={k} n={n} rows kernel")
            y = qk.matmul(q, torch.from_numpy(x), rows_max_n=0, bf16=False).numpy()
            check(y, xs @ W.T.astype(np.float64), 1e-5 * scale + 1e-30, f"{t} k={k} n={n} gemm f32")
            y = qk.matmul(q, torch.from_numpy(x), rows_max_n=0, bf16=True).numpy()        # x itself, in bf16
            x64, aw = x.astype(np.float64), np.abs(W.astype(np.float64)).T
            check(y, x64 @ W.T.astype(np.float64), 2 ** -7 * (np.abs(x64) @ aw) + 1e-30, f"{t} k={k} n={n} gemm bf16")
            assert qk.matmul(q, torch.from_numpy(x)).shape == (n, 37)            # the default split
    x3 = torch.randn(2, 3, k)                                                         # leading dims are kept
    assert qk.matmul(q, x3).shape == (2, 3, 37)


def test_matmul_default_gemm_dtype(qk):
    """bf16=None is the variant's (bf16 on avx512, f32 on avx2); False is f32 on either."""
    q, W = qtensor("Q8_0", (64, 512))
    x = torch.randn(64, 512)
    f32 = qk.matmul(q, x, rows_max_n=0, bf16=False)
    default = qk.matmul(q, x, rows_max_n=0)
    assert torch.equal(default, qk.matmul(q, x, rows_max_n=0, bf16=qk.ext.BF16_GEMM))
    assert torch.equal(default, f32) != qk.ext.BF16_GEMM
    assert qk.ext.BF16_GEMM == (qk.isa == "avx512")


def test_unaligned_float_weights(qk):
    """F32/BF16 bytes at an odd address (GGUF offsets are untrusted): matvec reads them unaligned, the
    GEMM path dequantizes them instead of viewing them as a float tensor."""
    x = torch.randn(5, 64)
    for t in ("F32", "BF16"):
        q, W = qtensor(t, (37, 64))
        buf = torch.empty(q.raw.numel() + 1, dtype=torch.uint8)
        buf[1:] = q.raw
        qu = QTensor(buf[1:], t, q.shape)
        xs = as_ggml_sees(qk, t, x.numpy())
        ref, scale = xs @ W.T.astype(np.float64), np.abs(xs) @ np.abs(W.astype(np.float64)).T
        check(qk.matmul(qu, x, rows_max_n=0, bf16=True).numpy(), x.double().numpy() @ W.T.astype(np.float64),
              2 ** -7 * (x.abs().double().numpy() @ np.abs(W.astype(np.float64)).T), f"{t} gemm bf16")
        check(qk.matmul(qu, x, rows_max_n=0, bf16=False).numpy(), ref, 1e-5 * scale, f"{t} gemm f32")
        check(qk.matvec(qu, x[0]).numpy()[None], ref[:1], 1e-6 * scale[:1], f"{t} matvec")


def test_isas_agree():
    """avx2 and avx512 give the same dequantization, activations and (to float rounding) products."""
    ks = [kernels.quant_kernels(i) for i in ("avx2", "avx512") if not kernels.missing_flags(i)]
    ks = [k for k in ks if not isinstance(k, str)]
    if len(ks) < 2:
        pytest.skip("this CPU runs only one variant")
    a, b = ks
    x = uneven(np.random.default_rng(7), 5, 512)
    for fmt in kernels.X_FORMATS:
        assert torch.equal(a.quantize_x(torch.from_numpy(x), fmt), b.quantize_x(torch.from_numpy(x), fmt)), fmt
    for t in ALL:
        q, W = qtensor(t, (37, 512))
        assert torch.equal(a.dequant(q), b.dequant(q))
        tol = 2e-6 * (np.abs(as_ggml_sees(a, t, x)) @ np.abs(W.astype(np.float64)).T) + 1e-30
        for i in range(5):
            xi = torch.from_numpy(x[i])
            check(a.matvec(q, xi).numpy()[None], b.matvec(q, xi).numpy()[None], tol[i:i + 1], t)
        xs = torch.from_numpy(x)
        check(a.matmul(q, xs, 8).numpy(), b.matmul(q, xs, 8).numpy(), tol, f"{t} rows")


def act_ref(act: str, g: np.ndarray, u: np.ndarray, alpha=1.702, limit=7.0) -> np.ndarray:
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    if act == "gelu":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-alpha * g)) * (u + 1)


# (gate/up type, down type, D, ff): a Q4_K_M-like mix, gpt-oss (MXFP4, 2880 wide), the fallbacks of
# llama.cpp's quantizer for rows that are not whole 256-value blocks, float weights
MOE_CASES = [("Q4_K", "Q6_K", 256, 512), ("MXFP4", "MXFP4", 2880, 64), ("Q5_0", "Q8_0", 2880, 96),
             ("IQ4_NL", "Q5_1", 704, 160), ("Q4_1", "IQ4_XS", 96, 256), ("BF16", "F16", 96, 80)]


@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("gt,dt,D,ff", MOE_CASES)
def test_moe_decode_matches_float_experts(qk, act, gt, dt, D, ff):
    """Against float64 experts on the dequantized weights, gate_up fused and separate, with and without
    biases and a residual. Quantized types round x and then the activations to int8 (each ~0.5% of a
    product's scale; measured up to 1% of the largest output): the bound is 3% of it, where a wrong expert,
    bias or weight moves outputs by their whole size. Float types (f16/bf16 x, f32 math): 1e-2 / 1e-4 of it."""
    E, ids, w = 6, np.array([4, 0, 5]), np.array([0.5, 0.3, 0.2], np.float32)
    g = np.random.default_rng(8)
    fused, F = qtensor(gt, (E, 2 * ff, D), seed=2)
    gate, G = qtensor(gt, (E, ff, D), seed=3)
    up, U = qtensor(gt, (E, ff, D), seed=4)
    down, DN = qtensor(dt, (E, D, ff), seed=5)
    x = (g.standard_normal(D) * 3 / np.sqrt(D)).astype(np.float32)     # gate, up ~ N(0, 9): swiglu_oai clamps some
    gb, ub = (g.standard_normal((E, ff)).astype(np.float32) for _ in range(2))
    db = (g.standard_normal((E, D)) * np.sqrt(ff)).astype(np.float32)
    res = g.standard_normal(D).astype(np.float32)
    tol = 3e-2 if gt not in FLOAT else 1e-2 if "F16" in (gt, dt) or "BF16" in (gt, dt) else 1e-4
    for stacked in (True, False):
        for bias in (False, True):
            ref = res.astype(np.float64) if bias else np.zeros(D)
            for j, e in enumerate(ids):
                gm, um = (F[e, :ff], F[e, ff:]) if stacked else (G[e], U[e])
                gv, uv = gm.astype(np.float64) @ x, um.astype(np.float64) @ x
                if bias:
                    gv, uv = gv + gb[e], uv + ub[e]
                ref += w[j] * (DN[e].astype(np.float64) @ act_ref(act, gv, uv) + (db[e] if bias else 0))
            b = {"gate_bias": gb, "up_bias": ub, "down_bias": db, "residual": res} if bias else {}
            y = qk.moe_decode(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w),
                              fused if stacked else gate, None if stacked else up, down, act,
                              **{k: torch.from_numpy(v) for k, v in b.items()})
            err = np.abs(y.numpy() - ref).max() / np.abs(ref - (res if bias else 0)).max()
            assert y.shape == (D,) and err <= tol, f"{gt}/{dt} {act} stacked={stacked} bias={bias}: {err:.2e} of max"


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("gt,dt,D,ff", MOE_CASES)
def test_moe_prefill_is_moe_decode_per_token(qk, act, gt, dt, D, ff):
    """Many tokens' experts (grouped by expert; each expert's rows through the rows kernel, or with
    rows_max 0 through dequantized tiles and the f32 GEMM) against moe_decode token by token, fused
    gate_up and separate, with biases. Float weights: the same products in another float order, within
    1e-5 of the largest output (measured <= 2.9e-6). Quantized: the rows path multiplies the same int8
    values (measured: identical in 37 of 40 cases, else <= 5e-5, where a float-order difference moved an
    activation across an int8 rounding boundary of the down product's x); the GEMM path the same values
    in f32 (measured <= 4.2e-4 for Q4_K/Q6_K); bound 3e-3. Routed experts include one no token picks and
    one with a single row."""
    E, n, k = 6, 37, 3
    g = np.random.default_rng(9)
    fused, _ = qtensor(gt, (E, 2 * ff, D), seed=2)
    gate, _ = qtensor(gt, (E, ff, D), seed=3)
    up, _ = qtensor(gt, (E, ff, D), seed=4)
    down, _ = qtensor(dt, (E, D, ff), seed=5)
    x = torch.from_numpy((g.standard_normal((n, D)) * 3 / np.sqrt(D)).astype(np.float32))
    ids = torch.from_numpy(np.stack([g.permutation(4)[:k] for _ in range(n)]))      # experts 0..3
    ids[0, 0] = 5                                                                     # expert 5: one row
    w = torch.from_numpy(g.random((n, k)).astype(np.float32))
    gb, ub = (torch.from_numpy(g.standard_normal((E, ff)).astype(np.float32)) for _ in range(2))
    db = torch.from_numpy((g.standard_normal((E, D)) * np.sqrt(ff)).astype(np.float32))
    tol = 1e-5 if gt in FLOAT and dt in FLOAT else 3e-3
    for stacked in (True, False):
        mats = (fused, None, down) if stacked else (gate, up, down)
        want = torch.stack([qk.moe_decode(x[t], ids[t], w[t], *mats, act, gate_bias=gb, up_bias=ub, down_bias=db)
                            for t in range(n)])
        scale = want.abs().max()
        got = qk.moe_prefill(x, ids, w, *mats, act, gate_bias=gb, up_bias=ub, down_bias=db, bf16=False)
        assert (got - want).abs().max() <= tol * scale, f"rows {gt}/{dt} stacked={stacked}"
        if gt in ("Q4_K", "BF16"):                       # the GEMM path: every expert past rows_max 0
            _, ff_, _, stacks = kernels._stacks(*mats, act, gb, ub, db)
            got = qk.ext.moe_prefill(x, ids, w, E, ff_, *stacks, kernels.ACTIVATIONS[act], 1.702, 7.0, gb, ub, db,
                                     0, 0, 0)
            assert (got - want).abs().max() <= tol * scale, f"gemm {gt}/{dt} stacked={stacked}"


def test_gelu_is_ggmls_f16_table(qk):
    """moe_decode's GELU: every f16 input equals libggml-cpu's own table (ggml_table_gelu_f16, filled by
    ggml_cpu_init), 0 at or below -10, x at or above 10. offload.gelu (torch) computes the same table
    entries except where torch's vectorized tanh rounds differently from tanhf (26 of the 37376 f16 inputs
    in (-10, 10) with torch 2.13: one f16 step, or ~2e-7 near -10): on a sweep of values the two agree
    everywhere else."""
    from engines.reference.offload import gelu as torch_gelu
    h = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    inside = torch.isfinite(h) & (h.abs() < 10)
    gelu = lambda x: qk.act(x, torch.ones_like(x), "gelu")     # noqa: E731
    ours = gelu(h[inside])
    g = _ggml()
    if g is not None:
        raw = np.frombuffer((ctypes.c_uint16 * (1 << 16)).in_dll(g.cpu, "ggml_table_gelu_f16"), dtype=np.uint16)
        table = torch.from_numpy(raw.copy().view(np.float16)).float()
        assert torch.equal(ours, table[inside])
    edge = torch.tensor([-1e30, -10.0, 10.0, 11.5, 1e30])
    assert torch.equal(gelu(edge), torch.tensor([0.0, 0.0, 10.0, 11.5, 1e30]))
    grid = torch_gelu(h[inside])                     # torch's value for every f16 input
    moved = grid != ours
    # one f16 step, or (near -10, where tanh is -1 to within its rounding) a few f16 subnormal steps
    assert moved.sum() <= 64 and ((grid - ours)[moved].abs() <= ours[moved].abs() * 2 ** -10 + 1e-6).all()
    sweep = torch.linspace(-12, 12, 24001)
    a, b = gelu(sweep), torch_gelu(sweep)
    differ = a != b                                  # only at f16 inputs where torch's own entry differs
    f16 = sweep[differ].half().float()
    assert torch.isin(f16, h[inside][moved]).all() and (a[differ] == gelu(f16)).all()


def test_silu_is_ggmls_swiglu(qk):
    """silu(g) u equals libggml-cpu's ggml_vec_swiglu_f32 bit for bit, for the variant of the ISA that library
    was built for (llama_cpp builds natively: its AVX-512 vectorized exp here, its AVX2 one on AVX2 machines)."""
    g = _ggml()
    if g is None or not hasattr(g.cpu, "ggml_vec_swiglu_f32"):
        pytest.skip("llama_cpp's libggml-cpu does not export ggml_vec_swiglu_f32")
    if qk.isa != devices.cpu_isa(devices.cpu_flags()):
        pytest.skip(f"llama_cpp's libggml-cpu is built for this CPU's widest ISA, not {qk.isa}")
    x = np.concatenate([np.linspace(-120, 120, 4001), np.random.default_rng(3).standard_normal(4000) * 4])
    x = x.astype(np.float32)
    u = np.random.default_rng(4).standard_normal(x.size).astype(np.float32)
    ref = np.empty_like(x)
    ptr = ctypes.c_void_p
    g.cpu.ggml_vec_swiglu_f32(ctypes.c_int(x.size), *(a.ctypes.data_as(ptr) for a in (ref, x, u)))
    assert np.array_equal(qk.act(torch.from_numpy(x), torch.from_numpy(u)).numpy(), ref)


def test_isa_choice(monkeypatch):
    avx2 = frozenset({"avx2", "fma", "f16c"})
    full = avx2 | frozenset(devices.CPU_ISAS["avx512"])
    monkeypatch.delenv("MOEBENCH_ISA", raising=False)
    assert devices.cpu_isa(full) == "avx512" and devices.cpu_isa(avx2) == "avx2"
    assert devices.cpu_isa(full | {"amx_tile", "amx_int8", "amx_bf16"}) == "amx"
    assert kernels.missing_flags("avx512", avx2)[0] == "avx512f" and not kernels.missing_flags("avx2", full)
    monkeypatch.setenv("MOEBENCH_ISA", "avx512")
    monkeypatch.setattr(devices, "cpu_flags", lambda: avx2)      # forced avx512 on an AVX2 CPU: a message, no load
    assert "lacks avx512f" in kernels.quant_kernels()
    monkeypatch.setenv("MOEBENCH_ISA", "sse4")
    assert "MOEBENCH_ISA=sse4 is not a kernel variant" in kernels.quant_kernels()


def test_qtensor_validate():
    q, _ = qtensor("Q4_K", (37, 512))
    assert q.validate() is q
    with pytest.raises(ValueError, match=r"10655 torch.uint8 values in 1 dims, but Q4_K \(37, 512\) takes 10656 bytes"):
        QTensor(q.raw[:-1], "Q4_K", (37, 512)).validate()
    with pytest.raises(ValueError, match=r"rows of 288 values are not whole blocks of 256 \(Q4_K\)"):
        QTensor(q.raw, "Q4_K", (37, 288)).validate()
    with pytest.raises(ValueError, match="ggml type 'Q3_K' is not one of"):
        QTensor(q.raw, "Q3_K", (37, 512)).validate()
    with pytest.raises(ValueError, match="in 2 dims"):
        QTensor(q.raw.view(37, -1), "Q4_K", (37, 512)).validate()
    with pytest.raises(ValueError, match="with_raw"):
        q.with_raw(q.raw[1:])
    with pytest.raises(ValueError, match="with_raw"):
        q.with_raw(q.raw.view(torch.int8))


def test_bad_input_is_refused(qk):
    q, _ = qtensor("Q4_K", (37, 512))
    x = torch.randn(512)
    with pytest.raises(ValueError, match=r"weight: 10655 torch.uint8 values"):
        qk.matvec(QTensor(q.raw[:-1], "Q4_K", (37, 512)), x)
    with pytest.raises(ValueError, match="not whole blocks"):
        qk.matvec(QTensor(q.raw, "Q4_K", (37 * 2, 256 + 32)), x)
    with pytest.raises(ValueError, match="f32 CPU tensor with last dim 512"):
        qk.matvec(q, x.double())
    with pytest.raises(ValueError, match="last dim 512"):
        qk.matmul(q, torch.randn(3, 511))
    # the extension itself checks what it reads: offsets and sizes past the bytes, unknown types
    with pytest.raises(ValueError, match="do not fit"):
        qk.ext.matvec(q.raw, 1, q.code, 37, 512, x)
    with pytest.raises(ValueError, match="unsupported ggml type 10"):
        qk.ext.matvec(q.raw, 0, 10, 37, 512, x)
    with pytest.raises(ValueError, match="not a positive multiple"):
        qk.ext.dequant(q.raw, 0, q.code, 1, 100, torch.empty(100))
    gu, _ = qtensor("Q8_0", (4, 64, 32))
    dn, _ = qtensor("Q8_0", (4, 32, 32))
    ids, w = torch.tensor([1, 3]), torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="expert id 4 out of range"):
        qk.moe_decode(torch.randn(32), torch.tensor([1, 4]), w, gu, None, dn)
    with pytest.raises(ValueError, match="act: one of"):
        qk.moe_decode(torch.randn(32), ids, w, gu, None, dn, act="relu")
    with pytest.raises(ValueError, match="down"):
        qk.moe_decode(torch.randn(32), ids, w, gu, None, gu)
    with pytest.raises(ValueError, match="gate_bias must be f32"):
        qk.moe_decode(torch.randn(32), ids, w, gu, None, dn, gate_bias=torch.zeros(4, 31))
    with pytest.raises(ValueError, match="residual"):
        qk.moe_decode(torch.randn(32), ids, w, gu, None, dn, residual=torch.zeros(31))
    with pytest.raises(ValueError, match="do not fit"):            # an expert stride past the stack
        qk.ext.moe_decode(torch.randn(32), ids, w, 4, 32, (gu.raw, 0, 10**6, gu.code), (gu.raw, 0, 64 * 34, gu.code),
                          (dn.raw, 0, 32 * 34, dn.code), 0, 1.702, 7.0, None, None, None, None)
    with pytest.raises(ValueError, match="moe_prefill: x"):
        qk.moe_prefill(torch.randn(3, 32), ids[None].expand(2, 2), w[None].expand(2, 2), gu, None, dn)
    with pytest.raises(ValueError, match="expert id 4 out of range"):
        qk.moe_prefill(torch.randn(2, 32), torch.tensor([[1, 3], [0, 4]]), w[None].expand(2, 2), gu, None, dn)
    with pytest.raises(ValueError, match="expert id 7 out of range"):
        qk.ext.moe_decode(torch.randn(32), torch.tensor([7]), torch.tensor([1.0]), 4, 32, (gu.raw, 0, 64 * 34, gu.code),
                          (gu.raw, 32 * 34, 64 * 34, gu.code), (dn.raw, 0, 32 * 34, dn.code), 0, 1.702, 7.0, None, None,
                          None, None)
