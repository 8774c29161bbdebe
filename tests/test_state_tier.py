"""The state tier and the fast-step data path on a real multi-node local Ray cluster.

Each test trains the small MLP of tests/_training.py with runtime="ray", then compares restored states with an
uninterrupted reference run (torch.equal on every tensor): replica fulls, zero-replay restores, a killed node
worker, a killed replica, a removed node, a forced gap, and the number of actor calls per step.
"""
from __future__ import annotations

import logging
import time
import uuid

import pytest
import ray
import torch

import ray_ckpt
from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.runtime.worker import OBJECT_STORE_SHARE
from ray_ckpt.runtime import naming
from ray_ckpt.runtime.trainer import client
from ray_ckpt.runtime.trainer.client import load_via_coordinator
from ray_ckpt.runtime.coordinator import shutdown_run
from ray_ckpt.storage import open_storage
from tests import _training as T

pytestmark = pytest.mark.ray


def _fresh():
    model = T.make_model("mlp", seed=77)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt)


def _coord(run):
    return ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE)


def _wait(cond, timeout=60.0, what="condition"):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _wait_delegated(ck, timeout=60.0):
    _wait(lambda: ck.stats()["runtime"]["delegated_fulls"], timeout, "the replica to take over fulls")


def _wait_replica_at(run, step, timeout=60.0):
    def ok():
        r = ray.get(_coord(run).status.remote())["replica"]
        return r is not None and r["ok"] and r["step"] == step
    _wait(ok, timeout, f"the replica to reach step {step}")


def _assert_restores(uri, run, ref, steps, runtime="ray"):
    for s in steps:
        m, o, sc = _fresh()
        got = ray_ckpt.restore(uri, m, o, scheduler=sc, step=s, runtime=runtime, run=run)
        assert got == s
        T.assert_same(ref[s], T.snapshot(m, o, sc), f"step {s} ({runtime})")


@pytest.fixture
def run_env(tmp_path, ray_cluster):  # noqa: F811
    run = f"st-{uuid.uuid4().hex[:8]}"
    yield run, str(tmp_path / "ckpt")
    shutdown_run(run)


def test_replica_writes_the_fulls_and_restores_the_latest_step_with_zero_replay(run_env):
    run, uri = run_env
    ref = T.reference_states(50)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=10,
                               batch_steps=4, recovery_every=1, keep_fulls=0)
    _wait_delegated(ck)
    for s in range(50):
        T.train_step("mlp", model, opt, sch, s)
    ck.flush()
    # a snapshot for the latest step waits for the replica to apply the records it was fed (the restoring
    # process would replay them otherwise); one for a step never fed returns what it has once progress stalls
    replica = ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE)
    assert ray.get(replica.snapshot.remote(ck.generation, 50, 30.0))["step"] == 50
    t0 = time.monotonic()
    assert ray.get(replica.snapshot.remote(ck.generation, 60, 0.3))["step"] == 50
    assert time.monotonic() - t0 < 20
    _wait_replica_at(run, 50)
    stats = ck.stats()
    assert stats["trainer_fulls"] == 1, stats      # the attach full only
    ck.close()

    storage = open_storage(uri)
    lineage, _ = load_lineage(storage)
    fulls = {m.last_step: m for m in lineage.manifests if m.kind == "full"}
    assert sorted(fulls) == [0, 10, 20, 30, 40, 50]
    assert all(fulls[s].info.get("computed_on") == "replica" for s in (10, 20, 30, 40, 50))
    assert "computed_on" not in fulls[0].info
    _assert_restores(uri, run, ref, [10, 20, 30, 40, 50], runtime="local")   # each full alone, bitwise

    chain, tiers = load_via_coordinator(storage, None, run=run)
    assert chain.step == 50 and tiers["replica"] == 1 and tiers["replayed"] == 0
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 50
    T.assert_same(ref[50], T.snapshot(m, o, sc), "latest from the replica")
    # an older step restores from the newest durable replica full before it, not from the (longer) chain of the
    # attach full plus diffs that the memory tier still holds
    for s, replayed in ((30, 0), (33, 3)):
        chain, tiers = load_via_coordinator(storage, s, run=run)
        assert chain.step == s and chain.plan.full.last_step == 30 and tiers["replayed"] == replayed, tiers
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=s, runtime="ray", run=run) == s
        T.assert_same(ref[s], T.snapshot(m, o, sc), f"step {s} from the replica's full")


