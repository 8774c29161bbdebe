"""A persistence worker's write queue: which held chunks go to storage next, and how consecutive diff chunks are
laid end to end into one object. No Ray: the worker (:mod:`ray_ckpt.runtime.worker`) holds one, under its lock,
and its writer thread carries the jobs out.

Jobs: a full as it is, else the first run of consecutive diff chunks of a generation once it holds ``batch_steps``
steps, or on flush / memory pressure / a drain of this node / when its oldest chunk waited ``durable_delay``. A
*lazy* diff chunk (``durable_diffs`` "fulls" or "amber") is written alone, only when its second copy is missing:
the peer did not acknowledge it within :data:`LAZY_GRACE_S`, or it is no longer the ring's next node. Without
any peer (one node) it is the only copy and is written like any other.
"""
from __future__ import annotations

import collections
import time

from ray_ckpt.format import checksum, segments
from ray_ckpt.lineage import Manifest, diff_name, object_key
from ray_ckpt.lineage.manifest import lazy_diffs

#: durable_diffs="fulls": how long a diff chunk may wait for the peer's acknowledgement before it is written
LAZY_GRACE_S = 10.0


class WriteQueue:
    """The chunks of one lineage waiting for their write (persistence worker actor; every method is called under
    the worker's lock)."""

    def __init__(self, durable_delay: float = 2.0) -> None:
        self.durable_delay = durable_delay
        self.pending: dict[int, dict[int, tuple[Manifest, int]]] = {}  # gen -> first_step -> (chunk, batch)
        self.fulls: collections.deque = collections.deque()            # full manifests to write
        self.flush_requested = 0    #: flushes waiting: every pending chunk is written now
        self.writing = False        #: the writer thread carries a job out

    def add(self, m: Manifest, batch_steps: int) -> None:
        """A chunk received from a training process (held by now)."""
        if m.kind == "full":
            self.fulls.append(m)
        else:
            self.pending.setdefault(m.generation, {})[m.first_step] = (m, max(1, batch_steps))

    def any(self) -> bool:
        """Whether a write is queued."""
        return bool(self.fulls) or any(self.pending.values())

    def busy(self) -> bool:
        """Whether a write is queued or running."""
        return self.any() or self.writing

    def queued_chunks(self) -> int:
        return sum(len(p) for p in self.pending.values())

    def requeue(self, kind: str, payload) -> None:
        """Put a job whose write failed back at the head of its queue (held data is never dropped)."""
        if kind == "full":
            self.fulls.appendleft(payload)
            return
        steps = sum(m.last_step - m.first_step + 1 for m in payload)
        chunks = self.pending.setdefault(payload[0].generation, {})
        for m in payload:
            chunks[m.first_step] = (m, steps)

    def cover(self, generation: int, step: int) -> None:
        """A durable full of ``generation`` at ``step`` exists: lazy diffs up to it are never written."""
        chunks = self.pending.get(generation, {})
        for first in [f for f, (m, _) in chunks.items() if m.last_step <= step and lazy_diffs(m)]:
            del chunks[first]

    def drop(self, m: Manifest) -> None:
        """``m`` was released before it was written (a newer durable full took its place): not written."""
        chunks = self.pending.get(m.generation, {})
        if m.kind == "diff" and chunks.get(m.first_step, (None,))[0] is m:
            del chunks[m.first_step]

    def next_job(self, held: dict, *, urgent: bool, peer_node: str, now: float | None = None):
        """``("full", manifest)``, ``("diffs", [manifests])`` or None (see the module docstring). ``held``: the
        worker's held chunks by name (``.received``, ``.peer``); ``urgent``: write now (flush, memory pressure, a
        drain of this node; a flush counts by itself); ``peer_node``: the ring's next node ("" without a peer)."""
        if self.fulls:
            return "full", self.fulls.popleft()
        urgent = urgent or self.flush_requested > 0
        now = time.monotonic() if now is None else now
        for gen, chunks in self.pending.items():
            if not chunks:
                continue
            run: list[Manifest] = []
            steps = 0
            for first in sorted(chunks):
                m, batch = chunks[first]
                if run and (first != run[-1].last_step + 1 or m.info != run[0].info or m.info.get("atomic")
                            or run[0].info.get("atomic")):
                    break
                run.append(m)
                steps += m.last_step - m.first_step + 1
                if steps >= batch:
                    break
            h = held.get(run[0].name)
            age = now - h.received if h is not None else self.durable_delay
            if lazy_diffs(run[0]) and not urgent and peer_node:
                # a lazy chunk is written alone, only when its second copy is missing: the peer did not
                # acknowledge it within LAZY_GRACE_S, or it is no longer the ring's next node (died, replaced).
                # Without any peer (one node) this copy is the only one: written like durable_diffs="all".
                for first in sorted(chunks):
                    m = chunks[first][0]
                    h = held.get(m.name)
                    if h is None or (now - h.received >= LAZY_GRACE_S and (not h.peer or h.peer != peer_node)):
                        del chunks[first]
                        return "diffs", [m]
                continue
            if steps >= chunks[run[0].first_step][1] or urgent or age >= self.durable_delay \
                    or run[0].info.get("atomic"):
                for m in run:
                    del chunks[m.first_step]
                return "diffs", run
        return None


def merged_manifest(covers: list[Manifest], bufs: list) -> Manifest:
    """The manifest of one object laying the diff chunks ``covers`` end to end (segments: no decode, no
    re-encode), its checksum combined from the chunks' (one pass over ``bufs`` only when their algorithms
    differ)."""
    algs = {m.crc_alg for m in covers}
    if len(algs) == 1:   # from the chunks' checksums, no pass over the bytes
        alg = algs.pop()
        crc, n = segments.combine_all([(m.crc32, m.nbytes) for m in covers], alg)
    else:   # one generation has one sender, so its chunks share an algorithm; should they ever not, the
            # checksums do not combine: one pass over the bytes rather than a wrong checksum
        alg = checksum.DEFAULT
        crc, n = checksum.of_buffers(alg, bufs)
    first, last = covers[0].first_step, covers[-1].last_step
    m0 = covers[0]
    return Manifest(kind="diff", generation=m0.generation, first_step=first, last_step=last,
                    object=object_key(diff_name(m0.generation, first, last)), nbytes=n, crc32=crc, crc_alg=alg,
                    strategy=m0.strategy, info=dict(m0.info))
