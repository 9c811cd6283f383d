"""The llama-bench engine across the llama.cpp family: output formats and flags read from each build's --help, the
depth each build really used (cpu_moe_layers from its -v load log), ik_llama.cpp's knobs (rtr, fmoe), builds named
for engine specs (spec_label), and `moebench tools build-llama-bench --source DIR`.

ik_llama.cpp's llama-bench is not built in CI: its tests run where MOEBENCH_TEST_IK_LLAMA_BENCH names one (build it
with `moebench tools build-llama-bench --source <ik_llama.cpp checkout>`) and skip with the reason elsewhere. Tests of
mainline's real llama-bench are `slow`, as in tests/test_llama_bench.py."""
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from engines.base import EngineSettings
from engines.external import ExternalError
from engines.llama_bench import LlamaBenchEngine, parse_json, parse_jsonl, pick_record
from engines.llama_bench_family import IK, UPSTREAM, BenchHelp, help_of
from engines.llama_cpp import override_patterns
from harness.run.spec import SweepSpec
from harness.run.sweep import run_sweep
from workloads.grammar import parse_workload

from .conftest import moebench

IK_ENV = "MOEBENCH_TEST_IK_LLAMA_BENCH"
LABEL = re.compile(r"[A-Za-z0-9._+-]+")


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    monkeypatch.setenv("MOEBENCH_LLAMA_BENCH", "")      # restored after each test


def ik_binary() -> Path:
    path = os.environ.get(IK_ENV, "").strip()
    if not path or not Path(path).is_file():
        pytest.skip(f"no ik_llama.cpp llama-bench: set {IK_ENV}=PATH (`moebench tools build-llama-bench --source "
                    f"<ik_llama.cpp checkout>` builds one)")
    return Path(path)


def mainline_binary() -> Path:
    binary = LlamaBenchEngine.find()
    assert binary and binary.is_file(), "no llama-bench; run `moebench tools build-llama-bench` first"
    return binary


# --- output formats ------------------------------------------------------------------------------------------------

def test_json_array_output_is_parsed_and_checked():
    out = ('[\n  {"n_prompt": 16, "n_gen": 0, "samples_ns": [ 5, 6 ]},\n  {"n_prompt": 0, "n_gen": 4, '
           '"samples_ns": [ 7, 8 ]}\n]\n')
    records = parse_json("llama-bench: some preamble [not json\n" + out)     # the array opens a line
    assert [r["samples_ns"] for r in records] == [[5, 6], [7, 8]]
    assert pick_record(records, 0, 4, 0, out)["samples_ns"] == [7, 8]
    assert parse_json("| model | t/s |\n") == []                               # no array: pick_record says so
    with pytest.raises(ExternalError, match="printed no JSON record"):
        pick_record(parse_json("| model | t/s |\n"), 16, 0, 0, "| model | t/s |")
    for bad, why in (('[\n  {"n_prompt": 16, "samples_ns": [ 5,', "not JSON"),          # cut short (a crash)
                     ('[\n  {"n_prompt": 16}, 3\n]', "not a list of records"),
                     ('[\n  ["n_prompt", 16]\n]', "not a list of records")):
        with pytest.raises(ExternalError, match=why):
            parse_json(bad)


def test_output_format_is_read_from_the_help():
    ours = BenchHelp("  -o, --output <csv|json|jsonl|md|sql>      (default: md)\n")
    older = BenchHelp("  -o, --output <csv|json|md|sql>      (default: md)\n")      # ik_llama.cpp's, older builds
    assert (ours.output_format(Path("x")), older.output_format(Path("x"))) == ("jsonl", "json")
    with pytest.raises(ExternalError, match="lists no JSON output"):
        BenchHelp("  -o, --output <csv|md>\n").output_format(Path("x"))
    assert not ours.ik and older.has("-o", "--output") == "-o" and older.has("-ncmoe") is None


@pytest.mark.slow
def test_mainline_json_array_is_its_jsonl_records(tiny):
    """The real llama-bench's `-o json` (an array) and `-o jsonl` (lines) hold the same records."""
    binary = mainline_binary()
    runs = {fmt: subprocess.run([binary, "-m", tiny, "-p", "8", "-n", "0", "-r", "2", "-t", "2", "-o", fmt],
                                capture_output=True, text=True, timeout=120) for fmt in ("json", "jsonl")}
    assert all(r.returncode == 0 for r in runs.values()), runs
    array, lines = parse_json(runs["json"].stdout), parse_jsonl(runs["jsonl"].stdout)
    assert len(array) == len(lines) == 1 and set(array[0]) == set(lines[0])
    assert help_of(binary).output_format(binary) == "jsonl" and not help_of(binary).ik


