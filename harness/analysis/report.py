"""`moebench report`: turn one or more result directories into report.md, a self-contained report.html
(plots embedded as data URIs, no external scripts, fonts or stylesheets) and PNG plots.

Reads result files only (harness.store.results); never runs an engine. Every string that came from a GGUF
file or a result file is escaped for its output (HTML: html.escape; Markdown: backslash escapes).
"""
from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from engines.errors import UserError
from harness.analysis.tables import md_escape

A_PREFERRED, B_PREFERRED = ("reference", "tensorsharp"), ("llama-cpp", "llama-bench")    # as `report --help` says
SETTINGS = ["n_ctx", "n_batch", "n_ubatch", "threads", "flash_attn", "device", "dtype", "mmap", "extra",
            "expert_host_fraction", "expert_bytes_host", "cpu_moe_layers", "host", "node"]
@dataclass
class P:
    """A paragraph: a trusted template with untrusted fields, escaped per output format."""
    template: str
    fields: dict = field(default_factory=dict)

    def md(self) -> str:
        return self.template.format(**{k: md_escape(v) for k, v in self.fields.items()})

    def html(self) -> str:
        return html.escape(self.template).format(**{k: html.escape(str(v)) for k, v in self.fields.items()})


@dataclass
class Report:
    out_dir: Path
    blocks: list = field(default_factory=list)     # ("h", level, P) | ("p", P) | ("table", P, rows) | ("img", path, P)
    tables: list = field(default_factory=list)     # (title, raw rows) for stdout
    layout: list = field(default_factory=list)     # the published-layout rows of every model (csv, json)

    def print_tables(self, fmt: str) -> None:
        from harness.analysis.published import display
        from harness.analysis.tables import render
        if fmt in ("csv", "json", "jsonl"):
            render(self.layout, fmt)
            return
        for title, rows in self.tables:
            render(display(rows), fmt, title)      # md: tables.markdown escapes every cell


def load_runs(run_dirs: list[Path]):
    """(runs, cells, measurements, samples) of every run; cell ids prefixed by run id when merging runs.
    A cell's `engine` here is its label (an interleaved run's two arms are two engines, `A:...` and `B:...`)."""
    import pandas as pd

    from harness.store import results

    runs, frames = [], []
    for d in run_dirs:
        run, *fs = results.load_frames(d)
        cells = fs[0]
        # the latest cell wins when runs repeat one: same label, model file, depth and node
        cells["key"] = [(c["label"], k.model_fingerprint, k.n_cpu_moe, k.node)
                        for c, k in ((c, results.CellKey.of(c)) for c in cells.to_dict("records"))]
        cells["engine"] = cells["label"]
        if len(run_dirs) > 1:
            for f in fs:
                f["cell_id"] = run["run_id"] + ":" + f["cell_id"].astype(str)
        runs.append(run)
        frames.append(fs)
    cells, meas, samples = (pd.concat([f[i] for f in frames], ignore_index=True) for i in range(3))
    cells = cells.drop_duplicates("key", keep="last")
    return runs, cells, meas, samples


def pick_engines(engines: list[str], engine_a: str | None, baseline: str | None,
                 failed: frozenset[str] = frozenset()) -> tuple[str, str]:
    """Engines A and B of a comparison: the ones asked for, else the preferred ones present. An engine in failed
    (not one cell ok) is never a default: a baseline that measured nothing would turn every ratio into its error."""
    for e in (engine_a, baseline):
        if e and e not in engines:
            raise UserError(f"Engine {e!r} is not in these results; choose from: {', '.join(engines)}.")
    usable = [e for e in engines if e not in failed] or engines
    arms = [e for e in usable if e.startswith(("A:", "B:"))]       # an interleaved run: A against B
    b = baseline or next((e for e in [*B_PREFERRED, *arms[1:]] if e in usable), usable[0])
    a = engine_a or next((e for e in [*A_PREFERRED, *usable] if e in usable and e != b), "(none)")
    return a, b


def reason(cell) -> str:
    err = str(cell["error"]) if isinstance(cell["error"], str) else ""
    err = err.split(" | log tail")[0]
    return f"{cell['status']} ({err[:80]}{'...' if len(err) > 80 else ''})" if err else str(cell["status"])


def last_cell(cells, engine: str, depth: int):
    """The cell of engine at depth (the last one run), or None."""
    c = cells[(cells["engine"] == engine) & (cells["n_cpu_moe"] == depth)]
    return c.iloc[-1] if len(c) else None


