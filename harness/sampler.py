"""Memory sampler: a thread in the parent that watches a child's process tree.

Every `interval_ms`: RSS (with its RssAnon/RssFile split from /proc) summed over the tree; every
`pss_every`-th sample PSS (smaps_rollup is costly). With NVML: the tree's per-process GPU memory
and the device's used memory minus a baseline taken before the child started. Without an NVIDIA
GPU the VRAM columns are NaN, not zero. The runner sets `phase` as the worker reports phases.
"""
from __future__ import annotations

import math
import threading
import time

import psutil

MIB = 2**20
NAN = float("nan")


class Nvml:
    """NVML handles and a device-memory baseline; `ok` is False without a driver or GPU."""

    def __init__(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            self.nv, self.handles = None, []
        self.ok = bool(self.handles)
        self.baseline = self.device_used() if self.ok else 0

    def device_used(self) -> int:
        return sum(self.nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)

    def proc_used(self, pids: set[int]) -> int:
        total = 0
        for h in self.handles:
            for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in pids and p.usedGpuMemory:
                    total += p.usedGpuMemory
        return total


def _status_kib(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) in KiB from /proc/<pid>/status; (0, 0) if the process is gone."""
    anon = file_ = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("RssFile:"):
                    file_ = int(line.split()[1])
    except OSError:
        pass
    return anon, file_


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval_ms: float = 50, pss_every: int = 10, nvml: Nvml | None = None):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval_ms / 1000
        self.pss_every = pss_every
        self.nvml = nvml or Nvml()
        self.phase = "start"
        self.samples: list[dict] = []
        self._stop_event = threading.Event()
        self._t0 = time.perf_counter()

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def sample(self) -> dict | None:
        procs = self._tree()
        if not procs:
            return None
        rss = anon = file_ = 0
        pss = NAN
        want_pss = len(self.samples) % self.pss_every == 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                if want_pss:
                    pss = (0 if math.isnan(pss) else pss) + p.memory_full_info().pss
            except psutil.Error:
                continue
            a, f = _status_kib(p.pid)
            anon, file_ = anon + a * 1024, file_ + f * 1024
        vp = vd = NAN
        if self.nvml.ok:
            vp = self.nvml.proc_used({p.pid for p in procs}) / MIB
            vd = (self.nvml.device_used() - self.nvml.baseline) / MIB
        s = {"t_ms": (time.perf_counter() - self._t0) * 1000, "phase": self.phase, "rss_mib": rss / MIB,
             "rss_anon_mib": anon / MIB, "rss_file_mib": file_ / MIB, "pss_mib": pss / MIB,
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


def peaks(samples: list[dict], phase_prefix: str | None = None) -> tuple[float, float]:
    """(peak RSS MiB, peak VRAM MiB) over samples whose phase starts with phase_prefix (all if None).
    VRAM prefers the per-process figure and falls back to the device delta; NaN without a GPU."""
    sel = [s for s in samples if phase_prefix is None or s["phase"].startswith(phase_prefix)]
    rss = max((s["rss_mib"] for s in sel), default=NAN)
    vram = [s["vram_proc_mib"] if s["vram_proc_mib"] == s["vram_proc_mib"] and s["vram_proc_mib"] > 0
            else s["vram_device_mib"] for s in sel]
    vram = [v for v in vram if v == v]
    return rss, max(vram, default=NAN)
