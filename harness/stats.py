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


@dataclass(frozen=True)
class RatioInterval:
    """A / B with a confidence interval. `ratio` is the headline, median(A) / median(B) over every sample; the
    interval comes from the same samples (see ratio_interval). `unit` names what was resampled: "rounds (paired)",
    "rounds" or "repetitions"; `n` how many of them per side (pairs when paired)."""
    ratio: float
    low: float
    high: float
    n: int
    unit: str
    verdict: str

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


def _t_interval(d: np.ndarray, level: float) -> tuple[float, float]:
    """Student t interval of the mean of d."""
    from scipy.stats import t

    half = float(t.ppf(0.5 + level / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    return float(d.mean()) - half, float(d.mean()) + half


def _welch_interval(x: np.ndarray, y: np.ndarray, level: float) -> tuple[float, float]:
    """Welch's t interval of mean(x) - mean(y) (unequal variances, Welch-Satterthwaite degrees of freedom)."""
    from scipy.stats import t

    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    diff = float(x.mean() - y.mean())
    if vx + vy == 0:
        return diff, diff
    dof = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    half = float(t.ppf(0.5 + level / 2, dof) * math.sqrt(vx + vy))
    return diff - half, diff + half


def _logs(groups: Mapping) -> dict:
    """{group: log of each positive finite sample}, empty groups dropped."""
    out = {}
    for k, vs in groups.items():
        a = np.asarray(list(vs), dtype=float)
        a = a[np.isfinite(a) & (a > 0)]
        if len(a):
            out[k] = np.log(a)
    return out


def ratio_interval(a: Mapping, b: Mapping, paired: bool = False, level: float = LEVEL,
                   higher_is_better: bool = True) -> RatioInterval:
    """A / B with a `level` interval and a verdict, from raw samples grouped by what is independent:
    a, b = {group: samples}, a group being one process (a round of a cell; the repetitions measured in it).

    A t interval on logarithms, not a bootstrap: a percentile bootstrap of 3 round means can only return ratios of
    those 3 values and covers the true ratio far less often than it claims; the t quantile (4.30 at 2 degrees of
    freedom) pays for the few samples instead. Timings are skewed and multiplicative, so logs. Which samples:
    - two or more groups a side: the groups are the units (each group's mean log); `paired` (the two cells ran
      round by round in the same sweep: round r of A and of B at the same time) takes the t interval of the
      per-round differences over the rounds both have, so drift the two saw together cancels; else Welch's
      interval of the difference of the group means;
    - one group a side: the repetitions are the units (Welch over them). They see the noise within a process, not
      between processes, and `unit` says so.
    Verdict: "A faster" or "B faster" when the interval excludes 1 (for higher_is_better=False, e.g. ns, a ratio
    above 1 means A is slower), else "not distinguishable"; "insufficient data" with fewer than 2 units a side."""
    la, lb = _logs(a), _logs(b)
    allv = lambda g: np.concatenate(list(g.values())) if g else np.array([])
    va, vb = allv(la), allv(lb)
    ratio = float(np.median(np.exp(va)) / np.median(np.exp(vb))) if len(va) and len(vb) else math.nan
    common = sorted(set(la) & set(lb), key=str)
    if paired and len(common) >= 2:
        d = np.array([la[k].mean() - lb[k].mean() for k in common])
        lo, hi = _t_interval(d, level)
        n, unit = len(d), "rounds (paired)"
    elif len(la) >= 2 and len(lb) >= 2:
        lo, hi = _welch_interval(np.array([g.mean() for g in la.values()]),
                                 np.array([g.mean() for g in lb.values()]), level)
        n, unit = min(len(la), len(lb)), "rounds"
    elif len(va) >= 2 and len(vb) >= 2:
        lo, hi = _welch_interval(va, vb, level)
        n, unit = min(len(va), len(vb)), "repetitions"
    else:
        return RatioInterval(ratio, math.nan, math.nan, min(len(va), len(vb)), "", VERDICTS[3])
    low, high = math.exp(lo), math.exp(hi)
    if low > 1 or high < 1:
        a_higher = low > 1
        verdict = VERDICTS[0] if a_higher == higher_is_better else VERDICTS[1]
    else:
        verdict = VERDICTS[2]
    return RatioInterval(ratio, low, high, n, unit, verdict)
