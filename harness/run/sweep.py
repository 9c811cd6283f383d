"""A sweep from start to end: check every input, make (or resume) the run directory, run the cells here
(harness.run.runner, one process each) or on a Ray cluster (harness.run.ray), index the finished run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from engines.errors import UserError
from harness.run.ray import Cluster
from harness.run.runner import drop_unfinished, new_run_dir, prepare_run_dir, run_rounds, write_run_json
from harness.run.spec import Cell, SweepSpec, expand
from harness.store import results
from harness.store.history import index_run      # every finished run is indexed into <results-dir>/history.sqlite


def run_sweep(spec: SweepSpec, results_dir: Path, resume: Path | None = None,
              on_cell: Callable[[Cell, dict, int, int], None] | None = None,
              on_start: Callable[[Path], None] | None = None) -> Path:
    """Run every cell not yet finished; returns the run directory. on_cell(cell, row, i, n) reports progress."""
    if resume:
        results.require_run(resume)
        spec = SweepSpec.from_dict(json.loads((resume / "run.json").read_text())["spec"])
    cells = expand(spec)
    cluster = None
    if spec.ray or spec.per_node or spec.ray_nodes:   # connect first: a missing Ray or cluster leaves no run directory
        if (spec.rounds or 1) > 1:
            raise UserError("--rounds does not apply to --ray sweeps (each node runs a cell once); drop --rounds.")
        cluster = Cluster.connect(spec)
    run_dir = resume or new_run_dir(results_dir, spec)
    prepare_run_dir(run_dir)
    done = drop_unfinished(run_dir) if resume else set()
    if not resume:
        write_run_json(run_dir, spec)
    todo = [c for c in cells if c.cell_id not in done]
    if on_start:
        on_start(run_dir)
    if cluster:
        cluster.run(spec, cells, run_dir, done, on_cell)
        index_run(run_dir)
        return run_dir
    for i, cell in enumerate(todo):
        row, meas, samples = run_rounds(cell, spec, run_dir)
        results.append_cell(run_dir, row, meas, samples)
        if on_cell:
            on_cell(cell, row, i + 1, len(todo))
    index_run(run_dir)
    return run_dir
