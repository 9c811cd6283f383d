"""recommend on constructed result sets (exact numbers), size parsing, and the CLI."""
import json
import math

import pytest

from engines.errors import UserError
from engines.gguf_meta import read_meta
from harness.planning.plan import PlanSettings, make_plan
from harness.planning.recommend import recommend_depth
from harness.store.results import append_rows
from harness.units import parse_size
from tests.conftest import moebench

GiB = 2**30


def make_run(run_dir, meta, cells: dict, profile=None, effective=None, by_device=None):
    """cells: depth -> (status, {workload: tok/s}); llama-cpp, n_ctx 256, no memory peaks. The tok/s of a workload
    are a list (one process: repetitions) or a list of lists (one per round, as --rounds writes them). effective /
    by_device: the cells' effective settings and buffers (where the engine ran; default: not recorded)."""
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name, "hardware_profile": profile}))
    for n, (status, wls) in cells.items():
        cid = f"llama-cpp/{meta.fingerprint}/ncmoe{n}"
        append_rows(run_dir, "cells.csv", [{
            "run_id": run_dir.name, "cell_id": cid, "engine": "llama-cpp", "model": str(meta.path),
            "model_name": meta.name, "model_fingerprint": meta.fingerprint, "n_cpu_moe": n, "n_ctx": 256,
            "n_batch": 2048, "n_ubatch": 512, "threads": 2, "flash_attn": "auto", "status": status,
            "error": "" if status == "ok" else "killed", "effective_settings": effective or {},
            "bytes_by_device": by_device or {}}])
        rounds = {wl: vs if vs and isinstance(vs[0], list) else [vs] for wl, vs in wls.items()}
        append_rows(run_dir, "measurements.csv", [
            {"run_id": run_dir.name, "cell_id": cid, "engine": "llama-cpp", "n_cpu_moe": n, "workload": wl,
             "n_prompt": int(wl[2:]) if wl.startswith("pp") else 0, "n_gen": int(wl[2:]) if wl.startswith("tg") else 0,
             "n_depth": 0, "rep": i, "ns": 1, "tokens_per_s": v, "round": k + 1 if len(rs) > 1 else ""}
            for wl, rs in rounds.items() for k, vs in enumerate(rs) for i, v in enumerate(vs)])
    return run_dir


@pytest.fixture(autouse=True)
def no_stored_profile(tmp_path, monkeypatch):
    """Without a profile in the runs, recommend falls back to this machine's stored one: keep it out."""
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def meta(tiny):
    return read_meta(tiny)


def rec(meta, runs=(), vram=GiB, objective="decode", margin=0):
    p = make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=256), list(runs))
    return p, recommend_depth(p, objective, vram, 64 * GiB, margin, list(runs))


def test_nothing_measured_gives_the_smallest_feasible_depth(meta):
    p, _ = rec(meta)
    p, r = rec(meta, vram=p.at(2).accel_bytes + 1000, margin=1000)     # depth 2 fits exactly, 0 and 1 do not
    assert r.recommended == 2
    assert [x.fits for x in r.rows] == [False, False, True, True, True]
    assert "smallest depth that fits" in r.rationale


def test_best_measured_feasible_depth_and_predicted_ranges(meta, tmp_path):
    run = make_run(tmp_path / "r", meta, {0: ("ok", {"tg8": [100, 98, 102], "pp64": [500, 500]}),
                                          2: ("ok", {"tg8": [60], "pp64": [900]}),
                                          4: ("ok", {"tg8": [30], "pp64": [400]})})
    _, r = rec(meta, [run])
    assert r.recommended == 0 and r.rows[0].measured["decode"] == pytest.approx(100)
    assert r.rows[1].status == "predicted" and r.rows[1].predicted["decode"] == pytest.approx((60, 100))
    assert r.rows[3].predicted["decode"] == pytest.approx((30, 60))
    _, r = rec(meta, [run], objective="prefill")
    assert r.recommended == 2 and "prefill 900.0 tok/s" in r.rationale
    _, r = rec(meta, [run], objective="balanced")      # geomean of normalized decode and prefill scores
    assert r.recommended == 2 and r.rows[2].score == pytest.approx(math.sqrt(0.6 * 1.0))


