"""pyperf-style summaries of raw repetitions: the one definition every table, report and profile uses."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

CV_WARN = 0.05      # a cell whose repetitions vary more than this is called unstable


def stats(values) -> dict:
    """pyperf-style summary of raw repetitions."""
    a = np.asarray(list(values), dtype=float)
    n = len(a)
    mean = float(a.mean()) if n else float("nan")
    std = float(a.std(ddof=1)) if n > 1 else float("nan")
    return {"n": n, "median": float(np.median(a)) if n else float("nan"), "mean": mean, "std": std,
            "cv": std / mean if n > 1 and mean else float("nan"),
            "min": float(a.min()) if n else float("nan"), "max": float(a.max()) if n else float("nan")}


def within_cv(*groups: Mapping) -> float:
    """Pooled spread of the samples within their groups (one group: one process), as the standard deviation of
    their logarithms (about the CV): the noise a process adds, before processes and time differ. NaN without a
    group of two or more."""
    logs = [x for g in groups for x in _logs(g).values() if len(x) > 1]
    dof = sum(len(x) - 1 for x in logs)
    return math.sqrt(sum(((x - x.mean()) ** 2).sum() for x in logs) / dof) if dof else math.nan


# --- ratios with their uncertainty: the one definition every table, report, plot, compare and --until uses --------

LEVEL = 0.95
VERDICTS = ("A faster", "B faster", "not distinguishable", "insufficient data")
ROUNDS_FOR_A_VERDICT = 3     # processes a side that give an interval with a usable t quantile (4.30 at 2 dof)


@dataclass(frozen=True)
class RatioInterval:
    """A / B with a confidence interval (see ratio_interval). `ratio` is the headline and the centre of the interval
    (on a log scale): the geometric mean of the paired per-round ratios, or the ratio of the geometric means of the
    processes; `median_ratio` is median(A) / median(B) over every sample, a column beside it. `unit` names what the
    interval's units were: "rounds (paired)", "rounds (paired, two-stage)", "rounds"; `n` how many of them per side
    (pairs when paired). Without an interval (low, high NaN) the verdict is "insufficient data" and `note` says why."""
    ratio: float
    low: float
    high: float
    n: int
    unit: str
    verdict: str
    median_ratio: float = math.nan
    note: str = ""

    @property
    def half_width(self) -> float:
        """Relative half-width of the interval, sqrt(high / low) - 1 (0.03 = about ±3 %); NaN without one."""
        return math.sqrt(self.high / self.low) - 1 if self.low > 0 and self.high == self.high else math.nan

    def text(self) -> str:
        """'1.12x (0.93–1.31)' for people."""
        if self.ratio != self.ratio:
            return ""
        ci = f" ({fmt_ratio(self.low)}–{fmt_ratio(self.high)})" if self.low == self.low else ""
        return f"{fmt_ratio(self.ratio)}x{ci}"


def fmt_ratio(v: float) -> str:
    """A ratio for people: two decimals in the usual range, two significant digits far outside it."""
    return f"{v:.2f}" if 0.1 <= abs(v) < 100 else f"{v:.2g}"


def _t(dof: float, level: float) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, dof))


def _welch_half(x: np.ndarray, y: np.ndarray, level: float) -> float:
    """Half-width of Welch's t interval of mean(x) - mean(y) (unequal variances, Welch-Satterthwaite dof)."""
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    if vx + vy == 0:
        return 0.0
    dof = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    return _t(dof, level) * math.sqrt(vx + vy)


def _logs(groups: Mapping) -> dict:
    """{group: log of each positive finite sample}, empty groups dropped."""
    out = {}
    for k, vs in groups.items():
        a = np.asarray(list(vs), dtype=float)
        a = a[np.isfinite(a) & (a > 0)]
        if len(a):
            out[k] = np.log(a)
    return out


def _round_order(k) -> tuple:
    """Rounds in the order they ran: 1 < 2 < 10, "run/2" < "run/10"."""
    s = str(k)
    digits = len(s) - len(s.rstrip("0123456789"))
    return s[:len(s) - digits], int(s[len(s) - digits:]) if digits else -1, s


def paired_log_ratios(a: Mapping, b: Mapping) -> np.ndarray:
    """Per round both sides have, in round order: mean log of A's samples minus mean log of B's (the round's log
    ratio; the unit of a paired interval and of --until's pilot)."""
    la, lb = _logs(a), _logs(b)
    return np.array([la[k].mean() - lb[k].mean() for k in sorted(set(la) & set(lb), key=_round_order)])


