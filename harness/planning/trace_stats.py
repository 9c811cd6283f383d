"""Statistics of a routing trace itself, which say how much any expert cache can gain before one is simulated:
- experts covering 90 % of the routing per layer (few = skewed popularity, a small static set helps),
- normalized entropy of expert popularity per layer (1 = uniform, 0 = one expert),
- reuse distance: for each token selection, tokens since the same layer last selected the same expert (short =
  temporal locality, LRU-like caches help), as a histogram over power-of-two bins,
- next-token overlap: the share of a token's experts the previous token (same segment) also used, per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.routing import PHASES, Trace

REUSE_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256)     # upper edges in tokens; beyond: "more", first use: "never"


@dataclass
class TraceStats:
    n_tokens: int
    n_expert: int
    k: int
    cover90: list[int]              # (L,) experts covering 90 % of the token selections
    entropy: list[float]            # (L,) normalized entropy of popularity
    overlap: list[float]            # (L,) mean next-token overlap
    reuse: dict[str, float]         # bin label -> share of token selections (all layers)
    popularity: np.ndarray          # (L, E) token selections per expert

    def rows(self) -> list[dict]:
        """One row per MoE layer plus "all" (means over layers)."""
        out = [{"layer": i, "experts for 90%": c, "entropy": e, "next-token overlap": o}
               for i, (c, e, o) in enumerate(zip(self.cover90, self.entropy, self.overlap))]
        out.append({"layer": "all", "experts for 90%": float(np.mean(self.cover90)) if self.cover90 else 0.0,
                    "entropy": float(np.mean(self.entropy)) if self.entropy else 0.0,
                    "next-token overlap": float(np.mean(self.overlap)) if self.overlap else 0.0})
        return out

    def to_json(self) -> dict:
        return {"n_tokens": self.n_tokens, "n_expert": self.n_expert, "k": self.k, "cover90": self.cover90,
                "entropy": self.entropy, "next_token_overlap": self.overlap, "reuse_distance": self.reuse}


def reuse_labels() -> list[str]:
    lo = [1, *(b + 1 for b in REUSE_BINS[:-1])]
    return [f"{a}" if a == b else f"{a}-{b}" for a, b in zip(lo, REUSE_BINS)] + [f">{REUSE_BINS[-1]}", "never"]


def cover(counts: np.ndarray, share: float = 0.9) -> int:
    """Fewest experts whose selections reach `share` of the total (counts: (E,))."""
    total = counts.sum()
    if total == 0:
        return 0
    c = np.cumsum(np.sort(counts)[::-1])
    return int(np.searchsorted(c, share * total - 1e-9) + 1)


def entropy(counts: np.ndarray) -> float:
    """Shannon entropy of the popularity over log(E): 1 uniform, 0 a single expert."""
    total = counts.sum()
    if total == 0 or len(counts) < 2:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum() / np.log(len(counts)))


def reuse_histogram(trace: Trace) -> dict[str, float]:
    """Share of token selections per reuse-distance bin (tokens since this layer last chose this expert, within
    the trace's token order; the first use of an expert in a layer is "never")."""
    T, L, k = trace.ids.shape
    labels = reuse_labels()
    counts = np.zeros(len(labels), dtype=np.int64)
    if T == 0:
        return dict.fromkeys(labels, 0.0)
    rows = np.repeat(np.arange(T), k)
    edges = np.asarray(REUSE_BINS)
    for layer in range(L):
        e = trace.ids[:, layer, :].ravel().astype(np.int64)
        order = np.lexsort((rows, e))                  # by expert, then token
        es, rs = e[order], rows[order]
        same = np.r_[False, es[1:] == es[:-1]]
        d = np.r_[0, np.diff(rs)][same]
        d = d[d > 0]                                   # an expert twice in one token's top-k cannot happen
        counts[-1] += int((~same).sum())
        counts[:-1] += np.bincount(np.searchsorted(edges, d, side="left"), minlength=len(labels) - 1)
    return {lab: float(c / counts.sum()) for lab, c in zip(labels, counts)}


def next_token_overlap(trace: Trace) -> list[float]:
    """Per MoE layer: mean over tokens (with a previous token in the same segment) of |S_t & S_t-1| / k."""
    T, L, k = trace.ids.shape
    if T < 2:
        return [0.0] * L
    pair = trace.segment[1:] == trace.segment[:-1]
    if not pair.any():
        return [0.0] * L
    out = []
    for layer in range(L):
        a, b = trace.ids[1:, layer, :], trace.ids[:-1, layer, :]
        shared = (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)     # (T-1,)
        out.append(float(shared[pair].mean() / k))
    return out


def trace_stats(trace: Trace, phase: str | None = None) -> TraceStats:
    t = trace.select(phase=phase) if phase is not None else trace
    T, L, k = t.ids.shape
    pop = np.zeros((L, trace.n_expert), dtype=np.int64)
    for layer in range(L):
        pop[layer] = np.bincount(t.ids[:, layer, :].ravel().astype(np.int64), minlength=trace.n_expert)
    return TraceStats(T, trace.n_expert, k, [cover(p) for p in pop], [entropy(p) for p in pop],
                      next_token_overlap(t), reuse_histogram(t), pop)


def stats_by_phase(trace: Trace) -> dict[str, TraceStats]:
    """"all" plus each phase the trace has."""
    out = {"all": trace_stats(trace)}
    for p in sorted(set(trace.phase.tolist())):
        out[PHASES[p]] = trace_stats(trace, PHASES[p])
    return out
