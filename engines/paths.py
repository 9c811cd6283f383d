"""Where moebench keeps what it makes once per machine: synthesized models, kernel builds, llama-bench
builds, hardware profiles. MOEBENCH_CACHE moves it (default ~/.cache/moebench)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("MOEBENCH_CACHE", Path.home() / ".cache" / "moebench"))
