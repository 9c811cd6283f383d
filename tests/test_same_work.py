"""Same work, or the difference named: every engine's effective `compute_dtype` (per phase, the arithmetic of its
products with weights) and `weights` (where the weights it multiplies live) say what really happened, checked
against the kernels' own arithmetic, the process's memory map and llama.cpp's library; the report names them where
two engines differ."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from engines import ggml_build
from engines.base import ARITHMETIC, Q8_ACTIVATIONS, EngineSettings, arithmetic, joined, weight_arithmetic
from engines.devices import CPU_ISAS, cpu_flags
from engines.gguf_meta import GGML_TYPES, read_meta
from engines.reference.engine import ReferenceEngine, cpu_arithmetic
from harness.analysis.tables import md_escape
from tests import conftest
from tests.conftest import moebench, run_dir_of
from workloads.synth import PRESETS, preset, synthesize

# qwen3moe with rows of 256 (whole K-quant blocks), 4 layers, 8 experts top-2: Q4_K_M stores Q4_K, Q5_K, Q6_K, Q8_0
BASE = preset(PRESETS["tiny"], n_embd=256, n_head=4, head_dim=64, n_ff_exp=256, n_vocab=512)
ISAS = [isa for isa in ("avx2", "avx512", "amx") if set(CPU_ISAS[isa]) <= cpu_flags()]
PROMPT = [i % 511 + 1 for i in range(512)]        # one full ubatch, as pp512 runs it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("same-work")
    return {dt: synthesize(preset(BASE, dtype=dt), d / f"{dt}.gguf") for dt in ("f32", "f16", "q4_k_m")}


def _library_vec_dot_types() -> dict[str, str]:
    import llama_cpp

    from engines.llama_cpp import vec_dot_types
    return vec_dot_types(llama_cpp, GGML_TYPES)


def test_the_weight_type_rule_is_libggml_cpus_type_traits():
    """llama-bench's and the reference engine's rule (engines.base.weight_arithmetic) says, for every type the
    project reads, what the type traits of the libggml-cpu llama-cpp-python loads say (read through ctypes)."""
    vec_dot = conftest.isolated(_library_vec_dot_types)
    assert set(vec_dot) == set(GGML_TYPES) and set(vec_dot.values()) <= set(ARITHMETIC)
    assert (vec_dot["F16"], vec_dot["Q4_K"], vec_dot["Q4_0"], vec_dot["Q4_1"]) == ("F16", "Q8_K", "Q8_0", "Q8_1")
    assert {t: arithmetic(v) for t, v in vec_dot.items()} == {t: weight_arithmetic(t) for t in GGML_TYPES}


def _llama_cpp_infos(paths: dict) -> dict:
    from engines.llama_cpp import LlamaCppEngine

    out = {}
    for (dt, mmap), path in paths.items():
        e = LlamaCppEngine()
        e.load(path, EngineSettings(n_ctx=64, threads=2, mmap=mmap))
        out[dt, mmap] = e.info()
        e.close()
    return out


def test_llama_cpp_reports_its_type_traits_and_its_buffers(models):
    """A real load of an F16 and a Q4_K_M file: the same arithmetic in both phases (ggml-cpu converts the activations
    to the weight type's vec_dot_type at every batch), q8 activations exactly where the file is quantized; weights
    mapped with mmap, plus a repacked copy where its log shows an extra buffer type, copied without mmap."""
    infos = conftest.isolated(_llama_cpp_infos, {(dt, m): models[dt] for dt in ("f16", "q4_k_m") for m in (1, 0)})
    bufts = ggml_build.cpu_bufts()
    for (dt, mmap), info in infos.items():
        s, meta = info.settings, read_meta(models[dt])
        words = set(s["compute_dtype"]["prefill"].split("+"))
        assert s["compute_dtype"]["decode"] == s["compute_dtype"]["prefill"]
        assert words == {"f16", "f32"} if dt == "f16" else words == {Q8_ACTIVATIONS, "f32"}     # F32: the router
        repacked = any(k.startswith("model:") and k.split(":")[1] in ("AMX", "CPU_REPACK") and v
                       for k, v in info.bytes_by_device.items())
        assert repacked == any(ggml_build.extra_buft(t.name, t.ne, t.ggml_type, bufts) for t in meta.tensors)
        assert s["weights"] == ("copy" if not mmap else "mapped+repacked-copy" if repacked else "mapped"), (dt, mmap)


def _nearest(y: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str:
    """The candidate y is nearest to (median absolute difference), asserting it is clearly so (10x)."""
    d = {k: float((y - c).abs().median()) for k, c in candidates.items()}
    best, other = sorted(d, key=d.get)
    assert d[best] * 10 <= d[other] or d[best] == d[other] == 0, d
    return best


@pytest.mark.parametrize("asked", ["auto", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["f16", "q4_k_m"])
def test_the_reference_engine_names_the_arithmetic_its_kernels_do(models, dtype, isa, asked, monkeypatch):
    """Each dense weight product the engine's forward runs (Products, as the model calls it), at one row, a full ubatch
    and between: the output is the rows kernel's (the weight's vec_dot arithmetic, f32 GEMMs with x rounded alike
    too) or a bf16 GEMM's (x and W rounded to bf16), whichever cpu_arithmetic names. The reported compute_dtype: decode
    is llama.cpp's arithmetic (the rule the library's traits give), and so is prefill unless the GEMM runs in bf16
    (the compute dtype, asked for here), where bf16 joins it. Forced avx2 (MOEBENCH_ISA) and this CPU's widest."""
    monkeypatch.setenv("MOEBENCH_ISA", isa)
    e = ReferenceEngine()
    e.load(models[dtype], EngineSettings(n_ctx=64, threads=2, dtype=asked))
    s, qk, meta = e.info().settings, e._qk, read_meta(models[dtype])
    bf16 = s["dtype"] == "bf16"
    x = torch.randn(len(PROMPT), BASE.h.n_embd, generator=torch.Generator().manual_seed(0))
    for t in meta.product_weights():
        qt = e._held[t.name]
        if t.layer is not None or qt.k != BASE.h.n_embd:
            continue
        w = qk.dequant(qt)
        for rows in (1, 64, len(PROMPT)):            # 64: between the limits of the layouts (x8 128, ggml 32)
            xr = x[:rows]
            word = cpu_arithmetic(qk, qt, rows, bf16)
            got = e.model.linear(xr, qt)
            as_bf16 = (xr.bfloat16().double() @ w.bfloat16().double().T).bfloat16().float()
            as_rows = qk.matmul(qt, xr, rows_max_n=1 << 40)                  # the rows kernel, whatever the size
            assert _nearest(got, {"bf16": as_bf16, "rows": as_rows}) == ("bf16" if word == "bf16" else "rows"), \
                (t.name, rows, word)
            assert word in ("bf16", weight_arithmetic(t.ggml_type))
    library = joined(weight_arithmetic(t.ggml_type) for t in meta.product_weights())       # llama.cpp's words
    prefill = set(s["compute_dtype"]["prefill"].split("+"))
    assert s["compute_dtype"]["decode"] == library and s["extra"]["cpu_isa"] == isa
    if bf16:
        assert "bf16" in prefill and prefill <= set(library.split("+")) | {"bf16"}
    else:
        assert s["compute_dtype"]["prefill"] == library


