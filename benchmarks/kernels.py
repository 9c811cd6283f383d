"""Throughput of the GGUF quant kernels (engines.reference.kernels.quant_kernels) per ggml type and
ISA variant, next to the machine's read bandwidth and llama.cpp's own CPU kernels.

- matvec: GB/s of weight bytes on N x K matrices (default 4096 x 4096) that are not in cache: each
  repetition cycles through copies totalling > 64 MiB. 1 and 2 threads, each next to the read
  bandwidth at that thread count measured as `moebench probe` does (harness/hw/probe.py: torch sum
  over a 256 MiB f32 tensor, median of the repetitions).
- ggml: llama.cpp's vec_dot for the type (ggml_get_type_traits_cpu from llama_cpp's libggml-cpu,
  built -march=native, so its x86 AVX2/AVX512 paths) over all rows of the same matrices, one
  thread, x converted once by its from_float to the vec_dot_type: the per-thread reference for our
  1-thread matvec. --ggml-lib DIR takes libggml-base.so/libggml-cpu.so from DIR instead, e.g. an
  AVX2-only build for the avx2 variant (cmake ggml/ -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
  -DGGML_F16C=ON -DGGML_AVX512=OFF -DBUILD_SHARED_LIBS=ON; make ggml-cpu).
- moe_decode: GB/s of the expert bytes one token reads, on Qwen3-30B-A3B, gpt-oss-20b and gemma-4-26B-A4B
  shapes (those with a type among --types); moe_prefill: GFLOP/s of --prefill-tokens tokens (512: ~32 rows
  an expert at k 8 of 128). Each in every weight layout of --layouts the type has (ggml: as stored; x8: 8 rows
  interleaved, QuantKernels.host_layout), interleaved with the file layout in every repetition.
- matmul: GFLOP/s for n = 16, 64, 512 activation rows against ATen's f32 GEMM (and bf16 where the
  CPU has avx512_bf16) on the same shape as a float tensor.
- --engine f16,q8_0,q4_k_m,mxfp4: instead of the tables above, the whole reference engine on
  preset:small files of those types, on each ISA variant, next to llama.cpp (engines.llama_cpp): load
  with n_ctx 1024, 2 threads, n_ubatch 512, warm up, then --reps times pp512 (prefill 512 tokens into an
  empty cache) and tg64 (64 single-token decodes after 8 prompt tokens); one process per engine, variant
  and type (MOEBENCH_ISA picks the variant), run one after another per type.
Variants run interleaved inside each repetition, so machine drift falls on all of them; figures
are the median (and best) over repetitions. On a 2-core machine, measure only while nothing else runs.

    .venv/bin/python benchmarks/kernels.py [--types Q4_K,Q6_K] [--isa avx2,avx512] [--threads 1,2]
        [--reps 7] [--shape 4096x4096] [--matmul-types Q4_K,Q8_0,MXFP4,BF16] [--no-matmul] [--no-moe]
        [--no-ggml] [--ggml-lib DIR] [--no-matvec] [--prefill-tokens 512] [--layouts ggml,x8]
    .venv/bin/python benchmarks/kernels.py --engine f16,q8_0,q4_k_m,mxfp4 [--isa avx2,avx512] [--reps 5]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines import devices  # noqa: E402
from engines.reference import kernels  # noqa: E402
from engines.reference.qtensor import COMPUTED, TYPES, QTensor  # noqa: E402

ALL = list(COMPUTED)
GGML_TYPE_Q8_K = 15

# one thread timing a ggml vec_dot over every row (ctypes would add ~1 us a row)
GGML_ROWS = r"""
#include <torch/extension.h>
#include <chrono>
typedef void (*vec_dot_t)(int n, float* s, size_t bs, const void* x, size_t bx, const void* y, size_t by, int nrc);
// seconds for out[r] = row r of w . xq, r < n_rows
double ggml_rows(int64_t fn, int64_t w, int64_t row_bytes, int64_t n_rows, int64_t xq, int64_t k, int64_t out) {
  const auto f = (vec_dot_t)fn;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < n_rows; ++r)
    f((int)k, (float*)out + r, 0, (const char*)w + r * row_bytes, 0, (const void*)xq, 0, 1);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
