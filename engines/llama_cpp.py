"""llama.cpp through llama-cpp-python's low-level ctypes API.

`Llama(...)` cannot place tensors, so the model is loaded with llama_model_params directly:
`--n-cpu-moe N` becomes a NULL-terminated tensor_buft_overrides array, one pattern per layer
0..N-1, all pointing at the CPU buffer type of the already loaded library (docs/engines.md, "llama.cpp").
Timing follows llama-bench: clear memory before each repetition, llama_synchronize before return.
llama-bench's `repack` (= use_extra_bufts: the AMX and CPU_REPACK buffer types) and `no_host` are engine knobs
(settings.extra, crossed as lists by a sweep); a build that would crash with them (engines/ggml_build.py) runs
without the extra buffer types, and notes() says so once per run.
"""
from __future__ import annotations

import ctypes
import functools
import re
from importlib import metadata
from pathlib import Path
from typing import Sequence

from engines import base, ggml_build
from engines.base import Engine, EngineInfo, EngineSettings, arithmetic, expert_layer, joined, switch
from engines.gguf_meta import GGML_TYPES, ModelMeta, read_meta

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
MIB = 2**20
# "load_tensors:   CPU_Mapped model buffer size =   820.00 MiB", "... KV buffer size", "... compute buffer size"
# (?<!\S): a match starts at a word's start; without it the search backtracks quadratically over a long word
# (a 4 MiB general.name in the load log took minutes)
_BUFFER = re.compile(r"(?<!\S)(\S+)\s+(model|KV|compute|output|RS) buffer size =\s*([\d.]+) MiB")
EXTRA_BUFTS = ("AMX", "CPU_REPACK", "CPU_KLEIDIAI")     # llama.cpp's extra CPU buffer types (model buffers)
_OVERRIDE = re.compile(r"tensor (blk\.\d+\.\S+) \(.*\) buffer type overridden to (\S+)")


_LOG: list[str] = []        # llama.cpp's log lines since the current engine's load()
_LOG_CALLBACK = None        # installed once, alive for the whole process: llama.cpp's logger is global


def _capture_log(L) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = L.llama_log_callback(lambda level, text, _: _LOG.append(text.decode(errors="replace")))
    L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))   # again each load: others may have replaced it
    _LOG.clear()


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _compiler() -> str:
    """The compiler of the installed libggml-cpu (engines.ggml_build.compiler_of)."""
    lib = ggml_build.llama_cpp_lib()
    return ggml_build.compiler_of(lib) if lib else ""


def _system_info() -> str:
    import llama_cpp as L
    return L.llama_print_system_info().decode(errors="replace").strip()


@functools.cache
def amx_fallback() -> str:
    """Why llama.cpp must run without its extra buffer types here ("" when it need not): a build by a compiler
    that miscompiles AMX, with AMX compiled in, on an AMX CPU. Imports llama_cpp only where the cheap checks
    (CPU flags, the library's compiler) point that way."""
    compiler = _compiler()
    if not (ggml_build.amx_host() and ggml_build.miscompiles_amx(compiler)):
        return ""
    if not ggml_build.amx_crash_applies(compiler, _system_info()):
        return ""
    return (f"llama-cpp runs with repack=0 (no AMX, no CPU_REPACK buffers) whatever was asked: its libggml was built "
            f"by {compiler}, which miscompiles llama.cpp's AMX code, and this CPU has AMX (it would crash); "
            f"`make setup` rebuilds it with clang.")


class _TypeTraitsCpu(ctypes.Structure):       # ggml-cpu.h struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def vec_dot_types(L, weight_types) -> dict[str, str]:
    """Each ggml weight type's vec_dot_type (the type its products convert the activations to: "F16", "Q8_K", ...) as
    the libggml-cpu llama-cpp-python loaded defines it (ggml_get_type_traits_cpu, named by ggml_type_name); its
    symbols resolve through libllama's dependencies, as engines.llama_cpp_routing's do."""
    lib = L.llama_cpp._lib
    traits, name = lib.ggml_get_type_traits_cpu, lib.ggml_type_name
    traits.restype, traits.argtypes = ctypes.POINTER(_TypeTraitsCpu), [ctypes.c_int]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return {t: name(traits(GGML_TYPES[t][0]).contents.vec_dot_type).decode().upper() for t in set(weight_types)}


def compute_dtype(meta: ModelMeta, word_of) -> dict[str, str]:
    """settings["compute_dtype"] of ggml-cpu running this model: the words (word_of: ggml weight type -> word) of its
    weight matrices. Prefill and decode alike: every CPU product (the llamafile GEMM, the CPU_REPACK and AMX kernels
    included) converts the activations to the weight type's vec_dot_type, whatever the batch."""
    words = joined(word_of(t.ggml_type) for t in meta.product_weights())
    return {"prefill": words, "decode": words}


