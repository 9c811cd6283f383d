"""The reference engine's own expert cache (engines.reference.device_cache): on a CPU-only host its slots are host
memory, so its logic runs for real. Its counters must equal a replay of the cell's routing trace through the same
policies (engines.cache_policies.make_policy) and its logits must equal those with the cache off, bit for bit."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.base import EngineSettings
from engines.errors import UserError
from engines.cache_policies import make_policy
from engines.reference.device_cache import PHASES, capacities, static_sets
from engines.reference.engine import ReferenceEngine
from engines.routing import Trace, load_trace
from tests import conftest
from workloads.grammar import parse_workload
from workloads.tokens import workload_tokens

ONLINE = ("lru", "lfu", "classlru")
PROMPT = [int(t) for t in np.random.default_rng(5).integers(1, 1024, 45)]
RUNS = [("pp45", PROMPT, []), ("tg6@d7", PROMPT[:7], PROMPT[7:13])]      # (segment, prefill tokens, decodes)


def drive(path: Path, depth: int, device: str = "cpu", **extra) -> tuple[list[torch.Tensor], dict]:
    """Each run as the worker drives it (a segment, reset, prefill, decodes): the logits of every call, and the
    effective extra settings (counters) after all of them. On the CPU (where the cache is bit-exact) by default."""
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=64, n_ubatch=16, threads=2, device=device,
                                extra={"logits_all": True} | extra))
    out = []
    for name, pre, dec in RUNS:
        e.trace_segment(name, pre + dec)
        e.reset()
        e.prefill(pre)
        out.append(e.logits().clone())
        for t in dec:
            e.decode(t)
            out.append(e.logits().clone())
        e.trace_segment(None)
    info = e.info()
    e.close()
    return out, info.settings["extra"] | {"bytes_by_device": info.bytes_by_device}


def replay(tr: Trace, policy: str, capacity: list[int], static: list[list[int]] | None = None) -> dict:
    """The cache counters a trace predicts: each segment from a cold cache (a run starts with reset()), requests per
    step and offloaded MoE layer (distinct experts ascending, their selection counts), t = the segment's tokens so
    far."""
    out = {f"cache_{k}_{p}": 0 for p in PHASES for k in ("hits", "misses", "uploads", "upload_bytes")}
    for seg in range(len(tr.header["segments"])):
        pol, t = make_policy(policy, capacity, static_sets=static), 0
        for _, phase, rows in tr.steps(segment=seg):
            for li in range(len(capacity)):
                before = (pol.hits, pol.misses, pol.uploads)
                pol.request(li, *tr.request(rows, li), t)
                p = PHASES[phase]
                out[f"cache_hits_{p}"] += pol.hits - before[0]
                out[f"cache_misses_{p}"] += pol.misses - before[1]
                out[f"cache_uploads_{p}"] += pol.uploads - before[2]
                out[f"cache_upload_bytes_{p}"] += (pol.uploads - before[2]) * tr.expert_bytes[li]
            t += rows.stop - rows.start
    return out


def counters(extra: dict) -> dict:
    return {k: v for k, v in extra.items() if k.startswith("cache_") and k.split("_")[-1] in PHASES}


@pytest.fixture(scope="module")
def off(tiny, tmp_path_factory) -> tuple[list[torch.Tensor], Path]:
    """Logits with the cache off, and the trace of those runs."""
    path = tmp_path_factory.mktemp("cache") / "off.npz"
    logits, _ = drive(tiny, 4, trace_routing=str(path))
    return logits, path


def test_capacities_split_the_budget_by_bytes(tiny):
    from engines.reference.offload import ExpertStack
    from engines.reference.qtensor import QTensor

    def stack(E: int, ff: int) -> ExpertStack:
        m = QTensor(torch.zeros(E * ff * 32 * 4, dtype=torch.uint8), "F32", (E, ff, 32))
        return ExpertStack(m, m, QTensor(m.raw, "F32", (E, 32, ff)))

    small, big = stack(8, 16), stack(8, 48)          # one expert: 6 KiB and 18 KiB; the layers: 48 and 144 KiB
    assert capacities([small, big], 96 << 10) == [4, 4]      # half of 192 KiB: half of each layer's experts
    assert capacities([small, big], 1 << 30) == [8, 8]
    assert capacities([small, big], 23 << 10) == [0, 0]


@pytest.mark.parametrize("policy", ONLINE)
def test_counters_equal_the_replay_of_the_trace_and_logits_are_unchanged(tiny, off, tmp_path, policy):
    base, _ = off
    for mib in (1, 2):               # 2 and 5 of 8 experts a layer: requests of more experts than slots bypass
        trace = tmp_path / f"{mib}.npz"
        logits, extra = drive(tiny, 4, cache_mib=mib, cache_policy=policy, trace_routing=str(trace))
        assert all(torch.equal(a, b) for a, b in zip(logits, base)), f"{policy} {mib} MiB changed the logits"
        tr = load_trace(trace)
        assert extra["cache_capacity"] == capacities_of(tr, mib)
        want = replay(tr, policy, extra["cache_capacity"])
        assert counters(extra) == want
        assert want["cache_hits_decode"] > 0 and want["cache_uploads_prefill"] > 0 and want["cache_misses_prefill"] > 0
        assert extra["bytes_by_device"]["accelerator"] >= extra["cache_slot_bytes"] == \
            sum(extra["cache_capacity"]) * tr.expert_bytes[0]


def capacities_of(tr: Trace, mib: int) -> list[int]:
    """What the budget holds per layer, split by bytes (the same share of every layer's experts)."""
    return [min(tr.n_expert, (mib << 20) // sum(tr.expert_bytes))] * tr.n_layers_moe


def test_static_pins_the_top_experts_of_a_trace_and_replays(tiny, off, tmp_path):
    base, learned = off
    trace = tmp_path / "static.npz"
    logits, extra = drive(tiny, 4, cache_mib=1, cache_policy="static", cache_static_trace=str(learned),
                          trace_routing=str(trace))
    assert all(torch.equal(a, b) for a, b in zip(logits, base))
    src = load_trace(learned)
    pinned = static_sets([src.ids[:, li] for li in range(4)], extra["cache_capacity"], 8)
    counts = np.bincount(src.ids[:, 0].ravel(), minlength=8)
    assert set(pinned[0]) == set(np.argsort(-counts, kind="stable")[:2].tolist())
    assert counters(extra) == replay(load_trace(trace), "static", extra["cache_capacity"], pinned)
    assert extra["cache_uploads_prefill"] == extra["cache_uploads_decode"] == 0
    assert extra["cache_preload_bytes"] == extra["cache_slot_bytes"] > 0


def test_partial_depth_caches_only_offloaded_layers(tiny, tmp_path):
    base, _ = drive(tiny, 2)
    logits, extra = drive(tiny, 2, cache_mib=1, cache_policy="lru", trace_routing=str(tmp_path / "t.npz"))
    assert all(torch.equal(a, b) for a, b in zip(logits, base))
    assert len(extra["cache_capacity"]) == 2 and extra["cache_capacity"] == [5, 5]     # 1 MiB / 2 x 96 KiB
    assert counters(extra) == replay(load_trace(tmp_path / "t.npz"), "lru", extra["cache_capacity"])
    _, none = drive(tiny, 0, cache_mib=64)
    assert not counters(none)                             # no offloaded layer: no cache


@pytest.mark.parametrize("extra, match", [
    ({"cache_mib": "lots"}, "not a whole number of MiB"),
    ({"cache_mib": 1, "cache_policy": "fifo"}, "not one the engine runs"),
    ({"cache_mib": 1, "cache_policy": "static"}, "--cache-static-trace"),
])
def test_bad_cache_settings_are_user_errors(tiny, extra, match):
    with pytest.raises(UserError, match=match):
        ReferenceEngine().load(tiny, EngineSettings(n_cpu_moe=4, n_ctx=32, device="cpu", extra=extra))


def test_static_trace_of_another_model_is_a_user_error(tmp_path, off):
    from workloads.synth import synthesize
    other = synthesize("tiny", tmp_path / "other.gguf", seed=1)
    with pytest.raises(UserError, match="not of this model"):
        ReferenceEngine().load(other, EngineSettings(n_cpu_moe=4, n_ctx=32, device="cpu", extra={
            "cache_mib": 1, "cache_policy": "static", "cache_static_trace": str(off[1])}))


def test_sweep_crosses_cache_knobs_and_cells_csv_counts_match_the_trace(tmp_path):
    """Each run starts cold, so a cell's counters are (warm-up + repetitions) x the replay of each workload's trace."""
    r = conftest.moebench("sweep", "-m", "preset:tiny", "-e", "reference", "--n-cpu-moe", "all", "-w", "pp24,tg4@d8",
                          "-r", "1", "--threads", "2", "--sample-ms", "0", "--trace-routing", "--cache-mib", "1",
                          "--cache-policy", "lru,classlru", "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    run = conftest.run_dir_of(r)
    with open(run / "cells.csv") as f:
        cells = list(csv.DictReader(f))
    assert sorted(c["cell_id"].split("/")[0] for c in cells) == ["reference@cache_policy=classlru",
                                                                 "reference@cache_policy=lru"]
    for c in cells:
        assert c["status"] == "ok", c["error"]
        eff = json.loads(c["effective_settings"])["extra"]
        tr = load_trace(run / "traces" / (c["cell_id"].replace("/", "_") + ".npz"))
        assert eff["trace_routing"].endswith(".npz") and eff["cache_mib"] == 1
        want = replay(tr, eff["cache_policy"], eff["cache_capacity"])
        assert counters(eff) == {k: 2 * v for k, v in want.items()}       # warm-up + 1 repetition
        assert want["cache_hits_decode"] + want["cache_hits_prefill"] > 0
        depth, timed = workload_tokens(parse_workload("tg4@d8"), 1024, 0)
        assert len(tr.select(segment="tg4@d8")) == len(depth) + len(timed)


def test_sweep_rejects_bad_cache_flags(tmp_path):
    r = conftest.moebench("sweep", "-m", "preset:tiny", "-e", "reference", "--cache-mib", "lots", "-w", "tg2",
                          "--results-dir", tmp_path)
    assert r.returncode == 2 and "--cache-mib 'lots' is not valid; use a whole number" in r.stderr
    r = conftest.moebench("sweep", "-m", "preset:tiny", "-e", "stamp", "--cache-mib", "64", "-w", "tg2",
                          "--results-dir", tmp_path)
    assert r.returncode == 2 and "takes --cache-mib" in r.stderr and "-e reference" in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device; runs on a GPU machine (pytest -m gpu)")
@pytest.mark.parametrize("mib", [1, 2])
def test_cuda_cache_counts_the_replay_and_keeps_logits_close(tiny, tmp_path, mib):
    """On CUDA the slots are device memory and the two parts (slots on the GPU, the rest on the CPU) add: counters
    still equal the replay exactly; logits match the cache-off run (host path on the CPU) to rounding."""
    base, _ = drive(tiny, 4)
    trace = tmp_path / "t.npz"
    out, extra = drive(tiny, 4, "cuda", cache_mib=mib, cache_policy="lru", trace_routing=str(trace))
    assert extra["bytes_by_device"].get("accelerator", 0) >= extra["cache_slot_bytes"] > 0
    assert counters(extra) == replay(load_trace(trace), "lru", extra["cache_capacity"])
    assert all(torch.allclose(a.float().cpu(), b, atol=2e-2) for a, b in zip(out, base))


def test_sweep_refuses_a_static_trace_of_the_stream_it_times(tiny, tmp_path):
    """--cache-policy static pins the experts a trace used most: a trace recorded on the tokens the sweep is about to
    time (the same --seed and stream) is refused before anything runs; one of another seed is taken."""
    from engines.gguf_meta import read_meta
    from harness.run.spec import SweepSpec, expand

    n_vocab, path = read_meta(tiny).n_vocab, tmp_path / "t.npz"
    e = ReferenceEngine()
    e.load(tiny, EngineSettings(n_cpu_moe=4, n_ctx=64, n_ubatch=16, threads=2, device="cpu",
                                extra={"trace_routing": str(path)}))
    for name in ("tg4@d8", "pp16+corr"):          # each workload's first run as the worker drives it, at --seed 0
        w = parse_workload(name)
        depth, timed = workload_tokens(w, n_vocab, 0, tiny)
        e.trace_segment(name, depth + timed, w.stream)
        e.reset()
        e.prefill(depth)
        if w.n_prompt:
            e.prefill(timed)
        for t in [] if w.n_prompt else timed:
            e.decode(t)
        e.trace_segment(None)
    e.close()

    def spec(seed: int, workloads: list[str], policy: str = "static") -> SweepSpec:
        return SweepSpec(models=[str(tiny)], engines=["reference"], depths=["all"], workloads=workloads, seed=seed,
                         extra={"cache_static_trace": str(path)}, knobs={"cache_mib": ["1"], "cache_policy": [policy]})

    for workloads in (["tg4@d8"], ["pp32+corr"]):
        with pytest.raises(UserError, match="recorded on the token stream this sweep times.*--seed 1"):
            expand(spec(0, workloads))
    assert expand(spec(1, ["tg4@d8", "pp32+corr"])) and expand(spec(0, ["tg4@d8"], "lru"))
    r = conftest.moebench("sweep", "-m", tiny, "-e", "reference", "--n-cpu-moe", "all", "-w", "tg4", "--cache-mib", "1",
                          "--cache-policy", "lru,static", "--cache-static-trace", path, "--results-dir", tmp_path)
    assert r.returncode == 2 and "record the trace with another --seed" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*/cells.csv"))
