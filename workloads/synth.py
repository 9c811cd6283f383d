"""Synthetic random-weight MoE GGUF models that llama.cpp and the reference engine both load.

What a preset holds comes from the architecture table (engines.reference.archs: tensors, metadata,
presets); which type each tensor is stored in, from llama.cpp's own rules for the file type
(workloads.quantize), quantized by llama.cpp's own quantizer. Deterministic: the same preset, dtype and
seed give the same bytes (each tensor draws from its own generator seeded by (seed, tensor index)).
Numpy shapes are the reverse of ggml `ne`.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from engines.errors import UserError
from engines.gguf_meta import ModelMeta, read_meta, tensor_bytes
from engines.paths import cache_dir
from engines.reference.archs import ARCHS, PRESETS, Hparams, Preset
from workloads.planted import Planter, Planting, parse_options
from workloads.quantize import FTYPES, quantize, tensor_types

DTYPES = tuple(FTYPES)      # llama.cpp file types: f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m q6_k iq4_xs mxfp4
FILE_VERSION = 2            # in cached presets' names: an older synthesizer's file (no token list) is not reused


def get_preset(name: str, dtype: str | None = None) -> Preset:
    if name not in PRESETS:
        raise UserError(f"Unknown preset {name!r}; choose from: {', '.join(PRESETS)}.")
    if dtype and dtype not in DTYPES:
        raise UserError(f"Unknown dtype {dtype!r}; choose from: {', '.join(DTYPES)}.")
    return replace(PRESETS[name], dtype=dtype) if dtype else PRESETS[name]


def preset(base: Preset, dtype: str | None = None, **h) -> Preset:
    """`base` with other hyperparameters (e.g. arch="qwen2moe", n_ff_shexp=96) and/or another file type."""
    return Preset(replace(base.h, **h), dtype or base.dtype)


def tensor_shapes(p: Preset) -> dict[str, tuple[int, ...]]:
    """Every tensor the llama.cpp loader expects for the preset's architecture, name -> numpy shape."""
    if p.h.arch not in ARCHS:
        raise UserError(f"Cannot synthesize architecture {p.h.arch!r}; supported: {', '.join(ARCHS)}.")
    return ARCHS[p.h.arch].shapes(p.h)


def write_metadata(w, h: Hparams, name: str) -> None:
    w.add_name(name)
    ARCHS[h.arch].write_metadata(w, h)
    # a token per id, for engines that will not load a file without a token list; the tokenizer model stays
    # "no_vocab", so llama.cpp (and workloads.tokens) still treat the file as having no tokenizer
    w.add_token_list([f"<t{i}>" for i in range(h.n_vocab)])
    w.add_token_scores([0.0] * h.n_vocab)
    w.add_token_types([1] * h.n_vocab)      # 1: a normal token


def _weights(shape: tuple[int, ...], name: str, rng: np.random.Generator) -> np.ndarray:
    """Random weights whose activations stay O(1): std 1/sqrt(fan_in); norms near 1."""
    if len(shape) == 1:
        if name.endswith(".bias"):
            return rng.normal(0, 0.02, shape).astype(np.float32)
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    std = 1.0 if name == "token_embd.weight" else shape[-1] ** -0.5
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= std
    return a


