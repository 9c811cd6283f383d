"""Dequantize ggml weights with plain torch ops, on whatever device the bytes live on.

The same code runs on CUDA (the engine's GPU path expands resident weights into a per-layer scratch,
and streamed experts once their quantized bytes were copied over) and on CPU (tests, fallback).
Only bit shifts, masks, lookups in small tables, views and elementwise float ops: no numpy, no host
syncs (.item(), .tolist(), branches on tensor values), so a call only enqueues kernels.

Block layouts follow ggml/src/ggml-common.h and the arithmetic follows the dequantize_row_* functions
of ggml/src/ggml-quants.c operation for operation (same products in the same order), so float32
results are bit-identical to llama.cpp's CPU dequantization and to gguf.quants.dequantize. Another
output dtype is the float32 result rounded once (F16 and BF16 weights in their own dtype are exact).

Every quantized format is decoded block-wise: a row of k values is k/B blocks of `size` bytes;
`b` below is (..., nb, size) uint8 and each decoder returns (..., nb, B) float32. Temporary memory is
about 5-9 bytes per value (4-bit codes, int32 lookup indices, the float32 result, updated in place);
to bound it, dequantize a large expert stack one expert (QTensor.expert) or a slice of rows at a time.
"""
from __future__ import annotations

from typing import Callable

import torch

from engines.reference.qtensor import TYPES, QTensor

# ggml type name -> (values per block, bytes per block), for every type of engines.gguf_meta.GGML_TYPES
BLOCKS: dict[str, tuple[int, int]] = {name: (blk, size) for name, (_, blk, size) in TYPES.items()}

# Lookup tables (ggml-common.h) and shift amounts, as tensors created once per device.
_TABLES: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "kvalues_iq4nl": (torch.float32, (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)),
    "kvalues_mxfp4": (torch.float32, (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)),  # 2 * e2m1
    "bits8": (torch.uint8, (0, 1, 2, 3, 4, 5, 6, 7)),           # bit b of a byte: (x >> b) & 1
    "pairs4": (torch.uint8, (0, 2, 4, 6)),                      # 2-bit field f of a byte: (x >> 2f) & 3
    "pairs8": (torch.int32, (0, 2, 4, 6, 8, 10, 12, 14)),       # 2-bit field f of a uint16
}
_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A constant on `device`, copied there once (a host->device copy of pageable memory syncs the stream)."""
    t = _cache.get((name, device))
    if t is None:
        dtype, values = _TABLES[name]
        t = _cache[(name, device)] = torch.tensor(values, dtype=dtype, device=device)
    return t


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one row of k values; raises ValueError if the type is unknown or k is not whole blocks."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"Cannot dequantize ggml type {ggml_type!r}; supported: {', '.join(BLOCKS)}.")
    blk, size = BLOCKS[ggml_type]
    if k <= 0 or k % blk:
        raise ValueError(f"A {ggml_type} row holds whole blocks of {blk} values, but k = {k}.")
    return k // blk * size


# ---- field helpers: b is (..., nb, size) uint8 ----

def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The little-endian fp16 at byte `off` of each block as float32, (..., nb, 1)."""
    return b[..., off:off + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) packed bytes -> (..., 2n): the n low nibbles, then the n high nibbles (ggml's order)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 8n) their bits, least significant first: bit i of a little-endian word."""
    bits = (x.unsqueeze(-1) >> _table("bits8", x.device)) & 1      # (..., n, 8)
    return bits.flatten(-2)


def _lookup(name: str, codes: torch.Tensor) -> torch.Tensor:
    """table[codes] for uint8 codes of any shape, as float32 (index_select: the fastest gather on CPU)."""
    return _table(name, codes.device).index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """GGML_E8M0_TO_FP32_HALF: 0.5 * 2^(e - 127) for a uint8 exponent (denormal for e < 2), as float32."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, (e + 1) * 0x00200000, (e - 1) << 23)  # e<2: 0x00200000 << e
    return bits.view(torch.float32)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """get_scale_min_k4 for j = 0..7: the 12 packed bytes (..., 12) -> 6-bit scales and mins (..., 8)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


# ---- one decoder per block format: (..., nb, size) uint8 -> (..., nb, B) float32 ----

def _q8_0(b):      # d f16 | qs int8[32]
    return b[..., 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b):      # d f16 | qs[16]: (nibble - 8) * d
    return _nibbles(b[..., 2:]).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b):      # d f16 | m f16 | qs[16]: nibble * d + m
    return _nibbles(b[..., 4:]).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b):      # d f16 | qh u32 (bit j: 5th bit of value j) | qs[16]
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)            # (..., nb, 32) in 0..31
    return q.float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b):      # d f16 | m f16 | qh u32 | qs[16]
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _mxfp4(b):     # e (e8m0) | qs[16]: kvalues_mxfp4[nibble] * 2^(e-128)
    return _lookup("kvalues_mxfp4", _nibbles(b[..., 1:])).mul_(_e8m0_half(b[..., 0:1]))


def _iq4_nl(b):    # d f16 | qs[16]: d * kvalues_iq4nl[nibble]
    return _lookup("kvalues_iq4nl", _nibbles(b[..., 2:])).mul_(_f16(b, 0))