# --- flags and depth per build ------------------------------------------------------------------------------------

def _load(binary: Path, model: Path, **extra) -> LlamaBenchEngine:
    s = EngineSettings(n_cpu_moe=extra.pop("n_cpu_moe", 0), threads=2, extra={"llama_bench": str(binary)} | extra)
    e = LlamaBenchEngine()
    e.load(model, s)
    return e


@pytest.mark.slow
@pytest.mark.parametrize("knob", ["rtr", "fmoe"])
def test_ik_knobs_on_mainline_are_one_sentence_errors(tiny, knob):
    with pytest.raises(ExternalError) as e:
        _load(mainline_binary(), tiny, **{knob: 1})
    assert str(e.value).count(". ") == 0 and f"{knob}=1 asks for ik_llama.cpp's" in str(e.value), e.value


@pytest.mark.slow
def test_mainline_reports_the_layers_its_log_shows(tiny):
    """-ncmoe 2 on the tiny model: its -v load log overrides the first two layers' expert tensors, and only those; a
    CPU-only build keeps every layer's experts in host memory whatever the depth (engines.base.host_layers)."""
    e = _load(mainline_binary(), tiny, n_cpu_moe=2)
    info = e.info()
    assert info.n_overridden_tensors == 6 and info.cpu_moe_layers == [0, 1, 2, 3], (info.cpu_moe_layers, info)
    assert info.expert_bytes_host * 2 == info.expert_bytes_total         # 2 of 4 equal layers overridden
    depth0 = _load(mainline_binary(), tiny).info()
    assert depth0.n_overridden_tensors == 0 and depth0.cpu_moe_layers == [0, 1, 2, 3]


def test_two_builds_in_one_process_keep_their_own_help(tiny, tmp_path):
    """No build's --help stands for another's: a stand-in that lists only -o json beside one that lists jsonl, and a
    rebuilt binary at the same path is read again."""
    jsonl = Path(__file__).parent / "stand_ins" / "llama-bench"
    json_only = tmp_path / "llama-bench"
    text = jsonl.read_text().replace("<csv|json|jsonl|md|sql>", "<csv|json|md|sql>").replace(
        "print(json.dumps(rec))", "print(json.dumps([rec], indent=2))")
    json_only.write_text(text)
    json_only.chmod(json_only.stat().st_mode | stat.S_IXUSR)
    a, b = _load(jsonl, tiny), _load(json_only, tiny)
    assert (a.flags[a.flags.index("-o") + 1], b.flags[b.flags.index("-o") + 1]) == ("jsonl", "json")
    assert b.measure(parse_workload("pp16"), 3, 0, 0) == [16_000_000 + 1000 * i for i in range(3)]
    json_only.write_text(text.replace("<csv|json|md|sql>", "<csv|json|jsonl|md|sql>") + "\n# rebuilt\n")
    assert help_of(json_only).output_format(json_only) == "jsonl"


@pytest.fixture(scope="module")
def ik_sweep(tiny, tmp_path_factory):
    """ik_llama.cpp's llama-bench through an engine spec, depths 0 and 2, default knobs and rtr=1 fmoe=1."""
    binary = ik_binary()
    out = tmp_path_factory.mktemp("ik")
    spec = SweepSpec(models=[str(tiny)], workloads=["pp16", "tg4@d8"], depths=["0", "2"], threads=2, repetitions=2,
                     rounds=1, engines=[f"llama-bench@bin={binary}", f"llama-bench@bin={binary}@rtr=1@fmoe=1"])
    run = run_sweep(spec, out)
    return binary, run, pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv")


