"""The reference engine's own device cache of offloaded experts (engine settings cache_mib, cache_policy,
cache_static_trace): a number of expert slots on the accelerator for each layer whose experts live in host RAM.

Which experts the slots hold is decided by engines.cache_policies (the policies the planner simulates), fed the same
requests the planner replays from a routing trace: per forward pass and offloaded MoE layer, the distinct experts
its tokens route to (ascending), their selection counts and the token clock (tokens of the run's earlier passes).
So the counted hits, misses and uploads equal the simulated ones on the same trace by construction.

An expert the policy holds after the request (a hit, or a miss it admitted: its stored bytes were copied into a
free slot, an "upload") computes from its slot; a miss it did not admit (static sets, or more distinct experts than
slots) computes from host RAM. On a CPU-only host the "device" is host memory: the slots and copies are real, so the
logic runs and its counters can be checked, and the result is bit-identical to the cache off (the kernels sum each
token's experts in routing order, whichever stack holds them). Each run starts cold: reset() empties the slots
(static sets stay pinned), so every repetition of a workload sees what the trace of its first run replays.

The budget (cache_mib) is split over the offloaded layers by bytes: every layer gets the same share of its experts,
capacity_l = floor(budget * E_l / sum over offloaded layers of E_j * expert_bytes_j).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engines.errors import UserError
from engines.cache_policies import make_policy
from engines.reference.offload import ExpertStack
from engines.reference.qtensor import QTensor

PHASES = ("prefill", "decode")
COUNTERS = ("hits", "misses", "uploads", "upload_bytes")


def capacities(stacks: list[ExpertStack], budget: int) -> list[int]:
    """Experts per layer a budget of bytes holds, split over the layers by bytes (module doc)."""
    total = sum(s.gate.shape[0] * s.expert_bytes for s in stacks)
    return [min(s.gate.shape[0], budget * s.gate.shape[0] // total) if total else 0 for s in stacks]


def static_sets(ids_per_layer: list, capacity: list[int], n_expert: int) -> list[list[int]]:
    """The C_l most selected experts of each layer (ties: the lower id), ascending; ids_per_layer[l]: every id the
    trace routed to in layer l (any shape, numpy)."""
    import numpy as np
    out = []
    for ids, c in zip(ids_per_layer, capacity):
        counts = np.bincount(np.asarray(ids).ravel().astype(np.int64), minlength=n_expert)
        out.append(sorted(int(e) for e in np.argsort(-counts, kind="stable")[:c] if counts[e] > 0))
    return out


@dataclass
class Plan:
    """Where a request's experts compute: used (u,) ascending expert ids, on_device (u,) bool, slot (u,) the slot
    of each on-device expert (-1 otherwise)."""
    used: torch.Tensor
    on_device: list[bool]
    slot: list[int]


@dataclass
class ExpertCache:
    stacks: list[ExpertStack]            # the offloaded MoE layers' stacks, in layer order (cache layer j)
    budget: int                          # bytes
    policy: str
    device: torch.device
    static: list[list[int]] | None = None
    capacity: list[int] = field(init=False)
    counters: dict[str, dict[str, int]] = field(init=False)

    def __post_init__(self):
        self.capacity = capacities(self.stacks, self.budget)
        if not any(self.capacity):
            total = sum(s.gate.shape[0] * s.expert_bytes for s in self.stacks)
            need = total / max(s.gate.shape[0] for s in self.stacks)
            raise UserError(f"cache_mib {self.budget >> 20} holds no expert (split over the offloaded layers by bytes, "
                            f"one expert a layer takes {need / 2 ** 20:.1f} MiB); raise --cache-mib or leave it 0.")
        # per layer, per matrix (gate, up, down): capacity slots of that matrix's stored bytes
        self.slots = [[torch.empty(c * m.matrix_bytes, dtype=torch.uint8, device=self.device) for m in s.matrices]
                      for s, c in zip(self.stacks, self.capacity)]
        self.counters = {p: dict.fromkeys(COUNTERS, 0) for p in PHASES}
        self.preload_bytes = 0
        self.reset()

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() for layer in self.slots for t in layer)

    def reset(self) -> None:
        """An empty cache (static: its pinned sets, copied in once at the first reset) and the token clock at 0."""
        self.pol = make_policy(self.policy, self.capacity, static_sets=self.static)
        if self.policy != "static" or not hasattr(self, "where"):
            self.where: list[dict[int, int]] = [{} for _ in self.stacks]     # expert -> slot, per layer
            for j, pinned in enumerate(self.static or []):
                for e in pinned:
                    self._upload(j, e, self._free_slot(j))
                    self.preload_bytes += self.stacks[j].expert_bytes
        self.t, self._last_n = 0, 0

    def begin_pass(self, n: int) -> None:
        """A forward pass of n tokens starts: the clock moves past the previous one."""
        self.t += self._last_n
        self._last_n = n

    def request(self, j: int, ids: torch.Tensor, phase: int) -> Plan:
        """Layer j's request for routed ids (n, k): ask the policy, copy admitted experts into free slots."""
        used, counts = torch.unique(ids.cpu(), return_counts=True)
        experts = used.tolist()
        p, before = self.pol, (self.pol.hits, self.pol.misses, self.pol.uploads)
        self.pol.request(j, experts, counts.tolist(), self.t)
        c = self.counters[PHASES[phase]]
        uploads = p.uploads - before[2]
        c["hits"] += p.hits - before[0]
        c["misses"] += p.misses - before[1]
        c["uploads"] += uploads
        c["upload_bytes"] += uploads * self.stacks[j].expert_bytes
        if uploads:                                  # a policy evicts only to admit
            held, where = set(self.pol.resident(j)), self.where[j]
            for e in [e for e in where if e not in held]:             # evicted by this request
                del where[e]
            for e in experts:
                if e in held and e not in where:                      # admitted by this request
                    self._upload(j, e, self._free_slot(j))
        where = self.where[j]
        return Plan(used, [e in where for e in experts], [where.get(e, -1) for e in experts])

    def stack(self, j: int, experts: list[int] | None = None) -> ExpertStack:
        """Layer j's slots as an expert stack of `capacity` experts (biases gathered by slot); experts: the
        expert each slot holds (default: the current map)."""
        s, C = self.stacks[j], self.capacity[j]
        if experts is None:
            experts = [0] * C
            for e, slot in self.where[j].items():
                experts[slot] = e
        mats = iter(QTensor(buf, m.type, (C, *m.shape[1:]), m.layout) for m, buf in zip(s.matrices, self.slots[j]))
        mats = [None if m is None else next(mats) for m in (s.gate, s.up, s.down)]
        idx = torch.tensor(experts, dtype=torch.long)
        b = [None if t is None else t[idx.to(t.device)].to(self.device) for t in s.biases()]
        return replace(s, gate=mats[0], up=mats[1], down=mats[2], gate_b=b[0], up_b=b[1], down_b=b[2], scale=None,
                       on_host=False)

    def gathered(self, j: int, plan: Plan) -> ExpertStack:
        """CPU-only host: every used expert of a mixed request copied into one stack of len(used) experts, in
        ascending order (from its slot or from host RAM), so the kernels compute the request in one call."""
        s = self.stacks[j]
        bufs = []
        for m, slots in zip(s.matrices, self.slots[j]):
            mb, out = m.matrix_bytes, torch.empty(len(plan.slot) * m.matrix_bytes, dtype=torch.uint8)
            for i, (e, slot) in enumerate(zip(plan.used.tolist(), plan.slot)):
                src = slots[slot * mb:(slot + 1) * mb] if slot >= 0 else m.raw[e * mb:(e + 1) * mb]
                out[i * mb:(i + 1) * mb] = src
            bufs.append(QTensor(out, m.type, (len(plan.slot), *m.shape[1:]), m.layout))
        mats = iter(bufs)
        mats = [None if m is None else next(mats) for m in (s.gate, s.up, s.down)]
        b = [None if t is None else t[plan.used.to(t.device)] for t in s.biases()]
        return replace(s, gate=mats[0], up=mats[1], down=mats[2], gate_b=b[0], up_b=b[1], down_b=b[2], scale=None,
                       on_host=False)

    def to_dict(self) -> dict:
        """Counters per phase (cache_hits_prefill, ...) and the cache's shape, for info()."""
        out = {f"cache_{k}_{p}": v for p, c in self.counters.items() for k, v in c.items()}
        return out | {"cache_capacity": list(self.capacity), "cache_slot_bytes": self.slot_bytes,
                      "cache_preload_bytes": self.preload_bytes}

    def _free_slot(self, j: int) -> int:
        taken = set(self.where[j].values())
        return next(i for i in range(self.capacity[j]) if i not in taken)

    def _upload(self, j: int, e: int, slot: int) -> None:
        s = self.stacks[j]
        for m, buf in zip(s.matrices, self.slots[j]):
            mb = m.matrix_bytes
            buf[slot * mb:(slot + 1) * mb].copy_(m.raw[e * mb:(e + 1) * mb], non_blocking=True)
        self.where[j][e] = slot
