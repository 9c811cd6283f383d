"""Result files of a run: schema, incremental writing, reading, summaries.

results/<run_id>/run.json, cells.csv, measurements.csv, samples.csv (docs/design.md, "The result schema").
Rows are appended as each cell finishes, so an interrupted sweep keeps every finished cell.
Readers select columns by name, never by position.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from engines.base import switch
from engines.llama_cpp import FLASH_ATTN      # llama-bench's flash_attn field: llama_flash_attn_type
from engines.gguf_meta import clean_text
from harness.stats import stats

SCHEMA_VERSION = 1
# Characters of one text field: half of Python's default csv field limit (131072), so every reader of these files
# reads them. Model names are cut far shorter where they are read (engines.gguf_meta.TEXT_LIMIT).
FIELD_LIMIT = 65536

CELL_COLUMNS = [
    "run_id", "cell_id", "engine", "engine_version", "model", "model_name", "model_fingerprint", "arch",
    "n_layers", "n_moe_layers", "depth", "n_cpu_moe", "expert_host_fraction", "expert_bytes_host",
    "expert_bytes_total", "n_overridden_tensors", "cpu_moe_layers", "n_ctx", "n_batch", "n_ubatch", "threads",
    "flash_attn", "device", "dtype", "mmap", "extra", "effective_settings", "bytes_by_device", "status", "error",
    "load_s", "wall_s", "peak_rss_mib", "peak_rss_anon_mib", "peak_rss_file_mib", "peak_vram_mib", "host", "node",
    "arm",
    # the worker's RSS before load() with the engine's runtime imported (Engine.runtime), and peak_rss_mib minus it
    # (a cell of several rounds: the largest, with its floor); the same for the anonymous part (RssAnon): the
    # engine's own allocations (copies of weights, KV cache, compute buffers), what `plan` predicts
    "rss_floor_mib", "peak_rss_above_floor_mib", "rss_anon_floor_mib", "peak_rss_anon_above_floor_mib",
]
# peak_rss_anon_mib / peak_rss_file_mib: the peak of each series of the RSS's RssAnon / RssFile split over the cell
# (harness.run.sampler.Peaks says what each means). Runs written before the split lack them (and the anonymous floor).
MEASUREMENT_COLUMNS = [
    "run_id", "cell_id", "engine", "model_name", "model_fingerprint", "n_cpu_moe", "workload", "n_prompt",
    "n_gen", "n_depth", "rep", "ns", "tokens_per_s", "engine_ms", "n_ctx", "n_batch", "n_ubatch", "threads",
    "flash_attn", "peak_rss_mib", "peak_vram_mib", "round", "stream", "peak_rss_anon_mib", "peak_rss_file_mib",
]   # round: 1, 2, ... (--rounds: each round of a cell is one process); empty in runs written before it.
# stream: the token stream's source (workloads.tokens.SOURCES: random | text | repeats); empty in older runs
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
    variant: str = ""        # the engine knobs a sweep crossed, e.g. "repack=0" or "repack=0@no_host=1"

    @property
    def cell_id(self) -> str:
        """`[A/]engine[@variant]/<fingerprint>/ncmoeN[@node]`: unique within a run, stable across --resume."""
        engine = self.engine + (f"@{self.variant}" if self.variant else "")
        core = f"{engine}/{self.model_fingerprint}/ncmoe{self.n_cpu_moe}"
        return (f"{self.arm}/" if self.arm else "") + core + (f"@{self.node}" if self.node else "")

    @classmethod
    def of(cls, row: Mapping) -> "CellKey":
        """The key of a cells.csv row (a dict or a pandas row). Arm, variant and node come from the cell id, which
        every version of the files wrote the same way (the `node` column holds Ray's node id instead)."""
        cell_id = str(row.get("cell_id", ""))
        arm = cell_id[0] if cell_id[:2] in ("A/", "B/") else ""
        parts = cell_id.removeprefix(f"{arm}/").split("/")
        variant = parts[0].partition("@")[2] if parts[0] else ""
        node = parts[-1].partition("@")[2] if len(parts) > 1 else ""
        return cls(str(row["engine"]), str(row["model_fingerprint"]), int(row["n_cpu_moe"]), arm, node, variant)

    def label(self, run: Mapping | None = None) -> str:
        """How tables name the engine of this cell: the engine (with the knobs a sweep crossed, as an engine spec:
        `llama-cpp@repack=0`), or an interleaved arm as `A:<its engine spec>`."""
        if not self.arm:
            return self.engine + (f"@{self.variant}" if self.variant else "")
        spec = ((run or {}).get("interleave") or {}).get(self.arm, self.engine)
        return f"{self.arm}:{spec}"


def layer_text(layers: list[int] | None) -> str:
    """cells.csv's cpu_moe_layers: the layers an engine placed in host memory as ranges ("0-3", "0-1,5"), "none" for
    no layer, "" when the engine cannot tell (EngineInfo.cpu_moe_layers)."""
    if layers is None:
        return ""
    runs: list[list[int]] = []
    for i in sorted(set(layers)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs) or "none"


def layers_compared(a, b) -> str:
    """Two cells' cpu_moe_layers side by side for a ratio: "same (0-3)" when both engines kept the same layers in host
    memory, else what each kept ("" when either cannot tell, or a run predates the column)."""
    a, b = ("" if x is None or x != x else str(x) for x in (a, b))
    if not a or not b:
        return ""
    return f"same ({a})" if a == b else f"differ: A kept {a}, B kept {b}"


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
    round: one process; harness.stats.within_cv). With n repetitions per round, noise within processes alone puts
    tps_cv_rounds near tps_cv_within / sqrt(n); much more means the processes or the machine differed between rounds."""
    from harness.stats import within_cv

    nan = float("nan")
    if "round" not in g or g["round"].isna().all():
        return {"rounds": nan, "tps_cv_rounds": nan, "tps_cv_within": nan}
    means = g.groupby("round")["tokens_per_s"].mean()
    return {"rounds": len(means), "tps_cv_rounds": float(means.std(ddof=1) / means.mean()) if len(means) > 1 else nan,
            "tps_cv_within": within_cv(round_groups(g))}


def round_groups(g) -> dict:
    """One cell x workload's tok/s by the process that measured them, {round: [tok/s, ...]} (g: its measurement
    rows): what harness.stats.ratio_interval resamples. Runs written before rounds were recorded: one group."""
    if "round" not in g or g["round"].isna().all():
        return {1: list(g["tokens_per_s"])}
    return {int(k): list(v) for k, v in g.groupby("round")["tokens_per_s"]}


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


MEMORY_COLUMNS = ("peak_rss_mib", "peak_rss_anon_mib", "peak_rss_file_mib", "peak_rss_above_floor_mib",
                  "peak_rss_anon_above_floor_mib", "peak_vram_mib")


def memory_cells(r: Mapping) -> dict:
    """The memory columns of a summary row (summarize) as the sweep's summary and the report show them: the peak
    anonymous RSS as the RAM the engine needs (and above its runtime's floor), the file-backed pages apart, VRAM.
    Empty (NaN) in runs written before the split; their total RSS stays in cells.csv."""
    return {"RAM MiB (anon)": r["peak_rss_anon_mib"], "anon above floor MiB": r["peak_rss_anon_above_floor_mib"],
            "file-backed MiB": r["peak_rss_file_mib"], "peak VRAM MiB": r["peak_vram_mib"]}


def summarize(cells, measurements):
    """One row per cell x workload (cells from load_frames): cell_id, `engine` = the cell's label, tok/s
    statistics, how their spread splits between rounds and within a process (round_split), the cell's peak
    memory (MEMORY_COLUMNS: RSS, its anonymous and file-backed parts, both above the engine runtime's floor too;
    NaN where an older run lacks them) and status. Failed cells appear with their status and no throughput, never
    as a silent gap."""
    import pandas as pd

    rows = []
    for _, c in cells.iterrows():
        m = measurements[measurements["cell_id"] == c["cell_id"]]
        base = {"cell_id": c["cell_id"], "engine": c["label"], "model_name": c["model_name"],
                "model_fingerprint": c["model_fingerprint"], "n_cpu_moe": c["n_cpu_moe"], "depth": c["depth"],
                "status": c["status"], **{k: c.get(k, float("nan")) for k in MEMORY_COLUMNS},
                "error": c["error"]}
        if m.empty:
            rows.append(base | {"workload": "", **{f"tps_{k}": float("nan") for k in stats([])},
                                **round_split(m)})
            continue
        for wl, g in m.groupby("workload", sort=False):
            rows.append(base | {"workload": wl, **{f"tps_{k}": v for k, v in stats(g["tokens_per_s"]).items()},
                                **round_split(g)})
    return pd.DataFrame(rows)


# llama-bench's fields in its order (test::get_fields() in tools/llama-bench/llama-bench.cpp of the llama.cpp that
# llama-cpp-python 0.3.36 vendors) and their kinds (get_field_type: str TEXT, bool and int INTEGER, float REAL)
LLAMA_BENCH_FIELDS = {
    "build_commit": str, "build_number": int, "cpu_info": str, "gpu_info": str, "backends": str,
    "model_filename": str, "model_type": str, "model_size": int, "model_n_params": int, "n_batch": int,
    "n_ubatch": int, "n_threads": int, "cpu_mask": str, "cpu_strict": bool, "poll": int, "type_k": str,
    "type_v": str, "n_gpu_layers": int, "n_cpu_moe": int, "split_mode": str, "main_gpu": int, "no_kv_offload": bool,
    "flash_attn": int, "devices": str, "tensor_split": str, "tensor_buft_overrides": str, "load_mode": str,
    "lazy_mode": str, "embeddings": bool, "no_op_offload": int, "no_host": bool, "repack": bool, "fit_target": int,
    "fit_min_ctx": int, "n_prompt": int, "n_gen": int, "n_depth": int, "test_time": str, "avg_ns": int,
    "stddev_ns": int, "avg_ts": float, "stddev_ts": float,
}
# What llama-bench reports when not told otherwise, which is also what the llama-cpp engine runs with (llama.cpp's
# default model/context parameters and ggml's default threadpool: poll 50, no CPU mask). --n-cpu-moe leaves
# tensor_buft_overrides "none" as llama-bench's -ncmoe does (it adds its patterns inside, not to that field).
LLAMA_CPP_DEFAULTS = {
    "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "split_mode": "layer",
    "main_gpu": 0, "no_kv_offload": False, "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none",
    "lazy_mode": "auto", "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0,
    "fit_min_ctx": 0,
}
# An engine that is not llama.cpp: what is true of it in these fields' terms (no CPU mask or strict placement, no
# tensor overrides but n_cpu_moe's, no KV offload switch, no repacking, no fitting), "n/a" where a text field names a
# llama.cpp mechanism it has not or a setting we do not know, and poll -1: it has no ggml threadpool to poll at
# llama-bench's levels (still a number, so tools that read it as one still do)
NOT_LLAMA_CPP = {
    "cpu_mask": "0x0", "cpu_strict": False, "poll": -1, "type_k": "n/a", "type_v": "n/a", "split_mode": "n/a",
    "main_gpu": 0, "no_kv_offload": False, "tensor_split": "n/a", "tensor_buft_overrides": "none", "lazy_mode": "n/a",
    "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": False, "fit_target": 0, "fit_min_ctx": 0,
}
LLAMA_CPP_ENGINES = ("llama-cpp", "llama-bench")


def json_dict(v) -> dict:
    """A JSON object column of cells.csv (effective_settings, extra, ...) as a dict; {} where empty or unreadable."""
    try:
        d = json.loads(v) if isinstance(v, str) and v else {}
    except json.JSONDecodeError:
        return {}
    return d if isinstance(d, dict) else {}


def _ggml_backends(system_info: str) -> str:
    """llama-bench's `backends` from llama.cpp's system info ("CUDA : ARCHS = 890 | ... | CPU : SSE3 = 1 | ..."):
    the backends other than the CPU, or "CPU" when there are none (test::get_backend)."""
    names = [n for n in re.findall(r"(?:^|\| )(\w+) : ", system_info) if n != "CPU"]
    return ",".join(names) or "CPU"


def _model_numbers(path: str, fingerprint: str) -> tuple[int | None, int | None]:
    """llama-bench's model_size and model_n_params (bytes and values of every tensor) from the file's header when
    the file is still there as measured (same fingerprint); else unknown (None)."""
    from engines.errors import UserError
    from engines.gguf_meta import read_meta
    try:
        meta = read_meta(path)
    except UserError:
        return None, None
    if meta.fingerprint != fingerprint:
        return None, None
    return sum(t.n_bytes for t in meta.tensors), sum(math.prod(t.ne) for t in meta.tensors)


def llama_bench_settings(run: dict, c) -> dict:
    """One cell's llama-bench fields other than the test's and its timings: what the cell really ran with, in
    llama-bench's terms (cells from load_frames)."""
    eff, extra = json_dict(c["effective_settings"]), json_dict(c["extra"])
    host = (run.get("nodes") or {}).get(c.get("node")) or run.get("host") or {}     # --ray: the node's own
    llama_cpp = c["engine"] in LLAMA_CPP_ENGINES or "system_info" in eff or "backends" in eff   # or a plugin build
    load_mode = eff.get("load_mode") or ("mmap" if switch(eff.get("mmap", c["mmap"])) else "none")
    if llama_cpp:
        s = {k: eff.get(k, v) for k, v in LLAMA_CPP_DEFAULTS.items()}     # llama-bench's own, or as asked
        s |= {"repack": switch(eff.get("repack", extra.get("repack", True))),
              "no_host": switch(eff.get("no_host", extra.get("no_host", False))),
              "no_op_offload": int(eff.get("no_op_offload", not switch(eff.get("op_offload", True)))),
              "n_gpu_layers": eff.get("n_gpu_layers", -1), "load_mode": load_mode,
              "flash_attn": eff["flash_attn"] if isinstance(eff.get("flash_attn"), int)
              else FLASH_ATTN.get(c["flash_attn"], -1)}
        backends = eff.get("backends") or _ggml_backends(eff.get("system_info", ""))
    else:
        device = str(eff.get("device", c["device"]))
        s = dict(NOT_LLAMA_CPP) | {
            "devices": device, "load_mode": load_mode,
            "n_gpu_layers": -1,     # llama.cpp's "all layers": every layer on its device but the experts of the
                                    # first n_cpu_moe layers, as these engines place them
            "flash_attn": -1}       # auto: the engine's own attention (the reference engine: torch's SDPA)
        if c["engine"] == "reference":      # its KV cache: f16 on a CPU (extra cache_type), the compute dtype on CUDA
            kv = eff.get("dtype") if device.startswith("cuda") else extra.get("cache_type", "f16")
            s |= {"type_k": kv, "type_v": kv}
        backends = device.upper()
    # The script compares runs by build_commit and matches tests on every other setting, so the engine (as the
    # tables name it, with its crossed knobs or arm) goes into backends: two engines of one run stay two rows.
    return s | {"backends": f"{c['label']}: {backends}", "cpu_info": host.get("cpu", ""),
                "gpu_info": ", ".join(g.get("name", "") for g in host.get("gpus") or []),
                "model_filename": c["model"], "model_type": f"{c['arch']} {c['model_name']}",
                "n_batch": c["n_batch"], "n_ubatch": c["n_ubatch"], "n_threads": c["threads"],
                "n_cpu_moe": c["n_cpu_moe"]}


def llama_bench_records(run: dict, cells, measurements) -> list[dict]:
    """The measurements as llama-bench's `-o json` records, one per cell x workload: every field of llama-bench's
    (LLAMA_BENCH_FIELDS, in its order and kinds), then samples_ns and samples_ts, then ours (engine,
    engine_version, ggml_compiler where known), which llama.cpp's compare-llama-bench.py ignores.
    build_commit is the run id: that script compares builds, and here a run is what is compared
    (`compare-llama-bench.py -i a.json -i b.json -b RUN_A -c RUN_B`); the engines' versions are in engine_version."""
    from datetime import datetime

    started = run.get("started")
    test_time = datetime.fromisoformat(started).strftime("%Y-%m-%dT%H:%M:%SZ") if started else ""
    models: dict[tuple, tuple] = {}
    out = []
    for _, c in cells.iterrows():
        m = measurements[measurements["cell_id"] == c["cell_id"]]
        if m.empty:
            continue
        key = (c["model"], c["model_fingerprint"])
        if key not in models:
            models[key] = _model_numbers(*key)
        base = llama_bench_settings(run, c) | {"build_commit": run.get("run_id", ""), "build_number": 0,  # unknown
                                               "model_size": models[key][0], "model_n_params": models[key][1],
                                               "test_time": test_time}
        eff = json_dict(c["effective_settings"])
        for _, g in m.groupby("workload", sort=False):
            ns, ts = g["ns"].astype(int).tolist(), g["tokens_per_s"].astype(float).tolist()
            sn, st = stats(ns), stats(ts)
            first = g.iloc[0]
            values = base | {"n_prompt": first["n_prompt"], "n_gen": first["n_gen"], "n_depth": first["n_depth"],
                             "avg_ns": sn["mean"], "stddev_ns": 0 if math.isnan(sn["std"]) else sn["std"],
                             "avg_ts": st["mean"], "stddev_ts": 0.0 if math.isnan(st["std"]) else st["std"]}
            record = {f: None if values[f] is None else kind(values[f]) for f, kind in LLAMA_BENCH_FIELDS.items()}
            out.append(record | {"samples_ns": ns, "samples_ts": ts, "engine": c["engine"],
                                 "engine_version": c["engine_version"],
                                 **({"ggml_compiler": eff["ggml_compiler"]} if eff.get("ggml_compiler") else {})})
    return out
