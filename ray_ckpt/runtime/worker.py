"""PersistenceWorker: one Ray actor per node that holds checkpoint objects in the object store and persists them.

Data path (docs/architecture.md): the training process's sender thread calls :meth:`submit` with one *chunk* —
a full checkpoint, or the encoded records of one or more consecutive steps (one segment, encoded once in the
training process, its checksum left to this worker) — and its manifest. The worker

1. checksums the chunk's bytes and ``ray.put``s them itself (objects put by a training worker die with it): the
   chunk is held in this node's object store, the *memory tier*;
2. replicates it to a peer node's worker (:meth:`hold_replica`) and forwards it to the run's state-tier replica
   (:mod:`ray_ckpt.runtime.replica`), both asynchronously — except a *coarse* full (``records_follow: false`` in
   its manifest info: the overhead budget's every-k mode, where no record follows a full), which is only written
   (but copied to the peer too on a node that drains): the replica would rebuild itself from it for no record to
   replay, and the peer copy would cost the node a transfer of the whole state for the moments until the write
   is done;
3. writes it to durable storage from a background thread: consecutive diff chunks are laid end to end into one
   object of about ``batch_steps`` steps (segments, :mod:`ray_ckpt.format.segments`: no decode, no re-encode,
   the checksum combined from the chunks'), fulls as they are; each commit is reported.

A chunk is *safe* once it is held on two nodes or durable. :meth:`submit` answers with this worker's
incarnation and the chunks that became safe since the last answer; the sender keeps every chunk until it is
safe and sends the unsafe ones again to a restarted worker (a new incarnation holds nothing), so a worker
restart never opens a hole in the lineage.

Messages to the coordinator (receiving, held, durable, released: :mod:`ray_ckpt.runtime.reports`) go through one
queue and one thread, in order, batched: one actor call per report interval (50 ms, longer in a wide job: the
coordinator answers each call with the interval that keeps all its workers' calls near ``REPORT_CALLS_PER_S``),
not one per step, and none while the
last one is unanswered (a coordinator that is behind gets fewer, larger calls); they carry the manifests as
objects (no JSON for the coordinator to parse and validate: the worker validated them on arrival) and no object
references (a restore plan asks the holders for them: :meth:`PersistenceWorker.holder_refs`).

With ``durable_diffs="fulls"`` (in the chunk's manifest info) a diff chunk is *lazy*: it is written only on
flush, under memory pressure, or when it is not held on a second node (no peer acknowledged it within
``LAZY_GRACE_S``, or its peer is no longer the ring's next node; on a one-node cluster always); once a durable
full of its generation covers its steps (:meth:`cover`, from the coordinator), it is dropped from the write queue and becomes releasable.

Memory is bounded by ``memory_budget`` bytes: durable objects are released oldest first (the newest full is
kept); an object that is not durable is never released, whoever holds it. When nothing is releasable,
:meth:`submit` waits for the writer, which stalls the sender and, through its bounded queue, the training
thread (backpressure, never an unbounded queue).

Where it runs: a detached, named, node-pinned actor (``max_restarts=-1``); all methods are called remotely.
The actor is threaded (``max_concurrency``); shared state is guarded by one condition variable.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import uuid

import ray

from ray_ckpt.engine.lineage_io import unhide
from ray_ckpt.lineage import Manifest
from ray_ckpt.runtime import metrics as _metrics
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.buffers import as_buffers, taken
from ray_ckpt.runtime.control_relay import CONTROL_RELAY_S, CONTROL_STALE_S, ControlRelay
from ray_ckpt.runtime.drain import draining_nodes
from ray_ckpt.runtime.held_store import Held, HeldStore
from ray_ckpt.runtime.peer_ring import PeerRing
from ray_ckpt.runtime.report_channel import REPORT_INTERVAL_S, ReportChannel
from ray_ckpt.runtime.reports import answered_interval, pack_reports  # noqa: F401 - re-exported (benchmarks, tests)
from ray_ckpt.runtime.write_queue import WriteQueue, merged_manifest
from ray_ckpt.storage.retry import RetryPolicy

log = logging.getLogger("ray_ckpt")

_RETRY_AFTER_FAILURE_S = 10.0   # a job whose write failed beyond its retry budget is tried again this much later


#: the share of its node's object store a worker may fill with held chunks (the rest: chunks in flight, copies
#: pulled for the peer and the replica, other users of the object store). A fuller store makes Ray spill held
#: chunks to disk and ask every Python worker of the cluster for a ``gc.collect()`` (at most every 10 s), which
#: holds each training process's interpreter lock for a few hundred ms (docs/state-tier.md#object-store-room)
OBJECT_STORE_SHARE = 0.3


def object_store_capacity(node_id: str) -> int:
    """The object store bytes of node ``node_id`` (0 when unknown). Any process connected to Ray."""
    return int(next((n["Resources"].get("object_store_memory", 0) for n in ray.nodes()
                     if n.get("NodeID") == node_id), 0))


def _fit_object_store(budget: int, node_id: str) -> int:
    """``budget``, capped to :data:`OBJECT_STORE_SHARE` of this node's object store (with a warning): a budget the
    object store cannot hold makes Ray spill held chunks to disk and back, which costs more CPU than the
    checkpointing itself."""
    capacity = object_store_capacity(node_id)
    cap = int(capacity * OBJECT_STORE_SHARE)
    if capacity and budget > cap:
        log.warning("ray_ckpt: memory_budget %.0f MiB exceeds %d%% of this node's object store (%.0f MiB); holding "
                    "at most %.0f MiB on node %s (raise object_store_memory or lower memory_budget)",
                    budget / 2**20, OBJECT_STORE_SHARE * 100, capacity / 2**20, cap / 2**20, node_id[:12])
        return cap
    return budget


class PersistenceWorker:
    """One node's persistence worker of one run (see the module docstring): a thin actor over its parts — the held
    store (:class:`~ray_ckpt.runtime.held_store.HeldStore`), the write queue
    (:class:`~ray_ckpt.runtime.write_queue.WriteQueue`), the peer ring (:class:`~ray_ckpt.runtime.peer_ring.PeerRing`),
    the report channel (:class:`~ray_ckpt.runtime.report_channel.ReportChannel`) and the control relay
    (:class:`~ray_ckpt.runtime.control_relay.ControlRelay`), all under one condition variable. Its public methods
    are called remotely and run on the actor's threads; two threads of its own write (writer thread) and report
    (report thread)."""

    def __init__(self, run: str, storage, memory_budget: int, durable_delay: float = 2.0,
                 write_timeout: float = 300.0):
        self.run = run
        self._retry_policy = RetryPolicy(budget_s=write_timeout)
        self._retry_at = 0.0   # after a write failed beyond its retry budget: when to try that job again
        self.storage = storage  # a picklable StorageBackend
        self.node_id = ray.get_runtime_context().get_node_id()
        self.memory_budget = _fit_object_store(memory_budget, self.node_id)
        self.incarnation = uuid.uuid4().hex
        self._cv = threading.Condition()
        self._store = HeldStore(self.memory_budget)  # what this node's object store holds (under _cv)
        self._queue = WriteQueue(durable_delay)       # what goes to storage next (under _cv)
        self._error: str | None = None
        self._stats = collections.Counter()
        self._channel = ReportChannel(self.node_id, self._cv, lambda: lineages.coordinator(run))
        self._ring = PeerRing(
            self.node_id, self._cv, alive=lambda: [n["NodeID"] for n in ray.nodes() if n.get("Alive")],
            worker_of=lambda node: get_or_create_worker(run, node, storage, self.memory_budget, write_timeout),
            # a shard run's replica: its lineage of the replica host of this (the trainer's) node
            replica_of=lambda: lineages.replica(run, self.node_id if lineages.is_shard_run(run) else None),
            draining=draining_nodes)
        self._relay = ControlRelay()                  # control relayed for this node's rank (under _cv)
        for target, name in ((self._write_loop, "ray_ckpt-persist"), (self._report_loop, "ray_ckpt-report")):
            threading.Thread(target=target, daemon=True, name=name).start()
        # a restarted worker lost its objects: tell the coordinator first (in order with what follows); a first
        # incarnation says so (True: it never held anything, the coordinator has nothing to heal or re-read)
        self._channel.add(("started", self.node_id, not _reconstructed()))

    def _hold(self, m: Manifest, ref, nbytes: int, *, durable: bool, replica: bool, origin: str) -> None:
        """Hold ``m``'s object and report it ``held``, then wait for room in the memory budget (backpressure):
        durable objects are released oldest first; while nothing is releasable, the writer is waited for. The
        report is queued first, under the lock: a hold that waits for room while a later chunk passes it is no
        hole in the coordinator's view, and nothing of it is released before its hold is reported. Actor
        thread (submit, hold_replica)."""
        with self._cv:
            self._store.put(Held(m, ref, nbytes, durable, replica, origin))
            self._channel.add(("held", m, None, origin))   # no object ref: a plan asks the holders
            released = self._store.release_for_budget()
            while self._store.over_budget and self._error is None and self._queue.busy():
                t0 = time.perf_counter()
                self._cv.wait(0.5)
                self._stats["stall_seconds"] += time.perf_counter() - t0
                released += self._store.release_for_budget()
            if released:
                self._stats["released"] += len(released)
                self._channel.add(("release", released))

    # -- remote API: training processes --------------------------------------------------------------------------
    def submit(self, manifest_json: bytes, buffers: list, batch_steps: int = 1, replicate: bool = True,
               sealed: bool = True) -> dict:
        """Take one encoded chunk from a training process: hold, replicate, forward to the replica, persist.

        ``sealed=False``: encoded without its data checksum, which is computed here, off the training process
        (:func:`ray_ckpt.runtime.buffers.taken`).

        Returns ``{"node": node id, "incarnation": id, "safe": [chunk names safe since the last answer]}``.
        Its steps are in flight from the start (``receiving``: the coordinator does not call them lost while a
        put into a full object store waits and a later chunk is held) until held (or ``not_received``)."""
        m = Manifest.from_json(manifest_json)
        if self._received_again(m, sealed):
            return self.poll(m.generation)
        self._channel.add(("receiving", [m]))
        try:
            bufs, m, nbytes = taken(m, buffers, sealed)   # the trainer's shared memory read in place, sealed
            ref = ray.put(bufs)  # this actor owns the copy (ray.put's _owner is gone since Ray 2.56)
        except BaseException:
            self._channel.add(("not_received", [m.name]))
            raise
        self._hold(m, ref, nbytes, durable=False, replica=False, origin=self.node_id)   # reports it held
        # a coarse full (no record follows it: the overhead budget's every-k mode) is safe once written: no peer
        # copy and no state-tier replica, whose rebuild from it would serve no record (the restore reads it) —
        # but on a node that drains it is copied too: its write may not make the deadline (storage slow or
        # down), and the trainer waits for every step it handed over to be safe before the node goes
        coarse = m.kind == "full" and m.info.get("records_follow") is False
        copied = replicate and (not coarse or self._ring.drain_self)
        peer, peer_node = self._ring.peer() if copied else (None, "")
        if peer is not None:
            self._ring.copy(peer, peer_node, m, ref)
        replica = None if coarse else self._ring.replica()
        if replica is not None:
            replica.feed.remote(m.to_json(), [ref])
        with self._cv:
            self._queue.add(m, batch_steps)
            self._cv.notify_all()
        self._stats["received"] += 1
        self._stats["received_bytes"] += nbytes
        return self.poll(m.generation)

    def _received_again(self, m: Manifest, sealed: bool = True) -> bool:
        """Whether this incarnation holds ``m`` already: a hand-off sent again (its first call's answer was lost,
        e.g. a call Ray retried) is held and written once — queued again, it was written a second time, laid into
        a later batch — and, when it is safe by now, reported safe again (the lost answer may have said so)."""
        with self._cv:
            if not self._store.held_again(m, sealed):
                return False
        self._stats["received_again"] += 1
        return True

    def poll(self, generation: int) -> dict:
        """This worker's incarnation, the chunks of ``generation`` that became safe since the last poll, and
        ``error``: why writes to storage fail, once a write failed beyond its retry budget or in a way waiting does
        not fix (None while writes work; the sender then fails the training process with it)."""
        with self._cv:
            return {"node": self.node_id, "incarnation": self.incarnation,
                    "safe": self._store.take_safe(generation), "error": self._error}

    # -- remote API: other workers, the coordinator ----------------------------------------------------------------
    def hold_replica(self, manifest_json: bytes, refs: list, origin: str) -> bool:
        """Keep a copy of another node's chunk (pulled to this node, re-put: this actor owns the copy)."""
        m = Manifest.from_json(manifest_json)
        try:
            value = ray.get(refs[0], timeout=60)
        except Exception as e:  # noqa: BLE001 - the origin died before the copy: nothing to hold
            log.warning("ray_ckpt: replica of %s from %s lost: %s", m.name, origin, e)
            return False
        bufs = as_buffers(value)
        ref = ray.put(bufs)
        self._hold(m, ref, sum(memoryview(b).nbytes for b in bufs), durable=False, replica=True, origin=origin)
        self._stats["replicas"] += 1
        return True

    def mark_durable(self, names: list[str]) -> None:
        """The origin wrote these objects to storage: our replicas of them may now be released."""
        with self._cv:
            self._store.mark_durable(names)
            self._cv.notify_all()

    def persist(self, names: list[str]) -> list[str]:
        """Write held objects (replicas of a lost node or worker) to durable storage as they are.

        These commits may come after later steps' (the run went on): each object is first made known to the
        coordinator (one call, so that no lineage index it writes passes it) and, once committed, an index that
        hides it anyway (written before) is deleted (:func:`ray_ckpt.engine.lineage_io.unhide`)."""
        done = []
        for name in names:
            with self._cv:
                h = self._store.get(name)
            if h is None or h.durable:
                continue
            try:
                ray.get(self._channel.coordinator().report.remote(h.manifest.to_json(), self.node_id, [h.ref],
                                                                  False), timeout=30)
            except Exception as e:  # noqa: BLE001 - the coordinator restarts: unhide below still holds
                log.info("ray_ckpt: could not announce %s to the coordinator (%s)", name, e)
            self._commit(h.manifest, as_buffers(ray.get(h.ref)), [name])
            unhide(self.storage, h.manifest)
            done.append(name)
        return done

    def persist_origin(self, origin: str) -> list[str]:
        """``origin``'s worker restarted or its node is gone: write every replica of its chunks held here that is
        not durable yet (the coordinator asks every live worker: it may not know of replicas just taken)."""
        with self._cv:
            names = self._store.replicas_of(origin)
        done = self.persist(names)
        if done:
            log.info("ray_ckpt: node %s wrote %d chunks of restarted/lost node %s", self.node_id[:8], len(done),
                     origin[:8])
        return done

    def flush(self, timeout: float = 300.0) -> dict:
        """Write every pending chunk now and wait until everything received so far is durable, every replication
        call has settled (a replica whose peer died is given up: the object is durable) and the coordinator has
        applied the last report."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._queue.flush_requested += 1
            self._cv.notify_all()
            try:
                while ((self._queue.busy() or self._ring.copies or not self._channel.idle())
                       and self._error is None):
                    if time.monotonic() > deadline:
                        raise TimeoutError("persistence worker flush timed out")
                    self._cv.wait(0.1)
            finally:
                self._queue.flush_requested -= 1
            if self._error is not None:
                raise RuntimeError(f"persistence worker on node {self.node_id} failed: {self._error}")
            last = self._channel.last
        self._channel.await_delivery(last, deadline)
        return self.stats()

    def holder_refs(self, names: list[str]) -> dict:
        """``{name: [ObjectRef]}`` of the objects among ``names`` held here (a restore plan asks the holders:
        ``held`` reports carry no object refs, see :meth:`Coordinator.plan`). Called by the coordinator."""
        with self._cv:
            return {n: [h.ref] for n in names if (h := self._store.get(n)) is not None}

    # -- full-checkpoint control, relayed for this node's ranks (shard runs) -----------------------------------
    def control(self, generation: int, trainer: dict | None = None) -> dict | None:
        """The coordinator's latest control answer for ``generation``, as :meth:`Coordinator.control` gives it
        (``want_full`` and ``gaps`` delivered once), asked by the rank's sender instead of the coordinator: the
        node's worker host asks the coordinator once per ``CONTROL_RELAY_S`` for all its lineages
        (:meth:`WorkerHost.control_many`). ``trainer`` is forwarded with the next ask. None while this worker
        has no answer younger than ``CONTROL_STALE_S`` (the sender then asks the coordinator itself).
        Training process (remote)."""
        with self._cv:
            return self._relay.ask(generation, trainer)

    def control_requests(self) -> dict:
        """``{generation: [trainer reports]}`` of the generations whose sender asked within
        ``CONTROL_STALE_S`` (the reports taken). Worker host's control thread."""
        with self._cv:
            return self._relay.requests()

    def control_answer(self, generation: int, answer: dict, trainers: list) -> None:
        """The coordinator's answer for ``generation`` (kept until the sender's next :meth:`control`; a
        ``want_full`` or gap is kept until delivered). ``answer=None``: the ask failed, its ``trainers`` are
        forwarded with the next one. Worker host's control thread."""
        with self._cv:
            self._relay.answered(generation, answer, trainers)

    def inventory(self) -> list:
        """``[(manifest_json, [ref], durable)]`` of everything held (coordinator rebuild)."""
        with self._cv:
            return [(h.manifest.to_json(), [h.ref], h.durable) for h in self._store.items.values()]

    def cover(self, generation: int, step: int) -> int:
        """A durable full of ``generation`` at ``step`` exists: lazy diffs up to it need never be written (they
        stay held, releasable like durable objects, for restores of older steps while memory allows; the sender
        may drop them: nothing will ever write them)."""
        with self._cv:
            self._queue.cover(generation, step)
            n = len(self._store.cover(generation, step))
            self._stats["covered"] += n
            self._cv.notify_all()
        return n

    def release(self, names: list[str]) -> None:
        """Drop these objects (the coordinator's GC, or its memory budget once they are durable). One released
        before it was written or held on a peer is no longer needed (a newer durable full took its place): it is
        not written, and its sender hears that it is safe, since nothing will make it durable for it to wait on."""
        with self._cv:
            for m in self._store.release(names):
                self._queue.drop(m)
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return {"node_id": self.node_id, "incarnation": self.incarnation, "memory_budget": self.memory_budget,
                    "held_objects": len(self._store.items),
                    "held_bytes": self._store.nbytes, "queued_chunks": self._queue.queued_chunks(),
                    "error": self._error, **self._stats}

    def ping(self) -> str:
        return self.node_id

    # -- node drains (preemption notices, :mod:`ray_ckpt.runtime.drain`) ------------------------------------------
    def drain_notice(self, drains: dict) -> dict:
        """Ray drains the nodes ``drains`` (``{node: deadline_ms}``), from the coordinator. Peers are chosen among
        the nodes that stay from now on; when this node drains, everything it received is written at once
        (lazy diffs included) and so is what arrives until it is gone; every chunk received here whose second copy
        is not acknowledged yet, or is on a draining node, is copied to a node that stays. Returns
        ``{"node", "draining_self", "copied": chunks sent to a new peer}``."""
        if self._ring.notice(drains):
            log.warning("ray_ckpt: node %s is draining (deadline %s): writing everything it holds now",
                        self.node_id[:12], self._ring.draining[self.node_id] or "none")
        peer, peer_node = self._ring.peer()
        todo = []
        if peer is not None and peer_node not in self._ring.draining:
            with self._cv:
                todo = self._store.unsecured(self._ring.draining, self._ring.copying())
                for h in todo:
                    h.peer = None
            for h in todo:
                self._ring.copy(peer, peer_node, h.manifest, h.ref)
            if todo:
                log.info("ray_ckpt: node %s copies %d chunks to node %s (their second copy was on a draining "
                         "node or not acknowledged)", self.node_id[:12], len(todo), peer_node[:12])
        self._stats["drain_copies"] += len(todo)
        return {"node": self.node_id, "draining_self": self._ring.drain_self, "copied": len(todo)}

    # -- report thread: coordinator messages, replication acknowledgements -----------------------------------------
    def _report_loop(self) -> None:
        """Report thread: every report interval, the peer's acknowledgements (those chunks are safe) and one
        update call with the messages queued since the last one. One update call in flight: while the coordinator
        has not answered the last one (it is behind), the messages wait and go in the next call (a saturated
        coordinator gets fewer, larger calls, and answers sooner, instead of a growing queue of calls each costing
        it Ray's per-call work). Metrics about once a second."""
        deltas = _metrics.CounterDeltas({"run": self.run, "node": self.node_id[:12]})
        metrics_t = 0.0
        while True:
            if time.monotonic() - metrics_t >= 1.0:
                metrics_t = time.monotonic()
                _metrics.worker_metrics(self.stats(), deltas)
            self._channel.take_interval()
            busy = self._channel.unanswered()
            with self._cv:
                if not self._channel.pending and not self._ring.copies:
                    self._cv.wait(1.0)
                msgs = self._channel.take(busy)
            if not ray.is_initialized():   # a worker built outside an actor (tests) outlives its Ray: stop
                return
            self._ring.refresh_replica()
            for name, peer_node in self._ring.acknowledged():
                with self._cv:
                    self._store.mark_safe([name], peer=peer_node)
                    self._cv.notify_all()
            if self._channel.send(msgs):
                self._stats["coordinator_calls"] += 1
            with self._cv:   # a flush does not wait out a long interval (a wide job's)
                self._cv.wait_for(lambda: self._queue.flush_requested > 0, timeout=self._channel.interval)
            if self._queue.flush_requested > 0:
                time.sleep(REPORT_INTERVAL_S)

    # -- writer thread -----------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        """Writer thread: the write queue's next job (a full, or a run of diffs laid end to end), retried by the
        retry policy; a job that failed beyond it stays held and queued and is tried again later."""
        while True:
            with self._cv:
                job = None
                while job is None:
                    # after a write failed beyond its retry budget, nothing until _retry_at
                    if self._error is None or time.monotonic() >= self._retry_at:
                        job = self._queue.next_job(self._store.items, peer_node=self._ring.peer_node,
                                                   urgent=self._store.over_budget or self._ring.drain_self)
                    if job is None:
                        self._cv.wait(0.2)
                self._queue.writing = True
            try:
                kind, payload = job
                if kind == "full":
                    h = self._store.get(payload.name)
                    if h is not None:
                        self._commit(payload, as_buffers(ray.get(h.ref)), [payload.name])
                else:
                    self._write_batch(payload)
                with self._cv:
                    if self._error is not None:
                        log.warning("ray_ckpt: persistence on node %s works again", self.node_id[:8])
                    self._error = None
            except Exception as e:  # noqa: BLE001 - the job stays held and queued: retried, never dropped
                log.error("ray_ckpt: persistence failed beyond its retry budget (%s: %s); the data stays held "
                          "in memory and is retried in %g s", type(e).__name__, e, _RETRY_AFTER_FAILURE_S)
                with self._cv:
                    self._error = f"{type(e).__name__}: {e}"
                    self._retry_at = time.monotonic() + _RETRY_AFTER_FAILURE_S
                    self._queue.requeue(kind, payload)
            finally:
                with self._cv:
                    self._queue.writing = False
                    self._cv.notify_all()

    def _write_batch(self, run: list[Manifest]) -> None:
        """Writer thread: the diff chunks ``run`` as one object (those released meanwhile left out)."""
        bufs, covers = [], []
        for m in run:
            with self._cv:
                h = self._store.get(m.name)
            if h is None:  # released by GC meanwhile
                continue
            bufs.extend(as_buffers(ray.get(h.ref)))
            covers.append(m)
        if not covers:
            return
        if len(covers) == 1:
            self._commit(covers[0], bufs, [covers[0].name])
            return
        self._commit(merged_manifest(covers, bufs), bufs, [m.name for m in covers])

    def _commit(self, m: Manifest, bufs: list, covers: list[str]) -> None:
        """Write one object and its manifest; the chunks ``covers`` are durable (reported, safe for their sender,
        and their peers' replicas releasable). Writer thread, or the actor thread of a persist."""
        t0 = time.perf_counter()
        self._retry_policy.call(lambda: self.storage.write(m.object, bufs), f"writing {m.object!r}")
        self._retry_policy.call(lambda: self.storage.write(m.key, m.to_json()), f"writing {m.key!r}")
        self._stats["write_seconds"] += time.perf_counter() - t0
        self._stats["objects_written"] += 1
        self._stats["bytes_written"] += m.nbytes
        self._stats["diff_bytes_written" if m.kind == "diff" else "full_bytes_written"] += m.nbytes
        with self._cv:
            peers = self._store.mark_durable(covers)
            self._channel.add(("durable", m, covers))
            self._store.mark_safe(covers)
            self._cv.notify_all()
        for node, names in peers.items():
            try:
                lineages.worker(self.run, node).mark_durable.remote(names)
            except ValueError:
                pass


def _reconstructed() -> bool:
    """Whether this actor is a restarted incarnation (a hosted lineage's worker: whether its host is). Actor."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in an actor: say restarted (the coordinator then does the full check)
        return True


def _actor_options(name: str, node_id: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return dict(name=name, namespace=naming.NAMESPACE, lifetime="detached", get_if_exists=True,
                max_restarts=-1, max_task_retries=-1, max_concurrency=8, num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def _none() -> None:
    return None


class WorkerHost(lineages.LineageHost):
    """The persistence worker of a sharded job on one node (:mod:`ray_ckpt.runtime.lineages`): one
    :class:`PersistenceWorker` per shard lineage that this node's ranks write (opened by their first
    :meth:`~PersistenceWorker.submit`) or whose chunks it keeps for a peer node (opened by the first
    :meth:`~PersistenceWorker.hold_replica`), each with its own memory tier, write queue and threads and the
    budget this host was created with (the node's share of one rank). A restarted host holds nothing: it tells
    the job's coordinator, whose lineages forget what this node held and have peers persist it, as for a
    restarted worker of a run. Worker host actor (node-pinned, threaded); its methods are called remotely."""

    OPENING = frozenset({"submit", "hold_replica", "ping", "poll"})   # the rank's sink pings and polls it first
    ABSENT = {"inventory": list, "persist": list, "persist_origin": list, "cover": int, "release": _none,
              "mark_durable": _none, "drain_notice": dict, "flush": dict, "stats": dict, "holder_refs": dict,
              "control": _none}

    def __init__(self, job: str, root, memory_budget: int, write_timeout: float = 300.0):
        self._host_init(job)
        self.root = root
        self.memory_budget = memory_budget
        self.write_timeout = write_timeout
        if ray.get_runtime_context().was_current_actor_reconstructed:
            try:
                ray.get_actor(lineages.coordinator_host_name(job), namespace=naming.NAMESPACE
                              ).worker_host_started.remote(ray.get_runtime_context().get_node_id())
            except ValueError:
                pass
        threading.Thread(target=self._control_loop, daemon=True, name="ray_ckpt-control").start()

    def _control_loop(self) -> None:
        """Control thread: every ``CONTROL_RELAY_S``, one call to the job's coordinator host asking the control
        of every lineage whose rank asked this node's worker (:meth:`PersistenceWorker.control`), instead of
        one call per rank every 0.5 s; the answers wait in each lineage's worker for its rank's next ask."""
        coord = None
        while True:
            time.sleep(CONTROL_RELAY_S)
            workers = dict(self._lineages)
            reqs = [(run, gen, trainers) for run, w in workers.items()
                    for gen, trainers in w.control_requests().items()]
            if not reqs:
                continue
            try:
                coord = coord or ray.get_actor(lineages.coordinator_host_name(self.job), namespace=naming.NAMESPACE)
                answers = ray.get(coord.control_many.remote(reqs), timeout=CONTROL_STALE_S)
            except Exception as e:  # noqa: BLE001 - restarting or gone: the ranks ask the coordinator themselves
                log.debug("ray_ckpt: control relay of job %r failed: %s", self.job, e)
                coord, answers = None, [None] * len(reqs)
            for (run, gen, trainers), answer in zip(reqs, answers):
                workers[run].control_answer(gen, answer, trainers)

    def _open(self, run: str) -> PersistenceWorker:
        return PersistenceWorker(run, lineages.lineage_storage(self.root, run), self.memory_budget,
                                 write_timeout=self.write_timeout)


_remote_cls = None
_host_cls = None


def get_or_create_worker(run: str, node_id: str, storage, memory_budget: int, write_timeout: float = 300.0):
    """The PersistenceWorker of ``node_id`` for ``run`` (created pinned to that node if missing). Any process.

    Creation is idempotent across processes (``get_if_exists``): concurrent callers get the same actor. A shard
    run gets its lineage of the job's :class:`WorkerHost` on ``node_id`` (one actor per node and job, whatever
    the number of ranks; the lineage opens at its first chunk).
    """
    global _remote_cls, _host_cls
    if lineages.is_shard_run(run):
        name = lineages.worker_host_name(lineages.job_of(run), node_id)
        try:
            host = ray.get_actor(name, namespace=naming.NAMESPACE)
        except ValueError:
            if _host_cls is None:
                _host_cls = ray.remote(WorkerHost)
            opts = {**_actor_options(name, node_id), "max_concurrency": 32}
            host = _host_cls.options(**opts).remote(lineages.job_of(run), lineages.root_storage(storage, run),
                                                    memory_budget, write_timeout=write_timeout)
        return lineages.LineageHandle(host, run)
    name = naming.worker_name(run, node_id)
    try:
        return ray.get_actor(name, namespace=naming.NAMESPACE)
    except ValueError:
        pass
    if _remote_cls is None:
        _remote_cls = ray.remote(PersistenceWorker)
    return _remote_cls.options(**_actor_options(name, node_id)).remote(run, storage, memory_budget,
                                                                       write_timeout=write_timeout)
