"""The expert-cache planner's page (`moebench cache --report DIR`): cache.md, a self-contained cache.html and PNGs:
hit rate vs cache MiB per policy with both bounds, link and CPU bytes per token vs cache MiB, expert popularity per
layer (heat map), the reuse-distance histogram, and the time model's predicted vs measured seconds per token.
Built from harness.planning.cache_planner studies; the page machinery (paragraphs, escaping, HTML) is
harness.analysis.report's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.analysis.plots import _plt, _save, slug
from harness.analysis.report import P, Report, to_html, to_markdown
from harness.planning import cache_planner as plan_cache
from harness.planning.trace_stats import reuse_labels

COLORS = {"none": "tab:gray", "static": "tab:green", "lru": "tab:blue", "lfu": "tab:purple", "classlru": "tab:orange"}
BOUND_STYLE = {"belady": dict(color="black", ls="--"), "static-oracle": dict(color="tab:green", ls=":")}


def _phases(st) -> list[str]:
    return [p for p in ("decode", "prefill") if p in st.stats]


def _series(st, policy: str, phase: str, key: str) -> tuple[list[float], list[float]]:
    pts = sorted((r.budget_mib, r.summary(phase)[key]) for r in st.results if r.policy == policy)
    return [b for b, _ in pts], [v for _, v in pts]


def _xscale(ax, budgets) -> None:
    pos = [b for b in budgets if b > 0]
    if pos and max(pos) / min(pos) >= 8:
        ax.set_xscale("symlog", linthresh=min(pos))


def hit_rate_plot(st, out: Path) -> Path:
    plt = _plt()
    phases = _phases(st)
    fig, axes = plt.subplots(1, len(phases), figsize=(6.2 * len(phases), 4.2), squeeze=False)
    policies = sorted({r.policy for r in st.results} - set(plan_cache.BOUNDS), key=list(COLORS).index)
    for ax, ph in zip(axes[0], phases):
        for p in policies:
            x, y = _series(st, p, ph, "hit_rate")
            ax.plot(x, [100 * v for v in y], marker="o", ms=4, color=COLORS.get(p), label=p)
        for b, style in BOUND_STYLE.items():
            x, y = _series(st, b, ph, "hit_rate")
            ax.plot(x, [100 * v for v in y], lw=1.6, label=f"{b} (bound)", **style)
        _xscale(ax, st.budgets)
        ax.set(xlabel="cache size (MiB)", ylabel="hit rate (% of requested experts)", ylim=(-2, 102),
               title=f"{ph}: hit rate vs cache size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(_title(st), fontsize=9)
    return _save(fig, out / f"cache_hits_{slug(st.label)}.png")


def bytes_plot(st, out: Path) -> Path:
    plt = _plt()
    phases = _phases(st)
    fig, axes = plt.subplots(len(phases), 2, figsize=(12, 3.8 * len(phases)), squeeze=False)
    policies = sorted({r.policy for r in st.results} - set(plan_cache.BOUNDS), key=list(COLORS).index)
    for row, ph in zip(axes, phases):
        for ax, key, what in ((row[0], "link_bytes_per_token", "uploaded over the link"),
                              (row[1], "cpu_bytes_per_token", "read by the CPU from RAM")):
            for p in policies:
                x, y = _series(st, p, ph, key)
                ax.plot(x, [v / 1e6 for v in y], marker="o", ms=4, color=COLORS.get(p), label=p)
            _xscale(ax, st.budgets)
            ax.set(xlabel="cache size (MiB)", ylabel="MB per token", title=f"{ph}: expert bytes {what}")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(_title(st), fontsize=9)
    return _save(fig, out / f"cache_bytes_{slug(st.label)}.png")


def popularity_plot(st, out: Path) -> Path:
    """Share of each layer's token selections per expert id; rows = host MoE layers."""
    from matplotlib.colors import LogNorm
    plt = _plt()
    pop = st.stats["all"].popularity.astype(float)
    share = pop / np.maximum(pop.sum(axis=1, keepdims=True), 1)
    L, E = share.shape
    fig, ax = plt.subplots(figsize=(min(14, 3 + E / 10), 1.6 + 0.28 * L))
    floor = max(1e-5, share[share > 0].min() if (share > 0).any() else 1e-5)
    im = ax.imshow(np.maximum(share, floor), aspect="auto", interpolation="nearest", cmap="viridis",
                   norm=LogNorm(vmin=floor, vmax=max(share.max(), floor * 10)))
    ax.set(xlabel="expert id", ylabel="MoE layer", title=f"expert popularity (share of token selections; uniform = "
                                                         f"{1 / E:.3g})")
    step = max(1, L // 12)
    ax.set_yticks(range(0, L, step), [str(st.header["moe_layers"][i]) for i in range(0, L, step)])
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    fig.suptitle(_title(st), fontsize=9)
    return _save(fig, out / f"cache_popularity_{slug(st.label)}.png")


def reuse_plot(st, out: Path) -> Path:
    plt = _plt()
    labels = reuse_labels()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    phases = list(st.stats)
    w = 0.8 / len(phases)
    for i, ph in enumerate(phases):
        ax.bar(np.arange(len(labels)) + i * w, [100 * st.stats[ph].reuse[lab] for lab in labels], w, label=ph)
    ax.set_xticks(np.arange(len(labels)) + w * (len(phases) - 1) / 2, labels, rotation=30)
    ax.set(xlabel="tokens since the layer last used the expert", ylabel="% of token selections",
           title="reuse distance")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.suptitle(_title(st), fontsize=9)
    return _save(fig, out / f"cache_reuse_{slug(st.label)}.png")


def model_plot(fits: dict, out: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(fits), figsize=(5 * len(fits), 4.2), squeeze=False)
    for ax, (ph, f) in zip(axes[0], fits.items()):
        for pts, label, m in ((f.fitted, "fitted", "o"), (f.held_out, "held out", "s")):
            ms = [1e3 * p.seconds_per_token for p in pts]
            ax.scatter(ms, [1e3 * f.predict(p.features) for p in pts], marker=m, label=label)
        allv = [1e3 * p.seconds_per_token for p in f.fitted + f.held_out]
        lo, hi = min(allv) * 0.95, max(allv) * 1.05
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set(xlabel="measured ms/token (median)", ylabel="predicted ms/token", title=f"time model: {ph}",
               xlim=(lo, hi), ylim=(lo, hi))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "cache_time_model.png")


