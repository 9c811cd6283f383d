"""Routed-expert placement (`--n-cpu-moe N`) and the executor that runs a layer's experts.

Placement: the expert stacks of layers 0..N-1 live in host RAM (page-locked when CUDA is present); all
other layers' experts live on the accelerator. Stacks stay as the file stores them (QTensors). A layer's
experts are computed by grouping tokens per expert (on the CPU in one kernel call, kernels.moe_prefill;
on CUDA grouped_experts: one product chain per used expert, weighted index_add back). Weights are never
gathered per token.

Paths for an offloaded layer (TensorSharp's scheme):
  host    batch < stream_min_batch (decode, small batches): the experts run on the CPU where they live,
          with a capped thread count (host_threads); activations travel, weights do not.
  stream  larger batches: only the stored bytes of the experts the batch routes to are copied into a
          reused staging buffer on the accelerator (non_blocking from pinned memory, on a side stream) and
          run there (dequantized per expert into a scratch on CUDA). Prefetch (CUDA only): the next
          offloaded layer's routing is unknown until its router runs, so while layer i computes, the whole
          expert set of layer i+1 is copied into the second staging buffer. This is sound because a
          stream-path batch routes n*k >= 128*k (token, expert) pairs, and the chance that an expert stays
          unused, (1 - k/E)^n, is negligible (qwen3-30b: (1-8/128)^128 ~ 3e-4).
Without CUDA the accelerator is the same RAM, so auto takes the host path at every batch size (a staging
copy would cost time and bytes llama.cpp does not spend); stream can still be forced (path="stream", its
staging buffer a CPU tensor) and checked to give the same output as host.
  cache   with an expert cache (engines.reference.device_cache, engine setting cache_mib): every batch of an offloaded
          layer asks the cache; experts it holds (or admits, copying them into a slot) run from their slots on
          the accelerator, the rest from host RAM as on the host path.

  kt      with KTransformers' experts (engines.reference.kt_experts, engine setting experts=kt): kt-kernel computes
          the offloaded layers' experts (from its own mapping of the file), at every batch size.

Three optional passengers, None unless asked for (one attribute test a call when off): `recorder`, an
engines.routing.TraceRecorder that sees every MoE call's ids and weights (routing traces), `cache` and `kt`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

from engines.reference.qtensor import QTensor

PATHS = ("auto", "host", "stream")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")


@dataclass(frozen=True)
class OffloadConfig:
    n_cpu_moe: int              # layers 0..n_cpu_moe-1 keep their routed experts in host RAM
    path: str = "auto"          # auto | host | stream (forces the path of offloaded layers)
    stream_min_batch: int = 128  # auto, with CUDA: batches of at least this many tokens take the stream path
    host_threads: int = 1       # CPU threads for host-path expert products (engine.py picks the default)
    threads: int = 1            # threads for everything else


def gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU (vec.h, GGML_GELU_FP16): the tanh GELU looked up in an f16 table, x and the result
    rounded to f16, 0 below -10 and x above 10. Matching it matters: its rounding flips near-tied expert
    choices (gemma4, measured ~1 logit at a few positions with the exact GELU)."""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@dataclass(frozen=True)
class Activation:
    """The gated activation of the experts: silu(g) u, ggml's GELU(g) u (gelu above), or gpt-oss's clamped
    SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit), g sigmoid(alpha g) (u + 1)."""
    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return F.silu(g) * u
        if self.name == "gelu":
            return gelu(g) * u
        g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)


