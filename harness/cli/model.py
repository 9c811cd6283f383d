"""`moebench model synth | info`: synthesize and inspect GGUF models."""
from __future__ import annotations

import click

from harness.cli.options import FORMAT, user_errors


@click.group()
def model() -> None:
    """Synthesize and inspect GGUF models."""


@model.command()
@click.option("--preset", default="tiny", show_default=True, help="tiny | small | qwen3-30b-a3b-4l")
@click.option("--dtype", default=None, help="f32 | f16 | bf16 | q8_0 | q4_0 (default: the preset's).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@user_errors
def synth(preset, dtype, seed, output) -> None:
    """Write a deterministic random-weight MoE GGUF (same preset + seed = same bytes)."""
    from workloads.synth import synthesize

    path = synthesize(preset, output, seed=seed, dtype=dtype)
    click.echo(f"wrote {path} ({path.stat().st_size / 2**20:,.1f} MiB)")


@model.command()
@click.argument("path", type=click.Path())
@FORMAT
@user_errors
def info(path, fmt) -> None:
    """Architecture, layers, experts and expert bytes of a GGUF file."""
    from engines.gguf_meta import read_meta
    from harness.analysis.tables import render
    from harness.run.checks import model_problems

    m = read_meta(path)
    render([{"name": m.name, "arch": m.arch, "n_layers": m.n_layers, "moe_layers": len(m.moe_layers),
             "n_expert": m.n_expert, "n_expert_used": m.n_expert_used, "file_mib": m.file_bytes / 2**20,
             "expert_mib": m.expert_bytes() / 2**20, "fingerprint": m.fingerprint}], fmt)
    problems = model_problems(m)
    if problems:     # shown, not refused: info is how one looks at a broken file
        click.echo(f"warning: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                   + "; `moebench sweep` refuses this file.", err=True)
