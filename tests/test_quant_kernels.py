"""The GGUF quant kernels (engines.reference.kernels.quant_kernels) on both ISA variants, against
gguf-py's dequantizer and float64 math. Test weights come from real quantizers: gguf-py for F16, BF16,
Q8_0, Q4_0, MXFP4; llama.cpp's own ggml_quantize_chunk (libggml-base from the llama_cpp package) for
Q4_K, Q5_K, Q6_K, IQ4_XS.

Tolerances. Dequant is bit-exact. Float weight types multiply x in f32: 1e-5 of sum |w x| (f32
accumulation over K <= 2880 terms in several partial sums; measured errors are ~0.2% of that).
Block-quantized types multiply x rounded to int8 per 32 values with scale d = max|x_block| / 127,
so each x_i moves by at most d/2: the bound is that worst case,
sum_i |w_i| d(i) / 2, computed from the data, plus the f32 slack; and since that worst case is ~10x
what random rounding does, the RMS error must also stay within 2x the rounding noise's expected RMS,
sqrt(sum_i w_i^2 d(i)^2 / 12). The bf16 GEMM path (avx512, n above the rows kernel's range) rounds x,
w and the output to bf16 (each <= 2^-9 relative): 2^-7 of sum |w x|.
"""
import ctypes
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.reference import kernels
from engines.reference.qtensor import TYPES, QTensor

ALL = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
GGML_QUANTIZED = {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}       # gguf-py has no quantizer for these
FLOAT = {"F32", "F16", "BF16"}


