"""A sweep spec and its expansion into cells (engine x model x depth), validated before anything runs."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engines.base import ANY_WHOLE_NUMBER, EngineSettings, parse_depth
from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.registry import check_available, engine_class
from harness.run.checks import read_checked
from harness.store.results import CellKey
from workloads.grammar import DEFAULT_WORKLOADS, parse_workloads
from workloads.synth import resolve_model


# an engine spec's keys that are sweep settings; every other key is an engine knob (EngineSettings.extra)
SPEC_KEYS = {"threads": int, "n_ctx": int, "n_batch": int, "n_ubatch": int, "flash_attn": str}
LABEL_CHARS = re.compile(r"[A-Za-z0-9._+-]+")    # a spec's values as they appear in cell ids and labels


@dataclass
class EngineSpec:
    """`NAME[@KEY=VALUE]...`: an engine with its own settings, e.g. `llama-cpp@threads=1`, `reference@experts=kt`,
    `llama-bench@bin=PATH@rtr=1` (bin: the binary of an external engine)."""
    text: str
    engine: str
    overrides: dict       # SweepSpec fields
    extra: dict           # engine-specific knobs


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_engine_spec(text: str) -> EngineSpec:
    """`llama-cpp@threads=1@n_ubatch=64` -> EngineSpec(engine='llama-cpp', overrides={...})."""
    name, *pairs = text.strip().split("@")
    overrides, extra = {}, {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (sep and key.strip() and value.strip()):
            raise UserError(f"Engine spec {text!r}: {pair!r} is not KEY=VALUE; write e.g. llama-cpp@threads=1.")
        key, value = key.strip(), value.strip()
        if key in SPEC_KEYS:
            try:
                overrides[key] = SPEC_KEYS[key](value)
            except ValueError:
                raise UserError(f"Engine spec {text!r}: {key} must be a whole number, not {value!r}.") from None
        else:
            extra[key] = _value(value)
    if not name.strip():
        raise UserError(f"Engine spec {text!r} has no engine name; "
                        "write NAME[@KEY=VALUE]..., e.g. llama-cpp@threads=1.")
    return EngineSpec(text.strip(), name.strip(), overrides, extra)


def knob_value_ok(allowed: tuple[str, ...], value) -> bool:
    """Whether an engine knob (Engine.knobs: its values, or ANY_WHOLE_NUMBER) takes `value`."""
    return str(value).isdigit() if allowed == ANY_WHOLE_NUMBER else str(value) in allowed


def allowed_text(allowed: tuple[str, ...]) -> str:
    return "a whole number" if allowed == ANY_WHOLE_NUMBER else ", ".join(allowed)


def spec_settings(es: EngineSpec, cls: type) -> tuple[dict, str]:
    """A sweep's engine spec -> (its engine settings, its label in cell ids: `key=value@...`). `bin=PATH` names an
    external engine's binary (settings.extra[cls.extra_key]), labelled by its build (cls.spec_label), since a path
    cannot be part of a cell id."""
    extra, label = {}, []
    for key, value in es.extra.items():
        if key == "bin":
            if not getattr(cls, "extra_key", ""):
                raise UserError(f"Engine spec {es.text!r}: {es.engine} runs no external binary, so it takes no bin=; "
                                f"drop it.")
            path = Path(str(value)).expanduser().absolute()
            if not path.is_file():
                raise UserError(f"Engine spec {es.text!r}: {path} is not a file; give the path of the "
                                f"{cls.binary_name} binary.")
            extra[cls.extra_key], value = str(path), cls.spec_label(str(path))
        else:
            allowed = getattr(cls, "knobs", {}).get(key)
            if allowed and not knob_value_ok(allowed, value):
                raise UserError(f"Engine spec {es.text!r}: {key}={value} is not valid; use {allowed_text(allowed)}.")
            extra[key] = value
        if not LABEL_CHARS.fullmatch(str(value)):
            raise UserError(f"Engine spec {es.text!r}: {key}={value!r} cannot name a cell (letters, digits and . _ + - "
                            f"only); give it as a sweep option instead.")
        label.append(f"{key}={value}")
    label += [f"{k}={v}" for k, v in es.overrides.items()]
    return extra, "@".join(label)


@dataclass
class SweepSpec:
    models: list[str]                       # paths, or preset:NAME[:DTYPE] (synthesized into the cache)
    engines: list[str]                      # engine specs (EngineSpec): NAME[@KEY=VALUE]...
    depths: list[str] = field(default_factory=lambda: ["0"])     # N or "all"
    workloads: list[str] = field(default_factory=lambda: DEFAULT_WORKLOADS.split(","))
    repetitions: int = 5
    warmup: int = 1
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_ctx: int | None = None                # None: the largest workload's need (same for every engine)
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: str = "auto"
    timeout_s: float = 3600
    sample_ms: float = 50                   # 0 turns the memory sampler off
    seed: int = 0
    extra: dict = field(default_factory=dict)   # engine-specific knobs, e.g. cpu_moe_threads
    knobs: dict = field(default_factory=dict)   # engine knobs crossed as lists, e.g. {"repack": ["0", "1"]}: every
                                                # engine that takes a knob (Engine.knobs) runs a cell per value
    trace_routing: bool = False             # engines that can (Engine.routing_traces) record a routing trace per
                                            # cell into <run_dir>/traces/ (the runner names the file)
    ray: str | None = None                  # Ray address (auto | ray://host:port): cells run on the cluster
    per_node: bool = False                  # with ray: every node runs every cell
    ray_nodes: list[str] = field(default_factory=list)   # with ray: only these nodes (hostname, IP, node-id prefix)
    rounds: int | None = None               # the sweep K times over, each cell in a fresh process per round
                                            # (None: default_rounds; with --interleave min(5, reps))
    round_order: str = "interleaved"        # interleaved: round 1 of every cell, then round 2 ...; back-to-back:
                                            # each cell's rounds one after the other (the old order, to compare)
    round_seed: int | None = None           # shuffles the order within each round; drawn and recorded when None
    until: float | None = None              # --until: add rounds until every compared ratio's 95 % interval is
                                            # within ±until (relative half-width), or max_rounds / max_minutes
    max_rounds: int = 10                    # with until: rounds in all, the first ones included
    max_minutes: float | None = None        # with until: no new round starts after this long

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SweepSpec":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


ROUND_ORDERS = ("interleaved", "back-to-back")
DEFAULT_ROUNDS = 3      # with more than one engine: each engine's cells see the machine of every part of the sweep


def default_rounds(spec: SweepSpec) -> int:
    """--rounds when not given: DEFAULT_ROUNDS when more than one engine is swept (a fair table on a drifting
    machine), else 1; 1 on Ray (a cell runs once on its node)."""
    if spec.ray or spec.per_node or spec.ray_nodes:
        return 1
    return DEFAULT_ROUNDS if len(spec.engines) > 1 else 1


@dataclass
class Cell:
    engine: str
    model: Path
    meta: ModelMeta
    depth: str          # as asked ("all", "4")
    settings: EngineSettings
    arm: str = ""       # --interleave: "A" | "B"
    node: str = ""      # --ray --per-node: the node it is pinned to
    variant: str = ""   # the crossed knobs of more than one value: "repack=0@no_host=1"

    @property
    def key(self) -> CellKey:
        return CellKey(self.engine, self.meta.fingerprint, self.settings.n_cpu_moe, self.arm, self.node, self.variant)

    @property
    def cell_id(self) -> str:
        return self.key.cell_id


def expand(spec: SweepSpec) -> list[Cell]:
    """Every cell of the sweep, after checking every input; raises UserError on the first bad one."""
    if spec.repetitions < 1:
        raise UserError(f"--repetitions {spec.repetitions} must be at least 1.")
    if spec.rounds is not None and spec.rounds < 1:
        raise UserError(f"--rounds {spec.rounds} must be at least 1.")
    if spec.round_order not in ROUND_ORDERS:
        raise UserError(f"--round-order {spec.round_order!r} is not valid; use {' or '.join(ROUND_ORDERS)}.")
    if spec.threads < 1:
        raise UserError(f"--threads {spec.threads} must be at least 1; leave --threads out to use all "
                        f"{os.cpu_count() or 1} cores.")
    if "cpu_moe_threads" in spec.extra and int(spec.extra["cpu_moe_threads"]) < 1:
        raise UserError(f"--cpu-moe-threads {spec.extra['cpu_moe_threads']} must be at least 1; leave it out for the "
                        "engine's own rule.")
    if spec.flash_attn not in ("on", "off", "auto"):
        raise UserError(f"--flash-attn {spec.flash_attn!r} is not valid; use on, off or auto.")
    if not spec.engines:
        raise UserError("No engines given; pass e.g. -e llama-cpp,reference.")
    if not spec.models:
        raise UserError("No model given; pass -m FILE.gguf or -m preset:tiny.")
    workloads = parse_workloads(",".join(spec.workloads))
    specs = [parse_engine_spec(e) for e in spec.engines]
    # an engine given its binary (bin=) needs no other one to be found
    classes = {es.engine: engine_class(es.engine) if "bin" in es.extra else check_available(es.engine) for es in specs}
    own = {es.text: spec_settings(es, classes[es.engine]) for es in specs}
    seen: dict[tuple, str] = {}
    for es in specs:
        key = (es.engine, own[es.text][1])
        if key in seen:
            raise UserError(f"Engine specs {seen[key]!r} and {es.text!r} name the same cells; drop one.")
        seen[key] = es.text
    for knob, values in spec.knobs.items():
        takes = [c for c in classes.values() if knob in c.knobs]
        if not takes:
            who = "-e reference" if knob.startswith("cache_") else "-e llama-cpp or llama-bench"
            raise UserError(f"None of the engines in -e ({', '.join(spec.engines)}) takes --{knob.replace('_', '-')}; "
                            f"drop it or add an engine that does ({who}).")
        allowed = takes[0].knobs[knob]
        for v in values:
            if not knob_value_ok(allowed, v):
                raise UserError(f"--{knob.replace('_', '-')} {v!r} is not valid; use {allowed_text(allowed)}.")
    n_ctx = spec.n_ctx or max(w.n_ctx_needed for w in workloads)
    if n_ctx < max(w.n_ctx_needed for w in workloads):
        raise UserError(f"--n-ctx {n_ctx} is smaller than the largest workload needs "
                        f"({max(w.n_ctx_needed for w in workloads)}); raise it or leave it unset.")
    cells = []
    for m in spec.models:
        meta = read_checked(resolve_model(m, spec.seed))   # what every engine needs of the file, before any cell
        check_static_trace(spec, meta, workloads)
        depths: dict[int, str] = {}
        for d in spec.depths:
            depths.setdefault(parse_depth(d, meta.n_layers), d)
        for es in specs:
            extra, spec_label = own[es.text]
            for knobs, variant in crossings(spec.knobs, classes[es.engine].knobs):
                for n, label in depths.items():
                    s = EngineSettings(n_cpu_moe=n, n_ctx=n_ctx, n_batch=spec.n_batch, n_ubatch=spec.n_ubatch,
                                       threads=spec.threads, flash_attn=spec.flash_attn, seed=spec.seed,
                                       extra=dict(spec.extra) | extra | knobs)
                    s = replace(s, **es.overrides)
                    cells.append(Cell(es.engine, meta.path, meta, label, s,
                                      variant="@".join(v for v in (spec_label, variant) if v)))
    return cells


def check_static_trace(spec: SweepSpec, meta: ModelMeta, workloads: list) -> None:
    """--cache-policy static pins the experts a routing trace used most. Refuse a trace recorded on the token stream
    this sweep times (the same seed and kind: the same tokens, routed the same way): its pins would be chosen on the
    very tokens they are then timed on. A segment matches when its workload's tokens at this --seed hash as the
    trace recorded them (the worker's stream, workloads.tokens.workload_tokens)."""
    path = spec.extra.get("cache_static_trace")
    if not path or "static" not in [*map(str, spec.knobs.get("cache_policy", [])), str(spec.extra.get("cache_policy"))]:
        return
    import numpy as np

    from engines.routing import load_trace, token_hash
    from workloads.grammar import parse_workload
    from workloads.tokens import workload_tokens

    trace = load_trace(Path(path))
    header = trace.header
    if header["fingerprint"] != meta.fingerprint:       # another model's trace: the engine says so
        return
    rows = np.bincount(trace.segment, minlength=len(header["segments"]))     # tokens a segment's run processed
    timed = {w.stream for w in workloads}
    for name, digest, n in zip(header["segments"], header["token_hash"], rows):
        try:
            w = parse_workload(name)
        except UserError:                               # a name this version does not know: not a stream it times
            continue
        if w.stream not in timed or w.n_ctx_needed != n:
            continue
        depth, tokens = workload_tokens(w, meta.n_vocab, spec.seed, meta.path)
        if token_hash(depth + tokens) == digest:
            raise UserError(f"--cache-static-trace {Path(path).name} was recorded on the token stream this sweep times "
                            f"({w.stream}, --seed {spec.seed}), so static would pin the experts of the very tokens it "
                            f"is timed on; record the trace with another --seed (e.g. --seed {spec.seed + 1}).")


def crossings(knobs: dict[str, list], takes) -> list[tuple[dict, str]]:
    """Every combination of the knob values an engine takes -> (its extra settings, its variant label: the knobs
    of more than one value as `k=v@k2=v2`, so one-value knobs keep the plain engine name and cell id)."""
    mine = {k: [str(v) for v in vs] for k, vs in knobs.items() if k in takes}
    out: list[tuple[dict, list[str]]] = [({}, [])]
    for k, vs in mine.items():
        out = [(extra | {k: int(v) if v.isdigit() else v}, label + ([f"{k}={v}"] if len(vs) > 1 else []))
               for extra, label in out for v in vs]
    return [(extra, "@".join(label)) for extra, label in out]
