"""benchmarks/gpu_check.sh's engine: runs plan.py's steps against one deadline, keeps every output, packs it.

Modes: --prepare (here: make .gpu/), --check (read .gpu/ back), --dry-run (a CPU machine: the checks, the CPU
part of every step against device=cpu, and the GPU commands printed), and the GPU run (no flag).
Outputs: everything under a work folder (`res`), then at most 8 files (pack.py) in $OUT when it is set,
else in reports/gpu-check/ (with the work folder beside them). The packing runs after every phase, so a
run stopped at the device tool's limit still brings back what it had.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import site
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pack  # noqa: E402
import plan as P  # noqa: E402
import prepare  # noqa: E402

REPO = prepare.ROOT
sys.path.insert(1, str(REPO))


@dataclass
class Step:
    name: str
    status: str = "pending"          # ok | failed | timeout | skipped
    seconds: float = 0.0
    planned_s: float = 0.0
    command: str = ""
    note: str = ""


@dataclass
class Check:
    """One run of the check: the clock, the folders, the environment every step gets, the step records."""
    dry: bool
    gpu_dir: Path                    # .gpu/ (prepare.py)
    flash_attn: bool                 # build llama.cpp's CUDA flash-attention kernels
    res: Path                        # every output
    dest: Path                       # the packed files
    work: Path                       # big scratch: sources, build, site-packages, model cache
    budget: float = P.BUDGET_S
    py: str = sys.executable
    t0: float = field(default_factory=time.monotonic)
    steps: list[Step] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def step(self, name: str, note: str = "") -> Step:
        s = Step(name, planned_s=P.PLANNED.get(name, 0), note=note)
        self.steps.append(s)
        print(f"[{self.elapsed():6.1f}s] {name}{': ' + note if note else ''}", flush=True)
        return s

    def start(self, cmd: list[str], log: str, cwd: Path = REPO, extra_env: dict | None = None) -> subprocess.Popen:
        """A step's command in its own process group (so a timeout kills its whole tree), output to logs/."""
        (self.res / "logs").mkdir(parents=True, exist_ok=True)
        f = open(self.res / "logs" / log, "ab")
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        return subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=self.env | (extra_env or {}))

    def wait(self, p: subprocess.Popen, s: Step, cap: float, t_start: float) -> int | None:
        """Wait for p until t_start + cap (and never past the budget); None when it was killed."""
        try:
            rc = p.wait(timeout=max(1.0, min(cap - (time.monotonic() - t_start), self.left())))
        except subprocess.TimeoutExpired:
            kill(p)
            s.status, s.seconds = "timeout", time.monotonic() - t_start
            return None
        s.status, s.seconds = ("ok" if rc == 0 else "failed"), time.monotonic() - t_start
        return rc

    def run(self, name: str, cmd: list[str], cap: float, log: str | None = None, cwd: Path = REPO,
            extra_env: dict | None = None, note: str = "") -> Step:
        s = self.step(name, note)
        s.command = " ".join(cmd)
        t = time.monotonic()
        p = self.start(cmd, log or f"{name}.log", cwd, extra_env)
        self.wait(p, s, cap, t)
        if s.status != "ok":
            s.note = (s.note + "; " if s.note else "") + f"{s.status}; see logs/{log or name + '.log'}"
        return s

    def pack(self) -> None:
        pack.write_all(self)


