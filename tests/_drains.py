"""Helpers of the node-drain tests (tests/test_drain.py, tests/test_drain_ray_train.py): waiting, draining a node
through the GCS as ``ray drain-node`` and the autoscaler do, and reading a run's drain records from its
coordinator. Driver process."""
from __future__ import annotations

import os
import time


def log(msg) -> None:
    """A line to ``$DRAIN_TEST_LOG`` when it is set (timings of a drain test's phases)."""
    if os.environ.get("DRAIN_TEST_LOG"):
        with open(os.environ["DRAIN_TEST_LOG"], "a") as f:
            f.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def wait(cond, timeout=60.0, what="condition"):
    """``cond()``'s first true value, polled every 0.1 s; AssertionError after ``timeout`` seconds."""
    t0 = time.monotonic()
    while True:
        got = cond()
        if got:
            log(f"{what}: {time.monotonic() - t0:.1f} s")
            return got
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def drain_gcs(cluster, node_id: str, seconds: float) -> None:
    """The GCS call ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` and the autoscaler make, with a
    deadline ``seconds`` from now."""
    import ray
    from ray.core.generated import autoscaler_pb2
    gcs = ray._raylet.GcsClient(address=cluster.address)
    ok, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                             "spot preemption (test)", int((time.time() + seconds) * 1000))
    assert ok, why


def coordinator(run):
    """The run's coordinator actor."""
    import ray
    from ray_ckpt.runtime import naming
    return ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE)


def drain_record(run, node, until):
    """The coordinator's record of ``node``'s drain once ``until(record)`` holds (None before: for :func:`wait`)."""
    import ray
    rec = ray.get(coordinator(run).drain_status.remote()).get(node)
    return rec if rec and until(rec) else None
