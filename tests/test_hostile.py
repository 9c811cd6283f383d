"""Hostile model files (issue 13): one sentence and exit 2, never a traceback, a hang or a terminal escape.

- the shared model checks (harness.run.checks): one test per rule, consistent files of every architecture
  pass, and a sweep refuses an inconsistent file before any cell (llama.cpp used to abort on it);
- headers that lie about sizes or lengths are refused at once (read_meta);
- a 4 MiB general.name holding terminal escapes: the sweep finishes and every output is bounded and clean;
- a seeded fuzz of mutated tiny files through `model info`, `plan` and `sweep` (quick slice here, a long
  one marked slow).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import time

import pytest

from engines.errors import UserError
from engines.gguf_meta import TEXT_LIMIT, ModelMeta, TensorEntry, clean_text, read_meta
from harness.run.checks import check_model, model_problems
from tests.conftest import FAULTS, ROOT, moebench
from tests.hostile_gguf import BIG, ESC, rewrite

# what must never reach a terminal or a file: C0 controls but tab and newline, DEL, C1, bidi overrides
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
A = "qwen3moe"


@pytest.fixture(scope="module")
def meta(tiny) -> ModelMeta:
    return read_meta(tiny)


def variant(meta: ModelMeta, drop: tuple[str, ...] = (), tensors: list[TensorEntry] | None = None,
            **fields) -> ModelMeta:
    """meta with arch-relative keys set (`expert_used_count=0`; `__` for `.`) or dropped, or other tensors."""
    f = {k: v for k, v in meta.fields.items() if k.removeprefix(f"{meta.arch}.") not in drop}
    f |= {f"{meta.arch}.{k.replace('__', '.')}": v for k, v in fields.items()}
    return dataclasses.replace(meta, fields=f, tensors=meta.tensors if tensors is None else tensors)


def retensor(meta: ModelMeta, name: str, **change) -> list[TensorEntry]:
    return [dataclasses.replace(t, **change) if t.name == name else t for t in meta.tensors]


# --- the shared model checks, one rule each ----------------------------------------------------------------

RULES = {   # label: (changes to the tiny model, words the first problem must contain)
    "block_count 0": (dict(block_count=0), "block_count = 0"),
    "block_count over llama.cpp's 512": (dict(block_count=600), "block_count = 600"),
    "embedding_length missing": (dict(drop=("embedding_length",)), "embedding_length is missing"),
    "expert_count over 1024": (dict(expert_count=2000), "expert_count = 2000"),
    "expert_used_count missing": (dict(drop=("expert_used_count",)), "expert_used_count is missing"),
    "expert_used_count 0": (dict(expert_used_count=0), "expert_used_count = 0"),
    "expert_used_count above expert_count": (dict(expert_used_count=9), "expert_used_count 9 must be 1..8"),
    "per-layer expert_used_count of the wrong length": (dict(expert_used_count=[2, 2]), "4 whole numbers"),
    "per-layer expert_used_count above expert_count": (dict(expert_used_count=[2, 2, 9, 2]), "9 must be 1..8"),
    "expert groups that do not divide": (dict(expert_group_count=3, expert_group_used_count=1),
                                         "expert_group_count 3"),
    "head_count 0": (dict(attention__head_count=0), "head_count = 0"),
    "no layer with heads": (dict(attention__head_count=[0, 0, 0, 0]), "no layer with attention heads"),
    "head_count_kv 0": (dict(attention__head_count_kv=0), "head_count_kv = 0"),
    "heads not divisible": (dict(attention__head_count_kv=3), "head_count 4 is not a multiple of head_count_kv 3"),
    "heads not divisible in one layer": (dict(attention__head_count_kv=[2, 2, 3, 2]), "(layer 2)"),
    "negative rms epsilon": (dict(attention__layer_norm_rms_epsilon=-1.0), "layer_norm_rms_epsilon = -1.0"),
    "nan rms epsilon": (dict(attention__layer_norm_rms_epsilon=math.nan), "= nan must be a finite number"),
    "infinite norm epsilon": (dict(attention__layer_norm_epsilon=math.inf), "layer_norm_epsilon = inf"),
    "rope base 0": (dict(rope__freq_base=0.0), "rope.freq_base = 0.0"),
    "negative swa rope base": (dict(rope__freq_base_swa=-1.0), "rope.freq_base_swa = -1.0"),
    "embedding_length not the embedding's width": (dict(embedding_length=64), "token_embd.weight is 128 wide"),
}


@pytest.mark.parametrize("label", RULES)
def test_each_shared_check_names_the_problem_in_one_sentence(meta, label):
    changes, words = RULES[label]
    bad = variant(meta, **changes)
    assert words in model_problems(bad)[0]
    with pytest.raises(UserError) as e:
        check_model(bad)
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value) and "re-create it" in str(e.value)


def test_tensor_shapes_must_agree_with_the_metadata(meta):
    gate = "blk.1.ffn_gate_exps.weight"
    t = next(t for t in meta.tensors if t.name == gate)
    few = variant(meta, tensors=retensor(meta, gate, ne=t.ne[:-1] + (7,)))
    assert model_problems(few) == [f"tensor {gate} holds 7 experts but expert_count is 8"]
    router = variant(meta, tensors=retensor(meta, "blk.0.ffn_gate_inp.weight", ne=(128, 6)))
    assert "blk.0.ffn_gate_inp.weight holds 6 experts" in model_problems(router)[0]
    stray = variant(meta, tensors=meta.tensors + [dataclasses.replace(meta.tensors[1], name="blk.9.attn_q.weight")])
    assert "belongs to block 9, beyond block_count 4" in model_problems(stray)[0]
    bad_arch = dataclasses.replace(meta, arch="x y\x1b")
    assert "is not an architecture name" in model_problems(bad_arch)[0]


def test_consistent_files_of_every_architecture_pass(meta):
    """Headers as llama.cpp's supported MoE architectures write them (hyperparameters from real headers:
    llama.cpp's ggml-vocab-gemma-4.gguf, and gpt-oss, qwen35moe, deepseek4 conversions): optional keys absent,
    per-layer head_count_kv arrays, one kv head, Gated-DeltaNet layers, expert biases and scales."""
    assert model_problems(meta) == []

    def arch(name, n_layers, n_embd, n_expert, fields, extra_tensors=()):
        t = [TensorEntry("token_embd.weight", (n_embd, 1000), "F16", 1, 0, None)]
        for i in range(n_layers):
            t += [TensorEntry(f"blk.{i}.ffn_gate_inp.weight", (n_embd, n_expert), "F32", 1, 0, None),
                  TensorEntry(f"blk.{i}.ffn_gate_exps.weight", (n_embd, 64, n_expert), "Q4_K", 1, 0, i),
                  TensorEntry(f"blk.{i}.ffn_down_exps.weight", (64, n_embd, n_expert), "Q4_K", 1, 0, i)]
            t += [TensorEntry(x.format(i=i), ne, "F32", 1, 0, i if "_exps" in x else None) for x, ne in extra_tensors]
        f = {f"{name}.{k}": v for k, v in fields.items()} | {f"{name}.block_count": n_layers,
                                                              f"{name}.embedding_length": n_embd,
                                                              f"{name}.expert_count": n_expert}
        return dataclasses.replace(meta, arch=name, n_layers=n_layers, n_expert=n_expert, fields=f, tensors=t,
                                   moe_layers=list(range(n_layers)))

    gemma4 = arch("gemma4", 30, 2816, 128, {
        "attention.head_count": 16, "attention.head_count_kv": [8, 8, 8, 8, 8, 2] * 5, "expert_used_count": 8,
        "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4, "attention.layer_norm_rms_epsilon": 1e-6},
        [("blk.{i}.ffn_gate_inp.scale", (2816,))])
    gpt_oss = arch("gpt-oss", 24, 2880, 32, {
        "attention.head_count": 64, "attention.head_count_kv": 8, "expert_used_count": 4, "rope.freq_base": 150000.0,
        "attention.layer_norm_rms_epsilon": 1e-5},
        [("blk.{i}.ffn_gate_exps.bias", (64, 32)), ("blk.{i}.ffn_down_exps.bias", (2880, 32)),
         ("blk.{i}.ffn_gate_inp.bias", (32,))])
    qwen35moe = arch("qwen35moe", 40, 2048, 256, {
        "attention.head_count": 16, "attention.head_count_kv": 2, "expert_used_count": 8, "rope.freq_base": 1e7,
        "attention.layer_norm_rms_epsilon": 1e-6, "full_attention_interval": 4, "ssm.inner_size": 4096},
        [("blk.{i}.ssm_a", (32,)), ("blk.{i}.ffn_gate_inp_shexp.weight", (2048,))])
    deepseek4 = arch("deepseek4", 43, 4096, 256, {
        "attention.head_count": 64, "attention.head_count_kv": 1, "expert_used_count": 6, "rope.freq_base": 1e4,
        "attention.layer_norm_rms_epsilon": 1e-6, "attention.compress_ratios": [0, 0] + [4, 128] * 20 + [4]},
        [("blk.{i}.ffn_up_exps.scale", (256,))])
    no_attention_keys = arch("nomic-bert-moe", 12, 768, 8, {"expert_used_count": 2, "attention.layer_norm_epsilon":
                                                            1e-5})
    for m in (gemma4, gpt_oss, qwen35moe, deepseek4, no_attention_keys):
        assert model_problems(m) == [], m.arch


@pytest.mark.parametrize("key,value,words", [
    ("expert_used_count", 0, "expert_used_count = 0 must be"),
    ("expert_used_count", 99, "expert_used_count 99 must be 1..8"),
    ("attention.layer_norm_rms_epsilon", -1.0, "layer_norm_rms_epsilon = -1.0 must be a finite number > 0"),
])
def test_sweep_refuses_an_inconsistent_file_before_any_cell(tiny, tmp_path, key, value, words):
    """llama.cpp aborted on these (SIGABRT rows with a C backtrace); now the harness says one sentence."""
    bad = rewrite(tiny, tmp_path / "bad.gguf", {f"{A}.{key}": value})
    r = moebench("sweep", "-m", bad, "-e", "llama-cpp", "-w", "pp8", "-r", "1", "--sample-ms", "0",
                 "--results-dir", tmp_path / "res", timeout=120)
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert words in errors[0] and "bad.gguf" in errors[0] and "inconsistent" in errors[0]
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())     # no cell ran


def test_model_info_shows_an_inconsistent_file_with_a_warning(tiny, tmp_path):
    bad = rewrite(tiny, tmp_path / "bad.gguf", {f"{A}.expert_used_count": 0})
    r = moebench("model", "info", bad, "--format", "csv")
    assert r.returncode == 0 and "warning: metadata qwen3moe.expert_used_count = 0" in r.stderr


# --- headers that lie -------------------------------------------------------------------------------------

def test_counts_and_sizes_that_claim_more_than_the_file_holds_are_refused_at_once(tiny, tmp_path):
    """An array length of 2**60 made the gguf reader loop (a hang); two tensors sharing bytes were accepted; a
    string where a count belongs reached plan's int() (a traceback)."""
    src = rewrite(tiny, tmp_path / "arr.gguf", {"test.array": [7, 7, 7]})
    raw = bytearray(src.read_bytes())
    at = raw.index(b"test.array") + len(b"test.array") + 4 + 4       # key, value type, element type: the length
    assert int.from_bytes(raw[at:at + 8], "little") == 3
    raw[at:at + 8] = (1 << 60).to_bytes(8, "little")
    (tmp_path / "long.gguf").write_bytes(raw)
    started = time.perf_counter()
    r = moebench("model", "info", tmp_path / "long.gguf", timeout=60)
    assert r.returncode == 2 and "runs past the end of the file" in r.stderr and time.perf_counter() - started < 30

    raw = bytearray(tiny.read_bytes())
    q, k = (offset_field(raw, f"blk.0.attn_{x}.weight") for x in "qk")
    raw[k:k + 8] = raw[q:q + 8]                        # attn_k's data starts where attn_q's does
    (tmp_path / "overlap.gguf").write_bytes(raw)
    r = moebench("model", "info", tmp_path / "overlap.gguf")
    assert r.returncode == 2 and "'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' overlap" in r.stderr, r.stderr

    rewrite(tiny, tmp_path / "str.gguf", {f"{A}.attention.head_count": "many"})
    r = moebench("plan", "-m", tmp_path / "str.gguf", "--no-calibrate")
    assert r.returncode == 2 and "head_count = 'many' is not a whole number" in r.stderr and "Traceback" not in r.stderr


