"""The reference engine against llama.cpp (same synthesized files), across depths, paths and file types."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engines.base import EngineSettings
from engines.errors import UserError
from engines.reference.engine import ReferenceEngine
from workloads.synth import PRESETS, preset, synthesize, tensor_shapes, write_metadata
from tests import conftest

# llama.cpp keeps its KV cache in f16, so its f32-file logits differ from ours by ~2e-3 (logits are
# O(4) here); 2e-2 is ten times that and still far below the gap between the top two tokens.
LOGIT_ATOL = 2e-2
TINY = PRESETS["tiny"]       # qwen3moe, 4 layers, n_embd 128, 8 experts top-2, f32
H = TINY.h
ARCH_PRESETS = {
    "qwen3moe": TINY,
    "qwen2moe": preset(TINY, arch="qwen2moe", n_ff_shexp=96),
    "olmoe": preset(TINY, arch="olmoe", n_head_kv=H.n_head),   # llama.cpp: no GQA for olmoe
    "llama": preset(TINY, arch="llama", rope_base=10000.0),       # Mixtral-style llama with experts
}
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, H.n_vocab, 40)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ref_models")
    return {arch: synthesize(p, d / f"{arch}.gguf") for arch, p in ARCH_PRESETS.items()}


def run_ref(path: Path, depth: int, tokens=PROMPT, **extra) -> tuple[np.ndarray, ReferenceEngine]:
    e = ReferenceEngine()
    extra.setdefault("logits_all", True)
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=256, n_ubatch=16, threads=2, dtype=extra.pop("dtype", "auto"),
                                extra=extra))
    e.prefill(tokens)
    return e.logits().numpy(), e


@pytest.fixture(scope="module")
def llama(models) -> dict[str, np.ndarray]:
    """llama.cpp's logits at every position of PROMPT, per architecture: one child process for all."""
    calls = {arch: (path, PROMPT) for arch, path in models.items()}
    return conftest.isolated(conftest.for_each, conftest.llama_cpp_logits, calls, n_ctx=256, n_threads=2)


@pytest.mark.parametrize("arch", list(ARCH_PRESETS))
def test_logits_match_llama_cpp_at_depth_0_and_all(models, llama, arch):
    """Every position's logits within LOGIT_ATOL of llama.cpp's and the same top-1, at depth 0 and all.
    n_ubatch 16 < 40 tokens, so later ubatches exercise the KV cache and the offset causal mask."""
    ref = llama[arch]
    for depth in (0, H.n_layers):
        got, e = run_ref(models[arch], depth)
        assert got.shape == ref.shape == (len(PROMPT), H.n_vocab)
        err = np.abs(got - ref).max()
        assert err < LOGIT_ATOL, f"{arch} depth {depth}: max |logit diff| {err}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        assert e.info().expert_host_fraction == depth / H.n_layers


def greedy(path: Path, depth: int, n: int = 32) -> list[int]:
    e = ReferenceEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=128, n_ubatch=16, threads=2))
    return conftest.greedy(e, PROMPT[:8], n)


