"""ReferenceEngine: the built-in PyTorch MoE offload engine behind the Engine contract.

It holds every weight as the file stores it (engines.reference.weights) and computes from those bytes:
on the CPU with its own kernels (engines.reference.kernels: AVX2 + FMA + F16C, or AVX-512 where the CPU
has it; MOEBENCH_ISA=avx2 forces the baseline), on CUDA by dequantizing into a scratch per product.

Knobs in EngineSettings.extra (all optional):
  moe_path              "auto" | "host" | "stream": force the execution path of offloaded layers
  moe_stream_min_batch  auto, with CUDA: batches of at least this many tokens stream experts (default 128); a
                        CPU-only run takes the host path at every size (offload.py)
  cpu_moe_threads       threads for host-path expert products. Default with a CUDA device: TensorSharp's
                        max(1, min(cpus // 2, 64)) (the host works beside the GPU); on a CPU-only run the
                        "accelerator" part and the host part are the same cores taking turns, so the
                        default is settings.threads (a cap would only idle cores and re-size the pool)
  depth_from_env        true: ignore n_cpu_moe and resolve the depth from TS_N_CPU_MOE / TS_CPU_MOE
                        (engines.base.resolve_depth, TensorSharp's rule); the harness passes the
                        depth explicitly, which always beats the environment
  logits_all            true: prefill keeps the logits of every position (tests), else only the last
  hugepages             CPU device: hold matrices >= 2 MiB as one copy of their bytes on memory advised for
                        transparent huge pages (weights.hugepage_copy; default true; false: the file mapping)
  repack                CPU device: hold the matrices of qtensor.LAYOUT_TYPES in the CPU kernels' interleaved layout
                        (QuantKernels.host_layout, made once at load in place of the file's bytes; default true; false:
                        as the file stores them)
  fused_decode          CPU device: one-token decode through the fused C++ block steps where the architecture
                        allows (kernels.FusedDecode; default true; false: the model's ATen ops)
  cache_type            CPU device: the KV cache's type, "f16" (default: llama.cpp's, so both engines hold the
                        same KV bytes) or "f32" (to compare with llama.cpp run with type_k = type_v = f32); on
                        CUDA the cache holds the compute dtype
  trace_routing         path of a .npz: record the routing of each workload's first run (engines.routing; the
                        worker names the workloads through trace_segment)
  cache_mib             MiB of accelerator memory for an expert cache of the offloaded layers (default 0: none;
                        engines.reference.device_cache); on a CPU-only host the slots are host memory, counted the same
  cache_policy          the cache's policy: lru (default), lfu, classlru, or static (needs cache_static_trace)
  cache_static_trace    a routing trace of this model (.npz) whose most selected experts per layer static pins
  experts               who computes the offloaded layers' routed experts: "reference" (default: the engine's own
                        kernels) or "kt" (KTransformers' kt-kernel, CPU only: engines.reference.kt_experts; its
                        worker threads are cpu_moe_threads, default kt_experts.THREADS_RULE)
"""
from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Sequence

from engines.base import (ANY_WHOLE_NUMBER, Engine, EngineInfo, EngineSettings, host_layers, joined, resolve_depth,
                          weight_arithmetic)
from engines.errors import UserError

VERSION = "0.2.0"
TORCH_DTYPES = ("f32", "bf16", "f16")
CACHE_TYPES = {"f16": "float16", "f32": "float32"}          # cache_type -> torch dtype
ONLINE_POLICIES = ("lru", "lfu", "static", "classlru")       # the expert-cache policies cheap enough to run inside
EXPERTS = ("reference", "kt")                                # the knob experts: who computes the offloaded experts


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 32 MiB (its largest mmap threshold) in the heap and not trim
    the heap below 1 GiB of free space, so that the next op reuses them. By default it gives a freed block of 128 KiB
    or more back to the kernel (its mmap threshold only rises step by step as big blocks are freed) and each op's
    output faults its pages in again: a 512-token prefill of gemma-4-26b-a4b-4l IQ4_XS on 2 threads of a Xeon ran
    0.99 s without this and 0.88 s with it, and its second run (a cell's first timed one) ran at steady speed. llama.cpp
    keeps its compute buffers the same way. The high-water mark, peak RSS, does not rise. False: not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 1 << 30))


