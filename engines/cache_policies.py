"""Device expert-cache policies, shared by the planner's simulator (harness/planning/cache_replay.py) and the
reference engine's own cache, so simulated and counted hits agree by construction when both feed the same
requests. Torch-free engine leaf: stdlib only.

A request = one forward pass (step) x one MoE layer: the distinct experts its tokens route to (ascending) and how
many token-selections each got. The answer is a hit flag per expert, from the cache contents *before* the request.
Then misses are admitted (uploaded) or bypassed (computed on the CPU from host RAM):
- an admission never evicts an expert of the same request (upstream's "not in the current plan"), so the hits of
  any policy here equal those of a sequential policy with bypass, and Belady-with-bypass bounds them all;
- `upload_cap`: at most that many admissions per request (layer x step); the rest run on the CPU;
- `cpu_share` F (upstream --moe-cache-cpu-share): once the pool is full, a share F of the misses runs on the CPU
  instead of being uploaded (spread evenly with a carried remainder, so exactly F of them over a run).

Policies (POLICIES):
- none: no cache, every expert is a miss and none is uploaded (stock llama.cpp decode: host experts on the CPU).
- static: pinned sets per layer (e.g. the hottest experts of a profile); never changes, misses run on the CPU.
- lru: least recently used; per layer, or one pool over all layers (global_pool=True).
- lfu: least frequently used (token-selections since the start, kept across evictions), ties by recency.
- classlru: upstream llama.cpp's ClassLRU (src/llama-moe-cache.cpp, #31233): every (layer, expert) has a CRF =
  its uses decayed with a half-life of 128 tokens, kept across evictions; class = min(floor(log2 CRF), 7), one LRU
  list per class, a slot sits in the list of its class as of its last use; the victim is an empty slot, else among
  the least recently used slot of each class list the one with the largest age / 2**class.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.errors import UserError

POLICIES = ("none", "static", "lru", "lfu", "classlru")
CRF_HALF_LIFE = 128.0        # tokens (upstream crf_half_life)
N_CLASS = 8                  # floor(log2(1 / (1 - 2**(-1/128)))) = 7 is the class of the largest CRF, so 8 classes

Key = tuple[int, int]        # (MoE layer, expert)


@dataclass
class _Pool:
    """The slots of one cache pool (one layer's, or the global one)."""
    capacity: int
    index: int                                                     # 0..n_pools-1
    resident: OrderedDict = field(default_factory=OrderedDict)   # Key -> None, least recently used first
    full_once: bool = False                                        # upstream: the CPU share starts once it is full


class Policy:
    """Base: the request protocol, counters, pools, upload cap and CPU share; subclasses pick victims."""
    admits = True                # False: nothing is ever uploaded (none, static)

    def __init__(self, name: str, capacity: list[int], *, global_pool: bool = False, upload_cap: int | None = None,
                 cpu_share: float = 0.0):
        if any(c < 0 for c in capacity):
            raise UserError(f"expert-cache capacity must be >= 0 experts per layer, got {capacity}; pass a budget "
                            "that is not negative")
        if upload_cap is not None and upload_cap < 0:
            raise UserError(f"--upload-cap must be >= 0, got {upload_cap}")
        if not 0.0 <= cpu_share <= 1.0:
            raise UserError(f"--cpu-share must be within 0..1, got {cpu_share}")
        self.name = name
        self.n_layers = len(capacity)
        self.global_pool = global_pool
        self.upload_cap = upload_cap
        self.cpu_share = cpu_share
        self.pools = [_Pool(sum(capacity), 0)] if global_pool else [_Pool(c, i) for i, c in enumerate(capacity)]
        self.hits = self.misses = self.uploads = 0
        self._credit = 0.0            # carried share of misses owed to the CPU

    # -- protocol -------------------------------------------------------------------------------------------------
    def request(self, layer: int, experts: Sequence[int], counts: Sequence[int], t: int) -> list[bool]:
        """Hit flag per expert (same order); then touch the hits and admit misses as the policy allows.
        `t` = token clock (tokens processed so far), used by the decayed counts of classlru."""
        pool = self._pool(layer)
        keys = [(layer, int(e)) for e in experts]
        hit = [k in pool.resident for k in keys]
        current = set(keys)
        for k, h, n in zip(keys, hit, counts):
            self._use(k, int(n), t, h)
        admitted = 0
        for k, h in zip(keys, hit):
            if h:
                continue
            if not self.admits or pool.capacity == 0:
                break
            if self.upload_cap is not None and admitted >= self.upload_cap:
                break
            victim = None
            if len(pool.resident) >= pool.capacity:
                victim = self._victim(pool, current, t)
                if victim is None:       # every slot holds an expert of this request: bypass
                    continue
            if self._to_cpu(pool):
                continue
            if victim is not None:
                self._evict(pool, victim)
            self._admit(pool, k, t)
            admitted += 1
            if len(pool.resident) >= pool.capacity:
                pool.full_once = True
        n_hit = sum(hit)
        self.hits += n_hit
        self.misses += len(hit) - n_hit
        self.uploads += admitted
        return hit

    def lookup(self, layer: int, experts: Sequence[int]) -> list[bool]:
        """Which experts are resident, with no change of state or counters (large batches read the cache but
        upload the rest into a transient buffer, as upstream does for ubatches above its small-batch limit)."""
        pool = self._pool(layer)
        return [(layer, int(e)) in pool.resident for e in experts]

    def resident(self, layer: int) -> list[int]:
        """Experts of `layer` in the cache, ascending."""
        return sorted(e for (ly, e) in self._pool(layer).resident if ly == layer)

    def occupancy(self) -> list[int]:
        """Experts held per pool (one entry per layer, or one for the global pool)."""
        return [len(p.resident) for p in self.pools]

    def capacities(self) -> list[int]:
        return [p.capacity for p in self.pools]

    # -- shared mechanics ----------------------------------------------------------------------------------------
    def _pool(self, layer: int) -> _Pool:
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} outside 0..{self.n_layers - 1}")
        return self.pools[0] if self.global_pool else self.pools[layer]

    def _to_cpu(self, pool: _Pool) -> bool:
        if self.cpu_share <= 0.0 or not pool.full_once:
            return False
        self._credit += self.cpu_share
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False

    def _evict(self, pool: _Pool, key: Key) -> None:
        del pool.resident[key]

    def _admit(self, pool: _Pool, key: Key, t: int) -> None:
        pool.resident[key] = None

    # -- per policy ------------------------------------------------------------------------------------------------
    def _use(self, key: Key, n: int, t: int, hit: bool) -> None:
        """Record a use (hit or miss) before admissions."""

    def _victim(self, pool: _Pool, current: set[Key], t: int) -> Key | None:
        return None


