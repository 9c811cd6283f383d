"""NVIDIA GPUs through NVML (nvidia-ml-py), in one place: the host fingerprint, the memory sampler,
`recommend`'s free-VRAM default and the engines that pick a CUDA backend all ask here. Without a
driver or a GPU every function answers "none" instead of raising."""
from __future__ import annotations

import functools


@functools.cache
def _nvml():
    """The initialized pynvml module, or None (no package, no driver, no GPU)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() else None
    except Exception:        # NVMLError_LibraryNotFound, DriverNotLoaded, ...: all mean "no NVIDIA GPU here"
        return None


def gpus() -> list[dict]:
    """Each GPU: index, name, uuid, vram_mib, driver, pcie ("gen5 x16" or ""); [] without one."""
    nv = _nvml()
    if nv is None:
        return []
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        d = {"index": i, "name": nv.nvmlDeviceGetName(h), "uuid": nv.nvmlDeviceGetUUID(h),
             "vram_mib": nv.nvmlDeviceGetMemoryInfo(h).total / 2**20, "driver": nv.nvmlSystemGetDriverVersion()}
        try:
            d["pcie"] = f"gen{nv.nvmlDeviceGetCurrPcieLinkGeneration(h)} x{nv.nvmlDeviceGetCurrPcieLinkWidth(h)}"
        except Exception:    # not reported on some boards (e.g. SXM)
            d["pcie"] = ""
        out.append(d)
    return out


def free_vram(index: int = 0) -> int | None:
    """Free bytes on GPU `index`, or None without a GPU."""
    nv = _nvml()
    if nv is None:
        return None
    return int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).free)


class Nvml:
    """Device handles and a device-memory baseline for sampling; `ok` is False without a GPU."""

    def __init__(self) -> None:
        self.nv = _nvml()
        self.handles = [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(self.nv.nvmlDeviceGetCount())] \
            if self.nv else []
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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (avx2, avx512_bf16, ...); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return frozenset()
    return frozenset(w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split())


# CPU kernel variants (engines.reference.kernels) -> the /proc/cpuinfo flags each needs, widest first
AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
CPU_ISAS: dict[str, tuple[str, ...]] = {
    "amx": (*AVX512, "amx_tile", "amx_int8", "amx_bf16"),
    "avx512": AVX512,
    "avx2": ("avx2", "fma", "f16c"),
}


def widest_isa(flags: frozenset[str] | None = None) -> str:
    """The widest CPU kernel variant whose flags `flags` (default: this CPU's) has; "" for none."""
    have = cpu_flags() if flags is None else flags
    return next((isa for isa, need in CPU_ISAS.items() if set(need) <= have), "")


def cpu_isa(flags: frozenset[str] | None = None) -> str:
    """The CPU kernel variant for this process: MOEBENCH_ISA=avx2|avx512|amx as asked, or (auto, the default)
    the widest one the CPU runs. Raises ValueError saying what is missing."""
    import os

    have = cpu_flags() if flags is None else flags
    missing = {isa: [f for f in need if f not in have] for isa, need in CPU_ISAS.items()}
    want = os.environ.get("MOEBENCH_ISA", "auto").strip().lower() or "auto"
    if want != "auto":
        if want not in CPU_ISAS:
            raise ValueError(f"MOEBENCH_ISA={want} is not a kernel variant; use auto, {', '.join(CPU_ISAS)}")
        if missing[want]:
            raise ValueError(f"MOEBENCH_ISA={want}, but the CPU lacks {', '.join(missing[want])}")
        return want
    if isa := widest_isa(have):
        return isa
    raise ValueError(f"the CPU kernels need at least AVX2, FMA and F16C; the CPU lacks {', '.join(missing['avx2'])}")
