"""Run history: every finished run indexed into <results-dir>/history.sqlite, and the queries on it.

The CSV files stay the source of truth; the index holds one row per run and one row per
cell x workload (configuration key + median/spread of the repetitions), so `compare` can find the
baseline runs of a cell and `history` can show a cell's trend without reading every run.
Queries are parameterized only (no values pasted into SQL text).
"""
from __future__ import annotations

import csv
import json
import sqlite3
import sys
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from engines.errors import UserError
from engines.gguf_meta import clean_text
from harness.stats import stats
from harness.store import results
from harness.store.results import KEY_FIELDS, CellKey

DB_NAME = "history.sqlite"
DB_VERSION = 1

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, path TEXT NOT NULL, started TEXT NOT NULL,
       host TEXT, git_commit TEXT, interleave TEXT, indexed_at TEXT)""",
    f"""CREATE TABLE IF NOT EXISTS cells (run_id TEXT NOT NULL REFERENCES runs(run_id), arm TEXT NOT NULL,
       key TEXT NOT NULL, model_name TEXT, depth TEXT, engine_version TEXT, status TEXT, n INTEGER,
       tps_median REAL, tps_mean REAL, tps_std REAL, tps_min REAL, tps_max REAL, ns_median REAL,
       {", ".join(f"{k} TEXT" for k in KEY_FIELDS)}, PRIMARY KEY (run_id, arm, key))""",
    "CREATE INDEX IF NOT EXISTS cells_key ON cells (key)",
]


@dataclass
class CellSamples:
    """The raw repetitions of one cell x workload of one run (arm "" unless the run was interleaved)."""
    run_id: str
    arm: str
    key: dict[str, str]
    model_name: str
    depth: str
    engine_version: str
    status: str
    error: str
    tokens_per_s: list[float] = field(default_factory=list)
    ns: list[float] = field(default_factory=list)
    process: list[str] = field(default_factory=list)   # per sample: the process that measured it, "<run_id>/<round>"

    def groups(self, metric: str) -> dict[str, list[float]]:
        """The metric's samples by process (harness.stats.ratio_interval's units)."""
        out: dict[str, list[float]] = {}
        for p, v in zip(self.process, getattr(self, metric)):
            out.setdefault(p, []).append(v)
        return out

    @property
    def key_text(self) -> str:
        return json.dumps([self.key[k] for k in KEY_FIELDS])


def pairing(run: dict) -> dict:
    """How harness.stats.ratio_interval treats two cells of this run (run.json), as keyword arguments: `paired`
    when round r of both ran in the same stretch of time (interleaved rounds, --interleave's turns; not
    back-to-back rounds, each cell's rounds in a row), and the `pilot` of an --until run (its rounds after the
    pilot were chosen by Stein's two-stage rule, harness.run.until, whose interval needs it)."""
    return {"paired": (run.get("rounds") or {}).get("order") != "back-to-back",
            "pilot": (run.get("until") or {}).get("pilot")}


def db_path(results_dir: str | Path) -> Path:
    return Path(results_dir) / DB_NAME


def load_cells(run_dir: str | Path) -> list[CellSamples]:
    """Every cell x workload of a run with its raw repetitions; failed cells appear with no samples."""
    run_dir = results.require_run(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    by_cell: dict[str, list[dict]] = {}
    for m in results.read_csv(run_dir, "measurements.csv"):
        by_cell.setdefault(m["cell_id"], []).append(m)
    out = []
    for c in results.read_csv(run_dir, "cells.csv"):
        arm = CellKey.of(c).arm
        meas = by_cell.get(c["cell_id"], [])
        workloads = list(dict.fromkeys(m["workload"] for m in meas))
        if c["status"] != "ok":      # a failed cell still names its workloads, so compare can say it failed
            workloads += [w for w in run.get("spec", {}).get("workloads", []) if w not in workloads]
        for wl in workloads:
            key = {k: c.get(k, "") for k in KEY_FIELDS} | {"workload": wl, "extra": c.get("extra", "")}
            rows = [m for m in meas if m["workload"] == wl]
            out.append(CellSamples(run.get("run_id", run_dir.name), arm, key, clean_text(c["model_name"]), c["depth"],
                                   c["engine_version"], c["status"], c.get("error", ""),
                                   [float(m["tokens_per_s"]) for m in rows], [float(m["ns"]) for m in rows],
                                   [f"{run.get('run_id', run_dir.name)}/{m.get('round') or 1}" for m in rows]))
    return out


def connect(db: Path) -> sqlite3.Connection:
    con = sqlite3.connect(db, timeout=30)     # two sweeps finishing together wait for each other's write
    for stmt in SCHEMA:
        con.execute(stmt)
    con.execute(f"PRAGMA user_version = {DB_VERSION}")
    return con


def index_run(run_dir: str | Path, db: Path | None = None) -> bool:
    """Index (or re-index, after --resume) a finished run into <run_dir>/../history.sqlite.
    Never fails the sweep that calls it: a problem becomes a warning on stderr and False."""
    run_dir = Path(run_dir).resolve()
    db = db or run_dir.parent / DB_NAME
    try:
        run = json.loads((run_dir / "run.json").read_text())
        cells = load_cells(run_dir)
        with closing(connect(db)) as con, con:   # one transaction: a run is indexed whole or not at all
            run_id = run.get("run_id", run_dir.name)
            con.execute("DELETE FROM cells WHERE run_id = ?", (run_id,))
            con.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (run_id, str(run_dir), run.get("started", ""), run.get("host", {}).get("hostname", ""),
                         run.get("host", {}).get("git_commit", "") or "", json.dumps(run.get("interleave") or ""),
                         datetime.now(timezone.utc).isoformat()))
            cols = ["run_id", "arm", "key", "model_name", "depth", "engine_version", "status", "n", "tps_median",
                    "tps_mean", "tps_std", "tps_min", "tps_max", "ns_median", *KEY_FIELDS]
            sql = f"INSERT OR REPLACE INTO cells ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
            for c in cells:
                t, n = stats(c.tokens_per_s), stats(c.ns)
                nan = lambda v: None if v != v else v       # sqlite NULL, not NaN
                con.execute(sql, (run_id, c.arm, c.key_text, c.model_name, c.depth, c.engine_version, c.status,
                                  t["n"], nan(t["median"]), nan(t["mean"]), nan(t["std"]), nan(t["min"]),
                                  nan(t["max"]), nan(n["median"]), *(c.key[k] for k in KEY_FIELDS)))
        return True
    except (OSError, sqlite3.Error, csv.Error, ValueError, KeyError, UserError) as e:
        print(f"warning: could not index {run_dir} into {db} ({e}); compare still reads the run directory.",
              file=sys.stderr)
        return False


def run_dir_of(db: Path, run_id: str) -> Path:
    """The directory of an indexed run (for `history:<run_id>`)."""
    with closing(_open(db)) as con:
        row = con.execute("SELECT path FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if row is None:
        raise UserError(f"Run {run_id!r} is not in {db}; list runs with `moebench history`.")
    return Path(row[0])


def indexed_cells(db: Path, exclude_run: str = "") -> list[tuple[str, str, str, str, str]]:
    """(run_id, arm, key, path, started) of every indexed cell with data, newest run first."""
    with closing(_open(db)) as con:
        return con.execute(
            "SELECT c.run_id, c.arm, c.key, r.path, r.started FROM cells c JOIN runs r ON r.run_id = c.run_id "
            "WHERE c.run_id != ? AND c.n > 0 ORDER BY r.started DESC, c.run_id DESC", (exclude_run,)).fetchall()


def _open(db: Path) -> sqlite3.Connection:
    if not db.exists():
        raise UserError(f"No run history at {db}; run a sweep first or pass --results-dir where the runs are.")
    return connect(db)


def _filter_sql(engines: list[str], workloads: list[str], depths: list[str]) -> tuple[str, list[str]]:
    """WHERE clause with one `?` per value: user text only ever travels as a parameter."""
    where, params = ["c.n > 0"], []
    for col, values in (("c.engine", engines), ("c.workload", workloads)):
        if values:
            where.append(f"{col} IN ({', '.join('?' * len(values))})")
            params += values
    if depths:     # a depth as asked ("all") or as resolved (layer count)
        marks = ", ".join("?" * len(depths))
        where.append(f"(c.n_cpu_moe IN ({marks}) OR c.depth IN ({marks}))")
        params += depths + depths
    return " AND ".join(where), params


def trend(db: Path, engines: list[str], workloads: list[str], depths: list[str], last: int) -> tuple[list[str], list]:
    """The newest `last` runs with a cell matching the filters, and their matching cells (oldest first):
    (run ids, rows of run_id, started, arm, engine, model_name, n_cpu_moe, workload, key, n, tps_median,
    tps_std, status)."""
    if last < 1:
        raise UserError(f"--last {last} must be at least 1.")
    where, params = _filter_sql(engines, workloads, depths)
    with closing(_open(db)) as con:
        runs = [r[0] for r in con.execute(
            f"SELECT DISTINCT c.run_id, r.started FROM cells c JOIN runs r ON r.run_id = c.run_id WHERE {where} "
            "ORDER BY r.started DESC, c.run_id DESC LIMIT ?", (*params, last))]
        if not runs:
            raise UserError(f"No indexed run in {db} matches these filters; "
                            "drop a filter or check the names with `moebench history` alone.")
        rows = con.execute(
            f"SELECT c.run_id, r.started, c.arm, c.engine, c.model_name, c.n_cpu_moe, c.workload, c.key, c.n, "
            f"c.tps_median, c.tps_std, c.status FROM cells c JOIN runs r ON r.run_id = c.run_id "
            f"WHERE {where} AND c.run_id IN ({', '.join('?' * len(runs))}) ORDER BY r.started, c.run_id, c.key",
            (*params, *runs)).fetchall()
    return runs, rows


def settings_label(key: dict, changed: dict | None = None) -> str:
    """The key fields a row is not already labelled by, compact: n_ctx=4096 n_ubatch=512 threads=2 ...;
    `changed` adds fields shown as old→new (compare --ignore)."""
    shown = {f: key[f] for f in ("n_ctx", "n_ubatch", "threads", "flash_attn")} | (changed or {})
    extra = "" if key["extra"] in ("", "{}") else f" {key['extra']}"
    return " ".join(f"{k}={v}" for k, v in shown.items()) + extra
