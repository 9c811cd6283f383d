"""engines.cache_policies: hand-computed sequences for LRU, LFU, static and upstream's ClassLRU (decay, classes,
victim rule), and invariants on random request streams (hypothesis): hits + misses = requests, no pool over its
capacity, no eviction of an expert of the current request, the upload cap."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.errors import UserError
from engines.cache_policies import CRF_HALF_LIFE, N_CLASS, POLICIES, make_policy


def run(policy, seq, layer=0):
    """One single-expert request per clock tick; the hit flags."""
    return [policy.request(layer, [e], [1], t)[0] for t, e in enumerate(seq)]


def test_lru_by_hand():
    p = make_policy("lru", [2])
    assert run(p, [1, 2, 1, 3, 2, 1]) == [False, False, True, False, False, False]
    assert (p.hits, p.misses, p.uploads) == (1, 5, 5)
    assert p.resident(0) == [1, 2]


def test_lru_global_pool_shares_slots():
    p = make_policy("lru", [1, 1], global_pool=True)
    p.request(0, [1, 2], [1, 1], 0)              # layer 0 takes both slots of the pool
    assert p.occupancy() == [2] and p.resident(0) == [1, 2] and p.resident(1) == []
    assert p.request(1, [5], [1], 1) == [False]  # evicts layer 0's least recently used (expert 1)
    assert p.resident(0) == [2] and p.resident(1) == [5]


def test_lfu_by_hand():
    p = make_policy("lfu", [2])
    p.request(0, [1], [5], 0)                    # expert 1: 5 selections
    p.request(0, [2], [1], 1)
    assert p.request(0, [3], [1], 2) == [False]  # evicts 2 (1 selection) not 1 (5)
    assert p.resident(0) == [1, 3]


def test_static_pins_and_never_uploads():
    p = make_policy("static", [2], static_sets=[[4, 7]])
    assert p.request(0, [1, 4, 7], [1, 1, 1], 0) == [False, True, True]
    assert (p.hits, p.misses, p.uploads) == (2, 1, 0) and p.resident(0) == [4, 7]
    with pytest.raises(UserError):
        make_policy("static", [1], static_sets=[[1, 2]])


def test_none_and_lookup():
    p = make_policy("none", [4])
    assert p.request(0, [1, 2], [1, 1], 0) == [False, False] and p.uploads == 0
    q = make_policy("lru", [2])
    q.request(0, [1], [1], 0)
    assert q.lookup(0, [1, 2]) == [True, False]
    assert (q.hits, q.misses, q.uploads, q.resident(0)) == (0, 1, 1, [1])      # lookup changed nothing


def test_classlru_decay_and_classes():
    assert N_CLASS == 8 and CRF_HALF_LIFE == 128
    # the largest CRF of one use per token: 1 / (1 - 2^(-1/128)) ~ 185, class 7 (hence 8 classes)
    p = make_policy("classlru", [4])
    assert p.class_of(1 / (1 - 2 ** (-1 / 128))) == 7 and p.class_of(1.0) == 0 and p.class_of(3.9) == 1
    p.request(0, [1], [2], 0)                    # CRF 2 at t=0 -> class 1
    assert p.crf[0, 1] == 2 and p.cls[0, 1] == 1
    p.request(0, [1], [1], 128)                  # one half-life later: 2 -> 1, plus 1 use = 2
    assert p.crf[0, 1] == pytest.approx(2.0)
    p.request(0, [1], [6], 128)                  # same clock: no decay, 8 -> class 3
    assert p.crf[0, 1] == pytest.approx(8.0) and p.cls[0, 1] == 3
    assert p.decayed_crf((0, 1), 128 + 256) == pytest.approx(2.0)
    assert p.class_of(1000.0) == 7


def test_classlru_victim_is_largest_age_over_class():
    p = make_policy("classlru", [2])
    p.request(0, [1], [4], 0)                    # expert 1: CRF 4, class 2, last use 0
    p.request(0, [2], [1], 3)                    # expert 2: CRF 1, class 0, last use 3
    # at t=5: expert 1 scores 5 / 4 = 1.25, expert 2 scores 2 / 1 = 2 -> expert 2 goes
    assert p.request(0, [3], [1], 5) == [False]
    assert p.resident(0) == [1, 3]
    # at t=13: expert 1 (class 2, age 13) 3.25; expert 3 (class 0, age 8) 8 -> expert 3 goes
    p.request(0, [4], [1], 13)
    assert p.resident(0) == [1, 4]
    # much later the frequent expert is old enough: t=200: expert 1: 200/4 = 50 (its class as of its last use),
    # expert 4: 187 -> still 4; then at t=201 expert 5 (class 0, age 1) vs 1 (201/4 = 50.25) -> 1 goes
    p.request(0, [5], [1], 200)
    assert p.resident(0) == [1, 5]
    p.request(0, [6], [1], 201)
    assert p.resident(0) == [5, 6]
    # CRF is kept across evictions: expert 1 comes back with its decayed count, not from zero
    assert p.decayed_crf((0, 1), 201) == pytest.approx(4 * 2 ** (-201 / 128))


def test_upload_cap_and_cpu_share():
    p = make_policy("lru", [8], upload_cap=2)
    assert p.request(0, [1, 2, 3, 4], [1] * 4, 0) == [False] * 4
    assert p.uploads == 2 and p.resident(0) == [1, 2]
    q = make_policy("lru", [2], cpu_share=0.5)
    q.request(0, [1, 2], [1, 1], 0)              # fills the pool: the CPU share starts after that
    assert q.uploads == 2
    for t in range(1, 9):
        q.request(0, [10 + t], [1], t)
    assert q.uploads == 2 + 4                    # half of the 8 later misses went to the CPU


def test_errors():
    with pytest.raises(UserError):
        make_policy("mru", [1])
    with pytest.raises(UserError):
        make_policy("lru", [1], cpu_share=2.0)
    assert POLICIES == ("none", "static", "lru", "lfu", "classlru")


requests = st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True),
                              st.integers(1, 4)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(reqs=requests, name=st.sampled_from(["lru", "lfu", "classlru", "none"]), cap=st.integers(0, 6),
       glob=st.booleans(), ucap=st.sampled_from([None, 0, 1, 3]), share=st.sampled_from([0.0, 0.3, 1.0]))
def test_invariants(reqs, name, cap, glob, ucap, share):
    p = make_policy(name, [cap] * 3, global_pool=glob, upload_cap=ucap, cpu_share=share)
    total, t = 0, 0
    for layer, experts, n in reqs:
        experts = sorted(experts)
        before = {e for e in experts if e in p.resident(layer)}
        up = p.uploads
        hit = p.request(layer, experts, [n] * len(experts), t)
        t += n
        total += len(experts)
        assert {e for e, h in zip(experts, hit) if h} == before
        assert all(e in p.resident(layer) for e in before)        # no expert of the request was evicted
        assert ucap is None or p.uploads - up <= ucap
        assert all(o <= c for o, c in zip(p.occupancy(), p.capacities()))
    assert p.hits + p.misses == total and p.uploads <= p.misses
    if name == "classlru":
        assert all(0 <= c < N_CLASS for c in p.cls.values())
        assert all(not math.isnan(x) and x >= 0 for x in p.crf.values())
