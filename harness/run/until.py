"""`moebench sweep --until 3%`: how many rounds the ratios a table compares need, by Stein's two-stage rule.

The compared ratios are those of the cells of one model x depth (x node): every pair of engines (and knob variants)
there, per workload. Round r of both cells ran in the same stretch of time, so a pair's unit is the round's log
ratio d (harness.stats.paired_log_ratios).

Why not "run rounds until the interval is narrow": stopping when the data happen to look precise picks the runs
whose spread was underestimated, so the intervals that stop early cover the truth far less often than 95 % (in a
simulation with the noise of separate processes, 63 % of the pairs that stopped at round 3). Stein's two-stage rule
decides the number of rounds once, from a pilot, and never looks again:
1. a pilot of PILOT (or the sweep's planned rounds, if more) interleaved rounds gives s0, the standard deviation
   of the pair's d over the pilot rounds;
2. the pair runs n = max(pilot, ceil((t(pilot - 1) * s0 / log(1 + target))^2)) rounds in all (harness.stats.
   stein_rounds), at most --max-rounds (none started after --max-minutes);
3. its interval is mean(d over the n rounds) ± t(pilot - 1) * s0 / sqrt(n) (harness.stats.ratio_interval with
   pilot=...), which every reader of the run computes the same way from run.json["until"]["pilot"].
With normal noise in log space the pilot's s0 is independent of the mean of any set of rounds, and n is a function
of the pilots' spreads alone (a cell's n is the largest its pairs ask, so one pair's n may follow another pair's
s0: still the pilot's spreads, which are independent of every mean), so (mean - true) * sqrt(n) / s0 is Student t
with pilot - 1 degrees of freedom: the coverage is exact, stopping included; a pair that reaches --max-rounds keeps
its coverage and only misses the width (its achieved half-width is reported).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from harness.run.spec import Cell
from harness.stats import paired_log_ratios, ratio_interval, stein_rounds, within_cv

# Pilot rounds. The interval keeps the pilot's degrees of freedom to the end, so a small pilot costs at every
# size: t(2) = 4.30 against t(4) = 2.78 makes a pair that reaches --max-rounds 1.55x wider, and a pair whose rounds
# spread 4.5 % needs 43 rounds for ±3 % after a pilot of 3, 18 after a pilot of 5.
PILOT = 5


@dataclass
class Pair:
    a: str              # cell ids
    b: str
    workload: str
    rounds: int         # paired rounds so far
    s0: float           # spread of the per-round log ratio over the pilot rounds (NaN until the pilot ran)
    needed: int         # rounds Stein's rule asks for, in all (the pilot until it ran)
    half_width: float   # relative half-width of the 95 % interval so far (NaN before the pilot ran)
    cv_within: float    # pooled spread of the repetitions within a process, both cells

    @property
    def reached(self) -> bool:
        return self.rounds >= self.needed and self.s0 == self.s0

    def why(self) -> str:
        """Where the remaining width comes from, and what would narrow it."""
        if self.s0 != self.s0:
            return f"its pilot did not finish ({self.rounds} of {self.needed} rounds): more --max-minutes"
        within = "n/a with one repetition a round" if self.cv_within != self.cv_within else f"{self.cv_within:.1%}"
        need = f"it needs {self.needed} rounds; "
        if self.cv_within != self.cv_within or self.s0 > self.cv_within:
            return (f"{need}the rounds disagree ({self.s0:.1%} between processes vs {within} within one): more "
                    f"rounds (--max-rounds), or a quieter machine")
        return (f"{need}the repetitions within a process spread {self.cv_within:.1%} (vs {self.s0:.1%} between "
                f"processes): more repetitions per round (-r), or a quieter machine")


def plan(ga: dict, gb: dict, pilot: int, target: float) -> tuple[float, int]:
    """(s0, rounds needed in all) of one pair from its rounds so far ({round: samples} a side): Stein's rule on the
    first `pilot` paired rounds; (NaN, pilot) until they ran."""
    d = paired_log_ratios(ga, gb)
    if len(d) < pilot:
        return math.nan, pilot
    s0 = float(np.std(d[:pilot], ddof=1))
    return s0, stein_rounds(s0, pilot, target)


def _groups(part_list: list[tuple], workload: str) -> dict[int, list[float]]:
    """{round: tok/s} of one cell's rounds so far (run_cell results in round order)."""
    return {k + 1: [m["tokens_per_s"] for m in ms if m["workload"] == workload]
            for k, (_, ms, _) in enumerate(part_list)}


def pairs(cells: list[Cell], parts: dict[str, list[tuple]], target: float, pilot: int) -> list[Pair]:
    """Every compared pair of ok cells, per workload, with the rounds it needs and its interval so far."""
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
                s0, needed = plan(ga, gb, pilot, target)
                rounds = len(paired_log_ratios(ga, gb))
                half = ratio_interval(ga, gb, paired=True, pilot=pilot).half_width if rounds >= pilot else math.nan
                out.append(Pair(ca.cell_id, cb.cell_id, wl, rounds, s0, needed, half, within_cv(ga, gb)))
    return out


def rounds_wanted(ps: list[Pair], cap: int) -> dict[str, int]:
    """{cell id: rounds it runs in all}: the most any of its pairs needs, at most cap."""
    out: dict[str, int] = {}
    for p in ps:
        for c in (p.a, p.b):
            out[c] = max(out.get(c, 0), min(p.needed, cap))
    return out
