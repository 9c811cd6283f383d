"""harness.stats.ratio_interval: units, centre, verdicts and edge cases; why not a bootstrap. Coverage on simulated
sweeps with process noise is tests/test_coverage.py.

A simulated sweep here: two cells A and B measured in R rounds of m repetitions, the machine's drift shared by both
cells in a round, every process at its own speed, every repetition with its own noise."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.stats import RatioInterval, paired_log_ratios, ratio_interval, stein_rounds

DRIFT, PROCESS, REP = 0.05, 0.02, 0.02       # log-sd: between rounds (shared), per process, per repetition
RUNS = 1000


def sweep(rng, rounds: int, reps: int, true: float) -> tuple[dict, dict]:
    drift = rng.normal(0, DRIFT, rounds)

    def cell(shift: float) -> dict:
        out = {}
        for r in range(rounds):
            out[r] = list(100 * np.exp(shift + drift[r] + rng.normal(0, PROCESS) + rng.normal(0, REP, reps)))
        return out
    return cell(math.log(true)), cell(0.0)


def test_percentile_bootstrap_of_three_rounds_undercovers():
    """Why not scipy's bootstrap here: resampling 3 per-round log ratios can only return averages of those 3 values,
    so its 95 % interval is too narrow; on the same simulated sweeps it covers the truth about 3 times in 4."""
    rng = np.random.default_rng(7)
    covered = 0
    for _ in range(RUNS):
        a, b = sweep(rng, 3, 1, 1.0)
        d = np.array([math.log(a[r][0] / b[r][0]) for r in range(3)])
        lo, hi = np.percentile(rng.choice(d, size=(2000, 3)).mean(axis=1), [2.5, 97.5])
        covered += lo <= 0 <= hi
    print(f"\npercentile bootstrap, 3 rounds: coverage {covered / RUNS:.3f}")
    assert covered / RUNS < 0.85


def test_units_centre_verdicts_and_edge_cases():
    # rounds pair only when asked and present on both sides
    a = {1: [110.0, 111.0], 2: [99.0, 100.0], 3: [120.0, 121.0]}
    b = {1: [100.0, 101.0], 2: [90.0, 91.0], 3: [109.0, 110.0]}
    paired, unpaired = ratio_interval(a, b, paired=True), ratio_interval(a, b)
    assert (paired.unit, paired.n, unpaired.unit) == ("rounds (paired)", 3, "rounds")
    assert paired.verdict == "A faster" and unpaired.verdict == "not distinguishable"
    # the headline is the interval's centre: the geometric mean of the round ratios (paired), the ratio of the
    # processes' geometric means (unpaired); the median ratio is a column of its own
    d = [np.log(a[k]).mean() - np.log(b[k]).mean() for k in (1, 2, 3)]
    assert paired.ratio == pytest.approx(math.exp(np.mean(d)))
    assert paired.ratio == pytest.approx(math.sqrt(paired.low * paired.high))
    assert unpaired.ratio == pytest.approx(math.sqrt(unpaired.low * unpaired.high)) == pytest.approx(paired.ratio)
    assert paired.median_ratio == pytest.approx(np.median([110, 111, 99, 100, 120, 121])
                                                / np.median([100, 101, 90, 91, 109, 110]))
    # lower is better (time): a ratio above 1 means A is slower
    assert ratio_interval(a, b, paired=True, higher_is_better=False).verdict == "B faster"
    # one process a side, however many repetitions: no interval, no verdict, and why
    one = ratio_interval({1: [100.0, 102.0, 101.0]}, {1: [50.0, 51.0, 52.0]})
    assert one.verdict == "insufficient data" and one.low != one.low and (one.n, one.unit) == (1, "process")
    assert "--rounds 3 or more" in one.note and "not independent" in one.note
    assert one.ratio == pytest.approx(math.exp(np.log([100, 102, 101]).mean() - np.log([50, 51, 52]).mean()))
    # one process on one side only: still none (the other side's processes say nothing about this one's)
    assert ratio_interval(a, {1: [100.0, 101.0]}).verdict == "insufficient data"
    # nothing usable (zeros, NaN) counts as nothing
    for x, y in [({1: [0.0, float("nan")]}, b), ({}, b)]:
        iv = ratio_interval(x, y)
        assert iv.verdict == "insufficient data" and iv.low != iv.low and iv.note == "no samples on one side"
    # identical processes: a zero-width interval at the ratio
    same = ratio_interval({1: [5.0], 2: [5.0]}, {1: [5.0], 2: [5.0]}, paired=True)
    assert (same.low, same.high, same.verdict) == (1.0, 1.0, "not distinguishable")


def test_rounds_pair_in_the_order_they_ran():
    """The pilot of a two-stage interval is the first rounds that ran: round 10 after round 2."""
    a = {k: [100.0 * (1 + 0.01 * (k % 3))] for k in range(1, 12)}
    b = {k: [100.0] for k in range(1, 12)}
    d = paired_log_ratios(a, b)
    assert d[:3] == pytest.approx(np.log([1.01, 1.02, 1.0]))
    assert list(paired_log_ratios({f"r/{k}": v for k, v in a.items()}, {f"r/{k}": v for k, v in b.items()})) == list(d)


def test_two_stage_interval_and_rounds():
    """Stein: the interval after n rounds is mean(d) ± t(pilot - 1) * s0 / sqrt(n), s0 from the pilot alone; the
    rounds asked are the fewest that bring it within the target."""
    from scipy.stats import t

    rng = np.random.default_rng(3)
    d = rng.normal(0.02, 0.03, 9)
    a, b = {k + 1: [100 * math.exp(x)] for k, x in enumerate(d)}, {k + 1: [100.0] for k in range(9)}
    iv = ratio_interval(a, b, paired=True, pilot=3)
    half = t.ppf(0.975, 2) * np.std(d[:3], ddof=1) / 3
    assert iv.unit == "rounds (paired, two-stage)" and iv.n == 9
    assert (math.log(iv.low), math.log(iv.high)) == pytest.approx((d.mean() - half, d.mean() + half))
    # fewer rounds than the pilot (a pair cut short): the plain t interval of what there is
    assert ratio_interval({1: [1.0], 2: [1.1]}, {1: [1.0], 2: [1.0]}, paired=True, pilot=3).unit == "rounds (paired)"
    s0, target = 0.04, 0.03
    n = stein_rounds(s0, 5, target)
    width = lambda k: math.exp(t.ppf(0.975, 4) * s0 / math.sqrt(k)) - 1
    assert width(n) <= target < width(n - 1)
    assert stein_rounds(0.0, 5, target) == 5 and stein_rounds(1e-4, 3, target) == 3


def test_text_and_half_width():
    iv = RatioInterval(1.1234, 0.9, 1.21, 3, "rounds (paired)", "not distinguishable")
    assert iv.text() == "1.12x (0.90–1.21)"
    assert iv.half_width == pytest.approx(math.sqrt(1.21 / 0.9) - 1)
    assert RatioInterval(1e9, 1e-3, 2e9, 2, "rounds", "").text() == "1e+09x (0.001–2e+09)"
    assert RatioInterval(float("nan"), float("nan"), float("nan"), 0, "", "insufficient data").text() == ""
