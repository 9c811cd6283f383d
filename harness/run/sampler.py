"""Memory sampler: a thread in the parent that watches a child's process tree.

Every `interval_ms`: RSS with its RssAnon/RssFile split, read straight from /proc/<pid>/status and
summed over the tree; every `tree_every`-th sample a fresh list of the tree's processes (~1 ms);
every `pss_every`-th sample PSS from smaps_rollup (it walks the page tables: ~13 ms for a 1.4 GB
process). Cheap sampling matters: with psutil's children() and memory_full_info() on every
sample (~3 ms), sampling at 50 ms slowed a 2-thread llama.cpp prefill by ~2.5 % on 2 cores. With NVML: the tree's
per-process GPU memory
and the device's used memory minus a baseline taken before the child started. Without an NVIDIA
GPU the VRAM columns are NaN, not zero. The runner sets `phase` as the worker reports phases.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psutil

from engines.devices import Nvml
from harness.units import MiB as MIB

NAN = float("nan")


def proc_kib(pid: int, path: str, keys: tuple[str, ...]) -> dict[str, int] | None:
    """`Key:  N kB` lines of /proc/<pid>/<path> in KiB; None if the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/{path}") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    out[key] = int(line.split()[1])
    except (OSError, ValueError):
        return None
    return out


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval_ms: float = 50, pss_every: int = 40, tree_every: int = 10,
                 nvml: Nvml | None = None):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval_ms / 1000
        self.pss_every, self.tree_every = pss_every, tree_every
        self.nvml = nvml or Nvml()
        self.phase = "start"
        self.samples: list[dict] = []
        self.pids: list[int] = [pid]
        self._stop_event = threading.Event()
        self._t0 = time.perf_counter()

    def _refresh_tree(self) -> None:
        try:
            self.pids = [self.root.pid, *(c.pid for c in self.root.children(recursive=True))]
        except psutil.Error:
            self.pids = []

    def sample(self) -> dict | None:
        if len(self.samples) % self.tree_every == 0:
            self._refresh_tree()
        want_pss = len(self.samples) % self.pss_every == 0
        rss = anon = file_ = 0
        pss = 0 if want_pss else NAN
        alive = []
        for pid in self.pids:
            st = proc_kib(pid, "status", ("VmRSS", "RssAnon", "RssFile"))
            if not st or "VmRSS" not in st:      # gone, or a zombie (exited, not yet reaped: no Vm* lines)
                continue
            alive.append(pid)
            rss, anon, file_ = rss + st["VmRSS"], anon + st.get("RssAnon", 0), file_ + st.get("RssFile", 0)
            if want_pss:
                pss += (proc_kib(pid, "smaps_rollup", ("Pss",)) or {}).get("Pss", 0)
        if not alive:
            return None
        vp = vd = NAN
        if self.nvml.ok:
            vp = self.nvml.proc_used(set(alive)) / MIB
            vd = (self.nvml.device_used() - self.nvml.baseline) / MIB
        s = {"t_ms": (time.perf_counter() - self._t0) * 1000, "phase": self.phase, "rss_mib": rss / 1024,
             "rss_anon_mib": anon / 1024, "rss_file_mib": file_ / 1024, "pss_mib": pss / 1024,
             "vram_proc_mib": vp, "vram_device_mib": vd}
        self.samples.append(s)
        return s

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> list[dict]:
        self._stop_event.set()
        if self.is_alive():
            self.join()
        return self.samples


@dataclass(frozen=True)
class Peaks:
    """Peak memory (MiB) over a cell or one phase; NaN where not measured. rss_anon_mib and rss_file_mib are the
    peaks of their own series, which may fall at different times (llama.cpp maps the file, then copies weights into
    anonymous buffers), so they need not add up to rss_mib. Anonymous pages are the RAM an engine needs; file-backed
    ones are the mapped model's page cache: reclaimable, but what keeps an mmap'd model fast."""
    rss_mib: float = NAN
    rss_anon_mib: float = NAN
    rss_file_mib: float = NAN
    vram_mib: float = NAN

    def columns(self) -> dict[str, float]:
        """As cells.csv and measurements.csv name them."""
        return {"peak_rss_mib": self.rss_mib, "peak_rss_anon_mib": self.rss_anon_mib,
                "peak_rss_file_mib": self.rss_file_mib, "peak_vram_mib": self.vram_mib}


def peaks(samples: list[dict], phase: str | None = None) -> Peaks:
    """The peaks over the samples of one phase (all if None); NaN when none. VRAM prefers the per-process figure
    and falls back to the device delta; NaN without a GPU."""
    sel = [s for s in samples if phase is None or s["phase"] == phase]
    top = lambda key: max((s[key] for s in sel), default=NAN)
    vram = [s["vram_proc_mib"] if s["vram_proc_mib"] == s["vram_proc_mib"] and s["vram_proc_mib"] > 0
            else s["vram_device_mib"] for s in sel]
    vram = [v for v in vram if v == v]
    return Peaks(top("rss_mib"), top("rss_anon_mib"), top("rss_file_mib"), max(vram, default=NAN))
