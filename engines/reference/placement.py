"""What the reference engine holds where, as rules that need no torch: the compute dtype it picks and the
bytes it holds per tensor. `moebench plan` and the roofline predict the engine's memory from these; the
engine itself uses the same functions, so the two cannot drift apart."""
from __future__ import annotations

import math

from engines.devices import cpu_flags
from engines.gguf_meta import ModelMeta, TensorEntry
from engines.reference.archs import ARCHS

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def compute_dtype(asked: str, device_type: str, stored: str, cuda_bf16: bool = True) -> str:
    """The compute dtype. auto: F32 files compute in f32; on CUDA F16 files in f16, the rest in bf16 (f16
    where the GPU lacks bf16); on a CPU with avx512_bf16/AMX everything else in bf16 (oneDNN: measured ~200
    GFLOP/s per Zen4 core for 64x1024x1024 vs 68 for f32 and 20 for f16), otherwise f32."""
    if asked != "auto":
        return asked
    if stored == "F32":
        return "f32"
    if device_type == "cuda":
        return "f16" if stored == "F16" or not cuda_bf16 else "bf16"
    return "bf16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "f32"


def stored_type(meta: ModelMeta) -> str:
    """The stored type of the big matrices (the type holding the most bytes), e.g. 'F16' or 'Q4_K'."""
    per: dict[str, int] = {}
    for t in meta.tensors:
        per[t.ggml_type] = per.get(t.ggml_type, 0) + t.n_bytes
    return max(per, key=per.get)


def f32_tensor(arch: str, t: TensorEntry) -> bool:
    """Tensors the engine keeps in f32 whatever the compute dtype: norms and the router (routing decisions
    as exact as ggml's). Unknown architectures: 1-D tensors, the norms and scales."""
    a = ARCHS.get(arch)
    role = a.role(t.name) if a else None
    return role in ("norm", "router") if role else len(t.ne) == 1


def held_bytes(arch: str, t: TensorEntry, dtype: str) -> int:
    """Bytes the engine holds for tensor t at compute dtype `dtype`."""
    return math.prod(t.ne) * (4 if f32_tensor(arch, t) else DTYPE_BYTES[dtype])
