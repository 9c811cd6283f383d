"""qwen35moe (Qwen3.5-35B-A3B family) in the reference engine against llama.cpp on the same synthesized files.

The tiny preset: blocks G G A G G A + 1 MTP block (G = Gated DeltaNet, A = gated attention), n_embd 256,
16 experts top-4. The prompt (200 tokens) is prefilled in ubatches of 80 (80 + 80 + 40): the chunked DeltaNet
(chunk 64) crosses a chunk boundary inside each of the first two ubatches, pads every chunk tail, and carries
its state across ubatches; then one-token decode steps run the recurrence.
"""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.base import EngineSettings
from engines.errors import UserError
from engines.reference.archs import ARCHS
from engines.reference.engine import ReferenceEngine
from engines.reference.models.qwen35moe import delta_chunked, delta_step
from workloads.synth import PRESETS, preset, synthesize, write_metadata
from tests import conftest

TINY = PRESETS["qwen35moe-tiny"]
H = TINY.h                                            # 7 blocks: 6 trunk + 1 MTP
ALL = H.n_layers
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, H.n_vocab, 200)]
N_NEW = 16
UBATCH = 80
# f32 weights, f32 KV cache on both sides: what differs is summation order (and the chunked vs per-token delta
# rule, 1e-14 apart in float64). Measured 1.2e-5 on logits of |x| <= ~5; 1e-3 leaves room for other ISAs'
# summation orders and is far below the smallest top-1/top-2 gap that matters for the top-1 checks.
F32_ATOL = 1e-3
# quantized file: both engines convert the activations of every quantized product to the same ggml blocks (q8_K
# for IQ4_XS/Q6_K, q8_0 for the 32-value fallbacks), byte for byte; float sums in other orders now and then tip
# an int8 rounding or a near-tied router (top-4 of 16 experts here), which moves the later logits (measured with
# ubatches of 80, against llama.cpp's AVX-512 / AVX2 builds: median row max |diff| 0.28 / 0.08, every top-1
# miss at a llama.cpp top-1/top-2 gap below 0.27). Top-1 is compared where that gap exceeds CLEAR_MARGIN.
CLEAR_MARGIN = 0.3


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qwen35moe")
    return {"f32": synthesize(TINY, d / "tiny-f32.gguf"),
            "iq4_xs": synthesize(preset(TINY, "iq4_xs"), d / "tiny-iq4_xs.gguf")}


