"""The reference engine on files in the formats people download (f16, Q8_0, K-quants, IQ4_XS, MXFP4):
it holds every weight as stored, and its logits follow llama.cpp's on the same file, on the baseline
AVX2 kernels and on the widest the CPU has."""
from __future__ import annotations

import numpy as np
import pytest

from engines.base import EngineSettings
from engines.devices import CPU_ISAS, cpu_flags
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.reference.engine import ReferenceEngine
from workloads.synth import PRESETS, preset, synthesize
from tests import conftest

# qwen3moe with rows of 256 (whole K-quant blocks), 4 layers, 8 experts top-2
BASE = preset(PRESETS["tiny"], n_embd=256, n_head=4, head_dim=64, n_ff_exp=256, n_vocab=512)
DTYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q6_k", "iq4_xs", "mxfp4"]
PROMPT = [int(t) for t in np.random.default_rng(11).integers(1, 512, 40)]
ISAS = [isa for isa in ("avx2", "avx512", "amx") if set(CPU_ISAS[isa]) <= cpu_flags()]     # the variants this CPU runs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("stored")
    return {dt: synthesize(preset(BASE, dtype=dt), d / f"{dt}.gguf") for dt in DTYPES}


# llama.cpp's run: its KV cache in f32 (its default f16 cache alone moves logits by ~1e-2 here), its generic CPU
# kernels (repack off), which the engine's follow: on an AMX CPU llama.cpp's AMX kernels take the Q8_0 dense weights
# and round otherwise (median logit difference 0.021 on the q8_0 file, Xeon with AMX)
LLAMA = dict(n_ctx=128, n_batch=64, n_ubatch=16, n_threads=2, type_k=0, type_v=0, repack=False)


@pytest.fixture(scope="module")
def llama(models) -> dict[str, np.ndarray]:
    """llama.cpp's logits at every position of PROMPT, per file type: one child process for all."""
    calls = {dt: (p, PROMPT) for dt, p in models.items()}
    return conftest.isolated(conftest.for_each, conftest.llama_cpp_logits, calls, **LLAMA)


def reference(path, depth: int, tokens=PROMPT, **extra) -> tuple[np.ndarray, ReferenceEngine]:
    e = ReferenceEngine()
    dtype = extra.pop("dtype", "auto")
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=128, n_ubatch=16, threads=2, dtype=dtype,
                                extra={"logits_all": True, "cache_type": "f32"} | extra))
    e.prefill(tokens)
    return e.logits().numpy(), e


