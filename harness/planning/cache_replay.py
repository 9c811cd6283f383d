"""Replay a routing trace (engines.routing) through device expert caches (engines.cache_policies) for a VRAM budget,
with two bounds on every answer: Belady (optimal replacement) and the best static set in hindsight.

A request = one forward pass (step) x one host MoE layer: the distinct experts its tokens route to. What a step
costs, per host layer (upstream llama.cpp's semantics):
- small steps (fewer than BIG_BATCH tokens: decode, short ubatches) go through Policy.request: hits run on the
  device from the cache, admitted misses are uploaded over the link, bypassed misses (no cache, pinned sets, the
  upload cap, the CPU share) run on the CPU from host RAM;
- large steps (prefill ubatches of >= BIG_BATCH tokens) read the experts the cache holds (Policy.lookup) and upload
  the union of the others into a transient buffer, with no change of the cache.
So policy "none" is stock llama.cpp: decode reads the host experts on the CPU, a large ubatch uploads its union.

Folds: the steps are split at the middle of the trace (in tokens) into two halves. Static-by-frequency pins the
top-C experts (by token selections) of one half and is scored on the other (both ways: every step is scored);
the static oracle pins the top-C of the scored half itself. Belady replays each half from the best possible
initial contents (a free reload at the fold boundary, which bounds the static sets as well as every online policy,
whatever their state there). Dynamic policies run once over the whole trace, cold.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from engines.errors import UserError
from engines.cache_policies import make_policy
from engines.routing import PHASES, Trace

BIG_BATCH = 32          # llama.cpp: GGML_OP_OFFLOAD_MIN_BATCH and the MoE cache's max_batch
MiB = 1 << 20


@dataclass
class Steps:
    """The requests of a trace's host layers (S steps, H host layers), precomputed once for every replay."""
    phase: np.ndarray            # (S,) 0 prefill, 1 decode
    n_tokens: np.ndarray         # (S,) tokens of the step
    clock: np.ndarray            # (S,) tokens processed before the step (the policies' clock)
    fold: np.ndarray             # (S,) 0 first half of the trace, 1 second
    experts: list[list[np.ndarray]]    # [S][H] distinct experts, ascending
    counts: list[list[np.ndarray]]     # [S][H] token selections of each
    layers: list[int]            # trace MoE-layer index of each host layer
    expert_bytes: list[int]      # (H,) bytes of one expert of each host layer
    n_expert: int


def host_layers(trace: Trace, n_cpu_moe: int | None) -> list[int]:
    """Indices (into the trace's MoE layers) of the layers whose experts stay in host RAM at depth n_cpu_moe
    (layers 0..N-1 of the model); None = every MoE layer."""
    moe = trace.header["moe_layers"]
    if n_cpu_moe is None:
        return list(range(len(moe)))
    if not 0 <= n_cpu_moe <= trace.header["n_layers"]:
        raise UserError(f"--n-cpu-moe {n_cpu_moe} is outside 0..{trace.header['n_layers']} (the model's layers)")
    return [i for i, layer in enumerate(moe) if layer < n_cpu_moe]


def steps_of(trace: Trace, layers: list[int]) -> Steps:
    phase, n_tok, exps, cnts = [], [], [], []
    for _, ph, rows in trace.steps():
        phase.append(ph)
        n_tok.append(rows.stop - rows.start)
        req = [trace.request(rows, li) for li in layers]
        exps.append([np.asarray(e, dtype=np.int64) for e, _ in req])
        cnts.append([np.asarray(c, dtype=np.int64) for _, c in req])
    n_tok = np.asarray(n_tok, dtype=np.int64)
    clock = np.concatenate([[0], np.cumsum(n_tok)[:-1]]) if len(n_tok) else n_tok
    fold = (clock + n_tok / 2 > n_tok.sum() / 2).astype(np.int64) if len(n_tok) else n_tok
    eb = trace.expert_bytes
    return Steps(np.asarray(phase, dtype=np.int64), n_tok, clock, fold, exps, cnts, list(layers),
                 [eb[i] for i in layers], trace.n_expert)


