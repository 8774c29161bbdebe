"""Offline garbage collection of a lineage on storage: keep the ``keep_fulls`` newest full checkpoints and every
object a step at or after the oldest of them needs; delete the rest (manifest first, so an object is
uncommitted before it goes), including the per-rank loop-state lineages below ``ranks/<r>/`` and the Amber tier's
increments below ``tiers/amber/`` (:mod:`ray_ckpt.engine.amber_tier`).

The selection is the coordinator's (:func:`ray_ckpt.lineage.gc_cutoff` / :func:`~ray_ckpt.lineage.collectable`),
so ``ray-ckpt gc`` and ``keep_fulls`` of a running job agree. Safe next to a running writer: only chains
older than the kept fulls are touched, and new objects are always newer than the newest full. The lineage
index is rewritten without the deleted manifests (readers that still see a stale one relist), and the lineage's
retention record (:mod:`ray_ckpt.lineage.retention`) says which steps were removed, written before they go.

Runs in the calling process (CLI, tests); no Ray.
"""
from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Callable

from ray_ckpt.engine import amber_tier
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine import rank_heads
from ray_ckpt.engine.rank_heads import MAIN_GENERATION, rank_storage
from ray_ckpt.lineage import Manifest, collectable
from ray_ckpt.lineage.layout import INDEX_KEY, OBJECTS_DIR, OBJECT_SUFFIX, RANKS_DIR, parse_name
from ray_ckpt.lineage import index as lineage_index
from ray_ckpt.lineage import retention
from ray_ckpt.storage import ObjectNotFound

log = logging.getLogger("ray_ckpt")


@dataclass
class GcResult:
    """What a collection deleted (or would delete, with ``dry_run``)."""

    kept_from_step: int | None                           #: the oldest kept full's step; None: nothing to do
    deleted: list[Manifest] = field(default_factory=list)  #: main lineage
    rank_deleted: dict[int, list[Manifest]] = field(default_factory=dict)
    tier_deleted: list[Manifest] = field(default_factory=list)  #: the Amber tier (``tiers/amber/``)
    dry_run: bool = False
    orphans: list[str] = field(default_factory=list)   #: object keys without a manifest (interrupted collection)

    @property
    def nbytes(self) -> int:
        return (sum(m.nbytes for m in self.deleted) + sum(m.nbytes for ms in self.rank_deleted.values() for m in ms)
                + sum(m.nbytes for m in self.tier_deleted))

    @property
    def count(self) -> int:
        return (len(self.deleted) + sum(len(ms) for ms in self.rank_deleted.values()) + len(self.orphans)
                + len(self.tier_deleted))


def collect(storage, keep_fulls: int, *, dry_run: bool = False,
            progress: Callable[[int, int], None] | None = None, keep_from: int | None = None) -> GcResult:
    """Delete what only serves steps before the ``keep_fulls`` newest fulls (see the module docstring); with
    ``keep_from``, also keep every step from ``keep_from`` on (the cutoff is then the newest full at or before it:
    the shard lineages of sharded state keep what a step complete on every rank needs)."""
    lineage, _ = load_lineage(storage, strict=False, use_index=False)
    floor = rank_heads.group_floor(storage, lineage.generations[-1]) if lineage.manifests else None
    if floor is not None:   # what the ranks' loop state allows the group to restore is kept
        keep_from = floor if keep_from is None else min(keep_from, floor)
    cutoff = rank_heads.cutoff_keeping(lineage, keep_fulls, keep_from)
    out = GcResult(cutoff.last_step if cutoff is not None else None,
                   [m for m in lineage.manifests if collectable(lineage, m, cutoff)], dry_run=dry_run)
    ranks = rank_garbage(storage, lineage, cutoff)
    out.rank_deleted = {r: doomed for r, (_, _, doomed) in ranks.items()}
    out.orphans = _orphans(storage, lineage, cutoff)
    out.tier_deleted = amber_tier.garbage(storage, lineage, cutoff)
    if dry_run or (out.count == 0 and not out.orphans):
        return out
    # what is removed, before it goes (a restore of those steps says retention removed them)
    retention.note(storage, keep_fulls, cutoff, out.deleted, by=retention.BY_CLI)
    tier = amber_tier.tier_storage(storage)
    jobs = ([(tier, m) for m in out.tier_deleted] + [(storage, m) for m in out.deleted]
            + [(ranks[r][0], m) for r, ms in out.rank_deleted.items() for m in ms])
    for i, (st, m) in enumerate(jobs, 1):
        # manifest first: uncommitted before the object goes
        lineage_index.delete_committed(st, [m], missing=(ObjectNotFound,))
        if progress is not None:
            progress(i, len(jobs))
    for key in out.orphans:   # objects whose manifest an interrupted collection already deleted
        try:
            storage.delete(key)
        except ObjectNotFound:
            pass
    _reindex(storage, lineage, out.deleted)
    for rs, rl, doomed in ranks.values():
        _reindex(rs, rl, doomed)
    log.info("ray_ckpt: gc of %s (keep_fulls=%d) deleted %d objects", storage.describe(), keep_fulls, out.count)
    return out


