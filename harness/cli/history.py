"""`moebench history`: each cell's median tokens/s across the indexed runs, as a table and a plot."""
from __future__ import annotations

import json
from pathlib import Path

import click

from harness.cli.options import FORMAT, split_list, user_errors


@click.command()
@click.option("-e", "--engine", "engines", multiple=True, help="Only these engines (repeat or comma-separate).")
@click.option("-w", "--workload", "workloads", multiple=True, help="Only these workloads, e.g. pp512,tg128.")
@click.option("--depth", "depths", multiple=True, help="Only these --n-cpu-moe depths (N or all).")
@click.option("--last", default=20, show_default=True, type=int, help="Show the newest N runs.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True,
              help="Where the runs and history.sqlite are.")
@click.option("-o", "--output", "plot", type=click.Path(dir_okay=False), default="reports/history.png",
              show_default=True, help="Write the trend plot (PNG) here.")
@FORMAT
@user_errors
def history(engines, workloads, depths, last, results_dir, plot, fmt) -> None:
    """Each cell's median tokens/s across the indexed runs: a trend table and a PNG plot."""
    from harness.analysis.plots import history_plot
    from harness.analysis.tables import render
    from harness.store.history import db_path, settings_label, trend
    from harness.store.results import KEY_FIELDS

    runs, rows = trend(db_path(results_dir), split_list(engines), split_list(workloads), split_list(depths), last)
    table = []
    for run_id, started, arm, engine, model, ncm, wl, key, n, med, std, status in rows:
        label = settings_label(dict(zip(KEY_FIELDS, json.loads(key))))
        table.append({"run": run_id + (f":{arm}" if arm else ""), "started": started[:19], "engine": engine,
                      "model": model, "n_cpu_moe": ncm, "workload": wl, "settings": label, "n": n,
                      "tok/s median": med, "± std": std if std is not None else float("nan"), "status": status})
    render(table, fmt, title=f"history ({len(runs)} runs)")
    history_plot(table, Path(plot))
    click.echo(f"plot: {plot}", err=True)
