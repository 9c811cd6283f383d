"""ik_llama.cpp through the ik-llama-cpp-python wheel's ctypes binding (a peer package: engines.peers).

The binding's struct layouts are written by hand for its bundled llama.h, so load() first holds every struct it
passes by value or reads (and the log callback's signature) to that header's C definitions, and refuses to run on a
layout that differs. Its high-level `IkLlama` is never used (n_batch = n_ctx, a Python loop over the vocabulary per
token): the model and context come from the C API as in engines/llama_cpp.py, with the same timing rules (memory
cleared per repetition, llama_synchronize before return, only the last token's logits, n_batch chunks).
Depth is always explicit tensor overrides of the FIRST N layers to this library's CPU buffer type, the library's own
`ncmoe` left 0: its meaning differs between ik_llama.cpp versions (first N here, last N in later sources).
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from engines import base, c_layout, ggml_build, peers
from engines.base import Q8_ACTIVATIONS, Engine, EngineInfo, EngineSettings, arithmetic, expert_layer, switch
from engines.errors import UserError
from engines.c_layout import LayoutError, Types, header_struct, header_text, layout_difference
from engines.gguf_meta import GGML_TYPES, clean_text, read_meta
from engines.llama_cpp import MIB, compute_dtype, fill_batch, override_patterns

DIST = "ik-llama-cpp-python"
# "llm_load_tensors:        CPU buffer size =     4.77 MiB" (model), "...: CPU KV buffer size = ...", "CPU  output ...",
# "CPU compute ..."; anchored at a line's start, so a long word in the log cannot make the search quadratic
_BUFFER = re.compile(r"^[\w.]+:\s+(\S+)\s+(?:(KV|compute|output|RS)\s+)?buffer size =\s*([\d.]+) MiB$", re.M)
# "Tensor blk.0.ffn_up_exps.weight (size = 0.25 MiB) buffer type overriden to CPU" (this build spells it so)
_OVERRIDE = re.compile(r"^Tensor (blk\.\d+\.\S+) \(size = [\d.]+ MiB\) buffer type overridd?en to (\S+)$", re.M)
_REPACKED = re.compile(r"^=+ Repacked (\d+) tensors$", re.M)

_LOG: list[str] = []        # the library's log lines since the current engine's load()
_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)    # ggml.h ggml_log_callback
_LOG_CALLBACK = None        # alive for the whole process: the library's logger is global


class _Override(ctypes.Structure):          # llama.h struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class _TypeTraits(ctypes.Structure):        # ggml.h ggml_type_traits_t (returned by value)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p),
                ("from_float_to_mat", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64), ("ncols", ctypes.c_int64), ("gemv", ctypes.c_void_p),
                ("gemm", ctypes.c_void_p), ("row_meta_size", ctypes.c_int64)]


# --- the binding's layouts against its header ------------------------------------------------------------------------

def _broken(problem: str) -> UserError:
    return UserError(f"{problem}; reinstall ik-llama-cpp-python {peers.PEERS[DIST]} with `make peers`.")


def check_layouts(C, include: Path) -> None:
    """Every struct the engine passes by value or reads, and the log callback, as the header at `include` defines
    them; UserError naming the struct and its first differing field otherwise."""
    structs = {"llama_model_params": C.llama_model_params, "llama_context_params": C.llama_context_params,
               "llama_batch": C.llama_batch, "llama_timings": C.llama_timings,
               "llama_model_tensor_buft_override": _Override, "ggml_type_traits_t": _TypeTraits}
    try:
        text = header_text(include)
        types = Types(text)
        diffs = {name: layout_difference(binding, header_struct(text, types, name)) for name, binding in
                 structs.items()}
        ret, params = types.callbacks.get("ggml_log_callback", ("missing", ""))
        got = [ret] + [c_layout.kind(types.ctype(p, "ggml_log_callback")[1]) for p in params.split(",") if p.strip()]
    except LayoutError as e:
        raise _broken(f"The bundled llama.h cannot be checked: {e}") from None
    for name, diff in diffs.items():
        if diff:
            raise _broken(f"ik-llama-cpp-python's struct {name} does not match its bundled llama.h ({diff}), so it "
                          f"would run on a wrong memory layout")
    want = ["void"] + [c_layout.kind(t) for t in _LOG_FN._argtypes_]
    if got != want:
        raise _broken(f"The bundled headers' ggml_log_callback is {' '.join(got)}, not the {' '.join(want)} the "
                      f"engine's log capture passes")


# --- the library ---------------------------------------------------------------------------------------------------

def _binding():
    """The binding module (ik_llama_cpp._ctypes_api), its library loaded; its structs checked once per process."""
    if os.environ.get("IK_LLAMA_CPP_LIB_PATH"):
        raise UserError("IK_LLAMA_CPP_LIB_PATH is set, so ik-llama-cpp-python would load a library its bundled "
                        "llama.h does not describe; unset it to run the ik-llama-cpp engine.")
    peers.use(DIST)
    from ik_llama_cpp import _ctypes_api as C
    _checked(C)
    return C


@functools.cache
def _checked(C) -> None:
    check_layouts(C, peers.peer_dir(DIST) / "include")
    lib = C._lib
    for fn, res, args in (("llama_log_set", None, [_LOG_FN, ctypes.c_void_p]),
                          ("llama_print_system_info", ctypes.c_char_p, []),
                          ("llama_synchronize", None, [ctypes.c_void_p]),
                          ("llama_n_ctx", ctypes.c_uint32, [ctypes.c_void_p]),
                          ("llama_n_batch", ctypes.c_uint32, [ctypes.c_void_p]),
                          ("ggml_backend_cpu_buffer_type", ctypes.c_void_p, []),
                          ("ggml_internal_get_type_traits", _TypeTraits, [ctypes.c_int]),
                          ("ggml_type_name", ctypes.c_char_p, [ctypes.c_int])):
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args


def _capture_log(lib) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = _LOG_FN(lambda level, text, _: _LOG.append((text or b"").decode(errors="replace")))
    lib.llama_log_set(_LOG_CALLBACK, None)
    _LOG.clear()


def vec_dot_words(lib, weight_types) -> dict[str, str | None]:
    """Each ggml weight type's arithmetic word from this library's type traits (the vec_dot_type its products convert
    activations to; ik's 8-bit blocks Q8_K, Q8_2_X4, ... all read "q8-activations"). None where not established: F16
    and BF16, whose traits say f16/bf16 activations while this build's logits on such files sit as far from
    llama.cpp's (f16/bf16 activations) as from f32 activations (2.4e-3 / 1.5e-2 at position 0, where on an F32 file it
    agrees with f32 to 1e-6): its iqk float kernels also take f32 activations; and types outside GGML_TYPES."""
    out: dict[str, str | None] = {}
    for t in set(weight_types):
        if t in ("F16", "BF16") or t not in GGML_TYPES:
            out[t] = None
            continue
        name = lib.ggml_type_name(lib.ggml_internal_get_type_traits(GGML_TYPES[t][0]).vec_dot_type).decode().upper()
        out[t] = Q8_ACTIVATIONS if name.startswith("Q8_") else arithmetic(name)
    return out


def cannot_run(meta) -> str:
    """Why this library cannot run the model (one sentence), or "". Its loader fails on qwen35moe files with MTP
    (nextn) layers (it looks for attention tensors in the MTP block). Its gemma4 graph loads llama.cpp's gemma4
    files but computes another function: logits ~10 apart from llama.cpp's already at the first position (logits of
    O(8)); its flash attention also aborts there (GGML_ASSERT(S > 0)) once a prompt passes the sliding window."""
    name = f"ik-llama-cpp-python {peers.PEERS[DIST]}"
    n_nextn = meta.get("nextn_predict_layers", 0)
    if meta.arch == "qwen35moe" and isinstance(n_nextn, int) and n_nextn > 0:
        return (f"{name} cannot load {meta.path.name}: its qwen35moe loader does not know the file's {n_nextn} MTP "
                f"(nextn) layer(s); use a qwen35moe file without them, or another engine.")
    if meta.arch == "gemma4":
        return (f"{name} cannot run {meta.path.name} as llama.cpp does: its gemma4 graph gives other logits on the "
                f"same file, so its timings would not be comparable; use llama-cpp or reference for gemma4 models.")
    return ""


def _mapped(path: Path) -> bool | None:
    """Whether this process maps the model file (None: unknown, no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    where = " " + os.path.realpath(path)
    return any(line.endswith(where) for line in maps.splitlines())


class IkLlamaCppEngine(Engine):
    name = "ik-llama-cpp"
    knobs = {"fmoe": ("0", "1"), "rtr": ("0", "1")}     # fused MoE up/gate (context), run-time repack (model)

    @classmethod
    def available(cls) -> str | None:
        return peers.missing(DIST) or _probe()[0]

    @classmethod
    def isa(cls) -> str:
        return ggml_build.system_info_isa(_probe()[1])

    @classmethod
    def version(cls) -> str:
        return peers.installed(DIST) or "unknown"

    @classmethod
    def runtime(cls) -> None:
        C = _binding()
        _capture_log(C._lib)
        C.llama_backend_init()

    def load(self, model: Path, s: EngineSettings) -> None:
        self.meta = read_meta(model)
        why = cannot_run(self.meta)
        if why:
            raise UserError(why)
        C = self.C = _binding()
        lib = C._lib
        self.s, self.model_path = s, model
        _capture_log(lib)
        C.llama_backend_init()
        self.system_info = lib.llama_print_system_info().decode(errors="replace").strip()

        mp, cp = C.llama_model_default_params(), C.llama_context_default_params()
        self.defaults = {"fmoe": int(cp.fused_moe_up_gate), "rtr": int(mp.repack_tensors)}
        self.fmoe = switch(s.extra.get("fmoe", self.defaults["fmoe"]))
        self.rtr = switch(s.extra.get("rtr", self.defaults["rtr"]))
        flash = {"on": True, "off": False}.get(s.flash_attn, bool(cp.flash_attn))    # auto: the library's default
        # n_gpu_layers stays 0 (CPU-only build): -1 corrupts its heap on qwen35moe files
        mp.ncmoe, mp.use_mmap, mp.repack_tensors, mp.flash_attn = 0, s.mmap, self.rtr, flash
        # keep the patterns and the array alive as long as the model
        self._patterns = [p.encode() for p in override_patterns(s.n_cpu_moe)]
        if self._patterns:
            buft = lib.ggml_backend_cpu_buffer_type()
            self._overrides = (_Override * (len(self._patterns) + 1))(
                *[_Override(p, buft) for p in self._patterns], _Override(None, None))
            mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.model = C.llama_model_load_from_file(str(model).encode(), mp)
        if not self.model:
            raise UserError(f"ik-llama-cpp could not load {model.name}: {self._log_tail()}; use a model file this "
                            f"library supports, or another engine.")

        cp.n_ctx, cp.n_batch, cp.n_ubatch = s.n_ctx, s.n_batch, s.n_ubatch
        cp.n_threads = cp.n_threads_batch = s.threads      # the C default (4) oversubscribes small machines
        cp.flash_attn, cp.fused_moe_up_gate = flash, self.fmoe
        self.ctx = C.llama_init_from_model(self.model, cp)
        if not self.ctx:
            C.llama_free_model(self.model)
            raise RuntimeError(f"ik-llama-cpp could not create a context: {self._log_tail()}")
        self.flash = bool(cp.flash_attn)
        self.n_batch = lib.llama_n_batch(self.ctx)          # the library caps n_batch at n_ctx
        self.batch = C.llama_batch_init(self.n_batch, 0, 1)
        self.pos = 0
        self._load_log = "".join(_LOG)
        self.mapped = _mapped(model)
        words = vec_dot_words(lib, {t.ggml_type for t in self.meta.product_weights()})
        self.compute_dtype = compute_dtype(self.meta, words.__getitem__) if all(words.values()) else None

    @staticmethod
    def _log_tail() -> str:
        lines = [x.strip() for x in "".join(_LOG).splitlines() if x.strip()]
        errors = [x for x in lines if "error" in x.lower() or "fail" in x.lower()] or lines
        return clean_text(" / ".join(errors[-2:]) or "no log", 300)

    def reset(self) -> None:
        self.C.llama_kv_cache_clear(self.ctx)
        self.C.llama_reset_timings(self.ctx)
        self.pos = 0

    def _decode(self, tokens: Sequence[int]) -> None:
        fill_batch(self.batch, tokens, self.pos)
        rc = self.C.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"ik-llama-cpp's llama_decode returned {rc} at position {self.pos}")
        self.pos += len(tokens)

    def prefill(self, tokens: Sequence[int]) -> None:
        for i in range(0, len(tokens), self.n_batch):      # the library splits each batch into ubatches
            self._decode(tokens[i:i + self.n_batch])
        self.C._lib.llama_synchronize(self.ctx)

    def decode(self, token: int) -> None:
        self._decode([token])
        self.C._lib.llama_synchronize(self.ctx)

    def counters(self) -> dict[str, float]:
        t = self.C.llama_get_timings(self.ctx)
        return {"engine_ms": t.t_p_eval_ms + t.t_eval_ms, "n_p_eval": t.n_p_eval, "n_eval": t.n_eval}

    def logits(self) -> list[float]:
        """Logits of the last token of the last call (for correctness checks against other engines)."""
        return self.C.llama_get_logits_ith(self.ctx, -1)[: self.meta.n_vocab]

    def info(self) -> EngineInfo:
        log, s = self._load_log, self.s
        by_buffer: dict[str, int] = {}
        for buft, kind, mib in _BUFFER.findall(log):
            key = f"{(kind or 'model').lower()}:{buft}"
            by_buffer[key] = by_buffer.get(key, 0) + int(float(mib) * MIB)
        overridden = [name for name, buft in _OVERRIDE.findall(log) if buft == "CPU"]    # as the library says
        host_layers = sorted({expert_layer(n) for n in overridden} - {None})
        repacked = sum(int(n) for n in _REPACKED.findall(log))
        weights = ({} if self.mapped is None else
                   {"weights": "copy" if not self.mapped else "mapped+repacked-copy" if repacked else "mapped"})
        return EngineInfo(
            engine=self.name, version=self.version(),
            settings={"n_cpu_moe": s.n_cpu_moe, "n_ctx": self.C._lib.llama_n_ctx(self.ctx), "n_batch": self.n_batch,
                      "n_ubatch": self.C.llama_n_ubatch(self.ctx), "threads": s.threads,
                      "flash_attn": int(self.flash), "mmap": s.mmap, "n_gpu_layers": 0, "ncmoe": 0,
                      "fmoe": int(self.fmoe), "rtr": int(self.rtr), "repack": int(self.rtr),
                      "knob_defaults": self.defaults, "repacked_tensors": repacked,
                      "system_info": self.system_info, "cpu_isa": ggml_build.system_info_isa(self.system_info),
                      **({"compute_dtype": self.compute_dtype} if self.compute_dtype else {}), **weights},
            bytes_by_device=by_buffer,
            expert_bytes_host=sum(t.n_bytes for t in self.meta.tensors if t.layer is not None
                                  and t.layer in host_layers),
            expert_bytes_total=self.meta.expert_bytes(),
            n_overridden_tensors=len(overridden),
            # this wheel's library is built for the CPU alone: every layer's experts are in host memory
            cpu_moe_layers=base.host_layers(host_layers, self.meta.moe_layers, accelerator=False),
            extra={"overridden_tensors": overridden},
        )

    def close(self) -> None:
        self.C.llama_batch_free(self.batch)
        self.C.llama_free(self.ctx)
        self.C.llama_free_model(self.model)


@functools.cache
def _probe() -> tuple[str | None, str]:
    """(why the binding cannot be imported, or None; its library's system info), from a child process, so that the
    harness's own process never loads a second libllama."""
    code = (f"import sys, ctypes; sys.path.append({str(peers.peer_dir(DIST))!r}); "
            f"from ik_llama_cpp import _ctypes_api as C; f = C._lib.llama_print_system_info; "
            f"f.restype = ctypes.c_char_p; print(f().decode(errors='replace'))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return str(_broken("importing ik_llama_cpp took over 120 s")), ""
    if r.returncode == 0:
        return None, clean_text(r.stdout.strip(), 2000)
    last = (r.stderr.strip().splitlines() or ["no message"])[-1]
    return str(_broken(f"ik_llama_cpp is not importable ({clean_text(last, 200)})")), ""