def test_batches_are_one_actor_call_each_and_stay_whole(run_env):
    run, uri = run_env
    ref = T.reference_states(40)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=1000,
                               batch_steps=10, handoff_delay=30.0, replica=False, recovery_every=1, keep_fulls=0)
    sent0 = ck._sink.chunks_sent
    for s in range(40):
        T.train_step("mlp", model, opt, sch, s)
    # the default memory_budget (2 GiB) does not fit this node's 300 MiB object store: capped at its share of it (a
    # larger budget makes Ray spill held chunks to disk and back)
    assert ck.stats()["runtime"]["worker"]["memory_budget"] == int((300 << 20) * OBJECT_STORE_SHARE)
    ck.close()
    sent = ck._sink.chunks_sent - sent0
    assert sent <= 40 // 10 + 1, sent   # at most one hand-off per batch (+1: the record finalized at close)
    lineage, _ = load_lineage(open_storage(uri))
    diffs = sorted((m.first_step, m.last_step) for m in lineage.manifests if m.kind == "diff")
    assert diffs == [(1, 10), (11, 20), (21, 30), (31, 40)], diffs
    _assert_restores(uri, run, ref, [0, 7, 10, 23, 40], runtime="local")


@ray.remote(num_cpus=0)
class _Trainer:
    """Trains in its own process on a chosen node (a plain Ray actor: no Ray Train)."""

    def __init__(self, uri, run, **kw):
        self.model = T.make_model("mlp")
        self.opt = T.make_optimizer("adamw", self.model)
        self.sch = T.make_scheduler(self.opt)
        self.ck = ray_ckpt.Checkpointer(uri, self.model, self.opt, scheduler=self.sch, runtime="ray", run=run,
                                        **{"recovery_every": 1, "keep_fulls": 0, **kw})
        self.run = run
        self.step = 0

    def node(self):
        return ray.get_runtime_context().get_node_id()

    def train(self, steps, kill_worker_at=None):
        for _ in range(steps):
            T.train_step("mlp", self.model, self.opt, self.sch, self.step)
            self.step += 1
            if self.step == kill_worker_at:
                w = ray.get_actor(naming.worker_name(self.run, self.node()), namespace=naming.NAMESPACE)
                ray.kill(w, no_restart=False)
        return self.step

    def flush(self):
        self.ck.flush()

    def close(self):
        self.ck.close()
        return self.ck.stats()


def _trainer_on_new_node(cluster, uri, run, **kw):
    node = cluster.add_node(num_cpus=1, object_store_memory=200 << 20, resources={"trainer": 1})
    cluster.wait_for_nodes()
    live = {n.node_id for n in cluster.list_all_nodes()}   # nodes removed by earlier tests are seen dead first
    _wait(lambda: {n["NodeID"] for n in ray.nodes() if n.get("Alive")} == live, 60, "removed nodes to be dead")
    tr = _Trainer.options(resources={"trainer": 0.01}).remote(uri, run, **kw)
    return node, tr


def test_killed_node_worker_then_lost_node_leave_no_hole(run_env, ray_cluster):
    run, uri = run_env
    ref = T.reference_states(30)
    node, tr = _trainer_on_new_node(ray_cluster, uri, run, full_every=10, batch_steps=4)
    try:
        assert ray.get(tr.train.remote(30, kill_worker_at=12), timeout=300) == 30
        stats = ray.get(tr.close.remote(), timeout=300)
        assert stats["last_committed_step"] == 30
        _assert_restores(uri, run, ref, range(31))                       # memory tier + storage
        _assert_restores(uri, run, ref, range(0, 31, 3), runtime="local")  # storage alone
    finally:
        ray_cluster.remove_node(node)
    _assert_restores(uri, run, ref, range(31))                           # after the node is gone


