"""`moebench compare BASE CAND`: per-cell verdicts a CI job can act on."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from engines.errors import UserError
from harness.cli.options import FORMAT, OUTPUT, split_list, user_errors


@click.command()
@click.argument("base")
@click.argument("cand")
@click.option("--threshold", default="5%", show_default=True,
              help="Smallest relative change that counts (5% or 0.05).")
@click.option("--alpha", default=0.05, show_default=True, type=float,
              help="1 - the interval's confidence level (0.05: the 95% interval every table prints).")
@click.option("--metric", type=click.Choice(["tokens_per_s", "ns"]), default="tokens_per_s", show_default=True,
              help="tokens_per_s: higher is better; ns (time per repetition): lower is better.")
@click.option("--ignore", default="", help="Key fields to leave out of cell matching, e.g. threads (comma list).")
@click.option("--fail-on-regression", is_flag=True, help="Exit 1 if any cell regressed or the candidate's cell failed.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True,
              help="Where history.sqlite is (for history:... selectors).")
@FORMAT
@OUTPUT
@user_errors
def compare(base, cand, threshold, alpha, metric, ignore, fail_on_regression, results_dir, fmt, output) -> None:
    """Compare CAND against BASE cell by cell.

    BASE and CAND are run directories, RUN:A / RUN:B (the arms of an interleaved run), or history
    selectors: history:latest, history:<run_id>, history:median-of-last-5 (the newest runs that
    measured each cell, the candidate's run excluded)."""
    from harness.analysis.compare import emit, headline, judge

    result, t, notes = judge(base, cand, Path(results_dir), metric, alpha, threshold, split_list(ignore))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    head = headline(result, alpha, t, metric)
    emit(result, fmt, output, f"{cand} vs {base}", head)
    if fmt in ("json", "jsonl", "csv") or output:
        click.echo(head, err=True)
    insufficient = [r for r in result["cells"] if r["verdict"] == "insufficient data" and r["n_base"] and r["n_cand"]]
    if insufficient:
        click.echo(f"insufficient data: {len(insufficient)} cell(s) give no interval ({insufficient[0]['note']}).",
                   err=True)
    if fail_on_regression and any(r["verdict"] in ("regression", "candidate failed") for r in result["cells"]):
        sys.exit(1)
    if fail_on_regression and insufficient and len(insufficient) == len(result["cells"]):
        # a gate that can judge nothing would pass every build: say so instead of exiting 0
        raise UserError(f"--fail-on-regression judged no cell: {insufficient[0]['note']}.")
