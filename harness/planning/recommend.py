"""`moebench recommend`: which --n-cpu-moe fits this GPU and RAM at this context, and how fast it is.

Feasible depths come from the memory plan (harness.planning.plan): accelerator bytes + margin <= VRAM and
host bytes <= RAM. Without measurements the answer is the smallest feasible depth (each offloaded
layer costs decode speed: the published advice). With measured runs of the same model and engine it
is the best measured feasible depth for the objective; unmeasured depths get a predicted range
(between their measured neighbours, scaled by the roofline beyond the measured ones, and never
above the roofline bound). Failed cells are shown and never recommended.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from engines.errors import UserError
from harness.planning.plan import Plan
from harness.stats import stats
from harness.units import GiB

OBJECTIVES = ("decode", "prefill", "balanced")
TIE_REL = 0.01      # scores within 1% of the best are a tie; the deepest of them wins (same speed, more VRAM free)
NAN = float("nan")


@dataclass
class DepthRow:
    n_cpu_moe: int
    accel_bytes: int
    host_bytes: int
    fits: bool
    why_not: str = ""
    status: str = ""                                     # measured | failed: <status> | predicted | ""
    measured: dict[str, float] = field(default_factory=dict)    # kind (decode|prefill) -> tok/s
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    score: float = NAN
    cache: object = None              # harness.planning.cache.CacheAdvice with a trace (recommend --trace)


@dataclass
class Recommendation:
    plan: Plan
    objective: str
    vram: int
    ram: int
    margin: int
    rows: list[DepthRow]
    recommended: int | None
    rationale: str
    smallest_vram: int | None = None
    notes: list[str] = field(default_factory=list)
    cache_pick: object = None         # the depth plus cache size the trace favours (CacheAdvice)
    cache_policy: str = ""


def _geomean(values: list[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v and all(x > 0 for x in v) else NAN


def _kinds(objective: str) -> tuple[str, ...]:
    return ("decode", "prefill") if objective == "balanced" else (objective,)


def load_measured(runs: list[Path], fingerprint: str, engine: str):
    """(per-depth workload medians of ok cells, per-depth failure status, a representative ok cell,
    the first hardware_profile found in the runs' run.json, the measured n_ctx values)."""
    from harness.store import results

    medians: dict[int, dict[str, float]] = {}
    failed: dict[int, str] = {}
    rep, profile, ctxs, seen = None, None, set(), 0
    for run in runs:
        info, cells, meas, _ = results.load_frames(run)
        profile = profile or info.get("hardware_profile")
        cells = cells[(cells["model_fingerprint"] == fingerprint) & (cells["engine"] == engine)]
        seen += len(cells)
        for c in cells.to_dict("records"):
            n = int(c["n_cpu_moe"])
            if c["status"] != "ok":
                failed.setdefault(n, str(c["status"]))
                continue
            rep = rep or c
            ctxs.add(int(c["n_ctx"]))
            m = meas[meas["cell_id"] == c["cell_id"]]
            for wl, g in m.groupby("workload"):
                medians.setdefault(n, {})[wl] = float(stats(g["tokens_per_s"])["median"])
    if runs and not seen:
        raise UserError(f"The --results runs hold no {engine} cells of this model (fingerprint {fingerprint}); "
                        "pass runs of the same model file or choose the --engine they measured.")
    return medians, {n: s for n, s in failed.items() if n not in medians}, rep, profile, ctxs


def _predict(n: int, values: dict[int, float], bounds: dict[int, float]) -> tuple[float, float]:
    """Range for unmeasured depth n from the measured depths of one workload (see module doc)."""
    below = [d for d in values if d < n]
    above = [d for d in values if d > n]
    b = bounds.get(n, NAN)
    if below and above:
        lo, hi = sorted((values[max(below)], values[min(above)]))
    else:
        near = min(above) if above else max(below)
        ratio = b / bounds.get(near, NAN)                 # how the roofline moves from near to n
        scaled = values[near] * ratio if not math.isnan(ratio) else NAN
        if above:                                         # less offload than any measured depth: faster
            lo, hi = values[near], scaled
        else:
            lo, hi = scaled, values[near]
    hi = min(hi, b) if not math.isnan(b) and not math.isnan(hi) else (b if math.isnan(hi) else hi)
    return (min(lo, hi) if not math.isnan(hi) else lo), hi


def recommend_depth(plan: Plan, objective: str, vram: int, ram: int, margin: int,
                    runs: list[Path] | None = None) -> Recommendation:
    from harness.hw import probe
    from harness.planning import roofline
    from workloads.grammar import parse_workload

    if objective not in OBJECTIVES:
        raise UserError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}.")
    meta, s = plan.meta, plan.settings
    rows = []
    for d in plan.depths:
        why = []
        if d.accel_bytes + margin > vram:
            why.append(f"needs {(d.accel_bytes + margin) / GiB:.2f} GiB VRAM with margin")
        if d.host_bytes > ram:
            why.append(f"needs {d.host_bytes / GiB:.2f} GiB RAM")
        rows.append(DepthRow(d.n_cpu_moe, d.accel_bytes, d.host_bytes, not why, "; ".join(why)))

    medians, failed, rep, profile, ctxs = load_measured(runs or [], meta.fingerprint, s.engine)
    notes = []
    if ctxs and ctxs != {s.n_ctx}:
        notes.append(f"measured at n_ctx {', '.join(map(str, sorted(ctxs)))}, planned for {s.n_ctx}")
    if rep is not None and profile is None:
        profile = probe.load_profile()
        if profile:
            notes.append("roofline from this machine's stored hardware profile (the runs carry none)")
    workloads = sorted({w for per in medians.values() for w in per})
    kind_of = {w: ("prefill" if parse_workload(w).n_prompt else "decode") for w in workloads}
    best = {w: max(per[w] for per in medians.values() if w in per) for w in workloads}
    bounds: dict[tuple[int, str], float] = {}       # (depth, workload) -> roofline tok/s

    def bound_at(d: int, w: str) -> float:
        if (d, w) not in bounds:
            wl = parse_workload(w)
            shape = roofline.shape_of(rep | {"n_cpu_moe": d})
            bounds[d, w] = roofline.bound(meta, shape, wl.n_prompt, wl.n_gen, wl.n_depth, profile)[0]
        return bounds[d, w]

    for r in rows:
        n = r.n_cpu_moe
        for k in ("decode", "prefill"):
            ws = [w for w in workloads if kind_of[w] == k]
            if not ws:
                continue
            r.bound[k] = _geomean([bound_at(n, w) for w in ws])
            if n in medians:
                r.measured[k] = _geomean([medians[n].get(w, NAN) for w in ws])
                continue
            per_w = []
            for w in ws:
                vals = {d: per[w] for d, per in medians.items() if w in per}
                per_w.append(_predict(n, vals, {d: bound_at(d, w) for d in [*vals, n]}))
            r.predicted[k] = (_geomean([p[0] for p in per_w]), _geomean([p[1] for p in per_w]))
        if n in medians:
            r.status = "measured"
            r.score = _geomean([_geomean([medians[n][w] / best[w] for w in workloads
                                          if w in medians[n] and kind_of[w] == k]) for k in _kinds(objective)])
        elif n in failed:
            r.status = f"failed: {failed[n]}"
        elif medians:
            r.status = "predicted"

    feasible = [r for r in rows if r.fits]
    scored = [r for r in feasible if not math.isnan(r.score)]
    rec, smallest = None, None
    if not feasible:
        fit_ram = [r for r in rows if r.host_bytes <= ram]
        if fit_ram:
            r0 = min(fit_ram, key=lambda r: r.accel_bytes)
            smallest = r0.accel_bytes + margin
            why = (f"nothing fits: the smallest VRAM that works at ctx {s.n_ctx} is {smallest / GiB:.2f} GiB "
                   f"(n_cpu_moe={r0.n_cpu_moe}, {margin / GiB:.2f} GiB margin included)")
        else:
            need = min(r.host_bytes for r in rows)
            why = f"nothing fits: every depth needs more RAM than {ram / GiB:.2f} GiB (at least {need / GiB:.2f} GiB)"
    elif scored:
        top = max(r.score for r in scored)
        tied = [r for r in scored if r.score >= top * (1 - TIE_REL)]
        pick = max(tied, key=lambda r: r.n_cpu_moe)
        rec = pick.n_cpu_moe
        figs = ", ".join(f"{k} {pick.measured[k]:,.1f} tok/s" for k in _kinds(objective) if k in pick.measured)
        why = f"n_cpu_moe={rec} is the fastest measured depth that fits for {objective} ({figs})"
        if len(tied) > 1:
            why += (f"; it ties within {TIE_REL:.0%} with "
                    f"n_cpu_moe={', '.join(str(r.n_cpu_moe) for r in tied if r is not pick)}"
                    " and keeps the most VRAM free")
        for r in feasible:
            hi = r.predicted.get(objective, (NAN, NAN))[1]
            faster = objective in pick.measured and not math.isnan(hi) and hi > pick.measured[objective]
            if faster and r.n_cpu_moe < rec:
                why += f"; unmeasured n_cpu_moe={r.n_cpu_moe} might reach {hi:,.1f} tok/s, measure it"
                break
    else:
        rec = min(r.n_cpu_moe for r in feasible)
        why = (f"n_cpu_moe={rec} is the smallest depth that fits "
               f"({'no feasible depth was measured' if medians else 'nothing measured'}): "
               "it keeps the most experts in VRAM, and each offloaded layer costs decode speed")
    return Recommendation(plan, objective, vram, ram, margin, rows, rec, why + ".", smallest, notes)


