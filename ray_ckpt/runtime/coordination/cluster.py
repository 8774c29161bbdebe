"""RayCluster: the Ray calls a run's coordinator makes — which nodes are alive, and the run's persistence workers
and state-tier replica (named actors, :mod:`ray_ckpt.runtime.lineages`).

The only part of the coordinator that talks to Ray; the other parts get its methods as plain callables. Runs in
the coordinator actor's thread. ``alive_node_ids`` and ``holder_refs`` are the coordinator's own methods, passed
in: the scale benchmark's coordinator subclass answers them for its simulated nodes.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from ray_ckpt.runtime import drain as drain_watch
from ray_ckpt.runtime import lineages

log = logging.getLogger("ray_ckpt")


class RayCluster:
    """The run ``run``'s view of the cluster. Coordinator actor thread."""

    def __init__(self, run: str, alive_node_ids: Callable[[], set]):
        self.run = run
        self._alive_node_ids = alive_node_ids
        self._nodes_cache: tuple[float, set[str]] | None = None   # (when, alive node ids), see alive

    def alive(self, max_age: float = 0.0) -> set[str]:
        """The alive nodes; ``max_age > 0`` accepts an answer that old (the periodic calls — control, metrics —
        ask several times a second and the node list is costly to ask; plans always ask afresh)."""
        now = time.monotonic()
        cached = self._nodes_cache
        if max_age > 0 and cached is not None and now - cached[0] <= max_age:
            return cached[1]
        alive = self._alive_node_ids()
        self._nodes_cache = (now, alive)
        return alive

    def workers(self, nodes) -> dict:
        """``{node: handle}`` of the run's persistence workers on ``nodes`` that exist: one listing of the named
        actors, then a lookup only of those (a wide job's worker starts each ask every node: one failed lookup
        per node without a worker would cost a round trip to Ray's control store each)."""
        named = lineages.worker_nodes(self.run)
        out = {}
        for node in nodes:
            if node in named:
                try:
                    out[node] = lineages.worker(self.run, node)
                except ValueError:
                    pass
        return out

    def inventories(self):
        """``(node, [(manifest json, refs, durable), ...])`` of each live node's worker that answers (a
        restarted coordinator rebuilds its state from them)."""
        alive = self.alive()
        for node in sorted(lineages.worker_nodes(self.run)):
            if node not in alive:
                continue
            try:
                inv = ray.get(lineages.worker(self.run, node).inventory.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001
                log.warning("ray_ckpt coordinator: the worker of run %r on node %s did not answer: %s",
                            self.run, node[:12], e)
                continue
            yield node, inv

    def holder_refs(self, ask: dict, timeout: float) -> dict:
        """``{node: {name: [ObjectRef]}}`` of the objects ``ask`` names per node, from the run's workers there
        (all asked at once); a worker that does not answer within ``timeout`` gives none."""
        calls = {node: w.holder_refs.remote(ask[node]) for node, w in self.workers(ask).items()}
        out = {}
        if calls:
            ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout)
        for node, ref in calls.items():
            try:
                out[node] = ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - restarting, gone or slow: no memory copy from it
                log.info("ray_ckpt coordinator: node %s gave no object references for a plan: %s", node[:12], e)
        return out

    # -- asks of the workers (fire and forget) ---------------------------------------------------------------------
    def _each(self, nodes, method: str, *args) -> None:
        for node in nodes:
            try:
                getattr(lineages.worker(self.run, node), method).remote(*args)
            except ValueError:
                pass

    def cover(self, nodes, gen: int, step: int) -> None:
        """Tell the workers on ``nodes`` that a durable full at ``step`` of ``gen`` covers their lazy diffs."""
        self._each(nodes, "cover", gen, step)

    def release(self, nodes, names: list[str]) -> None:
        """Tell the workers on ``nodes`` to let ``names`` go (GC deleted them)."""
        self._each(nodes, "release", names)

    def persist_origin(self, lost: str) -> list[str]:
        """Ask every live node's worker but ``lost``'s to persist what it holds of ``lost``; returns the nodes
        asked."""
        workers = self.workers(n for n in self.alive() if n != lost)
        for worker in workers.values():
            worker.persist_origin.remote(lost)
        return list(workers)

    def drain_notice(self, draining: dict) -> None:
        """Tell every live node's worker which nodes drain (``{node: deadline_ms}``)."""
        for node in self.alive():
            worker = drain_watch.worker_handle(self.run, node)
            if worker is not None:
                worker.drain_notice.remote(draining)

    # -- the state-tier replica ------------------------------------------------------------------------------------
    def replica_status(self) -> dict | None:
        """The replica's own status (None: no replica, or it is restarting)."""
        try:
            return ray.get(lineages.replica(self.run).status.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - no replica (or it is restarting): restore from the chain
            log.debug("ray_ckpt coordinator: no replica status (%s)", e)
            return None

    def restart_replica(self) -> bool:
        """Kill the replica so that Ray restarts it elsewhere (soft affinity avoids draining nodes); a shard
        lineage's replica moves with its host. False: there is none."""
        try:
            handle = lineages.replica(self.run)
        except ValueError:
            return False
        ray.kill(getattr(handle, "host", handle), no_restart=False)
        return True
