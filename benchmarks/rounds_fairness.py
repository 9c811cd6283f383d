"""Does a sweep compare engines fairly on a drifting machine? llama-bench against the llama-cpp engine (the same
llama.cpp commit and settings: they should agree within a few percent), in N sweeps one after the other.

Each sweep is `moebench sweep -m preset:small -e llama-bench,llama-cpp --n-cpu-moe 0,all -w pp256,tg32 -r 6
--rounds 3 --threads 2` in one round order (interleaved: every cell's round r before any cell's round r+1;
back-to-back: each cell's rounds in a row, the order before). Prints, per sweep, the llama-bench / llama-cpp ratio
for each of the 4 cells (the ratio every table prints, harness.stats.ratio_interval's centre: the geometric mean of
the paired round ratios when interleaved, the ratio of the rounds' geometric means when back-to-back), the spread
between rounds vs within a process, the load average before the sweep, and a verdict: every ratio within
--tolerance (5 %) of 1.0 in every sweep.

    .venv/bin/moebench tools build-llama-bench             # once
    .venv/bin/python benchmarks/rounds_fairness.py --order interleaved
    .venv/bin/python benchmarks/rounds_fairness.py --order back-to-back
    .venv/bin/python benchmarks/rounds_fairness.py --tabulate results/rounds_fairness/<run_id> ...   # no sweeps

Before each sweep it waits for a quiet minute: the 1-minute load average below --max-load and all processes together
using less than --max-busy of the CPUs (other jobs on a shared machine are not the drift this is about; a 2-thread
llama.cpp on 2 cores slows several-fold when anything else wants a core), at most --max-wait seconds in all; then it
runs anyway and says so. Each row also says how busy the machine was *during* the sweep: `others %` is the CPU time
the kernel counted (/proc/stat: every process, other containers' too) minus this sweep's own (its process tree),
over cores x wall time; `steal %` what the hypervisor took.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.store import results  # noqa: E402

A, B = "llama-bench", "llama-cpp"


def _cpu_s() -> tuple[float, float, float]:
    """(busy seconds of every CPU, stolen seconds, this process's children's CPU seconds) so far."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    user, nice, system, _, _, irq, softirq, steal = f
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz, ru.ru_utime + ru.ru_stime


def wait_quiet(max_load: float, max_busy: float, deadline: float, window_s: float = 60) -> float:
    """Wait until, over the last window_s, the 1-minute load average stayed below max_load and every process on
    the machine used less than max_busy of its CPUs (or the deadline passes); returns the load average then."""
    seen: list[tuple[float, float, bool]] = []           # (time, busy seconds so far, load below max_load)
    while True:
        now, (busy, _, _) = time.time(), _cpu_s()
        seen = [x for x in seen if now - x[0] <= window_s] + [(now, busy, os.getloadavg()[0] < max_load)]
        span = now - seen[0][0]
        if span >= window_s * 0.9 and all(ok for *_, ok in seen) \
                and (busy - seen[0][1]) / (span * (os.cpu_count() or 1)) < max_busy:
            return os.getloadavg()[0]
        if now >= deadline:
            return os.getloadavg()[0]
        time.sleep(5)


def sweep(args, order: str) -> tuple[Path, dict]:
    """Run one sweep; (its run directory, {"others": CPU share other processes used during it, "steal": ...})."""
    cmd = [sys.executable, "-m", "harness", "sweep", "-m", args.model, "-e", f"{A},{B}", "--n-cpu-moe", "0,all",
           "-w", "pp256,tg32", "-r", str(args.repetitions), "--rounds", str(args.rounds), "--round-order", order,
           "--threads", str(args.threads), "--results-dir", str(args.results_dir), "--format", "csv"]
    (busy0, steal0, ours0), t0 = _cpu_s(), time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (busy1, steal1, ours1), wall = _cpu_s(), time.time() - t0
    if p.returncode != 0:
        sys.exit(f"sweep failed ({p.returncode}):\n{p.stderr[-3000:]}")
    capacity = wall * (os.cpu_count() or 1)
    load = {"others": max(0.0, (busy1 - busy0) - (ours1 - ours0)) / capacity, "steal": (steal1 - steal0) / capacity,
            "wall_s": wall}
    return Path(p.stderr.strip().splitlines()[-1].removeprefix("results: ")), load


