"""Rank agreement: the ranks of a worker group restore one step together, or all of them raise.

Runs in the training process of each rank, collective over ``torch.distributed``'s default process group when
one is initialized with more than one rank; without it (or in a group of one) the same calls run on this rank
alone. Importing this module imports no Ray (the run's coordinator is asked only while ranks agree on a step).

:class:`Collective` is the one place where ranks exchange outcomes, after PyTorch DCP's ``_DistWrapper``: a
function runs on every rank (or on one), the results or errors are exchanged, and when any rank failed every
rank raises the same :class:`RestoreError` naming each failed rank and its error, so a group never trains from
mixed states. :func:`agreed_restore` (replicated state: DDP) and :func:`sharded_agreed_restore` (FSDP2 shards)
use it.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch.distributed as dist

from ray_ckpt.api import restore
from ray_ckpt.engine import rankloop
from ray_ckpt.engine.loopstate import derive_rng
from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage import NoCheckpointError

log = logging.getLogger("ray_ckpt")

#: restores per agreement, the first included: a rank that fell back further than the others (it read a missing
#: or corrupt object) brings every rank to the step it reached, so each round can only lower the step
AGREE_ROUNDS = 3


class RestoreError(RayCkptError, RuntimeError):
    """The ranks of a worker group could not all restore the step they agreed on (raised on every rank)."""


def distributed() -> bool:
    """Whether this process has an initialized ``torch.distributed`` default process group. Any process."""
    return dist.is_available() and dist.is_initialized()


class Collective:
    """The ranks of the default process group, for steps they take together (DCP's ``_DistWrapper``).

    Without a process group, or in a group of one, it is a world of one: the functions run on this rank and
    nothing is exchanged. Every rank makes the same calls in the same order. Training process of each rank.
    Errors read ``rank(s) [1, 3] could not <what>: rank 1: <error>; rank 3: <error>``.
    """

    def __init__(self) -> None:
        grouped = distributed() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if grouped else 0
        self.world = dist.get_world_size() if grouped else 1

    def all_gather(self, what: str, fn: Callable[[], Any]) -> list:
        """Run ``fn`` on every rank; return every rank's result, in rank order (the same list on every rank).
        When ``fn`` raised on any rank, every rank raises :class:`RestoreError` naming each failed rank and its
        error (``what``: what ``fn`` does, as in "restore step 12")."""
        outcome = _attempt(fn)
        outcomes = [outcome]
        if self.world > 1:
            outcomes = [None] * self.world
            dist.all_gather_object(outcomes, outcome)
        failed = {r: error for r, (_, error) in enumerate(outcomes) if error is not None}
        if failed:
            raise RestoreError(f"rank(s) {sorted(failed)} could not {what}: "
                               + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))
        return [value for value, _ in outcomes]

    def broadcast(self, what: str, fn: Callable[[], Any], src: int = 0) -> Any:
        """Run ``fn`` on rank ``src`` only and return its result on every rank; when it raised, every rank
        raises :class:`RestoreError` naming rank ``src`` and its error."""
        box = [_attempt(fn) if self.rank == src else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=src)
        value, error = box[0]
        if error is not None:
            raise RestoreError(f"rank {src} could not {what}: {error}")
        return value


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, "<type>: <message>")`` when ``fn`` raised."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - exchanged with the other ranks, then raised on all
        return None, f"{type(e).__name__}: {e}"


def agreed_restore(storage, model, optimizer, *, scheduler=None, extra_state=None, scaler=None,
                   run: str | None = None, runtime: str = "ray",
                   mark: Callable[[str], Any] | None = None) -> tuple[int, bool]:
    """Restore every rank of the process group to **one** step; returns ``(step, restored)``. Runs in each
    training process (every rank calls it; it is collective when ``torch.distributed`` is initialized).

    World rank 0 resolves the latest recoverable step of the main lineage once; every other rank says up to
    which step it has recorded its own loop state (RNG, extra state; :mod:`ray_ckpt.engine.rankloop`) for that
    generation; the step restored is the smallest of these, the same on every rank (so neither a commit landing
    while the ranks resolve nor a rank whose last records were lost can split the group across steps). Every
    rank restores model, optimizer, scheduler and scaler of that step from the main lineage, then its *own*
    RNG and extra state from its rank lineage; a rank that was not part of the saved world keeps rank 0's extra
    state (then calls ``extra_state.reset_for_new_rank()`` when it has one: the user's hook to adapt it, e.g. to
    a new data shard) and derives its RNG from rank 0's and its rank (:func:`~ray_ckpt.engine.rankloop.
    derive_rng`, logged).
    Every step is exchanged through :class:`Collective`: when any rank failed, every rank raises
    :class:`RestoreError` naming the failed ranks (a group never trains from mixed states). A run without a
    lineage starts from scratch on every rank: ``(0, False)``. Without a process group (or a group of one) this
    is a plain :func:`ray_ckpt.restore` of the latest step. ``runtime`` as in :func:`ray_ckpt.restore`
    (``"local"``: storage only, no Ray needed). ``mark``: called with the name of each phase as it ends
    (``resolve``, ``heads``, ``apply``, ``own_loop``), e.g. a start-up clock's ``mark``."""
    group = Collective()
    mark = mark or (lambda name: None)

    def restore_at(step: int | None) -> int:   # fallback: a missing or corrupt object costs steps, not the run
        return restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state, scaler=scaler,
                       step=step, runtime=runtime, run=run, fallback=True)

    if group.world == 1:
        try:
            return restore_at(None), True
        except NoCheckpointError as e:
            log.info("ray_ckpt: run %r starts from scratch (%s)", run, e)
            return 0, False
    latest = group.broadcast("resolve the step to restore", functools.partial(_latest, storage, run, runtime))
    mark("resolve")
    if isinstance(latest, str):
        log.info("ray_ckpt: run %r starts from scratch (%s)", run, latest)
        return 0, False
    newest, generation = latest
    heads = group.all_gather("read their loop state", lambda: None if group.rank == 0 else
                             rankloop.rank_loop_head(storage, group.rank, generation))
    bound = min([newest, *(h for h in heads if h is not None)])
    step = bound
    if bound < newest:   # every-k recording (the overhead budget): the newest recovery point at or before it
        step, _ = group.broadcast(f"resolve a recovery point at or before step {bound}", functools.partial(
            _point_at_or_before, storage, run, runtime, bound))
    mark("heads")
    lost, why = explain_loss(newest, heads, step, bound)
    if lost:
        log.warning("ray_ckpt: restoring step %d: %d step(s) lost (recomputed now): %s", step, lost, why)
    else:
        log.info("ray_ckpt: restoring step %d: %s", step, why)
    restored = _agree(group, restore_at, group.all_gather(f"restore step {step}", lambda: restore_at(step)))
    mark("apply")
    if restored != step:
        log.error("ray_ckpt: restored step %d instead of %d: objects were missing or corrupt (logged above); "
                  "the steps in between are recomputed", restored, step)
    group.all_gather(f"restore their loop state at step {restored}",
                     lambda: _restore_own_loop(storage, group.rank, generation, restored,
                                               recorded=heads[group.rank] is not None, extra_state=extra_state))
    mark("own_loop")
    return restored, True


def explain_loss(newest: int, heads: list, step: int, bound: int | None = None) -> tuple[int, str]:
    """``(steps lost, why)`` of restoring ``step`` when rank 0's lineage reaches ``newest`` and rank ``r > 0``
    recorded its loop state up to ``heads[r]`` (None: not part of the saved world; ``heads[0]`` is ignored);
    ``bound``: the step every rank recorded (default ``step``), of which ``step`` is the newest recovery point of
    rank 0's lineage at or before it (a full every k steps under the overhead budget).
    The steps lost are counted from the furthest step any rank recorded: the group reached at least that one,
    while a step no rank recorded is unknown here (at most ``handoff_delay`` seconds or ``batch_steps`` steps of
    training are captured but not yet handed off or written). Any process."""
    bound = step if bound is None else bound
    recorded = {0: newest, **{r: h for r, h in enumerate(heads) if r > 0 and h is not None}}
    reached = max(recorded.values())
    lost = reached - step
    behind = sorted(r for r, h in recorded.items() if h == bound)
    if not lost:
        return 0, (f"every rank recorded it and none recorded a later step (work after step {step} that was "
                   f"captured but not yet handed off, at most handoff_delay or batch_steps, is recomputed)")
    ahead = ", ".join(f"rank {r} at {h}" for r, h in sorted(recorded.items()) if h > step)
    causes = []
    for r in behind:
        if r == 0:
            causes.append(f"rank 0's step records end at step {step} (its later records were not yet handed "
                          f"off to the node's persistence worker or storage when the group stopped)")
        else:
            causes.append(f"rank {r} recorded its loop state only up to step {bound} (its later records were not "
                          f"yet written when the group stopped)")
    if step < bound:
        causes.append(f"rank 0's lineage has no recovery point between step {step} and step {bound} (the overhead "
                      f"budget records a full every k steps)")
    return lost, f"the group reached at least step {reached} ({ahead}), but " + "; ".join(causes)


def _latest(storage, run: str | None, runtime: str) -> tuple[int, int] | str:
    """``(step, generation)`` of the latest recoverable step of the main lineage, or why there is none.
    World rank 0."""
    from ray_ckpt.runtime.trainer.client import resolve_step   # imports Ray: only where a group agrees on a step
    try:
        return resolve_step(storage, None, run=run, use_coordinator=runtime == "ray")
    except NoCheckpointError as e:
        return str(e)


def _point_at_or_before(storage, run: str | None, runtime: str, step: int) -> tuple[int, int]:
    """``(step, generation)`` of the newest recoverable step of the main lineage at or before ``step``. World
    rank 0."""
    from ray_ckpt.runtime.trainer.client import resolve_step   # imports Ray: only where a group agrees on a step
    return resolve_step(storage, step, run=run, use_coordinator=runtime == "ray", at_or_before=True)


def _restore_own_loop(storage, rank: int, generation: int, step: int, *, recorded: bool, extra_state) -> None:
    """A rank > 0 installs its own RNG and extra state of ``step`` when it ``recorded`` them in ``generation``;
    otherwise (it was not part of the saved world) it keeps rank 0's extra state (then runs its
    ``reset_for_new_rank()``) and derives its RNG from rank 0's and its rank. Training process."""
    if rank == 0:
        return
    if recorded:
        rankloop.apply_rank_loop(rankloop.load_rank_loop(storage, rank, generation, step), extra_state=extra_state)
        return
    seed = derive_rng(rank)
    hook = getattr(extra_state, "reset_for_new_rank", None)
    if callable(hook):
        hook()
    if rankloop.rank_loop_recorded(storage, rank, generation):   # it was part of the world: its own state is lost
        log.warning("ray_ckpt: rank %d recorded loop state in generation %d, but none that restores step %d: extra "
                    "state is rank 0's%s, RNG derived from rank 0's (seed %d); this rank does NOT continue bit for "
                    "bit as the uninterrupted run", rank, generation, step,
                    " (then reset_for_new_rank())" if callable(hook) else "", seed)
        return
    log.info("ray_ckpt: rank %d has no loop state of its own in generation %d (it was not part of the saved "
             "world): extra state is rank 0's%s, RNG derived from rank 0's (seed %d)", rank, generation,
             " (then reset_for_new_rank())" if callable(hook) else "", seed)


def _agree(group: Collective, restore_at: Callable[[int], int], reached: list[int]) -> int:
    """The step every rank holds, given the step each rank ``reached`` in its first restore: while they differ
    (a rank fell back further: it read a missing or corrupt object), every rank restores the smallest, in at
    most :data:`AGREE_ROUNDS` restores in all. Training process of each rank (collective)."""
    for _ in range(AGREE_ROUNDS - 1):
        if len(set(reached)) == 1:
            break
        target = min(reached)
        reached = group.all_gather(f"restore step {target}", functools.partial(restore_at, target))
    if len(set(reached)) > 1:
        raise RestoreError(f"the ranks could not agree on a step to restore (they reached {sorted(set(reached))})")
    return reached[0]


def sharded_agreed_restore(storage, model, optimizer, *, scheduler=None, extra_state=None,
                           scaler=None, run: str | None = None, runtime: str = "local") -> tuple[int, bool]:
    """:func:`agreed_restore` for sharded (FSDP2) state: each rank restores its shards of the newest step that
    every saved rank holds (:func:`ray_ckpt.engine.sharded.restore_sharded` decides from storage alone, so every
    rank reaches the same decision; with ``runtime="ray"`` from storage and the coordinators of the shard runs of
    ``run``, whose replicas give each shard's state without replay), resharding when the world size changed; the
    ranks then exchange their outcome: a rank that fell back further (a missing or corrupt object of its shards)
    brings every rank to the step it reached; every rank raises :class:`RestoreError` unless all restored one step
    (or all start from scratch). Training process of each rank (collective when ``torch.distributed`` is
    initialized)."""
    group = Collective()

    def restore_at(step: int | None) -> int:   # fallback: a bad object of this rank's shards costs steps
        return restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state,
                       scaler=scaler, runtime=runtime, run=run, step=step, fallback=True)

    def newest() -> int | str:
        try:
            return restore_at(None)
        except NoCheckpointError as e:
            return str(e)   # nothing to restore: a fresh start when it is so on every rank

    first = group.all_gather("restore the newest step of their shards", newest)
    fresh = [o for o in first if isinstance(o, str)]
    if len(fresh) == len(first):
        log.info("ray_ckpt: sharded run starts from scratch (%s)", fresh[0])
        return 0, False
    if fresh:
        raise RestoreError(f"the ranks could not restore one step: {first}")
    step = _agree(group, restore_at, first)
    if len(set(first)) > 1:
        log.error("ray_ckpt: the ranks restored step %d: objects of later steps were missing or corrupt on some "
                  "rank (logged there); the steps in between are recomputed", step)
    return step, True
