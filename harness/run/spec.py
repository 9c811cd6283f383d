"""A sweep spec and its expansion into cells (engine x model x depth), validated before anything runs."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engines.base import ANY_WHOLE_NUMBER, EngineSettings, parse_depth
from engines.errors import UserError
from engines.gguf_meta import ModelMeta
from engines.registry import check_available
from harness.run.checks import read_checked
from harness.store.results import CellKey
from workloads.grammar import DEFAULT_WORKLOADS, parse_workloads
from workloads.synth import resolve_model


@dataclass
class SweepSpec:
    models: list[str]                       # paths, or preset:NAME[:DTYPE] (synthesized into the cache)
    engines: list[str]
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
    classes = {e: check_available(e) for e in spec.engines}
    for knob, values in spec.knobs.items():
        takes = [c for c in classes.values() if knob in c.knobs]
        if not takes:
            who = "-e reference" if knob.startswith("cache_") else "-e llama-cpp or llama-bench"
            raise UserError(f"None of the engines in -e ({', '.join(spec.engines)}) takes --{knob.replace('_', '-')}; "
                            f"drop it or add an engine that does ({who}).")
        allowed = takes[0].knobs[knob]
        for v in values:
            if not (str(v).isdigit() if allowed == ANY_WHOLE_NUMBER else str(v) in allowed):
                raise UserError(f"--{knob.replace('_', '-')} {v!r} is not valid; use "
                                f"{'a whole number' if allowed == ANY_WHOLE_NUMBER else ', '.join(allowed)}.")
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
        for engine in spec.engines:
            for knobs, variant in crossings(spec.knobs, classes[engine].knobs):
                for n, label in depths.items():
                    s = EngineSettings(n_cpu_moe=n, n_ctx=n_ctx, n_batch=spec.n_batch, n_ubatch=spec.n_ubatch,
                                       threads=spec.threads, flash_attn=spec.flash_attn, seed=spec.seed,
                                       extra=dict(spec.extra) | knobs)
                    cells.append(Cell(engine, meta.path, meta, label, s, variant=variant))
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
