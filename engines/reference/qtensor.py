"""A weight as the GGUF file stores it: its raw bytes, its ggml type and its shape.

The reference engine never expands a matrix into a whole float copy: it computes from these bytes
(CPU kernels in engines.reference.kernels; on CUDA, engines.reference.dequant into a per-layer scratch).
`raw` is a 1-D uint8 tensor: a zero-copy view of the file mapping, or one copy of the same bytes
(huge pages, page-locked host memory, or device memory). Rows are stored one after another, each
`row_bytes` long; an expert stack (E, N, K) is E matrices of N rows each, expert e starting at byte
e * N * row_bytes.

`layout` says how the bytes are ordered: "ggml" (as the file stores them) or "x8" (LAYOUT_TYPES with 8
rows interleaved per block, made once at load for the CPU kernels, held instead of the file's bytes:
engines/reference/kernels/quant_x8*.h). An x8 tensor has whole groups of 8 rows and the
file's size (`row_bytes` is a row's share of a group); only the CPU kernels read it, and
kernels.QuantKernels.repack converts either way, losslessly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engines.gguf_meta import GGML_TYPES, tensor_bytes

TYPES = GGML_TYPES           # name -> (ggml type id, values per block, bytes per block)
# the stored types the engine's products compute with (engines.reference.kernels, dequant)
COMPUTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_XS")
# interleaved layouts (a permutation of the file's bytes: the same size): name -> (rows per group, the
# kernels' type-code offset); the types each one exists for
LAYOUTS = {"x8": (8, 1000)}
LAYOUT_TYPES = {"x8": ("Q4_K", "Q6_K", "MXFP4", "Q8_0", "IQ4_NL", "IQ4_XS", "F16")}


@dataclass(frozen=True)
class QTensor:
    raw: torch.Tensor              # (n_bytes,) uint8, contiguous
    type: str                      # a key of TYPES
    shape: tuple[int, ...]         # numpy order: (..., N, K); K values per row
    layout: str = "ggml"           # "ggml" (the file's bytes) or a key of LAYOUTS

    @property
    def code(self) -> int:
        """The type code the CPU kernels take: the ggml type id, plus the layout's offset."""
        return TYPES[self.type][0] + (LAYOUTS[self.layout][1] if self.layout != "ggml" else 0)

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        """Rows of one matrix (N); an expert stack has shape[0] of them."""
        return self.shape[-2] if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        _, block, size = TYPES[self.type]
        return self.k // block * size

    @property
    def matrix_bytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def expert(self, e: int) -> "QTensor":
        """Matrix e of an expert stack (E, N, K), a view of the same bytes."""
        n = self.matrix_bytes
        return QTensor(self.raw[e * n:(e + 1) * n], self.type, self.shape[1:], self.layout)

    def head(self, k: int) -> "QTensor":
        """Matrices 0..k-1 of an expert stack (E, N, K), a view of the same bytes."""
        return QTensor(self.raw[:k * self.matrix_bytes], self.type, (k, *self.shape[1:]), self.layout)

    def rows(self, start: int, stop: int) -> "QTensor":
        """Rows start..stop-1 of a matrix (N, K), a view (e.g. the gate half of a fused gate_up matrix)."""
        rb, g = self.row_bytes, self.group
        if start % g or stop % g:
            raise ValueError(f"rows {start}:{stop} split a group of {g} rows of layout {self.layout}")
        return QTensor(self.raw[start * rb:stop * rb], self.type, (stop - start, self.k), self.layout)

    @property
    def group(self) -> int:
        """Rows stored together (1 in the file's layout)."""
        return LAYOUTS[self.layout][0] if self.layout != "ggml" else 1

    def with_raw(self, raw: torch.Tensor) -> "QTensor":
        """The same tensor held in other memory (a copy of the bytes: pinned, huge pages, a device)."""
        if raw.dtype != torch.uint8 or raw.numel() != self.raw.numel():
            raise ValueError(f"with_raw: {raw.numel()} {raw.dtype} values in place of {self.raw.numel()} uint8 bytes")
        return replace(self, raw=raw)

    def validate(self, what: str = "weight") -> "QTensor":
        """self, after checking that its bytes are what its type and shape say (GGUF files are untrusted):
        a known type, rows of whole blocks, a 1-D uint8 tensor of exactly the bytes the shape takes.
        Raises ValueError naming `what`. The kernels and dequantize() call it before reading a byte."""
        if self.type not in TYPES:
            raise ValueError(f"{what}: ggml type {self.type!r} is not one of {', '.join(TYPES)}")
        block = TYPES[self.type][1]
        if len(self.shape) < 1 or min(self.shape) < 1 or self.k % block:
            raise ValueError(f"{what}: shape {self.shape}: rows of {self.k} values are not whole blocks of {block} "
                             f"({self.type})")
        if self.layout != "ggml":
            if self.layout not in LAYOUTS or self.type not in LAYOUT_TYPES[self.layout]:
                raise ValueError(f"{what}: layout {self.layout!r} does not exist for {self.type}")
            if self.n_rows % self.group:
                raise ValueError(f"{what}: layout {self.layout} needs rows in whole groups of {self.group}, got shape "
                                 f"{self.shape}")
        r, n = self.raw, tensor_bytes(self.type, self.shape)
        if r.dtype != torch.uint8 or r.dim() != 1 or r.numel() != n:
            raise ValueError(f"{what}: {r.numel()} {r.dtype} values in {r.dim()} dims, but {self.type} {self.shape} "
                             f"takes {n} bytes")
        return self