def test_depths_within_noise_are_ties_resolved_to_the_least_vram(meta, tmp_path):
    """Depth 2 is 5 % slower than 0 in the medians, but three rounds this noisy cannot tell them apart (the 95 %
    interval of their ratio holds 1): a tie, which goes to depth 2 (less VRAM). Depth 4 is clearly slower."""
    run = make_run(tmp_path / "r", meta, {0: ("ok", {"tg8": [[100, 101], [96, 97], [104, 103]]}),
                                          2: ("ok", {"tg8": [[94, 95], [99, 100], [92, 93]]}),
                                          4: ("ok", {"tg8": [[50, 51], [49, 50], [51, 52]]})})
    p, r = rec(meta, [run])
    assert p.at(2).accel_bytes < p.at(0).accel_bytes
    assert r.recommended == 2 and r.ties == [0, 2]
    assert "n_cpu_moe=0 and 2 are within noise of each other" in r.rationale
    assert "picked 2, the one needing the least VRAM" in r.rationale
    # the same medians from quiet rounds: depth 0 is faster, no tie
    quiet = make_run(tmp_path / "q", meta, {0: ("ok", {"tg8": [[100, 100.5], [100.2, 100], [99.8, 100]]}),
                                            2: ("ok", {"tg8": [[95, 95.2], [95.1, 95], [94.9, 95]]})})
    _, r = rec(meta, [quiet])
    assert r.recommended == 0 and r.ties == [0] and "fastest measured depth" in r.rationale
    # one sample a side gives no interval: compared by median, and the note says so
    single = make_run(tmp_path / "s", meta, {0: ("ok", {"tg8": [100]}), 2: ("ok", {"tg8": [95]})})
    _, r = rec(meta, [single])
    assert r.recommended == 0 and any("too few samples for an interval" in n for n in r.notes)


def test_ties_need_every_workload_of_the_objective_within_noise(meta, tmp_path):
    """balanced: depth 2 ties with 0 at decode but is clearly slower at prefill, so it is no tie."""
    noisy0, noisy2 = [[100, 101], [96, 97], [104, 103]], [[94, 95], [99, 100], [92, 93]]
    run = make_run(tmp_path / "r", meta, {0: ("ok", {"tg8": noisy0, "pp64": [[500, 501], [499, 500], [500, 502]]}),
                                          2: ("ok", {"tg8": noisy2, "pp64": [[400, 401], [399, 400], [401, 400]]})})
    _, r = rec(meta, [run], objective="balanced")
    assert r.recommended == 0 and r.ties == [0]
    _, r = rec(meta, [run], objective="decode")
    assert r.recommended == 2 and r.ties == [0, 2]


@pytest.mark.parametrize("effective, by_device, refused", [
    ({"n_cpu_moe": 0}, {"model:CPU": 1000, "model:CPU_REPACK": 10}, True),     # llama.cpp, CPU buffers only
    ({"device": "cpu", "dtype": "float32"}, {"host": 1000}, True),             # the reference engine on the CPU
    ({"n_cpu_moe": 0}, {"model:CUDA0": 1000, "model:CPU": 10}, False),         # llama.cpp with a GPU
    ({"device": "cuda:0"}, {"accelerator": 1000}, False),
])
def test_runs_measured_without_a_gpu_are_refused_for_a_vram_plan(meta, tmp_path, effective, by_device, refused):
    run = make_run(tmp_path / "r", meta, {0: ("ok", {"tg8": [100, 99]}), 2: ("ok", {"tg8": [60, 61]})},
                   effective=effective, by_device=by_device)
    if refused:
        with pytest.raises(UserError, match="without a GPU.*measure on the GPU you plan for"):
            rec(meta, [run])
    else:
        assert rec(meta, [run])[1].recommended == 0


def test_a_failed_cell_is_shown_and_never_recommended(meta, tmp_path):
    run = make_run(tmp_path / "r", meta, {0: ("oom", {}), 2: ("ok", {"tg8": [60]}), 4: ("ok", {"tg8": [30]})})
    _, r = rec(meta, [run])
    assert r.recommended == 2 and r.rows[0].status == "failed: oom" and not r.rows[0].measured


def test_predictions_are_capped_by_the_roofline(meta, tmp_path):
    # CPU-only profile: decode bound = 0.1 GB/s / bytes per token ~ 47 tok/s at every depth
    prof = {"threads": 2, "cores_physical": 2, "figures": {"host_read_gbps": {"max": 0.1}}}
    run = make_run(tmp_path / "r", meta, {0: ("ok", {"tg8": [50]}), 2: ("ok", {"tg8": [40]})}, prof)
    _, r = rec(meta, [run])
    cap = r.rows[1].bound["decode"]
    assert 40 < cap < 50 and r.rows[1].predicted["decode"] == pytest.approx((40, cap))


def test_no_feasible_depth_names_the_smallest_vram(meta, tmp_path):
    p, r = rec(meta, vram=1000, margin=GiB)
    assert r.recommended is None and r.smallest_vram == p.at(4).accel_bytes + GiB
    assert "smallest VRAM" in r.rationale
    out = moebench("recommend", "-m", meta.path, "--vram", "1KiB", "--ram", "64GiB", "--ctx", "256", "--format", "json")
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout)
    assert js["recommended"] is None and js["smallest_vram_bytes"] == p.at(4).accel_bytes + GiB


