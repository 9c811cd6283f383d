"""Integration: real llama.cpp (llama-cpp-python) on the tiny preset through real sweeps."""
import json

import pandas as pd
import pytest

from engines.base import EngineSettings
from engines.gguf_meta import read_meta
from engines.llama_cpp import override_patterns
from harness.store.results import CELL_COLUMNS, MEASUREMENT_COLUMNS, SAMPLE_COLUMNS
from harness.run.sweep import run_sweep
from harness.run.spec import SweepSpec
from tests.conftest import isolated, llama_cpp_load


def test_override_patterns_do_not_leak_across_layers():
    import re
    pats = override_patterns(2)
    hit = lambda name: any(re.search(p, name) for p in pats)
    assert all(hit(n) for n in ("blk.0.ffn_up_exps.weight", "blk.1.ffn_gate_exps.weight",
                                "blk.1.ffn_gate_up_exps.weight"))
    assert not hit("blk.10.ffn_up_exps.weight") and not hit("blk.2.ffn_down_exps.weight")
    assert not hit("blk.0.ffn_up_shexp.weight") and not hit("blk.0.ffn_gate_inp.weight")


@pytest.mark.parametrize("depth", [0, 1, 3, 4])
def test_depth_moves_exactly_the_first_layers_experts_to_cpu_buffers(tiny, depth):
    info, _ = isolated(llama_cpp_load, tiny, EngineSettings(n_cpu_moe=depth, n_ctx=64, threads=2))
    meta = read_meta(tiny)
    expected = sorted(t.name for t in meta.tensors if t.layer is not None and t.layer < depth)
    assert sorted(info.extra["overridden_tensors"]) == expected        # parsed from llama.cpp's own log
    assert info.n_overridden_tensors == 3 * depth
    assert info.expert_bytes_host == meta.expert_bytes(depth)
    assert info.expert_host_fraction == pytest.approx(depth / 4)
    # llama.cpp's model buffers hold the whole file's tensor data (header excluded)
    model_bytes = sum(v for k, v in info.bytes_by_device.items() if k.startswith("model:"))
    assert model_bytes == pytest.approx(sum(t.n_bytes for t in meta.tensors), rel=0.01)
    assert info.settings["n_ctx"] >= 64 and info.settings["threads"] == 2


def test_sweep_rows_columns_and_placement(tiny, tmp_path):
    spec = SweepSpec(models=[str(tiny)], engines=["llama-cpp"], depths=["0", "all"], workloads=["pp64", "tg8"],
                     repetitions=2, threads=2, sample_ms=10)
    run = run_sweep(spec, tmp_path)
    assert sorted(p.name for p in run.iterdir()) == ["cells.csv", "logs", "measurements.csv", "run.json", "samples.csv"]
    cells, meas, samples = (pd.read_csv(run / f) for f in ("cells.csv", "measurements.csv", "samples.csv"))
    assert list(cells.columns) == CELL_COLUMNS and list(meas.columns) == MEASUREMENT_COLUMNS
    assert list(samples.columns) == SAMPLE_COLUMNS
    assert cells["status"].tolist() == ["ok", "ok"]
    assert cells["n_cpu_moe"].tolist() == [0, 4] and cells["depth"].astype(str).tolist() == ["0", "all"]
    assert cells["n_overridden_tensors"].tolist() == [0, 12]
    assert cells["expert_host_fraction"].tolist() == [0.0, 1.0]
    assert (cells["peak_rss_mib"] > 10).all() and cells["peak_vram_mib"].isna().all()   # no GPU here: NaN, not 0
    assert (cells["load_s"] > 0).all()
    # 2 cells x 2 workloads x 2 repetitions, every rep a positive duration and a consistent rate
    assert len(meas) == 8 and sorted(meas["rep"].unique()) == [0, 1]
    assert (meas["ns"] > 0).all()
    n_tok = meas["n_prompt"] + meas["n_gen"]
    assert ((meas["tokens_per_s"] - n_tok / (meas["ns"] / 1e9)).abs() < 1e-3 * meas["tokens_per_s"]).all()
    # llama.cpp's own counters measured the same work (the harness clock also covers Python batch filling)
    assert (meas["engine_ms"] > 0).all() and (meas["engine_ms"] <= meas["ns"] / 1e6 * 1.01).all()
    assert set(samples["phase"]) >= {"load"} and samples["rss_mib"].max() > 10
    run_json = json.loads((run / "run.json").read_text())
    assert run_json["spec"]["depths"] == ["0", "all"] and run_json["host"]["cores_logical"] >= 1
