"""The ik-llama-cpp engine (ik_llama.cpp through the ik-llama-cpp-python wheel, a peer package) against llama.cpp on
the same files, its depth placement read back from its own log, and its struct check against the bundled llama.h.

The two libraries can share a process (only GNU-unique template statics bind across them, measured with LD_DEBUG),
but each engine runs in a child process (conftest.isolated) as every llama.cpp test does: an abort inside a library
fails one test, not pytest.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from engines import peers
from engines.base import EngineSettings
from engines.errors import UserError
from engines.gguf_meta import read_meta
from engines.c_layout import HEADER_LIMIT, LayoutError, Types, _uncommented, header_struct, header_text
from engines.ik_llama_cpp import DIST
from tests import conftest
from tests.test_logits_pp512 import SPREAD_FACTOR
from tests.test_reference import LOGIT_ATOL
from tests.test_stored_weights import BASE
from workloads.synth import PRESETS, preset, synthesize

pytestmark = pytest.mark.skipif(peers.missing(DIST) is not None, reason=str(peers.missing(DIST)))

PROMPT = [int(t) for t in np.random.default_rng(35).integers(1, 512, 40)]    # crosses the presets' 24-token windows
N_GEN = 6
SETTINGS = dict(n_ctx=128, n_batch=64, n_ubatch=16, threads=2)     # 40 tokens: three ubatches, the KV cache in use
# the archs it runs; qwen35moe-tiny's MTP block and gemma4 it refuses (test_refusals)
ARCHS = {"qwen3moe": "tiny", "gpt-oss": "gpt-oss-tiny",
         "qwen35moe": preset(PRESETS["qwen35moe-tiny"], n_layers=6, n_nextn=0)}
INCLUDE = peers.peer_dir(DIST) / "include"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ik")
    return {arch: synthesize(p, d / f"{arch}.gguf") for arch, p in ARCHS.items()}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tests' qwen3moe (rows of 256) in a stored format, synthesized on first use."""
    d, made = tmp_path_factory.mktemp("ikq"), {}

    def model(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = synthesize(preset(BASE, dtype=fmt), d / f"{fmt}.gguf")
        return made[fmt]
    return model


# --- in the child processes -----------------------------------------------------------------------------------------

def run(engine: str, path: Path, forced: list[int] | None = None, **settings) -> tuple[np.ndarray, list[int]]:
    """Last-position logits after PROMPT, then after each of N_GEN decode steps, (1 + N_GEN, V), and the tokens
    decoded: the engine's own greedy choices, or `forced` (the other engine's) so that both see the same inputs."""
    from engines.registry import engine_class
    e = engine_class(engine)()
    e.load(path, EngineSettings(**(SETTINGS | settings)))
    e.prefill(PROMPT)
    rows, tokens = [np.array(e.logits(), dtype=np.float32)], []
    for i in range(N_GEN):
        tokens.append(forced[i] if forced else int(rows[-1].argmax()))
        e.decode(tokens[-1])
        rows.append(np.array(e.logits(), dtype=np.float32))
    e.close()
    return np.stack(rows), tokens


def load_info(path: Path, depth: int, extra: dict | None = None, repeat: bool = False) -> dict | str:
    """info() after loading path at depth (the UserError's sentence where it refuses); repeat: then whether a prefill
    after reset() gives the first prefill's logits exactly."""
    from engines.ik_llama_cpp import IkLlamaCppEngine
    e = IkLlamaCppEngine()
    try:
        e.load(path, EngineSettings(n_cpu_moe=depth, extra=extra or {}, **SETTINGS))
    except UserError as err:
        return str(err)
    info = e.info().to_dict()
    runs = []
    for _ in range(2 if repeat else 0):
        e.reset()
        e.prefill(PROMPT)
        runs.append(np.array(e.logits()))
    e.close()
    return info | ({"reset_repeats": bool((runs[0] == runs[1]).all())} if repeat else {})


def layout_error(include: str) -> str | None:
    """The struct check's sentence for the headers in `include`, None when they match the binding."""
    from engines import ik_llama_cpp
    ik_llama_cpp._binding()
    from ik_llama_cpp import _ctypes_api as C
    try:
        ik_llama_cpp.check_layouts(C, Path(include))
    except UserError as err:
        return str(err)
    return None


# --- tests ----------------------------------------------------------------------------------------------------------

def margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


@pytest.fixture(scope="module")
def pairs(models) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per arch (llama.cpp's logits, ik's on llama.cpp's greedy tokens): one child process per engine."""
    want = conftest.isolated(conftest.for_each, run, {a: ("llama-cpp", p) for a, p in models.items()})
    got = conftest.isolated(conftest.for_each, run, {a: ("ik-llama-cpp", p, want[a][1]) for a, p in models.items()})
    return {a: (want[a][0], got[a][0]) for a in models}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_greedy_tokens_match_llama_cpp(pairs, arch):
    """f32 files: the prompt's last-position logits and every decode step's within LOGIT_ATOL of llama.cpp's (both
    keep an f16 KV cache; measured <= 7e-3, gpt-oss), the same greedy token wherever llama.cpp's top-2 margin exceeds
    2 LOGIT_ATOL."""
    want, got = pairs[arch]
    err = np.abs(got - want).max(-1)
    assert err.max() < LOGIT_ATOL, f"{arch}: max |logit diff| per step {err}"
    clear = margin(want) > 2 * LOGIT_ATOL
    assert clear.sum() >= N_GEN // 2 and (got.argmax(-1) == want.argmax(-1))[clear].all()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["q4_k_m", "q8_0", "f16"])
def test_stored_formats_follow_llama_cpp(quantized, fmt):
    """Quantized files: ik's products take its own 8-bit activation blocks (Q8_2_X4 for Q8_0/K-quants, not ggml's
    Q8_0/Q8_K), so its logits sit ~5e-2 from llama.cpp's already at position 0 (measured); held, like
    test_logits_pp512, to SPREAD_FACTOR times llama.cpp's own spread between its two attention paths (the median
    step), the same greedy token at margins above that. The F16 file: every step within LOGIT_ATOL (measured 3e-3)."""
    path = quantized(fmt)
    want, tokens = conftest.isolated(run, "llama-cpp", path, flash_attn="on")
    plain, _ = conftest.isolated(run, "llama-cpp", path, forced=tokens, flash_attn="off")
    got, _ = conftest.isolated(run, "ik-llama-cpp", path, forced=tokens)
    err = np.abs(got - want).max(-1)
    bound = LOGIT_ATOL if fmt == "f16" else max(LOGIT_ATOL, SPREAD_FACTOR * float(np.median(
        np.abs(plain - want).max(-1))))
    assert (err.max() if fmt == "f16" else np.median(err)) < bound, (fmt, err, bound)
    clear = margin(want) > 2 * bound
    assert (got.argmax(-1) == want.argmax(-1))[clear].all(), (fmt, margin(want))


def test_depth_is_the_first_layers_as_its_log_says(models, quantized):
    """--n-cpu-moe N: the experts of layers 0..N-1, read back from the library's own "buffer type overridden" lines
    (gpt-oss's expert biases included), the same bytes as the file's; its effective settings; a reset repeats a
    prefill exactly."""
    calls = {("qwen3moe", d): (models["qwen3moe"], d) for d in (0, 1, 4)} | {
        ("gpt-oss", 2): (models["gpt-oss"], 2), ("qwen35moe", 2): (models["qwen35moe"], 2, None, True),  # recurrent
        ("q4_k_m", 2): (quantized("q4_k_m"), 2), ("rtr", 2): (quantized("q4_k_m"), 2, {"rtr": 1, "fmoe": 0})}
    infos = conftest.isolated(conftest.for_each, load_info, calls)
    for (what, d), info in infos.items():
        path = calls[(what, d)][0]
        meta = read_meta(path)
        # a CPU-only library: every layer's experts are in host memory (engines.base.host_layers); the overrides say
        # which layers the depth placed
        assert info["cpu_moe_layers"] == meta.moe_layers, (what, d, info["cpu_moe_layers"])
        assert sorted(info["extra"]["overridden_tensors"]) == sorted(
            t.name for t in meta.tensors if t.layer is not None and t.layer < d)
        assert info["expert_bytes_host"] == meta.expert_bytes(d) and info.get("reset_repeats", True)
        model_bytes = sum(v for k, v in info["bytes_by_device"].items() if k.startswith("model:"))
        assert model_bytes == pytest.approx(sum(t.n_bytes for t in meta.tensors), rel=0.01)
        s = info["settings"]
        assert (s["n_batch"], s["n_ubatch"], s["threads"], s["ncmoe"]) == (64, 16, 2, 0)
        assert s["n_ctx"] == 256        # the library's, read back: it pads n_ctx to a multiple of 256
        assert s["cpu_isa"] == "avx2" and "AVX2 = 1" in s["system_info"]      # the wheel's AVX2-only build
        # this build reads the whole file into buffers once any tensor override is given
        assert s["weights"] == ("mapped" if d == 0 else "copy"), (what, d)
    assert infos[("qwen3moe", 4)]["n_overridden_tensors"] == 12 and infos[("qwen35moe", 2)]["reset_repeats"]
    s = infos[("qwen3moe", 1)]["settings"]
    assert s["compute_dtype"] == {"prefill": "f32", "decode": "f32"}
    assert (s["fmoe"], s["rtr"], s["knob_defaults"], s["repacked_tensors"]) == (1, 0, {"fmoe": 1, "rtr": 0}, 0)
    q = infos[("q4_k_m", 2)]["settings"]
    assert q["compute_dtype"]["decode"] == "f32+q8-activations"      # the F32 router, the quantized rest
    r = infos[("rtr", 2)]["settings"]
    assert (r["fmoe"], r["rtr"], r["weights"]) == (0, 1, "copy") and r["repacked_tensors"] > 0


def test_refusals(tmp_path):
    """qwen35moe with an MTP block and gemma4: one sentence before loading; an arch the library does not know
    (deepseek4): its NULL model as one sentence quoting the library's own error."""
    paths = {name: synthesize(name, tmp_path / f"{name}.gguf")
             for name in ("qwen35moe-tiny", "gemma4-tiny", "deepseek4-tiny")}
    said = conftest.isolated(conftest.for_each, load_info, {k: (p, 0) for k, p in paths.items()})
    assert "MTP" in said["qwen35moe-tiny"] and "qwen35moe" in said["qwen35moe-tiny"]
    assert "gemma4" in said["gemma4-tiny"] and "llama-cpp" in said["gemma4-tiny"]
    assert "unknown model architecture: 'deepseek4'" in said["deepseek4-tiny"]
    for text in said.values():
        assert text.count(". ") == 0 and text.endswith(".")


DOCTORED = {        # header file, text, replacement -> what the sentence must name
    "added": ("llama.h", "int32_t ncmoe;", "int32_t ncmoe;\n        int32_t ncmoe_last;",
              ("llama_model_params", "`type_k`", "`ncmoe_last`")),
    "renamed": ("llama.h", "int32_t ncmoe;", "int32_t n_cpu_moe;", ("llama_model_params", "`ncmoe`", "`n_cpu_moe`")),
    "retyped": ("llama.h", "int32_t ncmoe;", "float ncmoe;", ("llama_model_params", "`ncmoe`", "float32")),
    "widened": ("llama.h", "bool fused_moe_up_gate;", "int fused_moe_up_gate;",
                ("llama_context_params", "`fused_moe_up_gate`", "int32")),
    "dropped": ("llama.h", "int8_t       *  logits;", "", ("llama_batch", "`logits`")),
    "callback": ("ggml.h", "const char * text, void * user_data);", "int text, void * user_data);",
                 ("ggml_log_callback",)),
}


def test_struct_check_passes_the_bundled_header_and_refuses_a_doctored_one(tmp_path):
    dirs = {"bundled": INCLUDE}
    for name, (file, old, new, _) in DOCTORED.items():
        d = shutil.copytree(INCLUDE, tmp_path / name)
        text = (d / file).read_text()
        assert text.count(old) == 1, (name, old)
        (d / file).write_text(text.replace(old, new))
        dirs[name] = d
    said = conftest.isolated(conftest.for_each, layout_error, {k: (str(d),) for k, d in dirs.items()})
    assert said.pop("bundled") is None
    for name, text in said.items():
        assert text and all(w in text for w in DOCTORED[name][3]), (name, text)
        assert text.count(". ") == 0 and "make peers" in text


def test_header_parser_is_strict_and_bounded(tmp_path):
    """Untrusted header text: an oversized file is refused, an unknown field type is refused, and no text makes the
    parser slow (unterminated comments, runs of typedefs)."""
    (tmp_path / "llama.h").write_bytes(b" " * (HEADER_LIMIT + 1))
    with pytest.raises(LayoutError, match="larger than"):
        header_text(tmp_path)
    text = "struct s { int32_t a; mystery_t b; };"
    with pytest.raises(LayoutError, match="mystery_t"):
        header_struct(text, Types(text), "s")
    hostile = "typedef " * 60_000 + "(*" * 60_000 + "struct x {" * 20_000 + "/*" * 60_000
    start = time.perf_counter()
    Types(hostile)
    assert _uncommented("a /* b */ c // d\ne /* f") == "a  c \ne "
    assert time.perf_counter() - start < 5
    s = header_struct("typedef struct { char k[4]; const float * p; int8_t b; } t_t;",
                      Types(""), "t_t")
    assert [(n, getattr(s, n).offset) for n, _ in s._fields_] == [("k", 0), ("p", 8), ("b", 16)]


def test_sweep_smoke_through_the_cli(tmp_path):
    """`moebench sweep -e ik-llama-cpp` on preset:tiny at depths 0 and all: every cell ok, its layers recorded."""
    r = conftest.moebench("sweep", "-m", "preset:tiny", "-e", "ik-llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16,tg4",
                          "-r", "1", "--threads", "2", "--sample-ms", "0", "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    cells = pd.read_csv(conftest.run_dir_of(r) / "cells.csv", keep_default_na=False)
    assert cells["status"].tolist() == ["ok", "ok"], cells["error"].tolist()
    assert cells["cpu_moe_layers"].astype(str).tolist() == ["0-3", "0-3"]      # no GPU: all in host memory
    assert cells["n_overridden_tensors"].tolist() == [0, 12]
