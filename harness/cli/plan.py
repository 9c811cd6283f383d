"""`moebench plan`: bytes on the accelerator and in host RAM for every --n-cpu-moe depth."""
from __future__ import annotations

from pathlib import Path

import click

from harness.cli.options import FORMAT, OUTPUT, read_header, user_errors
from harness.planning.plan import ENGINES


@click.command()
@click.option("-m", "--model", required=True, help="GGUF file or preset:NAME[:DTYPE].")
@click.option("--ctx", "n_ctx", type=int, default=8192, show_default=True, help="Context size (KV cache cells).")
@click.option("--engine", type=click.Choice(ENGINES), default="llama-cpp", show_default=True)
@click.option("--n-ubatch", type=int, default=512, show_default=True)
@click.option("--n-batch", type=int, default=2048, show_default=True)
@click.option("--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@click.option("--device", default="cuda", show_default=True,
              help="Accelerator planned for (cuda | cpu); decides the reference engine's dtype. cpu: no "
                   "accelerator, host RAM holds everything.")
@click.option("--mmap/--no-mmap", default=True, show_default=True,
              help="llama.cpp on a CPU: weights left in the file mapping (file-backed, not in the host RAM figure).")
@click.option("--results", "runs", multiple=True, type=click.Path(file_okay=False),
              help="Run directories to calibrate from (default: every run under --results-dir).")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True)
@click.option("--no-calibrate", is_flag=True, help="Pure arithmetic; ignore measured runs.")
@FORMAT
@OUTPUT
@user_errors
def plan(model, n_ctx, engine, n_ubatch, n_batch, flash_attn, device, mmap, runs, results_dir, no_calibrate, fmt,
         output):
    """Bytes on the accelerator and in host RAM for every --n-cpu-moe depth (from the GGUF table)."""
    from harness.analysis.tables import render
    from harness.planning.plan import PlanSettings, find_runs, make_plan

    meta = read_header(model)
    s = PlanSettings(engine, n_ctx, n_ubatch, n_batch, flash_attn, device, mmap=mmap)
    p = make_plan(meta, s, [] if no_calibrate else [Path(r) for r in runs] or find_runs(Path(results_dir)))
    render(p.rows(), fmt, title=f"memory plan: {meta.name}, {engine}, ctx {n_ctx} (KV {p.bytes.kv_dtype}, "
           f"{p.n_kv_cells} cells)", out=output, json_payload=p.to_dict())
    if fmt not in ("json", "jsonl"):
        click.echo(p.calibration.describe() if p.calibration else
                   "uncalibrated: compute buffers are an estimate; run a sweep of this model to calibrate.", err=True)