def test_byte_sizes_follow_the_type_and_shape(tmp_path):
    """A quantized tensor is whole blocks of its type (GGML_TYPES: values and bytes per block) and lies inside
    the file; read_meta computes its bytes from the shape, so a header that lies is refused before any engine
    allocates for it."""
    from workloads.synth import synthesize
    q8 = synthesize("tiny", tmp_path / "q8.gguf", dtype="q8_0")
    t = next(t for t in read_meta(q8).tensors if t.name == "blk.0.attn_q.weight")
    assert t.ggml_type == "Q8_0" and t.n_bytes == t.ne[0] * t.ne[1] // 32 * 34
    raw = bytearray(q8.read_bytes())
    dims = raw.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight") + 4
    for ne in ((112, t.ne[1]), (t.ne[0], 1 << 20)):      # rows not whole blocks of 32; 140 MB in a 1.4 MB file
        bad = bytearray(raw)
        bad[dims:dims + 16] = ne[0].to_bytes(8, "little") + ne[1].to_bytes(8, "little")
        (tmp_path / "bad.gguf").write_bytes(bad)
        with pytest.raises(UserError, match="is not a valid GGUF file"):    # the gguf reader's words, or ours
            read_meta(tmp_path / "bad.gguf")


def offset_field(raw: bytes, name: str) -> int:
    """Where a tensor's data offset is written in the header: after its name, dimensions and type."""
    at = raw.index(name.encode()) + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    return at + 4 + 8 * n_dims + 4


