"""`moebench sweep --format json|jsonl|sql`: llama-bench's records (every field of its JSON, its SQL table) for a
real tiny sweep, checked against a copy of llama-bench's own field list. The real llama-bench and llama.cpp's
compare-llama-bench.py reading two runs are in tests/test_llama_bench.py (slow)."""
import json
import math
import shutil
import sqlite3
import subprocess

import pandas as pd
import pytest

from engines.gguf_meta import read_meta
from harness.analysis.tables import llama_bench_sql
from harness.cli.sweep import show_run
from harness.store.results import LLAMA_BENCH_FIELDS, llama_bench_settings

from .conftest import moebench, run_dir_of

# llama-bench's test::get_fields() and the sets of get_field_type(), copied from tools/llama-bench/llama-bench.cpp
# of the llama.cpp that llama-cpp-python 0.3.36 vendors (vendor/llama.cpp in its sdist); every other field is STRING
GET_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch",
    "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode",
    "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "load_mode", "lazy_mode",
    "embeddings",
    "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx",
    "n_prompt", "n_gen", "n_depth",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]
INT = {"build_number", "n_batch", "n_ubatch", "n_threads", "poll", "model_size", "model_n_params", "n_gpu_layers",
       "main_gpu", "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "no_op_offload", "n_cpu_moe", "fit_target",
       "fit_min_ctx", "flash_attn"}
BOOL = {"f16_kv", "no_kv_offload", "cpu_strict", "embeddings", "no_host", "repack"}
FLOAT = {"avg_ts", "stddev_ts"}
KIND = {f: int if f in INT else bool if f in BOOL else float if f in FLOAT else str for f in GET_FIELDS}
OURS = {"engine", "engine_version", "ggml_compiler"}     # our keys after llama-bench's (its tools drop them)


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """llama-cpp and an engine that is not llama.cpp (the `crash` test plugin, which runs while FAULT is unset),
    2 depths x 2 workloads: 8 records."""
    out = tmp_path_factory.mktemp("runs")
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp,crash", "--n-cpu-moe", "0,all", "-w", "pp16,tg4@d8", "-r", "2",
                 "--rounds", "1", "--threads", "2", "--sample-ms", "0", "--results-dir", out)
    assert r.returncode == 0, r.stderr
    return run_dir_of(r)


def output(run, fmt, tmp_path) -> str:
    show_run(run, fmt, str(tmp_path / f"out.{fmt}"))      # what `moebench sweep --format FMT -o FILE` writes
    return (tmp_path / f"out.{fmt}").read_text()


def test_the_field_list_is_llama_benchs():
    assert list(LLAMA_BENCH_FIELDS) == GET_FIELDS and LLAMA_BENCH_FIELDS == KIND


def test_json_has_every_llama_bench_field_with_its_type(run, tiny, tmp_path):
    recs = json.loads(output(run, "json", tmp_path))
    assert len(recs) == 8
    for rec in recs:
        assert list(rec)[:len(GET_FIELDS) + 2] == GET_FIELDS + ["samples_ns", "samples_ts"]
        assert set(rec) - set(GET_FIELDS) - {"samples_ns", "samples_ts"} <= OURS
        for f in GET_FIELDS:
            assert type(rec[f]) is KIND[f], (f, rec[f])
        assert rec["build_commit"] == run.name and rec["n_threads"] == 2 and rec["test_time"].endswith("Z")
        assert len(rec["samples_ns"]) == 2 and rec["avg_ns"] == int(sum(rec["samples_ns"]) / 2)
    meta = read_meta(tiny)
    assert {(r["model_size"], r["model_n_params"]) for r in recs} == {
        (sum(t.n_bytes for t in meta.tensors), sum(math.prod(t.ne) for t in meta.tensors))}
    by = {(r["backends"], r["n_cpu_moe"], r["n_prompt"], r["n_gen"], r["n_depth"]) for r in recs}
    assert by == {(b, n, *t) for b in ("llama-cpp: CPU", "crash: AUTO") for n in (0, 4)
                  for t in ((16, 0, 0), (0, 4, 8))}
    cpp = next(r for r in recs if r["engine"] == "llama-cpp")
    assert (cpp["n_gpu_layers"], cpp["poll"], cpp["type_k"], cpp["split_mode"], cpp["repack"], cpp["load_mode"],
            cpp["flash_attn"]) == (-1, 50, "f16", "layer", True, "mmap", -1)
    other = next(r for r in recs if r["engine"] == "crash")       # not llama.cpp: says so where a field can't mean
    assert (other["poll"], other["type_k"], other["split_mode"], other["repack"]) == (-1, "n/a", "n/a", False)


