"""CUDA paths of the harness and both engines on a real NVIDIA GPU: `pytest -m gpu` (benchmarks/gpu_check.sh
runs them on the lent GPU machine). Without a CUDA device every test here is skipped, with the reason.

The helpers above the tests need no GPU: tests/test_gpu_check.py runs them on the CPU (the stream log and
its check against a real CPU run, the overlap arithmetic, the phase levels, llama.cpp's placement rule), so
what the GPU tests compute cannot rot between GPU sessions. Tolerances are the CPU tests' (tests/test_plan.py):
bytes within 2%, llama.cpp's compute buffer within 10% (an estimate). Each comparison with `moebench plan` is
its own test, so one gap in the plan shows as one failure and hides nothing else.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.base import EngineSettings
from engines.gguf_meta import ModelMeta, read_meta
from tests.conftest import for_each, isolated, llama_cpp_load

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False); these run on "
                                                  "a GPU machine: benchmarks/gpu_check.sh")]
MIB = 2**20
N_LAYERS = 4
DEPTHS = (0, N_LAYERS // 2, N_LAYERS)        # 0, half, all
LOGIT_ATOL = 1e-3                            # f32 file, f32 compute on both sides: only summation order differs


# --- helpers (CPU-runnable) ---------------------------------------------------------------------------

def gpu_model_preset():
    """f16, 4 layers, 8 experts of ff 768 x n_embd 256: each expert tensor is 3 MiB (llama.cpp's MiB log lines are
    exact; not a power of two, so a pinned allocator that rounds up shows)."""
    from engines.reference.archs import Hparams, Preset
    return Preset(Hparams("qwen3moe", N_LAYERS, 256, 4, 2, 64, 8, 2, 768, 1024), dtype="f16")


def is_gpu_buffer(name: str) -> bool:
    """llama.cpp buffer types in device memory: CUDA0, CUDA1, ... (CUDA_Host, CPU, CPU_Mapped are host memory)."""
    return name.startswith("CUDA") and name[4:].isdigit()


def llama_buffers(by_buffer: dict[str, int]) -> dict[str, dict[str, int]]:
    """LlamaCppEngine.info().bytes_by_device ("model:CUDA0": n, ...) -> {"model": {"gpu": n, "host": m}, ...}."""
    out: dict[str, dict[str, int]] = {}
    for key, n in by_buffer.items():
        kind, buft = key.split(":", 1)
        side = out.setdefault(kind, {"gpu": 0, "host": 0})
        side["gpu" if is_gpu_buffer(buft) else "host"] += n
    return out


def llama_placement(meta: ModelMeta, depth: int) -> tuple[int, int, int]:
    """(gpu, host, host span) weight bytes as llama.cpp 0.3.36 places them with n_gpu_layers=-1 and --n-cpu-moe
    depth: routed experts of layers < depth on the host, and the token embedding always on the host
    (src/llama-model.cpp: "there is very little benefit to offloading the input layer, so always keep it on the
    CPU"). With mmap the host tensors are one CPU_Mapped buffer over the file from the first of them to the end of
    the last (llama_model_loader::get_mapping_range), GPU tensors in between included: its logged size is the span."""
    on_host = [t for t in meta.tensors if t.name == "token_embd.weight" or (t.layer is not None and t.layer < depth)]
    host = sum(t.n_bytes for t in on_host)
    span = max(t.offset + t.n_bytes for t in on_host) - min(t.offset for t in on_host)
    return sum(t.n_bytes for t in meta.tensors) - host, host, span


def phase_level(samples: list[dict], phase: str, key: str) -> float:
    """The median of one sampler column over one phase (a level, not a peak: one stray sample does not move it)."""
    vals = [s[key] for s in samples if s["phase"] == phase and s[key] == s[key]]
    return statistics.median(vals) if vals else float("nan")


def overlap_ms(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of two [start, end] intervals (ms)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def overlap_fraction(pairs: list[tuple[tuple[float, float], tuple[float, float]]]) -> float:
    """For (copy, compute) interval pairs: overlapped time / the time that could have overlapped (the shorter of
    each pair), summed over pairs. 1.0: the shorter one always ran entirely beside the other; 0.0: serialized."""
    could = sum(min(c[1] - c[0], k[1] - k[0]) for c, k in pairs)
    return sum(overlap_ms(c, k) for c, k in pairs) / could if could > 0 else float("nan")


@dataclass
class StreamCall:
    layer: int
    routed: list[int]                        # the experts this batch routes to in this layer (sorted)
    copied: list[int] = field(default_factory=list)   # the experts copied into staging for this call
    prefetched: bool = False                 # its experts came from the previous layer's prefetch


@contextmanager
def stream_log(ex):
    """Record every stream-path call of MoEExecutor `ex`: which experts it routed, which were copied for it (by its
    own copy, or by the previous layer's prefetch) and whether they were prefetched."""
    calls: list[StreamCall] = []
    pending: dict[int, list[int]] = {}
    copy, stream = ex._copy_experts, ex._stream

    def logged_copy(il, b, experts):
        pending.setdefault(il, []).extend(int(e) for e in experts)
        return copy(il, b, experts)

    def logged_stream(il, x, ids, w):
        call = StreamCall(il, sorted({int(e) for e in ids.reshape(-1).tolist()}), prefetched=il in ex._prefetched)
        y = stream(il, x, ids, w)
        call.copied = pending.pop(il, [])
        calls.append(call)
        return y

    ex._copy_experts, ex._stream = logged_copy, logged_stream
    try:
        yield calls
    finally:
        del ex._copy_experts, ex._stream


def stream_problems(calls: list[StreamCall], n_expert: int) -> list[str]:
    """A call streams exactly its routed experts, in routing order of slots; a prefetched one holds the whole
    layer (slot == expert: the routing of layer i+1 is unknown while layer i runs; engines/reference/offload.py)."""
    out = []
    for i, c in enumerate(calls):
        want = list(range(n_expert)) if c.prefetched else c.routed
        if c.copied != want:
            out.append(f"call {i} (layer {c.layer}, prefetched={c.prefetched}): copied {c.copied}, expected {want}")
    return out


def streamed_bytes(calls: list[StreamCall], expert_bytes: dict[int, int]) -> int:
    return sum(len(c.copied) * expert_bytes[c.layer] for c in calls)


# --- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory) -> Path:
    from workloads.synth import synthesize
    return synthesize(gpu_model_preset(), tmp_path_factory.mktemp("gpu") / "gpu-f16.gguf")


def reference(path: Path, depth: int, device: str = "cuda", **extra):
    from engines.reference.engine import ReferenceEngine
    e = ReferenceEngine()
    dtype = extra.pop("dtype", "auto")
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=extra.pop("n_ctx", 300), n_ubatch=extra.pop("n_ubatch", 16),
                                threads=os.cpu_count() or 1, device=device, dtype=dtype, extra=extra))
    return e


