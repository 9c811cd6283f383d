"""`moebench tools build-llama-bench`: build the binary the llama-bench engine drives."""
from __future__ import annotations

import click

from engines.errors import UserError
from harness.cli.options import user_errors


@click.group()
def tools() -> None:
    """Build the external binaries that the external engines (llama-bench) drive."""


@tools.command("build-llama-bench")
@click.option("--version", "version", default=None,
              help="llama-cpp-python version whose vendored llama.cpp to build (default: the installed one).")
@click.option("--source", "source", default=None, metavar="DIR",
              help="Build the llama-bench of this ik_llama.cpp or llama.cpp checkout instead (into the cache, under "
                   "its fork and commit; run it with `-e llama-bench@bin=PATH`).")
@click.option("--cuda/--no-cuda", default=None, help="Build with CUDA (default: when nvcc and an NVIDIA GPU are "
                                                     "present).")
@click.option("-j", "--jobs", type=int, default=None, help="Parallel build jobs (default: all cores).")
@click.option("--force", is_flag=True, help="Rebuild even if the cache already holds this version.")
@user_errors
def build_llama_bench(version, source, cuda, jobs, force) -> None:
    """Build llama-bench from llama-cpp-python's source distribution (or a checkout) into the cache directory."""
    from harness.tools import build_llama_bench as build, build_llama_bench_source

    echo = lambda line: click.echo(line, err=True)   # noqa: E731
    if source is not None and version is not None:
        raise UserError("--version and --source name two different sources; give one of them.")
    if source is not None:
        click.echo(build_llama_bench_source(source, cuda, jobs, force, echo=echo))
    else:
        click.echo(build(version, cuda, jobs, force, echo=echo))
