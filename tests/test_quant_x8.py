"""The CPU kernels' interleaved layout of Q4_K, Q6_K, MXFP4, Q8_0, IQ4_NL and IQ4_XS (QTensor layout "x8",
kernels/quant_x8.h, quant_x8_q6.h, quant_x8_mx.h, quant_x8_signed.h)
on every ISA variant this CPU runs (amx: Q4_K's, IQ4_XS's and IQ4_NL's tile products of many x rows,
quant_amx.h), against the file layout's kernels (which tests/test_quant_kernels.py holds to llama.cpp's own code).

- Repacking is lossless (x8 and back gives the file's bytes) and dequantizes bit for bit as the file layout.
- Products multiply the same int8 values and integer scales as the file layout's (ggml's): only the float
  additions' order differs, so every result is within 2e-6 of sum |w x| of the file layout's (test_isas_agree's
  bound), on the rows kernel (1..11, 16, 37 and 53 x rows: every x tile, pairs of groups and a lone group), matvec,
  the GEMM path (dequantized tiles), moe_decode and moe_prefill (Q4_K gate/up with a Q6_K or Q4_K down, as in Q4_K_M;
  MXFP4 throughout, as gpt-oss; IQ4_XS gate/up with an IQ4_NL down, as gemma-4's IQ4_XS file).
- The x8 products of avx2 and avx512 are bit-identical (exact int32 sums, the same float operations per row), and
  so are amx's tile products and avx512's.
- The loader holds a CPU run's matrices of those types as x8 in place of the file's bytes (weights.Holder).
"""
import numpy as np
import pytest
import torch

from engines.reference import kernels
from engines.reference.qtensor import LAYOUT_TYPES, QTensor
from tests.test_quant_kernels import as_ggml_sees, check, qtensor, uneven


@pytest.fixture(scope="module", params=["avx2", "avx512", "amx"])
def qk(request):
    """The variant's kernels (as test_quant_kernels' fixture); skipped where this CPU or toolchain can't."""
    if missing := kernels.missing_flags(request.param):
        pytest.skip(f"{request.param}: the CPU lacks {', '.join(missing)}")
    k = kernels.quant_kernels(request.param)
    if isinstance(k, str):
        pytest.skip(f"{request.param}: {k}")
    return k


def x8(qk, t: str, shape: tuple[int, ...], seed: int = 0) -> tuple[QTensor, QTensor, np.ndarray]:
    """(the file layout, x8, dequantized values) of a random matrix or stack quantized to t by ggml."""
    q, W = qtensor(t, shape, seed)
    return q, qk.repack(q, "x8"), W


@pytest.mark.parametrize("t", LAYOUT_TYPES["x8"])
@pytest.mark.parametrize("k", [512, 2816])
def test_repack_is_lossless(qk, t, k):
    q, p, _ = x8(qk, t, (40, k))
    assert p.layout == "x8" and p.raw.numel() == q.raw.numel() and p.validate() is p
    assert torch.equal(qk.repack(p, "ggml").raw, q.raw)
    assert torch.equal(qk.dequant(p), qk.dequant(q))
    ids = torch.tensor([0, 7, 8, 39, 21])
    assert torch.equal(qk.embed(p, ids), qk.embed(q, ids))
    assert qk.repack(q, "ggml") is q


def test_layout_rules(qk):
    q, _ = qtensor("Q4_K", (37, 512))                  # rows not whole groups of 8: stays as stored
    assert qk.host_layout(q) == "ggml"
    assert qk.host_layout(qtensor("Q6_K", (40, 512))[0]) == "x8"
    assert qk.host_layout(qtensor("Q5_K", (40, 512))[0]) == "ggml"
    assert qk.host_layout(qtensor("F16", (40, 512))[0]) == "x8"                # the f32 default: the rows kernel
    assert qk.host_layout(qtensor("F16", (40, 512))[0], bf16=True) == ("x8" if qk.isa == "avx2" else "ggml")
    assert qk.host_layout(qtensor("F16", (40, 100))[0]) == "ggml"      # rows not whole blocks of 8 values
    with pytest.raises(ValueError, match="whole groups of 8"):
        QTensor(q.raw, "Q4_K", (37, 512), "x8").validate()
    with pytest.raises(ValueError, match="layout 'x8' does not exist for Q5_K"):
        QTensor(q.raw, "Q5_K", (40, 512), "x8").validate()
    p = qk.repack(qtensor("Q4_K", (40, 512))[0], "x8")
    with pytest.raises(ValueError, match="split a group"):
        p.rows(4, 12)
    assert p.rows(8, 24).shape == (16, 512) and torch.equal(qk.dequant(p.rows(8, 24)), qk.dequant(p)[8:24])
    with pytest.raises(ValueError, match="convert it back first"):
        from engines.reference.dequant import dequantize
        dequantize(p)
    with pytest.raises(ValueError, match="interleaved layout of 8 rows needs whole groups"):
        qk.ext.matvec(p.raw, 0, p.code, 36, 512, torch.randn(512))


