"""Sharded training state (FSDP2): every rank checkpoints its own shard; restores at any world size.

With ``torch.distributed.fsdp.fully_shard`` the parameters are DTensors sharded along one dimension over a 1-D
device mesh (``Shard(d)``; the chunks of ``torch.chunk``), and so are the optimizer's per-parameter state tensors.
Replicated state is the special case of one shard: nothing here is a second engine. Each rank runs the ordinary
LowDiff machinery on its *local* tensors (the capture copies ``to_local()`` views: the gradient shard its optimizer
step consumes, its parameter and optimizer-state shards for fulls) into its own lineage, under
``<root>/shards/w<world>/r<rank>/`` (:mod:`ray_ckpt.engine.shard_layout`: the keys, the world markers, the spec).
Every full records the sharding (:func:`~ray_ckpt.engine.shard_layout.sharding_info`: world size, rank, each
parameter's global shape and shard dimension, replicas) in its layout.

This module holds the restore of a rank's shards (:func:`restore_sharded`); below it,
:mod:`ray_ckpt.engine.shard_layout` (where and how the shards are laid out) and :mod:`ray_ckpt.engine.shard_chains`
(the steps complete on every rank, one shard replayed); beside it, :mod:`ray_ckpt.engine.consolidate` (the shards
gathered into an unsharded model).

**HSDP** (``fully_shard`` on a 2-D (replicate, shard) mesh; placements ``Replicate() x Shard(d)``): ``world`` and
``rank`` are the size of the sharding mesh dimension and this rank's coordinate on it, so the layout is that of a
1-D mesh of ``world`` ranks. Replica 0 of every shard writes it
(:attr:`~ray_ckpt.engine.shard_layout.ShardSpec.writes`); the other replicas hold the same bytes and write nothing
(:mod:`ray_ckpt.engine.hsdp`); every rank restores the shard of its shard coordinate, so any mesh shape restores
from any other. Tensor-parallel placements, ``Partial`` and meshes of 3+ dimensions are refused
(:func:`~ray_ckpt.engine.shard_layout.mesh_layout`).

**A step is recoverable only when every rank's shard of it is** (:func:`~ray_ckpt.engine.shard_chains.agreed_step`):
a restore takes the newest step that each shard lineage of one world size restores exactly, never mixing steps
across ranks. With ``fallback=True`` a step whose objects this rank cannot read (missing, corrupt) is skipped for
the next older complete step; ranks that fell back differently are brought to one step by
:func:`ray_ckpt.integrations.agreement.sharded_agreed_restore` (a restore at the smallest step they reached).

**Restore** (:func:`restore_sharded`, each rank of the new world, no collectives): the shard chains are replayed on
plain tensors of the training device with the same replay code as every restore
(:func:`ray_ckpt.engine.shadow.rebuild` + :func:`ray_ckpt.engine.restore.replay`; on CPU this is bitwise the FSDP2
optimizer step, element-wise on the same local values). At the saved world size a rank replays its own shard; at
another world size it replays the saved shards that overlap its new chunk of some parameter (plus its own saved
rank, or rank 0, for the loop state), concatenates them and cuts its chunk out
(:func:`~ray_ckpt.engine.shard_layout.chunk_span`, ``torch.chunk`` placement; a 2 -> 3 reshard reads 1 or 2 of the 2
saved shards per rank). The result is loaded into the live DTensors' local shards and the optimizer. Loop state
(param groups, scheduler, RNG, extra state) is the rank's own when the saved world had that rank, else rank 0's with
RNG streams derived from it and the rank (:func:`ray_ckpt.engine.loopstate.derive_rng`).

**Consolidation** (:mod:`ray_ckpt.engine.consolidate`; one process, no process group): an unsharded model and
optimizer restored from the root (``ray_ckpt.restore``), an export of the root and the CLI read every saved rank's
chain of the agreed step in turn, replay it and copy it into its chunk of the global tensors: bitwise the run's
gathered state, loop state rank 0's.

Supported: 1-D meshes with ``Shard(d)`` placements, 2-D HSDP meshes with ``Replicate() x Shard(d)``, optimizers
whose state tensors have their parameter's shape or are scalars (SGD, Adam, AdamW, ...). With ``runtime="ray"``
every shard lineage is a shard run of its job (:func:`~ray_ckpt.engine.shard_layout.shard_run`), tracked by the
job's one coordinator and served by the job's worker and replica hosts of each node
(:mod:`ray_ckpt.runtime.lineages`: O(nodes) actors), and restores go through the shard runs
(:class:`ray_ckpt.runtime.trainer.client.ShardedMemoryTier`). Where calls run: the training process of each rank.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ray_ckpt.engine.dtensor import local
from ray_ckpt.engine.loopstate import RESTORED_STEP_ATTR, apply_loop, check_not_attached, derive_rng
from ray_ckpt.engine.shard_chains import choose_world, load_shard, replay_shard
from ray_ckpt.engine.shard_layout import ShardSpec, chunk_span, saved_ranks
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import ManifestError, NoCheckpointError
from ray_ckpt.storage import ObjectNotFound


log = logging.getLogger("ray_ckpt")


def _overlapping(spec: ShardSpec, saved_world: int) -> list[int]:
    """The saved shards a rank of another world size reads: those overlapping its chunk of any parameter, plus
    its own saved rank (its loop state) or else rank 0 (whose loop state it derives from)."""
    need = {spec.rank if spec.rank < saved_world else 0}
    for shape, dim in zip(spec.shapes, spec.dims):
        need.update(saved_ranks(shape[dim], saved_world, spec.world, spec.rank))
    return sorted(need)


def restore_sharded(storage, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: ShardSpec, *,
                    step: int | None = None, scheduler: Any = None, scaler: Any = None, extra_state: Any = None,
                    fallback: bool = False, restore_rng: bool = True, memory=None) -> int:
    """Restore this rank's shards of ``model``/``optimizer`` (FSDP2) to ``step`` (None = latest step complete on
    every saved rank), from the saved world size that holds it, resharding when it differs from ``spec.world``.
    Returns the step. Training process of each rank; no collectives (every rank decides from storage alone).

    ``memory`` (``runtime="ray"``, see :class:`ray_ckpt.runtime.trainer.client.ShardedMemoryTier`): the shard runs'
    coordinators, which may hold newer steps than storage in their memory tier and replicas; its ``choose`` gives
    ``(world, steps)`` as :func:`~ray_ckpt.engine.shard_chains.choose_world` does, its ``load`` one shard's chain (a
    replica snapshot needs no replay)."""
    check_not_attached(optimizer)
    world, candidates = choose_world(storage, step, strict=not fallback, at_most=fallback) \
        if memory is None else memory.choose(storage, step, fallback=fallback)
    load = load_shard if memory is None else memory.load
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    sources = [spec.rank] if world == spec.world else _overlapping(spec, world)
    for step in candidates:
        try:
            shards = {r: replay_shard(storage, world, r, step, device, load) for r in sources}
            break
        except (CorruptObjectError, ObjectNotFound, ManifestError) as e:
            if not fallback:
                raise
            log.warning("ray_ckpt: step %d of the sharded state cannot be read (%s); falling back to an earlier "
                        "step complete on every rank", step, e)
    else:
        raise NoCheckpointError(f"no step at or before {candidates[0]} of the sharded state under "
                                f"{storage.describe()} can be read on rank {spec.rank}")
    first = shards[sources[0]]
    own = shards.get(spec.rank)   # None when the saved world had no rank of this number
    home = own or first           # buffers and loop state: this rank's own, else rank 0's
    if [tuple(s) for s in first.sharding["shapes"]] != list(spec.shapes) or \
            list(first.sharding["dims"]) != list(spec.dims):
        raise ValueError("the saved sharded state does not match this model: parameter shapes or shard dimensions "
                         "differ (restore into the same model and optimizer layout)")

    def mine(tensors_of, dim: int, length: int) -> torch.Tensor:
        if world == spec.world:
            return tensors_of(shards[spec.rank])
        (a, b), held = chunk_span(length, spec.world, spec.rank), saved_ranks(length, world, spec.world, spec.rank)
        if not held:   # this rank's chunk is empty: any saved shard gives the shape (narrowed to nothing)
            part = tensors_of(first)
            return part.narrow(dim, 0, 0)
        part = torch.cat([tensors_of(shards[r]) for r in held], dim=dim)   # global [start of held[0], ...)
        return part.narrow(dim, a - chunk_span(length, world, held[0])[0], b - a)

    # the model: parameters (their local shards) and buffers (replicated: rank 0's, or this rank's)
    dim_of = {id(p): d for p, d in zip(params, spec.dims)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) not in dim_of:
                raise ValueError(f"model parameter {name!r} is not an optimizer parameter: it cannot be restored "
                                 f"from a sharded checkpoint")
            value = mine(lambda s, n=name: s.model[n], dim_of[id(p)], p.shape[dim_of[id(p)]])
            dst = local(p)
            if tuple(dst.shape) != tuple(value.shape):
                raise ValueError(f"parameter {name!r}: this rank holds a {tuple(dst.shape)} shard, the saved state "
                                 f"gives {tuple(value.shape)} (not torch.chunk placement?)")
            dst.copy_(value)
        for name, b in model.named_buffers():
            if name in home.model:
                b.copy_(home.model[name])
    # the optimizer: every state tensor of a parameter's shape is resharded like it; scalars are rank 0's
    sd_first = first.optimizer
    state: dict = {}
    for i, p in enumerate(params):
        st = sd_first["state"].get(i)
        if st is None:
            continue
        out = {}
        for key, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                value = mine(lambda s, i=i, k=key: s.optimizer["state"][i][k], spec.dims[i],
                             spec.shapes[i][spec.dims[i]])
                if tuple(value.shape) != tuple(local(p).shape):
                    raise ValueError(f"optimizer state {key!r} of parameter {i} has shape {tuple(value.shape)} "
                                     f"where the parameter's shard is {tuple(local(p).shape)}: only state of the "
                                     f"parameter's shape can be resharded")
                out[key] = _as_like(value, p)
            else:
                out[key] = v
        state[i] = out
    optimizer.load_state_dict({"state": state, "param_groups": sd_first["param_groups"]})
    apply_loop(home.loop, optimizer, scheduler=scheduler, scaler=scaler, extra_state=extra_state,
               restore_rng=restore_rng)
    if (own is None or spec.replica) and restore_rng:
        # a rank the saved world did not have, or an HSDP replica > 0 (replica 0 wrote the loop state of its
        # shard): streams of its own, reproducible (for replica 0 the key is the rank, as on a 1-D mesh)
        derive_rng(spec.replica * spec.world + spec.rank)
    setattr(optimizer, RESTORED_STEP_ATTR, step)
    log.info("ray_ckpt: rank %d of %d restored step %d from %d saved shard(s) of world size %d", spec.rank,
             spec.world, step, len(sources), world)
    return step


def _as_like(value: torch.Tensor, p) -> Any:
    """``value`` (a local shard) as a DTensor placed like parameter ``p``."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value.to(local(p).device).contiguous(), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())
