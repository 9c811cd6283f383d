"""What every command shares: output options, list parsing, model headers, and one sentence for user errors."""
from __future__ import annotations

import functools
import sys

import click

from engines.errors import UserError
from engines.gguf_meta import ModelMeta, clean_text
from harness.analysis.tables import FORMATS

FORMAT = click.option("--format", "fmt", type=click.Choice(FORMATS), default=FORMATS[0], show_default=True,
                      help="Output format. For a sweep, json, jsonl and sql are llama-bench's `-o` output "
                           "(sql: its table, to pipe into sqlite3; sweeps only).")
OUTPUT = click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the output to FILE.")
RESULTS_DIR = click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True)


def user_errors(f):
    """Turn a UserError into one sentence on stderr and exit 2 (no traceback for user mistakes). One line, no
    control characters, bounded: a message may quote a model file."""
    @functools.wraps(f)
    def wrapper(*a, **kw):
        try:
            return f(*a, **kw)
        except UserError as e:
            click.echo(f"error: {clean_text(e, 2000)}", err=True)
            sys.exit(2)
    return wrapper


def split_list(values: str | list[str] | tuple[str, ...]) -> list[str]:
    """`a,b` or repeated flags -> [a, b] (llama-bench style lists)."""
    items = [values] if isinstance(values, str) else list(values)
    return [x.strip() for v in items for x in str(v).split(",") if x.strip()]


def read_header(model: str) -> ModelMeta:
    """A -m value for the commands that read only a model's header (plan, recommend), checked as every command
    checks it: a preset without synthesizing its weights (workloads.synth.preset_meta), else the file."""
    from harness.run.checks import check_model, read_checked
    from workloads.synth import preset_meta, resolve_model

    if not model.startswith("preset:"):
        return read_checked(resolve_model(model))
    meta = preset_meta(model)
    check_model(meta)
    return meta
