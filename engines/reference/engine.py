"""ReferenceEngine: the built-in PyTorch MoE offload engine behind the Engine contract.

Knobs in EngineSettings.extra (all optional):
  moe_path              "auto" | "host" | "stream": force the execution path of offloaded layers
  moe_stream_min_batch  auto: batches of at least this many tokens stream experts (default 128)
  cpu_moe_threads       threads for host-path expert matmuls. Default with a CUDA device: TensorSharp's
                        max(1, min(cpus // 2, 64)) (the host works beside the GPU); on a CPU-only run the
                        "accelerator" part and the host part are the same cores taking turns, so the
                        default is settings.threads (a cap would only idle cores and re-size the pool)
  depth_from_env        true: ignore n_cpu_moe and resolve the depth from TS_N_CPU_MOE / TS_CPU_MOE
                        (engines.base.resolve_depth, TensorSharp's rule); the harness passes the
                        depth explicitly, which always beats the environment
  logits_all            true: prefill keeps the logits of every position (tests), else only the last
  hugepages             CPU device: copy weights >= 2 MiB into memory advised for transparent huge
                        pages (kernels.hugepage_copy; default true, false keeps 4 KiB pages)
  decode_matvec         "auto" (default) | "aten": auto runs single-token decode products through the
                        AVX512-BF16 kernels (engines.reference.kernels) when the compute dtype is bf16 on
                        a CPU device with avx512_bf16 and they compile; info().extra["decode_matvec"] says
                        which path runs ("avx512bf16-kernel" | "aten") and decode_matvec_note why
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

from engines.base import Engine, EngineInfo, EngineSettings, resolve_depth
from engines.errors import UserError

VERSION = "0.1.0"


def pick_dtype(asked: str, device, stored: str):
    """The torch compute dtype by placement.compute_dtype's rule."""
    import torch

    from engines.reference.gguf_io import TORCH_DTYPES
    from engines.reference.placement import compute_dtype

    if asked not in ("auto", *TORCH_DTYPES):
        raise UserError(f"dtype {asked!r} is not supported by the reference engine; use auto, f32, bf16 or f16.")
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return TORCH_DTYPES[compute_dtype(asked, device.type, stored, cuda_bf16)]


