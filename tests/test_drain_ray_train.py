"""Zero-loss preemption under Ray Train: two real drains (the GCS DrainNode call with reason preemption and a
deadline, as ``ray drain-node`` and the autoscaler make it) of the node hosting world rank 0 and the memory tier's
only copy of the steps since the attach (``durable_diffs="fulls"``), each during ``fit`` and each node removed at
its deadline, a replacement "spot" node joining meanwhile. Ray Train restarts the group at the deadline (charged
to ``FailureConfig.max_preemption_failures``; ``max_failures=0``: any other failure fails the fit) and every rank
resumes at the last step rank 0 captured: 0 steps lost, and the run ends bitwise in the uninterrupted run's state
(model, optimizer, RNG; computed without Ray Train by the gloo ranks of :func:`tests._loader_fn.reference_worker`).

The first deadline lets the draining node write what it held (the drain record: every step durable). Before the
second drain storage stops taking the lineage's writes (a deadline far too short for the durable write): the new
group restores from the copies on the node that stays, and those steps become durable once storage is back.

Batching is wide (``batch_steps=16``, ``handoff_delay=30`` s): without the drain notice a rank would hold up to 16
steps, lost at the removal; with it every rank hands each step over at once, and near the deadline only once it is
safe (rank 1, on a node that stays, hears of it from Ray Train's preemption info)."""
from __future__ import annotations

import glob
import json
import os
import threading
import time
import uuid

import pytest
import torch

from ray_ckpt.cli.main import main as cli_main
from tests import _training as T
from tests._drains import drain_gcs, drain_record, log, wait
from tests._loader_fn import BATCH, ROWS, fit, read_finals, reference_worker

EPOCHS = 7
STEPS = EPOCHS * ROWS // 2 // BATCH      # 56
FIRST_DRAIN_AT, FIRST_DEADLINE_S = 6, 5.0
SECOND_DRAIN_AFTER, SECOND_DEADLINE_S = 4, 3.0


def _attempts(out, rank=0) -> dict:
    """``{start step: steps completed}`` of each attempt of ``rank`` so far."""
    got = {}
    for p in glob.glob(os.path.join(out, f"progress-{rank}-*")):
        try:
            got[int(p.rsplit("-", 1)[1])] = int(open(p).read() or 0)
        except (OSError, ValueError):
            pass
    return got


def _train_workers_on(node_id) -> list:
    """The live Ray Train workers on node ``node_id`` (the GCS actor table)."""
    import ray
    return [a for a in ray._private.state.actors(actor_state_name="ALIVE").values()
            if a["ActorClassName"] == "RayTrainWorker" and a["Address"]["NodeID"] == node_id]


def _spot(cluster):
    node = cluster.add_node(num_cpus=1, object_store_memory=200 << 20, labels={"pool": "spot"})
    cluster.wait_for_nodes()
    return node


def _preempt(cluster, out, spots, start, deadline_s, *, before_drain=None):
    """Drain rank 0's node (one of ``spots``, in the attempt that started at ``start``) with a deadline ``deadline_s``
    from now, wait for rank 0 to hear of it, remove the node at the deadline (and from ``spots``). The steps rank 0
    completed by then, and the drained node."""
    here = open(os.path.join(out, f"node-0-{start}")).read()
    mine = [n for n in spots if n.node_id == here]
    assert mine, f"rank 0 runs on node {here}, not on a spot node"
    node = mine[0]
    if before_drain is not None:
        before_drain()
    deadline = time.time() + deadline_s
    drain_gcs(cluster, node.node_id, deadline_s)
    notice = os.path.join(out, f"notice-0-{start}.json")
    wait(lambda: os.path.exists(notice), deadline_s, "rank 0 to hear of the drain")
    time.sleep(max(0.0, deadline - time.time()))
    # Ray Train ends the group at the deadline; the node goes right after (removed first, its raylet's exit on
    # SIGTERM reads to Ray 2.60's Train controller as a plain node failure, charged to max_failures)
    wait(lambda: not _train_workers_on(node.node_id), 60, "Ray Train to end the group at the deadline")
    cluster.remove_node(node)                # the preemption itself
    spots.remove(node)
    last = _attempts(out)[start]
    log(f"node {node.node_id[:12]} removed at step {last}")
    return last, node


