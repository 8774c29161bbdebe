"""LineageState: what a run's coordinator knows of each object, and the lineage views built from it.

For every known object: its manifest, whether it is durable, which nodes hold it in their object store (and the
object references that came with it, if any) and which node's worker received it from the trainer. The state is
derivable: a restarted coordinator rebuilds it from the committed manifests on storage
(:meth:`LineageState.refresh_durable`) and from the live workers' inventories (:meth:`LineageState.add`).

Runs in the coordinator actor's thread (its calls run one at a time); no Ray: ``alive`` (which nodes are alive,
given how old an answer may be) is a callable the coordinator passes in, and tests pass a stand-in.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.lineage import Lineage, Manifest, retention
from ray_ckpt.lineage import index as _lineage_index
from ray_ckpt.lineage.manifest import lazy_diffs

log = logging.getLogger("ray_ckpt")

#: the periodic figures (control, metrics, gap checks) are recomputed at most once per this many times the CPU
#: their last computation took: they are linear in the run's objects, so their CPU share stays near
#: 1/COST_FACTOR while their age grows
COST_FACTOR = 50.0
#: below this many CPU seconds a periodic computation is redone every time, as in a short run
CHEAP_S = 0.005
#: manifests parsed from the same bytes (an origin's report and its peer's report of the same chunk) are reused
_PARSED_CACHE = 4096


@dataclass
class RunRef:
    """The run's name and its storage, shared by the coordinator's parts (``set_storage`` replaces the storage
    for all of them at once)."""

    name: str
    storage: object


@dataclass
class Entry:
    manifest: Manifest
    durable: bool = False
    holders: dict = field(default_factory=dict)  # node_id -> [ObjectRef], or [None]: asked at a plan
    origin: str | None = None                    # node whose worker received it from the trainer


class LineageState:
    """Every object known to the coordinator (:attr:`entries`, by name) and the cached lineage views.

    Call order: :meth:`refresh_durable` and :meth:`add` build it (constructor, reports, rebuilds); :meth:`release`
    and :meth:`drop_node` take holders away; :meth:`lineage` answers views at any time. Coordinator actor thread.
    """

    def __init__(self, run: RunRef, alive: Callable[..., set]):
        self.run = run
        self.alive = alive                    # alive(max_age=0.0) -> ids of the alive nodes
        self.entries: dict[str, Entry] = {}   # never replaced: the coordinator shows the same dict
        self.last_generation = 0
        self.lazy_gens: set[int] = set()      # generations with durable_diffs="fulls"
        #: durable_only -> (when, CPU seconds it took, the view): periodic callers reuse a view (see lineage)
        self.views: dict[bool, tuple[float, float, Lineage]] = {}
        self.view_counts = (0, 0)    # objects held by a live node, by two or more: counted with the view
        self._parsed: dict[bytes, Manifest] = {}   # manifest bytes -> Manifest (insertion order: oldest first)
        self._index_clock = _lineage_index.RewriteClock()

    # -- building it -----------------------------------------------------------------------------------------------
    def manifest(self, mjson) -> Manifest:
        """A reported manifest: as the worker sent it (a :class:`Manifest`), or ``Manifest.from_json`` of its
        bytes (older workers, the replica), reusing the parse of the same bytes (a chunk is reported by its
        origin and by its peer)."""
        if isinstance(mjson, Manifest):
            return mjson
        m = self._parsed.pop(mjson, None)
        if m is None:
            m = Manifest.from_json(mjson)
            if len(self._parsed) >= _PARSED_CACHE:
                del self._parsed[next(iter(self._parsed))]
        self._parsed[mjson] = m
        return m

    def add(self, m: Manifest, node: str | None, refs, durable: bool, origin: str | None = None) -> None:
        """``m`` is known: held by ``node`` (with ``refs``) and/or ``durable``; ``origin`` received it."""
        e = self.entries.get(m.name)
        if e is None:
            e = self.entries[m.name] = Entry(m)
        e.durable = e.durable or durable
        if origin is not None and e.origin is None:
            e.origin = origin
        if node is not None and refs:
            e.holders[node] = refs
        self.last_generation = max(self.last_generation, m.generation)
        if lazy_diffs(m):
            self.lazy_gens.add(m.generation)

    def refresh_durable(self) -> None:
        """Add every committed manifest on storage (a worker that died may have written objects whose reports
        it never sent)."""
        lineage, bad = load_lineage(self.run.storage, strict=False)
        for key in bad:
            log.warning("ray_ckpt coordinator: ignoring malformed manifest %s", key)
        for m in lineage.manifests:
            e = self.entries.get(m.name)
            if e is None:
                self.entries[m.name] = Entry(m, durable=True)
            else:
                e.durable = True
        self.last_generation = max([self.last_generation] + [m.generation for m in lineage.manifests])

    def mark_durable(self, names, but: str) -> None:
        """The known objects ``names`` (except ``but``) are durable: their steps are inside a committed batch."""
        for n in names:
            if n in self.entries and n != but:
                self.entries[n].durable = True

    def release(self, node: str, names) -> None:
        """``node``'s worker let ``names`` go; an object neither held nor durable is forgotten."""
        for n in names:
            e = self.entries.get(n)
            if e is not None:
                e.holders.pop(node, None)
                if not e.holders and not e.durable:
                    del self.entries[n]

    def drop_node(self, node: str) -> list[str]:
        """Forget what ``node`` held; returns the names now neither durable nor held anywhere (forgotten)."""
        lost = []
        for name, e in list(self.entries.items()):
            if e.holders.pop(node, None) is not None and not e.holders and not e.durable:
                del self.entries[name]
                lost.append(name)
        return lost

    # -- questions -------------------------------------------------------------------------------------------------
    def durable_floor(self, gen: int) -> int | None:
        """``durable_diffs="fulls"``: the newest durable full of ``gen`` — the steps before it need not be held
        (not a gap when released). None for generations that write every diff."""
        if gen not in self.lazy_gens:
            return None
        return max((e.manifest.last_step for e in self.entries.values() if e.durable
                    and e.manifest.kind == "full" and e.manifest.generation == gen), default=None)

    def durable_step(self, gen: int) -> int:
        """The newest step of ``gen`` a durable object ends at (-1: none)."""
        return max((e.manifest.last_step for e in self.entries.values()
                    if e.durable and e.manifest.generation == gen), default=-1)

    def lazy_holders(self, gen: int, step: int, alive: set[str]) -> set[str]:
        """The live nodes holding diffs of ``gen`` up to ``step`` that are not durable (a durable full at
        ``step`` covers them)."""
        return {n for e in self.entries.values() if e.manifest.generation == gen and e.manifest.kind == "diff"
                and e.manifest.last_step <= step and not e.durable for n in e.holders if n in alive}

    def known_on(self, node: str) -> bool:
        """Whether some known object is held by ``node`` or was received there."""
        return any(e.origin == node or node in e.holders for e in self.entries.values())

    def dead_holders(self, alive: set[str]) -> set[str]:
        """The nodes holding known objects that are not in ``alive``."""
        return {n for e in self.entries.values() for n in e.holders if n not in alive}

    def unpersisted(self, alive: set[str]) -> dict:
        """``{node_id: [names]}``: objects not yet durable, by their first live holder."""
        out: dict[str, list[str]] = {}
        for name, e in self.entries.items():
            if not e.durable:
                live = sorted(n for n in e.holders if n in alive)
                if live:
                    out.setdefault(live[0], []).append(name)
        return out

    def of_generation(self, gen: int) -> Lineage:
        """Every known object of ``gen`` (held, durable or neither) as a lineage: its holes are lost steps."""
        return Lineage([e.manifest for e in self.entries.values() if e.manifest.generation == gen])

    def held_lineage(self, nodes: set[str], durable: bool = False) -> Lineage:
        """The objects held by one of ``nodes`` (or ``durable`` ones too) as a lineage."""
        return Lineage([e.manifest for e in self.entries.values()
                        if (durable and e.durable) or any(n in nodes for n in e.holders)])

    def lineage(self, durable_only: bool = False, max_age: float = 0.0) -> Lineage:
        """The lineage of what storage holds (``durable_only``) or of what storage or a live node holds.

        ``max_age > 0`` (the periodic callers) accepts how old the list of alive nodes may be, and a view built
        less than ``COST_FACTOR`` times its CPU cost ago once that cost exceeds ``CHEAP_S``: a long run's views
        cost tens of ms, and rebuilding them several times a second would grow the actor's CPU with the run.
        Plans and explicit status calls (``max_age=0``) always get a fresh view."""
        now = time.monotonic()
        cached = self.views.get(durable_only)
        if (max_age > 0 and cached is not None and cached[1] > CHEAP_S
                and now - cached[0] <= COST_FACTOR * cached[1]):
            return cached[2]
        # no need to ask which nodes are alive for durable_only (the node list is costly to ask)
        alive = None if durable_only else self.alive(max_age)
        cpu0 = time.thread_time()   # the view's own cost (the node list has its own cache)
        counts = None
        # a step a plan cannot reach is explained from the retention record (read only then)
        removed = functools.partial(retention.read, self.run.storage)
        if alive is None:
            lin = Lineage([e.manifest for e in self.entries.values() if e.durable], retention=removed)
        else:
            ms, held, twice = [], 0, 0
            for e in self.entries.values():
                live = sum(1 for n in e.holders if n in alive) if e.holders else 0
                held += live > 0
                twice += live >= 2
                if e.durable or live:
                    ms.append(e.manifest)
            lin, counts = Lineage(ms, retention=removed), (held, twice)
        lin.head()   # the sweep every periodic caller needs, timed with the build (the view keeps its result)
        self.views[durable_only] = (now, time.thread_time() - cpu0, lin)
        if counts is not None:
            self.view_counts = counts
        return lin

    def view_age(self) -> float:
        """Seconds since the older of the two views was built (after :meth:`lineage` built both)."""
        return time.monotonic() - min(self.views[False][0], self.views[True][0])

    # -- the lineage index -----------------------------------------------------------------------------------------
    def write_index(self, force: bool) -> None:
        """Roll the durable manifests up into the lineage index on storage, when its clock says so (``force``:
        GC just deleted objects). Called at a durable full."""
        now = time.monotonic()
        if not self._index_clock.due(now, force=force):
            return
        cpu0 = time.thread_time()
        try:
            # objects still held and not durable may be committed later, some out of order (a peer
            # persisting a lost worker's chunks): no watermark may pass them
            _lineage_index.write_index(self.run.storage,
                                       [e.manifest for e in self.entries.values() if e.durable],
                                       pending=[e.manifest for e in self.entries.values() if not e.durable])
        except Exception as e:  # noqa: BLE001 - a cache: readers fall back to listing
            log.warning("ray_ckpt coordinator: could not write the lineage index: %s", e)
        self._index_clock.done(now, time.thread_time() - cpu0)
