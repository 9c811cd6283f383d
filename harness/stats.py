"""pyperf-style summaries of raw repetitions: the one definition every table, report and profile uses."""
from __future__ import annotations

import numpy as np

CV_WARN = 0.05      # a cell whose repetitions vary more than this is called unstable


def stats(values) -> dict:
    """pyperf-style summary of raw repetitions."""
    a = np.asarray(list(values), dtype=float)
    n = len(a)
    mean = float(a.mean()) if n else float("nan")
    std = float(a.std(ddof=1)) if n > 1 else float("nan")
    return {"n": n, "median": float(np.median(a)) if n else float("nan"), "mean": mean, "std": std,
            "cv": std / mean if n > 1 and mean else float("nan"),
            "min": float(a.min()) if n else float("nan"), "max": float(a.max()) if n else float("nan")}
