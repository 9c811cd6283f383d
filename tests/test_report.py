"""`moebench report`: tables, fairness, failed cells, escaping of hostile names, plots, and a real
headless Chromium rendering the self-contained report.html (console errors, decoded images, screenshot)."""
import base64
import json
import os
import re
import select
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from harness.store import results
from tests.conftest import moebench

HOSTILE = "<script>alert(1)</script>|**x**_`y`"


@pytest.fixture(scope="module")
def real_run(tiny, tmp_path_factory) -> Path:
    """A real sweep on the tiny preset: both engines, resident and fully offloaded."""
    out = tmp_path_factory.mktemp("results")
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp,reference", "--n-cpu-moe", "0,all", "-w", "pp16,tg4",
                 "-r", "2", "--threads", "2", "--results-dir", out)
    assert r.returncode == 0, r.stderr
    return next(d for d in out.iterdir() if d.is_dir())


def _cell(engine, depth, status="ok", error="", **kw) -> dict:
    return {"run_id": "fake", "cell_id": f"{engine}/fp/ncmoe{depth}", "engine": engine, "engine_version": "1",
            "model": "/m/hostile.gguf", "model_name": HOSTILE, "model_fingerprint": "fp", "arch": "qwen3moe",
            "n_layers": 48, "n_moe_layers": 48, "depth": str(depth), "n_cpu_moe": depth,
            "expert_host_fraction": depth / 48, "expert_bytes_host": depth * 10, "expert_bytes_total": 480,
            "n_ctx": 8448, "n_batch": 2048, "n_ubatch": 512, "threads": 2, "flash_attn": "auto", "device": "auto",
            "dtype": "auto", "mmap": True, "extra": {}, "effective_settings": {}, "bytes_by_device": {},
            "status": status, "error": error, "load_s": 1.0, "wall_s": 2.0, "peak_rss_mib": 100.0 + depth,
            "peak_rss_anon_mib": 60.0 + depth, "peak_rss_file_mib": 70.0 + depth, "rss_anon_floor_mib": 20.0,
            "peak_rss_anon_above_floor_mib": 40.0 + depth, "peak_vram_mib": float("nan"), "host": "box"} | kw


def _meas(engine, depth, workload, tps, n_depth=0) -> list[dict]:
    n_gen = 128 if workload.startswith("tg") else 0
    return [{"run_id": "fake", "cell_id": f"{engine}/fp/ncmoe{depth}", "engine": engine, "model_name": HOSTILE,
             "model_fingerprint": "fp", "n_cpu_moe": depth, "workload": workload, "n_prompt": 4096 - 4096 * bool(n_gen),
             "n_gen": n_gen, "n_depth": n_depth, "rep": i, "ns": int(1e9), "tokens_per_s": t}
            for i, t in enumerate(tps)]


@pytest.fixture
def fake_run(tmp_path) -> Path:
    """Constructed results with exact numbers: unmatched settings (TensorSharp's caveats), an OOM cell
    and a model whose GGUF name is hostile."""
    d = tmp_path / "fake"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"run_id": "fake", "started": "2026-01-01T00:00:00", "spec": {},
                                            "host": {"hostname": "laptop", "cpu": "Tiny CPU", "cores_logical": 2,
                                                     "ram_mib": 8192, "gpus": [], "gpu_name": ""}}))
    results.append_rows(d, "cells.csv", [
        _cell("reference", 0, n_ubatch=2048, threads=40, effective_settings={
            "n_ctx": 8448, "compute_dtype": {"prefill": "bf16+q8-activations", "decode": "q8-activations"},
            "weights": "hugepage-copy"}),
        _cell("llama-cpp", 0, n_ubatch=512, threads=192, effective_settings={
            "n_ctx": 8704, "compute_dtype": {"prefill": "q8-activations", "decode": "q8-activations"}}),
        _cell("reference", 12),
        _cell("llama-cpp", 12, status="oom", error="killed by SIGKILL (OOM killer) | log tail: <b>boom</b>"),
    ])
    results.append_rows(d, "measurements.csv", [
        *_meas("reference", 0, "pp4096", [1000, 1100]), *_meas("reference", 0, "tg128@d8192", [50, 52], 8192),
        *_meas("llama-cpp", 0, "pp4096", [500, 400]), *_meas("llama-cpp", 0, "tg128", [25, 20]),
        *_meas("reference", 12, "pp4096", [800, 820]), *_meas("reference", 12, "tg128@d8192", [40, 41], 8192),
    ])
    return d


