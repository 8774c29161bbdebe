"""``RayCkptCallback.after_worker_group_start`` (controller side of a restart): when the new worker group's world
rank 0 lands on a node without the run's persistence worker (a replacement node after a node loss), the callback
starts that worker without waiting, so its process starts while the train loop builds its model rather than inside
``attach``; on a first start (no worker of the run yet) and on a node that has one, it starts nothing."""
from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest
import ray

import ray_ckpt.train
from ray_ckpt.runtime import lineages
from ray_ckpt.runtime.coordinator import shutdown_run
from ray_ckpt.runtime.worker import get_or_create_worker
from ray_ckpt.storage import open_storage

pytestmark = pytest.mark.ray


def _group(node_of_rank0: str, other: str):
    """The part of Ray Train's WorkerGroup the hook reads: its workers' world ranks and nodes."""
    def worker(rank, node):
        return SimpleNamespace(distributed_context=SimpleNamespace(world_rank=rank),
                               metadata=SimpleNamespace(node_id=node))
    return SimpleNamespace(get_workers=lambda: [worker(1, other), worker(0, node_of_rank0)])


def _wait_for_worker(run, node) -> set:
    deadline = time.monotonic() + 60   # the hook's thread asks Ray for the run's workers, then creates one
    while node not in lineages.worker_nodes(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    return lineages.worker_nodes(run)


def test_a_restart_onto_a_node_without_the_runs_worker_starts_it(tmp_path, ray_cluster):
    run = f"pre-{uuid.uuid4().hex[:8]}"
    head = ray.get_runtime_context().get_node_id()
    node2 = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
    cb = ray_ckpt.train.RayCkptCallback(str(tmp_path / "ckpt"), run=run)
    cb._storage = storage = open_storage(str(tmp_path / "ckpt"))   # as after_controller_start leaves it
    try:
        cb._start_node_worker(storage, node2)           # (the hook's thread, run here) a first start: no workers
        assert lineages.worker_nodes(run) == set()
        ray.get(get_or_create_worker(run, head, storage, 64 << 20).ping.remote())
        cb._start_node_worker(storage, head)            # rank 0 where the run's worker runs: nothing to start
        assert lineages.worker_nodes(run) == {head}
        cb.after_worker_group_start(_group(node2, head))   # rank 0 on a node without one: started
        assert _wait_for_worker(run, node2) == {head, node2}
        ray.get(lineages.worker(run, node2).ping.remote())
    finally:
        shutdown_run(run)
