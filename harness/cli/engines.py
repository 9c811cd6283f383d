"""`moebench engines`: which engines run here, their versions, or why not."""
from __future__ import annotations

import click

from engines.errors import UserError
from harness.cli.options import user_errors


@click.command()
@user_errors
def engines() -> None:
    """Which engines run here, their versions, or why not."""
    from engines.registry import engine_class, known_engines
    from harness.analysis.tables import render

    rows = []
    for name in known_engines():
        try:
            cls = engine_class(name)
            why = cls.available()
        except UserError as e:
            cls, why = None, str(e)
        rows.append({"engine": name, "available": "yes" if why is None else "no",
                     "version": cls.version() if why is None else "", "ISA": cls.isa() if why is None else "",
                     "note": why or ""})
        for spec, (why, version, isa) in (cls.variants() if cls else {}).items():
            rows.append({"engine": spec, "available": "yes" if why is None else "no", "version": version,
                         "ISA": isa, "note": why or ""})
    render(rows, title="engines")
