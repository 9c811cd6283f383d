"""TensorSharp's published MoE CPU-offload tables (results/published/) as data: the published layout,
ratios recomputed next to the printed ones, the measured-vs-published comparison, and `reproduce`,
which runs the sweep behind one published table.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import click

from engines.base import UserError
from harness.cli import FORMAT, user_errors

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "results" / "published" / "tensorsharp_moe_cpu_offload.csv"
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
    return pd.read_csv(DATA)


def select(df, model: str | None = None, revision: str | None = None):
    """Rows of one model and/or revision; names match case-insensitively, revisions by their key."""
    if revision:
        keys = {revision_key(r) for r in df["doc_revision"]}
        if revision.lower() not in {k.lower() for k in keys}:
            raise UserError(f"Unknown published revision {revision!r}; choose from: {', '.join(sorted(keys))}.")
        df = df[df["doc_revision"].map(lambda r: revision_key(r).lower() == revision.lower())]
    if model:
        if model.lower() not in {m.lower() for m in df["model"]}:
            raise UserError(f"No published table for model {model!r}; choose from: {', '.join(sorted(set(df['model'])))}.")
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


def layout_rows(depths: list[int], workloads: list[str], a: str, b: str, get: Getter, vram_unit: str = "MiB",
                printed: Getter | None = None) -> list[dict]:
    """The published layout: one row per depth,
    n_cpu_moe | A VRAM | B VRAM | ratio | A wl | B wl | ratio ... (ratio = A / B, recomputed from the values).
    get(engine, depth, metric) gives a value for metric 'vram' or a workload; printed(None, depth, metric)
    gives the ratio as published, shown next to the recomputed one."""
    rows = []
    for d in depths:
        row: dict = {"n_cpu_moe": d}
        for metric, label, short in [("vram", f"VRAM {vram_unit}", "VRAM"), *((w, w, w) for w in workloads)]:
            va, vb = get(a, d, metric), get(b, d, metric)
            row[f"{a} {label}"], row[f"{b} {label}"] = va, vb
            row[f"{short} ratio"] = ratio(va, vb)
            if printed:
                row[f"{short} printed"] = printed(None, d, metric)
        rows.append(row)
    return rows


def display(rows: list[dict]) -> list[dict]:
    """Numbers formatted for people (ratios as 1.23x); strings (failures, notes) unchanged."""
    def f(col: str, v):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return "" if v is None else v
        if isinstance(v, float) and math.isnan(v):
            return ""
        if col.endswith(("ratio", "printed")):
            return f"{v:.2f}x" if abs(v) >= 0.1 else f"{v:.2g}x"
        if col == "n_cpu_moe" or isinstance(v, int):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return [{k: f(k, v) for k, v in r.items()} for r in rows]


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


@click.command()
@click.option("--model", default=None, help="Only this model (e.g. Qwen3.5-35B-A3B).")
@click.option("--revision", default=None, help="Only this revision of the document: final | 2026-08-05 | 2026-08-04.")
@FORMAT
@user_errors
def published(model, revision, fmt) -> None:
    """TensorSharp's published tables, with ratios recomputed from the data next to the printed ones."""
    from harness.tables import render

    groups = tables(select(load(), model, revision))
    if fmt in ("csv", "json"):       # one machine-readable document, raw numbers
        render([r for _, rows in groups for r in rows], fmt)
        return
    for title, rows in groups:
        render(display([{k: v for k, v in r.items() if k not in ("revision", "model")} for r in rows]), fmt, title)


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
        {"": "CPU", "published": p.cpu, "this run": f"{host.get('cpu', '')} ({host.get('cores_logical', '?')} threads)"},
        {"": "RAM GiB", "published": str(p.ram_gib), "this run": f"{host.get('ram_mib', 0) / 1024:.0f}"},
        {"": "model", "published": f"{p.model} {p.quant}", "this run": model_meta.get("name", "")},
        {"": "MoE layers", "published": str(p.moe_layers), "this run": str(model_meta.get("n_moe_layers", ""))},
    ]


def against_rows(df, a: str, b: str, measured: Getter, n_layers: int, measured_workloads: list[str]) -> list[dict]:
    """Per published depth x metric: published A, B and ratio next to measured a, b and ratio (a ~ TensorSharp,
    b ~ llama.cpp). Depths beyond the measured model, or workloads not run, are named, not left blank."""
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
            out.append({"n_cpu_moe": d, "metric": label, f"published {A}": r[f"{A} {label}"],
                        f"published {B}": r[f"{B} {label}"], "published ratio": r[f"{label.split()[0]} ratio"],
                        f"measured {a}": ma, f"measured {b}": mb, "measured ratio": ratio(ma, mb), "note": note})
    return out


# --- reproduce ------------------------------------------------------------------------------------

