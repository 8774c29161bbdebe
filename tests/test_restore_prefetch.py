"""A restore through the state-tier replica reads one snapshot object per replica state, and that object can be
pulled ahead of the restore (what RayCkptCallback starts on every worker of a restarted Ray Train group).

The small MLP of tests/_training.py with runtime="ray" on the session's 2-node cluster; every restore is compared
with an uninterrupted reference run (torch.equal on every tensor).
"""
from __future__ import annotations

import time
import uuid

import pytest
import ray

import ray_ckpt
from ray_ckpt.runtime import naming
from ray_ckpt.runtime.trainer.client import prefetch_snapshot
from ray_ckpt.runtime.coordinator import shutdown_run
from tests import _training as T

pytestmark = pytest.mark.ray


def _fresh():
    model = T.make_model("mlp", seed=77)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt)


def _wait(cond, what, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_one_snapshot_per_replica_state_pulled_ahead_and_restored_bitwise(tmp_path, ray_cluster):
    run, uri = f"pf-{uuid.uuid4().hex[:8]}", str(tmp_path / "ckpt")
    ref = T.reference_states(29)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    try:
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, full_every=10,
                                   batch_steps=4, recovery_every=1)
        replica = ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE)

        def stats():
            return ray.get(replica.status.remote())

        done = [0]

        def train_to(step):
            for s in range(done[0], step):
                T.train_step("mlp", model, opt, sch, s)
            done[0] = step
            ck.flush()
            _wait(lambda: stats()["step"] == step, f"the replica to reach step {step}")

        train_to(23)
        # the ranks of a group asking for the same state get the same object: one encode and put, not one each
        a, b = ray.get([replica.snapshot.remote(ck.generation, 23), replica.snapshot.remote(ck.generation, 23)])
        assert a["ref"] == b["ref"] and a["step"] == b["step"] == 23 and (a.get("shared") or b.get("shared"))
        s0 = stats()

        # pulled ahead, then restored: the restore reads the object the prefetch pulled (no second snapshot)
        assert prefetch_snapshot(run)
        _wait(lambda: stats()["snapshots_shared"] > s0["snapshots_shared"], "the prefetch's snapshot")
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 23
        T.assert_same(ref[23], T.snapshot(m, o, sc), "step 23 after a prefetch")
        s1 = stats()
        assert s1["snapshots"] == s0["snapshots"], (s0, s1)
        assert s1["snapshots_shared"] == s0["snapshots_shared"] + 2, (s0, s1)

        # the replica moves on after a prefetch: the restore gets the new state, never the pulled one
        assert prefetch_snapshot(run)
        _wait(lambda: stats()["snapshots_shared"] > s1["snapshots_shared"], "the second prefetch's snapshot")
        train_to(29)
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 29
        T.assert_same(ref[29], T.snapshot(m, o, sc), "step 29 after a stale prefetch")
        s2 = stats()
        assert s2["snapshots"] == s1["snapshots"] + 1, (s1, s2)
        # an earlier step than the snapshot's: read from the chain, bitwise
        assert prefetch_snapshot(run)
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=26, runtime="ray", run=run) == 26
        T.assert_same(ref[26], T.snapshot(m, o, sc), "step 26 with a prefetch of step 29")
        ck.close()
    finally:
        shutdown_run(run)
