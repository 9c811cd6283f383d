"""KTransformers' CPU experts in the reference engine (engine extra experts=kt): kt-kernel computes the routed experts
of the offloaded layers (0..depth-1), one KTMoEWrapper (method LLAMAFILE) per layer, reading ffn_{gate,up,down}_exps
from the same GGUF file; routing, shared experts and everything else stay the reference engine's. So the two CPU expert
implementations meet on the same file, tokens and depth.

What kt computes with (its LLAMAFILE operator, kt-kernel operators/llamafile/moe.hpp, and measured here): the wrapper
copies the activations into a bf16 buffer (its API's input type, so x is rounded to bf16 first), the operator widens
each row to f32 and converts it to the weight's ggml vec_dot_type (Q8_K / Q8_0 blocks for quantized types, the float
type itself for F32/F16/BF16), keeps gate/up outputs and SiLU(g)*u in f32, converts that to down's vec_dot_type, sums
the k experts in f32 and writes the sum as bf16. Measured on synthesized qwen3moe layers against the reference's own
kernels fed bf16(x) and rounded to bf16 after: equal for Q8_0, Q4_0, BF16 and MXFP4, within a bf16 unit for F32/F16;
for the K-quants 70-100 % of the values equal, the rest up to ~1 % of the largest off (kt's K-quant kernels are not
ggml's bit for bit, but of the same arithmetic: relative RMS error against f32 math 1.82 % for both). IQ4_XS runs
but its products are ~3x further from ggml's dequantized product than ggml's own (relative RMS 5.5 % against 1.9 %,
every ISA variant): kt's arithmetic, reported as such, not hidden.

Its weights: kt reads the experts straight from its own read-only mapping of the file (GGUFLoader, kept for the
process's life): measured, loading them adds nothing to RssAnon and running them makes ~their bytes resident as RssFile
in that mapping. The reference engine keeps only an unread view of the same tensors, so no expert is held twice.

kt-kernel is imported only when an engine with experts=kt loads at depth > 0 (engines.peers: its own directory on the
path of that worker only). Its CPU-only traps, handled in KTExperts: forward returns zeros unless KT_FORCE_SYNC_SUBMIT=1
(it then submits and waits synchronously instead of through a CUDA stream callback); its buffers are allocated with
pin_memory=True, which raises without CUDA; and its output is a view into a buffer reused by the next layer of the same
parity (cloned here).
"""
from __future__ import annotations

import os

import torch

from engines.base import Q8_ACTIVATIONS, weight_arithmetic

DIST = "kt-kernel"
METHOD = "LLAMAFILE"
QK_K = 256                              # LLAMAFILE splits the expert width in blocks of 256 (kt's own check)
M_BLOCK = 32                            # ...and the embedding in blocks of 32 rows (per its source, a rest is left out)
# the expert types measured to compute here (module docstring); on a type its llamafile sgemm lacks, kt's operator
# throws inside its worker thread (per its source: the process would abort), so nothing else is handed to it
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4")
MATRICES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# kt's workers spin-wait (its pool's threads for 50 ms after each job, so all through a decode; kt pins them to cores
# 0..n-1) and so does the engine's thread that waits on them; any other thread runnable beside them takes their cores.
# Measured on 2 cores (preset small Q4_K_M, depth all, interleaved rounds; tg tok/s, pp64 tok/s): torch 2 + kt 2
# threads 5-6, 120-160; torch 2 + kt 1: 14-92, 350-800 (erratic); torch 1 + kt 2: 10-11, 370-400; torch 1 + kt 1:
# 130-200, 710-930 (the reference's own experts, 2 threads: 230-490, 1100-2100). So the engine's threads are split
# between kt and the engine's own torch ops, kt taking at most half.
THREADS_RULE = "split: kt max(1, threads // 2), the engine's torch ops the rest (at least 1): kt's workers spin-wait"


