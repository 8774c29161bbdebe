"""Chain resolution: which full checkpoint and which diff objects reproduce a requested step.

Rules (pure functions of the committed manifests):

* Generation ``g`` holds the steps its objects cover; it starts at its earliest full checkpoint.
* A newer generation supersedes older ones from its start on (the newer generation resumed or branched at
  that step), so an older generation is only valid for steps ``<=`` the start of every newer one.
* Step ``s`` of generation ``g`` is reachable when a full ``f <= s`` of ``g`` exists and ``g``'s diff objects
  cover ``f+1 .. s`` without a gap. The plan picks the latest such full (shortest replay).
* ``resolve(None)`` is the newest generation's highest reachable step, falling back to older generations
  only when the newer ones have nothing reachable (e.g. every object of theirs is excluded as corrupt).
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Iterable

from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage import unrecoverable
from ray_ckpt.lineage.manifest import Manifest


class NoCheckpointError(RayCkptError, LookupError):
    """No committed state satisfies the request."""


@dataclass(frozen=True)
class Plan:
    """What to read to reproduce ``step``: one full, then diffs whose records ``full.last_step+1 .. step`` replay."""

    step: int
    generation: int
    full: Manifest
    diffs: tuple[Manifest, ...]

    @property
    def objects(self) -> tuple[Manifest, ...]:
        return (self.full, *self.diffs)


class Lineage:
    """An immutable view over committed manifests. Built from a listing; cheap to rebuild.

    ``retention``: what garbage collection removed from the lineage (:class:`ray_ckpt.lineage.retention.
    Retention`), or a function without arguments that reads it (called at most once, and only to explain a step
    that is not recoverable), or None: a restore of a removed step then says it was removed by retention."""

    def __init__(self, manifests: Iterable[Manifest], exclude: Iterable[str] = (), retention=None):
        self.retention = retention
        excl = set(exclude)
        self.manifests: list[Manifest] = sorted(
            (m for m in manifests if not excl or m.name not in excl),
            key=lambda m: (m.generation, m.first_step, m.last_step, m.kind))
        self._gens: dict[int, list[Manifest]] = {}
        self._reach: dict[int, list[int]] = {}   # reachable_steps per generation (this view never changes)
        for m in self.manifests:
            self._gens.setdefault(m.generation, []).append(m)

    # ----------------------------------------------------------------------------------------------
    @property
    def generations(self) -> list[int]:
        return sorted(self._gens)

    def next_generation(self) -> int:
        return (max(self._gens) + 1) if self._gens else 1

    def start_of(self, gen: int) -> int | None:
        fulls = [m.last_step for m in self._gens.get(gen, []) if m.kind == "full"]
        return min(fulls) if fulls else None

    def _branch_point(self, gen: int) -> int | None:
        """The step generation ``gen`` branched from, from any manifest of it: its attach full, the ``start_step``
        its writer recorded, or the first step of a diff minus one. Known even when its full is lost, so a lost
        full never revives the timeline it superseded."""
        points = []
        for m in self._gens.get(gen, []):
            points.append(m.last_step if m.kind == "full" else m.first_step - 1)
            start = m.info.get("start_step") if isinstance(m.info, dict) else None
            if isinstance(start, int) and not isinstance(start, bool) and start >= 0:
                points.append(start)
        return min(points) if points else None

    def _cap(self, gen: int) -> int | None:
        """Highest step of ``gen`` still on the current timeline (None: unbounded)."""
        starts = [s for g in self._gens if g > gen for s in [self._branch_point(g)] if s is not None]
        return min(starts) if starts else None

    def timeline_cap(self, gen: int) -> int | None:
        """The highest step of generation ``gen`` on the current timeline (None: unbounded): newer generations
        supersede it from the step they branched from."""
        return self._cap(gen)

    def _chain_from(self, gen: int, full: int, target: int | None) -> list[Manifest]:
        """The greedy chain of diffs after the full at step ``full`` of ``gen``, as far as contiguous (and, with
        ``target``, not past it): at each next step, the diff covering it that reaches furthest.

        A diff object whose manifest says ``info.atomic`` (e.g. a merged Amber increment) cannot be cut inside
        its range: it is only used when ``target`` is None or ``>=`` its last step. One pass over the diffs in
        (first, last) order: the running maximum of last_step over the diffs starting at or before ``nxt`` is
        the diff covering ``nxt`` that reaches furthest (the first such in that order on a tie), if any covers
        it — O(diffs), not O(diffs) per chain link."""
        diffs = [m for m in self._gens.get(gen, []) if m.kind == "diff"
                 and (target is None or not m.info.get("atomic") or m.last_step <= target)]
        chain: list[Manifest] = []
        nxt = full + 1
        best, i = None, 0
        while True:
            while i < len(diffs) and diffs[i].first_step <= nxt:
                if best is None or diffs[i].last_step > best.last_step:
                    best = diffs[i]
                i += 1
            if best is None or best.last_step < nxt or (target is not None and nxt > target):
                break
            chain.append(best)
            nxt = best.last_step + 1
        return chain

    def _chains(self, gen: int, target: int | None) -> dict[int, list[Manifest]]:
        """For every full of ``gen``: :meth:`_chain_from` (O(fulls x diffs): for checks, not for plans)."""
        return {m.last_step: self._chain_from(gen, m.last_step, target)
                for m in self._gens.get(gen, []) if m.kind == "full"}

    def reachable_ranges(self, gen: int) -> list[tuple[int, int]]:
        """Every step of ``gen`` that some full + contiguous diffs reproduce (capped by newer generations), as
        sorted, disjoint, non-adjacent ranges ``(first, last)``.

        From a full at ``f`` the *positions* (next step to replay) start at ``f + 1``; a diff covering a position
        ``p`` reaches steps ``p .. last`` and every position up to ``last + 1`` where some diff starts or ends; an
        ``info.atomic`` diff covering ``p`` reaches only its ``last`` step and position ``last + 1``. What a
        position reaches does not depend on the full it was reached from, so one sweep starts from every full at
        once; positions are visited in increasing order (every move goes forward), so each diff is looked at
        once: O(diffs log diffs) per generation, whatever the number of fulls and steps (the coordinator asks
        several times a second, over runs of 10⁵-10⁶ steps with a full every few hundred). Computed once per
        generation of this view (``head``, ``resolve`` and the coordinator's figures share it)."""
        if gen not in self._reach:
            self._reach[gen] = self._reachable(gen)
        return list(self._reach[gen])

    def reachable_steps(self, gen: int) -> list[int]:
        """:meth:`reachable_ranges` as a list of every step (O(steps): for tools, not for periodic calls)."""
        return [s for lo, hi in self.reachable_ranges(gen) for s in range(lo, hi + 1)]

    def reaches(self, gen: int, step: int) -> bool:
        """Whether ``step`` of ``gen`` is reachable (a binary search in :meth:`reachable_ranges`)."""
        ranges = self.reachable_ranges(gen)
        i = bisect.bisect_right(ranges, (step, float("inf"))) - 1
        return i >= 0 and ranges[i][0] <= step <= ranges[i][1]

    def _reachable(self, gen: int) -> list[tuple[int, int]]:
        cap = self._cap(gen)
        ms = self._gens.get(gen, [])
        diffs = [m for m in ms if m.kind == "diff"]          # sorted by (first_step, last_step)
        plain = [d for d in diffs if not d.info.get("atomic")]
        atomic = [d for d in diffs if d.info.get("atomic")]
        interest = sorted({d.first_step for d in diffs} | {d.last_step + 1 for d in diffs})
        fulls = sorted({m.last_step for m in ms if m.kind == "full"})
        spans: list[tuple[int, int]] = [(f, f) for f in fulls]
        todo = sorted({f + 1 for f in fulls})                 # a sorted list is a heap
        seen = set(todo)
        # positions are >= 1 and steps >= 0, so -1 is "nothing yet" for both:
        hi = -1        # every interest point above the current position and up to here is reachable
        done_to = -1   # steps from the current position up to below this are in `spans` already
        i = j = k = 0
        while todo:
            p = heapq.heappop(todo)
            while i < len(plain) and plain[i].first_step <= p:
                d = plain[i]
                i += 1
                if d.last_step >= p:     # covers p (else it ended before every later position too)
                    lo = max(p, done_to)
                    if lo <= d.last_step:
                        spans.append((lo, d.last_step))
                    done_to = max(done_to, d.last_step + 1)
                    hi = max(hi, d.last_step + 1)
            while j < len(atomic) and atomic[j].first_step <= p:
                d = atomic[j]
                j += 1
                if d.last_step >= p:
                    spans.append((d.last_step, d.last_step))
                    if d.last_step + 1 not in seen:
                        seen.add(d.last_step + 1)
                        heapq.heappush(todo, d.last_step + 1)
            while k < len(interest) and interest[k] <= hi:
                q = interest[k]
                k += 1
                if q > p and q not in seen:
                    seen.add(q)
                    heapq.heappush(todo, q)
        return _merge(spans, cap)

    def uncovered_steps(self, gen: int) -> list[int]:
        """Steps of ``gen`` between its first full and the last step any of its objects holds that no object
        holds: steps lost for good (a *gap*: held nowhere and never written). O(objects log objects)."""
        ms = self._gens.get(gen, [])
        start = self.start_of(gen)
        if start is None:
            return []
        # a full may name steps before it that were left unrecorded by choice (the overhead budget's
        # granularity: ``info["unrecorded_from"]``): not lost, never written
        covered = _merge([(_unrecorded_from(m), m.last_step) for m in ms], None)
        top = covered[-1][1]
        out: list[int] = []     # the full at `start` is covered: only holes between ranges, from there on
        for (_, prev_hi), (lo, _) in zip(covered, covered[1:]):
            out.extend(range(max(prev_hi + 1, start), min(lo, top)))
        return out

    def head(self) -> int | None:
        """The latest recoverable step on the current timeline, or None."""
        for gen in sorted(self._gens, reverse=True):
            ranges = self.reachable_ranges(gen)
            if ranges:
                return ranges[-1][1]
        return None

    def resolve(self, step: int | None = None) -> Plan:
        """The plan for ``step`` (``None`` = latest). Raises :class:`NoCheckpointError` with what exists."""
        if not self._gens:
            raise NoCheckpointError("no committed checkpoint exists")
        gens = sorted(self._gens, reverse=True)
        if step is None:
            for gen in gens:
                ranges = self.reachable_ranges(gen)
                if ranges:
                    return self._plan(gen, ranges[-1][1])
            raise NoCheckpointError("no committed full checkpoint exists (no step is recoverable)")
        for gen in gens:
            start = self.start_of(gen)
            if start is None or start > step:
                continue
            if self.reaches(gen, step):
                return self._plan(gen, step)
            break  # the newest generation that started at or before `step` does not hold it
        raise NoCheckpointError(self.why_not(step))

    def why_not(self, step: int) -> str:
        """Why ``step`` is not recoverable, in words (:mod:`ray_ckpt.lineage.unrecoverable`): removed by retention,
        left unrecorded by the overhead budget, or neither. Reads the retention record when it was given as a
        function (once per view)."""
        if callable(self.retention):
            try:
                self.retention = self.retention()
            except Exception:  # noqa: BLE001 - an unreadable record explains nothing: the plain message
                self.retention = None
        return unrecoverable.explain(self, step, self.retention)

    def latest_at_or_before(self, step: int) -> int | None:
        """The newest recoverable step at or before ``step`` on the current timeline (None: none). A step the
        overhead budget left unrecorded (a full every k steps) maps to the recovery point before it."""
        for gen in sorted(self._gens, reverse=True):
            start = self.start_of(gen)
            if start is None or start > step:
                continue
            best = None
            for lo, hi in self.reachable_ranges(gen):
                if lo > step:
                    break
                best = min(hi, step)
            if best is not None:
                return best
        return None

    def plan_in(self, gen: int, step: int) -> Plan:
        """The plan for ``step`` within generation ``gen`` (no supersession rules: the caller applies them)."""
        return self._plan(gen, step)

    def _plan(self, gen: int, step: int) -> Plan:
        """The latest full ``<= step`` of ``gen`` whose chain reaches ``step`` (fulls tried newest first: the
        first that works is the plan, usually the nearest; each try is O(diffs))."""
        for f in sorted({m.last_step for m in self._gens.get(gen, []) if m.kind == "full" and m.last_step <= step},
                        reverse=True):
            used = [d for d in self._chain_from(gen, f, step) if d.first_step <= step]
            hi = used[-1].last_step if used else f
            if hi >= step and (not used or not used[-1].info.get("atomic") or used[-1].last_step == step):
                return Plan(step=step, generation=gen, full=self._full(gen, f), diffs=tuple(used))
        raise NoCheckpointError(f"step {step} of generation {gen} has no complete chain")

    def _full(self, gen: int, step: int) -> Manifest:
        return next(m for m in self._gens[gen] if m.kind == "full" and m.last_step == step)



def _merge(spans: list[tuple[int, int]], cap: int | None) -> list[tuple[int, int]]:
    """``spans`` (inclusive ranges, any order, may overlap) as sorted, disjoint, non-adjacent ranges, cut at
    ``cap`` (None: not cut)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if cap is not None:
            if lo > cap:
                break
            hi = min(hi, cap)
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def range_difference(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The steps of ranges ``a`` not in ranges ``b`` (both sorted and disjoint, as :meth:`Lineage.
    reachable_ranges` gives them), as ranges. O(len(a) + len(b))."""
    out: list[tuple[int, int]] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] < lo:
            j += 1
        k = j
        while lo <= hi:
            if k >= len(b) or b[k][0] > hi:
                out.append((lo, hi))
                break
            if b[k][0] > lo:
                out.append((lo, b[k][0] - 1))
            lo = max(lo, b[k][1] + 1)
            k += 1
    return out


