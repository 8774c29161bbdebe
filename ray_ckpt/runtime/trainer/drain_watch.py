"""The training process's drain watch: a thread that turns drain notices into its sink's notice — this node's
drain in the GCS (``runtime="local"``; a ``runtime="ray"`` sink hears of it from its coordinator) and, in a Ray
Train worker, a preemption of any node of the worker group. What the notice then does (margins, the every-step
window) is :mod:`ray_ckpt.engine.drains`; the GCS reading is :mod:`ray_ckpt.runtime.drain`. Training process.
"""
from __future__ import annotations

import logging
import sys
import threading

import ray

from ray_ckpt.runtime.drain import POLL_S, deadline_monotonic, draining_nodes, notice_info

log = logging.getLogger("ray_ckpt")

#: the module of a Ray Train (V2) worker's own context, loaded in every Ray Train worker
_TRAIN_CONTEXT = "ray.train.v2._internal.execution.context"


def train_group_preemption() -> dict | None:
    """In a Ray Train worker: the preemption Ray Train's ``PreemptionWatcher`` marked on this worker (a node of its
    worker group drains; Ray Train restarts the whole group at the deadline), read from the worker's own context:
    what ``ray.train.get_preemption_info()`` returns, without its barrier across the group. None elsewhere, or
    when there is none. Training thread or any thread of the worker."""
    if _TRAIN_CONTEXT not in sys.modules:   # not a Ray Train worker (never import Ray Train for this)
        return None
    try:
        from ray.train.v2._internal.execution.context import get_train_context   # no public call without a barrier
        info = get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001 - not a Ray Train (V2) worker
        return None
    if info is None:
        return None
    nodes = list(info.preempted_node_ids)
    out = notice_info(nodes[0] if nodes else "", int(info.deadline_ms or 0))
    out.update(source="ray_train", nodes=nodes, ranks=list(info.preempted_ranks))
    return out


class SinkWatch:
    """A daemon thread that turns drain notices into ``sink.notice(...)`` for one sink of this process, every
    :data:`POLL_S`: this node's drain in the GCS (``node=True``: a ``runtime="local"`` writer; a
    ``runtime="ray"`` sink hears of it from its coordinator) and, in a Ray Train worker, a preemption of any
    node of its worker group (Ray Train restarts every worker at the deadline, so every rank's steps must be
    safe by then). It ends when the sink is closed, or on :meth:`stop`. Any process connected to Ray."""

    def __init__(self, sink, node: bool, interval: float = POLL_S):
        self.sink, self.node, self.interval = sink, node, interval
        self.node_id = ray.get_runtime_context().get_node_id()
        self._stop = threading.Event()
        self._mine = False   # the notice in force is this watch's
        threading.Thread(target=self._loop, daemon=True, name="ray_ckpt-drain-sink").start()

    def stop(self) -> None:
        self._stop.set()

    def _current(self) -> dict | None:
        info = train_group_preemption()
        if info is None and self.node:
            deadline = draining_nodes().get(self.node_id)
            if deadline is not None:
                info = dict(notice_info(self.node_id, deadline), source="node")
        return info

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.sink.closed:
                return
            try:
                info = self._current()
                if info is not None and self.sink.noticed is None:
                    log.warning("ray_ckpt: %s: from now on every step is handed over at once, and near the "
                                "deadline each step waits until it is safe",
                                f"node {info['node'][:12]} of this worker group drains (Ray Train preemption)"
                                if info["source"] == "ray_train" else f"this node ({self.node_id[:12]}) drains")
                    self._mine = True
                    self.sink.notice(info, deadline_monotonic(info["deadline_ms"] or 0))
                elif info is None and self._mine and self.sink.noticed is not None:
                    log.info("ray_ckpt: the drain is over; batching again")
                    self._mine = False
                    self.sink.notice(None)
            except Exception as e:  # noqa: BLE001 - the watch survives; the next poll retries
                log.warning("ray_ckpt: drain watch failed: %s", e)


def watch_sink(sink, *, node: bool) -> SinkWatch | None:
    """A :class:`SinkWatch` for ``sink`` when this process is connected to Ray (None otherwise)."""
    if not ray.is_initialized() or (not node and _TRAIN_CONTEXT not in sys.modules):
        return None   # runtime="ray" outside Ray Train: the coordinator's control answer brings the node's drain
    return SinkWatch(sink, node)
