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
to measure what interleaving buys; its rounds did not run at the same time, so no reader pairs them
(harness.store.history.pairing). A sweep of one round runs its cells in the sweep's own order.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

from engines.errors import UserError
from harness.hw.probe import read_bandwidth, with_host_best
from harness.run.ray import Cluster
from harness.run.runner import (ROUNDS_DIR, drop_rounds, drop_unfinished, join_rounds, load_rounds, new_run_dir,
                                prepare_run_dir, probe_steadiness, round_sizes, run_cell, save_round, save_run_json,
                                write_run_json)
from harness.run.until import PILOT
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
        if spec.until:
            raise UserError("--until adds rounds, which --ray sweeps do not have; drop --until.")
        cluster = Cluster.connect(spec)
    if spec.until and not any(len({c.engine + c.variant for c in cells if (c.model, c.depth) == (x.model, x.depth)}) > 1
                              for x in cells):
        raise UserError("--until makes the ratios between engines precise, and this sweep compares none; "
                        "pass two or more engines (or knob values), or drop --until.")
    if spec.until and spec.round_order == "back-to-back":
        raise UserError("--until pairs rounds that ran at the same time, and back-to-back rounds do not; "
                        "drop --round-order back-to-back.")
    if spec.until and spec.max_rounds < PILOT:
        raise UserError(f"--max-rounds {spec.max_rounds} leaves --until no pilot; it needs {PILOT} rounds or more.")
    sizes, plan, steps = schedule(cells, spec)
    run_dir = resume or new_run_dir(results_dir, spec)
    prepare_run_dir(run_dir)
    done = drop_unfinished(run_dir) if resume else set()
    if not resume:
        write_run_json(run_dir, spec, rounds={"sizes": sizes, "order": spec.round_order, "seed": spec.round_seed,
                                              "default": defaulted, "plan": [[c.cell_id for c in p] for p in plan]},
                       # the decode bound's bandwidth, here at each thread count (a Ray cell runs on another host)
                       bandwidth=None if cluster else
                       with_host_best(read_bandwidth({c.settings.threads for c in cells})))
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
    ended: set[str] = set()                    # cells whose rows are written: last round ran, or one failed

    def finish(cell: Cell) -> None:
        results.append_cell(run_dir, *join_rounds(parts[cell.cell_id]))
        drop_rounds(run_dir, cell.cell_id)
        ended.add(cell.cell_id)

    def run_round(r: int, cell: Cell, reps: int) -> dict:
        got = parts[cell.cell_id]
        got.append(run_cell(cell, dataclasses.replace(spec, repetitions=reps), run_dir, run_dir.name))
        if got[-1][0]["status"] != "ok" or (len(got) == len(sizes) and not spec.until):   # a failed round ends it
            finish(cell)
        else:
            save_round(run_dir, cell.cell_id, r, got[-1])
        return got[-1][0]

    i, n, current = 0, len(steps), None
    for r, cell in steps:
        if cell.cell_id in ended:
            continue
        if r != current:
            probe_steadiness(run_dir, f"round {r + 1}")
            current = r
        row = run_round(r, cell, sizes[r])
        if cell.cell_id in ended:
            n -= len(sizes) - len(parts[cell.cell_id])      # its rounds that will not run
        i += 1
        if on_cell:
            on_cell(cell, row | {"round": r + 1, "rounds": len(sizes)}, i, n)
    if spec.until:
        _until(spec, cells, parts, ended, sizes, run_dir, run_round, on_cell)
        for cell in cells:
            if cell.cell_id in parts and cell.cell_id not in ended:
                finish(cell)
    probe_steadiness(run_dir, "end")
    if (run_dir / ROUNDS_DIR).is_dir() and not any((run_dir / ROUNDS_DIR).iterdir()):
        (run_dir / ROUNDS_DIR).rmdir()
    index_run(run_dir)
    return run_dir


def _until(spec: SweepSpec, cells: list[Cell], parts: dict, ended: set, sizes: list[int], run_dir: Path,
           run_round: Callable, on_cell) -> None:
    """--until (harness.run.until: Stein's two-stage rule): the cells in compared pairs run interleaved rounds
    up to the pilot (PILOT, or the planned rounds if more), then, round by round, those whose pairs need more, up to
    what the pilot fixed (at most spec.max_rounds rounds in all, none started after spec.max_minutes); then say in
    run.json["until"] (and on stderr) what each pair needed and got, and why any fell short. run.json["until"]
    ["pilot"] is what every reader needs to compute the same interval."""
    from harness.run.until import pairs, rounds_wanted

    pilot, cap = max(PILOT, len(sizes)), max(spec.max_rounds, len(sizes))
    t0, k = time.monotonic(), len(sizes)
    while True:
        wanted = rounds_wanted(pairs(cells, parts, spec.until, pilot), cap)
        need = {c for c, n in wanted.items() if n > k} - ended
        out_of_time = spec.max_minutes is not None and time.monotonic() - t0 > 60 * spec.max_minutes
        if not need or out_of_time:
            break
        probe_steadiness(run_dir, f"round {k + 1}")
        todo = round_plan([c for c in cells if c.cell_id in need], k + 1, spec.round_seed or 0)[k]
        for j, cell in enumerate(todo):
            row = run_round(len(parts[cell.cell_id]), cell, sizes[0])
            if on_cell:
                on_cell(cell, row | {"round": k + 1, "rounds": k + 1}, j + 1, len(todo))
        k += 1
    final = pairs(cells, parts, spec.until, pilot)
    unmet = [p for p in final if not p.reached]
    why = ("no compared pair has every round ok" if not final else "target reached" if not unmet else
           f"max minutes ({spec.max_minutes:g})" if out_of_time else f"max rounds ({cap})")
    report = {"target": spec.until, "method": "two-stage (Stein)", "pilot": pilot, "rounds": k, "stopped_by": why,
              "pairs": [{"a": p.a, "b": p.b, "workload": p.workload, "s0": p.s0, "needed": p.needed,
                         "half_width": p.half_width, "rounds": p.rounds, "reached": p.reached,
                         **({"why": p.why()} if not p.reached else {})} for p in final]}
    run = json.loads((run_dir / "run.json").read_text())
    save_run_json(run_dir, run | {"until": report})
    print(f"--until {spec.until:.1%}: {k} rounds (a pilot of {pilot}, then what each pair's pilot asked for); "
          f"{len(final) - len(unmet)} of {len(final)} compared ratios within ±{spec.until:.1%} ({why})",
          file=sys.stderr)
    for p in unmet:
        print(f"  not reached: {p.a} vs {p.b} {p.workload}: ±{p.half_width:.1%} after {p.rounds} rounds; {p.why()}",
              file=sys.stderr)
