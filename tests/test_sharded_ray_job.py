"""The Ray actors of a sharded job with ``runtime="ray"``: O(nodes), not O(ranks). Four FSDP2 gloo ranks, two on
each node of the session's 2-node cluster, checkpoint through one coordinator for the job, one persistence worker
host per node and one replica host per node that runs ranks (1 + 2 x 2 = 5 ray_ckpt actors, where a run per
rank took 3 x 4 = 12); the consolidated restore after the run, through those actors (the coordinator restarted
meanwhile: it reopens each lineage from its name), is bitwise. The same 4
ranks as a 2x2 HSDP mesh (long: make reliability): replica 0 of each shard (the ranks of the first node) writes
the 2 shard lineages, the other replicas start no actor, and the consolidated restore is bitwise too."""
from __future__ import annotations

import collections
import os
import uuid

import pytest
import ray
import torch

import ray_ckpt
from ray_ckpt.engine import consolidate, shard_layout
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.trainer.client import ShardedMemoryTier
from ray_ckpt.runtime.coordinator import shard_runs, shutdown_job
from ray_ckpt.runtime.placement import prefer_node
from tests import _fsdp_worker as W, _training as T

pytestmark = pytest.mark.ray

STEPS = 8
WORLD = 4


class _Rank:
    """One FSDP2 rank in a Ray actor pinned to its node (as a Ray Train worker would be)."""

    def train(self, rank: int, world: int, port: int, uri: str, out: str, run: str, hsdp: bool) -> str:
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        with T.dist_group(rank, world, port):
            model, opt, sch = W.hsdp_model(0, (2, 2)) if hsdp else W.fsdp_model(0)
            ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=W.FULL_EVERY,
                                       batch_steps=W.BATCH, policy="fixed", runtime="ray", run=run)
            for s in range(STEPS):
                T.train_step(W.KIND, model, opt, sch, s, rank)
            glob = W.global_snapshot(model, opt)   # collective
            if rank == 0:
                torch.save(glob, os.path.join(out, "global.pt"))
            if ck.shard_spec.writes:   # HSDP: replica 1 of each shard writes nothing
                ck._capture.flush_pending()
                ck._sink.wait_safe()
            ck.close()
        return ray.get_runtime_context().get_node_id()


@pytest.mark.parametrize("hsdp", [False, pytest.param(True, marks=pytest.mark.long)], ids=["fsdp", "hsdp"])
def test_sharded_job_actors_are_per_node(tmp_path, ray_cluster, hsdp):  # noqa: F811
    uri, out = str(tmp_path / "ckpt"), str(tmp_path)
    run = f"job-{uuid.uuid4().hex[:6]}"
    head = ray.get_runtime_context().get_node_id()
    nodes = [head] + sorted(n["NodeID"] for n in ray.nodes()
                            if n.get("Alive") and n["NodeID"] != head and "node2" in n.get("Resources", {}))
    assert len(nodes) == 2, nodes
    port = T.free_port()
    ranks = [ray.remote(_Rank).options(num_cpus=0, **prefer_node(nodes[r // 2])).remote() for r in range(WORLD)]
    try:
        where = ray.get([a.train.remote(r, WORLD, port, uri, out, run, hsdp) for r, a in enumerate(ranks)],
                        timeout=300)
    finally:
        for a in ranks:
            ray.kill(a)
    assert where == [nodes[0], nodes[0], nodes[1], nodes[1]], where

    # the job's ray_ckpt actors (all named, detached, in the ray_ckpt namespace; the session cluster runs no
    # dashboard, so the named-actor listing of the GCS stands in for ray.util.state.list_actors)
    mine = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == naming.NAMESPACE and a["name"].startswith(f"ray_ckpt:{run}:"))
    kinds = collections.Counter(name.split(":")[3] for name in mine)
    # 1 + 2 x nodes, whatever the ranks; HSDP: only the first node's ranks (replica 0) write, so one replica host
    assert kinds == {"coordinator": 1, "worker": 2, "replica": 1 if hsdp else 2}, mine
    assert mine == lineages.host_names(run, mine)
    world = 2 if hsdp else WORLD    # the shard lineages: one per coordinate of the sharding mesh dimension
    shards = [shard_layout.shard_run(run, world, r) for r in range(world)]
    assert shard_runs(run) == shards     # the one coordinator tracks every rank's lineage
    for name in mine:
        host = ray.get_actor(name, namespace=naming.NAMESPACE)
        held = ray.get(host.lineages.remote())
        if ":replica:" in name:   # the replicas of the ranks of one node, on its peer
            trainer = name.rsplit(":", 1)[1]
            assert held == [s for r, s in enumerate(shards) if nodes[r // 2] == trainer], (name, held)
            assert ray.get(host.ping.remote()) != trainer
        elif ":worker:" in name:  # its node's ranks, and the peer's ranks' second copies
            assert set(held) == set(shards), (name, held)
    for s in shards:
        st = ray.get(lineages.coordinator(s).status.remote())
        assert st["recoverable_step"] == STEPS and not st["gaps"], (s, st)

    if not hsdp:   # the job's coordinator restarts: it holds no lineage until a call names one, which reopens it
        ray.kill(ray.get_actor(lineages.coordinator_host_name(run), namespace=naming.NAMESPACE), no_restart=False)

    # restored after the run through the job's actors, consolidated in this process: bitwise
    glob = torch.load(os.path.join(out, "global.pt"), weights_only=False)
    model = T.make_model(W.KIND, 99)
    opt = T.make_optimizer("adamw", model)
    tier = ShardedMemoryTier(run)
    from ray_ckpt.storage import open_storage
    assert consolidate.restore_consolidated(open_storage(uri), model, opt, memory=tier) == STEPS
    assert tier.tiers["memory"] + tier.tiers["replica"] >= world, tier.tiers
    T.assert_same(glob["model"], dict(model.state_dict()), "consolidated model")
    T.assert_same(glob["opt"], opt.state_dict()["state"], "consolidated optimizer")
    assert shard_runs(run) == shards     # reopened from storage and the worker hosts' inventories

    shutdown_job(run)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert lineages.host_names(run, names) == []