def getter(cells, summary, stat: str):
    """get(engine, depth, metric) for published.layout_rows: a number, or why there is none."""
    def get(engine: str, depth: int, metric: str):
        c = last_cell(cells, engine, depth)
        if c is None:
            return "not run"
        if c["status"] != "ok":
            return reason(c)
        if metric == "vram":
            return "not measured" if math.isnan(c["peak_vram_mib"]) else float(c["peak_vram_mib"])
        s = summary[(summary["engine"] == engine) & (summary["n_cpu_moe"] == depth) & (summary["workload"] == metric)]
        return "not run" if s.empty else float(s.iloc[0][stat])
    return get


def steadiness_text(run: dict) -> str:
    """The fixed bandwidth probe timed at the start of every round (run.json["steadiness"]) in one sentence: how much
    the machine itself moved during the run, measured without the engines ('' for runs without it)."""
    probes = [p for p in run.get("steadiness") or [] if p.get("read_gbps")]
    if not probes:
        return ""
    gbps = [p["read_gbps"] for p in probes]
    moved = (max(gbps) - min(gbps)) / max(gbps)
    each = ", ".join(f"{p['when']} {p['read_gbps']:.1f}" for p in probes)
    return (f"Memory read bandwidth (a fixed probe, one thread, at the start of each round): {each} GB/s: the "
            f"machine's bandwidth moved {moved:.0%} during this run{' (steady)' if moved <= STEADY else ''}.")


STEADY = 0.05       # the probe moving less than this: the machine was steady


@dataclass
class Intervals:
    """intervals(a, b, depth, workload) -> harness.stats.RatioInterval of engine a over engine b at that depth, or
    None when either cell is missing or failed; `units` collects what each interval resampled and `notes` why a
    ratio has none (for captions). Two cells of one run are treated as their run.json says (`runs`;
    harness.store.history.pairing): round r of both ran in the same stretch of time (interleaved rounds, the turns
    of --interleave) so their rounds pair, unless back-to-back; an --until run's intervals are Stein's. Without
    `runs`, cells of one run pair."""
    cells: object
    meas: object
    runs: list = field(default_factory=list)            # run.json of each run (load_runs), for pairing
    units: set = field(default_factory=set)
    notes: set = field(default_factory=set)
    _memo: dict = field(default_factory=dict)          # the layout table and the speedup plot ask the same cells

    def __call__(self, a: str, b: str, depth: int, workload: str):
        key = (a, b, depth, workload)
        if key not in self._memo:
            self._memo[key] = self._interval(*key)
        return self._memo[key]

    def _interval(self, a: str, b: str, depth: int, workload: str):
        from harness.stats import ratio_interval
        from harness.store.history import pairing
        from harness.store.results import round_groups

        ca, cb = last_cell(self.cells, a, depth), last_cell(self.cells, b, depth)
        if ca is None or cb is None or ca["status"] != "ok" or cb["status"] != "ok":
            return None
        m = self.meas[self.meas["workload"] == workload]
        ga, gb = (round_groups(m[m["cell_id"] == c["cell_id"]]) for c in (ca, cb))
        run = next((r for r in self.runs if r.get("run_id") == ca.get("run_id")), {})
        how = pairing(run) if ca.get("run_id") == cb.get("run_id") else {"paired": False}
        iv = ratio_interval(ga, gb, **how)
        if iv.low == iv.low:
            self.units.add(f"{iv.n} {iv.unit}")
        elif iv.note:
            self.notes.add(iv.note)
        return iv

    def describe(self) -> str:
        """What the intervals were computed over, and why some ratios have none."""
        over = [f"t interval on log ratios over {' / '.join(sorted(self.units))}"] if self.units else []
        return "; ".join(over + [f"no interval for {n}" for n in sorted(self.notes)]) or "no samples"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _settings(cell, meas) -> dict:
    """What a cell asked for, what the engine reports it did (effective), and its decode context depths."""
    from harness.store import results

    m = meas[meas["cell_id"] == cell["cell_id"]]
    tg = sorted({int(x) for x in m.loc[m["n_gen"] > 0, "n_depth"]}) if not m.empty else []
    out = {k: cell.get(k, "") for k in SETTINGS}          # older runs lack newer columns
    out["expert_host_fraction"] = f"{float(cell['expert_host_fraction']):.3f}"
    out["workloads"] = ", ".join(dict.fromkeys(m["workload"])) if not m.empty else ""
    out["decode context depth"] = ", ".join(map(str, tg))
    out |= {f"{k} (effective)": v for k, v in _flat(results.json_dict(cell["effective_settings"])).items()}
    return {k: str(v) for k, v in out.items()}


