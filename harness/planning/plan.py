"""Memory plan per offload depth, from the GGUF tensor table alone (no weights are loaded).

For every depth N in 0..n_layers (the `--n-cpu-moe N` rule of engines.base):
  accelerator = non-expert weights + routed experts of layers >= N + KV cache + compute buffers
                (+ the reference engine's expert staging buffer, + a calibrated runtime overhead)
  host        = routed experts of layers < N (+ llama.cpp's input layer on CUDA)
Bytes are what the engine holds: both engines keep every weight as the file stores it (quantized stays
quantized; engines/reference/weights.py); so do their KV caches on a CPU (f16, llama.cpp's default), on CUDA
the reference engine's holds its compute dtype. The host figure is anonymous memory, the RAM an engine needs
(cells.csv's peak_rss_anon_mib): on CUDA both engines copy host weights into page-locked memory; on a CPU-only
host (device cpu: no accelerator, every byte in host RAM) weights read through the file mapping are file-backed
pages (page cache: reclaimable, but what keeps an mmap'd model fast), planned apart as mapped bytes, and
everything copied (llama.cpp's extra buffer types, the reference engine's huge-page and repacked copies), the KV
cache and the compute buffers is anonymous. When measured cells of the same model exist (cells.csv, same
model_fingerprint and engine), the estimate is calibrated from them and the plan says so.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from engines import ggml_build
from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.reference import placement
from engines.reference.placement import DTYPE_BYTES
from harness.units import MiB as MIB

ENGINES = ("llama-cpp", "reference")
LLAMA_CTX_PAD = 256        # llama.cpp 0.3.36 rounds the KV cache up to 256 cells (asked 100 -> 256 cells)


@dataclass(frozen=True)
class PlanSettings:
    engine: str = "llama-cpp"
    n_ctx: int = 8192
    n_ubatch: int = 512
    n_batch: int = 2048
    flash_attn: str = "auto"     # on | off | auto (auto: llama.cpp enables it on CPU and CUDA)
    device: str = "cuda"         # the accelerator planned for (cpu: none); the reference engine picks its dtype from it
    dtype: str = "auto"          # reference engine compute dtype; auto = the engine's own rule
    mmap: bool = True            # llama.cpp on a CPU: the file's pages mapped (else loaded into its CPU buffer)
    repack: bool = True          # llama.cpp on a CPU: its extra buffer types (AMX, CPU_REPACK) for this CPU


@dataclass(frozen=True)
class ModelBytes:
    """Bytes the engine holds per part of the model."""
    non_expert: int
    expert_by_layer: tuple[int, ...]       # routed-expert bytes of layer i (0 for dense layers)
    kv_per_cell: int                       # K + V bytes of one context cell over all layers
    compute_dtype: str                     # the dtype of many-token products (the roofline's FLOP/s figure)
    kv_dtype: str
    embed: int = 0                         # token_embd bytes (part of non_expert)
    state: int = 0                         # recurrent state of one sequence (f32), whatever the context

    def experts(self, lo: int = 0, hi: int | None = None) -> int:
        return sum(self.expert_by_layer[lo:hi])


def reference_dtype(meta: ModelMeta, s: PlanSettings) -> str:
    """The reference engine's compute dtype for this file and device (its own rule)."""
    return placement.compute_dtype(s.dtype, s.device.split(":")[0], placement.stored_type(meta))