def test_ik_places_the_first_n_layers_by_explicit_overrides(ik_sweep):
    """With a GPU, -ot keeps the first N layers' experts in host memory; without one ik_llama.cpp drops every tensor
    override (src/llama.cpp, llama_model_load_from_file: n_gpu_layers 0 -> no overrides), and its log shows none."""
    binary, run, cells, meas = ik_sweep
    assert (cells["status"] == "ok").all(), cells["error"].tolist()
    label = LlamaBenchEngine.spec_label(str(binary))
    assert set(cells["cell_id"].str.split("/").str[0]) == {f"llama-bench@bin={label}",
                                                            f"llama-bench@bin={label}@rtr=1@fmoe=1"}
    gpu = {json.loads(e)["backends"] != "CPU" for e in cells["effective_settings"]}
    assert len(gpu) == 1
    gpu = gpu.pop()
    by_depth = {int(n): set(g["cpu_moe_layers"].astype(str)) for n, g in cells.groupby("n_cpu_moe")}
    assert by_depth == ({0: {"none"}, 2: {"0-1"}} if gpu else {0: {"0-3"}, 2: {"0-3"}}), by_depth
    for _, c in cells.iterrows():
        eff = json.loads(c["effective_settings"])
        placed = c["n_cpu_moe"] if gpu else 0
        assert eff["fork"] == IK and eff["n_cpu_moe"] == placed, eff
        assert "-ncmoe" not in eff["argv"] and "--n-cpu-moe" not in eff["argv"]
        if c["n_cpu_moe"]:       # the -ot syntax ik_llama.cpp's llama-bench parses: PATTERN=CPU,PATTERN=CPU
            assert eff["argv"][eff["argv"].index("-ot") + 1] == ",".join(f"{p}=CPU" for p in override_patterns(2))
        knobs = "rtr=1" in c["cell_id"]
        assert (eff["rtr"], eff["fmoe"]) == (knobs, True), eff            # fmoe: on by default in ik_llama.cpp
        assert eff["weights"] == ("copy" if knobs or placed else "mapped") and eff["mmap"] == (not knobs and not placed)
        if not gpu:
            assert eff["compute_dtype"] == {"prefill": "f32", "decode": "f32"}       # the tiny model is f32
    assert len(meas) == len(cells) * 2 * 2 and (meas["tokens_per_s"] > 0).all()      # 2 workloads x 2 repetitions


def test_ik_decode_at_depth_runs_as_its_gp_test(ik_sweep):
    """ik_llama.cpp's llama-bench has no -d: tg4@d8 is its -gp 8,4 (generation timed after an 8-token prompt)."""
    _, run, cells, _ = ik_sweep
    logs = "\n".join(p.read_text() for p in (run / "logs").iterdir())
    assert re.search(r"-p 0 -n 0 -r 2 -gp 8,4", logs) and " -d " not in logs
    assert "llama_model_loader: loaded meta data" in logs            # the probe's -v log was read
    if json.loads(cells["effective_settings"].iloc[0])["backends"] == "CPU":
        assert "ik_llama.cpp applies no tensor overrides without a GPU: --n-cpu-moe 2 placed nothing" in logs
    else:
        assert re.search(r"Tensor blk\.1\.ffn_up_exps\.weight \(size = [\d.]+ MiB\) buffer type overridden to", logs)


def test_ik_without_overrides_would_miss_merged_experts():
    """Why explicit overrides: ik_llama.cpp's own --n-cpu-moe pattern misses gemma4's merged up/gate experts, the
    llama-cpp engine's patterns (passed with -ot) do not."""
    ik_rule = re.compile(r"blk\.0\.(ffn_(up|down|gate)_exps\.weight)")
    ours = re.compile(override_patterns(1)[0])
    merged = "blk.0.ffn_gate_up_exps.weight"
    assert not ik_rule.search(merged) and ours.search(merged) and not ours.search("blk.10.ffn_up_exps.weight")


def test_ik_compute_dtype_agrees_with_llama_cpp_on_a_quantized_file(tmp_path):
    """On a Q4_K_M file (quantized weights and an f32 router) ik_llama.cpp's rule gives llama.cpp's words."""
    binary = ik_binary()
    from engines.gguf_meta import read_meta
    from engines.llama_bench_family import ik_compute_dtype
    from engines.llama_cpp import compute_dtype
    from engines.base import weight_arithmetic
    from workloads.synth import resolve_model
    path = resolve_model("preset:tiny:q4_k_m")
    e = _load(binary, path, n_cpu_moe=1, rtr=1)
    info = e.info()
    gpu = info.settings["backends"] != "CPU"
    assert info.cpu_moe_layers == ([0] if gpu else [0, 1, 2, 3]) and info.settings["rtr"] is True
    assert info.settings["weights"] == "copy" and info.settings["mmap"] is False       # -rtr turns mmap off
    if gpu:
        pytest.skip("compute_dtype is known only for ik_llama.cpp's CPU path")
    words = compute_dtype(read_meta(path), weight_arithmetic)
    assert info.settings["compute_dtype"] == ik_compute_dtype(read_meta(path)) == words
    assert "q8-activations" in words["decode"]


