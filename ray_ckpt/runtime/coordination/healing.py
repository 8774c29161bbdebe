"""Healing: what a run's coordinator does when steps go missing — gaps, full checkpoints asked of the trainer,
workers that restarted and nodes that died.

* the steps of the current generation must form an unbroken sequence: a step that no object covers and no
  hand-off in flight brings, for longer than a grace period, is a **gap** (:class:`~ray_ckpt.runtime.gaps.GapWatch`
  decides) — logged as a WARNING naming the steps and closed by asking the trainer for a full checkpoint at its
  next step (:meth:`Healing.take_want_full`, from the coordinator's ``control``);
* a worker that restarts (or a node that dies) loses what it held; what it received that a peer still holds is
  persisted by the peer at once (:meth:`Healing.heal`), and the training process's sender resends what no other
  node held (it keeps every chunk until it is safe).

Runs in the coordinator actor's thread; no Ray: the cluster's calls (alive nodes, asking peers to persist) come
from the object passed as ``cluster`` (:class:`~ray_ckpt.runtime.coordination.cluster.RayCluster`; tests pass a
stand-in with ``alive(max_age)`` and ``persist_origin(lost)``).
"""
from __future__ import annotations

import logging
import time

from ray_ckpt.runtime.coordination import state as _state
from ray_ckpt.runtime.coordination.state import LineageState
from ray_ckpt.runtime.gaps import GapWatch

log = logging.getLogger("ray_ckpt")


class Healing:
    """Gaps, asked fulls and lost nodes of one run's lineage (``state``). Coordinator actor thread."""

    def __init__(self, run: str, state: LineageState, cluster):
        self.run = run
        self.state = state
        self.cluster = cluster
        self.gap_watch = GapWatch()   # holes, hand-offs in flight, declared gaps (see check_gaps)
        self.want_full: set[int] = set()   # generations whose trainer must take a full now

    # -- gaps and fulls ----------------------------------------------------------------------------------------------
    def check_gaps(self, force: bool = False) -> None:
        """Declare lost the steps of the current generation that no object covers and no hand-off in flight to
        a live node brings, past the grace period: logged, kept in :attr:`gap_watch` (the coordinator's status
        shows them), told to the trainer with a full asked of it. Checks at most as often as ``GapWatch.due``
        allows; before declaring, storage is read once more (commits whose reports a dead worker never sent)."""
        watch, now = self.gap_watch, time.monotonic()
        if not watch.due(now, force, _state.COST_FACTOR):
            return
        cpu0 = time.thread_time()
        gen = self.state.last_generation
        holes = self.state.of_generation(gen).uncovered_steps(gen)
        watch.cost = time.thread_time() - cpu0
        floor = self.state.durable_floor(gen)
        if floor is not None:
            holes = [s for s in holes if s > floor]
        new = watch.overdue(gen, holes, now, self.cluster.alive(1.0) if watch.arriving() else None)
        if not new:
            return
        if not force:   # before calling it a gap: commits whose reports a dead worker never sent
            self.state.refresh_durable()
            self.check_gaps(force=True)
            return
        for first, last in watch.declare(gen, new, time.time()):
            log.warning("ray_ckpt coordinator: run %r lost steps %d..%d of generation %d (held nowhere, not "
                        "durable, none in flight): they cannot be restored; asking the trainer for a full "
                        "checkpoint now", self.run, first, last, gen)
        self.want_full.add(gen)

    def request_full(self, generation: int, reason: str) -> None:
        """Ask the trainer of ``generation`` for a full at its next step (e.g. the replica restarted)."""
        log.info("ray_ckpt coordinator: full checkpoint requested: %s", reason)
        self.want_full.add(generation)

    def take_want_full(self, generation: int) -> bool:
        """Whether the trainer of ``generation`` must take a full now (consumed: asked once)."""
        want = generation in self.want_full
        self.want_full.discard(generation)
        return want

    # -- lost workers and nodes --------------------------------------------------------------------------------------
    def drop_node(self, node: str) -> list[str]:
        """Forget what ``node`` held and was receiving; returns names now neither durable nor held anywhere."""
        self.gap_watch.node_reset(node)
        return self.state.drop_node(node)

    def worker_started(self, node: str, fresh: bool = False) -> None:
        """A (re)started worker holds nothing: forget its old object references, persist what only a peer
        still holds of what it had received. ``fresh``: the worker's first incarnation — when no object known
        here was held by or received on that node either, there is nothing to heal and no report it could have
        lost (the storage listing is not read again: a wide job's start would re-read it once per node)."""
        known = self.state.known_on(node)
        self.drop_node(node)
        if fresh and not known:
            return
        self.state.refresh_durable()
        self.heal(node)

    def heal(self, lost: str) -> None:
        """Objects received by ``lost`` that are not durable and still held by a live peer: the peer writes
        them to storage now (the sender resends what no peer held).

        Asked of every live node's worker (:meth:`PersistenceWorker.persist_origin`), not only of the holders
        this coordinator knows: a peer reports a replica it holds within one report interval, and ``lost``'s
        sender may have dropped the chunk as safe (held on two nodes) before that report arrived — so the peer
        decides from what it holds, never from this possibly older view."""
        for node in self.cluster.persist_origin(lost):
            log.info("ray_ckpt coordinator: node %s persists what it holds of lost node %s", node[:8], lost[:8])

    def forget_dead_nodes(self) -> None:
        """Every node holding known objects that is no longer alive: dropped, and healed."""
        for node in self.state.dead_holders(self.cluster.alive()):
            self.drop_node(node)
            self.heal(node)