def _orphans(storage, lineage, cutoff) -> list[str]:
    """Object keys without a manifest whose name (generation, steps) is collectable: left by a collection that
    was killed between deleting a manifest and its object. Only below a real cutoff (more fulls than kept):
    an object a live writer has written but not yet committed is newer than the kept fulls, never touched."""
    if cutoff is None:
        return []
    named = {m.object for m in lineage.manifests}
    out = []
    for key in storage.list(OBJECTS_DIR):
        if key in named or not key.endswith(OBJECT_SUFFIX):
            continue
        parsed = parse_name(key[len(OBJECTS_DIR):-len(OBJECT_SUFFIX)])
        if parsed is None:
            continue
        gen, kind, first, last = parsed
        if collectable(lineage, SimpleNamespace(generation=gen, kind=kind, first_step=first, last_step=last), cutoff):
            out.append(key)
    return out


def rank_garbage(storage, lineage, cutoff) -> dict[int, tuple]:
    """Per rank: ``(rank storage, rank lineage, collectable manifests)`` of the per-rank loop-state lineages.
    A manifest goes when the main lineage no longer needs its steps (judged by the main timeline and ``cutoff``,
    as of the main generation it names) *and* the rank's own chains of the kept steps do not read it: a rank
    takes its loop-state fulls on a schedule of its own (every ``full_every`` steps), sparser than the main
    lineage's fulls can be (the overhead budget's every-k mode, the replica's fulls), so its full at or before the
    main cutoff stays with the records after it."""
    out = {}
    ranks = set()
    for key in storage.list(RANKS_DIR):
        rank = key[len(RANKS_DIR):].split("/", 1)[0]
        if rank.isdigit():
            ranks.add(int(rank))
    for r in sorted(ranks):
        rs = rank_storage(storage, r)
        rl, _ = load_lineage(rs, strict=False, use_index=False)
        own = _rank_cutoff(rl, cutoff)
        doomed = [m for m in rl.manifests if _rank_collectable(lineage, m, cutoff) and collectable(rl, m, own)]
        if doomed:
            out[r] = (rs, rl, doomed)
    return out


def _rank_cutoff(rank_lineage, cutoff) -> Manifest | None:
    """The rank's newest full on its own current timeline at or before the main ``cutoff``'s step: the base of the
    rank's chain for the oldest step the main lineage keeps (None: no such full, or no cutoff)."""
    if cutoff is None:
        return None
    fulls = [m for m in rank_lineage.manifests if m.kind == "full" and m.last_step <= cutoff.last_step
             and (rank_lineage.timeline_cap(m.generation) is None
                  or m.last_step <= rank_lineage.timeline_cap(m.generation))]
    return max(fulls, key=lambda m: (m.last_step, m.generation), default=None)


def _rank_collectable(lineage, m: Manifest, cutoff) -> bool:
    """A rank's generations are its own; each of its manifests names the main generation it recorded for
    (``main_generation``): judged as a manifest of that generation. One without it is kept."""
    main_gen = m.info.get(MAIN_GENERATION) if isinstance(m.info, dict) else None
    if not isinstance(main_gen, int) or isinstance(main_gen, bool):
        return False
    return collectable(lineage, dataclasses.replace(m, generation=main_gen), cutoff)


def collect_ranks(storage, lineage, cutoff) -> int:
    """Delete the per-rank loop state that ``cutoff`` makes collectable (the coordinator's ``keep_fulls``).
    Returns the number of objects deleted."""
    n = 0
    for rs, rl, doomed in rank_garbage(storage, lineage, cutoff).values():
        lineage_index.delete_committed(rs, doomed, missing=(ObjectNotFound,))
        _reindex(rs, rl, doomed)
        n += len(doomed)
    return n


def _reindex(storage, lineage, deleted: list[Manifest]) -> None:
    """Rewrite an existing lineage index without the deleted manifests."""
    if not storage.exists(INDEX_KEY):
        return
    gone = {m.name for m in deleted}
    lineage_index.write_index(storage, [m for m in lineage.manifests if m.name not in gone])
