"""`moebench sweep`: every engine x model x depth cell in its own process, then the summary table."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from engines.errors import UserError
from harness.cli.options import FORMAT, OUTPUT, split_list, user_errors
from harness.run.spec import ROUND_ORDERS


@click.command()
@click.option("-m", "--model", "models", multiple=True, default=["preset:small"], show_default=True,
              help="GGUF file(s) or preset:NAME[:DTYPE][@zipf=S[@clusters=C]] (synthesized once into the cache; "
                   "@zipf plants a skewed routing); repeat or comma-separate.")
@click.option("-e", "--engines", default="llama-cpp,reference", show_default=True, help="Engines, comma-separated.")
@click.option("--n-cpu-moe", "depths", default="0", show_default=True,
              help="Offload depths: layers whose routed experts stay in RAM; list of N and 'all'.")
@click.option("--cpu-moe", is_flag=True, help="Offload the experts of all layers (same as --n-cpu-moe all).")
@click.option("-w", "--workloads", default="pp4096,pp8192,tg128", show_default=True,
              help="ppN, tgN, ppN@dD, tgN@dD; a +corr suffix (pp512+corr) feeds a correlated token stream.")
@click.option("-r", "--repetitions", default=5, show_default=True, type=int, help="Timed repetitions per workload.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores).")
@click.option("--n-ctx", type=int, default=None, help="Context size (default: what the largest workload needs).")
@click.option("--n-batch", type=int, default=2048, show_default=True)
@click.option("--n-ubatch", type=int, default=512, show_default=True)
@click.option("--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@click.option("--timeout", type=float, default=3600, show_default=True, help="Seconds per cell.")
@click.option("--sample-ms", type=float, default=50, show_default=True, help="Memory sampling period; 0 = off.")
@click.option("--cpu-moe-threads", type=int, default=None, help="reference: threads for host expert matmuls.")
@click.option("--moe-stream-min-batch", type=int, default=None,
              help="reference: batches at least this large stream offloaded experts to the accelerator (default 128).")
@click.option("--llama-bench", "llama_bench", type=click.Path(dir_okay=False), default=None,
              help="llama-bench: the binary to run (default: $MOEBENCH_LLAMA_BENCH, `moebench tools "
                   "build-llama-bench`, PATH).")
@click.option("--tensorsharp", type=click.Path(dir_okay=False), default=None,
              help="tensorsharp: the TensorSharp.Cli binary (default: $MOEBENCH_TENSORSHARP, PATH).")
@click.option("--repack", default=None, metavar="0,1",
              help="llama.cpp (llama-cpp, llama-bench): its extra CPU buffer types, AMX and repacked weights "
                   "(llama-bench's --repack); a list runs a cell per value (default 1).")
@click.option("--no-host", "no_host", default=None, metavar="0,1",
              help="llama.cpp: bypass the host buffer type so extra buffer types can be used (llama-bench's "
                   "--no-host); a list runs a cell per value (default 0).")
@click.option("--trace-routing", "trace_routing", is_flag=True,
              help="Record each cell's routing (per forward pass and MoE layer: top-k expert ids and weights of "
                   "each workload's first run) into <run dir>/traces/<cell>.npz; engines that cannot (all but "
                   "reference) run as usual, with a note.")
@click.option("--cache-mib", "cache_mib", default=None, metavar="MIB,...",
              help="reference: MiB of accelerator memory caching experts of the offloaded layers (split over them by "
                   "bytes; on a CPU-only host the slots are host memory); a list runs a cell per value (default 0).")
@click.option("--cache-policy", "cache_policy", default=None, metavar="lru,lfu,classlru,static",
              help="reference: the expert cache's policy; a list runs a cell per value (default lru; static pins the "
                   "most used experts of --cache-static-trace).")
@click.option("--cache-static-trace", type=click.Path(dir_okay=False, exists=True), default=None,
              help="reference: the routing trace (.npz, from --trace-routing) whose top experts per layer "
                   "--cache-policy static pins.")
@click.option("--seed", type=int, default=0, show_default=True, help="Token ids and synthesized weights.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True)
@click.option("--resume", type=click.Path(file_okay=False), default=None, help="Continue results/<run_id>.")
@click.option("--strict", is_flag=True, help="Exit 1 if any cell failed.")
@click.option("--interleave", is_flag=True,
              help="A/B: exactly two engine specs (NAME[@KEY=VALUE]...), measured turn by turn (docs/sweeps.md).")
@click.option("--rounds", type=int, default=None,
              help="Run the sweep this many times over: round 1 runs every cell once in a fresh process with its "
                   "share of the repetitions, then round 2 ..., so drift falls on every engine and depth alike; "
                   "each cell is still one cell (default 3 with more than one engine, else 1; with --interleave "
                   "min(5, repetitions)).")
@click.option("--round-order", type=click.Choice(ROUND_ORDERS), default=ROUND_ORDERS[0],
              show_default=True, help="back-to-back: each cell's rounds one after the other (the order before "
                                      "rounds interleaved; to measure what interleaving buys).")
@click.option("--until", default=None, metavar="PCT",
              help="Make every compared ratio's 95% interval ±PCT (e.g. 3%) by Stein's two-stage rule: a pilot of "
                   "5 interleaved rounds (or --rounds, if more) fixes how many rounds each pair runs; at most "
                   "--max-rounds / --max-minutes (then the pair's achieved width is reported).")
@click.option("--max-rounds", type=int, default=10, show_default=True, help="With --until: rounds in all.")
@click.option("--max-minutes", type=float, default=None, help="With --until: start no round after this long.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run the cells on a Ray cluster: auto (RAY_ADDRESS or the local cluster) or ray://HOST:PORT.")
@click.option("--per-node", is_flag=True, help="With --ray: every node runs every cell (compare hardware).")
@click.option("--ray-nodes", default="", metavar="NODES",
              help="With --ray: run cells only on these nodes (hostnames, IPs or node-id prefixes, comma-separated; "
                   "default: every node that offers CPUs to Ray, or those offering moebench_slot if any do).")
@FORMAT
@OUTPUT
@user_errors
def sweep(models, engines, depths, cpu_moe, workloads, repetitions, threads, n_ctx, n_batch, n_ubatch, flash_attn,
          timeout, sample_ms, cpu_moe_threads, moe_stream_min_batch, llama_bench, tensorsharp, repack, no_host,
          trace_routing, cache_mib, cache_policy, cache_static_trace, seed,
          results_dir,
          resume, strict, interleave, rounds, round_order, until, max_rounds, max_minutes, ray_address, per_node,
          ray_nodes, fmt, output):
    """Run every engine x model x depth cell, each in its own process, and write tidy results."""
    from harness.run.progress import sweep_with_progress
    from harness.run.spec import SweepSpec
    from harness.units import parse_fraction
    from workloads.synth import resolve_model

    extra = {k: v for k, v in {"cpu_moe_threads": cpu_moe_threads, "moe_stream_min_batch": moe_stream_min_batch}.items()
             if v is not None}
    if cache_static_trace:       # absolute: the cells' workers run in the project root
        extra["cache_static_trace"] = str(Path(cache_static_trace).expanduser().absolute())
    for key, path in (("llama_bench", llama_bench), ("tensorsharp", tensorsharp)):
        env = f"MOEBENCH_{key.upper()}"
        if path:   # kept in the spec; exported so the engines' availability check sees it too
            extra[key] = os.environ[env] = str(Path(path).expanduser().absolute())
        elif os.environ.get(env, "").strip():   # the cells' workers run in the project root, not here
            os.environ[env] = str(Path(os.environ[env].strip()).expanduser().absolute())
    # run.json keeps the spec: a model file by its absolute path, so --resume finds it from any directory
    models = [m if m.startswith("preset:") else str(resolve_model(m)) for m in split_list(models)]
    spec = SweepSpec(models=models, engines=split_list(engines),
                     depths=["all"] if cpu_moe else split_list(depths), workloads=split_list(workloads),
                     repetitions=repetitions, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=flash_attn,
                     timeout_s=timeout, sample_ms=sample_ms, seed=seed, extra=extra, ray=ray_address,
                     per_node=per_node, ray_nodes=split_list(ray_nodes), rounds=rounds, round_order=round_order,
                     knobs={k: split_list(v) for k, v in (("repack", repack), ("no_host", no_host),
                                                          ("cache_mib", cache_mib), ("cache_policy", cache_policy))
                            if v}, trace_routing=trace_routing,
                     until=parse_fraction(until, "--until") if until else None, max_rounds=max_rounds,
                     max_minutes=max_minutes,
                     **({"threads": threads} if threads is not None else {}))
    if interleave:
        from harness.run.interleave import run_interleaved
        if any(len(v) > 1 for v in spec.knobs.values()):
            raise UserError("--interleave takes exactly two engine specs; write the knobs into them (e.g. "
                            "-e llama-cpp@repack=0,llama-cpp@repack=1) instead of listing --repack/--no-host/--cache-* "
                            "values.")
        if until:
            raise UserError("--until adds rounds to a sweep of rounds; --interleave pairs turns instead, so give it "
                            "more --rounds, or drop --interleave.")
        run_dir, failed = run_interleaved(spec, Path(results_dir), Path(resume) if resume else None)
    else:
        run_dir, failed = sweep_with_progress(spec, Path(results_dir), Path(resume) if resume else None)
    show_run(run_dir, fmt, output)
    none_ok = every_cell_failed(run_dir)
    click.echo(f"results: {run_dir}", err=True)
    if none_ok or (strict and failed):
        sys.exit(1)


def every_cell_failed(run_dir: Path) -> bool:
    """Say so in one line on stderr when no cell of the run finished ok: a sweep that measured nothing is no
    success, --strict or not (its rows are written by now)."""
    from harness.store import results

    cells = results.read_csv(run_dir, "cells.csv")
    if cells and not any(c["status"] == "ok" for c in cells):
        click.echo(f"error: every cell of this sweep failed ({len(cells)} cells); see each cell's error in "
                   f"{run_dir / 'cells.csv'}", err=True)
        return True
    return False


def show_run(run_dir: Path, fmt: str = "table", output: str | None = None) -> None:
    from harness.analysis.report import steadiness_text
    from harness.analysis.tables import render
    from harness.stats import CV_WARN
    from harness.planning.roofline import annotate, bound_messages
    from harness.store import results

    run, cells, meas, _ = results.load_frames(run_dir)
    summary = results.summarize(cells, meas)
    summary = annotate(cells, summary, run)    # bound_tps, fraction (NaN without a profile)
    if not summary.empty:                   # rounds finish cells in a shuffled order: show the sweep's own
        summary = summary.iloc[_sweep_order(summary, run.get("spec", {}))]
    many_models = not summary.empty and summary["model_name"].nunique() > 1
    many_rounds = not summary.empty and (summary["rounds"] > 1).any()
    rows = []
    for _, r in summary.iterrows():
        rows.append({"engine": r["engine"], **({"model": r["model_name"]} if many_models else {}),
                     "n_cpu_moe": r["n_cpu_moe"], "workload": r["workload"], "status": r["status"],
                     "tok/s median": r["tps_median"], "± std": r["tps_std"], "cv %": 100 * r["tps_cv"],
                     **({"cv % rounds": 100 * r["tps_cv_rounds"], "cv % in proc": 100 * r["tps_cv_within"]}
                        if many_rounds else {}),
                     "n": r["tps_n"], "bound tok/s": r["bound_tps"], "% of bound": 100 * r["fraction"],
                     **results.memory_cells(r)})
        if r["tps_cv"] > CV_WARN:
            split = (f": {_pct(r['tps_cv_rounds'])} between rounds, {_pct(r['tps_cv_within'])} within a process"
                     if r["rounds"] > 1 else "")
            click.echo(f"warning: {r['engine']} n_cpu_moe={r['n_cpu_moe']} {r['workload']} is unstable "
                       f"(CV {100 * r['tps_cv']:.1f}% > 5%{split}); use more repetitions or a quieter machine.",
                       err=True)
        if r["status"] != "ok":
            click.echo(f"warning: {r['engine']} n_cpu_moe={r['n_cpu_moe']} {r['status']}: {r['error']}", err=True)
    for note in run.get("notes") or []:
        click.echo(f"note: {note}", err=True)
    for line in bound_messages(summary):       # a cell above its bound, a cell without one: never silent
        click.echo(line, err=True)
    render(rows, fmt, title=f"moebench {run['run_id']}", out=output,
           json_payload=results.llama_bench_records(run, cells, meas))
    if fmt in ("table", "md") and not output:
        ratios, notes = ratio_rows(cells, meas, run)
        if ratios:
            render(ratios, fmt, title="ratios: A / B (baseline), geometric mean over the processes with its 95% "
                                      "interval; median ratio = median tok/s / median tok/s")
        for note in notes:
            click.echo(f"note: no interval for a ratio of {note}.", err=True)
    if many_rounds:
        click.echo(rounds_note(run, summary, results.round_speed(meas)), err=True)
    if steadiness_text(run):
        click.echo(steadiness_text(run), err=True)


def ratio_rows(cells, meas, run: dict | None = None) -> tuple[list[dict], set[str]]:
    """Every engine over the baseline the report picks (llama-cpp or llama-bench first), per model, depth and
    workload: the ratio with its 95 % interval and verdict, and the median ratio (harness.stats.ratio_interval,
    paired as run.json says); and why some ratios have no interval."""
    from harness.analysis.report import Intervals, pick_engines
    from harness.stats import fmt_ratio

    from harness.store.results import layers_compared

    ok = cells[cells["status"] == "ok"].assign(engine=cells["label"])     # knob variants and bin= builds apart
    if ok["engine"].nunique() < 2:
        return [], set()
    _, b = pick_engines(sorted(ok["engine"].unique()), None, None)
    rows, notes = [], set()
    for _, mg in ok.groupby("model_fingerprint", sort=False):          # a file, not a name
        get = Intervals(mg, meas, [run] if run else [])
        for depth, g in mg.groupby("n_cpu_moe"):                          # depths in order
            for a in [e for e in dict.fromkeys(g["engine"]) if e != b]:
                for wl in dict.fromkeys(meas.loc[meas["cell_id"].isin(g["cell_id"]), "workload"]):
                    iv = get(a, b, depth, wl)
                    if iv:
                        layers = (g.loc[g["engine"] == e, "cpu_moe_layers"].iloc[-1] if "cpu_moe_layers" in g else ""
                                  for e in (a, b))
                        rows.append({"model": g["model_name"].iloc[0], "n_cpu_moe": depth, "workload": wl,
                                     "A / B": f"{a} / {b}", "ratio (95% CI)": iv.text(),
                                     "median ratio": f"{fmt_ratio(iv.median_ratio)}x"
                                     if iv.median_ratio == iv.median_ratio else "", "verdict": iv.verdict,
                                     "over": f"{iv.n} {iv.unit}", "host layers": layers_compared(*layers)})
        notes |= get.notes
    return rows, notes


def _sweep_order(summary, spec: dict) -> list[int]:
    """Row positions in the sweep's own order (model, engine, depth as given), whatever order cells finished in."""
    engines, depths = spec.get("engines", []), [str(d) for d in spec.get("depths", [])]
    models = list(dict.fromkeys(summary["model_fingerprint"]))
    key = [(models.index(r["model_fingerprint"]), engines.index(r["engine"]) if r["engine"] in engines
            else len(engines), depths.index(str(r["depth"])) if str(r["depth"]) in depths else len(depths), i)
           for i, (_, r) in enumerate(summary.iterrows())]
    return [k[-1] for k in sorted(key)]


