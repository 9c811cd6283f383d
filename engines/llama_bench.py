"""llama.cpp's own `llama-bench` binary as an engine, so its numbers land in the same tables.

One llama-bench process per workload: `-m F -p N -n 0` (ppN) or `-p 0 -n N` (tgN), `-d D` for @dD,
`-r R -b -ub -t -fa -ngl 99 -ncmoe N -o jsonl`. Its JSON is read by key name (the field list
changes between builds) and its `samples_ns` become our repetitions. llama-bench does its own
warm-up run and loads the model inside every run, so load() runs it once on a 1-token prompt:
that checks binary, flags and model before any workload, gives the build and the effective
settings for info(), and load_s is that probe's wall time (a model load plus one token).
Flags are mapped from the binary's `--help`, since they change between builds too.

llama-bench's `--repack` and `--no-host` are engine knobs, as for the llama-cpp engine; a binary built by a compiler
that miscompiles AMX runs with `--repack 0` on an AMX CPU (engines/ggml_build.py), and notes() says so.

Where the binary comes from: `moebench sweep --llama-bench PATH` (settings.extra["llama_bench"]),
$MOEBENCH_LLAMA_BENCH, the cache that `moebench tools build-llama-bench` fills
(<cache>/llama-bench/<llama-cpp-python version>/bin/llama-bench, the same llama.cpp commit as the
llama-cpp engine), then PATH.
"""
from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

from engines import ggml_build
from engines.base import EngineInfo, EngineSettings, switch, weight_arithmetic
from engines.external import ExternalEngine, ExternalError, tail
from engines.gguf_meta import read_meta
from engines.llama_cpp import compute_dtype

# llama-bench's JSON field -> our settings name, for info()
EFFECTIVE = {"n_threads": "threads", "n_batch": "n_batch", "n_ubatch": "n_ubatch", "flash_attn": "flash_attn",
             "n_gpu_layers": "n_gpu_layers", "n_cpu_moe": "n_cpu_moe", "type_k": "type_k", "type_v": "type_v",
             "load_mode": "load_mode", "use_mmap": "mmap", "no_op_offload": "no_op_offload",
             "backends": "backends", "cpu_info": "cpu_info", "gpu_info": "gpu_info", "devices": "devices",
             "repack": "repack", "no_host": "no_host"}


def cache_root() -> Path:
    from engines.paths import cache_dir
    return cache_dir() / "llama-bench"


def installed_llama_cpp_python() -> str | None:
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None


def parse_jsonl(stdout: str) -> list[dict]:
    """llama-bench's `-o jsonl` records (one JSON object per line); other lines are ignored."""
    records = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ExternalError(f"llama-bench printed a line that is not JSON ({e.msg}): "
                                    f"{tail(line, 200)}") from None
    return records


def pick_record(records: list[dict], n_prompt: int, n_gen: int, n_depth: int, output: str) -> dict:
    """The record of the test we asked for, checked by key name; fields this build lacks are not checked."""
    for r in records:
        if all(r.get(k, v) == v for k, v in (("n_prompt", n_prompt), ("n_gen", n_gen), ("n_depth", n_depth))):
            return r
    asked = f"n_prompt={n_prompt} n_gen={n_gen} n_depth={n_depth}"
    if records:
        got = "; ".join(f"n_prompt={r.get('n_prompt')} n_gen={r.get('n_gen')} n_depth={r.get('n_depth')}"
                        for r in records)
        raise ExternalError(f"llama-bench output has no record for {asked} (got {got})")
    raise ExternalError(f"llama-bench printed no JSON record for {asked}; output tail: {tail(output) or '(none)'}")


def samples_ns(record: dict, repetitions: int) -> list[int]:
    samples = record.get("samples_ns")
    if not isinstance(samples, list) or not samples:
        raise ExternalError(f"llama-bench's record has no samples_ns list (fields: {', '.join(sorted(record))})")
    if len(samples) != repetitions:
        raise ExternalError(f"llama-bench reported {len(samples)} samples, asked for {repetitions} repetitions")
    return [int(x) for x in samples]


