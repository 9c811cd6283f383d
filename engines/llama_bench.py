"""The `llama-bench` binaries of the llama.cpp family (upstream llama.cpp, ik_llama.cpp) as an engine, so their numbers
land in the same tables.

One llama-bench process per workload: `-m F -p N -n 0` (ppN) or `-p 0 -n N` (tgN), `-d D` for @dD,
`-r R -b -ub -t -fa -ngl 99 -ncmoe N -o jsonl`. Its JSON is read by key name (the field list
changes between builds) and its `samples_ns` become our repetitions. llama-bench does its own
warm-up run and loads the model inside every run, so load() runs it once on a 1-token prompt:
that checks binary, flags and model before any workload, gives the build and the effective
settings for info(), and load_s is that probe's wall time (a model load plus one token). The probe runs with -v, and
its load log's "buffer type overridden" lines say which layers' routed experts it really placed in host memory
(EngineInfo.cpu_moe_layers).
Flags and output formats are read from the binary's `--help`, since they change between builds and forks: `-o jsonl`
where it lists jsonl, else `-o json` (one JSON array); ik_llama.cpp's llama-bench (engines/llama_bench_family.py) has no
depth flag but `-gp D,N` for tgN@dD, its own `--n-cpu-moe` rule (replaced by explicit -ot overrides), and the knobs
`rtr` (-rtr, run-time repack) and `fmoe` (-fmoe, fused MoE), passed only when asked.

llama-bench's `--repack` and `--no-host` are engine knobs, as for the llama-cpp engine; a binary built by a compiler
that miscompiles AMX runs with `--repack 0` on an AMX CPU (engines/ggml_build.py), and notes() says so.

Where the binary comes from: an engine spec's `bin=PATH` or `moebench sweep --llama-bench PATH` (settings.extra
["llama_bench"]), $MOEBENCH_LLAMA_BENCH, the cache that `moebench tools build-llama-bench` fills
(<cache>/llama-bench/<llama-cpp-python version>/bin/llama-bench, the same llama.cpp commit as the
llama-cpp engine; `--source DIR` builds land beside it under their own label), then PATH.
"""
from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

from engines import base, ggml_build
from engines.base import EngineInfo, EngineSettings, expert_layer, switch, weight_arithmetic
from engines.external import Completed, ExternalEngine, ExternalError, label_text, tail
from engines.gguf_meta import read_meta
from engines.llama_bench_family import IK, UPSTREAM, BenchHelp, checkout_of, help_of, ik_compute_dtype, ik_weights
from engines.llama_cpp import compute_dtype, override_patterns

# llama-bench's JSON field -> our settings name, for info()
EFFECTIVE = {"n_threads": "threads", "n_batch": "n_batch", "n_ubatch": "n_ubatch", "flash_attn": "flash_attn",
             "n_gpu_layers": "n_gpu_layers", "n_cpu_moe": "n_cpu_moe", "type_k": "type_k", "type_v": "type_v",
             "load_mode": "load_mode", "use_mmap": "mmap", "no_op_offload": "no_op_offload",
             "backends": "backends", "cpu_info": "cpu_info", "gpu_info": "gpu_info", "devices": "devices",
             "repack": "repack", "no_host": "no_host"}
# ik_llama.cpp's record: its "repack" is -rtr (run-time repack), "fused_moe" is -fmoe
IK_EFFECTIVE = {"n_threads": "threads", "n_batch": "n_batch", "n_ubatch": "n_ubatch", "flash_attn": "flash_attn",
                "n_gpu_layers": "n_gpu_layers", "type_k": "type_k", "type_v": "type_v", "use_mmap": "mmap",
                "cpu_info": "cpu_info", "gpu_info": "gpu_info", "repack": "rtr", "fused_moe": "fmoe",
                "override_tensor": "override_tensor"}
IK_BACKENDS = ("cuda", "vulkan", "metal", "sycl", "rpc", "gpu_blas", "blas")   # its record's flags for non-CPU backends
# knob -> the flags that carry it (ik_llama.cpp's)
IK_KNOBS = {"rtr": ("-rtr", "--run-time-repack"), "fmoe": ("-fmoe", "--fused-moe")}
# the load log's placement lines (-v): upstream "tensor blk.0.ffn_up_exps.weight (0 MiB f32) buffer type overridden
# to CPU", ik_llama.cpp "Tensor blk.0.ffn_up_exps.weight (size = 0.50 MiB) buffer type overridden to CPU";
# (?<!\S): a match starts at a word's start (no quadratic backtracking over a long word)
OVERRIDDEN = re.compile(r"(?<!\S)[Tt]ensor (blk\.\d+\.\S+) \([^)\n]*\) buffer type overridden to (\S+)")
HOST_BUFT = re.compile(r"CPU\w*|\w+_Host")       # host memory: CPU, CPU_REPACK, ...; CUDA_Host (pinned) in CUDA builds
LOADER = re.compile(r"^llama_model_loader: ", re.M)   # the load log was printed at all
ECHO_CHARS = 20_000            # the verbose probe's log in the cell log: its first and last 10 kB


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