def close(e) -> None:
    e.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# --- NVML and the fingerprint -------------------------------------------------------------------------

CHILD = r"""
import sys, torch
x = torch.ones(1, device="cuda"); torch.cuda.synchronize()
print("ctx", flush=True); sys.stdin.readline()
buf = torch.ones(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
print("alloc", flush=True); sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def nvml_run():
    """A child creates its CUDA context, then allocates 2048 MiB; the sampler watches it through both phases."""
    from harness.run.sampler import Sampler

    p = subprocess.Popen([sys.executable, "-c", CHILD, "2048"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    s = Sampler(p.pid, interval_ms=20)
    s.start()
    try:
        assert p.stdout.readline().strip() == "ctx"
        s.phase = "ctx"
        time.sleep(0.5)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "alloc"
        s.phase = "alloc"
        time.sleep(0.5)
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
    finally:
        samples = s.stop()
        p.kill()
    return samples


@pytest.mark.parametrize("key", ["vram_proc_mib", "vram_device_mib"])
def test_nvml_sees_a_known_allocation(nvml_run, key):
    """2048 MiB more between the phases, per process (NVML's list of the child's processes) and per device
    (used minus the baseline); within 3%. A per-process 0 means NVML lists no process of ours (pid namespaces)."""
    grown = phase_level(nvml_run, "alloc", key) - phase_level(nvml_run, "ctx", key)
    print(f"{key}: ctx {phase_level(nvml_run, 'ctx', key):.0f} MiB, alloc {phase_level(nvml_run, 'alloc', key):.0f}")
    assert grown == pytest.approx(2048, rel=0.03), f"{key} grew by {grown:.0f} MiB for a 2048 MiB allocation"


def test_gpu_fingerprint():
    from engines.devices import gpus
    from harness.hw.host import fingerprint

    g = gpus()
    print(g)
    assert len(g) == torch.cuda.device_count() >= 1
    props = torch.cuda.get_device_properties(0)
    assert g[0]["name"] == torch.cuda.get_device_name(0) and g[0]["uuid"].startswith("GPU-") and g[0]["driver"]
    assert g[0]["vram_mib"] == pytest.approx(props.total_memory / MIB, rel=0.01)
    assert fingerprint()["gpu_name"] == g[0]["name"]


# --- llama.cpp (CUDA build) ---------------------------------------------------------------------------

def test_llama_cpp_is_a_cuda_build():
    import llama_cpp
    assert llama_cpp.llama_supports_gpu_offload(), f"{llama_cpp.__file__} is a CPU build"
    assert "CUDA" in llama_cpp.llama_print_system_info().decode()


@pytest.fixture(scope="module")
def llama_infos(gpu_model):
    """llama.cpp's info() at depths 0, half, all (flash attention off: the plan is asked for the same)."""
    loads = isolated(for_each, llama_cpp_load, {
        d: (gpu_model, EngineSettings(n_cpu_moe=d, n_ctx=300, threads=os.cpu_count() or 1, flash_attn="off"))
        for d in DEPTHS})
    return {d: info for d, (info, _) in loads.items()}


