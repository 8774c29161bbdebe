"""ReplicaHealth: the state-tier replica's progress as its reports tell it, and whether it is usable.

While the replica is healthy, on a live node and close behind the lineage's head, the trainer takes no full
checkpoints (the replica writes them) and a restore may start from the replica's state. Runs in the coordinator
actor's thread; no Ray: asking the replica for its status and restarting it are callables the coordinator
passes in (:class:`~ray_ckpt.runtime.coordination.cluster.RayCluster`'s), tests pass stand-ins.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("ray_ckpt")


@dataclass
class Replica:
    generation: int
    step: int
    node: str
    ok: bool
    reason: str = ""
    updated: float = field(default_factory=time.time)


class ReplicaHealth:
    """The replica of run ``run`` (:attr:`replica`: its latest report, None before one). Coordinator actor thread.

    ``ask()`` returns the replica's own status dict (or None), ``restart()`` kills it for Ray to place it again
    (False: there is none)."""

    def __init__(self, run: str, max_lag: int, ask: Callable[[], dict | None], restart: Callable[[], bool]):
        self.run = run
        self.max_lag = max_lag
        self.replica: Replica | None = None
        self._ask = ask
        self._restart = restart

    def progress(self, generation: int, step: int, node: str, ok: bool, reason: str = "") -> None:
        """The replica applied the records of ``generation`` up to ``step`` (or failed: ``ok=False``)."""
        prev = self.replica
        if not ok and (prev is None or prev.ok):
            log.warning("ray_ckpt coordinator: the state-tier replica of run %r stopped (%s); the trainer takes "
                        "full checkpoints again", self.run, reason)
        self.replica = Replica(generation, step, node, ok, reason)

    def known(self) -> Replica | None:
        """The replica's progress; a restarted coordinator does not know it until the next report, so it asks."""
        if self.replica is None:
            st = self._ask()
            if st is not None and st.get("generation") is not None and st.get("step") is not None:
                self.replica = Replica(st["generation"], st["step"], st["node"], st["ok"], st.get("reason", ""))
        return self.replica

    def usable(self, gen: int, alive: Callable[[], set], head: Callable[[], int | None]) -> bool:
        """Whether the replica serves ``gen``: healthy, on a node of ``alive()``, at most ``max_lag`` steps
        behind ``head()`` (the lineage's head; both asked only when the cheaper tests pass)."""
        r = self.replica
        if r is None or not r.ok or r.generation != gen or r.node not in alive():
            return False
        h = head()
        return h is None or h - r.step <= self.max_lag

    def in_chain(self, first: int, last: int) -> dict | None:
        """``{"step", "node"}`` when the replica's state lies in ``first..last`` (a plan's full to its step)."""
        r = self.replica
        return {"step": r.step, "node": r.node} if r is not None and first <= r.step <= last else None

    def move_off(self, draining) -> None:
        """A replica on a node among ``draining`` is restarted on a node that stays (soft affinity: Ray avoids
        draining nodes) and rebuilds itself from the lineage; the trainer takes fulls meanwhile."""
        r = self.known()
        if r is None or r.node not in draining or not self._restart():
            return
        log.warning("ray_ckpt coordinator: run %r: the state-tier replica is on draining node %s: restarting it on "
                    "a node that stays (it rebuilds from the lineage; the trainer takes fulls meanwhile)",
                    self.run, r.node[:12])
        self.replica = Replica(r.generation, r.step, r.node, False, "moving off a draining node")

    def status(self, recoverable: int | None) -> dict | None:
        """The replica's figures for the coordinator's status (``lag``: steps behind ``recoverable``)."""
        r = self.replica
        return None if r is None else {"generation": r.generation, "step": r.step, "node": r.node, "ok": r.ok,
                                       "reason": r.reason, "lag": (recoverable or 0) - r.step}