# --- hostile strings --------------------------------------------------------------------------------------

def clean_and_bounded(text: str, limit: int, what: str) -> None:
    bad = CONTROL.search(text)
    assert bad is None, f"{what}: control character {bad.group()!r} at {bad.start()}: {text[bad.start() - 40:][:80]!r}"
    assert len(text) <= limit, f"{what}: {len(text)} characters"
    assert "x" * (TEXT_LIMIT + 1) not in text, f"{what}: the 4 MiB name was not cut"


def test_clean_text():
    assert clean_text("a\x1b[31mb\x9bc\u202ed\r\ne\tf") == "a[31mbcd  e f"
    assert clean_text("l1\nl2\r\n\tx", lines=True) == "l1\nl2\n\tx"
    assert clean_text("y" * 1000) == "y" * (TEXT_LIMIT - 1) + "…"
    assert clean_text(ESC * 1000, None) == clean_text(ESC, None) * 1000


def test_a_4mib_name_with_terminal_escapes_never_reaches_an_output(tiny, tmp_path):
    """The name's sweep used to end in `_csv.Error: field larger than field limit` and `model info` printed
    the escapes raw. Now every output is bounded and clean, and Python's csv module reads cells.csv with its
    default field limit."""
    bad = rewrite(tiny, tmp_path / "bad.gguf", {"general.name": "x" * BIG + ESC, "general.description": ESC})
    res = tmp_path / "res"
    r = moebench("sweep", "-m", bad, "-e", "stamp", "-w", "pp8", "-r", "1", "--sample-ms", "0", "--results-dir", res,
                 env={"MOEBENCH_STAMP_FILE": str(tmp_path / "stamps")}, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    clean_and_bounded(r.stdout + r.stderr, 20_000, "sweep table")
    run = res / next(p.name for p in res.iterdir() if p.is_dir())

    old = csv.field_size_limit(131072)              # the default, whatever read_csv set in this process
    try:
        with open(run / "cells.csv", newline="") as f:
            cells = list(csv.DictReader(f))
        with open(run / "measurements.csv", newline="") as f:
            names = [m["model_name"] for m in csv.DictReader(f)]
    finally:
        csv.field_size_limit(old)
    assert cells[0]["status"] == "ok" and len(names) == 1
    for name in [cells[0]["model_name"], *names]:
        assert name.startswith("xxxx") and name.endswith("…") and len(name) == TEXT_LIMIT
    clean_and_bounded((run / "cells.csv").read_text(), 20_000, "cells.csv")

    with sqlite3.connect(res / "history.sqlite") as con:
        (indexed,) = con.execute("SELECT model_name FROM cells").fetchone()
    assert indexed == cells[0]["model_name"]
    h = moebench("history", "--results-dir", res, "-o", tmp_path / "h.png")
    assert h.returncode == 0, h.stderr
    clean_and_bounded(h.stdout + h.stderr, 20_000, "history")

    rep = moebench("report", run, "-o", tmp_path / "rep", "--engine", "stamp", "--baseline", "stamp")
    assert rep.returncode == 0, rep.stderr[-3000:]
    clean_and_bounded(rep.stdout + rep.stderr, 50_000, "report tables")
    clean_and_bounded((tmp_path / "rep" / "report.md").read_text(), 200_000, "report.md")
    html = (tmp_path / "rep" / "report.html").read_text()
    clean_and_bounded(re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html), 200_000, "report.html")

    for args in (["model", "info", bad], ["plan", "-m", bad, "--no-calibrate"]):
        out = moebench(*args)
        assert out.returncode == 0, out.stderr
        clean_and_bounded(out.stdout + out.stderr, 20_000, " ".join(map(str, args[:2])))


