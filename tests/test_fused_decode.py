"""The fused one-token decode (engines.reference.kernels.FusedDecode: attention and routing as one C++ call
each) against the model's own ATen ops, for every architecture whose features it implements, on stored
types f32, f16, q8_0 and q4_k_m (rows of 256: whole K-quant blocks); 8 prompt tokens, then 16 decodes.

Tolerance. Both paths multiply with the same kernels, x converted to the same f16 / int8 values and scales;
only the float ops around them (RMS norms, RoPE, softmax, attention sums) round differently, ~1e-7
relative. f32 files, with an f32 KV cache: logits (O(1-4)) within 1e-5 (measured <= 3e-6). Elsewhere (and
in the default f16 cache) that 1e-7 now and then moves an activation across a rounding boundary of its f16
or int8 form, and a value moved in K or V stays in the cache for every later step: f16 files within 5e-3
(measured <= 2e-3); block-quantized files median within 2e-2 and every logit within 0.1 (measured: exact
until the first moved value, then ~3e-2 at most), and the greedy token equal wherever the top two logits are
0.1 apart.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.base import EngineSettings
from engines.reference import kernels
from engines.reference.engine import ReferenceEngine
from engines.reference.archs import ARCHS
from workloads.synth import PRESETS, preset, synthesize

TINY = preset(PRESETS["tiny"], n_embd=256, n_head=4, head_dim=64, n_ff_exp=256, n_vocab=512)
ARCH_PRESETS = {
    "qwen3moe": TINY,
    "qwen2moe": preset(TINY, arch="qwen2moe", n_ff_shexp=256),
    "olmoe": preset(TINY, arch="olmoe", n_head_kv=4),            # q/k norms over the whole projection (256)
    "llama": preset(TINY, arch="llama", rope_base=10000.0),        # NORM RoPE
}
DTYPES = ["f32", "f16", "q8_0", "q4_k_m"]
PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 512, 24)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], Path]:
    d = tmp_path_factory.mktemp("fused")
    return {(a, dt): synthesize(preset(p, dtype=dt), d / f"{a}-{dt}.gguf") for a, p in ARCH_PRESETS.items()
            for dt in DTYPES}


def decode_logits(path: Path, fused: bool, n_prompt: int = 8, cache: str = "f16") -> tuple[np.ndarray, ReferenceEngine]:
    """Prefill PROMPT[:n_prompt], then decode the rest one token at a time: the logits of each decode (n, V)."""
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_ctx=64, n_ubatch=16, threads=2, extra={"fused_decode": fused, "cache_type": cache}))
    e.prefill(PROMPT[:n_prompt])
    out = []
    for t in PROMPT[n_prompt:]:
        e.decode(t)
        out.append(e.logits()[0].numpy().copy())
    return np.stack(out), e


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(ARCH_PRESETS))
def test_fused_decode_matches_unfused(models, arch, dtype):
    cache = "f32" if dtype == "f32" else "f16"
    fused, ef = decode_logits(models[arch, dtype], True, cache=cache)
    plain, ep = decode_logits(models[arch, dtype], False, cache=cache)
    assert ef.info().extra["fused_decode"] and not ep.info().extra["fused_decode"]
    err = np.abs(fused - plain)
    if dtype in ("f32", "f16"):
        assert err.max() < {"f32": 1e-5, "f16": 5e-3}[dtype], (arch, dtype, float(err.max()))
    else:
        assert np.median(err) < 2e-2 and err.max() < 0.1, (arch, dtype, float(np.median(err)), float(err.max()))
    top2 = np.sort(plain, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1
    assert (fused.argmax(-1) == plain.argmax(-1))[clear].all(), (arch, dtype)


def test_fused_steps_are_used_for_one_token_only(models, monkeypatch):
    """Decode goes through FusedDecode (once per layer and token); prefill never does."""
    calls = []
    orig = kernels.FusedDecode.attention
    monkeypatch.setattr(kernels.FusedDecode, "attention", lambda self, *a: calls.append(1) or orig(self, *a))
    e = ReferenceEngine()
    e.load(models["qwen2moe", "q8_0"], EngineSettings(n_ctx=64, n_ubatch=16, threads=2))
    e.prefill(PROMPT[:8])
    assert not calls
    e.decode(PROMPT[8])
    e.decode(PROMPT[9])
    assert len(calls) == 2 * TINY.h.n_layers


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "gemma4-tiny", "qwen35moe-tiny"])
def test_an_arch_beyond_the_fused_features_keeps_its_own_path(tmp_path, name, monkeypatch):
    p = PRESETS[name]
    assert not ARCHS[p.h.arch].features <= kernels.FUSED_FEATURES
    monkeypatch.setattr(kernels.FusedDecode, "attention", lambda *a: pytest.fail("fused attention called"))
    monkeypatch.setattr(kernels.FusedDecode, "route", lambda *a: pytest.fail("fused routing called"))
    e = ReferenceEngine()
    e.load(synthesize(p, tmp_path / f"{name}.gguf"), EngineSettings(n_ctx=32, threads=2))
    e.prefill(PROMPT[:4])
    e.decode(PROMPT[4])
    assert e.model.fused is None and not e.info().extra["fused_decode"]
    assert np.isfinite(e.logits().numpy()).all()


def test_fused_features_gate():
    qk = kernels.quant_kernels()
    if isinstance(qk, str):
        pytest.skip(qk)
    assert isinstance(qk.fused(frozenset({"rope_neox", "qk_norm_head", "norm_topk"})), kernels.FusedDecode)
    assert qk.fused(frozenset({"rope_neox", "attn_sinks"})) is None


@pytest.mark.parametrize("n_head,n_head_kv,head_dim", [(6, 2, 36), (10, 2, 64)])
def test_fused_attention_blocks_of_query_heads(tmp_path, n_head, n_head_kv, head_dim):
    """The fused attention takes a kv head's query heads in blocks of up to 4: 3 heads a kv head with a head size
    that is no whole number of vectors (36), and 5 heads (a block of 4 and one of 1), against the unfused path."""
    p = preset(TINY, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, dtype="f32")
    path = synthesize(p, tmp_path / "heads.gguf")
    fused, _ = decode_logits(path, True, cache="f32")
    plain, _ = decode_logits(path, False, cache="f32")
    assert np.abs(fused - plain).max() < 1e-5


@pytest.mark.parametrize("cache", ["float16", "float32"])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim,lo,end", [(6, 2, 36, 0, 1), (10, 2, 64, 5, 40), (8, 8, 16, 30, 64)])
@pytest.mark.parametrize("sinks", [False, True])
def test_attend_against_float64(cache, n_head, n_head_kv, head_dim, lo, end, sinks):
    """QuantKernels.attend (every model's one-token attention on the CPU) over a window of an f16 or f32 cache, with
    and without gpt-oss's sinks, against softmax(scale q K^T [, sink]) V in float64 on the cache's values."""
    import torch
    qk = kernels.quant_kernels()
    if isinstance(qk, str):
        pytest.skip(qk)
    g = torch.Generator().manual_seed(end)
    Kc, Vc = (torch.randn(n_head_kv, 64, head_dim, generator=g).to(getattr(torch, cache)) for _ in range(2))
    q = torch.randn(n_head * head_dim, generator=g)
    sk = torch.randn(n_head, generator=g) * 2 if sinks else None
    scale = head_dim ** -0.5
    got = qk.attend(q, Kc, Vc, lo, end, scale, sk)

    K, V = Kc[:, lo:end].double(), Vc[:, lo:end].double()
    s = (q.double().view(n_head_kv, -1, head_dim) @ K.transpose(1, 2)) * scale       # (Hkv, G, T)
    if sinks:
        s = torch.cat((s, sk.double().view(n_head_kv, -1, 1)), -1)
    p = torch.softmax(s, -1)[..., :end - lo]
    want = (p @ V).reshape(1, -1)
    assert got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="window"):
        qk.attend(q, Kc, Vc, 10, 65, scale)
    with pytest.raises(ValueError, match="Hkv"):
        qk.attend(q, Kc[:0].contiguous(), Vc[:0].contiguous(), 0, 1, scale)