def plan_depths(published_depths: list[int], n_layers: int, clamp: bool) -> tuple[list[int], str]:
    """The depths to run on a file with n_layers layers, and a warning ('' if none).
    Depths beyond the file are an error unless clamp: then they become n_layers (deduplicated)."""
    over = [d for d in published_depths if d > n_layers]
    if not over:
        return published_depths, ""
    if not clamp:
        raise UserError(f"Published depths {', '.join(map(str, over))} exceed the model file's {n_layers} layers; "
                        f"pass the published model's GGUF, or --clamp to run them at {n_layers} (all layers).")
    depths = sorted({min(d, n_layers) for d in published_depths})
    return depths, f"warning: depths {', '.join(map(str, over))} clamped to {n_layers} (the file's layer count)."


@click.command()
@click.option("--published-model", required=True, help="A model of the published tables, e.g. Qwen3.5-35B-A3B.")
@click.option("--model-file", required=True, type=click.Path(dir_okay=False), help="The GGUF file to run.")
@click.option("--revision", default=DEFAULT_REVISION, show_default=True, help="Revision of the published document.")
@click.option("-e", "--engines", default="reference,llama-cpp", show_default=True,
              help=f"Two engines: the first stands for {A}, the second for {B}.")
@click.option("-w", "--workloads", default=None, help="Override the published workloads (e.g. pp16,tg4 for a quick check).")
@click.option("-r", "--repetitions", type=int, default=None, help="Override the published repetitions.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores).")
@click.option("--clamp", is_flag=True, help="Run depths beyond the file's layers at all layers (else an error).")
@click.option("--dry-run", is_flag=True, help="Print the plan and run nothing.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results", show_default=True)
@click.option("--reports-dir", type=click.Path(file_okay=False), default="reports", show_default=True)
@FORMAT
@user_errors
def reproduce(published_model, model_file, revision, engines, workloads, repetitions, threads, clamp, dry_run,
              results_dir, reports_dir, fmt) -> None:
    """Plan and run the sweep behind one published table, then report it against the published numbers."""
    from engines.gguf_meta import read_meta
    from harness.spec import SweepSpec, split_list
    from harness.tables import render

    df = select(load(), model=published_model, revision=revision)
    engines_ = split_list(engines)
    if len(engines_) != 2:
        raise UserError(f"--engines {engines!r} must name two engines (one for {A}, one for {B}), e.g. reference,llama-cpp.")
    if not Path(model_file).exists():
        raise UserError(f"--model-file {model_file!r} does not exist; pass the path of a GGUF file.")
    meta = read_meta(model_file)
    depths, warning = plan_depths(sorted(set(df["n_cpu_moe"].astype(int))), meta.n_layers, clamp)
    reps_published = REPETITIONS[revision_key(df["doc_revision"].iloc[0])]
    # One repetition count for every engine keeps it one matched sweep; the larger count means
    # neither side gets fewer best-of tries than it had in the document.
    reps = repetitions or max(reps_published.values())
    wls = split_list(workloads) if workloads else workload_order(df["workload"])
    spec_kw = {"threads": threads} if threads else {}
    spec = SweepSpec(models=[str(model_file)], engines=engines_, depths=[str(d) for d in depths], workloads=wls,
                     repetitions=reps, **spec_kw)
    layers = int(df["moe_layers"].iloc[0])
    plan = [
        {"item": "published table", "value": f"{df['model'].iloc[0]} | {df['doc_revision'].iloc[0]}"},
        {"item": "model file", "value": f"{model_file} ({meta.name}, {meta.n_layers} layers; published: {layers})"},
        {"item": "engines", "value": f"{engines_[0]} for {A}, {engines_[1]} for {B}"},
        {"item": "n_cpu_moe", "value": ", ".join(map(str, depths))},
        {"item": "workloads", "value": ", ".join(wls)},
        {"item": "repetitions", "value": f"{reps} (published best-of: {A} {reps_published[A]}, {B} {reps_published[B]})"},
        {"item": "matched settings", "value": f"threads {spec.threads}, n_ubatch {spec.n_ubatch}, n_batch "
                                              f"{spec.n_batch}, flash-attn {spec.flash_attn} for both engines"},
    ]
    if meta.n_layers != layers:
        plan.append({"item": "note", "value": f"the file has {meta.n_layers} layers, the published model {layers}: "
                                              "this is not the published model"})
    render(plan, fmt, title="reproduce plan")
    if warning:
        click.echo(warning, err=True)
    if dry_run:
        return
    from harness.progress import sweep_with_progress
    from harness.report import write_report

    run_dir, _ = sweep_with_progress(spec, Path(results_dir), None)
    rep = write_report([run_dir], Path(reports_dir) / run_dir.name, engine_a=engines_[0], baseline=engines_[1],
                       against=published_model, revision=revision)
    rep.print_tables(fmt)
    click.echo(f"results: {run_dir}\nreport: {rep.out_dir / 'report.html'}", err=True)
