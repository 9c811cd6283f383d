"""The reference engine against llama.cpp on files in the formats people download, both holding the weights
as stored: throughput with the 95 % interval of each ratio, RSS above each engine's runtime floor and expert
bytes in host RAM, per CPU kernel variant, side by side.

One sweep per file and kernel variant (MOEBENCH_ISA=avx2 forces the baseline every x86-64 machine in use has;
native = the widest this CPU runs), both engines in the same sweep with the same settings, each cell in fresh
processes over --rounds interleaved rounds (one process is one sample). Prints one Markdown table and checks the
targets of the CPU-experts issue at every depth given: reference / llama.cpp pp >= 1.3x, tg >= 1.0x, peak RSS
above the runtime floor <= 1.05x, expert bytes in host RAM equal. The default files are that issue's table:
the real-shape Qwen3-30B-A3B Q4_K_M preset, the 8-layer qwen3moe preset `small` as Q4_K_M, Q8_0 and F16 (the
project's quantizer writes llama.cpp's bytes: tests/test_quantize.py), gemma-4 IQ4_XS and gpt-oss MXFP4.

  .venv/bin/python benchmarks/stored_weights.py --isas avx2,native -r 6 --rounds 3

llama-cpp-python builds llama.cpp for the CPU it is built on (GGML_NATIVE), so on an AVX-512 machine llama.cpp
runs AVX-512 code even where the reference is forced to avx2. --llama-pythonpath DIR puts DIR first on the cells'
PYTHONPATH: a copy of the llama_cpp package whose libggml-base/libggml-cpu are an AVX2-only build (cmake ggml/
-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DBUILD_SHARED_LIBS=ON from the
same sources) makes both engines run what an AVX2 machine runs. The `llama ISA` column is read from llama.cpp's
own system_info in cells.csv, +amx where its AMX buffer type holds weights.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = {"rss": 1.05, "tg": 1.0, "pp": 1.3}      # reference / llama.cpp: at most (rss above floor), at least
FILES = "qwen3-30b-a3b-4l:q4_k_m,small:q4_k_m,small:q8_0,small:f16,gemma-4-26b-a4b-4l:iq4_xs,gpt-oss-20b-4l:mxfp4"


def sweep(isa: str, file: str, args) -> Path:
    """One sweep of both engines on preset:<file>; returns its run directory."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*args.llama_pythonpath, str(ROOT)]))
    env.pop("MOEBENCH_ISA", None)
    if isa != "native":
        env["MOEBENCH_ISA"] = isa
    cmd = [sys.executable, "-m", "harness", "sweep", "-m", f"preset:{file}", "-e", "reference,llama-cpp",
           "--n-cpu-moe", args.depths, "-w", args.workloads, "-r", str(args.repetitions), "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--results-dir", str(args.results_dir), "--format", "csv"]
    print("$", " ".join(cmd[2:]), f"(MOEBENCH_ISA={env.get('MOEBENCH_ISA', 'auto')})", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit(f"sweep failed ({r.returncode}): {r.stderr[-2000:]}")
    return Path(r.stderr.strip().splitlines()[-1].removeprefix("results: "))


def rows(run_dir: Path, file: str) -> list[dict]:
    """Per depth x workload: both engines' median tok/s, the ratio with its interval, each engine's arithmetic
    (compute_dtype of the workload's phase) and weights, its fraction of the roofline bound, anonymous RSS above its
    runtime floor (the RAM it needs; llama.cpp's mapped file pages are not in it), the ratio of whole RSS above the
    floors (the CPU-experts target: a mapped file counts as resident) and host expert bytes."""
    import json

    from harness.analysis.report import Intervals
    from harness.planning import roofline
    from harness.store import results

    info, cells, meas, _ = results.load_frames(run_dir)
    summary = roofline.annotate(cells, results.summarize(cells, meas), info)
    interval = Intervals(cells, meas)
    out = []
    for (depth, wl), g in summary.groupby(["n_cpu_moe", "workload"], sort=False):
        by = {r["engine"]: r for r in g.to_dict("records")}
        ref, lcp = by.get("reference"), by.get("llama-cpp")
        if not ref or not lcp:
            continue
        c = {e: cells[(cells["engine"] == e) & (cells["n_cpu_moe"] == depth)].iloc[0]
             for e in ("reference", "llama-cpp")}
        eff = {e: json.loads(c[e]["effective_settings"]) for e in c}
        phase = "decode" if wl.startswith("tg") else "prefill"
        arith = {e: f"{(eff[e].get('compute_dtype') or {}).get(phase, '?')}, {eff[e].get('weights', '?')}" for e in c}
        iv = interval("reference", "llama-cpp", depth, wl)
        llama = str(c["llama-cpp"]["effective_settings"])      # its system_info, and its buffer types in use
        anon = {e: by[e]["peak_rss_anon_above_floor_mib"] for e in c}
        out.append({"isa": eff["reference"]["extra"]["cpu_isa"],
                    "llama ISA": ("avx512" if "AVX512 = 1" in llama else "avx2") + ("+amx" if '"AMX"' in llama else ""),
                    "file": file, "n_cpu_moe": depth, "workload": wl,
                    "ref tok/s": ref["tps_median"], "llama tok/s": lcp["tps_median"],
                    "ratio": iv.ratio, "ratio (95% CI)": iv.text(),
                    "ref % of bound": 100 * ref["fraction"], "llama % of bound": 100 * lcp["fraction"],
                    "ref compute_dtype, weights": arith["reference"],
                    "llama compute_dtype, weights": arith["llama-cpp"],
                    "ref anon RAM above floor MiB": anon["reference"],
                    "llama anon RAM above floor MiB": anon["llama-cpp"],
                    "anon RAM ratio": anon["reference"] / anon["llama-cpp"],
                    "RSS ratio": ref["peak_rss_above_floor_mib"] / lcp["peak_rss_above_floor_mib"],
                    "host experts equal":
                        int(c["reference"]["expert_bytes_host"]) == int(c["llama-cpp"]["expert_bytes_host"]),
                    "run": run_dir.name})
    return out


def verdicts(r: dict) -> list[str]:
    kind = "tg" if r["workload"].startswith("tg") else "pp"
    bad = []
    if r["ratio"] < TARGETS[kind]:
        bad.append(f"{kind} {r['ratio']:.2f}x < {TARGETS[kind]}x")
    if r["RSS ratio"] > TARGETS["rss"]:
        bad.append(f"RSS {r['RSS ratio']:.2f}x > {TARGETS['rss']}x")
    for side in ("ref", "llama"):
        if r[f"{side} % of bound"] > 100:
            bad.append(f"{side} above its bound")
    if not r["host experts equal"]:
        bad.append("host expert bytes differ")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default=FILES, help="preset:dtype list (moebench model presets)")
    ap.add_argument("--isas", default="avx2,native", help="avx2 (forced baseline), avx512, native")
    ap.add_argument("--depths", default="all")
    ap.add_argument("--workloads", default="pp512,tg64")
    ap.add_argument("-r", "--repetitions", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", type=Path, default=ROOT / "results")
    ap.add_argument("--llama-pythonpath", action="append", default=[], metavar="DIR",
                    help="put DIR first on the cells' PYTHONPATH (another llama_cpp build; see above)")
    args = ap.parse_args()
    from harness.analysis.tables import render

    table = []
    for isa in args.isas.split(","):
        for file in args.files.split(","):
            table += rows(sweep(isa, file, args), file)
    for r in table:
        r["targets"] = "; ".join(verdicts(r)) or "met"
        del r["ratio"]
    render(table, "md", title="reference vs llama.cpp, weights as stored (median tok/s, anonymous RAM above the "
                             "runtime floor)")


if __name__ == "__main__":
    main()
