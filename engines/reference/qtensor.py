"""A weight as the GGUF file stores it: its raw bytes, its ggml type and its shape.

The reference engine never expands a matrix into a whole float copy: it computes from these bytes
(CPU kernels in engines.reference.kernels; on CUDA, engines.reference.dequant into a per-layer scratch).
`raw` is a 1-D uint8 tensor: a zero-copy view of the file mapping, or one copy of the same bytes
(huge pages, page-locked host memory, or device memory). Rows are stored one after another, each
`row_bytes` long; an expert stack (E, N, K) is E matrices of N rows each, expert e starting at byte
e * N * row_bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engines.gguf_meta import GGML_TYPES, tensor_bytes

TYPES = GGML_TYPES           # name -> (ggml type id, values per block, bytes per block)
# the stored types the engine's products compute with (engines.reference.kernels, dequant)
COMPUTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_XS")


@dataclass(frozen=True)
class QTensor:
    raw: torch.Tensor              # (n_bytes,) uint8, contiguous
    type: str                      # a key of TYPES
    shape: tuple[int, ...]         # numpy order: (..., N, K); K values per row

    @property
    def code(self) -> int:
        return TYPES[self.type][0]

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
        return QTensor(self.raw[e * n:(e + 1) * n], self.type, self.shape[1:])

    def head(self, k: int) -> "QTensor":
        """Matrices 0..k-1 of an expert stack (E, N, K), a view of the same bytes."""
        return QTensor(self.raw[:k * self.matrix_bytes], self.type, (k, *self.shape[1:]))

    def rows(self, start: int, stop: int) -> "QTensor":
        """Rows start..stop-1 of a matrix (N, K), a view (e.g. the gate half of a fused gate_up matrix)."""
        rb = self.row_bytes
        return QTensor(self.raw[start * rb:stop * rb], self.type, (stop - start, self.k))

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
        r, n = self.raw, tensor_bytes(self.type, self.shape)
        if r.dtype != torch.uint8 or r.dim() != 1 or r.numel() != n:
            raise ValueError(f"{what}: {r.numel()} {r.dtype} values in {r.dim()} dims, but {self.type} {self.shape} "
                             f"takes {n} bytes")
        return self

