"""Synthetic random-weight MoE GGUF models that llama.cpp and the reference engine both load.

Deterministic: the same preset, dtype and seed give the same bytes (each tensor draws from its own
generator seeded by (seed, tensor index)). Numpy shapes are the reverse of ggml `ne`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engines.errors import UserError
from engines.paths import cache_dir
from engines.reference.archs import ARCHS, Hparams


@dataclass(frozen=True)
class Preset:
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    n_ctx_train: int = 32768
    dtype: str = "f16"          # f32 | f16 | bf16 | q8_0 | q4_0 (matrices; norms stay f32)
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    n_ff_shexp: int = 0         # qwen2moe shared expert width


PRESETS: dict[str, Preset] = {
    # a few MB: unit and integration tests
    "tiny": Preset("qwen3moe", 4, 128, 4, 2, 32, 8, 2, 64, 1024, dtype="f32"),
    # ~0.9 GB: the measured reference point in DESIGN.md
    "small": Preset("qwen3moe", 8, 1024, 16, 4, 64, 32, 4, 512, 4096),
    # Qwen3-30B-A3B layer shapes (n_embd 2048, 128 experts, top-8, expert ff 768, 32/4 heads x 128)
    # with 4 of its 48 layers and a 32K vocab: ~5 GB in f16
    "qwen3-30b-a3b-4l": Preset("qwen3moe", 4, 2048, 32, 4, 128, 128, 8, 768, 32768),
}
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def get_preset(name: str, dtype: str | None = None) -> Preset:
    if name not in PRESETS:
        raise UserError(f"Unknown preset {name!r}; choose from: {', '.join(PRESETS)}.")
    if dtype and dtype not in DTYPES:
        raise UserError(f"Unknown dtype {dtype!r}; choose from: {', '.join(DTYPES)}.")
    return replace(PRESETS[name], dtype=dtype) if dtype else PRESETS[name]


def hparams(p: Preset) -> Hparams:
    """The preset as the architecture table's hyperparameters (what its tensor shapes are computed from)."""
    if p.arch not in ARCHS:
        raise UserError(f"Cannot synthesize architecture {p.arch!r}; supported: {', '.join(ARCHS)}.")
    return Hparams(arch=p.arch, n_layers=p.n_layers, n_embd=p.n_embd, n_head=p.n_head, n_head_kv=p.n_head_kv,
                   head_dim=p.head_dim, n_expert=p.n_expert, n_expert_used=p.n_expert_used, n_ff_exp=p.n_ff_exp,
                   n_ff_shexp=p.n_ff_shexp, n_vocab=p.n_vocab, rope_base=p.rope_base, rms_eps=p.rms_eps,
                   expert_weights_scale=0.0, tied_output=False, features=ARCHS[p.arch].features)


def tensor_shapes(p: Preset) -> dict[str, tuple[int, ...]]:
    """Every tensor the llama.cpp loader expects for p.arch (engines.reference.archs), name -> numpy shape."""
    return ARCHS[p.arch].shapes(hparams(p))


def _metadata(w, p: Preset, name: str) -> None:
    w.add_name(name)
    w.add_block_count(p.n_layers)
    w.add_context_length(p.n_ctx_train)
    w.add_embedding_length(p.n_embd)
    w.add_feed_forward_length(p.n_ff_exp)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_rope_dimension_count(p.head_dim)
    w.add_rope_freq_base(p.rope_base)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_expert_count(p.n_expert)
    w.add_expert_used_count(p.n_expert_used)
    w.add_expert_feed_forward_length(p.n_ff_exp)
    if p.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(p.n_ff_shexp)
    w.add_vocab_size(p.n_vocab)
    w.add_tokenizer_model("no_vocab")


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


def synthesize(preset: str | Preset, out: str | Path, seed: int = 0, dtype: str | None = None) -> Path:
    """Write a random-weight GGUF for the preset; returns the path. Same inputs -> same bytes."""
    import gguf

    p = get_preset(preset, dtype) if isinstance(preset, str) else preset
    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
              "q4_0": gguf.GGMLQuantizationType.Q4_0}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, p.arch)
    _metadata(w, p, f"moebench-synth-{preset if isinstance(preset, str) else p.arch}-{p.dtype}-s{seed}")
    for idx, (name, shape) in enumerate(tensor_shapes(p).items()):
        a = _weights(shape, name, np.random.default_rng([seed, idx]))
        qt = qtypes[p.dtype] if a.ndim > 1 else gguf.GGMLQuantizationType.F32
        if qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)   # uint8 data: shape from bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)   # atomic: a half-written file never looks like a model
    return out


def cached_model(spec: str, seed: int = 0) -> Path:
    """`preset:NAME[:DTYPE]` -> a synthesized file in the cache directory, created once and reused."""
    _, name, *rest = spec.split(":")
    p = get_preset(name, rest[0] if rest else None)
    path = cache_dir() / "models" / f"{name}-{p.dtype}-s{seed}.gguf"
    return path if path.exists() else synthesize(name, path, seed=seed, dtype=p.dtype)


def resolve_model(m: str, seed: int = 0) -> Path:
    """A -m/--model value: `preset:NAME[:DTYPE]` (synthesized once into the cache) or a file path."""
    return cached_model(m, seed) if m.startswith("preset:") else Path(m)
