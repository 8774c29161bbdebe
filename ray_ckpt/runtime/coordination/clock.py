"""RunClock: a run's failures and events, how long it has been running, and the overhead budget's state — what a
run's next attempt needs to pick its recording granularity (:meth:`RunClock.granularity`: the budget's state and
the observed mean time between failures).

Runs in the coordinator actor's thread; pure (no Ray, no storage): tests pass the times.
"""
from __future__ import annotations

import math
import time


def _num(v) -> float:
    """``v`` as a non-negative finite float (0 otherwise): a figure of a trainer report."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0


class RunClock:
    """Failures, events and running time of one run, from ``started_at`` (wall clock). Coordinator actor thread.

    Call order: :meth:`observe_trainer` with each trainer report (from ``control``), :meth:`record_failure` and
    :meth:`record_event` from the Ray Train callback, :meth:`granularity` at a training process's attach."""

    def __init__(self, started_at: float | None = None):
        self.started_at = time.time() if started_at is None else started_at
        self.failures: list[dict] = []
        self.events: list[dict] = []
        self.down: list[list] = []                 # [failure time, the next attach's time or None]
        self.running_since: float | None = None    # the trainer's first measured window (its steps began)
        self.budget: dict | None = None            # the overhead budget's state in the latest trainer report

    def observe_trainer(self, trainer: dict | None, now: float | None = None) -> None:
        """A trainer's measured window (``steps``, ``wall_s``, ..., ``granularity``: the budget's state)."""
        if not trainer:
            return
        if self.running_since is None:   # steps began about a window before (not the start-up before them)
            now = time.time() if now is None else now
            self.running_since = now - _num(trainer.get("steps")) * _num(trainer.get("wall_s"))
        g = trainer.get("granularity")
        if isinstance(g, dict):
            self.budget = g

    def record_failure(self, info: dict, now: float | None = None) -> float:
        """A worker-group failure; returns its time."""
        t = time.time() if now is None else now
        self.failures.append({"time": t, **info})
        self.down.append([t, None])
        return t

    def record_event(self, info: dict, now: float | None = None) -> None:
        """Another run event (a resize...)."""
        self.events.append({"time": time.time() if now is None else now, **info})

    def granularity(self, now: float | None = None) -> dict | None:
        """The overhead budget's state in the trainer's latest report (``BudgetPolicy.state``), with ``mtbf_s``:
        the run's observed mean running time between worker-group failures (its time since its trainer's first
        steps, less each failure's time to the next attach, over the failures recorded; absent before the
        first). None when there is neither. Called at an attach: the failures' down times end now."""
        out = dict(self.budget or {})
        if self.failures:
            now = time.time() if now is None else now
            for d in self.down:          # an attach after a failure: the run is up again
                if d[1] is None:
                    d[1] = now
            since = self.running_since or self.started_at
            running = now - since - sum(up - max(down, since) for down, up in self.down if up > since)
            out["mtbf_s"] = max(1e-3, running) / len(self.failures)
        return out or None