def llama_plan(meta, depth: int):
    from harness.planning.plan import PlanSettings, make_plan
    return make_plan(meta, PlanSettings(engine="llama-cpp", n_ctx=300, flash_attn="off", device="cuda")).at(depth)


@pytest.mark.parametrize("depth", DEPTHS)
def test_llama_cuda_placement(gpu_model, llama_infos, depth):
    """What llama.cpp put where, against its own placement rule (llama_placement) and the override it was given."""
    meta, info = read_meta(gpu_model), llama_infos[depth]
    b = llama_buffers(info.bytes_by_device)
    print(depth, info.bytes_by_device)
    assert sorted(info.extra["overridden_tensors"]) == sorted(t.name for t in meta.tensors
                                                              if t.layer is not None and t.layer < depth)
    gpu, _, span = llama_placement(meta, depth)
    assert b["model"]["gpu"] == pytest.approx(gpu, rel=0.02), f"GPU model buffers {b['model']}, expected {gpu}"
    assert b["model"]["host"] == pytest.approx(span, rel=0.02), f"host model buffers {b['model']}, span {span}"
    assert b["kv"]["host"] == 0 and b["compute"]["gpu"] > 0, f"KV {b['kv']}, compute {b['compute']}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_plan_llama_cuda_model_buffer(gpu_model, llama_infos, depth):
    d, b = llama_plan(read_meta(gpu_model), depth), llama_buffers(llama_infos[depth].bytes_by_device)
    assert b["model"]["gpu"] == pytest.approx(d.non_expert_bytes + d.expert_accel_bytes, rel=0.02), \
        "plan's accelerator weights differ from llama.cpp's CUDA model buffer (token_embd stays on the CPU?)"


