"""The state tier's replica restarts from the newest trainer full it is fed, whatever order the fulls arrive in.

Feeds reach the replica out of order: it runs several calls at once, and after the replica restarts Ray delivers the
calls sent meanwhile in one burst. A full older than a restart already pending (or under way) used to replace it,
after the newer full had dropped the queued chunks up to it: the replica restarted from the older full, behind the
trainer with nothing queued, and never caught up (tests/test_state_tier.py::
test_killed_replica_is_rebuilt_and_follows_again timed out that way in the serial tier)."""
from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import ray_ckpt
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.lineage import Manifest, full_name, object_key
from ray_ckpt.runtime.replica import resets
from ray_ckpt.storage import open_storage
from tests import _training as T


def _full(gen: int, step: int) -> Manifest:
    return Manifest(kind="full", generation=gen, first_step=step, last_step=step,
                    object=object_key(full_name(gen, step)), nbytes=1, crc32=0)


def test_only_a_newer_full_restarts_the_replica():
    assert resets(_full(1, 10), None, None)                     # nothing installed, nothing pending
    assert resets(_full(1, 30), (1, 20), None)                  # ahead of the state (a trainer full after a gap)
    assert resets(_full(2, 5), (1, 20), None)                   # a newer generation
    assert not resets(_full(1, 20), (1, 20), None) and not resets(_full(1, 10), (1, 20), None)
    assert not resets(_full(1, 30), (2, 5), None)               # a superseded generation's full
    # a restart from the full of step 40 is pending or under way: an older full delivered late does not replace it
    assert not resets(_full(1, 30), None, (1, 40)) and not resets(_full(1, 40), None, (1, 40))
    assert not resets(_full(1, 30), (1, 20), (1, 40))
    assert resets(_full(1, 50), None, (1, 40)) and resets(_full(2, 0), (1, 20), (1, 40))


@pytest.mark.ray
def test_a_replica_fed_an_older_full_after_a_newer_one_follows_the_newer(tmp_path, ray_cluster):  # noqa: F811
    import ray
    from ray_ckpt.runtime.replica import get_or_create_replica
    uri = str(tmp_path / "ck")
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=10, keep_fulls=0, recovery_every=1):
        for s in range(20):
            T.train_step("mlp", model, opt, sch, s)
    storage = open_storage(uri)
    fulls = {m.last_step: m for m in load_lineage(storage)[0].manifests if m.kind == "full"}
    run = f"feed-{uuid.uuid4().hex[:8]}"
    replica, _ = get_or_create_replica(run, ray.get_runtime_context().get_node_id(), storage, full_every=10,
                                       max_lag=100)
    try:
        ray.get(replica.ping.remote(), timeout=120)
        refs = {s: ray.put([np.frombuffer(storage.read(fulls[s].object), dtype=np.uint8)]) for s in (10, 20)}
        for s in (20, 10):    # as a burst after a restart may deliver them
            ray.get(replica.feed.remote(fulls[s].to_json(), [refs[s]]), timeout=60)
        deadline = time.monotonic() + 60
        while ray.get(replica.status.remote(), timeout=60)["step"] is None:
            assert time.monotonic() < deadline, "the replica installed no full"
            time.sleep(0.1)
        time.sleep(1.0)       # a wrongly pending restart from the older full would have run by now
        st = ray.get(replica.status.remote(), timeout=60)
        assert (st["generation"], st["step"], st["ok"]) == (1, 20, True), st
    finally:
        ray.kill(replica)