def parse_json(stdout: str) -> list[dict]:
    """llama-bench's `-o json`: one JSON array of records, from the first line that opens it; [] when none does."""
    start = re.search(r"^\s*\[", stdout, re.M)
    if start is None:
        return []
    try:
        data, _ = json.JSONDecoder().raw_decode(stdout, start.end() - 1)
    except json.JSONDecodeError as e:
        raise ExternalError(f"llama-bench's -o json output is not JSON ({e.msg}): "
                            f"{tail(stdout[start.start():], 200)}") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ExternalError(f"llama-bench's -o json output is not a list of records (JSON objects): "
                            f"{tail(stdout[start.start():], 200)}")
    return data


def parse_records(stdout: str, fmt: str) -> list[dict]:
    return parse_jsonl(stdout) if fmt == "jsonl" else parse_json(stdout)


def pick_record(records: list[dict], n_prompt: int, n_gen: int, n_depth: int, output: str) -> dict:
    """The record of the test we asked for, checked by key name; fields this build lacks are not checked."""
    for r in records:
        if all(r.get(k, v) == v for k, v in (("n_prompt", n_prompt), ("n_gen", n_gen), ("n_depth", n_depth))):
            return r
    asked = f"n_prompt={n_prompt} n_gen={n_gen} n_depth={n_depth}"
    if records:
        got = "; ".join(f"n_prompt={r.get('n_prompt')} n_gen={r.get('n_gen')} n_depth={r.get('n_depth')}"
                        for r in records)
        raise ExternalError(f"llama-bench output has no record for {asked} (got {tail(got, 300)})")
    raise ExternalError(f"llama-bench printed no JSON record for {asked}; output tail: {tail(output) or '(none)'}")


def samples_ns(record: dict, repetitions: int) -> list[int]:
    samples = record.get("samples_ns")
    if not isinstance(samples, list) or not samples:
        raise ExternalError(f"llama-bench's record has no samples_ns list (fields: {', '.join(sorted(record))})")
    if len(samples) != repetitions:
        raise ExternalError(f"llama-bench reported {len(samples)} samples, asked for {repetitions} repetitions")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in samples):
        raise ExternalError(f"llama-bench's samples_ns are not all positive whole numbers: {tail(str(samples), 200)}")
    return samples


def host_layers(log: str, meta) -> tuple[list[int], int]:
    """(layers all of whose routed-expert tensors the load log shows overridden to a host buffer, overridden tensor
    count). A layer counts only whole: a rule that misses one of its expert tensors (ik_llama.cpp's --n-cpu-moe on
    gemma4's merged ffn_gate_up_exps) does not keep that layer's experts in host memory."""
    overridden = {name for name, buft in OVERRIDDEN.findall(log) if HOST_BUFT.fullmatch(buft)}
    experts: dict[int, set[str]] = {}
    for t in meta.tensors:
        layer = expert_layer(t.name)
        if layer is not None:
            experts.setdefault(layer, set()).add(t.name)
    return sorted(layer for layer, names in experts.items() if names <= overridden), len(overridden)


