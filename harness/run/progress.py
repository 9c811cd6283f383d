"""A sweep with a progress bar over its processes (cells, or rounds of cells) on stderr; Ctrl-C keeps every
finished cell and round."""
from __future__ import annotations

import sys
from pathlib import Path

from harness.run.sweep import run_sweep
from harness.run.spec import Cell, SweepSpec


def sweep_with_progress(spec: SweepSpec, results_dir: Path, resume: Path | None) -> tuple[Path, int]:
    """Run the sweep; returns (run directory, number of cells that did not finish ok)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    failed = 0
    started: dict = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("cells", total=None)

        def on_cell(cell: Cell, row: dict, i: int, n: int) -> None:
            nonlocal failed
            failed += row["status"] != "ok"          # a failed round ends its cell: counted once
            rnd = f"round {row['round']}/{row['rounds']} " if row.get("rounds", 1) > 1 else ""
            bar.update(task, total=n, completed=i,
                       description=f"{rnd}{cell.engine} n_cpu_moe={cell.settings.n_cpu_moe}: {row['status']}")

        try:
            run_dir = run_sweep(spec, results_dir, resume, on_cell=on_cell, on_start=lambda d: started.update(dir=d))
        except KeyboardInterrupt:
            bar.stop()
            d = started.get("dir")
            console.print(f"interrupted: finished cells and rounds are kept in {d}; continue with --resume {d}")
            sys.exit(130)
    return run_dir, failed