# --- naming builds (engine specs llama-bench@bin=PATH) -------------------------------------------------------------

def _tree(root: Path, ik: bool, git: bool) -> Path:
    """A llama.cpp-family source tree with a binary in build/bin (no real build)."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "llama.h").write_text("")
    (root / "ggml" / "src" / ("iqk" if ik else "ggml-cpu")).mkdir(parents=True)
    (root / ("examples" if ik else "tools") / "llama-bench").mkdir(parents=True)
    (root / ("examples" if ik else "tools") / "llama-bench" / "llama-bench.cpp").write_text("")
    if git:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
            subprocess.run(["git", "-C", root, *cmd], check=True, env=env)
    for folder in ("build", "build-cuda"):
        (root / folder / "bin").mkdir(parents=True)
        (root / folder / "bin" / "llama-bench").write_text("")
    return root


def _commit(root: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          env=env, check=True).stdout.strip()


def test_spec_label_names_the_build(tmp_path):
    ik, up = _tree(tmp_path / "ik", True, True), _tree(tmp_path / "up", False, True)
    nogit = _tree(tmp_path / "plain", True, False)
    labels = {
        "ik": LlamaBenchEngine.spec_label(str(ik / "build" / "bin" / "llama-bench")),
        "ik-cuda": LlamaBenchEngine.spec_label(str(ik / "build-cuda" / "bin" / "llama-bench")),
        "up": LlamaBenchEngine.spec_label(str(up / "build" / "bin" / "llama-bench")),
        "nogit": LlamaBenchEngine.spec_label(str(nogit / "build" / "bin" / "llama-bench"))}
    assert labels == {"ik": f"{IK}-{_commit(ik)}", "ik-cuda": f"{IK}-{_commit(ik)}-build-cuda",
                      "up": f"{UPSTREAM}-{_commit(up)}", "nogit": f"{IK}-nogit"}
    # a moebench build: its build.json (the sdist's commit, or a --source build's label)
    sdist = tmp_path / "cache" / "0.3.36" / "bin" / "llama-bench"
    sdist.parent.mkdir(parents=True)
    sdist.write_text("")
    (sdist.parent.parent / "build.json").write_text('{"llama_cpp_python": "0.3.36", "llama_cpp_commit": "0c1e57098"}')
    assert LlamaBenchEngine.spec_label(str(sdist)) == "llama.cpp-0c1e57098"
    (sdist.parent.parent / "build.json").write_text('{"source": "/x", "label": "ik_llama.cpp-8337e4cd3"}')
    assert LlamaBenchEngine.spec_label(str(sdist)) == "ik_llama.cpp-8337e4cd3"
    # elsewhere: its folders' names, without the generic ones, as a cell id may hold them
    loose = tmp_path / "my builds@x=1" / "b2" / "bin" / "llama-bench"
    loose.parent.mkdir(parents=True)
    loose.write_text("")
    assert LlamaBenchEngine.spec_label(str(loose)) == "my-builds-x-1-b2"
    assert all(LABEL.fullmatch(v) for v in labels.values())


def test_spec_label_of_the_real_builds():
    """The cached mainline build and, where given, ik_llama.cpp's: told apart by name."""
    names = []
    cached = LlamaBenchEngine.find()
    if cached and cached.is_file():
        names.append(LlamaBenchEngine.spec_label(str(cached)))
        assert names[-1].startswith(f"{UPSTREAM}-") and LABEL.fullmatch(names[-1]), names
    if os.environ.get(IK_ENV):
        names.append(LlamaBenchEngine.spec_label(os.environ[IK_ENV]))
        assert names[-1].startswith(f"{IK}-") and LABEL.fullmatch(names[-1]), names
    if not names:
        pytest.skip("no llama-bench build here to name")
    assert len(set(names)) == len(names)


