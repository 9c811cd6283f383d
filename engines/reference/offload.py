"""Routed-expert placement (`--n-cpu-moe N`) and the executor that runs a layer's experts.

Placement: the stacked expert tensors of layers 0..N-1 live in host RAM (page-locked when CUDA is
present); all other layers' experts live on the accelerator. Each layer's experts are computed by
grouping tokens per expert: sort the (token, slot) pairs by expert id, one matmul chain per used
expert, weighted index_add back. Weights are never gathered per token.

Paths for an offloaded layer (TensorSharp's scheme):
  host    batch < stream_min_batch (decode, small batches): the experts run on the CPU where they
          live, with a capped thread count (host_threads); activations travel, weights do not.
  stream  larger batches: only the experts the batch routes to are copied into a reused staging
          buffer on the accelerator (non_blocking from pinned memory, on a side stream) and run there.
          Prefetch (CUDA only): the next offloaded layer's routing is unknown until its router runs,
          so while layer i computes, the whole expert set of layer i+1 is copied into the second
          staging buffer. This is sound because a stream-path batch routes n*k >= 128*k (token,
          expert) pairs, and the chance that an expert stays unused, (1 - k/E)^n, is negligible
          (qwen3-30b: (1-8/128)^128 ~ 3e-4): the prefetch copies what the routed set would be anyway.
Without CUDA both paths run on the CPU (the staging buffer is a CPU tensor), so each can be forced
(path="host"|"stream") and checked to give the same output as the other.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

PATHS = ("auto", "host", "stream")


@dataclass(frozen=True)
class OffloadConfig:
    n_cpu_moe: int              # layers 0..n_cpu_moe-1 keep their routed experts in host RAM
    path: str = "auto"          # auto | host | stream (forces the path of offloaded layers)
    stream_min_batch: int = 128  # auto: batches of at least this many tokens take the stream path
    host_threads: int = 1       # CPU threads for host-path expert matmuls (engine.py picks the default)
    threads: int = 1            # threads for everything else


@dataclass
class ExpertLayer:
    gate_up: torch.Tensor       # (E, 2*ff, D) gate rows then up rows: one matmul per expert
    down: torch.Tensor          # (E, D, ff)
    on_host: bool

    def __post_init__(self):
        self.experts = expert_views(self.gate_up, self.down)


@dataclass
class Counters:
    calls: dict[str, int] = field(default_factory=lambda: {"resident": 0, "host": 0, "stream": 0})
    streamed_experts: int = 0
    streamed_bytes: int = 0
    prefetched_layers: int = 0

    def to_dict(self) -> dict:
        return {f"moe_calls_{k}": v for k, v in self.calls.items()} | {
            "streamed_experts": self.streamed_experts, "streamed_bytes": self.streamed_bytes,
            "prefetched_layers": self.prefetched_layers}


def expert_views(gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-expert transposed views [(gate_up_e.T (D, 2*ff), down_e.T (ff, D))] of stacks (E, 2*ff, D) and
    (E, D, ff), made once: x @ view is what F.linear runs, minus the per-call indexing and transposes
    (single-token decode is bound by per-op overhead)."""
    return [(gu.t(), dn.t()) for gu, dn in zip(gate_up.unbind(0), down.unbind(0))]


def expert_ffn(x: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """x: (c, D); gate_up_t: (D, 2*ff); down_t: (ff, D) -> (c, D): down(silu(gate x) * up x)."""
    g, u = (x @ gate_up_t).chunk(2, dim=-1)                      # (c, ff) each
    return (F.silu(g) * u) @ down_t


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    experts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """x: (n, D); ids: (n, k) indices into experts (expert_views); w: (n, k) f32
    -> (n, D) f32 = sum_j w_j * expert_j(x)."""
    n, k = ids.shape
    if n == 1:   # decode: the k routed experts in turn, no sort; one gating op for all k
        used = [experts[e] for e in ids.tolist()[0]]
        g, u = torch.cat([x @ gu for gu, _ in used]).chunk(2, dim=-1)   # (k, ff) each
        act = F.silu(g) * u
        ys = torch.cat([act[j:j + 1] @ dn for j, (_, dn) in enumerate(used)])   # (k, D)
        return w @ ys.float()                                     # (1, D)
    flat = ids.reshape(-1)                                       # (n*k,) expert of each (token, slot)
    order = torch.argsort(flat, stable=True)                     # (n*k,) grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()   # one host sync per layer
    tok = order // k                                             # (n*k,) token of each grouped row
    xs = x[tok]                                                  # (n*k, D) activations, grouped
    ys = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts):
        if c:
            ys[start:start + c] = expert_ffn(xs[start:start + c], *experts[e])
            start += c
    ws = w.reshape(-1)[order, None]                              # (n*k, 1)
    return torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, ys.float() * ws)


@contextmanager
def num_threads(n: int):
    """Temporarily run torch CPU ops with n threads (the host-path cap)."""
    prev = torch.get_num_threads()
    if prev != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if prev != n:
            torch.set_num_threads(prev)


