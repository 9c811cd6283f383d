"""The `moebench` command line: a click group that parses flags and calls into the harness (no logic)."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from engines.base import UserError


def user_errors(f):
    """Turn a UserError into one sentence on stderr and exit 2 (no traceback for user mistakes)."""
    @functools.wraps(f)
    def wrapper(*a, **kw):
        try:
            return f(*a, **kw)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
    return wrapper


FORMAT = click.option("--format", "fmt", type=click.Choice(["table", "md", "csv", "json"]), default="table",
                      show_default=True, help="Output format (json = llama-bench field names for sweeps).")
OUTPUT = click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the output to FILE.")


# Commands that live in their own modules, imported only when used (keeps `moebench --help` fast).
LAZY_COMMANDS = {
    "report": "harness.report:report",
    "published": "harness.published:published",
    "reproduce": "harness.published:reproduce",
    "plan": "harness.plan:plan",
    "recommend": "harness.recommend:recommend",
    "probe": "harness.probe:probe",
    "compare": "harness.compare:compare",
    "history": "harness.history:history",
    "tools": "harness.tools:tools",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *filter(self._present, LAZY_COMMANDS)])

    @staticmethod
    def _present(name: str) -> bool:
        import importlib.util
        return importlib.util.find_spec(LAZY_COMMANDS[name].split(":")[0]) is not None

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS and self._present(name):
            import importlib
            module, attr = LAZY_COMMANDS[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
def cli() -> None:
    """Benchmark MoE expert offload (--n-cpu-moe) across engines at matched depths."""


@cli.command()
@click.option("-m", "--model", "models", multiple=True, default=["preset:small"], show_default=True,
              help="GGUF file(s) or preset:NAME[:DTYPE] (synthesized once into the cache); repeat or comma-separate.")
@click.option("-e", "--engines", default="llama-cpp,reference", show_default=True, help="Engines, comma-separated.")
@click.option("--n-cpu-moe", "depths", default="0", show_default=True,
              help="Offload depths: layers whose routed experts stay in RAM; list of N and 'all'.")
@click.option("--cpu-moe", is_flag=True, help="Offload the experts of all layers (same as --n-cpu-moe all).")
@click.option("-w", "--workloads", default="pp4096,pp8192,tg128", show_default=True, help="ppN, tgN, ppN@dD, tgN@dD.")
@click.option("-r", "--repetitions", default=5, show_default=True, type=int, help="Timed repetitions per workload.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores).")
@click.option("--n-ctx", type=int, default=None, help="Context size (default: what the largest workload needs).")
@click.option("--n-batch", type=int, default=2048, show_default=True)
@click.option("--n-ubatch", type=int, default=512, show_default=True)
@click.option("--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@click.option("--timeout", type=float, default=3600, show_default=True, help="Seconds per cell.")
@click.option("--sample-ms", type=float, default=50, show_default=True, help="Memory sampling period; 0 = off.")
@click.option("--cpu-moe-threads", type=int, default=None, help="reference: threads for host expert matmuls.")
@click.option("--moe-stream-min-batch", type=int, default=None,
              help="reference: batches at least this large stream offloaded experts to the accelerator (default 128).")
@click.option("--llama-bench", "llama_bench", type=click.Path(dir_okay=False), default=None,
              help="llama-bench: the binary to run (default: $MOEBENCH_LLAMA_BENCH, `moebench tools build-llama-bench`, PATH).")
@click.option("--tensorsharp", type=click.Path(dir_okay=False), default=None,
              help="tensorsharp: the TensorSharp.Cli binary (default: $MOEBENCH_TENSORSHARP, PATH).")
@click.option("--seed", type=int, default=0, show_default=True, help="Token ids and synthesized weights.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True)
@click.option("--resume", type=click.Path(file_okay=False), default=None, help="Continue results/<run_id>.")
@click.option("--strict", is_flag=True, help="Exit 1 if any cell failed.")
@click.option("--interleave", is_flag=True,
              help="A/B: exactly two engine specs (NAME[@KEY=VALUE]...), measured turn by turn (see README).")
@click.option("--rounds", type=int, default=None,
              help="Run each cell in this many fresh processes, the repetitions split between them, so one "
                   "process's speed does not decide a cell (default 1; with --interleave min(5, repetitions)).")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run the cells on a Ray cluster: auto (RAY_ADDRESS or the local cluster) or ray://HOST:PORT.")
@click.option("--per-node", is_flag=True, help="With --ray: every node runs every cell (compare hardware).")
@FORMAT
@OUTPUT
@user_errors
def sweep(models, engines, depths, cpu_moe, workloads, repetitions, threads, n_ctx, n_batch, n_ubatch, flash_attn,
          timeout, sample_ms, cpu_moe_threads, moe_stream_min_batch, llama_bench, tensorsharp, seed, results_dir,
          resume, strict, interleave, rounds, ray_address, per_node, fmt, output):
    """Run every engine x model x depth cell, each in its own process, and write tidy results."""
    from harness.progress import sweep_with_progress
    from harness.spec import SweepSpec, split_list

    extra = {k: v for k, v in {"cpu_moe_threads": cpu_moe_threads, "moe_stream_min_batch": moe_stream_min_batch}.items()
             if v is not None}
    for key, path in (("llama_bench", llama_bench), ("tensorsharp", tensorsharp)):
        if path:   # kept in the spec; exported so the engines' availability check sees it too
            extra[key] = os.environ[f"MOEBENCH_{key.upper()}"] = str(Path(path).expanduser().absolute())
    spec = SweepSpec(models=split_list(models), engines=split_list(engines),
                     depths=["all"] if cpu_moe else split_list(depths), workloads=split_list(workloads),
                     repetitions=repetitions, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=flash_attn,
                     timeout_s=timeout, sample_ms=sample_ms, seed=seed, extra=extra, ray=ray_address,
                     per_node=per_node, rounds=rounds, **({"threads": threads} if threads else {}))
    if interleave:
        from harness.interleave import run_interleaved
        run_dir, failed = run_interleaved(spec, Path(results_dir), Path(resume) if resume else None)
    else:
        run_dir, failed = sweep_with_progress(spec, Path(results_dir), Path(resume) if resume else None)
    show_run(run_dir, fmt, output)
    click.echo(f"results: {run_dir}", err=True)
    if strict and failed:
        sys.exit(1)


def show_run(run_dir: Path, fmt: str = "table", output: str | None = None) -> None:
    from harness import results
    from harness.roofline import annotate
    from harness.tables import render

    run, cells, meas, _ = results.load_frames(run_dir)
    summary = results.summarize(cells, meas)
    summary = annotate(cells, summary, run.get("hardware_profile"))    # bound_tps, fraction (NaN without a profile)
    many_models = summary["model_name"].nunique() > 1
    rows = []
    for _, r in summary.iterrows():
        rows.append({"engine": r["engine"], **({"model": r["model_name"]} if many_models else {}),
                     "n_cpu_moe": r["n_cpu_moe"], "workload": r["workload"], "status": r["status"],
                     "tok/s median": r["tps_median"], "± std": r["tps_std"], "cv %": 100 * r["tps_cv"],
                     "n": r["tps_n"], "bound tok/s": r["bound_tps"], "% of bound": 100 * r["fraction"],
                     "peak RAM MiB": r["peak_rss_mib"], "peak VRAM MiB": r["peak_vram_mib"]})
        if r["tps_cv"] > results.CV_WARN:
            click.echo(f"warning: {r['engine']} n_cpu_moe={r['n_cpu_moe']} {r['workload']} is unstable "
                       f"(CV {100 * r['tps_cv']:.1f}% > 5%); use more repetitions or a quieter machine.", err=True)
        if r["status"] != "ok":
            click.echo(f"warning: {r['engine']} n_cpu_moe={r['n_cpu_moe']} {r['status']}: {r['error']}", err=True)
    render(rows, fmt, title=f"moebench {run['run_id']}", out=output,
           json_payload=results.llama_bench_records(run, cells, meas))


@cli.command()
@user_errors
def engines() -> None:
    """Which engines run here, their versions, or why not."""
    from engines.registry import engine_class, known_engines
    from harness.tables import render

    rows = []
    for name in known_engines():
        try:
            cls = engine_class(name)
            why = cls.available()
        except UserError as e:
            cls, why = None, str(e)
        rows.append({"engine": name, "available": "yes" if why is None else "no",
                     "version": cls.version() if why is None else "", "note": why or ""})
    render(rows, title="engines")


@cli.group()
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
    from harness.tables import render

    m = read_meta(path)
    render([{"name": m.name, "arch": m.arch, "n_layers": m.n_layers, "moe_layers": len(m.moe_layers),
             "n_expert": m.n_expert, "n_expert_used": m.n_expert_used, "file_mib": m.file_bytes / 2**20,
             "expert_mib": m.expert_bytes() / 2**20, "fingerprint": m.fingerprint}], fmt)


def main() -> None:
    cli(prog_name="moebench")


if __name__ == "__main__":
    main()
