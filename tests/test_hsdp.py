"""HSDP (FSDP2 fully_shard on a 2-D (replicate, shard) mesh, gloo on CPU): replica 0 of every shard writes the
shard lineages, the replicas write nothing; after the ranks are killed every rank restores at 2x2 (replicas read
their shard) and the state reshards to 1x2 and 1x1, bitwise; tensor-parallel placements are refused."""
from __future__ import annotations

import pytest

from ray_ckpt.engine import shard_layout
from ray_ckpt.storage import open_storage
from tests import _fsdp_worker as W, _training as T


@pytest.mark.procs
def test_hsdp_2x2_writes_one_replica_group_and_restores_bitwise_at_any_shape(tmp_path):
    uri, out = str(tmp_path / "ckpt"), str(tmp_path)
    T.spawn(W.hsdp_train_killed, args=(4, T.free_port(), uri, out), nprocs=4)   # they die at the end
    storage = open_storage(uri)
    # the layout of a 1-D FSDP2 run of 2 ranks: replica 0 of each shard wrote it, no key from the replicas
    assert shard_layout.saved_worlds(storage) == [2]
    assert {k.split("/")[2] for k in storage.list("shards/w00002/")} == {"r00000", "r00001"}
    assert [k for k in storage.list("") if not k.startswith("shards/w00002/r0000")] == ["shards/world-00002.json"]
    T.spawn(W.hsdp_restore, args=(4, T.free_port(), uri, out, (2, 2), [None, 7]), nprocs=4)
    T.spawn(W.hsdp_restore, args=(2, T.free_port(), uri, out, (1, 2), [None, 7]), nprocs=2)
    T.spawn(W.hsdp_restore, args=(1, T.free_port(), uri, out, (1, 1), [None]), nprocs=1)


def test_placements_other_than_shard_and_hsdp_are_refused_naming_them():
    """Which DTensor placements sharded state takes (pure: no process group): Shard(d) on a 1-D mesh, Replicate()
    with Shard(d) on a 2-D mesh; tensor parallelism (two Shard placements, a strided shard), Partial, 3-D meshes
    and replicated-only parameters raise NotImplementedError naming what was found."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    assert shard_layout.mesh_layout((Shard(0),), 1) == (0, None)
    assert shard_layout.mesh_layout((Replicate(), Shard(1)), 2) == (1, 0)       # HSDP: (replicate, shard)
    assert shard_layout.mesh_layout((Shard(0), Replicate()), 2) == (0, 1)
    refused = {(Shard(0), Shard(1)): "two Shard placements", (Replicate(), Partial()): "Partial",
               (Partial(),): "Partial", (Replicate(),): "no Shard placement",
               (Replicate(), Replicate(), Shard(0)): "3-D"}
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
        refused[(_StridedShard(0, split_factor=2), Shard(0))] = "_StridedShard"
    except ImportError:
        pass
    for placements, what in refused.items():
        with pytest.raises(NotImplementedError, match=what):
            shard_layout.mesh_layout(placements, len(placements))


@pytest.mark.procs
def test_amber_for_sharded_state_holds_its_bound_after_consolidation(tmp_path):
    """strategy=Amber on 2 FSDP2 ranks (runtime="local"): each rank writes increments of its shards; restores at
    2 ranks, and resharded to 1, gathered into whole tensors, are within |restored - true| <= tau·|restored| for
    every element (parameters: threshold, optimizer state: optimizer_threshold; step counters exact)."""
    uri, out = str(tmp_path / "ckpt"), str(tmp_path)
    T.spawn(W.amber_train_restore, args=(2, T.free_port(), uri, out), nprocs=2)
    storage = open_storage(uri)
    assert any("-diff-" in k for k in storage.list("shards/w00002/r00001/manifests/"))
    T.spawn(W.amber_restore_at_world, args=(1, T.free_port(), uri, out), nprocs=1)
