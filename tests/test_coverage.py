"""Do the 95 % intervals hold? Simulated sweeps with the noise of separate processes, 1000 per case, through the
functions every table, report and compare use (harness.stats.ratio_interval, harness.store.history.pairing) and the
one --until decides its rounds with (harness.run.until.plan).

A simulated sweep: cells A and B, each round one fresh process per cell with REPS repetitions. Log speed of a
repetition = the cell's true log speed + the machine's drift in that stretch of time (DRIFT, shared by A and B
when their rounds are interleaved, separate when back-to-back) + the process's own offset (PROCESS: two processes
of one build differ by a few %, independent per process and side) + the repetition's noise (REP). A's true speed
is B's times TRUE. Fixed seeds: the fractions below are the same on every run of the test; each band is about
±3 standard errors of a 1000-run fraction around 95 %.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.run.until import PILOT, plan
from harness.run.spec import SweepSpec
from harness.stats import ratio_interval
from harness.store.history import pairing

DRIFT, PROCESS, REP, REPS = 0.05, 0.03, 0.02, 2       # log-sd; repetitions per round
RUNS, TRUE = 1000, 1.05
BAND = (0.93, 0.97)
INTERLEAVED, BACK_TO_BACK = (pairing({"rounds": {"order": order}}) for order in ("interleaved", "back-to-back"))


def sweeps(seed: int, rounds: int, true: float, interleaved: bool = True, reps: int = REPS,
           skewed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """RUNS simulated sweeps of `rounds` rounds: tok/s of A and B, shape (RUNS, rounds, reps). `skewed`: each
    repetition's noise is a gamma(2) slowdown (mostly small, a long tail of slow repetitions) instead of normal."""
    rng = np.random.default_rng(seed)
    shape, each = (RUNS, rounds, 1), (RUNS, rounds, reps)
    drift_a = rng.normal(0, DRIFT, shape)
    drift_b = drift_a if interleaved else rng.normal(0, DRIFT, shape)

    def noise() -> np.ndarray:
        return -(rng.gamma(2.0, REP / math.sqrt(2), each) - math.sqrt(2) * REP) if skewed else rng.normal(0, REP, each)

    def cell(log_speed: float, drift: np.ndarray) -> np.ndarray:
        return np.exp(log_speed + drift + rng.normal(0, PROCESS, shape) + noise())
    return cell(math.log(100 * true), drift_a), cell(math.log(100), drift_b)


def groups(x: np.ndarray) -> dict[int, list[float]]:
    """One cell's rounds as the readers get them (results.round_groups): {round: its repetitions}."""
    return {r + 1: list(v) for r, v in enumerate(x)}


def rate(ivs, event) -> float:
    return sum(map(event, ivs)) / len(ivs)


def check(ivs_true, ivs_equal, label: str) -> None:
    """Coverage of TRUE, 'not distinguishable' for equal engines, and the headline inside its interval."""
    covered = rate(ivs_true, lambda iv: iv.low <= TRUE <= iv.high)
    same = rate(ivs_equal, lambda iv: iv.verdict == "not distinguishable")
    print(f"\n{label}: coverage {covered:.3f}, equal engines not distinguishable {same:.3f}, "
          f"median half-width {np.median([iv.half_width for iv in ivs_true]):.3f} ({ivs_true[0].unit})")
    assert BAND[0] <= covered <= BAND[1], (label, covered)
    assert BAND[0] <= same <= BAND[1], (label, same)
    assert all(iv.low <= iv.ratio <= iv.high for iv in ivs_true + ivs_equal)


@pytest.mark.parametrize("rounds,order,skewed", [(3, "interleaved", False), (5, "interleaved", False),
                                                  (3, "interleaved", True), (3, "back-to-back", False),
                                                  (5, "back-to-back", False)])
def test_fixed_rounds_cover_95_percent(rounds, order, skewed):
    """Interleaved rounds pair (t interval on the per-round log ratios, rounds - 1 dof); back-to-back rounds ran at
    different times and do not (Welch over the processes' mean logs)."""
    how = INTERLEAVED if order == "interleaved" else BACK_TO_BACK
    out = []
    for true, seed in ((TRUE, 1), (1.0, 2)):
        a, b = sweeps(100 * rounds + 10 * skewed + seed, rounds, true, order == "interleaved", skewed=skewed)
        out.append([ratio_interval(groups(x), groups(y), **how) for x, y in zip(a, b)])
    assert out[0][0].unit == ("rounds (paired)" if order == "interleaved" else "rounds")
    check(*out, f"{rounds} rounds {order}{', skewed repetitions' if skewed else ''}")


def until(seed: int, true: float, target: float, cap: int) -> tuple[list, list[int]]:
    """--until target: the pilot's rounds, then as many rounds as harness.run.until.plan asks (at most cap),
    then the interval every reader computes (run.json's pilot); the intervals and each run's rounds."""
    a, b = sweeps(seed, cap, true)
    how = pairing({"rounds": {"order": "interleaved"}, "until": {"pilot": PILOT}})     # run.json as the sweep writes it
    ivs, used = [], []
    for x, y in zip(a, b):
        _, needed = plan(groups(x[:PILOT]), groups(y[:PILOT]), PILOT, target)
        n = min(needed, cap)
        ivs.append(ratio_interval(groups(x[:n]), groups(y[:n]), **how))
        used.append(n)
    return ivs, used


@pytest.mark.parametrize("target", [0.03, 0.05])
def test_until_covers_95_percent_with_the_stopping_included(target):
    """Stein's two-stage rule: the pilot's spread alone fixes the rounds and scales the interval, so 95 % of the
    intervals cover, stopping included, whether a pair stopped after its pilot or ran to --max-rounds (the old rule,
    stop once the interval looks narrow, looked again after every round and covered 91 %)."""
    cap = SweepSpec.max_rounds
    (ivs, used), (ivs_equal, _) = (until(int(1000 * target) + s, true, target, cap) for s, true in ((1, TRUE),
                                                                                                    (2, 1.0)))
    check(ivs, ivs_equal, f"--until {target:.0%} (max {cap} rounds)")
    assert ivs[0].unit == "rounds (paired, two-stage)"
    early, capped = used.count(PILOT), used.count(cap)
    print(f"rounds: {early} runs stopped after the pilot of {PILOT}, {RUNS - early - capped} in between, "
          f"{capped} ran to the cap")
    assert early >= 50 and capped >= 50 and early + capped < RUNS           # the rule did decide, run by run
    assert all(iv.half_width <= target + 1e-9 for iv, n in zip(ivs, used) if n < cap)    # and got the width


def test_one_process_a_side_gives_no_verdict():
    """One process a side (--rounds 1, or compare between single-process runs): its 6 repetitions show only the
    noise within a process; an interval over them covered 59 % and called equal engines different 41 % of the
    time. No interval, no verdict, and the note says what would give one."""
    a, b = sweeps(7, 1, 1.0, reps=6)
    for x, y in zip(a, b):
        iv = ratio_interval(groups(x), groups(y), **INTERLEAVED)
        assert iv.verdict == "insufficient data" and iv.low != iv.low and "--rounds 3" in iv.note, iv
        assert iv.ratio == pytest.approx(math.exp(np.log(x).mean() - np.log(y).mean()))
