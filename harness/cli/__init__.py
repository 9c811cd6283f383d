"""The `moebench` command line: a click group whose commands parse flags and call the layers below.

The only layer that imports click. Each command lives in its own module, imported only when used, so
`moebench --help` stays fast; shared options and the user-error wrapper are in options.py.
"""
from __future__ import annotations

import importlib

import click

COMMANDS = {   # name -> module under harness.cli, attribute
    "sweep": ("sweep", "sweep"), "report": ("report", "report"), "published": ("published", "published"),
    "reproduce": ("reproduce", "reproduce"), "plan": ("plan", "plan"), "recommend": ("recommend", "recommend"),
    "probe": ("probe", "probe"), "compare": ("compare", "compare"), "history": ("history", "history"),
    "engines": ("engines", "engines"), "model": ("model", "model"), "tools": ("tools", "tools"),
    "cache": ("cache", "cache"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        return getattr(importlib.import_module(f"harness.cli.{module}"), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
def cli() -> None:
    """Benchmark MoE expert offload (--n-cpu-moe) across engines at matched depths."""


def main() -> None:
    cli(prog_name="moebench")


if __name__ == "__main__":
    main()