@functools.cache
def ggml_base():
    """libggml-base from the llama_cpp package, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    return lib


@functools.cache
def weights(t: str, shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(raw bytes, their gguf-py dequantization) of a random f32 matrix quantized to t."""
    import gguf
    from gguf.quants import dequantize, quantize
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    k, rows = shape[-1], a.size // shape[-1]
    if t == "F32":
        raw = a.reshape(-1).view(np.uint8)
    elif t in GGML_QUANTIZED:
        lib = ggml_base()
        if lib is None:
            pytest.skip(f"{t}: llama_cpp's libggml-base (ggml_quantize_chunk) is not installed")
        _, block, size = TYPES[t]
        raw = np.empty(rows * k // block * size, np.uint8)
        lib.ggml_quantize_chunk(TYPES[t][0], a.ctypes.data, raw.ctypes.data, 0, rows, k, None)
    else:
        raw = quantize(a, gguf.GGMLQuantizationType[t]).reshape(-1).view(np.uint8)
    ref = raw.view(np.float32) if t == "F32" else dequantize(raw, gguf.GGMLQuantizationType[t])
    return torch.from_numpy(raw.copy()), ref.reshape(shape).astype(np.float32)


def qtensor(t: str, shape: tuple[int, ...], seed: int = 0) -> tuple[QTensor, np.ndarray]:
    raw, ref = weights(t, shape, seed)
    return QTensor(raw, t, shape), ref


def k_of(t: str) -> list[int]:
    """Row lengths to test: 256-value super-blocks for K-quants and IQ4_XS; gpt-oss's 2880 (90 blocks
    of 32, so 11 units of 8 and a tail of 2) for the 32-value-block and float types; float types
    take any length (37: vector tails)."""
    return [512] if TYPES[t][1] == 256 else [512, 2880] if t not in FLOAT else [512, 2880, 37]


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


def int8_x(x: np.ndarray) -> np.ndarray:
    """Per value, the largest move the int8 activation rounding can make: half its block's scale."""
    xb = x.reshape(*x.shape[:-1], -1, 32)
    return np.repeat(np.abs(xb).max(-1) / 127 / 2, 32, axis=-1).reshape(x.shape)


def bound(t: str, W: np.ndarray, x: np.ndarray, bf16_gemm: bool = False) -> np.ndarray:
    """Per output, the tolerance of the module docstring. W (N, K), x (n, K) -> (n, N)."""
    aw, ax = np.abs(W).astype(np.float64), np.abs(x).astype(np.float64)
    if bf16_gemm:
        return 2 ** -7 * ax @ aw.T
    b = 1e-5 * ax @ aw.T
    return b if t in FLOAT else b + int8_x(x).astype(np.float64) @ aw.T


def noise(W: np.ndarray, x: np.ndarray) -> float:
    """The expected RMS error of int8 x rounding (uniform on +-d/2, variance d^2 / 12), over all outputs."""
    d2 = (2 * int8_x(x).astype(np.float64)) ** 2 / 12
    return float(np.sqrt((d2 @ (W.astype(np.float64) ** 2).T).mean()))


def check(y: torch.Tensor, ref: np.ndarray, tol: np.ndarray, what: str, rms: float | None = None):
    err = np.abs(y.numpy().astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"{what}: |err| {err[worst]:.3g} > bound {tol[worst]:.3g} at {worst}"
    if rms is not None:
        e = np.sqrt((err ** 2).mean())
        assert e <= 2 * rms, f"{what}: RMS error {e:.3g} > 2 x the expected {rms:.3g}"


@pytest.mark.parametrize("t", ALL)
def test_dequant_is_bit_exact(qk, t):
    for k in k_of(t):
        q, ref = qtensor(t, (37, k))
        out = qk.dequant(q)
        assert out.dtype == torch.float32 and out.shape == (37, k)
        assert np.array_equal(out.numpy(), ref), f"{t} k={k}: f32 dequant differs from gguf-py"
        assert torch.equal(qk.dequant(q, torch.bfloat16), torch.from_numpy(ref).bfloat16()), f"{t} k={k}: bf16 dequant"
    stack, sref = qtensor(t, (3, 5, k_of(t)[0]), seed=1)     # an expert stack, and one expert of it
    assert np.array_equal(qk.dequant(stack).numpy(), sref)
    assert np.array_equal(qk.dequant(stack.expert(2)).numpy(), sref[2])


@pytest.mark.parametrize("t", ALL)
def test_matvec_within_bound(qk, t):
    g = np.random.default_rng(5)
    for k in k_of(t):
        for n_rows in (37, 1):
            q, W = qtensor(t, (37, k))
            q, W = (q, W) if n_rows == 37 else (q.rows(36, 37), W[36:])
            x = (g.standard_normal(k) * np.exp(g.standard_normal(k))).astype(np.float32)   # uneven magnitudes
            y = qk.matvec(q, torch.from_numpy(x))
            assert y.shape == (n_rows,) and y.dtype == torch.float32
            ref = x[None].astype(np.float64) @ W.T.astype(np.float64)
            check(y[None], ref, bound(t, W, x[None]), f"{t} k={k} N={n_rows}",
                  None if t in FLOAT or n_rows == 1 else noise(W, x[None]))
            assert qk.matvec(q, torch.from_numpy(x)[None]).shape == (1, n_rows)


@pytest.mark.parametrize("t", ALL)
def test_matmul_both_paths(qk, t):
    g = np.random.default_rng(6)
    for k in k_of(t):
        q, W = qtensor(t, (37, k))
        for n in (1, 3, 17, 64):
            x = g.standard_normal((n, k)).astype(np.float32)
            ref = x.astype(np.float64) @ W.T.astype(np.float64)
            check(qk.matmul(q, torch.from_numpy(x), rows_max_n=n), ref, bound(t, W, x), f"{t} k={k} n={n} rows",
                  None if t in FLOAT else noise(W, x))
            bf16 = qk.ext.BF16_GEMM and t != "F32"
            check(qk.matmul(q, torch.from_numpy(x), rows_max_n=0), ref, bound(t, W, x, bf16), f"{t} k={k} n={n} gemm")
            y = qk.matmul(q, torch.from_numpy(x))                 # the default split
            assert y.shape == (n, 37)
    x3 = torch.randn(2, 3, k)                                     # leading dims are kept
    assert qk.matmul(q, x3).shape == (2, 3, 37)


def test_unaligned_float_weights(qk):
    """F32/BF16 bytes at an odd address (GGUF offsets are untrusted): matvec reads them unaligned, the
    GEMM path dequantizes them instead of viewing them as a float tensor."""
    x = torch.randn(5, 64)
    for t in ("F32", "BF16"):
        q, W = qtensor(t, (37, 64))
        buf = torch.empty(q.raw.numel() + 1, dtype=torch.uint8)
        buf[1:] = q.raw
        qu = QTensor(buf[1:], t, q.shape)
        ref = x.double().numpy() @ W.T.astype(np.float64)
        check(qk.matmul(qu, x, rows_max_n=0), ref, bound(t, W, x.numpy(), qk.ext.BF16_GEMM), f"{t} gemm")
        check(qk.matvec(qu, x[0])[None], ref[:1], bound(t, W, x[:1].numpy()), f"{t} matvec")


def test_isas_agree():
    """avx2 and avx512 give the same dequantization and products within the int8 bound."""
    ks = [kernels.quant_kernels(i) for i in ("avx2", "avx512") if not kernels.missing_flags(i)]
    ks = [k for k in ks if not isinstance(k, str)]
    if len(ks) < 2:
        pytest.skip("this CPU runs only one variant")
    a, b = ks
    x = np.random.default_rng(7).standard_normal((5, 512)).astype(np.float32)
    for t in ALL:
        q, W = qtensor(t, (37, 512))
        assert torch.equal(a.dequant(q), b.dequant(q))
        tol = 2 * bound(t, W, x)
        for i in range(5):
            xi = torch.from_numpy(x[i])
            check(a.matvec(q, xi)[None], b.matvec(q, xi)[None].numpy(), tol[i:i + 1], t)
        check(a.matmul(q, torch.from_numpy(x), 8), b.matmul(q, torch.from_numpy(x), 8).numpy(), tol, f"{t} rows")


def act_ref(act: str, g: np.ndarray, u: np.ndarray, alpha=1.702, limit=7.0) -> np.ndarray:
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    if act == "gelu":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-alpha * g)) * (u + 1)


