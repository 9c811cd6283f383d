"""`moebench report`: report.md, a self-contained report.html and PNG plots from result directories."""
from __future__ import annotations

from pathlib import Path

import click

from harness.cli.options import FORMAT, user_errors


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Report directory (default: reports/<run_id>).")
@click.option("--engine", "engine_a", default=None, help="Engine A of the published layout (default: reference).")
@click.option("--baseline", default=None, help="Engine B, the baseline of ratios and speedups (default: llama-cpp).")
@click.option("--against-published", default=None, help="Place the numbers next to a published model's table.")
@click.option("--published-revision", default="final", show_default=True, help="final | 2026-08-05 | 2026-08-04")
@FORMAT
@user_errors
def report(runs, output, engine_a, baseline, against_published, published_revision, fmt) -> None:
    """Write report.md, a self-contained report.html and PNG plots from result directories; print the tables."""
    from harness.analysis.report import write_report

    dirs = [Path(r) for r in runs]
    out = Path(output) if output else Path("reports") / (dirs[0].name + (f"+{len(dirs) - 1}" if len(dirs) > 1 else ""))
    rep = write_report(dirs, out, engine_a, baseline, against_published, published_revision)
    rep.print_tables(fmt)
    click.echo(f"report: {out / 'report.html'}", err=True)
