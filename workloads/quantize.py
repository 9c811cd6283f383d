"""llama.cpp's own quantizer and its per-tensor type choice, for synthesized models.

`quantize(a, "Q4_K")` runs ggml's quantizer (`ggml_quantize_chunk` from the libggml-base that ships
with llama-cpp-python, called through ctypes), so the bytes are exactly those `llama-quantize` writes
for the same float32 data. gguf-py is not used for any type: it cannot quantize the K-quants or IQ4_XS,
and one path for every type keeps the bytes identical to llama.cpp by construction (rows are quantized
independently and without an importance matrix, as llama-quantize does when given none). (gguf-py's
F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/MXFP4 gave the same bytes on Gaussian test data, for the record.)

`tensor_type(ftype, name, shape, ...)` is llama.cpp's choice of type for one tensor of a file type
(src/llama-quant.cpp: tensor_allows_quantization, llama_tensor_get_type, llama_tensor_get_type_impl,
tensor_type_fallback), for the file types in FTYPES. What `moebench model synth --dtype X` means:

  f32, f16, bf16  every matrix in that type; norms, biases, 1-D tensors and the router ffn_gate_inp F32
  q8_0            every matrix Q8_0 (router and 1-D tensors F32)
  q4_0            Q4_0, with output.weight Q6_K and, with exactly 8 experts, attn_k/attn_v Q8_0
  q4_k_m          Q4_K; Q6_K for output.weight, for attn_v and ffn_down (routed, shared and dense) in
                  the layers use_more_bits() picks (first and last eighth, every third in between);
                  with exactly 8 experts attn_k/attn_v Q8_0 and attn_output Q5_K
  q5_k_m          Q5_K; Q6_K for output.weight and the use_more_bits() attn_v/ffn_down; 8 experts: attn_k/v Q8_0
  q6_k            Q6_K everywhere; with exactly 8 experts attn_k/attn_v Q8_0
  iq4_xs          IQ4_XS; ffn_down of the first eighth of the layers Q5_K (no imatrix), output Q6_K,
                  attn_v Q5_K when n_head/n_head_kv >= 4; 8 experts: attn_k/v Q8_0, attn_output Q5_K
  mxfp4           LLAMA_FTYPE_MOSTLY_MXFP4_MOE: 3-D expert stacks MXFP4, every other matrix Q8_0

Rules reproduced: which tensors are quantized at all (2+ dims as ggml_n_dims counts them, name ends in
"weight", not *_norm.weight, not ffn_gate_inp.weight, and the other name exclusions of
tensor_allows_quantization); the tensor categories (substring matches, attn_qkv/attn_kv_b counting as
attn_v); output.weight (and token_embd.weight when there is no output.weight, i.e. tied embeddings);
the MXFP4_MOE split; the attn_v, attn_k, attn_output and ffn_down rules for the file types above,
including use_more_bits, the n_expert == 8 bumps, the n_gqa >= 4 rule and the 70B rule (llama with 80
layers and GQA); and tensor_type_fallback for rows that are not whole blocks (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, then F16 if k is not a multiple of 32 either).

Simplified: the layer index of the attn_v and (dense) ffn_down rules is read from the tensor name;
llama.cpp counts tensors of that category in its loading order (layer, then name), which is the same
thing when every layer has one such tensor, as all our architectures do. Not reproduced: Falcon and
GLM5-next special cases, IQ1/IQ2/IQ3/Q2_K/Q3_K file types, imatrix-dependent rules (we never use an
imatrix), and the user overrides of llama-quantize (--tensor-type, --output-tensor-type, --pure).
Tensors that are not quantized keep their source type, which tensor_type reports as F32 (what
convert_hf_to_gguf writes for them).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.gguf_meta import GGML_TYPES

@dataclass(frozen=True)
class FileType:
    llama_ftype: int        # enum llama_ftype (include/llama.h)
    default: str            # llama_ftype_get_default_type


FTYPES: dict[str, FileType] = {
    "f32": FileType(0, "F32"), "f16": FileType(1, "F16"), "bf16": FileType(32, "BF16"),
    "q8_0": FileType(7, "Q8_0"), "q4_0": FileType(2, "Q4_0"),
    "q4_k_m": FileType(15, "Q4_K"), "q5_k_m": FileType(17, "Q5_K"), "q6_k": FileType(18, "Q6_K"),
    "iq4_xs": FileType(30, "IQ4_XS"), "mxfp4": FileType(38, "MXFP4"),
}


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one row of k values; ValueError if the type is unknown or k is not whole blocks."""
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"Cannot quantize to ggml type {ggml_type!r}; supported: {', '.join(GGML_TYPES)}.")
    _, blk, size = GGML_TYPES[ggml_type]
    if k <= 0 or k % blk:
        raise ValueError(f"A {ggml_type} row holds whole blocks of {blk} values, but the rows have k = {k} "
                         f"values; use a type whose block size divides {k} (tensor_type() picks one).")
    return k // blk * size


