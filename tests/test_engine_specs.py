"""Engine specs in a sweep (`-e NAME@KEY=VALUE`, `llama-bench@bin=PATH`) and the layers each engine reports it kept in
host memory (cells.csv cpu_moe_layers, compared beside every ratio)."""
import csv
import os
import stat

import pytest

from engines.errors import UserError
from harness.run.spec import SweepSpec, expand
from harness.store.results import layer_text, layers_compared
from tests.conftest import moebench, run_dir_of


def test_layer_text_and_comparison():
    assert layer_text(None) == "" and layer_text([]) == "none"
    assert layer_text([3, 0, 1, 2]) == "0-3" and layer_text([0, 1, 5, 7, 8]) == "0-1,5,7-8" and layer_text([4]) == "4"
    assert layers_compared("0-3", "0-3") == "same (0-3)"
    assert layers_compared("0-3", "28-31") == "differ: A kept 0-3, B kept 28-31"
    assert layers_compared("0-3", float("nan")) == "" and layers_compared("", "0-3") == ""


def cells_of(tiny, *engines, **kw):
    return expand(SweepSpec(models=[str(tiny)], engines=list(engines), depths=["2"], workloads=["tg4"], **kw))


def test_specs_become_variants_with_their_settings(tiny):
    cells = cells_of(tiny, "llama-cpp", "llama-cpp@repack=0@threads=1")
    assert [(c.engine, c.variant) for c in cells] == [("llama-cpp", ""), ("llama-cpp", "repack=0@threads=1")]
    assert cells[1].settings.extra["repack"] == 0 and cells[1].settings.threads == 1
    assert cells[1].cell_id.startswith("llama-cpp@repack=0@threads=1/")
    # a crossed knob and a spec's own settings make one label
    crossed = cells_of(tiny, "llama-cpp@threads=1", knobs={"no_host": ["0", "1"]})
    assert [c.variant for c in crossed] == ["threads=1@no_host=0", "threads=1@no_host=1"]


def fake_binary(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_binary_per_spec_is_labelled_by_its_build_not_its_path(tiny, tmp_path):
    a, b = fake_binary(tmp_path / "one" / "llama-bench"), fake_binary(tmp_path / "two" / "llama-bench")
    cells = cells_of(tiny, f"llama-bench@bin={a}", f"llama-bench@bin={b}")
    assert [c.settings.extra["llama_bench"] for c in cells] == [str(a), str(b)]
    labels = [c.variant for c in cells]
    assert all(v.startswith("bin=") and "/" not in v for v in labels) and labels[0] != labels[1], labels


@pytest.mark.parametrize("spec, words", [
    ("reference@bin=/bin/true", "takes no bin="),
    ("llama-bench@bin=/nonexistent/llama-bench", "is not a file"),
    ("llama-cpp@repack=2", "repack=2 is not valid"),
    ("reference@cache_mib=lots", "cache_mib=lots is not valid; use a whole number"),
    ("llama-cpp@op_offload=a/b", "cannot name a cell"),
    ("llama-cpp@repack", "is not KEY=VALUE"),
])
def test_bad_specs_are_one_sentence(tiny, spec, words):
    with pytest.raises(UserError, match=words):
        cells_of(tiny, spec)


def test_the_same_cells_twice_is_an_error(tiny):
    with pytest.raises(UserError, match="name the same cells"):
        cells_of(tiny, "llama-cpp@repack=0", "llama-cpp@repack=0")


def test_a_sweep_records_and_compares_the_layers_each_engine_kept(tiny, tmp_path):
    """A real sweep of two engines at depths 0 and 2: each engine's own report of its host layers lands in cells.csv,
    and the ratio table says they are the same."""
    r = moebench("sweep", "-m", tiny, "-e", "reference,llama-cpp@repack=0", "--n-cpu-moe", "0,2", "-w", "tg4",
                 "-r", "2", "--rounds", "1", "--threads", "2", "--results-dir", tmp_path,
                 env=os.environ | {"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    with open(run_dir_of(r) / "cells.csv") as f:
        cells = {(c["engine"], c["n_cpu_moe"]): c for c in csv.DictReader(f)}
    # no GPU here: every layer's experts are in host memory at every depth (engines.base.host_layers); the depth shows
    # in what each engine placed by its rule
    for engine in ("reference", "llama-cpp"):
        assert cells[(engine, "0")]["cpu_moe_layers"] == cells[(engine, "2")]["cpu_moe_layers"] == "0-3"
    assert [cells[("llama-cpp", d)]["n_overridden_tensors"] for d in "02"] == ["0", "6"]
    assert cells[("llama-cpp", "2")]["cell_id"].startswith("llama-cpp@repack=0/")
    ratios = r.stdout[r.stdout.index("ratios"):]
    assert "reference / llama-cpp@repack=0" in ratios and "same (0-3)" in ratios
