"""Sharded training state (FSDP2): every rank checkpoints its own shard; restores at any world size.

With ``torch.distributed.fsdp.fully_shard`` the parameters are DTensors sharded along one dimension over a 1-D
device mesh (``Shard(d)``; the chunks of ``torch.chunk``), and so are the optimizer's per-parameter state
tensors. Replicated state is the special case of one shard: nothing here is a second engine. Each rank runs the
ordinary LowDiff machinery on its *local* tensors (the capture copies ``to_local()`` views: the gradient shard its
optimizer step consumes, its parameter and optimizer-state shards for fulls) into its own lineage::

    <root>/shards/world-00002.json          marker of a world size (what restores look for)
    <root>/shards/w00002/r00000/...         rank 0's lineage (manifests, objects, lease, index) at world size 2
    <root>/shards/w00002/r00001/...         rank 1's

Every full records the sharding (:func:`sharding_info`: world size, rank, each parameter's global shape and
shard dimension, replicas) in its layout.

**HSDP** (``fully_shard`` on a 2-D (replicate, shard) mesh; placements ``Replicate() x Shard(d)``): ``world`` and
``rank`` are the size of the sharding mesh dimension and this rank's coordinate on it, so the layout is that of a
1-D mesh of ``world`` ranks. Replica 0 of every shard writes it (:attr:`ShardSpec.writes`); the other replicas
hold the same bytes and write nothing (:mod:`ray_ckpt.engine.hsdp`); every rank restores the shard of its shard
coordinate, so any mesh shape restores from any other. Tensor-parallel placements, ``Partial`` and meshes of 3+
dimensions are refused (:func:`mesh_layout`).

**A step is recoverable only when every rank's shard of it is** (:func:`agreed_step`): a restore takes the newest
step that each shard lineage of one world size restores exactly, never mixing steps across ranks. With
``fallback=True`` a step whose objects this rank cannot read (missing, corrupt) is skipped for the next older
complete step; ranks that fell back differently are brought to one step by
:func:`ray_ckpt.integrations.agreement.sharded_agreed_restore` (a restore at the smallest step they reached).

**Restore** (:func:`restore_sharded`, each rank of the new world, no collectives): the shard chains are replayed
on plain tensors of the training device with the same replay code as every restore
(:func:`ray_ckpt.engine.shadow.rebuild` + :func:`ray_ckpt.engine.restore.replay`; on CPU this is bitwise the
FSDP2 optimizer step, element-wise on the same local values). At the saved world size a rank replays its own
shard; at another world size it replays the saved shards that overlap its new chunk of some parameter (plus its
own saved rank, or rank 0, for the loop state), concatenates them and cuts its chunk out (:func:`_span`,
``torch.chunk`` placement; a 2 -> 3 reshard reads 1 or 2 of the 2 saved shards per rank). The result is loaded
into the live DTensors' local shards and the optimizer. Loop state (param groups, scheduler, RNG, extra state) is
the rank's own when the saved world had that rank, else rank 0's with RNG streams derived from it and the rank
(:func:`ray_ckpt.engine.loopstate.derive_rng`).

**Consolidation** (:func:`gather_sharded`, :func:`restore_consolidated`; one process, no process group): an
unsharded model and optimizer restored from the root (``ray_ckpt.restore``), an export of the root and the CLI
read every saved rank's chain of the agreed step in turn, replay it and copy it into its chunk of the global
tensors: bitwise the run's gathered state, loop state rank 0's.

Supported: 1-D meshes with ``Shard(d)`` placements, 2-D HSDP meshes with ``Replicate() x Shard(d)``, optimizers
whose state tensors have their parameter's shape or are scalars (SGD, Adam, AdamW, ...). With ``runtime="ray"``
every shard lineage is a shard run of its job (:func:`shard_run`), tracked by the job's one coordinator and
served by the job's worker and replica hosts of each node (:mod:`ray_ckpt.runtime.lineages`: O(nodes) actors), and
restores go through the shard runs (:class:`ray_ckpt.runtime.trainer.client.ShardedMemoryTier`). Where calls run: the training process of each rank.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from ray_ckpt.engine.dtensor import is_dtensor, local
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.loopstate import RESTORED_STEP_ATTR, apply_loop, check_not_attached, derive_rng
from ray_ckpt.engine.optim_layout import ShadowError
from ray_ckpt.engine.restore import replay, resolve_and_load
from ray_ckpt.engine.shadow import rebuild
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import Lineage, ManifestError, NoCheckpointError
from ray_ckpt.lineage.layout import INDEX_KEY, MANIFESTS_DIR, SHARD_RUN_TAG, SHARDS_DIR
from ray_ckpt.storage import ObjectNotFound
from ray_ckpt.storage.prefixed import PrefixedStorage

log = logging.getLogger("ray_ckpt")

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


def timeline_steps(lineage: Lineage) -> set[int]:
    """Every step :meth:`Lineage.resolve` restores exactly: the newest generation that started at or before a
    step decides it."""
    out: set[int] = set()
    below = None   # the steps at or above this are decided by a newer generation
    for gen in sorted(lineage.generations, reverse=True):
        start = lineage.start_of(gen)
        if start is None:
            continue
        out.update(s for s in lineage.reachable_steps(gen) if s >= start and (below is None or s < below))
        below = start if below is None else min(below, start)
    return out


def common_steps(lineages: list[Lineage]) -> set[int]:
    """The steps that every shard lineage restores exactly."""
    common: set[int] | None = None
    for lin in lineages:
        steps = timeline_steps(lin)
        common = steps if common is None else common & steps
        if not common:
            return set()
    return common or set()


def agreed_step(lineages: list[Lineage], step: int | None) -> int | None:
    """The newest step (``step`` itself when given) that every shard lineage restores exactly; None if none."""
    common = common_steps(lineages)
    if step is not None:
        return step if step in common else None
    return max(common) if common else None


def _shard_lineages(storage, world: int, strict: bool) -> list[Lineage]:
    return [load_lineage(shard_storage(storage, world, r), strict=strict)[0] for r in range(world)]


def choose_world(storage, step: int | None, *, strict: bool = True, at_most: bool = False
                 ) -> tuple[int, list[int]]:
    """``(world, steps)``: the saved world size a restore of ``step`` (None = latest) reads and the steps it may
    restore there, best first: the newest step complete on every rank of one world size (for a tie, the world
    with the newest manifest wins) — or, with ``at_most``, every complete step at or before ``step``, newest
    first (the fallbacks of a restore with ``fallback=True``). Raises NoCheckpointError."""
    best = None
    for world in saved_worlds(storage):
        lins = _shard_lineages(storage, world, strict)
        common = common_steps(lins)
        ok = sorted((s for s in common if step is None or s == step or (at_most and s <= step)), reverse=True)
        if not ok:
            continue
        newest = max((m.created for lin in lins for m in lin.manifests), default=0.0)
        if best is None or (ok[0], newest) > (best[1][0], best[2]):
            best = (world, ok, newest)
    if best is None:
        raise NoCheckpointError(_none_complete(storage, step, strict))
    return best[0], best[1] if at_most else best[1][:1]


def _none_complete(storage, step: int | None, strict: bool) -> str:
    """What a root holds when no saved world size has ``step`` (None: any step) on every rank."""
    what = "any step" if step is None else f"step {step}"
    worlds = saved_worlds(storage)
    if not worlds:
        return (f"no sharded checkpoint under {storage.describe()} holds {what} on every rank (no shard lineages "
                f"there" + ("; it holds an unsharded lineage: restore it into an unsharded model)"
                            if storage.list(MANIFESTS_DIR) else ")"))
    heads = "; ".join(f"world size {w}: latest recoverable step per rank "
                      f"{[lin.head() for lin in _shard_lineages(storage, w, strict)]}" for w in worlds)
    return f"no sharded checkpoint under {storage.describe()} holds {what} on every rank ({heads})"


@dataclass
class _Replayed:
    """One saved shard at the restored step: tensors by state-dict name, optimizer state dict, loop state."""

    model: dict[str, torch.Tensor]
    optimizer: dict
    loop: dict
    sharding: dict
    layout: dict | None = None
    generation: int = 0


def load_shard(storage, world: int, rank: int, step: int):
    """The chain of shard ``rank`` of ``world`` at ``step``, from storage (a LoadedChain). Any process."""
    return resolve_and_load(shard_storage(storage, world, rank), step, fallback=False)


def _replay_shard(storage, world: int, rank: int, step: int, device: torch.device | None, load=load_shard
                  ) -> _Replayed:
    """Shard ``rank`` of ``world`` at ``step``, replayed on ``device`` (None: :func:`replay_device`)."""
    chain = load(storage, world, rank, step)
    if chain.step != step:
        raise NoCheckpointError(f"rank {rank} of world {world} restores step {chain.step}, not {step}")
    layout = chain.full.layout or {}
    sharding = layout.get("sharding")
    if sharding is None or sharding.get("world") != world or sharding.get("rank") != rank:
        raise ShadowError(f"the full of rank {rank} (world {world}) does not describe that shard: {sharding}")
    model, optimizer, _ = rebuild(chain.full, device=replay_device(layout) if device is None else device)
    strategies = {m.strategy for m in chain.plan.diffs}
    loop = replay(strategies.pop() if strategies else "lowdiff", chain.records, model, optimizer,
                  chain.full.step, chain.full.loop)
    return _Replayed(model.state_dict(), optimizer.state_dict(), loop, sharding, layout, chain.plan.generation)


def _span(length: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s chunk of a dimension of ``length`` split over ``world`` ranks as
    ``Shard(d)`` places it (``torch.chunk``: chunks of ``ceil(length / world)``, the last ones shorter or empty)."""
    size = -(-length // world) if length else 0
    start = min(rank * size, length)
    return start, min(start + size, length)


def _saved_ranks(length: int, saved_world: int, world: int, rank: int) -> list[int]:
    """The saved ranks whose chunks overlap rank ``rank``'s chunk at ``world`` (a dimension of ``length``)."""
    a, b = _span(length, world, rank)
    out = []
    for r in range(saved_world):
        lo, hi = _span(length, saved_world, r)
        if lo < b and a < hi:
            out.append(r)
    return out


def _overlapping(spec: ShardSpec, saved_world: int) -> list[int]:
    """The saved shards a rank of another world size reads: those overlapping its chunk of any parameter, plus
    its own saved rank (its loop state) or else rank 0 (whose loop state it derives from)."""
    need = {spec.rank if spec.rank < saved_world else 0}
    for shape, dim in zip(spec.shapes, spec.dims):
        need.update(_saved_ranks(shape[dim], saved_world, spec.world, spec.rank))
    return sorted(need)


def restore_sharded(storage, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: ShardSpec, *,
                    step: int | None = None, scheduler: Any = None, scaler: Any = None, extra_state: Any = None,
                    fallback: bool = False, restore_rng: bool = True, memory=None) -> int:
    """Restore this rank's shards of ``model``/``optimizer`` (FSDP2) to ``step`` (None = latest step complete on
    every saved rank), from the saved world size that holds it, resharding when it differs from ``spec.world``.
    Returns the step. Training process of each rank; no collectives (every rank decides from storage alone).

    ``memory`` (``runtime="ray"``, see :class:`ray_ckpt.runtime.trainer.client.ShardedMemoryTier`): the shard runs'
    coordinators, which may hold newer steps than storage in their memory tier and replicas; its ``choose``
    gives ``(world, steps)`` as :func:`choose_world` does, its ``load`` one shard's chain (a replica snapshot needs
    no replay)."""
    check_not_attached(optimizer)
    world, candidates = choose_world(storage, step, strict=not fallback, at_most=fallback) \
        if memory is None else memory.choose(storage, step, fallback=fallback)
    load = load_shard if memory is None else memory.load
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    sources = [spec.rank] if world == spec.world else _overlapping(spec, world)
    for step in candidates:
        try:
            shards = {r: _replay_shard(storage, world, r, step, device, load) for r in sources}
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
        (a, b), held = _span(length, spec.world, spec.rank), _saved_ranks(length, world, spec.world, spec.rank)
        if not held:   # this rank's chunk is empty: any saved shard gives the shape (narrowed to nothing)
            part = tensors_of(first)
            return part.narrow(dim, 0, 0)
        part = torch.cat([tensors_of(shards[r]) for r in held], dim=dim)   # global [start of held[0], ...)
        return part.narrow(dim, a - _span(length, world, held[0])[0], b - a)

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


# ------------------------------------------------------------------------------------------------------------
# Consolidation: the saved shards of one step gathered into the unsharded state, in one process without a process
# group (a restore into an unsharded model, export, the CLI).

@dataclass
class Gathered:
    """The saved shards of one step gathered into the full (unsharded) training state: what a plain run over the
    same model would hold. ``model``: tensors by state-dict name in their global shapes (tied parameters: one
    tensor under each key; buffers are rank 0's); ``optimizer``: as ``optimizer.state_dict()`` of a plain optimizer
    over the model's parameters (state keyed by parameter index; tensors of a parameter's shape gathered, scalars
    such as Adam's ``step`` rank 0's; param-group values as the loop left them); ``loop``: rank 0's loop state
    (scheduler, scaler, RNG, extra state); ``layout``: rank 0's full layout (optimizer class, parameter names)."""

    step: int
    world: int
    generation: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    loop: dict
    layout: dict


def consolidates(storage) -> list[int]:
    """The saved world sizes when ``storage`` is the root of sharded state and holds no lineage of its own (what
    an unsharded restore or an export of the root then consolidates); ``[]`` otherwise. One listing of the shard
    markers (and, only where there are some, one of the root's manifests). Any process."""
    worlds = saved_worlds(storage)
    if not worlds or storage.list(MANIFESTS_DIR) or storage.exists(INDEX_KEY):
        return []
    return worlds


def shard_of(layout: dict | None) -> dict | None:
    """The sharding a full's layout records (None for unsharded state): ``{"world", "rank", ...}``."""
    return (layout or {}).get("sharding")


_warned_cpu_replay = False   # the warning of a CUDA run replayed on the CPU: once per process


def replay_device(layout: dict | None) -> torch.device:
    """Where a process without the training devices replays a saved shard: on the kind of device the run trained
    on when this process has one (the same kernels as the run: bitwise), else on the CPU (a CUDA run's replayed
    steps may then differ from the run's in the last bits; logged)."""
    global _warned_cpu_replay
    kind = (layout or {}).get("device", "cpu")
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "cuda" and not _warned_cpu_replay:
        _warned_cpu_replay = True
        log.warning("ray_ckpt: the run trained on CUDA and this process has no GPU: its shards are replayed on the "
                    "CPU (fulls are exact; replayed steps may differ from the run's in the last bits)")
    return torch.device("cpu")


def gather_sharded(storage, step: int | None = None, *, fallback: bool = False, device: Any = "cpu",
                   memory=None, progress=None) -> Gathered:
    """The saved shards of ``step`` (None = the newest step complete on every rank of one saved world size) gathered
    into the unsharded state on ``device`` (see :class:`Gathered`), bitwise the run's gathered state. Each saved
    rank's chain is read, verified and replayed in turn (on the device kind the run used, see
    :func:`replay_device`) and copied into its chunk of the global tensors: memory holds the result and one shard.
    With ``fallback`` a step whose objects cannot be read on some rank is skipped for the next older complete step
    (logged). ``memory``: the shard runs of ``runtime="ray"`` as in :func:`restore_sharded`. ``progress(phase,
    done, total)`` is called with phase "gather" after each rank. Calling process; no process group, no
    collectives. Raises NoCheckpointError (saying what the root holds) or ShadowError."""
    if memory is None:
        world, candidates = choose_world(storage, step, strict=not fallback, at_most=fallback)
        load = load_shard
    else:
        world, candidates = memory.choose(storage, step, fallback=fallback)
        load = memory.load
    out = torch.device(device)
    for s in candidates:
        try:
            return _gather_at(storage, world, s, out, load, progress)
        except (CorruptObjectError, ObjectNotFound, ManifestError) as e:
            if not fallback:
                raise
            log.warning("ray_ckpt: step %d of the sharded state cannot be read (%s); falling back to an earlier "
                        "step complete on every rank", s, e)
    raise NoCheckpointError(f"no step at or before {candidates[0]} of the sharded state under "
                            f"{storage.describe()} can be read on every rank")


def _gather_at(storage, world: int, step: int, out: torch.device, load, progress) -> Gathered:
    from types import SimpleNamespace
    from ray_ckpt.engine.loopstate import apply_group_values
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict] = {}
    first = None
    for r in range(world):
        shard = _replay_shard(storage, world, r, step, None, load)
        if first is None:
            first = shard
            layout, gen = shard.layout, shard.generation
            names, shapes, dims = layout["param_names"], shard.sharding["shapes"], shard.sharding["dims"]
            if not (len(names) == len(shapes) == len(dims)):
                raise ShadowError(f"rank 0's full records {len(names)} parameters and a sharding of {len(shapes)}")
            pnames = {n for ns in names for n in ns}
            for k, v in shard.model.items():   # buffers: replicated, rank 0's
                if k not in pnames:
                    model[k] = v.detach().to(out, copy=True)
        elif (shard.sharding["shapes"], shard.sharding["dims"]) != (shapes, dims) or \
                sorted(shard.optimizer["state"]) != sorted(first.optimizer["state"]):
            raise ShadowError(f"rank {r} of world {world} saved another layout than rank 0 at step {step} "
                              f"(parameter shapes, shard dimensions or optimizer state differ)")
        for i, (ns, shape, dim) in enumerate(zip(names, shapes, dims)):
            a, b = _span(shape[dim], world, r)
            _place(model, ns[0], shard.model[ns[0]], shape, dim, a, b, out, f"parameter {ns[0]!r}", r)
            st = shard.optimizer["state"].get(i)
            if st is None:
                continue
            dst = state.setdefault(i, {})
            if r > 0 and set(st) != set(first.optimizer["state"][i]):
                raise ShadowError(f"rank {r} holds optimizer state {sorted(st)} of parameter {i}, rank 0 "
                                  f"{sorted(first.optimizer['state'][i])}")
            for key, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    _place(dst, key, v, shape, dim, a, b, out, f"optimizer state {key!r} of parameter {ns[0]!r} "
                           f"(only state of the parameter's shape can be gathered)", r)
                elif r == 0:
                    dst[key] = v.detach().to(out, copy=True) if torch.is_tensor(v) else v
        if r == 0:
            loop = {k: v for k, v in shard.loop.items() if k != "fingerprint"}
        del shard
        if progress is not None:
            progress("gather", r + 1, world)
    for ns in names:                  # tied parameters: one tensor under every key
        for n in ns[1:]:
            model[n] = model[ns[0]]
    groups = [dict(g) for g in first.optimizer["param_groups"]]
    if "groups" in loop:              # the values the scheduler left, as a plain optimizer's state_dict() has them
        apply_group_values(SimpleNamespace(param_groups=groups), loop["groups"])
    log.info("ray_ckpt: gathered step %d from the %d shard lineages of world size %d under %s", step, world, world,
             storage.describe())
    return Gathered(step=step, world=world, generation=gen, model=model,
                    optimizer={"state": dict(sorted(state.items())), "param_groups": groups}, loop=loop,
                    layout={k: v for k, v in layout.items() if k != "sharding"})


