"""reference@experts=kt: KTransformers' kt-kernel computes the offloaded layers' routed experts (engines.reference.
kt_experts), everything else stays the reference engine's; against llama.cpp on the same files, its refusals, its
CPU-only trap, its placement and its isolation. Skipped, with the reason, where kt-kernel is not installed.

What kt's arithmetic does to the logits (measured on this project's synthesized files at depth all, a 64-token prompt
in ubatches of 32, f32 KV caches; max |logit diff| per position, logits |x| <= ~5): kt against llama.cpp over the
prompt and 16 greedy decodes; over the prompt alone, the reference's own kernels with kt's bf16 I/O added (x and the
experts' sum rounded to bf16) against llama.cpp, and llama.cpp's flash attention against its plain attention.

  file                          kt vs llama.cpp          reference + bf16 I/O     llama.cpp flash vs plain
                                median  pos 0   max      median  pos 0            median  max
  qwen3moe width 256, Q4_K_M    0.075   0.051   1.39     0.066   0.051            0.067   0.74
  qwen35moe-tiny, Q4_K_M        0.228   0.125   0.88     0.182   0.099            0.077   0.39
  preset small, Q4_K_M          0.110   0.185   0.86     0.103   0.284            0.125   0.74
  preset small, Q8_0            0.089   0.263   0.67     0.092   0.263            0.069   0.45
  qwen3-30b-a3b-4l, Q4_K_M      0.075   0.224   0.47

The reference engine itself follows llama.cpp to < 1e-6 at position 0 (tests/test_stored_weights.py); kt rounds each
offloaded layer's expert input and output to bf16 (its API), and the reference's kernels with that rounding added land
as far from llama.cpp as kt does: kt's distance is its bf16 I/O, up to ~3x llama.cpp's spread between its two attention
paths. Hence POSITION_MEDIAN (1.5x the largest measured median) and POSITION_MAX (a tipped near-tied router moves a
position by up to ~1.4). Every greedy continuation was llama.cpp's (16 of 16 tokens); top-1 misses were at llama.cpp
top-1/top-2 gaps <= 0.14, so top-1 and the greedy tokens are compared where that gap exceeds CLEAR_MARGIN.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engines import peers
from engines.base import EngineSettings
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.reference import kt_experts
from engines.reference.archs import arch_of, hparams
from engines.reference.engine import ReferenceEngine
from tests import conftest
from tests.test_arch_qwen35moe import llama_cpp_run
from tests.test_stored_weights import BASE
from workloads.synth import PRESETS, preset, synthesize

MISSING = peers.missing(kt_experts.DIST)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

POSITION_MEDIAN = 0.35
POSITION_MAX = 2.0
CLEAR_MARGIN = 0.3
N_NEW = 16
Q35 = PRESETS["qwen35moe-tiny"]             # expert width 256; 6 trunk blocks + 1 MTP block
FILES = {"qwen3moe-q4_k_m": (BASE, "q4_k_m"), "qwen35moe-q4_k_m": (Q35, "q4_k_m")}
SLOW_FILES = {"small-q4_k_m": (PRESETS["small"], "q4_k_m"), "small-q8_0": (PRESETS["small"], "q8_0")}


def prompt_for(path: Path) -> list[int]:
    return [int(t) for t in np.random.default_rng(7).integers(1, hparams(read_meta(path)).n_vocab, 64)]


def kt_run(path: Path) -> tuple[np.ndarray, list[int], np.ndarray, ReferenceEngine]:
    """reference@experts=kt at depth all as llama_cpp_run runs llama.cpp: prompt logits (n, V), its own greedy
    continuation and the logits each token was chosen from (N_NEW, V)."""
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=hparams(read_meta(path)).n_layers, n_ctx=256, n_ubatch=32, threads=2,
                                extra={"logits_all": True, "cache_type": "f32", "experts": "kt"}))
    e.prefill(prompt_for(path))
    prompt = e.logits().numpy()
    last, gen, steps = prompt[-1], [], []
    for _ in range(N_NEW):
        gen.append(int(last.argmax()))
        steps.append(last)
        e.decode(gen[-1])
        last = e.logits()[-1].numpy()
    return prompt, gen, np.stack(steps), e


def check_follows_llama_cpp(got: tuple, want: tuple, what) -> None:
    """The greedy tokens are llama.cpp's, or part from them only at a step where llama.cpp's own choice is a near tie;
    every position with the same history (the prompt, then the steps up to the first differing token) within the
    module's bounds, top-1 equal where clear."""
    (g_prompt, g_gen, g_steps), (w_prompt, w_gen, w_steps) = got, want
    same = next((i for i, (a, b) in enumerate(zip(g_gen, w_gen)) if a != b), N_NEW)
    if same < N_NEW:
        top2 = np.sort(w_steps[same])[-2:]
        assert top2[1] - top2[0] <= CLEAR_MARGIN, (what, same, g_gen, w_gen)
    g, w = np.concatenate((g_prompt, g_steps[:same + 1])), np.concatenate((w_prompt, w_steps[:same + 1]))
    err = np.abs(g - w).max(-1)
    assert np.isfinite(g).all() and np.median(err) < POSITION_MEDIAN and err.max() < POSITION_MAX, \
        (what, float(np.median(err)), float(err.max()))
    top2 = np.sort(w, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR_MARGIN
    assert (g.argmax(-1) == w.argmax(-1))[clear].all(), what


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kt")
    return {name: synthesize(preset(p, dtype=dt), d / f"{name}.gguf") for name, (p, dt) in FILES.items()}


@pytest.fixture(scope="module")
def llama(files) -> dict[str, tuple]:
    return conftest.isolated(conftest.for_each, llama_cpp_run, {k: (p, prompt_for(p), N_NEW) for k, p in files.items()})


@pytest.mark.parametrize("name", list(FILES))
def test_logits_and_greedy_tokens_follow_llama_cpp(files, llama, name):
    """qwen3moe (width 256) and qwen35moe-tiny, Q4_K_M, every offloaded layer's experts computed by kt."""
    prompt, gen, steps, e = kt_run(files[name])
    assert e.info().settings["experts"] == "kt"
    assert e.counters()["moe_calls_kt"] > 0 and e.counters()["moe_calls_host"] == 0
    check_follows_llama_cpp((prompt, gen, steps), llama[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_FILES))
def test_preset_small_follows_llama_cpp(tmp_path, name):
    """preset small (8 layers, n_embd 1024, 32 experts top-4, width 512) in Q4_K_M and Q8_0 (slow: its K-quants take
    ~40 s to synthesize)."""
    p, dt = SLOW_FILES[name]
    path = synthesize(preset(p, dtype=dt), tmp_path / f"{name}.gguf")
    want = conftest.isolated(llama_cpp_run, path, prompt_for(path), N_NEW)
    prompt, gen, steps, _ = kt_run(path)
    check_follows_llama_cpp((prompt, gen, steps), want, name)


# --- kt's arithmetic and what info() says about it ----------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """qwen3moe at width 256 in three expert formats (4 layers, 8 experts top-2)."""
    d = tmp_path_factory.mktemp("kt-base")
    return {dt: synthesize(preset(BASE, dtype=dt), d / f"{dt}.gguf") for dt in ("q8_0", "q4_k_m", "f16")}


def reference_kt(path: Path, depth: int, **extra) -> ReferenceEngine:
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=64, n_ubatch=16, threads=2, extra={"experts": "kt"} | extra))
    return e


