"""The shard lineages of a sharded root read together: the steps every saved rank of one world size restores
exactly (:func:`agreed_step`; a restore never mixes steps across ranks), the saved world a restore reads
(:func:`choose_world`), the garbage collection that keeps those steps complete (:func:`collect_sharded`), and one
saved shard's chain loaded and replayed at such a step (:func:`replay_shard`), which both a sharded restore
(:mod:`ray_ckpt.engine.sharded`) and consolidation (:mod:`ray_ckpt.engine.consolidate`) build on. Any process that
reads a root: the training process of each rank, the calling process of a consolidation, export or the CLI.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.optim_layout import ShadowError
from ray_ckpt.engine.restore import replay, resolve_and_load
from ray_ckpt.engine.shadow import rebuild
from ray_ckpt.engine.shard_layout import saved_worlds, shard_storage
from ray_ckpt.lineage import Lineage, NoCheckpointError
from ray_ckpt.lineage.layout import MANIFESTS_DIR

log = logging.getLogger("ray_ckpt")


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


def shard_lineages(storage, world: int, strict: bool) -> list[Lineage]:
    return [load_lineage(shard_storage(storage, world, r), strict=strict)[0] for r in range(world)]


def choose_world(storage, step: int | None, *, strict: bool = True, at_most: bool = False
                 ) -> tuple[int, list[int]]:
    """``(world, steps)``: the saved world size a restore of ``step`` (None = latest) reads and the steps it may
    restore there, best first: the newest step complete on every rank of one world size (for a tie, the world
    with the newest manifest wins) — or, with ``at_most``, every complete step at or before ``step``, newest
    first (the fallbacks of a restore with ``fallback=True``). Raises NoCheckpointError."""
    best = None
    for world in saved_worlds(storage):
        lins = shard_lineages(storage, world, strict)
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
                      f"{[lin.head() for lin in shard_lineages(storage, w, strict)]}" for w in worlds)
    return f"no sharded checkpoint under {storage.describe()} holds {what} on every rank ({heads})"


@dataclass
class ReplayedShard:
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


def replay_shard(storage, world: int, rank: int, step: int, device: torch.device | None, load=load_shard
                  ) -> ReplayedShard:
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
    return ReplayedShard(model.state_dict(), optimizer.state_dict(), loop, sharding, layout, chain.plan.generation)


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
        lins = shard_lineages(storage, world, strict=False)
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