def test_the_prefill_words_follow_the_ubatches_a_cell_ran(models):
    """Before any prefill the engine names what a full ubatch does; after, what the ubatches it ran did: on the F32
    file with a bf16 GEMM, 512 rows go to the GEMM (bf16) but 16 stay in the rows kernel (f32)."""
    e = ReferenceEngine()
    e.load(models["f32"], EngineSettings(n_ctx=64, threads=2, dtype="bf16"))
    assert e.info().settings["compute_dtype"] == {"prefill": "bf16+f32", "decode": "f32"}      # the head: one row
    e.prefill(PROMPT[:16])
    assert e.info().settings["compute_dtype"] == {"prefill": "f32", "decode": "f32"}


def _vm_flags(ptr: int) -> tuple[str, str]:
    """(the mapped file's path or "", the VmFlags) of this process's mapping that holds address ptr."""
    found, path = False, ""
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            found, path = lo <= ptr < hi, head[5] if len(head) > 5 else ""
        elif found and line.startswith("VmFlags:"):
            return path, line
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.parametrize("dtype, extra, weights", [
    ("f32", {}, "hugepage-copy"),                                  # 2 MiB expert stacks copied onto huge pages
    ("f32", {"hugepages": False}, "mapped"),                       # F32 is never repacked: the file mapping
    ("q4_k_m", {"hugepages": False}, "copy"),                      # the kernels' x8 layout, ordinary pages
])
def _where_weights_live(model, extra: dict) -> tuple:
    """(weights, mmap, the expert stack lies in the file's mapping, its mapping is advised for huge pages), in a fresh
    process: glibc keeps freed blocks for the next allocation, so a copy made after an earlier engine's huge-page
    copy was freed can land in memory that still carries that advice."""
    e = ReferenceEngine()
    e.load(model, EngineSettings(n_ctx=64, threads=2, extra=extra))
    s = e.info().settings
    path, flags = _vm_flags(e._held["blk.0.ffn_up_exps.weight"].raw.data_ptr())
    return s["weights"], s["mmap"], path == str(model.resolve()), " hg" in flags


