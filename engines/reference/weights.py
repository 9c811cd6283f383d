"""The model file's tensors as the engine holds them, and the bytes it holds where.

Every matrix stays as the file stores it (a QTensor: its bytes and ggml type), in one of three homes: the
file mapping itself (zero-copy), one copy of the same bytes on 2 MiB pages (CPU), or one copy on the GPU /
in page-locked host memory (CUDA). A copy releases the mapping's pages, so no tensor is ever held twice.
Matrices the CPU kernels compute (every matrix of a CPU-device run) may instead be held in an interleaved
layout made once here (QuantKernels.host_layout: the types of LAYOUT_TYPES as "x8", the same bytes
reordered), again in place of the file's bytes, never beside them.
Vectors (norms, biases, sinks, scales: at most a few KiB a layer) are held as f32 tensors.
"""
from __future__ import annotations

import mmap
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engines.errors import UserError
from engines.gguf_meta import ModelMeta, TensorEntry, tensor_bytes
from engines.reference.qtensor import COMPUTED, TYPES, QTensor

VECTOR_TYPES = ("F32", "F16", "BF16")      # the types vectors may be stored in (llama.cpp writes F32)


def check(entry: TensorEntry, shape: tuple[int, ...], matrix: bool) -> None:
    """Validate one tensor against the shape the metadata implies and the types the engine computes
    with, before anything is allocated."""
    if entry.shape != tuple(shape):
        raise UserError(f"Tensor {entry.name!r} has shape {entry.shape}, but the model metadata implies "
                        f"{tuple(shape)}; the file is corrupt or not a supported model.")
    types = COMPUTED if matrix else VECTOR_TYPES
    if entry.ggml_type not in types:
        raise UserError(f"Tensor {entry.name!r} is stored as {entry.ggml_type}, which the reference engine does not "
                        f"compute with; supported: {', '.join(types)}.")
    block = TYPES[entry.ggml_type][1]
    if entry.ne[0] % block or tensor_bytes(entry.ggml_type, entry.shape) != entry.n_bytes:
        raise UserError(f"Tensor {entry.name!r} ({entry.ggml_type} {entry.shape}) occupies {entry.n_bytes} bytes, "
                        f"not whole {entry.ggml_type} rows; the file is corrupt.")


