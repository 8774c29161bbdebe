"""A persistence worker's neighbours: its *peer* (the next alive node's worker in ring order by node id, nodes that
drain skipped), the run's state-tier replica, the drain state of the cluster's nodes, and the copies of chunks sent
to the peer whose acknowledgement is awaited.

No Ray: the worker (:mod:`ray_ckpt.runtime.worker`) passes in how to list the alive nodes, find a node's worker,
find the replica, read the GCS's drain state and look at call answers (:class:`ray_ckpt.runtime.calls.Calls`).
The ring shares the worker's lock (``cv``) and takes it itself: it is called from the worker's actor threads
(:meth:`PeerRing.peer`, :meth:`PeerRing.copy`, :meth:`PeerRing.notice`) and its report thread
(:meth:`PeerRing.acknowledged`).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ray_ckpt.runtime.calls import RAY, Calls

log = logging.getLogger("ray_ckpt")

PEER_CACHE_S = 5.0      # the peer is chosen again this often (a node joined, died or drains)
REPLICA_CACHE_S = 2.0   # the replica's handle is looked up again this often


def ring_after(me: str, alive) -> list[str]:
    """The nodes of ``alive`` other than ``me``, in ring order by node id starting after ``me``: the first is the
    node ``me``'s worker copies to (and where a run's replica goes)."""
    alive = sorted(alive)
    return [n for n in alive if n > me] + [n for n in alive if n < me]


def staying(nodes: list[str], draining: dict) -> list[str]:
    """``nodes`` without the draining ones, in the same order (all of them when every one drains)."""
    return [n for n in nodes if n not in draining] or nodes


class PeerRing:
    def __init__(self, node_id: str, cv, *, alive: Callable[[], list], worker_of: Callable[[str], object],
                 replica_of: Callable[[], object], draining: Callable[[], dict], calls: Calls = RAY) -> None:
        self.node_id = node_id
        self._cv = cv
        self._alive = alive            # () -> ids of the alive nodes
        self._worker_of = worker_of    # node id -> that node's worker of this run
        self._replica_of = replica_of  # () -> the state-tier replica (ValueError: none)
        self._gcs_draining = draining  # () -> {node: deadline ms} as the GCS has it
        self._calls = calls
        self._peer: tuple[float, object, str] | None = None
        self._replica: tuple[float, object] | None = None
        self.draining: dict[str, int] = {}   #: node drains (node -> deadline ms)
        self.drain_self = False              #: this node drains: write everything it received now
        self.copies: dict = {}               #: call reference of hold_replica -> (chunk name, peer node)

    @property
    def peer_node(self) -> str:
        """The peer's node as last chosen ("" without one). Under the worker's lock."""
        return self._peer[2] if self._peer is not None else ""

    def peer(self) -> tuple[object, str]:
        """``(handle, node_id)`` of the next alive node's worker (ring order by node id), or (None, "")."""
        now = time.monotonic()
        if self._peer is not None and now - self._peer[0] < PEER_CACHE_S:
            return self._peer[1], self._peer[2]
        others = staying(ring_after(self.node_id, self._alive()), self.refresh_draining())
        handle = self._worker_of(others[0]) if others else None
        self._peer = (now, handle, others[0] if others else "")
        return handle, self._peer[2]

    def replica(self):
        """The run's state-tier replica, or None: the handle looked up last (a hand-off never waits for a lookup,
        which blocks while the replica's actor restarts, e.g. moved off a draining node: a handle of the restarting
        actor stays valid). Looked up here only the first time; :meth:`refresh_replica` renews it. Actor thread."""
        if self._replica is None:
            self.refresh_replica()
        return self._replica[1]

    def refresh_replica(self, force: bool = False) -> None:
        """Look the replica up again when the last lookup is older than :data:`REPLICA_CACHE_S` (a replica created
        or replaced meanwhile). Report thread (and the first :meth:`replica`)."""
        now = time.monotonic()
        if not force and self._replica is not None and now - self._replica[0] < REPLICA_CACHE_S:
            return
        try:
            handle = self._replica_of()
        except ValueError:
            handle = None
        self._replica = (now, handle)

    def copy(self, peer, peer_node: str, manifest, ref) -> None:
        """Send the peer a copy of a chunk held here (its acknowledgement comes with :meth:`acknowledged`)."""
        call = peer.hold_replica.remote(manifest.to_json(), [ref], self.node_id)
        with self._cv:
            self.copies[call] = (manifest.name, peer_node)

    def copying(self) -> set:
        """Names of the chunks whose copy is not acknowledged yet. Under the worker's lock."""
        return {name for name, _ in self.copies.values()}

    def acknowledged(self) -> list[tuple[str, str]]:
        """``(chunk name, peer node)`` of the copies the peer acknowledged since the last call (a peer that died or
        refused: not listed, the chunk waits for durability). Report thread; never waits."""
        with self._cv:
            calls = list(self.copies)
        out = []
        for c in self._calls.ready(calls):
            with self._cv:
                name, peer_node = self.copies.pop(c)
            try:
                ok = self._calls.get(c)
            except Exception as e:  # noqa: BLE001 - the peer died: the chunk waits for durability
                log.info("ray_ckpt: replication of %s failed: %s", name, e)
                ok = False
            if ok:
                out.append((name, peer_node))
        return out

    def notice(self, drains: dict) -> bool:
        """Ray drains the nodes ``drains`` (``{node: deadline_ms}``): peers are chosen among the others from now
        on. Returns whether this node began to drain with it."""
        with self._cv:
            self.draining = {str(n): int(d) for n, d in drains.items()}
            self._peer = None
            was, self.drain_self = self.drain_self, self.node_id in self.draining
            self._cv.notify_all()
        return self.drain_self and not was

    def refresh_draining(self) -> dict:
        """The drain state as the GCS has it (asked when the peer is chosen again): a worker created after a
        notice, or one whose notice was lost, still avoids draining peers."""
        got = self._gcs_draining()
        with self._cv:
            self.draining = got
            if got and self.node_id in got and not self.drain_self:
                self.drain_self = True
                log.warning("ray_ckpt: node %s is draining: writing everything it holds now", self.node_id[:12])
            return dict(self.draining)
