"""Sweeps on a Ray cluster (`moebench sweep --ray auto|ray://HOST:PORT [--per-node] [--ray-nodes A,B]`).

Works on a cluster as it is (`ray start --head`, `ray start --address HEAD:6379`; KubeRay; a shared cluster):
no custom resource. The driver is the scheduler. It reads the alive nodes (ray.nodes(), again every
NODE_REFRESH_S), keeps its own set of busy nodes and starts at most one cell per node, pinned there with a hard
NodeAffinitySchedulingStrategy (a benchmark cell must own its machine). Each cell is a Ray task that calls
harness.run.runner.run_cell on the node - the cell still runs in its own worker process there, with the same
memory sampling - in a node-local temp directory, and returns its rows; the driver appends them to the one run
directory as tasks finish (ray.wait) and starts the next cell on the node that came free. A node that joins
takes cells not yet started; a lost node or killed Ray worker costs only its running cell (a failed row), and
--resume runs the rest.

Why not a task that asks for all of a node's CPUs (and GPUs), leaving the exclusion to Ray's scheduler: one
amount fits only equal nodes (a 16-CPU task fits twice on a 32-CPU node), so it must be per node, which is
pinning anyway; on a shared cluster such a task waits until nobody holds even one CPU of the node, possibly
forever. What pinning does not see: work on a node that is not this sweep's (another user's tasks, another
sweep) - hence the optional resource below.
Nodes used: those named by --ray-nodes; else those offering the optional custom resource `moebench_slot` when
any does (a cell there also asks for it, which keeps two sweeps on one cluster off each other's nodes); else
every node that offers CPUs to Ray (a KubeRay head started with num-cpus 0 is kept free of work on purpose).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from engines.errors import UserError
from harness.hw import host
from harness.store import results
from harness.run.runner import cell_row, log_path, run_cell, save_run_json
from harness.run.spec import Cell, SweepSpec
from workloads.synth import resolve_model

SLOT = "moebench_slot"          # optional: where nodes offer it, only they are used and each cell asks for one
LOG_KEEP = 256 << 10            # bytes of a cell's engine log brought back to the head
NODE_REFRESH_S = 2.0            # how often the driver reads the cluster's nodes again (joins, leaves)
NODE_WAIT_S = 60.0              # how long cells wait for a node to run them (a lost --per-node node; no node left)
START_NODES = ("start one with `ray start --head` on the first machine and `ray start --address HEAD:6379` on "
               "the others")
# Environment the cells see on the nodes: the node's own, plus these from the machine that starts the sweep.
FORWARD_ENV = ("MOEBENCH_ENGINES",)      # engine plugins; MOEBENCH_RAY_ENV=A,B forwards more variables


def forwarded_env() -> dict[str, str]:
    extra = [x.strip() for x in os.environ.get("MOEBENCH_RAY_ENV", "").split(",") if x.strip()]
    return {k: os.environ[k] for k in (*FORWARD_ENV, *extra) if k in os.environ}


def _unreachable(address: str) -> str | None:
    """Why HOST:PORT (or ray://HOST:PORT) cannot be reached, checked in 5 s: ray.init itself retries an
    unreachable address for minutes. None when reachable, or when the address is not HOST:PORT (auto)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        return f"{host}:{port} is not reachable: {e.strerror or e}"
    return None


def node_labels(nodes: list[dict]) -> dict[str, str]:
    """Node id -> its hostname, or hostname-<id prefix> where several nodes share a hostname.
    Hostnames survive a cluster restart (node ids do not), so --resume --per-node finds its cells."""
    hosts = [n["NodeManagerHostname"] for n in nodes]
    return {n["NodeID"]: h if hosts.count(h) == 1 else f"{h}-{n['NodeID'][:8]}" for n, h in zip(nodes, hosts)}


def named(node: dict, label: str, names: list[str]) -> bool:
    """Whether --ray-nodes names this node: by hostname, label (cell ids' @<node>), IP, or a node-id prefix."""
    ids = (node["NodeManagerHostname"], label, node["NodeManagerAddress"])
    return any(x in ids or (len(x) >= 6 and node["NodeID"].startswith(x)) for x in names)


def describe(nodes: list[dict], most: int = 8) -> str:
    """For messages: `hostname (IP, node id prefix, N CPU)` of the first `most` nodes."""
    text = ", ".join(f"{n['NodeManagerHostname']} ({n['NodeManagerAddress']}, {n['NodeID'][:8]}, "
                     f"{n['Resources'].get('CPU', 0):g} CPU)" for n in nodes[:most]) or "none"
    return text + (f" and {len(nodes) - most} more" if len(nodes) > most else "")


@functools.lru_cache(maxsize=1)
def _node_fingerprint() -> dict:
    return host.fingerprint()          # once per Ray worker process (they are reused)


def _model_on_node(cell: Cell, seed: int, preset: str | None) -> tuple[Cell, str | None]:
    """The cell with this node's model path, or a reason why the node cannot run it."""
    host = socket.gethostname()
    try:
        path = resolve_model(preset, seed) if preset else Path(cell.model)   # a preset is synthesized here once
    except Exception as e:      # noqa: BLE001 - any failure to synthesize is the cell's failure, with its reason
        return cell, f"cannot synthesize {preset} on node {host}: {type(e).__name__}: {e}"
    if not path.is_file():
        return cell, (f"model {path} not found on node {host}; put the file at the same path on every node "
                      f"or use -m preset:NAME")
    from engines.gguf_meta import read_meta
    fp = read_meta(path).fingerprint
    if fp != cell.meta.fingerprint:
        return cell, (f"model {path} on node {host} differs from the one the sweep was planned with "
                      f"(fingerprint {fp} vs {cell.meta.fingerprint}); copy the same file to every node")
    return dataclasses.replace(cell, model=path), None


def reap_orphans(worker_pid: int, period_s: float = 0.2) -> None:
    """Sidecar of one task: once the Ray worker is gone (killed, node out of memory), kill the processes it had
    started. The cell's worker process runs in its own session (so run_cell can kill its whole tree), which
    Ray's own cleanup of a dead worker's process group does not reach; left alive, it would share the node
    with the next cell."""
    import psutil

    seen: dict[int, psutil.Process] = {}
    try:
        worker = psutil.Process(worker_pid)
        while worker.is_running():
            seen |= {p.pid: p for p in worker.children(recursive=True) if p.pid != os.getpid()}
            time.sleep(period_s)
    except psutil.NoSuchProcess:
        pass
    for p in seen.values():
        try:
            if p.is_running():          # also checks the start time: a reused pid is left alone
                p.kill()
        except psutil.Error:
            pass


def run_on_node(cell: Cell, spec: SweepSpec, run_id: str, preset: str | None) -> dict:
    """The Ray task: run one cell on this node; returns its rows, its log tail, the node's fingerprint and when the
    cell started and ended here (this node's clock)."""
    import psutil
    import ray

    started = _now()
    node = {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
            **_node_fingerprint()}
    if "OMP_NUM_THREADS" not in psutil.Process().environ():     # Ray's default for a task (1), not the node's:
        os.environ.pop("OMP_NUM_THREADS", None)                  # a local cell would not see it (Ray unsets it after)
    # its own session: Ray kills a dead worker's process group, and the reaper must outlive the worker
    reaper = subprocess.Popen([sys.executable, "-m", "harness.run.ray", "--reap", str(os.getpid())],
                              start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        return _run_here(cell, spec, run_id, preset, node) | {"started": started, "ended": _now()}
    finally:
        reaper.kill()
        reaper.wait()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _run_here(cell: Cell, spec: SweepSpec, run_id: str, preset: str | None, node: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="moebench-cell-") as tmp:
        tmp = Path(tmp)
        (tmp / "logs").mkdir()
        cell, problem = _model_on_node(cell, spec.seed, preset)
        if problem:
            row, meas, samples = cell_row(cell, run_id, "failed", problem), [], []
        else:
            row, meas, samples = run_cell(cell, spec, tmp, run_id)
        log = b"".join(p.read_bytes()[-LOG_KEEP:] for p in (tmp / "logs").iterdir())
    row["node"] = node["node_id"]
    return {"row": row, "measurements": meas, "samples": samples, "log": log.decode(errors="replace"), "node": node}


def _lost(cell: Cell, node: dict | None, err: Exception, run_id: str) -> dict:
    """A failed row for a cell whose task never returned (node lost, Ray worker killed, task error)."""
    lines = [x for x in str(err).strip().splitlines() if x.strip()]
    why = f"{type(err).__name__}: {lines[-1].strip() if lines else ''}"
    where = f" on node {node['NodeManagerHostname']} ({node['NodeID'][:8]})" if node else ""
    if type(err).__name__.startswith("RayTaskError"):       # the task itself raised (e.g. moebench missing there)
        error = f"the Ray task failed{where}: {why}"
    else:                                                   # WorkerCrashedError, NodeDiedError, ...
        error = f"lost{where}: the node or its Ray worker died while running the cell ({why}); --resume runs it again"
    row = cell_row(cell, run_id, "failed", error)
    row["host"], row["node"] = (node["NodeManagerHostname"], node["NodeID"]) if node else ("", "")
    return row


def _stranded(cell: Cell, run_id: str) -> dict:
    """A failed row for a cell that no node could take for NODE_WAIT_S (it never started)."""
    error = (f"node {cell.node} is not in the Ray cluster (waited {NODE_WAIT_S:g} s for it); --resume runs the cell "
             f"once it is back" if cell.node else
             f"no node of the Ray cluster could take the cell for {NODE_WAIT_S:g} s; --resume runs it when one can")
    row = cell_row(cell, run_id, "failed", error)
    row["host"] = row["node"] = ""
    return row


@dataclass
class Cluster:
    ray: Any                     # the connected `ray` module
    address: str
    names: list[str] = field(default_factory=list)     # --ray-nodes
    slot_only: bool = False      # no --ray-nodes, and some node offers SLOT: only such nodes
    gpu_only: bool = False       # spread over a cluster with GPUs: only GPU nodes (each cell asks for a GPU)
    nodes: list[dict] = field(default_factory=list)    # usable alive nodes (ray.nodes() records), last read
    labels: dict[str, str] = field(default_factory=dict)   # node id -> label, never changed once given
    excluded: set[str] = field(default_factory=set)        # nodes that refused a pinned task (gone, infeasible)

    @classmethod
    def connect(cls, spec: SweepSpec) -> "Cluster":
        names = list(getattr(spec, "ray_nodes", None) or [])
        if not spec.ray:
            raise UserError(f"{'--ray-nodes' if names else '--per-node'} needs --ray ADDRESS "
                            f"(auto, or ray://HOST:PORT).")
        try:
            import ray
        except ImportError:
            raise UserError("--ray needs Ray, which is not installed; install it with pip install 'moebench[ray]' "
                            "(on every node too).") from None
        try:
            if why := _unreachable(spec.ray):
                raise ConnectionError(why)
            ray.init(address=spec.ray, logging_level="ERROR", log_to_driver=False)
        except Exception as e:   # noqa: BLE001 - ConnectionError, ValueError, gRPC errors: all mean "no cluster there"
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"Cannot connect to a Ray cluster at --ray {spec.ray} ({first}); {START_NODES}, "
                            f"then pass --ray auto on a node or --ray ray://HEAD:10001.") from None
        alive = [n for n in ray.nodes() if n["Alive"]]
        cluster = cls(ray, spec.ray, names, not names and any(n["Resources"].get(SLOT, 0) >= 1 for n in alive))
        cluster.refresh(alive)
        if not spec.per_node and any(n["Resources"].get("GPU", 0) >= 1 for n in cluster.nodes):
            cluster.gpu_only = True        # GPU engines ask for the GPU (Ray then sets CUDA_VISIBLE_DEVICES)
            cluster.refresh(alive)
        if not cluster.nodes:
            ray.shutdown()
            why = (f"--ray-nodes {','.join(names)} names none of them" if names else
                   "none of them offers CPUs to Ray; name the nodes to use with --ray-nodes HOST,...")
            raise UserError(f"No node of the Ray cluster at --ray {spec.ray} can run cells ({why}); its alive nodes: "
                            f"{describe(alive)}.")
        return cluster

    def refresh(self, alive: list[dict] | None = None) -> list[dict]:
        """Read the alive nodes again; keep the usable ones in self.nodes."""
        alive = [n for n in (self.ray.nodes() if alive is None else alive)
                 if n["Alive"] and n["NodeID"] not in self.excluded]
        new = [n for n in alive if n["NodeID"] not in self.labels]
        if new:      # labels of nodes already seen stay as they were (queued --per-node cells carry them)
            self.labels = node_labels(new + [n for n in alive if n["NodeID"] in self.labels]) | self.labels
        if self.names:
            alive = [n for n in alive if named(n, self.labels[n["NodeID"]], self.names)]
        elif self.slot_only:
            alive = [n for n in alive if n["Resources"].get(SLOT, 0) >= 1]
        else:
            alive = [n for n in alive if n["Resources"].get("CPU", 0) > 0]
        self.nodes = [n for n in alive if n["Resources"].get("GPU", 0) >= 1 or not self.gpu_only]
        return self.nodes

    def _plan(self, spec: SweepSpec, cells: list[Cell], run_dir: Path) -> list[Cell]:
        """Every cell of the sweep; with --per-node one copy per node, pinned by label: the nodes usable now plus
        those of the run so far (run.json "ray_per_node"), so --resume also waits for a node that is missing."""
        if not spec.per_node:
            return cells
        run = json.loads((run_dir / "run.json").read_text())
        labels = list(dict.fromkeys([*run.get("ray_per_node", []), *(self.labels[n["NodeID"]] for n in self.nodes)]))
        if labels != run.get("ray_per_node"):
            save_run_json(run_dir, run | {"ray_per_node": labels})
        return [dataclasses.replace(c, node=label) for label in labels for c in cells]

    def _drop(self, node: dict) -> None:
        """Use this node no more in this sweep (a node that comes back has a new node id)."""
        self.excluded.add(node["NodeID"])
        self.nodes = [n for n in self.nodes if n["NodeID"] != node["NodeID"]]

    def _options(self, node: dict) -> dict:
        """Task options that pin a cell to this node (hard affinity: it runs there or fails)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        res = node["Resources"]
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                "num_gpus": 1 if res.get("GPU", 0) >= 1 else 0, **({"resources": {SLOT: 1}} if res.get(SLOT) else {})}

    def run(self, spec: SweepSpec, cells: list[Cell], run_dir: Path, done: set[str],
            on_cell: Callable[[Cell, dict, int, int], None] | None = None) -> None:
        """Run every cell not in `done` on the cluster, at most one per node at a time; rows are appended to
        run_dir as each cell finishes."""
        ray = self.ray
        env = forwarded_env()
        task = ray.remote(max_retries=0, num_cpus=0, **({"runtime_env": {"env_vars": env}} if env else {}))(run_on_node)
        presets = {str(resolve_model(m, spec.seed)): m for m in spec.models if m.startswith("preset:")}
        queue = [c for c in self._plan(spec, cells, run_dir) if c.cell_id not in done]   # cells not started
        total, finished = len(queue), 0
        running: dict[Any, tuple[Cell, dict]] = {}      # task ref -> (cell, the node it is pinned to)
        seen: dict[str, float] = {}                     # cell.node ("" = any) -> last time a node for it was usable
        refreshed = time.monotonic()

        def finish(cell: Cell, out: dict, node: dict | None = None) -> None:
            nonlocal finished
            finished += 1
            self._write(run_dir, out, node)
            if on_cell:
                on_cell(cell, out["row"], finished, total)

        try:
            while queue or running:
                now = time.monotonic()
                if now - refreshed >= NODE_REFRESH_S:
                    self.refresh()
                    refreshed = now
                busy = {node["NodeID"] for _, node in running.values()}
                for node in self.nodes:                 # each idle node takes the first cell it may run
                    label = self.labels[node["NodeID"]]
                    cell = None if node["NodeID"] in busy else next((c for c in queue if c.node in ("", label)), None)
                    if cell:
                        queue.remove(cell)
                        ref = task.options(**self._options(node)).remote(cell, spec, run_dir.name,
                                                                         presets.get(str(cell.model)))
                        running[ref] = (cell, node)
                present = {self.labels[n["NodeID"]] for n in self.nodes} | ({""} if self.nodes else set())
                for key in {c.node for c in queue}:
                    seen[key] = now if key in present else seen.get(key, now)
                for cell in [c for c in queue if now - seen[c.node] > NODE_WAIT_S]:
                    queue.remove(cell)
                    finish(cell, {"row": _stranded(cell, run_dir.name), "measurements": [], "samples": []})
                if not running:
                    time.sleep(min(1.0, NODE_REFRESH_S))       # waiting for a node: look again soon
                    refreshed = -NODE_REFRESH_S
                    continue
                # bounded waits: an unbounded ray.wait holds off Ctrl-C until a cell ends
                ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                for ref in ready:
                    cell, node = running.pop(ref)
                    try:
                        out = ray.get(ref)
                    except ray.exceptions.TaskUnschedulableError:   # the node left (or cannot take it): never started
                        self._drop(node)
                        queue.insert(0, cell)
                        continue
                    except ray.exceptions.RayError as e:
                        if isinstance(e, ray.exceptions.NodeDiedError):
                            self._drop(node)        # before ray.nodes() says so: no next cell pinned to it
                        out = {"row": _lost(cell, node, e, run_dir.name), "measurements": [], "samples": []}
                    finish(cell, out, node)
        except BaseException:        # Ctrl-C: a plain cancel interrupts run_cell on the node, which stops its child
            for ref in running:
                ray.cancel(ref)
            if running:
                ray.wait(list(running), num_returns=len(running), timeout=10)
            raise
        finally:
            ray.shutdown()

    @staticmethod
    def _write(run_dir: Path, out: dict, node: dict | None) -> None:
        """The cell's rows and log; in run.json each node's fingerprint once ("nodes") and where and when each
        cell ran ("ray_cells": node id, hostname, IP, start and end on the node's clock; null for a lost cell)."""
        row, fp = out["row"], out.get("node")
        if fp:                                              # the task returned: its log came with it
            log_path(run_dir, row["cell_id"]).write_text(out["log"])
        results.append_cell(run_dir, row, out["measurements"], out["samples"])
        if not node:                                        # never started: nothing to say where
            return
        run = json.loads((run_dir / "run.json").read_text())
        if fp:
            run.setdefault("nodes", {}).setdefault(fp["node_id"], fp)
        run.setdefault("ray_cells", {})[row["cell_id"]] = {
            "node": node["NodeID"], "host": node["NodeManagerHostname"], "address": node["NodeManagerAddress"],
            "started": out.get("started"), "ended": out.get("ended")}
        save_run_json(run_dir, run)



if __name__ == "__main__":      # python -m harness.run.ray --reap PID (started by run_on_node)
    if sys.argv[1:2] == ["--reap"]:
        reap_orphans(int(sys.argv[2]))