def llama_cpp_run(path: Path, tokens=PROMPT, n_new=N_NEW) -> tuple[np.ndarray, list[int], np.ndarray]:
    """llama.cpp with an f32 KV cache: prompt logits (n, V), then a greedy continuation of n_new one-token
    decodes: its tokens and the logits each was chosen from (n_new, V). Run it conftest.isolated()."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=32, n_threads=2, logits_all=True,
                          verbose=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(tokens)
    prompt = np.array(llm.scores[:len(tokens)], dtype=np.float32)
    last, gen, steps = prompt[-1], [], []
    for _ in range(n_new):
        gen.append(int(last.argmax()))
        steps.append(last)
        llm.eval([gen[-1]])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    llm.close()
    return prompt, gen, np.stack(steps)


@pytest.fixture(scope="module")
def llama(files) -> dict[str, tuple]:
    return conftest.isolated(conftest.for_each, llama_cpp_run, {k: (p,) for k, p in files.items()})


def engine(path: Path, depth: int, n_ubatch: int = UBATCH, **extra) -> ReferenceEngine:
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=256, n_ubatch=n_ubatch, threads=2,
                                extra={"logits_all": True, "cache_type": "f32"} | extra))
    return e


def reference_run(path: Path, depth: int, forced: list[int], n_ubatch: int = UBATCH, tokens=PROMPT):
    """Prompt logits (n, V), then one-token decodes of `forced` (llama.cpp's continuation): the logits before
    each forced token (len(forced), V)."""
    e = engine(path, depth, n_ubatch)
    e.prefill(tokens)
    prompt, steps = e.logits().numpy(), [e.logits()[-1].numpy()]
    for t in forced[:-1]:
        e.decode(t)
        steps.append(e.logits()[-1].numpy())
    return prompt, np.stack(steps)


@pytest.mark.parametrize("depth", [0, ALL])
def test_f32_logits_match_llama_cpp(files, llama, depth):
    """Every prompt position and every decode step within F32_ATOL of llama.cpp, same top-1 everywhere. The decode
    steps are fed llama.cpp's greedy continuation and pick it themselves: the same greedy continuation."""
    ref_prompt, gen, ref_steps = llama["f32"]
    prompt, steps = reference_run(files["f32"], depth, gen)
    assert steps.argmax(-1).tolist() == gen
    for got, ref in ((prompt, ref_prompt), (steps, ref_steps)):
        assert got.shape == ref.shape and np.isfinite(got).all()
        err = np.abs(got - ref).max()
        assert err < F32_ATOL, f"depth {depth}: max |logit diff| {err}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("depth", [0, ALL])
def test_iq4_xs_top1_matches_llama_cpp_where_clear(files, llama, depth):
    """The real model's expert format (IQ4_XS; output Q6_K): the same top-1 wherever llama.cpp's own
    top-1/top-2 gap exceeds CLEAR_MARGIN (see there: near-tied routers can pick other experts), logits close on
    the whole. Ubatches of 32 keep
    prefill products on the int8 rows kernel with dtype bf16 too (more rows: its GEMM on AVX512 CPUs)."""
    ref_prompt, gen, ref_steps = llama["iq4_xs"]
    prompt, steps = reference_run(files["iq4_xs"], depth, gen, n_ubatch=32)
    got, ref = np.concatenate((prompt, steps)), np.concatenate((ref_prompt, ref_steps))
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR_MARGIN
    agree = got.argmax(-1) == ref.argmax(-1)
    assert clear.sum() > 50 and agree[clear].all() and agree.mean() > 0.8
    diff = np.abs(got - ref)           # measured: median 0.055, max 0.98 (logits |x| <= ~4.5)
    assert np.median(diff) < 0.1 and diff.max() < 1.5, (np.median(diff), diff.max())


def test_greedy_continuation_identical_at_depths_0_half_all(files, llama):
    """Depths 0 and all follow llama.cpp's greedy continuation step by step (test_f32_logits_match_llama_cpp);
    here the reference engine's own greedy loop at half depth (3 of 6 trunk layers' experts on the host)."""
    e = engine(files["f32"], ALL // 2)
    e.prefill(PROMPT)
    out = [int(e.logits()[-1].argmax())]
    for _ in range(N_NEW - 1):
        e.decode(out[-1])
        out.append(int(e.logits()[-1].argmax()))
    assert out == llama["f32"][1] and len(set(out)) > 4          # a real continuation, not one token repeated


def test_host_experts_are_those_llama_cpp_overrides(files):
    """At every depth the reference engine keeps in host RAM exactly the expert tensors llama.cpp's --n-cpu-moe
    moves to the CPU (its own log). The MTP block's experts (block 6) are never loaded by either engine."""
    from engines.gguf_meta import read_meta
    path = files["iq4_xs"]
    by_layer = {}
    for t in read_meta(path).tensors:
        if t.layer is not None:
            by_layer.setdefault(t.layer, set()).add(t.name)
    depths = (0, 2, H.n_trunk, ALL)
    theirs = conftest.isolated(conftest.for_each, conftest.llama_cpp_load, {
        d: (path, EngineSettings(n_cpu_moe=d, n_ctx=64, n_batch=64, n_ubatch=64, threads=2)) for d in depths})
    for depth in depths:
        li, _ = theirs[depth]
        e = engine(path, depth)
        held = {n for il, s in enumerate(e.moe.layers) if s is not None and s.on_host for n in by_layer[il]}
        assert held == set(li.extra["overridden_tensors"]) == {n for il in range(min(depth, H.n_trunk))
                                                                for n in by_layer[il]}
        assert len(e.moe.layers) == H.n_trunk                                       # MTP experts let go
        if depth <= H.n_trunk:   # engine.py also counts the never-loaded MTP experts under depth ALL
            info = e.info()
            assert info.n_overridden_tensors == li.n_overridden_tensors == 3 * depth
            assert info.expert_bytes_host == li.expert_bytes_host


def test_host_and_stream_paths_give_the_same_output(files):
    host, stream = (engine(files["f32"], ALL, moe_path=p) for p in ("host", "stream"))
    for e in (host, stream):
        e.prefill(PROMPT)
    np.testing.assert_allclose(stream.logits().numpy(), host.logits().numpy(), atol=1e-5)
    n_ub = -(-len(PROMPT) // UBATCH)
    assert host.counters()["moe_calls_host"] == stream.counters()["moe_calls_stream"] == n_ub * H.n_trunk
    assert stream.counters()["moe_calls_host"] == host.counters()["moe_calls_stream"] == 0


def test_reset_zeroes_the_recurrent_state(files):
    """After reset() a prompt gives what it gives in a fresh engine (the DeltaNet states start from zero)."""
    e = engine(files["f32"], 0)
    e.prefill(PROMPT[:50])
    e.decode(PROMPT[50])
    e.reset()
    e.prefill(PROMPT[100:140])
    fresh = engine(files["f32"], 0)
    fresh.prefill(PROMPT[100:140])
    assert torch.equal(e.logits(), fresh.logits())
    assert all(t.abs().max() > 0 for il, c in enumerate(e.model.caches) if H.recurrent(il) for t in c)


def test_chunked_delta_rule_equals_the_recurrence():
    """float64, random inputs with llama.cpp's value ranges: 150 tokens = chunks 64 + 64 + 22 (padded), from a
    nonzero state; the chunked form and the token-by-token step agree to rounding."""
    g = torch.Generator().manual_seed(0)
    n, Hh, dk, dv = 150, 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(n, Hh, dk, generator=g, dtype=torch.float64), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, Hh, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(n, Hh, dv, generator=g, dtype=torch.float64)
    gl = -torch.rand(n, Hh, generator=g, dtype=torch.float64) * 0.3        # log-decay <= 0
    beta = torch.rand(n, Hh, generator=g, dtype=torch.float64)
    S0 = torch.randn(Hh, dk, dv, generator=g, dtype=torch.float64)
    S1, S2 = S0.clone(), S0.clone()
    o1 = torch.stack([delta_step(q[t], k[t], v[t], gl[t], beta[t], S1) for t in range(n)])
    o2 = delta_chunked(q, k, v, gl, beta, S2)
    assert (o1 - o2).abs().max() < 1e-12 and (S1 - S2).abs().max() < 1e-12


def test_layout_variants_match_llama_cpp(tmp_path, monkeypatch):
    """The other layouts llama.cpp's loader accepts: fused attn_qkv and ffn_gate_up_exps, q/k/v biases, an
    explicit attention.recurrent_layers (A G G A G G), no MTP block, rope sections [2,2,2,2] whose 4th-section
    pairs stay unrotated for text, and no output.weight (the head tied to token_embd)."""
    import workloads.synth as synth
    shapes = synth.tensor_shapes
    monkeypatch.setattr(synth, "tensor_shapes", lambda p: {n: s for n, s in shapes(p).items() if n != "output.weight"})
    p = preset(TINY, n_layers=6, n_nextn=0, recurrent_layers=(False, True, True, False, True, True),
               fused_qkv=True, fused_gate_up=True, attn_bias=True, rope_sections=(2, 2, 2, 2))
    path = synthesize(p, tmp_path / "variant.gguf")
    tokens = PROMPT[:100]
    ref_prompt, gen, ref_steps = conftest.isolated(llama_cpp_run, path, tokens, n_new=4)
    prompt, steps = reference_run(path, 6, gen, n_ubatch=64, tokens=tokens)
    assert np.abs(prompt - ref_prompt).max() < F32_ATOL and np.abs(steps - ref_steps).max() < F32_ATOL
    assert (prompt.argmax(-1) == ref_prompt.argmax(-1)).all()


# --- bad input -----------------------------------------------------------------------------------------

SMALL = replace(H, n_layers=4, n_nextn=0, n_expert=4, n_expert_used=2, n_vocab=256)


def write_file(path: Path, h=SMALL, drop=(), keys=None, f16=()) -> Path:
    """A zero-weight qwen35moe file of h, without the metadata keys in `drop`, with `keys` overwritten and the
    tensors in `f16` stored F16."""
    import gguf
    w = gguf.GGUFWriter(path, "qwen35moe")
    write_metadata(w, h, "bad")
    for k in drop:
        del w.kv_data[0][f"qwen35moe.{k}"]
    for k, v in (keys or {}).items():
        w.kv_data[0].pop(f"qwen35moe.{k}", None)
        w.add_array(f"qwen35moe.{k}", v) if isinstance(v, list) else w.add_uint32(f"qwen35moe.{k}", v)
    for name, shape in ARCHS["qwen35moe"].shapes(h).items():
        w.add_tensor(name, np.zeros(shape, np.float16 if name in f16 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind, match", [
    ("no_conv_kernel", "ssm.conv_kernel is missing"),
    ("sections", "dimension_sections"),
    ("inner_size", "inner_size"),
    ("recurrent_layers", "recurrent_layers"),
    ("conv_f16", "ssm_conv1d.weight is stored as F16"),
])
def test_malformed_file_is_one_sentence(tmp_path, kind, match):
    args = {"no_conv_kernel": dict(drop=["ssm.conv_kernel"]),
            "sections": dict(keys={"rope.dimension_sections": [3, 3, 2]}),
            "inner_size": dict(keys={"ssm.inner_size": 100}),
            "recurrent_layers": dict(keys={"attention.recurrent_layers": [True, False]}),
            "conv_f16": dict(f16=["blk.0.ssm_conv1d.weight"])}[kind]
    path = write_file(tmp_path / f"{kind}.gguf", **args)
    with pytest.raises(UserError, match=match) as exc:
        ReferenceEngine().load(path, EngineSettings(n_ctx=32, threads=2))
    text = str(exc.value)
    assert "\n" not in text and text.endswith(".") and text.count(". ") == 0
