"""Time model of expert offload with a device cache, fitted on measured cells, checked on held-out ones.

Per phase (prefill, decode), seconds per token =
    base + c_cpu x (expert bytes the CPU reads per token) + c_link x (expert bytes uploaded per token)
         + c_sync x (host layers synchronized per token)
The features of a measured cell x workload come from its own routing trace (the segment of that workload) replayed
through the simulator with the engine's stock behaviour at the cell's depth (policy "none"); the times are the
medians of its measurements. On a machine without a GPU the "accelerator" is the same CPU and RAM: every routed
expert, host or not, is read by the CPU, nothing crosses a link, so only base, c_cpu and c_sync can be fitted
there (c_link needs GPU cells; harness.hw.probe's pinned/pageable bandwidth is printed beside it, never used in its
place). A feature that does not vary over the fitted points is folded into the base and its constant reported as
not identified. Constants are fitted by non-negative least squares on every other point (sorted by feature
values, so the held-out points lie between fitted ones) and the relative error on the held-out points is reported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engines.errors import UserError
from engines.routing import PHASES, Trace, load_trace
from harness.planning import cache_replay as cs

FEATURES = ("cpu_bytes", "link_bytes", "syncs")
REFERENCE_STREAM_MIN = 128        # reference engine on CUDA: batches of >= 128 tokens take the stream path


@dataclass
class Point:
    """One measured cell x workload."""
    run: str
    cell_id: str
    workload: str
    phase: str
    n_cpu_moe: int
    seconds_per_token: float
    features: dict[str, float]


@dataclass
class Fit:
    phase: str
    constants: dict[str, float]              # "base" and the identified features -> seconds per (byte|sync|token)
    unidentified: list[str]
    fitted: list[Point]
    held_out: list[Point]
    errors: list[float] = field(default_factory=list)    # relative error of each held-out prediction

    def predict(self, features: dict[str, float]) -> float:
        return self.constants["base"] + sum(self.constants.get(f, 0.0) * features.get(f, 0.0) for f in FEATURES)

    def describe(self) -> str:
        c = self.constants
        parts = [f"base {c['base'] * 1e3:.3f} ms/token"]
        if "cpu_bytes" in c:
            parts.append(f"CPU experts {_gbps(c['cpu_bytes'])}")
        if "link_bytes" in c:
            parts.append(f"link {_gbps(c['link_bytes'])}")
        if "syncs" in c:
            parts.append(f"sync {c['syncs'] * 1e6:.1f} µs/layer")
        err = (f"held-out error median {np.median(np.abs(self.errors)):.1%}, max {np.max(np.abs(self.errors)):.1%} "
               f"({len(self.errors)} points)") if self.errors else "no held-out points"
        miss = f"; not identified here: {', '.join(self.unidentified)}" if self.unidentified else ""
        return f"{self.phase}: {', '.join(parts)} from {len(self.fitted)} points; {err}{miss}"


def _gbps(sec_per_byte: float) -> str:
    return f"{1 / sec_per_byte / 1e9:.2f} GB/s" if sec_per_byte > 0 else "free (0 s/byte)"


def segment_trace(trace: Trace, workload: str) -> Trace | None:
    """The rows a workload's timed region ran: its segment's prefill rows after the untimed depth (pp), or its
    decode rows (tg). None if the trace has no such segment."""
    from workloads.grammar import parse_workload

    if workload not in trace.header["segments"]:
        return None
    w = parse_workload(workload)
    seg = trace.select(segment=workload)
    if w.n_prompt:
        pre = seg.select(phase="prefill")
        keep = np.arange(len(pre)) >= w.n_depth
        return pre.select() if keep.all() else _rows(pre, keep)
    return seg.select(phase="decode")


def _rows(t: Trace, keep: np.ndarray) -> Trace:
    from dataclasses import replace

    from engines.routing import ROW_ARRAYS
    return replace(t, **{k: getattr(t, k)[keep] for k in ROW_ARRAYS})


def features(trace: Trace, n_cpu_moe: int, accelerator_is_cpu: bool, big_batch: int = cs.BIG_BATCH) -> dict:
    """Per token: expert bytes the CPU reads, bytes uploaded, host layers synchronized, with stock offload."""
    host = cs.host_layers(trace, n_cpu_moe)
    if accelerator_is_cpu:            # every layer's experts are read by the CPU, none cross a link
        r = cs.simulate(cs.steps_of(trace, cs.host_layers(trace, None)), "none", 0, big_batch=math.inf)
    else:
        r = cs.simulate(cs.steps_of(trace, host), "none", 0, big_batch=big_batch)
    s = r.summary()
    n_steps = len(set(trace.step.tolist()))
    return {"cpu_bytes": s["cpu_bytes_per_token"], "link_bytes": s["link_bytes_per_token"],
            "syncs": len(host) * n_steps / max(len(trace), 1)}


def measured_points(runs: list[Path], traces: dict[tuple[str, int], Trace] | None = None) -> list[Point]:
    """Points of every ok reference cell in the runs whose trace (<run>/traces/*.npz, matched by model fingerprint
    and depth) has the workload's segment."""
    from harness.store import results
    from harness.stats import stats

    points = []
    for run in runs:
        info, cells, meas, _ = results.load_frames(run)
        found = dict(traces or {})
        for f in sorted(Path(run, "traces").glob("*.npz")):
            t = load_trace(f)
            found.setdefault((t.header["fingerprint"], int(t.header["n_cpu_moe"])), t)
        for c in cells.to_dict("records"):
            t = found.get((str(c["model_fingerprint"]), int(c["n_cpu_moe"])))
            if c["status"] != "ok" or t is None:
                continue
            on_cpu = "cuda" not in str(results.json_dict(c["effective_settings"]).get("device", c["device"])).lower()
            big = REFERENCE_STREAM_MIN if c["engine"] == "reference" else cs.BIG_BATCH
            m = meas[meas["cell_id"] == c["cell_id"]]
            for wl, g in m.groupby("workload"):
                seg = segment_trace(t, str(wl))
                if seg is None or not len(seg):
                    continue
                tps = float(stats(g["tokens_per_s"])["median"])
                phase = "prefill" if int(g["n_prompt"].iloc[0]) else "decode"
                points.append(Point(str(run), str(c["cell_id"]), str(wl), phase, int(c["n_cpu_moe"]), 1.0 / tps,
                                    features(seg, int(c["n_cpu_moe"]), on_cpu, big)))
    return points


def fit(points: list[Point], phase: str) -> Fit:
    """Fit one phase's constants on every other point and score the rest (see the module doc)."""
    from scipy.optimize import nnls

    pts = sorted((p for p in points if p.phase == phase),
                 key=lambda p: (tuple(p.features[f] for f in FEATURES), p.n_cpu_moe, p.workload))
    if len(pts) < 2:
        raise UserError(f"the time model needs at least 2 measured {phase} cells with routing traces, found "
                        f"{len(pts)}; sweep more depths or workloads with --trace-routing")
    train, test = pts[::2], pts[1::2]
    if pts[-1] not in train:               # keep both ends in the fit: held-out points are interpolations
        train, test = train + [pts[-1]], test[:-1]
    X = np.array([[p.features[f] for f in FEATURES] for p in train])
    span = X.max(axis=0) - X.min(axis=0)
    scale = np.where(np.abs(X).max(axis=0) > 0, np.abs(X).max(axis=0), 1.0)
    used = [i for i, f in enumerate(FEATURES) if span[i] > 1e-9 * scale[i]]
    y = np.array([p.seconds_per_token for p in train])
    A = np.column_stack([np.ones(len(train)), *(X[:, i] / scale[i] for i in used)])
    coef, _ = nnls(A, y)
    constants = {"base": float(coef[0])} | {FEATURES[i]: float(coef[j + 1] / scale[i]) for j, i in enumerate(used)}
    # a feature constant over the fitted points is inside the base: predictions hold for that value of it only
    out = Fit(phase, constants, [FEATURES[i] for i in range(len(FEATURES)) if i not in used], train, test)
    for p in test:
        out.errors.append(out.predict(p.features) / p.seconds_per_token - 1.0)
    return out


def fit_all(points: list[Point]) -> dict[str, Fit]:
    return {ph: fit(points, ph) for ph in PHASES if sum(p.phase == ph for p in points) >= 2}
