"""llama.cpp on the CPUs users have: its extra buffer types (AMX, CPU_REPACK) as sweep knobs, the compiler that
built it, the AMX miscompile and its fallback, and what a crash says. The rules are checked with faked CPU flags and
compiler strings on any host; llama.cpp itself is always the real one (on an AMX CPU its AMX path runs)."""
from __future__ import annotations

import json
import signal

import pandas as pd
import pytest

from engines import ggml_build
from engines.base import EngineSettings
from tests.conftest import moebench, run_dir_of

AMX = frozenset({"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"})
AVX2 = frozenset({"avx2", "fma", "f16c"})


def test_compiler_of_reads_the_build_notes(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path))           # record_build writes there
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF...GCC: (Debian 12.2.0-14+deb12u1) 12.2.0\x00...")
    assert ggml_build.compiler_of(lib) == "gcc 12.2.0"
    # a clang build also carries GCC's note from the C runtime objects: clang wins
    lib.write_bytes(b"GCC: (Debian 12.2.0-14) 12.2.0\x00Debian clang version 19.1.7 (3~deb12u1)\x00")
    assert ggml_build.compiler_of(lib) == "clang 19.1.7"
    # a stripped wheel: what the installer recorded for these bytes, else the OpenMP runtime it links
    lib.write_bytes(b"\x7fELF stripped libgomp.so.1\x00")
    assert ggml_build.compiler_of(lib) == "gcc"
    ggml_build.record_build(lib, "gcc 12.2.0")
    assert ggml_build.compiler_of(lib) == "gcc 12.2.0"
    assert ggml_build.compiler_of(tmp_path / "missing.so") == ""


def test_the_installed_llama_cpp_names_its_compiler():
    """The wheel `make setup` installs (scripts/install_llama_cpp.py records it), and on an AMX CPU not one that
    miscompiles AMX: that is what the installer is for."""
    compiler = ggml_build.compiler_of(ggml_build.llama_cpp_lib())
    assert compiler.split(" ")[0] in ("gcc", "clang"), compiler
    if ggml_build.amx_host():
        assert not ggml_build.miscompiles_amx(compiler), compiler


def test_compiler_version_of_the_real_compilers():
    assert ggml_build.compiler_version("cc").split(" ")[0] in ("gcc", "clang")
    assert ggml_build.compiler_version("no-such-compiler") == ""


@pytest.mark.parametrize("compiler,bad", [("gcc 12.2.0", True), ("gcc 11.4.0", True), ("gcc", True),
                                          ("gcc 13.2.0", False), ("gcc 10.2.1", False), ("clang 19.1.7", False),
                                          ("", False)])
def test_which_compilers_miscompile_amx(compiler, bad):
    assert ggml_build.miscompiles_amx(compiler) is bad


def test_the_amx_crash_needs_an_amx_cpu_an_amx_build_and_a_bad_compiler():
    info = "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |"
    assert ggml_build.amx_crash_applies("gcc 12.2.0", info, AMX)
    assert not ggml_build.amx_crash_applies("clang 19.1.7", info, AMX)
    assert not ggml_build.amx_crash_applies("gcc 12.2.0", info, AVX2)                     # no AMX on this CPU
    assert not ggml_build.amx_crash_applies("gcc 12.2.0", info.replace("AMX_INT8 = 1 | ", ""), AMX)   # built without
    cause = ggml_build.crash_cause("SIGSEGV", "gcc 12.2.0", info, True, AMX)
    assert "gcc 12.2.0" in cause and "clang" in cause and "repack=0" in cause
    assert ggml_build.crash_cause("SIGSEGV", "gcc 12.2.0", info, False, AMX) == ""       # AMX was off: not this
    assert "another CPU" in ggml_build.crash_cause("SIGILL", "clang 19.1.7", info, True, AVX2)
    assert "process of its own" in ggml_build.crash_cause("SIGILL", "clang 19.1.7", info, True, AMX)


