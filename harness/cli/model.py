"""`moebench model synth | info`: synthesize and inspect GGUF models."""
from __future__ import annotations

import click

from engines.errors import UserError
from harness.cli.options import FORMAT, user_errors


@click.group()
def model() -> None:
    """Synthesize and inspect GGUF models."""


@model.command()
@click.option("--preset", default="tiny", show_default=True, help="A preset (`moebench model presets` lists them).")
@click.option("--dtype", default=None,
              help="A llama.cpp file type: f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m q6_k iq4_xs mxfp4 (default: the "
                   "preset's); each tensor gets the type llama-quantize gives it.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--sparse", is_flag=True, help="Header and tensor table only, the data a hole (for `moebench plan` "
                                             "of the full-size models; no weights, no disk).")
@click.option("--zipf", default=None, type=float,
              help="Plant routing: expert popularity per layer Zipf with this exponent, experts tied to token "
                   "clusters (token_id %% clusters); recorded as moebench.routing.* metadata. -m spelling: "
                   "preset:NAME[:DTYPE]@zipf=S[@clusters=C].")
@click.option("--clusters", default=0, type=int, help="With --zipf: token clusters (default min(4 experts, n_embd)).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@user_errors
def synth(preset, dtype, seed, sparse, zipf, clusters, output) -> None:
    """Write a deterministic random-weight MoE GGUF (same preset + seed = same bytes)."""
    from workloads.planted import Planting
    from workloads.synth import synthesize

    if clusters and zipf is None:
        raise UserError("--clusters plants routing only together with --zipf; add --zipf S (0 = uniform).")
    routing = Planting(zipf, clusters) if zipf is not None else None
    path = synthesize(preset, output, seed=seed, dtype=dtype, sparse=sparse, routing=routing)
    click.echo(f"wrote {path} ({path.stat().st_size / 2**20:,.1f} MiB{', sparse' if sparse else ''})")


@model.command()
@user_errors
def presets() -> None:
    """The synthesizer's presets: architecture, layers, experts, file type, size."""
    from engines.gguf_meta import tensor_bytes
    from engines.reference.archs import ARCHS, PRESETS
    from harness.analysis.tables import render
    from workloads.synth import tensor_shapes
    from workloads.quantize import tensor_types

    rows = []
    for name, p in PRESETS.items():
        h, shapes = p.h, tensor_shapes(p)
        types = tensor_types(p.dtype, shapes, h.n_layers, h.arch, n_expert=h.n_expert, n_head=h.n_head,
                             n_head_kv=h.n_head_kv)
        size = sum(tensor_bytes(types[n], s) for n, s in shapes.items())
        rows.append({"preset": name, "arch": h.arch, "layers": h.n_layers, "n_embd": h.n_embd,
                     "experts": f"{h.n_expert_used}/{h.n_expert}", "dtype": p.dtype, "GiB": size / 2**30,
                     "reference engine": "no" if ARCHS[h.arch].unsupported else "yes"})
    render(rows, title="presets (moebench model synth --preset NAME [--dtype D]; -m preset:NAME[:DTYPE][@zipf=S])")


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