# --- moebench tools build-llama-bench --source DIR -----------------------------------------------------------------

def test_build_from_source_refuses_what_is_not_a_checkout(tmp_path):
    (tmp_path / "notes").mkdir()
    for source, why in ((tmp_path / "notes", "is not the root of a llama.cpp-family checkout"),
                        (tmp_path / "missing", "is not a directory")):
        r = moebench("tools", "build-llama-bench", "--source", source, env={"MOEBENCH_CACHE": str(tmp_path)})
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = moebench("tools", "build-llama-bench", "--source", tmp_path, "--version", "0.3.36")
    assert r.returncode == 2 and "give one of them" in r.stderr


def test_build_from_source_command_lines(tmp_path):
    """What it would run (the configure command) and where the build goes, without a 20-minute build: a checkout
    built before at the same commit is already built."""
    from harness.tools import build_llama_bench_source, cmake_argv, source_checkout, source_label
    ik, up = _tree(tmp_path / "ik", True, True), _tree(tmp_path / "up", False, False)
    c = source_checkout(str(ik))
    assert (c.fork, c.commit, source_label(c)) == (IK, _commit(ik), f"{IK}-{_commit(ik)}")
    argv = cmake_argv(c.root, tmp_path / "b", cuda=False, ninja=False)
    assert argv[:5] == ["cmake", "-S", str(ik), "-B", str(tmp_path / "b")]
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_BUILD_EXAMPLES=ON", "-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=OFF"} <= set(argv)
    up_argv = cmake_argv(up, tmp_path / "b", cuda=True, ninja=True)
    assert {"-DLLAMA_BUILD_TOOLS=ON", "-DGGML_CUDA=ON"} <= set(up_argv) and up_argv[-2:] == ["-G", "Ninja"]
    assert source_label(source_checkout(str(up))) == f"{UPSTREAM}-up"        # no git: its folder's name
    dest = tmp_path / "cache" / "llama-bench" / source_label(c)
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "llama-bench").write_text("")
    (dest / "build.json").write_text(json.dumps({"source": str(c.root), "commit": c.commit, "fork": c.fork,
                                                 "label": dest.name}))
    os.environ["MOEBENCH_CACHE"] = str(tmp_path / "cache")
    try:
        done = build_llama_bench_source(str(ik), None, None, False)
        assert done == f"already built: {dest / 'bin' / 'llama-bench'} (--force rebuilds)"
        assert LlamaBenchEngine.spec_label(str(dest / "bin" / "llama-bench")) == dest.name
        assert LlamaBenchEngine.version_of(dest / "bin" / "llama-bench") == f"{c.commit} ({IK} checkout)"
    finally:
        del os.environ["MOEBENCH_CACHE"]


def test_sweep_names_two_builds_apart(tiny, tmp_path):
    """Two binaries in one sweep, labelled by their build; rtr asked of a build without it fails that cell alone."""
    stand_in = Path(__file__).parent / "stand_ins" / "llama-bench"
    other = _tree(tmp_path / "ik", True, True) / "build" / "bin" / "llama-bench"
    other.write_text(stand_in.read_text())
    other.chmod(other.stat().st_mode | stat.S_IXUSR)
    r = moebench("sweep", "-m", tiny, "-e", f"llama-bench@bin={stand_in},llama-bench@bin={other}@rtr=1", "-w", "pp16",
                 "-r", "1", "--threads", "2", "--results-dir", tmp_path / "results")
    assert r.returncode == 0, r.stderr
    cells = pd.read_csv(next((tmp_path / "results").glob("*/cells.csv"))).set_index("cell_id")
    ids = sorted(cells.index.str.split("/").str[0])
    assert ids == sorted([f"llama-bench@bin={LlamaBenchEngine.spec_label(str(stand_in))}",
                          f"llama-bench@bin={IK}-{_commit(tmp_path / 'ik')}@rtr=1"]), ids
    ok, failed = (cells[cells.index.str.contains(k)].iloc[0] for k in ("stand_ins", "rtr=1"))
    assert ok["status"] == "ok" and failed["status"] == "failed"
    assert "rtr=1 asks for ik_llama.cpp's --run-time-repack, which this llama-bench" in failed["error"]