@pytest.mark.parametrize("depth", DEPTHS)
def test_plan_llama_cuda_kv_buffer(gpu_model, llama_infos, depth):
    d, b = llama_plan(read_meta(gpu_model), depth), llama_buffers(llama_infos[depth].bytes_by_device)
    assert b["kv"]["gpu"] == pytest.approx(d.kv_bytes, rel=0.02), f"CUDA KV {b['kv']}, plan {d.kv_bytes}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_plan_llama_cuda_compute_buffer(gpu_model, llama_infos, depth):
    d, b = llama_plan(read_meta(gpu_model), depth), llama_buffers(llama_infos[depth].bytes_by_device)
    assert b["compute"]["gpu"] == pytest.approx(d.compute_bytes, rel=0.10), \
        f"CUDA compute buffer {b['compute']['gpu'] / MIB:.2f} MiB, plan {d.compute_bytes / MIB:.2f} MiB"


@pytest.mark.parametrize("depth", DEPTHS)
def test_plan_llama_host_bytes(gpu_model, llama_infos, depth):
    meta = read_meta(gpu_model)
    d, b = llama_plan(meta, depth), llama_buffers(llama_infos[depth].bytes_by_device)
    _, host, span = llama_placement(meta, depth)
    assert b["model"]["host"] == pytest.approx(d.host_bytes, rel=0.02), \
        (f"llama.cpp's host model buffers {b['model']['host'] / MIB:.2f} MiB (host weights {host / MIB:.2f} MiB, "
         f"mapped span {span / MIB:.2f} MiB), plan {d.host_bytes / MIB:.2f} MiB")


def llama_cuda_rows(path: Path, depth: int, toks: list[int]) -> np.ndarray:
    """llama.cpp's last logits after prefilling toks[:64], then after decoding each of the rest. Run it isolated()."""
    from engines.llama_cpp import LlamaCppEngine

    e = LlamaCppEngine()
    e.load(path, EngineSettings(n_cpu_moe=depth, n_ctx=128, threads=os.cpu_count() or 1, flash_attn="off"))
    e.prefill(toks[:64])
    rows = [np.array(e.logits())]
    for t in toks[64:]:
        e.decode(t)
        rows.append(np.array(e.logits()))
    e.close()
    return np.stack(rows)


def test_llama_cuda_runs_the_same_at_depth_0_and_all(gpu_model):
    """A 64-token prefill (op offload: the host experts are copied to the GPU for a batch >= 32) and 4 decodes (the
    host experts computed on the CPU) at depth all give about the logits of depth 0 (f16 weights; cuBLAS and the
    CPU kernels round differently, so: close, and the same top token in at least 4 of the 5 rows)."""
    toks = [int(t) for t in np.random.default_rng(3).integers(0, 1024, 68)]
    out = isolated(for_each, llama_cuda_rows, {d: (gpu_model, d, toks) for d in (0, N_LAYERS)})
    diff = np.abs(out[0] - out[N_LAYERS]).max(axis=-1)
    print(f"max |logit diff| per row, depth 0 vs all: {np.round(diff, 4)}")
    assert np.isfinite(out[0]).all() and np.isfinite(out[N_LAYERS]).all()
    assert diff.max() < 0.25 and (out[0].argmax(-1) == out[N_LAYERS].argmax(-1)).mean() >= 0.8


# --- the reference engine on CUDA ---------------------------------------------------------------------