def test_removed_trainer_node_restores_latest_from_the_replica_with_zero_replay(run_env, ray_cluster):
    run, uri = run_env
    ref = T.reference_states(25)
    node, tr = _trainer_on_new_node(ray_cluster, uri, run, full_every=100, batch_steps=5)
    try:
        assert ray.get(tr.train.remote(25), timeout=300) == 25
        ray.get(tr.flush.remote(), timeout=300)
        trainer_node = ray.get(tr.node.remote())
        _wait_replica_at(run, 25)
        assert ray.get(_coord(run).status.remote())["replica"]["node"] != trainer_node   # on a peer node
    finally:
        ray_cluster.remove_node(node)
    storage = open_storage(uri)
    chain, tiers = load_via_coordinator(storage, None, run=run)
    assert chain.step == 25 and tiers["source"] == "replica" and tiers["replayed"] == 0
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 25
    T.assert_same(ref[25], T.snapshot(m, o, sc), "latest after the trainer node was lost")


def test_a_restore_of_the_latest_step_on_a_live_cluster_reads_the_replica(run_env, ray_cluster, caplog,
                                                                          monkeypatch):
    """The trainer is gone, its node alive: its worker and the peer still hold every object of the chain. The latest
    step comes from the replica's state (nothing replayed, bitwise), and the replica answers first: the restore's
    plan asks no holder for references it would not read. Without the replica the whole chain is planned again."""
    run, uri = run_env
    n = 25
    ref = T.reference_states(n)
    node, tr = _trainer_on_new_node(ray_cluster, uri, run, full_every=100, batch_steps=5)
    try:
        assert ray.get(tr.train.remote(n), timeout=300) == n
        ray.get(tr.close.remote(), timeout=300)
        trainer_node = ray.get(tr.node.remote())
        ray.kill(tr)                                   # the training process is gone; its node and worker stay
        _wait_replica_at(run, n)
        assert ray.get(_coord(run).status.remote())["replica"]["node"] != trainer_node
        whole = ray.get(_coord(run).plan.remote(None))
        assert any(o["refs"] for o in whole["objects"]), whole   # the memory tier holds the chain on live nodes
        first = ray.get(_coord(run).plan.remote(None, replica_first=True))
        assert first["replica"]["step"] == first["refs_after"] == n and not any(o["refs"] for o in first["objects"])
        m, o, sc = _fresh()
        with caplog.at_level(logging.INFO, logger="ray_ckpt"):
            assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == n
        reports = [r.ray_ckpt_restore for r in caplog.records if hasattr(r, "ray_ckpt_restore")]
        assert len(reports) == 1 and reports[0]["source"] == "replica" and reports[0]["replayed"] == 0, reports
        T.assert_same(ref[n], T.snapshot(m, o, sc), "latest on the live cluster")

        def no_replica(run):   # a test double: the replica is gone between the plan and the snapshot
            raise ValueError("no replica")

        monkeypatch.setattr(client.lineages, "replica", no_replica)
        caplog.clear()
        m, o, sc = _fresh()
        with caplog.at_level(logging.INFO, logger="ray_ckpt"):
            assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == n
        reports = [r.ray_ckpt_restore for r in caplog.records if hasattr(r, "ray_ckpt_restore")]
        r = reports[0]
        assert "planning the whole chain" in caplog.text
        assert r["source"].startswith("memory") and r["replayed"] == n - r["from_step"] > 0, reports   # a full + diffs
        T.assert_same(ref[n], T.snapshot(m, o, sc), "latest from the chain")
    finally:
        ray_cluster.remove_node(node)


