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
  C       = all the host's CPU caches (run.json host.cache_mib): at most C bytes stay cached from one token to the
            next, so at least B - C of a token's bytes come from memory; B <= C: no memory bound (NaN, kind "none")
  bound   = 1 / (max(B_host - C, 0) / BW_host + B_accel / BW_accel)            [tokens/s]
  With no CUDA device the "accelerator" is the CPU itself: both terms are read from host RAM,
  BW_accel = BW_host, so bound = BW_host / (B_host + B_accel - C) ("mem").
  BW_host = the best of the run's own read probe at the cell's thread count and every earlier one on its host
  (run.json["bandwidth"], harness.hw.probe.read_bandwidth and with_host_best); runs without it fall back to the
  host profile's host_read_gbps ("mem (host profile)");
  BW_accel = gpu_mem_gbps (device copy).

Prefill (compute-bound unless experts stream over the bus):
  F       = 2 * (P_ne + sum_i P_i * k/E) + 4 * n_layers * n_head * head_dim * ctx   [FLOP per token]
  compute = PEAK / F; PEAK = the measured matmul peak of the arithmetic the engine's prefill products use, its
            effective setting compute_dtype["prefill"]: f32 -> fp32 FMA, bf16 -> bf16, q8-activations -> int8 dot
            products, f16 -> fp32 where the CPU has no fp16 arithmetic (ggml and oneDNN convert and multiply in
            f32 lanes), else the larger of fp16 and fp32; several words ("bf16+q8-activations") -> the largest
            (no product runs above its own peak). Unknown compute_dtype (older runs, external engines) or an
            unmeasured peak: no prefill bound (NaN), never a guess. CPU figures scale by min(threads, cores) /
            min(profile threads, cores).
  stream  (CUDA, N > 0, ubatch >= the engine's stream threshold: llama.cpp 32, reference 128):
            each ubatch of n_ub tokens copies the experts it uses of every offloaded layer,
            B_x = sum_{i<N} E_i * (1 - (1 - k/E)^n_ub)   (expected fraction of experts hit);
            stream = n_ub / (B_x / BW_h2d), BW_h2d = pageable (llama.cpp's CPU buffers) or
            pinned (the reference engine page-locks host experts)
  CUDA below the threshold: offloaded layers compute on the CPU, t = F_host/PEAK_cpu + F_rest/PEAK_gpu.
  bound   = min(compute, stream)   (copies and compute overlap at best)

Each bound carries its inputs as text (bytes a token and the bandwidth at N threads, or FLOP a token and the peak
of the dtype); a cell measured above its bound is a warning naming them (bound_messages), never silent.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NamedTuple

from engines.gguf_meta import ModelMeta
from harness.planning.plan import ModelBytes, PlanSettings, attention_shape, model_bytes
from harness.hw.probe import figure

STREAM_MIN_BATCH = {"llama-cpp": 32, "reference": 128}
NAN = float("nan")
# compute_dtype word -> the profile figure of its peak (f16 on the CPU: _peak_figures)
CPU_PEAKS = {"f32": "cpu_matmul_fp32_gflops", "bf16": "cpu_matmul_bf16_gflops",
             "q8-activations": "cpu_matmul_int8_gops"}
GPU_PEAKS = {"f32": "gpu_matmul_fp32_gflops", "bf16": "gpu_matmul_bf16_gflops", "f16": "gpu_matmul_f16_gflops",
             "q8-activations": "gpu_matmul_int8_gops"}


@dataclass(frozen=True)
class CellShape:
    """What the bound depends on besides the model and the workload."""
    engine: str
    n_cpu_moe: int
    n_ubatch: int = 512
    threads: int = 1
    gpu: bool = False
    dtype: str = "auto"          # reference engine weight dtype (from its effective settings): the bytes it holds
    stream_min_batch: int | None = None
    compute_dtype: str = ""      # effective settings compute_dtype["prefill"]; "" unknown: no prefill bound


class Bound(NamedTuple):
    """tokens/s no run of the cell can beat, what limits it ("mem", "compute", "h2d", ...; "none" with a NaN bound
    that cannot be given) and its inputs in words (or why there is none)."""
    tps: float
    kind: str
    inputs: str


def hardware(run: dict | None) -> dict | None:
    """What the bounds of a run's cells divide by: its hardware profile with the run's own read bandwidth probe
    (run.json["bandwidth"]) and its host's CPU cache size folded in; None when the run has neither."""
    run = run or {}
    profile, bw = run.get("hardware_profile") or {}, run.get("bandwidth") or {}
    if "figures" not in profile and not bw.get("threads"):
        return None
    return profile | {"bandwidth": bw, "cache_mib": (run.get("host") or {}).get("cache_mib")}


def read_gbps(hw: dict, threads: int) -> tuple[float, bool]:
    """(GB/s, measured at this thread count) of the host memory a cell at `threads` threads reads: the best of the
    run's own probe and every earlier probe at that thread count on its host (harness.hw.probe.with_host_best: a
    VM's bandwidth moves from minute to minute, and a bound must hold in its fastest minute), else the host
    profile's figure (measured at another time and thread count)."""
    bw = hw.get("bandwidth") or {}
    seen = [float(v) for v in ((bw.get(k) or {}).get(str(threads)) for k in ("threads", "best")) if v]
    return (max(seen), True) if seen else (figure(hw, "host_read_gbps"), False)


def _peak_figures(hw: dict, word: str, gpu: bool) -> list[str] | None:
    """The profile figures whose largest is word's peak; None when the word's arithmetic on this device is unknown."""
    if gpu:
        return [GPU_PEAKS[word]] if word in GPU_PEAKS else None
    if word == "f16":         # fp16 products: native only with AVX512-FP16 / AMX-FP16, else f32 lanes
        native = hw.get("cpu_fp16_arith")
        return None if native is None else ["cpu_matmul_fp32_gflops"] + (["cpu_matmul_f16_gflops"] if native else [])
    return [CPU_PEAKS[word]] if word in CPU_PEAKS else None


def peak(hw: dict, compute_dtype: str, gpu: bool = False) -> tuple[float, str]:
    """(operations/s at the profile's threads, the figure and word) of the fastest arithmetic in compute_dtype: with
    several words the largest peak, as no product runs above its own. NaN when the dtype is unknown or a peak was
    not measured."""
    found = []
    for word in filter(None, compute_dtype.split("+")):
        names = _peak_figures(hw, word, gpu)
        if not names or any(math.isnan(figure(hw, n)) for n in names):
            return NAN, ""
        found += [(figure(hw, n) * 1e9, f"{n} ({word})") for n in names]
    return max(found) if found else (NAN, "")


def _cpu_scale(hw: dict, threads: int) -> float:
    cores = hw.get("cores_physical") or hw.get("threads") or 1
    return min(threads, cores) / min(hw.get("threads") or 1, cores)


def memory_bound(bytes_per_token: float, gbps: float, cache_bytes: float) -> float:
    """tokens/s that reading bytes_per_token at gbps allows when up to cache_bytes of them stay cached from one token
    to the next; NaN where all of them can (the memory is then no bound)."""
    from_memory = bytes_per_token - cache_bytes
    return gbps * 1e9 / from_memory if from_memory > 0 else NAN


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


def _decode(c: CellShape, hw: dict, b_host: float, b_acc: float) -> Bound:
    gbps, in_run = read_gbps(hw, c.threads)
    source = (f"{c.threads} threads, the best of this run's probe and this host's earlier ones" if in_run else
              f"host profile at {hw.get('threads', '?')} threads, not measured in this run")
    cache = (hw.get("cache_mib") or 0) * 2**20
    cached = f"up to {cache / 2**20:.0f} MiB of them cached" if cache else "CPU caches unknown"
    if not c.gpu:
        b = b_host + b_acc
        if b <= cache:
            return Bound(NAN, "none", f"the {b / 1e6:.1f} MB a token reads fit in the {cache / 2**20:.0f} MiB of CPU "
                                      f"caches: no memory bound")
        return Bound(memory_bound(b, gbps, cache), "mem" if in_run else "mem (host profile)",
                     f"{b / 1e6:.1f} MB a token ({cached}) at {gbps:.1f} GB/s read ({source})")
    acc_gbps = figure(hw, "gpu_mem_gbps")
    t_host, t_acc = max(b_host - cache, 0) / (gbps * 1e9), b_acc / (acc_gbps * 1e9)
    return Bound(1 / (t_host + t_acc), "host-mem" if t_host >= t_acc else "accel-mem",
                 f"{b_host / 1e6:.1f} MB a token in host RAM ({cached}) at {gbps:.1f} GB/s read ({source}), "
                 f"{b_acc / 1e6:.1f} MB in VRAM at {acc_gbps:.0f} GB/s")


def bound(meta: ModelMeta, c: CellShape, n_prompt: int, n_gen: int, n_depth: int, hw: dict | None) -> Bound:
    """The bound of one workload on one cell. hw: hardware(run) (a bare hardware profile works too: its bandwidth is
    then the profile's, marked); NaN with kind "" without one."""
    if not hw:
        return Bound(NAN, "", "no hardware profile")
    # every engine but the reference holds the GGUF's bytes as stored (llama.cpp, llama-bench, ...)
    ps = PlanSettings(engine="reference" if c.engine == "reference" else "llama-cpp",
                      device="cuda" if c.gpu else "cpu", dtype=c.dtype)
    mb = model_bytes(meta, ps)
    frac = meta.n_expert_used / meta.n_expert if meta.n_expert else 1.0
    N = c.n_cpu_moe
    ctx = n_depth + (n_prompt + n_gen) / 2
    head, _, hd, _ = attention_shape(meta)
    if n_gen:      # decode
        b_host = mb.experts(0, N) * frac
        b_acc = mb.experts(N) * frac + _weights_read(meta, mb) + mb.kv_per_cell * ctx
        return _decode(c, hw, b_host, b_acc)
    p_ne, p_exp = _params(meta)
    attn = 4 * meta.n_layers * head * hd * ctx
    f_host = 2 * sum(p_exp[:N]) * frac
    f_all = 2 * (p_ne + sum(p_exp) * frac) + attn
    flop = f"{f_all / 1e9:.3g} GFLOP a token"
    cpu, cpu_name = peak(hw, c.compute_dtype)
    cpu *= _cpu_scale(hw, c.threads)
    gpu, gpu_name = peak(hw, c.compute_dtype, gpu=True) if c.gpu else (NAN, "")
    unknown = Bound(NAN, "none", f"no measured peak for compute_dtype {c.compute_dtype!r}: no prefill bound"
                    if c.compute_dtype else "compute_dtype unknown (the engine does not report it): no prefill bound")
    if not c.gpu:
        return unknown if math.isnan(cpu) else Bound(cpu / f_all, "compute", f"{flop} at {cpu / 1e9:.0f} G(FL)OP/s "
                                                                             f"{cpu_name}, {c.threads} threads")
    n_ub = min(c.n_ubatch, n_prompt)
    if N and n_ub < (c.stream_min_batch or STREAM_MIN_BATCH.get(c.engine, 32)):
        if math.isnan(cpu + gpu):
            return unknown
        return Bound(1 / (f_host / cpu + (f_all - f_host) / gpu), "compute",
                     f"{flop}, {f_host / 1e9:.3g} of it on the CPU at {cpu / 1e9:.0f} G(FL)OP/s {cpu_name} "
                     f"({c.threads} threads), the rest at {gpu / 1e9:.0f} {gpu_name}")
    compute = unknown if math.isnan(gpu) else Bound(gpu / f_all, "compute", f"{flop} at {gpu / 1e9:.0f} G(FL)OP/s "
                                                                            f"{gpu_name}")
    if not N:
        return compute
    h2d_name = "h2d_pinned_gbps" if c.engine == "reference" else "h2d_pageable_gbps"
    h2d = figure(hw, h2d_name) * 1e9
    crossing = mb.experts(0, N) * (1 - (1 - frac) ** n_ub)
    stream = n_ub / (crossing / h2d)
    if stream < compute.tps or math.isnan(compute.tps):      # the copies alone bound it, dtype known or not
        return Bound(stream, "h2d", f"{crossing / 1e6:.1f} MB of experts copied an ubatch of {n_ub} at "
                                    f"{h2d / 1e9:.1f} GB/s ({h2d_name})")
    return compute


def shape_of(cell: dict) -> CellShape:
    """A cells.csv row -> CellShape (GPU when llama.cpp logged CUDA buffers or the reference ran on cuda)."""
    eff = cell.get("effective_settings")
    eff = json.loads(eff) if isinstance(eff, str) and eff else (eff or {})
    by_dev = cell.get("bytes_by_device")
    by_dev = json.loads(by_dev) if isinstance(by_dev, str) and by_dev else (by_dev or {})
    extra = eff.get("extra") or {}
    gpu = any("CUDA" in k for k in by_dev) or str(eff.get("device", "")).startswith("cuda")
    engine = str(cell["engine"]).removeprefix("A:").removeprefix("B:").split("@")[0]   # a table's label works too
    return CellShape(engine=engine, n_cpu_moe=int(cell["n_cpu_moe"]), n_ubatch=int(cell["n_ubatch"]),
                     threads=int(cell["threads"]), gpu=gpu, dtype=str(eff.get("dtype", "auto")),
                     stream_min_batch=extra.get("moe_stream_min_batch"),
                     compute_dtype=str((eff.get("compute_dtype") or {}).get("prefill", "")))


def annotate(cells, summary, runs: dict | list[dict] | None):
    """summary (harness.store.results.summarize) + bound_tps, bound_kind, bound_inputs and fraction (= tps_median /
    bound_tps). runs: the run.json of the cells' run (or of each run, matched by the cells' run_id). Rows whose model
    file is gone, or without a profile, get NaN (never a guess)."""
    from engines.errors import UserError
    from engines.gguf_meta import read_meta
    from workloads.grammar import parse_workload

    runs = [runs or {}] if not isinstance(runs, list) else runs
    hw_of = {r.get("run_id"): hardware(r) for r in runs}
    metas: dict[str, ModelMeta | None] = {}
    by_id = {c["cell_id"]: c for c in cells.to_dict("records")}     # each summary row names its own cell
    out = summary.copy()
    got = []
    for r in summary.to_dict("records"):
        c = by_id.get(r["cell_id"])
        b = Bound(NAN, "", "")
        if c is not None and isinstance(r.get("workload"), str) and r["workload"]:
            if c["model"] not in metas:
                try:
                    metas[c["model"]] = read_meta(c["model"])
                except UserError:
                    metas[c["model"]] = None
            meta = metas[c["model"]]
            hw = hw_of.get(c.get("run_id"), hardware(runs[0]))
            if meta is not None:
                try:
                    w = parse_workload(r["workload"])
                    b = bound(meta, shape_of(c), w.n_prompt, w.n_gen, w.n_depth, hw)
                except (UserError, ValueError, KeyError, ZeroDivisionError):   # a summary never fails for it
                    b = Bound(NAN, "", "")
        got.append(b)
    out["bound_tps"] = [b.tps for b in got]
    out["bound_kind"] = [b.kind for b in got]
    out["bound_inputs"] = [b.inputs for b in got]
    out["fraction"] = out["tps_median"] / out["bound_tps"]
    return out


def bound_messages(annotated) -> list[str]:
    """What a reader must hear about the bounds (annotate's output): a warning for every cell measured above its
    bound, naming the cell and the bound's inputs (a bound cannot be beaten: one of its inputs is wrong), and a note
    per engine, model and reason where no bound could be given."""
    out, why_none = [], {}
    for r in annotated.to_dict("records"):
        cell = f"{r['engine']} {r['model_name']} n_cpu_moe={r['n_cpu_moe']} {r['workload']}"
        if r["fraction"] > 1:
            out.append(f"warning: {cell}: {r['tps_median']:.1f} tok/s is {100 * r['fraction']:.0f}% of its "
                       f"{r['bound_kind']} bound of {r['bound_tps']:.1f} tok/s ({r['bound_inputs']}); nothing runs "
                       f"above its bound, so one of these inputs is too low.")
        elif r["bound_kind"] == "none":
            why_none.setdefault((r["engine"], r["model_name"], r["bound_inputs"]), []).append(r["workload"])
    for (engine, model, why), wls in why_none.items():
        out.append(f"note: no bound for {engine} {model} {', '.join(dict.fromkeys(wls))}: {why}.")
    return out