def greedy(path, depth: int, n: int = 24) -> list[int]:
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=128, n_ubatch=16, threads=2))
    return conftest.greedy(e, PROMPT[:8], n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_held_as_stored(models, dtype):
    """Every matrix is held in exactly its stored bytes, host experts and the rest alike (no expanded copy)."""
    meta = read_meta(models[dtype])
    _, e = reference(models[dtype], 2, PROMPT[:4])
    info = e.info()
    held, stored = info.extra["held_bytes"], info.extra["file_bytes"]
    assert held["experts"] == stored["experts"]
    assert info.expert_bytes_host == meta.expert_bytes(2) and info.expert_bytes_total == meta.expert_bytes()
    matrices = sum(t.n_bytes for t in meta.tensors if t.layer is None and len(t.ne) > 1)
    vectors = sum(t.n_bytes for t in meta.tensors if len(t.ne) == 1)           # F32 in every file type
    assert held["non_experts"]["accelerator"] == stored["non_experts"]["accelerator"] == matrices + vectors
    assert info.extra["file_dtype"] != "F32" and info.settings["extra"]["cpu_isa"] in ISAS


def test_an_untied_embedding_stays_in_the_file_mapping(models):
    """The token embedding of a CPU run is only read a row per token: it stays in the file's mapping (as llama.cpp's
    mmap leaves it: a real vocabulary's rows are mostly never resident), while the output head is held."""
    _, e = reference(models["q4_k_m"], 2, PROMPT[:4])
    top, mapped = e.model.top, e._hold.src._buf.untyped_storage().data_ptr()
    assert top["token_embd.weight"].raw.untyped_storage().data_ptr() == mapped
    assert top["output.weight"].raw.untyped_storage().data_ptr() != mapped
    assert top["output.weight"].layout == "x8"


# Position 0 of the prompt (no KV history): max |logit diff| with llama.cpp. Block-quantized products
# multiply exactly ggml's int8 values and scales (only float sums are ordered differently): measured <= 1e-6.
# F16/BF16 files: the avx512 kernels' bf16 GEMM (dtype bf16) rounds x, weights and results to bf16 (measured
# 2e-2); with the default f32 GEMM the f16 x equals ggml's, but llama.cpp's own position-0 logits of an F16 file
# move by 2.5e-4 between a 1-token and a longer batch (the BF16 file's by 2e-7), and by 1.8e-3 between its
# AVX2 and its AVX-512 libggml-cpu (measured: the same llama-cpp-python 0.3.36 with an AVX2-only ggml build
# swapped in; the reference's avx2 kernels follow the AVX-512 build to 4e-7 on one token and the AVX2 build
# to 1.7e-3). llama.cpp is built for the CPU it runs on, so the bound is llama.cpp's own spread across builds.
POS0_TOL = {"f16": 3e-3, "bf16": 1e-5}
POS0_TOL_BF16_GEMM = 3e-2
POS0_TOL_QUANT = 2e-6


def check_follows_llama_cpp(got: np.ndarray, ref: np.ndarray, pos0_tol: float, what) -> None:
    """The bounds of test_logits_follow_llama_cpp: position 0 within pos0_tol; every position median within
    1.5e-2, max within 1.0, the same top-1 wherever llama.cpp's own top two are 0.1 apart."""
    err = np.abs(got - ref)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1
    assert err[0].max() < pos0_tol, (what, "position 0", float(err[0].max()))
    assert np.median(err) < 1.5e-2 and err.max() < 1.0, (what, float(np.median(err)), float(err.max()))
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all(), what


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_follow_llama_cpp(models, llama, dtype, isa, monkeypatch):
    """Every position of a 40-token prompt (ubatches 16, 16, 8), depths 0 and all, on both kernel variants.
    Both engines quantize x identically (ggml's vec_dot_types, byte for byte), so at position 0 the logits
    agree to float rounding (POS0_TOL). Later positions read the KV cache: there a 1e-7 difference in some
    float sum now and then moves an activation across an int8 (or f16) rounding boundary (measured: one value
    in ~1e5), which moves that position's K or V by ~1e-3 and every later logit by up to ~5e-2; one such
    move can tip a near-tied expert choice (measured once: 0.66 at one position). Without one the logits
    agree to ~1e-7 (measured over all 40 positions: q4_k_m, iq4_xs on avx512; q4_0, q4_k_m, q6_k on avx2)."""
    monkeypatch.setenv("MOEBENCH_ISA", isa)
    ref = llama[dtype]
    tol = POS0_TOL.get(dtype, POS0_TOL_QUANT)
    for depth in (0, BASE.h.n_layers):
        got, e = reference(models[dtype], depth)
        assert e.info().extra["cpu_isa"] == isa
        check_follows_llama_cpp(got, ref, tol, (dtype, isa, depth))


@pytest.mark.skipif("avx512" not in ISAS, reason="the AVX2 kernels have no bf16 GEMM")
def test_a_bf16_compute_dtype_is_honoured_on_avx512(models, llama, monkeypatch):
    """dtype bf16: the avx512 kernels' prefill GEMM rounds x, the weights and the results to bf16 (the CPU default
    is f32: tests/test_logits_pp512.py), and is held to the bf16 GEMM's looser position-0 bound."""
    monkeypatch.setenv("MOEBENCH_ISA", "avx512")
    got, e = reference(models["f16"], 0, dtype="bf16")
    assert e.info().settings["dtype"] == "bf16"
    err0 = np.abs(got[0] - llama["f16"][0]).max()
    assert POS0_TOL["f16"] < err0, "the bf16 GEMM rounds: not the f32 GEMM's numbers"
    check_follows_llama_cpp(got, llama["f16"], POS0_TOL_BF16_GEMM, "f16 dtype=bf16")


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k_m", "iq4_xs", "mxfp4"])
def test_greedy_continuation_identical_at_depths_0_half_all(models, dtype):
    seqs = {d: greedy(models[dtype], d) for d in (0, BASE.h.n_layers // 2, BASE.h.n_layers)}
    assert len(set(seqs[0])) > 1 and seqs[0] == seqs[2] == seqs[4]


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU has only the AVX2 kernels: nothing to compare them with")
@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_k_m", "iq4_xs", "mxfp4"])
def test_forced_avx2_and_native_give_the_same_tokens(models, dtype, monkeypatch):
    """Both variants decode the same 24 tokens (avx2's greedy ones, fed to both) and pick the same next token at
    every position that is not a near-tie (top two logits within 0.02 in either run: there the two variants'
    summation orders may pick either)."""
    runs, toks = {}, []
    for isa in (ISAS[0], ISAS[-1]):
        monkeypatch.setenv("MOEBENCH_ISA", isa)
        e = ReferenceEngine()
        e.load(models[dtype], EngineSettings(n_cpu_moe=BASE.h.n_layers // 2, n_ctx=128, n_ubatch=16, threads=2))
        e.prefill(PROMPT[:8])
        picks, gaps = [], []
        for i in range(24):
            top = e.logits()[-1].float().topk(2)
            picks.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            if isa == ISAS[0]:
                toks.append(picks[-1])
            e.decode(toks[i])
        runs[isa] = (picks, gaps)
    (a, ga), (b, gb) = runs.values()
    clear = [i for i in range(len(a)) if min(ga[i], gb[i]) >= 0.02]
    assert len(clear) >= 12 and all(a[i] == b[i] for i in clear), (clear, a, b)


@pytest.mark.parametrize("dtype", ["q4_k_m", "q5_k_m", "iq4_xs"])
def test_fallback_types_of_rows_that_are_not_whole_super_blocks(tmp_path, dtype):
    """Rows of 128 values (tiny): llama.cpp's quantizer stores them in its 32-value fallbacks (Q4_K -> Q5_0,
    Q5_K -> Q5_1, IQ4_XS -> IQ4_NL, Q6_K -> Q8_0); the engine computes with them as stored and follows
    llama.cpp as on the other files."""
    path = synthesize(preset(PRESETS["tiny"], dtype=dtype), tmp_path / f"{dtype}.gguf")
    types = {t.ggml_type for t in read_meta(path).tensors}
    assert types & {"Q5_0", "Q5_1", "IQ4_NL"} and not types & {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
    prompt = [t % PRESETS["tiny"].h.n_vocab for t in PROMPT]
    ref = conftest.isolated(conftest.llama_cpp_logits, path, prompt, **LLAMA)
    for isa in ISAS:
        with pytest.MonkeyPatch.context() as m:
            m.setenv("MOEBENCH_ISA", isa)
            got, _ = reference(path, 0, prompt)
        check_follows_llama_cpp(got, ref, POS0_TOL_QUANT, (dtype, isa))


def test_a_type_without_kernels_is_one_sentence(tmp_path, monkeypatch):
    """A matrix stored in a type the engine does not compute with (here Q5_0, struck from the list): one
    sentence naming the type and the supported ones, never an expanded fallback."""
    from engines.reference import weights
    path = synthesize(preset(PRESETS["tiny"], dtype="q4_k_m"), tmp_path / "q.gguf")
    assert "Q5_0" in {t.ggml_type for t in read_meta(path).tensors}
    monkeypatch.setattr(weights, "COMPUTED", tuple(t for t in weights.COMPUTED if t != "Q5_0"))
    with pytest.raises(UserError, match=r"stored as Q5_0, which the reference engine does not compute with; "
                                        r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q4_K"):
        ReferenceEngine().load(path, EngineSettings(n_ctx=32))


def test_both_engines_hold_the_same_expert_bytes_in_host_ram(models, tmp_path):
    """A real sweep of both engines on a quantized file: at every depth the two hold exactly the same routed-expert
    bytes in host RAM (cells.csv), so the report's fairness section has no expert-bytes row."""
    import pandas as pd

    from tests.conftest import moebench

    r = moebench("sweep", "-m", models["q4_k_m"], "-e", "reference,llama-cpp", "--n-cpu-moe", "0,2,all", "-w", "pp16",
                 "-r", "1", "--threads", "2", "--sample-ms", "0", "--results-dir", tmp_path / "res")
    assert r.returncode == 0, r.stderr[-2000:]
    run = next((tmp_path / "res").glob("2*"))
    cells = pd.read_csv(run / "cells.csv")
    assert (cells["status"] == "ok").all()
    per = cells.pivot(index="n_cpu_moe", columns="engine", values="expert_bytes_host")
    assert per["reference"].tolist() == per["llama-cpp"].tolist() == [read_meta(models["q4_k_m"]).expert_bytes(n)
                                                                      for n in (0, 2, 4)]
    r = moebench("report", run, "-o", tmp_path / "rep", "--format", "md")
    assert r.returncode == 0 and "expert_bytes_host" not in r.stdout
