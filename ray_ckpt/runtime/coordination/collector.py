"""GarbageCollector: retention for a run's lineage — chains older than the ``keep_fulls`` newest durable fulls are
deleted from storage and the memory tier, with the ranks' loop-state lineages and the Amber tier by the same rule.

Call order: :meth:`GarbageCollector.gc` at a durable full (``keep_fulls > 0``) or when asked (``gc`` of the
coordinator); :meth:`GarbageCollector.collected_already` for each object reported durable, before it is added.
Runs in the coordinator actor's thread; no Ray: telling the holders to let objects go is a callable the
coordinator passes in, tests pass a stand-in.
"""
from __future__ import annotations

import logging
from typing import Callable

from ray_ckpt.engine import rank_heads
from ray_ckpt.lineage import Manifest, collectable, gc_cutoff, retention
from ray_ckpt.runtime.coordination.state import LineageState

log = logging.getLogger("ray_ckpt")


class GarbageCollector:
    """Collects ``state``'s lineage on ``state.run.storage``. ``release(nodes, names)`` tells the workers on
    ``nodes`` to let ``names`` go. Coordinator actor thread."""

    def __init__(self, state: LineageState, release: Callable[[list, list], None]):
        self.state = state
        self.release = release
        self.floor: tuple[int, int] | None = None   # (generation, step) of the last GC's oldest kept full

    def gc(self, keep_fulls: int = 2) -> list[str]:
        """Delete chains older than the ``keep_fulls`` newest full checkpoints of the current timeline, from
        storage and from the memory tier. Returns the deleted object names."""
        state, storage = self.state, self.state.run.storage
        lin = state.lineage(durable_only=True)  # only durable fulls count as kept
        cutoff = gc_cutoff(lin, keep_fulls)
        if cutoff is not None and lin.generations:   # back to the newest step every rank's loop state reaches
            cutoff = rank_heads.cutoff_keeping(lin, keep_fulls, rank_heads.group_floor(storage, lin.generations[-1]))
        if cutoff is not None:
            self.floor = (cutoff.generation, cutoff.last_step)
        doomed = [e for e in state.entries.values() if collectable(lin, e.manifest, cutoff)]
        if not doomed:
            return []
        # what is removed, before it goes (a restore of those steps says retention removed them)
        retention.note(storage, keep_fulls, cutoff, [e.manifest for e in doomed])
        deleted = []
        for e in doomed:
            m = e.manifest
            if e.durable:
                storage.delete(m.key)      # manifest first: the object is uncommitted from here on
                storage.delete(m.object)
            for node in list(e.holders):
                self.release([node], [m.name])
            del state.entries[m.name]
            deleted.append(m.name)
        self._collect_others(lin, cutoff)
        return deleted

    def _collect_others(self, lin, cutoff) -> None:
        """The ranks' loop-state lineages (``ranks/<r>/``) and the Amber tier (``tiers/amber/``) by the same
        rule as the lineage; a failure is logged and retried at the next full."""
        try:
            # imported here: they bring torch, which the coordinator needs for nothing else (a faster, leaner
            # actor start)
            from ray_ckpt.engine import amber_tier
            from ray_ckpt.engine import gc as _gc
            _gc.collect_ranks(self.state.run.storage, lin, cutoff)
            amber_tier.collect(self.state.run.storage, lin, cutoff)
        except Exception as e:  # noqa: BLE001 - retried at the next full
            log.warning("ray_ckpt coordinator: could not collect per-rank loop state or the Amber tier: %s", e)

    def stale(self, m: Manifest) -> bool:
        """Whether ``m`` only serves steps GC already collected: before the oldest full the last GC kept, in the
        generation it ran on, while that is still the newest (a newer one may branch anywhere: the next GC decides).
        Such an object reported held or durable after that GC (its hand-off, peer copy or write was in flight
        then) is let go instead of being added back: a restore of its steps would otherwise still find it in
        memory after retention said they were removed, and its holders would keep it."""
        floor = self.floor
        return (floor is not None and m.generation == floor[0] and self.state.last_generation == floor[0]
                and m.last_step < floor[1])

    def collected_already(self, m: Manifest) -> bool:
        """An object committed after GC dropped its steps (:meth:`stale`): delete it now, or it would stay on
        storage until the next full's GC, forever at a run's end. Returns whether ``m`` was deleted (then it is
        not added to the state)."""
        if not self.stale(m):
            return False
        storage = self.state.run.storage
        try:
            storage.delete(m.key)      # manifest first, as in gc
            storage.delete(m.object)
        except Exception as e:  # noqa: BLE001 - kept as an entry: the next GC deletes it
            log.warning("ray_ckpt coordinator: could not delete %s, written after GC collected its steps: %s",
                        m.name, e)
            return False
        log.info("ray_ckpt coordinator: deleted %s, written after GC collected its steps", m.name)
        return True
