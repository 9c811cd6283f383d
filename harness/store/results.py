"""Result files of a run: schema, incremental writing, reading, summaries.

results/<run_id>/run.json, cells.csv, measurements.csv, samples.csv (DESIGN.md, "Results").
Rows are appended as each cell finishes, so an interrupted sweep keeps every finished cell.
Readers select columns by name, never by position.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from engines.gguf_meta import clean_text
from harness.stats import stats

SCHEMA_VERSION = 1
# Characters of one text field: half of Python's default csv field limit (131072), so every reader of these files
# reads them. Model names are cut far shorter where they are read (engines.gguf_meta.TEXT_LIMIT).
FIELD_LIMIT = 65536

CELL_COLUMNS = [
    "run_id", "cell_id", "engine", "engine_version", "model", "model_name", "model_fingerprint", "arch",
    "n_layers", "n_moe_layers", "depth", "n_cpu_moe", "expert_host_fraction", "expert_bytes_host",
    "expert_bytes_total", "n_overridden_tensors", "n_ctx", "n_batch", "n_ubatch", "threads", "flash_attn",
    "device", "dtype", "mmap", "extra", "effective_settings", "bytes_by_device", "status", "error",
    "load_s", "wall_s", "peak_rss_mib", "peak_vram_mib", "host", "node", "arm",
]
MEASUREMENT_COLUMNS = [
    "run_id", "cell_id", "engine", "model_name", "model_fingerprint", "n_cpu_moe", "workload", "n_prompt",
    "n_gen", "n_depth", "rep", "ns", "tokens_per_s", "engine_ms", "n_ctx", "n_batch", "n_ubatch", "threads",
    "flash_attn", "peak_rss_mib", "peak_vram_mib", "round",
]   # round: 1, 2, ... (--rounds: each round of a cell is one process); empty in runs written before it
SAMPLE_COLUMNS = [
    "run_id", "cell_id", "t_ms", "phase", "rss_mib", "rss_anon_mib", "rss_file_mib", "pss_mib",
    "vram_proc_mib", "vram_device_mib",
]
FILES = {"cells.csv": CELL_COLUMNS, "measurements.csv": MEASUREMENT_COLUMNS, "samples.csv": SAMPLE_COLUMNS}
# What makes two measured cells comparable (compare, history): the key plus every setting that changes speed.
KEY_FIELDS = ("engine", "model_fingerprint", "n_cpu_moe", "workload", "n_ctx", "n_batch", "n_ubatch", "threads",
              "flash_attn", "dtype", "device", "mmap", "extra")


@dataclass(frozen=True)
class CellKey:
    """The identity of a cell: every writer makes its cell id from this and every reader matches cells by it.
    Not the model's name (two files may share a GGUF general.name) and not the engine alone (the two arms of an
    interleaved run may be the same engine)."""
    engine: str
    model_fingerprint: str
    n_cpu_moe: int
    arm: str = ""            # "A" | "B" in an interleaved run
    node: str = ""           # --ray --per-node: the node that ran it

    @property
    def cell_id(self) -> str:
        """`[A/]engine/<fingerprint>/ncmoeN[@node]`: unique within a run, stable across --resume."""
        core = f"{self.engine}/{self.model_fingerprint}/ncmoe{self.n_cpu_moe}"
        return (f"{self.arm}/" if self.arm else "") + core + (f"@{self.node}" if self.node else "")

    @classmethod
    def of(cls, row: Mapping) -> "CellKey":
        """The key of a cells.csv row (a dict or a pandas row). Arm and node come from the cell id, which
        every version of the files wrote the same way (the `node` column holds Ray's node id instead)."""
        cell_id = str(row.get("cell_id", ""))
        arm = cell_id[0] if cell_id[:2] in ("A/", "B/") else ""
        node = cell_id.rpartition("@")[2] if "@" in cell_id else ""
        return cls(str(row["engine"]), str(row["model_fingerprint"]), int(row["n_cpu_moe"]), arm, node)

    def label(self, run: Mapping | None = None) -> str:
        """How tables name the engine of this cell: the engine, or an interleaved arm as `A:<its engine spec>`."""
        if not self.arm:
            return self.engine
        spec = ((run or {}).get("interleave") or {}).get(self.arm, self.engine)
        return f"{self.arm}:{spec}"


def _fmt(v) -> object:
    """A value as written: floats rounded, dicts/lists as JSON, text bounded and without control characters
    (error text quotes engine logs, which quote the model file)."""
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(round(v, 6))
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)       # JSON escapes control characters itself
    if isinstance(v, str):
        return clean_text(v, FIELD_LIMIT, lines=True)
    return "" if v is None else v