def synthesize(preset: str | Preset, out: str | Path, seed: int = 0, dtype: str | None = None,
               sparse: bool = False, routing: Planting | None = None) -> Path:
    """Write a random-weight GGUF for the preset; returns the path. Same inputs -> same bytes.
    sparse: the header and tensor table only, the data a hole of the right size (no disk, no weights): what
    `moebench plan` reads, for the real models' full layer counts (their weights would take 13-150 GB).
    routing: plant a skewed, token-tied routing (workloads.planted), recorded as `moebench.routing.*` metadata."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    _write_gguf(preset, tmp, seed, dtype, sparse, routing)
    tmp.replace(out)   # atomic: a half-written file never looks like a model
    return out


def _write_gguf(preset: str | Preset, path: Path, seed: int, dtype: str | None, sparse: bool,
                routing: Planting | None) -> None:
    import gguf

    p = get_preset(preset, dtype) if isinstance(preset, str) else replace(preset, dtype=dtype or preset.dtype)
    h = p.h
    w = gguf.GGUFWriter(path, h.arch)
    shapes = tensor_shapes(p)
    planter = None
    if routing is not None:
        routers = [int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.endswith(".ffn_gate_inp.weight")]
        planter = Planter(routing.resolved(h.n_expert, h.n_embd, h.n_vocab), h, routers, seed)
    tag = f"-{planter.p.tag}" if planter else ""
    write_metadata(w, h, f"moebench-synth-{preset if isinstance(preset, str) else h.arch}-{p.dtype}-s{seed}{tag}")
    if planter:
        planter.write_metadata(w)
    types = tensor_types(p.dtype, shapes, h.n_layers, h.arch, n_expert=h.n_expert, n_head=h.n_head,
                         n_head_kv=h.n_head_kv)        # llama-quantize's choice for this file type
    special = ARCHS[h.arch].synth_tensor
    for name, shape in shapes.items():     # the whole tensor table first, so the data can follow as it is made
        if special and (s := special(name, (1,) * len(shape), np.random.default_rng(0), h)):
            types[name] = s[1]                    # the type the architecture asks for (an I32 table, F32 scales)
        w.add_tensor_info(name, shape, np.float32, tensor_bytes(types[name], shape),
                          raw_dtype=gguf.GGMLQuantizationType[types[name]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    w.write_padding(f, f.tell())
    if sparse:                               # the data section left as a hole
        end = f.tell() + sum(w.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values())
        w.close()
        os.truncate(path, end)
        return
    for idx, (name, shape) in enumerate(shapes.items()):     # one tensor (an expert stack: one expert) at a time
        rng = np.random.default_rng([seed, idx])
        values = _values(special, name, shape, types[name], rng, h)
        n = sum(_write(f, planter.values(name, a) if planter else a, types[name]) for a in values)
        assert n == tensor_bytes(types[name], shape), (name, n)
        w.write_padding(f, n)
    w.close()


def _values(special, name: str, shape: tuple[int, ...], ggml_type: str, rng: np.random.Generator, h: Hparams):
    """A tensor's values; an expert stack (E, rows, k) one expert at a time (the same draws as one whole draw)."""
    if special and (s := special(name, shape, rng, h)):
        assert s[1] == ggml_type, (name, s[1], ggml_type)
        yield s[0]
    elif len(shape) == 3:
        for _ in range(shape[0]):
            yield _weights(shape[1:], name, rng)
    else:
        yield _weights(shape, name, rng)


def _write(f, a: np.ndarray, ggml_type: str) -> int:
    """Values a appended to f in ggml_type (llama.cpp's quantizer for block types); the bytes written."""
    if ggml_type in ("F32", "I32"):
        data = a
    elif ggml_type == "F16":
        data = a.astype(np.float16)
    else:
        data = quantize(a, ggml_type)
    data.tofile(f)
    return data.nbytes


def _cached(spec: str, seed: int) -> tuple[str, Preset, Planting | None, Path]:
    """`preset:NAME[:DTYPE][@zipf=S[@clusters=C]]` -> (name, preset, planted routing, its path in the cache)."""
    base, *opts = spec.split("@")
    _, name, *rest = base.split(":")
    p, routing = get_preset(name, rest[0] if rest else None), parse_options(opts)
    tag = f"-{routing.tag}" if routing else ""
    return name, p, routing, cache_dir() / "models" / f"{name}-{p.dtype}-s{seed}{tag}-v{FILE_VERSION}.gguf"


def cached_model(spec: str, seed: int = 0) -> Path:
    """`preset:NAME[:DTYPE][@zipf=S[@clusters=C]]` -> a synthesized file in the cache directory, created once and
    reused; the @ options plant a skewed, token-tied routing (workloads.planted)."""
    name, p, routing, path = _cached(spec, seed)
    return path if path.exists() else synthesize(name, path, seed=seed, dtype=p.dtype, routing=routing)


def preset_meta(spec: str, seed: int = 0) -> ModelMeta:
    """A preset's header as read_meta reads the synthesized file, without writing it (`plan`, `recommend`: a
    full-size preset's weights take 11-150 GB and minutes to make). The cached file when it exists (its real
    fingerprint, which measured runs carry); else the header and tensor table written to memory with the data a
    hole, and read back: the same fields, tensors and sizes, a fingerprint of that header alone, and `path` where
    the file would be synthesized."""
    name, p, routing, path = _cached(spec, seed)
    if path.exists():
        return read_meta(path)
    fd = os.memfd_create(f"moebench-{name}")      # a file in memory: read_meta reads it as any file
    try:
        _write_gguf(name, Path(f"/proc/self/fd/{fd}"), seed, p.dtype, True, routing)
        meta = read_meta(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return replace(meta, path=path)


def resolve_model(m: str, seed: int = 0) -> Path:
    """A -m/--model value: `preset:NAME[:DTYPE][@zipf=S[@clusters=C]]` (synthesized once into the cache) or a file
    path, made absolute
    against the user's directory (so is a relative MOEBENCH_CACHE): cells run in workers whose cwd is the project
    root, or on Ray nodes."""
    return (cached_model(m, seed) if m.startswith("preset:") else Path(m).expanduser()).absolute()