def kernel_path_rows(cells) -> list[dict]:
    """llama.cpp cells in which --n-cpu-moe kept experts in the plain CPU buffer that its extra buffer types would
    have taken (effective experts_unrepacked_bytes): its expert kernels then change with the depth (repacked at
    depth 0, generic at depth N), a difference beside the one being measured."""
    from harness.store import results

    rows = []
    for _, c in cells.sort_values("n_cpu_moe").iterrows():
        eff = results.json_dict(c["effective_settings"])
        plain = int(eff.get("experts_unrepacked_bytes") or 0)
        if plain:
            rows.append({"engine": c["engine"], "n_cpu_moe": int(c["n_cpu_moe"]),
                         "experts in the plain CPU buffer MiB": plain / 2**20,
                         "extra buffer types MiB": ", ".join(f"{k} {v / 2**20:,.1f}"
                                                             for k, v in (eff.get("extra_bufts") or {}).items())})
    return rows


NOT_REPORTED = "(not reported)"


def fairness_rows(cells, meas, a: str, b: str, depths: list[int]) -> list[dict]:
    """Every setting that differed between A and B at one depth, over the union of both sides' settings (asked,
    effective with nested ones flattened as compute_dtype.prefill, workload context): one side's setting the other
    does not report is a difference too, shown as NOT_REPORTED. Only pairs of cells that both produced numbers."""
    rows = []
    for d in depths:
        ca, cb = (cells[(cells["engine"] == e) & (cells["n_cpu_moe"] == d)] for e in (a, b))
        if ca.empty or cb.empty or "ok" != ca.iloc[-1]["status"] or "ok" != cb.iloc[-1]["status"]:
            continue
        sa, sb = _settings(ca.iloc[-1], meas), _settings(cb.iloc[-1], meas)
        for k in dict.fromkeys([*sa, *sb]):
            va, vb = sa.get(k) or NOT_REPORTED, sb.get(k) or NOT_REPORTED
            if va != vb:
                rows.append({"n_cpu_moe": d, "setting": k, a: va, b: vb})
    return rows


def host_layers_text(cells, a: str, b: str, depths: list[int]) -> str:
    """Whether A and B kept the same layers' experts in host memory at each depth (results.layers_compared)."""
    from harness.store.results import layers_compared

    parts = []
    for d in depths:
        ca, cb = (last_cell(cells, e, d) for e in (a, b))
        if ca is not None and cb is not None:
            parts.append(f"n_cpu_moe {d}: " + (layers_compared(ca.get("cpu_moe_layers"), cb.get("cpu_moe_layers"))
                                               or "not reported by both"))
    return "; ".join(parts) or "no depth with both engines"


def _runs_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        h, s = r.get("host", {}), r.get("spec", {})
        rows.append({"run": r["run_id"], "started": r.get("started", "")[:19], "CPU": h.get("cpu", ""),
                     "threads": h.get("cores_logical", ""), "RAM GiB": f"{h.get('ram_mib', 0) / 1024:.0f}",
                     "GPU": h.get("gpu_name") or "none", "commit": h.get("git_commit", ""),
                     "engines": ", ".join(s.get("engines", [])), "workloads": ", ".join(s.get("workloads", [])),
                     "repetitions": s.get("repetitions", ""), "rounds": _rounds_text(r)})
    return rows


def _rounds_text(run: dict) -> str:
    """`3 interleaved`, `10 interleaved (3 planned, then --until)`, `2 back-to-back`, `5 A/B turns`; "" for runs
    written before rounds were recorded."""
    if run.get("interleave"):
        return f"{len(run['interleave'].get('rounds', [])) or ''} A/B turns".strip()
    info = run.get("rounds") or {}
    if not info.get("sizes"):
        return ""
    planned = len(info["sizes"])
    ran = (run.get("until") or {}).get("rounds", planned)
    return f"{ran} {info.get('order', '')}".strip() + (f" ({planned} planned, then --until)" if ran != planned else "")


def _cell_label(cell_id: str) -> str:
    """'llama-bench/dbcbae4a9961c76e/ncmoe0' -> 'llama-bench n_cpu_moe=0' (the model is the section's)."""
    parts = cell_id.split("/")
    return " ".join([parts[0], *(re.sub(r"^ncmoe", "n_cpu_moe=", x) for x in parts[2:])])


