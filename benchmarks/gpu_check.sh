#!/usr/bin/env bash
# One prepared GPU check: every CUDA path of the harness and both engines, in one run of under 9 minutes.
#
#   benchmarks/gpu_check.sh --prepare   here (network or pip cache): make .gpu/, the sources and wheels that travel
#   benchmarks/gpu_check.sh --check     read .gpu/ back (manifest, sha256, archive contents, 64 MiB limit)
#   benchmarks/gpu_check.sh --dry-run   any CPU machine (tests/test_gpu_check.py runs it): the checks, the CPU part
#                                       of every step against device=cpu, and the GPU commands with their budget
#   benchmarks/gpu_check.sh             on the GPU machine, from the repository root
#
# Preparation (once per checkout, here; again when llama-cpp-python's pin or the carried wheels change):
#   benchmarks/gpu_check.sh --prepare [--sdist llama_cpp_python-0.3.36.tar.gz]  # default: pip download (cache)
#   benchmarks/gpu_check.sh --check
# It writes .gpu/ (ignored by git through its own .gitignore "*"): llama-cpp-python-0.3.36-cuda-src.tar.xz (the
# 76 MB sdist trimmed to 738 files, 18 MB raw, 2.0 MB xz, byte-for-byte reproducible: no git history, docs,
# models, tests, tools, examples, other ggml backends, common/; two CMake defaults patched off: LLAMA_BUILD_COMMON
# and LLAVA_BUILD), wheels/gguf-0.19.0 and wheels/diskcache-5.6.3 (the only packages moebench and llama_cpp
# import that the GPU image lacks) and manifest.json (sha256 of each). It configures the trimmed tree with CMake
# and runs every compile step as a dependency scan (-M), so a file the trim dropped fails here (~4 min; --no-verify
# skips it).
#
# On a session with a GPU machine (device tool), one call, .gpu named in carry:
#   run(command="benchmarks/gpu_check.sh", carry=[".gpu"], timeout_s=600)
# It finds python3 (the image's: torch CUDA 13, pandas, ... scikit-build-core, nvidia-cublas), nvcc and cuBLAS
# (the toolkit's, else pip's nvidia/cu13), then, against one 540 s deadline (benchmarks/gpu_check/plan.py):
#   setup    untar the sources; pip install --no-index --no-deps --target /tmp/moebench-gpu-check/site the
#            wheels; moebench runs from this tree (PYTHONPATH), like tests/conftest.py runs it
#   build    llama-cpp-python 0.3.36 with CUDA, built there (16 cores): pip install --no-index
#            --no-build-isolation, CMAKE_ARGS -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=<the GPU's, e.g. 90-real>
#            -DGGML_CUDA_FA=OFF -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF (+ cuBLAS paths when
#            they come from pip); beside it, synthesize preset:qwen3-30b-a3b-4l (f16, ~5 GB, numpy only) and
#            compile the reference engine's CPU kernels. Killed at 330 s; the rest then runs without llama.cpp.
#   probe    moebench probe (H2D pageable/pinned, device bandwidth, matmul), stored for the sweep's roofline
#   tests    pytest -m gpu tests/test_gpu.py: NVML, fingerprint, llama.cpp's CUDA buffers vs moebench plan at
#            depths 0/half/all, the reference engine's bytes/paths/streaming/pinning/prefetch overlap, probe
#   sweep    -m preset:qwen3-30b-a3b-4l -e llama-cpp,reference --n-cpu-moe 0,2,all -w pp4096,pp8192,tg128
#            -r 3 (2, 1, or depths 0,all with pp4096,tg128, whichever fits the time left), then moebench report
#   pack     summary.md, steps.json, gpu-check.tar.gz (everything), pytest-gpu.txt, report.md, sweep.md,
#            probe.json, build-tail.txt into $OUT (the device tool returns at most 8 files), else reports/gpu-check/
#
# Why build there (option b), not a wheel built here (option a): here a CUDA build has 2 shared cores. Compile
# steps timed here one by one (CPU seconds, sm_90 only; cuBLAS's header stubbed): the 69 top-level .cu files 404 s
# in all (mmvq 39, mmvf 30, argsort 29, binbcast 21, the other 65 at most 11 each); 22 mmq instances ~21 s each
# (456); 16 mmf instances 11 each (181); the 33 flash-attention instances 196 with GGML_CUDA_FA=OFF (their device
# code compiled out) against 889 with it (mma ~27 s, tile ~25 s each); the 74 C/C++ steps 1-9 s each (~300).
# In all ~1,550 CPU-s without flash attention (~2,250 with it; the field note's 1.5-2 h on 2 cores is that plus
# common/ and mtmd). On the 16 cores there: ~100 s of compiling, plus CMake's configure, the link and the tail
# of the longest step: planned 230 s, killed at 330 s. A wheel made here would take ~15-20 minutes of both shared
# cores per attempt, slow everyone's measurements, and still be unproven against that machine's libraries.
# The trimmed tree was built here without CUDA the same way (pip --no-index --no-build-isolation --target: 83
# steps, imports, loads a model with --n-cpu-moe, quantizes), and --prepare dependency-scans all 218 compile
# steps with CUDA on. --flash-attn adds the flash-attention kernels (~+45 s there).
#
# What this trimmed build cannot measure: llama.cpp's CUDA flash attention (-fa on is refused; auto resolves to
# off, so its KV/compute buffers are the non-FA ones), its VMM memory pool (the legacy cudaMalloc pool is used),
# NCCL (one GPU anyway), GPUs of other architectures, and multimodal (mtmd). Ray's GPU requests cannot run
# there: Ray is not on the image and its wheel (75 MiB) exceeds what travels; tests/test_ray.py covers the
# requests themselves on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${GPU_CHECK_PYTHON:-}
if [[ -z "$PY" ]]; then
  case " $* " in
    *" --prepare "*|*" --check "*|*" --dry-run "*) [[ -x .venv/bin/python ]] && PY=.venv/bin/python || PY=python3 ;;
    *) PY=python3 ;;     # the GPU image's interpreter (torch with CUDA), not a CPU venv that may have travelled
  esac
fi
exec "$PY" benchmarks/gpu_check/run.py "$@"