# ---------------------------------------------------------------- the quantizer

_lib: ctypes.CDLL | None = None    # kept for the life of the process: the functions point into it


def _ggml() -> ctypes.CDLL:
    """libggml-base from the llama_cpp package (loaded RTLD_GLOBAL, as llama_cpp loads its own libs)."""
    global _lib
    if _lib is None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.origin:
            raise RuntimeError("llama-cpp-python is not installed; it provides ggml's quantizer (pip install "
                               "llama-cpp-python).")
        libdir = Path(spec.origin).parent / "lib"
        names = ["libggml-base.dylib", "libggml-base.so"] if sys.platform == "darwin" else ["libggml-base.so"]
        path = next((libdir / n for n in names if (libdir / n).exists()), None)
        if path is None:
            raise RuntimeError(f"libggml-base not found in {libdir}; reinstall llama-cpp-python.")
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        # size_t ggml_quantize_chunk(type, const float * src, void * dst, int64 start, int64 nrows,
        #                            int64 n_per_row, const float * imatrix)
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        lib.ggml_validate_row_data.restype = ctypes.c_bool
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_row_size.restype = ctypes.c_size_t
        _lib = lib
    return _lib


def requires_imatrix(ggml_type: str) -> bool:
    """Whether ggml refuses to quantize this type without an importance matrix (none of GGML_TYPES does)."""
    return bool(_ggml().ggml_quantize_requires_imatrix(GGML_TYPES[ggml_type][0]))


