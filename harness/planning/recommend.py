"""`moebench recommend`: which --n-cpu-moe fits this GPU and RAM at this context, and how fast it is.

Feasible depths come from the memory plan (harness.planning.plan): accelerator bytes + margin <= VRAM and
host bytes <= RAM. Without measurements the answer is the smallest feasible depth (each offloaded
layer costs decode speed: the published advice). With measured runs of the same model and engine it
is the best measured feasible depth for the objective, where depths within noise of the fastest (every 95 %
interval of their tok/s ratio, harness.stats.ratio_interval, holds 1) are ties that go to the one needing the
least VRAM; unmeasured depths get a predicted range (between their measured neighbours, scaled by the roofline
beyond the measured ones, and never above the roofline bound). Failed cells are shown and never recommended.
Runs measured without a GPU are refused: the plan is for a GPU, and on the CPU alone every depth runs the same
work on the same device, so their differences say nothing about the depths on a GPU.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from engines.errors import UserError
from harness.planning.plan import Plan
from harness.stats import ratio_interval
from harness.units import GiB

OBJECTIVES = ("decode", "prefill", "balanced")
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
    cache: object = None              # harness.planning.cache_planner.CacheAdvice with a trace (recommend --trace)


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
    ties: list[int] = field(default_factory=list)   # the measured depths within noise of the pick (it included)


def _geomean(values: list[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v and all(x > 0 for x in v) else NAN


def _kinds(objective: str) -> tuple[str, ...]:
    return ("decode", "prefill") if objective == "balanced" else (objective,)


@dataclass
class Measured:
    """The runs' ok cells of one model and engine, per depth and workload: tok/s grouped by process (the last
    cell that measured it), and what recommend needs besides."""
    groups: dict[int, dict[str, dict]] = field(default_factory=dict)    # depth -> workload -> {round: [tok/s]}
    source: dict[int, tuple[int, bool]] = field(default_factory=dict)   # depth -> (run index, its rounds pair up)
    failed: dict[int, str] = field(default_factory=dict)
    rep: dict | None = None                  # a representative ok cell
    profile: dict | None = None              # the first run's roofline.hardware (profile, its bandwidth)
    ctxs: set[int] = field(default_factory=set)
    cpu_only: bool = False                   # an ok cell ran without a GPU

    def median(self, n: int, w: str) -> float:
        import numpy as np
        return float(np.median([v for vs in self.groups[n][w].values() for v in vs]))

    def interval(self, a: int, b: int, w: str):
        """depth a / depth b on workload w with its interval (harness.stats.ratio_interval); rounds pair up when
        both come from one run whose rounds interleaved."""
        (ra, pa), (rb, _) = self.source[a], self.source[b]
        return ratio_interval(self.groups[a][w], self.groups[b][w], paired=ra == rb and pa)


def _ran_without_gpu(c: dict) -> bool:
    """A cells.csv row that says what it ran on (effective settings) and used no GPU (roofline.shape_of; llama-bench
    names its backends)."""
    from harness.planning import roofline

    eff = c.get("effective_settings")
    eff = json.loads(eff) if isinstance(eff, str) and eff else {}
    return bool(eff) and not roofline.shape_of(c).gpu and "CUDA" not in str(eff.get("backends", "")).upper()


def load_measured(runs: list[Path], fingerprint: str, engine: str) -> Measured:
    from harness.planning import roofline
    from harness.store import results
    from harness.store.history import pairing

    m = Measured()
    seen = 0
    for i, run in enumerate(runs):
        info, cells, meas, _ = results.load_frames(run)
        m.profile = m.profile or roofline.hardware(info)
        pairs = pairing(info)["paired"]
        cells = cells[(cells["model_fingerprint"] == fingerprint) & (cells["engine"] == engine)]
        seen += len(cells)
        for c in cells.to_dict("records"):
            n = int(c["n_cpu_moe"])
            if c["status"] != "ok":
                m.failed.setdefault(n, str(c["status"]))
                continue
            m.rep = m.rep or c
            m.cpu_only = m.cpu_only or _ran_without_gpu(c)
            m.ctxs.add(int(c["n_ctx"]))
            m.source[n] = (i, pairs)
            rows = meas[meas["cell_id"] == c["cell_id"]]
            for wl, g in rows.groupby("workload"):
                m.groups.setdefault(n, {})[wl] = results.round_groups(g)
    if runs and not seen:
        raise UserError(f"The --results runs hold no {engine} cells of this model (fingerprint {fingerprint}); "
                        "pass runs of the same model file or choose the --engine they measured.")
    if m.cpu_only:
        raise UserError(f"The --results runs measured {engine} without a GPU, and recommend plans for a GPU's VRAM: "
                        "with no GPU every depth runs on the CPU, so their speeds do not rank the depths on a GPU; "
                        "measure on the GPU you plan for, or leave --results out.")
    m.failed = {n: s for n, s in m.failed.items() if n not in m.groups}
    return m


def _ties(m: Measured, top: DepthRow, rows: list[DepthRow], workloads: list[str]) -> tuple[list[DepthRow], list]:
    """The rows within noise of `top` (top included): the interval of their ratio holds 1 on every workload of the
    objective that gives one; and the rows no workload gives an interval for (too few samples)."""
    tied, unknown = [top], []
    for r in rows:
        if r is top:
            continue
        ivs = [m.interval(top.n_cpu_moe, r.n_cpu_moe, w) for w in workloads
               if w in m.groups[top.n_cpu_moe] and w in m.groups[r.n_cpu_moe]]
        ivs = [iv for iv in ivs if not math.isnan(iv.low)]
        if not ivs:
            unknown.append(r)
        elif all(iv.low <= 1 <= iv.high for iv in ivs):
            tied.append(r)
    return tied, unknown


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

    m = load_measured(runs or [], meta.fingerprint, s.engine)
    rep, profile, ctxs, failed = m.rep, m.profile, m.ctxs, m.failed
    medians = {n: {w: m.median(n, w) for w in per} for n, per in m.groups.items()}
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
    rec, smallest, ties = None, None, []
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
        top = max(scored, key=lambda r: (r.score, -r.accel_bytes))
        kind_ws = [w for w in workloads if kind_of[w] in _kinds(objective)]
        tied, unknown = _ties(m, top, scored, kind_ws)
        pick = min(tied, key=lambda r: (r.accel_bytes, -r.n_cpu_moe))       # more offload, less VRAM
        rec, ties = pick.n_cpu_moe, sorted(r.n_cpu_moe for r in tied)
        figs = ", ".join(f"{k} {pick.measured[k]:,.1f} tok/s" for k in _kinds(objective) if k in pick.measured)
        if len(tied) == 1:
            why = f"n_cpu_moe={rec} is the fastest measured depth that fits for {objective} ({figs})"
        else:
            names = ", ".join(map(str, ties[:-1])) + f" and {ties[-1]}"
            why = (f"n_cpu_moe={names} are within noise of each other for {objective} (every 95% interval of their "
                   f"tok/s ratio holds 1); picked {rec}, the one needing the least VRAM ({figs})")
        if unknown:
            notes.append(f"n_cpu_moe={', '.join(str(r.n_cpu_moe) for r in unknown)}: too few samples for an interval "
                         f"of the ratio to {top.n_cpu_moe} (one process each), so compared by median; measure with "
                         "--rounds 3 or more")
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
    return Recommendation(plan, objective, vram, ram, margin, rows, rec, why + ".", smallest, notes, ties=ties)


def with_cache(rec: Recommendation, trace, policy: str = "classlru", fit=None) -> None:
    """What an expert cache in the VRAM each feasible depth leaves free buys, replayed on a routing trace of this
    model (harness.planning.cache_planner.advise); the pick (depth plus cache size) goes into the rationale beside the
    depth without a cache."""
    from engines.gguf_meta import clean_text
    from harness.planning.cache_planner import advise

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
    return {"recommended": rec.recommended, "rationale": rec.rationale, "objective": rec.objective, "ties": rec.ties,
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