def test_jsonl_is_the_json_records_one_a_line(run, tmp_path):
    lines = output(run, "jsonl", tmp_path).splitlines()
    assert [json.loads(line) for line in lines] == json.loads(output(run, "json", tmp_path))


def test_sql_pipes_into_sqlite_like_llama_benchs(run, tmp_path):
    text = output(run, "sql", tmp_path)
    assert text.startswith("CREATE TABLE IF NOT EXISTS llama_bench (\n") and text.count("INSERT INTO llama_bench") == 8
    db = sqlite3.connect(":memory:")
    db.executescript(text)
    db.executescript(text)                  # a second run into the same database, as `llama-bench -o sql | sqlite3`
    assert [(c[1], c[2]) for c in db.execute("PRAGMA table_info(llama_bench)")] == [
        (f, "TEXT" if k is str else "REAL" if k is float else "INTEGER") for f, k in KIND.items()]
    rows = db.execute("SELECT backends, n_cpu_moe, n_prompt, n_gen, repack, avg_ts FROM llama_bench").fetchall()
    assert len(rows) == 16 and {r[0] for r in rows} == {"llama-cpp: CPU", "crash: AUTO"}
    assert all(r[4] in (0, 1) and r[5] > 0 for r in rows)
    if shutil.which("sqlite3"):             # the CLI, as llama-bench's docs pipe it
        subprocess.run(["sqlite3", str(tmp_path / "lb.sqlite")], input=text, text=True, check=True)
        count = subprocess.run(["sqlite3", str(tmp_path / "lb.sqlite"), "SELECT COUNT(*) FROM llama_bench"],
                               capture_output=True, text=True, check=True).stdout
        assert count.strip() == "8"


def test_sql_text_is_quoted_and_clean(run, tmp_path):
    """Names come from GGUF files: a quote stays data, control characters go."""
    rec = json.loads(output(run, "json", tmp_path))[0]
    hostile = "x'); DROP TABLE llama_bench; --\x1b[31m\x00\nname"
    db = sqlite3.connect(":memory:")
    db.executescript(llama_bench_sql([rec | {"model_type": hostile}, rec]))
    assert [r[0] for r in db.execute("SELECT model_type FROM llama_bench")] == [
        "x'); DROP TABLE llama_bench; --[31m name", rec["model_type"]]


def test_the_reference_engine_says_what_its_kv_cache_holds():
    run = {"host": {"cpu": "some CPU", "gpus": [{"name": "GPU A"}, {"name": "GPU B"}]}}
    cell = {"engine": "reference", "label": "reference", "model": "m.gguf", "arch": "qwen3moe", "model_name": "m",
            "n_batch": 2048, "n_ubatch": 512, "threads": 2, "n_cpu_moe": 1, "flash_attn": "auto", "mmap": True,
            "device": "auto", "node": float("nan")}
    eff = {"device": "cpu", "dtype": "f32", "mmap": True}
    cpu = llama_bench_settings(run, pd.Series(cell | {"effective_settings": json.dumps(eff),
                                                       "extra": json.dumps({"cache_type": "f32"})}))
    cuda = llama_bench_settings(run, pd.Series(cell | {"effective_settings": json.dumps(eff | {"device": "cuda",
                                                                                               "dtype": "bf16"}),
                                                        "extra": "{}"}))
    default = llama_bench_settings(run, pd.Series(cell | {"effective_settings": json.dumps(eff), "extra": "{}"}))
    assert [(s["type_k"], s["type_v"]) for s in (cpu, cuda, default)] == [("f32", "f32"), ("bf16", "bf16"),
                                                                          ("f16", "f16")]
    assert (cpu["backends"], cuda["backends"], cpu["devices"]) == ("reference: CPU", "reference: CUDA", "cpu")
    assert (cpu["gpu_info"], cpu["repack"], cpu["n_gpu_layers"], cpu["cpu_info"]) == ("GPU A, GPU B", False, -1,
                                                                                      "some CPU")


def test_other_commands_write_jsonl_rows_and_refuse_sql():
    r = moebench("published", "--format", "jsonl")
    assert r.returncode == 0 and all(isinstance(json.loads(line), dict) for line in r.stdout.splitlines())
    r = moebench("published", "--format", "sql")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --format sql writes llama-bench's table, which only `moebench sweep` has; use jsonl, json or csv "
        "here."), r.stderr