def residency(hold, held: dict) -> tuple[str, dict[str, int]]:
    """settings["weights"] (engines.base.WEIGHTS) from the matrices as held (name -> QTensor) and the bytes behind it:
    "mapped" when every matrix still reads the file mapping, else "hugepage-copy" when copies lie on huge pages
    (weights.hugepage_empty: CPU, hugepages on, matrices of 2 MiB or more), else "copy" (the kernels' layout on
    ordinary pages, the GPU, page-locked memory). The untied token embedding stays mapped on a CPU (Holder.lookup)."""
    from engines.reference.weights import HUGE

    b = {"mapped": 0, "copied": 0, "hugepage_copied": 0}
    for name, qt in held.items():
        if qt.raw.data_ptr() == hold.src.qtensor(name).raw.data_ptr():
            b["mapped"] += qt.nbytes
        else:
            b["copied"] += qt.nbytes
            b["hugepage_copied"] += qt.nbytes if hold.hugepages and qt.nbytes >= HUGE else 0
    return ("mapped" if not b["copied"] else "hugepage-copy" if b["hugepage_copied"] else "copy"), b


def cpu_arithmetic(qk, qt, rows: int, gemm_bf16: bool) -> str:
    """The compute_dtype word of the CPU kernels' product of stored matrix qt with `rows` activation rows, as
    QuantKernels.matmul and Experts.prefill choose (gemm_bf16: the engine's compute dtype is bf16): up to rows_max rows
    the rows kernel at the weight type's vec_dot_type (int8 dots and AMX int8 tiles for quantized types); past it the
    GEMM on dequantized tiles, in bf16 (x, W and the results rounded) or in f32 with x rounded as the rows kernel's."""
    if gemm_bf16 and rows > qk.rows_max(qt.type, gemm_bf16, qt.layout):
        return "bf16"
    return weight_arithmetic(qt.type)


