"""What tells the llama.cpp family's llama-bench builds apart, read without running a model: a build's --help (its
flags, output formats, fork), the source checkout it was built in (fork, git commit), and what ik_llama.cpp's CPU path
does with weights (from its source: ggml/src/ggml.c, ggml/src/iqk/, src/llama-load-tensors.cpp, src/llama.cpp).
"""
from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from engines.base import Q8_ACTIVATIONS, expert_layer, joined
from engines.external import ExternalError
from engines.gguf_meta import ModelMeta

IK, UPSTREAM = "ik_llama.cpp", "llama.cpp"     # the forks whose llama-bench the llama-bench engine drives


# --- one build: its --help, its checkout ------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchHelp:
    """A llama-bench build's --help: the flags and output formats it takes."""
    text: str

    def has(self, *names: str) -> str | None:
        """The first of `names` the help lists as a flag, else None."""
        return next((n for n in names if re.search(rf"(^|[\s,]){re.escape(n)}[\s,]", self.text, re.M)), None)

    def output_format(self, binary: Path) -> str:
        """`-o jsonl` where the build lists it, else `-o json` (older builds, ik_llama.cpp)."""
        m = re.search(r"-o, --output <([^>]*)>", self.text)
        formats = m.group(1).split("|") if m else []
        if "json" not in formats and "jsonl" not in formats:
            raise ExternalError(f"this llama-bench ({binary}) lists no JSON output (-o json/jsonl) in its --help")
        return "jsonl" if "jsonl" in formats else "json"

    @property
    def ik(self) -> bool:
        """ik_llama.cpp's llama-bench, by the rule: its help lists run-time repack (-rtr) and fused MoE (-fmoe), flags
        upstream llama.cpp's llama-bench has never had."""
        return bool(self.has("-rtr", "--run-time-repack") and self.has("-fmoe", "--fused-moe"))


def help_of(binary: Path | None) -> BenchHelp:
    """The --help of the binary at this path as it is now (a rebuilt binary is read again); never raises: a binary that
    does not start gives a help that lists nothing."""
    try:
        st = Path(binary).stat() if binary else None
    except OSError:
        st = None
    return BenchHelp(_help_text(str(binary), st.st_mtime_ns, st.st_size) if st else "")


@functools.lru_cache(maxsize=32)
def _help_text(binary: str, mtime_ns: int, size: int) -> str:
    try:
        p = subprocess.run([binary, "--help"], capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({binary} --help did not run: {e})"
    return (p.stdout + "\n" + p.stderr)[:200_000]


@dataclass(frozen=True)
class Checkout:
    root: Path
    fork: str          # IK | UPSTREAM
    commit: str        # git's short hash, "" when the tree is not a git checkout of its own


def checkout_of(path: Path) -> Checkout | None:
    """The llama.cpp-family source tree `path` lies in (include/llama.h and ggml/ at its root), or None; ik_llama.cpp's
    has its iqk kernels (ggml/src/iqk)."""
    path = Path(path).resolve()
    root = next((d for d in (path, *path.parents) if (d / "include" / "llama.h").is_file() and (d / "ggml").is_dir()),
                None)
    if root is None:
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=30, env=env).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    # a tree without git of its own (an unpacked sdist) inside some other repository is not that repository's commit
    commit = out[1] if len(out) == 2 and Path(out[0]).resolve() == root and re.fullmatch(r"[0-9a-f]{4,40}", out[1]) \
        else ""
    return Checkout(root, IK if (root / "ggml" / "src" / "iqk").is_dir() else UPSTREAM, commit)


# --- what ik_llama.cpp's CPU path does (from its source: ggml/src/ggml.c, ggml/src/iqk/, src/llama*.cpp) -------------

def ik_word(name: str, ggml_type: str, ne: tuple[int, ...]) -> str | None:
    """The compute_dtype word of ik_llama.cpp's x86 CPU product with this weight, None where not known. Quantized types
    meet 8-bit activations (their vec_dot_types and the types iqk converts weights to for large batches are all
    Q8 blocks); F32 f32; F16: dense products hand iqk the f32 activations as they are (its f16 x f32 kernel, rows
    of a multiple of 4), routed experts (MUL_MAT_ID) convert them to f16 first; BF16 depends on whether the build
    has AVX512-BF16, which the binary does not say."""
    if ggml_type == "F32":
        return "f32"
    if ggml_type == "BF16" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if ggml_type == "F16":
        return "f16" if expert_layer(name) is not None or ne[0] % 4 else "f32"
    return Q8_ACTIVATIONS


def ik_compute_dtype(meta: ModelMeta) -> dict[str, str] | None:
    """settings["compute_dtype"] of ik_llama.cpp's CPU path on this model (prefill and decode alike), None if a weight's
    arithmetic is not known."""
    words = [ik_word(t.name, t.ggml_type, t.ne) for t in meta.product_weights()]
    return None if None in words else {"prefill": joined(words), "decode": joined(words)}


def ik_weights(meta: ModelMeta, mmap: bool, rtr: bool, n_overridden: int | None) -> str | None:
    """settings["weights"] of ik_llama.cpp's loader: a copy with -rtr (it turns mmap off to repack in place), without
    mmap, with any tensor overridden to host memory (unless GGML_CUDA_NO_PINNED is set), or with a file of per-expert
    tensors (merged at load); else mapped. None where the overrides are not known."""
    if rtr or not mmap or re.search(r"\bblk\.\d+\.ffn_(gate|up|down)\.\d+\.", " ".join(t.name for t in meta.tensors)):
        return "copy"
    if n_overridden is None or (n_overridden and os.environ.get("GGML_CUDA_NO_PINNED") is not None):
        return None
    return "copy" if n_overridden else "mapped"