@pytest.mark.parametrize("dtype, extra, weights", [
    ("f32", {}, "hugepage-copy"),                                  # 2 MiB expert stacks copied onto huge pages
    ("f32", {"hugepages": False}, "mapped"),                       # F32 is never repacked: the file mapping
    ("q4_k_m", {"hugepages": False}, "copy"),                      # the kernels' x8 layout, ordinary pages
])
def test_the_reference_engine_says_where_its_weights_live(models, dtype, extra, weights):
    """weights (and mmap) as the process's memory map shows them: a matrix the engine reports mapped lies in the
    model file's mapping, a hugepage-copy one in anonymous memory advised for huge pages (VmFlags hg)."""
    assert conftest.isolated(_where_weights_live, models[dtype], extra) == (
        weights, weights == "mapped", weights == "mapped", weights == "hugepage-copy")


@pytest.mark.slow            # a real sweep of two engines and its report: ~1-2 min on 2 busy cores
def test_the_report_names_compute_dtype_and_weights_where_they_differ(models, tmp_path):
    """A real sweep of both engines on the Q4_K_M file: the fairness table names every effective setting the two cells'
    JSON holds differently (the weights: a copy in the kernels' layout against llama.cpp's mapping and its repacked
    copy), compute dtypes included where they differ, and none they hold alike."""
    r = moebench("sweep", "-m", models["q4_k_m"], "-e", "reference,llama-cpp", "--n-cpu-moe", "0", "-w", "pp64",
                 "-r", "1", "--rounds", "1", "--threads", "2", "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    cells = pd.read_csv(run / "cells.csv").set_index("engine")
    eff = {e: json.loads(cells.loc[e, "effective_settings"]) for e in ("reference", "llama-cpp")}
    assert eff["reference"]["weights"] != eff["llama-cpp"]["weights"]
    rep = moebench("report", run, "-o", tmp_path / "rep", "--format", "md")
    assert rep.returncode == 0, rep.stderr
    fair = (tmp_path / "rep" / "report.md").read_text().split("Fairness")[1].split("All cells")[0]
    for key in ("weights", "compute_dtype.prefill", "compute_dtype.decode"):
        ref, cpp = (str(eff[e]["compute_dtype"][key.split(".")[1]] if "." in key else eff[e][key])
                    for e in ("reference", "llama-cpp"))
        row = "| " + " | ".join(md_escape(v) for v in ("0", f"{key} (effective)", ref, cpp)) + " |"
        assert (row in fair) == (ref != cpp), (row, fair)