class LlamaBenchEngine(ExternalEngine):
    name = "llama-bench"
    binary_name = "llama-bench"
    extra_key = "llama_bench"
    env_var = "MOEBENCH_LLAMA_BENCH"
    how_to_get = ("build one matching the installed llama-cpp-python with `moebench tools build-llama-bench`, "
                  "or pass `--llama-bench PATH` / set MOEBENCH_LLAMA_BENCH=PATH.")
    knobs = {"repack": ("0", "1"), "no_host": ("0", "1")}

    @classmethod
    def amx_fallback(cls, binary: Path | None) -> str:
        """Why this binary must run with --repack 0 here, or "". It was built for this CPU (-march=native, as
        `moebench tools build-llama-bench` builds), so on an AMX CPU its AMX code is in."""
        compiler = ggml_build.compiler_of(binary) if binary else ""
        if not ggml_build.amx_crash_applies(compiler, "AMX_INT8 = 1"):
            return ""
        return (f"llama-bench runs with --repack 0 (no AMX, no CPU_REPACK buffers) whatever was asked: {binary} was "
                f"built by {compiler}, which miscompiles llama.cpp's AMX code, and this CPU has AMX (it would crash); "
                f"`moebench tools build-llama-bench --force` rebuilds it with clang.")

    @classmethod
    def repack_on(cls, extra: dict, binary: Path | None) -> bool:
        """--repack as this binary runs it: as asked (default 1), off where amx_fallback applies."""
        return switch(extra.get("repack", True)) and not cls.amx_fallback(binary)

    @classmethod
    def notes(cls) -> list[str]:
        why = cls.amx_fallback(cls.find())
        return [why] if why else []

    @classmethod
    def crash_cause(cls, signal_name: str, settings: EngineSettings, info: dict) -> str:
        binary = cls.find(settings.extra.get(cls.extra_key))
        return ggml_build.crash_cause(signal_name, ggml_build.compiler_of(binary) if binary else "", "AMX_INT8 = 1",
                                      cls.repack_on(settings.extra, binary))

    @classmethod
    def discovered(cls) -> list[Path]:
        """The cache build for the installed llama-cpp-python first, then other cached builds, then PATH."""
        root, want = cache_root(), installed_llama_cpp_python()
        cached = sorted(root.glob("*/bin/llama-bench"), key=lambda p: (p.parent.parent.name != want, p))
        return [*cached, *super().discovered()]

    @classmethod
    def build_info(cls, binary: Path) -> dict:
        """build.json that `moebench tools build-llama-bench` writes next to its build (else {})."""
        try:
            return json.loads((binary.parent.parent / "build.json").read_text())
        except (OSError, ValueError):
            return {}

    @classmethod
    def version_of(cls, binary: Path, record: dict | None = None) -> str:
        """llama-bench's build_commit/build_number; a build from an sdist has no git, so it says
        "unknown" and the commit comes from build.json."""
        record = record or {}
        commit, number = str(record.get("build_commit", "unknown")), record.get("build_number", 0)
        if commit not in ("", "unknown"):
            return f"{commit} (build {number})"
        b = cls.build_info(binary)
        if b.get("llama_cpp_commit"):
            return f"{b['llama_cpp_commit']} (llama-cpp-python {b.get('llama_cpp_python', '?')} sdist)"
        return "unknown"

    @classmethod
    def version(cls) -> str:
        binary = cls.find()
        return cls.version_of(binary) if binary and binary.is_file() else "unknown"

    # --- flags ----------------------------------------------------------------------------------

    def _flags(self, s: EngineSettings) -> list[str]:
        """The cell's settings as flags this build understands (checked against its --help)."""
        help_text = self.run([self.binary, "--help"], check=False).output
        has = lambda *names: next((n for n in names if re.search(rf"(^|[\s,]){re.escape(n)}[\s,]", help_text, re.M)),
                                  None)
        if not has("-m", "--model"):
            raise ExternalError(f"{self.binary} --help does not look like llama-bench's; "
                                f"output tail: {tail(help_text)}")
        flags = ["-m", str(self.model), "-b", s.n_batch, "-ub", s.n_ubatch, "-t", s.threads, "-ngl", 99, "-o", "jsonl"]
        ncmoe = has("-ncmoe", "--n-cpu-moe")
        if ncmoe:
            flags += [ncmoe, s.n_cpu_moe]
        elif s.n_cpu_moe:
            raise ExternalError(f"this llama-bench ({self.binary}) has no -ncmoe/--n-cpu-moe flag; use a newer build "
                                f"(`moebench tools build-llama-bench`)")
        fa = re.search(r"-fa, --flash-attn <([^>]*)>", help_text)
        if fa and "auto" in fa.group(1):
            flags += ["-fa", s.flash_attn]
        elif s.flash_attn != "auto":          # older builds: -fa <0|1>, default off
            flags += ["-fa", int(s.flash_attn == "on")]
        if has("-lm", "--load-mode"):
            flags += ["-lm", "mmap" if s.mmap else "none"]
        elif has("-mmp", "--mmap"):
            flags += ["-mmp", int(s.mmap)]
        self.repack = self.repack_on(s.extra, self.binary)
        self.no_host = switch(s.extra.get("no_host", False))
        # passed when asked (or forced off), so an older llama-bench without the flags still runs its defaults
        for flag, on, asked in (("--repack", self.repack, "repack" in s.extra or not self.repack),
                                ("--no-host", self.no_host, "no_host" in s.extra)):
            if asked and not has(flag):
                raise ExternalError(f"this llama-bench ({self.binary}) has no {flag} flag; use a newer build "
                                    f"(`moebench tools build-llama-bench`)")
            flags += [flag, int(on)] if asked else []
        self.has_depth = bool(has("-d", "--n-depth"))
        self.has_no_warmup = bool(has("--no-warmup"))
        return [str(f) for f in flags]

    def _bench(self, n_prompt: int, n_gen: int, n_depth: int, reps: int, warmup: bool = True) -> dict:
        argv = [self.binary, *self.flags, "-p", n_prompt, "-n", n_gen, "-r", reps]
        if n_depth:
            if not self.has_depth:
                raise ExternalError(f"this llama-bench ({self.binary}) has no -d/--n-depth flag for @d{n_depth} "
                                    f"workloads")
            argv += ["-d", n_depth]
        if not warmup and self.has_no_warmup:
            argv.append("--no-warmup")
        done = self.run(argv)
        return pick_record(parse_jsonl(done.stdout), n_prompt, n_gen, n_depth, done.output)

    # --- Engine ---------------------------------------------------------------------------------

    def load(self, model: Path, s: EngineSettings) -> None:
        self.s, self.model, self.meta = s, model, read_meta(model)
        self.binary = self.locate(s)
        self.flags = self._flags(s)
        self.probe = self._bench(1, 0, 0, 1, warmup=False)

    def measure(self, workload, repetitions: int, warmup: int, seed: int) -> list[int]:
        # llama-bench runs one warm-up itself (skipped with --no-warmup when we are asked for none);
        # its token ids are its own random ones, not our seeded stream.
        record = self._bench(workload.n_prompt, workload.n_gen, workload.n_depth, repetitions, warmup > 0)
        return samples_ns(record, repetitions)

    def known_work(self) -> dict:
        """compute_dtype and weights (engines.base) where the probe's record tells them: llama.cpp's CPU arithmetic
        (llama_cpp.compute_dtype with the weight-type rule: this process has not loaded the binary's ggml) when its only
        backend was the CPU's; the weights from its load mode and --repack, and whether a weight of this file
        goes into an extra buffer type (ggml_build.extra_buft, as `plan` predicts). Left out where not known."""
        p, out = self.probe, {}
        if p.get("backends") == "CPU":          # a BLAS or GPU backend takes some products its own way
            out["compute_dtype"] = compute_dtype(self.meta, weight_arithmetic)
        mode = str(p["load_mode"]) if "load_mode" in p else {True: "mmap", False: "none"}.get(p.get("use_mmap"), "auto")
        if mode != "auto":                      # auto: llama.cpp decides by itself, and the record does not say
            bufts = ggml_build.cpu_bufts() if p.get("repack", self.repack) else {}
            repacked = any(ggml_build.extra_buft(t.name, t.ne, t.ggml_type, bufts) for t in self.meta.tensors)
            out["weights"] = "copy" if "mmap" not in mode else "mapped+repacked-copy" if repacked else "mapped"
        return out

    def info(self) -> EngineInfo:
        p, s = self.probe, self.s
        effective = {ours: p[theirs] for theirs, ours in EFFECTIVE.items() if theirs in p} | self.known_work()
        effective |= {"n_ctx": "n_prompt + n_gen + n_depth of each test (llama-bench sizes it per test)",
                      "load": "inside every llama-bench run (load_s = a 1-token probe run)",
                      "binary": str(self.binary), "argv": self.flags,
                      "ggml_compiler": ggml_build.compiler_of(self.binary)}
        return EngineInfo(
            engine=self.name, version=self.version_of(self.binary, p), settings=effective,
            bytes_by_device={},            # llama-bench reports no per-buffer sizes; see extra.model_size
            expert_bytes_host=self.meta.expert_bytes(int(p.get("n_cpu_moe", s.n_cpu_moe))),
                # as llama-bench reports it
            expert_bytes_total=self.meta.expert_bytes(),
            extra={"probe": {k: v for k, v in p.items() if k not in ("samples_ns", "samples_ts")},
                   "build": self.build_info(self.binary)})