def append_rows(run_dir: Path, file: str, rows: list[dict]) -> None:
    """Append rows (dicts keyed by column name) to one of the run's CSV files, header on first write. A file
    begun by an older version keeps its header (--resume of an old run): columns it lacks are left out."""
    path = run_dir / file
    new = not path.exists() or path.stat().st_size == 0
    columns = FILES[file]
    if not new:
        with open(path, newline="") as f:
            columns = next(csv.reader(f), None) or columns
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows({k: _fmt(r.get(k)) for k in columns} for r in rows)


def append_cell(run_dir: Path, row: dict, measurements: list[dict], samples: list[dict]) -> None:
    """One finished cell's rows; cells.csv last: a cell row means the cell is complete."""
    append_rows(run_dir, "measurements.csv", measurements)
    append_rows(run_dir, "samples.csv", samples)
    append_rows(run_dir, "cells.csv", [row])


def write_cells(run_dir: Path, rows: list[dict]) -> None:
    """Rewrite cells.csv whole (used by --resume to drop the rows of cells it runs again)."""
    (run_dir / "cells.csv").unlink(missing_ok=True)
    append_rows(run_dir, "cells.csv", rows)


def read_csv(run_dir: Path, file: str) -> list[dict]:
    path = Path(run_dir) / file
    if not path.exists():
        return []
    # files written before FIELD_LIMIT (or JSON fields, which are not cut) may hold longer fields
    csv.field_size_limit(max(csv.field_size_limit(), (1 << 31) - 1))
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def require_run(run_dir: str | Path) -> Path:
    """The run directory, or one sentence saying it is not one."""
    from engines.errors import UserError

    run_dir = Path(run_dir)
    if not (run_dir / "run.json").exists():
        raise UserError(f"{str(run_dir)!r} is not a moebench run directory (no run.json); pass results/<run_id>.")
    return run_dir


