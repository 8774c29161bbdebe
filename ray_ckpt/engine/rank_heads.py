"""Where the ranks' loop-state lineages stand (``ranks/<r>/``), for what reads them without recording: a restore
agreeing on a step (:mod:`ray_ckpt.integrations.agreement`) and retention, which keeps the main lineage back to the
newest step every rank recorded — a rank's loop records go out in batches, so after a crash of that rank the group
can only agree on its last written step, and deleting the main lineage's steps up to it would leave the group
nothing to restore. No torch; any process (the coordinator's collector, the writer thread, the CLI).
"""
from __future__ import annotations

from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.lineage import Lineage, Manifest, gc_cutoff
from ray_ckpt.lineage.layout import RANKS_DIR
from ray_ckpt.storage.prefixed import PrefixedStorage

#: the manifest info key naming the main lineage's generation a rank recorded under
MAIN_GENERATION = "main_generation"


def rank_storage(storage, rank: int) -> PrefixedStorage:
    """The view of ``storage`` holding rank ``rank``'s loop-state lineage."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank loop state is kept for ranks >= 1 (rank 0's is in the main lineage), got {rank!r}")
    return PrefixedStorage(storage, f"{RANKS_DIR}{rank}/")


def generation_lineage(storage, rank: int, main_generation: int) -> Lineage:
    """Rank ``rank``'s loop-state manifests recorded under main generation ``main_generation``."""
    lineage, _ = load_lineage(rank_storage(storage, rank), strict=False)
    return Lineage([m for m in lineage.manifests if m.info.get(MAIN_GENERATION) == main_generation])


def rank_loop_head(storage, rank: int, main_generation: int) -> int | None:
    """The last step rank ``rank`` recorded (durably) while attached to main generation ``main_generation``;
    None when it recorded nothing then (it was not part of that world). Any process."""
    return generation_lineage(storage, rank, main_generation).head()


def ranks(storage) -> list[int]:
    """The ranks with a loop-state lineage in ``storage`` (one listing)."""
    out = set()
    for key in storage.list(RANKS_DIR):
        rank = key[len(RANKS_DIR):].split("/", 1)[0]
        if rank.isdigit() and int(rank) >= 1:
            out.add(int(rank))
    return sorted(out)


def group_floor(storage, main_generation: int) -> int | None:
    """The oldest of the ranks' loop-state heads under main generation ``main_generation``: the newest step the
    whole group can restore to when a rank dies now (None: no rank records under it)."""
    heads = [h for h in (rank_loop_head(storage, r, main_generation) for r in ranks(storage)) if h is not None]
    return min(heads) if heads else None


def cutoff_keeping(lineage: Lineage, keep_fulls: int, keep_from: int | None) -> Manifest | None:
    """Retention's cutoff (:func:`ray_ckpt.lineage.gc_cutoff`: the oldest of the ``keep_fulls`` newest fulls),
    moved back to a full at or before ``keep_from`` when it is later (None: as it is)."""
    cutoff, k = gc_cutoff(lineage, keep_fulls), keep_fulls
    while cutoff is not None and keep_from is not None and cutoff.last_step > keep_from:
        k += 1
        cutoff = gc_cutoff(lineage, k)
    return cutoff