def kill(p: subprocess.Popen) -> None:
    """End a step's process group (only processes this check started): INT first, which a sweep turns into
    stopping its cell's worker (its own session) and keeping what is written; then TERM, then KILL."""
    for sig, grace in ((signal.SIGINT, 8), (signal.SIGTERM, 3), (signal.SIGKILL, 2)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def folders(dry: bool, out: str | None) -> tuple[Path, Path, Path]:
    """(res, dest, work): with $OUT (or --out) the packed files go there and nothing else does."""
    dest = Path(out or os.environ.get("OUT") or REPO / "reports" / "gpu-check")
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/moebench-gpu-check" + ("-dry" if dry else "")))
    res = work / "out" if (out or os.environ.get("OUT")) else dest / "work"
    for d in (res, work / "site"):            # outputs and installs of an earlier run go
        shutil.rmtree(d, ignore_errors=True)
    for d in (res, work, dest):
        d.mkdir(parents=True, exist_ok=True)
    return res, dest, work


def base_env(c: Check, site_dir: Path, lib_dirs: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(site_dir), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["MOEBENCH_CACHE"] = str(c.work / "cache") if not c.dry else env.get("MOEBENCH_CACHE", "")
    env = {k: v for k, v in env.items() if v != ""}
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return env


def gpu_facts() -> dict:
    """The GPU as nvidia-smi reports it (no CUDA context in this process: it would hold VRAM all run long)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    name, cap, driver, mem = [x.strip() for x in out.splitlines()[0].split(",")]
    return {"gpu": name, "compute_cap": cap, "driver": driver, "memory": mem}


def preflight(tc: P.Toolchain) -> list[str]:
    """What the CUDA build needs on the machine and lacks, one line each (the build would fail on it)."""
    import importlib.util

    out = [f"no {m} in {sys.executable}" for m in ("scikit_build_core", "torch") if not importlib.util.find_spec(m)]
    out += [f"no {t} on PATH" for t in ("cmake", "ninja", "g++") if shutil.which(t) is None]
    out += [] if tc.nvcc else ["no nvcc"]
    out += [] if tc.cublas_in_toolkit or tc.cublas_libs else ["no cuBLAS (toolkit or pip nvidia-cublas)"]
    return out


def site_dirs() -> list[str]:
    return [*site.getsitepackages(), site.getusersitepackages(), *sys.path]


# --- the steps ----------------------------------------------------------------------------------------

def setup(c: Check, manifest: dict | None) -> None:
    """Unpack the trimmed sources and install the carried wheels into work/site, offline."""
    s = c.step("setup")
    t = time.monotonic()
    gpu = c.gpu_dir
    wheels = sorted((gpu / "wheels").glob("*.whl")) if manifest else []
    if not wheels:
        s.status, s.note = ("skipped" if c.dry else "failed"), "no .gpu/ (run --prepare here first)"
        return
    site_dir = c.work / "site"
    cmd = P.wheels_cmd(c.py, wheels, site_dir)
    s.command = " ".join(cmd)
    p = c.start(cmd, "setup.log")
    if c.wait(p, s, 60, t) != 0:
        return
    if not c.dry:
        with tarfile.open(gpu / manifest["archive"]["name"]) as tf:
            tf.extractall(c.work / "src", filter="data")
    # the carried wheels must be what is imported (not a copy that happens to be installed here)
    probe = subprocess.run([c.py, "-c", "import gguf, diskcache; print(gguf.__file__); print(diskcache.__file__)"],
                           capture_output=True, text=True, env=c.env)
    if probe.returncode or not all(line.startswith(str(site_dir)) for line in probe.stdout.split()):
        s.status, s.note = "failed", f"wheels not imported from {site_dir}: {probe.stdout} {probe.stderr[-300:]}"
    s.seconds = time.monotonic() - t


def phase_a(c: Check, tc: P.Toolchain, preset: str) -> None:
    """The CUDA build of llama-cpp-python, beside the model synthesis and the reference kernels' compile (one core
    each); all polled together, so each step's time is its own, and all stopped at BUILD_DEADLINE_S."""
    synth = [c.py, "-c", f"from workloads.synth import cached_model; print(cached_model('preset:{preset}'))"]
    kern = [c.py, "-c", "from engines.reference import kernels; k = kernels.quant_kernels(); "
                        "print(k if isinstance(k, str) else 'quant kernels: ' + k.isa)"]
    jobs = {"synth": synth, "kernels": kern}
    src = next((c.work / "src").glob("llama_cpp_python-*"), None)
    if not c.dry and src is not None:
        jobs["build"] = P.build_cmd(c.py, src, c.work / "site", c.work / "build")
    t, running = time.monotonic(), {}
    for name, cmd in jobs.items():
        args = " ".join(P.cmake_args(tc, c.flash_attn))
        s = c.step(name, "CMAKE_ARGS=" + args if name == "build" else "")
        s.command = " ".join(cmd)
        extra = {"CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": str(tc.cores),
                 "CUDACXX": tc.nvcc or ""} if name == "build" else {}
        running[name] = (c.start(cmd, f"{name}.log", extra_env=extra), s)
    if "build" not in jobs:
        c.step("build", "dry run: printed, not built" if c.dry else "no sources").status = "skipped"
    deadline = c.t0 + P.BUILD_DEADLINE_S
    while running:
        time.sleep(0.5)
        for name, (p, s) in list(running.items()):
            rc = p.poll()
            if rc is None and time.monotonic() < deadline and c.left() > 0:
                continue
            if rc is None:
                kill(p)
            s.status = "timeout" if rc is None else "ok" if rc == 0 else "failed"
            s.seconds = time.monotonic() - t
            s.note = s.note if s.status == "ok" else f"{s.status}; see logs/{name}.log"
            del running[name]
            if name == "synth" and s.status == "ok":
                c.env["MOEBENCH_GPU_CHECK_MODEL"] = (c.res / "logs" / "synth.log").read_text().strip().splitlines()[-1]
            if name == "build":
                s.note = pack.build_progress(c.res / "logs" / "build.log") + ("" if s.status == "ok" else f"; {s.note}")


def verify_install(c: Check) -> str:
    """Whether the llama_cpp that the steps import is the CUDA build from work/site."""
    code = "import llama_cpp as L; print(L.__file__); print(L.llama_supports_gpu_offload())"
    r = subprocess.run([c.py, "-c", code], capture_output=True, text=True, env=c.env)
    if r.returncode:
        return f"not importable: {r.stderr[-300:]}"
    return r.stdout.strip().replace("\n", " gpu_offload=")


def sweep_and_report(c: Check, preset: str) -> None:
    if c.dry:
        sw = P.DRY_SWEEP
    else:
        sw = P.choose_sweep(c.left() - P.REPORT_RESERVE_S)
        if sw is None:
            c.step("sweep", f"skipped: {c.left():.0f} s left").status = "skipped"
            return
    engines = P.ENGINES if c.facts.get("llama_cpp_cuda") or c.dry else "reference"
    cmd = P.sweep_cmd(c.py, preset, sw, c.res / "results", 2 if c.dry else os.cpu_count() or 1, c.res / "sweep.md")
    cmd[cmd.index("-e") + 1] = engines
    c.facts["sweep"] = (f"{engines}; depths {','.join(sw.depths)}; {','.join(sw.workloads)}; -r {sw.repetitions}; "
                        f"estimate {sw.estimate_s} s; cell timeout {sw.cell_timeout_s} s")
    c.run("sweep", cmd, cap=max(30.0, c.left() - P.REPORT_RESERVE_S),
          note=f"-r {sw.repetitions}, {','.join(sw.workloads)}, estimate {sw.estimate_s} s")
    run_dir = pack.latest_run(c.res / "results")
    if run_dir is None:
        return
    c.facts["sweep_checks"] = pack.verify_run(run_dir, gpu=not c.dry)
    c.run("report", P.harness(c.py, "report", str(run_dir), "-o", str(c.res / "report"), "--format", "md"),
          cap=max(20.0, c.left() - 10))


def cache_check(c: Check, preset: str) -> None:
    """The reference engine's expert cache at P.CACHE_MIB with traces, then `moebench cache` on that run (the time
    model's GPU terms); only in the time the main sweep left."""
    sw = P.DRY_CACHE_SWEEP if c.dry else P.CACHE_SWEEP
    if not c.dry and c.left() - P.REPORT_RESERVE_S < sw.estimate_s:
        c.step("cache sweep", f"skipped: {c.left():.0f} s left").status = "skipped"
        return
    c.run("cache sweep", P.cache_sweep_cmd(c.py, preset, sw, c.res / "cache-results", 2 if c.dry else
                                           os.cpu_count() or 1), cap=max(30.0, c.left() - P.REPORT_RESERVE_S),
          note=f"reference, --cache-mib {','.join(map(str, P.CACHE_MIB))}, {','.join(sw.workloads)}")
    run_dir = pack.latest_run(c.res / "cache-results")
    if run_dir is not None:
        c.run("cache", P.cache_cmd(c.py, run_dir, c.res / "cache.md", c.res / "cache-report"),
              cap=max(20.0, c.left() - 10))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_check.sh", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="here: make .gpu/ (see prepare.py)")
    mode.add_argument("--check", action="store_true", help="read .gpu/ back: manifest, sha256, archive, size")
    mode.add_argument("--dry-run", action="store_true", help="CPU machine: checks + CPU parts + the GPU plan")
    ap.add_argument("--out", help="where the packed files go (default: $OUT, else reports/gpu-check)")
    ap.add_argument("--budget", type=float, default=P.BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--gpu-dir", default=str(prepare.GPU_DIR), help="the prepared folder (default: .gpu/)")
    ap.add_argument("--flash-attn", action="store_true",
                    help="also compile llama.cpp's CUDA flash-attention kernels (+700 CPU-s: ~+45 s on 16 cores)")
    ap.add_argument("--preset", default=None, help=f"the sweep's model (default: {P.PRESET}; dry run: {P.DRY_PRESET})")
    a, rest = ap.parse_known_args(argv)
    if a.prepare:
        return prepare.main(rest + ["--gpu-dir", a.gpu_dir])
    if rest:
        ap.error(f"unknown arguments: {' '.join(rest)}")
    gpu_dir = Path(a.gpu_dir)
    manifest, problems = prepare.check(gpu_dir)
    if a.check:
        print("\n".join(f"problem: {p}" for p in problems) or "ok: .gpu/ holds what the GPU run needs")
        return 1 if problems else 0
    dry = a.dry_run
    if problems and (manifest is not None or not dry):     # unprepared is fine for a dry run; broken is not
        print("\n".join(f"problem: {p}" for p in problems), file=sys.stderr)
        return 2
    res, dest, work = folders(dry, a.out)
    c = Check(dry, gpu_dir, a.flash_attn, res, dest, work, a.budget)
    c.facts |= {"mode": "dry-run" if dry else "gpu", "prepared": manifest is not None, "prepare_problems": problems}
    s = c.step("env")
    c.facts |= gpu_facts()
    if not dry and not c.facts.get("gpu"):
        print("error: no NVIDIA GPU (nvidia-smi answers nothing); use --dry-run on a CPU machine.", file=sys.stderr)
        return 2
    cap = c.facts.get("compute_cap", "9.0").replace(".", "")
    tc = P.find_toolchain(site_dirs(), f"{cap}-real")
    c.facts["toolchain"] = {"nvcc": tc.nvcc, "cublas": tc.cublas_source, "arch": tc.arch, "cores": tc.cores,
                            "cmake_args": P.cmake_args(tc, c.flash_attn)}
    c.facts["missing_on_image"] = pack.missing_on_image()
    c.facts["preflight"] = preflight(tc)
    c.env = base_env(c, work / "site", tc.lib_dirs)
    s.status = "ok"
    preset = a.preset or (P.DRY_PRESET if dry else P.PRESET)
    setup(c, manifest)
    c.pack()
    phase_a(c, tc, preset)
    c.facts["llama_cpp"] = verify_install(c)
    c.facts["llama_cpp_cuda"] = c.facts["llama_cpp"].endswith("gpu_offload=True")
    c.pack()
    probe = P.harness(c.py, "probe", "--format", "json", "-o", str(c.res / "probe.json"))
    c.run("probe", probe + (["--quick", "--no-save"] if dry else []), cap=P.PROBE_CAP_S)
    c.run("tests", P.tests_cmd(c.py, c.res / "pytest-gpu.xml"), cap=P.TESTS_CAP_S, log="pytest-gpu.txt")
    c.pack()
    sweep_and_report(c, preset)
    c.pack()
    cache_check(c, preset)
    c.step("pack").status = "ok"
    c.pack()
    print(pack.plan_text(c, tc) if dry else "", end="")
    print((c.dest / "summary.md").read_text())
    bad = [s.name for s in c.steps if s.status in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