@pytest.mark.parametrize("dtype, equal, within", [("q8_0", 0.99, 2.0 ** -8), ("q4_k_m", 0.5, 2.0 ** -6)])
def test_a_layer_is_the_reference_kernels_with_bf16_in_and_out(base, dtype, equal, within):
    """What kt_experts says kt computes: x rounded to bf16, ggml's vec_dot_type activations (Q8_0 / Q8_K blocks, as the
    reference's kernels), the sum rounded to bf16: the reference's kernels fed bf16(x), their output rounded to bf16,
    give the same values, for decode (1 row) and prefill (16 rows). Measured: Q8_0 all (or all but a value that a float
    sum in another order moves across a bf16 rounding); Q4_K_M (Q4_K and Q6_K experts) 71-100 % of them (at least half
    asked), the rows that differ by up to 1.3 % of the largest value (kt's K-quant products are not ggml's bit for
    bit). Without the bf16 rounding on both sides hardly a value would be equal."""
    e = reference_kt(base[dtype], BASE.h.n_layers)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 16):
        x = torch.randn(n, BASE.h.n_embd, generator=gen)
        ids = torch.stack([torch.randperm(BASE.h.n_expert, generator=gen)[:BASE.h.n_expert_used] for _ in range(n)])
        w = torch.softmax(torch.randn(n, BASE.h.n_expert_used, generator=gen), -1)
        with torch.inference_mode():                 # as the engine runs it (kt's buffers are inference tensors)
            got = e.moe.kt(1, x, ids, w)
        want = e.moe._compute(e.moe.layers[1], x.bfloat16().float(), ids, w).bfloat16().float()
        assert got.shape == want.shape and got.abs().max() > 0.1
        assert (got == want).float().mean() >= equal and (got - want).abs().max() <= within * want.abs().max(), \
            (dtype, n, float((got == want).float().mean()), float((got - want).abs().max()))


