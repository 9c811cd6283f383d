"""Sweeps on a real local Ray cluster: a head plus one more node on loopback, each offering one moebench_slot.

The cluster is started once for the module (Ray start is slow) in its own temp dir and stopped at the end by
killing exactly the processes it started (never `ray stop`, which would stop other users' clusters too).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tests.conftest import FAULTS, ROOT, moebench, run_dir_of, sigint_default



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


@pytest.fixture(scope="module")
def cluster():
    """A 2-node cluster; yields (RAY_ADDRESS, ray:// client address, the nodes' MOEBENCH_CACHE)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    tmp = tempfile.mkdtemp(prefix="mbray-", dir="/tmp")      # short: Ray's unix socket paths must stay < 108 chars
    port, client_port = free_port(), free_port()
    # on a loaded 2-core box the client server's per-client process can take longer than Ray's 30 s to start
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEBENCH_CACHE": f"{tmp}/node-cache",
           "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "300"}
    common = ["--node-ip-address", HOST, "--resources", '{"moebench_slot": 1}', "--num-cpus", "1",
              "--disable-usage-stats"]

    def agent_ports():
        return ["--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]

    try:
        subprocess.run([ray_bin, "start", "--head", "--port", str(port), "--temp-dir", f"{tmp}/ray",
                        "--include-dashboard=false", "--dashboard-port", str(free_port()),
                        "--ray-client-server-port", str(client_port), *common, *agent_ports()],
                       env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([ray_bin, "start", "--address", f"{HOST}:{port}", *common, *agent_ports()],
                       env=env, check=True, capture_output=True, timeout=120)
        yield f"{HOST}:{port}", f"ray://{HOST}:{client_port}", Path(tmp) / "node-cache"
    finally:
        for p in cluster_processes(tmp):
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(cluster_processes(tmp), timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)



def frames(run: Path):
    return (pd.read_csv(run / "cells.csv"), pd.read_csv(run / "measurements.csv"), pd.read_csv(run / "samples.csv"))


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
    assert r.returncode == 2 and "not reachable" in r.stderr and "moebench_slot" in r.stderr
    assert not list(tmp_path.glob("*/run.json"))              # no run directory for a sweep that cannot start