@dataclass
class ExpertStack:
    """One layer's routed experts as stored: gate and up (E, ff, D), or up None and gate the fused gate_up
    (E, 2 ff, D) (gate rows first), down (E, D, ff); optional f32 biases (E, ff), (E, ff), (E, D) and a
    per-expert output scale (E,)."""
    gate: QTensor
    up: QTensor | None
    down: QTensor
    gate_b: torch.Tensor | None = None
    up_b: torch.Tensor | None = None
    down_b: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    on_host: bool = False
    # the CPU kernels' checked arguments (kernels.Experts), made on the stack's first CPU call; a stack made
    # by replace() makes its own
    kernel_args: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def matrices(self) -> list[QTensor]:
        return [m for m in (self.gate, self.up, self.down) if m is not None]

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of one expert (all its matrices)."""
        return sum(m.matrix_bytes for m in self.matrices)

    def biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.gate_b, self.up_b, self.down_b


def expert_ffn(linear: Callable, s: ExpertStack, e: int, x: torch.Tensor, act: Activation) -> torch.Tensor:
    """Expert e of stack s on x (c, D) f32 -> (c, D) f32 (bias of down added before any routing weight)."""
    if s.up is None:
        g, u = linear(x, s.gate.expert(e)).chunk(2, dim=-1)             # (c, ff) each
    else:
        g, u = linear(x, s.gate.expert(e)), linear(x, s.up.expert(e))
    if s.gate_b is not None:
        g, u = g + s.gate_b[e], u + s.up_b[e]
    y = linear(act(g, u), s.down.expert(e))                              # (c, D)
    return y if s.down_b is None else y + s.down_b[e]


def grouped_experts(linear: Callable, s: ExpertStack, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    act: Activation) -> torch.Tensor:
    """x: (n, D) f32; ids: (n, k) expert of each slot; w: (n, k) f32 -> (n, D) f32 = sum_j w_j expert_j(x)."""
    n, k = ids.shape
    flat = ids.reshape(-1)                                       # (n*k,) expert of each (token, slot)
    order = torch.argsort(flat, stable=True)                     # (n*k,) grouped by expert
    counts = torch.bincount(flat, minlength=s.gate.shape[0]).tolist()   # one host sync per layer
    tok = order // k                                             # (n*k,) token of each grouped row
    xs = x[tok]                                                  # (n*k, D) activations, grouped
    ys = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts):
        if c:
            ys[start:start + c] = expert_ffn(linear, s, e, xs[start:start + c], act)
            start += c
    ws = w.reshape(-1)[order, None]                              # (n*k, 1)
    return torch.zeros_like(x).index_add_(0, tok, ys * ws)


@dataclass
class Counters:
    calls: dict[str, int] = field(default_factory=lambda: {"resident": 0, "host": 0, "stream": 0, "cache": 0,
                                                           "kt": 0})
    streamed_experts: int = 0
    streamed_bytes: int = 0
    prefetched_layers: int = 0

    def to_dict(self) -> dict:
        return {f"moe_calls_{k}": v for k, v in self.calls.items()} | {
            "streamed_experts": self.streamed_experts, "streamed_bytes": self.streamed_bytes,
            "prefetched_layers": self.prefetched_layers}


@contextmanager
def num_threads(n: int):
    """Temporarily run torch CPU ops (and the kernels' at::parallel_for) with n threads (the host-path cap)."""
    prev = torch.get_num_threads()
    if prev != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if prev != n:
            torch.set_num_threads(prev)


class MoEExecutor:
    """Runs layer il's routed experts for a batch, on the path the placement and batch size select.
    `linear(x, qt)` is the model's product with a stored matrix (engines.reference.models.transformer.Products);
    `kernels` the CPU kernels (their moe_decode and moe_prefill) or None."""

    def __init__(self, layers: list[ExpertStack | None], cfg: OffloadConfig, device: torch.device,
                 linear: Callable, act: Activation, kernels=None):
        self.layers, self.cfg, self.device, self.linear, self.act = layers, cfg, device, linear, act
        self.kernels = kernels
        self.cuda = device.type == "cuda"
        self.counters = Counters()
        self.staging: list[list[torch.Tensor]] = []      # per buffer: one uint8 tensor per stack matrix
        offloaded = [s for s in layers if s is not None and s.on_host]
        if offloaded and (cfg.path == "stream" or cfg.path == "auto" and self.cuda):
            # staging: for each matrix of a stack (gate, up, down) the largest stored size over the offloaded
            # layers (a file type may store ffn_down as Q6_K in some layers, Q4_K in others); two buffers on
            # CUDA, for prefetch
            sizes = [max(s.matrices[j].nbytes for s in offloaded) for j in range(len(offloaded[0].matrices))]
            for _ in range(2 if self.cuda else 1):
                self.staging.append([torch.empty(n, dtype=torch.uint8, device=device) for n in sizes])
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.buf_free = [None, None]      # event: compute finished reading staging buffer b
        self._prefetched: dict[int, tuple[int, object]] = {}   # layer -> (buffer, copy-done event)
        self._n = 0
        self.recorder = None          # engines.routing.TraceRecorder: records every call's routing
        self.moe_index: dict[int, int] = {il: li for li, il in enumerate(i for i, s in enumerate(layers) if s)}
        self.cache = None             # engines.reference.device_cache.ExpertCache over the offloaded layers
        self.phase = 0                # 0 prefill, 1 decode: what the engine is running (the cache counts per phase)
        self.kt = None                # engines.reference.kt_experts.KTExperts: computes the offloaded layers' experts

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() for buf in self.staging for t in buf)

    def path_for(self, il: int, n: int) -> str:
        if not self.layers[il].on_host:
            return "resident"
        if self.kt is not None:
            return "kt"
        if self.cache is not None:
            return "cache"
        if self.cfg.path != "auto":
            return self.cfg.path
        return "stream" if self.cuda and n >= self.cfg.stream_min_batch else "host"

    def begin_batch(self, n: int) -> None:
        """A new forward pass of n tokens starts: prefetches of the previous one are void."""
        self._n = n
        self._prefetched.clear()
        if self.recorder is not None:
            self.recorder.step(n)
        if self.cache is not None:
            self.cache.begin_pass(n)

    def __call__(self, il: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x: (n, D) f32 on the accelerator; ids, w: (n, k) -> (n, D) f32 on the accelerator."""
        path = self.path_for(il, x.shape[0])
        self.counters.calls[path] += 1
        if self.recorder is not None:
            self.recorder.record(self.moe_index[il], ids.cpu().numpy(), w.float().cpu().numpy())
        s = self.layers[il]
        if s.scale is not None:                                # an expert's output scale folds into its weight
            w = w * s.scale.to(w.device)[ids]
        if path == "kt":
            return self.kt(il, x, ids, w)
        if path == "stream":
            return self._stream(il, x, ids, w)
        if path == "cache":
            return self._cached(il, x, ids, w)
        if self.cuda and path == "resident":
            return self._compute(s, x, ids, w)
        return self._on_host(s, x, ids, w, path)

    def _on_host(self, s: ExpertStack, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, path: str) -> torch.Tensor:
        """Stack s's experts computed on the CPU (its bytes there), the result back on the accelerator."""
        with num_threads(self.cfg.host_threads if path == "host" else self.cfg.threads):
            if not self.cuda:           # all of it on the CPU already: a decode layer is ~80 us, the moves ~15 us
                return self._compute(s, x, ids, w)
            xc, ic, wc = x.cpu(), ids.cpu(), w.cpu()
            gb, ub, db = (None if t is None else t.cpu() for t in s.biases())    # vectors live on the accelerator
            y = self._compute(replace(s, gate_b=gb, up_b=ub, down_b=db), xc, ic, wc)
        return y.to(self.device, non_blocking=True)

    def _cached(self, il: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """An offloaded layer with the expert cache: its experts from the slots where the cache holds them, the
        rest from host RAM (engines.reference.device_cache). On the CPU a mixed request is gathered into one stack, so
        every token's sum runs in routing order as without the cache (bit-identical); on CUDA the slots' part runs
        on the GPU, the rest on the CPU, and the two parts add."""
        c, j = self.cache, self.moe_index[il]
        plan = c.request(j, ids, self.phase)
        if not any(plan.on_device):
            return self._on_host(self.layers[il], x, ids, w, "host")
        if all(plan.on_device) or not self.cuda:
            stack = c.stack(j) if all(plan.on_device) else c.gathered(j, plan)
            lut = torch.full((self.layers[il].gate.shape[0],), -1, dtype=torch.long)
            lut[plan.used] = torch.tensor(plan.slot) if all(plan.on_device) else torch.arange(len(plan.slot))
            slot_ids = lut.to(ids.device)[ids]                 # (n, k) index of each routed expert in `stack`
            if not self.cuda:
                with num_threads(self.cfg.threads):
                    return self._compute(stack, x, slot_ids, w)
            return self._compute(stack, x, slot_ids, w)
        dev = torch.zeros(self.layers[il].gate.shape[0], dtype=torch.bool)
        dev[plan.used[torch.tensor(plan.on_device)]] = True
        slot = torch.zeros(len(dev), dtype=torch.long)
        slot[plan.used] = torch.tensor(plan.slot).clamp(min=0)
        on = dev.to(ids.device)[ids]                           # (n, k): computed from a slot
        y_dev = self._compute(c.stack(j), x, slot.to(ids.device)[ids], w * on)
        return y_dev + self._on_host(self.layers[il], x, ids, w * ~on, "host")

    def _compute(self, s: ExpertStack, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Stack s's experts on the device its bytes are on: on the CPU the kernels' one call (gate, up,
        activation, down and the weighted sum; for many tokens grouped by expert), else grouped_experts."""
        if s.gate.device.type != "cpu" or self.kernels is None:
            return grouped_experts(self.linear, s, x, ids, w, self.act)
        if s.kernel_args is None:
            s.kernel_args = self.kernels.experts(s.gate, s.up, s.down, self.act.name, self.act.alpha, self.act.limit,
                                                 *s.biases())
        if x.shape[0] == 1:
            return s.kernel_args.decode(x, ids, w)
        return s.kernel_args.prefill(x, ids, w, bf16=self.linear.dtype == torch.bfloat16)

    # --- stream path ----------------------------------------------------------------------------

    def _copy_experts(self, il: int, b: int, experts: list[int]) -> None:
        """Copy the stored bytes of the listed experts of layer il into slots 0..m-1 of staging buffer b."""
        src = self.layers[il]
        for m, dst in zip(src.matrices, self.staging[b]):
            mb = m.matrix_bytes
            for slot, e in enumerate(experts):
                dst[slot * mb:(slot + 1) * mb].copy_(m.raw[e * mb:(e + 1) * mb], non_blocking=True)
        self.counters.streamed_experts += len(experts)
        self.counters.streamed_bytes += len(experts) * src.expert_bytes

    def _staged(self, il: int, b: int, used: torch.Tensor | None) -> ExpertStack:
        """Layer il's stack read from staging buffer b: slot s holds expert used[s] (or expert s when the
        whole layer was prefetched, used None), a stack of the staged experts only; the small biases are
        gathered the same way."""
        s = self.layers[il]
        k = s.gate.shape[0] if used is None else len(used)
        views = iter(buf[:m.nbytes] for m, buf in zip(s.matrices, self.staging[b]))
        mats = [m if m is None else m.with_raw(next(views)).head(k) for m in (s.gate, s.up, s.down)]
        biases = [None if t is None else (t if used is None else t[used.to(t.device)]).to(self.device)
                  for t in s.biases()]
        return replace(s, gate=mats[0], up=mats[1], down=mats[2], gate_b=biases[0], up_b=biases[1],
                       down_b=biases[2], scale=None, on_host=False)

    def _stream(self, il: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        E = self.layers[il].gate.shape[0]
        if il in self._prefetched:                    # whole layer already in buffer b, slot == expert
            b, done = self._prefetched.pop(il)
            torch.cuda.current_stream().wait_event(done)
            slot_ids, used = ids, None
        else:
            b = il % len(self.staging)
            used = torch.unique(ids)                  # sorted expert ids this batch routes to
            listed = used.tolist()
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    if self.buf_free[b] is not None:
                        self.copy_stream.wait_event(self.buf_free[b])
                    self._copy_experts(il, b, listed)
                    done = torch.cuda.Event()
                    done.record()
                torch.cuda.current_stream().wait_event(done)
            else:
                self._copy_experts(il, b, listed)
            lut = torch.full((E,), -1, dtype=torch.long, device=ids.device)
            lut[used] = torch.arange(len(listed), device=ids.device)
            slot_ids = lut[ids]                       # (n, k) staging slot of each routed expert
        if self.cuda:
            self._prefetch_next(il, 1 - b)
        y = self._compute(self._staged(il, b, used), x, slot_ids, w)
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
            self._copy_experts(nxt, b, list(range(self.layers[nxt].gate.shape[0])))
            done = torch.cuda.Event()
            done.record()
        self._prefetched[nxt] = (b, done)
        self.counters.prefetched_layers += 1