# (gate/up type, down type, D, ff): a Q4_K_M-like mix, gpt-oss (MXFP4, 2880 wide), float weights
MOE_CASES = [("Q4_K", "Q6_K", 256, 512), ("MXFP4", "MXFP4", 2880, 64), ("BF16", "F16", 96, 80)]


@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("gt,dt,D,ff", MOE_CASES)
def test_moe_decode_matches_float_experts(qk, act, gt, dt, D, ff):
    """Against float64 experts on the dequantized weights, gate_up fused and separate, with and without
    biases. Quantized types round x and then the activations to int8 (each ~0.5% of a product's
    scale; measured up to 1% of the largest output): the bound is 3% of it, where a wrong expert,
    bias or weight moves outputs by their whole size. Float types (f32 math throughout): 1e-4."""
    E, ids, w = 6, np.array([4, 0, 5]), np.array([0.5, 0.3, 0.2], np.float32)
    g = np.random.default_rng(8)
    fused, F = qtensor(gt, (E, 2 * ff, D), seed=2)
    gate, G = qtensor(gt, (E, ff, D), seed=3)
    up, U = qtensor(gt, (E, ff, D), seed=4)
    down, DN = qtensor(dt, (E, D, ff), seed=5)
    x = (g.standard_normal(D) * 3 / np.sqrt(D)).astype(np.float32)     # gate, up ~ N(0, 9): swiglu_oai clamps some
    gb, ub = (g.standard_normal((E, ff)).astype(np.float32) for _ in range(2))
    db = (g.standard_normal((E, D)) * np.sqrt(ff)).astype(np.float32)
    tol = 1e-4 if gt in FLOAT and dt in FLOAT else 3e-2
    for stacked in (True, False):
        for bias in (False, True):
            ref = np.zeros(D)
            for j, e in enumerate(ids):
                gm, um = (F[e, :ff], F[e, ff:]) if stacked else (G[e], U[e])
                gv, uv = gm.astype(np.float64) @ x, um.astype(np.float64) @ x
                if bias:
                    gv, uv = gv + gb[e], uv + ub[e]
                ref += w[j] * (DN[e].astype(np.float64) @ act_ref(act, gv, uv) + (db[e] if bias else 0))
            b = {"gate_bias": gb, "up_bias": ub, "down_bias": db} if bias else {}
            y = qk.moe_decode(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w),
                              fused if stacked else gate, None if stacked else up, down, act,
                              **{k: torch.from_numpy(v) for k, v in b.items()})
            err = np.abs(y.numpy() - ref).max() / np.abs(ref).max()
            assert y.shape == (D,) and err <= tol, f"{gt}/{dt} {act} stacked={stacked} bias={bias}: {err:.2e} of max"


