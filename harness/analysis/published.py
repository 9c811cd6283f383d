"""TensorSharp's published MoE CPU-offload tables (package data, harness/analysis/data/) as data: the published layout,
ratios recomputed next to the printed ones, the measured-vs-published comparison, and `reproduce`,
which runs the sweep behind one published table.
"""
from __future__ import annotations

import math
import re
from typing import Callable

from engines.errors import UserError
from harness.stats import fmt_ratio

DATA = "tensorsharp_moe_cpu_offload.csv"        # package data: harness/analysis/data/, see its README
A, B = "TensorSharp", "llama.cpp"                      # as published: ratio = A / B
DEFAULT_REVISION = "final"
# Best-of repetitions the document states per revision (README facts): llama-bench -r 2 for the final
# pp4096/pp8192/tg128 tables, -r 3 for the 512-token ones; TensorSharp --bench-runs 3 throughout.
REPETITIONS = {"final": {A: 3, B: 2}, "2026-08-05": {A: 3, B: 3}, "2026-08-04": {A: 3, B: 3}}

# A value in a layout row: a number, or a string saying why there is none ("failed (oom)", "not run").
Getter = Callable[[str, int, str], "float | str | None"]


def revision_key(revision: str) -> str:
    """'final (pp4096/pp8192/tg128)' -> 'final' (what --revision accepts)."""
    return revision.split(" (")[0]


def load():
    import pandas as pd
    from importlib.resources import files
    with files("harness.analysis").joinpath("data", DATA).open() as f:
        return pd.read_csv(f)


def select(df, model: str | None = None, revision: str | None = None):
    """Rows of one model and/or revision; names match case-insensitively, revisions by their key."""
    if revision:
        keys = {revision_key(r) for r in df["doc_revision"]}
        if revision.lower() not in {k.lower() for k in keys}:
            raise UserError(f"Unknown published revision {revision!r}; choose from: {', '.join(sorted(keys))}.")
        df = df[df["doc_revision"].map(lambda r: revision_key(r).lower() == revision.lower())]
    if model:
        if model.lower() not in {m.lower() for m in df["model"]}:
            raise UserError(f"No published table for model {model!r}; choose from: "
                            f"{', '.join(sorted(set(df['model'])))}.")
        df = df[df["model"].str.lower() == model.lower()]
    return df


def workload_order(names) -> list[str]:
    """pp before tg, then by size: the column order of the published tables."""
    def key(w: str):
        m = re.match(r"(pp|tg)(\d+)", w)
        return (m.group(1) != "pp", int(m.group(2)), w) if m else (2, 0, w)
    return sorted({w for w in names if isinstance(w, str) and w}, key=key)


def ratio(a, b) -> float:
    ok = all(isinstance(x, (int, float)) and not math.isnan(x) for x in (a, b)) and b
    return a / b if ok else float("nan")


def with_interval(row: dict, col: str, iv) -> None:
    """Put the interval and verdict of the ratio in column `col` next to it (iv: harness.stats.RatioInterval or
    None): `col low`, `col high`, `col verdict`; display() folds them into the ratio's cell."""
    nan = float("nan")
    row[f"{col} low"], row[f"{col} high"] = (iv.low, iv.high) if iv else (nan, nan)
    row[f"{col} verdict"] = iv.verdict if iv else ""


def layout_rows(depths: list[int], workloads: list[str], a: str, b: str, get: Getter, vram_unit: str = "MiB",
                printed: Getter | None = None, interval: Callable | None = None) -> list[dict]:
    """The published layout: one row per depth,
    n_cpu_moe | A VRAM | B VRAM | ratio | A wl | B wl | ratio ... (ratio = A / B, recomputed from the values).
    get(engine, depth, metric) gives a value for metric 'vram' or a workload; printed(None, depth, metric)
    gives the ratio as published, shown next to the recomputed one; interval(a, b, depth, workload) the
    measured ratio's 95 % interval and verdict (with_interval)."""
    rows = []
    for d in depths:
        row: dict = {"n_cpu_moe": d}
        for metric, label, short in [("vram", f"VRAM {vram_unit}", "VRAM"), *((w, w, w) for w in workloads)]:
            va, vb = get(a, d, metric), get(b, d, metric)
            row[f"{a} {label}"], row[f"{b} {label}"] = va, vb
            row[f"{short} ratio"] = ratio(va, vb)
            if interval and metric != "vram":
                iv = interval(a, b, d, metric)
                if iv and iv.ratio == iv.ratio:     # the headline is the interval's centre; median / median beside it
                    row[f"{short} median ratio"], row[f"{short} ratio"] = row[f"{short} ratio"], iv.ratio
                with_interval(row, f"{short} ratio", iv)
            if printed:
                row[f"{short} printed"] = printed(None, d, metric)
        rows.append(row)
    return rows


def display(rows: list[dict]) -> list[dict]:
    """Numbers formatted for people (ratios as 1.23x, with their interval when the row has one: 1.23x (1.10–1.37));
    strings (failures, notes) unchanged."""
    def f(col: str, v):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return "" if v is None else v
        if isinstance(v, float) and math.isnan(v):
            return ""
        if col.endswith(("ratio", "printed")):
            return f"{fmt_ratio(v)}x"
        if col == "n_cpu_moe" or isinstance(v, int):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"

    def fold(r: dict) -> dict:
        out = {}
        for k, v in r.items():
            if k.endswith((" low", " high")) and k.rsplit(" ", 1)[0] in r:
                continue
            out[k] = f(k, v)
            lo, hi = r.get(f"{k} low", math.nan), r.get(f"{k} high", math.nan)
            if out[k] and lo == lo and hi == hi:
                out[k] += f" ({fmt_ratio(lo)}–{fmt_ratio(hi)})"
        return out
    return [fold(r) for r in rows]


