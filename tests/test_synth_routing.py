"""Planted routing (workloads.planted) and correlated token streams (workloads.tokens, `+corr` workloads): the
routing the reference engine computes on a planted model is the planted one, a sweep's trace shows the planted
popularity, and a correlated stream has the temporal locality a random one lacks."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from benchmarks.routing_agreement import reference_routing
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.routing import load_trace
from tests.conftest import isolated, moebench, run_dir_of
from workloads.grammar import parse_workload
from workloads.planted import Planting, parse_options, planted_frequency, planted_sets, read_planting, zipf_rank
from workloads.synth import get_preset, preset, resolve_model, synthesize
from workloads.tokens import P_REPEAT, repeat_stream, stream_source, text_tokens, workload_tokens

VOCAB = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf")   # if present


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    return synthesize("tiny", tmp_path_factory.mktemp("planted") / "tiny-zipf.gguf", routing=Planting(1.2))


def test_planted_file_records_its_parameters_and_is_deterministic(planted, tmp_path):
    meta = read_meta(planted)
    p, seed, layers = read_planting(meta)
    assert (p, seed, layers) == (Planting(1.2, 32), 0, [0, 1, 2, 3])        # tiny: 8 experts -> 4*8 clusters
    assert meta.fields["moebench.routing.cluster_rule"] == "token_id % clusters"
    sets = planted_sets(meta)
    assert sorted(sets) == layers and all(s.shape == (32, 2) for s in sets.values())
    assert all(len(set(row)) == 2 for s in sets.values() for row in s)      # k distinct experts per cluster
    again = synthesize("tiny", tmp_path / "again.gguf", routing=Planting(1.2))
    digest = lambda f: hashlib.sha256(Path(f).read_bytes()).hexdigest()
    assert digest(again) == digest(planted)
    other = synthesize("tiny", tmp_path / "other.gguf", routing=Planting(1.2), seed=1)
    assert not np.array_equal(planted_sets(read_meta(other))[0], sets[0])
    assert planted_sets(read_meta(synthesize("tiny", tmp_path / "plain.gguf"))) is None


def test_zipf_exponent_sets_the_skew():
    """Higher s: a larger share for the most popular expert, and popularity follows the planted ranks."""
    def top1(s: float) -> float:
        sets = planted_sets_of(Planting(s, 256), E=64, k=4)
        return float(planted_frequency(sets, 64).max())
    assert top1(0.0) < top1(1.0) < top1(2.0)
    sets = planted_sets_of(Planting(1.2, 256), E=64, k=4)
    rho = np.corrcoef(np.argsort(np.argsort(-planted_frequency(sets, 64))), zipf_rank(Planting(1.2, 256), 0, 64, 0))
    assert rho[0, 1] > 0.8


def planted_sets_of(p: Planting, E: int, k: int) -> np.ndarray:
    from workloads.planted import expert_sets
    return expert_sets(p, [0], E, k, seed=0)[0]


@pytest.mark.parametrize("name,kw", [("tiny", {}), ("tiny", {"arch": "qwen2moe", "n_ff_shexp": 96}),
                                     ("tiny", {"arch": "olmoe", "n_head_kv": 4}), ("tiny", {"arch": "llama"}),
                                     ("gpt-oss-tiny", {}), ("gemma4-tiny", {}), ("qwen35moe-tiny", {})])
def test_reference_engine_routes_as_planted(tmp_path, name, kw):
    """Every token is routed to its cluster's planted expert set, in every MoE layer (the residual stream of the
    random model does not wash the cluster direction out)."""
    path = synthesize(preset(get_preset(name), **kw), tmp_path / "m.gguf", routing=Planting(1.2))
    meta = read_meta(path)
    sets, (p, _, layers) = planted_sets(meta), read_planting(meta)
    tokens = np.random.default_rng(3).integers(1, meta.n_vocab, 96).tolist()
    ids = reference_routing(path, tokens, n_ubatch=32)                      # (T, L, k)
    clusters = np.array(tokens) % p.clusters
    for li, il in enumerate(layers[:ids.shape[1]]):
        want = np.sort(sets[il][clusters], -1)
        assert np.mean((np.sort(ids[:, li], -1) == want).all(-1)) >= 0.98, (name, il)


def test_sweep_trace_matches_the_planted_popularity(tmp_path):
    """`moebench sweep --trace-routing` on `preset:tiny@zipf=1.5`: per layer, the experts' selection shares in the
    trace equal the planted table's for the tokens streamed, and the correlated stream repeats experts at the next
    token far more often than the random one."""
    r = moebench("sweep", "-m", "preset:tiny@zipf=1.5", "-e", "reference", "-w", "pp256,pp256+corr", "-r", "1",
                 "--threads", "2", "--sample-ms", "0", "--trace-routing", "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    run = run_dir_of(r)
    trace = load_trace(next((run / "traces").glob("*.npz")))
    assert trace.header["segments"] == ["pp256", "pp256+corr"]
    assert trace.header["streams"] == ["random", "correlated"]
    meas = (run / "measurements.csv").read_text()
    assert ",pp256+corr," in meas and ",repeats" in meas and ",random" in meas
    meta = read_meta(resolve_model("preset:tiny@zipf=1.5"))                 # the file the sweep ran
    sets, (p, _, layers) = planted_sets(meta), read_planting(meta)
    tokens = workload_tokens(parse_workload("pp256"), meta.n_vocab, 0, meta.path)[1]
    rnd = trace.select(segment="pp256")
    weights = np.bincount(np.array(tokens) % p.clusters, minlength=p.clusters).astype(float)
    for li, il in enumerate(layers):
        seen = np.bincount(rnd.ids[:, li].ravel(), minlength=8) / rnd.ids[:, li].size
        want = planted_frequency(sets[il], 8, weights)
        assert np.abs(seen - want).max() < 0.02, (il, seen, want)
        assert abs(seen.max() - want.max()) < 0.02                          # the top-1 expert's share
        assert spearmanr(seen, zipf_rank(p, il, 8, 0)).statistic < -0.6       # popular = low planted rank
    corr = trace.select(segment="pp256+corr")
    assert next_overlap(corr.ids) > next_overlap(rnd.ids) + 0.15


def next_overlap(ids: np.ndarray) -> float:
    """Mean share of a token's experts that the previous token also used (all layers)."""
    a, b = ids[1:], ids[:-1]
    return float((a[..., :, None] == b[..., None, :]).any(-1).mean())