def test_a_new_replica_that_lands_on_the_trainers_node_is_placed_again(run_env, monkeypatch, caplog):
    """Soft node affinity can fall back to the trainer's own node although a peer is alive (CI saw it): the
    attach does not wait for the replica's process; a daemon thread finds where it runs, re-places a replica the
    attach has just created, and the coordinator asks the trainer for a full for the new one to start from (the
    latest step then restores from it with zero replay). An existing replica is never moved."""
    from ray_ckpt.runtime.trainer import client
    run, uri = run_env
    me = ray.get_runtime_context().get_node_id()
    real = client._replica_node
    targets = []

    def first_here_then_peer():   # a test double for the fallback: the first placement lands on this node
        targets.append(me if not targets else real())
        return targets[-1]

    monkeypatch.setattr(client, "_replica_node", first_here_then_peer)
    n = 60
    ref = T.reference_states(n)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)

    def replica_ok():
        r = ray.get(_coord(run).status.remote())["replica"]
        return r is not None and r["ok"]

    with caplog.at_level(logging.INFO, logger="ray_ckpt"):
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=1000,
                                   batch_steps=4, policy="fixed", recovery_every=1, keep_fulls=0)
        for s in range(n):   # steps go on while the thread re-places the replica and the full is asked for
            T.train_step("mlp", model, opt, sch, s)
            if s < n - 1 and not replica_ok():
                time.sleep(0.25)
        ck.flush()
        _wait_replica_at(run, n, timeout=120)
    replica = ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE)
    where = ray.get(replica.ping.remote())
    assert len(targets) == 2 and targets[0] == me and where == targets[1] != me, (targets, where)
    assert "placing it again" in caplog.text and "runs on the trainer's node" not in caplog.text
    fulls = [m.last_step for m in load_lineage(open_storage(uri), strict=False)[0].manifests if m.kind == "full"]
    assert len(fulls) >= 2 and 0 < max(fulls) < 1000, fulls   # the requested full, beyond the attach full
    chain, tiers = load_via_coordinator(open_storage(uri), None, run=run)
    assert chain.step == n and tiers["replica"] == 1 and tiers["replayed"] == 0
    _assert_restores(uri, run, ref, [n])
    ck.close()
    storage = open_storage(uri)
    # an existing replica stays where it is, with a WARNING when that is this node
    monkeypatch.setattr(client, "_replica_node", lambda: me)
    again = client._place_replica(run, storage, full_every=10, max_lag=64)
    assert ray.get(again.ping.remote()) == where


def test_killed_replica_is_rebuilt_and_follows_again(run_env):
    run, uri = run_env
    ref = T.reference_states(40)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=10,
                               batch_steps=4, recovery_every=1, keep_fulls=0)
    for s in range(15):
        T.train_step("mlp", model, opt, sch, s)
    ck.flush()
    ray.kill(ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE), no_restart=False)
    for s in range(15, 40):
        T.train_step("mlp", model, opt, sch, s)
        time.sleep(0.05)
    ck.flush()
    _wait_replica_at(run, 40, timeout=120)
    rep = ray.get(ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE).status.remote())
    assert rep["rebuilds"] >= 1 or rep["step"] == 40
    chain, tiers = load_via_coordinator(open_storage(uri), None, run=run)
    assert chain.step == 40 and tiers["replica"] == 1 and tiers["replayed"] == 0
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 40
    T.assert_same(ref[40], T.snapshot(m, o, sc), "latest after the replica was rebuilt")
    ck.close()


