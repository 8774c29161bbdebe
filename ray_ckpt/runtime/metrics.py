"""ray_ckpt's runtime state as Ray metrics (``ray.util.metrics``): the Ray dashboard and Prometheus see them.

Ray exports application metrics from every process through its node's metrics agent (Prometheus format on the
node's ``MetricsExportPort``) with the prefix ``ray_``, and counters with the suffix ``_total``: the counter
``ray_ckpt_steps`` is scraped as ``ray_ray_ckpt_steps_total``, the gauge ``ray_ckpt_durable_lag_steps`` as
``ray_ray_ckpt_durable_lag_steps``. Every metric has the tag ``run``; per-node ones also ``node``. Names and
meanings (the README lists them with sample queries):

===================================  =========  ==================================================================
``ray_ckpt_capture_seconds``         histogram  training thread time of one step's capture (pre + post hooks)
``ray_ckpt_stall_seconds``     counter    training thread time spent waiting on backpressure
``ray_ckpt_steps``             counter    optimizer steps captured
``ray_ckpt_memory_bytes``            gauge      bytes held in this node's object store (memory tier)
``ray_ckpt_memory_objects``          gauge      objects held in this node's object store
``ray_ckpt_written_bytes``     counter    bytes written to durable storage by this node's worker
``ray_ckpt_written_objects``   counter    objects written to durable storage
``ray_ckpt_write_seconds``     counter    time spent writing (bandwidth = rate(bytes) / rate(seconds))
``ray_ckpt_write_queue_chunks``      gauge      chunks waiting for their durable write
``ray_ckpt_recoverable_step``        gauge      the newest step a restore can reach (any tier)
``ray_ckpt_durable_step``            gauge      the newest step that restores from storage alone
``ray_ckpt_durable_lag_steps``       gauge      recoverable − durable: steps only the memory tier holds
``ray_ckpt_memory_only_steps``       gauge      steps of the current generation restorable only from memory
``ray_ckpt_replica_lag_steps``       gauge      steps the state-tier replica is behind the recoverable step
``ray_ckpt_gaps``                    gauge      lost step ranges seen by the coordinator
``ray_ckpt_failures``          counter    failures recorded (worker deaths, node losses)
``ray_ckpt_restores``          counter    restores planned by the coordinator
``ray_ckpt_restore_seconds``         histogram  wall time of a restore (read + replay + install)
===================================  =========  ==================================================================

Runs in the process that records: the sender thread of a training process, the PersistenceWorker's report
thread, the coordinator actor. Recording never raises into the caller (a metrics failure is logged once).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("ray_ckpt")

_SECONDS_BOUNDS = [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]

# name -> (kind, description, tag keys)
SPECS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "ray_ckpt_capture_seconds": ("histogram", "training-thread time of one step's capture", ("run",)),
    "ray_ckpt_stall_seconds": ("counter", "training-thread time waiting on backpressure", ("run",)),
    "ray_ckpt_steps": ("counter", "optimizer steps captured", ("run",)),
    "ray_ckpt_memory_bytes": ("gauge", "bytes held in the node's object store (memory tier)", ("run", "node")),
    "ray_ckpt_memory_objects": ("gauge", "objects held in the node's object store", ("run", "node")),
    "ray_ckpt_written_bytes": ("counter", "bytes written to durable storage", ("run", "node")),
    "ray_ckpt_written_objects": ("counter", "objects written to durable storage", ("run", "node")),
    "ray_ckpt_write_seconds": ("counter", "time spent writing to durable storage", ("run", "node")),
    "ray_ckpt_write_queue_chunks": ("gauge", "chunks waiting for their durable write", ("run", "node")),
    "ray_ckpt_recoverable_step": ("gauge", "newest recoverable step (any tier)", ("run",)),
    "ray_ckpt_durable_step": ("gauge", "newest step restorable from storage alone", ("run",)),
    "ray_ckpt_durable_lag_steps": ("gauge", "steps held only by the memory tier (recoverable - durable)", ("run",)),
    "ray_ckpt_memory_only_steps": ("gauge", "steps restorable only from the memory tier", ("run",)),
    "ray_ckpt_replica_lag_steps": ("gauge", "steps the state-tier replica is behind", ("run",)),
    "ray_ckpt_gaps": ("gauge", "lost step ranges seen by the coordinator", ("run",)),
    "ray_ckpt_failures": ("counter", "failures recorded by the coordinator", ("run",)),
    "ray_ckpt_restores": ("counter", "restores planned by the coordinator", ("run",)),
    "ray_ckpt_restore_seconds": ("histogram", "wall time of a restore", ("run",)),
}

_lock = threading.Lock()
_made: dict[str, Any] = {}
_warned = False


def _metric(name: str):
    with _lock:
        m = _made.get(name)
        if m is None:
            from ray.util import metrics as rm
            kind, desc, tags = SPECS[name]
            if kind == "histogram":
                m = rm.Histogram(name, description=desc, boundaries=_SECONDS_BOUNDS, tag_keys=tags)
            elif kind == "counter":
                m = rm.Counter(name, description=desc, tag_keys=tags)
            else:
                m = rm.Gauge(name, description=desc, tag_keys=tags)
            _made[name] = m
        return m


def _safe(fn):
    def wrapper(*args, **kwargs):
        global _warned
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - metrics never break checkpointing
            if not _warned:
                _warned = True
                log.warning("ray_ckpt: could not record metrics (%s); continuing without them", e)
    return wrapper


@_safe
def observe(name: str, values, tags: dict) -> None:
    """Histogram observations."""
    m = _metric(name)
    for v in values:
        m.observe(float(v), tags=tags)


@_safe
def add(name: str, value: float, tags: dict) -> None:
    """Counter increment (ignored when not positive)."""
    if value > 0:
        _metric(name).inc(float(value), tags=tags)


@_safe
def set_gauges(values: dict, tags: dict) -> None:
    for name, v in values.items():
        if v is not None:
            _metric(name).set(float(v), tags=tags)


class CounterDeltas:
    """Turns monotonic totals (a stats dict) into counter increments: ``publish({"name": total})``."""

    def __init__(self, tags: dict):
        self.tags = tags
        self._last: dict[str, float] = {}

    def start_at(self, name: str, total: float) -> None:
        """Count ``name`` from ``total`` on: the next :meth:`publish` adds only what grew past it (a resumed run's
        step count is not new work)."""
        self._last[name] = float(total)

    def publish(self, totals: dict) -> None:
        for name, total in totals.items():
            prev = self._last.get(name, 0.0)
            self._last[name] = float(total)
            add(name, float(total) - prev, self.tags)


def worker_metrics(stats: dict, deltas: CounterDeltas) -> None:
    """A PersistenceWorker's ``stats()`` (its report thread, about once a second)."""
    set_gauges({"ray_ckpt_memory_bytes": stats.get("held_bytes"), "ray_ckpt_memory_objects": stats.get("held_objects"),
                "ray_ckpt_write_queue_chunks": stats.get("queued_chunks")}, deltas.tags)
    deltas.publish({"ray_ckpt_written_bytes": stats.get("bytes_written", 0),
                    "ray_ckpt_written_objects": stats.get("objects_written", 0),
                    "ray_ckpt_write_seconds": stats.get("write_seconds", 0.0)})


def coordinator_metrics(status: dict, deltas: CounterDeltas) -> None:
    """The coordinator's ``status()`` (after a batch of reports, at most once a second)."""
    rec, dur = status.get("recoverable_step"), status.get("durable_step")
    replica = status.get("replica") or {}
    memory_only = sum(b - a + 1 for a, b in (status.get("restorable") or {}).get("memory", []))
    set_gauges({"ray_ckpt_recoverable_step": rec, "ray_ckpt_durable_step": dur,
                "ray_ckpt_durable_lag_steps": (rec - (dur if dur is not None else -1)) if rec is not None else None,
                "ray_ckpt_memory_only_steps": memory_only, "ray_ckpt_replica_lag_steps": replica.get("lag"),
                "ray_ckpt_gaps": len(status.get("gaps", []))}, deltas.tags)
    deltas.publish({"ray_ckpt_failures": status.get("failures", 0)})
