"""What a run's coordinator keeps up besides its lineage: the pace of its workers' reports
(:class:`ReportPacing`), its Ray metrics (:class:`MetricsGate`) and the heartbeat of the run's writer lease
(:class:`LeaseKeeper`).

Each runs in the coordinator actor's thread: :class:`ReportPacing` in each worker's ``update`` call, the other two
in the calls the actor's ticker thread makes of it (``publish_metrics``, ``renew_lease``: actor calls, so they run
between the others). No Ray here: the metrics and the lease are passed in.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ray_ckpt.engine.lease import LeaseLost
from ray_ckpt.storage import StorageError
from ray_ckpt.runtime import metrics as _metrics

log = logging.getLogger("ray_ckpt")

#: the worker update calls per second the coordinator asks of all its reporting workers together: each call
#: costs the actor a fixed amount besides its messages, so a wide job's workers report less often each (their
#: reports batched into fewer calls) instead of one call per node every 50 ms (docs/scale.md)
REPORT_CALLS_PER_S = 200.0
#: the shortest report interval a worker is asked for (seconds): a narrow job's coordinator lags by at most this
MIN_REPORT_INTERVAL_S = 0.05
#: a node that sent no update for this long no longer counts towards the report interval
_REPORTER_TTL_S = 5.0
#: without new reports, the metrics are still recomputed this often (seconds)
_METRICS_QUIET_S = 15.0


class ReportPacing:
    """How often each reporting worker should call the coordinator's ``update``. Coordinator actor thread."""

    def __init__(self):
        self.reporters: dict[str, float] = {}   # node -> when its last update arrived (monotonic)
        self._pruned = 0.0

    def interval(self, node_id: str | None = None, now: float | None = None) -> float:
        """``MIN_REPORT_INTERVAL_S``, or the nodes that reported within ``_REPORTER_TTL_S`` divided by
        ``REPORT_CALLS_PER_S`` when more, so that the calls into the actor stay near ``REPORT_CALLS_PER_S``
        however wide the job (its view lags by about one interval). ``node_id``: the node whose update arrived
        now."""
        now = time.monotonic() if now is None else now
        if node_id is not None:
            self.reporters[node_id] = now
        if now - self._pruned > 1.0:
            self._pruned = now
            for n in [n for n, t in self.reporters.items() if now - t > _REPORTER_TTL_S]:
                del self.reporters[n]
        return max(MIN_REPORT_INTERVAL_S, len(self.reporters) / REPORT_CALLS_PER_S)


class MetricsGate:
    """The run's lineage figures as Ray metrics (:mod:`ray_ckpt.runtime.metrics`), computed only when reports
    arrived since the last time (:meth:`changed`), else every ``_METRICS_QUIET_S``. Coordinator actor thread."""

    def __init__(self, run: str):
        self.deltas = _metrics.CounterDeltas({"run": run})
        self.changes = 0            # reports and failures seen
        self._published = -1        # ``changes`` at the last publication
        self._t = 0.0

    def changed(self) -> None:
        """A report or a failure arrived: the figures may differ."""
        self.changes += 1

    def publish(self, status: Callable[[], dict], now: float | None = None) -> bool:
        """Publish ``status()`` when due; returns whether it was computed. Never raises (metrics never break
        the coordinator)."""
        now = time.monotonic() if now is None else now
        if self.changes == self._published and now - self._t < _METRICS_QUIET_S:
            return False
        self._t, self._published = now, self.changes
        try:
            _metrics.coordinator_metrics(status(), self.deltas)
        except Exception as e:  # noqa: BLE001 - metrics never break the coordinator
            log.debug("ray_ckpt coordinator: metrics not published: %s", e)
        return True


class LeaseKeeper:
    """The run's writer lease (:class:`~ray_ckpt.engine.lease.Lease`, taken by ``get_or_create_coordinator``),
    renewed here. A lease another job took over is logged as an ERROR and kept in :attr:`lost`. Coordinator actor
    thread."""

    def __init__(self, lease):
        self.lease = lease
        self.lost: str | None = None
        self._failing = False   # the last renewal met a storage error (logged once as a WARNING)

    def renew(self) -> None:
        """Heartbeat (the lease writes at most once a ``ttl/3``). A storage error (an outage) is logged once as a
        WARNING, then at INFO until a renewal succeeds, and retried at the next tick (the lease outlives a few
        missed heartbeats); anything else is a bug, logged as an ERROR with its type, and retried too."""
        if self.lost is not None:
            return
        try:
            self.lease.renew()
            if self._failing:
                log.warning("ray_ckpt coordinator: the writer lease is renewed again")
            self._failing = False
        except LeaseLost as e:
            self.lost = str(e)
            log.error("ray_ckpt coordinator: %s", e)
        except StorageError as e:
            log.log(logging.INFO if self._failing else logging.WARNING,
                    "ray_ckpt coordinator: storage error renewing the writer lease (%s); retrying", e)
            self._failing = True
        except Exception as e:  # noqa: BLE001 - not a storage fault: a bug, logged with its type; the next tick retries
            log.error("ray_ckpt coordinator: lease renewal failed (%s: %s); retrying", type(e).__name__, e)

    def release(self) -> None:
        """Delete the lease (end of the run)."""
        self.lease.release()
