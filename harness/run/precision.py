"""`moebench sweep --until 3%`: which cells need another round for the ratios a table compares to be precise.

The compared ratios are those of the cells of one model x depth (x node): every pair of engines (and knob variants)
there, per workload, as harness.stats.ratio_interval computes them from the rounds measured so far (round r of both
cells ran in the same stretch of time, so the rounds pair). A pair is precise when its interval's relative
half-width is within the target. A cell runs another round while any pair it is in is not precise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from harness.run.spec import Cell
from harness.stats import ratio_interval, within_cv


@dataclass
class Pair:
    a: str              # cell ids
    b: str
    workload: str
    half_width: float   # relative half-width of the 95 % interval (NaN: no interval yet)
    rounds: int
    cv_between: float   # spread of the per-round log ratio (processes and time)
    cv_within: float    # pooled spread of the repetitions within a process, both cells

    def why(self) -> str:
        """Where the remaining width comes from, and what would narrow it."""
        within = "n/a with one repetition a round" if self.cv_within != self.cv_within else f"{self.cv_within:.1%}"
        if self.cv_within != self.cv_within or self.cv_between > self.cv_within:
            return (f"the rounds disagree ({self.cv_between:.1%} between processes vs {within} within one): more "
                    f"rounds, or a quieter machine")
        return (f"the repetitions within a process spread {self.cv_within:.1%} (vs {self.cv_between:.1%} between "
                f"processes): more repetitions per round (-r), or a quieter machine")


def _groups(part_list: list[tuple], workload: str) -> dict[int, list[float]]:
    """{round: tok/s} of one cell's rounds so far (run_cell results in round order)."""
    return {k + 1: [m["tokens_per_s"] for m in ms if m["workload"] == workload]
            for k, (_, ms, _) in enumerate(part_list)}


def pairs(cells: list[Cell], parts: dict[str, list[tuple]]) -> list[Pair]:
    """Every compared pair of ok cells, per workload, with its interval's half-width so far."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        if parts.get(c.cell_id) and all(p[0]["status"] == "ok" for p in parts[c.cell_id]):
            groups.setdefault((str(c.model), c.settings.n_cpu_moe, c.node), []).append(c)
    out = []
    for g in groups.values():
        for ca, cb in combinations(g, 2):
            pa, pb = parts[ca.cell_id], parts[cb.cell_id]
            for wl in dict.fromkeys(m["workload"] for _, ms, _ in pa for m in ms):
                ga, gb = _groups(pa, wl), _groups(pb, wl)
                iv = ratio_interval(ga, gb, paired=True)
                d = [np.log(ga[k]).mean() - np.log(gb[k]).mean() for k in ga if k in gb and ga[k] and gb[k]]
                out.append(Pair(ca.cell_id, cb.cell_id, wl, iv.half_width, len(d),
                                float(np.std(d, ddof=1)) if len(d) > 1 else math.nan, within_cv(ga, gb)))
    return out


def imprecise(ps: list[Pair], target: float) -> list[Pair]:
    return [p for p in ps if not p.half_width <= target]        # NaN (no interval yet) is not precise
