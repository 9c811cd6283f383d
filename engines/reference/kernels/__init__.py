"""AVX512-BF16 matrix-vector kernels for single-token CPU decode (bf16 weights, fp32 accumulation).

Why: ATen's bf16 GEMV (oneDNN off) is compute-bound at ~20 GB/s a Zen4 core. `vdpbf16ps` multiplies
32 bf16 pairs per instruction into 16 fp32 lanes, which makes the product memory-bound: measured on
2 Zen4 threads, weights in DRAM, ~45 GB/s with weights on huge pages (hugepage_copy; ~29 GB/s on
4 KiB pages, where ATen also reaches ~30). `small` preset decode, interleaved A/B on a busy shared
machine: +14% over ATen on 4 KiB pages (118 -> 135 tok/s), +8-10% over ATen on huge pages. The routed
experts of a layer also run as one call (gate_up, SiLU-gating, down, weighted sum), which removes
~8 Python/ATen ops per layer; a layer's one-token attention block (attn_decode, ~35 ops) and its
ffn norm + routing (route_decode, ~8 ops) are one call each too (DecodeKernels): decode on `small`
went from ~6.2 to ~4.2-5 ms a token. Batched products (prefill) never use these (oneDNN's GEMM is faster);
the one single-row product of a prefill, its last position's output head, does.

Layout: every weight is an (N, K) row-major CONTIGUOUS bf16 matrix (y = W x, what F.linear does
with W): attention wqkv (q+2kv, D), wo (D, q), output (V, D), expert stacks gate_up (E, 2*ff, D)
and down (E, D, ff). Rows are split over torch's intra-op threads (at::parallel_for).
Compiled once (g++ and ninja needed, ~30 s) by torch.utils.cpp_extension.load_inline into
cache_dir()/kernels/torch-VERSION; load_inline rebuilds when the source
(bf16_decode.cpp, beside this file) changes.
"""
from __future__ import annotations

import functools
import mmap
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("bf16_decode.cpp")
FUNCTIONS = ["matvec", "moe_decode", "rms_norm", "attn_decode", "route_decode"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split())


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


@functools.cache
def load():
    """The compiled extension, or the reason it is unavailable (str). Compiles once per source
    (~30 s), later loads reuse the build. -fopenmp is what makes at::parallel_for parallel in an
    extension; the .so then needs libgomp.so.1, which resolves to the copy torch already loaded
    (one OpenMP pool: two would make each other's threads spin-wait on 2 cores)."""
    if not cpu_has_avx512_bf16():
        return "the CPU has no avx512_bf16"
    from torch.utils.cpp_extension import load_inline

    from engines.paths import cache_dir
    build = cache_dir() / "kernels" / f"torch-{torch.__version__}"   # a build per torch ABI
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load_inline("moebench_bf16_kernels", cpp_sources=SOURCE.read_text(), functions=FUNCTIONS, build_directory=str(build),
                           extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"], extra_ldflags=["-fopenmp"])
    except Exception as e:   # no compiler, no ninja, ...: decode keeps ATen's GEMV
        return f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


HUGE = 2 << 20   # x86 transparent huge page


def hugepage_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous CPU tensor t in an anonymous mapping advised for 2 MiB transparent huge
    pages (THP is often "madvise"-only). Why: decode streams ~150 MB of weights per token; with 4 KiB
    pages every 4 KiB read walks the page table and the prefetcher stops at each page end (measured,
    2 Zen4 threads: the kernel reads at ~29 GB/s on 4 KiB pages, ~45 on huge pages). Tensors under
    2 MiB, or platforms without MADV_HUGEPAGE, are returned as they are."""
    n = t.numel() * t.element_size()
    if n < HUGE or not hasattr(mmap, "MADV_HUGEPAGE") or t.device.type != "cpu":
        return t
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(m, dtype=torch.uint8)          # holds a reference to m: lives as long as buf
    off = (-buf.data_ptr()) % HUGE                         # huge pages need 2 MiB-aligned addresses
    return buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)


class DecodeKernels:
    """The extension as model.py uses it on a bf16 CPU: drop-ins for F.rms_norm and F.linear that send
    single rows to the kernels (everything else to ATen), and single-token steps fused into one call
    each: attention (model.attention's n == 1 branch; ~35 ATen ops a layer) and the ffn norm + routing
    (model.route; ~8 ops)."""

    def __init__(self, ext):
        self.ext = ext

    def norm(self, x: torch.Tensor, shape: tuple[int, ...], w: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
        """F.rms_norm; single-token f32 rows normed over their last dim: one op instead of ~8."""
        if (x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu" and len(shape) == 1
                and (w is None or w.dtype == torch.float32)):
            return self.ext.rms_norm(x.contiguous(), w, eps)
        return F.rms_norm(x, shape, w, eps)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear; single rows with bf16 weights run the GEMV (f32 output; callers' .float() is then free)."""
        if x.shape[0] == 1 and w.dtype == torch.bfloat16 and x.device.type == "cpu":
            y = self.ext.matvec(x, w)
            return y if b is None else y + b
        return F.linear(x, w, b)

    def attention(self, cfg, lw, Kc: torch.Tensor, Vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: (1, D) f32 residual -> (1, D) f32, writing K/V at pos."""
        return self.ext.attn_decode(x.contiguous(), lw.attn_norm, cfg.rms_eps, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm,
                                    Kc, Vc, cos, sin, pos, cfg.spec.rope_neox, cfg.n_head, lw.wo)

    def norm_route(self, cfg, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (1, D) f32 residual -> h (1, D) f32 normed, w (1, k) f32, ids (1, k)."""
        return tuple(self.ext.route_decode(x.contiguous(), lw.ffn_norm, cfg.rms_eps, lw.router, cfg.n_expert_used,
                                           cfg.spec.norm_topk, cfg.expert_weights_scale))
