"""The reference engine against llama.cpp on files in the formats people download, both holding the weights
as stored: throughput, peak RSS and expert bytes in host RAM, per CPU kernel variant, side by side.

One sweep per kernel variant (MOEBENCH_ISA=avx2 forces the baseline the CI machines have; native = the widest
this CPU runs), each cell in fresh processes over --rounds rounds (one process is one sample), both engines in
the same sweep with the same settings. Prints one Markdown table and checks the targets of issue 12:
peak RSS <= 1.15x llama.cpp's, expert_bytes_host equal, tg >= 0.9x, pp >= 1.2x.

  .venv/bin/python benchmarks/stored_weights.py --dtypes f16,q8_0,q4_k_m,mxfp4 --isas avx2,native -r 5 --rounds 5

llama-cpp-python builds llama.cpp for the CPU it is built on (GGML_NATIVE), so on an AVX-512 machine llama.cpp
runs AVX-512 code even where the reference is forced to avx2. --llama-pythonpath DIR puts DIR first on the cells'
PYTHONPATH: a copy of the llama_cpp package whose libggml-base/libggml-cpu are an AVX2-only build (cmake ggml/
-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DBUILD_SHARED_LIBS=ON from the
same sources) makes both engines run what an AVX2 machine runs. The `llama ISA` column is read from llama.cpp's
own system_info in cells.csv.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = {"rss": 1.15, "tg": 0.9, "pp": 1.2}      # reference / llama.cpp: at most (rss), at least (tg, pp)


def sweep(isa: str, dtype: str, args) -> Path:
    """One sweep of both engines on preset:<preset>:<dtype>; returns its run directory."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*args.llama_pythonpath, str(ROOT)]))
    env.pop("MOEBENCH_ISA", None)
    if isa != "native":
        env["MOEBENCH_ISA"] = isa
    cmd = [sys.executable, "-m", "harness", "sweep", "-m", f"preset:{args.preset}:{dtype}", "-e", "reference,llama-cpp",
           "--n-cpu-moe", args.depths, "-w", args.workloads, "-r", str(args.repetitions), "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--results-dir", str(args.results_dir), "--format", "csv"]
    print("$", " ".join(cmd[2:]), f"(MOEBENCH_ISA={env.get('MOEBENCH_ISA', 'auto')})", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit(f"sweep failed ({r.returncode}): {r.stderr[-2000:]}")
    return Path(r.stderr.strip().splitlines()[-1].removeprefix("results: "))


def rows(run_dir: Path, isa: str, dtype: str) -> list[dict]:
    """Per depth x workload: both engines' median tok/s, peak RSS and host expert bytes, and the ratios."""
    from harness.store import results

    _, cells, meas, _ = results.load_frames(run_dir)
    summary = results.summarize(cells, meas)
    out = []
    for (depth, wl), g in summary.groupby(["n_cpu_moe", "workload"], sort=False):
        by = {r["engine"]: r for r in g.to_dict("records")}
        ref, lcp = by.get("reference"), by.get("llama-cpp")
        if not ref or not lcp:
            continue
        c = {e: cells[(cells["engine"] == e) & (cells["n_cpu_moe"] == depth)].iloc[0]
             for e in ("reference", "llama-cpp")}
        isa_used = str(c["reference"]["effective_settings"]).split('"cpu_isa": "')[-1].split('"')[0]
        llama_isa = "avx512" if "AVX512 = 1" in str(c["llama-cpp"]["effective_settings"]) else "avx2"
        out.append({"isa": isa_used, "llama ISA": llama_isa, "dtype": dtype, "n_cpu_moe": depth, "workload": wl,
                    "ref tok/s": ref["tps_median"], "llama tok/s": lcp["tps_median"],
                    "tok/s ratio": ref["tps_median"] / lcp["tps_median"],
                    "ref RSS MiB": ref["peak_rss_mib"], "llama RSS MiB": lcp["peak_rss_mib"],
                    "RSS ratio": ref["peak_rss_mib"] / lcp["peak_rss_mib"],
                    "host experts equal":
                        int(c["reference"]["expert_bytes_host"]) == int(c["llama-cpp"]["expert_bytes_host"]),
                    "run": run_dir.name})
    return out


def verdicts(r: dict) -> list[str]:
    kind = "tg" if r["workload"].startswith("tg") else "pp"
    bad = []
    if r["tok/s ratio"] < TARGETS[kind]:
        bad.append(f"{kind} {r['tok/s ratio']:.2f}x < {TARGETS[kind]}x")
    if r["RSS ratio"] > TARGETS["rss"]:
        bad.append(f"RSS {r['RSS ratio']:.2f}x > {TARGETS['rss']}x")
    if not r["host experts equal"]:
        bad.append("host expert bytes differ")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtypes", default="f16,q8_0,q4_k_m,mxfp4")
    ap.add_argument("--isas", default="avx2,native", help="avx2 (forced baseline), avx512, native")
    ap.add_argument("--depths", default="0,all")
    ap.add_argument("--workloads", default="pp512,pp4096,tg128")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", type=Path, default=ROOT / "results")
    ap.add_argument("--llama-pythonpath", action="append", default=[], metavar="DIR",
                    help="put DIR first on the cells' PYTHONPATH (another llama_cpp build; see above)")
    args = ap.parse_args()
    from harness.analysis.tables import render

    table = []
    for isa in args.isas.split(","):
        for dtype in args.dtypes.split(","):
            table += rows(sweep(isa, dtype, args), isa, dtype)
    for r in table:
        r["targets"] = "; ".join(verdicts(r)) or "met"
    render(table, "md", title="reference vs llama.cpp, weights as stored (median tok/s, peak RSS)")


if __name__ == "__main__":
    main()