def gc_cutoff(lineage: Lineage, keep_fulls: int) -> Manifest | None:
    """The oldest full kept when only the ``keep_fulls`` newest fulls *of the current timeline* are kept (a full
    of a generation past the step a newer generation branched from belongs to an abandoned timeline and does
    not count); None when there are ``keep_fulls`` or fewer. Pure."""
    if keep_fulls < 1:
        raise ValueError(f"keep_fulls must be >= 1, got {keep_fulls}")
    live = []
    for m in lineage.manifests:
        if m.kind != "full":
            continue
        cap = lineage._cap(m.generation)
        if cap is None or m.last_step <= cap:
            live.append(m)
    live.sort(key=lambda m: (m.last_step, m.generation))
    return live[-keep_fulls] if len(live) > keep_fulls else None


def collectable(lineage: Lineage, m: Manifest, cutoff: Manifest | None) -> bool:
    """Whether no plan of the current timeline from step ``cutoff`` on reads ``m``: it only serves earlier steps
    (of ``cutoff``'s generation or older ones), or it lies wholly past the step a newer generation branched from
    (an abandoned timeline, which no restore returns). ``cutoff`` None: only the abandoned part. Pure."""
    cap = lineage._cap(m.generation)
    if cap is not None and m.first_step > cap:
        return True
    return cutoff is not None and m.last_step < cutoff.last_step and m.generation <= cutoff.generation


def _unrecorded_from(m) -> int:
    """The first step ``m`` accounts for: its first step, or for a full the first of the steps before it that
    were left unrecorded by choice (``info["unrecorded_from"]``)."""
    u = m.info.get("unrecorded_from") if m.kind == "full" else None
    return u if isinstance(u, int) and 0 <= u <= m.first_step else m.first_step