def _place(dst: dict, key, part: torch.Tensor, shape, dim: int, a: int, b: int, out: torch.device, what: str,
           rank: int) -> None:
    """Copy rank ``rank``'s chunk ``part`` (``[a, b)`` of dimension ``dim``) into ``dst[key]``, a tensor of the global
    ``shape`` on ``out`` (allocated by the first rank)."""
    want = list(shape)
    want[dim] = b - a
    if list(part.shape) != want:
        raise ShadowError(f"{what}: rank {rank} saved a {tuple(part.shape)} shard where torch.chunk placement over "
                          f"the saved world gives {tuple(want)}")
    t = dst.get(key)
    if t is None:
        t = dst[key] = torch.empty(tuple(shape), dtype=part.dtype, device=out)
    t.narrow(dim, a, b - a).copy_(part)


def restore_consolidated(storage, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                         step: int | None = None, scheduler: Any = None, scaler: Any = None, extra_state: Any = None,
                         fallback: bool = False, restore_rng: bool = True, memory=None) -> int:
    """Restore an unsharded ``model``/``optimizer`` (plain tensors, any device) from the sharded state under
    ``storage``: the saved shards of ``step`` (None = the newest step complete on every saved rank; ``fallback`` as
    in :func:`restore_sharded`) gathered (:func:`gather_sharded`) and loaded, bitwise the run's gathered state.
    Loop state (scheduler, scaler, extra state, RNG) is rank 0's. Everything is read, replayed and checked against
    the model and optimizer before the first live tensor is written. Returns the step. Calling process (world size
    1 or every rank of any world); no process group needed, no collectives."""
    check_not_attached(optimizer)
    g = gather_sharded(storage, step, fallback=fallback, memory=memory)
    _check_target(g, model, optimizer)
    with torch.no_grad():
        model.load_state_dict(g.model, strict=True)
    optimizer.load_state_dict(g.optimizer)
    apply_loop(g.loop, optimizer, scheduler=scheduler, scaler=scaler, extra_state=extra_state,
               restore_rng=restore_rng)
    setattr(optimizer, RESTORED_STEP_ATTR, g.step)
    log.info("ray_ckpt: consolidated step %d of the %d shard lineages under %s into an unsharded model", g.step,
             g.world, storage.describe())
    return g.step


