"""What the GPU check brings back: summary.md, steps.json and at most six more files (the device tool returns at
most 8 files of 16 MiB each, named in letters, digits, '.', '_' and '-'), plus the checks that read a run."""
from __future__ import annotations

import ast
import csv
import json
import math
import re
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path

MAX_FILES, MAX_BYTES = 8, 16 << 20
TARBALL = "gpu-check.tar.gz"
# what the device tool returns, with where it comes from in the work folder (None: written here)
FILES = {"summary.md": None, "steps.json": None, TARBALL: None, "pytest-gpu.txt": "logs/pytest-gpu.txt",
         "report.md": "report/report.md", "sweep.md": "sweep.md", "probe.json": "probe.json",
         "build-tail.txt": "logs/build.log"}
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")

# Python packages of the lent machine's image (../.library/device/KINDS.md, 2026-11-17) by import name, as far
# as moebench could import them; what moebench imports and this lacks must travel as a wheel (prepare.WHEELS).
IMAGE_IMPORTS = {"torch", "numpy", "pandas", "matplotlib", "psutil", "pynvml", "click", "rich", "scipy", "pytest",
                 "yaml", "requests", "tqdm", "jinja2", "typing_extensions", "packaging", "setuptools", "filelock",
                 "fsspec", "sympy", "networkx", "triton", "cupy", "jax", "safetensors", "tabulate", "PIL", "pyarrow",
                 "cmake", "ninja", "scikit_build_core", "pybind11", "cython", "xxhash", "msgpack", "markdown"}
CARRIED = {"gguf", "diskcache", "llama_cpp"}         # wheels in .gpu/, and the CUDA build
OPTIONAL = {"ray": "only with --ray; its wheel (75 MiB for cp311 here) exceeds the 64 MiB that travel",
            "ik_llama_cpp": "the optional ik-llama-cpp engine's package (make peers), not part of the GPU check",
            "kt_kernel": "reference@experts=kt's package (make peers), CPU-only and not part of the GPU check"}
PROJECT = {"harness", "engines", "workloads", "tests", "benchmarks"}


def missing_on_image(root: Path | None = None) -> list[str]:
    """Top-level modules that moebench's packages and the GPU tests import (at any depth, read with ast) that are
    neither in the standard library, nor on the GPU image, nor carried, nor optional."""
    root = root or Path(__file__).resolve().parents[2]
    files = [p for pkg in ("harness", "engines", "workloads") for p in (root / pkg).rglob("*.py")]
    files += [root / "tests" / "test_gpu.py", root / "tests" / "conftest.py"]
    names = set()
    for f in files:
        if not f.is_file():
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    known = set(sys.stdlib_module_names) | IMAGE_IMPORTS | CARRIED | set(OPTIONAL) | PROJECT | {"__future__"}
    return sorted(names - known)


def build_progress(log: Path) -> str:
    """'N/M compile steps' from ninja's last '[N/M]' line in the build log."""
    try:
        hits = re.findall(rb"\[(\d+)/(\d+)\]", log.read_bytes()[-2_000_000:])
    except OSError:
        return "no build log"
    return f"{int(hits[-1][0])}/{int(hits[-1][1])} compile steps" if hits else "no compile step reached"