class MoEExecutor:
    """Runs layer il's routed experts for a batch, on the path the placement and batch size select."""

    def __init__(self, layers: list[ExpertLayer], cfg: OffloadConfig, device: torch.device, kernels=None):
        self.layers, self.cfg, self.device = layers, cfg, device
        self.kernels = kernels      # engines.reference.kernels extension (bf16 CPU decode) or None
        self.cuda = device.type == "cuda"
        self.counters = Counters()
        self.staging: list[tuple[torch.Tensor, torch.Tensor]] = []
        if cfg.n_cpu_moe and cfg.path != "host":
            # one staging buffer (two on CUDA, for prefetch) sized to a whole layer's expert stack
            gu, dn = layers[0].gate_up, layers[0].down
            for _ in range(2 if self.cuda else 1):
                self.staging.append((torch.empty(gu.shape, dtype=gu.dtype, device=device),
                                     torch.empty(dn.shape, dtype=dn.dtype, device=device)))
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.buf_free = [None, None]      # event: compute finished reading staging buffer b
        self._prefetched: dict[int, tuple[int, object]] = {}   # layer -> (buffer, copy-done event)
        self._n = 0

        self.staging_views = [expert_views(gu, dn) for gu, dn in self.staging]

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.staging for t in pair)

    def path_for(self, il: int, n: int) -> str:
        if not self.layers[il].on_host:
            return "resident"
        if self.cfg.path != "auto":
            return self.cfg.path
        return "stream" if n >= self.cfg.stream_min_batch else "host"

    def begin_batch(self, n: int) -> None:
        """A new forward pass of n tokens starts: prefetches of the previous one are void."""
        self._n = n
        self._prefetched.clear()

    def __call__(self, il: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x: (n, D) compute dtype on the accelerator; ids, w: (n, k) -> (n, D) f32 on the accelerator."""
        path = self.path_for(il, x.shape[0])
        self.counters.calls[path] += 1
        layer = self.layers[il]
        if self.kernels is not None and x.shape[0] == 1 and path != "stream":   # CPU bf16 decode: one call
            with num_threads(self.cfg.host_threads if path == "host" else self.cfg.threads):
                return self.kernels.moe_decode(x, layer.gate_up, layer.down, ids, w)
        if path == "resident":
            return grouped_experts(x, ids, w, layer.experts)
        if path == "host":
            with num_threads(self.cfg.host_threads):
                y = grouped_experts(x.cpu(), ids.cpu(), w.cpu(), layer.experts)
            return y.to(self.device, non_blocking=True)
        return self._stream(il, x, ids, w)

    # --- stream path ----------------------------------------------------------------------------

    def _copy_experts(self, il: int, b: int, experts: list[int]) -> None:
        """Copy the listed experts of layer il into slots 0..m-1 of staging buffer b."""
        src, (gu, dn) = self.layers[il], self.staging[b]
        for slot, e in enumerate(experts):
            gu[slot].copy_(src.gate_up[e], non_blocking=True)
            dn[slot].copy_(src.down[e], non_blocking=True)
        per_expert = gu[0].numel() * gu.element_size() + dn[0].numel() * dn.element_size()
        self.counters.streamed_experts += len(experts)
        self.counters.streamed_bytes += len(experts) * per_expert

    def _stream(self, il: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        E = self.layers[il].gate_up.shape[0]
        if il in self._prefetched:                    # whole layer already in buffer b, slot == expert
            b, done = self._prefetched.pop(il)
            torch.cuda.current_stream().wait_event(done)
            slot_ids = ids
        else:
            b = il % len(self.staging)
            used = torch.unique(ids).tolist()         # sorted expert ids this batch routes to
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    if self.buf_free[b] is not None:
                        self.copy_stream.wait_event(self.buf_free[b])
                    self._copy_experts(il, b, used)
                    done = torch.cuda.Event()
                    done.record()
                torch.cuda.current_stream().wait_event(done)
            else:
                self._copy_experts(il, b, used)
            lut = torch.full((E,), -1, dtype=torch.long, device=ids.device)
            lut[used] = torch.arange(len(used), device=ids.device)
            slot_ids = lut[ids]                       # (n, k) staging slot of each routed expert
        if self.cuda:
            self._prefetch_next(il, 1 - b)
        y = grouped_experts(x, slot_ids, w, self.staging_views[b])
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.buf_free[b] = ev
        return y

    def _prefetch_next(self, il: int, b: int) -> None:
        """CUDA: copy layer il+1's whole expert set into buffer b while layer il computes (see module doc)."""
        nxt = il + 1
        if nxt >= len(self.layers) or self.path_for(nxt, self._n) != "stream" or nxt in self._prefetched:
            return
        with torch.cuda.stream(self.copy_stream):
            if self.buf_free[b] is not None:
                self.copy_stream.wait_event(self.buf_free[b])
            self._copy_experts(nxt, b, list(range(self.layers[nxt].gate_up.shape[0])))
            done = torch.cuda.Event()
            done.record()
        self._prefetched[nxt] = (b, done)
        self.counters.prefetched_layers += 1
