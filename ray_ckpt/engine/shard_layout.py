"""Where and how sharded (FSDP2/HSDP) state is laid out: a rank's sharding (:class:`ShardSpec`, read off the
optimizer's DTensor parameters), the names of the shard lineages under a root and of their Ray shard runs, the
world-size markers, and ``torch.chunk`` placement (which part of a dimension each rank holds). Storage keys::

    <root>/shards/world-00002.json          marker of a world size (what restores look for)
    <root>/shards/w00002/r00000/...         rank 0's lineage (manifests, objects, lease, index) at world size 2
    <root>/shards/w00002/r00001/...         rank 1's

Every full of a shard lineage records its sharding (:func:`sharding_info`) in its layout. What the layout means
for capture, restore and consolidation: :mod:`ray_ckpt.engine.sharded`. Runs in the training process of each rank
(the spec, the markers) and in any process that reads a root (names, markers, placement).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from ray_ckpt.engine.dtensor import is_dtensor
from ray_ckpt.lineage.layout import SHARD_RUN_TAG, SHARDS_DIR
from ray_ckpt.storage.prefixed import PrefixedStorage

_MARKER_RE = re.compile(r"^world-(\d{5})\.json$")


@dataclass(frozen=True)
class ShardSpec:
    """How this rank's optimizer parameters are sharded: ``world`` shards (the size of the mesh dimension that
    shards), this rank holds shard ``rank``; per optimizer parameter (param_groups order) its global shape and
    shard dimension. On a 2-D mesh (HSDP: replicate x shard) the shards are replicated ``replicas`` times and this
    rank is replica ``replica`` of its shard (1 and 0 on a 1-D mesh)."""

    world: int
    rank: int
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    replicas: int = 1
    replica: int = 0

    @property
    def writes(self) -> bool:
        """Whether this rank writes its shard lineage: replica 0 of every shard does, the other replicas of an
        HSDP mesh hold the same bytes and write nothing."""
        return self.replica == 0


def _placement_kind(pl) -> str:
    """``"shard"`` for ``Shard(d)`` itself, ``"replicate"`` for ``Replicate()``, else the placement's repr (a
    ``Partial``, a strided shard of FSDP + tensor parallelism, ...): what sharded state refuses."""
    from torch.distributed.tensor import Replicate, Shard
    if type(pl) is Shard:
        return "shard"
    if type(pl) is Replicate:
        return "replicate"
    return repr(pl)


def mesh_layout(placements, ndim: int) -> tuple[int, int | None]:
    """``(shard mesh dim, replicate mesh dim or None)`` of a parameter placed by ``placements`` on a mesh of
    ``ndim`` dimensions. Supported: ``(Shard(d),)`` on a 1-D mesh (FSDP2's ``fully_shard``) and one
    ``Replicate()`` with one ``Shard(d)`` on a 2-D mesh (HSDP: ``fully_shard`` on a (replicate, shard) mesh).
    Raises NotImplementedError naming what it found otherwise: a ``Partial``, two ``Shard`` placements (tensor
    parallelism or 2-D sharding), a strided shard (FSDP over tensor parallelism), a mesh of 3 or more
    dimensions, or a replicated-only parameter."""
    kinds = [_placement_kind(pl) for pl in placements]
    odd = [k for k in kinds if k not in ("shard", "replicate")]
    if odd:
        raise NotImplementedError(f"placement {odd[0]} is not supported (tensor parallelism, Partial and strided "
                                  f"shards are refused: only Shard(d), and Replicate() x Shard(d) for HSDP)")
    if ndim > 2 or len(kinds) != ndim:
        raise NotImplementedError(f"a {ndim}-D device mesh is not supported (1-D FSDP2 meshes and 2-D "
                                  f"(replicate, shard) HSDP meshes are)")
    if kinds.count("shard") != 1:
        what = "two Shard placements (tensor parallelism / 2-D sharding)" if kinds.count("shard") > 1 \
            else "no Shard placement (a replicated DTensor)"
        raise NotImplementedError(f"{what} is not supported: sharded state needs exactly one mesh dimension "
                                  f"that shards (Shard(d)), any other replicating (Replicate())")
    shard_dim = kinds.index("shard")
    return shard_dim, (None if ndim == 1 else 1 - shard_dim)


def spec_of(optimizer: torch.optim.Optimizer) -> ShardSpec | None:
    """The sharding of ``optimizer``'s parameters; None when none is a DTensor (replicated state). Raises
    NotImplementedError for what is not supported (see :func:`mesh_layout`: tensor-parallel placements,
    ``Partial``, meshes of 3 or more dimensions; also parameters on different meshes or placed differently, or
    plain parameters mixed with DTensors). Training process."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kinds = [is_dtensor(p) for p in params]
    if not any(kinds):
        return None
    if not all(kinds):
        raise NotImplementedError("ray_ckpt: this optimizer mixes DTensor (FSDP2) parameters with plain ones; "
                                  "shard every parameter (fully_shard the root module) or none")
    mesh = params[0].device_mesh
    shapes, dims, layout = [], [], None
    for i, p in enumerate(params):
        if p.device_mesh != mesh:
            raise NotImplementedError(f"ray_ckpt: optimizer parameter {i} lives on another device mesh than "
                                      f"parameter 0; sharded state needs one mesh")
        try:
            this = mesh_layout(p.placements, mesh.ndim)
        except NotImplementedError as e:
            raise NotImplementedError(f"ray_ckpt: optimizer parameter {i} (shape {tuple(p.shape)}) has placements "
                                      f"{tuple(p.placements)} on a {mesh.ndim}-D mesh "
                                      f"{mesh.mesh_dim_names or ''}: {e}") from None
        if layout is not None and this != layout:
            raise NotImplementedError(f"ray_ckpt: optimizer parameter {i} shards along mesh dimension {this[0]}, "
                                      f"parameter 0 along {layout[0]}; sharded state needs one layout")
        layout = this
        shapes.append(tuple(p.shape))
        dims.append(p.placements[layout[0]].dim)
    shard_dim, rep_dim = layout
    replicas, replica = (1, 0) if rep_dim is None else (mesh.size(rep_dim), mesh.get_local_rank(rep_dim))
    return ShardSpec(world=mesh.size(shard_dim), rank=mesh.get_local_rank(shard_dim), shapes=tuple(shapes),
                     dims=tuple(dims), replicas=replicas, replica=replica)


def sharding_info(spec: ShardSpec) -> dict:
    """What each full of a shard lineage records about the sharding (JSON)."""
    return {"world": spec.world, "rank": spec.rank, "shapes": [list(s) for s in spec.shapes],
            "dims": list(spec.dims), "replicas": spec.replicas}


def shard_of(layout: dict | None) -> dict | None:
    """The sharding a full's layout records (None for unsharded state): ``{"world", "rank", ...}``."""
    return (layout or {}).get("sharding")


def shard_storage(storage, world: int, rank: int) -> PrefixedStorage:
    """The view of ``storage`` holding rank ``rank``'s shard lineage at world size ``world``."""
    if not (isinstance(world, int) and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"bad shard {rank} of world {world}")
    return PrefixedStorage(storage, shard_prefix(world, rank))


def shard_prefix(world: int, rank: int) -> str:
    """The keys of rank ``rank``'s shard lineage at world size ``world`` start with this, below the root."""
    return f"{SHARDS_DIR}w{world:05d}/r{rank:05d}/"


def shard_run(run: str | None, world: int, rank: int) -> str | None:
    """The Ray runtime's run of one shard lineage (``runtime="ray"``: its lineage of the job's coordinator, node
    workers and replicas, :mod:`ray_ckpt.runtime.lineages`). None for None (the Checkpointer names the shard runs
    of an unnamed job after its root: :func:`ray_ckpt.runtime.trainer.client.shard_lineage_run`)."""
    return None if run is None else f"{run}{SHARD_RUN_TAG}w{world:05d}-r{rank:05d}"


def mark_world(storage, spec: ShardSpec) -> None:
    """Record that shard lineages of ``spec.world`` ranks exist (each rank writes the same marker at attach)."""
    body = {"world": spec.world, "shapes": [list(s) for s in spec.shapes], "dims": list(spec.dims)}
    storage.write(f"{SHARDS_DIR}world-{spec.world:05d}.json", json.dumps(body).encode())


def saved_worlds(storage) -> list[int]:
    """World sizes that have shard lineages under ``storage``, ascending."""
    out = []
    for key in storage.list(f"{SHARDS_DIR}world-"):
        m = _MARKER_RE.match(key[len(SHARDS_DIR):])
        if m:
            out.append(int(m.group(1)))
    return sorted(set(out))


def chunk_span(length: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s chunk of a dimension of ``length`` split over ``world`` ranks as
    ``Shard(d)`` places it (``torch.chunk``: chunks of ``ceil(length / world)``, the last ones shorter or empty)."""
    size = -(-length // world) if length else 0
    start = min(rank * size, length)
    return start, min(start + size, length)


def saved_ranks(length: int, saved_world: int, world: int, rank: int) -> list[int]:
    """The saved ranks whose chunks overlap rank ``rank``'s chunk at ``world`` (a dimension of ``length``)."""
    a, b = chunk_span(length, world, rank)
    out = []
    for r in range(saved_world):
        lo, hi = chunk_span(length, saved_world, r)
        if lo < b and a < hi:
            out.append(r)
    return out