@pytest.mark.parametrize("t", LAYOUT_TYPES["x8"])
@pytest.mark.parametrize("k", [512, 2816])
def test_products_equal_file_layout(qk, t, k):
    q, p, W = x8(qk, t, (40, k))                       # 5 groups: two pairs and a lone group where there is dot2
    x = uneven(np.random.default_rng(11), 53, k)
    tol = 2e-6 * (np.abs(as_ggml_sees(qk, t, x)) @ np.abs(W.astype(np.float64)).T) + 1e-30
    xs = torch.from_numpy(x)
    for n in (*range(1, 12), 16, 37, 53):            # 16, 24, 48 and more: the amx variant's tiles (quant_amx.h)
        check(qk.matmul(p, xs[:n], rows_max_n=n).numpy(), qk.matmul(q, xs[:n], rows_max_n=n).numpy(), tol[:n],
              f"rows n={n}")
    check(qk.matvec(p, xs[3]).numpy()[None], qk.matvec(q, xs[3]).numpy()[None], tol[3:4], "matvec")
    for bf16 in (False, True):
        check(qk.matmul(p, xs, rows_max_n=0, bf16=bf16).numpy(), qk.matmul(q, xs, rows_max_n=0, bf16=bf16).numpy(),
              tol * (1 if not bf16 else 1e3), f"gemm bf16={bf16}")


@pytest.mark.parametrize("gt,dt", [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"), ("MXFP4", "MXFP4"),
                                   ("IQ4_XS", "IQ4_NL"),
                                   ("Q8_0", "Q8_0"), ("F16", "F16")])
def test_experts_equal_file_layout(qk, gt, dt):
    """moe_decode and moe_prefill (rows kernel and GEMM path) on x8 stacks, fused gate_up and separate,
    against the same stacks as stored. The same int8 values, in another float order: mostly within 1e-6
    of the largest output, but an activation may cross an int8 rounding boundary of the down product's x
    (measured 6e-4): test_moe_prefill_is_moe_decode_per_token's bound, 3e-3."""
    E, D, ff, n, k = 6, 256, 512, 70, 3                # ~50 rows an expert: amx's tiles take Q4_K from 48
    g = np.random.default_rng(12)
    fused = x8(qk, gt, (E, 2 * ff, D), 2)
    gate, up = x8(qk, gt, (E, ff, D), 3), x8(qk, gt, (E, ff, D), 4)
    down = x8(qk, dt, (E, D, ff), 5)
    assert fused[1].layout == down[1].layout == "x8"
    x = torch.from_numpy((g.standard_normal((n, D)) * 3 / np.sqrt(D)).astype(np.float32))
    ids = torch.from_numpy(np.stack([g.permutation(4)[:k] for _ in range(n)]))
    ids[0, 0] = 5
    w = torch.from_numpy(g.random((n, k)).astype(np.float32))
    for stacked in (True, False):
        mats = [(fused, None, down) if stacked else (gate, up, down)]
        file, packed = [[None if m is None else m[i] for m in mats[0]] for i in (0, 1)]
        want = qk.moe_decode(x[1], ids[1], w[1], *file)
        got = qk.moe_decode(x[1], ids[1], w[1], *packed)
        assert (got - want).abs().max() <= 3e-3 * want.abs().max(), f"decode stacked={stacked}"
        for rows_max in (None, 0):
            if rows_max is None:
                want, got = (qk.moe_prefill(x, ids, w, *m, bf16=False) for m in (file, packed))
            else:                                  # every expert through dequantized tiles and the f32 GEMM
                want, got = (qk.ext.moe_prefill(x, ids, w, E, ff, *kernels._stacks(*m, "silu")[3], 0, 1.702, 7.0,
                                                None, None, None, 0, 0, 0) for m in (file, packed))
            assert (got - want).abs().max() <= 3e-3 * want.abs().max(), f"prefill {rows_max} stacked={stacked}"


