"""The reference engine's AVX512-BF16 decode kernels (engines.reference.kernels) against f32 math,
and decode with the kernels on vs off. On a CPU without avx512_bf16 the tests check the fallback."""
import csv
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engines.base import EngineSettings
from engines.errors import UserError
from engines.reference import kernels
from engines.reference.engine import ReferenceEngine
from tests.conftest import moebench, run_dir_of
from workloads.synth import PRESETS, synthesize

# qwen2moe: qkv bias and a shared expert, so every DecodeKernels.linear call site runs
TINY2 = replace(PRESETS["tiny"], arch="qwen2moe", n_ff_shexp=96)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, TINY2.n_vocab, 16)]


@pytest.fixture(scope="module")
def ext():
    e = kernels.load()
    if not kernels.cpu_has_avx512_bf16():        # no kernel here: the reason must say so
        assert e == "the CPU has no avx512_bf16"
        pytest.skip("this CPU has no avx512_bf16: the bf16 decode kernels cannot run here")
    assert not isinstance(e, str), e              # this CPU has the instructions: it must compile
    return e


def bound(W: torch.Tensor, x: torch.Tensor) -> float:
    """fp32-accumulation tolerance: 1e-5 of the largest sum |w_i x_i| (K <= 1024: K * 2^-24 ~ 6e-5 worst)."""
    return 1e-5 * float((W.abs().float() @ x.abs().float().reshape(-1)).max())


def test_matvec_matches_f32_linear(ext):
    g = torch.Generator().manual_seed(0)
    for N, K in [(300, 200), (64, 1024), (5, 33)]:     # K % 32 tails, K % 128 remainders, tiny N
        W = torch.randn(N, K, generator=g).bfloat16()
        x = torch.randn(1, K, generator=g).bfloat16()
        ref = F.linear(x.float(), W.float())
        for xin in (x, x.float(), x[0]):                # (1, K) bf16, f32 (cast inside), (K,)
            y = ext.matvec(xin, W)
            assert y.dtype == torch.float32 and y.shape == (1, N)
            torch.testing.assert_close(y, ref, rtol=0, atol=bound(W, x))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.matvec(x, W.t())                            # transposed views are refused, not misread


def test_rms_norm_matches_aten(ext):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1024, generator=g) * 3
    w = torch.randn(1024, generator=g)
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-6), F.rms_norm(x, (1024,), w, 1e-6), rtol=1e-6, atol=1e-6)
    qk = torch.randn(1, 20, 64, generator=g)          # per-head norm: rows of the last dim, no weight
    torch.testing.assert_close(ext.rms_norm(qk, None, 1e-5), F.rms_norm(qk, (64,), None, 1e-5), rtol=1e-6, atol=1e-6)
    norm = kernels.DecodeKernels(ext).norm
    many = torch.randn(7, 1024, generator=g)          # batches go to ATen, same results
    torch.testing.assert_close(norm(many, (1024,), w, 1e-6), F.rms_norm(many, (1024,), w, 1e-6))
    with pytest.raises(RuntimeError, match="w: "):
        ext.rms_norm(x, w[:10], 1e-6)                 # a weight of the wrong size is refused, not misread


def test_moe_decode_matches_f32_experts(ext):
    g = torch.Generator().manual_seed(1)
    E, D, ff, k = 6, 160, 96, 3
    gu = (torch.randn(E, 2 * ff, D, generator=g) * 0.1).bfloat16()
    dn = (torch.randn(E, D, ff, generator=g) * 0.1).bfloat16()
    x = torch.randn(1, D, generator=g).bfloat16()
    ids, w = torch.tensor([[4, 0, 5]]), torch.softmax(torch.randn(1, k, generator=g), -1)
    ref = torch.zeros(1, D)
    for j, e in enumerate(ids[0].tolist()):             # the kernel rounds silu(g)*u to bf16 for the down product
        gate, up = F.linear(x.float(), gu[e].float()).chunk(2, dim=-1)
        ref += w[0, j] * F.linear((F.silu(gate) * up).bfloat16().float(), dn[e].float())
    y = ext.moe_decode(x, gu, dn, ids, w)
    assert y.shape == (1, D) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-4)