def test_greedy_continuation_identical_at_depths_0_half_all(models):
    seqs = {d: greedy(models["qwen3moe"], d) for d in (0, H.n_layers // 2, H.n_layers)}
    assert len(seqs[0]) == 32 and len(set(seqs[0])) > 1          # a real continuation, not one token
    assert seqs[0] == seqs[2] == seqs[4]


def test_decode_matches_prefill_logits(models):
    """Decoding token by token gives the logits that prefilling the same tokens does (KV cache, RoPE). An f32
    cache: in the default f16 one, the last-bit differences between one-row and many-row products flip
    some cached values by an f16 step (measured: logits then differ by 2.6e-4)."""
    full, _ = run_ref(models["qwen2moe"], 0, PROMPT[:12], cache_type="f32")
    e = ReferenceEngine()
    e.load(models["qwen2moe"], EngineSettings(n_ctx=64, threads=2, extra={"cache_type": "f32"}))
    e.prefill(PROMPT[:4])
    for i, t in enumerate(PROMPT[4:12]):
        e.decode(t)
        np.testing.assert_allclose(e.logits()[0].numpy(), full[4 + i], atol=1e-4)


# llama.cpp 0.3.36's graphs (src/models/*.cpp): these keep only the output rows (inp_out_ids) from the last layer's
# attention on; gemma4.cpp, openai-moe.cpp and qwen35moe.cpp keep every row through the last layer (they prune there
# only for masked next-n embeddings) and drop rows before the output norm
PRUNES_LAST_LAYER = {"qwen3moe": True, "qwen2moe": True, "olmoe": True, "llama": True,
                     "gemma4-tiny": False, "gpt-oss-tiny": False, "qwen35moe-tiny": False}


class RowsSeen:
    """The engine's real MoE executor, noting how many rows each layer's call gets."""

    def __init__(self, moe):
        self.moe, self.rows = moe, {}

    def __call__(self, il, x, ids, w):
        self.rows.setdefault(il, []).append(x.shape[0])
        return self.moe(il, x, ids, w)

    def __getattr__(self, name):
        return getattr(self.moe, name)


@pytest.mark.parametrize("arch", list(PRUNES_LAST_LAYER))
def test_the_last_layer_runs_the_rows_llama_cpp_runs(models, tmp_path, arch):
    """40 prompt tokens in ubatches of 16, only the last token's logits wanted: where llama.cpp prunes, the last MoE
    layer runs that one row and nothing in the earlier ubatches, elsewhere (and in every other layer) every row.
    The logits are those of an every-position run at that position, and a decode step after the pruned prefill
    reads the last layer's K/V of every token: the same logits as after an unpruned one. A routing trace records
    every token's routing, so a traced run keeps every row."""
    path = models[arch] if arch in models else synthesize(arch, tmp_path / f"{arch}.gguf")
    prompt = [t % (PRESETS[arch].h.n_vocab if arch in PRESETS else H.n_vocab) for t in PROMPT]
    runs = {}
    for name, extra in {"pruned": {}, "all": {"logits_all": True},
                        "traced": {"trace_routing": str(tmp_path / "t.npz")}}.items():
        e = ReferenceEngine()
        e.load(path, EngineSettings(n_ctx=64, n_ubatch=16, threads=2, extra={"cache_type": "f32"} | extra))
        e.model.moe = spy = RowsSeen(e.model.moe)
        e.trace_segment("pp40", prompt)
        e.prefill(prompt)
        e.trace_segment(None)
        rows, last_logits = {il: r.copy() for il, r in spy.rows.items()}, e.logits()[-1].numpy()
        e.decode(prompt[0])
        runs[name] = (rows, last_logits, e.logits()[0].numpy())
    rows = runs["pruned"][0]
    last = max(rows)
    assert all(r == [16, 16, 8] for il, r in rows.items() if il != last) and len(rows) > 1
    assert rows[last] == ([1] if PRUNES_LAST_LAYER[arch] else [16, 16, 8])
    assert runs["all"][0][last] == runs["traced"][0][last] == [16, 16, 8]
    for a, b in zip(runs["pruned"][1:], runs["all"][1:]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_host_and_stream_paths_give_the_same_output(models):
    host, eh = run_ref(models["qwen3moe"], H.n_layers, moe_path="host")
    stream, es = run_ref(models["qwen3moe"], H.n_layers, moe_path="stream")
    ch, cs = eh.counters(), es.counters()
    assert ch["moe_calls_host"] == 3 * H.n_layers and ch["moe_calls_stream"] == 0   # 3 ubatches x 4 layers
    assert cs["moe_calls_stream"] == 3 * H.n_layers and cs["moe_calls_host"] == 0
    # only the routed experts travel: at most n_expert per layer and ubatch, bytes match the expert size
    assert 0 < cs["streamed_experts"] <= 3 * H.n_layers * H.n_expert
    assert cs["streamed_bytes"] == cs["streamed_experts"] * 3 * H.n_ff_exp * H.n_embd * 4
    np.testing.assert_allclose(stream, host, atol=1e-5)
    assert es.info().bytes_by_device["accelerator"] - eh.info().bytes_by_device["accelerator"] == \
        H.n_expert * 3 * H.n_ff_exp * H.n_embd * 4          # one staging buffer = one layer's experts


def test_auto_path_never_streams_without_cuda(models):
    """Without CUDA the accelerator is the same RAM: auto keeps offloaded experts on the host path at every
    batch size, with no staging buffer (test_gpu checks the switch at moe_stream_min_batch on a GPU)."""
    _, e = run_ref(models["qwen3moe"], 2, moe_stream_min_batch=16)   # ubatches 16, 16, 8
    c = e.counters()
    assert (c["moe_calls_stream"], c["moe_calls_host"], c["moe_calls_resident"]) == (0, 6, 6)
    assert e.moe.staging_bytes == 0 and e.info().extra["held_bytes"]["staging"] == {"accelerator": 0}


def test_info_reports_placement_and_bytes(models):
    _, e = run_ref(models["qwen3moe"], 1)
    info = e.info()
    layer_experts = 3 * H.n_expert * H.n_ff_exp * H.n_embd * 4
    assert info.engine == "reference" and info.settings["n_cpu_moe"] == 1 and info.settings["dtype"] == "f32"
    assert info.extra["malloc_keeps_freed"] is True         # glibc here
    assert info.expert_bytes_host == layer_experts and info.expert_bytes_total == 4 * layer_experts
    assert info.n_overridden_tensors == 3
    assert info.bytes_by_device["host"] == layer_experts
    held, stored = info.extra["held_bytes"], info.extra["file_bytes"]
    assert held["experts"] == stored["experts"] == {"host": layer_experts, "accelerator": 3 * layer_experts}
    assert held["non_experts"]["accelerator"] == stored["non_experts"]["accelerator"]   # f32 file, f32 compute
    kv = 2 * H.n_layers * H.n_head_kv * 256 * H.head_dim * 2             # f16, as llama.cpp's
    assert held["kv_cache"] == {"accelerator": kv}
    # CPU-only: the host experts get all the run's threads (TensorSharp's cpus/2 cap is for a GPU run)
    assert info.settings["extra"]["cpu_moe_threads"] == 2 and info.extra["cpu_moe_threads_rule"].startswith("threads")
    _, e = run_ref(models["qwen3moe"], 1, cpu_moe_threads=1)
    assert e.info().settings["extra"]["cpu_moe_threads"] == 1


KEEP_FREED_CHILD = """
import ctypes, resource, sys
from engines.reference.engine import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
kept = sys.argv[1] == "1" and keep_freed_memory()
def faults(n=16 << 20):                 # an op's output: taken, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(kept, faults())
"""


@pytest.mark.parametrize("keep", [True, False])
def test_freed_blocks_keep_their_pages(keep):
    """keep_freed_memory (what load() sets, reported as malloc_keeps_freed): a 16 MiB block freed and taken again
    faults no pages in (glibc keeps it in the heap); without it each take faults its 4096 pages in again."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", KEEP_FREED_CHILD, "1" if keep else "0"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, check=True)
    kept, faults = r.stdout.split()
    assert kept == str(keep)
    assert int(faults) < 256 if keep else int(faults) > 2048, r.stdout


def test_depth_from_environment(models, monkeypatch):
    monkeypatch.setenv("TS_N_CPU_MOE", "3")
    e = ReferenceEngine()
    e.load(models["qwen3moe"], EngineSettings(n_cpu_moe=0, n_ctx=32, extra={"depth_from_env": True}))
    assert e.info().settings["n_cpu_moe"] == 3
    monkeypatch.setenv("TS_N_CPU_MOE", "")
    monkeypatch.setenv("TS_CPU_MOE", "1")
    e.load(models["qwen3moe"], EngineSettings(n_cpu_moe=0, n_ctx=32, extra={"depth_from_env": True}))
    assert e.info().expert_host_fraction == 1.0


def test_bf16_compute_stays_close_to_f32(models):
    f32, _ = run_ref(models["qwen3moe"], 0)
    bf16, e = run_ref(models["qwen3moe"], 0, dtype="bf16")
    assert e.info().settings["dtype"] == "bf16"
    assert np.abs(bf16 - f32).max() < 0.15 and (bf16.argmax(-1) == f32.argmax(-1)).mean() >= 0.9


# --- quantized files ---------------------------------------------------------------------------------

def write_gguf(path: Path, p, arrays: dict[str, np.ndarray], quant: dict[str, tuple[np.ndarray, object]]) -> Path:
    """A GGUF with p's metadata: float arrays as F32, `quant` entries as raw (bytes, type) tensors."""
    import gguf
    w = gguf.GGUFWriter(path, p.h.arch)
    write_metadata(w, p.h, "ref-test")
    for name, shape in tensor_shapes(p).items():
        if name in quant:
            data, qt = quant[name]
            w.add_tensor(name, data, raw_dtype=qt)      # uint8 blocks: gguf derives the shape
        else:
            w.add_tensor(name, arrays[name])
    finish(w)
    return path


def finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_q4_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K blocks (144 bytes per 256 values): random nibbles and 6-bit scales, finite f16 d/dmin."""
    n_blocks = int(np.prod(shape)) // 256
    blocks = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((n_blocks, 1), 2e-4, np.float16).view(np.uint8)   # d
    blocks[:, 2:4] = np.full((n_blocks, 1), 4e-4, np.float16).view(np.uint8)   # dmin
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quantized_experts_are_held_as_stored(tmp_path, qtype):
    """Expert tensors stored quantized stay in their stored bytes (held == file bytes, no expanded copy)
    and give the logits of an F32 file holding exactly their dequantized values, up to the activations'
    rounding: one-token and small-batch products quantize them to int8 per block, as ggml's do (which
    moves a few positions' logits by a few tenths here, llama.cpp's as much as ours)."""
    import gguf
    qt = gguf.GGMLQuantizationType[qtype]
    p = preset(TINY, n_embd=256, n_head=4, head_dim=64, n_ff_exp=256, n_layers=2)   # K-quant rows of 256
    rng = np.random.default_rng(3)
    arrays = {n: (rng.standard_normal(s) * (s[-1] ** -0.5 if len(s) > 1 else 0.05) + (len(s) == 1)).astype(np.float32)
              for n, s in tensor_shapes(p).items()}
    quant = {n: (random_q4_k(s, rng) if qtype == "Q4_K" else gguf.quants.quantize(arrays[n], qt), qt)
             for n, s in tensor_shapes(p).items() if "_exps" in n}
    qpath = write_gguf(tmp_path / "q.gguf", p, arrays, quant)
    deq = {n: gguf.quants.dequantize(b, qt) for n, (b, _) in quant.items()}
    fpath = write_gguf(tmp_path / "f.gguf", p, arrays | deq, {})
    tokens = PROMPT[:20]
    q_logits, e = run_ref(qpath, 1, tokens, dtype="f32")
    f_logits, _ = run_ref(fpath, 1, tokens, dtype="f32")
    diff = np.abs(q_logits - f_logits)      # logits O(4); llama.cpp on the same files: max 0.045 (Q8_0), 0.30 (Q4_K)
    assert np.isfinite(q_logits).all() and np.median(diff) < 0.01 and diff.max() < 0.5, (np.median(diff), diff.max())
    assert (q_logits.argmax(-1) == f_logits.argmax(-1)).mean() >= 0.9
    info = e.info().extra
    assert info["file_bytes"]["experts"] == info["held_bytes"]["experts"]          # as stored, host and accelerator
    host = sum(b.nbytes for n, (b, _) in quant.items() if n.startswith("blk.0."))
    assert info["held_bytes"]["experts"]["host"] == host


# --- bad input -----------------------------------------------------------------------------------------

def test_unsupported_architecture_is_a_user_error(tmp_path):
    import gguf
    p = preset(TINY, n_layers=1)
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "phimoe")      # an MoE file of an architecture we do not run
    write_metadata(w, p.h, "x")
    for name, shape in tensor_shapes(p).items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    finish(w)
    with pytest.raises(UserError, match="architecture 'phimoe'.*qwen3moe, qwen2moe, olmoe, llama"):
        ReferenceEngine().load(tmp_path / "x.gguf", EngineSettings(n_ctx=32))
    w = gguf.GGUFWriter(tmp_path / "dense.gguf", "llama")   # a supported arch, but no experts
    write_metadata(w, replace(p.h, arch="llama"), "dense")
    w.add_tensor("token_embd.weight", np.zeros((p.h.n_vocab, p.h.n_embd), np.float32))
    finish(w)
    with pytest.raises(UserError, match="without routed experts.*qwen3moe, qwen2moe, olmoe, llama"):
        ReferenceEngine().load(tmp_path / "dense.gguf", EngineSettings(n_ctx=32))


def test_shape_mismatch_and_bad_settings_are_user_errors(tmp_path, models):
    arrays = {n: np.zeros(s, np.float32) for n, s in tensor_shapes(preset(TINY, n_ff_exp=32)).items()}
    bad = write_gguf(tmp_path / "bad.gguf", TINY, arrays, {})      # metadata says ff 64, tensors hold 32
    with pytest.raises(UserError, match="ffn_gate_exps.weight.*shape"):
        ReferenceEngine().load(bad, EngineSettings(n_ctx=32))
    with pytest.raises(UserError, match="larger than the model's 4 layers"):
        ReferenceEngine().load(models["qwen3moe"], EngineSettings(n_cpu_moe=5, n_ctx=32))
    with pytest.raises(UserError, match="moe_path"):
        ReferenceEngine().load(models["qwen3moe"], EngineSettings(n_ctx=32, extra={"moe_path": "gpu"}))
    with pytest.raises(UserError, match="cache_type 'q8_0' is not one of f16, f32"):
        ReferenceEngine().load(models["qwen3moe"], EngineSettings(n_ctx=32, extra={"cache_type": "q8_0"}))
    e = ReferenceEngine()
    e.load(models["qwen3moe"], EngineSettings(n_ctx=8))
    with pytest.raises(UserError, match="context"):
        e.prefill(list(range(9)))
