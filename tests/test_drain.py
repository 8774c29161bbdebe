"""Node drains (Ray's preemption notices) on a real multi-node local Ray cluster, and the notice in the writers.

The Ray tests drain a node through the GCS exactly as ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds S`` and the autoscaler do, remove it at the deadline, and restore the latest step:
it must be the last step the trainer captured (0 lost), bitwise equal to an uninterrupted run's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

import ray_ckpt
from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.engine import writer as writer_mod
from ray_ckpt.lineage import drains
from ray_ckpt.storage import open_storage
from tests import _training as T
from tests._drains import coordinator as _coord, drain_gcs as _drain_gcs, log as _log, wait as _wait


def _reference(steps: int) -> list:
    """The uninterrupted run (MLP, AdamW, no scheduler: each step's record is handed over by its own
    optimizer.step(), so "captured" is exactly "completed")."""
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    out = [T.snapshot(model, opt)]
    for s in range(steps):
        T.train_step("mlp", model, opt, None, s)
        out.append(T.snapshot(model, opt))
    return out


# -- no Ray: the records and the writer's notice ----------------------------------------------------------------
def test_drain_records_roundtrip_and_describe(tmp_path):
    storage = open_storage(str(tmp_path / "ckpt"))
    rec = {"node": "ab" * 28, "noticed_ms": 1_800_000_000_000, "deadline_ms": 1_800_000_004_000,
           "generation": 2, "status": "node gone", "held": [[5, 16]], "durable": [[5, 14]], "peer": [[15, 16]],
           "unsafe": []}
    drains.write_record(storage, rec)
    storage.write("drains/garbage.json", b"{not json")
    got = drains.read_records(storage)
    assert got == [rec]
    line = drains.describe(rec)
    assert "12 steps held there" in line and "made durable 5..14" in line and "stays (memory tier) 15..16" in line
    assert "deadline +4.0 s" in line and "all 12 safe" in line
    lost = dict(rec, peer=[], unsafe=[[15, 16]])
    assert "NOT made safe (lost): 15..16" in drains.describe(lost)
    assert "held no step" in drains.describe(dict(rec, held=[], durable=[], peer=[]))


def test_a_coordinator_restarted_during_a_drain_continues_its_record(tmp_path):
    """One drain (a node and its deadline), one record: a coordinator that restarts while the node drains takes
    the open record from storage up again instead of writing a second one; a new drain of the node (another
    deadline) or one after a withdrawn drain gets a record of its own. The coordinator's drains part is driven
    without Ray (its cluster calls are stand-ins here; the Ray tests below drain real nodes)."""
    from ray_ckpt.runtime.coordination.drains import Drains
    from ray_ckpt.runtime.coordination.state import LineageState, RunRef
    storage = open_storage(str(tmp_path / "ckpt"))
    node, deadline = "ab" * 28, 1_800_000_004_000
    told = []

    def fresh():   # what a (re)started coordinator holds of the drains before the first poll
        state = LineageState(RunRef("r", storage), alive=lambda max_age=0.0: {node})
        state.last_generation = 1
        d = Drains(state, alive=lambda: {node}, notify=told.append, move_replica=lambda draining: None,
                   forget_dead=lambda: None)
        d.progress = lambda: False
        return d

    first = fresh()
    first.changed({node: deadline})
    first.records[node].update(status="safe", held=[[3, 9]], durable=[[3, 9]])
    first.write(first.records[node])
    assert len(drains.read_records(storage)) == 1
    time.sleep(0.01)                     # a later notice would get a later key
    again = fresh()                      # the coordinator restarted; the node still drains
    again.changed({node: deadline})
    recs = drains.read_records(storage)
    assert len(recs) == 1 and again.records[node]["noticed_ms"] == recs[0]["noticed_ms"]
    assert again.records[node]["held"] == [[3, 9]] and again.records[node]["status"] == "safe"
    other = fresh()                      # the same node drained again with another deadline: another drain
    other.changed({node: deadline + 60_000})
    assert len(drains.read_records(storage)) == 2
    assert drains.find_open(storage, node, deadline)["held"] == [[3, 9]]
    assert drains.find_open(storage, "cd" * 28, deadline) is None
    again.changed({})                    # withdrawn: the record is closed, a later drain is a new one
    assert drains.find_open(storage, node, deadline) is None
    assert told == [{node: deadline}, {node: deadline}, {node: deadline + 60_000}]   # the workers heard of each


def test_a_notice_makes_the_local_writer_write_every_step_and_wait_near_the_deadline(tmp_path):
    """runtime="local": after a notice each step is its own object; within SYNC_BEFORE_DEADLINE_S of the deadline a
    step returns from optimizer.step() only once it is committed; withdrawn, batching resumes."""
    uri = str(tmp_path / "ckpt")
    ref = _reference(16)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, full_every=1000, batch_steps=50, policy="fixed", recovery_every=1)
    assert ck.preempted() is None
    for s in range(5):
        T.train_step("mlp", model, opt, None, s)
    far = time.monotonic() + writer_mod.SYNC_BEFORE_DEADLINE_S + 3600
    ck._sink.notice({"node": "n", "deadline_ms": 1, "remaining_s": 3600.0}, far)
    assert ck.preempted()["node"] == "n"
    for s in range(5, 8):
        T.train_step("mlp", model, opt, None, s)
    _wait(lambda: ck.last_committed_step == 8, 30, "the steps after the notice to be written at once")
    ck._sink.notice({"node": "n", "deadline_ms": 1, "remaining_s": 1.0}, time.monotonic() + 1.0)
    for s in range(8, 12):
        T.train_step("mlp", model, opt, None, s)
        assert ck.last_committed_step == s + 1   # committed before optimizer.step() returned
    ck._sink.notice(None)
    assert ck.preempted() is None
    for s in range(12, 16):
        T.train_step("mlp", model, opt, None, s)
    assert ck.last_committed_step == 12          # batching again (batch_steps=50)
    ck.close()
    m = T.make_model("mlp", seed=5)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(uri, m, o, step=10) == 10
    T.assert_same(ref[10], T.snapshot(m, o), "step 10")


def test_under_a_short_deadline_steps_wait_only_within_a_margin_measured_from_the_first_wait(tmp_path):
    """A notice with a deadline inside SYNC_BEFORE_DEADLINE_S: the first step after it waits until it is safe
    (measuring the wait), the next ones are only handed over at once until the margin (a few such waits, at
    least SYNC_MIN_S) before the deadline, from where each waits again; every step restores bitwise."""
    uri = str(tmp_path / "ckpt")
    ref = _reference(14)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, full_every=1000, batch_steps=50, policy="fixed", recovery_every=1)
    sink = ck._sink
    for s in range(3):
        T.train_step("mlp", model, opt, None, s)
    deadline = time.monotonic() + writer_mod.SYNC_BEFORE_DEADLINE_S - 2.0
    assert not sink.drain_due
    sink.notice({"node": "n", "deadline_ms": 1, "remaining_s": 8.0}, deadline)
    assert sink.sync_margin() == writer_mod.SYNC_BEFORE_DEADLINE_S   # nothing measured yet
    assert sink.drain_due
    T.train_step("mlp", model, opt, None, 3)
    assert sink.stats.notice_syncs == 1 and ck.last_committed_step == 4   # the first step waited
    margin = sink.sync_margin()
    assert writer_mod.SYNC_MIN_S <= margin == max(writer_mod.SYNC_MIN_S,
                                                  writer_mod.SYNC_WAIT_FACTOR * sink.stats.notice_sync_seconds)
    # (the overhead budget's every-step recording under the notice is due from the longest margin on: here at once)
    assert sink.drain_due
    early = 0
    for s in range(4, 8):
        before = time.monotonic() < deadline - margin
        T.train_step("mlp", model, opt, None, s)
        early += before
    assert early >= 1, "the steps took the whole notice; nothing left to check"
    assert sink.stats.notice_syncs == 1 + (4 - early)   # steps before the margin did not wait
    _wait(lambda: ck.last_committed_step == 8, 30, "the steps handed over at once to be written")
    sink.notice({"node": "n", "deadline_ms": 1, "remaining_s": 0.5}, time.monotonic() + 0.5)
    for s in range(8, 11):   # a new notice measures again; its deadline is inside any margin: every step waits
        T.train_step("mlp", model, opt, None, s)
        assert ck.last_committed_step == s + 1
    ck.close()
    for step in (4, 8, 11):
        m = T.make_model("mlp", seed=5)
        o = T.make_optimizer("adamw", m)
        assert ray_ckpt.restore(uri, m, o, step=step) == step
        T.assert_same(ref[step], T.snapshot(m, o), f"step {step}")


def test_a_ray_train_group_preemption_reaches_every_ranks_writer(tmp_path, monkeypatch):
    """A sink watch turns Ray Train's worker-local preemption info (any node of the group) into the sink's notice
    and withdraws it when the info is gone; a node drain seen in the GCS does too (runtime="local"). No Ray is
    started: the two sources are stand-ins here, the real ones are read by the Ray tests below."""
    import types
    from ray_ckpt.runtime.trainer import drain_watch as drain_mod
    monkeypatch.setattr(drain_mod.ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(get_node_id=lambda: "me" * 28))
    group = {"info": None}
    gcs = {}
    monkeypatch.setattr(drain_mod, "train_group_preemption", lambda: group["info"])
    monkeypatch.setattr(drain_mod, "draining_nodes", lambda: dict(gcs))
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(str(tmp_path / "ckpt"), model, opt, full_every=1000, batch_steps=50,
                               recovery_every=1)
    watch = drain_mod.SinkWatch(ck._sink, node=True, interval=0.05)
    try:
        group["info"] = dict(drain_mod.notice_info("other", int(time.time() * 1000) + 3_600_000),
                             source="ray_train", nodes=["other"], ranks=[1])
        got = _wait(ck.preempted, 10, "the group's preemption to reach the writer")
        assert got["source"] == "ray_train" and got["ranks"] == [1] and got["remaining_s"] > 3000
        group["info"] = None
        _wait(lambda: ck.preempted() is None, 10, "the notice to be withdrawn")
        gcs["me" * 28] = 0                                   # this node drains, no deadline: safe at every step
        got = _wait(ck.preempted, 10, "the node's drain to reach the writer")
        assert got["source"] == "node" and got["deadline_ms"] is None
        T.train_step("mlp", model, opt, None, 0)
        assert ck.last_committed_step == 1
    finally:
        watch.stop()
        ck.close()


# -- real drains -----------------------------------------------------------------------------------------------
try:
    import ray
except ImportError:  # pragma: no cover
    ray = None


def _progress(path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"step": 0}


if ray is not None:
    @ray.remote(num_cpus=0)
    class _DrainTrainer:
        """Trains on a chosen node; after every step it writes the step and its Checkpointer's drain notice
        to ``progress`` (a file on this machine, read by the test after the node is gone)."""

        def __init__(self, uri, run, **kw):
            self.model = T.make_model("mlp")
            self.opt = T.make_optimizer("adamw", self.model)
            # every step recorded (the drain paths under test), unless a test pins another granularity
            self.ck = ray_ckpt.Checkpointer(uri, self.model, self.opt, runtime="ray", run=run,
                                            **{"recovery_every": 1, **kw})
            self.step = 0

        def node(self):
            return ray.get_runtime_context().get_node_id()

        def train(self, progress, max_steps, pause, other_drain=None):
            """``other_drain``: ``{"at": step, "node": id, "seconds": s}`` — after that step, the notice Ray Train
            gives every worker of a group when a node of it drains (here another node; as its watch hands it on)."""
            while self.step < max_steps:
                T.train_step("mlp", self.model, self.opt, None, self.step)
                self.step += 1
                if other_drain is not None and self.step == other_drain["at"]:
                    self.ck._sink.notice(
                        {"node": other_drain["node"], "nodes": [other_drain["node"]], "source": "ray_train",
                         "deadline_ms": int((time.time() + other_drain["seconds"]) * 1000),
                         "remaining_s": other_drain["seconds"]}, time.monotonic() + other_drain["seconds"])
                tmp = progress + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"step": self.step, "preempted": self.ck.preempted(),
                               "mode": self.ck.budget.mode, "reason": self.ck.budget.reason,
                               "waits": dict(getattr(self.ck._sink, "notice_waits", {}))}, f)
                os.replace(tmp, progress)
                time.sleep(pause)
            return self.step


def _trainer_node(cluster, uri, run, **kw):
    node = cluster.add_node(num_cpus=1, object_store_memory=200 << 20, resources={"drained": 1})
    cluster.wait_for_nodes()
    live = {n.node_id for n in cluster.list_all_nodes()}   # nodes removed by earlier tests are seen dead first
    _wait(lambda: {n["NodeID"] for n in ray.nodes() if n.get("Alive")} == live, 60, "removed nodes to be dead")
    tr = _DrainTrainer.options(resources={"drained": 0.01}).remote(uri, run, **kw)
    assert ray.get(tr.node.remote(), timeout=120) == node.node_id
    return node, tr


def _drain_cli(cluster, node_id: str, seconds: int) -> None:
    """``ray drain-node`` as an operator (or a preemption handler) runs it."""
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", cluster.address,
                    "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                    "spot preemption (test)", "--deadline-remaining-seconds", str(seconds)],
                   check=True, timeout=120, capture_output=True)


def _restore_latest(uri, run, ref_for):
    m = T.make_model("mlp", seed=5)
    o = T.make_optimizer("adamw", m)
    got = ray_ckpt.restore(uri, m, o, runtime="ray", run=run)
    T.assert_same(ref_for(got), T.snapshot(m, o), f"latest step {got}")
    return got


@pytest.fixture
def drain_run(ray_cluster):  # noqa: F811
    from ray_ckpt.runtime.coordinator import shutdown_run
    run = f"drain-{uuid.uuid4().hex[:8]}"
    yield run
    shutdown_run(run)


@pytest.mark.ray
def test_a_drained_trainer_node_removed_at_the_deadline_loses_no_captured_step(ray_cluster, drain_run, tmp_path,
                                                                               capsys):
    """The memory tier holds the only copies of the steps since the attach full (durable_diffs="fulls"): the
    notice makes the draining node write them and every step is safe before the trainer goes on; after the node
    is removed at the deadline the latest step is the last one the trainer took, bitwise."""
    run, uri = drain_run, str(tmp_path / "ckpt")
    progress = str(tmp_path / "progress.json")
    node, tr = _trainer_node(ray_cluster, uri, run, full_every=1000, batch_steps=8, durable_diffs="fulls",
                             policy="fixed")
    removed = False
    _log("trainer attached")
    try:
        tr.train.remote(progress, 100_000, 0.02)
        _wait(lambda: _progress(progress)["step"] >= 20, 120, "20 steps")
        deadline = time.time() + 5
        _drain_cli(ray_cluster, node.node_id, 5)
        seen = _wait(lambda: _progress(progress).get("preempted"), 15, "the trainer to hear of the drain")
        assert seen["node"] == node.node_id and seen["deadline_ms"] is not None
        time.sleep(max(0.0, deadline - time.time()))
        ray_cluster.remove_node(node)           # the preemption itself, at the deadline
        removed = True
    finally:
        if not removed:
            ray_cluster.remove_node(node)
    last = _progress(progress)["step"]
    _log(f"removed at step {last}")
    ref = _reference(last + 1)
    got = _restore_latest(uri, run, lambda s: ref[s])
    _log(f"restored {got}")
    assert last <= got <= last + 1, (got, last)   # 0 lost (+1: killed after the step, before its progress write)
    rec = _wait(lambda: (lambda r: r if r and r.get("settled") else None)(
        ray.get(_coord(run).drain_status.remote()).get(node.node_id)), 90, "the drain to settle")
    assert rec["status"] == "node gone" and rec["unsafe"] == [] and rec["held"], rec
    assert rec["durable"] == rec["held"], rec      # the deadline allowed the durable writes
    assert cli_main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert f"drain of node {node.node_id[:12]}" in out and "all " in out and "safe" in out, out
    # storage alone (the cluster's memory tier aside) restores the last step too
    m = T.make_model("mlp", seed=5)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(uri, m, o, step=got) == got
    T.assert_same(ref[got], T.snapshot(m, o), "from storage alone")


@pytest.mark.ray
def test_a_drain_makes_a_budget_that_left_steps_unrecorded_record_every_step(ray_cluster, drain_run, tmp_path):
    """The overhead budget had left every-step recording (a budget no step fits: a full every 1,000 steps, the
    steps between them unrecorded): the notice keeps that choice until SYNC_BEFORE_DEADLINE_S before its deadline,
    then turns recording back on (a full of the step it came at, then each step's record, each safe before the
    next step), so the node removed at the deadline still loses no step, bitwise."""
    run, uri = drain_run, str(tmp_path / "ckpt")
    progress = str(tmp_path / "progress.json")
    node, tr = _trainer_node(ray_cluster, uri, run, full_every=1000, batch_steps=8, policy="fixed",
                             overhead_budget=1e-6, recovery_every=0)   # (the budget chooses)
    removed = False
    try:
        tr.train.remote(progress, 100_000, 0.02)
        left = _wait(lambda: (lambda p: p if p.get("mode", "every_step") != "every_step" else None)(
            _progress(progress)), 120, "the budget to leave every-step recording")
        _log(f"budget: {left['mode']} at step {left['step']}: {left['reason']}")
        _wait(lambda: _progress(progress)["step"] >= left["step"] + 10, 60, "unrecorded steps")
        deadline = time.time() + 15
        _drain_cli(ray_cluster, node.node_id, 15)
        heard = _wait(lambda: (lambda p: p if p.get("preempted") else None)(_progress(progress)), 15,
                      "the trainer to hear of the drain")
        # more than the longest margin (SYNC_BEFORE_DEADLINE_S) left: the budget's choice holds until the margin
        left_s = deadline - time.time()
        _log(f"notice heard at step {heard['step']} with {left_s:.1f} s left: {heard['mode']}")
        if left_s > writer_mod.SYNC_BEFORE_DEADLINE_S + 0.5:
            assert heard["mode"] != "every_step", heard
        time.sleep(max(0.0, deadline - time.time()))
        at_removal = _progress(progress)
        ray_cluster.remove_node(node)           # the preemption itself, at the deadline
        removed = True
    finally:
        if not removed:
            ray_cluster.remove_node(node)
    assert at_removal["mode"] == "every_step" and "drain notice" in at_removal["reason"], at_removal
    last = at_removal["step"]
    ref = _reference(last + 1)
    got = _restore_latest(uri, run, lambda s: ref[s])
    _log(f"removed at step {last}, restored {got}")
    assert last <= got <= last + 1, (got, last)   # 0 lost


@pytest.mark.ray
def test_a_drain_of_another_node_waits_only_until_this_nodes_worker_holds_each_step(ray_cluster, drain_run,
                                                                                    tmp_path):
    """A preemption of another node of a Ray Train worker group: Ray Train ends every worker at the deadline, this
    one too, but this node stays, and what its persistence worker holds outlives the process. So a step that waits
    under the notice (the first after it, those near the deadline) waits only until that worker holds it (the
    hand-off's answer), not for a second copy or a write —
    storage refuses writes here — and the trainer killed at the deadline has lost no step: the latest restores
    from the memory tier, bitwise. Batches are wide (16 steps, 30 s): without the notice the kill would lose them."""
    from tests._gated_storage import GatedBackend
    run = drain_run
    root, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    storage = GatedBackend(root, gate)
    progress = str(tmp_path / "progress.json")
    node, tr = _trainer_node(ray_cluster, storage, run, full_every=1000, batch_steps=16, handoff_delay=30,
                             policy="fixed", write_timeout=300)
    other = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != node.node_id)
    try:
        open(gate, "w").close()                 # storage takes no write from here on
        deadline_s = 4.0
        tr.train.remote(progress, 100_000, 0.02, {"at": 10, "node": other, "seconds": deadline_s})
        seen = _wait(lambda: (lambda p: p if p.get("preempted") else None)(_progress(progress)), 120,
                     "the notice at step 10")
        t_notice = time.time()
        time.sleep(max(0.0, deadline_s - (time.time() - t_notice) - 0.5))
        ray.kill(tr)                            # Ray Train ends the worker at the deadline
        at_kill = _progress(progress)
        last = at_kill["step"]
        assert seen["preempted"]["node"] == other and last > 15, at_kill
        # the first step after the notice and those within the margin before the deadline waited, each only
        # for this node's worker (the margin itself: test_under_a_short_deadline_steps_wait_only_within_a_margin...)
        assert at_kill["waits"]["safe"] == 0 and at_kill["waits"]["received"] >= 2, at_kill
        ref = _reference(last + 1)
        got = _restore_latest(storage, run, lambda s: ref[s])   # from this node's worker: storage refuses writes
        _log(f"killed at step {last}, restored {got}")
        assert last <= got <= last + 1, (got, last)   # 0 lost
    finally:
        if os.path.exists(gate):
            os.remove(gate)
        ray_cluster.remove_node(node)


@pytest.mark.ray
def test_a_drain_too_short_for_the_durable_write_loses_nothing_a_surviving_node_holds(ray_cluster, drain_run,
                                                                                     tmp_path, capsys):
    """Storage takes no write from before the notice until after the node is gone (a deadline far too short
    for the durable write): the peer copies on the node that stays restore the last step, bitwise; the drain
    record says the steps were safe only in memory, and they become durable once storage takes writes again.

    The run records a full every 2 steps (``recovery_every=2``: the granularity the overhead budget picked here
    about one run in five): a full no record follows is only written, not copied to a peer — except on a node
    that drains, whose trainer waits for each step to be safe (before, it waited the whole write timeout)."""
    from tests._gated_storage import GatedBackend
    run = drain_run
    root, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    storage = GatedBackend(root, gate)
    progress = str(tmp_path / "progress.json")
    node, tr = _trainer_node(ray_cluster, storage, run, full_every=1000, batch_steps=4, policy="fixed",
                             write_timeout=300, recovery_every=2)
    removed = False
    try:
        tr.train.remote(progress, 100_000, 0.02)
        _wait(lambda: _progress(progress)["step"] >= 10, 120, "10 steps")
        open(gate, "w").close()                 # storage stops taking writes
        start = _progress(progress)["step"]
        _wait(lambda: _progress(progress)["step"] >= start + 10, 60, "10 steps more")
        deadline = time.time() + 3
        _drain_gcs(ray_cluster, node.node_id, 3)
        _wait(lambda: _progress(progress).get("preempted"), 15, "the trainer to hear of the drain")
        time.sleep(max(0.0, deadline - time.time()))
        ray_cluster.remove_node(node)
        removed = True
    finally:
        if not removed:
            ray_cluster.remove_node(node)
    last = _progress(progress)["step"]
    ref = _reference(last + 1)
    got = _restore_latest(storage, run, lambda s: ref[s])     # from the memory tier of the node that stays
    assert last <= got <= last + 1, (got, last)
    rec = _wait(lambda: (lambda r: r if r and r["status"] == "node gone" else None)(
        ray.get(_coord(run).drain_status.remote()).get(node.node_id)), 60, "the node to be seen gone")
    assert rec["unsafe"] == [] and rec["peer"] and rec["peer"][-1][1] >= last, rec
    os.remove(gate)                             # storage is back: the record and the survivors' copies are written
    rec = _wait(lambda: (lambda r: r if r and r.get("settled") else None)(
        ray.get(_coord(run).drain_status.remote()).get(node.node_id)), 120, "the drain to settle")
    assert rec["unsafe"] == [] and rec["durable"] == rec["held"], rec
    written = _wait(lambda: drains.read_records(storage), 30, "the drain record on storage")
    assert written[-1]["node"] == node.node_id
    assert cli_main(["ls", root]) == 0
    assert f"drain of node {node.node_id[:12]}" in capsys.readouterr().out
    m = T.make_model("mlp", seed=5)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(root, m, o, step=got) == got         # storage alone, once it took the writes
    T.assert_same(ref[got], T.snapshot(m, o), "from storage alone")


@pytest.mark.ray
def test_the_state_tier_replica_moves_off_a_draining_node(ray_cluster, drain_run, tmp_path):
    """The replica (placed on the node that drains) is restarted on a node that stays and rebuilds from the
    lineage before the node goes; the chunks whose second copy was there are copied elsewhere; after the node is
    removed the latest step restores from the moved replica with zero replay, bitwise."""
    from ray_ckpt.runtime import naming
    from ray_ckpt.runtime.trainer.client import load_via_coordinator
    from ray_ckpt.runtime.replica import get_or_create_replica
    run, uri = drain_run, str(tmp_path / "ckpt")
    storage = open_storage(uri)
    node = ray_cluster.add_node(num_cpus=1, object_store_memory=200 << 20)
    ray_cluster.wait_for_nodes()
    live = {n.node_id for n in ray_cluster.list_all_nodes()}
    _wait(lambda: {n["NodeID"] for n in ray.nodes() if n.get("Alive")} == live, 60, "removed nodes to be dead")
    replica, _ = get_or_create_replica(run, node.node_id, storage, full_every=1000, max_lag=100)
    assert ray.get(replica.ping.remote(), timeout=120) == node.node_id
    ref = _reference(60)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, runtime="ray", run=run, full_every=1000, batch_steps=4,
                               durable_diffs="fulls", policy="fixed", recovery_every=1)
    removed = False
    try:
        for s in range(20):
            T.train_step("mlp", model, opt, None, s)
        _drain_gcs(ray_cluster, node.node_id, 30)
        handle = ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE)

        def moved():
            try:
                st = ray.get(handle.status.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - restarting
                return False
            return st["node"] != node.node_id and st["ok"] and st["step"] is not None and st["step"] >= 20
        for s in range(20, 40):
            T.train_step("mlp", model, opt, None, s)
            time.sleep(0.05)
        _wait(moved, 120, "the replica to move off the draining node and catch up")
        ray_cluster.remove_node(node)
        removed = True
        for s in range(40, 60):
            T.train_step("mlp", model, opt, None, s)
        ck.flush()
    finally:
        if not removed:
            ray_cluster.remove_node(node)
    _wait(lambda: ray.get(_coord(run).status.remote())["replica"]["step"] == 60, 120, "the replica at step 60")
    chain, tiers = load_via_coordinator(storage, None, run=run)
    assert chain.step == 60 and tiers["replica"] == 1 and tiers["replayed"] == 0, tiers
    m = T.make_model("mlp", seed=5)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(uri, m, o, runtime="ray", run=run) == 60
    T.assert_same(ref[60], T.snapshot(m, o), "latest after the replica moved")
    rec = _wait(lambda: (lambda r: r if r and r.get("settled") else None)(
        ray.get(_coord(run).drain_status.remote()).get(node.node_id)), 90, "the drain to settle")
    assert rec["unsafe"] == [], rec
    ck.close()
