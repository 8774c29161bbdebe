"""Drains: node drains (preemption notices, :mod:`ray_ckpt.runtime.drain`) as a run's coordinator handles them.

A new drain is logged (WARNING), recorded on storage (``drains/``, :mod:`ray_ckpt.lineage.drains`, shown by
``ray-ckpt ls``) and told to every live node's worker (peers among the nodes that stay; the draining node writes
what it holds at once); a state-tier replica on a draining node is restarted elsewhere. Each poll of the drain
watch then accounts for every open drain: which of the steps the draining node holds are durable, held on a node
that stays, or neither.

Call order: :meth:`Drains.changed` when the GCS drain state changes, :meth:`Drains.progress` at each poll of the
drain watch while a drain is open, :meth:`Drains.status` and :attr:`Drains.draining` at any time. Runs in the
coordinator actor's thread (the drain watch's thread calls the actor); no Ray: the cluster's calls come from
callables the coordinator passes in, tests pass stand-ins.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ray_ckpt.lineage import drains as drain_records
from ray_ckpt.lineage import range_difference
from ray_ckpt.runtime.coordination.state import LineageState

log = logging.getLogger("ray_ckpt")

#: how long after its node is gone a drain whose steps a peer still holds stays open (ms)
_GONE_OPEN_MS = 60_000


class Drains:
    """The drains of one run's lineage (``state``). Coordinator actor thread.

    ``alive()``: the alive nodes; ``notify(draining)``: tell the live workers; ``move_replica(draining)``: restart
    a replica on a draining node; ``forget_dead()``: drop and heal nodes that are gone; ``retained_from()``:
    ``(generation, step)`` of the oldest full retention keeps (None: no GC yet)."""

    def __init__(self, state: LineageState, alive: Callable[[], set], notify: Callable[[dict], None],
                 move_replica: Callable[[dict], None], forget_dead: Callable[[], None],
                 retained_from: Callable[[], tuple[int, int] | None] = lambda: None):
        self.state = state
        self.retained_from = retained_from
        self.alive = alive
        self.notify = notify
        self.move_replica = move_replica
        self.forget_dead = forget_dead
        self.records: dict[str, dict] = {}    # node -> its drain record (lineage/drains.py)
        self.draining: dict[str, int] = {}    # the GCS drain state: node -> deadline ms (0: none)

    def changed(self, drains: dict) -> None:
        """The GCS drain state changed to ``drains`` (``{node: deadline_ms}``). A withdrawn drain's record is
        closed (``cancelled``); a new drain gets a record (or continues an open one on storage: the coordinator
        restarted during it), the workers are told, a replica on a draining node moves, and the drains are
        accounted for at once."""
        run, storage = self.state.run.name, self.state.run.storage
        self.draining = {str(n): int(d or 0) for n, d in drains.items()}
        now_ms = int(time.time() * 1000)
        new = [n for n in self.draining if n not in self.records or self.records[n]["status"] == "cancelled"]
        for node, rec in self.records.items():
            if node not in self.draining and rec["status"] in ("draining", "safe") and node in self.alive():
                rec["status"] = "cancelled"
                rec["settled"] = True
                self.write(rec)
        for node in new:
            deadline = self.draining[node]
            prior = None if node in self.records else drain_records.find_open(storage, node, deadline)
            if prior is not None:   # the coordinator restarted during the drain: its record goes on
                self.records[node] = prior
                log.info("ray_ckpt coordinator: run %r: node %s is still draining: continuing its drain record",
                         run, node[:12])
                continue
            gen = self.state.last_generation
            self.records[node] = rec = {"node": node, "noticed_ms": now_ms, "deadline_ms": deadline,
                                        "generation": gen, "status": "draining",
                                        "held": [], "durable": [], "peer": [], "unsafe": [],
                                        # the newest step durable at the notice: what the node receives past it
                                        # counts as held there even when it is written before the next poll
                                        "durable_before": self.state.durable_step(gen)}
            log.warning("ray_ckpt coordinator: run %r: node %s is draining (%s): making the steps it holds safe on "
                        "the nodes that stay", run, node[:12],
                        f"deadline in {deadline / 1000.0 - now_ms / 1000.0:.1f} s" if deadline else "no deadline")
            self.write(rec)
        if not new:
            return
        self.notify(self.draining)
        self.move_replica(self.draining)
        self.progress()

    def progress(self) -> bool:
        """Account for every open drain: which of the steps the draining node holds (not durable) are durable,
        held on a node that stays, or neither; the record on storage is rewritten when that changes. Once the
        node is gone, what only a surviving node holds is written to storage (``forget_dead``) and the record
        closes when nothing is left to make durable (or after a minute). Returns whether a drain is still open."""
        if not any(not rec.get("settled") or rec.get("unwritten") for rec in self.records.values()):
            return False
        alive = self.alive()
        if any(n not in alive for n, rec in self.records.items() if not rec.get("settled")):
            self.forget_dead()   # the drained node is gone: survivors persist what they hold of it
        durable_lin = self.state.lineage(True)
        safe_lin = self.state.held_lineage({n for n in alive if n not in self.draining}, durable=True)
        open_any = False
        for node, rec in self.records.items():
            if rec.get("settled"):
                if rec.get("unwritten"):
                    self.write(rec)
                    open_any = open_any or bool(rec.get("unwritten"))
                continue
            before = {k: rec[k] for k in ("held", "durable", "peer", "unsafe", "status")}
            unsafe, peer = self._account(node, rec, durable_lin, safe_lin)
            self._settle(node, rec, node in alive, unsafe, peer)
            changed = before != {k: rec[k] for k in before}
            if before["status"] != "safe" and rec["status"] == "safe":
                log.info("ray_ckpt coordinator: run %r: %s", self.state.run.name, drain_records.describe(rec))
            if changed or rec.get("unwritten"):
                self.write(rec)
            open_any = open_any or not rec.get("settled")
        return open_any

    def _account(self, node: str, rec: dict, durable_lin, safe_lin) -> tuple[list, list]:
        """``rec``'s ranges from the lineage now: held (what ``node`` holds and, once it is gone, the last reports
        before that included, what it received), durable, held by a peer that stays, unsafe. Returns (unsafe,
        peer)."""
        gen = rec["generation"]
        since = rec.get("durable_before", float("inf"))   # (a record of an older coordinator: none)
        held = _union([], [(e.manifest.first_step, e.manifest.last_step) for e in self.state.entries.values()
                           if (node in e.holders or e.origin == node) and e.manifest.generation == gen
                           and (not e.durable or e.manifest.first_step > since)])
        held = _union(rec["held"], held)
        # steps no drain needs to save: with durable_diffs="fulls", those a durable full covers; and those before
        # the oldest (durable) full retention keeps, e.g. the every-k fulls newer durable fulls supersede
        retired = [self.state.durable_floor(gen)]
        kept = self.retained_from()
        if kept is not None and kept[0] == gen:
            retired.append(kept[1] - 1)
        last_retired = max((s for s in retired if s is not None), default=-1)
        if last_retired >= 0:
            held = range_difference(held, [(0, last_retired)])
        durable = _intersect(held, durable_lin.reachable_ranges(gen))
        rest = range_difference(held, durable)
        peer = _intersect(rest, safe_lin.reachable_ranges(gen))
        unsafe = range_difference(rest, peer)
        rec.update(held=[list(r) for r in held], durable=[list(r) for r in durable],
                   peer=[list(r) for r in peer], unsafe=[list(r) for r in unsafe])
        return unsafe, peer

    def _settle(self, node: str, rec: dict, alive: bool, unsafe: list, peer: list) -> None:
        """``rec``'s status: ``safe`` or ``draining`` while its node is alive; ``node gone`` after (logged once),
        settled when no peer holds anything of it or a minute after it went."""
        if alive:
            rec["status"] = "safe" if not unsafe else "draining"
            return
        if rec["status"] != "node gone":
            rec["gone_ms"] = int(time.time() * 1000)
            (log.warning if unsafe else log.info)(
                "ray_ckpt coordinator: run %r: %s", self.state.run.name,
                drain_records.describe({**rec, "status": "node gone"}))
        rec["status"] = "node gone"
        if not peer or time.time() * 1000 - rec["gone_ms"] > _GONE_OPEN_MS:
            rec["settled"] = True

    def write(self, rec: dict) -> None:
        """The drain record on storage (a failed write is retried at the next poll)."""
        rec["updated_ms"] = int(time.time() * 1000)
        try:
            drain_records.write_record(self.state.run.storage, {k: v for k, v in rec.items() if k != "unwritten"})
            rec.pop("unwritten", None)
        except Exception as e:  # noqa: BLE001 - storage outage: the record is written when it is back
            rec["unwritten"] = True
            log.info("ray_ckpt coordinator: drain record not written yet: %s", e)

    def status(self) -> dict:
        """``{node: record}`` of the drains seen (what ``drains/`` on storage says)."""
        return {n: {k: v for k, v in rec.items() if k != "unwritten"} for n, rec in self.records.items()}


def _union(a: list, b: list) -> list[tuple[int, int]]:
    """The union of two lists of step ranges, as sorted disjoint ranges."""
    out: list[tuple[int, int]] = []
    for x, y in sorted([tuple(r) for r in a] + [tuple(r) for r in b]):
        if out and x <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def _intersect(a: list, b: list) -> list[tuple[int, int]]:
    """The steps in both ``a`` and ``b`` (lists of ranges)."""
    return range_difference(_union(a, []), range_difference(_union(a, []), _union(b, [])))