def ratios(run_dir: Path) -> dict:
    """{(n_cpu_moe label, workload): llama-bench / llama-cpp as every table prints it} plus the run's spread
    figures."""
    from harness.analysis.report import Intervals

    run, cells, meas, _ = results.load_frames(run_dir)
    s = results.summarize(cells, meas)
    bad = s[s["status"] != "ok"]
    if not bad.empty:
        sys.exit(f"{run_dir}: failed cells: {bad[['engine', 'n_cpu_moe', 'error']].to_dict('records')}")
    interval = Intervals(cells, meas, [run])           # paired or not as run.json's round order says
    out = {(str(r["depth"]), r["workload"]): interval(A, B, r["n_cpu_moe"], r["workload"]).ratio
           for r in s.to_dict("records") if r["engine"] == A}
    return {"run": run["run_id"], "order": (run.get("rounds") or {}).get("order", "?"), "ratios": out,
            "cv_rounds": float(s["tps_cv_rounds"].median()), "cv_within": float(s["tps_cv_within"].median()),
            "speed": results.round_speed(meas)}


def table(rows: list[dict], tolerance: float) -> bool:
    cols = [(d, w) for d in ("0", "all") for w in ("pp256", "tg32")]
    print(f"\nllama-bench / llama-cpp per cell, centre of the 95% interval ({rows[0]['order']} rounds)")
    print(f"{'run':>3} {'order':>12} " + " ".join(f"{w + '@' + d:>10}" for d, w in cols)
          + f" {'cv% rounds':>10} {'cv% proc':>8} {'load':>5} {'others%':>7} {'steal%':>6}  speed by round  verdict")
    ok_all = True
    for i, r in enumerate(rows, 1):
        ok = all(abs(r["ratios"][c] - 1) <= tolerance for c in cols)
        ok_all &= ok
        speed = " ".join(f"{v:.2f}" for v in r["speed"].values())
        print(f"{i:>3} {r['order']:>12} " + " ".join(f"{r['ratios'][c]:>10.3f}" for c in cols)
              + f" {100 * r['cv_rounds']:>10.1f} {100 * r['cv_within']:>8.1f} {r.get('load', float('nan')):>5.2f}"
              + f" {100 * r.get('others', float('nan')):>7.1f} {100 * r.get('steal', float('nan')):>6.1f}"
              + f"  {speed:<14}  {'within' if ok else 'OUTSIDE'} {tolerance:.0%}   {r['run']}")
    worst = max(abs(r["ratios"][c] - 1) for r in rows for c in cols)
    print(f"verdict: {'PASS' if ok_all else 'FAIL'}: {'every' if ok_all else 'not every'} ratio within "
          f"{tolerance:.0%} of 1.0 in {len(rows)} runs (largest deviation {worst:.1%})")
    return ok_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", choices=["interleaved", "back-to-back"], default="interleaved")
    ap.add_argument("-n", "--runs", type=int, default=5)
    ap.add_argument("-m", "--model", default="preset:small")
    ap.add_argument("-r", "--repetitions", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--max-load", type=float, default=2.5)
    ap.add_argument("--max-busy", type=float, default=0.15, help="CPU share all processes may use in the quiet minute")
    ap.add_argument("--max-wait", type=float, default=1800, help="seconds of waiting for quiet, in all")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "results" / "rounds_fairness")
    ap.add_argument("--tabulate", nargs="+", type=Path, help="print the table of these runs; run no sweeps")
    args = ap.parse_args()
    if args.tabulate:
        rows = [ratios(d) for d in args.tabulate]
    else:
        rows, deadline = [], time.time() + args.max_wait
        for i in range(args.runs):
            load = wait_quiet(args.max_load, args.max_busy, deadline)
            run_dir, busy = sweep(args, args.order)
            r = ratios(run_dir) | {"load": load} | busy
            print(f"run {i + 1}/{args.runs}: {r['run']} in {busy['wall_s']:.0f} s, load before {load:.2f}, "
                  f"other processes {busy['others']:.0%} of the CPUs during it"
                  f"{' (not quiet: waited long enough)' if load >= args.max_load else ''}", file=sys.stderr)
            rows.append(r)
        out = args.results_dir / f"fairness-{args.order}-{time.strftime('%Y%m%dT%H%M%S')}.json"
        out.write_text(json.dumps([r | {"ratios": {f"{w}@{d}": v for (d, w), v in r["ratios"].items()}}
                                   for r in rows], indent=2))
        print(f"table data: {out}", file=sys.stderr)
    sys.exit(0 if table(rows, args.tolerance) else 1)


if __name__ == "__main__":
    main()
