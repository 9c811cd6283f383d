"""Memory plan: hand-computed bytes, and agreement with what llama.cpp and the reference engine report."""
import json
import re

import pytest

from engines.base import EngineSettings
from engines.gguf_meta import read_meta
from harness.planning.plan import cpu_buffers, PlanSettings, find_runs, make_plan
from harness.store.results import read_csv
from tests.conftest import moebench

# tiny preset: 4 layers, n_embd 128, 4 heads / 2 kv heads x 32, 8 experts (top-2) x ff 64, vocab 1024, f32
EXPERTS_PER_LAYER = 3 * 8 * 64 * 128 * 4                       # gate, up, down
NON_EXPERT = 4 * (4 * (128 + 128 * 128 + 64 * 128 * 2 + 128 * 128 + 128 + 8 * 128 + 32 + 32)
                  + 2 * 1024 * 128 + 128)                       # 4 layers + embedding, output, output norm


def test_plan_arithmetic_on_tiny_by_hand(tiny):
    meta = read_meta(tiny)
    p = make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=300, device="cpu"))
    assert p.n_kv_cells == 512                                  # llama.cpp pads the cache to 256 cells
    assert len(p.depths) == 5
    for d in p.depths:
        n = d.n_cpu_moe
        assert d.non_expert_bytes == NON_EXPERT
        assert d.expert_host_bytes == n * EXPERTS_PER_LAYER
        assert d.expert_accel_bytes == (4 - n) * EXPERTS_PER_LAYER
        assert d.kv_bytes == 512 * 4 * 2 * (32 + 32) * 2        # cells x layers x kv heads x (K+V) x f16
        # CPU-only: no accelerator; f32 weights take no extra buffer type, so every weight stays in the mapping
        # (file-backed) and the RAM llama.cpp needs is its KV cache and compute buffer
        assert d.accel_bytes == 0 and d.mapped_bytes == NON_EXPERT + 4 * EXPERTS_PER_LAYER
        assert d.host_bytes == d.kv_bytes + d.compute_bytes
    unmapped = make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=300, device="cpu", mmap=False)).at(2)
    assert unmapped.mapped_bytes == 0                           # read into its CPU buffer: anonymous
    assert unmapped.host_bytes == NON_EXPERT + 4 * EXPERTS_PER_LAYER + unmapped.kv_bytes + unmapped.compute_bytes
    # on CUDA llama.cpp keeps the token embedding in host RAM, and a batch of >= 32 tokens copies an offloaded
    # layer's experts into the GPU compute buffer (op offload)
    g = make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=300, device="cuda"))
    embed = 1024 * 128 * 4
    for n in range(5):
        assert g.at(n).non_expert_bytes == NON_EXPERT - embed and g.at(n).host_bytes == n * EXPERTS_PER_LAYER + embed
        assert g.at(n).accel_bytes == NON_EXPERT - embed + (4 - n) * EXPERTS_PER_LAYER + g.at(n).kv_bytes + \
            g.at(n).compute_bytes and g.at(n).mapped_bytes == 0      # host weights: page-locked copies
        assert g.at(n).compute_bytes == p.at(n).compute_bytes + (EXPERTS_PER_LAYER if n else 0)
    # the reference engine: f32 file -> f32 compute, f16 KV (as llama.cpp's) without padding, no staging on the
    # CPU, two staging layers on CUDA
    r = make_plan(meta, PlanSettings(engine="reference", n_ctx=300, device="cpu"))
    assert r.at(0).kv_bytes == 2 * 4 * 2 * 300 * 32 * 2
    # its f32 matrices are all under 2 MiB and in no layout its kernels repack: they stay in the mapping; the
    # vectors (norms, each layer's q/k norms) are f32 copies, anonymous
    vectors = 4 * 4 * (128 + 128 + 32 + 32) + 4 * 128
    assert r.at(2).mapped_bytes == NON_EXPERT + 4 * EXPERTS_PER_LAYER - vectors
    assert r.at(2).host_bytes == vectors + r.at(2).kv_bytes + r.at(2).compute_bytes
    assert r.at(0).staging_bytes == r.at(3).staging_bytes == 0
    rg = make_plan(meta, PlanSettings(engine="reference", n_ctx=300, device="cuda"))
    assert rg.at(0).staging_bytes == 0 and rg.at(3).staging_bytes == 2 * EXPERTS_PER_LAYER
    assert r.at(4).expert_host_bytes == 4 * EXPERTS_PER_LAYER and r.at(4).expert_accel_bytes == 0
    assert rg.at(4).host_bytes == 4 * EXPERTS_PER_LAYER                  # on CUDA: page-locked copies