def test_repeat_stream_has_locality_and_stays_in_clusters():
    ids = repeat_stream(4000, 1024, seed=5, clusters=32)
    assert ids == repeat_stream(4000, 1024, seed=5, clusters=32) and min(ids) >= 1 and max(ids) < 1024
    arr = np.array(ids)
    within8 = np.mean([arr[i] in arr[max(0, i - 8):i] for i in range(1, len(arr))])
    assert within8 > P_REPEAT * 0.9                       # random ids in 1024 would repeat within 8 about 1 %
    assert np.mean(arr[1:] % 32 == arr[:-1] % 32) > 0.3    # runs of fresh draws in one cluster (1/32 by chance)
    plain = np.array(repeat_stream(4000, 1024, seed=5))
    assert np.mean(plain[1:] % 32 == plain[:-1] % 32) < 0.15


def test_stream_grammar_and_sources(planted):
    w = parse_workload("tg16@d32+corr")
    assert (w.name, w.n_gen, w.n_depth, w.stream) == ("tg16@d32+corr", 16, 32, "correlated")
    assert parse_workload("pp8").stream == "random"
    for bad in ("pp8+text", "pp8+corr@d4", "pp8+"):
        with pytest.raises(UserError, match="correlated token stream"):
            parse_workload(bad)
    assert stream_source(w, planted) == "repeats" and stream_source(parse_workload("pp8"), planted) == "random"
    depth, timed = workload_tokens(w, 1024, 0, planted)
    assert len(depth) == 32 and len(timed) == 16
    assert workload_tokens(parse_workload("tg16@d32"), 1024, 0, planted) != (depth, timed)


@pytest.mark.skipif(not VOCAB.exists(), reason="needs a vocabulary-only GGUF from llama.cpp's sources")
def test_text_stream_through_the_models_tokenizer():
    assert stream_source(parse_workload("pp64+corr"), VOCAB) == "text"
    ids = isolated(text_tokens, str(VOCAB))
    assert len(ids) > 500 and len(set(ids)) > 200
    assert ids[:3] == isolated(text_tokens, str(VOCAB))[:3]


def test_bad_planting_options_are_one_sentence():
    with pytest.raises(UserError, match="Unknown model option"):
        parse_options(["zipff=1"])
    with pytest.raises(UserError, match="needs a number"):
        parse_options(["zipf=high"])
    with pytest.raises(UserError, match="clusters=C plants routing only together"):
        parse_options(["clusters=4"])
    with pytest.raises(UserError, match="clusters=2000 is not valid"):
        Planting(1.0, 2000).resolved(8, 128, 1024)
    r = moebench("model", "synth", "--clusters", "4", "-o", "/tmp/never.gguf")
    assert r.returncode == 2 and "--zipf" in r.stderr