def with_cache(rec: Recommendation, trace, policy: str = "classlru", fit=None) -> None:
    """What an expert cache in the VRAM each feasible depth leaves free buys, replayed on a routing trace of this
    model (harness.planning.cache.advise); the pick (depth plus cache size) goes into the rationale beside the
    depth without a cache."""
    from engines.gguf_meta import clean_text
    from harness.planning.cache import advise

    fp = clean_text(str(trace.header.get("fingerprint")), 32)          # a trace file is untrusted input
    if fp != rec.plan.meta.fingerprint:
        raise UserError(f"The --trace was recorded on another model file (fingerprint {fp}, this one "
                        f"{rec.plan.meta.fingerprint}); record one of this file with `moebench sweep --trace-routing`.")
    if not len(trace.select(phase="decode")):
        raise UserError("The --trace has no decode steps; record a tg workload (e.g. -w tg64+corr) with "
                        "`moebench sweep --trace-routing`.")
    feasible = [r for r in rec.rows if r.fits]
    advice, pick = advise(trace, [(r.n_cpu_moe, rec.vram - rec.margin - r.accel_bytes) for r in feasible],
                          policy, fit)
    for r, a in zip(feasible, advice):
        r.cache = a
    rec.cache_pick, rec.cache_policy = pick, policy
    if pick is not None:
        by = "predicted decode time" if pick.predicted_s is not None else "expert bytes per token from host RAM"
        source = clean_text(f"{trace.header.get('model')}, {', '.join(trace.header.get('streams', []))} stream")
        rec.rationale += (f" With a {policy} expert cache in the VRAM left free (trace {source}): "
                          f"n_cpu_moe={pick.n_cpu_moe} plus "
                          f"{pick.cache_mib:,.0f} MiB of cache, decode hit rate {pick.hit_rate:.0%}, "
                          f"{pick.host_mb_per_token:.1f} MB of experts per token from host RAM (least {by} of the "
                          f"feasible depths).")


