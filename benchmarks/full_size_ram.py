"""Full-size gpt-oss-20b: each engine's anonymous RAM (the RAM it needs) against `moebench plan`'s host figure.

Synthesizes the full-size preset once into the model cache (11.5 GiB, ~15 minutes; `moebench model synth --preset
gpt-oss-20b` writes the same bytes; later runs reuse it), runs each engine at depth all on a short workload through
the normal `moebench sweep` (one sweep per engine, one process each, so the machine's used memory can be read per
engine), and prints per engine: plan's predicted anonymous MiB (uncalibrated: from the file's header and the cell's
settings), the measured peak anonymous RSS of the whole worker and above its runtime's anonymous floor, the error
of the prediction against each, the peak file-backed RSS beside plan's mapped bytes (page cache, not RAM the
engine needs), the peak RSS and how far the machine's used memory (MemTotal - MemAvailable: page cache is not used)
rose during the sweep (on a shared machine other processes move it too).

  .venv/bin/python benchmarks/full_size_ram.py [--max-error 5]

--max-error: exit 1 when a prediction is further than that many percent from the measured peak anonymous RSS
(tests/test_full_size_ram.py, a slow test, runs it so). Exit 77 (skipped) when the model is not synthesized and
its disk has no room for it.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
NO_ROOM = 77           # the exit status of a check that could not run (automake's "skipped")


def model_file(spec: str) -> Path:
    """The synthesized model of `spec` (preset:NAME[:DTYPE]), made now when the cache lacks it and its disk has
    room; else exit NO_ROOM saying so."""
    from engines.paths import cache_dir
    from workloads.synth import cached_model, preset_meta

    meta = preset_meta(spec)
    if not Path(meta.path).exists():
        cache_dir().mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(cache_dir()).free
        if free < meta.file_bytes + 2 * 2**30:
            print(f"{spec} takes {meta.file_bytes / 2**30:.1f} GiB and {cache_dir()} has {free / 2**30:.1f} GiB "
                  "free; free some space or set MOEBENCH_CACHE.", file=sys.stderr)
            sys.exit(NO_ROOM)
        print(f"synthesizing {spec} ({meta.file_bytes / 2**30:.1f} GiB) into {meta.path} ...", file=sys.stderr,
              flush=True)
    t0 = time.time()
    path = cached_model(spec)
    if time.time() - t0 > 1:
        print(f"synthesized in {time.time() - t0:.0f} s", file=sys.stderr)
    return path


def used_mib() -> float:
    """The machine's used memory: MemTotal - MemAvailable (page cache the kernel can drop is not used)."""
    kib = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")}
    return (kib["MemTotal"] - kib["MemAvailable"]) / 1024


class UsedPeak(threading.Thread):
    """The machine's peak used memory while a sweep runs, every 100 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.before, self.peak, self._stop_event = used_mib(), 0.0, threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, used_mib())
            self._stop_event.wait(0.1)

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return self.peak


def sweep(model: Path, engine: str, args) -> tuple[Path, list[str], UsedPeak]:
    """One `moebench sweep` of one engine; (run directory, the command, the machine's used memory)."""
    cmd = [sys.executable, "-m", "harness", "sweep", "-m", str(model), "-e", engine, "--n-cpu-moe", args.depth,
           "-w", args.workloads, "-r", "1", "--rounds", "1", "--threads", str(args.threads),
           "--results-dir", str(args.results_dir), "--format", "csv"]
    print("$ moebench", " ".join(cmd[3:]), file=sys.stderr, flush=True)
    used = UsedPeak()
    used.start()
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    used.stop()
    if r.returncode:
        raise SystemExit(f"sweep failed ({r.returncode}): {r.stderr[-2000:]}")
    return Path(r.stderr.strip().splitlines()[-1].removeprefix("results: ")), cmd, used


def rows(run_dir: Path, used: UsedPeak) -> list[dict]:
    """Per cell of the run: plan's prediction (the cell's settings, no calibration) against the measured peaks."""
    from engines.gguf_meta import read_meta
    from harness.planning.plan import PlanSettings, cell_settings, make_plan
    from harness.store import results

    out = []
    for c in results.read_csv(run_dir, "cells.csv"):
        if c["status"] != "ok":
            raise SystemExit(f"{c['engine']} did not finish ({c['status']}): {c['error'][:500]}")
        meta = read_meta(c["model"])
        d = make_plan(meta, cell_settings(PlanSettings(engine=c["engine"], device="cpu"), c)).at(int(c["n_cpu_moe"]))
        anon, above = float(c["peak_rss_anon_mib"]), float(c.get("peak_rss_anon_above_floor_mib") or "nan")
        pred = d.host_bytes / MIB
        out.append({"engine": c["engine"], "run": run_dir.name, "n_cpu_moe": int(c["n_cpu_moe"]),
                    "plan anon MiB": pred, "peak anon MiB": anon, "error %": 100 * (pred / anon - 1),
                    "anon above floor MiB": above, "error above floor %": 100 * (pred / above - 1),
                    "plan mapped MiB": d.mapped_bytes / MIB, "peak file-backed MiB": float(c["peak_rss_file_mib"]),
                    "peak RSS MiB": float(c["peak_rss_mib"]), "machine used +MiB": used.peak - used.before})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="preset:gpt-oss-20b", help="preset:NAME[:DTYPE] or a GGUF file")
    ap.add_argument("-e", "--engines", default="reference,llama-cpp")
    ap.add_argument("--depth", default="all", help="--n-cpu-moe of the cells")
    ap.add_argument("-w", "--workloads", default="pp64,tg4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", type=Path, default=ROOT / "results")
    ap.add_argument("--max-error", type=float, default=None, metavar="PCT",
                    help="exit 1 when a prediction misses the peak anonymous RSS by more than PCT percent")
    args = ap.parse_args()
    from harness.analysis.tables import render

    model = model_file(args.model) if args.model.startswith("preset:") else Path(args.model)
    table, cmds = [], []
    for engine in args.engines.split(","):
        run_dir, cmd, used = sweep(model, engine, args)
        table += rows(run_dir, used)
        cmds.append("moebench " + " ".join(cmd[3:]))
    render(table, "md", title=f"anonymous RAM: plan against measured ({model.name})")
    print("\n".join(f"- `{c}`" for c in cmds))
    off = [r for r in table if args.max_error is not None and not abs(r["error %"]) <= args.max_error]
    for r in off:
        print(f"{r['engine']}: plan {r['plan anon MiB']:,.0f} MiB, measured {r['peak anon MiB']:,.0f} MiB "
              f"({r['error %']:+.1f} %, more than {args.max_error:g} %)", file=sys.stderr)
    sys.exit(1 if off else 0)


if __name__ == "__main__":
    main()
