"""The scale benchmark's simulated nodes (benchmarks/scale.py) against the real coordinator class, in this
process: the per-node report aggregation keeps the lineage exact (every figure equals a brute-force count of
what the nodes sent), and a lost simulated node is handled as a real one (Ray's node list loses it)."""
from __future__ import annotations

import uuid

import pytest

import time

import ray

from benchmarks.scale import SimCoordinator, SimJob, node_ids
from ray_ckpt.lineage import Manifest
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.runtime import coordinator as C
from ray_ckpt.runtime import lineages
from ray_ckpt.runtime.worker import CONTROL_RELAY_S, get_or_create_worker, pack_reports
from ray_ckpt.storage import open_storage

pytestmark = pytest.mark.ray


def _coord(tmp_path, name: str) -> SimCoordinator:
    return SimCoordinator(f"t-{name}-{uuid.uuid4().hex[:8]}", open_storage(str(tmp_path / name)),
                          CheckpointConfig(full_every=100, batch_steps=10, keep_fulls=0))


def _play(coord: SimCoordinator, job: SimJob, rounds: int, pack: bool) -> list[float]:
    """Every node's messages of one round (one chunk per stream) in one update call per node, in order."""
    answers = []

    def send(pairs):
        per_node: dict[str, list] = {}
        for node, msg in pairs:
            per_node.setdefault(node, []).append(msg)
        for node in sorted(per_node):
            msgs = per_node[node]
            answers.append(coord.update(node, pack_reports(msgs) if pack else msgs))

    send(job.start())
    for _ in range(rounds):
        send([p for s in job.streams for p in job.emit(s)])
    return answers


def _job(nodes, ranks=2, objects=True, held_refs=False):
    return SimJob(nodes, ranks, chunk_steps=2, batch_steps=10, full_every=20, hold_chunks=4, refs=["tagged"],
                  manifest_objects=objects, held_refs=held_refs, started_fresh=not held_refs)


def test_aggregated_reports_keep_a_64_node_lineage_exact(ray_cluster, tmp_path):
    nodes = node_ids(64)
    figures = {}
    # as at first (a message each, manifests as JSON, an object ref in each held report), as now (packed, as
    # objects, no refs: a plan asks the holders)
    for pack in (False, True):
        coord, job = _coord(tmp_path, f"pack{pack}"), _job(nodes, objects=pack, held_refs=not pack)
        coord.sim_join(nodes)
        coord.sim_job = job
        answers = _play(coord, job, rounds=13, pack=pack)   # 26 steps a stream: commits, a full, releases
        gens = [job.generation(s) for s in job.streams]
        got, want = coord.sim_figures(gens), job.expected()
        assert want["objects"] > 128 * 13 and want["replicated_objects"] > 0
        assert want["memory_objects"] < want["objects"]          # released chunks (durable) count only as known
        assert got == want
        figures[pack] = got
        # 64 nodes report: each is asked to report every 64 / REPORT_CALLS_PER_S seconds
        assert answers[-1] == pytest.approx(max(C.MIN_REPORT_INTERVAL_S, 64 / C.REPORT_CALLS_PER_S))
        assert coord.status()["recoverable_step"] == job.base(job.streams[-1]) + 26
        s = job.streams[-1]                     # a plan reads every held object of the chain from its holders
        plan = coord.plan(job.base(s) + 26)
        held = [Manifest.from_json(o["manifest"]).name for o in plan["objects"] if not o["durable"]]
        assert held and all(sorted(o["refs"]) == sorted(f"{n}:{Manifest.from_json(o['manifest']).name}"
                                                      for n in job.holders[Manifest.from_json(o["manifest"]).name])
                            for o in plan["objects"] if not o["durable"])
    assert figures[False] == figures[True]


def test_one_control_call_per_node_answers_every_rank_as_its_own_call(ray_cluster, tmp_path):
    nodes = node_ids(4)
    coord, job = _coord(tmp_path, "control"), _job(nodes, ranks=3)
    coord.sim_join(nodes)
    _play(coord, job, rounds=3, pack=True)
    gens = [job.generation(s) for s in job.streams]
    coord.request_full(gens[4], "test")             # a rank of nodes[1]
    reqs = {n: job.control_request(n) for n in nodes}
    assert [len(r) for r in reqs.values()] == [3] * 4 and len({run for r in reqs.values() for run, _, _ in r}) == 12
    answers = {n: coord.control_many(reqs[n]) for n in nodes}
    direct = {g: coord.control(g) for g in gens}   # after the relayed calls: the full was asked for once
    flat = [a for n in nodes for a in answers[n]]
    assert [a["want_full"] for a in flat] == [g == gens[4] for g in gens]
    assert not any(a["want_full"] for a in direct.values())
    assert all(a["delegate"] == direct[g]["delegate"] and a["draining"] == direct[g]["draining"]
               for a, g in zip(flat, gens))


