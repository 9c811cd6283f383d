"""workloads.quantize against llama.cpp itself: llama_model_quantize on small synthesized f32 models.

For every tensor of every quantized file, tensor_type() must name the type llama.cpp chose and
quantize() must produce llama.cpp's bytes. The models are shaped to reach the rules: 8 layers (so
"first eighth" and use_more_bits pick layers), exactly 8 experts (the attn_k/attn_v/attn_output
bumps), GQA 4 with 4 experts, rows that are not whole 256-blocks or not even 32-blocks (fallbacks),
tied embeddings (no output.weight), and 80 llama layers with GQA (the 70B rule).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from workloads.quantize import (FTYPES, GGML_TYPES, allows_quantization, quantize, requires_imatrix, tensor_type,
                                tensor_types)
from workloads.synth import PRESETS, Preset, preset, synthesize, tensor_shapes, write_metadata
from tests.conftest import for_each, isolated

llama_cpp = pytest.importorskip("llama_cpp")

TINY = PRESETS["tiny"]
MODELS: dict[str, Preset] = {
    # 8 layers, 8 experts, n_gqa 2, every row a multiple of 256
    "moe8": preset(TINY, n_layers=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_ff_exp=256,
                    n_vocab=512),
    # qwen2moe: shared experts, q/k/v biases, n_gqa 4, 4 experts
    "gqa4": preset(TINY, arch="qwen2moe", n_layers=4, n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_expert=4,
                    n_ff_exp=256, n_ff_shexp=256, n_vocab=512),
    # rows of 160 (not whole 256-blocks) and 48 (not even whole 32-blocks) values
    "odd": preset(TINY, n_layers=4, n_embd=160, n_head=4, n_head_kv=2, head_dim=40, n_expert=4, n_ff_exp=48,
                   n_vocab=320),
    # no output.weight: token_embd.weight takes output's rule
    "tied": preset(TINY, n_layers=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=4, n_ff_exp=256,
                    n_vocab=512),
    # llama (Mixtral-style) with 80 layers and GQA: llama.cpp calls it a 70B, attn_v gets Q5_K instead of Q4_K
    "70b": preset(TINY, arch="llama", n_layers=80, n_embd=256, n_head=4, n_head_kv=1, head_dim=16, n_expert=2,
                   n_expert_used=1, n_ff_exp=32, n_vocab=256),
}
CASES = ([("moe8", f) for f in FTYPES] + [("gqa4", f) for f in ("q4_0", "q4_k_m", "q6_k", "iq4_xs", "mxfp4")]
         + [("odd", f) for f in ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "iq4_xs", "mxfp4")]
         + [("tied", f) for f in ("q8_0", "q4_k_m", "mxfp4")] + [("70b", "q4_k_m")])


def _write_tied(p: Preset, path: Path) -> Path:
    """A qwen3moe f32 GGUF without output.weight (llama.cpp then ties the output to token_embd)."""
    w = gguf.GGUFWriter(path, p.h.arch)
    write_metadata(w, p.h, "tied")
    for i, (name, shape) in enumerate(tensor_shapes(p).items()):
        if name != "output.weight":
            w.add_tensor(name, np.random.default_rng([7, i]).standard_normal(shape, dtype=np.float32) * 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("quant")
    return {name: (_write_tied(p, d / f"{name}.gguf") if name == "tied" else synthesize(p, d / f"{name}.gguf"))
            for name, p in MODELS.items()}


def _llama_quantize(src: Path, ftype: str) -> Path:
    """src quantized by llama.cpp to ftype. Run it isolated()."""
    dst = src.with_name(f"{src.stem}-{ftype}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype].llama_ftype
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0
    return dst


@pytest.fixture(scope="module")
def quantized(models) -> dict[tuple[str, str], Path]:
    """Every case's file quantized by llama.cpp, all in one child process (a child costs a second of imports)."""
    return isolated(for_each, _llama_quantize, {(m, f): (models[m], f) for m, f in CASES})


@pytest.mark.parametrize("model,ftype", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_types_and_bytes_match_llama_cpp(models, quantized, model, ftype):
    p = MODELS[model]
    src = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(models[model]).tensors}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in gguf.GGUFReader(models[model]).tensors}
    h = p.h
    ours = tensor_types(ftype, shapes, h.n_layers, h.arch, n_expert=h.n_expert, n_head=h.n_head,
                        n_head_kv=h.n_head_kv)
    out = gguf.GGUFReader(quantized[model, ftype])
    assert {t.name for t in out.tensors} == set(shapes)
    wrong_type, wrong_bytes = [], []
    for t in out.tensors:
        theirs = t.tensor_type.name
        if ours[t.name] != theirs:
            wrong_type.append(f"{t.name}: llama.cpp {theirs}, tensor_type {ours[t.name]}")
        elif quantize(src[t.name].reshape(shapes[t.name]), theirs).tobytes() != np.asarray(t.data).tobytes():
            wrong_bytes.append(f"{t.name} ({theirs})")
    assert not wrong_type and not wrong_bytes, (wrong_type, wrong_bytes)
    # the model reaches the rules it was built for
    seen = Counter(ours.values())
    expected = {
        ("moe8", "q4_k_m"): {"Q4_K", "Q6_K", "Q5_K", "Q8_0", "F32"}, ("moe8", "iq4_xs"): {"IQ4_XS", "Q5_K", "Q6_K",
                                                                                          "Q8_0"},
        ("moe8", "q5_k_m"): {"Q5_K", "Q6_K", "Q8_0"}, ("moe8", "q4_0"): {"Q4_0", "Q6_K", "Q8_0"},
        ("moe8", "mxfp4"): {"MXFP4", "Q8_0", "F32"}, ("gqa4", "iq4_xs"): {"IQ4_XS", "Q5_K", "Q6_K"},
        ("odd", "q4_k_m"): {"Q5_0", "Q8_0", "F16"}, ("odd", "q5_k_m"): {"Q5_1", "Q8_0", "F16"},
        ("odd", "iq4_xs"): {"IQ4_NL", "F16"}, ("odd", "mxfp4"): {"F16", "Q8_0"},
        ("tied", "q4_k_m"): {"Q6_K"}, ("70b", "q4_k_m"): {"Q5_K", "Q6_K"},
    }.get((model, ftype), set())
    assert expected <= set(seen), seen