def test_cli_table_and_json_with_results(meta, tmp_path):
    run = make_run(tmp_path / "r", meta, {0: ("ok", {"tg8": [100]}), 4: ("ok", {"tg8": [30]})})
    out = moebench("recommend", "-m", meta.path, "--vram", "16GiB", "--ram", "64GB", "--ctx", "256",
                   "--objective", "decode", "--results", run, "--format", "json")
    js = json.loads(out.stdout)
    assert js["recommended"] == 0 and js["vram_bytes"] == 16 * GiB and js["ram_bytes"] == 64 * 10**9
    assert js["depths"][0]["measured_tps"]["decode"] == pytest.approx(100)
    t = moebench("recommend", "-m", meta.path, "--vram", "16GiB", "--ram", "64GiB", "--ctx", "256", "--results", run)
    assert t.returncode == 0 and "n_cpu_moe=0 is the fastest" in t.stdout
    bad = moebench("recommend", "-m", meta.path, "--vram", "lots")
    assert bad.returncode == 2 and "--vram" in bad.stderr and "Traceback" not in bad.stderr
    for flag, value in (("--vram", "16"), ("--ram", "64"), ("--margin", "1")):
        bare = moebench("recommend", "-m", meta.path, "--vram", "16GiB", "--ram", "64GiB", flag, value)
        assert bare.returncode == 2 and f"error: {flag} {value} has no unit; write {value}GiB" in bare.stderr
    other = moebench("recommend", "-m", meta.path, "--vram", "16GiB", "--results", run, "--engine", "reference")
    assert other.returncode == 2 and "no reference cells" in other.stderr


def test_vram_defaults_to_the_gpu_or_asks_for_it(meta):
    from harness.hw.host import gpus
    r = moebench("recommend", "-m", meta.path, "--ctx", "256")
    if gpus():
        assert r.returncode == 0 and "free on GPU 0" in r.stdout
    else:
        assert r.returncode == 2 and "--vram" in r.stderr


def test_parse_size():
    assert parse_size("16GiB") == 16 * GiB and parse_size("16GB") == 16 * 10**9
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5G") == int(1.5 * GiB)
    assert parse_size("4096B") == 4096 and parse_size("0") == 0
    with pytest.raises(UserError, match="--vram"):
        parse_size("16 parsecs", "--vram")
    with pytest.raises(UserError, match="^--vram 16 has no unit; write 16GiB, 16GB or 16384MiB"):
        parse_size("16", "--vram")
    with pytest.raises(UserError, match="^--ram 1.5 has no unit; write 1.5GiB, 1.5GB or 1536MiB"):
        parse_size("1.5", "--ram")


def test_trace_adds_an_expert_cache_in_the_vram_left_free(meta, tmp_path):
    """recommend --trace: each feasible depth gets a cache of the VRAM it leaves free, replayed on the trace; decode
    routed to experts {0, 1} only is nearly all hits once two experts per host layer fit."""
    import numpy as np

    from engines.routing import FORMAT, Trace, save_trace

    L, E, k = len(meta.moe_layers), meta.n_expert, 2
    per_expert = meta.expert_bytes() // (L * E)
    T = 64
    ids = np.tile(np.array([0, 1], np.int16), (T, L, 1))
    header = {"format": FORMAT, "model": meta.name, "fingerprint": meta.fingerprint, "arch": meta.arch,
              "n_layers": meta.n_layers, "moe_layers": list(meta.moe_layers), "n_expert": E, "k": k,
              "expert_bytes": [per_expert] * L, "n_cpu_moe": meta.n_layers, "n_ubatch": 512, "segments": ["tg64"],
              "streams": ["random"], "token_hash": [""]}
    save_trace(tmp_path / "t.npz", Trace(header, ids, np.ones(ids.shape, np.float16), np.arange(T, dtype=np.int32),
                                         np.arange(T, dtype=np.int32), np.ones(T, np.uint8), np.zeros(T, np.int16)))
    p, _ = rec(meta)
    cache = 3 * per_expert * L
    vram = p.at(meta.n_layers).accel_bytes + cache
    out = moebench("recommend", "-m", meta.path, "--vram", f"{vram}B", "--ram", "64GiB", "--ctx", "256", "--margin",
                   "0", "--trace", tmp_path / "t.npz", "--format", "json")
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout)
    rows = {d["n_cpu_moe"]: d for d in js["depths"]}
    deepest = rows[meta.n_layers]["cache"]
    assert deepest["cache_mib"] == pytest.approx(cache / 2**20) and deepest["hit_rate"] >= 0.9
    fits = [d["cache"] for d in js["depths"] if d["fits"]]
    assert all(d["cache"] is None for d in js["depths"] if not d["fits"])
    assert js["cache"]["pick"]["host_mb_per_token"] == min(c["host_mb_per_token"] for c in fits)
    t = moebench("recommend", "-m", meta.path, "--vram", f"{vram}B", "--ram", "64GiB", "--ctx", "256", "--margin", "0",
                 "--trace", tmp_path / "t.npz")
    assert t.returncode == 0 and "MiB of cache" in t.stdout and "cache hit" in t.stdout
    header["fingerprint"] = "0" * 16
    save_trace(tmp_path / "other.npz", Trace(header, ids, np.ones(ids.shape, np.float16), np.arange(T, dtype=np.int32),
                                             np.arange(T, dtype=np.int32), np.ones(T, np.uint8), np.zeros(T, np.int16)))
    bad = moebench("recommend", "-m", meta.path, "--vram", f"{vram}B", "--trace", tmp_path / "other.npz")
    assert bad.returncode == 2 and "another model file" in bad.stderr and "Traceback" not in bad.stderr
