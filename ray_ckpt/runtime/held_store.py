"""The chunks a persistence worker holds in its node's object store (the memory tier), within its memory budget,
and which of them became safe for their sender since it last asked.

No Ray: the worker (:mod:`ray_ckpt.runtime.worker`) holds one :class:`HeldStore` and calls every method under its
lock — from its actor threads (a chunk received or copied here, released, covered), its writer thread (written)
and its report thread (a peer acknowledged its copy). Object references are opaque here.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace

from ray_ckpt.lineage import Manifest
from ray_ckpt.lineage.manifest import lazy_diffs


@dataclass
class Held:
    manifest: Manifest
    ref: object                   #: the object in this node's object store (owned by the worker)
    nbytes: int
    durable: bool
    replica: bool                 #: held for another node (that node's worker persists it)
    origin: str = ""              #: the node whose worker received it from a training process
    peer: str | None = None       #: origin copies: the node holding our replica (once acknowledged)
    received: float = field(default_factory=time.monotonic)


class HeldStore:
    """Held chunks by name, oldest first, their bytes, the memory budget, and per generation the names that became
    safe (held on two nodes or durable) since the sender's last answer. Every method runs under the worker's
    lock."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.items: "collections.OrderedDict[str, Held]" = collections.OrderedDict()
        self.nbytes = 0
        self.newly_safe: dict[int, list[str]] = {}   # gen -> names safe since the last answer

    def get(self, name: str) -> Held | None:
        return self.items.get(name)

    def held_again(self, m: Manifest, sealed: bool = True) -> bool:
        """Whether ``m`` is a chunk this store holds from its sender already (a hand-off sent again); when it is safe
        by now, it is marked safe again. ``sealed=False``: ``m`` came without its size and checksum (the worker
        fills them in as it takes the bytes), compared on everything else."""
        h = self.items.get(m.name)
        if h is None or h.replica:
            return False
        held = h.manifest if sealed else replace(h.manifest, nbytes=m.nbytes, crc32=m.crc32, crc_alg=m.crc_alg)
        if held != m:   # another chunk of that name: taken as new
            return False
        if h.durable or h.peer:
            self.mark_safe([m.name])
        return True

    def put(self, h: Held) -> None:
        """Hold ``h`` (replacing what was held under its name: a resend)."""
        old = self.items.pop(h.manifest.name, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self.items[h.manifest.name] = h
        self.nbytes += h.nbytes

    @property
    def over_budget(self) -> bool:
        return self.nbytes > self.budget

    def release_for_budget(self) -> list[str]:
        """Release durable objects oldest first until the bytes fit the budget (the newest full is kept), and
        return their names; what is not durable is never released (it may be the only copy of its steps)."""
        released = []
        while self.over_budget:
            newest_full = max((h.manifest.last_step for h in self.items.values() if h.manifest.kind == "full"),
                              default=None)
            victim = next((n for n, h in self.items.items() if h.durable
                           and not (h.manifest.kind == "full" and h.manifest.last_step == newest_full)), None)
            if victim is None:
                break
            self.nbytes -= self.items.pop(victim).nbytes
            released.append(victim)
        return released

    def mark_safe(self, names: list[str], peer: str | None = None) -> None:
        """Tell the sender (next answer) that ``names`` are safe; ``peer``: the node that acknowledged its copy.
        Called under the lock that made them safe: a durable object may be released the moment it is let go, and
        one released before this ran was never reported safe."""
        for n in names:
            h = self.items.get(n)
            if h is None or h.replica:
                continue
            if peer is not None:
                h.peer = peer
            self.newly_safe.setdefault(h.manifest.generation, []).append(n)

    def take_safe(self, generation: int) -> list[str]:
        """The chunks of ``generation`` that became safe since the last call."""
        return self.newly_safe.pop(generation, [])

    def mark_durable(self, names: list[str]) -> dict[str, list[str]]:
        """``names`` are written to storage; returns ``{peer node: names}`` of the origin copies held there too
        (whose replicas may now be released)."""
        peers: dict[str, list[str]] = {}
        for n in names:
            h = self.items.get(n)
            if h is not None:
                h.durable = True
                if h.peer:
                    peers.setdefault(h.peer, []).append(n)
        return peers

    def cover(self, generation: int, step: int) -> list[str]:
        """A durable full of ``generation`` at ``step`` exists: the lazy diffs up to it count as durable (for
        release and persist) and are safe for their sender. Returns their names."""
        covered = []
        for h in self.items.values():
            m = h.manifest
            if m.generation == generation and m.kind == "diff" and m.last_step <= step and lazy_diffs(m) \
                    and not h.durable:
                h.durable = True
                covered.append(m.name)
        self.mark_safe(covered)
        return covered

    def release(self, names: list[str]) -> list[Manifest]:
        """Drop ``names``. Those not written nor held on a peer are no longer needed (a newer durable full took
        their place): they become safe for their sender, and their manifests are returned (not to be written)."""
        unsafe = [n for n in names if (h := self.items.get(n)) is not None and not h.durable and not h.replica
                  and not h.peer]
        self.mark_safe(unsafe)
        dropped = [self.items[n].manifest for n in unsafe]
        for n in names:
            h = self.items.pop(n, None)
            if h is not None:
                self.nbytes -= h.nbytes
        return dropped

    def replicas_of(self, origin: str) -> list[str]:
        """The copies held for ``origin``'s worker that are not durable yet."""
        return [n for n, h in self.items.items() if h.replica and h.origin == origin and not h.durable]

    def unsecured(self, draining: dict, copying: set) -> list[Held]:
        """Chunks received here whose second copy is not acknowledged, or is on a ``draining`` node, and are
        neither durable nor being copied (``copying``: names)."""
        return [h for n, h in self.items.items() if not h.replica and not h.durable and n not in copying
                and (h.peer is None or h.peer in draining)]