class NoCache(Policy):
    admits = False


class Static(Policy):
    """Pinned sets: resident from the start (loaded with the model), never replaced."""
    admits = False

    def __init__(self, name: str, capacity: list[int], static_sets: list[list[int]], **kw):
        super().__init__(name, capacity, **kw)
        if len(static_sets) != self.n_layers:
            raise UserError(f"static sets given for {len(static_sets)} layers, the cache has {self.n_layers}")
        for layer, s in enumerate(static_sets):
            pool = self._pool(layer)
            for e in sorted(set(int(x) for x in s)):
                if len(pool.resident) >= pool.capacity:
                    raise UserError(f"the static set of layer {layer} has more experts than its {pool.capacity} "
                                    "slots; pin fewer experts or give the cache more memory")
                pool.resident[(layer, e)] = None



class LRU(Policy):
    def _use(self, key: Key, n: int, t: int, hit: bool) -> None:
        if hit:
            self._pool(key[0]).resident.move_to_end(key)

    def _victim(self, pool: _Pool, current: set[Key], t: int) -> Key | None:
        return next((k for k in pool.resident if k not in current), None)


class LFU(Policy):
    """Counts token-selections of every key since the start (kept across evictions); evicts the resident expert
    with the fewest, the least recently used among equals."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.freq: dict[Key, int] = {}

    def _use(self, key: Key, n: int, t: int, hit: bool) -> None:
        self.freq[key] = self.freq.get(key, 0) + n
        if hit:
            self._pool(key[0]).resident.move_to_end(key)

    def _victim(self, pool: _Pool, current: set[Key], t: int) -> Key | None:
        best, best_f = None, None
        for k in pool.resident:              # least recently used first: the first minimum wins ties
            if k in current:
                continue
            f = self.freq.get(k, 0)
            if best_f is None or f < best_f:
                best, best_f = k, f
        return best


class ClassLRU(Policy):
    """Upstream's ClassLRU (see the module docstring). Class lists are OrderedDicts, least recently used first."""

    def __init__(self, *a, half_life: float = CRF_HALF_LIFE, n_class: int = N_CLASS, **kw):
        super().__init__(*a, **kw)
        self.half_life = half_life
        self.n_class = n_class
        self.crf: dict[Key, float] = {}
        self.last_use: dict[Key, int] = {}
        self.cls: dict[Key, int] = {}
        self.lists = [[OrderedDict() for _ in range(n_class)] for _ in self.pools]

    def decayed_crf(self, key: Key, t: int) -> float:
        """The CRF of `key` as of clock t (before any use at t)."""
        if key not in self.crf:
            return 0.0
        return self.crf[key] * 2.0 ** (-(t - self.last_use[key]) / self.half_life)

    def class_of(self, crf: float) -> int:
        return 0 if crf < 1.0 else min(int(math.floor(math.log2(crf))), self.n_class - 1)

    def _lists(self, layer: int) -> list[OrderedDict]:
        return self.lists[0] if self.global_pool else self.lists[layer]

    def _use(self, key: Key, n: int, t: int, hit: bool) -> None:
        self.crf[key] = self.decayed_crf(key, t) + n
        self.last_use[key] = t
        c = self.class_of(self.crf[key])
        if hit:                          # move the slot to the MRU end of its (new) class list
            lists = self._lists(key[0])
            del lists[self.cls[key]][key]
            lists[c][key] = None
            self._pool(key[0]).resident.move_to_end(key)
        self.cls[key] = c

    def _admit(self, pool: _Pool, key: Key, t: int) -> None:
        super()._admit(pool, key, t)
        self._lists(key[0])[self.cls[key]][key] = None

    def _evict(self, pool: _Pool, key: Key) -> None:
        super()._evict(pool, key)
        del self._lists(key[0])[self.cls[key]][key]

    def _victim(self, pool: _Pool, current: set[Key], t: int) -> Key | None:
        lists = self.lists[pool.index]
        best, best_score = None, -1.0
        for c, lst in enumerate(lists):
            k = next((k for k in lst if k not in current), None)
            if k is None:
                continue
            score = (t - self.last_use[k]) / 2.0 ** c
            if score > best_score:       # strict: among equal scores the lower class goes first
                best, best_score = k, score
        return best


def make_policy(name: str, capacity: list[int], *, global_pool: bool = False,
                static_sets: list[list[int]] | None = None, upload_cap: int | None = None, **kw) -> Policy:
    """A fresh cache. `capacity` = experts per MoE layer (global_pool=True: their sum, shared by all layers);
    `static` needs `static_sets` (experts pinned per layer); kw: cpu_share, and half_life for classlru."""
    common = dict(global_pool=global_pool, upload_cap=upload_cap, cpu_share=kw.pop("cpu_share", 0.0))
    if name == "none":
        return NoCache(name, [0] * len(capacity), **common)
    if name == "static":
        if static_sets is None:
            raise UserError("the static policy needs the experts to pin per layer (static_sets)")
        return Static(name, capacity, static_sets, **common)
    if name == "lru":
        return LRU(name, capacity, **common)
    if name == "lfu":
        return LFU(name, capacity, **common)
    if name == "classlru":
        return ClassLRU(name, capacity, **common, **kw)
    raise UserError(f"unknown expert-cache policy {name!r}; pick one of {', '.join(POLICIES)}")
