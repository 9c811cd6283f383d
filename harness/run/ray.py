"""Sweeps on a Ray cluster (`moebench sweep --ray auto|ray://HOST:PORT [--per-node]`).

No scheduler of our own: every node offers the custom resource `moebench_slot` once
(`ray start ... --resources '{"moebench_slot": 1}'`) and every cell is a Ray task that asks for it, so
a node runs at most one cell at a time (a benchmark must not share its machine with another cell).
The task calls harness.run.runner.run_cell on the node - the cell still runs in its own worker process
there, with the same memory sampling - in a node-local temp directory, and returns its rows. The head
appends them to the one run directory as tasks finish (ray.wait), so results stream back and a lost
node or killed Ray worker costs only its running cell (a failed row); --resume runs the rest.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engines.errors import UserError
from harness.hw import host
from harness.store import results
from harness.run.runner import cell_row, log_path, run_cell
from harness.run.spec import Cell, SweepSpec
from workloads.synth import resolve_model

SLOT = "moebench_slot"
LOG_KEEP = 256 << 10            # bytes of a cell's engine log brought back to the head
START_NODES = (f"start every node once with `ray start --head --resources '{{\"{SLOT}\": 1}}'` (first machine) or "
               f"`ray start --address HEAD:6379 --resources '{{\"{SLOT}\": 1}}'` (the others)")
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
    """The Ray task: run one cell on this node; returns its rows, its log tail and the node's fingerprint."""
    import ray

    node = {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
            **_node_fingerprint()}
    # its own session: Ray kills a dead worker's process group, and the reaper must outlive the worker
    reaper = subprocess.Popen([sys.executable, "-m", "harness.run.ray", "--reap", str(os.getpid())],
                              start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        return _run_here(cell, spec, run_id, preset, node)
    finally:
        reaper.kill()
        reaper.wait()


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


@dataclass
class Cluster:
    ray: Any                     # the connected `ray` module
    address: str
    nodes: list[dict]            # alive nodes that offer SLOT (ray.nodes() records)

    @classmethod
    def connect(cls, spec: SweepSpec) -> "Cluster":
        if not spec.ray:
            raise UserError("--per-node needs --ray ADDRESS (auto, or ray://HOST:PORT).")
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
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOT, 0) >= 1]
        if not nodes:
            ray.shutdown()
            raise UserError(f"No node of the Ray cluster at --ray {spec.ray} offers the {SLOT} resource; "
                            f"{START_NODES}.")
        return cls(ray, spec.ray, nodes)

    def _jobs(self, spec: SweepSpec, cells: list[Cell]) -> list[tuple[Cell, dict, dict | None]]:
        """(cell, task options, pinned node) for every cell of the sweep."""
        if not spec.per_node:
            # GPU engines ask for the GPU when the cluster has one (Ray then sets CUDA_VISIBLE_DEVICES)
            gpus = 1 if any(n["Resources"].get("GPU", 0) >= 1 for n in self.nodes) else 0
            return [(c, {"num_gpus": gpus}, None) for c in cells]
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        labels = node_labels(self.nodes)      # a pinned cell's id names its node, so --resume works per node
        return [(dataclasses.replace(c, node=labels[n["NodeID"]]),
                 {"num_gpus": 1 if n["Resources"].get("GPU", 0) >= 1 else 0,
                  "scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)}, n)
                for n in self.nodes for c in cells]

    def run(self, spec: SweepSpec, cells: list[Cell], run_dir: Path, done: set[str],
            on_cell: Callable[[Cell, dict, int, int], None] | None = None) -> None:
        """Run every cell not in `done` on the cluster; rows are appended to run_dir as each cell finishes."""
        ray = self.ray
        env = forwarded_env()
        task = ray.remote(max_retries=0, num_cpus=0, resources={SLOT: 1},
                          **({"runtime_env": {"env_vars": env}} if env else {}))(run_on_node)
        presets = {str(resolve_model(m, spec.seed)): m for m in spec.models if m.startswith("preset:")}
        jobs = [j for j in self._jobs(spec, cells) if j[0].cell_id not in done]
        pending = {task.options(**opts).remote(cell, spec, run_dir.name, presets.get(str(cell.model))): (cell, node)
                   for cell, opts, node in jobs}
        try:
            for i in range(len(jobs)):
                ready: list = []
                while not ready:    # bounded waits: an unbounded ray.wait holds off Ctrl-C until a cell ends
                    ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                ref = ready[0]
                cell, node = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayError as e:
                    out = {"row": _lost(cell, node, e, run_dir.name), "measurements": [], "samples": [], "log": "",
                           "node": None}
                self._write(run_dir, out)
                if on_cell:
                    on_cell(cell, out["row"], i + 1, len(jobs))
        except BaseException:        # Ctrl-C: a plain cancel interrupts run_cell on the node, which stops its child
            for ref in pending:
                ray.cancel(ref)
            ray.wait(list(pending), num_returns=len(pending), timeout=10)
            raise
        finally:
            ray.shutdown()

    @staticmethod
    def _write(run_dir: Path, out: dict) -> None:
        row = out["row"]
        if out["node"]:                                     # the task returned: its log came with it
            log_path(run_dir, row["cell_id"]).write_text(out["log"])
        results.append_cell(run_dir, row, out["measurements"], out["samples"])
        node = out["node"]
        if node:                                            # run.json "nodes": each node's fingerprint, once
            run_json = run_dir / "run.json"
            run = json.loads(run_json.read_text())
            if node["node_id"] not in run.setdefault("nodes", {}):
                run["nodes"][node["node_id"]] = node
                run_json.write_text(json.dumps(run, indent=2, default=str))


if __name__ == "__main__":      # python -m harness.run.ray --reap PID (started by run_on_node)
    if sys.argv[1:2] == ["--reap"]:
        reap_orphans(int(sys.argv[2]))
