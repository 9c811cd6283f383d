"""PNG plots of a report (matplotlib, Agg): throughput vs depth, speedup over a baseline, peak memory,
and the memory timeline of one cell with its phases shaded; and `history`'s trend plot. Every report
function returns the files it wrote.

Inputs are the frames of harness.store.results: `summary` (results.summarize: one row per cell x workload)
and `samples` (samples.csv). Failed cells are marked on the plots, never dropped silently.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

NO_GPU = "no GPU: VRAM not measured"


def _plt():
    import matplotlib
    matplotlib.use("Agg")           # no display; safe in CI and worker-less report runs
    import matplotlib.pyplot as plt
    return plt


def slug(text: str) -> str:
    """A file-name-safe version of untrusted text (model names come from GGUF metadata)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(text)).strip("-.")[:60] or "x"


def _depth_ticks(ax, depths) -> None:
    """Depths are layer counts: tick exactly the depths that were run."""
    ax.set_xticks(sorted({int(d) for d in depths}))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _mark_failed(ax, failed: list[tuple[int, str]]) -> None:
    """A red x at the bottom of the axes for each failed cell (depth, label)."""
    for x, label in failed:
        ax.annotate(f"x {label}", (x, 0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                    textcoords="offset points", color="tab:red", fontsize=7, rotation=90, va="bottom", ha="center")


def _dodge(i: int, n: int, depths) -> float:
    """x offset of series i of n: bars at one depth side by side, not on top of each other."""
    span = max(float(depths.max() - depths.min()), 1.0)
    return (i - (n - 1) / 2) * 0.03 * span


def throughput(summary, out: Path, stem: str) -> list[Path]:
    """One PNG per workload: median tok/s vs n_cpu_moe, one line per engine, min-max bars over repetitions."""
    plt = _plt()
    paths = []
    for wl in [w for w in summary["workload"].unique() if isinstance(w, str) and w]:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        groups = list(summary.groupby("engine", sort=True))
        for i, (engine, g) in enumerate(groups):
            ok = g[(g["workload"] == wl) & (g["status"] == "ok")].sort_values("n_cpu_moe")
            if not ok.empty:
                err = [ok["tps_median"] - ok["tps_min"], ok["tps_max"] - ok["tps_median"]]
                ax.errorbar(ok["n_cpu_moe"] + _dodge(i, len(groups), summary["n_cpu_moe"]), ok["tps_median"],
                            yerr=err, marker="o", capsize=3, label=f"{engine} (n={int(ok['tps_n'].max())})")
            bad = g[g["status"] != "ok"].drop_duplicates("n_cpu_moe")
            _mark_failed(ax, [(int(r.n_cpu_moe), f"{engine} {r.status}") for r in bad.itertuples()])
        vals = summary.loc[summary["workload"] == wl, "tps_median"].dropna()
        if len(vals) and vals.min() > 0 and vals.max() / vals.min() > 20:
            ax.set_yscale("log")       # offloaded cells can be 100x slower than resident ones
        _depth_ticks(ax, summary["n_cpu_moe"])
        ax.set(xlabel="n_cpu_moe (layers with experts in RAM)", ylabel="tokens/s (median, bars: min-max)",
               title=f"{wl}: throughput vs offload depth")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / f"{stem}throughput_{slug(wl)}.png"))
    return paths


RATIO_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100)


