"""Sharded training state (FSDP2) with ``runtime="ray"``: every rank's shard lineage is a shard run of the job —
tracked by the job's one coordinator, persisted by its node's worker host, replicated by the replica host of its
node on the peer node — and restores go through the shard runs: with ``durable_diffs="fulls"`` storage alone holds only an older step while the latest comes
from each shard's replica (nothing replayed); an older step from the memory tier; resharded 2 -> 1 from the shard
runs; all bitwise."""
from __future__ import annotations

import os
import uuid

import pytest
import ray
import torch

import ray_ckpt

from ray_ckpt.engine import consolidate, shard_layout
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.coordinator import shard_runs, shutdown_job
from ray_ckpt.storage import open_storage
from tests import _fsdp_worker as W, _training as T

pytestmark = pytest.mark.ray


def test_fsdp2_shard_runs_restore_from_their_replicas(tmp_path, ray_cluster):  # noqa: F811
    uri, out = str(tmp_path / "ckpt"), str(tmp_path)
    run = f"fsdp-ray-{uuid.uuid4().hex[:6]}"
    T.spawn(W.ray_train_and_restore, args=(2, T.free_port(), uri, out, ray_cluster.address, run), nprocs=2)
    # one coordinator for the job tracks both shard lineages; each shard's replica runs on the peer of the
    # trainer's node, in the one replica host of that node
    me = ray.get_runtime_context().get_node_id()
    assert shard_runs(run) == [shard_layout.shard_run(run, 2, r) for r in range(2)]
    hosts = set()
    for rank in range(2):
        shard = shard_layout.shard_run(run, 2, rank)
        ray.get(lineages.coordinator(shard).status.remote())
        replica = lineages.replica(shard)
        assert ray.get(replica.ping.remote()) != me
        hosts.add(replica.host)
    assert len(hosts) == 1
    assert shard_layout.saved_worlds(open_storage(uri)) == [2]
    # 2 -> 1: both saved shards come from their replicas, resharded
    T.spawn(W.ray_restore_at_world, args=(1, T.free_port(), uri, out, ray_cluster.address, run), nprocs=1)
    # consolidated in this process (no process group) into the unsharded model, through the shard runs
    _consolidate_through_the_shard_runs(uri, out, run)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert naming.shard_runs(run, names) == []    # no actors per shard run: the job's hosts serve them
    assert shard_runs(run) == [shard_layout.shard_run(run, 2, r) for r in range(2)]
    shutdown_job(run)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert lineages.host_names(run, names) == []


def _consolidate_through_the_shard_runs(uri, out, run):
    """The unsharded model and optimizer restored with ``runtime="ray"`` in this process: the latest step, each
    shard through its shard run, bitwise the run's gathered state."""
    from ray_ckpt.runtime.trainer.client import ShardedMemoryTier
    glob = torch.load(os.path.join(out, "global.pt"), weights_only=False)
    model = T.make_model(W.KIND, 99)
    opt = T.make_optimizer("adamw", model)
    assert ray_ckpt.restore(uri, model, opt, runtime="ray", run=run) == W.STEPS
    T.assert_same(glob[W.STEPS]["model"], dict(model.state_dict()), "consolidated model (runtime='ray')")
    T.assert_same(glob[W.STEPS]["opt"], opt.state_dict()["state"], "consolidated optimizer (runtime='ray')")
    tier = ShardedMemoryTier(run)
    model = T.make_model(W.KIND, 98)
    opt = T.make_optimizer("adamw", model)
    assert consolidate.restore_consolidated(open_storage(uri), model, opt, memory=tier) == W.STEPS
    assert tier.tiers["replica"] + tier.tiers["memory"] >= 2, tier.tiers     # each shard through its run
    T.assert_same(glob[W.STEPS]["model"], dict(model.state_dict()), "consolidated from the replicas")