class ReferenceEngine(Engine):
    name = "reference"

    @classmethod
    def available(cls) -> str | None:
        try:
            import gguf  # noqa: F401
            import numpy  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            return f"{e.name} is not installed; pip install torch numpy gguf."
        return None

    @classmethod
    @functools.cache           # once per harness process
    def prepare(cls) -> None:
        """Compile the decode kernels (once per kernel source and torch version) in a child process:
        inside a cell the compile would add ~30 s to its load and g++'s ~1.3 GB to its peak RAM. A
        failure is left to load(), which falls back to ATen and says why in info()."""
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "from engines.reference import kernels; kernels.load()"],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True)

    @classmethod
    def version(cls) -> str:
        import torch
        return f"{VERSION}+torch{torch.__version__}"

    def load(self, model: Path, s: EngineSettings) -> None:
        import torch

        from engines.gguf_meta import read_meta
        from engines.reference.gguf_io import (ByteLedger, GGUFTensors, check_entry, dtype_name,
                                               file_dtype, tensor_bytes)
        from engines.reference.archs import arch_of, hparams
        from engines.reference.model import LayerWeights, ModelWeights, Transformer
        from engines.reference.kernels import DecodeKernels, hugepage_copy
        from engines.reference.offload import PATHS, ExpertLayer, MoEExecutor, OffloadConfig

        meta = read_meta(model, require_moe=False)     # from_meta says which MoE archs are supported
        cfg = hparams(meta)
        entries = {t.name: t for t in meta.tensors}
        shapes = arch_of(meta).shapes(cfg, set(entries))
        missing, extra = sorted(set(shapes) - set(entries)), sorted(set(entries) - set(shapes))
        if missing or extra:
            raise UserError(f"{meta.path.name} does not hold the tensors a {cfg.arch} model needs "
                            f"(missing: {missing[:3]}, unexpected: {extra[:3]}); the file is corrupt or a variant the "
                            f"reference engine does not support.")
        for name, shape in shapes.items():
            check_entry(entries[name], shape)

        x = s.extra
        depth = resolve_depth(None if x.get("depth_from_env") else s.n_cpu_moe, cfg.n_layers)
        path = str(x.get("moe_path", "auto"))
        if path not in PATHS:
            raise UserError(f"moe_path {path!r} is not one of {', '.join(PATHS)}.")
        matvec = str(x.get("decode_matvec", "auto"))
        if matvec not in ("auto", "aten"):
            raise UserError(f"decode_matvec {matvec!r} is not one of auto, aten.")
        if s.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(s.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise UserError(f"device {s.device!r} was asked for but torch sees no CUDA device; use --device cpu or "
                                f"auto.")
        stored = file_dtype(meta)
        dtype = pick_dtype(s.dtype, device, stored)
        if s.threads < 1 or s.n_ubatch < 1 or s.n_ctx < 1:
            raise UserError("threads, n_ubatch and n_ctx must be positive whole numbers.")
        torch.set_num_threads(s.threads)
        if x.get("cpu_moe_threads"):
            host_threads, self._host_threads_rule = int(x["cpu_moe_threads"]), "set by cpu_moe_threads"
        elif device.type == "cuda":
            host_threads, self._host_threads_rule = max(1, min((os.cpu_count() or 2) // 2,
                                                               64)), "TensorSharp: min(cpus // 2, 64)"
        else:
            host_threads = s.threads
            self._host_threads_rule = "threads: CPU-only, host and accelerator parts share the cores"
        ocfg = OffloadConfig(n_cpu_moe=depth, path=path, stream_min_batch=int(x.get("moe_stream_min_batch", 128)),
                             host_threads=host_threads, threads=s.threads)
        cuda = device.type == "cuda"
        huge = not cuda and bool(x.get("hugepages", True))   # CPU: weights on 2 MiB pages (hugepage_copy)
        self._huge = huge

        ledger = ByteLedger()
        src = GGUFTensors(meta)

        def fetch(name: str, dt=dtype) -> torch.Tensor:
            return src.load(name, dt)

        def stacked(names: list[str], dim: int = 0) -> torch.Tensor:
            """Tensors concatenated into one (q|k|v, gate|up): a copy, so the sources' pages are released."""
            t = torch.cat([fetch(n) for n in names], dim=dim)
            for n in names:
                src.release(n)
            return t

        def place(t: torch.Tensor, group: str, role: str, names: Sequence[str]) -> torch.Tensor:
            """Move t to its planned home and book its bytes (file bytes of its source tensors)."""
            src_t = t
            if cuda:
                t = t.to(device) if role == "accelerator" else t.pin_memory()   # pinned: async H2D copies
            elif huge:
                t = hugepage_copy(t)
            if t is not src_t:          # a copy leaves the mapping: its pages can go
                for n in names:
                    src.release(n)
            ledger.add(group, role, sum(entries[n].n_bytes for n in names), tensor_bytes(t))
            return t

        def acc(name: str, dt=dtype) -> torch.Tensor:
            return place(fetch(name, dt), "non_experts", "accelerator", [name])

        f32 = torch.float32
        layers, experts = [], []
        for i in range(cfg.n_layers):
            b = f"blk.{i}."
            qkv = [b + f"attn_{p}.weight" for p in "qkv"]
            bias = [b + f"attn_{p}.bias" for p in "qkv"]
            norm = cfg.has("qk_norm_head") or cfg.has("qk_norm_full")
            sh = cfg.has("shared_expert_gated")
            shg = [b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"]
            layers.append(LayerWeights(
                attn_norm=acc(b + "attn_norm.weight", f32),
                wqkv=place(stacked(qkv), "non_experts", "accelerator", qkv),
                bqkv=place(stacked(bias), "non_experts", "accelerator", bias) if cfg.has("qkv_bias") else None,
                q_norm=acc(b + "attn_q_norm.weight", f32) if norm else None,
                k_norm=acc(b + "attn_k_norm.weight", f32) if norm else None,
                wo=acc(b + "attn_output.weight"), ffn_norm=acc(b + "ffn_norm.weight", f32),
                router=acc(b + "ffn_gate_inp.weight", f32),
                shexp_gate_inp=acc(b + "ffn_gate_inp_shexp.weight", f32) if sh else None,
                shexp_gate_up=place(stacked(shg), "non_experts", "accelerator", shg) if sh else None,
                shexp_down=acc(b + "ffn_down_shexp.weight") if sh else None))
            role = "host" if i < depth else "accelerator"
            gu_names = [b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"]
            gate_up = stacked(gu_names, dim=1)                                 # (E, 2*ff, D)
            experts.append(ExpertLayer(gate_up=place(gate_up, "experts", role, gu_names),
                                       down=place(fetch(b + "ffn_down_exps.weight"), "experts", role,
                                                  [b + "ffn_down_exps.weight"]),
                                       on_host=i < depth))
        embd = acc("token_embd.weight")
        weights = ModelWeights(token_embd=embd, output_norm=acc("output_norm.weight", f32),
                               output=embd if cfg.tied_output else acc("output.weight"), layers=layers)
        ext = self._decode_kernels(matvec, device, dtype, cfg.features)
        self.moe = MoEExecutor(experts, ocfg, device, kernels=ext)
        self.model = Transformer(cfg, weights, self.moe, s.n_ctx, device, dtype,
                                 kernels=DecodeKernels(ext) if ext is not None else None)
        ledger.add("kv_cache", "accelerator", 0, self.model.kv_bytes)
        ledger.add("staging", "accelerator", 0, self.moe.staging_bytes)

        self.s, self.cfg, self.meta, self.ledger, self.device, self.dtype = s, cfg, meta, ledger, device, dtype
        self.depth, self.ocfg, self.stored = depth, ocfg, stored
        self.all_logits = bool(x.get("logits_all", False))
        self.pos, self._logits = 0, None
        self._dtype_name = dtype_name(dtype)

    def _decode_kernels(self, asked: str, device, dtype, features: frozenset[str]):
        """The compiled decode kernels, or None (ATen); sets self._matvec/_matvec_note for info()."""
        import torch

        from engines.reference import kernels
        self._matvec, ext = "aten", None
        if asked == "aten":
            self._matvec_note = "asked for by decode_matvec=aten"
        elif not features <= kernels.FUSED_FEATURES:
            self._matvec_note = f"the fused kernels lack {', '.join(sorted(features - kernels.FUSED_FEATURES))}"
        elif device.type != "cpu" or dtype != torch.bfloat16:
            self._matvec_note = "the kernels are for bf16 compute on a CPU device"
        else:
            ext = kernels.load()
            if isinstance(ext, str):
                self._matvec_note, ext = ext, None
            else:
                self._matvec = "avx512bf16-kernel"
                self._matvec_note = "bf16 CPU decode: single-row products and routed experts"
        return ext

    # --- running ------------------------------------------------------------------------------

    def _sync(self) -> None:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.s.n_ctx:
            raise UserError(f"{self.pos + n} tokens do not fit the context of {self.s.n_ctx}; raise --n-ctx.")

    def reset(self) -> None:
        self.pos, self._logits = 0, None     # stale cache rows past pos are never read

    def prefill(self, tokens: Sequence[int]) -> None:
        import torch

        from engines.reference.model import prefill
        if not len(tokens):
            return
        self._check_room(len(tokens))
        t = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self._logits = prefill(self.model, t, self.pos, self.s.n_ubatch, self.all_logits)
        self.pos += len(tokens)
        self._sync()

    def decode(self, token: int) -> None:
        import torch

        from engines.reference.model import decode
        self._check_room(1)
        t = torch.tensor([token], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self._logits = decode(self.model, t, self.pos)
        self.pos += 1
        self._sync()

    def logits(self):
        """Logits of the last prefill (every position with extra logits_all, else the last) or decode: (n, V) f32."""
        return self._logits

    def counters(self) -> dict[str, float]:
        return self.moe.counters.to_dict()

    def info(self) -> EngineInfo:
        lg = self.ledger
        n_host_tensors = 3 * self.depth  # gate, up, down per offloaded layer (gate+up are stacked in memory)
        eff = self.s.to_dict() | {
            "n_cpu_moe": self.depth, "dtype": self._dtype_name, "device": str(self.device), "mmap": True,
            "extra": dict(self.s.extra) | {
                "moe_path": self.ocfg.path, "moe_stream_min_batch": self.ocfg.stream_min_batch,
                "cpu_moe_threads": self.ocfg.host_threads}}
        return EngineInfo(
            engine=self.name, version=self.version(), settings=eff,
            bytes_by_device=lg.by_device(),
            expert_bytes_host=lg.held_bytes("experts", "host"), expert_bytes_total=lg.held_bytes("experts"),
            n_overridden_tensors=n_host_tensors,
            extra=lg.to_dict() | {
                "arch": self.cfg.arch, "attention": "torch scaled_dot_product_attention", "file_dtype": self.stored,
                    "compute_dtype": self._dtype_name,
                "host_device": "cpu", "accelerator_device": str(self.device),
                "cpu_moe_threads_rule": self._host_threads_rule,
                "decode_matvec": self._matvec, "decode_matvec_note": self._matvec_note,
                "weights_hugepages": self._huge,
                "host_pinned": self.device.type == "cuda",
                "placement_note": ("the accelerator part runs on the CPU: no CUDA device" if self.device.type != "cuda"
                                   else "host experts are page-locked; the rest is on the GPU"),
                **self.moe.counters.to_dict()})

    def close(self) -> None:
        self.model = self.moe = None
        self._logits = None
