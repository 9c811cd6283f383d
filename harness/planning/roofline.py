"""The bound the hardware puts on each measured cell, and the fraction of it achieved.

Notation (per model, bytes as the engine holds them, harness.planning.plan.model_bytes):
  E_i   routed-expert bytes of layer i, P_i their parameter count; k/E = n_expert_used / n_expert
  W     non-expert weight bytes read per token: everything but the token embedding table (a row
        lookup), unless the output head is tied to it;  P_ne their matrix parameter count (without
        the embedding and the output head: prefill computes logits for its last token only)
  KV    bytes of one context cell over all layers; ctx = context position averaged over the test
        (n_depth + n_tokens / 2)
  N     offload depth: layers 0..N-1 keep their experts in host RAM

Decode (one token reads every active weight once; memory-bound):
  B_host  = sum_{i<N}  E_i * k/E
  B_accel = sum_{i>=N} E_i * k/E + W + KV * ctx
  bound   = 1 / (B_host / BW_host + B_accel / BW_accel)              [tokens/s]
  With no CUDA device the "accelerator" is the CPU itself: both terms are read from host RAM,
  BW_accel = BW_host, so bound = BW_host / (B_host + B_accel) ("mem").
  BW_host = host_read_gbps (torch sum over 256 MiB), BW_accel = gpu_mem_gbps (device copy).

Prefill (compute-bound unless experts stream over the bus):
  F       = 2 * (P_ne + sum_i P_i * k/E) + 4 * n_layers * n_head * head_dim * ctx   [FLOP per token]
  compute = FLOPS / F; FLOPS = the device matmul figure in the engine's dtype (llama.cpp on the
            CPU: fp32, ggml's CPU kernels accumulate in f32; the reference engine: its compute
            dtype). CPU figures scale by min(threads, cores) / min(profile threads, cores).
  stream  (CUDA, N > 0, ubatch >= the engine's stream threshold: llama.cpp 32, reference 128):
            each ubatch of n_ub tokens copies the experts it uses of every offloaded layer,
            B_x = sum_{i<N} E_i * (1 - (1 - k/E)^n_ub)   (expected fraction of experts hit);
            stream = n_ub / (B_x / BW_h2d), BW_h2d = pageable (llama.cpp's CPU buffers) or
            pinned (the reference engine page-locks host experts)
  CUDA below the threshold: offloaded layers compute on the CPU, t = F_host/FLOPS_cpu + F_rest/FLOPS_gpu.
  bound   = min(compute, stream)   (copies and compute overlap at best)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from engines.gguf_meta import ModelMeta
from harness.planning.plan import ModelBytes, PlanSettings, attention_shape, model_bytes
from harness.hw.probe import figure

STREAM_MIN_BATCH = {"llama-cpp": 32, "reference": 128}


@dataclass(frozen=True)
class CellShape:
    """What the bound depends on besides the model and the workload."""
    engine: str
    n_cpu_moe: int
    n_ubatch: int = 512
    threads: int = 1
    gpu: bool = False
    dtype: str = "auto"          # reference engine compute dtype (from its effective settings)
    stream_min_batch: int | None = None


def _params(meta: ModelMeta) -> tuple[int, list[int]]:
    """(non-expert matrix params without embedding/output head, routed-expert params per layer)."""
    per = [0] * meta.n_layers
    ne = 0
    for t in meta.tensors:
        n = math.prod(t.ne)
        if t.layer is not None:
            per[t.layer] += n
        elif len(t.ne) >= 2 and t.name not in ("token_embd.weight", "output.weight"):
            ne += n
    return ne, per


def _weights_read(meta: ModelMeta, mb: ModelBytes) -> int:
    names = {t.name for t in meta.tensors}
    embd = next(t for t in meta.tensors if t.name == "token_embd.weight") if "token_embd.weight" in names else None
    tied = "output.weight" not in names
    return mb.non_expert - (embd.n_bytes if embd is not None and not tied else 0)


def _cpu_flops(profile: dict, dtype: str, threads: int) -> float:
    base = figure(profile, "cpu_matmul_bf16_gflops" if dtype == "bf16" else "cpu_matmul_fp32_gflops") * 1e9
    cores = profile.get("cores_physical") or profile.get("threads") or 1
    return base * min(threads, cores) / min(profile.get("threads") or 1, cores)


def bound(meta: ModelMeta, c: CellShape, n_prompt: int, n_gen: int, n_depth: int,
          profile: dict | None) -> tuple[float, str]:
    """(tokens/s bound, kind) for one workload on one cell; (nan, "") without a usable profile."""
    if not profile:
        return float("nan"), ""
    # every engine but the reference holds the GGUF's bytes as stored (llama.cpp, llama-bench, ...)
    ps = PlanSettings(engine="reference" if c.engine == "reference" else "llama-cpp",
                      device="cuda" if c.gpu else "cpu", dtype=c.dtype)
    mb = model_bytes(meta, ps)
    frac = meta.n_expert_used / meta.n_expert if meta.n_expert else 1.0
    N = c.n_cpu_moe
    ctx = n_depth + (n_prompt + n_gen) / 2
    head, _, hd, _ = attention_shape(meta)
    host_bw = figure(profile, "host_read_gbps") * 1e9
    if n_gen:      # decode
        b_host = mb.experts(0, N) * frac
        b_acc = mb.experts(N) * frac + _weights_read(meta, mb) + mb.kv_per_cell * ctx
        if not c.gpu:
            return host_bw / (b_host + b_acc), "mem"
        t_host, t_acc = b_host / host_bw, b_acc / (figure(profile, "gpu_mem_gbps") * 1e9)
        return 1 / (t_host + t_acc), "host-mem" if t_host >= t_acc else "accel-mem"
    p_ne, p_exp = _params(meta)
    attn = 4 * meta.n_layers * head * hd * ctx
    f_host = 2 * sum(p_exp[:N]) * frac
    f_all = 2 * (p_ne + sum(p_exp) * frac) + attn
    wdt = mb.compute_dtype
    cpu = _cpu_flops(profile, wdt, c.threads)
    if not c.gpu:
        return cpu / f_all, "compute"
    gpu = figure(profile, "gpu_matmul_fp32_gflops" if wdt == "f32" and c.engine == "reference"
                 else "gpu_matmul_bf16_gflops") * 1e9
    n_ub = min(c.n_ubatch, n_prompt)
    if N and n_ub < (c.stream_min_batch or STREAM_MIN_BATCH.get(c.engine, 32)):
        return 1 / (f_host / cpu + (f_all - f_host) / gpu), "compute"
    compute = gpu / f_all
    if not N:
        return compute, "compute"
    h2d = figure(profile, "h2d_pinned_gbps" if c.engine == "reference" else "h2d_pageable_gbps") * 1e9
    crossing = mb.experts(0, N) * (1 - (1 - frac) ** n_ub)
    stream = n_ub / (crossing / h2d)
    return (stream, "h2d") if stream < compute else (compute, "compute")


def shape_of(cell: dict) -> CellShape:
    """A cells.csv row -> CellShape (GPU when llama.cpp logged CUDA buffers or the reference ran on cuda)."""
    eff = cell.get("effective_settings")
    eff = json.loads(eff) if isinstance(eff, str) and eff else (eff or {})
    by_dev = cell.get("bytes_by_device")
    by_dev = json.loads(by_dev) if isinstance(by_dev, str) and by_dev else (by_dev or {})
    extra = eff.get("extra") or {}
    gpu = any("CUDA" in k for k in by_dev) or str(eff.get("device", "")).startswith("cuda")
    return CellShape(engine=str(cell["engine"]), n_cpu_moe=int(cell["n_cpu_moe"]), n_ubatch=int(cell["n_ubatch"]),
                     threads=int(cell["threads"]), gpu=gpu, dtype=str(eff.get("dtype", "auto")),
                     stream_min_batch=extra.get("moe_stream_min_batch"))


def annotate(cells, summary, profile: dict | None):
    """summary (harness.store.results.summarize) + bound_tps, bound_kind, fraction (= tps_median / bound_tps).
    Rows whose model file is gone, or without a profile, get NaN (never a guess)."""
    from engines.errors import UserError
    from engines.gguf_meta import read_meta
    from workloads.grammar import parse_workload

    metas: dict[str, ModelMeta | None] = {}
    by_id = {c["cell_id"]: c for c in cells.to_dict("records")}     # each summary row names its own cell
    out = summary.copy()
    tps, kinds = [], []
    for r in summary.to_dict("records"):
        c = by_id.get(r["cell_id"])
        b, kind = float("nan"), ""
        if c is not None and isinstance(r.get("workload"), str) and r["workload"]:
            if c["model"] not in metas:
                try:
                    metas[c["model"]] = read_meta(c["model"])
                except UserError:
                    metas[c["model"]] = None
            meta = metas[c["model"]]
            if meta is not None:
                try:
                    w = parse_workload(r["workload"])
                    b, kind = bound(meta, shape_of(c), w.n_prompt, w.n_gen, w.n_depth, profile)
                except (UserError, ValueError, KeyError, ZeroDivisionError):   # a summary never fails for it
                    b, kind = float("nan"), ""
        tps.append(b)
        kinds.append(kind)
    out["bound_tps"] = tps
    out["bound_kind"] = kinds
    out["fraction"] = out["tps_median"] / out["bound_tps"]
    return out