"""


class Ggml:
    """llama_cpp's libggml-base (ggml_quantize_chunk) and libggml-cpu (type traits)."""

    class Traits(ctypes.Structure):       # struct ggml_type_traits_cpu, ggml/include/ggml-cpu.h
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    def __init__(self, lib: Path | None = None):
        if lib is None:
            import llama_cpp
            lib = Path(llama_cpp.__file__).parent / "lib"
        self.lib = lib
        self.base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.base.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.base.ggml_row_size.restype = ctypes.c_size_t
        self.base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(self.Traits)
        self.cpu.ggml_cpu_init()
        self._rows = None

    def quantize(self, t: str, a: np.ndarray) -> torch.Tensor:
        """a (N, K) f32 -> the bytes of type t (ggml_quantize_chunk covers every type here)."""
        code, block, size = TYPES[t]
        n, k = a.shape
        raw = np.empty(n * k // block * size, np.uint8)
        src = np.ascontiguousarray(a, np.float32)
        self.base.ggml_quantize_chunk(code, src.ctypes.data, raw.ctypes.data, 0, n, k, None)
        return torch.from_numpy(raw)

    def vec_dot(self, t: str, x: np.ndarray):
        """(vec_dot function pointer, x converted to its vec_dot_type: bytes kept alive by the caller)."""
        tr = self.cpu.ggml_get_type_traits_cpu(TYPES[t][0]).contents
        xq = np.empty(self.base.ggml_row_size(tr.vec_dot_type, x.size), np.uint8)
        from_float = self.cpu.ggml_get_type_traits_cpu(tr.vec_dot_type).contents.from_float
        convert = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(from_float)
        convert(x.ctypes.data, xq.ctypes.data, x.size)
        return tr.vec_dot, xq

    def rows(self):
        if self._rows is None:
            from torch.utils.cpp_extension import load_inline

            from engines.paths import cache_dir
            build = cache_dir() / "kernels" / f"torch-{torch.__version__}" / "ggml-rows"
            build.mkdir(parents=True, exist_ok=True)
            self._rows = load_inline("moebench_ggml_rows", GGML_ROWS, functions=["ggml_rows"], extra_cflags=["-O3"],
                                     build_directory=str(build)).ggml_rows
        return self._rows


def read_gbps(threads: int, reps: int) -> list[float]:
    """harness/hw/probe.py's host_read_gbps: torch sum over 256 MiB of f32."""
    torch.set_num_threads(threads)
    size = 256 * 2**20
    x = torch.empty(size // 4, dtype=torch.float32).uniform_()
    x.sum()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        out.append(size / (time.perf_counter() - t0) / 1e9)
    return out


def med_best(v: list[float]) -> str:
    return f"{statistics.median(v):6.1f} ({max(v):5.1f})"


def bench_matvec(args, qks: dict, gg: Ggml, read: dict[int, float]):
    N, K = args.shape
    rng = np.random.default_rng(0)
    vs_ggml = not args.no_ggml
    cols = [f"{isa} {th}T" for isa in qks for th in args.threads] + (["ggml 1T"] if vs_ggml else [])
    print(f"\nmatvec {N} x {K}, weights cycled through > 64 MiB: GB/s median (best) of {args.reps}, "
          "median as % of the read bandwidth at that thread count")
    print(f"{'type':7s} " + " ".join(f"{c:>22s}" for c in cols) + ("   ours 1T / ggml 1T" if vs_ggml else ""))
    for t in args.types:
        raw = gg.quantize(t, rng.standard_normal((N, K)).astype(np.float32))
        copies = [raw.clone() for _ in range(max(2, (80 << 20) // raw.numel() + 1))]
        mats = [QTensor(c, t, (N, K)) for c in copies]
        x = torch.randn(K)
        gbps: dict[str, list[float]] = {c: [] for c in cols}
        dot = gg.vec_dot(t, x.numpy()) if vs_ggml else None
        out = np.empty(N, np.float32)
        for _ in range(args.reps):
            for isa, qk in qks.items():
                for th in args.threads:
                    torch.set_num_threads(th)
                    qk.matvec(mats[-1], x)
                    t0 = time.perf_counter()
                    for m in mats:
                        qk.matvec(m, x)
                    gbps[f"{isa} {th}T"].append(raw.numel() * len(mats) / (time.perf_counter() - t0) / 1e9)
            if vs_ggml:
                s = sum(gg.rows()(dot[0], c.data_ptr(), raw.numel() // N, N, dot[1].ctypes.data, K, out.ctypes.data)
                        for c in copies)
                gbps["ggml 1T"].append(raw.numel() * len(copies) / s / 1e9)
        cells = [f"{med_best(v)} {100 * statistics.median(v) / read[int(c.split()[-1][:-1])]:3.0f}%"
                 for c, v in gbps.items()]
        ratio = ""
        if vs_ggml and 1 in args.threads:
            g = statistics.median(gbps["ggml 1T"])
            ratio = "   " + "  ".join(f"{isa} {statistics.median(gbps[f'{isa} 1T']) / g:4.2f}" for isa in qks)
        print(f"{t:7s} " + " ".join(f"{c:>22s}" for c in cells) + ratio, flush=True)


def bench_matmul(args, qks: dict, gg: Ggml):
    N, K = args.shape
    threads = max(args.threads)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(1)
    bf16 = "avx512_bf16" in devices.cpu_flags()
    print(f"\nmatmul (n, {K}) x ({N}, {K})^T, {threads} threads: GFLOP/s median (best) of {args.reps}; "
          f"ATen GEMM on the same shape as a float tensor for reference")
    for n in (16, 64, 512):
        x = torch.randn(n, K)
        w32 = torch.randn(N, K)
        ref = {"aten f32": lambda: torch.mm(x, w32.t())}
        if bf16:
            xb, wb = x.bfloat16(), w32.bfloat16()
            ref["aten bf16"] = lambda: torch.mm(xb, wb.t())
        runs: dict[str, object] = dict(ref)
        for t in args.matmul_types:
            q = QTensor(gg.quantize(t, rng.standard_normal((N, K)).astype(np.float32)), t, (N, K))
            for isa, qk in qks.items():
                runs[f"{t} {isa}"] = (lambda qk, q: lambda: qk.matmul(q, x))(qk, q)
        flops: dict[str, list[float]] = {k: [] for k in runs}
        for f in runs.values():
            f()
        for _ in range(args.reps):
            for name, f in runs.items():
                t0 = time.perf_counter()
                f()
                flops[name].append(2 * n * N * K / (time.perf_counter() - t0) / 1e9)
        print(f"n={n:4d}  " + "  ".join(f"{k}: {med_best(v).strip()}" for k, v in flops.items()), flush=True)


# routed-expert shapes: (name, gate/up type, down type, D, ff, E, k, act)
MOE = [("qwen3-30b-a3b", "Q4_K", "Q6_K", 2048, 768, 128, 8, "silu"),
       ("qwen3-30b-a3b", "Q4_K", "Q4_K", 2048, 768, 128, 8, "silu"),
       ("gpt-oss-20b", "MXFP4", "MXFP4", 2880, 2880, 32, 4, "swiglu_oai"),
       ("gemma-4-26b-a4b", "IQ4_XS", "IQ4_NL", 2816, 704, 128, 8, "gelu")]


def moe_stacks(gg: "Ggml", qks: dict, gt: str, dt: str, D: int, ff: int, E: int, rng) -> dict:
    """layout -> (gate_up (E, 2 ff, D), down (E, D, ff)) of E distinct copies of one random expert (no expert
    stays cached), in each layout --layouts asks for that the type has (QuantKernels.host_layout)."""
    one_gu = gg.quantize(gt, rng.standard_normal((2 * ff, D)).astype(np.float32))
    one_dn = gg.quantize(dt, rng.standard_normal((D, ff)).astype(np.float32))
    gu = QTensor(one_gu.repeat(E), gt, (E, 2 * ff, D))
    dn = QTensor(one_dn.repeat(E), dt, (E, D, ff))
    qk = next(iter(qks.values()))
    out = {"ggml": (gu, dn)}
    for lay in LAYOUTS_ASKED:
        if lay != "ggml" and lay in (qk.host_layout(gu), qk.host_layout(dn)):
            out[lay] = tuple(qk.repack(m, qk.host_layout(m)) for m in (gu, dn))
    return out


LAYOUTS_ASKED: list[str] = ["ggml", "x8"]


def moe_shapes(args) -> list[tuple]:
    """The MOE shapes with a type among --types."""
    return [m for m in MOE if m[1] in args.types or m[2] in args.types]


def bench_moe(args, qks: dict, gg: Ggml):
    """moe_decode on real model shapes, each call routing to k experts drawn at random: GB/s of the
    expert bytes one token reads (k gate_up and down matrices)."""
    print(f"\nmoe_decode (one token, k experts drawn at random): GB/s of expert bytes read, median (best) of "
          f"{args.reps}")
    rng = np.random.default_rng(2)
    for name, gt, dt, D, ff, E, k, act in moe_shapes(args):
        stacks = moe_stacks(gg, qks, gt, dt, D, ff, E, rng)
        x = torch.randn(D) / D ** 0.5
        w = torch.full((k,), 1 / k)
        gu, dn = stacks["ggml"]
        token_bytes = k * (gu.matrix_bytes + dn.matrix_bytes)        # as the file stores them
        for th in args.threads:
            torch.set_num_threads(th)
            gbps: dict[str, list[float]] = {f"{isa} {lay}": [] for isa in qks for lay in stacks}
            for _ in range(args.reps):
                for isa, qk in qks.items():
                    for lay, (gu, dn) in stacks.items():
                        ids = [torch.from_numpy(rng.choice(E, k, replace=False)) for _ in range(16)]
                        t0 = time.perf_counter()
                        for i in ids:
                            qk.moe_decode(x, i, w, gu, None, dn, act)
                        gbps[f"{isa} {lay}"].append(token_bytes * len(ids) / (time.perf_counter() - t0) / 1e9)
            print(f"{name:14s} {gt}/{dt} {th}T  " + "  ".join(f"{c} {med_best(v)}" for c, v in gbps.items()),
                  flush=True)


def bench_moe_prefill(args, qks: dict, gg: Ggml):
    """moe_prefill of --prefill-tokens tokens, each routed to k distinct experts drawn at random (512
    tokens, k 8 of 128: ~32 rows an expert): GFLOP/s of the expert products (2 x 3 D ff per token and slot)."""
    n = args.prefill_tokens
    print(f"\nmoe_prefill ({n} tokens, k experts each drawn at random): GFLOP/s, median (best) of {args.reps}")
    rng = np.random.default_rng(3)
    for name, gt, dt, D, ff, E, k, act in moe_shapes(args):
        stacks = moe_stacks(gg, qks, gt, dt, D, ff, E, rng)
        x = torch.randn(n, D) / D ** 0.5
        w = torch.full((n, k), 1 / k)
        flop = 2 * 3 * D * ff * k * n
        for th in args.threads:
            torch.set_num_threads(th)
            gf: dict[str, list[float]] = {f"{isa} {lay}": [] for isa in qks for lay in stacks}
            for _ in range(args.reps):
                ids = torch.from_numpy(np.argsort(rng.random((n, E)), axis=1)[:, :k].copy())
                for isa, qk in qks.items():
                    for lay, (gu, dn) in stacks.items():
                        t0 = time.perf_counter()
                        qk.moe_prefill(x, ids, w, gu, None, dn, act)
                        gf[f"{isa} {lay}"].append(flop / (time.perf_counter() - t0) / 1e9)
            print(f"{name:14s} {gt}/{dt} {th}T  " + "  ".join(f"{c} {med_best(v)}" for c, v in gf.items()),
                  flush=True)


def engine_cell(engine: str, dtype: str, reps: int) -> dict:
    """One engine on preset:small:<dtype> in this process: median and best pp512 / tg64 tok/s."""
    from engines.base import EngineSettings
    from workloads.synth import resolve_model
    if engine == "llama-cpp":
        from engines.llama_cpp import LlamaCppEngine as E
    else:
        from engines.reference.engine import ReferenceEngine as E
    e = E()
    e.load(resolve_model(f"preset:small:{dtype}"), EngineSettings(n_ctx=1024, threads=2, n_ubatch=512, n_batch=512))
    toks = [int(t) for t in np.random.default_rng(0).integers(1, 4000, 512)]

    def pp() -> float:
        e.reset()
        t0 = time.perf_counter()
        e.prefill(toks)
        return len(toks) / (time.perf_counter() - t0)

    def tg(n: int = 64) -> float:
        e.reset()
        e.prefill(toks[:8])
        t0 = time.perf_counter()
        for t in toks[8:8 + n]:
            e.decode(t)
        return n / (time.perf_counter() - t0)

    pp(), tg(8)
    p, g = zip(*[(pp(), tg()) for _ in range(reps)])
    isa = e.info().extra.get("cpu_isa", "") if engine == "reference" else ""
    e.close()
    return {"isa": isa, "pp": statistics.median(p), "pp_best": max(p), "tg": statistics.median(g), "tg_best": max(g)}


def bench_engine(args, isas: list[str]):
    import json
    import os
    import subprocess
    print(f"\npreset:small (qwen3moe, 8 layers, n_embd 1024, 32 experts top-4), 2 threads: tok/s median (best) "
          f"of {args.reps}")
    print(f"{'type':7s} {'engine':16s} {'pp512':>16s} {'tg64':>16s}")
    for dtype in args.engine.split(","):
        for engine, isa in [("reference", i) for i in isas] + [("llama-cpp", "")]:
            env = dict(os.environ, PYTHONPATH=str(ROOT)) | ({"MOEBENCH_ISA": isa} if isa else {})
            r = subprocess.run([sys.executable, __file__, "--engine-cell", f"{engine}:{dtype}",
                                "--reps", str(args.reps)],
                               env=env, capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                print(f"{dtype:7s} {engine:16s} failed: {r.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            c = json.loads(r.stdout.strip().splitlines()[-1])
            name = f"{engine} {c['isa']}".strip()
            print(f"{dtype:7s} {name:16s} {c['pp']:7.1f} ({c['pp_best']:6.1f}) {c['tg']:7.1f} ({c['tg_best']:6.1f})",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(ALL))
    p.add_argument("--isa", default="avx2,avx512", help="variants to run (those this CPU lacks are skipped)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--shape", default="4096x4096", help="N x K of the weight matrix")
    p.add_argument("--matmul-types", default="Q4_K,Q8_0,MXFP4,BF16")
    p.add_argument("--no-matmul", action="store_true")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--no-matvec", action="store_true")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the moe_prefill table (0: none)")
    p.add_argument("--layouts", default="ggml,x8", help="weight layouts of the moe tables (qtensor.LAYOUTS)")
    p.add_argument("--no-ggml", action="store_true", help="skip llama.cpp's vec_dot column")
    p.add_argument("--ggml-lib", type=Path, help="directory of the libggml-base.so and libggml-cpu.so to compare with")
    p.add_argument("--engine", help="file types: the engine comparison on preset:small instead of the kernel tables")
    p.add_argument("--engine-cell", help=argparse.SUPPRESS)           # ENGINE:DTYPE, one child process
    args = p.parse_args()
    if args.engine_cell:
        import json
        engine, dtype = args.engine_cell.split(":")
        print(json.dumps(engine_cell(engine, dtype, args.reps)))
        return
    if args.engine:
        bench_engine(args, [i for i in args.isa.split(",") if not kernels.missing_flags(i)])
        return
    args.types, args.matmul_types = args.types.split(","), args.matmul_types.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.shape = tuple(int(v) for v in args.shape.lower().split("x"))
    qks = {}
    for isa in args.isa.split(","):
        k = kernels.quant_kernels(isa)
        if isinstance(k, str):
            print(f"{isa}: skipped ({k})")
        else:
            qks[isa] = k
    try:
        gg = Ggml(args.ggml_lib)
    except (ImportError, OSError) as e:
        raise SystemExit(f"the benchmark quantizes with llama_cpp's libggml (llama-cpp-python): {e}")
    if not args.no_ggml:
        print(f"ggml: {gg.lib}")
    # the ggml column runs on one thread: its % needs the 1-thread bandwidth even without --threads 1
    read = {th: statistics.median(read_gbps(th, args.reps)) for th in {*args.threads, 1}}
    print("read bandwidth (torch sum over 256 MiB f32, as moebench probe): "
          + ", ".join(f"{th} thread{'s' * (th > 1)} {v:.1f} GB/s" for th, v in read.items()))
    LAYOUTS_ASKED[:] = args.layouts.split(",")
    if not args.no_matvec:
        bench_matvec(args, qks, gg, read)
    if not args.no_moe:
        bench_moe(args, qks, gg)
        if args.prefill_tokens:
            bench_moe_prefill(args, qks, gg)
    if not args.no_matmul:
        bench_matmul(args, qks, gg)


if __name__ == "__main__":
    main()
