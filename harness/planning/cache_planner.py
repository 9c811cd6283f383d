"""The expert-cache planner (`moebench cache`, and `moebench recommend --trace`): which experts to keep in VRAM and
what that buys, from routing traces. The parts: cache_replay (replay through engines.cache_policies policies, Belady and
the static oracle), trace_stats (the trace's own statistics), cache_time_model (the time model, fitted on measured
cells); this module runs them over budgets and policies and shapes the rows that tables, reports and
recommendations print.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engines.errors import UserError
from engines.cache_policies import POLICIES
from engines.routing import PHASES, Trace, load_trace
from harness.planning import cache_replay as cs
from harness.planning.trace_stats import TraceStats, stats_by_phase

BOUNDS = ("belady", "static-oracle")
MAX_TRACES = 64


@dataclass
class Study:
    """One trace replayed at every budget through every policy, with both bounds."""
    label: str
    header: dict
    host: list[int]                      # trace MoE-layer indices on the host
    budgets: list[float]                 # MiB
    results: list[cs.SimResult]          # policies x budgets, then the bounds x budgets
    stats: dict[str, TraceStats]         # "all", "prefill", "decode"
    streams: list[str] = field(default_factory=list)

    def result(self, policy: str, budget: float) -> cs.SimResult:
        return next(r for r in self.results if r.policy == policy and r.budget_mib == budget)


def find_traces(paths: list[Path]) -> list[tuple[str, Path]]:
    """(label, file) of each .npz given, or found under <run>/traces/ of each run directory given."""
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files = sorted(p.glob("traces/*.npz")) or sorted(p.glob("*.npz"))
            if not files:
                raise UserError(f"{p} holds no routing traces (traces/*.npz); record some with `moebench sweep "
                                "--trace-routing` or pass .npz files")
            out += [(f"{p.name}/{f.stem}", f) for f in files]
        elif p.is_file():
            out.append((p.stem, p))
        else:
            raise UserError(f"{p} does not exist; pass routing trace files (.npz) or run directories")
    if len(out) > MAX_TRACES:
        raise UserError(f"{len(out)} traces given, at most {MAX_TRACES}; pass fewer files or run directories")
    return out


def select(trace: Trace, segments: list[str] | None) -> Trace:
    """The rows of the named segments (all when None)."""
    if not segments:
        return trace
    import numpy as np

    from engines.routing import ROW_ARRAYS
    names = trace.header["segments"]
    missing = [s for s in segments if s not in names]
    if missing:
        raise UserError(f"the trace has no segment {missing[0]!r}; it has {', '.join(names)}")
    keep = np.isin(trace.segment, [names.index(s) for s in segments])
    from dataclasses import replace
    return replace(trace, **{k: getattr(trace, k)[keep] for k in ROW_ARRAYS})


def study(label: str, trace: Trace, budgets: list[float], policies: list[str] | None = None, *,
          global_pool: bool = False, cpu_share: float = 0.0, upload_cap: int | None = None,
          n_cpu_moe: int | None = None) -> Study:
    policies = list(policies or POLICIES)
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise UserError(f"unknown --policy {bad[0]!r}; pick from {', '.join(POLICIES)}")
    if not budgets or any(b < 0 for b in budgets):
        raise UserError("--vram needs cache sizes >= 0, e.g. --vram 256MiB,1GiB,4GiB")
    host = cs.host_layers(trace, n_cpu_moe)
    steps = cs.steps_of(trace, host)
    results = []
    for p in policies:
        for b in budgets:
            results.append(cs.simulate(steps, p, b, global_pool=global_pool,
                                       cpu_share=cpu_share, upload_cap=upload_cap))
    for b in budgets:
        results.append(cs.belady(steps, b, global_pool=global_pool))
        results.append(cs.static_oracle(steps, b, global_pool=global_pool))
    segs = sorted(set(trace.segment.tolist()))
    return Study(label, trace.header, host, list(budgets), results, stats_by_phase(trace),
                 [trace.header["streams"][s] for s in segs])


def rows(st: Study) -> list[dict]:
    """One row per phase x policy x budget: hit rate, link and CPU MB per token (bounds: hit rate, miss MB)."""
    out = []
    for ph in [p for p in PHASES if p in st.stats]:
        for r in st.results:
            s = r.summary(ph)
            bound = r.policy in BOUNDS
            out.append({"trace": st.label, "stream": "+".join(sorted(set(st.streams))), "phase": ph,
                        "policy": r.policy, "kind": "bound" if bound else "policy", "cache MiB": r.budget_mib,
                        "experts/layer": r.capacity[0] if r.capacity and not r.global_pool else sum(r.capacity),
                        "hit %": 100 * s["hit_rate"],
                        "link MB/token": float("nan") if bound else s["link_bytes_per_token"] / 1e6,
                        "CPU MB/token": float("nan") if bound else s["cpu_bytes_per_token"] / 1e6,
                        "miss MB/token": (s["link_bytes_per_token"] + s["cpu_bytes_per_token"]) / 1e6})
    return out


def layer_rows(st: Study, phase: str, policy: str, budget: float) -> list[dict]:
    r = st.result(policy, budget)
    return [{"layer": st.header["moe_layers"][h], **{k: v for k, v in x.items()}}
            for h, x in zip(st.host, r.per_layer(phase))]


def stats_rows(st: Study) -> list[dict]:
    out = []
    for ph, s in st.stats.items():
        for r in s.rows():
            out.append({"trace": st.label, "phase": ph, **r})
    return out


def reuse_rows(st: Study) -> list[dict]:
    return [{"trace": st.label, "phase": ph, **{k: round(100 * v, 1) for k, v in s.reuse.items()}}
            for ph, s in st.stats.items()]


def to_json(studies: list[Study], fits: dict | None = None) -> dict:
    return {"rows": [r for st in studies for r in rows(st)],
            "stats": {st.label: {ph: s.to_json() for ph, s in st.stats.items()} for st in studies},
            "per_layer": {st.label: {f"{r.policy}@{r.budget_mib:g}": {ph: r.per_layer(ph) for ph in r.tally}
                                     for r in st.results} for st in studies},
            "time_model": {ph: {"constants": f.constants, "unidentified": f.unidentified,
                                "held_out_relative_errors": f.errors, "describe": f.describe()}
                           for ph, f in (fits or {}).items()}}


def load(paths: list[Path], segments: list[str] | None = None) -> list[tuple[str, Trace]]:
    return [(label, select(load_trace(f), segments)) for label, f in find_traces(paths)]


# --- recommendation: depth plus cache size -------------------------------------------------------------------
@dataclass
class CacheAdvice:
    n_cpu_moe: int
    cache_mib: float
    hit_rate: float                # decode, policy below
    host_mb_per_token: float       # decode: expert MB per token not served from VRAM (CPU + link)
    predicted_s: float | None      # decode seconds per token from the time model, if it has the terms


def advise(trace: Trace, depths: list[tuple[int, int]], policy: str = "classlru", fit=None,
           max_mib: float | None = None) -> tuple[list[CacheAdvice], CacheAdvice | None]:
    """For each feasible depth (n_cpu_moe, VRAM bytes left after the plan and margin), a cache of that size: its
    decode hit rate and expert bytes per token from host RAM. Pick the smallest of those bytes (or of the predicted
    time when the time model has fitted both the CPU and the link term); ties go to the shallower depth."""
    out = []
    for n, free in depths:
        host = cs.host_layers(trace, n)
        if not host:
            out.append(CacheAdvice(n, 0.0, float("nan"), 0.0, None))
            continue
        steps = cs.steps_of(trace.select(phase="decode"), host)
        mib = max(0.0, free / cs.MiB)
        full = sum(steps.expert_bytes) * steps.n_expert / cs.MiB
        mib = min(mib, full, max_mib if max_mib is not None else mib)
        r = cs.simulate(steps, policy, mib)
        s = r.summary("decode")
        host_mb = (s["link_bytes_per_token"] + s["cpu_bytes_per_token"]) / 1e6
        pred = None
        if fit is not None and not {"cpu_bytes", "link_bytes"} & set(fit.unidentified):
            pred = fit.predict({"cpu_bytes": s["cpu_bytes_per_token"], "link_bytes": s["link_bytes_per_token"],
                                "syncs": len(host)})
        out.append(CacheAdvice(n, mib, s["hit_rate"], host_mb, pred))
    if not out:
        return out, None
    key = (lambda a: (round(a.predicted_s, 9), a.n_cpu_moe)) if all(a.predicted_s is not None for a in out) \
        else (lambda a: (round(a.host_mb_per_token, 6), a.n_cpu_moe))
    return out, min(out, key=key)
