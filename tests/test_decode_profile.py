"""benchmarks/decode_profile.py on preset tiny for a few tokens: each engine's components add up to its token time,
and the bytes of each component are the model's tensors as the engine holds them."""
import math
import sys

import pytest

from engines.base import EngineSettings
from engines.gguf_meta import read_meta
from engines.reference.engine import ReferenceEngine
from harness.planning.plan import PlanSettings, model_bytes
from tests import conftest
from tests.conftest import ROOT
from workloads.synth import PRESETS, preset, synthesize

sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_profile as dp  # noqa: E402

N, D = 4, 5                         # tokens decoded after D context tokens
LAYERS = PRESETS["tiny"].h.n_layers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(preset(PRESETS["tiny"], dtype="q8_0"), tmp_path_factory.mktemp("profile") / "tiny.gguf")


@pytest.fixture(scope="module")
def table(model):
    return dp.token_bytes(read_meta(model))


def test_bytes_are_the_tensors_the_engine_holds(model, table):
    """Per layer: attention = its attn_* tensors as held plus the f16 K and V rows up to the position, experts = one
    expert's stored bytes per routed expert; head = output norm and matrix; together the roofline's weight bytes."""
    e = ReferenceEngine()
    e.load(model, EngineSettings(n_cpu_moe=LAYERS, n_ctx=32, threads=2))
    meta, pos = read_meta(model), 7
    got = table.token(pos)
    for il, lw in enumerate(e.model.layers):
        attn = sum(t.nbytes for name, t in lw.items() if name.startswith("attn_"))
        K, V = e.model.caches[il]
        kv = (K[:, :pos + 1].nbytes + V[:, :pos + 1].nbytes)
        assert got[il, "attention"] == attn + kv and K.dtype.itemsize == 2
        assert got[il, "experts"] == meta.n_expert_used * e.moe.layers[il].expert_bytes
        assert got[il, "rest"] == sum(t.nbytes for name, t in lw.items() if not name.startswith("attn_"))
    top = e.model.top
    assert got[-1, "head"] == top["output.weight"].nbytes + top["output_norm.weight"].nbytes
    assert got[-1, "other"] == top["token_embd.weight"].nbytes // meta.n_vocab        # one embedding row
    mb = model_bytes(meta, PlanSettings(engine="reference", device="cpu"))
    weights = sum(v for (il, c), v in table.token(-1, [0] * LAYERS).items() if c != "other")
    assert weights == mb.non_expert - mb.embed                  # what the roofline's decode bound reads a token
    e.close()


def check_layers(tokens: list[dict]) -> None:
    """Every token times attention, experts and rest of every layer, the head and something else."""
    for tok in tokens:
        keys = {(il, c) for il, c, _ in tok["ns"]}
        assert {(il, c) for il in range(LAYERS) for c in dp.LAYER_PARTS} | {(-1, "head")} <= keys, keys
        assert all(ns > 0 for _, _, ns in tok["ns"]), tok


def check_timed(p: dict, share: float) -> None:
    """No token's parts add up to more than its time (nested calls are not counted twice), and on the token the
    machine disturbed least they cover at least `share` of it: a pause between two parts lengthens only the wall."""
    shares = [sum(ns for _, _, ns in tok["ns"]) / wall for tok, wall in zip(p["tokens"], p["wall_ns"])]
    assert all(s < 1 for s in shares) and max(shares) > share, shares


def test_the_reference_engines_components_add_up_to_its_token_time(model, table):
    p = dp.profile("reference", str(model), "all", D, N, threads=2, reps=1)
    assert len(p["tokens"]) == len(p["wall_ns"]) == len(p["plain_ns"][0]) == N
    check_layers(p["tokens"])
    check_timed(p, 0.5)
    for tok in p["tokens"]:
        assert tok["experts"] == [PRESETS["tiny"].h.n_expert_used] * LAYERS
    s = dp.summarize(p, table)
    assert math.isclose(sum(s["ms"].values()), s["token_ms"]) and s["ms"][-1, "other"] > 0
    rows = {r["component"]: r for r in dp.component_rows(s, None, 10.0)}
    assert math.isclose(sum(rows[c]["ref ms"] for c in dp.COMPONENTS), rows["token"]["ref ms"])
    assert math.isclose(rows["experts"]["MB/token"] * 1e6, sum(table.per_expert) * PRESETS["tiny"].h.n_expert_used)
    kv = sum(table.kv_cell) * (D + (N + 1) / 2)                  # positions D..D+N-1 read pos + 1 cells
    assert math.isclose(rows["attention"]["MB/token"] * 1e6, sum(table.attention) + kv)


def test_llama_cpps_nodes_add_up_to_its_plain_token_time(model, table):
    p = conftest.isolated(dp.profile, "llama-cpp", str(model), "all", D, N, threads=2, reps=1)
    check_layers(p["tokens"])
    check_timed(p, 0.3)
    s = dp.summarize(p, table)
    assert math.isclose(sum(s["ms"].values()), s["plain_ms"]) and s["raw_ms"] > s["plain_ms"] / 10


def test_nodes_are_grouped_by_weight_name_and_place():
    nodes = [("inp_embd", "GET_ROWS", "token_embd.weight"), ("norm-0", "RMS_NORM", ""), ("Qcur-0", "MUL_MAT", "q"),
             ("node_9", "FLASH_ATTN_EXT", ""), ("ffn_inp-0", "ADD", ""), ("norm-0", "RMS_NORM", "ffn_inp-0"),
             ("ffn_moe_logits-0", "MUL_MAT", "blk.0.ffn_gate_inp.weight"),
             ("node_20", "MUL_MAT_ID", "blk.0.ffn_down_exps.weight"), ("node_21", "ADD", ""),
             ("ffn_moe_combined-0", "ADD", ""), ("l_out-0", "ADD", ""), ("norm", "RMS_NORM", "l_out-0"),
             ("result_output", "MUL_MAT", "output.weight")]
    assert dp.node_components(nodes) == [(-1, "other"), (0, "attention"), (0, "attention"), (0, "attention"),
                                         (0, "attention"), (0, "rest"), (0, "rest"), (0, "experts"), (0, "experts"),
                                         (0, "rest"), (0, "rest"), (-1, "head"), (-1, "head")]


def test_the_script_writes_its_tables(model, tmp_path):
    isa = ReferenceEngine.isa()
    dp.main([str(model), "-n", "2", "-t", "2", "-r", "1", "--variants", isa, "--probe-mib", "64", "--out",
             str(tmp_path)])
    md = (tmp_path / "profile.md").read_text()
    assert f"## variant {isa}" in md and "| experts |" in md and "llama.cpp:" in md
    import pandas as pd
    comps = pd.read_csv(tmp_path / "components.csv")
    assert list(comps["component"]) == [*dp.COMPONENTS, "token"] and (comps["llama ms"] >= 0).all()
    assert len(pd.read_csv(tmp_path / "layers.csv")) == LAYERS
    assert set(pd.read_csv(tmp_path / "tokens.csv")["engine"]) == {"reference", "llama-cpp"}
