"""llama.cpp's routing of a token stream, read through its eval callback, and the top-k set overlap with another
engine's routing of the same tokens (issue 23: a trace predicts another engine only beside this number).

llama.cpp names the router's selection `ffn_moe_topk-<il>` (src/llama-graph.cpp, build_moe_ffn): a view of the
first k columns of `ffn_moe_argsort-<il>` (ggml_argsort_top_k = argsort + view), i.e. (n_tokens, k) int32 ids
whose rows are n_expert ids apart in memory. Read as if contiguous, those bytes are the full ranking of the first
tokens, and the "routing" looks uniform; so the ids are read with the tensor's own strides (ne, nb).

Run it in a child process where a crash must not take the caller down (tests: conftest.isolated()).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import numpy as np

from engines.errors import UserError

TOPK = b"ffn_moe_topk-"
GGML_TYPE_I32 = 26           # ggml.h enum ggml_type
_NE, _NB = 16, 48            # struct ggml_tensor: type (4 + 4 pad), buffer*, int64 ne[4] at 16, size_t nb[4] at 48


def _ggml(L):
    """The ggml functions the callback needs, from the library llama-cpp-python already loaded (its symbols
    resolve through libllama's dependencies; a second CDLL of libggml would be another copy)."""
    lib = L.llama_cpp._lib
    lib.ggml_get_name.restype, lib.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    lib.ggml_nbytes.restype, lib.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


def read_ids(lib, t: int, strides: bool = True) -> np.ndarray:
    """The (n_tokens, k) int32 ids of an ffn_moe_topk tensor t (a ggml_tensor*). strides=False: the naive read of
    n_tokens * k contiguous values from its start (wrong for the view; kept so a test shows it scores low)."""
    if ctypes.c_int32.from_address(t).value != GGML_TYPE_I32:
        raise RuntimeError(f"{lib.ggml_get_name(t)!r} is not an I32 tensor; this llama.cpp names routing otherwise")
    ne = (ctypes.c_int64 * 4).from_address(t + _NE)
    nb = (ctypes.c_size_t * 4).from_address(t + _NB)
    k, n = int(ne[0]), int(ne[1])
    size = int(lib.ggml_nbytes(t))                          # the view's extent: (k-1)*nb0 + (n-1)*nb1 + 4
    buf = np.empty(size // 4 + 1, np.int32)
    lib.ggml_backend_tensor_get(t, buf.ctypes.data, 0, size)   # works for any backend's buffer
    if not strides:
        return buf[:n * k].reshape(n, k).copy()
    return np.lib.stride_tricks.as_strided(buf, shape=(n, k), strides=(int(nb[1]), int(nb[0]))).copy()


def llama_cpp_routing(model: str | Path, tokens: Sequence[int], n_ubatch: int = 512, threads: int = 2,
                      repack: bool | None = None, strides: bool = True) -> np.ndarray:
    """llama.cpp's top-k expert ids for every token of `tokens` prefilled from position 0, (T, L, k) int32 in
    the router's ranking, L = the layers with routed experts in order. repack None: as LlamaCppEngine decides
    (without AMX/CPU_REPACK on a build that would crash with them)."""
    import llama_cpp as L

    from engines.llama_cpp import _capture_log, amx_fallback

    tokens = [int(t) for t in tokens]
    if not tokens:
        raise UserError("No tokens to route; pass at least one token id.")
    lib = _ggml(L)
    _capture_log(L)                                    # llama.cpp's log into a list, not onto stderr
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = (not amx_fallback()) if repack is None else repack
    model_p = L.llama_model_load_from_file(str(model).encode(), mp)
    if not model_p:
        raise UserError(f"llama.cpp could not load {Path(model).name}; check the file with `moebench model info`.")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model_p))
    if not all(0 <= t < n_vocab for t in tokens):
        L.llama_model_free(model_p)
        raise UserError(f"Token ids must lie in [0, {n_vocab}) for {Path(model).name}; got "
                        f"{min(tokens)}..{max(tokens)}.")
    rows: dict[int, list[np.ndarray]] = {}

    def callback(t, ask, _user):
        name = lib.ggml_get_name(t) or b""
        if not name.startswith(TOPK):
            return not ask          # asked: not this one; after its compute: carry on
        if not ask:
            rows.setdefault(int(name[len(TOPK):]), []).append(read_ids(lib, t, strides))
        return True

    cb = L.ggml_backend_sched_eval_callback(callback)       # referenced until the context is freed
    cp = L.llama_context_default_params()
    cp.n_ctx = len(tokens) + 8
    cp.n_batch = cp.n_ubatch = n_ubatch
    cp.n_threads = cp.n_threads_batch = threads
    cp.cb_eval, cp.cb_eval_user_data = cb, None
    ctx = L.llama_init_from_model(model_p, cp)
    batch = L.llama_batch_init(n_ubatch, 0, 1)
    try:
        if not ctx:
            raise UserError(f"llama.cpp could not create a context for {Path(model).name}.")
        for s in range(0, len(tokens), n_ubatch):
            chunk = tokens[s:s + n_ubatch]
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, s + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True      # every token's output: else the last layer routes the last token only
            batch.n_tokens = len(chunk)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed at position {s}")
        L.llama_synchronize(ctx)
    finally:
        L.llama_batch_free(batch)
        if ctx:
            L.llama_free(ctx)
        L.llama_model_free(model_p)
    if not rows:
        raise RuntimeError("llama.cpp's graph had no ffn_moe_topk tensors; is this a Mixture-of-Experts model?")
    ids = [np.concatenate(rows[il]) for il in sorted(rows)]       # each (T, k)
    if any(len(a) != len(tokens) for a in ids):
        raise RuntimeError(f"llama.cpp routed {[len(a) for a in ids]} tokens per layer, not {len(tokens)}")
    return np.stack(ids, axis=1)


def set_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Top-k set overlap of two routings of the same tokens, per layer: mean over tokens of the Jaccard index
    |A & B| / |A | B| of the two expert sets. a, b: (T, L, k) ids -> (L,) in [0, 1]."""
    if a.shape != b.shape or a.ndim != 3:
        raise UserError(f"Routings of shapes {a.shape} and {b.shape} cannot be compared; they must be (tokens, "
                        f"layers, k) of the same tokens and model.")
    inter = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)           # (T, L): ids of a also in b
    k = a.shape[-1]
    return (inter / (2 * k - inter)).mean(0)
