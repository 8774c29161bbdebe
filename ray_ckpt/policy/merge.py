"""When to merge a chain of increments into one, and when a new full checkpoint is cheaper than a longer chain.

Pure: a :class:`ChainContext` in, a :class:`ChainDecision` out; the caller (Amber's capture, on the training
thread, once per closed diff object) carries it out. O(1), no torch.

Cost model. After a full ``F`` the chain holds per-step diff objects; a *merged* increment ``M`` is one atomic
object holding every element written since the full (latest value per element), so the latest step is
recovered from ``F + M`` (+ the objects written after ``M``). Recovery reads ``F + M_last + C`` bytes, where
``M_last`` is the latest merged increment and ``C`` the diff objects after it.

* **new full** when the merged increment would be at least ``full_ratio·F``: writing ``F`` instead costs at
  most ``1/full_ratio`` times the merge, makes recovery read one object, and restarts the chain so every later
  merged increment is small again (with Amber the full costs the training thread nothing extra: the step's
  snapshot copy is reused).
* **merge** when ``C`` spans ``merge_after`` objects, or at least two objects whose bytes
  (``M_last + C``) exceed ``merge_gain·M``: then most of the chain is overwritten elements and the merged
  increment is the cheaper read. A merge needs at least two objects since the full (one object already is a
  one-object chain).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ChainContext:
    step: int                 #: the step whose diff object was just closed
    full_bytes: int           #: bytes of the latest full checkpoint
    merged_bytes: int         #: bytes a merged increment (full+1 .. now) would have (estimate; 0 = unknown)
    chain_objects: int        #: diff objects after the latest merged increment (or the full), this one included
    chain_bytes: int          #: their bytes (those already encoded)
    merged_objects: int       #: merged increments written since the full
    last_merged_bytes: int    #: bytes of the latest merged increment (0 when none)


@dataclass(frozen=True)
class ChainDecision:
    merge: bool               #: write a merged increment covering full+1 .. step
    full: bool                #: take a full checkpoint at this step instead


@dataclass(frozen=True)
class CostChainPolicy:
    """See the module docstring. ``full_ratio=None`` never asks for an early full; ``merge_after=0`` never
    merges."""

    merge_after: int = 4
    full_ratio: float | None = 0.5
    merge_gain: float = 2.0

    def decide(self, ctx: ChainContext) -> ChainDecision:
        if (self.full_ratio is not None and ctx.full_bytes > 0 and ctx.merged_bytes > 0
                and ctx.merged_bytes >= self.full_ratio * ctx.full_bytes):
            return ChainDecision(merge=False, full=True)
        if self.merge_after <= 0:
            return ChainDecision(merge=False, full=False)
        since_full = ctx.chain_objects + ctx.merged_objects
        if ctx.chain_objects < 1 or (ctx.merged_objects == 0 and since_full < 2):
            return ChainDecision(merge=False, full=False)
        if ctx.chain_objects >= self.merge_after:
            return ChainDecision(merge=True, full=False)
        if (ctx.chain_objects >= 2 and ctx.merged_bytes > 0
                and ctx.last_merged_bytes + ctx.chain_bytes >= self.merge_gain * ctx.merged_bytes):
            return ChainDecision(merge=True, full=False)
        return ChainDecision(merge=False, full=False)