def test_pick_isa(monkeypatch):
    avx2 = frozenset({"avx2", "fma", "f16c"})
    full = avx2 | frozenset(kernels.ISAS["avx512"][0])
    monkeypatch.delenv("MOEBENCH_ISA", raising=False)
    assert kernels.pick_isa(full) == "avx512" and kernels.pick_isa(avx2) == "avx2"
    with pytest.raises(ValueError, match="need at least AVX2"):
        kernels.pick_isa(frozenset({"sse2", "avx"}))
    monkeypatch.setenv("MOEBENCH_ISA", "avx2")
    assert kernels.pick_isa(full) == "avx2"
    monkeypatch.setenv("MOEBENCH_ISA", "avx512")
    with pytest.raises(ValueError, match="MOEBENCH_ISA=avx512, but the CPU lacks avx512f"):
        kernels.pick_isa(avx2)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: avx2)       # forced avx512 on an AVX2 CPU: a message, no load
    assert "lacks avx512f" in kernels.quant_kernels()
    monkeypatch.setenv("MOEBENCH_ISA", "sse4")
    assert kernels.quant_kernels() == "MOEBENCH_ISA=sse4: expected auto, avx2, avx512"


def test_bad_input_is_refused(qk):
    q, _ = qtensor("Q4_K", (37, 512))
    x = torch.randn(512)
    with pytest.raises(ValueError, match=r"10655 torch.uint8 values, but Q4_K \(37, 512\) takes 10656 bytes"):
        qk.matvec(QTensor(q.raw[:-1], "Q4_K", (37, 512)), x)
    with pytest.raises(ValueError, match="whole Q4_K blocks"):
        qk.matvec(QTensor(q.raw, "Q4_K", (37 * 2, 256 + 32)), x)
    with pytest.raises(ValueError, match="f32 CPU tensor with last dim 512"):
        qk.matvec(q, x.double())
    with pytest.raises(ValueError, match="last dim 512"):
        qk.matmul(q, torch.randn(3, 511))
    # the extension itself checks what it reads: offsets and sizes past the bytes, unknown types
    with pytest.raises(ValueError, match="do not fit"):
        qk.ext.matvec(q.raw, 1, q.code, 37, 512, x)
    with pytest.raises(ValueError, match="unsupported ggml type 3"):
        qk.ext.matvec(q.raw, 0, 3, 37, 512, x)
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
    with pytest.raises(ValueError, match="do not fit"):            # an expert stride past the stack
        qk.ext.moe_decode(torch.randn(32), ids, w, 4, 32, gu.raw, 0, 10**6, gu.code, gu.raw, 0, 64 * 34, gu.code,
                          dn.raw, 0, 32 * 34, dn.code, 0, 1.702, 7.0, None, None, None)
    with pytest.raises(ValueError, match="expert id 7 out of range"):
        qk.ext.moe_decode(torch.randn(32), torch.tensor([7]), torch.tensor([1.0]), 4, 32,
                          gu.raw, 0, 64 * 34, gu.code, gu.raw, 32 * 34, 64 * 34, gu.code, dn.raw, 0, 32 * 34, dn.code,
                          0, 1.702, 7.0, None, None, None)