def test_compute_dtype_names_kts_arithmetic(base):
    """settings["compute_dtype"] carries kt's words: an F16 file's gate/up products meet bf16-rounded activations
    ("bf16", which the engine's own f32 run never reports), its down products the f32 intermediate as f16; K-quant
    experts meet 8-bit blocks."""
    e = reference_kt(base["f16"], BASE.h.n_layers)
    assert e.moe.kt.words == {"bf16", "f16"}
    words = e.info().settings["compute_dtype"]
    assert all("bf16" in words[phase].split("+") for phase in ("prefill", "decode")), words
    own = ReferenceEngine()
    own.load(base["f16"], EngineSettings(n_cpu_moe=BASE.h.n_layers, n_ctx=64, n_ubatch=16, threads=2))
    assert not any("bf16" in w.split("+") for w in own.info().settings["compute_dtype"].values())
    assert reference_kt(base["q4_k_m"], 2).moe.kt.words == {"q8-activations"}


def test_the_offloaded_experts_are_held_once(base):
    """kt computes from its own mapping of the file; the reference keeps an unread view of the same tensors (never a
    repacked or huge-page copy, never computed by its kernels), books their bytes once, and calls them mapped."""
    e = reference_kt(base["q4_k_m"], 2, hugepages=False, repack=False)
    e.prefill(list(range(1, 20)))
    e.decode(3)
    mapped = e._hold.src._buf
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    for il, s in enumerate(e.moe.layers):
        assert s.on_host == (il < 2)
        if s.on_host:
            assert all(lo <= m.raw.data_ptr() < hi for m in s.matrices) and s.kernel_args is None
    info = e.info()
    meta = read_meta(base["q4_k_m"])
    assert info.expert_bytes_host == meta.expert_bytes(2) and info.extra["held_bytes"]["experts"]["host"] == \
        info.extra["file_bytes"]["experts"]["host"]
    assert info.settings["weights"] == "mapped" and info.extra["weight_bytes"]["mapped"] >= meta.expert_bytes(2)
    own = ReferenceEngine()
    own.load(base["q4_k_m"], EngineSettings(n_cpu_moe=2, n_ctx=64, n_ubatch=16, threads=2))
    # the rest copied as the engine's own; kt's experts read the mapping: both said
    assert reference_kt(base["q4_k_m"], 2).info().settings["weights"] == f"mapped+{own.info().settings['weights']}"


# --- placement, depth 0, info ------------------------------------------------------------------------------------

@pytest.mark.parametrize("experts", ["reference", "kt"])
def test_cpu_moe_layers_are_the_placement_built(base, files, experts):
    """cpu_moe_layers: with no accelerator every MoE layer's experts are in host memory, at every depth
    (engines.base.host_layers, as llama-cpp reports it); the depth rule's layers are those kt computes, read from the
    stacks the engine placed: qwen35moe at depth all, its 6 trunk blocks (the MTP block's experts are never loaded, as
    in llama.cpp)."""
    for path, depths in ((base["q4_k_m"], (0, 2, BASE.h.n_layers)), (files["qwen35moe-q4_k_m"], (Q35.h.n_layers,))):
        meta = read_meta(path)
        for depth in depths:
            e = reference_kt(path, depth, experts=experts)
            info = e.info()
            assert info.cpu_moe_layers == meta.moe_layers, (path.name, depth)
            placed = [il for il, s in enumerate(e.moe.layers) if s.on_host]
            assert placed == list(range(min(depth, hparams(meta).n_trunk)))
            if experts == "kt":
                assert info.extra["kt_layers"] == placed