def latest_run(results: Path) -> Path | None:
    runs = sorted(p.parent for p in results.glob("*/run.json")) if results.is_dir() else []
    return runs[-1] if runs else None


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def verify_run(run_dir: Path, gpu: bool) -> list[str]:
    """One line per check of the sweep's cells: 'ok: ...' or 'FAIL: ...'."""
    out = []
    with open(run_dir / "cells.csv") as f:
        cells = list(csv.DictReader(f))
    for c in cells:
        tag = f"{c['engine']} n_cpu_moe={c['n_cpu_moe']}"
        problems = []
        if c["status"] != "ok":
            problems.append(f"status {c['status']}: {c['error'][:200]}")
        frac, want = _num(c["expert_host_fraction"]), _num(c["n_cpu_moe"]) / max(_num(c["n_moe_layers"]), 1)
        if not abs(frac - want) < 1e-6:
            problems.append(f"expert_host_fraction {frac} != {want:.3f}")
        vram = _num(c["peak_vram_mib"])
        by_dev = json.loads(c.get("bytes_by_device") or "{}")
        if gpu:
            if not vram > 0:
                problems.append(f"peak_vram_mib {c['peak_vram_mib']!r}: NVML saw no VRAM")
            if c["engine"] == "llama-cpp" and not any("CUDA" in k for k in by_dev):
                problems.append(f"no CUDA buffer in llama.cpp's log: {sorted(by_dev)}")
            device = json.loads(c["effective_settings"] or "{}").get("device", "")
            if c["engine"] == "reference" and not device.startswith("cuda"):
                problems.append(f"the reference engine ran on {device!r}, not cuda")
        elif not math.isnan(vram):
            problems.append(f"peak_vram_mib {vram} without a GPU (should be empty)")
        out.append(("FAIL: " + tag + ": " + "; ".join(problems)) if problems else
                   f"ok: {tag}: peak VRAM {vram:,.0f} MiB, peak RAM {_num(c['peak_rss_mib']):,.0f} MiB, "
                   f"load {_num(c['load_s']):.1f} s")
    return out or ["FAIL: the run has no cells"]


