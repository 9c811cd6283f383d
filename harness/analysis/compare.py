"""`moebench compare BASE CAND`: per-cell verdicts a CI job can act on.

A cell is a regression (or improvement) only when the change is both statistically significant (the 95 % interval
of cand / base, harness.stats.ratio_interval, the one every table prints, excludes 1) and larger than the threshold
(asv's rule), so noise stays quiet and tiny-but-real shifts do not fail a build. The interval's units are processes
(rounds): a run of one process a side gives no verdict ("insufficient data", with why), since its repetitions see
none of the few percent by which two processes of one build differ. Cells are matched by their full configuration
key (harness.store.results.KEY_FIELDS); nothing is ever pooled across depths or settings.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from engines.errors import UserError
from harness.store import history
from harness.store.results import KEY_FIELDS
from harness.units import parse_fraction

SELECTOR = re.compile(r"^history:(latest|median-of-last-(\d+)|.+)$")


@dataclass
class CellResult:
    """One matched cell: medians, ratio cand/base with its interval (harness.stats.ratio_interval), verdict."""
    n_base: int
    n_cand: int
    base_median: float
    cand_median: float
    ratio: float        # the interval's centre: geometric mean of the round ratios / ratio of the process means
    median_ratio: float
    ci_low: float
    ci_high: float
    over: str           # the interval's units: "3 rounds (paired)", "3 rounds"; "1 process" without one
    verdict: str        # regression | improvement | no change | insufficient data | candidate failed
    note: str = ""


def compare_samples(base: dict, cand: dict, alpha: float = 0.05, threshold: float = 0.05,
                    higher_is_better: bool = True, paired: bool = False) -> CellResult:
    """Verdict for one cell from raw samples grouped by process ({process: [values]}, CellSamples.groups): a
    regression (or improvement) when the 1 - alpha interval of cand / base excludes 1 (significant) and the
    ratio (its centre) is beyond the threshold (large enough), asv's rule; the same interval every table prints.
    `paired`: the harness.store.history.pairing of the one run both sides come from (the arms of --interleave)."""
    import numpy as np

    from harness.stats import ratio_interval

    b, c = ([v for vs in x.values() for v in vs] for x in (base, cand))
    mb, mc = (float(np.median(x)) if len(x) else math.nan for x in (b, c))
    iv = ratio_interval(cand, base, paired=paired, level=1 - alpha, higher_is_better=higher_is_better)
    over = f"{iv.n} {iv.unit}".strip()
    if iv.verdict == "insufficient data":
        return CellResult(len(b), len(c), mb, mc, iv.ratio, iv.median_ratio, iv.low, iv.high, over, iv.verdict,
                          f"candidate vs base: {iv.note}")
    worse = iv.ratio < 1 - threshold if higher_is_better else iv.ratio > 1 + threshold
    better = iv.ratio > 1 + threshold if higher_is_better else iv.ratio < 1 - threshold
    verdict = ("regression" if iv.verdict == "B faster" and worse else
               "improvement" if iv.verdict == "A faster" and better else "no change")
    return CellResult(len(b), len(c), mb, mc, iv.ratio, iv.median_ratio, iv.low, iv.high, over, verdict)


# --- inputs: run directories, arms of an interleaved run, history selectors -------------------------

@dataclass
class Side:
    label: str
    cells: list[history.CellSamples]
    run_dir: Path | None = None          # None for pooled history baselines
    arm: str = ""


def _split_arm(text: str) -> tuple[str, str]:
    """`RUN:A` -> (RUN, "A"): one arm of an interleaved run."""
    m = re.fullmatch(r"(.+):([AB])", text)
    return (m.group(1), m.group(2)) if m else (text, "")


def _run_side(text: str, results_dir: Path) -> Side:
    target, arm = _split_arm(text)
    m = SELECTOR.match(target)
    run_dir = history.run_dir_of(history.db_path(results_dir), m.group(1)) if m else Path(target)
    if not (run_dir / "run.json").exists():
        raise UserError(f"{text!r} is not a moebench run directory (no run.json); pass results/<run_id>, "
                        f"RUN:A / RUN:B for an interleaved run, or history:latest.")
    cells = history.load_cells(run_dir)
    if arm:
        if not json.loads((run_dir / "run.json").read_text()).get("interleave"):
            raise UserError(f"{text!r} names arm {arm}, but {run_dir} is not an interleaved run; drop ':{arm}'.")
        cells = [c for c in cells if c.arm == arm]
    return Side(text, cells, run_dir, arm)


def _history_side(text: str, results_dir: Path, cand: Side, match_key) -> Side:
    """history:latest / history:median-of-last-N: per candidate cell, the newest 1 or N runs that
    measured it (the candidate's own run excluded); their raw repetitions are pooled."""
    m = SELECTOR.match(text)
    k = 1 if m.group(1) == "latest" else int(m.group(2))
    if k < 1:
        raise UserError(f"{text!r} asks for no runs; use history:median-of-last-5 or history:latest.")
    db = history.db_path(results_dir)
    exclude = cand.cells[0].run_id if cand.cells else ""
    wanted = {match_key(c) for c in cand.cells}
    picked: dict[tuple, list[tuple[str, str, str]]] = {}
    for run_id, arm, key_text, path, _ in history.indexed_cells(db, exclude):
        key = match_key(dict(zip(KEY_FIELDS, json.loads(key_text))))
        runs = picked.setdefault(key, [])
        if key in wanted and (len({r for r, _, _ in runs}) < k or run_id in {r for r, _, _ in runs}):
            runs.append((run_id, arm, path))
    loaded: dict[str, list[history.CellSamples]] = {}
    cells = []
    for key, runs in picked.items():
        pooled = None
        for run_id, arm, path in runs:
            if path not in loaded:
                loaded[path] = history.load_cells(path) if Path(path, "run.json").exists() else []
            for c in loaded[path]:
                if c.arm == arm and match_key(c) == key:
                    if pooled is None:
                        pooled = history.CellSamples(f"{text}", "", c.key, c.model_name, c.depth, c.engine_version,
                                                     "ok", "", [], [])
                    pooled.tokens_per_s += c.tokens_per_s
                    pooled.ns += c.ns
                    pooled.process += c.process
        if pooled:
            cells.append(pooled)
    return Side(text, cells)


def _pooled(text: str) -> bool:
    """history:latest and history:median-of-last-N pick runs per cell (vs one run: a directory, history:<id>)."""
    m = SELECTOR.match(text)
    return bool(m and (m.group(1) == "latest" or m.group(2)))


# --- the comparison -----------------------------------------------------------------------------------

def key_of(fields: list[str]):
    """The match key of a cell (CellSamples or a key dict): its values of `fields`, in order."""
    return lambda c: tuple((c.key if isinstance(c, history.CellSamples) else c)[k] for k in fields)


def compare_sides(base: Side, cand: Side, metric: str, alpha: float, threshold: float, ignore: list[str]) -> dict:
    """Match cells by key (minus `ignore`), judge each pair; returns cells, summary and unmatched rows. The two arms
    of one run pair round by round (they ran in the same stretches of time); anything else is unpaired."""
    paired = bool(base.run_dir and cand.run_dir and base.run_dir.resolve() == cand.run_dir.resolve()) and \
        history.pairing(json.loads((cand.run_dir / "run.json").read_text()))["paired"]
    bad = [f for f in ignore if f not in KEY_FIELDS]
    if bad:
        raise UserError(f"--ignore {','.join(bad)} is not a key field; choose from {', '.join(KEY_FIELDS)}.")
    fields = [k for k in KEY_FIELDS if k not in ignore]
    match_key = key_of(fields)
    sides = {}
    for name, side in (("base", base), ("candidate", cand)):
        by_key: dict[tuple, history.CellSamples] = {}
        for c in side.cells:
            if match_key(c) in by_key:
                raise UserError(f"{side.label} has two cells that differ only in ignored fields ({', '.join(ignore)}); "
                                "ignore fewer fields so each cell is compared on its own (never averaged).")
            by_key[match_key(c)] = c
        sides[name] = by_key
    b, c = sides["base"], sides["candidate"]
    if not b or not c:
        raise UserError(f"{(base if not b else cand).label} has no measured cells; pass a finished run.")
    matched = [k for k in c if k in b]
    if not matched:
        raise UserError(f"No cell of {cand.label} matches {base.label}: they differ in "
                        f"{', '.join(_differing(b.values(), c.values())) or 'cells'}; "
                        "pass --ignore FIELD to compare across that setting.")
    rows = []
    for k in matched:
        bc, cc = b[k], c[k]
        r = compare_samples(bc.groups(metric), cc.groups(metric), alpha, threshold, metric == "tokens_per_s", paired)
        if cc.status != "ok":
            r.verdict, r.note = "candidate failed", f"candidate cell {cc.status}: {cc.error[:200]}"
        elif bc.status != "ok":
            r.verdict, r.note = "insufficient data", f"baseline cell {bc.status}"
        eb, ec = bc.key["engine"], cc.key["engine"]
        engine = eb if eb == ec else f"{eb} → {ec}"
        changed = {f: f"{bc.key[f]}→{cc.key[f]}" for f in ignore if bc.key[f] != cc.key[f]}
        rows.append({"engine": engine, "model": bc.model_name, "n_cpu_moe": bc.key["n_cpu_moe"],
                     "workload": bc.key["workload"], "settings": history.settings_label(bc.key, changed), **asdict(r)})
    unmatched = [{"only in": name, "engine": x.key["engine"], "model": x.model_name, "n_cpu_moe": x.key["n_cpu_moe"],
                  "workload": x.key["workload"], "settings": history.settings_label(x.key)}
                 for name, own, other in (("base", b, c), ("candidate", c, b)) for k,
                     x in own.items() if k not in other]
    return {"cells": rows, "summary": _summary(rows), "unmatched": unmatched}


def _differing(base, cand) -> list[str]:
    """The fields in which each candidate cell differs from its closest baseline cell."""
    fields: set[str] = set()
    for c in cand:
        diffs = [{f for f in KEY_FIELDS if b.key[f] != c.key[f]} for b in base]
        fields |= min(diffs, key=len) if diffs else set()
    return [f for f in KEY_FIELDS if f in fields]


def _summary(rows: list[dict]) -> list[dict]:
    """Geometric mean of the cand/base ratios per engine and workload (over depths and models)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["engine"], r["workload"]), []).append(r)
    out = []
    for (engine, wl), g in groups.items():
        logs = [math.log(r["ratio"]) for r in g if r["ratio"] == r["ratio"] and r["ratio"] > 0
                and r["verdict"] not in ("insufficient data", "candidate failed")]
        out.append({"engine": engine, "workload": wl, "cells": len(g),
                    "geomean ratio": math.exp(sum(logs) / len(logs)) if logs else float("nan"),
                    **{v: sum(r["verdict"] == v for r in g) for v in
                       ("regression", "improvement", "no change", "insufficient data", "candidate failed")}})
    return out


def judge(base: str, cand: str, results_dir: Path, metric: str, alpha: float, threshold: str,
          ignored: list[str]) -> tuple[dict, float, list[str]]:
    """Compare CAND (one run, or one arm RUN:A|B) against BASE (a run, an arm, or a history selector);
    returns (compare_sides result, the threshold as a fraction, notes for the user)."""
    if not 0 < alpha < 1:
        raise UserError(f"--alpha {alpha:g} must be between 0 and 1, e.g. 0.01.")
    t = parse_fraction(threshold, "--threshold")
    if _pooled(cand):
        raise UserError(f"CAND {cand!r} must be one run (a directory or history:<run_id>); history:latest and "
                        "history:median-of-last-N are baselines, pass them as BASE.")
    cand_side = _run_side(cand, results_dir)
    ignored, notes = list(ignored), []
    if _pooled(base):
        fields = [k for k in KEY_FIELDS if k not in ignored]
        base_side = _history_side(base, results_dir, cand_side, key_of(fields))
    else:
        base_side = _run_side(base, results_dir)
        if base_side.run_dir and base_side.run_dir.resolve() == cand_side.run_dir.resolve() and base_side.arm \
                and cand_side.arm and base_side.arm != cand_side.arm:
            # the two arms of one interleaved run differ on purpose in these fields: compare across them
            differs = json.loads((cand_side.run_dir / "run.json").read_text())["interleave"].get("differs", [])
            ignored += [f for f in differs if f not in ignored]
            if differs:
                notes.append(f"matching {base_side.arm} and {cand_side.arm} across {', '.join(differs)} "
                             "(what the arms differ in)")
    return compare_sides(base_side, cand_side, metric, alpha, t, ignored), t, notes


def headline(result: dict, alpha: float, threshold: float, metric: str) -> str:
    counts = {v: sum(r["verdict"] == v for r in result["cells"]) for v in
              ("regression", "candidate failed", "improvement", "no change", "insufficient data")}
    text = ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no cells"
    return (f"{text} ({len(result['cells'])} matched cells, {len(result['unmatched'])} unmatched; {metric}, "
            f"{1 - alpha:.0%} t interval on log ratios over processes (harness.stats.ratio_interval), threshold "
            f"{threshold:.1%})")


def decision(result: dict) -> dict:
    """What a CI gate acts on: fail when a cell regressed (interval below 1 and beyond the threshold) or the
    candidate's cell failed; the cells that decided it, with their intervals."""
    bad = [r for r in result["cells"] if r["verdict"] in ("regression", "candidate failed")]
    return {"fail": bool(bad), "failing_cells": [{k: r[k] for k in ("engine", "model", "n_cpu_moe", "workload",
                                                                      "settings", "ratio", "ci_low", "ci_high", "over",
                                                                      "verdict")} for r in bad]}


def _display(rows: list[dict]) -> list[dict]:
    from harness.stats import RatioInterval, fmt_ratio

    out = [{"engine": r["engine"], "model": r["model"], "n_cpu_moe": r["n_cpu_moe"], "workload": r["workload"],
            "settings": r["settings"], "base": r["base_median"], "cand": r["cand_median"],
            "ratio (95% CI)": RatioInterval(r["ratio"], r["ci_low"], r["ci_high"], 0, "", "").text(),
            "median ratio": f"{fmt_ratio(r['median_ratio'])}x" if r["median_ratio"] == r["median_ratio"] else "",
            "over": r["over"], "n": f"{r['n_base']}/{r['n_cand']}", "verdict": r["verdict"], "note": r["note"]}
           for r in rows]
    if not any(r["note"] for r in out):
        out = [{k: v for k, v in r.items() if k != "note"} for r in out]
    return out


def emit(result: dict, fmt: str, output: str | None, title: str, head: str) -> None:
    """Write the comparison: three sections for people (table, md), one table for csv, everything for json."""
    import contextlib

    from harness.analysis.tables import markdown, render

    sections = [(title, _display(result["cells"])), ("geometric mean per engine and workload", result["summary"]),
                ("unmatched cells (not compared)", result["unmatched"])]
    if fmt in ("json", "jsonl"):
        clean = lambda v: None if isinstance(v, float) and v != v else v      # NaN is not JSON
        payload = {k: [{f: clean(v) for f, v in r.items()} for r in rows] for k, rows in result.items()}
        render([], fmt, out=output, json_payload=payload | {"headline": head, "decision": decision(result)})
    elif fmt in ("csv", "sql"):          # sql: render's one sentence (llama-bench's table is the sweep's)
        render(result["cells"] + [{"verdict": f"only in {u['only in']}", **u} for u in result["unmatched"]],
               fmt, out=output)
    elif fmt == "md":
        text = f"**moebench compare**: {head}\n\n" + "".join(f"### {t}\n\n{markdown(rows)}\n" for t, rows in sections
                                                             if rows or t == title)
        (Path(output).write_text(text) if output else sys.stdout.write(text))
    else:
        with open(output, "w") if output else contextlib.nullcontext(sys.stdout) as f, contextlib.redirect_stdout(f):
            for t, rows in sections:
                if rows:
                    render(rows, "table", title=t)
            print(head)
