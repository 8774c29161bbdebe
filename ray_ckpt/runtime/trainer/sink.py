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
                    actor call, whose answer it collects later (at most ``transport.MAX_INFLIGHT`` unanswered: the next
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
``runtime_stats()["held_step"]`` is the newest such step (``last_committed_step`` counts the steps handed over,
acknowledged or not). Durability follows asynchronously in the worker.

Parts, each testable without Ray, all called on the sender thread: the transport to the node's worker (hand-offs,
answers, resends, the shared-memory fallback: :mod:`~ray_ckpt.runtime.trainer.transport`), the control poll
(:mod:`~ray_ckpt.runtime.trainer.control_poll`) and the durable-mode choice of ``durable_diffs="auto"``
(:mod:`~ray_ckpt.runtime.trainer.durable_choice`). The sink encodes the chunks and runs the sender loop.
"""
from __future__ import annotations

import logging
import time

import ray

from ray_ckpt.engine.writer import BoundedSink, FlushMarker, WriterError
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format import checksum, framing
from ray_ckpt.format.records import FullState
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.runtime import metrics as _metrics
from ray_ckpt.runtime import drain as drain_watch
from ray_ckpt.runtime import lineages
from ray_ckpt.runtime import shared
from ray_ckpt.runtime.shared import SharedMemoryUnavailable
from ray_ckpt.runtime.trainer.arena import SharedArena
from ray_ckpt.runtime.trainer.control_poll import CONTROL_S, ControlPoll
from ray_ckpt.runtime.trainer.durable_choice import DurableChoice
from ray_ckpt.runtime.trainer.transport import Chunk, Transport, coalesce
from ray_ckpt.runtime.worker import get_or_create_worker

log = logging.getLogger("ray_ckpt")

_METRICS_S = 1.0        # how often the sender publishes the training thread's metrics
_POLL_S = 0.25          # how often an idle sender asks the worker which chunks became safe
_REAP_S = 0.05          # how soon an idle sender collects the answers of hand-offs in flight


class RaySink(BoundedSink):
    checksums_here = False   # the node's worker seals each chunk (PersistenceWorker.submit)

    def __init__(self, run: str, storage, impl, generation: int, *, config, info: dict | None = None,
                 replica: bool = False, submit_retries: int = 20):
        # at most batch_steps records wait for the sender (plus the chunk it is collecting): a sender that falls
        # behind the training thread (interpreter lock, busy cores) slows it instead of piling up steps a crash
        # of this process would lose
        super().__init__(config.max_pending_bytes, f"ray_ckpt-sender-g{generation}",
                         max_queued=max(2, config.batch_steps))
        self.run, self.storage, self.impl, self.generation = run, storage, impl, generation
        self.config = config
        self.replica_enabled = replica
        self.info = dict(info or {})
        if config.durable_diffs not in ("all", "auto"):   # the workers hold these diffs in memory
            self.info["durable_diffs"] = config.durable_diffs
        #: durable_diffs="auto": the mode chosen per chunk from the measured write bandwidth ("all" or "fulls")
        self.durable = DurableChoice(config.durable_diffs, run)
        self._trainer_sent = 0               # meter windows already reported to the coordinator
        self.node_id = ray.get_runtime_context().get_node_id()
        worker = get_or_create_worker(run, self.node_id, storage, config.memory_budget, config.write_timeout)
        ray.get(worker.ping.remote())  # started and ready before the first step is handed over
        #: the capture's gradient buffers in memory shared with the node worker (None: not available here)
        arena: SharedArena | None = None
        if config.shared_handoff:
            try:
                arena = SharedArena(config.max_pending_bytes)
            except (OSError, SharedMemoryUnavailable) as e:
                log.info("ray_ckpt: no shared-memory hand-off (%s): the sender hands the bytes over", e)
        self.transport = Transport(
            worker, generation=generation, batch_steps=config.batch_steps, storage_uri=storage.uri,
            release=self._release, arena=arena, retries=submit_retries,
            worker_of=lambda: get_or_create_worker(run, self.node_id, storage, config.memory_budget,
                                                   config.write_timeout))
        self._coordinator = lineages.coordinator(run)   # a shard run's: its lineage of the job's coordinator
        #: a shard run asks its node's worker for control (relayed, one coordinator call per node)
        self.control = ControlPoll(run, generation, self._coordinator, worker=lambda: self.transport.worker,
                                   report=self._trainer_report, on_draining=self._drain_control,
                                   relay=lineages.is_shard_run(run))
        self._draining_nodes: set = set()   # the GCS drain state as the coordinator last told it (sender thread)
        #: steps that waited under a drain notice: until held by this node's worker / until safe
        self.notice_waits = {"received": 0, "safe": 0}
        self.chunks_sent = 0
        self.shared_chunks = 0        # chunks handed over by descriptor
        self.handoff_seconds = 0.0    # sender thread: encode + hand-off
        self.sender_cpu_seconds = 0.0
        self.capture = None           #: the training loop's capture (set by the Checkpointer): step times
        self._metrics_t = 0.0
        self._metrics = _metrics.CounterDeltas({"run": run})
        self._thread.start()

    # -- training thread ----------------------------------------------------------------------------------------
    def host_memory(self, nbytes: int):
        """Memory for one of the capture's gradient buffers (training thread): ``(tensor, descriptor)`` in the
        shared arena, or None (heap memory; the bytes are then handed over)."""
        arena = self.transport.arena
        return arena.allocate(nbytes) if arena is not None else None

    def full_control(self) -> tuple[bool, bool]:
        """``(delegated, wanted)``, see :class:`ray_ckpt.engine.capture.Sink`. Training thread, O(1)."""
        c = self.control.state
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
        t = self.transport
        out = {"actor_calls": t.actor_calls, "chunks_sent": self.chunks_sent,
               "shared_chunks": self.shared_chunks, "shared_handoff": t.arena is not None,
               "resent_chunks": t.resent_chunks, "unsafe_chunks": len(t.unsafe), "held_step": t.held_step,
               "handoff_seconds": self.handoff_seconds, "sender_cpu_seconds": self.sender_cpu_seconds,
               "delegated_fulls": bool(self.replica_enabled and self.control.state["delegate"]),
               "control_answers": dict(self.control.asks), "notice_waits": dict(self.notice_waits),
               "durable_diffs": self.durable.stats()}
        try:
            out["worker"] = ray.get(t.worker.stats.remote(), timeout=timeout)
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
                        waits.append(chunk_t0 + self.config.handoff_delay - now)
                    if self.transport.unsafe:
                        waits.append(self.transport.poll_t + _POLL_S - now)
                    if self.transport.inflight or self.control.ref is not None:
                        # answers to collect: looked for _REAP_S after the last round (a deadline, not a
                        # duration: this loop re-computes it after every wake-up), never spun on
                        waits.append(hk_t + _REAP_S - now)
                    if self.control.ref is None:
                        waits.append(self.control.t + CONTROL_S - now)
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
                            self.transport.drain()   # every hand-off answered: held by this node's worker
                        elif item.safe_only:
                            self.transport.wait_safe()
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
                        slow = gap_ewma is not None and gap_ewma > self.config.handoff_delay
                        if close_batch or len(chunk) >= self.config.batch_steps or self._pressure or slow \
                                or self.drain.active:   # a drain notice: nothing waits to be batched
                            self._handoff(chunk)
                            chunk = []
                        elif time.monotonic() - hk_t < _REAP_S:
                            # a record only collected: no Ray call per step (ray.wait on the hand-offs in flight
                            # holds the interpreter lock the training thread needs); at least every _REAP_S
                            continue
                elif chunk and time.monotonic() >= chunk_t0 + self.config.handoff_delay:
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
        with framing.unsealed():   # the worker checksums the bytes as it takes them (segments.seal)
            if full:
                state = items[0][0]
                bufs, info = rec_fmt.encode_full(state), dict(getattr(state, "manifest_info", None) or {})
            else:
                recs = [r for r, _ in items]
                bufs, info = self.impl.encode_diffs(recs)
        if full:
            kind, first, last = "full", state.step, state.step
            name = full_name(self.generation, state.step)
        else:
            info = dict(info)
            delegated = [r.step for r in recs if getattr(r, "full_delegated", False)]
            if delegated:
                info["replica_fulls"] = delegated   # the replica writes the fulls of these steps
            kind, last = "diff", recs[-1].step
            first = info.pop("first_step", recs[0].step)
            name = diff_name(self.generation, first, last)
            info.update(self.durable.info())   # "auto": the bandwidth may not carry every diff
        n = sum(memoryview(b).nbytes for b in bufs)
        # unsealed: the worker fills in the size and checksum of the sealed object (PersistenceWorker.submit)
        m = Manifest(kind=kind, generation=self.generation, first_step=first, last_step=last,
                     object=object_key(name), nbytes=n, crc32=0, crc_alg=checksum.DEFAULT, strategy=self.impl.name,
                     info={**self.info, **info})
        arena = self.transport.arena   # the capture's gradient buffers and fulls live there: named, not carried
        arrays = coalesce(bufs, describe=arena.describe if arena is not None else None)
        c = Chunk(m, arrays, sum(s for _, s in items), [r for r, _ in items], sealed=False)
        if any(shared.is_descriptor(a) for a in arrays):
            c.plain = coalesce(bufs)
            self.shared_chunks += 1
        self.transport.send(c)
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

    def safe_latency(self) -> float | None:
        """Seconds a recent hand-off took to become safe (the longest, fading); None before one was. Any
        thread."""
        return self.transport.safe_latency

    def _housekeeping(self) -> None:
        """Sender thread, between records: collect hand-off answers, publish metrics, poll what became safe,
        the control poll and (durable_diffs="auto") the write bandwidth. Never waits, but for a poll."""
        self.transport.reap()
        now = time.monotonic()
        if now - self._metrics_t >= _METRICS_S:
            self._metrics_t = now
            self._publish_metrics()
        if self.transport.unsafe and now - self.transport.poll_t >= _POLL_S:
            self.transport.poll_t = now
            self.transport.poll()
        self.control.poll(now)
        if self.durable.auto:
            self.durable.measure(now, self.transport.worker, self.stats.diff_bytes)

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

    def _flush_worker(self) -> None:
        """Everything handed over is durable (resending to a restarted worker as often as needed; after a
        restart, the peers' writes of what its old incarnation had secured are waited for too). Sender thread."""
        self.transport.flush()
        if self.transport.restarts_seen:
            self._wait_peers_durable()

    def _wait_peers_durable(self) -> None:
        """After a restart of this node's worker: chunks its old incarnation had secured on a peer (and so were
        not resent) are written by that peer (the coordinator asks it); wait until the coordinator's durable
        lineage reaches the last step handed over, so that ``flush`` keeps its promise."""
        last = self.stats.last_committed_step
        if last is None:
            return
        deadline = time.monotonic() + self.config.write_timeout
        while not self._closing and ray.is_initialized():   # an abandoned sink (or Ray shut down) stops waiting
            try:
                durable = ray.get(self._coordinator.status.remote(), timeout=30).get("durable_step")
            except Exception as e:  # noqa: BLE001 - the coordinator restarts: ask again
                log.debug("ray_ckpt: coordinator status unavailable: %s", e)
                durable = None
            if durable is not None and durable >= last:
                return
            if time.monotonic() > deadline:
                raise WriterError(f"steps up to {last} were not durable within {self.config.write_timeout} s after the "
                                  f"persistence worker restarted (durable up to {durable})")
            time.sleep(0.1)
