"""Routing traces (engines.routing): the file format and its checks, what the reference engine records per forward
pass and MoE layer, and `moebench sweep --trace-routing` (one file per reference cell, a note for other engines)."""
import csv
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from engines.base import EngineSettings
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.reference.engine import ReferenceEngine
from engines.routing import FORMAT, Trace, load_trace, save_trace, token_hash
from tests import conftest
from workloads.grammar import parse_workload
from workloads.tokens import workload_tokens

PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 1024, 37)]


def synthetic(T: int = 40, L: int = 3, k: int = 2, E: int = 8, seed: int = 0) -> Trace:
    """A trace of two segments: a prefill of T - 4 rows in ubatches of 16, then 4 decodes."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T * L)]).reshape(T, L, k).astype(np.int16)
    w = np.sort(rng.random((T, L, k)), axis=-1)[..., ::-1].astype(np.float16)
    n_pre = T - 4
    step = np.r_[np.arange(n_pre) // 16, (n_pre + 15) // 16 + np.arange(4)].astype(np.int32)
    header = {"format": FORMAT, "model": "m", "fingerprint": "0123", "arch": "qwen3moe", "n_layers": L,
              "moe_layers": list(range(L)), "n_expert": E, "k": k, "expert_bytes": [1000] * L, "n_cpu_moe": L,
              "n_ubatch": 16, "segments": ["pp36", "tg4"], "streams": ["random", "random"],
              "token_hash": [token_hash([1, 2]), token_hash([3])]}
    decode = np.r_[np.zeros(n_pre), np.ones(4)]
    return Trace(header, ids, w, np.r_[np.arange(n_pre), np.arange(4)].astype(np.int32), step,
                 decode.astype(np.uint8), decode.astype(np.int16))


def test_save_load_round_trip_and_helpers(tmp_path):
    tr = synthetic()
    save_trace(tmp_path / "t.npz", tr)
    back = load_trace(tmp_path / "t.npz")
    assert back.header == tr.header
    for name in ("ids", "weights", "pos", "step", "phase", "segment"):
        a, b = getattr(back, name), getattr(tr, name)
        assert np.array_equal(a, b) and a.dtype == b.dtype
    assert (back.n_layers_moe, back.n_expert, back.k, back.expert_bytes) == (3, 8, 2, [1000] * 3)
    steps = list(back.steps())
    assert [s for s, _, _ in steps] == [0, 1, 2, 3, 4, 5, 6]
    assert [r.stop - r.start for _, _, r in steps] == [16, 16, 4, 1, 1, 1, 1]
    assert [p for _, p, _ in back.steps(phase="decode")] == [1] * 4
    assert len(list(back.steps(segment="pp36"))) == 3
    dec = back.select(segment="tg4")
    assert len(dec) == 4 and dec.header["segments"] == ["pp36", "tg4"] and set(dec.segment) == {1}
    experts, counts = back.request(steps[0][2], 1)
    assert experts == sorted(experts) and sum(counts) == 16 * 2
    assert np.array_equal(np.repeat(experts, counts), np.sort(tr.ids[:16, 1].ravel()))
    with pytest.raises(UserError, match="no segment 'pp9'"):
        back.select(segment="pp9")


def _write(path: Path, arrays: dict) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _arrays(tr: Trace) -> dict:
    return {"header": np.array(json.dumps(tr.header))} | {k: getattr(tr, k) for k in
                                                          ("ids", "weights", "pos", "step", "phase", "segment")}


def _huge_member(path: Path) -> None:
    """A trace whose ids.npy header declares 2**40 rows over a few bytes of data (must fail before allocating)."""
    with zipfile.ZipFile(path, "w") as z:
        for name, a in _arrays(synthetic()).items():
            buf = io.BytesIO()
            if name == "ids":
                np.lib.format.write_array_header_1_0(buf, {"descr": "<i2", "fortran_order": False,
                                                           "shape": (1 << 40, 3, 2)})
                buf.write(b"\0" * 64)
            else:
                np.lib.format.write_array(buf, a)
            z.writestr(f"{name}.npy", buf.getvalue())


BAD = {
    "not a zip": lambda p: p.write_bytes(b"hello"),
    "format": lambda p: _write(p, _arrays(synthetic()) | {"header": np.array(json.dumps({"format": "x/9"}))}),
    "outside 0..7": lambda p: _write(p, _arrays(synthetic()) | {"ids": np.full((40, 3, 2), 8, np.int16)}),
    "weights is": lambda p: _write(p, _arrays(synthetic()) | {"weights": np.zeros((40, 3, 3), np.float16)}),
    "ids is int32": lambda p: _write(p, _arrays(synthetic()) | {"ids": np.zeros((40, 3, 2), np.int32)}),
    "no phase array": lambda p: _write(p, {k: v for k, v in _arrays(synthetic()).items() if k != "phase"}),
    "'k' is missing": lambda p: _write(p, _arrays(synthetic()) | {"header": np.array(json.dumps(
        {k: v for k, v in synthetic().header.items() if k != "k"}))}),
    "too large": _huge_member,
}


@pytest.mark.parametrize("why", list(BAD))
def test_load_rejects_bad_files_in_one_sentence(tmp_path, why):
    path = tmp_path / "bad.npz"
    BAD[why](path)
    with pytest.raises(UserError, match="not a usable routing trace") as e:
        load_trace(path)
    assert why.split()[0] in str(e.value) or why == "not a zip"


def run_engine(path: Path, depth: int, trace: Path | None, **extra) -> ReferenceEngine:
    """pp37 (ubatches 16, 16, 5) then tg3 after it, as the worker drives an engine: one segment each."""
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=64, n_ubatch=16, threads=2, device="cpu",
                                extra=({"trace_routing": str(trace)} if trace else {}) | extra))
    e.trace_segment("pp37", PROMPT)
    e.reset()
    e.prefill(PROMPT)
    e.trace_segment(None)
    e.reset()                                     # a second run of the workload: not recorded
    e.prefill(PROMPT)
    e.trace_segment("tg3@d5", PROMPT[:8], "correlated")
    e.reset()
    e.prefill(PROMPT[:5])
    for t in PROMPT[5:8]:
        e.decode(t)
    e.trace_segment(None)
    return e


def test_engine_records_each_pass_and_layer(tiny, tmp_path):
    e = run_engine(tiny, 4, tmp_path / "t.npz")
    info = e.info()
    e.close()
    tr = load_trace(tmp_path / "t.npz")
    h = tr.header
    assert (h["n_layers"], h["moe_layers"], h["n_expert"], h["k"], h["n_cpu_moe"], h["n_ubatch"]) == \
        (4, [0, 1, 2, 3], 8, 2, 4, 16)
    meta = read_meta(tiny)            # the file's expert tensors (gate, up, down as stored) per layer, per expert
    assert h["expert_bytes"] == [sum(t.n_bytes for t in meta.tensors if t.layer == il) // 8 for il in range(4)]
    assert h["expert_bytes"][0] == 3 * 64 * 128 * 4                 # f32, ff 64, D 128
    assert h["fingerprint"] == meta.fingerprint and h["arch"] == "qwen3moe"
    assert info.settings["extra"]["trace_routing"] == str(tmp_path / "t.npz")
    assert h["segments"] == ["pp37", "tg3@d5"] and h["streams"] == ["random", "correlated"]
    assert h["token_hash"] == [token_hash(PROMPT), token_hash(PROMPT[:8])]
    assert len(tr) == 37 + 5 + 3
    assert tr.pos.tolist() == list(range(37)) + list(range(8))
    assert tr.phase.tolist() == [0] * 42 + [1] * 3 and tr.segment.tolist() == [0] * 37 + [1] * 8
    assert [r.stop - r.start for _, _, r in tr.steps()] == [16, 16, 5, 5, 1, 1, 1]
    assert tr.step.tolist() == sorted(tr.step.tolist()) and len(set(tr.step.tolist())) == 7
    # the router's top-k: distinct experts, weights in rank order (softmax then top-k: descending)
    assert all(len(set(r)) == 2 for r in tr.ids.reshape(-1, 2).tolist())
    assert np.all(tr.weights[..., 0] >= tr.weights[..., 1]) and np.all(tr.weights > 0)
    # routing does not depend on where the experts live; the same tokens route the same in every segment
    e = run_engine(tiny, 0, tmp_path / "d0.npz")
    e.close()
    d0 = load_trace(tmp_path / "d0.npz")
    assert np.array_equal(d0.ids, tr.ids) and d0.header["n_cpu_moe"] == 0
    assert np.array_equal(tr.ids[37:42], tr.ids[:5])


def test_no_recorder_without_the_setting(tiny, tmp_path):
    e = run_engine(tiny, 4, None)
    assert e.moe.recorder is None and "trace_routing" not in e.info().settings["extra"]
    e.close()
    assert not list(tmp_path.iterdir())


def test_trace_size_of_a_pp8192_cell_of_48_layers_top8(tmp_path):
    """Uniform routing (the least compressible) of 8192 tokens x 48 layers x top-8 of 128 experts: a few MB."""
    rng = np.random.default_rng(0)
    T, L, k, E = 8192, 48, 8, 128
    logits = rng.standard_normal((T, L, E)).astype(np.float32)
    ids = np.argsort(-logits, axis=-1)[..., :k]
    w = np.exp(np.take_along_axis(logits, ids, -1))
    tr = synthetic()
    tr.header |= {"moe_layers": list(range(L)), "n_layers": L, "n_expert": E, "k": k, "expert_bytes": [1] * L,
                  "segments": ["pp8192"], "streams": ["random"], "token_hash": ["-"]}
    tr = Trace(tr.header, ids.astype(np.int16), (w / w.sum(-1, keepdims=True)).astype(np.float16),
               np.arange(T, dtype=np.int32), (np.arange(T) // 512).astype(np.int32), np.zeros(T, np.uint8),
               np.zeros(T, np.int16))
    save_trace(tmp_path / "big.npz", tr)
    assert os.path.getsize(tmp_path / "big.npz") < 9 << 20
    assert load_trace(tmp_path / "big.npz").ids.shape == (T, L, k)


def test_sweep_writes_one_trace_per_reference_cell_and_notes_other_engines(tmp_path):
    stamps = tmp_path / "stamps.txt"
    r = conftest.moebench("sweep", "-m", "preset:tiny", "-e", "reference,stamp", "--n-cpu-moe", "all",
                          "-w", "pp24,tg4@d8+corr", "-r", "1", "--threads", "2", "--sample-ms", "0", "--trace-routing",
                          "--results-dir", tmp_path / "results", env={"MOEBENCH_STAMP_FILE": str(stamps)})
    assert r.returncode == 0, r.stderr
    assert "stamp cannot record routing traces" in r.stderr
    run = conftest.run_dir_of(r)
    cells = _cells(run)
    assert [(c["engine"], c["status"], c["error"][:300]) for c in cells] == [("reference", "ok", ""),
                                                                              ("stamp", "ok", "")]
    files = sorted((run / "traces").iterdir())
    assert len(files) == 1 and files[0].name.startswith("reference_") and files[0].suffix == ".npz"
    tr = load_trace(files[0])
    assert tr.header["segments"] == ["pp24", "tg4@d8+corr"] and tr.header["streams"] == ["random", "correlated"]
    n_vocab = 1024
    for i, name in enumerate(tr.header["segments"]):
        depth, timed = workload_tokens(parse_workload(name), n_vocab, 0, _cached_model(run))
        assert tr.header["token_hash"][i] == token_hash(depth + timed)
    assert len(tr) == 24 + 8 + 4 and tr.phase.tolist() == [0] * 32 + [1] * 4
    assert "stamp" in json.loads((run / "run.json").read_text())["notes"][-1]


def _cells(run: Path) -> list[dict]:
    with open(run / "cells.csv") as f:
        return sorted(csv.DictReader(f), key=lambda c: c["engine"])


def _cached_model(run: Path) -> str:
    return next(r["model"] for r in _cells(run) if r["engine"] == "reference")
