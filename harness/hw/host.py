"""Host fingerprint stored with every run (pyperf-style metadata): CPU, its caches, RAM, GPU, OS, versions."""
from __future__ import annotations

import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import psutil

from engines.devices import gpus

PACKAGES = ("moebench", "torch", "llama_cpp_python", "gguf", "numpy", "pandas", "psutil", "nvidia-ml-py")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_mib(root: Path = Path("/sys/devices/system/cpu")) -> float | None:
    """All data and unified CPU caches of the host in MiB, every level and instance counted once (sysfs; an
    instance shared by several CPUs lists them all): the most bytes that can stay cached between two tokens.
    None where sysfs does not say."""
    seen: dict[tuple[str, str], int] = {}
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for d in root.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            size = (d / "size").read_text().strip()
            key = ((d / "level").read_text().strip(), (d / "shared_cpu_list").read_text().strip())
        except OSError:
            continue
        seen[key] = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
    return sum(seen.values()) / 2**20 if seen else None


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def fingerprint() -> dict:
    g = gpus()
    return {"hostname": socket.gethostname(), "cpu": cpu_name(), "cores_logical": psutil.cpu_count(),
            "cores_physical": psutil.cpu_count(logical=False), "ram_mib": psutil.virtual_memory().total / 2**20,
            "cache_mib": cache_mib(), "os": platform.platform(), "gpus": g, "gpu_name": g[0]["name"] if g else "",
            "versions": versions(), "git_commit": git_commit()}
