"""The Ray driver's own scheduling (harness.run.ray.Cluster: one cell per node, nodes that join or die, which nodes
are used) against a stand-in `ray` module, in steps, without a cluster: one ray.wait is one step."""
import json

import pandas as pd
import pytest

from tests.conftest import disjoint


def fake_node(i: int, cpu: float = 1, gpu: float = 0, slot: float = 0, host: str | None = None) -> dict:
    return {"NodeID": f"{i:02x}ff" * 14, "Alive": True, "NodeManagerHostname": host or f"h{i}",
            "NodeManagerAddress": f"10.0.0.{i}",
            "Resources": {"CPU": cpu, **({"GPU": gpu} if gpu else {}), **({"moebench_slot": slot} if slot else {})}}


class FakeRay:
    """Just what Cluster uses. A task runs STEPS waits on its node; `events` (step -> fn(fake)) let nodes join and
    die; a node killed with stale=True still looks alive in nodes() (the GCS has not noticed yet), and its running
    task fails as a crashed worker rather than a dead node."""
    STEPS = 3

    def __init__(self, nodes: list[dict], events: dict | None = None):
        import ray.exceptions
        self.exceptions = ray.exceptions
        self._nodes, self.events, self.step = nodes, events or {}, 0
        self.running: dict[object, tuple] = {}     # ref -> (cell, node id, start step, run id)
        self.results: dict[object, object] = {}    # ref -> out dict or exception
        self.spans: list[tuple[str, str, int, int]] = []   # (node id, cell id, start, end)
        self.stale: set[str] = set()
        self.submitted: list[dict] = []            # task options of every submission

    def nodes(self):
        return [n | {"Alive": n["Alive"] or n["NodeID"] in self.stale} for n in self._nodes]

    def remote(self, **_):
        return lambda fn: FakeTask(self, {})

    def submit(self, cell, opts: dict, run_id: str):
        self.submitted.append(opts)
        ref, node_id = object(), opts["scheduling_strategy"].node_id
        if any(n["NodeID"] == node_id and n["Alive"] for n in self._nodes):
            self.running[ref] = (cell, node_id, self.step, run_id)
        else:
            self.results[ref] = self.exceptions.TaskUnschedulableError(f"node {node_id} is dead")
        return ref

    def wait(self, refs, num_returns, timeout):
        self.step += 1
        if fn := self.events.get(self.step):
            fn(self)
        from harness.run.runner import cell_row
        for ref, (cell, node_id, start, run_id) in list(self.running.items()):
            if self.step - start >= self.STEPS:
                del self.running[ref]
                self.spans.append((node_id, cell.cell_id, start, self.step))
                self.results[ref] = {"row": cell_row(cell, run_id, "ok", "") | {"node": node_id}, "measurements": [],
                                     "samples": [], "log": "", "node": {"node_id": node_id}, "started": str(start),
                                     "ended": str(self.step)}
        ready = [r for r in refs if r in self.results][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        out = self.results.pop(ref)
        if isinstance(out, Exception):
            raise out
        return out

    def join(self, node: dict):
        self._nodes.append(node)

    def kill(self, i: int, stale: bool = False):
        node = next(n for n in self._nodes if n["NodeManagerHostname"] == f"h{i}")
        node["Alive"] = False
        if stale:
            self.stale.add(node["NodeID"])
        for ref, (cell, node_id, start, _) in list(self.running.items()):
            if node_id == node["NodeID"]:
                del self.running[ref]
                self.spans.append((node_id, cell.cell_id, start, self.step))
                self.results[ref] = (self.exceptions.WorkerCrashedError() if stale else   # the worker's death
                                     self.exceptions.NodeDiedError(f"node {node_id} died"))  # seen first, or the node's

    def cancel(self, ref):
        pass

    def shutdown(self):
        pass


class FakeTask:
    def __init__(self, ray: FakeRay, opts: dict):
        self.ray, self.opts = ray, opts

    def options(self, **opts):
        return FakeTask(self.ray, opts)

    def remote(self, cell, spec, run_id, preset):
        return self.ray.submit(cell, self.opts, run_id)


@pytest.fixture
def fake_run(tiny, tmp_path, monkeypatch):
    """(spec, cells, run_dir, ray module) for a Cluster run against FakeRay: 8 cells, nodes re-read every step."""
    import dataclasses

    import harness.run.ray as hray
    from harness.run.spec import SweepSpec, expand

    monkeypatch.setattr(hray, "NODE_REFRESH_S", 0.0)
    spec = SweepSpec(models=[str(tiny)], engines=["llama-cpp"], workloads=["pp16"])
    cells = [dataclasses.replace(expand(spec)[0], engine=f"e{i}") for i in range(8)]
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "run"}))
    return spec, cells, run_dir, hray


def fake_cluster(hray, fake: FakeRay, spec, names=()):
    cluster = hray.Cluster(fake, "fake", list(names))
    cluster.refresh()
    return cluster


def disjoint_steps(fake: FakeRay) -> bool:
    return all(disjoint([(s, e) for n, _, s, e in fake.spans if n == node]) for node in {s[0] for s in fake.spans})