CV_STEADY = 0.03    # a round whose cells ran this much faster or slower than their mean: the machine moved


def rounds_note(run: dict, summary, speed: dict[int, float]) -> str:
    """One paragraph on the rounds: how many, in which order and why, and whether the machine was steady."""
    info = run.get("rounds") or ({"order": "turns"} if run.get("interleave") else {})
    k = int(summary["rounds"].max())
    why = " (the default with more than one engine; --rounds 1 runs each cell once)" if info.get("default") else ""
    if run.get("until"):
        u = run["until"]
        why = (f" ({len(info.get('sizes', []))} planned, then --until {u['target']:.1%} added rounds to the cells "
               f"whose ratios were not yet precise: {u['stopped_by']})")
    order = {"interleaved": f"interleaved: every cell's round r before any cell's round r+1, order seed "
                            f"{info.get('seed')}", "back-to-back": "back-to-back: each cell's rounds in a row",
             "turns": "the two arms taking turns, a fresh pair of processes per round"}
    ok = summary[summary["rounds"] > 1]
    moved = max((abs(v - 1) for v in speed.values()), default=0.0)
    verdict = (f"the machine's speed moved by up to {moved:.0%} between rounds"
               + (" (interleaved: every cell saw it alike)" if info.get("order") == "interleaved" else "")
               if moved > CV_STEADY else "the machine was steady across rounds")
    return (f"rounds: {k}{why}, {order.get(info.get('order'), 'order not recorded')}. Spread of tok/s, median over "
            f"cells: {_pct(ok['tps_cv_rounds'].median())} between rounds (processes, time) vs "
            f"{_pct(ok['tps_cv_within'].median())} within a process; machine speed by round "
            f"(cell's round mean / its mean): {', '.join(f'{v:.2f}' for v in speed.values()) or 'n/a'}: {verdict}.")


def _pct(cv: float) -> str:
    return "n/a (one repetition per round)" if cv != cv else f"{100 * cv:.1f}%"
