"""A drain notice as a sink sees it: the node goes away at a deadline, and from when on each step must be safe.

Pure (no Ray): the notice, its deadline on the monotonic clock, the margin before it from which every step waits
until it is safe, and the window from which every step is recorded (the overhead budget reads it). Every sink
(:class:`ray_ckpt.engine.writer.BoundedSink`: the engine's writer, the Ray runtime's sender) holds one
:class:`DrainNotice`; who *hears* of a drain lives above: the Ray runtime's watches of the GCS and of Ray Train
(:mod:`ray_ckpt.runtime.drain`) and the coordinator's control answer (the sender) call :meth:`DrainNotice.set`
through the sink's ``notice``.

Call order: ``set`` (any thread: a watch, the sender) → ``every_step_due`` (training thread, every step, O(1),
through the sink's ``drain_due``) and ``sync_due`` (training thread, after each submit) → ``waited`` (training
thread, after a step waited until it was safe).
"""
from __future__ import annotations

import time
from typing import Callable

#: a drain notice (the node goes away at a deadline): at most this many seconds before the deadline, and from the
#: notice on when it names none, a step returns to the training loop only once it is safe (see DrainNotice)
SYNC_BEFORE_DEADLINE_S = 10.0
#: ... and at least this many; in between, SYNC_WAIT_FACTOR times the longest wait for safety seen under the notice
SYNC_MIN_S = 5.0
SYNC_WAIT_FACTOR = 4.0


class DrainNotice:
    """The drain notice in force for one sink, or none.

    From the notice on, the sink hands every step over at once instead of batching it; the first step submitted
    after the notice, and every step within :meth:`sync_margin` of the deadline (from the notice on without one),
    also waits until it is safe, so that a process killed at the deadline has lost no step it captured. What that
    costs the training thread is one write (or hand-off) per step, only then: the margin is
    :data:`SYNC_WAIT_FACTOR` times the longest such wait (the first one measures it), within
    [:data:`SYNC_MIN_S`, :data:`SYNC_BEFORE_DEADLINE_S`]: a long notice (a cloud's two minutes) is not spent waiting
    on every step, while the last seconds leave a loaded machine time to empty what was handed over at once.

    ``safe_latency()``: seconds a recent hand-off took to become safe (None where the sink does not measure it),
    the other measure the margin is made of. The caller guards :meth:`set` with its own lock when its background
    thread must wake up on a change (the sinks do)."""

    def __init__(self, safe_latency: Callable[[], float | None] = lambda: None) -> None:
        self.safe_latency = safe_latency
        self.info: dict | None = None           #: the notice in force (what ``noticed`` copies), or None
        self.deadline: float | None = None      #: its deadline on the monotonic clock (None: none given)
        self.wait_s: float | None = None        #: the longest wait for safety under it (None: none yet)

    def set(self, info: dict | None, deadline: float | None = None) -> None:
        """This node drains (``info``; ``deadline`` on the monotonic clock) or, with ``info=None``, no longer does.
        Any thread (under the sink's lock)."""
        self.info, self.deadline = (None, None) if info is None else (dict(info), deadline)
        self.wait_s = None

    @property
    def active(self) -> bool:
        """Whether a notice is in force (O(1), no copy)."""
        return self.info is not None

    def copy(self) -> dict | None:
        """The notice in force (a copy), or None."""
        n = self.info
        return None if n is None else dict(n)

    def sync_margin(self) -> float:
        """Seconds before the deadline from which every step submitted waits until it is safe:
        :data:`SYNC_WAIT_FACTOR` times the longest wait for safety seen under the notice or ``safe_latency()``,
        within [:data:`SYNC_MIN_S`, :data:`SYNC_BEFORE_DEADLINE_S`] (the longest while neither is known). Any
        thread."""
        known = [x for x in (self.wait_s, self.safe_latency()) if x is not None]
        if not known:
            return SYNC_BEFORE_DEADLINE_S
        return min(SYNC_BEFORE_DEADLINE_S, max(SYNC_MIN_S, SYNC_WAIT_FACTOR * max(known)))

    def every_step_due(self) -> bool:
        """Whether the notice asks for every step to be recorded now (the overhead budget reads it every step;
        O(1)): from the notice on when it names no deadline, otherwise from :data:`SYNC_BEFORE_DEADLINE_S` before
        it (the longest :meth:`sync_margin`), so that a budget that records a full every k steps keeps doing so
        through a long notice (a cloud's two minutes) and leaves the time a full of the whole state, then each
        step's record, takes to be made safe on a node that stays — which no hand-off of the every-k mode
        measures (its fulls are only written)."""
        if self.info is None:
            return False
        d = self.deadline
        return d is None or time.monotonic() >= d - SYNC_BEFORE_DEADLINE_S

    def sync_due(self) -> bool:
        """Whether the step just submitted waits until it is safe (a notice is in force). Training thread."""
        if self.info is None:
            return False
        d = self.deadline
        if d is None or self.wait_s is None:
            return True
        return time.monotonic() >= d - self.sync_margin()

    def waited(self, info: dict | None, seconds: float) -> None:
        """A step waited ``seconds`` until it was safe under the notice ``info`` (the one in force when it began;
        a later notice measures its own). Training thread."""
        if self.info is info:
            self.wait_s = max(self.wait_s or 0.0, seconds)