def _q4_k(b):      # d f16 | dmin f16 | scales[12] | qs[128]: 8 sub-blocks of 32, d*sc*q - dmin*m
    sc, mn = _scale_min_k4(b[..., 4:16])                             # (..., nb, 8)
    q = _nibbles(b[..., 16:].unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)  # (..., nb, 8, 32)
    y = q.float().mul_((_f16(b, 0) * sc).unsqueeze(-1)).sub_((_f16(b, 2) * mn).unsqueeze(-1))
    return y.flatten(-2)


def _q5_k(b):      # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]: sub-block s takes bit s of qh
    sc, mn = _scale_min_k4(b[..., 4:16])
    lo = _nibbles(b[..., 48:].unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)  # (..., nb, 8, 32)
    hi = (b[..., 16:48].unsqueeze(-2) >> _table("bits8", b.device).unsqueeze(-1)) & 1          # (..., nb, 8, 32)
    y = (lo | (hi << 4)).float().mul_((_f16(b, 0) * sc).unsqueeze(-1)).sub_((_f16(b, 2) * mn).unsqueeze(-1))
    return y.flatten(-2)


def _q6_k(b):      # ql[128] | qh[64] | scales int8[16] | d f16: two halves of 128 values, 16 scales of 16
    ql = b[..., 0:128].unflatten(-1, (2, 2, 32))                     # (..., nb, half, a, 32): ql[l + 32a]
    lo4 = torch.stack([ql & 0xF, ql >> 4], dim=-3).flatten(-3, -2)   # (..., nb, half, g = 2*nibble + a, 32)
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))                   # (..., nb, half, 1, 32)
    hi2 = (qh >> _table("pairs4", b.device).unsqueeze(-1)) & 3       # (..., nb, half, g, 32): bits 2g..2g+1
    q = (lo4 | (hi2 << 4)).float().sub_(32).reshape(*b.shape[:-1], 16, 16)  # value 32g + l of a half: scale 2g + l//16
    sc = b[..., 192:208].view(torch.int8).float()                    # (..., nb, 16)
    return q.mul_((_f16(b, 208) * sc).unsqueeze(-1)).flatten(-2)


def _iq4_xs(b):    # d f16 | scales_h u16 | scales_l[4] | qs[128]: 8 sub-blocks of 32, 6-bit scales - 32
    sh = b[..., 2:3].to(torch.int32) | (b[..., 3:4].to(torch.int32) << 8)          # (..., nb, 1)
    ls_l = torch.stack([b[..., 4:8] & 0xF, b[..., 4:8] >> 4], dim=-1).flatten(-2)  # (..., nb, 8)
    ls_h = (sh >> _table("pairs8", b.device)) & 3                                  # (..., nb, 8)
    dl = _f16(b, 0) * ((ls_l.to(torch.int32) | (ls_h << 4)) - 32).float()         # (..., nb, 8)
    v = _lookup("kvalues_iq4nl", _nibbles(b[..., 8:].unflatten(-1, (8, 16))))        # (..., nb, 8, 32)
    return v.mul_(dl.unsqueeze(-1)).flatten(-2)


_BLOCK_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "MXFP4": _mxfp4,
    "IQ4_NL": _iq4_nl, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs,
}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize_rows(raw: torch.Tensor, ggml_type: str, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of ggml blocks (..., row_bytes) uint8 -> values (..., k) in `dtype`, on raw's device."""
    rb = row_bytes(ggml_type, k)
    if raw.dtype != torch.uint8 or raw.dim() < 1 or raw.shape[-1] != rb:
        raise ValueError(f"A {ggml_type} row of {k} values is {rb} bytes, but got a {raw.dtype} tensor of shape "
                         f"{tuple(raw.shape)}; pass uint8 rows of exactly {rb} bytes.")
    if ggml_type in _FLOATS:
        ft = _FLOATS[ggml_type]
        size = torch.finfo(ft).bits // 8
        if not raw.is_contiguous() or raw.storage_offset() % size:   # a dtype view needs aligned, dense bytes
            raw = raw.clone(memory_format=torch.contiguous_format)
        return raw.view(ft).to(dtype)
    blk, size = BLOCKS[ggml_type]
    blocks = raw.unflatten(-1, (k // blk, size))                         # (..., nb, size)
    return _BLOCK_DECODERS[ggml_type](blocks).flatten(-2).to(dtype)    # (..., nb, blk) -> (..., k)


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A whole weight (matrix (N, K), expert stack (E, N, K), vector) as a `dtype` tensor of qt.shape."""
    qt.validate("dequantize")
    if qt.layout != "ggml":        # the CPU kernels' interleaved layout: only they read it (weights.Holder)
        raise ValueError(f"dequantize: {qt.type} in layout {qt.layout}; convert it back first with "
                         f"kernels.QuantKernels.repack(qt, 'ggml')")
    rb = qt.row_bytes
    return dequantize_rows(qt.raw.reshape(-1, rb), qt.type, qt.k, dtype).reshape(qt.shape)
