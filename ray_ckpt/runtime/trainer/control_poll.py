"""The sender's full-checkpoint control: every :data:`CONTROL_S` one ask (at most one in flight) for whether the
state tier takes the policy's fulls (``delegate``), whether a full is wanted now (a gap, a lost replica) and which
nodes drain. A shard run asks its node's worker, whose host relays the asks of all the node's ranks to the
coordinator in one call (:meth:`ray_ckpt.runtime.worker.PersistenceWorker.control`); when the relay has no fresh
answer or does not answer within :data:`RELAY_WAIT_S`, that ask goes to the coordinator directly (a rank never
waits on a lost worker).

Runs on the sender thread (:class:`ray_ckpt.runtime.trainer.sink.RaySink`); the training thread reads
:attr:`ControlPoll.state` (O(1)). Ray is reached through the handles and :class:`ray_ckpt.runtime.calls.Calls`
only: a unit test passes fakes.
"""
from __future__ import annotations

import logging
from typing import Callable

from ray_ckpt.runtime.calls import RAY, Calls

log = logging.getLogger("ray_ckpt")

CONTROL_S = 0.5         # how often the sender asks the coordinator for full-checkpoint control
RELAY_WAIT_S = 2.0      # a relayed control ask unanswered this long is given up for a direct one


class ControlPoll:
    """``coordinator``: the run's coordinator; ``worker()``: this node's worker now; ``report()``: the trainer's
    report to forward with the next ask (or None); ``on_draining(nodes)``: the draining nodes of each answer;
    ``relay``: ask the node's worker (shard runs)."""

    def __init__(self, run: str, generation: int, coordinator, *, worker: Callable[[], object],
                 report: Callable[[], dict | None], on_draining: Callable[[dict], None], relay: bool,
                 calls: Calls = RAY) -> None:
        self.run, self.generation = run, generation
        self.coordinator = coordinator
        self._worker = worker
        self._report = report
        self._on_draining = on_draining
        self.relay = relay
        self._calls = calls
        #: the latest answer as the training thread reads it (``want_full`` cleared once taken)
        self.state = {"want_full": False, "delegate": False}
        self.ref = None           #: the ask in flight
        self.t = 0.0              #: when the last ask was made (monotonic)
        self.via = None           #: the worker while an ask is relayed
        self.direct = False       #: the next ask goes to the coordinator
        self.asks = {"relayed": 0, "direct": 0}   #: control answers received, by path

    def poll(self, now: float) -> None:
        """Collect the answer of the ask in flight (never waits), then ask again when due."""
        if self.ref is not None:
            relayed = self.via is not None
            if not self._calls.ready([self.ref]):
                if relayed and now - self.t > RELAY_WAIT_S:
                    # the node's worker host does not answer (restarting, gone): ask the coordinator directly
                    self.via, self.ref = None, None
                    self.t, self.direct = 0.0, True
            else:
                ref, self.ref = self.ref, None
                try:
                    got = self._calls.get(ref)
                    if got is None:   # the relay has no fresh answer: ask the coordinator directly, now
                        self.t, self.direct = 0.0, True
                    else:
                        self._apply(got, relayed)
                except Exception as e:  # noqa: BLE001 - the coordinator restarts: keep the last answer
                    log.debug("ray_ckpt: coordinator control unavailable: %s", e)
                    if relayed:
                        self.t, self.direct = 0.0, True
        self._ask(now)

    def _apply(self, got: dict, relayed: bool) -> None:
        self.asks["relayed" if relayed else "direct"] += 1
        self.state["delegate"] = got["delegate"]
        for first, last in got.get("gaps", []):
            log.warning("ray_ckpt: lost steps %d..%d of run %r (held nowhere, never written): they cannot be "
                        "restored; taking a full checkpoint now", first, last, self.run)
        if got["want_full"]:
            self.state["want_full"] = True
        self._on_draining(got.get("draining") or {})

    def _ask(self, now: float) -> None:
        """One ask every :data:`CONTROL_S`, at most one in flight."""
        if self.ref is not None or now - self.t < CONTROL_S:
            return
        self.t = now
        direct, self.direct = self.direct, False
        try:
            if self.relay and not direct:
                self.via = self._worker()
                self.ref = self.via.control.remote(self.generation, self._report())
            else:
                self.via = None
                self.ref = self.coordinator.control.remote(self.generation, self._report())
        except Exception:  # noqa: BLE001
            self.ref = None