@pytest.mark.parametrize("depth", DEPTHS)
def test_reference_cuda_bytes_match_plan_and_the_allocator(gpu_model, depth):
    from harness.planning.plan import PlanSettings, make_plan

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    e = reference(gpu_model, depth)
    allocated = torch.cuda.memory_allocated() - before
    held, info = e.info().extra["held_bytes"], e.info()
    close(e)
    d = make_plan(read_meta(gpu_model), PlanSettings(engine="reference", n_ctx=300, device="cuda")).at(depth)
    assert info.settings["device"].startswith("cuda") and info.settings["dtype"] == "f16"
    assert held["experts"].get("host", 0) == pytest.approx(d.expert_host_bytes, rel=0.02)
    assert held["experts"].get("accelerator", 0) == pytest.approx(d.expert_accel_bytes, rel=0.02)
    assert held["non_experts"]["accelerator"] == pytest.approx(d.non_expert_bytes, rel=0.02)
    assert held["kv_cache"]["accelerator"] == pytest.approx(d.kv_bytes, rel=0.02)
    assert held["staging"]["accelerator"] == d.staging_bytes
    # what torch's allocator holds is what the ledger says is on the accelerator (+ RoPE tables, lookup tables)
    assert allocated == pytest.approx(info.bytes_by_device["accelerator"], rel=0.02, abs=MIB)


@pytest.mark.parametrize("depth", DEPTHS[1:])
def test_reference_host_experts_are_pinned(gpu_model, depth):
    e = reference(gpu_model, depth)
    try:
        for i, s in enumerate(e.moe.layers):
            for m in s.matrices:
                assert m.raw.is_pinned() == (i < depth) and m.raw.is_cuda == (i >= depth), (i, m.raw.device)
        assert e.info().extra["host_pinned"] is True
    finally:
        close(e)


def pinned_in_use() -> int:
    """Bytes of the blocks torch's caching host allocator has handed out (rounded block sizes)."""
    stats = torch.cuda.host_memory_stats()
    return int(next((stats[k] for k in ("active_bytes.current", "allocated_bytes.current") if k in stats), 0))


def test_pinned_host_memory_is_not_rounded_up(gpu_model):
    """The page-locked memory that torch's caching host allocator hands out for the host experts, against the host
    bytes the ledger books (and the RAM columns imply): within 5%. The allocator rounds every block up to a power of
    two (these 3 MiB tensors take 4 MiB; a 403 MB expert tensor of qwen3-30b-a3b-4l takes 512 MiB)."""
    before = pinned_in_use()
    e = reference(gpu_model, N_LAYERS)
    pinned = pinned_in_use() - before
    host = e.info().extra["held_bytes"]["experts"]["host"]
    close(e)
    print(f"pinned by torch's host allocator: {pinned / MIB:.1f} MiB for {host / MIB:.1f} MiB of host experts")
    assert pinned <= 1.05 * host, f"{pinned / MIB:.1f} MiB page-locked for {host / MIB:.1f} MiB of host experts"


def test_reference_cuda_dequant_scratch_is_bounded(tmp_path):
    """Resident quantized weights are dequantized per product "into a scratch of the compute dtype"
    (models/transformer.py). The VRAM a short prefill + decode needs beyond the loaded engine, against the
    largest matrix in the compute dtype: within 2x (one scratch plus the product's output). The decoders'
    float32 intermediates (4-9 bytes a value, engines/reference/dequant.py) would show here: on a real
    Qwen3-30B-A3B output head (151936 x 2048) that is GBs."""
    from dataclasses import replace

    from workloads.synth import synthesize
    p = gpu_model_preset()                 # with a 32K vocabulary: the output head (32768 x 256) is the largest matrix
    path = synthesize(replace(p, h=replace(p.h, n_vocab=32768), dtype="q4_k_m"), tmp_path / "q4km.gguf")
    e = reference(path, 0, n_ctx=64)
    for _ in range(2):                     # the first pass creates cuBLAS workspaces, lookup tables, caches
        e.reset()
        torch.cuda.synchronize()
        loaded = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        e.prefill(list(range(16)))
        for t in range(4):
            e.decode(t)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - loaded
    largest = max(t.shape[0] * t.shape[1] for t in read_meta(path).tensors if len(t.shape) == 2)
    close(e)
    scratch = 2 * largest * 2                                  # f16/bf16 compute dtype
    print(f"VRAM beyond the loaded engine: {extra / MIB:.2f} MiB; largest matrix in the compute dtype "
          f"{largest * 2 / MIB:.2f} MiB")
    assert extra <= scratch + MIB, f"{extra / MIB:.2f} MiB of scratch for a {largest * 2 / MIB:.2f} MiB matrix"