@pytest.mark.parametrize("stale", [False, True])
def test_scheduler_one_cell_per_node_takes_joined_nodes_and_loses_only_a_dead_nodes_cell(fake_run, stale):
    spec, cells, run_dir, hray = fake_run
    h1, h2, h3 = fake_node(1), fake_node(2), fake_node(3)
    # step 2: h3 joins; step 4: h1 dies while running its second cell (stale: the GCS still lists it for a while)
    fake = FakeRay([h1, h2], {2: lambda f: f.join(h3), 4: lambda f: f.kill(1, stale=stale)})
    cluster = fake_cluster(hray, fake, spec)
    progress = []
    cluster.run(spec, cells, run_dir, set(), lambda c, row, i, n: progress.append((i, n)))

    rows = pd.read_csv(run_dir / "cells.csv")
    assert len(rows) == 8 and rows["cell_id"].is_unique and progress[-1] == (8, 8)
    lost = rows[rows["status"] != "ok"]
    assert len(lost) == 1 and "lost" in lost["error"].iloc[0] and lost["node"].iloc[0] == h1["NodeID"]
    assert disjoint_steps(fake)                                  # never two cells on one node at once
    assert {n for n, *_ in fake.spans} == {h1["NodeID"], h2["NodeID"], h3["NodeID"]}   # the joined node worked
    assert max(s for n, _, s, _ in fake.spans if n == h1["NodeID"]) < 4                 # nothing started on h1 after
    strategies = [o["scheduling_strategy"] for o in fake.submitted]
    assert all(not s.soft for s in strategies) and "resources" not in fake.submitted[0]   # pinned, no custom resource
    # stale: one more submission than cells, the pin to the dead-but-listed h1 was refused and its cell ran elsewhere
    assert len(strategies) == 8 + stale and [s.node_id for s in strategies].count(h1["NodeID"]) == 2 + stale
    placements = json.loads((run_dir / "run.json").read_text())["ray_cells"]
    assert set(placements) == set(rows["cell_id"]) and placements[lost["cell_id"].iloc[0]]["started"] is None


def test_scheduler_per_node_keeps_each_nodes_cells_there_and_fails_those_of_a_missing_node(fake_run, monkeypatch):
    spec, cells, run_dir, hray = fake_run
    monkeypatch.setattr(hray, "NODE_WAIT_S", 0.3)
    spec.per_node = True
    # an earlier run of this sweep also had node h9, which is not there now (--resume)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "run", "ray_per_node": ["h9", "h1"]}))
    h1, h2 = fake_node(1), fake_node(2)
    fake = FakeRay([h1, h2])
    fake_cluster(hray, fake, spec).run(spec, cells[:2], run_dir, set())

    rows = pd.read_csv(run_dir / "cells.csv")
    assert len(rows) == 6 and rows["cell_id"].is_unique
    label = rows["cell_id"].str.split("@").str[1]
    assert (rows[label != "h9"]["status"] == "ok").all()
    missing = rows[label == "h9"]
    assert len(missing) == 2 and (missing["status"] == "failed").all()
    assert missing["error"].str.contains("node h9 is not in the Ray cluster").all()
    assert missing["error"].str.contains("--resume").all()
    for node in (h1, h2):                                  # every node ran its own copy of the sweep, one at a time
        ran = [c for n, c, *_ in fake.spans if n == node["NodeID"]]
        assert len(ran) == 2 and all(c.endswith("@" + node["NodeManagerHostname"]) for c in ran)
    assert disjoint_steps(fake)
    assert json.loads((run_dir / "run.json").read_text())["ray_per_node"] == ["h9", "h1", "h2"]


def test_which_nodes_are_used(fake_run):
    spec, _, _, hray = fake_run
    head = fake_node(0, cpu=0)                             # a KubeRay head: num-cpus 0, kept free of work
    w1, w2, w3 = fake_node(1, cpu=4), fake_node(2, cpu=4, gpu=1), fake_node(3, cpu=4) | {"Alive": False}
    nodes = [head, w1, w2, w3]

    def used(**kw) -> list[str]:
        return [n["NodeManagerHostname"] for n in hray.Cluster(FakeRay(nodes), "fake", **kw).refresh()]

    assert used() == ["h1", "h2"]                          # alive nodes that offer CPUs to Ray
    assert used(gpu_only=True) == ["h2"]                   # spread over a cluster with GPUs
    assert used(names=["h0", "10.0.0.2", w3["NodeID"][:8]]) == ["h0", "h2"]   # hostname, IP, id prefix; alive only
    w1["Resources"]["moebench_slot"] = 1
    assert used(slot_only=True) == ["h1"]                  # the optional custom resource names the nodes
    cluster = hray.Cluster(FakeRay(nodes), "fake")
    assert cluster._options(w1)["resources"] == {"moebench_slot": 1} and cluster._options(w1)["num_gpus"] == 0
    assert "resources" not in cluster._options(w2) and cluster._options(w2)["num_gpus"] == 1


def test_scheduler_fails_the_cells_left_when_no_node_is_left(fake_run, monkeypatch):
    spec, cells, run_dir, hray = fake_run
    monkeypatch.setattr(hray, "NODE_WAIT_S", 0.2)
    fake = FakeRay([fake_node(1)], {2: lambda f: f.kill(1)})
    fake_cluster(hray, fake, spec).run(spec, cells[:3], run_dir, set())
    errors = pd.read_csv(run_dir / "cells.csv")["error"].tolist()
    assert len(errors) == 3 and "lost" in errors[0]
    assert all("no node of the Ray cluster could take the cell" in e and "--resume" in e for e in errors[1:])