def capacity_for(budget_bytes: float, steps: Steps, global_pool: bool = False) -> list[int]:
    """Experts per host layer a budget holds: the same count in every layer (C x sum of the layers' expert bytes
    <= budget), or for one global pool slots of the largest expert size, spread over the layers (sum = slots)."""
    H, E = len(steps.layers), steps.n_expert
    if H == 0:
        return []
    if global_pool:
        slots = min(int(budget_bytes // max(steps.expert_bytes)), H * E)
        return [slots // H + (1 if i < slots % H else 0) for i in range(H)]
    return [min(E, int(budget_bytes // sum(steps.expert_bytes)))] * H


@dataclass
class Tally:
    """Counters of one phase: requests = distinct experts over steps x host layers; hits; misses uploaded over the
    link (into the cache or a transient buffer) or computed on the CPU; per host layer too."""
    tokens: int = 0
    requests: np.ndarray = None        # (H,)
    hits: np.ndarray = None
    link: np.ndarray = None            # experts uploaded
    cpu: np.ndarray = None             # experts the CPU computed from host RAM

    @classmethod
    def zeros(cls, H: int) -> "Tally":
        return cls(0, *(np.zeros(H, dtype=np.int64) for _ in range(4)))

    def add(self, other: "Tally") -> None:
        self.tokens += other.tokens
        for k in ("requests", "hits", "link", "cpu"):
            getattr(self, k).__iadd__(getattr(other, k))


@dataclass
class SimResult:
    policy: str
    budget_mib: float
    capacity: list[int]
    global_pool: bool
    tally: dict[str, Tally]            # phase name -> counters
    expert_bytes: list[int]
    options: dict = field(default_factory=dict)

    def summary(self, phase: str | None = None) -> dict:
        """hit rate, link and CPU bytes per token, over one phase or both."""
        t = Tally.zeros(len(self.expert_bytes))
        for ph, x in self.tally.items():
            if phase in (None, ph):
                t.add(x)
        eb = np.asarray(self.expert_bytes, dtype=np.float64)
        req = int(t.requests.sum())
        tok = max(t.tokens, 1)
        return {"hit_rate": float(t.hits.sum() / req) if req else float("nan"),
                "link_bytes_per_token": float((t.link * eb).sum() / tok),
                "cpu_bytes_per_token": float((t.cpu * eb).sum() / tok), "tokens": t.tokens, "requests": req}

    def per_layer(self, phase: str | None = None) -> list[dict]:
        out = []
        for h, eb in enumerate(self.expert_bytes):
            parts = [x for ph, x in self.tally.items() if phase in (None, ph)]
            req = sum(int(x.requests[h]) for x in parts)
            tok = max(sum(x.tokens for x in parts), 1)
            out.append({"hit_rate": sum(int(x.hits[h]) for x in parts) / req if req else float("nan"),
                        "link_bytes_per_token": sum(int(x.link[h]) for x in parts) * eb / tok,
                        "cpu_bytes_per_token": sum(int(x.cpu[h]) for x in parts) * eb / tok})
        return out


def _new_tally(steps: Steps) -> dict[str, Tally]:
    return {PHASES[p]: Tally.zeros(len(steps.layers)) for p in sorted(set(steps.phase.tolist()))}


def replay(steps: Steps, policy, select=None, tally: dict[str, Tally] | None = None,
           big_batch: float = BIG_BATCH) -> dict[str, Tally]:
    """Feed the steps (those with select[s] true, default all) through one engines.cache_policies policy; steps of
    >= big_batch tokens only read the cache (see the module doc)."""
    tally = tally or _new_tally(steps)
    for s in range(len(steps.phase)):
        if select is not None and not select[s]:
            continue
        t = tally[PHASES[steps.phase[s]]]
        t.tokens += int(steps.n_tokens[s])
        big = steps.n_tokens[s] >= big_batch
        for h in range(len(steps.layers)):
            e = steps.experts[s][h]
            if big:
                n_hit = sum(policy.lookup(h, e))
                t.link[h] += len(e) - n_hit
            else:
                before = policy.uploads
                n_hit = sum(policy.request(h, e, steps.counts[s][h], int(steps.clock[s])))
                t.link[h] += policy.uploads - before
                t.cpu[h] += len(e) - n_hit - (policy.uploads - before)
            t.requests[h] += len(e)
            t.hits[h] += n_hit
    return tally


def frequency(steps: Steps, fold: int, by: str = "selections") -> np.ndarray:
    """(H, E) how often each expert was used in one fold: token selections (what a profile records) or requests
    (steps that route to it: what a hit is scored on)."""
    out = np.zeros((len(steps.layers), steps.n_expert), dtype=np.int64)
    for s in np.flatnonzero(steps.fold == fold):
        for h in range(len(steps.layers)):
            np.add.at(out[h], steps.experts[s][h], steps.counts[s][h] if by == "selections" else 1)
    return out


def top_sets(freq: np.ndarray, capacity: list[int], global_pool: bool) -> list[list[int]]:
    """The C most used experts per layer (ties: lower id), or the sum(C) most used (layer, expert) overall."""
    H, E = freq.shape
    if global_pool:
        order = np.lexsort((np.arange(H * E), -freq.ravel()))[:sum(capacity)]
        return [sorted(int(i % E) for i in order if i // E == h) for h in range(H)]
    return [sorted(np.lexsort((np.arange(E), -freq[h]))[:c].tolist()) for h, c in enumerate(capacity)]


def simulate(steps: Steps, name: str, budget_mib: float, *, global_pool: bool = False, upload_cap: int | None = None,
             cpu_share: float = 0.0, big_batch: float = BIG_BATCH) -> SimResult:
    """One policy at one budget: "none", "static" (by frequency, cross-fold), "lru", "lfu", "classlru"."""
    cap = capacity_for(budget_mib * MiB, steps, global_pool)
    opts = dict(global_pool=global_pool, upload_cap=upload_cap, cpu_share=cpu_share)
    if name == "static":
        tally = _new_tally(steps)
        for fold in (0, 1):
            sets = top_sets(frequency(steps, 1 - fold), cap, global_pool)
            replay(steps, make_policy("static", cap, static_sets=sets, **opts), steps.fold == fold, tally, big_batch)
    else:
        tally = replay(steps, make_policy(name, cap, **opts), big_batch=big_batch)
    return SimResult(name, budget_mib, cap, global_pool, tally, steps.expert_bytes,
                     {"upload_cap": upload_cap, "cpu_share": cpu_share})


def static_oracle(steps: Steps, budget_mib: float, global_pool: bool = False) -> SimResult:
    """Upper bound for pinned sets: each fold scored with the top-C of its own requests."""
    cap = capacity_for(budget_mib * MiB, steps, global_pool)
    tally = _new_tally(steps)
    for fold in (0, 1):
        sets = top_sets(frequency(steps, fold, by="requests"), cap, global_pool)
        replay(steps, make_policy("static", cap, static_sets=sets, global_pool=global_pool), steps.fold == fold,
               tally)
    return SimResult("static-oracle", budget_mib, cap, global_pool, tally, steps.expert_bytes)


def belady(steps: Steps, budget_mib: float, global_pool: bool = False) -> SimResult:
    """Optimal replacement with bypass (Belady's MIN) per pool, each fold from the best initial contents. Counts
    hits only: its misses are reported as if uploaded (it admits whenever that helps)."""
    cap = capacity_for(budget_mib * MiB, steps, global_pool)
    H = len(steps.layers)
    tally = _new_tally(steps)
    for s in range(len(steps.phase)):
        t = tally[PHASES[steps.phase[s]]]
        t.tokens += int(steps.n_tokens[s])
        for h in range(H):
            t.requests[h] += len(steps.experts[s][h])
    pools = [list(range(H))] if global_pool else [[h] for h in range(H)]
    for pool in pools:
        c = sum(cap[h] for h in pool)
        for fold in (0, 1):
            acc = [(s, h, int(e)) for s in np.flatnonzero(steps.fold == fold) for h in pool
                   for e in steps.experts[s][h]]
            for (s, h, _), hit in zip(acc, _min_hits([(h, e) for _, h, e in acc], c)):
                if hit:
                    tally[PHASES[steps.phase[s]]].hits[h] += 1
    for t in tally.values():
        t.link = t.requests - t.hits
    return SimResult("belady", budget_mib, cap, global_pool, tally, steps.expert_bytes)


def _min_hits(keys: list, capacity: int) -> list[bool]:
    """Belady's MIN with bypass on a sequence of keys, starting from the best contents (the `capacity` keys used
    first): on a miss, keep the key used again soonest among the residents and the newcomer."""
    n = len(keys)
    nxt, last = [n] * n, {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(keys[i], n)
        last[keys[i]] = i
    if capacity <= 0:
        return [False] * n
    first = sorted(last.items(), key=lambda kv: kv[1])[:capacity]     # last now holds each key's first use
    resident = {k: i for k, i in first}              # key -> its next use
    heap = [(-i, k) for k, i in first]               # max-heap of next use (lazy: stale entries skipped)
    heapq.heapify(heap)
    hits = []
    for i, k in enumerate(keys):
        if k in resident:
            hits.append(True)
            resident[k] = nxt[i]
            heapq.heappush(heap, (-nxt[i], k))
            continue
        hits.append(False)
        if nxt[i] >= n:
            continue                                 # never used again: bypass
        if len(resident) < capacity:
            resident[k] = nxt[i]
            heapq.heappush(heap, (-nxt[i], k))
            continue
        while heap and resident.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)                      # stale
        far, victim = -heap[0][0], heap[0][1]
        if far > nxt[i]:
            heapq.heappop(heap)
            del resident[victim]
            resident[k] = nxt[i]
            heapq.heappush(heap, (-nxt[i], k))
    return hits