def junit_counts(xml: Path) -> dict:
    """passed/failed/skipped counts and the failures' first lines, from pytest's junit xml."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return {}
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": set()}
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname', '').rsplit('.', 1)[-1]}::{tc.get('name')}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            out["failed"] += 1
            first = (bad.get("message") or "").splitlines()
            out["failures"].append(f"{name}: {first[0][:300] if first else ''}")
        elif tc.find("skipped") is not None:
            out["skipped"] += 1
            out["skip_reasons"].add((tc.find("skipped").get("message") or "")[:200])
        else:
            out["passed"] += 1
    out["skip_reasons"] = sorted(out["skip_reasons"])
    return out


def probe_lines(probe: Path) -> list[str]:
    try:
        p = json.loads(probe.read_text())
    except (OSError, ValueError):
        return []
    return [f"- {k}: median {f['median']:,.1f} {f['unit']} (max {f['max']:,.1f}, cv {100 * f['cv']:.1f}%)"
            for k, f in p.get("figures", {}).items()]


def summary(c) -> str:
    f, tc = c.facts, c.facts.get("toolchain", {})
    lines = [f"# moebench GPU check: {f.get('mode')}, {datetime.now(timezone.utc).isoformat(timespec='seconds')}", "",
             f"- machine: {f.get('gpu', 'no GPU')} (compute {f.get('compute_cap', '-')}, driver "
             f"{f.get('driver', '-')}, {f.get('memory', '-')}), {tc.get('cores')} cores",
             f"- elapsed: {c.elapsed():.0f} s of a {c.budget:.0f} s budget",
             f"- toolchain: nvcc {tc.get('nvcc')}, cuBLAS from {tc.get('cublas')}",
             f"- llama_cpp: {f.get('llama_cpp', '-')}",
             f"- modules moebench imports that the GPU image lacks: {f.get('missing_on_image') or 'none'}",
             f"- what the CUDA build needs and this machine lacks: {'; '.join(f.get('preflight', [])) or 'nothing'}",
             "", "## Steps", "", "| step | status | seconds | planned | note |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.planned_s:.0f} | {s.note} |" for s in c.steps]
    j = junit_counts(c.res / "pytest-gpu.xml")
    lines += ["", "## GPU tests (pytest -m gpu tests/test_gpu.py)", ""]
    if j:
        lines.append(f"passed {j['passed']}, failed {j['failed']}, skipped {j['skipped']}")
        lines += [f"- FAILED {x}" for x in j["failures"]] + [f"- skipped: {x}" for x in j["skip_reasons"]]
    else:
        lines.append("no result (see pytest-gpu.txt)")
    lines += ["", "## Sweep", "", f"plan: {f.get('sweep', 'not run')}", ""]
    lines += [f"- {x}" for x in f.get("sweep_checks", [])]
    if (c.res / "sweep.md").is_file():
        lines += ["", (c.res / "sweep.md").read_text().strip()]
    if (c.res / "cache.md").is_file():
        lines += ["", "## Expert cache (reference engine, traced; moebench cache)", "",
                  (c.res / "cache.md").read_text().strip()]
    lines += ["", "## Probe", ""] + (probe_lines(c.res / "probe.json") or ["not run"])
    lines += ["", "## Build", "", "CMAKE_ARGS: `" + " ".join(tc.get("cmake_args", [])) + "`", ""]
    return "\n".join(lines) + "\n"


def _tail(path: Path, n: int = 300) -> bytes:
    try:
        return b"\n".join(path.read_bytes().splitlines()[-n:]) + b"\n"
    except OSError:
        return b""


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_all(c) -> None:
    """summary.md and steps.json into the work folder, then the 8 files into c.dest (each replaced whole)."""
    from dataclasses import asdict

    (c.res / "summary.md").write_text(summary(c))
    (c.res / "steps.json").write_text(json.dumps({"facts": c.facts, "steps": [asdict(s) for s in c.steps]},
                                                 indent=2, default=str))
    for name, src in FILES.items():
        if name == TARBALL:
            _atomic(c.dest / name, tarball(c.res))
        elif src is None:
            _atomic(c.dest / name, (c.res / name).read_bytes())
        elif name == "build-tail.txt":
            if (c.res / src).is_file():
                _atomic(c.dest / name, _tail(c.res / src))
        elif (c.res / src).is_file():
            _atomic(c.dest / name, (c.res / src).read_bytes()[-MAX_BYTES + 4096:])


def tarball(res: Path) -> bytes:
    """res as tar.gz; without the full build log if that would pass the 16 MiB a file may have."""
    import io

    for skip in ((), ("logs/build.log",), ("logs/build.log", "results", "cache-results")):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tf:
            for p in sorted(res.rglob("*")):
                rel = p.relative_to(res).as_posix()
                skipped = any(rel == s or rel.startswith(s + "/") for s in skip)
                if p.is_file() and not p.name.endswith(".part") and not skipped:
                    tf.add(p, arcname=f"gpu-check/{rel}")
        if buf.tell() <= MAX_BYTES - 4096:
            break
    return buf.getvalue()


def plan_text(c, tc) -> str:
    """What the GPU run would run (the dry run prints it)."""
    import plan as P

    py, w = "python3", Path("/tmp/moebench-gpu-check")
    site = w / "site"
    src = w / "src" / f"llama_cpp_python-{c.facts.get('llama_version', '0.3.36')}"
    rows = [("env", "nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total; find nvcc and cuBLAS"),
            ("setup", " ".join(P.wheels_cmd(py, [Path(".gpu/wheels/*.whl")], site))
             + f"; untar .gpu/*.tar.xz -> {w}/src"),
            ("build", "CMAKE_ARGS='" + " ".join(P.cmake_args(tc, c.flash_attn)) + "' CMAKE_BUILD_PARALLEL_LEVEL=16 "
             + " ".join(P.build_cmd(py, src, site, w / "build")) + "   (beside: synthesize preset:" + P.PRESET
             + ", compile the reference kernels; killed at " + f"{P.BUILD_DEADLINE_S} s)"),
            ("probe", " ".join(P.harness(py, "probe", "--format", "json", "-o", "probe.json"))),
            ("tests", " ".join(P.tests_cmd(py, Path("pytest-gpu.xml")))),
            ("sweep", " ".join(P.sweep_cmd(py, P.PRESET, P.SWEEPS[0], Path("results"), 16, Path("sweep.md")))
             + "   (-r " + "/".join(str(s.repetitions) for s in P.SWEEPS) + " as time allows)"),
            ("report", " ".join(P.harness(py, "report", "results/<run_id>", "-o", "report", "--format", "md"))),
            ("cache", " ".join(P.cache_sweep_cmd(py, P.PRESET, P.CACHE_SWEEP, Path("cache-results"), 16)) + "; "
             + " ".join(P.cache_cmd(py, Path("cache-results/<run_id>"), Path("cache.md"), Path("cache-report")))
             + "   (in the time the sweep leaves)"),
            ("pack", f"at most {MAX_FILES} files into $OUT: " + ", ".join(FILES))]
    total = sum(P.PLANNED.values())
    lines = ["", f"GPU plan (budget {P.BUDGET_S} s, planned {total} s):"]
    lines += [f"  {name:<6} {P.PLANNED.get(name, 0):>4} s  {cmd}" for name, cmd in rows]
    return "\n".join(lines) + "\n\n"
