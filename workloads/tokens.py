"""Token ids for the timed loops: one seeded generator, identical for every engine (no tokenizer)."""
from __future__ import annotations

import numpy as np

from workloads.grammar import Workload


def token_stream(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """n ids in [1, n_vocab) (id 0 avoided: often a special token), the same for a given seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, max(n_vocab, 2), size=n, dtype=np.int64).tolist()


def workload_tokens(w: Workload, n_vocab: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(untimed depth tokens, timed tokens) for one workload; a tgN run decodes its timed tokens one by one."""
    ids = token_stream(w.n_depth + w.n_tokens, n_vocab, seed)
    return ids[: w.n_depth], ids[w.n_depth:]