def quantize(a: np.ndarray, ggml_type: str, n_threads: int | None = None) -> np.ndarray:
    """float32 values (..., k) -> ggml rows (..., row_bytes) uint8, byte for byte what llama.cpp writes.

    Deterministic: each row is quantized on its own (no importance matrix), so the result does not
    depend on n_threads (default: the CPUs this process may use), which only splits the rows between threads.
    Raises ValueError for a k that is not whole blocks, and where ggml's own row check (the one
    llama-quantize applies) rejects the result: non-finite input, or for MXFP4 a block whose largest
    |x| lies in [2^-126, 2^-125) (ggml's exponent underflows to 255; still smaller blocks quietly become 0).
    """
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim < 1:
        raise ValueError("quantize() needs an array of rows (..., k), not a scalar.")
    k = a.shape[-1]
    rb = row_bytes(ggml_type, k)
    code = GGML_TYPES[ggml_type][0]
    if ggml_type == "F32":
        return a.view(np.uint8).reshape(*a.shape[:-1], rb).copy()
    lib = _ggml()
    if lib.ggml_quantize_requires_imatrix(code):
        raise ValueError(f"ggml cannot quantize {ggml_type} without an importance matrix.")
    assert lib.ggml_row_size(code, k) == rb, f"ggml's row size for {ggml_type} disagrees with GGML_TYPES"
    n_rows = a.size // k
    out = np.empty((n_rows, rb), dtype=np.uint8)
    if n_rows == 0:
        return out.reshape(*a.shape[:-1], rb)
    src, dst = a.ctypes.data, out.ctypes.data

    def run(r0: int, r1: int) -> None:
        n = lib.ggml_quantize_chunk(code, src + r0 * k * 4, dst + r0 * rb, 0, r1 - r0, k, None)
        if n != (r1 - r0) * rb:
            raise RuntimeError(f"ggml_quantize_chunk wrote {n} bytes for {r1 - r0} {ggml_type} rows, expected "
                               f"{(r1 - r0) * rb}.")
        if not lib.ggml_validate_row_data(code, dst + r0 * rb, n):   # as llama-quantize checks (NaN/inf scales)
            raise ValueError(f"Quantizing to {ggml_type} produced invalid blocks: the input has non-finite values"
                             + (" or a block whose largest |x| is below 2^-125" if ggml_type == "MXFP4" else "") + ".")

    if not n_threads:
        n_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n_threads = max(1, n_threads)
    rows_per_chunk = max(1, min(n_rows, (1 << 16) // k or 1, -(-n_rows // n_threads)))
    chunks = [(r, min(r + rows_per_chunk, n_rows)) for r in range(0, n_rows, rows_per_chunk)]
    if n_threads == 1 or len(chunks) == 1:
        for c in chunks:
            run(*c)
    else:   # ctypes releases the GIL for the duration of each call
        with ThreadPoolExecutor(min(n_threads, len(chunks))) as pool:
            list(pool.map(lambda c: run(*c), chunks))
    return out.reshape(*a.shape[:-1], rb)


# ---------------------------------------------------------------- llama.cpp's type choice

_EXCLUDED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
             "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
             "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
             "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
             "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
             "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
             "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
             "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one (in ggml order) larger than 1; a (1, K) matrix is 1-D."""
    ne = tuple(reversed(shape))
    return max([i + 1 for i, d in enumerate(ne) if d > 1], default=1)


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization: quantize 2-D/3-D weights, except norms, the router and a few others."""
    return (_n_dims(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _EXCLUDED)
            and name not in ("position_embd.weight", "token_types.weight"))


def _category(name: str) -> str:
    """tensor_get_category (the order of the substring tests matters)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:     # attn_qkv and attn_kv_b count as attn_v (category_is_attn_v)
            return cat
    return "other"


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    if not m:
        raise ValueError(f"Tensor {name!r} has no layer number (blk.N.) although its type depends on the layer.")
    return int(m.group(1))


def _fallback(t: str, k: int) -> str:
    """tensor_type_fallback: a type whose block does not divide the row falls back to a 32-block type, then F16."""
    blk = GGML_TYPES[t][1]
    if k % blk == 0:
        return t
    fb = {"IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(t, t)
    return fb if k % GGML_TYPES[fb][1] == 0 else "F16"


def tensor_type(ftype: str, name: str, shape: tuple[int, ...], n_layers: int, arch: str = "qwen3moe", *,
                n_expert: int = 0, n_head: int = 1, n_head_kv: int = 1, tied_embeddings: bool = False,
                attn_v: tuple[int, int] | None = None) -> str:
    """The ggml type llama-quantize gives tensor `name` (numpy shape) in a file of type `ftype`.

    n_expert (expert_count), n_head/n_head_kv (for n_gqa) and tied_embeddings (the file has no
    output.weight) are model facts some rules depend on. attn_v: (index among the model's attn_v tensors,
    their count), as llama.cpp counts them (i_attention_wv); default (the layer, n_layers), the same when every
    layer has one (not gemma4, whose full-attention layers have none). See the module docstring for the rules.
    """
    if ftype not in FTYPES:
        raise ValueError(f"Unknown file type {ftype!r}; choose from: {', '.join(FTYPES)}.")
    shape = tuple(int(d) for d in shape)
    if not allows_quantization(name, shape):
        return "F32"
    ft = FTYPES[ftype]
    new = ft.default
    if GGML_TYPES[new][1] == 1:       # F32/F16/BF16: not ggml_is_quantized, no mix and no fallback
        return new
    k = shape[-1]
    cat = _category(name)
    n_gqa = n_head // n_head_kv if n_head_kv else 0
    is_70b = arch in ("llama", "qwen2", "deci", "olmo") and n_layers == 80 and (arch != "llama" or n_head != n_head_kv)

    if cat == "output" or (tied_embeddings and cat == "token_embd"):
        if ftype == "mxfp4" or k % GGML_TYPES[new][1]:
            new = "Q8_0"
        elif new != "Q8_0":
            new = "Q6_K"
    elif ftype == "mxfp4":          # MoE tensors MXFP4, the rest Q8_0
        new = "MXFP4" if len(shape) >= 3 and shape[-3] > 1 else "Q8_0"
    elif cat == "token_embd":
        pass
    elif cat == "attn_v":           # llama.cpp counts attn_v tensors (i_attention_wv of n_attention_wv)
        if ftype == "iq4_xs" and n_gqa >= 4:
            new = "Q5_K"
        elif ftype in ("q4_k_m", "q5_k_m") and _use_more_bits(*(attn_v or (_layer(name), n_layers))):
            new = "Q6_K"
        if is_70b and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
        if n_expert == 8:
            new = "Q8_0"
    elif cat == "attn_k":
        if n_expert == 8:
            new = "Q8_0"
    elif cat == "ffn_down":         # routed, shared and dense FFN down projections alike
        i_layer = _layer(name)
        if ftype == "q4_k_m":
            if _use_more_bits(i_layer, n_layers):
                new = "Q6_K"
        elif ftype == "iq4_xs" and i_layer < n_layers // 8:      # (only without an imatrix)
            new = "Q5_K"
        elif ftype == "q5_k_m" and _use_more_bits(i_layer, n_layers):
            new = "Q6_K"
    elif cat == "attn_output":
        if n_expert == 8 and ftype in ("q4_k_m", "iq4_xs"):
            new = "Q5_K"
    return _fallback(new, k)


def tensor_types(ftype: str, shapes: dict[str, tuple[int, ...]], n_layers: int, arch: str = "qwen3moe", *,
                 n_expert: int = 0, n_head: int = 1, n_head_kv: int = 1) -> dict[str, str]:
    """tensor_type for every tensor of a model (name -> numpy shape); tied embeddings when there is no output.weight."""
    tied = "output.weight" not in shapes
    wv = [n for n in shapes if _category(n) == "attn_v"]         # in layer order, as llama.cpp counts them
    return {name: tensor_type(ftype, name, shape, n_layers, arch, n_expert=n_expert, n_head=n_head,
                              n_head_kv=n_head_kv, tied_embeddings=tied,
                              attn_v=(wv.index(name), len(wv)) if name in wv else None)
            for name, shape in shapes.items()}