class LlamaBenchEngine(ExternalEngine):
    name = "llama-bench"
    binary_name = "llama-bench"
    extra_key = "llama_bench"
    env_var = "MOEBENCH_LLAMA_BENCH"
    how_to_get = ("build one matching the installed llama-cpp-python with `moebench tools build-llama-bench`, "
                  "or pass `--llama-bench PATH` / set MOEBENCH_LLAMA_BENCH=PATH.")
    knobs = {"repack": ("0", "1"), "no_host": ("0", "1"), "rtr": ("0", "1"), "fmoe": ("0", "1")}
    help = BenchHelp("")                               # load() reads the binary's own
    placed: tuple[list[int], int] | None = None        # (cpu_moe_layers, overridden tensors) from the probe's log

    @classmethod
    def amx_fallback(cls, binary: Path | None) -> str:
        """Why this binary must run with --repack 0 here, or "". It was built for this CPU (-march=native, as
        `moebench tools build-llama-bench` builds), so on an AMX CPU its AMX code is in. ik_llama.cpp's ggml has no AMX
        buffer type (nor --repack)."""
        compiler = ggml_build.compiler_of(binary) if binary else ""
        if not ggml_build.amx_crash_applies(compiler, "AMX_INT8 = 1") or help_of(binary).ik:
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
        """The cache build for the installed llama-cpp-python first, then other cached builds of its sdist, then
        builds of users' checkouts (`--source`; named with bin=), then PATH."""
        root, want = cache_root(), installed_llama_cpp_python()
        cached = sorted(root.glob("*/bin/llama-bench"),
                        key=lambda p: (p.parent.parent.name != want, "source" in cls.build_info(p), p))
        return [*cached, *super().discovered()]

    @classmethod
    def build_info(cls, binary: Path) -> dict:
        """build.json that `moebench tools build-llama-bench` writes next to its build (else {})."""
        try:
            info = json.loads((binary.parent.parent / "build.json").read_text())
        except (OSError, ValueError):
            return {}
        ours = isinstance(info, dict) and any(k in info for k in ("llama_cpp_python", "llama_cpp_commit", "source"))
        return info if ours else {}

    @classmethod
    def spec_label(cls, path: str) -> str:
        """A short name of the build at `path` for cell ids ([A-Za-z0-9._+-]), read without running a model: the label
        build.json gives (a `moebench tools build-llama-bench` build), else the fork and git commit of the checkout
        the binary was built in (plus its build folder's name where that is not "build"), else the names of its
        parent folders."""
        binary = Path(path).expanduser().resolve()
        b = cls.build_info(binary)
        if b:
            return label_text(b.get("label") or f"llama.cpp-{b.get('llama_cpp_commit') or b.get('llama_cpp_python')}")
        c = checkout_of(binary.parent)
        if c:
            folder = binary.relative_to(c.root).parts[0]
            return label_text("-".join([c.fork, c.commit or "nogit"] + ([folder] if folder != "build" else [])))
        generic = {"bin", "build", "release", "out", "usr", "local"}
        names = [p.name for p in binary.parents if p.name and p.name.lower() not in generic][:2]
        return label_text("-".join(reversed(names)) or binary.parent.name)

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
        if b.get("commit"):
            return f"{b['commit']} ({b.get('fork', '?')} checkout)"
        return "unknown"

    @classmethod
    def version(cls) -> str:
        binary = cls.find()
        return cls.version_of(binary) if binary and binary.is_file() else "unknown"

    # --- flags ----------------------------------------------------------------------------------

    def _depth_flags(self, h: BenchHelp, n: int) -> list:
        if h.ik:
            # ik_llama.cpp's llama-bench --n-cpu-moe N overrides ffn_(up|down|gate)_exps of layers 0..N-1 and so misses
            # gemma4's merged ffn_gate_up_exps: the llama-cpp engine's patterns, one per layer, keep every routed
            # expert of the first N layers in host memory. Its -ot takes PATTERN=BUFFER_TYPE pairs split on ","
            # (the patterns hold none).
            return ["-ot", ",".join(f"{p}=CPU" for p in override_patterns(n))] if n else []
        flag = h.has("-ncmoe", "--n-cpu-moe")
        if not flag and n:
            raise ExternalError(f"this llama-bench ({self.binary}) has no -ncmoe/--n-cpu-moe flag; use a newer build "
                                f"(`moebench tools build-llama-bench`)")
        return [flag, n] if flag else []

    def _flags(self, s: EngineSettings) -> list[str]:
        """The cell's settings as flags this build understands (checked against its --help)."""
        h = self.help
        if not h.has("-m", "--model"):
            raise ExternalError(f"{self.binary} --help does not look like llama-bench's; output tail: {tail(h.text)}")
        flags = ["-m", str(self.model), "-b", s.n_batch, "-ub", s.n_ubatch, "-t", s.threads, "-ngl", 99,
                 "-o", h.output_format(self.binary), *self._depth_flags(h, s.n_cpu_moe)]
        fa = re.search(r"-fa, --flash-attn <([^>]*)>", h.text)
        if fa and "auto" in fa.group(1):
            flags += ["-fa", s.flash_attn]
        elif s.flash_attn != "auto":          # older builds and ik_llama.cpp: -fa <0|1>, their own default
            flags += ["-fa", int(s.flash_attn == "on")]
        if h.has("-lm", "--load-mode"):
            flags += ["-lm", "mmap" if s.mmap else "none"]
        elif h.has("-mmp", "--mmap"):
            flags += ["-mmp", int(s.mmap)]
        self.repack = self.repack_on(s.extra, self.binary)
        self.no_host = switch(s.extra.get("no_host", False))
        # passed when asked (or forced off), so an older llama-bench without the flags still runs its defaults
        for flag, on, asked in (("--repack", self.repack, "repack" in s.extra or not self.repack),
                                ("--no-host", self.no_host, "no_host" in s.extra)):
            if asked and not h.has(flag):
                raise ExternalError(f"this llama-bench ({self.binary}) has no {flag} flag; use a newer build "
                                    f"(`moebench tools build-llama-bench`)")
            flags += [flag, int(on)] if asked else []
        for knob, names in IK_KNOBS.items():     # ik_llama.cpp's; its defaults (rtr 0, fmoe 1) unless asked
            if knob in s.extra:
                if not h.has(*names):
                    raise ExternalError(f"{knob}={s.extra[knob]} asks for ik_llama.cpp's {names[1]}, which this "
                                        f"llama-bench ({self.binary}) does not have; drop {knob}= or give an "
                                        f"ik_llama.cpp llama-bench with bin=PATH.")
                flags += [h.has(*names), int(switch(s.extra[knob]))]
        return [str(f) for f in flags]

    def _bench(self, n_prompt: int, n_gen: int, n_depth: int, reps: int, warmup: bool = True,
               verbose: bool = False) -> tuple[dict, Completed]:
        h = self.help
        want, depth = (n_prompt, n_gen, n_depth), []
        if n_depth and h.has("-d", "--n-depth"):
            depth = ["-d", n_depth]
        elif n_depth and n_prompt == 0 and h.has("-gp"):
            # ik_llama.cpp's llama-bench: -gp D,N times N generated tokens after an untimed D-token prompt, in each
            # repetition (its record: n_prompt=D, n_gen=N)
            want, depth, n_gen = (n_depth, n_gen, 0), ["-gp", f"{n_depth},{n_gen}"], 0
        elif n_depth:
            raise ExternalError(f"this llama-bench ({self.binary}) has no -d/--n-depth flag for @d{n_depth} "
                                f"workloads" + (" (its -gp times only generation after a prompt)" if h.has("-gp")
                                                else ""))
        argv = [self.binary, *self.flags, "-p", n_prompt, "-n", n_gen, "-r", reps, *depth]
        if not warmup and h.has("--no-warmup"):
            argv.append("--no-warmup")
        elif not warmup and h.has("-w", "--warmup"):
            argv += [h.has("-w", "--warmup"), 0]
        if verbose:
            argv.append(h.has("-v", "--verbose"))
        done = self.run(argv, echo_chars=ECHO_CHARS if verbose else None)
        return pick_record(parse_records(done.stdout, h.output_format(self.binary)), *want, done.output), done

    # --- Engine ---------------------------------------------------------------------------------

    def load(self, model: Path, s: EngineSettings) -> None:
        self.s, self.model, self.meta = s, model, read_meta(model)
        self.binary = self.locate(s)
        self.help = help_of(self.binary)
        self.flags = self._flags(s)
        # the probe runs verbose where the build can, so that its load log tells where the experts went
        verbose = bool(self.help.has("-v", "--verbose"))
        self.probe, done = self._bench(1, 0, 0, 1, warmup=False, verbose=verbose)
        # None where the log cannot tell: a build without -v, or one whose log printed no loader lines
        self.placed = host_layers(done.output, self.meta) if verbose and LOADER.search(done.output) else None
        if self.placed is not None:
            print(f"moebench: the load log shows {self.placed[1]} tensors overridden to host memory; routed experts of "
                  f"layers {self.placed[0] or 'none'} kept there", flush=True)
        if self.help.ik and s.n_cpu_moe and self.placed == ([], 0) and not self._ik_gpu():
            # ik_llama.cpp's llama_model_load_from_file sets n_gpu_layers 0 without a GPU and then drops every
            # tensor override (and its ncmoe): on a CPU-only build a depth places nothing
            print(f"moebench: ik_llama.cpp applies no tensor overrides without a GPU: --n-cpu-moe {s.n_cpu_moe} placed "
                  f"nothing here (all weights are in host memory anyway)", flush=True)

    def measure(self, workload, repetitions: int, warmup: int, seed: int) -> list[int]:
        # llama-bench runs one warm-up itself (skipped with --no-warmup when we are asked for none);
        # its token ids are its own random ones, not our seeded stream.
        record, _ = self._bench(workload.n_prompt, workload.n_gen, workload.n_depth, repetitions, warmup > 0)
        return samples_ns(record, repetitions)

    def known_work(self) -> dict:
        """compute_dtype and weights (engines.base) where the probe's record tells them, left out where not known.
        Upstream: llama.cpp's CPU arithmetic (llama_cpp.compute_dtype with the weight-type rule: this process has not
        loaded the binary's ggml) when its only backend was the CPU's; the weights from its load mode and --repack,
        and whether a weight of this file goes into an extra buffer type (ggml_build.extra_buft, as `plan` predicts).
        ik_llama.cpp: its own rules (ik_compute_dtype, ik_weights)."""
        if self.help.ik:
            return self._ik_known_work()
        p, out = self.probe, {}
        if p.get("backends") == "CPU":          # a BLAS or GPU backend takes some products its own way
            out["compute_dtype"] = compute_dtype(self.meta, weight_arithmetic)
        mode = str(p["load_mode"]) if "load_mode" in p else {True: "mmap", False: "none"}.get(p.get("use_mmap"), "auto")
        if mode != "auto":                      # auto: llama.cpp decides by itself, and the record does not say
            bufts = ggml_build.cpu_bufts() if p.get("repack", self.repack) else {}
            repacked = any(ggml_build.extra_buft(t.name, t.ne, t.ggml_type, bufts) for t in self.meta.tensors)
            out["weights"] = "copy" if "mmap" not in mode else "mapped+repacked-copy" if repacked else "mapped"
        return out

    def _ik_gpu(self, *names: str) -> bool:
        """Whether ik_llama.cpp's record names a backend besides the CPU's (its "rpc" field is the string "0"/"1")."""
        return any(self.probe.get(k) not in (None, False, "0", 0) for k in names or IK_BACKENDS)

    def _ik_known_work(self) -> dict:
        p, out = self.probe, {}
        if not self._ik_gpu():
            words = ik_compute_dtype(self.meta)
            out |= {"compute_dtype": words} if words else {}
        weights = ik_weights(self.meta, mmap=bool(p.get("use_mmap", True)), rtr=bool(p.get("repack", False)),
                             n_overridden=self.placed[1] if self.placed is not None else None)
        return out | ({"weights": weights} if weights else {})

    def info(self) -> EngineInfo:
        p, s, ik = self.probe, self.s, self.help.ik
        effective = {ours: p[theirs] for theirs, ours in (IK_EFFECTIVE if ik else EFFECTIVE).items() if theirs in p}
        effective |= self.known_work()
        layers = self.placed[0] if self.placed is not None else None
        accelerator = self._ik_gpu() if ik else p.get("backends", "CPU") not in ("CPU", "BLAS", "CPU,BLAS")
        in_host = base.host_layers(layers or [], self.meta.moe_layers, accelerator) \
            if layers is not None or not accelerator else None
        if ik:          # its record has no n_cpu_moe: the depth it ran is the overrides its log shows, where first-N
            effective["backends"] = ",".join(k.upper() for k in IK_BACKENDS if self._ik_gpu(k)) or "CPU"
            if layers is not None and layers == list(range(len(layers))):
                effective["n_cpu_moe"] = len(layers)
            if "weights" in effective:      # its loader turns mmap off by itself (ik_weights)
                effective["mmap"] = effective["weights"] == "mapped"
        effective |= {"n_ctx": "n_prompt + n_gen + n_depth of each test (llama-bench sizes it per test)",
                      "load": "inside every llama-bench run (load_s = a 1-token probe run)",
                      "binary": str(self.binary), "argv": self.flags, "fork": IK if ik else UPSTREAM,
                      "ggml_compiler": ggml_build.compiler_of(self.binary)}
        host = (sum(t.n_bytes for t in self.meta.tensors if t.layer is not None and t.layer in layers)
                if layers is not None else self.meta.expert_bytes(int(p.get("n_cpu_moe", s.n_cpu_moe))))
        return EngineInfo(
            engine=self.name, version=self.version_of(self.binary, p), settings=effective,
            bytes_by_device={},            # llama-bench reports no per-buffer sizes; see extra.model_size
            expert_bytes_host=host, expert_bytes_total=self.meta.expert_bytes(),
            n_overridden_tensors=self.placed[1] if self.placed is not None else None, cpu_moe_layers=in_host,
            extra={"probe": {k: v for k, v in p.items() if k not in ("samples_ns", "samples_ts")},
                   "build": self.build_info(self.binary)})
