"""The reference engine's choices that `moebench plan` and the roofline predict, as rules that need no
torch: its compute dtype and the stored type of a file. The engine uses the same functions, so the plan
and the engine cannot drift apart. (What it holds needs no rule: every weight as the file stores it.)"""
from __future__ import annotations

from engines.gguf_meta import ModelMeta

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def compute_dtype(asked: str, device_type: str, stored: str, cuda_bf16: bool = True) -> str:
    """The dtype of many-token products (one-token products read the stored bytes with f32 or int8
    activations). auto: F32 files compute in f32; on CUDA F16 files in f16, the rest in bf16 (f16 where the
    GPU lacks bf16); on a CPU in f32 with every kernel variant: F16 and BF16 weights in an f32 GEMM with x rounded
    to the weight's type, quantized weights as int8 dot products against x quantized to 8-bit blocks at every
    batch size, which is ggml's arithmetic. The avx512 and amx variants' bf16 GEMM (dtype bf16; oneDNN's measured
    ~200 GFLOP/s per Zen4 core for 64x1024x1024 against 68 in f32) rounds x, weights and results to bf16 and misses
    the logit bound at pp512: position 0 of a 512-row ubatch 1.9e-2 (F16) to 0.8 (Q4_K_M) off llama.cpp, against
    <= 1.2e-3 in f32 (tests/test_logits_pp512.py)."""
    if asked != "auto":
        return asked
    if device_type == "cuda" and stored != "F32":
        return "f16" if stored == "F16" or not cuda_bf16 else "bf16"
    return "f32"


def stored_type(meta: ModelMeta) -> str:
    """The stored type of the big matrices (the type holding the most bytes), e.g. 'F16' or 'Q4_K'."""
    per: dict[str, int] = {}
    for t in meta.tensors:
        per[t.ggml_type] = per.get(t.ggml_type, 0) + t.n_bytes
    return max(per, key=per.get)
