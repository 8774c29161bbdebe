"""A persistence worker's messages to its coordinator (:mod:`ray_ckpt.runtime.reports`): one queue, in order, sent
by one thread in batches — one ``update`` call per report interval, none while the last one is unanswered (a
coordinator that is behind gets fewer, larger calls) — and the interval the coordinator asks for in its answers.

No Ray: the worker (:mod:`ray_ckpt.runtime.worker`) passes in how to find the coordinator and how to look at call
answers (:class:`ray_ckpt.runtime.calls.Calls`). The channel shares the worker's lock (``cv``): :meth:`add` runs
on any of the worker's threads, :meth:`take` and :meth:`send` on its report thread, :meth:`await_delivery` on the
actor thread of a flush.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from ray_ckpt.runtime.calls import RAY, Calls
from ray_ckpt.runtime.reports import pack_reports

log = logging.getLogger("ray_ckpt")

#: messages to the coordinator are sent at most this often (one call each time), so that the coordinator's view
#: lags the workers by at most this much (a restore right after a crash plans from it)
REPORT_INTERVAL_S = 0.05
DELIVERY_WAIT_S = 30.0       # flush: how long to wait for the coordinator to apply the last report


class ReportChannel:
    def __init__(self, node_id: str, cv, coordinator_of: Callable[[], object], calls: Calls = RAY) -> None:
        self.node_id = node_id
        self._cv = cv
        self._coordinator_of = coordinator_of   # () -> the run's coordinator (a lookup)
        self._coordinator = None
        self._calls = calls
        self.pending: list = []          #: messages for the coordinator, in order
        self.sending = False             #: taken from ``pending``, the update call not made yet
        self.last = None                 #: reference of the newest update call
        self.interval = REPORT_INTERVAL_S   #: as the coordinator asks (its answer to update)
        self._unanswered: collections.deque = collections.deque(maxlen=64)   # update calls not answered yet

    def coordinator(self):
        """The run's coordinator (looked up once, again after a failed call)."""
        if self._coordinator is None:
            self._coordinator = self._coordinator_of()
        return self._coordinator

    def add(self, msg) -> None:
        """Queue one message (any worker thread; takes the lock, which may be held already)."""
        with self._cv:
            self.pending.append(msg)
            self._cv.notify_all()

    def idle(self) -> bool:
        """Whether every message was handed to an update call. Under the lock."""
        return not self.pending and not self.sending

    def unanswered(self) -> bool:
        """Whether the newest update call is still unanswered. Report thread; never waits."""
        ref = self.last
        if ref is None:
            return False
        try:
            return not self._calls.ready([ref])
        except Exception:  # noqa: BLE001 - a ref that cannot be waited on is not waited for
            return False

    def take_interval(self) -> None:
        """Adopt the report interval the coordinator asked for in its newest answer (at most 10 s). A busy
        coordinator answers late: the calls still unanswered (at most 64) are looked at, not only the last one.
        Report thread; never waits."""
        pending = self._unanswered
        if self.last is not None and (not pending or pending[-1] is not self.last):
            pending.append(self.last)
        if not pending:
            return
        ready = self._calls.ready(list(pending))
        if ready:
            try:
                got = self._calls.get(ready[-1])
                if isinstance(got, (int, float)) and got > 0:
                    self.interval = min(float(got), 10.0)
            except Exception:  # noqa: BLE001 - a restarting coordinator: keep the interval
                pass
            done = set(ready)
            self._unanswered = collections.deque((r for r in pending if r not in done), maxlen=64)

    def take(self, busy: bool) -> list:
        """The messages to send now (none while the last call is unanswered: ``busy``). Under the lock."""
        msgs, self.pending = ([], self.pending) if busy else (self.pending, [])
        self.sending = bool(msgs)
        return msgs

    def send(self, msgs: list) -> bool:
        """One update call with ``msgs`` (none when empty); returns whether it was made (a coordinator that cannot
        be reached rebuilds from the workers' inventories). Report thread."""
        if not msgs:
            return False
        ref = None
        try:
            ref = self.coordinator().update.remote(self.node_id, pack_reports(msgs))
        except Exception as e:  # noqa: BLE001 - the coordinator is restarting: it rebuilds from inventories
            log.warning("ray_ckpt: coordinator unreachable (%s); it will rebuild from inventories", e)
            self._coordinator = None
        with self._cv:
            self.last = ref
            self.sending = False
            self._cv.notify_all()
        return ref is not None

    def await_delivery(self, ref, deadline: float) -> None:
        """Wait until the coordinator has applied the update call ``ref`` (its calls run one at a time, in order
        per caller): after a flush its status and GC see every object the worker made durable. A coordinator that
        is restarting rebuilds from inventories instead; that is not waited for beyond ``deadline``. Actor
        thread (flush)."""
        if ref is None:
            return
        try:
            self._calls.get(ref, timeout=max(0.1, min(DELIVERY_WAIT_S, deadline - time.monotonic())))
        except Exception as e:  # noqa: BLE001 - restarting or slow: it rebuilds from inventories
            log.info("ray_ckpt: the coordinator has not confirmed this worker's last report: %s", e)
