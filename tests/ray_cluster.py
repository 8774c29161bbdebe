"""Shared Ray fixtures: one local multi-node cluster per test session, isolated from any other Ray on the
machine (own temp dir, own RAY_TMPDIR, address passed explicitly), always shut down — after closing every
Checkpointer a test left open (:func:`close_leftovers`): a sender thread left running reconnects to Ray after the
shutdown, and removing the head node then fails ("Removing a node that is connected to this Ray client is not
allowed"). tests/conftest.py also closes, after each ``ray`` test, the Checkpointers it left open, and names it."""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest

#: how long closing one Checkpointer a test left open may wait for its sink (seconds)
LEFTOVER_CLOSE_S = 10.0


def close_leftovers(attachments=None) -> list[str]:
    """Close ``attachments`` (default: every one of this process not released yet,
    :func:`ray_ckpt.engine.attachment.open_attachments`): each Checkpointer's drain watch, capture hooks, sink
    thread and lease, without the final flush. Returns their owners, with the error when a close failed. Test
    process."""
    from ray_ckpt.engine.attachment import open_attachments
    names = []
    for att in open_attachments() if attachments is None else attachments:
        name = att.owner or repr(att)
        try:
            att.release(timeout=LEFTOVER_CLOSE_S)
        except Exception as e:  # noqa: BLE001 - the next one is closed all the same
            name += f" (closing it failed: {type(e).__name__}: {e})"[:300]
        names.append(name)
    return names


@pytest.fixture(scope="session")
def ray_cluster():
    """A 2-node ``ray.cluster_utils.Cluster`` (head + one worker node, each with its own object store) with
    this process connected as the driver. Yields the Cluster; tests may add/remove extra nodes themselves."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # inherited by every raylet/worker this fixture starts: test modules importable, fast Ray Train polls
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # Ray Train's PreemptionWatcher reads the drain state every 5 s by default: the drain tests' deadlines are a few s
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    # after a node is removed, Ray 2.60's elastic policy still counts it (its view refreshes on a 20 s tick), tries
    # the old group size and gives up only after this timeout (60 s by default), then starts the smaller group;
    # groups start here in ~6 s
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "25")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 300 << 20, "temp_dir": os.path.join(tmp, "ray"),
        "include_dashboard": False})
    cluster.add_node(num_cpus=2, object_store_memory=300 << 20, resources={"node2": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="ray_ckpt_tests", log_to_driver=False)
    try:
        yield cluster
    finally:
        left = close_leftovers()
        if left:
            warnings.warn(f"Checkpointers still open at the end of the session, closed before Ray shut down: "
                          f"{'; '.join(left)}")
        ray.shutdown()
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)
