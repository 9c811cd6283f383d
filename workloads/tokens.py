"""Token ids for the timed loops: one seeded generator, identical for every engine, no sampling.

Two streams (workloads.grammar.STREAMS), chosen per workload (`pp512` vs `pp512+corr`):
- random: llama-bench's uniform random ids; almost no temporal locality (an expert used by one token is
  reused by the next only by chance), which is the worst case for an expert cache;
- correlated: what real prompts look like. Its source ("text" or "repeats") depends on the model:
  - text: a model with a real tokenizer gets the bundled public-domain text (workloads/data/alice.txt) through
    llama.cpp's own tokenizer (llama-cpp-python, vocab only), cycled to length, starting at a seed-chosen token;
  - repeats: otherwise (synthesized files have no vocabulary) a seeded stream in which each token repeats one of
    the last 8 with probability P_REPEAT, else is a fresh draw; in a file with planted routing (workloads.planted)
    fresh draws stay in one token cluster for runs of ~RUN tokens, as words of one topic would.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from engines.errors import UserError
from workloads.grammar import Workload

TEXT = Path(__file__).with_name("data") / "alice.txt"
# On preset:qwen3-30b-a3b-4l@zipf=1.2 these give 59 % of expert selections repeated at the next token and 83 %
# within 8 (random ids: 34 % and 69 %, from the planted skew alone); Qwen3-30B-A3B on real text: 45 % and 80 %
# (issue 23). From the planted table over 1024 tokens (the reference engine's routing equals it on these files;
# its trace of a 256-token pp256+corr: 63 % and 83 %).
P_REPEAT = 0.2      # a token repeats one of the last WINDOW tokens (function words, names)
WINDOW = 8
RUN = 2             # mean run of fresh draws in one planted cluster (a geometric draw): a topic
SOURCES = ("random", "text", "repeats")


def token_stream(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """n ids in [1, n_vocab) (id 0 avoided: often a special token), the same for a given seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, max(n_vocab, 2), size=n, dtype=np.int64).tolist()


def repeat_stream(n: int, n_vocab: int, seed: int = 0, clusters: int = 0) -> list[int]:
    """n ids in [1, n_vocab) with temporal locality: a repeat of one of the last WINDOW ids with probability
    P_REPEAT, else a fresh id (with clusters > 0: from the current cluster `id % clusters`, which changes with
    probability 1/RUN per fresh draw)."""
    rng = np.random.default_rng([seed, 0xC0])
    out: list[int] = []
    cluster = -1
    hi = max(n_vocab, 2)
    for _ in range(n):
        if out and rng.random() < P_REPEAT:
            out.append(out[-int(rng.integers(1, min(WINDOW, len(out)) + 1))])
            continue
        if clusters <= 0 or clusters >= hi:
            out.append(int(rng.integers(1, hi)))
            continue
        if cluster < 0 or rng.random() < 1.0 / RUN:
            cluster = int(rng.integers(0, clusters))
        lo, top = (1 if cluster == 0 else 0), (hi - 1 - cluster) // clusters + 1   # ids cluster + clusters*j < hi
        out.append(cluster + clusters * int(rng.integers(lo, max(top, lo + 1))))
    return out


@functools.lru_cache(maxsize=8)
def _meta(model: str):
    from engines.gguf_meta import read_meta
    return read_meta(model, require_moe=False)


def has_tokenizer(meta) -> bool:
    """A vocabulary llama.cpp can tokenize with (synthesized files say `no_vocab`)."""
    kind = meta.fields.get("tokenizer.ggml.model")
    return isinstance(kind, str) and kind not in ("", "no_vocab", "none") and "tokenizer.ggml.tokens" in meta.fields


def stream_source(w: Workload, model: str | Path | None) -> str:
    """Which stream feeds workload w on this model: one of SOURCES (what a result row records)."""
    if w.stream == "random":
        return "random"
    return "text" if model is not None and has_tokenizer(_meta(str(model))) else "repeats"


@functools.lru_cache(maxsize=4)
def text_tokens(model: str) -> tuple[int, ...]:
    """The bundled text through the model's own tokenizer (llama.cpp, vocabulary only: no weights are loaded)."""
    import llama_cpp as L

    p = L.llama_model_default_params()
    p.vocab_only = True
    m = L.llama_model_load_from_file(model.encode(), p)
    if not m:
        raise UserError(f"llama.cpp could not load the tokenizer of {Path(model).name}; use a +corr workload only "
                        f"with a model llama.cpp reads, or drop +corr.")
    try:
        vocab, data = L.llama_model_get_vocab(m), TEXT.read_bytes()
        buf = (L.llama_token * (len(data) + 16))()
        n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
        if n <= 0:
            raise UserError(f"llama.cpp's tokenizer of {Path(model).name} returned no tokens for the bundled text; "
                            f"drop +corr for this model.")
        return tuple(buf[:n])
    finally:
        L.llama_model_free(m)


def stream_tokens(n: int, kind: str, n_vocab: int, seed: int = 0, model: str | Path | None = None) -> list[int]:
    """n ids of the given source (SOURCES) for a model."""
    if kind == "random":
        return token_stream(n, n_vocab, seed)
    if kind == "text":
        text = text_tokens(str(model))
        start = int(np.random.default_rng([seed, 0x7E]).integers(0, len(text)))
        return [text[(start + i) % len(text)] for i in range(n)]
    clusters = int(_meta(str(model)).fields.get("moebench.routing.clusters") or 0) if model is not None else 0
    return repeat_stream(n, n_vocab, seed, clusters)


def workload_tokens(w: Workload, n_vocab: int, seed: int = 0,
                    model: str | Path | None = None) -> tuple[list[int], list[int]]:
    """(untimed depth tokens, timed tokens) for one workload; a tgN run decodes its timed tokens one by one.
    model: the file (a correlated stream depends on its tokenizer and planted clusters)."""
    ids = stream_tokens(w.n_depth + w.n_tokens, stream_source(w, model), n_vocab, seed, model)
    return ids[: w.n_depth], ids[w.n_depth:]