def test_info_says_what_kt_ran_with(base):
    """settings["experts"] = "kt"; extra: kt-kernel's version and ISA variant (as kt_kernel picked it at import),
    LLAMAFILE, its threads and the rule they came from; cpu_moe_threads sets them."""
    import kt_kernel

    info = reference_kt(base["q4_k_m"], 2).info()
    x = info.extra
    assert info.settings["experts"] == "kt" and x["kt_kernel_version"] == peers.PEERS["kt-kernel"] == "0.7.2"
    assert x["kt_cpu_variant"] == kt_kernel.__cpu_variant__ and x["kt_method"] == "LLAMAFILE"
    assert x["kt_cpuinfer_threads"] == x["kt_engine_threads"] == 1 and kt_experts.split_threads(2) == (1, 1)
    assert kt_experts.split_threads(16) == (8, 8) and kt_experts.split_threads(2, kt=2) == (2, 1)
    assert x["kt_threads_rule"] == kt_experts.THREADS_RULE == x["cpu_moe_threads_rule"]
    assert reference_kt(base["q4_k_m"], 2, cpu_moe_threads=1).info().extra["cpu_moe_threads_rule"] == \
        "set by cpu_moe_threads"


def test_depth_0_runs_as_the_reference_engine(base):
    """Depth 0 offloads nothing, so kt has nothing to compute: the engine runs as usual (a sweep over depths 0 and all
    keeps its depth-0 cell, the same cell as the reference engine's) and says so; kt is not even loaded."""
    tokens = list(range(1, 30))
    e = reference_kt(base["q4_k_m"], 0, logits_all=True)
    own = ReferenceEngine()
    own.load(base["q4_k_m"], EngineSettings(n_cpu_moe=0, n_ctx=64, n_ubatch=16, threads=2, extra={"logits_all": True}))
    for eng in (e, own):
        eng.prefill(tokens)
    assert torch.equal(e.logits(), own.logits())
    info = e.info()
    assert e.moe.kt is None and info.extra["kt_layers"] == [] and "computed none" in info.extra["kt_note"]
    assert e.counters()["moe_calls_kt"] == 0


# --- the CPU-only trap and isolation, in fresh processes ---------------------------------------------------------

def _greedy_without_the_variable(path: str) -> tuple[bool, str | None, list[int], float]:
    """In a fresh process whose environment lacks KT_FORCE_SYNC_SUBMIT: whether it had it, its value after load, the
    greedy tokens, and the largest expert output of kt on a random batch."""
    had = os.environ.pop("KT_FORCE_SYNC_SUBMIT", None) is not None
    _, gen, _, e = kt_run(Path(path))
    x = torch.randn(4, e.cfg.n_embd)
    ids = torch.arange(4 * e.cfg.n_expert_used).reshape(4, -1) % e.cfg.n_expert
    with torch.inference_mode():
        y = e.moe.kt(0, x, ids, torch.full(ids.shape, 0.5))
    return had, os.environ.get("KT_FORCE_SYNC_SUBMIT"), gen, float(y.abs().max())


def test_outputs_are_real_without_the_variable_in_the_environment(files, llama, monkeypatch):
    """kt's forward returns zeros on a CPU unless KT_FORCE_SYNC_SUBMIT=1: the engine sets it itself, so a process
    started without it gets non-zero experts and llama.cpp's greedy tokens (as in this process)."""
    monkeypatch.delenv("KT_FORCE_SYNC_SUBMIT", raising=False)       # an engine loaded in this process set it
    had, after, gen, biggest = conftest.isolated(_greedy_without_the_variable, str(files["qwen3moe-q4_k_m"]))
    assert not had and after == "1" and biggest > 0.1
    _, want, _ = llama["qwen3moe-q4_k_m"]
    assert gen[:4] == want[:4] and gen == kt_run(files["qwen3moe-q4_k_m"])[1]