def _check_target(g: Gathered, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse (ValueError, saying what differs) a model or optimizer that the gathered state does not fit."""
    def fix(msg: str) -> ValueError:
        return ValueError(f"the sharded state of step {g.step} (world size {g.world}) does not fit this "
                          f"{msg}; consolidate into the model the run sharded (the same module before fully_shard) "
                          f"and an optimizer of the same class over model.parameters()")
    cls = type(optimizer)
    saved_cls = g.layout.get("optimizer_class")
    if saved_cls != f"{cls.__module__}:{cls.__qualname__}":
        raise fix(f"optimizer: it was saved from {saved_cls}, this is {cls.__module__}:{cls.__qualname__}")
    sd = model.state_dict()
    missing, extra = sorted(set(g.model) - set(sd)), sorted(set(sd) - set(g.model))
    if missing or extra:
        raise fix(f"model: keys only saved {missing[:4]}, keys only in the model {extra[:4]}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(g.model[k].shape):
            raise fix(f"model: {k!r} is {tuple(v.shape)} here, {tuple(g.model[k].shape)} in the checkpoint")
    names_of: dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), set()).add(name)
    params = [p for grp in optimizer.param_groups for p in grp["params"]]
    saved = g.layout["param_names"]
    sizes = [len(grp["params"]) for grp in optimizer.param_groups]
    if sizes != [len(grp["params"]) for grp in g.optimizer["param_groups"]]:
        raise fix(f"optimizer: its param groups hold {sizes} parameters, the saved ones "
                  f"{[len(grp['params']) for grp in g.optimizer['param_groups']]}")
    for i, (p, names) in enumerate(zip(params, saved)):
        if names_of.get(id(p)) != set(names):
            raise fix(f"optimizer: its parameter {i} is {sorted(names_of.get(id(p), {'not a model parameter'}))}, "
                      f"the saved one {names}")


def collect_sharded(storage, keep_fulls: int, *, dry_run: bool = False, progress=None) -> list[tuple]:
    """Garbage collection of every shard lineage under ``storage``: ``[(world, rank, shard storage, GcResult)]``.
    Each rank keeps its ``keep_fulls`` newest fulls, and no rank collects a step that another rank of its world
    still keeps or that the newest step complete on every rank needs: the cutoff step of a world is the oldest of
    its ranks' own cutoffs and of the fulls their plans of that step start from, and each rank keeps every step
    from there on (so every step complete on every rank from it on stays complete). Calling process (CLI)."""
    from ray_ckpt.engine import gc as gc_
    from ray_ckpt.lineage import gc_cutoff
    out = []
    for world in saved_worlds(storage):
        lins = _shard_lineages(storage, world, strict=False)
        latest = agreed_step(lins, None)
        keep_from = None
        for lin in lins:
            own = gc_cutoff(lin, keep_fulls)
            if own is None:   # a rank with no more fulls than kept: only abandoned branches go (on every rank)
                keep_from = -1
                break
            low = own.last_step if latest is None else min(own.last_step, lin.resolve(latest).full.last_step)
            keep_from = low if keep_from is None else min(keep_from, low)
        for r in range(world):
            st = shard_storage(storage, world, r)
            res = gc_.collect(st, keep_fulls, dry_run=dry_run, progress=progress, keep_from=keep_from)
            out.append((world, r, st, res))
    return out