ARCHS = {"qwen3moe": replace(PRESETS["tiny"], dtype="f16"), "qwen2moe": replace(TINY2, dtype="f16"),
         "olmoe": replace(PRESETS["tiny"], arch="olmoe", n_head_kv=4, dtype="f16"),
         "llama": replace(PRESETS["tiny"], arch="llama", rope_base=1e4, dtype="f16")}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_decode_matches_model_ops(tmp_path, ext, arch):
    """The fused one-token attention (per-head / whole-projection / no q-k norm, qkv bias, NEOX and
    NORM RoPE, GQA) against model.attention's ATen ops on the same weights and a cache filled by a
    real prefill: same K/V rows written at pos, same output within bf16 rounding of o (measured: equal).
    The fused ffn norm + routing against F.rms_norm + model.route (top-k renormalized or not)."""
    from engines.reference.model import attention, route

    e = ReferenceEngine()
    e.load(synthesize(ARCHS[arch], tmp_path / f"{arch}.gguf"), EngineSettings(n_ctx=64, threads=2, dtype="bf16"))
    m = e.model
    e.prefill(PROMPT)
    pos, g = len(PROMPT), torch.Generator().manual_seed(4)
    for il in (0, m.cfg.n_layers - 1):
        x = torch.randn(1, m.cfg.n_embd, generator=g) * 2
        kv = [(m.k_layers[il].clone(), m.v_layers[il].clone()) for _ in range(2)]
        fused = m.fused.attention(m.cfg, m.w.layers[il], *kv[0], m.cos, m.sin, x, pos)
        qk_norm = m.qk_norm[il] if m.qk_norm else None
        ref = attention(m.cfg, m.w.layers[il], qk_norm, *kv[1], m.cos, m.sin, x, pos, m.dtype, m.linear, m.norm)
        torch.testing.assert_close(kv[0][0][:, :pos + 1], kv[1][0][:, :pos + 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kv[0][1][:, :pos + 1], kv[1][1][:, :pos + 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fused, ref, rtol=0, atol=2e-2 * float(ref.abs().max()))
        h, w, ids = m.fused.norm_route(m.cfg, m.w.layers[il], x)
        h_ref = F.rms_norm(x, (m.cfg.n_embd,), m.w.layers[il].ffn_norm, m.cfg.rms_eps)
        w_ref, ids_ref = route(m.cfg, m.w.layers[il], h_ref)
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(ids, ids_ref), (ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="pos"):
        m.fused.attention(m.cfg, m.w.layers[0], m.k_layers[0], m.v_layers[0], m.cos, m.sin, x,
                          64)   # past n_ctx: refused


def test_hugepage_copy_is_an_aligned_equal_copy():
    big = torch.randn(1024, 1024).bfloat16()            # 2 MiB: copied
    h = kernels.hugepage_copy(big)
    assert h.data_ptr() != big.data_ptr() and h.data_ptr() % kernels.HUGE == 0 and torch.equal(h, big)
    small = torch.randn(16, 16)
    assert kernels.hugepage_copy(small) is small


def decode_run(path, mode: str, depth: int, dtype: str = "bf16"):
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=64, n_ubatch=16, threads=2, dtype=dtype,
                                extra={"decode_matvec": mode}))
    e.prefill(PROMPT[:8])
    out = [e.logits()[-1].clone()]
    for t in PROMPT[8:]:
        e.decode(t)
        out.append(e.logits()[0].clone())
    return torch.stack(out).numpy(), e


def test_decode_with_kernels_stays_close_to_f32(tmp_path, ext):
    """bf16 compute, half the layers' experts on the host path, logits O(4): with the kernels, the
    prefill's last position and 8 decode steps stay within 0.06 of an f32-compute run (measured
    0.029; ATen's bf16 path, which rounds every product to bf16, is off by up to 0.2 here) with the
    same top-1 everywhere."""
    path = synthesize(TINY2, tmp_path / "qwen2moe.gguf")
    depth = TINY2.n_layers // 2
    f32, _ = decode_run(path, "aten", depth, dtype="f32")
    aten, ea = decode_run(path, "aten", depth)
    kern, ek = decode_run(path, "auto", depth)
    assert ea.info().extra["decode_matvec"] == "aten"
    assert ek.info().extra["decode_matvec"] == ("aten" if ext is None else "avx512bf16-kernel")
    assert ek.counters()["moe_calls_host"] == 9 * depth        # 1 prefill ubatch + 8 decodes per host layer
    err, err_aten = np.abs(kern - f32).max(), np.abs(aten - f32).max()
    assert err < (0.25 if ext is None else 0.06), f"kernels {err}, aten {err_aten}"
    assert (kern.argmax(-1) == f32.argmax(-1)).all()


def test_unknown_decode_matvec_is_a_user_error(tmp_path):
    path = synthesize(TINY2, tmp_path / "qwen2moe.gguf")
    with pytest.raises(UserError, match="decode_matvec 'fast' is not one of auto, aten"):
        ReferenceEngine().load(path, EngineSettings(n_ctx=32, extra={"decode_matvec": "fast"}))


def test_sweep_compiles_the_kernels_before_the_cell(tmp_path):
    """With an empty kernel cache the harness compiles the kernels (ReferenceEngine.prepare, in a child
    of the harness) before the cell starts, so the cell's load time and peak RAM are the engine's own:
    compiled inside the cell, load took ~30 s and the peak held g++'s ~1.3 GB."""
    cache = tmp_path / "cache"
    model = synthesize(ARCHS["qwen3moe"], tmp_path / "tiny-f16.gguf")       # f16: bf16 compute, kernels used
    r = moebench("sweep", "-m", model, "-e", "reference", "-w", "tg4", "-r", "1", "--threads", "2",
                 "--results-dir", tmp_path / "res", "--format", "csv", env={"MOEBENCH_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    built = list(cache.glob("kernels/torch-*/*.so"))
    assert len(built) == (1 if kernels.cpu_has_avx512_bf16() else 0), built
    cell = next(csv.DictReader(open(run_dir_of(r) / "cells.csv")))
    assert cell["status"] == "ok" and float(cell["load_s"]) < 10 and float(cell["peak_rss_mib"]) < 1000, cell


def test_fused_kernels_run_only_the_features_they_implement(tmp_path, monkeypatch):
    """An architecture with a feature the fused decode kernels do not implement decodes through the
    model's own ops, and info() says which feature kept the kernels out."""
    import dataclasses

    from engines.reference import archs

    fake = dataclasses.replace(archs.ARCHS["qwen3moe"], features=archs.ARCHS["qwen3moe"].features | {"attn_sinks"})
    monkeypatch.setitem(archs.ARCHS, "qwen3moe", fake)
    e = ReferenceEngine()
    e.load(synthesize(ARCHS["qwen3moe"], tmp_path / "q.gguf"), EngineSettings(n_ctx=64, threads=2, dtype="bf16"))
    assert e.model.fused is None
    assert e.info().extra["decode_matvec"] == "aten"
    assert e.info().extra["decode_matvec_note"] == "the fused kernels lack attn_sinks"
