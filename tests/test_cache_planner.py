"""The expert-cache planner (harness.planning.cache_replay / trace_stats / cache_time_model, `moebench cache`): bounds
that must hold on every trace (property tests), stock llama.cpp's bytes on a hand-made trace, the trace statistics of
hand-made routings, the time model's fit, and the command end to end on a saved trace."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.routing import FORMAT, Trace, save_trace
from harness.planning import cache_replay as cs
from harness.planning.trace_stats import cover, entropy, trace_stats

EB = 1 << 20        # 1 MiB experts: budgets in MiB are expert counts per layer x layers


def make_trace(ids, steps=None, phase=None, segment=None, n_expert=8, expert_bytes=None, segments=("s0",)) -> Trace:
    """A Trace from (T, L, k) ids; default: each row its own decode step."""
    ids = np.asarray(ids, dtype=np.int16)
    T, L, k = ids.shape
    steps = np.arange(T) if steps is None else np.asarray(steps)
    header = {"format": FORMAT, "model": "test", "fingerprint": "f" * 16, "arch": "qwen3moe", "n_layers": L,
              "moe_layers": list(range(L)), "n_expert": n_expert, "k": k,
              "expert_bytes": list(expert_bytes or [EB] * L), "n_cpu_moe": 0, "n_ubatch": 512,
              "segments": list(segments), "streams": ["random"] * len(segments), "token_hash": [""] * len(segments)}
    return Trace(header, ids, np.ones(ids.shape, np.float16), np.arange(T, dtype=np.int32),
                 steps.astype(np.int32), np.asarray(phase if phase is not None else np.ones(T), np.uint8),
                 np.asarray(segment if segment is not None else np.zeros(T), np.int16))


def random_trace(rng, T, L, k, E, big_first=0) -> Trace:
    ids = np.stack([np.stack([rng.choice(E, k, replace=False, p=_zipf(E, rng)) for _ in range(L)])
                    for _ in range(T)])
    steps = np.r_[np.zeros(big_first, int), np.arange(1, T - big_first + 1)] if big_first else None
    phase = np.r_[np.zeros(big_first), np.ones(T - big_first)] if big_first else None
    return make_trace(ids, steps, phase, n_expert=E)


def _zipf(E, rng):
    w = 1.0 / np.arange(1, E + 1) ** rng.uniform(0, 1.5)
    return rng.permutation(w / w.sum())


POLICY_CASES = [("lru", {}), ("lfu", {}), ("classlru", {}), ("static", {}), ("none", {}),
                ("lru", {"global_pool": True}), ("classlru", {"global_pool": True}), ("lru", {"upload_cap": 1}),
                ("classlru", {"cpu_share": 0.5})]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), T=st.integers(2, 40), L=st.integers(1, 3), k=st.integers(1, 3),
       E=st.integers(3, 10), budget=st.integers(0, 20), big=st.sampled_from([0, 0, 33]))
def test_bounds_hold_on_random_traces(seed, T, L, k, E, budget, big):
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, T + big, L, min(k, E), E, big_first=big)
    steps = cs.steps_of(trace, cs.host_layers(trace, None))
    hits = {}
    for name, kw in POLICY_CASES:
        r = cs.simulate(steps, name, budget, **kw)
        for ph, t in r.tally.items():
            assert (t.hits + t.link + t.cpu == t.requests).all(), (name, kw, ph)
        hits[name, tuple(kw.items())] = sum(int(t.hits.sum()) for t in r.tally.values())
    per_layer = sum(int(t.hits.sum()) for t in cs.belady(steps, budget).tally.values())
    pooled = sum(int(t.hits.sum()) for t in cs.belady(steps, budget, global_pool=True).tally.values())
    assert per_layer <= pooled            # a partitioned cache is one of the global pool's choices
    for (name, kw), h in hits.items():
        assert h <= (pooled if dict(kw).get("global_pool") else per_layer), (name, kw, h, per_layer, pooled)
    oracle = sum(int(t.hits.sum()) for t in cs.static_oracle(steps, budget).tally.values())
    assert hits["static", ()] <= oracle <= per_layer


def test_static_oracle_beats_frequency_per_fold():
    """On each scored half on its own, the hindsight set is at least as good as the set learned on the other half."""
    rng = np.random.default_rng(3)
    trace = random_trace(rng, 60, 2, 2, 8)
    steps = cs.steps_of(trace, [0, 1])
    for budget in (1, 2, 4):
        cap = cs.capacity_for(budget * cs.MiB, steps)
        for fold in (0, 1):
            learned = cs.top_sets(cs.frequency(steps, 1 - fold), cap, False)
            best = cs.top_sets(cs.frequency(steps, fold, by="requests"), cap, False)
            req = cs.frequency(steps, fold, by="requests")
            assert sum(req[h, best[h]].sum() for h in range(2)) >= sum(req[h, learned[h]].sum() for h in range(2))


def test_lru_on_a_known_sequence_through_the_simulator():
    # one layer, k=1, capacity 2 (2 MiB of 1-MiB experts): 1 2 1 3 2 1 -> only the third access hits
    trace = make_trace(np.array([1, 2, 1, 3, 2, 1]).reshape(6, 1, 1))
    steps = cs.steps_of(trace, [0])
    r = cs.simulate(steps, "lru", 2)
    assert r.capacity == [2]
    assert r.summary()["hit_rate"] == pytest.approx(1 / 6)
    assert r.summary()["link_bytes_per_token"] == pytest.approx(5 * EB / 6)
    # Belady with the best initial contents {1, 2}: hits 1 2 1, misses 3 (bypassed: 2 and 1 are next), hits 2 1
    # Belady, each half from its best contents: 1 2 1 -> 3 hits; 3 2 1 from {3, 2} -> 2 hits
    assert cs.belady(steps, 2).summary()["hit_rate"] == pytest.approx(5 / 6)


def test_belady_min_by_hand():
    # capacity 2 from the best start {a, b}: a b c a b -> c is bypassed (a and b come back first): 4 hits
    assert cs._min_hits(list("abcab"), 2) == [True, True, False, True, True]
    # capacity 1: a b a b: start {a}; b (next at 3) vs a (next at 2): keep a -> hits a, a
    assert cs._min_hits(list("abab"), 1) == [True, False, True, False]
    assert cs._min_hits(list("abc"), 0) == [False] * 3


def test_stock_llama_cpp_bytes():
    """none: decode reads k experts per host layer on the CPU; a 40-token ubatch uploads the union of its experts."""
    T_pre, k = 40, 2
    pre = np.zeros((T_pre, 2, k), int)
    pre[:, :, 0], pre[:, :, 1] = np.arange(T_pre)[:, None] % 3, 3 + np.arange(T_pre)[:, None] % 2   # union 5
    dec = np.array([[[0, 1], [2, 3]]] * 4)
    trace = make_trace(np.concatenate([pre, dec]), np.r_[np.zeros(T_pre, int), 1 + np.arange(4)],
                       np.r_[np.zeros(T_pre), np.ones(4)])
    r = cs.simulate(cs.steps_of(trace, cs.host_layers(trace, None)), "none", 0)
    assert r.summary("decode") == {"hit_rate": 0.0, "link_bytes_per_token": 0.0, "cpu_bytes_per_token": 2 * k * EB,
                                   "tokens": 4, "requests": 16}
    p = r.summary("prefill")
    assert p["cpu_bytes_per_token"] == 0 and p["link_bytes_per_token"] == pytest.approx(2 * 5 * EB / T_pre)
    # depth 1: only layer 0 is on the host
    r1 = cs.simulate(cs.steps_of(trace, cs.host_layers(trace, 1)), "none", 0)
    assert r1.summary("decode")["cpu_bytes_per_token"] == k * EB


def test_capacity_split():
    trace = make_trace(np.zeros((2, 3, 1), int), expert_bytes=[EB, EB, 2 * EB])
    steps = cs.steps_of(trace, [0, 1, 2])
    assert cs.capacity_for(8 * EB, steps) == [2, 2, 2]                  # 2 x (1 + 1 + 2) MiB
    assert cs.capacity_for(7 * EB, steps, global_pool=True) == [1, 1, 1]   # 3 slots of 2 MiB
    assert cs.capacity_for(10**12, steps) == [8, 8, 8]                  # never more than the experts


def test_trace_statistics_of_planted_routing():
    assert cover(np.array([90, 5, 5, 0])) == 1 and cover(np.array([1, 1, 1, 1])) == 4
    assert entropy(np.array([1, 1, 1, 1])) == pytest.approx(1.0) and entropy(np.array([5, 0, 0, 0])) == 0.0
    # layer 0 repeats the same experts every token; layer 1 never repeats the previous token's experts
    ids = np.zeros((8, 2, 2), int)
    ids[:, 0] = [0, 1]
    ids[:, 1] = np.array([[0, 1], [2, 3]] * 4)
    s = trace_stats(make_trace(ids))
    assert s.overlap == [1.0, 0.0]
    assert s.cover90 == [2, 4]
    # reuse: layer 0: 2 firsts + 14 at distance 1; layer 1: 4 firsts + 12 at distance 2
    assert s.reuse["1"] == pytest.approx(14 / 32) and s.reuse["2"] == pytest.approx(12 / 32)
    assert s.reuse["never"] == pytest.approx(6 / 32)


def test_cache_command_end_to_end(tmp_path):
    from harness.cli import cli

    rng = np.random.default_rng(0)
    trace = random_trace(rng, 80, 2, 2, 8, big_first=40)
    run = tmp_path / "run"
    save_trace(run / "traces" / "cell.npz", trace)
    out = tmp_path / "out.json"
    res = CliRunner().invoke(cli, ["cache", str(run), "--vram", "2MiB,4MiB", "--format", "json", "-o", str(out),
                                   "--report", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["policy"] for r in rows} >= {"none", "lru", "classlru", "belady", "static-oracle"}
    assert (tmp_path / "rep" / "cache.md").exists() and (tmp_path / "rep" / "cache.html").exists()
    assert list((tmp_path / "rep").glob("*.png"))
    seg = CliRunner().invoke(cli, ["cache", str(run), "--vram", "2MiB", "--segment", "s0,nope"])     # a comma list
    assert seg.exit_code == 2 and "no segment 'nope'" in seg.output
    bad = CliRunner().invoke(cli, ["cache", str(tmp_path / "nothing"), "--vram", "1MiB"])
    assert bad.exit_code == 2 and "error:" in bad.output


def test_cache_command_without_vram_simulates_one_expert_per_layer_to_all(tmp_path):
    from harness.cli import cli

    trace = random_trace(np.random.default_rng(1), 60, 2, 2, 6, big_first=20)       # 2 layers of 6 experts, 1 MiB each
    save_trace(tmp_path / "t.npz", trace)
    res = CliRunner().invoke(cli, ["cache", str(tmp_path / "t.npz"), "--policy", "lru", "--format", "json",
                                   "-o", str(tmp_path / "out.json")])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert sorted({r["cache MiB"] for r in rows}) == [2, 4, 8, 12]          # 1, 2, 4 and all 6 experts x 2 layers
    assert sorted({r["experts/layer"] for r in rows}) == [1, 2, 4, 6]
    assert all(r["hit %"] == 100 for r in rows if r["policy"] == "belady" and r["experts/layer"] == 6)
    # a depth with one host layer halves every size
    res = CliRunner().invoke(cli, ["cache", str(tmp_path / "t.npz"), "--n-cpu-moe", "1", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert sorted({r["cache MiB"] for r in json.loads(res.stdout)["rows"]}) == [1, 2, 4, 6]
