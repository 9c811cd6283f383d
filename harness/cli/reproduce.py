"""`moebench reproduce`: run the sweep behind one published table, then report it against the published numbers."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from engines.errors import UserError
from harness.analysis.published import A, B, DEFAULT_REVISION
from harness.cli.options import FORMAT, split_list, user_errors


@click.command()
@click.option("--published-model", required=True, help="A model of the published tables, e.g. Qwen3.5-35B-A3B.")
@click.option("--model-file", required=True, type=click.Path(dir_okay=False), help="The GGUF file to run.")
@click.option("--revision", default=DEFAULT_REVISION, show_default=True, help="Revision of the published document.")
@click.option("-e", "--engines", default="reference,llama-cpp", show_default=True,
              help=f"Two engines: the first stands for {A}, the second for {B}.")
@click.option("-w", "--workloads", default=None, help="Override the published workloads (e.g. pp16,tg4 for a quick "
                                                      "check).")
@click.option("-r", "--repetitions", type=int, default=None, help="Override the published repetitions.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores).")
@click.option("--clamp", is_flag=True, help="Run depths beyond the file's layers at all layers (else an error).")
@click.option("--dry-run", is_flag=True, help="Print the plan and run nothing.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True)
@click.option("--reports-dir", type=click.Path(file_okay=False), default="reports", show_default=True)
@FORMAT
@user_errors
def reproduce(published_model, model_file, revision, engines, workloads, repetitions, threads, clamp, dry_run,
              results_dir, reports_dir, fmt) -> None:
    """Plan and run the sweep behind one published table, then report it against the published numbers."""
    from harness.analysis.published import REPETITIONS, load, plan_depths, revision_key, select, workload_order
    from harness.analysis.tables import render
    from harness.run.checks import read_checked
    from harness.run.spec import SweepSpec
    from workloads.synth import resolve_model

    df = select(load(), model=published_model, revision=revision)
    engines_ = split_list(engines)
    if len(engines_) != 2:
        raise UserError(f"--engines {engines!r} must name two engines (one for {A}, one for {B}), e.g. "
                        f"reference,llama-cpp.")
    if not Path(model_file).exists():
        raise UserError(f"--model-file {model_file!r} does not exist; pass the path of a GGUF file.")
    meta = read_checked(model_file)
    depths, warning = plan_depths(sorted(set(df["n_cpu_moe"].astype(int))), meta.n_layers, clamp, df["model"].iloc[0])
    reps_published = REPETITIONS[revision_key(df["doc_revision"].iloc[0])]
    # One repetition count for every engine keeps it one matched sweep; the larger count means
    # neither side gets fewer best-of tries than it had in the document.
    reps = repetitions or max(reps_published.values())
    wls = split_list(workloads) if workloads else workload_order(df["workload"])
    spec_kw = {"threads": threads} if threads is not None else {}
    spec = SweepSpec(models=[str(resolve_model(model_file))], engines=engines_, depths=[str(d) for d in depths],
                     workloads=wls, repetitions=reps, **spec_kw)      # a model file by its absolute path (run.json)
    layers = int(df["moe_layers"].iloc[0])
    plan = [
        {"item": "published table", "value": f"{df['model'].iloc[0]} | {df['doc_revision'].iloc[0]}"},
        {"item": "model file", "value": f"{model_file} ({meta.name}, {meta.n_layers} layers; published: {layers})"},
        {"item": "engines", "value": f"{engines_[0]} for {A}, {engines_[1]} for {B}"},
        {"item": "n_cpu_moe", "value": ", ".join(map(str, depths))},
        {"item": "workloads", "value": ", ".join(wls)},
        {"item": "repetitions",
         "value": f"{reps} (published best-of: {A} {reps_published[A]}, {B} {reps_published[B]})"},
        {"item": "matched settings", "value": f"threads {spec.threads}, n_ubatch {spec.n_ubatch}, n_batch "
                                              f"{spec.n_batch}, flash-attn {spec.flash_attn} for both engines"},
    ]
    if meta.n_layers != layers:
        plan.append({"item": "note", "value": f"the file has {meta.n_layers} layers, the published model {layers}: "
                                              "this is not the published model"})
    render(plan, fmt, title="reproduce plan")
    if warning:
        click.echo(warning, err=True)
    if dry_run:
        return
    from harness.analysis.report import write_report
    from harness.cli.sweep import every_cell_failed
    from harness.run.progress import sweep_with_progress

    run_dir, _ = sweep_with_progress(spec, Path(results_dir), None)
    rep = write_report([run_dir], Path(reports_dir) / run_dir.name, engine_a=engines_[0], baseline=engines_[1],
                       against=published_model, revision=revision)
    rep.print_tables(fmt)
    none_ok = every_cell_failed(run_dir)
    click.echo(f"results: {run_dir}\nreport: {rep.out_dir / 'report.html'}", err=True)
    if none_ok:
        sys.exit(1)
