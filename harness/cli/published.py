"""`moebench published`: TensorSharp's published tables in the published layout."""
from __future__ import annotations

import click

from harness.cli.options import FORMAT, user_errors


@click.command()
@click.option("--model", default=None, help="Only this model (e.g. Qwen3.5-35B-A3B).")
@click.option("--revision", default=None, help="Only this revision of the document: final | 2026-08-05 | 2026-08-04.")
@FORMAT
@user_errors
def published(model, revision, fmt) -> None:
    """TensorSharp's published tables, with ratios recomputed from the data next to the printed ones."""
    from harness.analysis.published import display, load, select, tables
    from harness.analysis.tables import render

    groups = tables(select(load(), model, revision))
    if fmt in ("csv", "json", "jsonl"):       # one machine-readable document, raw numbers
        render([r for _, rows in groups for r in rows], fmt)
        return
    for title, rows in groups:
        render(display([{k: v for k, v in r.items() if k not in ("revision", "model")} for r in rows]), fmt, title)