def test_rules_without_llama_cpp():
    kw = dict(n_layers=8, arch="qwen3moe", n_expert=128, n_head=32, n_head_kv=4)
    assert tensor_type("q4_k_m", "blk.0.ffn_down_exps.weight", (128, 2048, 768), **kw) == "Q6_K"
    assert tensor_type("q4_k_m", "blk.1.ffn_down_exps.weight", (128, 2048, 768), **kw) == "Q4_K"
    assert tensor_type("q4_k_m", "blk.3.ffn_down_exps.weight", (128, 2048, 768), **kw) == "Q6_K"  # (3-1)%3 == 2
    assert tensor_type("q4_k_m", "blk.1.ffn_up_exps.weight", (128, 768, 2048), **kw) == "Q4_K"
    assert tensor_type("q4_k_m", "blk.1.attn_v.weight", (512, 2048), **kw) == "Q4_K"
    assert tensor_type("q4_k_m", "blk.7.attn_v.weight", (512, 2048), **kw) == "Q6_K"
    assert tensor_type("q4_k_m", "blk.1.ffn_gate_inp.weight", (128, 2048), **kw) == "F32"
    assert tensor_type("q4_k_m", "blk.1.attn_norm.weight", (2048,), **kw) == "F32"
    assert tensor_type("q4_k_m", "output.weight", (32768, 2048), **kw) == "Q6_K"
    assert tensor_type("q4_k_m", "token_embd.weight", (32768, 2048), **kw) == "Q4_K"
    assert tensor_type("iq4_xs", "blk.1.attn_v.weight", (512, 2048), **kw) == "Q5_K"     # n_gqa 8
    assert tensor_type("iq4_xs", "blk.0.ffn_down_exps.weight", (128, 2048, 768), **kw) == "Q5_K"
    assert tensor_type("mxfp4", "blk.0.ffn_down_exps.weight", (128, 2048, 768), **kw) == "MXFP4"
    assert tensor_type("mxfp4", "blk.0.attn_q.weight", (4096, 2048), **kw) == "Q8_0"
    assert tensor_type("mxfp4", "blk.0.ffn_down_exps.weight", (1, 2048, 768), **kw) == "Q8_0"  # ne[2] == 1
    # gpt-oss widths: 2880 is whole 32-blocks but not 256-blocks
    assert tensor_type("q4_k_m", "blk.1.ffn_up_exps.weight", (32, 2880, 2880), **kw) == "Q5_0"
    assert tensor_type("q6_k", "blk.1.ffn_up_exps.weight", (32, 2880, 2880), **kw) == "Q8_0"
    assert tensor_type("iq4_xs", "blk.1.ffn_up_exps.weight", (32, 2880, 2880), **kw) == "IQ4_NL"
    assert tensor_type("q4_k_m", "output.weight", (201088, 2880), **kw) == "Q8_0"
    assert tensor_type("q8_0", "blk.1.attn_sinks.weight", (64,), **kw) == "F32"
    assert tensor_type("f16", "blk.1.ffn_gate_inp.weight", (128, 2048), **kw) == "F32"
    assert tensor_type("bf16", "blk.1.ffn_up_exps.weight", (128, 768, 2048), **kw) == "BF16"
    assert not allows_quantization("blk.0.ffn_gate_inp_shexp.weight", (1, 2048))    # ggml_n_dims 1
    assert tensor_type("q4_k_m", "blk.0.attn_qkv.weight", (3 * 2048, 2048), **kw) == "Q6_K"  # counts as attn_v
    with pytest.raises(ValueError, match="Unknown file type"):
        tensor_type("q3_k_m", "output.weight", (10, 256), **kw)


def test_quantize_api():
    a = np.random.default_rng(3).standard_normal((2, 5, 512), dtype=np.float32)
    for t in GGML_TYPES:
        assert not requires_imatrix(t)
        q = quantize(a, t)
        assert q.dtype == np.uint8 and q.shape == (2, 5, 512 // GGML_TYPES[t][1] * GGML_TYPES[t][2])
        assert np.array_equal(q, quantize(a, t, n_threads=1)) and np.array_equal(q, quantize(a[None], t)[0])
    assert np.array_equal(quantize(a, "F16").view(np.float16), a.astype(np.float16))
    with pytest.raises(ValueError, match="whole blocks of 256 values, but the rows have k = 2880"):
        quantize(np.zeros((4, 2880), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize(np.zeros((4, 48), np.float32), "MXFP4")
    with pytest.raises(ValueError, match="Cannot quantize"):
        quantize(a, "Q3_K")
    bad = a.copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="invalid blocks"):
        quantize(bad, "Q8_0")