def _fmt(r: DepthRow, k: str) -> str:
    if k in r.measured:
        return f"{r.measured[k]:,.1f}"
    lo, hi = r.predicted.get(k, (NAN, NAN))
    if math.isnan(lo) and math.isnan(hi):
        return ""
    if math.isnan(hi):
        return f"≥{lo:,.1f}"
    if math.isnan(lo):
        return f"≤{hi:,.1f}"
    return f"{lo:,.1f}–{hi:,.1f}"


def table(rec: Recommendation) -> list[dict]:
    kinds = [k for k in ("decode", "prefill") if any(k in r.measured or k in r.predicted for r in rec.rows)]
    bounds = any(not math.isnan(v) for r in rec.rows for v in r.bound.values())
    out = []
    for r in rec.rows:
        row = {"n_cpu_moe": r.n_cpu_moe, "VRAM GiB": r.accel_bytes / GiB, "RAM GiB": r.host_bytes / GiB,
               "fits": "yes" if r.fits else "no"}
        for k in kinds:
            row[f"{k} tok/s"] = _fmt(r, k)
            if bounds:
                row[f"{k} bound"] = r.bound.get(k, NAN)
        row["source"] = r.status
        row["pick"] = "◀" if r.n_cpu_moe == rec.recommended else ""
        if rec.cache_policy:
            c = r.cache
            row |= {"cache MiB": c.cache_mib if c else NAN, "cache hit": f"{c.hit_rate:.0%}" if c and c.cache_mib
                    else "", "host MB/token": c.host_mb_per_token if c else NAN,
                    "pick with cache": "◀" if c is not None and c is rec.cache_pick else ""}
        out.append(row)
    return out


def to_json(rec: Recommendation) -> dict:
    s = rec.plan.settings
    return {"recommended": rec.recommended, "rationale": rec.rationale, "objective": rec.objective,
            "engine": s.engine, "ctx": s.n_ctx, "vram_bytes": rec.vram, "ram_bytes": rec.ram,
                "margin_bytes": rec.margin,
            "smallest_vram_bytes": rec.smallest_vram, "model_fingerprint": rec.plan.meta.fingerprint,
            "calibration": rec.plan.calibration.describe() if rec.plan.calibration else None, "notes": rec.notes,
            "depths": [{"n_cpu_moe": r.n_cpu_moe, "accel_bytes": r.accel_bytes, "host_bytes": r.host_bytes,
                        "fits": r.fits, "why_not": r.why_not, "status": r.status, "measured_tps": r.measured,
                        "predicted_tps": {k: list(v) for k, v in r.predicted.items()}, "bound_tps": r.bound,
                        "score": None if math.isnan(r.score) else r.score,
                        "cache": _advice(r.cache)} for r in rec.rows],
            "cache": {"policy": rec.cache_policy, "pick": _advice(rec.cache_pick)} if rec.cache_pick else None}


def _advice(a) -> dict | None:
    """A CacheAdvice for JSON: NaN (no host layer, so no hit rate) as null."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in vars(a).items()} if a else None