def rounds_rows(mcells, meas) -> list[dict]:
    """Per cell x workload measured in more than one round: each round's mean tok/s and how the spread splits
    between rounds (processes, time) and within a process (results.round_split)."""
    from harness.store import results

    if "round" not in meas or meas["round"].isna().all():
        return []
    rows = []
    for c in mcells.sort_values(["engine", "n_cpu_moe"], kind="stable").to_dict("records"):
        m = meas[meas["cell_id"] == c["cell_id"]]
        for wl, g in m.groupby("workload", sort=False):
            split = results.round_split(g)
            if split["rounds"] > 1:
                means = g.groupby("round")["tokens_per_s"].mean()
                rows.append({"engine": c["engine"], "n_cpu_moe": c["n_cpu_moe"], "workload": wl,
                             **{f"round {int(k)} tok/s": float(v) for k, v in means.items()},
                             "cv % between rounds": 100 * split["tps_cv_rounds"],
                             "cv % within a process": 100 * split["tps_cv_within"]})
    cols = list(dict.fromkeys(k for r in rows for k in r))      # rounds missing from a cell that failed early
    cols = [k for k in cols if not k.startswith("cv")] + [k for k in cols if k.startswith("cv")]
    return [{k: r.get(k, float("nan")) for k in cols} for r in rows]


def _summary_rows(summary) -> list[dict]:
    from harness.store.results import memory_cells

    return [{"engine": r.engine, "n_cpu_moe": r.n_cpu_moe, "workload": r.workload,
             "status": r.status if r.status == "ok" else reason(r._asdict()), "median tok/s": r.tps_median,
             "std": r.tps_std, "cv %": 100 * r.tps_cv, "min": r.tps_min, "max": r.tps_max, "n": r.tps_n,
             **memory_cells(r._asdict())}
            for r in summary.sort_values(["engine", "n_cpu_moe"], kind="stable").itertuples()]