def fill_batch(b, tokens: Sequence[int], pos: int) -> None:
    """llama_batch `b` (llama.h's struct, any binding's) holds `tokens` at positions pos..., in sequence 0, asking for
    the last token's logits only, as llama-bench does."""
    n = len(tokens)
    for i, t in enumerate(tokens):
        b.token[i], b.pos[i], b.n_seq_id[i] = t, pos + i, 1
        b.seq_id[i][0] = 0
        b.logits[i] = i == n - 1
    b.n_tokens = n


def override_patterns(n_cpu_moe: int) -> list[str]:
    """One regex per offloaded layer (searched, not anchored, so `blk\\.1\\.` must not match blk.10)."""
    return [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in range(n_cpu_moe)]


class LlamaCppEngine(Engine):
    name = "llama-cpp"
    knobs = {"repack": ("0", "1"), "no_host": ("0", "1")}      # llama-bench's --repack, --no-host

    @classmethod
    def notes(cls) -> list[str]:
        return [amx_fallback()] if amx_fallback() else []

    @classmethod
    def crash_cause(cls, signal_name: str, settings: EngineSettings, info: dict) -> str:
        eff = info.get("settings", {})
        compiler = eff.get("ggml_compiler") or _compiler()
        return ggml_build.crash_cause(signal_name, compiler, eff.get("system_info", ""),
                                      bool(eff.get("repack", switch(settings.extra.get("repack", True)))))

    @classmethod
    def available(cls) -> str | None:
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:
            return f"llama-cpp-python is not importable ({e}); install it with `pip install llama-cpp-python`."
        return None

    @classmethod
    def runtime(cls) -> None:
        """The library (libllama, libggml) and llama_backend_init, which load() calls too: it starts ggml's timer,
        fills its f16 tables and loads the ggml backends, each only once per process, so load()'s second call
        does nothing new (Engine.runtime)."""
        import llama_cpp as L

        _capture_log(L)          # anything it says goes to the log list load() clears, not to the cell's stderr
        L.llama_backend_init()

    @classmethod
    def version(cls) -> str:
        try:
            return metadata.version("llama_cpp_python")
        except metadata.PackageNotFoundError:
            return "unknown"

    @classmethod
    def isa(cls) -> str:
        return ggml_build.system_info_isa(_system_info())

    def load(self, model: Path, s: EngineSettings) -> None:
        import llama_cpp as L

        self.L, self.s, self.model_path = L, s, model
        self.meta = read_meta(model)
        _capture_log(L)
        L.llama_backend_init()

        self.system_info = _system_info()
        self.compiler = _compiler()
        self.repack = switch(s.extra.get("repack", True)) and not amx_fallback()
        self.no_host = switch(s.extra.get("no_host", False))
        mp = L.llama_model_default_params()
        mp.use_extra_bufts, mp.no_host = self.repack, self.no_host
        mp.n_gpu_layers = -1
        mp.load_mode = L.LLAMA_LOAD_MODE_MMAP if s.mmap else L.LLAMA_LOAD_MODE_NONE
        # keep the patterns and the array alive as long as the model (else: segfault)
        self._patterns = [p.encode() for p in override_patterns(s.n_cpu_moe)]
        if self._patterns:
            cpu = L.llama_cpp._lib.ggml_backend_cpu_buffer_type
            cpu.restype = ctypes.c_void_p
            buft = cpu()
            self._overrides = (_Override * (len(self._patterns) + 1))(
                *[_Override(p, buft) for p in self._patterns], _Override(None, None))
            mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.model = L.llama_model_load_from_file(str(model).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}: {''.join(_LOG)[-500:]}")

        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = s.n_ctx, s.n_batch, s.n_ubatch
        cp.n_threads = cp.n_threads_batch = s.threads      # the C default (4) is 100x slower on 2 cores
        cp.flash_attn_type = FLASH_ATTN[s.flash_attn]
        cp.op_offload = bool(s.extra.get("op_offload", True))
        cp.no_perf = False
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context: {''.join(_LOG)[-500:]}")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(s.n_batch, 0, 1)
        self.pos = 0
        self._load_log = "".join(_LOG)       # what llama.cpp said while loading: info() parses it
        vec_dot = vec_dot_types(L, {t.ggml_type for t in self.meta.product_weights()})
        self.compute_dtype = compute_dtype(self.meta, lambda t: arithmetic(vec_dot[t]))

    def reset(self) -> None:
        self.L.llama_memory_clear(self.mem, True)
        self.L.llama_perf_context_reset(self.ctx)
        self.pos = 0

    def _decode(self, tokens: Sequence[int]) -> None:
        fill_batch(self.batch, tokens, self.pos)
        rc = self.L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} at position {self.pos}")
        self.pos += len(tokens)

    def prefill(self, tokens: Sequence[int]) -> None:
        for i in range(0, len(tokens), self.s.n_batch):    # llama.cpp splits each batch into ubatches
            self._decode(tokens[i:i + self.s.n_batch])
        self.L.llama_synchronize(self.ctx)

    def decode(self, token: int) -> None:
        self._decode([token])
        self.L.llama_synchronize(self.ctx)

    def counters(self) -> dict[str, float]:
        p = self.L.llama_perf_context(self.ctx)
        return {"engine_ms": p.t_p_eval_ms + p.t_eval_ms, "n_p_eval": p.n_p_eval, "n_eval": p.n_eval}

    def logits(self) -> list[float]:
        """Logits of the last token of the last call (for correctness checks against other engines)."""
        ptr = self.L.llama_get_logits_ith(self.ctx, -1)
        return ptr[: self.meta.n_vocab]

    def info(self) -> EngineInfo:
        log = self._load_log
        by_buffer: dict[str, int] = {}
        for buft, kind, mib in _BUFFER.findall(log):
            key = f"{kind.lower()}:{buft}"
            by_buffer[key] = by_buffer.get(key, 0) + int(float(mib) * MIB)
        overridden = [name for name, _ in _OVERRIDE.findall(log)]   # as llama.cpp reports it, not as asked
        host_layers = {expert_layer(n) for n in overridden} - {None}
        s = self.s
        extra_bufts = {k.split(":", 1)[1]: v for k, v in by_buffer.items() if k.split(":", 1)[1] in EXTRA_BUFTS}
        # the CPU backend's: where a model buffer lies on a GPU, ggml-cuda picks its arithmetic per batch (MMQ int8 or
        # cuBLAS) and holds copies beside the mapping, and a BLAS backend multiplies big batches in f32; nothing here
        # reads those, so compute_dtype (and with a GPU, weights) are then left out (unknown), not guessed
        gpu = any(k.startswith("model:") and not k.startswith(("model:CPU", "model:AMX")) for k in by_buffer)
        weights = "copy" if not s.mmap else "mapped+repacked-copy" if any(extra_bufts.values()) else "mapped"
        known = ({} if gpu or "BLAS" in self.system_info else {"compute_dtype": self.compute_dtype}) | \
            ({} if gpu else {"weights": weights})
        return EngineInfo(
            engine=self.name, version=self.version(),
            settings={"n_cpu_moe": s.n_cpu_moe, "n_ctx": self.L.llama_n_ctx(self.ctx), "n_batch": s.n_batch,
                      "n_ubatch": s.n_ubatch, "threads": s.threads, "flash_attn": s.flash_attn,
                      "op_offload": bool(s.extra.get("op_offload", True)), "mmap": s.mmap,
                      "n_gpu_layers": -1, "repack": int(self.repack), "no_host": int(self.no_host),
                      "ggml_compiler": self.compiler, "system_info": self.system_info,
                      "extra_bufts": extra_bufts, **known,
                      "experts_unrepacked_bytes": self._unrepacked(_OVERRIDE.findall(log))},
            bytes_by_device=by_buffer,
            expert_bytes_host=sum(t.n_bytes for t in self.meta.tensors
                                  if t.layer is not None and t.layer in host_layers),
            expert_bytes_total=self.meta.expert_bytes(),
            n_overridden_tensors=len(overridden),
            cpu_moe_layers=base.host_layers(host_layers, self.meta.moe_layers, accelerator=gpu),
            extra={"overridden_tensors": overridden},
        )

    def _unrepacked(self, overrides: list[tuple[str, str]]) -> int:
        """Expert bytes --n-cpu-moe put in the plain CPU buffer although an extra buffer type would take them, so
        llama.cpp's expert kernels change with the depth (repacked at depth 0, plain at depth N). This llama.cpp
        repacks overridden experts too (0 here); other builds may not, and the report's fairness section says so."""
        bufts = ggml_build.cpu_bufts() if self.repack else {}
        kept = {name for name, buft in overrides if buft == "CPU"}
        return sum(t.n_bytes for t in self.meta.tensors if t.name in kept
                   and ggml_build.extra_buft(t.name, t.ne, t.ggml_type, bufts) is not None)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
