"""Sweeps on a real local Ray cluster started the plain way (`ray start --head`, `ray start --address`, no custom
resource): a head plus one more node on loopback. The driver's own scheduling, in steps without a cluster:
tests/test_ray_scheduler.py.

The cluster is started once for the module (Ray start is slow) in its own temp dir and stopped at the end by
killing exactly the processes it started (never `ray stop`, which would stop other users' clusters too).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tests.conftest import FAULTS, ROOT, disjoint, moebench, run_dir_of, sigint_default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_processes(tmp: str) -> list[psutil.Process]:
    """Every process of our cluster: those naming its temp dir (gcs, raylets, agents) and their descendants."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if tmp in " ".join(p.info["cmdline"] or [])]
    procs = {}
    for r in roots:
        try:
            for p in [r, *r.children(recursive=True)]:
                procs[p.pid] = p
        except psutil.Error:
            pass
    return list(procs.values())


# Ray replaces 127.0.0.1 and localhost with the machine's network address; another loopback address
# keeps every connection of the test cluster on the loopback interface.
HOST = "127.0.0.2"


# plain `ray start`: no custom resources; one CPU each only so that Ray starts fewer idle workers here
PLAIN = ["--num-cpus", "1", "--disable-usage-stats"]
RAY_BIN = str(Path(sys.executable).parent / "ray")