def model_bytes(meta: ModelMeta, s: PlanSettings) -> ModelBytes:
    if s.engine not in ENGINES:
        raise UserError(f"--engine {s.engine!r} has no memory model; use one of {', '.join(ENGINES)}.")
    if s.engine == "llama-cpp":
        cdt, kvdt = "f32", "f16"                 # ggml's CPU products accumulate in f32; f16 K and V by default
    else:
        cdt = reference_dtype(meta, s)
        kvdt = cdt if s.device.startswith("cuda") else "f16"
    experts = [0] * meta.n_layers
    non_expert = embed = 0
    for t in meta.tensors:                       # both engines hold the file's bytes
        if t.layer is not None:
            experts[t.layer] += t.n_bytes
        else:
            non_expert += t.n_bytes
            embed += t.n_bytes if t.name == "token_embd.weight" else 0
    layout, state = cache_layout(meta)
    kv_per_cell = sum(h * (k + v) for h, k, v in layout) * DTYPE_BYTES[kvdt]
    return ModelBytes(non_expert, tuple(experts), kv_per_cell, cdt, kvdt, embed, state)


def per_layer(meta: ModelMeta, key: str, default: int = 0) -> list[int]:
    """A count that may be one number or one per layer (llama.cpp's get_key_or_arr), per layer."""
    v = meta.get(key)
    if isinstance(v, list):
        return [int(x) for x in v[:meta.n_layers]] + [default] * max(0, meta.n_layers - len(v))
    return [int(v) if isinstance(v, (int, float)) and v else default] * meta.n_layers


def attention_shape(meta: ModelMeta) -> tuple[int, int, int, int]:
    """(q heads, kv heads, key length, value length), the largest over the layers. Without key_length/value_length
    (common in llama/Mixtral-style files) a head is n_embd / n_head wide, as llama.cpp assumes."""
    n_head = max(per_layer(meta, "attention.head_count"))
    head_kv = max(per_layer(meta, "attention.head_count_kv", n_head))
    default = int(meta.get("embedding_length") or 0) // max(n_head, 1)
    return (n_head, head_kv, int(meta.get("attention.key_length") or default),
            int(meta.get("attention.value_length") or default))


def cache_layout(meta: ModelMeta) -> tuple[list[tuple[int, int, int]], int]:
    """Per layer (kv heads, key length, value length) of the KV cache, and the recurrent state's bytes: the
    architecture table's rules where it knows the file (per-layer head sizes, layers without a KV cache,
    DeltaNet states), else the plain metadata (per-layer kv head counts included)."""
    from engines.reference.archs import ARCHS

    if meta.arch in ARCHS:
        a = ARCHS[meta.arch]
        try:
            h = a.parse(meta)
            return a.cache_layout(h), a.state_bytes(h) if a.state_bytes else 0
        except UserError:          # a variant the table does not run (llama.cpp may): the metadata's numbers
            pass
    _, _, k_len, v_len = attention_shape(meta)
    heads = per_layer(meta, "attention.head_count")
    return [(kv, k_len, v_len) for kv in per_layer(meta, "attention.head_count_kv", max(heads))], 0