@pytest.mark.slow
def test_a_llama_cpp_cell_of_a_4mib_name_finishes(tiny, tmp_path):
    bad = rewrite(tiny, tmp_path / "bad.gguf", {"general.name": "x" * BIG + ESC})
    r = moebench("sweep", "-m", bad, "-e", "llama-cpp", "-w", "pp8", "-r", "1", "--threads", "2", "--sample-ms", "0",
                 "--timeout", "30", "--results-dir", tmp_path / "res", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    clean_and_bounded(r.stdout + r.stderr, 20_000, "llama-cpp sweep")
    assert "| ok" in r.stdout or ",ok," in r.stdout or " ok " in r.stdout, r.stdout[-2000:]


# --- the fuzz ---------------------------------------------------------------------------------------------

KNOWN = re.compile(r"^attention\.head_count(_kv)?=\[")     # see test_plan_with_per_layer_head_counts


def fuzz(tiny, tmp_path, seed: int, count: int, timeout: float) -> list[dict]:
    """The driver in tests/hostile_gguf.py, in a subprocess (a hang is a timeout, named by the last record)."""
    cmd = [sys.executable, "-m", "tests.hostile_gguf", str(tiny), str(seed), str(count), str(tmp_path / "fz")]
    env = {k: v for k, v in os.environ.items() if k != "FAULT"} | {
        "MOEBENCH_ENGINES": FAULTS, "PYTHONPATH": str(ROOT), "MOEBENCH_STAMP_FILE": str(tmp_path / "stamps")}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        last = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-1:] or ["(none)"]
        pytest.fail(f"fuzz seed {seed} ran past {timeout} s; last record: {last[0][:500]}")
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines()]