def tables(df) -> list[tuple[str, list[dict]]]:
    """(title, layout rows) per revision x model of the published data."""
    out = []
    for (rev, model), g in df.groupby(["doc_revision", "model"], sort=False):
        vals = {(r.engine, int(r.n_cpu_moe), r.metric, r.workload if isinstance(r.workload, str) else "vram"): r.value
                for r in g.itertuples()}
        get = lambda e, d, m: vals.get((e, d, "peak_vram" if m == "vram" else "throughput", m))
        has_printed = (g["metric"] == "throughput_ratio").any()
        printed = (lambda _, d, m: vals.get((f"{A}/{B}", d, "vram_ratio" if m == "vram" else "throughput_ratio", m))) \
            if has_printed else None
        unit = g.loc[g["metric"] == "peak_vram", "unit"].iloc[0]
        first = g.iloc[0]
        title = f"{model} ({first.quant}, {first.moe_layers} MoE layers) | {rev} | {first.host}"
        rows = layout_rows(sorted(set(g["n_cpu_moe"].astype(int))), workload_order(g["workload"]), A, B, get,
                           unit, printed)
        out.append((title, [{"revision": rev, "model": model} | r for r in rows]))
    return out


# --- measured vs published ------------------------------------------------------------------------

def hardware_rows(df, host: dict, model_meta: dict) -> list[dict]:
    """Published host and model next to the measured ones, so a laptop run is not read as a failed reproduction."""
    p = df.iloc[0]
    gpus = host.get("gpus") or []
    gpu = f"{gpus[0]['name']} ({gpus[0].get('vram_mib', 0) / 1024:.0f} GiB, PCIe {gpus[0].get('pcie', '?')})" \
        if gpus else "none (no GPU: VRAM not measured)"
    return [
        {"": "host", "published": p.host, "this run": host.get("hostname", "")},
        {"": "GPU", "published": p.gpu, "this run": gpu},
        {"": "CPU", "published": p.cpu,
         "this run": f"{host.get('cpu', '')} ({host.get('cores_logical', '?')} threads)"},
        {"": "RAM GiB", "published": str(p.ram_gib), "this run": f"{host.get('ram_mib', 0) / 1024:.0f}"},
        {"": "model", "published": f"{p.model} {p.quant}", "this run": model_meta.get("name", "")},
        {"": "MoE layers", "published": str(p.moe_layers), "this run": str(model_meta.get("n_moe_layers", ""))},
    ]


def against_rows(df, a: str, b: str, measured: Getter, n_layers: int, measured_workloads: list[str],
                 interval: Callable | None = None) -> list[dict]:
    """Per published depth x metric: published A, B and ratio next to measured a, b and ratio (a ~ TensorSharp,
    b ~ llama.cpp), with the measured ratio's interval (layout_rows' `interval`). Depths beyond the measured model,
    or workloads not run, are named, not left blank."""
    ((_, rows),) = tables(df)
    unit = df.loc[df["metric"] == "peak_vram", "unit"].iloc[0]
    out = []
    for r in rows:
        d = r["n_cpu_moe"]
        for metric, label in [("vram", f"VRAM {unit}"), *((w, w) for w in workload_order(df["workload"]))]:
            ma, mb = measured(a, d, metric), measured(b, d, metric)
            note = ""
            if d > n_layers:
                note = f"depth {d} > the measured model's {n_layers} layers"
            elif metric != "vram" and metric not in measured_workloads:
                note = f"{metric} not run (ran {', '.join(measured_workloads) or 'nothing'})"
            elif ma == mb == "not run":
                note = "depth not in this run"
            elif metric == "vram" and unit != "MiB":
                note = f"published VRAM is in {unit}, measured in MiB"
            row = {"n_cpu_moe": d, "metric": label, f"published {A}": r[f"{A} {label}"],
                   f"published {B}": r[f"{B} {label}"], "published ratio": r[f"{label.split()[0]} ratio"],
                   f"measured {a}": ma, f"measured {b}": mb, "measured ratio": ratio(ma, mb)}
            if interval:
                with_interval(row, "measured ratio", interval(a, b, d, metric) if metric != "vram" else None)
            out.append(row | {"note": note})
    return out


# --- reproduce ------------------------------------------------------------------------------------

# Published layer counts that the checkpoints contradict (the models' config.json on their hubs)
LAYER_NOTES = {"Qwen3.5-35B-A3B": "the published table gives Qwen3.5-35B-A3B 48 MoE layers, but its checkpoint has "
                                  "40; 48 is Qwen3.5-122B-A10B's count"}


def plan_depths(published_depths: list[int], n_layers: int, clamp: bool, model: str = "") -> tuple[list[int], str]:
    """The depths to run on a file with n_layers layers, and a warning ('' if none).
    Depths beyond the file are an error unless clamp: then they become n_layers (deduplicated)."""
    over = [d for d in published_depths if d > n_layers]
    if not over:
        return published_depths, ""
    why = LAYER_NOTES.get(model, "")
    if not clamp:
        raise UserError(f"Published depths {', '.join(map(str, over))} exceed the model file's {n_layers} layers"
                        + (f" ({why})" if why else "")
                        + f"; pass the published model's GGUF, or --clamp to run them at {n_layers} (all layers).")
    depths = sorted({min(d, n_layers) for d in published_depths})
    return depths, (f"warning: depths {', '.join(map(str, over))} clamped to {n_layers} (the file's layer count"
                    + (f"; {why}" if why else "") + ").")