def test_build_env_picks_clang_only_where_the_default_compiler_breaks_amx(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(ggml_build, "compiler_version", lambda cc: "gcc 12.2.0")
    monkeypatch.setattr(ggml_build, "good_compilers", lambda: ["clang-19"])
    assert ggml_build.build_env(AMX) == {"CC": "clang-19", "CXX": "clang++-19"}
    assert ggml_build.build_env(AVX2) == {}
    monkeypatch.setattr(ggml_build, "good_compilers", lambda: [])
    assert ggml_build.build_env(AMX) is None                       # the engine turns the extra buffer types off
    monkeypatch.setattr(ggml_build, "compiler_version", lambda cc: "gcc 13.2.0")
    assert ggml_build.build_env(AMX) == {}


def test_extra_buffer_types_follow_ggml_cpu():
    bufts = ggml_build.cpu_bufts(AMX)
    assert set(bufts) == {"AMX", "CPU_REPACK"} and "Q2_K" in bufts["CPU_REPACK"]
    assert set(ggml_build.cpu_bufts(AVX2)) == {"CPU_REPACK"}
    # Q8_0 dense weight, 4096 x 1024: AMX adds a 4-byte compensation per 34-byte block (+11.8 %)
    assert ggml_build.extra_buft("blk.0.attn_q.weight", (4096, 1024), "Q8_0", bufts) == ("AMX", 1024 * 128 * 4)
    assert ggml_build.extra_buft("blk.0.attn_q.weight", (4096, 1024), "Q8_0", ggml_build.cpu_bufts(AVX2)) is None
    assert ggml_build.extra_buft("blk.0.attn_q.weight", (4096, 1000), "Q8_0", bufts) is None    # rows % 32
    assert ggml_build.extra_buft("output.weight", (2048, 1024), "F16", bufts) == ("AMX", 0)     # copied unpacked
    # routed experts (MUL_MAT_ID) never go to AMX; Q4_K ones are repacked
    assert ggml_build.extra_buft("blk.0.ffn_up_exps.weight", (2048, 768, 128), "Q4_K", bufts) == ("CPU_REPACK", 0)
    assert ggml_build.extra_buft("blk.0.ffn_up_exps.weight", (2048, 768, 128), "Q6_K", bufts) is None
    assert ggml_build.extra_buft("token_embd.weight", (2048, 32000), "Q4_K", bufts) is None      # GET_ROWS
    assert ggml_build.extra_buft("blk.0.ffn_norm.weight", (2048,), "F32", bufts) is None


def test_the_engine_turns_extra_buffer_types_off_for_a_build_that_would_crash(tiny, monkeypatch):
    """Compiler detection faked to GCC 12 (nothing else): on an AMX CPU with AMX compiled in, the real llama.cpp
    then loads with use_extra_bufts off and says so; elsewhere the fallback does not apply."""
    from engines import llama_cpp

    monkeypatch.setattr(ggml_build, "compiler_of", lambda path: "gcc 12.2.0")
    llama_cpp.amx_fallback.cache_clear()
    try:
        applies = ggml_build.amx_host() and "AMX_INT8 = 1" in llama_cpp._system_info()
        e = llama_cpp.LlamaCppEngine()
        e.load(tiny, EngineSettings(n_ctx=64, threads=2, extra={"repack": 1}))
        eff = e.info().settings
        e.close()
        assert eff["repack"] == (0 if applies else 1) and eff["ggml_compiler"] == "gcc 12.2.0"
        notes = llama_cpp.LlamaCppEngine.notes()
        assert (len(notes) == 1 and "repack=0" in notes[0] and "clang" in notes[0]) if applies else notes == []
    finally:
        llama_cpp.amx_fallback.cache_clear()


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_sweep_crosses_repack_and_records_the_extra_buffer_types(tmp_path):
    """--repack 0,1 runs each llama.cpp cell twice (cell ids and labels say which) and records what llama.cpp
    used: its extra buffer types' bytes from its load log (AMX on an AMX CPU), the compiler, the knob as run."""
    r = moebench("sweep", "-m", "preset:tiny:q4_k_m", "-e", "llama-cpp,reference", "--n-cpu-moe", "0,all",
                 "-w", "pp16,tg2", "-r", "1", "--rounds", "1", "--threads", "2", "--repack", "0,1",
                 "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    cells = pd.read_csv(run_dir_of(r) / "cells.csv")
    assert sorted(cells["cell_id"].str.split("/").str[0]) == ["llama-cpp@repack=0"] * 2 + ["llama-cpp@repack=1"] * 2 \
        + ["reference"] * 2                                # the reference engine takes no repack knob: one cell
    assert (cells["status"] == "ok").all(), cells["error"].tolist()
    for _, c in cells[cells["engine"] == "llama-cpp"].iterrows():
        eff, by = json.loads(c["effective_settings"]), json.loads(c["bytes_by_device"])
        asked = json.loads(c["extra"])["repack"]
        assert eff["repack"] == asked and eff["ggml_compiler"]
        assert eff["extra_bufts"] == {k.split(":")[1]: v for k, v in by.items() if k.split(":")[1] in ("AMX",
                                                                                                   "CPU_REPACK")}
        assert bool(eff.get("extra_bufts")) == bool(asked and ggml_build.cpu_bufts().get("AMX"))   # tiny: no Q4_K
        assert eff["experts_unrepacked_bytes"] == 0
    r = moebench("report", run_dir_of(r), "-o", tmp_path / "rep", "--engine", "llama-cpp@repack=1",
                 "--baseline", "llama-cpp@repack=0")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args,says", [(["--repack", "2"], "--repack '2' is not valid"),
                                       (["-e", "reference", "--repack", "0"], "takes --repack")])
def test_bad_knobs_are_one_sentence(tiny, tmp_path, args, says):
    r = moebench("sweep", "-m", tiny, "-w", "pp16", "-r", "1", "--results-dir", tmp_path,
                 *(["-e", "llama-cpp"] if "-e" not in args else []), *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_crash_names_its_known_cause(tiny, tmp_path):
    """The real llama.cpp reporting GCC 12 (faked compiler detection) dies with SIGSEGV at its first batch: on an AMX
    CPU the cell's error names the miscompile and the fix; elsewhere no known cause applies and it says only the
    signal."""
    from engines.llama_cpp import _system_info

    r = moebench("sweep", "-m", tiny, "-e", "amx-crash", "-w", "pp16", "-r", "1", "--threads", "2",
                 "--results-dir", tmp_path)
    cells = pd.read_csv(run_dir_of(r) / "cells.csv")
    error = cells.loc[0, "error"]
    assert cells.loc[0, "status"] == "failed" and f"crashed with {signal.SIGSEGV.name}" in error
    if ggml_build.amx_host() and "AMX_INT8 = 1" in _system_info():
        assert "gcc 12.2.0, which miscompiles its AMX code" in error and "clang" in error, error
    else:
        assert "miscompiles" not in error, error
