"""The reference engine on files in the formats people download (f16, Q8_0, K-quants, IQ4_XS, MXFP4):
it holds every weight as stored, and its logits follow llama.cpp's on the same file, on the baseline
AVX2 kernels and on the widest the CPU has."""
from __future__ import annotations

import numpy as np
import pytest

from engines.base import EngineSettings
from engines.devices import cpu_flags
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.reference.engine import ReferenceEngine
from workloads.synth import PRESETS, preset, synthesize
from tests import conftest

# qwen3moe with rows of 256 (whole K-quant blocks), 4 layers, 8 experts top-2
BASE = preset(PRESETS["tiny"], n_embd=256, n_head=4, head_dim=64, n_ff_exp=256, n_vocab=512)
DTYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q6_k", "iq4_xs", "mxfp4"]
PROMPT = [int(t) for t in np.random.default_rng(11).integers(1, 512, 40)]
ISAS = ["avx2"] + (["avx512"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"} <= cpu_flags()
                   else [])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("stored")
    return {dt: synthesize(preset(BASE, dtype=dt), d / f"{dt}.gguf") for dt in DTYPES}


def llama_cpp_logits(path, tokens) -> np.ndarray:
    """llama.cpp's logits at every position, its KV cache in f32 (its default f16 cache alone moves logits
    by ~1e-2 here)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=64, n_ubatch=16, n_threads=2, logits_all=True,
                          type_k=0, type_v=0, verbose=False)
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)], dtype=np.float32)
    llm.close()
    return out


def reference(path, depth: int, tokens=PROMPT, **extra) -> tuple[np.ndarray, ReferenceEngine]:
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=128, n_ubatch=16, threads=2, extra={"logits_all": True} | extra))
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_follow_llama_cpp(models, dtype):
    """Every position of a 40-token prompt (ubatches 16, 16, 8), depths 0 and all: the same top-1 as llama.cpp
    wherever llama.cpp's own top two are not a near-tie, and logits within LOGIT_TOL. Both engines round the
    activations of block-quantized products to int8 (ggml: q8_0 / q8_K blocks), not identically, and bf16
    GEMMs (the avx512 kernels' prefill) round too; the tolerance covers that, measured below."""
    ref = llama_cpp_logits(models[dtype], PROMPT)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1                     # llama.cpp's own margin is clear
    for depth in (0, BASE.h.n_layers):
        got, _ = reference(models[dtype], depth)
        err = np.abs(got - ref)
        assert np.median(err) < 0.02 and err.max() < 0.5, (dtype, depth, float(np.median(err)), float(err.max()))
        assert (got.argmax(-1) == ref.argmax(-1))[clear].all(), (dtype, depth)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k_m", "iq4_xs", "mxfp4"])
def test_greedy_continuation_identical_at_depths_0_half_all(models, dtype):
    seqs = {d: greedy(models[dtype], d) for d in (0, BASE.h.n_layers // 2, BASE.h.n_layers)}
    assert len(set(seqs[0])) > 1 and seqs[0] == seqs[2] == seqs[4]


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU has only the AVX2 kernels: nothing to compare them with")
@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_k_m", "iq4_xs", "mxfp4"])
def test_forced_avx2_and_native_give_the_same_tokens(models, dtype, monkeypatch):
    seqs = {}
    for isa in ISAS:
        monkeypatch.setenv("MOEBENCH_ISA", isa)
        seqs[isa] = greedy(models[dtype], BASE.h.n_layers // 2)
    assert seqs["avx2"] == seqs["avx512"]


def test_a_type_without_kernels_is_one_sentence(tmp_path):
    """q4_k_m on rows of 128 values: llama.cpp falls back to Q5_0 for them, which the engine does not compute
    with: one sentence naming the type and the supported ones, never an expanded fallback."""
    path = synthesize(preset(PRESETS["tiny"], dtype="q4_k_m"), tmp_path / "q.gguf")
    assert "Q5_0" in {t.ggml_type for t in read_meta(path).tensors}
    with pytest.raises(UserError, match=r"stored as Q5_0, which the reference engine does not compute with; "
                                        r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4"):
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