def _title(st) -> str:
    h = st.header
    return (f"{st.label}: {h['model']}, {len(st.host)} host MoE layers of {len(h['moe_layers'])}, {h['n_expert']} "
            f"experts, top-{h['k']}, stream {'+'.join(sorted(set(st.streams)))}")[:160]


def write_cache_report(studies: list, out_dir: Path, fits: dict | None = None, points: list | None = None) -> Path:
    """cache.md, cache.html and the PNGs of the studies into out_dir; returns cache.html's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = Report(out_dir)
    H = lambda level, t, **f: rep.blocks.append(("h", level, P(t, f)))
    Pg = lambda t, **f: rep.blocks.append(("p", P(t, f)))
    T = lambda t, rows, **f: rep.blocks.append(("table", P(t, f), rows))
    img = lambda path, t, **f: rep.blocks.append(("img", path, P(t, f)))
    H(1, "Expert-cache planner")
    Pg("Each routing trace is replayed through device expert caches at each size. A request is one forward pass x "
       "one host MoE layer: the distinct experts its tokens route to. Hits run from the cache; misses are uploaded "
       "over the link (admitted into the cache, or into a transient buffer for ubatches of >= {big} tokens) or "
       "computed by the CPU from host RAM (no cache, pinned sets, the upload cap, the CPU share). Bounds: Belady "
       "(optimal replacement, each half of the trace from its best contents) and the best static set in "
       "hindsight; static-by-frequency is learned on one half of the trace and scored on the other.",
       big=plan_cache.cs.BIG_BATCH)
    for st in studies:
        H(2, "{label}", label=st.label)
        h = st.header
        Pg("Model {model} ({arch}), {n_exp} experts, top-{k}, host layers {host}, segments {segs} (streams "
           "{streams}), recorded at n_cpu_moe {ncm}, n_ubatch {ub}.", model=h["model"], arch=h["arch"],
           n_exp=h["n_expert"], k=h["k"], host=", ".join(str(h["moe_layers"][i]) for i in st.host) or "none",
           segs=", ".join(h["segments"]), streams=", ".join(st.streams), ncm=h["n_cpu_moe"], ub=h["n_ubatch"])
        T("Hit rate and bytes per token", plan_cache.rows(st))
        T("Trace statistics", plan_cache.stats_rows(st))
        T("Reuse distance (% of token selections)", plan_cache.reuse_rows(st))
        img(hit_rate_plot(st, out_dir), "hit rate vs cache size, {label}", label=st.label)
        img(bytes_plot(st, out_dir), "bytes per token vs cache size, {label}", label=st.label)
        img(popularity_plot(st, out_dir), "expert popularity per layer, {label}", label=st.label)
        img(reuse_plot(st, out_dir), "reuse distance, {label}", label=st.label)
    if fits:
        H(2, "Time model")
        Pg("Seconds per token = base + c_cpu x expert bytes the CPU reads + c_link x bytes uploaded + c_sync x host "
           "layers synchronized, per phase, fitted (non-negative least squares) on every other measured cell and "
           "checked on the rest. Features come from each cell's own trace at its depth.")
        for f in fits.values():
            Pg("{d}", d=f.describe())
        T("Measured points", [{"phase": p.phase, "cell": p.cell_id, "workload": p.workload, "n_cpu_moe": p.n_cpu_moe,
                               "ms/token": 1e3 * p.seconds_per_token,
                               "predicted": 1e3 * fits[p.phase].predict(p.features) if p.phase in fits else None,
                               "held out": any(p is q for q in fits[p.phase].held_out) if p.phase in fits else None,
                               "CPU MB/token": p.features["cpu_bytes"] / 1e6,
                               "link MB/token": p.features["link_bytes"] / 1e6, "syncs/token": p.features["syncs"]}
                              for p in points or []])
        img(model_plot(fits, out_dir), "time model: predicted vs measured")
    (out_dir / "cache.md").write_text(to_markdown(rep))
    page = out_dir / "cache.html"
    page.write_text(to_html(rep))
    return page