class GGUFFile:
    """The file mapped once, private copy-on-write (pages stay shared with the page cache until written,
    which nothing does; torch wants a writable buffer). Tensors are zero-copy views of the mapping."""

    def __init__(self, meta: ModelMeta):
        self.entries = {t.name: t for t in meta.tensors}
        with open(meta.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)

    def qtensor(self, name: str) -> QTensor:
        e = self.entries[name]
        return QTensor(self._buf[e.offset:e.offset + e.n_bytes], e.ggml_type, e.shape)

    def vector(self, name: str) -> torch.Tensor:
        """A small tensor as f32 (a copy)."""
        qt = self.qtensor(name)
        raw = qt.raw.clone()                     # a copy: the view of an odd offset may be unaligned
        if qt.type == "F32":
            return raw.view(torch.float32).reshape(qt.shape)
        return raw.view(torch.float16 if qt.type == "F16" else torch.bfloat16).reshape(qt.shape).float()

    def release(self, name: str) -> None:
        """Drop the mapped pages of a tensor that was copied elsewhere from this process's RSS. Safe even if
        a view is still in use: never-written pages of a private mapping are read from the file again."""
        e = self.entries[name]
        start = -(-e.offset // mmap.PAGESIZE) * mmap.PAGESIZE          # whole pages inside the tensor
        end = (e.offset + e.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


HUGE = 2 << 20   # x86 transparent huge page


def hugepage_empty(n: int) -> torch.Tensor:
    """n uint8 bytes in an anonymous mapping advised for 2 MiB transparent huge pages (see hugepage_copy);
    under 2 MiB, or without MADV_HUGEPAGE, an ordinary tensor."""
    if n < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(n, dtype=torch.uint8)
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(m, dtype=torch.uint8)          # holds a reference to m: lives as long as buf
    off = (-buf.data_ptr()) % HUGE                         # huge pages need 2 MiB-aligned addresses
    # only the whole huge pages: the tail in a huge page of its own would hold up to 2 MiB more than the
    # tensor (~1 MiB a tensor, tens of MiB a model, on the RSS llama.cpp is compared with)
    m.madvise(mmap.MADV_HUGEPAGE, off, n // HUGE * HUGE)
    return buf[off:off + n]


def hugepage_copy(raw: torch.Tensor) -> torch.Tensor:
    """A copy of CPU bytes in an anonymous mapping advised for 2 MiB transparent huge pages (THP is often
    "madvise"-only). Why: decode streams every active weight once per token; with 4 KiB pages each 4 KiB
    read walks the page table and the prefetcher stops at each page end (measured, 2 Zen4 threads, a bf16
    GEMV: ~29 GB/s on 4 KiB pages, ~45 on huge pages). Under 2 MiB, or without MADV_HUGEPAGE: as it is."""
    if raw.numel() < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return raw
    return hugepage_empty(raw.numel()).copy_(raw)


@dataclass
class ByteLedger:
    """Bytes per (group, device): as stored in the file and as held in memory.

    group: "experts" (routed ffn_*_exps), "non_experts" (everything else from the file), plus "kv_cache",
    "state" and "staging" (buffers the engine allocates, file bytes 0). device: "host" or "accelerator",
    the roles of the placement plan, whatever device the accelerator part runs on."""
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


class Holder:
    """Takes each tensor of the file to its home and books its bytes (see the module docstring)."""

    def __init__(self, src: GGUFFile, device: torch.device, hugepages: bool, kernels=None, bf16: bool = False):
        """kernels: the CPU kernels (kernels.QuantKernels) whose layout (its host_layout; bf16: the products' GEMM
        runs in bf16) a CPU device's matrices are repacked into, or None to keep every matrix as the file stores it."""
        self.src, self.device, self.cuda, self.bf16 = src, device, device.type == "cuda", bf16
        self.hugepages = hugepages and not self.cuda
        self.kernels = None if self.cuda else kernels
        self.ledger = ByteLedger()
        self.pinned: list[torch.Tensor] = []

    def pin(self, raw: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of exactly raw's size (async host->device copies need it). Not pin_memory():
        torch's pinned allocator rounds each block up to a power of two (a 384 MiB expert stack would lock
        512 MiB that no ledger shows)."""
        t = torch.empty_like(raw).copy_(raw)
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel()} bytes failed with CUDA error {int(err)}")
        self.pinned.append(t)
        return t

    def unpin(self) -> None:
        """Unregister the page-locked copies (before their memory goes back)."""
        for t in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self.pinned.clear()

    def matrix(self, name: str, group: str, where: str) -> QTensor:
        """A matrix as stored, at `where` ("host" | "accelerator")."""
        qt = self.src.qtensor(name)
        if self.kernels is not None and (layout := self.kernels.host_layout(qt, self.bf16)) != "ggml":
            new = self.kernels.repack(qt, layout, hugepage_empty(qt.nbytes) if self.hugepages else None)
            self.src.release(name)
            self.ledger.add(group, where, qt.nbytes, new.nbytes)
            return new
        raw = qt.raw
        if self.cuda:
            raw = raw.to(self.device) if where == "accelerator" else self.pin(raw)
        elif self.hugepages:
            raw = hugepage_copy(raw)
        if raw is not qt.raw:
            self.src.release(name)
        self.ledger.add(group, where, qt.nbytes, raw.numel())
        return qt.with_raw(raw)

    def lookup(self, name: str, group: str = "non_experts", where: str = "accelerator") -> QTensor:
        """A matrix only ever read a row at a time (an untied token embedding): on a CPU device the file's
        mapping itself, as llama.cpp's mmap leaves it, so that only the pages of the rows a prompt reads become
        resident (a real vocabulary's embedding is hundreds of MB); elsewhere as matrix()."""
        if self.cuda:
            return self.matrix(name, group, where)
        qt = self.src.qtensor(name)
        self.ledger.add(group, where, qt.nbytes, qt.nbytes)
        return qt

    def vector(self, name: str, group: str = "non_experts", where: str = "accelerator") -> torch.Tensor:
        """A vector as f32: on the accelerator, or on the host CPU (the biases of host experts)."""
        t = self.src.vector(name)
        t = t.to(self.device) if where == "accelerator" else t
        self.ledger.add(group, where, self.src.entries[name].n_bytes, t.numel() * 4)
        return t
