"""`moebench recommend`: the --n-cpu-moe for a VRAM/RAM budget and a context."""
from __future__ import annotations

from pathlib import Path

import click

from engines.errors import UserError
from harness.cli.options import FORMAT, OUTPUT, read_header, user_errors
from harness.planning.plan import ENGINES
from harness.planning.recommend import OBJECTIVES


@click.command()
@click.option("-m", "--model", required=True, help="GGUF file or preset:NAME[:DTYPE].")
@click.option("--vram", default=None, help="GPU memory to plan for, e.g. 16GiB (default: free VRAM of GPU 0).")
@click.option("--ram", default=None, help="Host RAM for offloaded experts, e.g. 64GiB (default: available RAM).")
@click.option("--ctx", "n_ctx", type=int, default=8192, show_default=True)
@click.option("--objective", type=click.Choice(OBJECTIVES), default="balanced", show_default=True)
@click.option("--results", "runs", multiple=True, type=click.Path(file_okay=False),
              help="Run directories with measurements of this model (repeatable).")
@click.option("--margin", default="1GiB", show_default=True, help="VRAM kept free on top of the plan.")
@click.option("--engine", type=click.Choice(ENGINES), default="llama-cpp", show_default=True)
@click.option("--n-ubatch", type=int, default=512, show_default=True)
@click.option("--trace", "trace_path", type=click.Path(), default=None,
              help="A routing trace of this model (.npz, or a run directory recorded with --trace-routing): also "
                   "recommend an expert cache in the VRAM each depth leaves free.")
@click.option("--cache-policy", type=click.Choice(["lru", "lfu", "classlru", "static"]), default="classlru",
              show_default=True, help="The cache policy --trace simulates.")
@FORMAT
@OUTPUT
@user_errors
def recommend(model, vram, ram, n_ctx, objective, runs, margin, engine, n_ubatch, trace_path, cache_policy, fmt,
              output):
    """The --n-cpu-moe to use for a VRAM/RAM budget and context, from the plan and measured runs."""
    import psutil

    from engines.devices import free_vram
    from harness.analysis.tables import render
    from harness.planning.plan import PlanSettings, make_plan
    from harness.planning.recommend import recommend_depth, table, to_json, with_cache
    from harness.units import GiB, parse_size

    meta = read_header(model)
    if vram:
        vram_b, vram_src = parse_size(vram, "--vram"), "given"
    elif (vram_b := free_vram()) is not None:
        vram_src = "free on GPU 0"
    else:
        raise UserError("No NVIDIA GPU found on this machine; pass --vram SIZE (e.g. --vram 16GiB) for the GPU you "
                        "plan for.")
    ram_b, ram_src = (parse_size(ram, "--ram"), "given") if ram else (psutil.virtual_memory().available, "available")
    margin_b = parse_size(margin, "--margin")
    runs = [Path(r) for r in runs]
    plan = make_plan(meta, PlanSettings(engine=engine, n_ctx=n_ctx, n_ubatch=n_ubatch), runs)
    rec = recommend_depth(plan, objective, vram_b, ram_b, margin_b, runs)
    if trace_path:
        from harness.planning import cache_planner, cache_time_model

        traces = [t for _, t in cache_planner.load([Path(trace_path)])]
        # this file's trace, else the first: with_cache says why another file's does not fit
        trace = next((t for t in traces if t.header.get("fingerprint") == meta.fingerprint), traces[0])
        points = cache_time_model.measured_points(runs) if runs else []
        with_cache(rec, trace, cache_policy, cache_time_model.fit_all(points).get("decode") if points else None)
    title = (f"{meta.name}, {engine}, ctx {n_ctx}: VRAM {vram_b / GiB:.2f} GiB ({vram_src}), "
             f"RAM {ram_b / GiB:.2f} GiB ({ram_src}), margin {margin_b / GiB:.2f} GiB")
    render(table(rec), fmt, title=title, out=output, json_payload=to_json(rec))
    if fmt not in ("json", "jsonl"):
        for note in rec.notes + ([plan.calibration.describe()] if plan.calibration else []):
            click.echo(f"note: {note}", err=True)
        click.echo(rec.rationale)