def test_report_of_a_real_sweep(real_run, tmp_path):
    out = tmp_path / "rep"
    r = moebench("report", real_run, "-o", out, "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = {row["n_cpu_moe"]: row for row in json.loads(r.stdout)}
    assert sorted(rows) == [0, 4]
    meas = pd.read_csv(real_run / "measurements.csv")
    med = meas.groupby(["engine", "n_cpu_moe", "workload"])["tokens_per_s"].median()
    for d in (0, 4):
        for wl in ("pp16", "tg4"):
            assert rows[d][f"reference {wl}"] == pytest.approx(med["reference", d, wl])
            assert rows[d][f"{wl} median ratio"] == pytest.approx(med["reference", d, wl] / med["llama-cpp", d, wl])
        assert rows[d]["llama-cpp VRAM MiB"] == "not measured"          # no GPU: said, not zero
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["m0_memory.png", "m0_speedup.png", "m0_throughput_pp16.png", "m0_throughput_tg4.png",
                    "m0_timeline_llama-cpp.png", "m0_timeline_reference.png"]
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(pngs)
    assert "<script" not in page and "http://" not in page and "https://" not in page and "<link" not in page
    md = (out / "report.md").read_text()
    assert all(f"]({p})" in md for p in pngs) and "not measured" in md
    r = moebench("report", real_run, "-o", out, "--format", "md")
    assert r.returncode == 0 and "| n\\_cpu\\_moe | reference VRAM MiB |" in r.stdout, r.stdout


def test_fairness_failed_cells_and_hostile_names(fake_run, tmp_path):
    out = tmp_path / "rep"
    r = moebench("report", fake_run, "-o", out, "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = {row["n_cpu_moe"]: row for row in json.loads(r.stdout)}
    assert rows[0]["pp4096 ratio"] == pytest.approx((1000 * 1100 / (500 * 400)) ** 0.5)     # geometric: the centre
    assert rows[0]["pp4096 median ratio"] == pytest.approx(1050 / 450)
    assert rows[0]["llama-cpp tg128@d8192"] == "not run" and rows[0]["reference tg128"] == "not run"
    assert rows[12]["llama-cpp pp4096"] == "oom (killed by SIGKILL (OOM killer))"    # failed, not a gap
    r = moebench("report", fake_run, "-o", out, "--format", "csv")
    assert r.returncode == 0 and "oom (killed by SIGKILL" in r.stdout
    md = (out / "report.md").read_text()
    fair = md.split("Fairness")[1].split("All cells")[0]
    for line in ["| 0 | n\\_ubatch | 2048 | 512 |", "| 0 | threads | 40 | 192 |",
                 "| 0 | decode context depth | 8192 | 0 |", "| 0 | n\\_ctx (effective) | 8448 | 8704 |",
                 # the union of both sides' settings, nested ones flattened: one side's alone is a difference too
                 "| 0 | compute\\_dtype.prefill (effective) | bf16+q8-activations | q8-activations |",
                 "| 0 | weights (effective) | hugepage-copy | (not reported) |"]:
        assert line in fair, fair
    assert "compute\\_dtype.decode" not in fair                 # the same on both sides
    assert "| 12 |" not in fair                       # a pair with a failed (OOM) cell measured nothing to compare
    # memory: the anonymous peak as the RAM an engine needs (and above its floor), the file-backed peak apart
    every = md.split("All cells")[1]
    assert "| RAM MiB (anon) | anon above floor MiB | file-backed MiB | peak VRAM MiB |" in every
    assert "| reference | 12 | pp4096 | ok | 810 | 14.1 | 1.75 | 800 | 820 | 2.00 | 72.0 | 52.0 | 82.0 |  |" in every
    assert "the RAM an engine needs" in md and "page cache the kernel can reclaim" in md
    page = (out / "report.html").read_text()
    assert "<script" not in page and "<b>boom" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;|**x**_`y`" in page
    assert "\\<script\\>alert(1)\\</script\\>\\|\\*\\*x\\*\\*\\_\\`y\\`" in md
    assert re.search(r"(?<!\\)[<>]", md) is None                  # no raw HTML reaches the Markdown
    assert all("<" not in p.name and "|" not in p.name for p in out.iterdir())


def test_against_published_places_both_side_by_side(fake_run, tmp_path):
    r = moebench("report", fake_run, "-o", tmp_path / "rep", "--against-published", "qwen3.5-35b-a3b", "--format", "md")
    assert r.returncode == 0, r.stderr
    against = r.stdout.split("measured vs published: Qwen3.5-35B-A3B")[1]
    # best of the repetitions, as published: 1100 / 500
    # one process a side: no interval, the verdict says so
    assert "| 0 | pp4096 | 9,538 | 8,149 | 1.17x | 1,100 | 500 | 2.20x | insufficient data |" in against, against
    assert "| 12 | pp4096 | 6,755 | 988 | 6.84x | 820 | oom (killed by SIGKILL (OOM killer)) |" in against
    assert "| 24 | pp4096 | 4,412 | 498 | 8.86x | not run | not run |  |  | depth not in this run |" in against
    assert "| 0 | tg128 | 160 | 228 | 0.70x | not run | 25.0 |" in against       # reference ran tg128@d8192 only
    hw = r.stdout.split("hardware: published vs this run")[1]
    assert "NVIDIA RTX PRO 6000" in hw and "Tiny CPU (2 threads)" in hw and "none (no GPU" in hw
    bad = moebench("report", fake_run, "-o", tmp_path / "rep", "--against-published", "nope")
    assert bad.returncode == 2 and "No published table for model 'nope'" in bad.stderr


def test_bad_inputs_are_one_sentence(tmp_path, fake_run):
    r = moebench("report", tmp_path)
    assert r.returncode == 2 and "no run.json" in r.stderr and "Traceback" not in r.stderr
    r = moebench("report", fake_run, "--baseline", "nope", "-o", tmp_path / "x")
    assert r.returncode == 2 and "Engine 'nope' is not in these results" in r.stderr


@pytest.mark.parametrize("broken, baseline", [("llama-bench", "llama-cpp"), ("llama-cpp", "llama-bench")])
def test_default_baseline_is_llama_cpp_and_never_a_failed_engine(tmp_path, broken, baseline):
    """Three engines, one of which failed every cell: B is llama-cpp as `report --help` says, and never the failed
    engine, even when that is the preferred one."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"run_id": "fake", "started": "2026-01-01T00:00:00", "spec": {},
                                            "host": {"hostname": "box", "cpu": "CPU", "cores_logical": 2,
                                                     "ram_mib": 8192, "gpus": [], "gpu_name": ""}}))
    engines = ["reference", "llama-cpp", "llama-bench"]
    results.append_rows(d, "cells.csv", [_cell(e, 0, **({"status": "failed", "error": "exit 1"} if e == broken else {}))
                                         for e in engines])
    results.append_rows(d, "measurements.csv", [m for e, tps in zip(engines, ([30, 30], [10, 10], [20, 20]))
                                                if e != broken for m in _meas(e, 0, "pp4096", tps)])
    r = moebench("report", d, "-o", tmp_path / "rep", "--format", "json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert f"{baseline} pp4096" in row and f"{broken} pp4096" not in row, row
    assert row["pp4096 ratio"] == pytest.approx(30 / (10 if baseline == "llama-cpp" else 20))


# --- a real browser --------------------------------------------------------------------------------

class Chromium:
    """Headless Chromium driven over the DevTools protocol on --remote-debugging-pipe (stdlib only):
    fd 3 carries commands to the browser, fd 4 its NUL-terminated JSON replies and events."""

    def __init__(self, profile: Path):
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()

        def fds() -> None:
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        self.proc = subprocess.Popen(
            [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buf, self._id, self.events = b"", 0, []

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}} | ({"sessionId": session} if session else {})
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self.next(timeout)
            if m.get("id") == self._id:
                assert "error" not in m, m
                return m["result"]

    def next(self, timeout: float) -> dict:
        while b"\0" not in self._buf:
            assert select.select([self._r], [], [], timeout)[0], "chromium did not answer"
            chunk = os.read(self._r, 1 << 20)
            assert chunk, "chromium exited"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        m = json.loads(raw)
        if "method" in m:
            self.events.append(m)
        return m

    def wait_event(self, method: str, timeout: float = 30) -> None:
        while not any(e["method"] == method for e in self.events):
            self.next(timeout)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed, so report.html is not rendered in a browser: install Debian's "
                           "package as root (apt-get install chromium); `make test` does so when run as root with "
                           "apt-get")
def test_report_renders_in_headless_chromium(real_run, tmp_path):
    out = tmp_path / "rep"
    assert moebench("report", real_run, "-o", out).returncode == 0
    browser = Chromium(tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        s = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            browser.send(f"{domain}.enable", session=s)
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session=s)
        browser.send("Page.navigate", {"url": (out / "report.html").as_uri()}, session=s)
        browser.wait_event("Page.loadEventFired")
        probe = ("JSON.stringify({imgs: Array.from(document.images).map(i => [i.complete, i.naturalWidth]),"
                 " scripts: document.scripts.length, h1: document.querySelector('h1').textContent,"
                 " height: document.documentElement.scrollHeight})")
        page = json.loads(browser.send("Runtime.evaluate", {"expression": probe, "returnByValue": True},
                                       session=s)["result"]["value"])
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": 1400, "height": page["height"], "deviceScaleFactor": 1, "mobile": False}, session=s)
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"}, session=s)["data"])
    finally:
        browser.close()
    errors = [e for e in browser.events if e["method"] == "Runtime.exceptionThrown"
              or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    assert errors == []
    assert len(page["imgs"]) == 6 and all(done and width > 0 for done, width in page["imgs"]), page["imgs"]
    assert page["scripts"] == 0 and page["h1"].startswith("moebench report")
    assert shot.startswith(b"\x89PNG") and len(shot) > 50_000
    (tmp_path / "report.png").write_bytes(shot)


def test_interleaved_arms_of_one_engine_are_two_engines_in_the_report(tiny, tmp_path):
    """`-e stamp,stamp@x=1 --interleave` runs one engine twice; the report's layout shows both arms
    (it once merged them into one, the last arm winning)."""
    stamps = tmp_path / "stamps.txt"
    r = moebench("sweep", "-m", tiny, "-e", f"stamp@stamp_file={stamps},stamp@x=1@stamp_file={stamps}",
                 "--interleave", "--rounds", "1", "-w", "pp8", "-r", "1", "--sample-ms", "0",
                 "--results-dir", tmp_path / "res")
    assert r.returncode == 0, r.stderr
    run = next((tmp_path / "res").glob("2*"))
    r = moebench("report", run, "-o", tmp_path / "rep", "--format", "csv")
    assert r.returncode == 0, r.stderr
    layout = pd.read_csv(pd.io.common.StringIO(r.stdout))
    a, b = f"A:stamp@stamp_file={stamps}", f"B:stamp@x=1@stamp_file={stamps}"
    assert {f"{a} pp8", f"{b} pp8"} <= set(layout.columns)
    assert layout[f"{a} pp8"].notna().all() and layout[f"{b} pp8"].notna().all()


def test_two_files_with_one_gguf_name_stay_two_models(tiny, tmp_path):
    """Two different files whose general.name is the same are two models in the report, each with its
    own cells (the report once grouped by name, and the second file's cells replaced the first's)."""
    other = tmp_path / "other.gguf"
    data = bytearray(tiny.read_bytes())
    data[-8:] = bytes(8)            # other weights at the end: another fingerprint, the same header and name
    other.write_bytes(bytes(data))
    r = moebench("sweep", "-m", f"{tiny},{other}", "-e", "stamp", "-w", "pp8", "-r", "1", "--sample-ms", "0",
                 "--results-dir", tmp_path / "res", env={"MOEBENCH_STAMP_FILE": str(tmp_path / "s.txt")})
    assert r.returncode == 0, r.stderr
    run = next((tmp_path / "res").glob("2*"))
    cells = pd.read_csv(run / "cells.csv")
    assert cells["model_name"].nunique() == 1 and cells["model_fingerprint"].nunique() == 2
    r = moebench("report", run, "-o", tmp_path / "rep", "--format", "csv")
    assert r.returncode == 0, r.stderr
    layout = pd.read_csv(pd.io.common.StringIO(r.stdout))
    assert len(layout) == 2 and layout["model"].nunique() == 2
    md = (tmp_path / "rep" / "report.md").read_text()
    assert all(fp in md for fp in cells["model_fingerprint"])
