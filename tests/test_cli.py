"""The CLI through a subprocess: exit codes, one-sentence errors, output formats."""
import csv
import json

import pytest

from tests.conftest import moebench, run_dir_of


def one_sentence_error(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in line, line
    return line


@pytest.fixture(scope="module")
def not_moe(tmp_path_factory):
    import gguf
    import numpy as np
    p = tmp_path_factory.mktemp("dense") / "dense.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def test_bad_inputs_exit_2_with_one_sentence(tiny, tmp_path, not_moe):
    sweep = lambda *a, **kw: moebench("sweep", "-w", "pp8", "-r", "1", "--results-dir", tmp_path, *a, **kw)
    one_sentence_error(sweep("-m", tmp_path / "nope.gguf", "-e", "llama-cpp"), "does not exist", "nope.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    one_sentence_error(sweep("-m", tmp_path / "notes.txt", "-e", "llama-cpp"), "not a GGUF file")
    one_sentence_error(sweep("-m", not_moe, "-e", "llama-cpp"), "not a Mixture-of-Experts")
    one_sentence_error(sweep("-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "-1"), "not a layer count")
    one_sentence_error(sweep("-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "two"), "not a layer count")
    one_sentence_error(sweep("-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,9"), "model's 4 layers")
    one_sentence_error(sweep("-m", tiny, "-e", "vllm"), "Unknown engine 'vllm'", "llama-cpp", "reference")
    one_sentence_error(moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp8,bogus"), "Unknown workload 'bogus'")
    one_sentence_error(sweep("-m", tiny, "-e", "unavailable"), "not available here", "not installed")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_sentence_error(moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp8", "--results-dir", blocker / "sub"),
                       "Cannot write results", "--results-dir")
    one_sentence_error(moebench("sweep", "--resume", tmp_path), "not a moebench run directory")
    one_sentence_error(moebench("model", "synth", "--preset", "huge", "-o", tmp_path / "x.gguf"), "Unknown preset")
    assert not list(tmp_path.glob("*/cells.csv"))    # nothing ran


def test_engines_lists_availability():
    r = moebench("engines")
    assert r.returncode == 0
    line = next(x for x in r.stdout.splitlines() if "unavailable" in x)
    assert "no" in line
    assert any("llama-cpp" in x and "yes" in x for x in r.stdout.splitlines())


@pytest.mark.parametrize("fmt", ["md", "csv", "json"])
def test_output_formats(tiny, tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16,tg4", "-r", "2",
                 "--threads", "2", "--results-dir", tmp_path, "--format", fmt, "-o", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    if fmt == "json":   # llama-bench field names, one record per cell x workload
        recs = json.loads(text)
        assert len(recs) == 4
        for rec in recs:
            for k in ("n_prompt", "n_gen", "n_depth", "n_cpu_moe", "n_ubatch", "n_threads", "avg_ts", "stddev_ts",
                      "samples_ns", "samples_ts", "avg_ns", "model_filename"):
                assert k in rec
            assert len(rec["samples_ns"]) == 2 and rec["avg_ts"] > 0 and rec["n_threads"] == 2
        got = sorted((r["n_cpu_moe"], r["n_prompt"], r["n_gen"]) for r in recs)
        assert got == [(0, 0, 4), (0, 16, 0), (4, 0, 4), (4, 16, 0)]
    elif fmt == "csv":
        lines = text.strip().splitlines()
        assert lines[0].startswith("engine,n_cpu_moe,workload,status,tok/s median") and len(lines) == 5
    else:
        assert text.count("| llama-cpp |") == 4 and "tok/s median" in text


def test_a_sweep_whose_every_cell_failed_says_so_and_exits_1(tiny, tmp_path):
    """--strict or not; the rows are written first, and --resume (the fault gone) ends it with exit 0."""
    args = ["sweep", "-m", tiny, "-e", "crash", "--n-cpu-moe", "0,2", "-w", "pp8", "-r", "1", "--sample-ms", "0",
            "--results-dir", tmp_path]
    for strict in ([], ["--strict"]):
        r = moebench(*args, *strict, env={"FAULT": "crash"})
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        run = run_dir_of(r)
        said = [line for line in r.stderr.splitlines() if "every cell" in line]
        assert said == [f"error: every cell of this sweep failed (2 cells); see each cell's error in "
                        f"{run / 'cells.csv'}"], r.stderr
        assert [c["status"] for c in csv.DictReader((run / "cells.csv").open())] == ["failed", "failed"]
    r = moebench("sweep", "--resume", run)
    assert r.returncode == 0 and "every cell" not in r.stderr, r.stderr


def test_threads_0_and_sizes_without_a_unit_are_errors(tiny, tmp_path):
    """--threads 0 once meant all cores; a size without a unit (--vram 16) once meant bytes (or MiB in `cache`)."""
    sweep = lambda *a: moebench("sweep", "-m", tiny, "-w", "pp8", "-r", "1", "--results-dir", tmp_path, *a)
    one_sentence_error(sweep("-e", "llama-cpp", "--threads", "0"), "--threads 0 must be at least 1; leave --threads")
    one_sentence_error(sweep("-e", "reference", "--cpu-moe-threads", "0"), "--cpu-moe-threads 0 must be at least 1")
    one_sentence_error(moebench("recommend", "-m", tiny, "--vram", "16", "--ram", "64GiB"),
                       "--vram 16 has no unit; write 16GiB, 16GB or 16384MiB")
    one_sentence_error(moebench("recommend", "-m", tiny, "--vram", "16GiB", "--ram", "64"),
                       "--ram 64 has no unit; write 64GiB, 64GB or 65536MiB")
    one_sentence_error(moebench("cache", tmp_path, "--vram", "256MiB,1024"), "--vram 1024 has no unit")
    assert not list(tmp_path.glob("*/cells.csv"))    # nothing ran
