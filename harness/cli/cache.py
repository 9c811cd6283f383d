"""`moebench cache`: simulate device expert caches on recorded routing traces (harness.planning.cache_planner)."""
from __future__ import annotations

from pathlib import Path

import click

from harness.cli.options import FORMAT, OUTPUT, split_list, user_errors


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--vram", "vram", multiple=True,
              help="Cache sizes to simulate, e.g. --vram 256MiB,1GiB,4GiB (repeatable; default: per trace, room for "
                   "1, 2, 4, ... experts in every host layer, up to all of them).")
@click.option("--policy", "policies", multiple=True,
              help="Policies: none, static, lru, lfu, classlru (comma list or repeated; default all).")
@click.option("--global", "global_pool", is_flag=True, help="One cache pool over all host layers (default: per layer).")
@click.option("--cpu-share", type=float, default=0.0, show_default=True,
              help="Share of the misses computed on the CPU instead of uploaded once the cache is full "
                   "(upstream --moe-cache-cpu-share).")
@click.option("--upload-cap", type=int, default=None, help="Most experts uploaded per layer per step.")
@click.option("--n-cpu-moe", type=int, default=None,
              help="Host layers: the first N layers' experts stay in RAM (default: every MoE layer).")
@click.option("--segment", "segments", multiple=True,
              help="Only these workloads of the traces (comma list or repeated).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None,
              help="Write cache.md, cache.html and the plots to this directory.")
@FORMAT
@OUTPUT
@user_errors
def cache(paths, vram, policies, global_pool, cpu_share, upload_cap, n_cpu_moe, segments, report_dir, fmt, output):
    """Hit rate, link and CPU bytes per token of expert caches on routing traces (.npz files or run directories
    recorded with `moebench sweep --trace-routing`), with Belady and the best static set as bounds, the traces'
    statistics, and the time model fitted on the runs' measured cells."""
    from harness.analysis.tables import render
    from harness.planning import cache_planner as plan_cache
    from harness.planning import cache_time_model
    from harness.units import MiB, parse_size

    budgets = [parse_size(x, "--vram") / MiB for x in split_list(vram)]
    names = split_list(policies) or None
    traces = plan_cache.load([Path(p) for p in paths], split_list(segments) or None)
    studies = []
    for label, t in traces:
        sizes = budgets or default_budgets(t, n_cpu_moe)
        if not budgets:
            click.echo(f"note: no --vram: {label}: caches of {', '.join(f'{b:g}' for b in sizes)} MiB (1, 2, 4, ... "
                       f"of its {t.n_expert} experts in each host layer)", err=True)
        studies.append(plan_cache.study(label, t, sizes, names, global_pool=global_pool, cpu_share=cpu_share,
                                        upload_cap=upload_cap, n_cpu_moe=n_cpu_moe))
    runs = [Path(p) for p in paths if (Path(p) / "cells.csv").exists()]
    points = cache_time_model.measured_points(runs) if runs else []
    fits = cache_time_model.fit_all(points) if points else {}
    table = [r for st in studies for r in plan_cache.rows(st)]
    render(table, fmt, title="expert caches (bounds: Belady, best static set in hindsight)", out=output,
           json_payload=plan_cache.to_json(studies, fits))
    if fmt in ("table", "md") and output is None:
        render([r for st in studies for r in plan_cache.stats_rows(st)], fmt, title="trace statistics")
        render([r for st in studies for r in plan_cache.reuse_rows(st)], fmt,
               title="reuse distance (% of token selections, tokens since the layer last used the expert)")
    for f in fits.values():
        click.echo(f"time model: {f.describe()}", err=True)
    if runs and not points:
        click.echo("time model: no measured cells with matching traces in the runs", err=True)
    if report_dir:
        from harness.analysis.cache_report import write_cache_report
        page = write_cache_report(studies, Path(report_dir), fits, points)
        click.echo(f"report: {page}", err=True)


def default_budgets(trace, n_cpu_moe: int | None) -> list[float]:
    """MiB of caches that hold 1, 2, 4, ... experts of every host layer, up to all of them: the range from the
    smallest cache that helps at all to one that keeps every offloaded expert (cache_replay.capacity_for splits a
    budget the same way). No host layer at this depth: one empty cache."""
    from harness.planning.cache_replay import MiB, host_layers

    host = host_layers(trace, n_cpu_moe)
    one = sum(trace.expert_bytes[i] for i in host)          # bytes of one expert in each host layer
    if not one:
        return [0.0]
    n = trace.n_expert
    return [c * one / MiB for c in sorted({*(1 << i for i in range(n.bit_length())), n})]