def load_frames(run_dir: str | Path):
    """(run, cells, measurements, samples) as a dict and three pandas DataFrames. cells gains a `label`
    column: the engine as tables name it (CellKey.label)."""
    import pandas as pd

    run_dir = require_run(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    frames = []
    for file, cols in FILES.items():
        path = run_dir / file
        frames.append(pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame(columns=cols))
    cells = frames[0]
    cells["label"] = [CellKey.of(c).label(run) for c in cells.to_dict("records")]
    return (run, *frames)


def round_split(g) -> dict:
    """Where the spread of one cell x workload's tok/s comes from (g: its measurement rows):
    `rounds` (how many; NaN for runs written before rounds were recorded), `tps_cv_rounds` (CV of the round
    means: between processes, and between the times the rounds ran) and `tps_cv_within` (pooled CV within a
    round: one process). With n repetitions per round, noise within processes alone puts tps_cv_rounds near
    tps_cv_within / sqrt(n); much more means the processes or the machine differed between rounds."""
    nan = float("nan")
    if "round" not in g or g["round"].isna().all():
        return {"rounds": nan, "tps_cv_rounds": nan, "tps_cv_within": nan}
    by = g.groupby("round")["tokens_per_s"]
    means, grand = by.mean(), g["tokens_per_s"].mean()
    dof = int((by.count() - 1).sum())
    within = float(((by.var(ddof=1).fillna(0) * (by.count() - 1)).sum() / dof) ** 0.5) if dof else nan
    return {"rounds": len(means), "tps_cv_rounds": float(means.std(ddof=1) / means.mean()) if len(means) > 1 else nan,
            "tps_cv_within": within / grand if grand else nan}


def round_speed(measurements) -> dict[int, float]:
    """The machine's speed in each round of a run: per cell x workload measured in more than one round, each
    round's mean tok/s over the mean of its round means; the median of those per round ({1: 1.02, 2: 0.97, ...}).
    In an interleaved run round r is one stretch of time, so this is the drift every cell saw; {} without rounds."""
    import pandas as pd

    if "round" not in measurements or measurements["round"].isna().all():
        return {}
    m = measurements.dropna(subset=["round"])
    means = m.groupby(["cell_id", "workload", "round"])["tokens_per_s"].mean()
    rel = means / means.groupby(level=["cell_id", "workload"]).transform("mean")
    counts = means.groupby(level=["cell_id", "workload"]).transform("count")
    rel = rel[counts > 1]
    if rel.empty:
        return {}
    return {int(k): float(v) for k, v in pd.Series(rel.values, index=rel.index.get_level_values("round"))
            .groupby(level=0).median().items()}


def summarize(cells, measurements):
    """One row per cell x workload (cells from load_frames): cell_id, `engine` = the cell's label, tok/s
    statistics, how their spread splits between rounds and within a process (round_split), the cell's peak
    memory and status. Failed cells appear with their status and no throughput, never as a silent gap."""
    import pandas as pd

    rows = []
    for _, c in cells.iterrows():
        m = measurements[measurements["cell_id"] == c["cell_id"]]
        base = {"cell_id": c["cell_id"], "engine": c["label"], "model_name": c["model_name"],
                "model_fingerprint": c["model_fingerprint"], "n_cpu_moe": c["n_cpu_moe"], "depth": c["depth"],
                    "status": c["status"], "peak_rss_mib": c["peak_rss_mib"],
                "peak_vram_mib": c["peak_vram_mib"], "error": c["error"]}
        if m.empty:
            rows.append(base | {"workload": "", **{f"tps_{k}": float("nan") for k in stats([])},
                                **round_split(m)})
            continue
        for wl, g in m.groupby("workload", sort=False):
            rows.append(base | {"workload": wl, **{f"tps_{k}": v for k, v in stats(g["tokens_per_s"]).items()},
                                **round_split(g)})
    return pd.DataFrame(rows)


def llama_bench_records(run: dict, cells, measurements) -> list[dict]:
    """The measurements in llama-bench's JSON field names, one record per cell x workload."""
    out = []
    for _, c in cells.iterrows():
        m = measurements[measurements["cell_id"] == c["cell_id"]]
        for wl, g in m.groupby("workload", sort=False):
            ns, ts = g["ns"].astype(int).tolist(), g["tokens_per_s"].astype(float).tolist()
            sn, st = stats(ns), stats(ts)
            first = g.iloc[0]
            out.append({
                "build_commit": "", "build_number": 0, "engine": c["engine"], "engine_version": c["engine_version"],
                "cpu_info": run.get("host", {}).get("cpu", ""), "gpu_info": run.get("host", {}).get("gpu_name", ""),
                "model_filename": c["model"], "model_type": c["arch"], "n_batch": int(c["n_batch"]),
                "n_ubatch": int(c["n_ubatch"]), "n_threads": int(c["threads"]), "n_cpu_moe": int(c["n_cpu_moe"]),
                "flash_attn": c["flash_attn"], "n_prompt": int(first["n_prompt"]), "n_gen": int(first["n_gen"]),
                "n_depth": int(first["n_depth"]), "test_time": run.get("started", ""),
                "avg_ns": int(sn["mean"]), "stddev_ns": 0 if math.isnan(sn["std"]) else int(sn["std"]),
                "avg_ts": st["mean"], "stddev_ts": 0.0 if math.isnan(st["std"]) else st["std"],
                "samples_ns": ns, "samples_ts": ts,
            })
    return out
