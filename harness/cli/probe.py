"""`moebench probe`: measure host/GPU bandwidth and matmul throughput, store the hardware profile."""
from __future__ import annotations

import click

from harness.cli.options import FORMAT, OUTPUT, user_errors


@click.command()
@click.option("--threads", type=int, default=None, help="CPU threads for the matmul figures (default: all cores).")
@click.option("--quick", is_flag=True, help="Smaller sizes, 3 repetitions (a few seconds).")
@click.option("--no-save", is_flag=True, help="Do not store the profile.")
@FORMAT
@OUTPUT
@user_errors
def probe(threads, quick, no_save, fmt, output):
    """Measure host/GPU bandwidth and matmul throughput (fp32, bf16, int8); store the hardware profile for the
    roofline. Also shows the read bandwidth a sweep measures at its start (1 thread and --threads), which its decode
    bounds divide by."""
    from engines.errors import UserError
    from harness.analysis.tables import render
    from harness.hw.probe import measure, read_bandwidth, save_profile

    if threads is not None and threads < 1:
        raise UserError(f"--threads {threads} must be at least 1.")
    p = measure(threads, quick)
    # as a sweep measures it at its start; for the reader only (a run's bounds divide by the run's own)
    p["read_bandwidth"] = bw = read_bandwidth({1, p["threads"]})
    rows = [{"figure": k, "median": f["median"], "min": f["min"], "max": f["max"], "cv %": 100 * f["cv"],
             "n": f["n"], "unit": f["unit"]} for k, f in p["figures"].items()]
    rows += [{"figure": f"read, {n} threads ({bw['buffer_mib']:,.0f} MiB, as a sweep)", "median": "", "min": "",
              "max": v, "cv %": "", "n": "", "unit": "GB/s"} for n, v in bw.get("threads", {}).items()]
    if p.get("cuda"):
        rows.append({"figure": "vram_free_mib", "median": p["vram_free_mib"], "unit": f"of {p['vram_total_mib']:,.0f} "
                                                                                      f"MiB"})
    render(rows, fmt, title=f"hardware profile: {p['hostname']}, {p['threads']} threads", out=output, json_payload=p)
    if not no_save:
        click.echo(f"stored: {save_profile(p)}", err=True)