@pytest.fixture(scope="module", params=["f16", "q4_k_m"])
def mib_model(request, tmp_path_factory):
    """Expert tensors of exactly 2 MiB each in f16, so llama.cpp's per-tensor MiB log lines are exact; and the same
    shapes in Q4_K_M (n_embd 256: every K-quant block fits), whose dense weights go to AMX (padded) on an AMX CPU
    and whose Q4_K experts to CPU_REPACK on any AVX2 CPU."""
    from engines.reference.archs import Hparams, Preset
    from workloads.synth import synthesize
    return synthesize(Preset(Hparams("qwen3moe", 4, 256, 4, 2, 64, 8, 2, 512, 1024), dtype=request.param),
                      tmp_path_factory.mktemp("m") / f"mib-{request.param}.gguf")


@pytest.mark.parametrize("depth", [0, 2, 4])
@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("repack", [True, False])
def test_plan_matches_llama_cpp_buffers(mib_model, depth, mmap, repack):
    """CPU-only llama.cpp keeps every buffer in CPU memory, so the device split is checked through what it
    logs: the tensors it moved to the host buffer type (names and sizes), its model buffers per buffer type (its
    extra buffer types' copies included: AMX on an AMX CPU, CPU_REPACK), KV and compute buffers. Load only: no
    llama_decode runs here."""
    from engines.llama_cpp import LlamaCppEngine

    e = LlamaCppEngine()
    e.load(mib_model, EngineSettings(n_cpu_moe=depth, n_ctx=300, threads=2, mmap=mmap, extra={"repack": int(repack)}))
    info, log = e.info(), e._load_log
    e.close()
    meta = read_meta(mib_model)
    s = PlanSettings(engine="llama-cpp", n_ctx=300, device="cpu", mmap=mmap, repack=bool(info.settings["repack"]))
    d = make_plan(meta, s).at(depth)
    moved = dict(re.findall(r"tensor (blk\.\d+\.\S+) \((\d+) MiB \S+\) buffer type overridden", log))
    host = [t for t in meta.tensors if t.layer is not None and t.layer < depth]
    assert moved == {t.name: str(t.n_bytes // 2**20) for t in host}          # llama.cpp prints whole MiB
    assert sum(t.n_bytes for t in host) == d.expert_host_bytes
    by = info.bytes_by_device
    theirs = {k.split(":", 1)[1]: v for k, v in by.items() if k.startswith("model:")}
    ours = cpu_buffers(meta, s)
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert theirs[k] == pytest.approx(ours[k], rel=0.02, abs=2**16), k
    model = sum(theirs.values())
    assert model == pytest.approx(d.non_expert_bytes + d.expert_accel_bytes + d.expert_host_bytes + d.cpu_copy_bytes,
                                  rel=0.02)
    assert by["kv:CPU"] == pytest.approx(d.kv_bytes, rel=0.02)
    assert by["compute:CPU"] == pytest.approx(d.compute_bytes, rel=0.10)     # an estimate: within 10%
    # the host RAM it needs (anonymous): every buffer but the mapped file range, which is file-backed
    assert d.mapped_bytes == pytest.approx(theirs.get("CPU_Mapped", 0), rel=0.02, abs=2**16)
    assert (d.mapped_bytes > 0) == mmap
    anon = sum(v for k, v in theirs.items() if k != "CPU_Mapped") + by["kv:CPU"] + by["compute:CPU"]
    assert d.host_bytes == pytest.approx(anon, rel=0.05) and d.accel_bytes == 0


@pytest.mark.parametrize("depth", [0, 2, 4])
def test_plan_matches_reference_engine_info(tiny, depth):
    from engines.reference.engine import ReferenceEngine

    e = ReferenceEngine()
    e.load(tiny, EngineSettings(n_cpu_moe=depth, n_ctx=300, threads=2, device="cpu"))
    held = e.info().extra["held_bytes"]
    e.close()
    d = make_plan(read_meta(tiny), PlanSettings(engine="reference", n_ctx=300, device="cpu")).at(depth)
    assert held["experts"].get("host", 0) == pytest.approx(d.expert_host_bytes, rel=0.02)
    assert held["experts"].get("accelerator", 0) == pytest.approx(d.expert_accel_bytes, rel=0.02)
    assert held["non_experts"]["accelerator"] == pytest.approx(d.non_expert_bytes, rel=0.02)
    assert held["kv_cache"]["accelerator"] == pytest.approx(d.kv_bytes, rel=0.02)
    assert held["staging"]["accelerator"] == d.staging_bytes


def test_both_engines_hold_the_same_kv_bytes(tiny):
    """On the CPU both KV caches hold f16 (llama.cpp's default; the reference engine's cache_type): at a context
    llama.cpp does not pad (a multiple of 256 cells) the bytes are the same, f32 on request twice them."""
    from engines.llama_cpp import LlamaCppEngine
    from engines.reference.engine import ReferenceEngine

    lc = LlamaCppEngine()
    lc.load(tiny, EngineSettings(n_ctx=512, threads=2))
    theirs = lc.info().bytes_by_device["kv:CPU"]
    lc.close()
    held = {}
    for cache in ("f16", "f32"):
        e = ReferenceEngine()
        e.load(tiny, EngineSettings(n_ctx=512, threads=2, device="cpu", extra={"cache_type": cache}))
        held[cache] = e.info().extra["held_bytes"]["kv_cache"]["accelerator"]
        assert e.info().extra["kv_cache_dtype"] == {"f16": "float16", "f32": "float32"}[cache]
        e.close()
    assert held["f16"] == theirs == 512 * 4 * 2 * 2 * 32 * 2      # cells x layers x kv heads x (K+V) x hd x f16
    assert held["f32"] == 2 * theirs


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_plan_calibrates_from_a_real_sweep(tiny, tmp_path):
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16,tg4", "-r", "2",
                 "--threads", "2", "--results-dir", tmp_path, env={"MOEBENCH_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    runs = find_runs(tmp_path)
    assert len(runs) == 1
    meta = read_meta(tiny)
    p = make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=16, device="cpu"), runs)
    assert p.calibration is not None and p.calibration.n_cells == 2
    assert p.calibration.compute_scale == pytest.approx(1.0, rel=0.05)   # llama.cpp's own compute buffer
    assert p.calibration.peak == "peak_rss_anon_mib"
    for c in read_csv(runs[0], "cells.csv"):   # calibrated: the host RAM planned is never below a measured peak
        d = p.at(int(c["n_cpu_moe"]))          # (CPU-only: the anonymous RSS)
        assert d.host_bytes >= float(c["peak_rss_anon_mib"]) * 2**20 - 2**20
    out = moebench("plan", "-m", tiny, "--ctx", "16", "--results-dir", tmp_path)
    assert out.returncode == 0 and "calibrated from 2 measured cell(s)" in out.stderr
    js = json.loads(moebench("plan", "-m", tiny, "--ctx", "16", "--no-calibrate", "--device", "cuda",
                             "--format", "json").stdout)
    assert js["calibration"] is None
    assert [d["host_bytes"] for d in js["depths"]] == [n * EXPERTS_PER_LAYER + 1024 * 128 * 4 for n in range(5)]


def test_plan_bad_input_is_one_sentence(tiny):
    r = moebench("plan", "-m", tiny, "--ctx", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--ctx" in r.stderr


@pytest.mark.parametrize("preset, layers, per_layer", [
    ("gpt-oss-20b", 24, 3 * 32 * 2880 * 2880 * 17 // 32 + 3 * 32 * 2880 * 4),      # MXFP4 experts + f32 biases
    ("deepseek-v4-flash", 43, 3 * 256 * 2048 * 4096 * 17 // 32),                    # MXFP4 experts
])
def test_plan_of_a_full_size_model_from_its_sparse_header(tmp_path, preset, layers, per_layer):
    """`model synth --sparse` writes a full-size model's header and tensor table, the data a hole (no disk):
    the plan then gives the published model's expert bytes per depth."""
    import os

    out = tmp_path / f"{preset}.gguf"
    r = moebench("model", "synth", "--preset", preset, "--sparse", "-o", out)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10 * 2**30 and os.stat(out).st_blocks * 512 < 16 * 2**20
    meta = read_meta(out)
    assert meta.n_layers == layers and meta.expert_bytes(1) == per_layer
    p = make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=8192, device="cpu"))
    assert [p.at(n).expert_host_bytes for n in (0, 1, layers)] == [0, per_layer, layers * per_layer]
    js = json.loads(moebench("plan", "-m", out, "--no-calibrate", "--format", "json").stdout)
    assert js["depths"][layers]["host_bytes"] >= layers * per_layer


@pytest.mark.parametrize("model", ["gemma4-tiny:q8_0", "qwen35moe-tiny:q4_k_m", "gpt-oss-tiny:mxfp4"])
def test_llama_cpp_cpu_buffers_per_architecture(model):
    """llama.cpp's model buffers by type against cpu_buffers on other architectures and types (gemma4 ties its
    output to token_embd, which the extra buffer types then copy a second time; qwen35moe's multi-token-prediction
    block is not loaded at all; MXFP4 experts repack)."""
    from engines.llama_cpp import LlamaCppEngine
    from workloads.synth import resolve_model

    path = resolve_model(f"preset:{model}")
    e = LlamaCppEngine()
    e.load(path, EngineSettings(n_cpu_moe=1, n_ctx=256, threads=2))
    info = e.info()
    e.close()
    theirs = {k.split(":", 1)[1]: v for k, v in info.bytes_by_device.items() if k.startswith("model:")}
    ours = cpu_buffers(read_meta(path), PlanSettings(device="cpu", repack=bool(info.settings["repack"])))
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert theirs[k] == pytest.approx(ours[k], rel=0.01, abs=2**16), k


@pytest.mark.parametrize("spec", ["preset:tiny", "preset:gpt-oss-tiny:mxfp4", "preset:tiny:q4_k_m@zipf=1.2"])
def test_a_preset_header_equals_the_synthesized_files(tmp_path, monkeypatch, spec):
    """plan and recommend read a preset from its header alone (workloads.synth.preset_meta): the same metadata,
    tensor table (names, shapes, types, bytes, offsets) and size as read_meta of the synthesized file, and no file
    written; once the file exists it is read itself (its fingerprint is the one measured runs carry)."""
    from dataclasses import asdict

    from workloads.synth import cached_model, preset_meta

    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path))
    header = preset_meta(spec)
    assert not list(tmp_path.rglob("*"))
    real = read_meta(cached_model(spec))
    assert header.path == real.path and header.file_bytes == real.file_bytes and header.name == real.name
    assert [asdict(t) for t in header.tensors] == [asdict(t) for t in real.tensors]
    assert header.fields == real.fields and header.moe_layers == real.moe_layers
    assert preset_meta(spec).fingerprint == real.fingerprint != header.fingerprint


def test_plan_of_a_full_size_preset_writes_no_file(tmp_path):
    """`plan -m preset:gpt-oss-20b` from the header alone: the 11.5 GiB file would take minutes to write."""
    env = {"MOEBENCH_CACHE": str(tmp_path / "cache")}
    r = moebench("plan", "-m", "preset:gpt-oss-20b", "--no-calibrate", "--format", "json", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    per_layer = 3 * 32 * 2880 * 2880 * 17 // 32 + 3 * 32 * 2880 * 4
    assert len(js["depths"]) == 25 and js["depths"][24]["host_bytes"] >= 24 * per_layer
    r = moebench("recommend", "-m", "preset:gpt-oss-20b", "--vram", "64GiB", "--ram", "64GiB", "--format", "json",
                 env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["recommended"] == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