def stein_rounds(s0: float, pilot: int, target: float, level: float = LEVEL) -> int:
    """Rounds in all that Stein's two-stage rule asks of a pair whose `pilot` rounds' log ratios have standard
    deviation s0: the fewest n >= pilot with t(pilot - 1) * s0 / sqrt(n) <= log(1 + target), so the interval
    ratio_interval(..., pilot=pilot) gives after n rounds is within ±target."""
    h = math.log1p(target)
    return max(pilot, math.ceil((_t(pilot - 1, level) * s0 / h) ** 2))


def _one_process_note(pa: int, pb: int) -> str:
    """Why a ratio of pa vs pb processes has no interval, and what would give one."""
    if not pa or not pb:
        return "no samples on one side"
    return (f"{pa} process{'es' if pa > 1 else ''} vs {pb}: a single process shows only the noise within it, not how "
            f"two processes of one build differ (its repetitions are not independent runs); --rounds "
            f"{ROUNDS_FOR_A_VERDICT} or more (compare: runs of {ROUNDS_FOR_A_VERDICT} or more rounds) give a verdict")


def ratio_interval(a: Mapping, b: Mapping, paired: bool = False, level: float = LEVEL,
                   higher_is_better: bool = True, pilot: int | None = None) -> RatioInterval:
    """A / B with a `level` interval and a verdict, from raw samples grouped by what is independent:
    a, b = {group: samples}, a group being one process (a round of a cell; the repetitions measured in it).

    The units are processes, never repetitions: two processes of one build differ by a few percent (memory layout,
    placement, the machine's state when each ran), and repetitions within one process see none of that, so an
    interval over them claims far more than it knows. Timings are skewed and multiplicative: logs; each process
    contributes the mean log of its samples. A t interval, not a bootstrap: a percentile bootstrap of 3 rounds can
    only return averages of those 3 values and covers the truth far less often than it claims; the t quantile
    (4.30 at 2 degrees of freedom) pays for the few units instead, and is exact for normal noise at any size.
    - `paired` (round r of A and of B ran in the same stretch of time: interleaved rounds, --interleave's turns):
      the t interval of the per-round log ratios d over the rounds both have, so drift the two saw together
      cancels. Centre: mean(d), the headline exp(mean(d)) is the geometric mean of the round ratios.
    - `pilot` (an --until run, harness.run.until): Stein's two-stage interval. The rounds after the first
      `pilot` were chosen from s0, the standard deviation of those pilot rounds' d alone, so the interval is
      mean(d over all n) ± t(pilot - 1) * s0 / sqrt(n): with normal noise the pilot's s0 is independent of every
      round's mean, so (mean - true) * sqrt(n) / s0 is Student t with pilot - 1 dof whatever n the rule chose.
    - unpaired (separate runs, back-to-back rounds): Welch's interval of the difference of the mean process logs.
    - fewer than 2 processes a side: no interval, verdict "insufficient data", and `note` says why.
    Verdict: "A faster" or "B faster" when the interval excludes 1 (for higher_is_better=False, e.g. ns, a ratio
    above 1 means A is slower), else "not distinguishable"."""
    la, lb = _logs(a), _logs(b)
    va, vb = (np.concatenate(list(g.values())) if g else np.array([]) for g in (la, lb))
    median_ratio = float(np.median(np.exp(va)) / np.median(np.exp(vb))) if len(va) and len(vb) else math.nan
    ma, mb = (np.array([x.mean() for x in g.values()]) for g in (la, lb))
    d = paired_log_ratios(a, b) if paired else np.array([])
    if len(d) >= 2:
        centre, n = float(d.mean()), len(d)
        if pilot and n >= pilot:
            half = _t(pilot - 1, level) * float(d[:pilot].std(ddof=1)) / math.sqrt(n)
            unit = "rounds (paired, two-stage)"
        else:
            half, unit = _t(n - 1, level) * float(d.std(ddof=1)) / math.sqrt(n), "rounds (paired)"
    elif len(ma) >= 2 and len(mb) >= 2:
        centre, n, unit = float(ma.mean() - mb.mean()), min(len(ma), len(mb)), "rounds"
        half = _welch_half(ma, mb, level)
    else:
        centre = float(ma.mean() - mb.mean()) if len(ma) and len(mb) else math.nan
        n = min(len(ma), len(mb))
        return RatioInterval(math.exp(centre), math.nan, math.nan, n, "process" if n == 1 else "processes",
                             VERDICTS[3], median_ratio, _one_process_note(len(ma), len(mb)))
    low, high = math.exp(centre - half), math.exp(centre + half)
    if low > 1 or high < 1:
        verdict = VERDICTS[0] if (low > 1) == higher_is_better else VERDICTS[1]
    else:
        verdict = VERDICTS[2]
    return RatioInterval(math.exp(centre), low, high, n, unit, verdict, median_ratio)