@pytest.mark.ray
def test_preempted_ray_train_nodes_lose_no_step(tmp_path, ray_cluster, capsys):
    ref_out, out = tmp_path / "ref", tmp_path / "run"
    ref_out.mkdir()
    out.mkdir()
    T.spawn(reference_worker, args=(2, T.free_port(), [{"out": str(ref_out), "epochs": EPOCHS}]), nprocs=2)
    reference = read_finals(ref_out)
    root, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    run = f"drain-train-{uuid.uuid4().hex[:6]}"
    config = {"out": str(out), "progress": True, "epochs": EPOCHS, "step_sleep": 0.25, "gate": [root, gate],
              "env": {"RAY_CKPT_DURABLE_DIFFS": "fulls", "RAY_CKPT_HANDOFF_DELAY": "30"}}
    # spot nodes (the node removed at each deadline, and its replacements: added here, as add_node takes the main
    # thread), rank 0 on one of them and rank 1 on a node that stays
    seen: dict = {"spots": [_spot(ray_cluster) for _ in range(3)]}

    def preemptions():
        """The two preemptions, while the main thread waits in fit()."""
        try:
            wait(lambda: _attempts(str(out)).get(0, 0) >= FIRST_DRAIN_AT, 300, "the first steps")
            last, first = _preempt(ray_cluster, str(out), seen["spots"], 0, FIRST_DEADLINE_S)
            seen["last"], seen["drained"] = [last], [first.node_id]
            start = wait(lambda: max(_attempts(str(out))), 300, "the restarted group")
            wait(lambda: _attempts(str(out))[start] >= start + SECOND_DRAIN_AFTER, 60, "steps after the restart")
            last, second = _preempt(ray_cluster, str(out), seen["spots"], start, SECOND_DEADLINE_S,
                               before_drain=lambda: open(gate, "w").close())   # storage stops taking writes
            seen["last"].append(last)
            seen["drained"].append(second.node_id)
            seen["gone"] = wait(lambda: drain_record(run, second.node_id, lambda r: r["status"] == "node gone"),
                                60, "the second node to be seen gone")
            log(f"seen gone: {seen['gone']}")
            os.remove(gate)                  # storage is back: the steps on the node that stays are written
            seen["settled"] = wait(lambda: drain_record(run, second.node_id, lambda r: r.get("settled")), 60,
                                   "the second drain to settle")
        except BaseException as e:  # noqa: BLE001 - re-raised by the test once fit() returns
            seen["error"] = e
        finally:
            if os.path.exists(gate):
                os.remove(gate)              # storage is back

    from ray.train import FailureConfig
    driver = threading.Thread(target=preemptions, daemon=True)
    driver.start()
    try:
        result = fit(root, run, config, storage_path=tmp_path / "ray_train", full_every=1000, batch_steps=16,
                     failure_config=FailureConfig(max_failures=0, max_preemption_failures=2),
                     label_selector=[{"pool": "spot"}, {}])      # rank 0 on a spot node, rank 1 where it fits
        driver.join(60)
    finally:
        for node in seen["spots"]:           # the spot nodes left: the session's cluster is as it was
            ray_cluster.remove_node(node)
    if "error" in seen:
        raise seen["error"]
    assert result.error is None, result.error
    attempts = _attempts(str(out))
    starts = sorted(attempts)
    print(f"rank 0's attempts (start: steps completed): {attempts}; removed at {seen['last']}")
    assert len(starts) == 3, attempts
    assert open(out / "node-1-0").read() not in seen["drained"]      # rank 1 on a node that stays
    for last, resumed in zip(seen["last"], starts[1:]):
        assert last <= resumed <= last + 1, (last, resumed)    # 0 lost (+1: removed after a step, before its write)
    # every rank heard of both drains before the deadline (rank 1, on a node that stays, from Ray Train's
    # preemption info: TrainSession.preempted())
    for rank in (0, 1):
        notices = [json.loads(open(p).read())["notice"] for p in glob.glob(str(out / f"notice-{rank}-*.json"))]
        assert len(notices) == 2 and all(n["deadline_ms"] and n["remaining_s"] > 0 for n in notices), notices
        assert rank == 0 or all(n["source"] == "ray_train" for n in notices), notices
    finals = read_finals(out)
    for rank in (0, 1):
        ref, got = reference[rank], finals[rank]
        assert got["start"] == starts[-1] and got["step"] == ref["step"] == STEPS
        T.assert_same(ref["state"], got["state"], f"rank {rank}")
        assert torch.equal(ref["rng"], got["rng"]), f"rank {rank}: RNG"
    # the records: the first drain made every step it held durable before its deadline; the second, with storage
    # refusing writes, lost nothing with the node, and what it held became durable once storage was back
    from ray_ckpt.lineage import drains
    from ray_ckpt.storage import open_storage
    records = {r["node"]: r for r in drains.read_records(open_storage(root))}
    rec1 = records[seen["drained"][0]]
    assert rec1["status"] == "node gone" and rec1["unsafe"] == [] and rec1["held"], rec1
    assert rec1["durable"] == rec1["held"], rec1
    assert seen["gone"]["unsafe"] == [], seen["gone"]      # nothing lost with the node, storage still refusing
    rec2 = records[seen["drained"][1]]
    assert rec2 == seen["settled"], (rec2, seen["settled"])
    assert rec2["unsafe"] == [] and rec2["durable"] == rec2["held"], rec2
    capsys.readouterr()
    assert cli_main(["ls", root]) == 0
    listed = capsys.readouterr().out
    assert all(f"drain of node {n[:12]}" in listed for n in seen["drained"]), listed
