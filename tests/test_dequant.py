"""engines.reference.dequant against gguf-py's numpy dequantizer, on bytes from llama.cpp's own quantizer.

float32 results must be bit-identical: both follow ggml's dequantize_row_* operation for operation
(products of a float scale and a small integer are exact; the one rounding, e.g. d*sc*q - dmin*m, is
the same single-precision operation in both). bf16/f16 outputs are that float32 result rounded once.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engines.gguf_meta import tensor_bytes
from engines.reference.dequant import BLOCKS, dequantize, dequantize_rows, row_bytes
from engines.reference.qtensor import TYPES, QTensor
from workloads.quantize import quantize

K256 = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# relative RMS error of a round trip on Gaussian weights: a check on the data itself, not only on agreement
TOLERANCE = {"F32": 0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.025, "Q5_K": 0.045, "Q5_0": 0.05,
             "Q5_1": 0.05, "Q4_K": 0.09, "Q4_0": 0.1, "Q4_1": 0.1, "IQ4_NL": 0.1, "IQ4_XS": 0.1, "MXFP4": 0.2}
K32 = ("Q8_0", "Q4_0", "MXFP4", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
ALL = ("F32", "F16", "BF16") + K32 + K256
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device in this environment"))]


def _data(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Weights with the awkward cases in their first rows: zeros, a constant, huge and tiny magnitudes."""
    a = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    rows = a.reshape(-1, shape[-1])
    rows[0, :64] = 0.0
    if len(rows) > 3:
        rows[1] = 1.5
        rows[2] *= 1e4
        # tiny blocks, max |x| 2^-124 or 2^-125: e8m0 exponents 1 and 0 (the denormal branch), f16 scales
        # that underflow. (Below 2^-125 ggml's MXFP4 quantizer has no exponent: it writes 255 and fails.)
        block = np.arange(shape[-1]) // 32
        rows[3] = np.sign(rows[3]) * np.where(block % 2, 2.0 ** -125, 2.0 ** -124)
    return a


def _reference(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    with np.errstate(all="ignore"):        # arbitrary bytes make NaN/inf scales
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]).astype(np.float32)


def _assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.cpu().numpy()
    assert got.shape == want.shape and got.dtype == np.float32
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, e.g. {got[~same][:4]} vs {want[~same][:4]}"


def _shapes(t: str) -> list[tuple[int, ...]]:
    k = 512 if t in K256 else 2880
    return [(4, k), (3, 5, k), (1, 256 if t in K256 else 96)]        # matrix, expert stack (E, N, K), one row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", ALL)
def test_matches_gguf_py_bit_for_bit(t, device):
    for shape in _shapes(t):
        a = _data(shape)
        raw = quantize(a, t)                                             # (..., row_bytes) from ggml
        want = _reference(raw, t)
        qt = QTensor(torch.from_numpy(raw.reshape(-1).copy()).to(device), t, shape)
        got = dequantize(qt)
        assert got.device.type == device and got.shape == shape
        _assert_bits_equal(got, want)
        plain = (got.cpu().numpy() - a).reshape(-1, shape[-1])[4:], a.reshape(-1, shape[-1])[4:]   # Gaussian rows
        if plain[1].size:
            assert np.sqrt((plain[0] ** 2).mean() / (plain[1] ** 2).mean()) <= TOLERANCE[t]
        for dtype in (torch.bfloat16, torch.float16):
            low = dequantize(qt, dtype)
            assert low.dtype == dtype
            assert torch.equal(low.cpu(), torch.from_numpy(want).to(dtype))


@pytest.mark.parametrize("t", [t for t in ALL if t not in ("F32",)])
def test_arbitrary_bytes(t):
    """Random bytes reach every bit field, NaN/inf scales and every e8m0 exponent; still bit-identical."""
    blk, size = BLOCKS[t]
    k = blk * 8 if blk > 1 else 64
    raw = np.random.default_rng(1).integers(0, 256, (64, row_bytes(t, k)), dtype=np.uint8)
    if t == "MXFP4":
        raw.reshape(64, -1, size)[:, :, 0] = np.arange(64 * (k // blk)).reshape(64, -1) % 256
    _assert_bits_equal(dequantize_rows(torch.from_numpy(raw), t, k), _reference(raw, t))


def test_expert_views_and_unaligned_bytes():
    shape = (4, 8, 256)
    a = _data(shape, seed=2)
    for t in ("Q6_K", "F16", "F32"):
        raw = torch.from_numpy(quantize(a, t).reshape(-1).copy())
        qt = QTensor(raw, t, shape)
        full = dequantize(qt)
        assert torch.equal(dequantize(qt.expert(2)), full[2])        # a view into the stack
        assert torch.equal(dequantize(qt.expert(1).rows(3, 6)), full[1, 3:6])
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), raw])[1:]   # storage offset 1
        assert torch.equal(dequantize(QTensor(shifted, t, shape)), full)
    assert torch.equal(dequantize(QTensor(torch.from_numpy(quantize(a, "F32").reshape(-1).copy()), "F32", shape)),
                       torch.from_numpy(a))


def test_rows_interface_keeps_leading_dims():
    raw = torch.from_numpy(quantize(_data((2, 3, 256)), "IQ4_XS"))       # (2, 3, 136)
    out = dequantize_rows(raw, "IQ4_XS", 256, torch.bfloat16)
    assert out.shape == (2, 3, 256) and out.dtype == torch.bfloat16


def test_sizes_agree_with_qtensor_and_gguf():
    for t, (_, blk, size) in TYPES.items():
        assert BLOCKS[t] == (blk, size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
        assert row_bytes(t, 256 * 3) == tensor_bytes(t, (1, 256 * 3))
    for t in ("Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        assert BLOCKS[t] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]


def test_bad_input_raises_value_error():
    raw = torch.zeros(2 * 210, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        dequantize(QTensor(raw[:-1], "Q6_K", (2, 256)))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        dequantize(QTensor(raw, "Q6_K", (2, 250)))
    with pytest.raises(ValueError, match="210 bytes"):
        dequantize_rows(raw.reshape(1, -1), "Q6_K", 256)
    with pytest.raises(ValueError, match="210 bytes"):
        dequantize_rows(raw.reshape(2, -1).to(torch.int8), "Q6_K", 256)
    with pytest.raises(ValueError, match="Cannot dequantize"):
        dequantize_rows(raw.reshape(2, -1), "Q3_K", 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this environment")
def test_cuda_no_host_sync():
    """After the constant tables exist on the device, dequantizing enqueues kernels and never syncs."""
    qts = {t: QTensor(torch.from_numpy(quantize(_data((4, 512)), t).reshape(-1).copy()).cuda(), t, (4, 512))
           for t in TYPES}
    for qt in qts.values():
        dequantize(qt)            # warm-up: creates the per-device tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for qt in qts.values():
            dequantize(qt, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
