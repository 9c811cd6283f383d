"""The reference engine's choices that `moebench plan` and the roofline predict, as rules that need no
torch: its compute dtype and the stored type of a file. The engine uses the same functions, so the plan
and the engine cannot drift apart. (What it holds needs no rule: every weight as the file stores it.)"""
from __future__ import annotations

from engines.devices import cpu_isa
from engines.gguf_meta import ModelMeta

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def compute_dtype(asked: str, device_type: str, stored: str, cuda_bf16: bool = True, isa: str | None = None) -> str:
    """The dtype of many-token products (one-token products read the stored bytes with f32 or int8
    activations). auto: F32 files compute in f32; on CUDA F16 files in f16, the rest in bf16 (f16 where the
    GPU lacks bf16); on a CPU the kernels' GEMMs run in bf16 with the avx512 and amx variants (oneDNN's
    bf16 GEMM measured ~200 GFLOP/s per Zen4 core for 64x1024x1024 vs 68 for f32), in f32 with avx2.
    `isa`: the CPU kernel variant (default: the one engines.devices.cpu_isa picks)."""
    if asked != "auto":
        return asked
    if stored == "F32":
        return "f32"
    if device_type == "cuda":
        return "f16" if stored == "F16" or not cuda_bf16 else "bf16"
    try:
        return "f32" if (isa or cpu_isa()) == "avx2" else "bf16"
    except ValueError:          # no usable variant: the engine itself will say so
        return "f32"


def stored_type(meta: ModelMeta) -> str:
    """The stored type of the big matrices (the type holding the most bytes), e.g. 'F16' or 'Q4_K'."""
    per: dict[str, int] = {}
    for t in meta.tensors:
        per[t.ggml_type] = per.get(t.ggml_type, 0) + t.n_bytes
    return max(per, key=per.get)
