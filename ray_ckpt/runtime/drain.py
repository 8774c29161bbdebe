"""Node drains: Ray's notice that a node will go away (preemption, or the autoscaler removing it) with a deadline.

Ray 2.60 marks a node as *draining* in the GCS when the autoscaler, a cloud's spot/preemption handler or
``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds S`` calls DrainNode; the node
keeps running until whoever drained it removes it (at the deadline, or when it is idle). New actors are no longer
placed there. ray_ckpt reads the draining nodes and their deadlines (:func:`draining_nodes`: one cheap GCS
call; the same call Ray Train's ``PreemptionWatcher`` and Ray Data make) and reacts without any call
from the user:

* the run's coordinator polls at :data:`POLL_S` (:func:`start_coordinator_watch`); on a new drain it tells every
  node worker (peers are chosen among the nodes that stay; the draining node writes what it received at once;
  chunks whose second copy is there are copied to a node that stays), moves the state-tier replica off the
  node, and records the drain (:mod:`ray_ckpt.lineage.drains`, shown by ``ray-ckpt ls``);
* the training process hears of its own node's drain through the coordinator's control answer (runtime="ray")
  or a watch of its own (:mod:`ray_ckpt.runtime.trainer.drain_watch`: runtime="local" in a process connected to
  Ray, and every Ray Train worker); its sink then hands every step over at once and, near the deadline, returns
  from a step only once it is safe (the notice, its margins and the every-step window:
  :mod:`ray_ckpt.engine.drains`).

Here: what the actors and the training process share (the GCS drain state, a notice's fields) and the actors'
watch (the coordinator's).

Nothing here calls ``ray.train.get_preemption_info()``: that call is a barrier across the worker group.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import ray

from ray_ckpt.runtime import lineages

log = logging.getLogger("ray_ckpt")

#: seconds between two reads of the GCS drain state (one call each; nothing else happens while no node drains)
POLL_S = float(os.environ.get("RAY_CKPT_DRAIN_POLL_S", "1.0"))


def draining_nodes() -> dict[str, int]:
    """``{node_id_hex: deadline_ms}`` of the nodes Ray is draining (0: no deadline). Any process connected to
    Ray; ``{}`` when the GCS cannot be asked (the reader then sees no drain, as before this existed)."""
    try:
        from ray._private import state as _ray_state   # what ray.train / ray.data read: no public call in 2.60
        return {str(k): int(v or 0) for k, v in (_ray_state.state.get_draining_nodes() or {}).items()}
    except Exception as e:  # noqa: BLE001 - not connected, or a Ray without the call
        log.debug("ray_ckpt: drain state unavailable: %s", e)
        return {}


def notice_info(node: str, deadline_ms: int, now: float | None = None) -> dict:
    """What :meth:`ray_ckpt.Checkpointer.preempted` returns for a drain of ``node``: ``{"node", "deadline_ms",
    "remaining_s"}`` (``deadline_ms`` and ``remaining_s`` None without a deadline)."""
    now = time.time() if now is None else now
    return {"node": node, "deadline_ms": deadline_ms or None,
            "remaining_s": (deadline_ms / 1000.0 - now) if deadline_ms else None}


def deadline_monotonic(deadline_ms: int) -> float | None:
    """A GCS deadline (unix ms, 0: none) on this process's monotonic clock."""
    if not deadline_ms:
        return None
    return time.monotonic() + (deadline_ms / 1000.0 - time.time())


class NodeWatch:
    """A daemon thread that polls :func:`draining_nodes` every ``interval`` seconds and calls
    ``on_change(drains)`` (the whole ``{node: deadline_ms}``) whenever it changes. Any process connected to Ray.
    ``on_change`` runs in the watch thread; an exception in it is logged and the watch goes on."""

    def __init__(self, on_change: Callable[[dict], None], interval: float = POLL_S, name: str = "ray_ckpt-drain",
                 on_tick: Callable[[], bool] | None = None):
        self.on_change, self.interval, self.on_tick = on_change, interval, on_tick
        self._stop = threading.Event()
        self._last: dict = {}
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if not ray.is_initialized():
                continue
            drains = draining_nodes()
            try:
                if drains != self._last:
                    self._last = drains
                    self.on_change(dict(drains))
                if self.on_tick is not None and not self.on_tick():
                    return
            except Exception as e:  # noqa: BLE001 - the watch survives a failed reaction; the next change retries
                log.warning("ray_ckpt: reacting to a node drain failed: %s", e)


def start_coordinator_watch(run: str) -> NodeWatch | None:
    """The coordinator's watch (started in its constructor): each change of the drain state becomes one call
    of its ``drains_changed``; while a drain is open, ``drain_progress`` is called every poll. None outside an
    actor (tests build the class directly)."""
    try:
        me = ray.get_runtime_context().current_actor
    except Exception:  # noqa: BLE001 - not an actor
        return None
    state = {"open": False}

    def changed(drains: dict) -> None:
        me.drains_changed.remote(drains)
        state["open"] = True

    def tick() -> bool:
        if state["open"]:
            try:
                state["open"] = bool(ray.get(me.drain_progress.remote(), timeout=30))
            except Exception as e:  # noqa: BLE001 - busy or restarting: asked again at the next poll
                log.debug("ray_ckpt: drain progress of run %r unavailable: %s", run, e)
        return True

    return NodeWatch(changed, name="ray_ckpt-drain-watch", on_tick=tick)


def worker_handle(run: str, node: str):
    """The run's persistence worker of ``node`` (None when it has none)."""
    try:   # a shard run's worker is its lineage of the job's host on that node
        return lineages.worker(run, node)
    except ValueError:
        return None
