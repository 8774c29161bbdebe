"""GapWatch: when the coordinator may call steps of a run lost.

A step of the current generation is **lost** (a *gap*) when no object covers it — none held by a live node's
worker, none committed to storage — *and* no hand-off of it is in flight to a live node's worker, for longer
than a grace period (:data:`GAP_GRACE_S`).

Why the hand-offs in flight count: a node's worker receives chunks in concurrent calls, and one call may take
seconds before its chunk is held (``ray.put`` into a full object store waits for Ray to spill). Meanwhile a later
chunk is held and reported, and the coordinator's view has a hole where the earlier chunk's steps are; they are
not lost (the worker is receiving them, and the sender keeps them until they are safe). The worker therefore
reports ``receiving`` when a call begins, and ``held`` (or ``not_received``, when the call failed) when it
ends; a worker that restarts or a node that dies ends its hand-offs (:meth:`GapWatch.node_reset`; the sender
resends what that worker had not secured, and those calls report ``receiving`` again).

Call order, all in the coordinator actor (its calls run one at a time; nothing here is thread-safe):

    receiving / received / node_reset   as each worker's update messages arrive, in the order it sent them
    due                                 before a check: whether one is due (a check costs O(objects log objects))
    overdue                             with the uncovered steps of a generation: the steps to declare lost now
    declare                             records those steps as gaps; returns their ranges, to log
    untold                              for the trainer's control answer: the gaps not told yet (told once)

Pure: no Ray, no storage; tests build it directly.
"""
from __future__ import annotations

GAP_GRACE_S = 2.0       #: how long a hole in the step sequence may last before it is declared a gap
#: the shortest interval between two gap checks (seconds), whatever they cost
MIN_CHECK_S = 0.5


class GapWatch:
    """The gap state of one run's lineage: its holes and since when, the hand-offs in flight per node, the
    declared gaps. Held by the coordinator actor, which calls it in the order above."""

    def __init__(self, grace_s: float = GAP_GRACE_S):
        self.grace_s = grace_s
        #: the declared gaps, oldest first: ``{"generation", "first", "last", "time"}`` (``"told"`` once the
        #: trainer was told); the coordinator's status shows them
        self.gaps: list[dict] = []
        self.cost = 0.0                 #: CPU seconds the last check took (the caller measures it)
        self._checked = 0.0             # when the last check ran (monotonic)
        self._holes: dict[tuple[int, int], float] = {}   # (generation, step) -> since when it is a hole
        #: hand-offs in flight: node -> {chunk name: (generation, first step, last step)}
        self._arriving: dict[str, dict[str, tuple[int, int, int]]] = {}

    # -- hand-offs in flight ---------------------------------------------------------------------------------
    def receiving(self, node: str, manifests) -> None:
        """``node``'s worker began to receive these chunks (their manifests) from a training process."""
        got = self._arriving.setdefault(node, {})
        for m in manifests:
            got[m.name] = (m.generation, m.first_step, m.last_step)

    def received(self, node: str, names) -> None:
        """``node``'s worker holds these chunks now, or gave up receiving them (the call failed)."""
        got = self._arriving.get(node)
        if got:
            for n in names:
                got.pop(n, None)
            if not got:
                del self._arriving[node]

    def node_reset(self, node: str) -> None:
        """``node``'s worker restarted or the node is gone: what it was receiving will not arrive from it."""
        self._arriving.pop(node, None)

    def arriving(self) -> bool:
        """Whether some hand-off is in flight (the caller then asks which nodes are alive)."""
        return bool(self._arriving)

    def in_flight(self, gen: int, alive: set[str] | None = None) -> set[int]:
        """The steps of ``gen`` that a hand-off in flight to a node of ``alive`` (None: any node) brings."""
        out: set[int] = set()
        for node, got in self._arriving.items():
            if alive is None or node in alive:
                for g, first, last in got.values():
                    if g == gen:
                        out.update(range(first, last + 1))
        return out

    # -- decisions -------------------------------------------------------------------------------------------
    def due(self, now: float, force: bool = False, cost_factor: float = 50.0) -> bool:
        """Whether a check is due at ``now`` (monotonic): at most every ``MIN_CHECK_S``, and at most once per
        ``cost_factor`` times the CPU the last one took; ``force``: always. Marks the check as done."""
        if not force and now - self._checked < max(MIN_CHECK_S, cost_factor * self.cost):
            return False
        self._checked = now
        return True

    def overdue(self, gen: int, holes, now: float, alive: set[str] | None = None) -> list[int]:
        """The steps of ``gen`` to declare lost at ``now`` (monotonic), sorted: steps among ``holes`` (the
        steps of ``gen`` no object covers now) that have been holes for ``grace_s`` while no hand-off of them
        was in flight to a node of ``alive`` (None: any node), and are not declared already. A step whose
        hand-off is in flight is no hole: its grace period starts when the hand-off ends without it."""
        arriving = self.in_flight(gen, alive) if self._arriving else set()
        current = {(gen, s) for s in holes if s not in arriving}
        for key in [k for k in self._holes if k not in current]:
            del self._holes[key]
        for key in current:
            self._holes.setdefault(key, now)
        known = {(g["generation"], s) for g in self.gaps for s in range(g["first"], g["last"] + 1)}
        return sorted(s for (g, s), t0 in self._holes.items()
                      if g == gen and now - t0 >= self.grace_s and (g, s) not in known)

    def declare(self, gen: int, steps: list[int], when: float) -> list[tuple[int, int]]:
        """Record ``steps`` of ``gen`` as lost at ``when`` (wall clock); returns them as ranges."""
        ranges = _runs(sorted(steps))
        for first, last in ranges:
            self.gaps.append({"generation": gen, "first": first, "last": last, "time": when})
        return ranges

    def untold(self, gen: int) -> list[tuple[int, int]]:
        """The ranges of ``gen``'s gaps the trainer was not told of yet (each is told once)."""
        out = []
        for g in self.gaps:
            if g["generation"] == gen and not g.get("told"):
                g["told"] = True
                out.append((g["first"], g["last"]))
        return out


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted steps as ranges of consecutive steps."""
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out
