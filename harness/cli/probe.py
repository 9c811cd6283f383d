"""`moebench probe`: measure host/GPU bandwidth and matmul throughput, store the hardware profile."""
from __future__ import annotations

import click

from harness.cli.options import FORMAT, OUTPUT, user_errors


@click.command()
@click.option("--threads", type=int, default=None, help="CPU threads for the matmul figures (default: all cores).")
@click.option("--quick", is_flag=True, help="Smaller sizes, 3 repetitions (about a second).")
@click.option("--no-save", is_flag=True, help="Do not store the profile.")
@FORMAT
@OUTPUT
@user_errors
def probe(threads, quick, no_save, fmt, output):
    """Measure host/GPU bandwidth and matmul throughput; store the hardware profile for the roofline."""
    from engines.errors import UserError
    from harness.analysis.tables import render
    from harness.hw.probe import measure, save_profile

    if threads is not None and threads < 1:
        raise UserError(f"--threads {threads} must be at least 1.")
    p = measure(threads, quick)
    rows = [{"figure": k, "median": f["median"], "min": f["min"], "max": f["max"], "cv %": 100 * f["cv"],
             "n": f["n"], "unit": f["unit"]} for k, f in p["figures"].items()]
    if p.get("cuda"):
        rows.append({"figure": "vram_free_mib", "median": p["vram_free_mib"], "unit": f"of {p['vram_total_mib']:,.0f} "
                                                                                      f"MiB"})
    render(rows, fmt, title=f"hardware profile: {p['hostname']}, {p['threads']} threads", out=output, json_payload=p)
    if not no_save:
        click.echo(f"stored: {save_profile(p)}", err=True)
