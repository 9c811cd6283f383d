"""Routing agreement with llama.cpp (engines.llama_cpp_routing): its top-k ids read through the eval callback match
the reference engine's on the same file and tokens, and readings that are wrong (a strided view read as if
contiguous, ids shuffled across tokens) score low, so the comparison can fail."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.routing_agreement import reference_routing
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.llama_cpp_routing import llama_cpp_routing, set_overlap
from tests.conftest import isolated
from workloads.synth import resolve_model


def test_set_overlap_is_the_jaccard_index_per_layer():
    a = np.array([[[0, 1], [4, 5]], [[2, 3], [6, 7]]])           # (T=2, L=2, k=2)
    assert set_overlap(a, a).tolist() == [1.0, 1.0]
    assert set_overlap(a, a[..., ::-1]).tolist() == [1.0, 1.0]       # sets: the ranking does not matter
    b = np.array([[[1, 9], [8, 9]], [[2, 3], [8, 9]]])
    assert set_overlap(a, b).tolist() == pytest.approx([(1 / 3 + 1) / 2, 0.0])
    with pytest.raises(UserError, match="cannot be compared"):
        set_overlap(a, a[:, :1])


def _agreement(path, tokens: list[int], n_ubatch: int) -> dict:
    """In one child: llama.cpp's ids read with the tensor's strides, and read naively as contiguous."""
    return {"ids": llama_cpp_routing(path, tokens, n_ubatch), "naive": llama_cpp_routing(path, tokens, n_ubatch,
                                                                                          strides=False)}


def agreement(path, n_tokens: int = 128, n_ubatch: int = 32) -> tuple[np.ndarray, dict, np.ndarray]:
    tokens = np.random.default_rng(0).integers(1, read_meta(path).n_vocab, n_tokens).tolist()
    ref = reference_routing(path, tokens, n_ubatch=n_ubatch)
    return ref, isolated(_agreement, path, tokens, n_ubatch), np.array(tokens)


def test_llama_cpp_routes_tiny_f32_as_the_reference_engine(tiny):
    ref, lc, _ = agreement(tiny)
    assert lc["ids"].shape == ref.shape == (128, 4, 2)
    j = set_overlap(ref, lc["ids"])
    assert j.mean() >= 0.95 and j.min() >= 0.9, j
    assert set_overlap(ref, lc["naive"]).mean() < 0.5              # a strided view read as contiguous
    shuffled = lc["ids"][np.random.default_rng(1).permutation(len(ref))]
    assert set_overlap(ref, shuffled).mean() < 0.5                  # right ids, wrong tokens


def _user_error(path, tokens: list[int]) -> str:
    try:
        llama_cpp_routing(path, tokens)
    except UserError as e:
        return str(e)
    return ""


def test_tokens_outside_the_vocabulary_are_a_user_error(tiny):
    assert "Token ids must lie in [0, 1024)" in isolated(_user_error, tiny, [1, 10**6])


@pytest.mark.slow
def test_llama_cpp_routes_preset_small_f32_as_the_reference_engine():
    """preset:small (8 layers, 32 experts, top-4) in f32: random weights, so some choices are near ties."""
    ref, lc, _ = agreement(resolve_model("preset:small:f32"), n_tokens=256, n_ubatch=64)
    j = set_overlap(ref, lc["ids"])
    assert j.mean() >= 0.95, j
    assert set_overlap(ref, lc["ids"][::-1]).mean() < 0.5
