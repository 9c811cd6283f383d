"""A decode profile per token and per layer: where one decoded token's time goes in the reference engine (on each
CPU kernel variant this CPU runs) and in llama.cpp, beside the bytes each part reads and the host's read bandwidth.

    .venv/bin/python benchmarks/decode_profile.py preset:qwen3-30b-a3b-4l:q4_k_m -d 4096 -n 128 -t 2

Components of a token; bytes from the file's tensors as harness.planning.plan's model_bytes counts them for the
roofline's decode bound, split by tensor name (both engines hold the file's bytes and an f16 KV cache):
  attention  each layer's attn_* (a recurrent layer's ssm_*) tensors and the KV cache cells read at the position (a
             sliding-window layer: its window), with the residual add after it
  experts    the routed experts: the distinct experts a layer runs for the token x its bytes per expert
  rest       the rest of each layer: norms, router, shared expert or dense MLP
  head       output norm and output matrix (the token embedding where the head is tied)
  other      the token's time outside the above: the embedding row, Python, the engine's own steps
Reference engine: one child process per variant (MOEBENCH_ISA), where the calls of its model that compute each part
are timed, wrapped on that one model instance (its blocks, attention, routed experts and head; the class untouched):
rest = a block's time minus its attention and experts calls, the Python between them included.
llama.cpp (llama-cpp-python, a child process): a context whose eval callback (cb_eval) asks for every node that
computes (not views), so the scheduler runs the nodes one at a time and each is timed between its two callbacks;
nodes are grouped by the weight they multiply and their names (node_components): MUL_MAT_ID on *_exps and the
ffn_moe_* expert ops (not the router's) = experts, a layer's other nodes up to its residual add after attention =
attention, then rest; after the last layer = head. Run node by node a graph is slower, so its times are shown as
shares of its plain token time (measured without the callback); the raw callback times are in tokens.csv.
Both engines decode the harness's tokens of tg<N>@d<D> (workloads.tokens) after D untimed context tokens, once to
warm up, --reps times plainly (the tok/s shown) and once profiled. Bandwidth: harness.hw.probe's read probe at the
same thread count, the best of it and this host's earlier probes (harness.planning.roofline.read_gbps), as a sweep's
bound divides by. Writes profile.md, components.csv, layers.csv and tokens.csv into --out.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.base import EngineSettings, parse_depth  # noqa: E402
from engines.gguf_meta import read_meta  # noqa: E402
from workloads.grammar import Workload  # noqa: E402
from workloads.tokens import workload_tokens  # noqa: E402

COMPONENTS = ("attention", "experts", "rest", "head", "other")
LAYER_PARTS = COMPONENTS[:3]
NO_OP = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})        # ggml ops that compute nothing
# llama.cpp's ffn_moe_* nodes that are not the experts' own (the router's, gemma4's sum of MLP and experts)
NOT_EXPERTS = ("ffn_moe_logits", "ffn_moe_probs", "ffn_moe_argsort", "ffn_moe_topk", "ffn_moe_weights", "ffn_moe_group",
               "ffn_moe_combined")
ATTENTION_ENDS = ("ffn_inp", "attn_out")      # the residual add after a layer's attention
NODE = re.compile(r"(.+?)-(\d+)(?: \(.*\))?")        # llama.cpp's node names: "<what>-<layer>"
NAN = float("nan")


@dataclass(frozen=True)
class Bytes:
    """The bytes one decoded token reads, per layer and component."""
    attention: list[int]          # per layer: attn_* / ssm_* tensors
    rest: list[int]               # per layer: its other non-expert tensors
    per_expert: list[int]         # per layer: one routed expert (its share of the layer's *_exps tensors)
    kv_cell: list[int]            # per layer: K + V bytes of one context cell
    window: list[int | None]      # per layer: the most cells a sliding-window layer reads (None: all of them)
    head: int
    other: int                    # one embedding row and the tensors outside the blocks that the head leaves
    n_used: int                   # experts a token routes to in a layer

    def token(self, pos: int, experts: list[int] | None = None) -> dict[tuple[int, str], float]:
        """(layer, component) -> bytes of the token at position pos (layer -1: head and other); experts: the distinct
        experts each layer ran (default n_used)."""
        out = {(-1, "head"): self.head, (-1, "other"): self.other}
        for il, cell in enumerate(self.kv_cell):
            cells = pos + 1 if self.window[il] is None else min(pos + 1, self.window[il])
            out[il, "attention"] = self.attention[il] + cell * cells
            out[il, "experts"] = self.per_expert[il] * (self.n_used if experts is None else experts[il])
            out[il, "rest"] = self.rest[il]
        return out


def token_bytes(meta) -> Bytes:
    """Bytes of meta's model as harness.planning.plan.model_bytes counts them (routed experts by layer, the KV cache's
    cells in its dtype), the other tensors split by name; blocks past the trunk (MTP) are not run, not counted."""
    from engines.reference.archs import hparams
    from engines.reference.placement import DTYPE_BYTES
    from harness.planning.plan import PlanSettings, cache_layout, model_bytes

    mb, cfg = model_bytes(meta, PlanSettings(engine="reference", device="cpu")), hparams(meta)
    n, swa = cfg.n_trunk, getattr(cfg, "is_swa", None)
    attention, rest, head, other = [0] * n, [0] * n, 0, 0
    tied = not any(t.name == "output.weight" for t in meta.tensors)
    for t in meta.tensors:
        if t.layer is not None:                  # a routed-expert tensor: per_expert
            continue
        if t.name.startswith("blk."):
            _, il, part = t.name.split(".", 2)
            if int(il) < n:
                (attention if part.startswith(("attn_", "ssm_")) else rest)[int(il)] += t.n_bytes
        elif t.name in ("output.weight", "output_norm.weight") or (tied and t.name == "token_embd.weight"):
            head += t.n_bytes
        else:
            other += t.n_bytes // t.ne[-1] if t.name == "token_embd.weight" else t.n_bytes     # a row a token
    return Bytes(attention, rest, [b // max(meta.n_expert, 1) for b in mb.expert_by_layer[:n]],
                 [h * (k + v) * DTYPE_BYTES[mb.kv_dtype] for h, k, v in cache_layout(meta)[0][:n]],
                 [cfg.n_swa if swa and swa(il) else None for il in range(n)], head, other, meta.n_expert_used)


class _Calls:
    """An object whose calls go through `call`, its other attributes its own (the model's MoE executor)."""

    def __init__(self, obj, call):
        self._obj, self._call = obj, call

    def __call__(self, *args, **kw):
        return self._call(*args, **kw)

    def __getattr__(self, name: str):
        return getattr(self._obj, name)


class RefClock:
    """The reference engine's times: the calls of one model instance that compute each component, wrapped on that
    instance (its class and every other model untouched, so nothing of this runs where it is not asked for): each
    block ("layer"), its attention (the model's attention/deltanet method, or the fused one-token step), its routed
    experts (the MoE executor) and the head. A token's record: mark(), after the token."""

    def __init__(self, model):
        self.model, self.tokens = model, []
        wrapped = [(model, "block", "layer"), (model, "head", "head")]
        wrapped += [(model, m, "attention") for m in ("attention", "deltanet") if hasattr(type(model), m)]
        if getattr(model, "fused", None) is not None:
            wrapped.append((model.fused, "attention", "attention"))
        for owner, name, component in wrapped:
            setattr(owner, name, self._timed(getattr(owner, name), component))
        model.moe = _Calls(model.moe, self._timed(model.moe, "experts"))
        self.reset()

    def _timed(self, fn, component: str):
        def timed(*args, **kw):
            if component == "layer":
                self.layer = args[0]
            t0 = time.perf_counter_ns()
            out = fn(*args, **kw)
            key = (-1 if component == "head" else self.layer, component)
            self.now[key] = self.now.get(key, 0) + time.perf_counter_ns() - t0
            if component == "experts":
                self.ids[self.layer] = args[2]            # moe(il, x, ids, w)
            return out
        return timed

    def reset(self) -> None:
        self.now, self.ids, self.layer = {}, {}, -1

    def mark(self) -> None:
        ns = dict(self.now)
        for il in [il for il, c in ns if c == "layer"]:
            ns[il, "rest"] = ns.pop((il, "layer")) - ns.get((il, "attention"), 0) - ns.get((il, "experts"), 0)
        experts = [len(set(self.ids[il].flatten().tolist())) if il in self.ids else 0
                   for il in range(self.model.cfg.n_layers)]
        self.tokens.append({"ns": [[il, c, v] for (il, c), v in ns.items()], "experts": experts})
        self.reset()


class _Tensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor (LlamaClock checks its name offset against ggml_get_name)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class LlamaClock:
    """llama.cpp's per-node times through its scheduler's eval callback (callback: llama_context_params.cb_eval): a
    node it asks for is computed alone, between the callback's ask and its answer; views are not asked for (they join
    the next node). A token's record: mark(), after the token."""

    def __init__(self, L):
        lib = L.llama_cpp._lib
        self.op_desc, self.get_name = lib.ggml_op_desc, lib.ggml_get_name
        self.op_desc.argtypes = self.get_name.argtypes = [ctypes.c_void_p]
        self.op_desc.restype, self.get_name.restype = ctypes.c_char_p, ctypes.c_void_p
        self.callback = L.ggml_backend_sched_eval_callback(self._eval)      # alive as long as the clock
        self.tokens, self.layout_ok, self.error = [], None, None
        self.reset()

    def reset(self) -> None:
        self.nodes, self.pending, self.t0 = [], None, 0      # nodes: (name, op, weight, ns) in graph order

    def _eval(self, t: int, ask: bool, _) -> bool:
        try:
            if not ask:                       # the node asked for has been computed
                self.nodes.append((*self.pending, time.perf_counter_ns() - self.t0))
                return True
            op = self.op_desc(t).decode()
            if op in NO_OP:
                return False
            if self.layout_ok is None:
                self.layout_ok = self.get_name(t) == t + _Tensor.name.offset
            node = _Tensor.from_address(t) if self.layout_ok else None
            weight = _Tensor.from_address(node.src[0]).name.decode(errors="replace") if node and node.src[0] else ""
            self.pending = (ctypes.string_at(self.get_name(t)).decode(errors="replace"), op, weight)
            self.t0 = time.perf_counter_ns()
            return True
        except Exception as e:               # noqa: BLE001 - raised inside C's call: kept for profile() to raise
            self.error = self.error or e
            return not ask

    def mark(self) -> None:
        ns = {}
        for key, node in zip(node_components(self.nodes), self.nodes):
            ns[key] = ns.get(key, 0) + node[3]
        self.tokens.append({"ns": [[il, c, v] for (il, c), v in ns.items()], "experts": None})
        self.reset()


def node_components(nodes: list[tuple]) -> list[tuple[int, str]]:
    """(layer, component) of each node of a llama.cpp graph, in order, from its name ("<what>-<layer>"), op and the
    weight it multiplies (nodes[i][:3]): MUL_MAT_ID on *_exps and the ffn_moe_* expert ops are experts; the other nodes
    of a layer are attention up to its residual add after attention (ffn_inp, gemma4's attn_out) or its first other
    ffn_* node, then rest; a node without a layer is the embedding (other) before the first layer, the head after the
    last, else goes with the node before it."""
    layered = [i for i, n in enumerate(nodes) if NODE.fullmatch(n[0])]
    first, last = (layered[0], layered[-1]) if layered else (len(nodes), -1)
    out, layer, ffn, prev = [], -1, False, (-1, "other")
    for i, (name, op, weight, *_) in enumerate(nodes):
        m = NODE.fullmatch(name)
        what = m.group(1) if m else ""
        if m and int(m.group(2)) != layer:
            layer, ffn = int(m.group(2)), False
        ffn |= what.startswith("ffn_") and what not in ATTENTION_ENDS
        if op == "MUL_MAT_ID" and "_exps" in weight or what.startswith("ffn_moe_") and not what.startswith(NOT_EXPERTS):
            prev = (layer, "experts")
        elif m or (first < i < last and ffn and prev[1] == "attention"):
            prev = (layer, "rest" if ffn else "attention")
        elif not first < i < last:
            prev = (-1, "other" if i < first else "head")
        ffn |= what in ATTENTION_ENDS
        out.append(prev)
    return out


@contextmanager
def eval_callback(L, callback):
    """LlamaCppEngine.load's context with cb_eval set, its settings otherwise its own (in this process)."""
    default = L.llama_context_default_params

    def with_callback():
        p = default()
        p.cb_eval = callback
        return p
    L.llama_context_default_params = with_callback
    try:
        yield
    finally:
        L.llama_context_default_params = default


def decode_run(engine, depth_tokens: list[int], tokens: list[int], clock=None) -> list[int]:
    """The harness's tg loop (harness.run.worker): reset, the untimed context, then each token decoded; the ns of
    each. clock: its record of each token taken between tokens (what the context left: dropped)."""
    engine.reset()
    if depth_tokens:
        engine.prefill(depth_tokens)
    if clock is not None:
        clock.reset()
    out = []
    for t in tokens:
        t0 = time.perf_counter_ns()
        engine.decode(t)
        out.append(time.perf_counter_ns() - t0)
        if clock is not None:
            clock.mark()
    return out


def profile(engine: str, model: str, n_cpu_moe: str = "all", n_depth: int = 0, n_tokens: int = 16, threads: int = 2,
            reps: int = 1, seed: int = 0) -> dict:
    """One engine's decode in this process: a warm-up, `reps` plain runs, one profiled run. JSON-able."""
    from engines import ggml_build
    from engines.registry import engine_class

    path, meta = Path(model), read_meta(Path(model))
    s = EngineSettings(n_cpu_moe=parse_depth(n_cpu_moe, meta.n_layers), n_ctx=n_depth + n_tokens, threads=threads)
    depth_tokens, tokens = workload_tokens(Workload(f"tg{n_tokens}", 0, n_tokens, n_depth), meta.n_vocab, seed, path)
    cls = engine_class(engine)
    e = cls()
    e.load(path, s)
    plain = [decode_run(e, depth_tokens, tokens) for _ in range(reps + 1)][1:]
    if engine == "reference":
        variant, clock = e.cpu_isa, RefClock(e.model)
    else:                                # the callback is set when the context is made: a second load
        variant, L = ggml_build.system_info_isa(e.system_info), e.L
        e.close()
        e, clock = cls(), LlamaClock(L)
        with eval_callback(L, clock.callback):
            e.load(path, s)
    wall = decode_run(e, depth_tokens, tokens, clock)
    e.close()
    if getattr(clock, "error", None) or getattr(clock, "layout_ok", True) is False:
        raise RuntimeError(f"llama.cpp's eval callback failed: {clock.error or 'its ggml_tensor is not _Tensor'}")
    return {"engine": engine, "variant": variant, "n_depth": n_depth, "plain_ns": plain, "wall_ns": wall,
            "tokens": clock.tokens}


def in_child(job: dict, isa: str | None = None) -> dict:
    """profile(**job) in a fresh process (MOEBENCH_ISA=isa: the reference kernels' variant)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MOEBENCH_ISA", None)
    env |= {"MOEBENCH_ISA": isa} if isa else {}
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{job['engine']} {isa or ''} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarize(p: dict, table: Bytes) -> dict:
    """A profile's means a token: ms and bytes by (layer, component), the token's ms (plain and profiled). The
    reference engine's other = its profiled token time minus its timed calls; llama.cpp's node times are scaled to
    its plain token time (shares of it)."""
    n, ms, nbytes = len(p["tokens"]), {}, {}
    for i, tok in enumerate(p["tokens"]):
        for il, c, ns in tok["ns"]:
            ms[il, c] = ms.get((il, c), 0.0) + ns / 1e6 / n
        for key, b in table.token(p["n_depth"] + i, tok["experts"]).items():
            nbytes[key] = nbytes.get(key, 0.0) + b / n
    plain = statistics.median(sum(r) / len(r) for r in p["plain_ns"]) / 1e6
    wall, raw = sum(p["wall_ns"]) / len(p["wall_ns"]) / 1e6, sum(ms.values())
    nodes = dict(ms)
    if p["engine"] == "reference":
        ms[-1, "other"] = wall - raw
        token = wall
    else:
        ms, token = {k: v * plain / raw for k, v in ms.items()}, plain
    return {"engine": p["engine"], "variant": p["variant"], "ms": ms, "bytes": nbytes, "token_ms": token,
            "plain_ms": plain, "wall_ms": wall, "raw_ms": raw, "node_ms": nodes}


def _total(d: dict, component: str | None = None) -> float:
    return sum(v for (_, c), v in d.items() if component in (None, c))


def component_rows(ref: dict, lcp: dict | None, gbps: float) -> list[dict]:
    """Per component and for the whole token: MB a token, then per engine ms a token, GB/s and % of gbps (and
    llama.cpp's unscaled node times)."""
    rows = []
    for c in (*COMPONENTS, None):
        b = _total(ref["bytes"], c)
        row = {"component": c or "token", "MB/token": b / 1e6}
        for side, s in (("ref", ref), ("llama", lcp)):
            if s is not None:
                t = s["token_ms"] if c is None else _total(s["ms"], c)
                rate = b / t / 1e6 if t > 0 else NAN
                row |= {f"{side} ms": t, f"{side} GB/s": rate, f"{side} % bw": 100 * rate / gbps}
        if lcp is not None:            # llama.cpp node by node, as its callback timed it (before the scaling)
            row["llama node ms"] = lcp["wall_ms"] if c is None else _total(lcp["node_ms"], c)
            row["ref/llama ms"] = row["ref ms"] / row["llama ms"] if row["llama ms"] > 0 else NAN
        rows.append(row)
    return rows


def layer_rows(ref: dict, lcp: dict | None, n_layers: int) -> list[dict]:
    """Per layer: MB and ms a token of attention, experts and rest, per engine."""
    rows = []
    for il in range(n_layers):
        row = {"layer": il} | {f"{c} MB": ref["bytes"].get((il, c), 0) / 1e6 for c in LAYER_PARTS}
        for side, s in (("ref", ref), ("llama", lcp)):
            row |= {f"{side} {c} ms": s["ms"].get((il, c), 0.0) for c in LAYER_PARTS} if s else {}
        rows.append(row)
    return rows


def token_rows(p: dict, table: Bytes, variant: str) -> list[dict]:
    """Every token, layer and component as measured (llama.cpp: its callback run's raw ns, not scaled)."""
    return [{"variant": variant, "engine": p["engine"], "token": i, "layer": il, "component": c, "raw_ms": ns / 1e6,
             "bytes": table.token(p["n_depth"] + i, tok["experts"]).get((il, c), 0)}
            for i, tok in enumerate(p["tokens"]) for il, c, ns in tok["ns"]]


def _md(rows: list[dict]) -> str:
    from harness.analysis.tables import markdown
    return markdown([{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="preset:small:q8_0",
                    help="GGUF file or preset:NAME[:DTYPE] (synthesized once into the cache); default %(default)s")
    ap.add_argument("-d", "--depth", type=int, default=0, help="context tokens before the decoded ones (D)")
    ap.add_argument("-n", "--tokens", type=int, default=64, help="tokens decoded and profiled (N)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="threads of both engines")
    ap.add_argument("--n-cpu-moe", default="all", help="layers whose routed experts stay in host RAM: N or all")
    ap.add_argument("--variants", default="",
                    help="reference kernel variants, comma-separated (avx2, avx512, amx); default: each this CPU runs")
    ap.add_argument("-r", "--reps", type=int, default=3, help="plain runs of each engine (tok/s: their median)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token stream (the harness's)")
    ap.add_argument("--no-llama", action="store_true", help="profile the reference engine only")
    ap.add_argument("--probe-mib", type=int, default=0,
                    help="read-bandwidth probe buffer in MiB (default: harness.hw.probe.read_buffer_bytes)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "decode-profile", help="directory of the tables")
    ap.add_argument("--child", default="", help="internal: run profile(**JSON) in this process, print its result")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(profile(**json.loads(args.child))))
        return
    from engines.devices import CPU_ISAS, cpu_flags
    from harness.analysis.tables import render
    from harness.hw.host import cache_mib, cpu_name
    from harness.hw.probe import read_bandwidth, with_host_best
    from harness.planning.roofline import memory_bound, read_gbps
    from workloads.synth import resolve_model

    flags = cpu_flags()
    variants = args.variants.split(",") if args.variants else \
        [v for v in ("avx2", "avx512", "amx") if set(CPU_ISAS[v]) <= flags]
    path = resolve_model(args.model)
    meta, T = read_meta(path), args.threads
    table = token_bytes(meta)
    probe = with_host_best(read_bandwidth([T], nbytes=args.probe_mib * 2**20 or None))
    gbps = read_gbps({"bandwidth": probe}, T)[0]
    job = {"model": str(path), "n_cpu_moe": args.n_cpu_moe, "n_depth": args.depth, "n_tokens": args.tokens,
           "threads": T, "reps": args.reps, "seed": args.seed}
    raw = {v: in_child(job | {"engine": "reference"}, v) for v in variants}
    raw_llama = None if args.no_llama else in_child(job | {"engine": "llama-cpp"})
    lcp = raw_llama and summarize(raw_llama, table)
    cache = (cache_mib() or 0) * 2**20
    token_b = sum(sum(table.token(args.depth + i).values()) for i in range(args.tokens)) / args.tokens
    isa_flags = " ".join(sorted({f for need in CPU_ISAS.values() for f in need} & flags))
    text = [f"# Decode profile: {path.name}, tg{args.tokens}@d{args.depth}, {T} threads, --n-cpu-moe {args.n_cpu_moe}",
            "", f"CPU: {cpu_name()}; flags: {isa_flags}; reference variants: {', '.join(variants)}"
            + (f"; llama.cpp: its {raw_llama['variant']} build" if raw_llama else ""),
            f"Read bandwidth at {T} threads: {gbps:.1f} GB/s (this run's probe: "
            f"{probe.get('threads', {}).get(str(T))} GB/s); a token reads {token_b / 1e6:.1f} MB, "
            f"{max(token_b - cache, 0) / 1e6:.1f} MB beyond the {cache / 2**20:.0f} MiB of CPU caches: bound "
            f"{memory_bound(token_b, gbps, cache):.1f} tok/s (harness.planning.roofline)"]
    comps, layers, tokens = [], [], [] if raw_llama is None else token_rows(raw_llama, table, raw_llama["variant"])
    for v, p in raw.items():
        ref = summarize(p, table)
        line = f"reference {ref['variant']}: {1e3 / ref['plain_ms']:.2f} tok/s plain ({ref['plain_ms']:.2f} ms a " \
               f"token, {ref['wall_ms']:.2f} profiled)"
        if lcp:
            line += f"; llama.cpp: {1e3 / lcp['plain_ms']:.2f} tok/s plain; reference/llama.cpp " \
                    f"{lcp['plain_ms'] / ref['plain_ms']:.3f}x. llama.cpp's ms: its nodes' shares of its plain token " \
                    f"time (run node by node: {lcp['wall_ms']:.2f} ms a token, {lcp['raw_ms']:.2f} in its nodes)"
        c_rows, l_rows = component_rows(ref, lcp, gbps), layer_rows(ref, lcp, len(table.attention))
        text += ["", f"## variant {v}", "", line, "", _md(c_rows), _md(l_rows)]
        comps += [{"variant": v} | r for r in c_rows]
        layers += [{"variant": v} | r for r in l_rows]
        tokens += token_rows(p, table, v)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.md").write_text("\n".join(text) + "\n")
    for name, rows in (("components", comps), ("layers", layers), ("tokens", tokens)):
        render(rows, "csv", out=args.out / f"{name}.csv")
    print("\n".join(text))
    print(f"tables: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