def test_a_lost_simulated_node_is_handled_as_a_real_one(ray_cluster, tmp_path):
    nodes = node_ids(8)
    coord, job = _coord(tmp_path, "lost"), _job(nodes)
    coord.sim_join(nodes)
    coord.sim_job = job                             # its nodes answer a plan's ask for object refs
    _play(coord, job, rounds=13, pack=True)
    lost, peer = nodes[-1], nodes[0]               # the last node's ranks hold the newest generation
    s = job.streams[-1]
    assert job.origin(s) == lost and job.peer(s) == peer
    gen, top = job.generation(s), job.base(s) + 26
    gens = [job.generation(x) for x in job.streams]

    coord.sim_lose(lost)                            # Ray's node list no longer has it
    alive = set(nodes) - {lost}
    assert coord.sim_figures(gens) == job.expected(alive)
    # nothing lost: its peer holds its chunks and is asked to persist those not durable yet
    assert job.expected(alive)["streams"][gen]["anywhere"][-1][1] == top
    pending = [m.name for m in job.held[s] if m.name not in job.durable_names]
    assert pending and set(pending) <= set(coord.unpersisted()[peer])
    plan = coord.plan(top)                          # a restore reads the peer's copies
    assert plan["step"] == top
    held = [o for o in plan["objects"] if not o["durable"]]
    assert held and all(o["refs"] == [f"{peer}:{Manifest.from_json(o['manifest']).name}"] for o in held)
    assert all(lost not in e.holders for e in coord.entries.values())   # the plan forgot the dead node

    coord.sim_lose(peer)                            # both copies gone: the steps after the last commit are lost
    alive -= {peer}
    want = job.expected(alive)
    assert coord.sim_figures(gens)["streams"] == want["streams"]
    assert want["streams"][gen]["anywhere"][-1][1] < top
    assert "error" in coord.plan(top)
    assert coord.plan(want["streams"][gen]["anywhere"][-1][1])["step"] == want["streams"][gen]["anywhere"][-1][1]
    # a restarted simulated worker ("started") holds nothing, as a real one
    node = nodes[3]
    coord.update(node, [("started", node, True)])   # even one saying it is a first incarnation: it held some
    assert all(node not in e.holders for e in coord.entries.values())
    assert coord.sim_figures(gens)["streams"] == job.expected(alive - {node})["streams"]


def test_a_node_worker_relays_its_ranks_control(ray_cluster, tmp_path):
    """A sharded job's rank asks its node's worker for control; the worker host asks the coordinator host for all
    its lineages in one call: a full asked for reaches the rank once, as through a direct ``control``."""
    job = f"relay-{uuid.uuid4().hex[:8]}"
    root = open_storage(str(tmp_path / "root"))
    runs = [f"{job}:shard-w00002-r{r:05d}" for r in range(2)]
    node = ray.get_runtime_context().get_node_id()
    try:
        for run in runs:
            C.get_or_create_coordinator(run, lineages.lineage_storage(root, run),
                                        config=CheckpointConfig.resolve(full_every=10, batch_steps=2))
        workers = [get_or_create_worker(run, node, lineages.lineage_storage(root, run), 1 << 20) for run in runs]
        ray.get([w.ping.remote() for w in workers])
        assert ray.get(workers[0].control.remote(1)) is None      # nothing relayed yet: the rank asks directly
        ray.get(lineages.coordinator(runs[1]).request_full.remote(1, "test"))
        for w in workers:
            w.control.remote(1)
        deadline = time.monotonic() + 30
        got = [None, None]
        while None in got and time.monotonic() < deadline:
            time.sleep(CONTROL_RELAY_S)
            got = [g or ray.get(w.control.remote(1)) for g, w in zip(got, workers)]
        assert [g["want_full"] for g in got] == [False, True]     # each lineage's own answer
        assert ray.get(workers[1].control.remote(1))["want_full"] is False   # delivered once
        assert ray.get(lineages.coordinator(runs[1]).control.remote(1))["want_full"] is False   # consumed there
    finally:
        C.shutdown_job(job)


def test_a_first_incarnation_is_not_healed_unless_its_node_held_something(ray_cluster, tmp_path, monkeypatch):
    nodes = node_ids(4)
    coord, job = _coord(tmp_path, "fresh"), _job(nodes)
    coord.sim_join(nodes)
    _play(coord, job, rounds=2, pack=True)
    healed = []
    monkeypatch.setattr(coord.healing, "heal", healed.append)
    new = node_ids(1, tag="f")[0]
    coord.sim_join([new])
    coord.update(new, [("started", new, True)])     # a new node's first worker: nothing to heal or re-read
    coord.update(new, [("started", new)])           # a restart (or an older worker, which does not say)
    coord.update(nodes[1], [("started", nodes[1], True)])   # a first incarnation on a node that held chunks
    assert healed == [new, nodes[1]]
    assert all(nodes[1] not in e.holders for e in coord.entries.values())