def kv_cells(s: PlanSettings) -> int:
    if s.engine == "llama-cpp":
        return -(-s.n_ctx // LLAMA_CTX_PAD) * LLAMA_CTX_PAD
    return s.n_ctx


def compute_estimate(meta: ModelMeta, s: PlanSettings) -> int:
    """Scratch bytes of one ubatch: the peak of three phases (ggml's graph allocator reuses memory
    between them), per token of the ubatch n_ub = min(n_ubatch, n_batch, n_ctx):
      attention: mask (f16 with flash attention, f32 without) over n_kv cells, without flash
                 attention also f32 scores n_kv x n_head, plus ~6 x n_embd f32 activations
      ffn:       (4 n_embd + 3.5 k n_ff_exp) f32 (routed expert intermediates and, for f16/quantized
                 weights, activation copies in the weight type; coefficients fitted, ~+6% on an f16 model)
      output:    (n_vocab + 2 n_embd) f32 logits (reserved for every token of the ubatch)
    Matches llama.cpp 0.3.36's CPU "compute buffer size" within ~1% on the tiny preset (f32) for
    n_ctx 256..8192, n_ubatch 64/512, flash attention on and off. The reference engine does not
    report its scratch; it is estimated like flash attention off (SDPA may materialize scores)."""
    n_embd = int(meta.get("embedding_length") or 0)
    n_head = max(per_layer(meta, "attention.head_count", 1))
    n_ff = max(per_layer(meta, "expert_feed_forward_length") + per_layer(meta, "feed_forward_length"))
    n_ub, n_kv = min(s.n_ubatch, s.n_batch, s.n_ctx), kv_cells(s)
    flash = s.flash_attn in ("on", "auto") and s.engine == "llama-cpp"
    attn = n_kv * (2 if flash else 4 + 4 * n_head) + 4 * 6 * n_embd
    ffn = int(4 * (4 * n_embd + 3.5 * meta.n_expert_used * n_ff))
    out = 4 * (meta.n_vocab + 2 * n_embd)
    return n_ub * max(attn, ffn, out)


def staging_bytes(mb: ModelBytes, s: PlanSettings, depth: int) -> int:
    """Reference engine on CUDA: offloaded layers stream through two whole-layer staging buffers (CPU-only runs
    compute offloaded experts where they are: no staging)."""
    if s.engine != "reference" or depth == 0 or not s.device.startswith("cuda"):
        return 0
    return 2 * max(mb.expert_by_layer)


@dataclass
class DepthPlan:
    n_cpu_moe: int
    non_expert_bytes: int
    expert_accel_bytes: int
    expert_host_bytes: int
    kv_bytes: int               # KV caches and recurrent states
    compute_bytes: int          # compute buffers (estimate x calibration scale)
    staging_bytes: int = 0
    overhead_bytes: int = 0     # calibrated: measured peak minus everything above
    input_host_bytes: int = 0   # llama.cpp on CUDA keeps the token embedding (a row lookup) in host RAM
    cpu_copy_bytes: int = 0     # llama.cpp on a CPU: what its extra buffer types (AMX with its padding, CPU_REPACK)
                                # hold beyond the file's bytes (copies of weights whose file pages stay mapped),
                                # less the blocks it does not load (multi-token prediction; the reference engine too)
    mapped_bytes: int = 0       # CPU-only: weights read through the file mapping (mapped_bytes): file-backed pages
    cpu_only: bool = False      # no accelerator: every part is in host RAM (the parts keep their placement roles)

    @property
    def _placed_accel(self) -> int:
        return (self.non_expert_bytes + self.expert_accel_bytes + self.kv_bytes + self.compute_bytes
                + self.staging_bytes + self.overhead_bytes + self.cpu_copy_bytes)

    @property
    def accel_bytes(self) -> int:
        """Bytes on the accelerator (0 on a CPU-only host)."""
        return 0 if self.cpu_only else self._placed_accel

    @property
    def host_bytes(self) -> int:
        """Host RAM the engine needs as anonymous memory (peak_rss_anon_mib less the runtime, which the calibrated
        overhead holds): on CUDA the host experts and llama.cpp's input layer, page-locked copies; CPU-only every
        part but the mapped file pages."""
        host = self.expert_host_bytes + self.input_host_bytes
        return self._placed_accel + host - self.mapped_bytes if self.cpu_only else host

    @property
    def expert_host_fraction(self) -> float:
        total = self.expert_host_bytes + self.expert_accel_bytes
        return self.expert_host_bytes / total if total else float("nan")


@dataclass
class Calibration:
    n_cells: int
    runs: list[str]
    peak: str                          # peak_vram_mib (GPU runs) or peak_rss_anon_mib (CPU-only runs)
    compute_scale: float | None        # measured / estimated compute buffer (llama.cpp reports it)
    overhead_bytes: int                # max over cells of measured peak - predicted total

    def describe(self) -> str:
        scale = f"compute buffer x{self.compute_scale:.2f}, " if self.compute_scale else ""
        return (f"calibrated from {self.n_cells} measured cell(s) in {', '.join(self.runs)}: {scale}"
                f"runtime overhead {self.overhead_bytes / MIB:+,.0f} MiB ({self.peak} minus predicted bytes)")


@dataclass
class Plan:
    meta: ModelMeta
    settings: PlanSettings
    bytes: ModelBytes
    n_kv_cells: int
    compute_estimate: int
    depths: list[DepthPlan] = field(default_factory=list)
    calibration: Calibration | None = None

    def at(self, n_cpu_moe: int) -> DepthPlan:
        return self.depths[n_cpu_moe]

    def rows(self) -> list[dict]:
        return [{"n_cpu_moe": d.n_cpu_moe, "accel MiB": d.accel_bytes / MIB, "non-expert MiB": d.non_expert_bytes / MIB,
                 "experts accel MiB": d.expert_accel_bytes / MIB, "KV MiB": d.kv_bytes / MIB,
                 "compute MiB": (d.compute_bytes + d.staging_bytes + d.overhead_bytes) / MIB,
                 "CPU copies MiB": d.cpu_copy_bytes / MIB, "host RAM MiB (anon)": d.host_bytes / MIB,
                 "host file-backed MiB": d.mapped_bytes / MIB, "expert host %": 100 * d.expert_host_fraction}
                for d in self.depths]

    def to_dict(self) -> dict:
        return {"model": str(self.meta.path), "model_fingerprint": self.meta.fingerprint,
                "settings": self.settings.__dict__, "compute_dtype": self.bytes.compute_dtype,
                "kv_dtype": self.bytes.kv_dtype, "n_kv_cells": self.n_kv_cells,
                "calibration": self.calibration.describe() if self.calibration else None,
                "depths": [d.__dict__ | {"accel_bytes": d.accel_bytes,
                                         "host_bytes": d.host_bytes} for d in self.depths]}


def loaded_tensors(meta: ModelMeta) -> list:
    """The tensors an engine loads: not the last nextn_predict_layers blocks, multi-token-prediction blocks that
    llama.cpp ignores ("model has unused tensor ... -- ignoring": in no buffer at all) and the reference engine
    never holds (past its trunk)."""
    first_mtp = meta.n_layers - int(meta.get("nextn_predict_layers") or 0)
    block = lambda name: int(name.split(".")[1]) if re.match(r"blk\.\d+\.", name) else -1
    return [t for t in meta.tensors if block(t.name) < first_mtp]


def cpu_buffers(meta: ModelMeta, s: PlanSettings) -> dict[str, int]:
    """llama.cpp on a CPU host: its model buffers by type, as its load log reports them, at any depth (experts
    --n-cpu-moe overrides to the CPU get its extra buffer types too). Weights its extra buffer types take
    (engines.ggml_build.extra_buft: AMX padded, CPU_REPACK as stored) are copied there; with mmap the rest stays
    in the mapped file range from the first to the last byte of the weights left in it (a moved weight inside
    that range is held twice), without mmap in one CPU buffer of their bytes."""
    bufts = ggml_build.cpu_bufts() if s.repack else {}
    out: dict[str, int] = {}
    plain = []
    for t in loaded_tensors(meta):
        where = ggml_build.extra_buft(t.name, t.ne, t.ggml_type, bufts)
        if where:
            out[where[0]] = out.get(where[0], 0) + t.n_bytes + where[1]
        else:
            plain.append(t)
    # a file without output.weight (tied embeddings): llama.cpp's output layer reads token_embd by MUL_MAT, a second
    # use of the same weight that its extra buffer types copy for themselves (gemma4's Q6_K token_embd in AMX)
    embd = next((t for t in meta.tensors if t.name == "token_embd.weight"), None)
    if embd and not any(t.name == "output.weight" for t in meta.tensors):
        where = ggml_build.extra_buft("output.weight", embd.ne, embd.ggml_type, bufts)
        if where:
            out[where[0]] = out.get(where[0], 0) + embd.n_bytes + where[1]
    if plain:
        key = "CPU_Mapped" if s.mmap else "CPU"
        out[key] = (max(t.offset + t.n_bytes for t in plain) - min(t.offset for t in plain) if s.mmap
                    else sum(t.n_bytes for t in plain))
    return out


def _copies(meta: ModelMeta, s: PlanSettings) -> int:
    """On a CPU-only host, what the engine holds beyond the file's weight bytes: llama.cpp's cpu_buffers (its extra
    buffer types' copies), less the blocks neither engine loads (0 on CUDA, where llama.cpp uses no extra buffer
    types: its builds hold CPU weights in host buffers)."""
    if s.device.startswith("cuda"):
        return 0
    held = cpu_buffers(meta, s).values() if s.engine == "llama-cpp" else [t.n_bytes for t in loaded_tensors(meta)]
    return sum(held) - sum(t.n_bytes for t in meta.tensors)


def mapped_bytes(meta: ModelMeta, s: PlanSettings) -> int:
    """Weight bytes an engine reads through its mapping of the file on a CPU-only host: file-backed pages (page
    cache, which the kernel can reclaim and read again from the file), not anonymous RAM. llama.cpp with mmap: its
    CPU_Mapped range (cpu_buffers; the weights its extra buffer types copy out of that range are resident there
    too, as they were read from it). The reference engine (with its default hugepages and repack): an untied token
    embedding (read a row at a time) and the matrices it neither repacks nor copies onto huge pages (under 2 MiB,
    in a type or shape its kernels take as stored: QuantKernels.host_layout; weights.Holder). 0 on CUDA, where
    both engines copy host weights into page-locked memory."""
    if s.device.startswith("cuda"):
        return 0
    if s.engine == "llama-cpp":
        return cpu_buffers(meta, s).get("CPU_Mapped", 0)
    import torch

    from engines.devices import cpu_isa
    from engines.reference.kernels import QuantKernels
    from engines.reference.qtensor import QTensor
    from engines.reference.weights import HUGE

    kernels, none = QuantKernels(None, cpu_isa()), torch.empty(0, dtype=torch.uint8)   # host_layout's rule only
    tied = not any(t.name == "output.weight" for t in meta.tensors)
    mapped = 0
    for t in loaded_tensors(meta):
        if t.name == "token_embd.weight" and not tied:
            mapped += t.n_bytes
        elif (len(t.ne) > 1 and not t.name.endswith(".bias") and t.n_bytes < HUGE
              and kernels.host_layout(QTensor(none, t.ggml_type, t.shape)) == "ggml"):
            mapped += t.n_bytes
    return mapped


def _depth(mb: ModelBytes, s: PlanSettings, n: int, compute: int, overhead: int = 0, copies: int = 0,
           mapped: int = 0) -> DepthPlan:
    llama_cuda = s.engine == "llama-cpp" and s.device.startswith("cuda")
    embed = mb.embed if llama_cuda else 0       # llama.cpp's input layer lives on the CPU (llama-model.cpp)
    if llama_cuda and n and min(s.n_ubatch, s.n_batch) >= 32:
        # op offload: a batch of >= 32 tokens copies an offloaded layer's experts into the GPU compute buffer
        compute += max(mb.expert_by_layer[:n])
    return DepthPlan(n, mb.non_expert - embed, mb.experts(n), mb.experts(0, n), kv_cells(s) * mb.kv_per_cell + mb.state,
                     compute, staging_bytes(mb, s, n), overhead, embed, copies, mapped, not s.device.startswith("cuda"))


def cell_settings(s: PlanSettings, c: dict) -> PlanSettings:
    """`s` with the settings a measured cell (a cells.csv row) ran with: its context and batch sizes, the
    reference engine's device and dtype, llama.cpp's mmap and extra buffer types."""
    eff = json.loads(c.get("effective_settings") or "{}")
    out = replace(s, n_ctx=int(c["n_ctx"]), n_ubatch=int(c["n_ubatch"]), n_batch=int(c["n_batch"]),
                  flash_attn=c.get("flash_attn") or s.flash_attn)
    if s.engine == "reference":   # the dtype/device the engine really used
        out = replace(out, device=str(eff.get("device", s.device)), dtype=str(eff.get("dtype", s.dtype)))
    else:                         # llama.cpp's extra buffer types as it ran (older cells: on)
        out = replace(out, mmap=str(c.get("mmap", "True")) != "False", repack=bool(int(eff.get("repack", 1))))
    return out


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def calibrate(meta: ModelMeta, s: PlanSettings, runs: list[Path]) -> Calibration | None:
    """From ok cells of the same model and engine: the ratio of llama.cpp's reported compute buffer to
    the estimate, and the residual (measured peak - predicted weights, KV, copies) as runtime overhead.
    The peak is VRAM when the run had a GPU, else the anonymous RSS (a CPU-only cell: every part but the mapped
    file pages; cells written before the RSS split give no residual)."""
    from harness.store import results

    scales, residuals, used, peak_name = [], [], set(), "peak_rss_anon_mib"
    for run in runs:
        for c in results.read_csv(run, "cells.csv"):
            if c["model_fingerprint"] != meta.fingerprint or c["engine"] != s.engine or c["status"] != "ok":
                continue
            vram = _num(c.get("peak_vram_mib"))
            gpu = not math.isnan(vram)
            cs = cell_settings(s, c)
            if gpu != cs.device.startswith("cuda"):       # where the cell ran, whatever the plan is for
                cs = replace(cs, device="cuda" if gpu else "cpu")
            est = compute_estimate(meta, cs)
            by_dev = json.loads(c.get("bytes_by_device") or "{}")
            measured = sum(v for k, v in by_dev.items() if k.startswith("compute:")
                           and not (gpu and ("CPU" in k or "Host" in k)))
            if measured > 0:
                scales.append(measured / est)
            peak = vram if gpu else _num(c.get("peak_rss_anon_mib"))
            if math.isnan(peak):
                continue
            d = _depth(model_bytes(meta, cs), cs, int(c["n_cpu_moe"]), 0, copies=_copies(meta, cs),
                       mapped=mapped_bytes(meta, cs))       # no compute: the residual keeps it, scaled below
            peak_name = "peak_vram_mib" if gpu else "peak_rss_anon_mib"
            residuals.append((peak * MIB - (d.accel_bytes if gpu else d.host_bytes), est))
            used.add(Path(run).name)
    if not residuals:
        return None
    scale = sorted(scales)[len(scales) // 2] if scales else None
    overhead = max(r - est * (scale or 1.0) for r, est in residuals)
    return Calibration(len(residuals), sorted(used), peak_name, scale, int(overhead))


def find_runs(results_dir: Path) -> list[Path]:
    return sorted(p.parent for p in Path(results_dir).glob("*/cells.csv")) if Path(results_dir).is_dir() else []


def make_plan(meta: ModelMeta, s: PlanSettings, runs: list[Path] | None = None) -> Plan:
    """The plan for every depth 0..n_layers; calibrated when `runs` hold ok cells of this model and engine."""
    if s.n_ctx < 1 or s.n_ubatch < 1 or s.n_batch < 1:
        raise UserError("--ctx, --n-ubatch and --n-batch must be positive whole numbers.")
    mb = model_bytes(meta, s)
    est = compute_estimate(meta, s)
    cal = calibrate(meta, s, runs or [])
    compute = int(est * (cal.compute_scale or 1.0)) if cal else est
    overhead = cal.overhead_bytes if cal else 0
    copies, mapped = _copies(meta, s), mapped_bytes(meta, s)
    depths = [_depth(mb, s, n, compute, overhead, copies, mapped) for n in range(meta.n_layers + 1)]
    return Plan(meta, s, mb, kv_cells(s), est, depths, cal)