def split_threads(threads: int, kt: int | None = None) -> tuple[int, int]:
    """(kt's cpuinfer_threads, the engine's torch threads) out of `threads` (THREADS_RULE); kt: as asked
    (cpu_moe_threads)."""
    kt = max(1, threads // 2) if kt is None else kt
    return kt, max(1, threads - kt)


def refusal(name: str, arch, cfg, entries: dict, depth: int, device: torch.device, extra: dict) -> str | None:
    """Why experts=kt cannot run this file or these settings (one sentence with the fix), else None. Checked at every
    depth: a file or setting kt cannot take is an error of the engine spec, even where depth 0 leaves kt nothing."""
    from engines import peers

    if (missing := peers.missing(DIST)) is not None:
        return f"experts=kt needs kt-kernel: {missing}"
    if device.type != "cpu":
        return (f"experts=kt runs kt-kernel's experts on the CPU only (this integration drives no {device.type} "
                "device); use --device cpu, or the reference engine's own experts.")
    def has(suffix: str) -> bool:
        return any(n.endswith(suffix) for n in entries)

    other = [what for what, bad in (
        (f"{arch.activation} gated", arch.activation != "silu"),
        ("merged gate_up", has(".ffn_gate_up_exps.weight")),
        ("with biases", has("_exps.bias")),
        ("scaled per expert", has(".ffn_down_exps.scale"))) if bad]
    if other:
        return (f"experts=kt: kt-kernel's LLAMAFILE experts are SiLU-gated with separate gate and up matrices and no "
                f"biases, but {name}'s {cfg.arch} experts are {', '.join(other)}; leave out experts=kt for this model.")
    if cfg.n_ff_exp % QK_K or cfg.n_embd % M_BLOCK:
        return (f"experts=kt needs an expert width that is a multiple of {QK_K} and an embedding width that is a "
                f"multiple of {M_BLOCK} (kt-kernel's LLAMAFILE blocks), but {name} has {cfg.n_ff_exp} and "
                f"{cfg.n_embd}; leave out experts=kt for this model.")
    for il in range(min(depth, cfg.n_trunk)):
        for m in MATRICES:
            t = entries[f"blk.{il}.{m}"]
            if t.ggml_type not in TYPES:
                return (f"experts=kt: kt-kernel's LLAMAFILE experts do not compute {t.ggml_type} weights ({t.name}); "
                        f"use a file whose experts are {', '.join(TYPES)}, or leave out experts=kt.")
    if str(extra.get("moe_path", "auto")) == "stream" or str(extra.get("cache_mib", 0)).strip() not in ("", "0"):
        return ("experts=kt computes the offloaded layers' experts itself, so moe_path=stream and an expert cache "
                "(cache_mib) do not apply; leave them out.")
    return None


def words(entries: dict, layers: list[int]) -> set[str]:
    """The compute_dtype words of kt's products (module docstring): gate and up meet x after its bf16 rounding, as
    8-bit blocks for quantized weights, else in bf16 precision (bf16 widened to f16/f32 is exact); down meets the f32
    intermediate converted to its vec_dot_type, as ggml does."""
    out = set()
    for il in layers:
        for m in MATRICES:
            t = entries[f"blk.{il}.{m}"].ggml_type
            quantized = t not in ("F32", "F16", "BF16")
            out.add(weight_arithmetic(t) if m.startswith("ffn_down") else Q8_ACTIVATIONS if quantized else "bf16")
    return out


class _Unpinned:
    """torch as kt_kernel.experts_base sees it: its buffers are made with pin_memory=True, which raises without CUDA;
    here they are ordinary CPU tensors (nothing copies them to a device)."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def zeros(self, *a, pin_memory: bool = False, **k):
        return self._torch.zeros(*a, **k)

    def empty(self, *a, pin_memory: bool = False, **k):
        return self._torch.empty(*a, **k)

    def full(self, *a, pin_memory: bool = False, **k):
        return self._torch.full(*a, **k)


def cpu_variant() -> str:
    """The build of its kernels kt-kernel picks on this CPU at import (avx2, avx512_bf16, amx...)."""
    from engines import peers

    os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"
    peers.use(DIST)
    import kt_kernel
    return str(kt_kernel.__cpu_variant__)


class KTExperts:
    """One KTMoEWrapper per offloaded layer, computing from kt's mapping of the file (the reference holds none of its
    experts). Call it as MoEExecutor calls its paths: (il, x (n, D) f32, ids (n, k), w (n, k) f32) -> (n, D) f32."""

    def __init__(self, meta, cfg, layers: list[int], n_ubatch: int, threads: int):
        from engines import peers

        os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"      # before the import, and read again at every forward
        peers.use(DIST)
        import kt_kernel
        from kt_kernel import KTMoEWrapper, experts_base

        experts_base.torch = _Unpinned(torch)
        # kt keeps its I/O buffers per process, keyed by batch size alone (one model per process, as a cell's worker):
        # those of a model loaded before in this process (other k, inference tensors) must not be reused
        KTMoEWrapper.clear_buffer_cache()
        # kt's worker pool (CPUInfer) is one per process, made by its first wrapper: its threads are this engine's as
        # long as it is the first kt engine of its process (a cell's worker loads one engine)
        self.layers, self.threads = layers, threads
        self.words = words({t.name: t for t in meta.tensors}, layers)
        self.version, self.isa = str(kt_kernel.__version__), str(kt_kernel.__cpu_variant__)
        self.wrappers = {}
        for il in layers:
            w = KTMoEWrapper(layer_idx=il, num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
                             hidden_size=cfg.n_embd, moe_intermediate_size=cfg.n_ff_exp, gpu_experts_mask=None,
                             cpuinfer_threads=threads, threadpool_count=1, weight_path=str(meta.path),
                             chunked_prefill_size=n_ubatch, method=METHOD)
            w.load_weights()
            self.wrappers[il] = w

    def __call__(self, il: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.wrappers[il].forward(x.contiguous(), ids, w.float(), 0).clone()

    def info(self) -> dict:
        return {"kt_kernel_version": self.version, "kt_cpu_variant": self.isa, "kt_method": METHOD,
                "kt_layers": self.layers, "kt_cpuinfer_threads": self.threads, "kt_threads_rule": THREADS_RULE,
                "kt_io": "x rounded to bf16 in, the experts' sum rounded to bf16 out (kt's API)"}
