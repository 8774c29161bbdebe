"""Consolidation: the saved shards of one step gathered into the unsharded training state, in one process without
a process group (:func:`gather_sharded`), and loaded into an unsharded model and optimizer
(:func:`restore_consolidated`). ``ray_ckpt.restore`` of a sharded root into a plain model, an export of the root
(:mod:`ray_ckpt.engine.export`) and the CLI read every saved rank's chain of the agreed step in turn, replay it and
copy it into its chunk of the global tensors: bitwise the run's gathered state, loop state rank 0's. Runs in the
calling process (world size 1, or every rank of any world); no collectives.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ray_ckpt.engine.loopstate import RESTORED_STEP_ATTR, apply_group_values, apply_loop, check_not_attached
from ray_ckpt.engine.optim_layout import ShadowError
from ray_ckpt.engine.shard_chains import choose_world, load_shard, replay_shard
from ray_ckpt.engine.shard_layout import chunk_span, saved_worlds
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import ManifestError, NoCheckpointError
from ray_ckpt.lineage.layout import INDEX_KEY, MANIFESTS_DIR
from ray_ckpt.storage import ObjectNotFound

log = logging.getLogger("ray_ckpt")


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


def gather_sharded(storage, step: int | None = None, *, fallback: bool = False, device: Any = "cpu",
                   memory=None, progress=None) -> Gathered:
    """The saved shards of ``step`` (None = the newest step complete on every rank of one saved world size) gathered
    into the unsharded state on ``device`` (see :class:`Gathered`), bitwise the run's gathered state. Each saved
    rank's chain is read, verified and replayed in turn (on the device kind the run used, see
    :func:`~ray_ckpt.engine.shard_chains.replay_device`) and copied into its chunk of the global tensors: memory
    holds the result and one shard. With ``fallback`` a step whose objects cannot be read on some rank is skipped
    for the next older complete step (logged). ``memory``: the shard runs of ``runtime="ray"`` as in
    :func:`~ray_ckpt.engine.sharded.restore_sharded`. ``progress(phase, done, total)`` is called with phase "gather"
    after each rank. Calling process; no process group, no collectives. Raises NoCheckpointError (saying what the
    root holds) or ShadowError."""
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
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict] = {}
    first = None
    for r in range(world):
        shard = replay_shard(storage, world, r, step, None, load)
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
            a, b = chunk_span(shape[dim], world, r)
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
    in :func:`~ray_ckpt.engine.sharded.restore_sharded`) gathered (:func:`gather_sharded`) and loaded, bitwise the
    run's gathered state. Loop state (scheduler, scaler, extra state, RNG) is rank 0's. Everything is read, replayed
    and checked against the model and optimizer before the first live tensor is written. Returns the step. Calling
    process (world size 1 or every rank of any world); no process group needed, no collectives."""
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