def speedup(summary, baseline: str, interval, out: Path, stem: str) -> list[Path]:
    """Median tok/s of each other engine over the baseline's, per workload, vs n_cpu_moe, with its 95 % interval
    as error bars (interval(a, b, depth, workload): harness.analysis.report.Intervals)."""
    import numpy as np

    plt = _plt()
    ok = summary[summary["status"] == "ok"]
    others = [e for e in sorted(ok["engine"].unique()) if e != baseline]
    if not (ok["engine"] == baseline).any() or not others:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    seen: list[float] = []
    series = [(e, wl, g) for e in others for wl, g in ok[ok["engine"] == e].groupby("workload", sort=False)]
    for i, (engine, wl, g) in enumerate(series):
        depths = sorted(g["n_cpu_moe"])
        ivs = [interval(engine, baseline, d, wl) for d in depths]
        ratio = np.array([iv.ratio if iv else math.nan for iv in ivs])
        err = np.array([[max(r - iv.low, 0), max(iv.high - r, 0)] if iv and iv.low == iv.low else [0.0, 0.0]
                        for r, iv in zip(ratio, ivs)]).T.reshape(2, -1)      # the median can sit off-centre
        ax.errorbar(np.array(depths, dtype=float) + _dodge(i, len(series), ok["n_cpu_moe"]), ratio, yerr=err,
                    marker="o", capsize=3, label=f"{engine} {wl}")
        seen += [r for r in ratio if r > 0]
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    if seen:        # ratios live on a log axis; the view follows the ratios, and a wider interval runs off it
        from matplotlib.ticker import NullLocator

        lo, hi = min(seen + [1.0]) / 1.5, max(seen + [1.0]) * 1.5
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ticks = [t for t in RATIO_TICKS if lo <= t <= hi]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.yaxis.set_minor_locator(NullLocator())
    _depth_ticks(ax, summary["n_cpu_moe"])
    ax.set(xlabel="n_cpu_moe", ylabel=f"speedup over {baseline} (median tok/s ratio)",
           title=f"Speedup over {baseline} vs offload depth (bars: 95% interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, out / f"{stem}speedup.png")]


def memory(summary, out: Path, stem: str) -> list[Path]:
    """Peak VRAM and peak RAM per cell vs n_cpu_moe, one line per engine: RAM as the anonymous peak (the RAM an
    engine needs, solid, dots) and the file-backed peak (the mapped model's page cache, dashed, crosses)."""
    plt = _plt()
    cells = summary.drop_duplicates(["engine", "n_cpu_moe"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, cols, name in [(axes[0], {"peak_vram_mib": ""}, "peak VRAM MiB"),
                           (axes[1], {"peak_rss_anon_mib": " anon", "peak_rss_file_mib": " file-backed"},
                            "peak RAM MiB")]:
        if cells[list(cols)].isna().all().all():
            ax.text(0.5, 0.5, NO_GPU if "peak_vram_mib" in cols else "not measured", ha="center", va="center",
                    transform=ax.transAxes, fontsize=11, color="gray")
        for i, (engine, g) in enumerate(cells.groupby("engine", sort=True)):
            for col, what in cols.items():
                h = g.sort_values("n_cpu_moe").dropna(subset=[col])
                if not h.empty:
                    file_ = col == "peak_rss_file_mib"
                    ax.plot(h["n_cpu_moe"], h[col], marker="x" if file_ else "o", color=f"C{i}", label=engine + what,
                            linestyle="--" if file_ else "-")
        _depth_ticks(ax, summary["n_cpu_moe"])
        ax.set(xlabel="n_cpu_moe", ylabel=name, title=f"{name} per cell")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return [_save(fig, out / f"{stem}memory.png")]


def _phase_kind(phase: str) -> str:
    return "load" if phase == "load" else "warm-up" if phase.startswith("warmup") else \
        "other" if phase in ("start", "close", "phase", "") else "workload"


COLORS = {"load": "tab:orange", "warm-up": "tab:olive", "workload": "tab:green", "other": "lightgray"}


def timeline(samples, cell_id: str, title: str, out: Path, name: str) -> list[Path]:
    """RSS (and VRAM when measured) over time of one cell, each phase (load, warm-up, workloads) shaded."""
    plt = _plt()
    s = samples[samples["cell_id"] == cell_id].sort_values("t_ms")
    if s.empty:
        return []
    t = s["t_ms"] / 1000
    fig, ax = plt.subplots(figsize=(10, 3.8))
    ax.plot(t, s["rss_mib"], color="tab:blue", label="RSS MiB")
    for col, color, label in (("rss_anon_mib", "tab:red", "anonymous"), ("rss_file_mib", "tab:cyan", "file-backed")):
        if col in s and s[col].notna().any():
            ax.plot(t, s[col], color=color, lw=1, label=f"{label} MiB")
    if s["vram_proc_mib"].notna().any():
        ax.plot(t, s["vram_proc_mib"], color="tab:purple", label="VRAM (process) MiB")
    else:
        ax.text(0.99, 0.02, NO_GPU, transform=ax.transAxes, ha="right", fontsize=8, color="gray")
    phase = s["phase"].fillna("").astype(str).tolist()
    times = t.tolist()
    start = 0
    for i in range(1, len(phase) + 1):      # contiguous runs of one phase -> one shaded span
        if i == len(phase) or phase[i] != phase[start]:
            end = times[i] if i < len(phase) else times[-1]
            kind = _phase_kind(phase[start])
            ax.axvspan(times[start], end, color=COLORS[kind], alpha=0.18, lw=0)
            if kind != "other":
                ax.text((times[start] + end) / 2, 0.97, phase[start], transform=ax.get_xaxis_transform(),
                        ha="center", va="top", fontsize=7, rotation=90)
            start = i
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in COLORS.values()]
    ax.legend(ax.get_legend_handles_labels()[0] + handles,
              ax.get_legend_handles_labels()[1] + [f"phase: {k}" for k in COLORS], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1))
    ax.set(xlabel="seconds since the cell's process started", ylabel="MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return [_save(fig, out / f"{name}.png")]


def history_plot(table: list[dict], out: Path) -> None:
    """The `history` trend: median tok/s (± std) of each cell x settings per run."""
    plt = _plt()
    runs = list(dict.fromkeys(r["run"] for r in table))
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for r in table:
        label = f"{r['engine']} {r['model']} ncmoe={r['n_cpu_moe']} {r['workload']} {r['settings']}"
        lines.setdefault(label, []).append((runs.index(r["run"]), r["tok/s median"], r["± std"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(runs) + 3), 4.5))
    for label, pts in lines.items():
        x, y, e = zip(*pts)
        ax.errorbar(x, y, yerr=[0 if v != v else v for v in e], marker="o", capsize=3, label=label)
    ax.set_xticks(range(len(runs)), [r[:16] for r in runs], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (median ± std)")
    values = [r["tok/s median"] for r in table if r["tok/s median"]]
    if values and max(values) > 20 * min(values):     # engines and depths can be orders of magnitude apart
        ax.set_yscale("log")
    ax.set_title("moebench history")
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