def test_a_forced_gap_is_logged_shown_and_closed_by_a_full(run_env, caplog, capsys, monkeypatch):
    run, uri = run_env
    N = 300
    ref = T.reference_states(N)
    from ray_ckpt.runtime.trainer.transport import Transport
    real_send = Transport.send
    dropped = []

    def lossy_send(self, c):   # a test double that loses the chunk holding step 13, for good
        m = c.manifest
        if m.kind == "diff" and m.first_step <= 13 <= m.last_step and not dropped:
            dropped.append(m.name)
            self.unsafe.pop(m.name, None)
            self.release(c.size)
            return
        return real_send(self, c)

    monkeypatch.setattr(Transport, "send", lossy_send)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=1000,
                               batch_steps=4, replica=False, recovery_every=1, keep_fulls=0)
    caplog.set_level(logging.WARNING, logger="ray_ckpt")
    step, deadline = 0, time.monotonic() + 60
    while step < 20 or ck.stats()["trainer_fulls"] < 2:   # the gap is declared after a grace period (time)
        T.train_step("mlp", model, opt, sch, step)
        step += 1
        time.sleep(0.05)
        assert step < N and time.monotonic() < deadline, "no full checkpoint was taken after the gap"
    for s in range(step, N):
        T.train_step("mlp", model, opt, sch, s)
    ck.close()
    assert dropped
    gaps = ray.get(_coord(run).status.remote())["gaps"]
    assert gaps and gaps[0]["first"] <= 13 <= gaps[0]["last"]
    assert any("lost steps" in r.getMessage() for r in caplog.records), caplog.text
    full_after = min(m.last_step for m in load_lineage(open_storage(uri))[0].manifests
                     if m.kind == "full" and m.last_step > 0)
    assert gaps[0]["last"] < full_after <= step
    _assert_restores(uri, run, ref, range(full_after, N + 1, 7), runtime="local")
    with pytest.raises(ray_ckpt.NoCheckpointError):
        ray_ckpt.restore(uri, *_fresh()[:2], step=13)
    capsys.readouterr()
    assert cli_main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "gap" in out.lower() and "13" in out


def test_durable_diffs_fulls_keeps_diffs_in_memory_on_two_nodes_and_writes_fulls(run_env, capsys):
    run, uri = run_env
    ref = T.reference_states(25)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=10,
                               batch_steps=2, replica=False, durable_diffs="fulls", recovery_every=1, keep_fulls=0)
    for s in range(25):
        T.train_step("mlp", model, opt, sch, s)
    ck._sink.wait_safe()            # every chunk held on two nodes (or, if its peer was late, written)
    time.sleep(3.0)                   # past the coordinator's gap grace: released/unwritten diffs are no gap
    storage = open_storage(uri)
    lineage, _ = load_lineage(storage)
    durable_diff_steps = sum(m.last_step - m.first_step + 1 for m in lineage.manifests if m.kind == "diff")
    assert sorted(m.last_step for m in lineage.manifests if m.kind == "full") == [0, 10, 20]
    assert durable_diff_steps <= 10, durable_diff_steps    # "all" writes all 25
    st = ck.stats()
    where = st["runtime"]["restorable"]
    assert [0, 0] in where["durable"] and [10, 10] in where["durable"] and [20, 20] in where["durable"], st
    # (step 25's record is finalized by the next step or by close)
    tier_steps = {k: {s for a, b in where[k] for s in range(a, b + 1)} for k in ("memory", "durable")}
    assert tier_steps["memory"] | tier_steps["durable"] == set(range(25)), where
    assert len(tier_steps["memory"]) >= 25 - 3 - 10, where
    assert ray.get(_coord(run).status.remote())["gaps"] == []
    _assert_restores(uri, run, ref, [3, 14, 21, 24])         # memory tier (two copies), bitwise
    ck.close()                                               # flush: the tail after the last full is written
    _assert_restores(uri, run, ref, [20, 25], runtime="local")
    with pytest.raises(ray_ckpt.NoCheckpointError):           # by design: between fulls only in memory
        ray_ckpt.restore(uri, *_fresh()[:2], step=14)
    capsys.readouterr()
    assert cli_main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "durable_diffs=fulls" in out and "GAP" not in out


def test_durable_diffs_fulls_is_refused_without_the_ray_runtime(tmp_path):
    model = T.make_model("mlp")
    with pytest.raises(ValueError, match="durable_diffs"):
        ray_ckpt.Checkpointer(str(tmp_path), model, T.make_optimizer("adamw", model), durable_diffs="fulls")
    with pytest.raises(ValueError, match="durable_diffs"):
        ray_ckpt.Checkpointer(str(tmp_path), model, T.make_optimizer("adamw", model), runtime="ray",
                              durable_diffs="some")