CASES = [(0, "auto"), (N_LAYERS // 2, "host"), (N_LAYERS // 2, "stream"), (N_LAYERS, "host"), (N_LAYERS, "stream")]


@pytest.mark.parametrize("depth,path", CASES)
def test_reference_cuda_logits_match_the_cpu(tiny, depth, path):
    """Every position of a 40-token prefill (3 ubatches) and 3 decodes: CUDA (host or stream path for the
    offloaded layers) against the same engine on the CPU, f32 file and compute on both."""
    toks = [int(t) for t in np.random.default_rng(7).integers(0, 1024, 43)]

    def logits(device):
        e = reference(tiny, depth, device, moe_path=path, logits_all=True, n_ctx=64)
        e.prefill(toks[:40])
        rows = [e.logits().float().cpu().numpy()]
        for t in toks[40:]:
            e.decode(t)
            rows.append(e.logits().float().cpu().numpy())
        calls = e.counters()
        close(e) if device == "cuda" else e.close()
        return np.concatenate(rows), calls

    cpu, _ = logits("cpu")
    gpu, calls = logits("cuda")
    if depth:
        assert calls[f"moe_calls_{path}"] > 0
    assert np.abs(gpu - cpu).max() < LOGIT_ATOL and (gpu.argmax(-1) == cpu.argmax(-1)).all()


def test_auto_path_switches_at_stream_min_batch(tiny):
    """With CUDA, auto streams an offloaded layer's experts for batches of at least moe_stream_min_batch tokens
    and runs smaller ones on the host: ubatches 16, 16, 8 at depth 2 of 4."""
    e = reference(tiny, 2, moe_stream_min_batch=16, n_ctx=64)
    try:
        e.prefill([int(t) for t in np.random.default_rng(7).integers(0, 1024, 40)])
        c = e.counters()
    finally:
        close(e)
    assert (c["moe_calls_stream"], c["moe_calls_host"], c["moe_calls_resident"]) == (4, 2, 6)


def test_stream_copies_exactly_the_routed_experts(tiny):
    from engines.reference.archs import PRESETS

    e = reference(tiny, N_LAYERS, moe_path="stream", logits_all=True, n_ctx=64)
    try:
        with stream_log(e.moe) as calls:
            e.prefill([int(t) for t in np.random.default_rng(5).integers(0, 1024, 40)])
        c = e.counters()
        sizes = {i: s.expert_bytes for i, s in enumerate(e.moe.layers)}
    finally:
        close(e)
    assert len(calls) == 3 * N_LAYERS and stream_problems(calls, PRESETS["tiny"].h.n_expert) == []
    assert sum(x.prefetched for x in calls) == c["prefetched_layers"] == 3 * (N_LAYERS - 1)    # all but layer 0
    assert c["streamed_bytes"] == streamed_bytes(calls, sizes)
    per_ubatch = [streamed_bytes(calls[i:i + N_LAYERS], sizes) for i in range(0, len(calls), N_LAYERS)]
    print(f"streamed bytes per ubatch: {per_ubatch}")


def overlap_model(tmp_path_factory) -> Path:
    """The sweep's model when the check synthesized it (MOEBENCH_GPU_CHECK_MODEL), else 2 layers of its shapes."""
    if os.environ.get("MOEBENCH_GPU_CHECK_MODEL"):
        return Path(os.environ["MOEBENCH_GPU_CHECK_MODEL"])
    from dataclasses import replace

    from engines.reference.archs import PRESETS
    from workloads.synth import synthesize
    p = PRESETS["qwen3-30b-a3b-4l"]
    return synthesize(replace(p, h=replace(p.h, n_layers=2)), tmp_path_factory.mktemp("big") / "big.gguf")


def test_prefetch_overlaps_copy_with_compute(tmp_path_factory, monkeypatch):
    """CUDA events around every expert copy (on the copy stream) and every layer's expert compute (on the compute
    stream) of a 1024-token prefill at depth all on the stream path: the prefetch of layer i+1, issued just before
    layer i's compute, must run beside it."""
    from engines.reference import offload

    path = overlap_model(tmp_path_factory)
    e = reference(path, read_meta(path).n_layers, moe_path="stream", n_ctx=1100, n_ubatch=512)
    toks = [int(t) for t in np.random.default_rng(1).integers(0, e.cfg.n_vocab, 1024)]
    ex, events, current = e.moe, [], {}
    grouped, copy, stream = offload.grouped_experts, ex._copy_experts, ex._stream

    def timed(kind, il, fn, *a):
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()                         # on the current stream: the copy stream inside the executor's copies
        y = fn(*a)
        t.record()
        events.append((kind, il, s, t))
        return y

    try:
        e.prefill(toks)                    # warm-up: cuBLAS handles, the allocator, pinned pages
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        monkeypatch.setattr(offload, "grouped_experts", lambda *a: timed("compute", current["il"], grouped, *a))
        ex._copy_experts = lambda il, b, experts: timed("copy", il, copy, il, b, experts)
        ex._stream = lambda il, *a: (current.update(il=il), stream(il, *a))[1]
        e.reset()
        e.prefill(toks)
        torch.cuda.synchronize()
        spans = [(k, il, (ref.elapsed_time(s), ref.elapsed_time(t))) for k, il, s, t in events]
    finally:
        close(e)
    pairs, last = [], None
    for kind, il, span in spans:           # host order: copy(il + 1) is issued inside layer il, just before its compute
        if kind == "copy":
            last = (il, span)
        else:
            if last is not None and last[0] == il + 1:
                pairs.append((last[1], span))
            last = None
    for c, k in pairs:
        print(f"prefetch {c[1] - c[0]:7.2f} ms  compute {k[1] - k[0]:7.2f} ms  overlap {overlap_ms(c, k):7.2f} ms")
    frac = overlap_fraction(pairs)
    print(f"overlap fraction {frac:.2f} over {len(pairs)} layer pairs")
    assert pairs and frac >= 0.5, f"the prefetch overlapped only {frac:.0%} of the time it could"


# --- the probe ----------------------------------------------------------------------------------------

def test_probe_measures_the_cuda_figures():
    from harness.hw.probe import figure, measure

    p = measure(quick=True)
    figs = {k: figure(p, k) for k in ("h2d_pageable_gbps", "h2d_pinned_gbps", "gpu_mem_gbps",
                                      "gpu_matmul_bf16_gflops", "gpu_matmul_fp32_gflops")}
    print(figs, p.get("gpu_name"), p.get("vram_total_mib"))
    assert p["cuda"] and p["vram_total_mib"] > 0
    assert 1 < figs["h2d_pageable_gbps"] < 200 and 1 < figs["h2d_pinned_gbps"] < 200
    assert figs["h2d_pinned_gbps"] >= 0.8 * figs["h2d_pageable_gbps"]       # page-locked is never much slower
    assert 100 < figs["gpu_mem_gbps"] < 20_000
    assert figs["gpu_matmul_bf16_gflops"] > figs["gpu_matmul_fp32_gflops"] > 1_000


def test_probe_pageable_h2d_reads_real_memory():
    """The probe copies from `torch.empty` host memory it never wrote: every page maps the kernel's shared zero page,
    so the driver's staging memcpy reads one cached page instead of DRAM. Same copy from written memory: the
    never-written source must not look more than 15% faster."""
    size = 256 * MIB
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")

    def gbps(src):
        dev.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            dev.copy_(src)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return size / statistics.median(times) / 1e9

    untouched, written = gbps(torch.empty(size, dtype=torch.uint8)), gbps(torch.ones(size, dtype=torch.uint8))
    print(f"pageable H2D: never-written source {untouched:.1f} GB/s, written source {written:.1f} GB/s")
    assert untouched <= 1.15 * written
