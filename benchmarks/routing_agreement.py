"""Routing agreement between the reference engine and llama.cpp on the same file and tokens (issue 23).

For each architecture the reference engine runs (a synthesized preset each), an f32 file and one quantized
file: both engines prefill the same seeded random token ids from position 0; the reference engine's routing
comes from its routing trace (engines.routing, extra trace_routing), llama.cpp's from its eval callback
(engines.llama_cpp_routing). Printed per file: the mean over layers and the worst layer of the top-k set
overlap (Jaccard, 1 = the same experts for every token). A trace of one engine predicts another only as well
as this number says.

    .venv/bin/python benchmarks/routing_agreement.py [--tokens 256] [--n-ubatch 64] [--only ARCH,...] [--plant ZIPF]

Each llama.cpp run happens in a child process (a crash ends that row, not the table).
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (architecture, preset, keyword overrides for workloads.synth.preset, quantized file type)
CASES = [
    ("qwen3moe", "tiny", {}, "q4_k_m"),
    ("qwen3moe", "small", {}, "q4_k_m"),
    ("qwen2moe", "tiny", {"arch": "qwen2moe", "n_ff_shexp": 96}, "q4_k_m"),
    ("olmoe", "tiny", {"arch": "olmoe", "n_head_kv": 4}, "q4_k_m"),
    ("llama", "tiny", {"arch": "llama"}, "q4_k_m"),
    ("gpt-oss", "gpt-oss-tiny", {}, "mxfp4"),
    ("gemma4", "gemma4-tiny", {}, "iq4_xs"),
    ("qwen35moe", "qwen35moe-tiny", {}, "iq4_xs"),
]


def reference_routing(model: Path, tokens: list[int], n_ubatch: int = 64, threads: int = 2) -> np.ndarray:
    """The reference engine's top-k ids for tokens prefilled from position 0, (T, L, k) int32, from its trace."""
    from engines.base import EngineSettings
    from engines.reference.engine import ReferenceEngine
    from engines.routing import load_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.npz"
        e = ReferenceEngine()
        e.load(Path(model), EngineSettings(n_ctx=len(tokens) + 8, n_ubatch=n_ubatch, threads=threads,
                                           extra={"trace_routing": str(path)}))
        try:
            e.trace_segment("agreement", tokens)
            e.prefill(tokens)
            e.trace_segment(None)
        finally:
            e.close()
        return load_trace(path).ids.astype(np.int32)


def _llama(conn, model: str, tokens: list[int], n_ubatch: int, threads: int) -> None:
    try:
        from engines.llama_cpp_routing import llama_cpp_routing
        conn.send((True, llama_cpp_routing(model, tokens, n_ubatch, threads)))
    except BaseException as e:
        conn.send((False, f"{type(e).__name__}: {e}"))


def llama_isolated(model: Path, tokens: list[int], n_ubatch: int, threads: int) -> np.ndarray:
    """llama_cpp_routing in a spawned child; a crash or an error raises RuntimeError with its cause."""
    ctx = multiprocessing.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_llama, args=(tx, str(model), tokens, n_ubatch, threads))
    p.start()
    tx.close()
    try:
        ok, value = rx.recv()
    except EOFError:
        ok, value = False, None
    p.join()
    if value is None:
        value = f"llama.cpp's child died (exit code {p.exitcode})"
    if not ok:
        raise RuntimeError(value)
    return value


def model_file(arch: str, name: str, kw: dict, dtype: str, out: Path, zipf: float | None) -> Path:
    from workloads.planted import Planting
    from workloads.synth import get_preset, preset, synthesize

    p = preset(get_preset(name), dtype, **kw)
    path = out / f"{arch}-{name}-{dtype}{f'-zipf{zipf:g}' if zipf is not None else ''}.gguf"
    return path if path.exists() else synthesize(p, path, seed=0, routing=Planting(zipf) if zipf is not None else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--n-ubatch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated architectures or presets (default: all)")
    ap.add_argument("--plant", type=float, default=None, help="plant routing with this Zipf exponent")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "moebench-agreement"))
    a = ap.parse_args()
    from engines.gguf_meta import read_meta
    from engines.llama_cpp_routing import set_overlap

    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    only = {x for x in a.only.split(",") if x}
    print(f"{'arch':10} {'preset':15} {'dtype':8} {'tokens':>6} {'layers':>6} {'mean J':>7} {'min J':>7}  same ids")
    for arch, name, kw, qtype in CASES:
        if only and not only & {arch, name}:
            continue
        for dtype in ("f32", qtype):
            try:
                path = model_file(arch, name, kw, dtype, out, a.plant)
                n_vocab = read_meta(path).n_vocab
                tokens = np.random.default_rng(0).integers(1, n_vocab, a.tokens).tolist()
                ref = reference_routing(path, tokens, a.n_ubatch, a.threads)
                lcpp = llama_isolated(path, tokens, a.n_ubatch, a.threads)
                j = set_overlap(ref, lcpp)
                exact = float(np.mean(np.sort(ref, -1) == np.sort(lcpp, -1)))
                print(f"{arch:10} {name:15} {dtype:8} {len(tokens):6} {len(j):6} {j.mean():7.4f} "
                      f"{j.min():7.4f}  {exact:.4f}", flush=True)
            except Exception as e:   # one row's failure is reported in its row
                print(f"{arch:10} {name:15} {dtype:8} failed: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