def write_report(run_dirs: list[Path], out_dir: Path, engine_a: str | None = None, baseline: str | None = None,
                 against: str | None = None, revision: str = "final") -> Report:
    """Build the report of run_dirs into out_dir (report.md, report.html, *.png); returns it."""
    from harness.analysis import plots, published
    from harness.planning.roofline import annotate, bound_messages
    from harness.store import results

    runs, cells, meas, samples = load_runs(run_dirs)
    if cells.empty:
        raise UserError(f"No finished cells in {', '.join(map(str, run_dirs))}; run a sweep first (moebench sweep).")
    failed = frozenset(cells["engine"]) - frozenset(cells.loc[cells["status"] == "ok", "engine"])
    a, b = pick_engines(sorted(cells["engine"].unique()), engine_a, baseline, failed)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = results.summarize(cells, meas)
    rep = Report(out_dir)
    H = lambda level, t, **f: rep.blocks.append(("h", level, P(t, f)))
    para = lambda t, **f: rep.blocks.append(("p", P(t, f)))
    table = lambda rows, t, **f: rep.blocks.append(("table", P(t, f), rows))
    H(1, "moebench report: {runs}", runs=", ".join(r["run_id"] for r in runs))
    table(_runs_rows(runs), "Runs and hosts")
    for r in runs:          # what an engine did differently on that host than asked (Engine.notes), and the machine
        for note in r.get("notes") or []:
            para("Note ({run}): {note}", run=r["run_id"], note=note)
        if steadiness_text(r):
            para("Steadiness ({run}): {text}", run=r["run_id"], text=steadiness_text(r))
        if r.get("until"):
            u = r["until"]
            missed = [p for p in u["pairs"] if not p["reached"]]
            para("--until ({run}): {rounds} rounds to bring every compared ratio within ±{target}; {n} of {total} got "
                 "there ({why}).", run=r["run_id"], rounds=u["rounds"], target=f"{u['target']:.1%}",
                 n=len(u["pairs"]) - len(missed), total=len(u["pairs"]), why=u["stopped_by"])
            if u.get("pilot"):
                para("--until ({run}) used Stein's two-stage rule: a pilot of {pilot} interleaved rounds fixed how "
                     "many rounds each pair runs, and its interval is the mean of the rounds' log ratios ± t({dof}) x "
                     "the pilot's spread / sqrt(rounds), so the 95% holds with the stopping included.",
                     run=r["run_id"], pilot=u["pilot"], dof=u["pilot"] - 1)
            if missed:
                table([{"A": _cell_label(p["a"]), "B": _cell_label(p["b"]), "workload": p["workload"],
                        "95% interval": f"±{p['half_width']:.1%}",
                        "rounds": f"{p['rounds']} of {p['needed']}" if "needed" in p else p["rounds"],
                        "why": p["why"]} for p in missed],
                      "--until ({run}): the ratios that did not get there", run=r["run_id"])
    for line in bound_messages(annotate(cells, summary, runs)):     # above its bound, or none: never silent
        para("Roofline: {line}", line=line)
    if not any(r.get("host", {}).get("gpus") for r in runs):
        para("No GPU: VRAM not measured (the VRAM columns say so instead of showing zeros).")
    para("Memory: RAM MiB (anon) is the peak of the cell's anonymous resident memory, the RAM an engine needs (anon "
         "above floor: less its runtime's before the model loads); file-backed MiB is the peak of its mapped file "
         "pages (the model file when mapped, libraries): page cache the kernel can reclaim, but what keeps an mmap'd "
         "model fast. Each is its own peak; their sum may exceed the peak RSS.")
    names = cells.groupby("model_name")["model_fingerprint"].nunique()
    for i, (fp, mcells) in enumerate(cells.groupby("model_fingerprint", sort=False)):   # a file, not a name
        ms = summary[summary["model_fingerprint"] == fp]
        first = mcells.iloc[0]
        model = first["model_name"] if names[first["model_name"]] == 1 else f"{first['model_name']} ({fp})"
        depths = sorted(int(d) for d in mcells["n_cpu_moe"].unique())
        wls = [w for w in dict.fromkeys(ms["workload"]) if isinstance(w, str) and w]
        H(2, "Model {m}", m=model)
        para("{arch}, {n} layers ({moe} MoE), fingerprint {fp}, file {path}.", arch=first["arch"],
             n=first["n_layers"], moe=first["n_moe_layers"], fp=first["model_fingerprint"], path=first["model"])
        layout = published.layout_rows(depths, wls, a, b, getter(mcells, ms, "tps_median"),
                                       interval=(iv := Intervals(mcells, meas, runs)))
        title = f"{model}: A = {a}, B = {b} (baseline); median tok/s; ratio = A / B"
        table(published.display(layout), "Published layout. A = {a}, B = {b} (baseline); throughput = median tok/s "
              "over the repetitions; ratio = A / B with its 95% interval ({unit}); verdict: A faster, B faster, or "
              "not distinguishable at this noise; failed cells name their status.", a=a, b=b,
              unit=iv.describe())
        rep.tables.append((title, [{"model": model} | r for r in layout]))
        rep.layout += rep.tables[-1][1]
        para("Host layers (the layers whose routed experts each engine kept in host memory, as it reported them): "
             "{text}.", text=host_layers_text(mcells, a, b, depths))
        fair = fairness_rows(mcells, meas, a, b, depths)
        if fair:
            table(fair, "Fairness: settings that differed between {a} and {b} at the same depth", a=a, b=b)
        else:
            para("Fairness: no compared setting differed between {a} and {b} ({s}, workloads, decode context "
                 "depth, effective settings).", a=a, b=b, s=", ".join(SETTINGS))
        rep.tables.append((f"{model}: fairness ({a} vs {b})", fair or [{"note": "no compared setting differed"}]))
        paths = kernel_path_rows(mcells)
        if paths:
            table(paths, "Fairness: llama.cpp's expert kernels change with the depth. --n-cpu-moe kept these experts "
                  "in the plain CPU buffer, which its extra buffer type (CPU_REPACK) takes at depth 0: repacked "
                  "kernels there, generic ones at these depths.")
            rep.tables.append((f"{model}: llama.cpp kernel path by depth", paths))
        table(published.display(_summary_rows(ms)), "All cells (tok/s over the repetitions)")
        rounds = rounds_rows(mcells, meas)
        if rounds:
            speed = results.round_speed(meas[meas["cell_id"].isin(mcells["cell_id"])])
            table(published.display(rounds), "Rounds: each round ran every cell once, in a fresh process; the "
                  "spread between rounds is processes and time, within a round one process. Machine speed by round "
                  "(a cell's round mean / its mean, median over cells): {speed}.",
                  speed=", ".join(f"round {k}: {v:.2f}" for k, v in speed.items()))
            rep.tables.append((f"{model}: rounds", rounds))
        stem = f"m{i}_"
        figs = [*plots.throughput(ms, out_dir, stem), *plots.speedup(ms, b, iv, out_dir, stem),
                *plots.memory(ms, out_dir, stem)]
        for e, g in mcells[mcells["status"] == "ok"].groupby("engine"):
            c = g.sort_values("n_cpu_moe").iloc[-1]          # the most offloaded cell shows the most traffic
            figs += plots.timeline(samples, c["cell_id"], f"{e} n_cpu_moe={c['n_cpu_moe']}: memory timeline",
                                   out_dir, f"{stem}timeline_{plots.slug(e)}")
        for f in figs:
            rep.blocks.append(("img", f, P("{name}", {"name": f.stem})))
        if against:
            _against(rep, runs, mcells, ms, meas, a, b, against, revision)
    (out_dir / "report.md").write_text(to_markdown(rep))
    (out_dir / "report.html").write_text(to_html(rep))
    return rep


