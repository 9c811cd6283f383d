"""`moebench published` (the published tables with recomputed ratios) and `moebench reproduce`."""
import json
import math

import pandas as pd
import pytest

from harness.analysis.published import load
from tests.conftest import moebench


def test_recomputed_ratios_agree_with_the_printed_ones_on_every_row():
    r = moebench("published", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    data = load()
    groups = data.groupby(["doc_revision", "model", "n_cpu_moe"]).ngroups
    assert len(rows) == groups                                   # one row per revision x model x depth
    checked = 0
    for row in rows:
        for col in [c for c in row if c.endswith(" printed") and row[c] is not None]:
            recomputed = row[col.replace(" printed", " ratio")]
            assert not math.isnan(recomputed), (row["model"], row["n_cpu_moe"], col)
            # the printed ratios came from unrounded numbers: within 1 %, not exact
            assert recomputed == pytest.approx(row[col], rel=0.01), (row["model"], row["n_cpu_moe"], col)
            checked += 1
    assert checked == data["metric"].isin(["throughput_ratio", "vram_ratio"]).sum() == 72


def test_published_layout_for_one_model():
    r = moebench("published", "--model", "qwen3.5-35b-a3b", "--revision", "final", "--format", "md")
    assert r.returncode == 0, r.stderr
    assert "| 24 | 15,414 | 9,010 | 1.71x | 1.71x | 4,412 | 498 | 8.86x | 8.85x | 5,259 | 484 | 10.87x | 10.86x |" \
        in r.stdout
    assert r.stdout.count("\n| ") == 6                          # header + 5 depths
    bad = moebench("published", "--revision", "draft")
    assert bad.returncode == 2 and "Unknown published revision 'draft'" in bad.stderr


def test_reproduce_plans_the_published_sweep(tiny, tmp_path):
    r = moebench("reproduce", "--published-model", "Qwen3.5-35B-A3B", "--model-file", tiny, "--dry-run")
    assert r.returncode == 2 and "exceed the model file's 4 layers" in r.stderr and "--clamp" in r.stderr
    r = moebench("reproduce", "--published-model", "Qwen3.5-35B-A3B", "--model-file", tiny, "--dry-run", "--clamp",
                 "--format", "json", "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    plan = {x["item"]: x["value"] for x in json.loads(r.stdout)}
    assert plan["n_cpu_moe"] == "0, 4" and plan["workloads"] == "pp4096, pp8192, tg128"
    assert plan["repetitions"].startswith("3 (published best-of: TensorSharp 3, llama.cpp 2)")
    assert "not the published model" in plan["note"]
    assert "depths 12, 24, 36, 48 clamped to 4" in r.stderr
    assert not list(tmp_path.iterdir())                          # a dry run runs nothing, writes nothing


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_reproduce_runs_and_reports_against_published(tiny, tmp_path):
    r = moebench("reproduce", "--published-model", "gpt-oss-20b", "--model-file", tiny, "--clamp", "-w", "pp16,tg4",
                 "-r", "1", "--threads", "2", "--results-dir", tmp_path / "results", "--reports-dir",
                 tmp_path / "reports", "--format", "md")
    assert r.returncode == 0, r.stderr
    (run,) = [d for d in (tmp_path / "results").iterdir() if d.is_dir()]
    cells = pd.read_csv(run / "cells.csv")
    assert sorted(zip(cells["engine"], cells["n_cpu_moe"])) == [("llama-cpp", 0), ("llama-cpp", 4),
                                                                ("reference", 0), ("reference", 4)]
    assert (cells["status"] == "ok").all()
    assert (tmp_path / "reports" / run.name / "report.html").exists()
    against = r.stdout.split("measured vs published: gpt-oss-20b")[1]
    assert "| 0 | pp4096 | " in against and "pp4096 not run (ran pp16, tg4)" in against
    assert "depth 6 \\> the measured model's 4 layers" in against          # Markdown-escaped >


def test_reproduce_names_the_qwen35_layer_count_the_table_got_wrong(tmp_path):
    """The published Qwen3.5-35B-A3B table runs to depth 48 but the checkpoint has 40 layers: one sentence says
    so (with the fix), and --clamp maps 48 to 40. A sparse full-size file stands in for the real one."""
    f = tmp_path / "q35.gguf"
    assert moebench("model", "synth", "--preset", "qwen3.5-35b-a3b", "--sparse", "-o", f).returncode == 0
    r = moebench("reproduce", "--published-model", "Qwen3.5-35B-A3B", "--model-file", f, "--dry-run")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "Traceback" not in r.stderr
    assert "48 MoE layers, but its checkpoint has 40" in r.stderr and "--clamp" in r.stderr
    r = moebench("reproduce", "--published-model", "Qwen3.5-35B-A3B", "--model-file", f, "--dry-run", "--clamp",
                 "--format", "json")
    assert r.returncode == 0 and "depths 48 clamped to 40" in r.stderr
    plan = {row["item"]: row["value"] for row in json.loads(r.stdout)}
    assert plan["n_cpu_moe"].split(", ")[-1] == "40"
