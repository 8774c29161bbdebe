"""RaySink: the training process's side of the Ray runtime (replaces the engine's AsyncWriter).

Call order, all in the training process::

    submit(item)    training thread: queue the captured item; blocks while queued + unsafe bytes exceed the
                    budget (backpressure)
    full_control()  training thread, once per step, O(1): whether the state tier takes the policy's fulls and
                    whether the coordinator asks for a full now
    sender thread   collects consecutive step records into a *chunk* — ``batch_steps`` records, or what arrived
                    within ``handoff_delay`` seconds, whichever comes first; at once when records arrive further
                    apart than ``handoff_delay`` (slow steps: nothing to batch) — encodes it once (one segment, the
                    checksum computed while encoding) and hands it to this node's PersistenceWorker in ONE
                    actor call, whose answer it collects later (at most ``_MAX_INFLIGHT`` unanswered: the next
                    chunk is encoded meanwhile); fulls are handed over as they are (their buffers, no
                    concatenation)
    flush()         training thread: hands over what is collected and waits until everything is durable

Fixed cost per step in this process: the capture's copy on the training thread, and a share of one encode and
one actor call per chunk on the sender thread. At 100 steps/s and ``batch_steps=10`` that is 10 actor calls a
second, not 100.

Healing: the sender keeps every chunk (it references the captured tensors; no copy) until the worker reports
it *safe* — held on two nodes or durable. The worker's answers carry its incarnation; when it changes (the
actor restarted and lost what it held), every unsafe chunk is sent again, in order, so a worker restart never
opens a hole in the lineage. A crash of this process loses the records not yet handed over: the chunk being
collected (``batch_steps`` steps or ``handoff_delay`` seconds of training; nothing when steps are slower than
``handoff_delay``, as their records are handed over on arrival) and at most ``batch_steps`` queued
records — when the sender falls behind, ``submit`` waits for room in the queue (``stats()["queue_stalls"]``).

A step is *recoverable* as soon as the worker acknowledged its chunk (held in the node's object store);
``last_committed_step`` counts those. Durability follows asynchronously in the worker.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import numpy as np
import ray

from ray_ckpt.engine.writer import BoundedSink, FlushMarker, WriterError
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format import segments
from ray_ckpt.format.records import FullState
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.policy.budget import choose_durable
from ray_ckpt.runtime import metrics as _metrics
from ray_ckpt.runtime import drain as drain_watch
from ray_ckpt.runtime import lineages
from ray_ckpt.runtime.shared import SharedMemoryUnavailable
from ray_ckpt.runtime.trainer.arena import SharedArena
from ray_ckpt.runtime.worker import get_or_create_worker

log = logging.getLogger("ray_ckpt")

_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
_METRICS_S = 1.0        # how often the sender publishes the training thread's metrics
_POLL_S = 0.25          # how often an idle sender asks the worker which chunks became safe
_CONTROL_S = 0.5        # how often the sender asks the coordinator for full-checkpoint control
#: hand-offs whose answer the sender has not waited for yet: it encodes the next chunk while the worker copies the
#: last one into the object store (on a busy machine that copy waits for a core, and a sender blocked on it filled
#: its queue and stalled the training thread)
_MAX_INFLIGHT = 2
_REAP_S = 0.05          # how soon an idle sender collects the answers of hand-offs in flight
_BANDWIDTH_S = 2.0      # how often the sender reads the node worker's write figures (durable_diffs="auto")
_RELAY_WAIT_S = 2.0     # a relayed control ask unanswered this long is given up for a direct one


#: encoded buffers smaller than this are laid end to end into one array before the hand-off: Ray pickles each
#: array of an argument separately (a top-k chunk of 10 steps is ~250 small buffers: most of the worker's CPU went
#: to that), while joining them costs one small copy; larger buffers are handed over as they are (zero-copy)
_SMALL_BUFFER = 64 << 10


def _coalesce(bufs: list, shared: dict | None = None) -> list:
    """The hand-off arrays of one encoded container: its first buffer (prefix and header, kept apart so that the
    decoder can read the tensors from the parts), then the data buffers with each run of small ones joined.
    ``shared``: ``{id(array): descriptor}`` of buffers in shared memory, handed over as their descriptor."""
    out = [np.frombuffer(memoryview(bufs[0]).cast("B"), dtype=np.uint8)]
    run: list = []

    def close_run():
        if run:
            out.append(np.frombuffer(b"".join(run), dtype=np.uint8) if len(run) > 1
                       else np.frombuffer(run[0], dtype=np.uint8))
            run.clear()

    for b in bufs[1:]:
        if shared and id(b) in shared:
            close_run()
            out.append(shared[id(b)])
            continue
        mv = memoryview(b).cast("B")
        if mv.nbytes < _SMALL_BUFFER:
            run.append(mv)
        else:
            close_run()
            out.append(np.frombuffer(mv, dtype=np.uint8))
    close_run()
    return out


@dataclass
class _Chunk:
    manifest: Manifest
    arrays: list
    size: int           # bytes of captured state it keeps alive (counted in the sink's budget)
    records: list       # the captured records whose buffers ``arrays`` views: recycled once the chunk is safe
    plain: list | None = None   # ``arrays`` with the bytes of its shared-memory descriptors (the fallback)
    t: float = 0.0              # when it was handed over (monotonic): its time to become safe is measured



def _refused_shared(e: BaseException) -> bool:
    """Whether a failed hand-off is the worker refusing the shared-memory descriptors. Ray raises the actor's
    exception as a class deriving from both ``RayTaskError`` and the cause's class (``as_instanceof_cause``); on
    Ray 2.60 its ``cause`` attribute is then not the exception, so the class decides."""
    return isinstance(e, SharedMemoryUnavailable) or isinstance(getattr(e, "cause", None), SharedMemoryUnavailable)

class RaySink(BoundedSink):
    def __init__(self, run: str, storage, impl, generation: int, *, config, info: dict | None = None,
                 replica: bool = False, submit_retries: int = 20):
        # at most batch_steps records wait for the sender (plus the chunk it is collecting): a sender that falls
        # behind the training thread (interpreter lock, busy cores) slows it instead of piling up steps a crash
        # of this process would lose
        super().__init__(config.max_pending_bytes, f"ray_ckpt-sender-g{generation}",
                         max_queued=max(2, config.batch_steps))
        self.run, self.storage, self.impl, self.generation = run, storage, impl, generation
        self.batch_steps = config.batch_steps
        self.handoff_delay = config.handoff_delay
        self.memory_budget = config.memory_budget
        self.replica_enabled = replica
        self.info = dict(info or {})
        if config.durable_diffs not in ("all", "auto"):   # the workers hold these diffs in memory
            self.info["durable_diffs"] = config.durable_diffs
        #: durable_diffs="auto": the mode chosen per chunk from the measured write bandwidth ("all" or "fulls")
        self.auto_durable = config.durable_diffs == "auto"
        self.durable_choice = "all" if config.durable_diffs == "auto" else config.durable_diffs
        self.durable_reason = "write bandwidth not measured yet" if self.auto_durable else "set by the user"
        self.write_bw: float | None = None   # the node worker's measured storage write bandwidth, bytes/s
        self._bw_ref = None
        self._bw_t = 0.0
        self._bw_prev: tuple | None = None   # (time, worker bytes, worker write seconds, diff bytes handed over)
        self._trainer_sent = 0               # meter windows already reported to the coordinator
        self.submit_retries = submit_retries
        self.node_id = ray.get_runtime_context().get_node_id()
        self.write_timeout = config.write_timeout
        self.worker = get_or_create_worker(run, self.node_id, storage, config.memory_budget, config.write_timeout)
        ray.get(self.worker.ping.remote())  # started and ready before the first step is handed over
        self._coordinator = lineages.coordinator(run)   # a shard run's: its lineage of the job's coordinator
        self._incarnation: str | None = None
        self._retired: set[str] = set()   # incarnations of this node's worker seen replaced
        self._unsafe: "collections.OrderedDict[str, _Chunk]" = collections.OrderedDict()
        self._draining_nodes: set = set()   # the GCS drain state as the coordinator last told it (sender thread)
        #: steps that waited under a drain notice: until held by this node's worker / until safe
        self.notice_waits = {"received": 0, "safe": 0}
        self._safe_latency: float | None = None   # seconds from a hand-off to its safety (see safe_latency)
        self._inflight: collections.deque = collections.deque()   # (answer ref, chunk) of unanswered hand-offs
        self._control = {"want_full": False, "delegate": False}
        self._control_ref = None
        self._control_t = 0.0
        #: a shard run asks its node's worker for control (relayed, one coordinator call per node), else the
        #: coordinator; _control_via: the worker while an ask is relayed; _control_direct: the next ask is direct
        self._relay_control = lineages.is_shard_run(run)
        self._control_via = None
        self._control_direct = False
        self.control_asks = {"relayed": 0, "direct": 0}   # control answers received, by path
        self._poll_t = 0.0
        self.actor_calls = 0          # calls to the persistence worker (submit, poll, flush)
        self.chunks_sent = 0
        self.resent_chunks = 0
        self.restarts_seen = 0        # restarts of this node's worker seen (a new incarnation answered)
        self.handoff_seconds = 0.0    # sender thread: encode + hand-off
        self.sender_cpu_seconds = 0.0
        self.capture = None           #: the training loop's capture (set by the Checkpointer): step times
        #: the capture's gradient buffers in memory shared with the node worker (None: not available here)
        self.arena: SharedArena | None = None
        if config.shared_handoff:
            try:
                self.arena = SharedArena(config.max_pending_bytes)
            except (OSError, SharedMemoryUnavailable) as e:
                log.info("ray_ckpt: no shared-memory hand-off (%s): the sender hands the bytes over", e)
        self.shared_chunks = 0        # chunks handed over by descriptor
        self._metrics_t = 0.0
        self._metrics = _metrics.CounterDeltas({"run": run})
        self._thread.start()

    # -- training thread ----------------------------------------------------------------------------------------
    def host_memory(self, nbytes: int):
        """Memory for one of the capture's gradient buffers (training thread): ``(tensor, descriptor)`` in the
        shared arena, or None (heap memory; the bytes are then handed over)."""
        arena = self.arena
        return arena.allocate(nbytes) if arena is not None else None

    def full_control(self) -> tuple[bool, bool]:
        """``(delegated, wanted)``, see :class:`ray_ckpt.engine.capture.Sink`. Training thread, O(1)."""
        c = self._control
        wanted = c["want_full"]
        if wanted:
            c["want_full"] = False
        return self.replica_enabled and c["delegate"], wanted

    def wait_safe(self, timeout: float | None = 300.0) -> None:
        """Return once everything submitted so far is held on two nodes or durable (training thread)."""
        marker = FlushMarker(safe_only=True)
        self._wait_marker(marker, timeout, 0.1, "the attach checkpoint was not secured")

    def wait_received(self, timeout: float | None = 300.0) -> None:
        """Return once everything submitted so far is held by this node's persistence worker (training thread)."""
        marker = FlushMarker(received_only=True)
        self._wait_marker(marker, timeout, 0.05, "the steps handed over were not received")

    def _wait_marker(self, marker: FlushMarker, timeout: float | None, poll: float, what: str) -> None:
        """Queue ``marker`` behind everything submitted and wait until the sender thread has handled it (training
        thread); the sender's failure is raised here."""
        with self._cv:
            self._raise_if_failed()
            self._queue.append((marker, 0, True))
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.done.wait(poll):
            with self._cv:
                self._raise_if_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout} s")
        with self._cv:
            self._raise_if_failed()

    def runtime_stats(self, timeout: float = 10.0) -> dict:
        """The node worker's and the replica's counters, and which steps restore from which tier (the
        coordinator's ``restorable``). Training thread; one actor call each."""
        out = {"actor_calls": self.actor_calls, "chunks_sent": self.chunks_sent,
               "shared_chunks": self.shared_chunks, "shared_handoff": self.arena is not None,
               "resent_chunks": self.resent_chunks, "unsafe_chunks": len(self._unsafe),
               "handoff_seconds": self.handoff_seconds, "sender_cpu_seconds": self.sender_cpu_seconds,
               "delegated_fulls": bool(self.replica_enabled and self._control["delegate"]),
               "control_answers": dict(self.control_asks), "notice_waits": dict(self.notice_waits),
               "durable_diffs": {"mode": self.durable_choice, "auto": self.auto_durable,
                                 "write_bandwidth": self.write_bw, "reason": self.durable_reason}}
        try:
            out["worker"] = ray.get(self.worker.stats.remote(), timeout=timeout)
        except Exception as e:  # noqa: BLE001
            out["worker"] = {"error": str(e)}
        if self.replica_enabled:
            try:
                rep = lineages.replica(self.run, self.node_id if lineages.is_shard_run(self.run) else None)
                out["replica"] = ray.get(rep.status.remote(), timeout=timeout)
            except Exception as e:  # noqa: BLE001
                out["replica"] = {"error": str(e)}
        try:
            out["restorable"] = ray.get(self._coordinator.restorable.remote(), timeout=timeout)
        except Exception as e:  # noqa: BLE001
            out["restorable"] = {"error": str(e)}
        return out

    # -- sender thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        chunk: list = []
        chunk_t0 = 0.0
        last_arrival, gap_ewma = None, None   # step records' inter-arrival time (smoothed)
        cpu0 = time.thread_time()
        hk_t = 0.0   # the last housekeeping (Ray calls: reap answers, poll, control, metrics)
        while True:
            entry = None
            with self._cv:
                while not self._queue and not self._closing:
                    now = time.monotonic()
                    waits = []
                    if chunk:
                        waits.append(chunk_t0 + self.handoff_delay - now)
                    if self._unsafe:
                        waits.append(self._poll_t + _POLL_S - now)
                    if self._inflight or self._control_ref is not None:
                        # answers to collect: looked for _REAP_S after the last round (a deadline, not a
                        # duration: this loop re-computes it after every wake-up), never spun on
                        waits.append(hk_t + _REAP_S - now)
                    if self._control_ref is None:
                        waits.append(self._control_t + _CONTROL_S - now)
                    timeout = min(waits)
                    if timeout <= 0:
                        break
                    self._cv.wait(timeout)
                if self._closing and not self._queue:
                    return
                if self._queue:
                    entry = self._queue.popleft()
                    if self.max_queued is not None:
                        self._cv.notify_all()   # a training thread may wait for room in the queue
            if not ray.is_initialized():   # a Ray call now would start (or join) another Ray instance
                raise WriterError("Ray was shut down while this Checkpointer was open: close() it first")
            try:
                if entry is not None:
                    item, size, close_batch = entry
                    if isinstance(item, FlushMarker):
                        if chunk:
                            self._handoff(chunk)
                            chunk = []
                        if item.received_only:
                            self._drain_inflight()   # every hand-off answered: held by this node's worker
                        elif item.safe_only:
                            self._wait_safe()
                        else:
                            self._flush_worker()
                        item.done.set()
                    elif isinstance(item, FullState):
                        if chunk:
                            self._handoff(chunk)
                            chunk = []
                        self._handoff([(item, size)], full=True)
                    else:
                        now = time.monotonic()
                        if not chunk:
                            chunk_t0 = now
                        if last_arrival is not None:
                            gap = now - last_arrival
                            gap_ewma = gap if gap_ewma is None else 0.7 * gap_ewma + 0.3 * gap
                        last_arrival = now
                        chunk.append((item, size))
                        # slow steps (records further apart than handoff_delay): waiting would batch nothing
                        # and only widen what a crash of this process loses, so hand the record over at once
                        slow = gap_ewma is not None and gap_ewma > self.handoff_delay
                        if close_batch or len(chunk) >= self.batch_steps or self._pressure or slow \
                                or self.drain.active:   # a drain notice: nothing waits to be batched
                            self._handoff(chunk)
                            chunk = []
                        elif time.monotonic() - hk_t < _REAP_S:
                            # a record only collected: no Ray call per step (ray.wait on the hand-offs in flight
                            # holds the interpreter lock the training thread needs); at least every _REAP_S
                            continue
                elif chunk and time.monotonic() >= chunk_t0 + self.handoff_delay:
                    self._handoff(chunk)
                    chunk = []
                self._housekeeping()
                hk_t = time.monotonic()
                self.sender_cpu_seconds = time.thread_time() - cpu0
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                self._fail(e, entry[0] if entry is not None else None)
                return

    def attach_capture(self, capture, start_step: int) -> None:
        """Training thread, once: the capture whose step times and step count the sender publishes."""
        self._metrics.start_at("ray_ckpt_steps", start_step)
        self.capture = capture

    def _publish_metrics(self) -> None:
        """Sender thread, about once a second: the training thread's figures as Ray metrics."""
        cap = self.capture
        if cap is None:
            return
        times = []
        q = cap.step_seconds
        while q:
            try:
                times.append(q.popleft())
            except IndexError:
                break
        _metrics.observe("ray_ckpt_capture_seconds", times, self._metrics.tags)
        self._metrics.publish({"ray_ckpt_stall_seconds": self.stats.stall_seconds,
                               "ray_ckpt_steps": cap.step})

    def _handoff(self, items: list, full: bool = False) -> None:
        t0 = time.perf_counter()
        if full:
            state = items[0][0]
            bufs, info = rec_fmt.encode_full(state), dict(getattr(state, "manifest_info", None) or {})
            kind, first, last = "full", state.step, state.step
            name = full_name(self.generation, state.step)
        else:
            recs = [r for r, _ in items]
            bufs, info = self.impl.encode_diffs(recs)
            info = dict(info)
            delegated = [r.step for r in recs if getattr(r, "full_delegated", False)]
            if delegated:
                info["replica_fulls"] = delegated   # the replica writes the fulls of these steps
            kind, last = "diff", recs[-1].step
            first = info.pop("first_step", recs[0].step)
            name = diff_name(self.generation, first, last)
            if self.auto_durable and self.durable_choice == "fulls":   # the bandwidth does not carry every diff
                info["durable_diffs"] = "fulls"
        crc, n, alg = segments.object_crc(bufs)
        m = Manifest(kind=kind, generation=self.generation, first_step=first, last_step=last,
                     object=object_key(name), nbytes=n, crc32=crc, crc_alg=alg, strategy=self.impl.name,
                     info={**self.info, **info})
        shared = None
        if not full and self.arena is not None:
            shared = {id(r.packed.array): r.packed.handle for r, _ in items
                      if getattr(r, "packed", None) is not None and r.packed.handle is not None}
        arrays = _coalesce(bufs, shared)
        c = _Chunk(m, arrays, sum(s for _, s in items), [r for r, _ in items])
        if shared:
            c.plain = _coalesce(bufs)
            self.shared_chunks += 1
        c.t = time.monotonic()
        self._unsafe[m.name] = c
        self._send(c)
        self.chunks_sent += 1
        st = self.stats
        st.objects_written += 1
        st.bytes_written += n
        if kind == "diff":
            st.diff_bytes += n
            st.steps_committed += last - first + 1
        else:
            st.full_bytes += n
        prev = st.last_committed_step
        st.last_committed_step = last if prev is None else max(prev, last)
        self.handoff_seconds += time.perf_counter() - t0
        st.encode_seconds = self.handoff_seconds

    def _send(self, c: _Chunk) -> None:
        """Hand ``c`` over without waiting for the answer; wait for the oldest when ``_MAX_INFLIGHT`` are
        unanswered. The worker is threaded, so two hand-offs may run in either order there: its write queue, the
        lineage and the replica order chunks by step, and a resend of a chunk it holds replaces it."""
        try:
            ref = self.worker.submit.remote(c.manifest.to_json(), c.arrays, self.batch_steps)
        except _RETRYABLE:
            self._send_sync(c)
            return
        self.actor_calls += 1
        self._inflight.append((ref, c))
        while len(self._inflight) > _MAX_INFLIGHT:
            self._complete(*self._inflight.popleft())

    def _send_sync(self, c: _Chunk) -> None:
        def call():
            return self._call(lambda w: w.submit.remote(c.manifest.to_json(), c.arrays, self.batch_steps),
                              f"hand-off of {c.manifest.name}")
        try:
            reply = call()
        except ray.exceptions.RayTaskError as e:
            if not _refused_shared(e):
                raise
            self._no_shared(e)
            if c.plain is not None:
                c.arrays, c.plain = c.plain, None
            reply = call()
        self._answered(reply)

    def _answered(self, reply: dict) -> None:
        self._poll_t = time.monotonic()   # the answer says what became safe: no poll while hand-offs are frequent
        self._on_reply(reply)

    def _complete(self, ref, c: _Chunk) -> None:
        """The answer of one hand-off in flight; a worker that died meanwhile gets the chunk again (its new
        incarnation's answer then brings the resend of every unsafe chunk)."""
        try:
            reply = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if not _refused_shared(e):
                raise
            # (several hand-offs may be in flight: the first refusal already gave every unsafe chunk, this one
            # among them, its bytes back; the later refusals of calls sent before it only resend)
            self._no_shared(e)
            if self._unsafe.get(c.manifest.name) is c:   # (its arrays now carry the bytes)
                self._send_sync(c)
            return
        except _RETRYABLE as e:
            if self._unsafe.get(c.manifest.name) is not c:
                return   # secured meanwhile (an answer to another call said so)
            log.warning("ray_ckpt: persistence worker unavailable during hand-off of %s (%s); retrying",
                        c.manifest.name, e)
            self._send_sync(c)
            return
        self._answered(reply)

    def _no_shared(self, err) -> None:
        """The node worker cannot map this process's shared memory (``err``, its refusal): from now on every chunk
        carries its bytes (those handed over already are resent with them). Sender thread."""
        if self.arena is not None:
            why = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            log.warning("ray_ckpt: the persistence worker cannot read this process's shared memory (%s); handing "
                        "the bytes over instead", why)
            self.arena.close()
            self.arena = None
        for u in self._unsafe.values():
            if u.plain is not None:
                u.arrays, u.plain = u.plain, None

    def _drain_inflight(self) -> None:
        while self._inflight:
            self._complete(*self._inflight.popleft())

    def _reap_inflight(self) -> None:
        """Collect the answers that arrived (sender thread, never blocks)."""
        while self._inflight:
            ready, _ = ray.wait([self._inflight[0][0]], timeout=0)
            if not ready:
                return
            self._complete(*self._inflight.popleft())

    def _call(self, fn, what: str):
        """One call to the node's worker; when the actor is restarting, retry (the new incarnation's first
        answer triggers the resend of unsafe chunks)."""
        for attempt in range(self.submit_retries):
            if not ray.is_initialized():   # shut down under an open sink: never start another Ray instance
                raise WriterError(f"Ray was shut down during {what}: close() the Checkpointer first")
            try:
                self.actor_calls += 1
                return ray.get(fn(self.worker))
            except _RETRYABLE as e:
                log.warning("ray_ckpt: persistence worker unavailable during %s (%s); retrying", what, e)
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
                self.worker = get_or_create_worker(self.run, self.node_id, self.storage, self.memory_budget,
                                                   self.write_timeout)
        raise WriterError(f"persistence worker unavailable for {what}")

    def safe_latency(self) -> float | None:
        return self._safe_latency

    def _on_reply(self, reply: dict) -> None:
        now = time.monotonic()
        for name in reply["safe"]:
            c = self._unsafe.pop(name, None)
            if c is not None:
                # the longest recent time to safety, fading by a tenth per chunk (a drain's margin is made of it)
                took = now - c.t
                self._safe_latency = took if self._safe_latency is None else max(took, 0.9 * self._safe_latency)
                c.arrays, c.plain = [], None
                rec_fmt.recycle(c.records)
                self._release(c.size)
        if reply["incarnation"] in self._retired:
            pass   # a late answer of an incarnation already replaced (a hand-off in flight when it restarted)
        elif self._incarnation is not None and reply["incarnation"] != self._incarnation:
            self._retired.add(self._incarnation)
            self._incarnation = reply["incarnation"]
            todo = list(self._unsafe.values())
            self.restarts_seen += 1
            log.warning("ray_ckpt: the persistence worker on this node restarted; resending %d chunks it had not "
                        "secured", len(todo))
            for c in todo:
                if self._unsafe.get(c.manifest.name) is not c:
                    continue   # became safe meanwhile (an answer to an earlier resend): its buffers are recycled
                self.resent_chunks += 1
                self._send_sync(c)
        else:
            self._incarnation = reply["incarnation"]
        if reply.get("error"):   # a write failed beyond its retry budget, or for good: the training thread hears
            raise WriterError(f"the persistence worker on node {reply['node'][:12]} cannot write to storage "
                              f"{self.storage.uri}: {reply['error']}")

    def _housekeeping(self) -> None:
        self._reap_inflight()
        now = time.monotonic()
        if now - self._metrics_t >= _METRICS_S:
            self._metrics_t = now
            self._publish_metrics()
        if self._unsafe and now - self._poll_t >= _POLL_S:
            self._poll_t = now
            self._on_reply(self._call(lambda w: w.poll.remote(self.generation), "poll"))
        if self._control_ref is not None:
            ready, _ = ray.wait([self._control_ref], timeout=0)
            relayed = self._control_via is not None
            if not ready and relayed and now - self._control_t > _RELAY_WAIT_S:
                # the node's worker host does not answer (restarting, gone): ask the coordinator directly
                self._control_via, self._control_ref = None, None
                self._control_t, self._control_direct = 0.0, True
            elif ready:
                try:
                    got = ray.get(self._control_ref)
                    if got is None:   # the relay has no fresh answer: ask the coordinator directly, now
                        self._control_ref, self._control_t = None, 0.0
                        self._control_direct = True
                        return self._housekeeping_control(now)
                    self.control_asks["relayed" if relayed else "direct"] += 1
                    self._control["delegate"] = got["delegate"]
                    for first, last in got.get("gaps", []):
                        log.warning("ray_ckpt: lost steps %d..%d of run %r (held nowhere, never written): they "
                                    "cannot be restored; taking a full checkpoint now", first, last, self.run)
                    if got["want_full"]:
                        self._control["want_full"] = True
                    self._drain_control(got.get("draining") or {})
                except Exception as e:  # noqa: BLE001 - the coordinator restarts: keep the last answer
                    log.debug("ray_ckpt: coordinator control unavailable: %s", e)
                    if relayed:
                        self._control_t, self._control_direct = 0.0, True
                self._control_ref = None
        self._housekeeping_control(now)

    def _housekeeping_control(self, now: float) -> None:
        """Sender thread: ask for full-checkpoint control every ``_CONTROL_S`` (one call in flight at most).
        A shard run asks its node's worker, whose host relays the asks of all the node's ranks to the
        coordinator in one call (:meth:`PersistenceWorker.control`); when the relay has no fresh answer or does
        not answer, that ask goes to the coordinator directly (a rank never waits on a lost worker)."""
        if self._control_ref is None and now - self._control_t >= _CONTROL_S:
            self._control_t = now
            direct, self._control_direct = self._control_direct, False
            try:
                if self._relay_control and not direct:
                    self._control_via = self.worker
                    self._control_ref = self.worker.control.remote(self.generation, self._trainer_report())
                else:
                    self._control_via = None
                    self._control_ref = self._coordinator.control.remote(self.generation, self._trainer_report())
            except Exception:  # noqa: BLE001
                self._control_ref = None
        if self.auto_durable:
            self._bandwidth(now)

    def _trainer_report(self) -> dict | None:
        """The training thread's latest measured window (:class:`ray_ckpt.policy.budget.Window`) for the
        coordinator's cost model, once per window; None when nothing new was measured. Sender thread."""
        meter = getattr(self.capture, "meter", None)
        if meter is None or meter.last is None or meter.windows == self._trainer_sent:
            return None
        self._trainer_sent = meter.windows
        out = meter.last.to_dict()
        state = getattr(getattr(self.capture, "policy", None), "state", None)
        if callable(state):   # the overhead budget's granularity: the run's next attempt starts from it
            out["granularity"] = state()
        return out

    def previous_granularity(self, timeout: float = 10.0) -> dict | None:
        """The overhead budget's state the coordinator last heard from this run's trainer (a previous attempt's,
        when this process attaches after a restart), or None. Training thread, at attach (one actor call)."""
        try:
            return ray.get(self._coordinator.granularity.remote(), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - an older or busy coordinator: measure from scratch
            log.debug("ray_ckpt: the previous attempt's granularity is not available: %s", e)
            return None

    def _bandwidth(self, now: float) -> None:
        """durable_diffs="auto": read the node worker's write figures about every ``_BANDWIDTH_S`` (one
        asynchronous call), derive its write bandwidth and choose the mode of the next diff chunks. Sender
        thread."""
        if self._bw_ref is not None:
            ready, _ = ray.wait([self._bw_ref], timeout=0)
            if not ready:
                return
            ref, self._bw_ref = self._bw_ref, None
            try:
                w = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a restarting worker: ask again later
                log.debug("ray_ckpt: worker stats unavailable: %s", e)
                return
            cur = (now, w.get("bytes_written", 0), w.get("write_seconds", 0.0), self.stats.diff_bytes)
            prev, self._bw_prev = self._bw_prev, cur
            if prev is None or cur[0] <= prev[0]:
                return
            dbytes, dsec = cur[1] - prev[1], cur[2] - prev[2]
            if dbytes >= 1 << 20 and dsec > 0.01:
                bw = dbytes / dsec
                self.write_bw = bw if self.write_bw is None else 0.5 * self.write_bw + 0.5 * bw
            rate = (cur[3] - prev[3]) / (cur[0] - prev[0])
            choice, self.durable_reason = choose_durable(self.durable_choice, diff_rate=rate,
                                                         write_bw=self.write_bw)
            if choice != self.durable_choice:
                log.info("ray_ckpt: durable_diffs=auto -> %s for run %r: %s", choice, self.run,
                         self.durable_reason)
                self.durable_choice = choice
        elif now - self._bw_t >= _BANDWIDTH_S:
            self._bw_t = now
            try:
                self._bw_ref = self.worker.stats.remote()
            except Exception:  # noqa: BLE001
                self._bw_ref = None

    def _drain_control(self, draining: dict) -> None:
        """Sender thread: the coordinator's view of the draining nodes; a drain of this node becomes the sink's
        notice (every record handed over at once; near the deadline each step waits until it is safe)."""
        self._draining_nodes = set(draining)
        deadline = draining.get(self.node_id)
        if deadline is None:
            if self.drain.active and self.drain.info.get("source") == "node":
                log.info("ray_ckpt: node %s no longer drains; batching again", self.node_id[:12])
                self.notice(None)
            return
        if not self.drain.active:
            info = dict(drain_watch.notice_info(self.node_id, deadline), source="node")
            log.warning("ray_ckpt: this node (%s) is draining%s: every step is handed over at once, and near "
                        "the deadline each step waits until it is held on a node that stays",
                        self.node_id[:12], "" if not deadline else f" (deadline in {info['remaining_s']:.1f} s)")
            self.notice(info, drain_watch.deadline_monotonic(deadline))

    def _wait_noticed(self) -> None:
        """Training thread, under a drain notice: return once everything submitted is safe (held on two nodes,
        the second one staying, or durable) — or, when the node that drains is another one (a preemption of a
        node of the worker group elsewhere: Ray Train ends this process at the deadline, but this node stays),
        once this node's worker holds it: what it holds outlives this process, as every step's record does
        between its hand-off and its second copy."""
        n = self.drain.info or {}
        nodes = [x for x in (n.get("nodes") or [n.get("node")]) if x]
        if nodes and self.node_id not in nodes and self.node_id not in self._draining_nodes:
            self.notice_waits["received"] += 1
            self.wait_received()
        else:
            self.notice_waits["safe"] += 1
            self.wait_safe()

    def _wait_safe(self) -> None:
        self._drain_inflight()
        deadline = time.monotonic() + 300
        while self._unsafe:
            if time.monotonic() > deadline:
                raise WriterError(f"{len(self._unsafe)} chunks were not secured within 300 s")
            time.sleep(0.02)
            self._on_reply(self._call(lambda w: w.poll.remote(self.generation), "poll"))

    def _flush_worker(self) -> None:
        """Everything handed over is durable (resending to a restarted worker as often as needed)."""
        self._drain_inflight()
        for _ in range(self.submit_retries):
            self._call(lambda w: w.flush.remote(), "flush")
            self._on_reply(self._call(lambda w: w.poll.remote(self.generation), "poll"))
            if not self._unsafe:
                break
        else:
            raise WriterError(f"{len(self._unsafe)} chunks could not be made durable after {self.submit_retries} "
                              f"flushes of the node's persistence worker: {sorted(self._unsafe)[:5]}")
        if self.restarts_seen:
            self._wait_peers_durable()

    def _wait_peers_durable(self) -> None:
        """After a restart of this node's worker: chunks its old incarnation had secured on a peer (and so were
        not resent) are written by that peer (the coordinator asks it); wait until the coordinator's durable
        lineage reaches the last step handed over, so that ``flush`` keeps its promise."""
        last = self.stats.last_committed_step
        if last is None:
            return
        deadline = time.monotonic() + self.write_timeout
        while not self._closing and ray.is_initialized():   # an abandoned sink (or Ray shut down) stops waiting
            try:
                durable = ray.get(self._coordinator.status.remote(), timeout=30).get("durable_step")
            except Exception as e:  # noqa: BLE001 - the coordinator restarts: ask again
                log.debug("ray_ckpt: coordinator status unavailable: %s", e)
                durable = None
            if durable is not None and durable >= last:
                return
            if time.monotonic() > deadline:
                raise WriterError(f"steps up to {last} were not durable within {self.write_timeout} s after the "
                                  f"persistence worker restarted (durable up to {durable})")
            time.sleep(0.1)
