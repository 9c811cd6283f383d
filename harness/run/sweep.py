"""A sweep from start to end: check every input, make (or resume) the run directory, run the cells here
(harness.run.runner, one process each) or on a Ray cluster (harness.run.ray), index the finished run.

Rounds (asv's `rounds`): with --rounds K the sweep runs K times over. Round 1 runs every cell once, in a fresh
process with its share of the repetitions, then round 2 runs every cell again, and so on, so a machine that drifts
between the start and the end of a sweep (here the same cell moved from 548 to 943 tok/s between two sweeps
minutes apart) slows every engine and depth alike instead of whichever cells ran last. Within a round the cells
of one model x depth (one per engine: the cells a table compares) run next to each other, the engine that goes
first rotating from round to round; those groups are shuffled per round with a seed recorded in the spec
(`round_seed`) and the plan in run.json["rounds"]. Each cell is still one cell in the results (runner.join_rounds);
its measurements keep their `round`. A round waits in rounds/ until its cell's last round, so --resume goes on
with the next round. `round_order="back-to-back"` keeps the old order (each cell's rounds one after the other),
to measure what interleaving buys. A sweep of one round runs its cells in the sweep's own order.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Callable

from engines.errors import UserError
from harness.run.ray import Cluster
from harness.run.runner import (ROUNDS_DIR, drop_rounds, drop_unfinished, join_rounds, load_rounds, new_run_dir,
                                prepare_run_dir, round_sizes, run_cell, save_round, write_run_json)
from harness.run.spec import Cell, SweepSpec, default_rounds, expand
from harness.store import results
from harness.store.history import index_run      # every finished run is indexed into <results-dir>/history.sqlite


def round_plan(cells: list[Cell], k: int, seed: int) -> list[list[Cell]]:
    """The cells of each of k rounds in the order they run (interleaved): the cells of one model x depth side by
    side, the first of them rotating per round (and per group, so within a round half the groups start with
    each of two engines); the groups shuffled per round."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((str(c.model), c.settings.n_cpu_moe, c.node), []).append(c)
    plan = []
    for r in range(k):
        order = [g[(r + i) % len(g):] + g[:(r + i) % len(g)] for i, g in enumerate(groups.values())]
        random.Random(f"{seed}/{r}").shuffle(order)       # a str seed hashes the same in every process
        plan.append([c for g in order for c in g])
    return plan


def schedule(cells: list[Cell], spec: SweepSpec) -> tuple[list[int], list[list[Cell]], list[tuple[int, Cell]]]:
    """(repetitions per round, cells per round, (round, cell) in the order they run, rounds from 0)."""
    sizes = round_sizes(spec.repetitions, spec.rounds or 1)
    if spec.round_order == "back-to-back" or len(sizes) == 1:         # one round: the sweep's own order
        plan = [list(cells) for _ in sizes]
        return sizes, plan, [(r, c) for c in cells for r in range(len(sizes))]
    plan = round_plan(cells, len(sizes), spec.round_seed or 0)
    return sizes, plan, [(r, c) for r, cells_r in enumerate(plan) for c in cells_r]


def _new_spec(spec: SweepSpec) -> tuple[SweepSpec, bool]:
    """A new sweep's spec with its rounds and order seed decided (both go into run.json); True when the
    rounds are the default."""
    defaulted = spec.rounds is None
    return dataclasses.replace(spec, rounds=default_rounds(spec) if defaulted else spec.rounds,
                               round_seed=random.randrange(1 << 31) if spec.round_seed is None
                               else spec.round_seed), defaulted


def run_sweep(spec: SweepSpec, results_dir: Path, resume: Path | None = None,
              on_cell: Callable[[Cell, dict, int, int], None] | None = None,
              on_start: Callable[[Path], None] | None = None) -> Path:
    """Run every cell not yet finished; returns the run directory. on_cell(cell, row, i, n) reports progress:
    after each process (a round of a cell; row["round"] says which, from 1), i of n."""
    defaulted = False
    if resume:
        results.require_run(resume)
        spec = SweepSpec.from_dict(json.loads((resume / "run.json").read_text())["spec"])
    else:
        spec, defaulted = _new_spec(spec)
    cells = expand(spec)
    cluster = None
    if spec.ray or spec.per_node or spec.ray_nodes:   # connect first: a missing Ray or cluster leaves no run directory
        if (spec.rounds or 1) > 1:
            raise UserError("--rounds does not apply to --ray sweeps (each node runs a cell once); drop --rounds.")
        cluster = Cluster.connect(spec)
    sizes, plan, steps = schedule(cells, spec)
    run_dir = resume or new_run_dir(results_dir, spec)
    prepare_run_dir(run_dir)
    done = drop_unfinished(run_dir) if resume else set()
    if not resume:
        write_run_json(run_dir, spec, rounds={"sizes": sizes, "order": spec.round_order, "seed": spec.round_seed,
                                              "default": defaulted, "plan": [[c.cell_id for c in p] for p in plan]})
        if defaulted and len(sizes) > 1:
            cap = ", at most one per repetition" if len(sizes) < (spec.rounds or 1) else ""
            print(f"note: --rounds {len(sizes)} (the default with more than one engine{cap}): every cell runs in "
                  f"{len(sizes)} fresh processes, round by round, so drift falls on every engine alike; "
                  "--rounds 1 runs each cell in one process.", file=sys.stderr)
    if on_start:
        on_start(run_dir)
    if cluster:
        cluster.run(spec, cells, run_dir, done, on_cell)
        index_run(run_dir)
        return run_dir
    parts = {c.cell_id: load_rounds(run_dir, c.cell_id) for c in cells if c.cell_id not in done}
    steps = [(r, c) for r, c in steps if c.cell_id in parts and r >= len(parts[c.cell_id])]
    ended: set[str] = set()                    # cells whose last round ran, or that failed in a round
    i, n = 0, len(steps)
    for r, cell in steps:
        if cell.cell_id in ended:
            continue
        got = parts[cell.cell_id]
        got.append(run_cell(cell, dataclasses.replace(spec, repetitions=sizes[r]), run_dir, run_dir.name))
        row = got[-1][0]
        if row["status"] != "ok" or len(got) == len(sizes):     # a failed round ends its cell
            results.append_cell(run_dir, *join_rounds(got))
            drop_rounds(run_dir, cell.cell_id)
            ended.add(cell.cell_id)
            n -= len(sizes) - len(got)            # its rounds that will not run
        else:
            save_round(run_dir, cell.cell_id, r, got[-1])
        i += 1
        if on_cell:
            on_cell(cell, row | {"round": r + 1, "rounds": len(sizes)}, i, n)
    if (run_dir / ROUNDS_DIR).is_dir() and not any((run_dir / ROUNDS_DIR).iterdir()):
        (run_dir / ROUNDS_DIR).rmdir()
    index_run(run_dir)
    return run_dir
