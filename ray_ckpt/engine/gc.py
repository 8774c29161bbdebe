"""Offline garbage collection of a lineage on storage: keep the ``keep_fulls`` newest full checkpoints and every
object a step at or after the oldest of them needs; delete the rest (manifest first, so an object is
uncommitted before it goes), including the per-rank loop-state lineages below ``ranks/<r>/``.

The selection is the coordinator's (:func:`ray_ckpt.lineage.gc_cutoff` / :func:`~ray_ckpt.lineage.collectable`),
so ``ray-ckpt gc`` and ``keep_fulls`` of a running job agree. Safe next to a running writer: only chains
older than the kept fulls are touched, and new objects are always newer than the newest full. The lineage
index is rewritten without the deleted manifests (readers that still see a stale one relist).

Runs in the calling process (CLI, tests); no Ray.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from ray_ckpt.engine.rankloop import RANKS_DIR, rank_storage
from ray_ckpt.engine.restore import load_lineage
from ray_ckpt.lineage import Manifest, collectable, gc_cutoff
from ray_ckpt.lineage import index as lineage_index
from ray_ckpt.storage import ObjectNotFound

log = logging.getLogger("ray_ckpt")


@dataclass
class GcResult:
    """What a collection deleted (or would delete, with ``dry_run``)."""

    kept_from_step: int | None                           #: the oldest kept full's step; None: nothing to do
    deleted: list[Manifest] = field(default_factory=list)  #: main lineage
    rank_deleted: dict[int, list[Manifest]] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.deleted) + sum(m.nbytes for ms in self.rank_deleted.values() for m in ms)

    @property
    def count(self) -> int:
        return len(self.deleted) + sum(len(ms) for ms in self.rank_deleted.values())


def collect(storage, keep_fulls: int, *, dry_run: bool = False,
            progress: Callable[[int, int], None] | None = None) -> GcResult:
    """Delete what only serves steps before the ``keep_fulls`` newest fulls (see the module docstring)."""
    lineage, _ = load_lineage(storage, strict=False, use_index=False)
    cutoff = gc_cutoff(lineage, keep_fulls)
    doomed = [m for m in lineage.manifests if collectable(lineage, m, cutoff)]
    if not doomed:
        return GcResult(None, dry_run=dry_run)
    out = GcResult(cutoff.last_step if cutoff is not None else None, doomed, dry_run=dry_run)
    ranks = {}
    for key in storage.list(RANKS_DIR):
        rank = key[len(RANKS_DIR):].split("/", 1)[0]
        if rank.isdigit():
            ranks.setdefault(int(rank), None)
    for r in sorted(ranks):
        rs = rank_storage(storage, r)
        rl, _ = load_lineage(rs, strict=False, use_index=False)
        # a rank lineage shares the main lineage's generations: the main lineage's timeline decides
        doomed = [m for m in rl.manifests if collectable(lineage, m, cutoff)]
        if doomed:
            out.rank_deleted[r] = doomed
            ranks[r] = (rs, rl)
    if dry_run:
        return out
    jobs = [(storage, m) for m in out.deleted] + [(ranks[r][0], m) for r, ms in out.rank_deleted.items() for m in ms]
    for i, (st, m) in enumerate(jobs, 1):
        lineage_index.delete_committed(st, [m], missing=(ObjectNotFound,))   # manifest first: uncommitted before the object goes
        if progress is not None:
            progress(i, len(jobs))
    _reindex(storage, lineage, out.deleted)
    for r, ms in out.rank_deleted.items():
        _reindex(*ranks[r], ms)
    log.info("ray_ckpt: gc of %s kept fulls from step %d, deleted %d objects", storage.describe(),
             cutoff.last_step, out.count)
    return out


def _reindex(storage, lineage, deleted: list[Manifest]) -> None:
    """Rewrite an existing lineage index without the deleted manifests."""
    if not storage.exists(lineage_index.INDEX_KEY):
        return
    gone = {m.name for m in deleted}
    lineage_index.write_index(storage, [m for m in lineage.manifests if m.name not in gone])