def agent_ports() -> list[str]:
    return ["--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]


@pytest.fixture(scope="module")
def cluster():
    """A 2-node cluster; yields (RAY_ADDRESS, ray:// client address, the nodes' MOEBENCH_CACHE). Each node has its
    own MOEBENCH_STAMP_FILE (<tmp>/stamps-head, <tmp>/stamps-worker): the stamp engine's cells say where they ran."""
    tmp = tempfile.mkdtemp(prefix="mbray-", dir="/tmp")      # short: Ray's unix socket paths must stay < 108 chars
    port, client_port = free_port(), free_port()
    # on a loaded 2-core box the client server's per-client process can take longer than Ray's 30 s to start
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEBENCH_CACHE": f"{tmp}/node-cache",
           "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "300"}
    common = ["--node-ip-address", HOST, *PLAIN]
    try:
        subprocess.run([RAY_BIN, "start", "--head", "--port", str(port), "--temp-dir", f"{tmp}/ray",
                        "--include-dashboard=false", "--dashboard-port", str(free_port()),
                        "--ray-client-server-port", str(client_port), *common, *agent_ports()],
                       env=env | {"MOEBENCH_STAMP_FILE": f"{tmp}/stamps-head"}, check=True, capture_output=True,
                       timeout=120)
        subprocess.run([RAY_BIN, "start", "--address", f"{HOST}:{port}", *common, *agent_ports()],
                       env=env | {"MOEBENCH_STAMP_FILE": f"{tmp}/stamps-worker"}, check=True, capture_output=True,
                       timeout=120)
        yield f"{HOST}:{port}", f"ray://{HOST}:{client_port}", Path(tmp) / "node-cache"
    finally:
        for p in cluster_processes(tmp):
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(cluster_processes(tmp), timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def spans(run: Path) -> dict[str, list[tuple[datetime, datetime]]]:
    """run.json "ray_cells": node id -> the (start, end) of every cell that ran there, in order (lost cells have
    none: their task never returned)."""
    out: dict[str, list] = {}
    for c in json.loads((run / "run.json").read_text())["ray_cells"].values():
        if c["started"]:
            out.setdefault(c["node"], []).append((datetime.fromisoformat(c["started"]),
                                                  datetime.fromisoformat(c["ended"])))
    return {k: sorted(v) for k, v in out.items()}


def frames(run: Path):
    return (pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv"), pd.read_csv(run / "samples.csv"))


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_spread_runs_cells_on_both_nodes_like_a_local_run(cluster, tiny, tmp_path):
    address, _, node_cache = cluster
    args = ["-e", "llama-cpp", "--n-cpu-moe", "0,1,2,all", "-w", "pp16,tg4", "-r", "2", "--threads", "1",
            "--sample-ms", "20"]
    # The head synthesizes preset:tiny into its own cache, each node its own copy. (Connected through the
    # GCS address: Ray's ray:// client server failed to start its per-client process here now and then,
    # "SpecificServer startup failed", and the driver then waits forever; see the closing note.)
    r = moebench("sweep", "-m", "preset:tiny", *args, "--ray", address, "--results-dir", tmp_path / "ray",
                 env={"MOEBENCH_CACHE": str(tmp_path / "head-cache")})
    assert r.returncode == 0, r.stderr
    local = moebench("sweep", "-m", tiny, *args, "--results-dir", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    run = run_dir_of(r)
    cells, meas, samples = frames(run)
    lcells, lmeas, lsamples = frames(run_dir_of(local))

    assert (cells["status"] == "ok").all(), cells["error"].tolist()
    assert cells["node"].nunique() == 2                        # spread over both nodes
    assert list(node_cache.glob("models/tiny-*.gguf"))         # the nodes synthesized the preset themselves
    assert str(node_cache) in " ".join(cells["model"])
    # same result shape as a local run of the same sweep: columns, cells, rows per cell and workload
    assert list(cells.columns) == list(lcells.columns) and list(meas.columns) == list(lmeas.columns)
    assert list(samples.columns) == list(lsamples.columns)
    assert sorted(cells["cell_id"]) == sorted(lcells["cell_id"])
    key = ["cell_id", "workload"]
    assert meas.groupby(key).size().to_dict() == lmeas.groupby(key).size().to_dict()
    assert lcells["node"].isna().all()                         # a local run has no Ray node
    assert set(samples["cell_id"]) == set(cells["cell_id"])   # memory was sampled on the nodes
    assert (meas["tokens_per_s"] > 0).all()
    nodes = json.loads((run / "run.json").read_text())["nodes"]
    assert set(nodes) == set(cells["node"]) and all(n["cpu"] and n["hostname"] for n in nodes.values())
    assert len(list((run / "logs").glob("*.log"))) == 4       # each cell's engine log came back
    assert set(spans(run)) == set(cells["node"]) and all(disjoint(s) for s in spans(run).values())


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_two_cells_never_share_a_node_at_the_same_time(cluster, tiny, tmp_path):
    address, _, node_cache = cluster
    tmp = node_cache.parent
    for file in ("stamps-head", "stamps-worker"):
        (tmp / file).unlink(missing_ok=True)
    r = moebench("sweep", "-m", tiny, "-e", "stamp", "--n-cpu-moe", "0,1,2,3,4", "-w", "pp16", "-r", "1",
                 "--threads", "1", "--sample-ms", "0", "--ray", address, "--results-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    cells = pd.read_csv(run / "cells.csv")
    assert len(cells) == 5 and (cells["status"] == "ok").all(), cells["error"].tolist()
    by_node = spans(run)                  # from the cells' start and end times on their nodes
    assert len(by_node) == 2 and sum(map(len, by_node.values())) == 5
    assert all(disjoint(s) for s in by_node.values()), by_node
    # the same from the cells' own processes: each node's stamp file, one worker pid per cell
    pids = 0
    for file in ("stamps-head", "stamps-worker"):
        stamps = pd.read_csv(tmp / file, sep=" ", names=["label", "start", "end", "pid"])
        per_cell = stamps.groupby("pid").agg(start=("start", "min"), end=("end", "max"))
        assert disjoint(zip(per_cell["start"], per_cell["end"])), per_cell
        pids += len(per_cell)
    assert pids == 5


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_per_node_runs_every_cell_on_every_node_and_resumes_per_node(cluster, tiny, tmp_path):
    address, _, _ = cluster
    env = {"RAY_ADDRESS": address}
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16,tg4", "-r", "1",
                 "--threads", "1", "--ray", "auto", "--per-node", "--results-dir", tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    cells, meas, _ = frames(run)
    assert len(cells) == 4 and (cells["status"] == "ok").all(), cells["error"].tolist()
    assert cells["cell_id"].is_unique
    per_node = cells.groupby("node")["n_cpu_moe"].apply(sorted).to_dict()
    assert len(per_node) == 2 and all(v == [0, 4] for v in per_node.values())   # tiny has 4 layers
    label = cells["cell_id"].str.split("@").str[1]
    assert label.nunique() == 2 and (cells.groupby("node")["cell_id"].nunique() == 2).all()
    assert len(meas) == 8
    r2 = moebench("sweep", "--resume", run, env=env)           # every (cell, node) is done: nothing runs again
    assert r2.returncode == 0, r2.stderr
    assert pd.read_csv(run / "cells.csv")[["cell_id", "load_s"]].equals(cells[["cell_id", "load_s"]])


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_ray_nodes_names_the_nodes_to_use(cluster, tiny, tmp_path):
    address, _, _ = cluster
    args = ["-m", tiny, "-e", "llama-cpp", "--n-cpu-moe", "0,all", "-w", "pp16", "-r", "1", "--threads", "1",
            "--sample-ms", "0", "--ray", address, "--results-dir", tmp_path]
    r = moebench("sweep", *args, "--ray-nodes", "nowhere")
    assert r.returncode == 2 and "--ray-nodes nowhere names none of them" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())                       # nothing started
    first = re.search(rf"\({HOST}, ([0-9a-f]{{8}}), 1 CPU\)", r.stderr).group(1)   # the message lists the nodes
    r = moebench("sweep", *args, "--ray-nodes", first)
    assert r.returncode == 0, r.stderr
    cells = pd.read_csv(run_dir_of(r) / "cells.csv")
    assert len(cells) == 2 and (cells["status"] == "ok").all() and set(cells["node"].str[:8]) == {first}


def _hang_cell_worker(tmp: str) -> psutil.Process | None:
    """The Ray worker (a child of one of our raylets) whose child is a cell's worker process."""
    for p in psutil.process_iter(["cmdline"]):
        if "harness.run.worker" in " ".join(p.info["cmdline"] or []):
            try:
                ray_worker = p.parent()
                if tmp in " ".join(ray_worker.parent().cmdline()):
                    return ray_worker
            except (psutil.Error, AttributeError):
                pass
    return None


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_killed_ray_worker_becomes_a_failed_row_and_resume_finishes(cluster, tiny, tmp_path):
    address, _, node_cache = cluster
    tmp = str(node_cache.parent)
    env = {"RAY_ADDRESS": address, "FAULT": "hang", "MOEBENCH_RAY_ENV": "FAULT"}   # the hang engine hangs
    cmd = ["sweep", "-m", tiny, "-e", "llama-cpp,hang", "-w", "pp16", "-r", "1", "--threads", "1",
           "--ray", "auto", "--results-dir", tmp_path]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(moebench, *cmd, env=env, timeout=120)
        victim, deadline = None, time.time() + 60
        while time.time() < deadline:
            cells = list(tmp_path.glob("*/cells.csv"))          # the llama-cpp cell is done: only hang runs
            victim = _hang_cell_worker(tmp) if cells else None
            if victim:
                break
            time.sleep(0.2)
        assert victim is not None, "the hang cell never started"
        cell_child = victim.children()[0]
        victim.send_signal(signal.SIGKILL)
        r = fut.result()
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    cells = pd.read_csv(run / "cells.csv").set_index("engine")
    assert cells.loc["llama-cpp", "status"] == "ok"
    assert cells.loc["hang", "status"] == "failed" and "lost" in cells.loc["hang", "error"]
    assert "--resume" in cells.loc["hang", "error"]
    psutil.wait_procs([cell_child], timeout=10)
    assert not cell_child.is_running()                         # the cell's own process did not outlive it
    load_before = cells.loc["llama-cpp", "load_s"]

    r2 = moebench("sweep", "--resume", run, env={"RAY_ADDRESS": address})   # no FAULT: the hang engine works
    assert r2.returncode == 0, r2.stderr
    cells2 = pd.read_csv(run / "cells.csv").set_index("engine")
    assert (cells2["status"] == "ok").all() and len(cells2) == 2
    assert cells2.loc["llama-cpp", "load_s"] == load_before   # not run again
    assert set(pd.read_csv(run / "measurements.csv")["engine"]) == {"llama-cpp", "hang"}


THIRD = "127.0.0.3"        # the node that joins during a sweep and is then lost


def node_processes(ip: str) -> list[psutil.Process]:
    """Every process of the node at this IP: raylet, agents, and all under them (Ray workers, cells, reapers)."""
    procs = {}
    for r in psutil.process_iter(["cmdline"]):
        if ip in " ".join(r.info["cmdline"] or []):
            try:
                procs |= {p.pid: p for p in [r, *r.children(recursive=True)]}
            except psutil.Error:
                pass
    return list(procs.values())


def cell_running_on(ip: str) -> bool:
    for p in node_processes(ip):
        try:
            if "harness.run.worker" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


@pytest.mark.slow
def test_a_node_that_joins_takes_cells_and_a_lost_node_costs_only_its_running_cell(cluster, tiny, tmp_path):
    """(~60 s: a third `ray start`, then Ray notices the lost node only after its health checks time out)"""
    address, _, node_cache = cluster
    cmd = ["sweep", "-m", tiny, "-e", "stamp,hang", "--n-cpu-moe", "0,1,2,3,4", "-w", "tg300", "-r", "1",
           "--threads", "1", "--sample-ms", "0", "--ray", address, "--results-dir", tmp_path]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEBENCH_CACHE": str(node_cache),
           "MOEBENCH_STAMP_FILE": f"{node_cache.parent}/stamps-third"}

    def on_third() -> list[dict]:          # run.json "ray_cells" of the cells that ran on the third node
        runs = list(tmp_path.glob("*/run.json"))
        cells = json.loads(runs[0].read_text()).get("ray_cells", {}) if runs else {}
        return [c for c in cells.values() if c["address"] == THIRD]

    from concurrent.futures import ThreadPoolExecutor
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(moebench, *cmd, timeout=300)
            while not list(tmp_path.glob("*/run.json")) and not fut.done():
                time.sleep(0.2)
            subprocess.run([RAY_BIN, "start", "--address", address, "--node-ip-address", THIRD, *PLAIN,
                            *agent_ports()], env=env, check=True, capture_output=True, timeout=120)
            deadline = time.time() + 120   # one cell done there and the next one running: then the node goes
            while time.time() < deadline and not fut.done() and not (on_third() and cell_running_on(THIRD)):
                time.sleep(0.3)
            assert on_third(), "the node that joined never ran a cell"
            victims = node_processes(THIRD)
            kill_all(victims)
            r = fut.result()
    finally:
        kill_all(node_processes(THIRD))
    assert r.returncode == 0, r.stderr
    run = run_dir_of(r)
    cells = pd.read_csv(run / "cells.csv")
    assert len(cells) == 10 and cells["cell_id"].is_unique
    lost = cells[cells["status"] != "ok"]
    assert len(lost) == 1 and "lost" in lost["error"].iloc[0], cells["error"].tolist()
    placed = json.loads((run / "run.json").read_text())["ray_cells"]
    assert placed[lost["cell_id"].iloc[0]]["address"] == THIRD
    assert any(c["address"] == THIRD and c["started"] for c in placed.values())    # it ran cells before it went
    assert len(spans(run)) == 3 and all(disjoint(s) for s in spans(run).values())
    assert not any(p.is_running() for p in victims)

    r2 = moebench("sweep", "--resume", run)                    # the lost cell runs again, on the nodes left
    assert r2.returncode == 0, r2.stderr
    cells2 = pd.read_csv(run / "cells.csv")
    assert len(cells2) == 10 and (cells2["status"] == "ok").all(), cells2["error"].tolist()


@pytest.mark.slow      # a real sweep of 7-45 s: .ci/run runs it
def test_ctrl_c_stops_the_running_cell_on_its_node(cluster, tiny, tmp_path):
    address, _, node_cache = cluster
    env = {**os.environ, "MOEBENCH_ENGINES": FAULTS, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": address,
           "FAULT": "hang", "MOEBENCH_RAY_ENV": "FAULT"}
    p = subprocess.Popen([sys.executable, "-m", "harness", "sweep", "-m", str(tiny), "-e", "hang", "-w", "pp16",
                          "-r", "1", "--ray", "auto", "--results-dir", str(tmp_path)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_default)
    deadline = time.time() + 60
    while time.time() < deadline and not (victim := _hang_cell_worker(str(node_cache.parent))):
        time.sleep(0.2)
    assert victim is not None, "the hang cell never started"
    cell_child = victim.children()[0]
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "--resume" in err
    psutil.wait_procs([cell_child], timeout=10)
    assert not cell_child.is_running()                         # cancelled on the node: the cell's process is gone


def test_model_missing_or_different_on_a_node_is_a_failed_cell_with_the_reason(tiny, tmp_path):
    from harness.run.ray import _model_on_node
    from harness.run.spec import SweepSpec, expand

    cell = expand(SweepSpec(models=[str(tiny)], engines=["llama-cpp"], workloads=["pp16"]))[0]
    _, why = _model_on_node(cell.__class__(**{**cell.__dict__, "model": tmp_path / "gone.gguf"}), 0, None)
    assert "not found on node" in why and "gone.gguf" in why
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny.read_bytes()[:-8] + b"\0" * 8)     # same path elsewhere, different weights
    _, why = _model_on_node(cell.__class__(**{**cell.__dict__, "model": other}), 0, None)
    assert "differs" in why
    ok, why = _model_on_node(cell, 0, None)
    assert why is None and ok.model == tiny


def test_without_ray_or_with_bad_flags_says_how_to_fix(tiny, tmp_path):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp16", "--ray", "auto", "--results-dir", tmp_path,
                 env={"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"})
    assert r.returncode == 2 and "pip install 'moebench[ray]'" in r.stderr and "Traceback" not in r.stderr
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp16", "--per-node", "--results-dir", tmp_path)
    assert r.returncode == 2 and "--per-node needs --ray" in r.stderr
    r = moebench("sweep", "-m", tiny, "-e", "llama-cpp", "-w", "pp16", "--ray", f"127.0.0.1:{free_port()}",
                 "--results-dir", tmp_path, timeout=30)            # nothing listens there: fails fast
    assert r.returncode == 2 and "not reachable" in r.stderr and "ray start --head" in r.stderr
    assert not list(tmp_path.glob("*/run.json"))              # no run directory for a sweep that cannot start