def test_kt_is_imported_only_by_an_engine_that_computes_with_it(base):
    """Importing engines.reference and running the reference engine (its own experts, or experts=kt at depth 0)
    imports no kt_kernel and leaves kt's directory off the path: only a cell's worker that computes with kt does. A
    fresh interpreter (a spawned child would inherit this process's path)."""
    code = ("import sys; from engines import peers; from engines.base import EngineSettings\n"
            "from engines.reference.engine import ReferenceEngine\n"
            "for extra in ({}, {'experts': 'kt'}):\n"
            f"    ReferenceEngine().load({str(base['q4_k_m'])!r}, EngineSettings(n_cpu_moe=0, n_ctx=32, extra=extra))\n"
            "print('kt_kernel' in sys.modules, str(peers.peer_dir('kt-kernel')) in sys.path)")
    out = subprocess.run([sys.executable, "-c", code], cwd=conftest.ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr[-2000:]


# --- refusals: one sentence each, at load, before any weight is held -----------------------------------------------

def load_refused(path: Path, match: str, depth: int = 1, **extra) -> None:
    e = ReferenceEngine()
    with pytest.raises(UserError, match=match) as err:
        e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=32, extra={"experts": "kt"} | extra))
    assert str(err.value).count(". ") == 0 and not hasattr(e, "moe")          # one sentence; nothing was built


@pytest.mark.parametrize("name, match", [
    ("gpt-oss-tiny", r"kt-kernel's LLAMAFILE experts are SiLU-gated .* gpt-oss experts are swiglu_oai gated, with "
                     r"biases; leave out experts=kt for this model\.$"),
    ("gemma4-tiny", r"gemma4 experts are gelu gated, merged gate_up, scaled per expert; leave out experts=kt"),
    ("deepseek4-tiny", r"which the reference engine does not run yet"),
    ("tiny", r"experts=kt needs an expert width that is a multiple of 256 .* has 64 and 128; leave out experts=kt"),
])
def test_archs_kt_cannot_run_are_one_sentence(tmp_path, name, match):
    """Header-only files (sparse): the refusal comes from the metadata, before any weight is read. The tiny preset's
    experts are 64 wide (kt: multiples of 256); deepseek4 is refused by the reference engine itself. At depth 0 too:
    the engine spec is wrong for the file whatever the depth."""
    path = synthesize(name, tmp_path / f"{name}.gguf", sparse=True)
    load_refused(path, match)
    load_refused(path, match, depth=0)


def test_a_weight_type_kt_does_not_compute_is_one_sentence(tmp_path, monkeypatch):
    path = synthesize(preset(BASE, dtype="q4_k_m"), tmp_path / "q.gguf", sparse=True)
    monkeypatch.setattr(kt_experts, "TYPES", tuple(t for t in kt_experts.TYPES if t != "Q4_K"))
    load_refused(path, r"^experts=kt: kt-kernel's LLAMAFILE experts do not compute Q4_K weights \(blk\.0\.ffn_gate_"
                       r"exps\.weight\); use a file whose experts are F32, .*, or leave out experts=kt\.$")


@pytest.mark.parametrize("extra", [{"moe_path": "stream"}, {"cache_mib": 64}])
def test_settings_kt_replaces_are_one_sentence(tmp_path, extra):
    path = synthesize(preset(BASE, dtype="q4_k_m"), tmp_path / "q.gguf", sparse=True)
    load_refused(path, r"^experts=kt computes the offloaded layers' experts itself, so moe_path=stream and an expert "
                       r"cache \(cache_mib\) do not apply; leave them out\.$", **extra)


def test_kt_not_installed_is_one_sentence(tmp_path, monkeypatch):
    path = synthesize(preset(BASE, dtype="q4_k_m"), tmp_path / "q.gguf", sparse=True)
    monkeypatch.setattr(peers, "peer_dir", lambda dist: tmp_path / "nowhere")
    load_refused(path, r"^experts=kt needs kt-kernel: kt-kernel is not installed \(in .*nowhere\); install it with "
                       r"`make peers`\.$")


def test_a_cuda_device_is_one_sentence(tmp_path):
    """This integration runs kt on the CPU only (no CUDA here to load on: the check itself, on a CUDA device)."""
    path = synthesize(preset(BASE, dtype="q4_k_m"), tmp_path / "q.gguf", sparse=True)
    meta = read_meta(path)
    why = kt_experts.refusal(path.name, arch_of(meta), hparams(meta), {t.name: t for t in meta.tensors}, 4,
                             torch.device("cuda"), {})
    assert why == ("experts=kt runs kt-kernel's experts on the CPU only (this integration drives no cuda device); use "
                   "--device cpu, or the reference engine's own experts.")