class ReferenceEngine(Engine):
    name = "reference"
    knobs = {"cache_mib": ANY_WHOLE_NUMBER, "cache_policy": ONLINE_POLICIES, "experts": EXPERTS}
    routing_traces = True

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
        """Compile the CPU kernels of the variant this machine (or MOEBENCH_ISA) picks, once per kernel
        source and torch version, in a child process: inside a cell the compile would add ~1 min to its
        load and g++'s ~1.3 GB to its peak RAM. A failure is left to load(), which says why."""
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "from engines.reference import kernels; kernels.quant_kernels()"],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True)

    @classmethod
    def runtime(cls) -> None:
        """torch, the modules load() imports, the compiled CPU kernels (the extension .so and the OpenMP
        runtime it links) and the code of the ATen ops a forward runs (transformer.touch_ops): what every model
        needs, so the RSS floor holds them (Engine.runtime). A kernel failure is left to load(), which says why."""
        import engines.reference.offload  # noqa: F401
        import engines.reference.weights  # noqa: F401
        from engines.reference import kernels
        from engines.reference.models.transformer import touch_ops

        kernels.quant_kernels()
        touch_ops()

    @classmethod
    def version(cls) -> str:
        import torch
        return f"{VERSION}+torch{torch.__version__}"

    @classmethod
    def variants(cls) -> dict[str, tuple[str | None, str, str]]:
        from engines import peers
        from engines.reference import kt_experts
        why = peers.missing(kt_experts.DIST)
        return {"reference@experts=kt": (why, "", "") if why else
                (None, f"kt-kernel {peers.installed(kt_experts.DIST)}", kt_experts.cpu_variant())}

    @classmethod
    def isa(cls) -> str:
        from engines.devices import cpu_isa
        try:
            return cpu_isa()            # MOEBENCH_ISA as asked, else the widest variant the CPU runs
        except ValueError:
            return ""

    def load(self, model: Path, s: EngineSettings) -> None:
        import torch

        from engines.gguf_meta import read_meta
        from engines.reference import kernels
        from engines.reference.archs import arch_of, hparams
        from engines.reference.models.transformer import Products
        from engines.reference.offload import PATHS, Activation, ExpertStack, MoEExecutor, OffloadConfig
        from engines.reference.placement import compute_dtype, stored_type
        from engines.reference.weights import GGUFFile, Holder, check

        meta = read_meta(model, require_moe=False)     # arch_of says which MoE archs are supported
        arch = arch_of(meta)
        cfg = hparams(meta)
        entries = {t.name: t for t in meta.tensors}
        shapes = arch.shapes(cfg, set(entries))
        missing, extra = sorted(set(shapes) - set(entries)), sorted(set(entries) - set(shapes))
        if missing or extra:
            raise UserError(f"{meta.path.name} does not hold the tensors a {cfg.arch} model needs "
                            f"(missing: {missing[:3]}, unexpected: {extra[:3]}); the file is corrupt or a variant the "
                            f"reference engine does not support.")
        for name, shape in shapes.items():
            check(entries[name], shape, matrix=len(shape) > 1 and not name.endswith(".bias"))

        x = s.extra
        depth = resolve_depth(None if x.get("depth_from_env") else s.n_cpu_moe, cfg.n_layers)
        path = str(x.get("moe_path", "auto"))
        if path not in PATHS:
            raise UserError(f"moe_path {path!r} is not one of {', '.join(PATHS)}.")
        if s.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(s.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise UserError(f"device {s.device!r} was asked for but torch sees no CUDA device; "
                                "use --device cpu or auto.")
        if s.threads < 1 or s.n_ubatch < 1 or s.n_ctx < 1:
            raise UserError("threads, n_ubatch and n_ctx must be positive whole numbers.")
        cache_type = str(x.get("cache_type", "f16"))
        if cache_type not in CACHE_TYPES:
            raise UserError(f"cache_type {cache_type!r} is not one of {', '.join(CACHE_TYPES)}.")
        if s.dtype not in ("auto", *TORCH_DTYPES):
            raise UserError(f"dtype {s.dtype!r} is not supported by the reference engine; use auto, f32, bf16 or f16.")
        experts = str(x.get("experts", "reference"))
        if experts not in EXPERTS:
            raise UserError(f"experts {experts!r} is not one of {', '.join(EXPERTS)}.")
        if experts == "kt":
            from engines.reference import kt_experts
            if (why := kt_experts.refusal(meta.path.name, arch, cfg, entries, depth, device, x)) is not None:
                raise UserError(why)
        torch.set_num_threads(s.threads)
        self._kept_freed = keep_freed_memory()
        qk = kernels.quant_kernels()         # every run keeps host experts (and on a CPU device everything) here
        if isinstance(qk, str):
            raise UserError(f"The reference engine's CPU kernels cannot run here: {qk}.")
        cuda = device.type == "cuda"
        stored = stored_type(meta)
        dtype = compute_dtype(s.dtype, device.type, stored, cuda and torch.cuda.is_bf16_supported())
        if x.get("cpu_moe_threads"):
            host_threads, self._host_threads_rule = int(x["cpu_moe_threads"]), "set by cpu_moe_threads"
        elif experts == "kt":
            host_threads, self._host_threads_rule = kt_experts.split_threads(s.threads)[0], kt_experts.THREADS_RULE
        elif cuda:
            host_threads = max(1, min((os.cpu_count() or 2) // 2, 64))
            self._host_threads_rule = "TensorSharp: min(cpus // 2, 64)"
        else:
            host_threads = s.threads
            self._host_threads_rule = "threads: CPU-only, host and accelerator parts share the cores"
        threads = s.threads
        if experts == "kt" and depth:       # kt's workers and the engine's torch ops share the threads (THREADS_RULE)
            threads = kt_experts.split_threads(s.threads, host_threads)[1]
            torch.set_num_threads(threads)
        ocfg = OffloadConfig(n_cpu_moe=depth, path=path, stream_min_batch=int(x.get("moe_stream_min_batch", 128)),
                             host_threads=host_threads, threads=threads)
        hold = Holder(GGUFFile(meta), device, hugepages=bool(x.get("hugepages", True)),
                      kernels=qk if x.get("repack", True) else None, bf16=dtype == "bf16")

        held = {}                  # name -> each matrix as held (compute_dtype and weights in info() read them)

        def take(name: str, group: str = "non_experts", where: str = "accelerator", by_kt: bool = False) -> "object":
            """A tensor of the file in its home: matrices as stored, vectors (and biases: experts' are (E, ff)) f32.
            by_kt: an expert matrix kt computes from (experts=kt): the engine keeps the mapping's view, never read, and
            books the bytes kt reads from its own mapping of the file (kt_experts)."""
            if by_kt:
                qt = hold.src.qtensor(name)
                hold.ledger.add(group, where, qt.nbytes, qt.nbytes)
                return qt
            if len(shapes[name]) == 1 or name.endswith(".bias"):
                return hold.vector(name, group, where)
            held[name] = hold.matrix(name, group, where)
            return held[name]

        # Routed-expert tensors are those llama.cpp's --n-cpu-moe pattern matches (engines.base.expert_layer:
        # their biases and scales too), so both engines keep exactly the same tensors in host RAM.
        layers, stacks = [], []
        for i in range(cfg.n_trunk):          # blocks past the trunk (MTP) are checked above, never held
            prefix = f"blk.{i}."
            names = [n for n in shapes if n.startswith(prefix)]
            where = "host" if i < depth else "accelerator"
            ex = {n[len(prefix):]: take(n, "experts", where, experts == "kt" and i < depth)
                  for n in names if entries[n].layer is not None}
            layers.append({n[len(prefix):]: take(n) for n in names if entries[n].layer is None})
            stacks.append(ExpertStack(gate=ex.get("ffn_gate_exps.weight", ex.get("ffn_gate_up_exps.weight")),
                                      up=ex.get("ffn_up_exps.weight"), down=ex["ffn_down_exps.weight"],
                                      gate_b=ex.get("ffn_gate_exps.bias"), up_b=ex.get("ffn_up_exps.bias"),
                                      down_b=ex.get("ffn_down_exps.bias"), scale=ex.get("ffn_down_exps.scale"),
                                      on_host=i < depth))
        layers += [{}] * (cfg.n_layers - cfg.n_trunk)
        tied = "output.weight" not in shapes                                 # the head reads token_embd
        top = {n: hold.lookup(n) if n == "token_embd.weight" and not tied else take(n)
               for n in shapes if not n.startswith("blk.")}
        held.setdefault("token_embd.weight", top["token_embd.weight"])
        top.setdefault("output.weight", top["token_embd.weight"])
        linear = Products(qk, getattr(torch, {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype]))
        self.moe = MoEExecutor(stacks, ocfg, device, linear, Activation(arch.activation), kernels=qk)
        on_host = [i for i, st in enumerate(stacks) if st.on_host]                 # the placement as built
        self._cpu_moe_layers = host_layers(on_host, meta.moe_layers, accelerator=cuda)
        if experts == "kt" and on_host:     # depth 0 leaves kt nothing: not loaded (its threads would spin)
            self.moe.kt = kt_experts.KTExperts(meta, cfg, on_host, s.n_ubatch, host_threads)
        module, cls = arch.model.split(":")
        model_class = getattr(importlib.import_module(module), cls)
        self.model = model_class(cfg, layers, top, self.moe, linear, s.n_ctx, device, linear.dtype,
                                 cache_dtype=getattr(torch, CACHE_TYPES[cache_type]))
        if not x.get("fused_decode", True):
            self.model.fused = None
        hold.ledger.add("kv_cache", "accelerator", 0, self.model.cache_bytes - self.model.state_bytes)
        hold.ledger.add("state", "accelerator", 0, self.model.state_bytes)
        self._setup_cache(x, stacks[:min(depth, cfg.n_trunk)], meta, device, hold.ledger)
        hold.ledger.add("staging", "accelerator", 0, self.moe.staging_bytes)
        self.recorder = self.moe.recorder = self._recorder(x, meta, cfg, stacks, depth, s)

        self.s, self.cfg, self.meta, self.ledger, self.device, self._hold = s, cfg, meta, hold.ledger, device, hold
        self.depth, self.ocfg, self.stored, self.cpu_isa = depth, ocfg, stored, qk.isa
        self._dtype_name, self._huge = dtype, hold.hugepages
        self._n_host_tensors = sum(1 for n in shapes if entries[n].layer is not None
                                   and entries[n].layer < min(depth, cfg.n_trunk))
        self.all_logits = bool(x.get("logits_all", False))
        self.pos, self._logits = 0, None
        self._weights, self._weight_bytes = residency(hold, held)
        if self.moe.kt is not None:         # kt reads the offloaded experts from its own mapping of the file
            self._weight_bytes["mapped"] += hold.ledger.held_bytes("experts", "host")
            self._weights = self._weights if self._weights == "mapped" else f"mapped+{self._weights}"
        self._experts = experts
        self._held, self._qk, self._ubatches = held, qk, set()      # _ubatches: the prefill chunk sizes run

    # --- running ------------------------------------------------------------------------------

    def _sync(self) -> None:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.s.n_ctx:
            raise UserError(f"{self.pos + n} tokens do not fit the context of {self.s.n_ctx}; raise --n-ctx.")

    def reset(self) -> None:
        self.pos, self._logits = 0, None
        self.model.reset()
        if self.moe.cache is not None:
            self.moe.cache.reset()

    def trace_segment(self, name: str | None, tokens: Sequence[int] = (), stream: str = "random") -> None:
        if self.recorder is not None:
            self.recorder.segment(name, tokens, stream)

    def prefill(self, tokens: Sequence[int]) -> None:
        import torch

        from engines.reference.models.transformer import prefill
        if not len(tokens):
            return
        self._check_room(len(tokens))
        t = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        self._ubatches |= {min(len(tokens), self.s.n_ubatch), len(tokens) % self.s.n_ubatch or self.s.n_ubatch}
        self._at(0)
        with torch.inference_mode():
            self._logits = prefill(self.model, t, self.pos, self.s.n_ubatch, self.all_logits)
        self.pos += len(tokens)
        self._sync()

    def decode(self, token: int) -> None:
        import torch

        from engines.reference.models.transformer import decode
        self._check_room(1)
        t = torch.tensor([token], dtype=torch.long, device=self.device)
        self._at(1)
        with torch.inference_mode():
            self._logits = decode(self.model, t, self.pos)
        self.pos += 1
        self._sync()

    def _at(self, phase: int) -> None:
        """A prefill (0) or decode (1) call starts at self.pos: what the recorder and the cache count it as."""
        self.moe.phase = phase
        if self.recorder is not None:
            self.recorder.at(self.pos, phase)

    def logits(self):
        """Logits of the last prefill (every position with extra logits_all, else the last) or decode: (n, V) f32."""
        return self._logits

    def counters(self) -> dict[str, float]:
        return self.moe.counters.to_dict()

    def info(self) -> EngineInfo:
        lg = self.ledger
        eff = self.s.to_dict() | {
            "n_cpu_moe": self.depth, "dtype": self._dtype_name, "device": str(self.device),
            "compute_dtype": self._phases(), "weights": self._weights, "experts": self._experts,
            "mmap": self._weights == "mapped",          # the products read the file mapping only if nothing was copied
            "extra": dict(self.s.extra) | {"cpu_isa": self.cpu_isa,
                "moe_path": self.ocfg.path, "moe_stream_min_batch": self.ocfg.stream_min_batch,
                "cpu_moe_threads": self.ocfg.host_threads}
            | ({} if self.moe.cache is None else self.moe.cache.to_dict())}
        return EngineInfo(
            engine=self.name, version=self.version(), settings=eff,
            bytes_by_device=lg.by_device(),
            expert_bytes_host=lg.held_bytes("experts", "host"), expert_bytes_total=lg.held_bytes("experts"),
            n_overridden_tensors=self._n_host_tensors, cpu_moe_layers=list(self._cpu_moe_layers),
            extra=lg.to_dict() | self._kt_info() | {
                "arch": self.cfg.arch, "attention": self._attention(), "file_dtype": self.stored,
                "cpu_isa": self.cpu_isa, "kv_cache_dtype": str(self.model.cache_dtype).removeprefix("torch."),
                "host_device": "cpu", "accelerator_device": str(self.device),
                "cpu_moe_threads_rule": self._host_threads_rule, "weights_hugepages": self._huge,
                "weight_bytes": self._weight_bytes,
                "malloc_keeps_freed": self._kept_freed,
                "fused_decode": getattr(self.model, "fused", None) is not None,
                "host_pinned": self.device.type == "cuda",
                "placement_note": ("the accelerator part runs on the CPU: no CUDA device" if self.device.type != "cuda"
                                   else "host experts are page-locked; the rest is on the GPU"),
                **self.moe.counters.to_dict()})

    def _attention(self) -> str:
        """The attention each phase runs: a many-token batch goes through torch's SDPA; one token through the fused
        C++ step (kernels.FusedDecode) where the model has one, else the kernels' one pass over the cache on the CPU
        (Products.attend), batched matmuls and a softmax elsewhere."""
        fused = getattr(self.model, "fused", None) is not None
        decode = "fused C++ kernel (kernels.FusedDecode)" if fused else \
            "C++ kernel over the KV cache (kernels.QuantKernels.attend)" if self.device.type == "cpu" else \
            "torch batched matmul + softmax"
        return f"prefill: torch scaled_dot_product_attention; decode: {decode}"

    def _kt_info(self) -> dict:
        """experts=kt: kt-kernel's version, ISA variant, method, threads and the layers it computes (none: depth 0)."""
        if self._experts != "kt":
            return {}
        if self.moe.kt is None:
            return {"kt_layers": [], "kt_note": "depth 0: no layer offloaded, so kt-kernel computed none (not loaded)"}
        return self.moe.kt.info() | {"kt_engine_threads": self.ocfg.threads}      # the torch ops' share

    def _phases(self) -> dict[str, str]:
        """settings["compute_dtype"]: per phase, the words (cpu_arithmetic) of every product with a weight matrix
        (ModelMeta.product_weights). Prefill: at each ubatch size it ran (none yet: a full n_ubatch); a routed expert
        gets 1 to all rows of a ubatch, so both sides of its rows kernel's limit can occur; the head, and the last
        layer's FFN where the model prunes output rows (Transformer.PRUNE_LAST_LAYER), see the output rows only.
        Decode: one row. On CUDA a matrix on the GPU computes in the compute dtype, and so do host experts that
        stream there (the stream path, the expert cache)."""
        qk, dtype, cuda, last = self._qk, self._dtype_name, self.device.type == "cuda", self.cfg.n_layers - 1
        bf16, sizes = dtype == "bf16", self._ubatches or {self.s.n_ubatch}
        pruned = f"blk.{last}.ffn_" if getattr(self.model, "PRUNE_LAST_LAYER", False) and self.recorder is None \
            else None
        head = "output.weight" if "output.weight" in self._held else "token_embd.weight"
        streams = cuda and (self.ocfg.path == "stream" or self.ocfg.path == "auto" and
                            max(sizes) >= self.ocfg.stream_min_batch)
        words: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        for t in self.meta.product_weights():
            qt = self._held.get(t.name)
            if qt is None:                  # a block the engine does not run (MTP)
                continue
            if qt.raw.device.type == "cuda":
                words["prefill"].add(dtype)
                words["decode"].add(dtype)
                continue
            words["decode"].add(cpu_arithmetic(qk, qt, 1, bf16))
            outputs = t.name == head or pruned and t.name.startswith(pruned)
            for n in sizes:
                rows = (n if self.all_logits else 1) if outputs else n
                if t.layer is None:
                    words["prefill"].add(cpu_arithmetic(qk, qt, rows, bf16))
                else:
                    words["prefill"] |= {dtype} if streams else {cpu_arithmetic(qk, qt, m, bf16) for m in (1, rows)}
            if cuda and t.layer is not None and self.moe.cache is not None:
                words["prefill"].add(dtype)
                words["decode"].add(dtype)
        if self.moe.kt is not None:         # the offloaded experts: kt's arithmetic (its matrices are not in _held)
            words["prefill"] |= self.moe.kt.words
            words["decode"] |= self.moe.kt.words
        return {phase: joined(w) for phase, w in words.items()}

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.segment(None)          # a segment left open (a failed run) is kept too
        self.model = self.moe = self.recorder = None
        self._logits = None
        self._hold.unpin()

    # --- routing traces and the expert cache ---------------------------------------------------------------

    def _recorder(self, x: dict, meta, cfg, stacks: list, depth: int, s: EngineSettings):
        """A TraceRecorder for extra trace_routing (a path), else None."""
        if not x.get("trace_routing"):
            return None
        from engines.routing import TraceRecorder

        moe = list(self.moe.moe_index)               # the layers with routed experts the engine runs
        return TraceRecorder(Path(x["trace_routing"]), {
            "model": meta.name, "fingerprint": meta.fingerprint, "arch": cfg.arch, "n_layers": cfg.n_layers,
            "moe_layers": moe, "n_expert": stacks[moe[0]].gate.shape[0], "k": cfg.n_expert_used,
            "expert_bytes": [stacks[il].expert_bytes for il in moe], "n_cpu_moe": depth, "n_ubatch": s.n_ubatch})

    def _setup_cache(self, x: dict, offloaded: list, meta, device, ledger) -> None:
        """The expert cache of extra cache_mib / cache_policy / cache_static_trace (engines.reference.device_cache)."""
        mib = str(x.get("cache_mib", 0)).strip()
        if not mib.isdigit():
            raise UserError(f"cache_mib {x.get('cache_mib')!r} is not a whole number of MiB; use e.g. 0 or 512.")
        policy = str(x.get("cache_policy", "lru"))
        if policy not in ONLINE_POLICIES:
            raise UserError(f"cache_policy {policy!r} is not one the engine runs; use {', '.join(ONLINE_POLICIES)}.")
        if int(mib) == 0 or not offloaded:
            return
        from engines.reference.device_cache import ExpertCache, capacities

        static = None
        if policy == "static":
            static = self._static_sets(x, meta, offloaded, capacities(offloaded, int(mib) << 20))
        self.moe.cache = ExpertCache(offloaded, int(mib) << 20, policy, device, static)
        self.moe.staging.clear()          # the cache replaces the stream path, whose staging buffers go unused
        ledger.add("expert_cache", "accelerator", 0, self.moe.cache.slot_bytes)

    @staticmethod
    def _static_sets(x: dict, meta, offloaded: list, capacity: list[int]) -> list[list[int]]:
        from engines.reference.device_cache import static_sets
        from engines.routing import load_trace

        if not x.get("cache_static_trace"):
            raise UserError("cache_policy static pins the most used experts of a routing trace; pass "
                            "--cache-static-trace FILE.npz (from a sweep with --trace-routing).")
        tr = load_trace(Path(x["cache_static_trace"]))
        if tr.header["fingerprint"] != meta.fingerprint or tr.n_layers_moe < len(offloaded):
            raise UserError(f"{x['cache_static_trace']} is a trace of {tr.header['model']!r}, not of this model "
                            f"({meta.name}); record one with `moebench sweep -m <this model> --trace-routing`.")
        return static_sets([tr.ids[:, j] for j in range(len(offloaded))], capacity, tr.n_expert)
