"""The sender's transport to its node's persistence worker: chunks handed over (at most :data:`MAX_INFLIGHT`
answers outstanding), kept until the worker says they are *safe* (held on two nodes or durable), sent again to a
restarted worker (a new incarnation holds nothing), and handed over with their bytes once the worker refuses this
process's shared memory. Also measured here: how long a hand-off takes to become safe (a drain's margin is made of
it).

Runs on the sender thread of the training process (:class:`ray_ckpt.runtime.trainer.sink.RaySink`), which encodes
the chunks; Ray is reached only through the worker's handle and :class:`ray_ckpt.runtime.calls.Calls`, so a unit
test passes a fake worker and futures.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import ray

from ray_ckpt.engine.writer import WriterError
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.lineage import Manifest
from ray_ckpt.runtime.calls import RAY, Calls
from ray_ckpt.runtime.shared import SharedMemoryUnavailable

log = logging.getLogger("ray_ckpt")

RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
#: hand-offs whose answer the sender has not waited for yet: it encodes the next chunk while the worker copies the
#: last one into the object store (on a busy machine that copy waits for a core, and a sender blocked on it filled
#: its queue and stalled the training thread)
MAX_INFLIGHT = 2
#: encoded buffers smaller than this are laid end to end into one array before the hand-off: Ray pickles each
#: array of an argument separately (a top-k chunk holds hundreds of small buffers: that pickling was most of the
#: worker's CPU), while joining them costs one small copy; larger buffers are handed over as they are (zero-copy)
SMALL_BUFFER = 64 << 10


def coalesce(bufs: list, shared: dict | None = None, describe: Callable | None = None) -> list:
    """The hand-off arrays of one encoded container: its first buffer (prefix and header, kept apart so that the
    decoder can read the tensors from the parts), then the data buffers with each run of small ones joined.
    Buffers in shared memory are handed over as their descriptor: those in ``shared`` (``{id(array):
    descriptor}``) and those ``describe(buffer)`` names (None: not shared; the sink's arena)."""
    out = [np.frombuffer(memoryview(bufs[0]).cast("B"), dtype=np.uint8)]
    run: list = []

    def close_run():
        if run:
            out.append(np.frombuffer(b"".join(run), dtype=np.uint8) if len(run) > 1
                       else np.frombuffer(run[0], dtype=np.uint8))
            run.clear()

    for b in bufs[1:]:
        d = shared.get(id(b)) if shared else None
        if d is None and describe is not None:
            d = describe(b)
        if d is not None:
            close_run()
            out.append(d)
            continue
        mv = memoryview(b).cast("B")
        if mv.nbytes < SMALL_BUFFER:
            run.append(mv)
        else:
            close_run()
            out.append(np.frombuffer(mv, dtype=np.uint8))
    close_run()
    return out


@dataclass
class Chunk:
    manifest: Manifest
    arrays: list
    size: int           # bytes of captured state it keeps alive (counted in the sink's budget)
    records: list       # the captured records whose buffers ``arrays`` views: recycled once the chunk is safe
    plain: list | None = None   # ``arrays`` with the bytes of its shared-memory descriptors (the fallback)
    t: float = 0.0              # when it was handed over (monotonic): its time to become safe is measured
    #: False: encoded without its data checksum (:func:`ray_ckpt.format.framing.unsealed`), which the worker
    #: computes as it takes the bytes, filling in the manifest's ``nbytes`` and ``crc32``
    sealed: bool = True


def refused_shared(e: BaseException) -> bool:
    """Whether a failed hand-off is the worker refusing the shared-memory descriptors. Ray raises the actor's
    exception as a class deriving from both ``RayTaskError`` and the cause's class (``as_instanceof_cause``); on
    Ray 2.60 its ``cause`` attribute is then not the exception, so the class decides."""
    return isinstance(e, SharedMemoryUnavailable) or isinstance(getattr(e, "cause", None), SharedMemoryUnavailable)


class Transport:
    """Every method runs on the sender thread. ``release(nbytes)``: the sink's budget gets a safe chunk's bytes
    back; ``worker_of()``: this node's worker found again (after it was unavailable); ``arena``: the shared-memory
    arena the chunks' descriptors point into (None: the bytes are handed over)."""

    def __init__(self, worker, *, generation: int, batch_steps: int, storage_uri: str,
                 release: Callable[[int], None], worker_of: Callable[[], object], arena=None, retries: int = 20,
                 calls: Calls = RAY) -> None:
        self.worker = worker
        self.generation = generation
        self.batch_steps = batch_steps
        self.storage_uri = storage_uri
        self.release = release
        self._worker_of = worker_of
        self.arena = arena
        self.retries = retries
        self._calls = calls
        self.unsafe: "collections.OrderedDict[str, Chunk]" = collections.OrderedDict()
        self.inflight: collections.deque = collections.deque()   # (answer ref, chunk) of unanswered hand-offs
        self.incarnation: str | None = None
        self._retired: set[str] = set()   # incarnations of this node's worker seen replaced
        self.safe_latency: float | None = None   #: seconds from a hand-off to its safety (the longest, fading)
        self.poll_t = 0.0                 #: the last answer that said what became safe (a poll or a hand-off's)
        self.actor_calls = 0              #: calls to the persistence worker (submit, poll, flush)
        self.resent_chunks = 0
        self.restarts_seen = 0            #: restarts of this node's worker seen (a new incarnation answered)
        #: the newest step whose chunk this node's worker acknowledged (held in its object store): it survives a
        #: crash of this process; the steps after it may not (still queued here, or a hand-off unanswered)
        self.held_step: int | None = None

    def call(self, fn, what: str):
        """One call to the node's worker, waited for; when the actor is restarting, retry (the new incarnation's
        first answer triggers the resend of unsafe chunks)."""
        for attempt in range(self.retries):
            if not self._calls.up():   # shut down under an open sink: never start another Ray instance
                raise WriterError(f"Ray was shut down during {what}: close() the Checkpointer first")
            try:
                self.actor_calls += 1
                return self._calls.get(fn(self.worker))
            except RETRYABLE as e:
                log.warning("ray_ckpt: persistence worker unavailable during %s (%s); retrying", what, e)
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
                self.worker = self._worker_of()
        raise WriterError(f"persistence worker unavailable for {what}")

    def send(self, c: Chunk) -> None:
        """Hand ``c`` over (kept until safe) without waiting for the answer; wait for the oldest when
        :data:`MAX_INFLIGHT` are unanswered. The worker is threaded, so two hand-offs may run in either order
        there: its write queue, the lineage and the replica order chunks by step, and a resend of a chunk it holds
        replaces it."""
        c.t = time.monotonic()
        self.unsafe[c.manifest.name] = c
        try:
            ref = self.worker.submit.remote(c.manifest.to_json(), c.arrays, self.batch_steps, sealed=c.sealed)
        except RETRYABLE:
            self.send_sync(c)
            return
        self.actor_calls += 1
        self.inflight.append((ref, c))
        while len(self.inflight) > MAX_INFLIGHT:
            self._complete(*self.inflight.popleft())

    def send_sync(self, c: Chunk) -> None:
        """Hand ``c`` over and wait for the answer (its bytes instead of descriptors once shared memory is
        refused)."""
        def call():
            return self.call(lambda w: w.submit.remote(c.manifest.to_json(), c.arrays, self.batch_steps,
                                                           sealed=c.sealed),
                             f"hand-off of {c.manifest.name}")
        try:
            reply = call()
        except ray.exceptions.RayTaskError as e:
            if not refused_shared(e):
                raise
            self.no_shared(e)
            if c.plain is not None:
                c.arrays, c.plain = c.plain, None
            reply = call()
        self._answered(reply, c)

    def _answered(self, reply: dict, c: Chunk) -> None:
        self.poll_t = time.monotonic()   # the answer says what became safe: no poll while hand-offs are frequent
        last = c.manifest.last_step
        self.held_step = last if self.held_step is None else max(self.held_step, last)
        self.on_reply(reply)

    def _complete(self, ref, c: Chunk) -> None:
        """The answer of one hand-off in flight; a worker that died meanwhile gets the chunk again (its new
        incarnation's answer then brings the resend of every unsafe chunk)."""
        try:
            reply = self._calls.get(ref)
        except ray.exceptions.RayTaskError as e:
            if not refused_shared(e):
                raise
            # (several hand-offs may be in flight: the first refusal already gave every unsafe chunk, this one
            # among them, its bytes back; the later refusals of calls sent before it only resend)
            self.no_shared(e)
            if self.unsafe.get(c.manifest.name) is c:   # (its arrays now carry the bytes)
                self.send_sync(c)
            return
        except RETRYABLE as e:
            if self.unsafe.get(c.manifest.name) is not c:
                return   # secured meanwhile (an answer to another call said so)
            log.warning("ray_ckpt: persistence worker unavailable during hand-off of %s (%s); retrying",
                        c.manifest.name, e)
            self.send_sync(c)
            return
        self._answered(reply, c)

    def no_shared(self, err) -> None:
        """The node worker cannot map this process's shared memory (``err``, its refusal): from now on every chunk
        carries its bytes (those handed over already are resent with them)."""
        if self.arena is not None:
            why = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            log.warning("ray_ckpt: the persistence worker cannot read this process's shared memory (%s); handing "
                        "the bytes over instead", why)
            self.arena.close()
            self.arena = None
        for u in self.unsafe.values():
            if u.plain is not None:
                u.arrays, u.plain = u.plain, None

    def drain(self) -> None:
        """Wait for the answer of every hand-off in flight (each then held by the worker)."""
        while self.inflight:
            self._complete(*self.inflight.popleft())

    def reap(self) -> None:
        """Collect the answers that arrived (never waits)."""
        while self.inflight:
            if not self._calls.ready([self.inflight[0][0]]):
                return
            self._complete(*self.inflight.popleft())

    def poll(self) -> None:
        """Ask the worker which chunks became safe (one call, waited for)."""
        self.on_reply(self.call(lambda w: w.poll.remote(self.generation), "poll"))

    def on_reply(self, reply: dict) -> None:
        """A worker's answer: release what became safe; a new incarnation gets every unsafe chunk again; a write
        error is raised (the training thread hears of it)."""
        now = time.monotonic()
        for name in reply["safe"]:
            c = self.unsafe.pop(name, None)
            if c is not None:
                # the longest recent time to safety, fading by a tenth per chunk (a drain's margin is made of it)
                took = now - c.t
                self.safe_latency = took if self.safe_latency is None else max(took, 0.9 * self.safe_latency)
                c.arrays, c.plain = [], None
                rec_fmt.recycle(c.records)
                self.release(c.size)
        if reply["incarnation"] in self._retired:
            pass   # a late answer of an incarnation already replaced (a hand-off in flight when it restarted)
        elif self.incarnation is not None and reply["incarnation"] != self.incarnation:
            self._retired.add(self.incarnation)
            self.incarnation = reply["incarnation"]
            todo = list(self.unsafe.values())
            self.restarts_seen += 1
            log.warning("ray_ckpt: the persistence worker on this node restarted; resending %d chunks it had not "
                        "secured", len(todo))
            for c in todo:
                if self.unsafe.get(c.manifest.name) is not c:
                    continue   # became safe meanwhile (an answer to an earlier resend): its buffers are recycled
                self.resent_chunks += 1
                self.send_sync(c)
        else:
            self.incarnation = reply["incarnation"]
        if reply.get("error"):   # a write failed beyond its retry budget, or for good: the training thread hears
            raise WriterError(f"the persistence worker on node {reply['node'][:12]} cannot write to storage "
                              f"{self.storage_uri}: {reply['error']}")

    def wait_safe(self, timeout: float = 300.0) -> None:
        """Return once every chunk handed over is safe (polling the worker)."""
        self.drain()
        deadline = time.monotonic() + timeout
        while self.unsafe:
            if time.monotonic() > deadline:
                raise WriterError(f"{len(self.unsafe)} chunks were not secured within {timeout:g} s")
            time.sleep(0.02)
            self.poll()

    def flush(self) -> None:
        """Everything handed over is durable (resending to a restarted worker as often as needed)."""
        self.drain()
        for _ in range(self.retries):
            self.call(lambda w: w.flush.remote(), "flush")
            self.poll()
            if not self.unsafe:
                return
        raise WriterError(f"{len(self.unsafe)} chunks could not be made durable after {self.retries} flushes of "
                          f"the node's persistence worker: {sorted(self.unsafe)[:5]}")