def _against(rep: Report, runs, mcells, ms, meas, a, b, model: str, revision: str) -> None:
    from harness.analysis import published

    df = published.select(published.load(), model=model, revision=revision)
    model = df["model"].iloc[0]                       # the published spelling
    first = mcells.iloc[0]
    rows = published.against_rows(df, a, b, getter(mcells, ms, "tps_max"), int(first["n_layers"]),
                                  [w for w in dict.fromkeys(meas["workload"]) if isinstance(w, str)],
                                  Intervals(mcells, meas, runs))
    hw = published.hardware_rows(df, runs[-1].get("host", {}),
                                 {"name": first["model_name"], "n_moe_layers": first["n_moe_layers"]})
    rep.blocks.append(("h", 2, P("Against published: {m} ({r})", {"m": model, "r": df["doc_revision"].iloc[0]})))
    rep.blocks.append(("table", P("Hardware and model: published vs this run"), hw))
    rep.blocks.append(("p", P("{a} stands for {A}, {b} for {B}. Measured throughput is the best of the repetitions, "
                              "as published; its interval is that of the typical ratio (mean of logs), as in every "
                              "table. Different hardware or model: compare ratios, not absolute numbers.",
                              {"a": a, "b": b, "A": published.A, "B": published.B})))
    rep.blocks.append(("table", P("Measured vs published"), published.display(rows)))
    rep.tables += [(f"hardware: published vs this run ({model})", hw), (f"measured vs published: {model}", rows)]


def to_markdown(rep: Report) -> str:
    from harness.analysis.tables import markdown
    out = []
    for blk in rep.blocks:
        if blk[0] == "h":
            out.append("#" * blk[1] + " " + blk[2].md())
        elif blk[0] == "p":
            out.append(blk[1].md())
        elif blk[0] == "table":
            out.append(f"**{blk[1].md()}**\n\n" + markdown(blk[2]).rstrip())
        else:
            out.append(f"![{blk[2].md()}]({blk[1].name})")
    return "\n\n".join(out) + "\n"


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:right}.nw{white-space:nowrap}th{background:#f2f2f2}.scroll{overflow-x:auto}figure{margin:1em 0}
img{max-width:100%}figcaption{font-size:12px;color:#666}"""


RATIO_TEXT = re.compile(r"(\d[\d.,e+-]*x \([^()<]*\))")     # RatioInterval.text() in a table cell


def to_html(rep: Report) -> str:
    """One self-contained page: inline CSS, PNGs as data URIs, no scripts."""
    import pandas as pd
    out = []
    for blk in rep.blocks:
        if blk[0] == "h":
            out.append(f"<h{blk[1]}>{blk[2].html()}</h{blk[1]}>")
        elif blk[0] == "p":
            out.append(f"<p>{blk[1].html()}</p>")
        elif blk[0] == "table":
            body = pd.DataFrame(blk[2]).to_html(index=False, escape=True, border=0,
                                                na_rep="") if blk[2] else "<p>none</p>"
            body = RATIO_TEXT.sub(r'<span class="nw">\1</span>', body)     # "1.12x (0.93–1.31)" on one line
            out.append(f"<h4>{blk[1].html()}</h4><div class=\"scroll\">{body}</div>")
        else:
            data = base64.b64encode(blk[1].read_bytes()).decode()
            out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{blk[2].html()}">'
                       f"<figcaption>{blk[2].html()}</figcaption></figure>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moebench report</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")