def check_records(records: list[dict]) -> None:
    for i in range(0, len(records), 3):             # per mutant: info, plan, sweep
        info, plan, sweep = records[i:i + 3]
        mutant = info["mutant"]
        for r in (info, plan, sweep):
            what = f"{mutant}: {r['args'][0]}"
            if r["args"] == ["plan"] and KNOWN.match(mutant):
                continue
            assert r["traceback"] == "", f"{what}\n{r['traceback'][-2000:]}"
            assert r["exit"] in (0, 2) and r["seconds"] < 20, (what, r["exit"], r["seconds"])
            errors = [x for x in r["stderr"].splitlines() if x.startswith("error:")]
            assert len(errors) == (r["exit"] == 2), (what, r["stderr"][-1000:])
            clean_and_bounded(r["stdout"] + r["stderr"], 200_000, what)     # 512 layers: 30 kB
        # the sweep's verdict agrees with info's: the same read error, the shared checks, or (a consistent file)
        # the depth no file has, which stops it after the checks and before any cell
        assert sweep["exit"] == 2, mutant
        said = sweep["stderr"].strip().splitlines()[-1]
        if info["exit"] == 2:
            assert said == info["stderr"].strip().splitlines()[-1], mutant
        elif "warning:" in info["stderr"]:
            assert "inconsistent" in said, (mutant, said)
        else:
            assert "--n-cpu-moe 65536 is larger" in said, (mutant, said)


def test_fuzz_quick(tiny, tmp_path):
    """40 mutants (8 of each kind) x 3 commands in one process: about 3 s."""
    records = fuzz(tiny, tmp_path, seed=0, count=40, timeout=120)
    assert len(records) == 120
    check_records(records)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_fuzz_long(tiny, tmp_path, seed):
    """5 x 600 mutants (9000 commands): about 2 minutes."""
    check_records(fuzz(tiny, tmp_path, seed=seed, count=600, timeout=900))


def test_plan_with_per_layer_head_counts(tiny, tmp_path):
    ok = rewrite(tiny, tmp_path / "kv.gguf", {f"{A}.attention.head_count_kv": [2, 1, 2, 1]})
    assert model_problems(read_meta(ok)) == []
    r = moebench("plan", "-m", ok, "--no-calibrate")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