def test_loader_holds_x8_in_place_of_the_file(qk):
    """weights.Holder on a CPU device: a Q4_K expert stack and a Q4_K/Q6_K matrix come back as x8 (as many
    bytes as the file's, booked so), a matrix of another type as stored, and everything as stored without
    the kernels."""
    from engines.gguf_meta import read_meta
    from engines.reference.weights import GGUFFile, Holder
    from workloads.synth import resolve_model
    meta = read_meta(resolve_model("preset:qwen35moe-tiny:q4_k_m"))
    names = [t.name for t in meta.tensors if t.ggml_type == "Q4_K" and len(t.shape) == 3]
    if not names:
        pytest.skip("preset:qwen35moe-tiny q4_k_m has no Q4_K expert stack")
    hold = Holder(GGUFFile(meta), torch.device("cpu"), hugepages=False, kernels=qk)
    src = GGUFFile(meta).qtensor(names[0])
    got = hold.matrix(names[0], "experts", "host")
    assert got.layout == "x8"
    assert got.nbytes == src.nbytes and torch.equal(qk.repack(got, "ggml").raw, src.raw)
    assert hold.ledger.held_bytes("experts") == got.nbytes
    other = next(t.name for t in meta.tensors if len(t.shape) == 2 and t.ggml_type in ("Q4_K", "Q6_K"))
    got = hold.matrix(other, "non_experts", "accelerator")
    assert got.layout == "x8" and torch.equal(qk.repack(got, "ggml").raw, GGUFFile(meta).qtensor(other).raw)
    assert hold.ledger.held_bytes("non_experts") == got.nbytes
    kept = next(t.name for t in meta.tensors if len(t.shape) == 2 and t.ggml_type not in LAYOUT_TYPES["x8"])
    assert hold.matrix(kept, "non_experts", "accelerator").layout == "ggml"
    plain = Holder(GGUFFile(meta), torch.device("cpu"), hugepages=False)
    assert plain.matrix(names[0], "experts", "host").layout == "ggml"


@pytest.mark.parametrize("t", LAYOUT_TYPES["x8"])
def test_isas_give_identical_products(t):
    ks = [kernels.quant_kernels(i) for i in ("avx2", "avx512") if not kernels.missing_flags(i)]
    ks = [k for k in ks if not isinstance(k, str)]
    if len(ks) < 2:
        pytest.skip("this CPU runs only one variant")
    a, b = ks
    _, p, _ = x8(a, t, (48, 2816))
    x = torch.from_numpy(uneven(np.random.default_rng(13), 11, 2816))
    for n in (1, 3, 11):
        assert torch.equal(a.matmul(p, x[:n], rows_max_n=64), b.matmul(p, x[:n], rows_max_n=64)), n


@pytest.mark.parametrize("t,k", [("Q4_K", 2048), ("Q4_K", 768), ("IQ4_XS", 2816), ("IQ4_NL", 704), ("IQ4_NL", 96)])
def test_amx_tiles_equal_avx512(t, k):
    """The amx variant's tiles form avx512's int32 sub-block dots and the same integer and float steps: equal bit for
    bit, for whole and partial x tiles and rows whose sub-blocks are not a multiple of the 4 tiles a step takes."""
    ks = [kernels.quant_kernels(i) for i in ("avx512", "amx") if not kernels.missing_flags(i)]
    ks = [k for k in ks if not isinstance(k, str)]
    if len(ks) < 2:
        pytest.skip("this CPU lacks AMX")
    a, b = ks
    _, p, _ = x8(a, t, (48, k))
    x = torch.from_numpy(uneven(np.random.default_rng(14), 53, k))
    for n in (16, 17, 37, 48, 53):                   # the tiles take Q4_K from 48 rows, IQ4_XS from 24
        assert torch.equal(a.matmul(p, x[:n], rows_max_n=64), b.matmul(p, x[:n], rows_max_n=64)), n
