"""GGUF tensors -> torch, with dequantization and byte accounting.

The header and tensor table come from engines.gguf_meta.read_meta (already validated against the
file size); here the file is memory-mapped once and each tensor is viewed in place. F32/F16/BF16
tensors that already have the compute dtype are handed to torch as zero-copy views of the mapping;
everything else is converted (float cast, or gguf's own dequantizer for quantized blocks) and the
view is dropped right away, so no tensor is ever held twice.
"""
from __future__ import annotations

import mmap
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from engines.errors import UserError
from engines.gguf_meta import ModelMeta, TensorEntry

FLOAT_TYPES = ("F32", "F16", "BF16")
# quantized block types gguf.quants can dequantize; the issue asks for at least Q8_0, Q4_0, Q4_K, Q5_K, Q6_K
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dt: torch.dtype) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[dt]


def stored_bytes(entry: TensorEntry) -> int:
    """Bytes a tensor of this type and shape must occupy: gguf's block size table, no trust in the file."""
    import gguf

    qtype = gguf.GGMLQuantizationType[entry.ggml_type]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if entry.ne[0] % block:
        raise UserError(f"Tensor {entry.name!r} has a row of {entry.ne[0]} values, not a multiple of the "
                        f"{entry.ggml_type} block size {block}; the file is corrupt.")
    return int(np.prod(entry.ne, dtype=np.int64)) // block * type_size


def check_entry(entry: TensorEntry, shape: tuple[int, ...]) -> None:
    """Validate one tensor against the shape the config implies, before anything is allocated."""
    if entry.shape != tuple(shape):
        raise UserError(f"Tensor {entry.name!r} has shape {entry.shape}, but the model metadata implies "
                        f"{tuple(shape)}; the file is corrupt or not a supported model.")
    if entry.ggml_type not in FLOAT_TYPES + QUANT_TYPES:
        raise UserError(f"Tensor {entry.name!r} has type {entry.ggml_type}, which the reference engine cannot "
                        f"load; supported: {', '.join(FLOAT_TYPES + QUANT_TYPES)}.")
    if stored_bytes(entry) != entry.n_bytes:
        raise UserError(f"Tensor {entry.name!r} occupies {entry.n_bytes} bytes, expected {stored_bytes(entry)} "
                        f"for {entry.ggml_type} {entry.shape}; the file is corrupt.")


class GGUFTensors:
    """The file mapped once (copy-on-write, so torch gets writable zero-copy views); tensors by name."""

    def __init__(self, meta: ModelMeta):
        self.meta = meta
        self.entries = {t.name: t for t in meta.tensors}
        # A private copy-on-write mapping: pages stay shared with the page cache until written, which
        # nothing does; torch.from_numpy needs a writable array to avoid its read-only warning.
        with open(meta.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._mm = np.frombuffer(self._map, dtype=np.uint8)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor as a uint8 view of the mapping (no copy)."""
        e = self.entries[name]
        return self._mm[e.offset:e.offset + e.n_bytes]

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` in numpy shape (reversed ne) as `dtype` on the CPU.

        Zero-copy when the stored type equals dtype (the tensor then keeps the mapping alive);
        otherwise one converted copy and the view is not kept."""
        import gguf

        e = self.entries[name]
        raw = self.raw(name)
        if e.ggml_type == "F32":
            t = torch.from_numpy(raw.view(np.float32).reshape(e.shape))
        elif e.ggml_type == "F16":
            t = torch.from_numpy(raw.view(np.float16).reshape(e.shape))
        elif e.ggml_type == "BF16":
            t = torch.from_numpy(raw.view(np.int16).reshape(e.shape)).view(torch.bfloat16)
        else:
            qtype = gguf.GGMLQuantizationType[e.ggml_type]
            rows = raw.reshape(*e.shape[:-1], -1)              # (..., bytes per row)
            t = torch.from_numpy(gguf.quants.dequantize(rows, qtype))   # f32, numpy shape
        if t.dtype == dtype:
            return t
        out = t.to(dtype)
        self.release(name)
        return out

    def release(self, name: str) -> None:
        """Drop the mapped pages of a tensor that was copied elsewhere from this process's RSS, so the
        file's bytes are not resident beside the converted copy. Safe even if a view is still in use:
        never-written pages of a private mapping are simply read from the file again on access."""
        e = self.entries[name]
        start = -(-e.offset // mmap.PAGESIZE) * mmap.PAGESIZE          # whole pages inside the tensor
        end = (e.offset + e.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass
class ByteLedger:
    """Bytes per (group, device): as stored in the file and as held in memory after conversion.

    group: "experts" (routed ffn_*_exps), "non_experts" (everything else from the file), plus
    "kv_cache" and "staging" (buffers the engine allocates, file bytes 0). device: "host" or
    "accelerator", the roles of the placement plan, whatever device the accelerator part runs on."""
    file: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    held: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, group: str, device: str, file_bytes: int, held_bytes: int) -> None:
        self.file[group][device] += file_bytes
        self.held[group][device] += held_bytes

    def by_device(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for per_dev in self.held.values():
            for dev, n in per_dev.items():
                out[dev] += n
        return dict(out)

    def held_bytes(self, group: str, device: str | None = None) -> int:
        per = self.held.get(group, {})
        return sum(per.values()) if device is None else per.get(device, 0)

    def to_dict(self) -> dict:
        return {"file_bytes": {g: dict(d) for g, d in self.file.items()},
                "held_bytes": {g: dict(d) for g, d in self.held.items()}}


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def file_dtype(meta: ModelMeta) -> str:
    """The stored type of the big matrices (most bytes), e.g. 'F16' or 'Q4_K'."""
    per: dict[str, int] = defaultdict(int)
    for t in meta.tensors:
        per[t.ggml_type] += t.n_bytes
    return max(per, key=per.get)

