"""How the llama.cpp in use was built, and what that means on this CPU (stdlib only: the installer
`scripts/install_llama_cpp.py` runs it before anything else is installed).

pip builds llama-cpp-python, and `moebench tools build-llama-bench` builds llama-bench, with the system
compiler and `-march=native`. GCC 11-12 miscompile ggml's AMX tile configuration (`ggml_tile_config_init`
in ggml-cpu/amx/mmq.cpp: GCC declares `_tile_loadconfig` to read 8 bytes, so the stores filling the
64-byte config are dropped and `ldtilecfg` faults). On a CPU with AMX such a build segfaults at the first
batch of >= 2 tokens that multiplies a weight held in the AMX buffer type; clang compiles it correctly.
The AMX buffer is one of llama.cpp's "extra" CPU buffer types (`use_extra_bufts`, llama-bench's
`--repack`): without them it runs, without AMX and without repacked weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from engines.devices import cpu_flags
from engines.gguf_meta import NOT_PRODUCT
from engines.paths import cache_dir

AMX_FLAGS = ("amx_tile", "amx_int8")
# the ISA flags GGML_NATIVE's -march=native compiles for: a build made on a CPU with more of them dies
# with SIGILL on one with fewer, so a wheel is only reused on a CPU with the same set
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse3", "sha_ni", "vaes", "gfni", "vpclmulqdq",
                 "movbe", "popcnt", "abm", "adx")
_CLANG = re.compile(rb"clang version (\d+)\.(\d+)\.(\d+)")
_GCC = re.compile(rb"GCC: \([^)\n]{0,80}\) (\d+)\.(\d+)\.(\d+)")


def amx_host(flags: frozenset[str] | None = None) -> bool:
    have = cpu_flags() if flags is None else flags
    return all(f in have for f in AMX_FLAGS)


def isa_flags(flags: frozenset[str] | None = None) -> list[str]:
    have = cpu_flags() if flags is None else flags
    return sorted(f for f in have if f.startswith(_ISA_PREFIXES))


def system_info_isa(system_info: str) -> str:
    """The widest x86 CPU path a ggml library was built with, from its system info text ("AVX2 = 1 | AVX512 = 1 |
    ..."): amx, avx512, avx2, or "" when none of them is on."""
    on = set(re.findall(r"(\w+) = 1", system_info))
    return next((isa for isa, flag in (("amx", "AMX_INT8"), ("avx512", "AVX512"), ("avx2", "AVX2")) if flag in on), "")


def compiler_of(path: Path) -> str:
    """The compiler a binary or shared library was built with: "clang 19.1.7", "gcc 12.2.0", "gcc" (version
    unknown) or "" (unknown). From the version strings compilers leave in its .comment section (clang wins: a
    clang build also carries GCC's string from the C runtime objects it links); where a wheel's build stripped
    them, from what scripts/install_llama_cpp.py recorded for these exact bytes; else from the OpenMP runtime it
    links (GCC's libgomp, LLVM's libomp)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return ""
    for kind, pattern in (("clang", _CLANG), ("gcc", _GCC)):
        found = pattern.findall(data)
        if found:
            return f"{kind} " + ".".join(x.decode() for x in max(found, key=lambda v: tuple(map(int, v))))
    recorded = _builds().get(hashlib.sha256(data).hexdigest(), {}).get("compiler")
    if recorded:
        return str(recorded)
    return "gcc" if b"libgomp.so" in data else "clang" if b"libomp.so" in data else ""


def _builds_file() -> Path:
    return cache_dir() / "wheels" / "builds.json"


def _builds() -> dict:
    try:
        return json.loads(_builds_file().read_text())
    except (OSError, ValueError):
        return {}


def record_build(lib: Path, compiler: str) -> None:
    """Remember which compiler built these library bytes (wheels are stripped of the compiler's own note)."""
    builds = _builds() | {hashlib.sha256(Path(lib).read_bytes()).hexdigest(): {"compiler": compiler, "lib": str(lib)}}
    _builds_file().parent.mkdir(parents=True, exist_ok=True)
    _builds_file().write_text(json.dumps(builds, indent=1))


def compiler_version(cc: str) -> str:
    """`cc --version` as "gcc 12.2.0" / "clang 19.1.7" ("" if it does not run)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = _CLANG.search(out)
    if m:
        return "clang " + ".".join(x.decode() for x in m.groups())
    # "cc (Debian 12.2.0-14+deb12u1) 12.2.0": GCC under any name, told by its copyright line
    m = re.search(rb"\) (\d+)\.(\d+)\.(\d+)", out.splitlines()[0] if out else b"")
    return "gcc " + ".".join(x.decode() for x in m.groups()) if m and b"Free Software Foundation" in out else ""


def miscompiles_amx(compiler: str) -> bool:
    """GCC 11 and 12 drop the AMX tile-config stores (fixed upstream in llama.cpp #26954, after the llama.cpp
    that llama-cpp-python 0.3.36 vendors). A GCC build whose version is unknown counts as one: the safe side."""
    if compiler == "gcc":      # a GCC build of unknown version: 11-12 are Debian 12's and Ubuntu 22.04's
        return True
    m = re.fullmatch(r"gcc (\d+)\..*", compiler)
    return bool(m) and int(m.group(1)) in (11, 12)


def amx_crash_applies(compiler: str, system_info: str, flags: frozenset[str] | None = None) -> bool:
    """A build that segfaults here as soon as a weight sits in the AMX buffer: an AMX CPU, ggml compiled with
    AMX (`AMX_INT8 = 1` in llama.cpp's system info), by a compiler that miscompiles it."""
    return amx_host(flags) and "AMX_INT8 = 1" in system_info and miscompiles_amx(compiler)


def good_compilers() -> list[str]:
    """clang C compilers on PATH, newest first (clang-N, then plain clang)."""
    found = [f"clang-{v}" for v in range(30, 13, -1) if shutil.which(f"clang-{v}") and shutil.which(f"clang++-{v}")]
    return found + (["clang"] if shutil.which("clang") and shutil.which("clang++") else [])


def build_env(flags: frozenset[str] | None = None) -> dict[str, str] | None:
    """CC/CXX to build llama.cpp with on this host: {} = the default compiler is fine (or the user set CC
    and CXX); None = this is an AMX host, the default compiler miscompiles AMX and no clang is installed."""
    if os.environ.get("CC") and os.environ.get("CXX"):
        return {}
    if not amx_host(flags) or not miscompiles_amx(compiler_version(os.environ.get("CC") or "cc")):
        return {}
    clangs = good_compilers()
    if not clangs:
        return None
    cc = clangs[0]
    return {"CC": cc, "CXX": cc.replace("clang", "clang++", 1)}


def crash_cause(signal_name: str, compiler: str, system_info: str, repack: bool,
                flags: frozenset[str] | None = None) -> str:
    """One sentence naming why a llama.cpp process died with this signal here and how to fix it, or ""."""
    if signal_name == "SIGSEGV" and repack and amx_crash_applies(compiler, system_info, flags):
        return (f"llama.cpp was built by {compiler}, which miscompiles its AMX code, and this CPU has AMX: rebuild "
                f"it with clang (`make setup` does: it installs clang-19 and keys its wheel cache by compiler) or "
                f"run with repack=0 (no AMX, no repacked weights).")
    if signal_name == "SIGILL" and repack and amx_host(flags) and "AMX_INT8 = 1" in system_info:
        # measured: a PyTorch bf16 matmul (oneDNN, AMX) between two llama.cpp evals in one process -> SIGILL
        return ("llama.cpp's AMX kernels load their tile configuration once per thread, and another AMX user in the "
                "same process (PyTorch's oneDNN, after a bf16 matmul) had reset it: run llama.cpp in a process of its "
                "own, as every moebench cell does, or with repack=0.")
    if signal_name == "SIGILL":
        return ("llama.cpp executed an instruction this CPU lacks: it was built with -march=native on another CPU "
                "(a reused wheel or build); rebuild it here (`make setup` keys its wheel cache by compiler and CPU).")
    return ""


def llama_cpp_lib(name: str = "ggml-cpu") -> Path | None:
    """lib<name>.so of the installed llama_cpp package, found without importing it (importing loads it)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(d) / "lib").glob(f"lib{name}.so*"))
        if found:
            return found[0]
    return None


# --- where llama.cpp (0.3.36, CPU backend) puts a weight when its extra buffer types are on ---------------
# AMX: dense MUL_MAT weights of these types (bytes the VNNI packing adds per block: Q8_0 a compensation int32,
# Q4_K/Q5_K their scales, IQ4_XS 2), F16 copied as it is; never MUL_MAT_ID (routed experts).
AMX_PAD = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 4, "Q4_K": 4, "Q5_K": 4, "Q6_K": 0, "IQ4_XS": 2, "F16": 0}
_AMX_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "F16": 16}       # the K alignment; K-quants and IQ4_XS: 256
# CPU_REPACK on x86: the 8x8-interleaved types (AVX2; Q2_K needs AVX-512), dense and experts alike
REPACK_TYPES = ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4")


def cpu_bufts(flags: frozenset[str] | None = None) -> dict[str, tuple[str, ...]]:
    """The extra CPU buffer types a native (-march=native) build has on this CPU -> the weight types each
    takes: AMX with amx_int8 + avx512_vnni, CPU_REPACK with AVX2 (+Q2_K with AVX-512)."""
    have = cpu_flags() if flags is None else flags
    out: dict[str, tuple[str, ...]] = {}
    if "amx_int8" in have and "avx512_vnni" in have:
        out["AMX"] = tuple(AMX_PAD)
    if "avx2" in have:
        out["CPU_REPACK"] = REPACK_TYPES + (("Q2_K",) if "avx512f" in have else ())
    return out


def extra_buft(name: str, ne: tuple[int, ...], ggml_type: str,
               bufts: dict[str, tuple[str, ...]]) -> tuple[str, int] | None:
    """(buffer type, bytes it adds to the file's bytes) for a weight llama.cpp moves out of the plain CPU buffer
    into an extra buffer type (`bufts`, from cpu_bufts), or None. Mirrors ggml-cpu's supports_op checks
    (amx/amx.cpp, repack.cpp). The vendored llama.cpp applies them to weights --n-cpu-moe overrides to the CPU
    too (llama-model-loader.cpp: "when overriding to a CPU buffer, consider the extra buffer types")."""
    if NOT_PRODUCT.search(name) or len(ne) < 2 or min(ne) <= 0:
        return None
    stack = any(n > 1 for n in ne[2:])       # routed experts (MUL_MAT_ID): never AMX
    block = _AMX_BLOCK.get(ggml_type, 256)
    if not stack and ggml_type in bufts.get("AMX", ()) and ne[1] % 32 == 0 and ne[0] % block == 0:
        return "AMX", (0 if ggml_type == "F16" else ne[1] * (ne[0] // block) * AMX_PAD[ggml_type])
    if ggml_type in bufts.get("CPU_REPACK", ()) and ne[1] % 8 == 0:
        return "CPU_REPACK", 0
    return None
