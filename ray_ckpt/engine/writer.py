"""The asynchronous writer: batches step records, encodes, writes, then commits with a manifest.

One daemon thread per Checkpointer. Call order::

    submit(item)   training thread; blocks while captured-but-not-durable bytes exceed the budget
    flush()        training thread; returns when everything submitted so far is committed (or raises the
                   writer's error)
    close()        training thread; flush, then stop the thread

Memory is bounded by ``max_pending_bytes`` (backpressure, no unbounded queue): when the training thread has
to wait, the writer writes the partial batch at once instead of waiting for it to fill. A write that fails
``write_retries`` times stops the writer; the error is raised on the training thread at the next
``submit``/``flush``. Commit protocol per object: data object written (atomically) → manifest written
(atomically) last. A reader never sees an object without its manifest.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import struct
import threading
import time
from typing import Callable

from ray_ckpt.format import checksum, framing, segments
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format.records import FullState
from ray_ckpt.lineage import Lineage, Manifest, collectable, diff_name, full_name, gc_cutoff, object_key
from ray_ckpt.lineage import index as lineage_index
from ray_ckpt.lineage import retention
from ray_ckpt.storage.retry import PermanentStorageError, RetryBudgetExceeded, RetryPolicy
from ray_ckpt.storage.base import ObjectNotFound
from ray_ckpt.engine.drains import SYNC_BEFORE_DEADLINE_S, SYNC_MIN_S, SYNC_WAIT_FACTOR, DrainNotice
from ray_ckpt.engine import rank_heads
from ray_ckpt.engine.lease import LeaseLost
from ray_ckpt.engine.sink import FlushMarker, Sink, WriterError, WriterStats

log = logging.getLogger("ray_ckpt")


__all__ = ["AsyncWriter", "BoundedSink", "FlushMarker", "WriterError", "WriterStats", "SYNC_BEFORE_DEADLINE_S",
           "SYNC_MIN_S", "SYNC_WAIT_FACTOR"]


class BoundedSink(Sink):
    """A bounded hand-off from the training thread to one background thread (the engine's writer, the Ray
    runtime's sender). Subclasses implement ``_run`` (the thread body) on ``_queue`` entries
    ``(item, size, close_batch)``, call :meth:`_release` when an item's bytes are no longer held, and
    :meth:`_fail` on an unrecoverable error.

    ``submit`` blocks while queued + unreleased bytes would exceed ``max_pending_bytes`` (setting ``_pressure``
    so the thread can act early); ``flush`` waits until the thread has processed a marker; errors of the thread
    are raised on the training thread at its next call.
    """

    def __init__(self, max_pending_bytes: int, thread_name: str, max_queued: int | None = None):
        self.max_pending_bytes = max_pending_bytes
        #: at most this many items wait in the queue for the background thread (None: bytes alone bound it); a
        #: thread that falls behind then slows the training thread instead of letting unsent steps pile up
        self.max_queued = max_queued
        self.stats = WriterStats()
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._pressure = False
        self._error: BaseException | None = None
        self._error_reported = False              # the error was raised in the training thread once
        self._closing = False
        #: the drain notice of this node, if any (:mod:`ray_ckpt.engine.drains`)
        self.drain = DrainNotice(safe_latency=self.safe_latency)
        self._cpu_clock: int | None = None       # the background thread's CPU clock (where the platform has one)
        self._cpu_clock_failed = False
        self._cpu_seen = 0.0
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)

    def _main(self) -> None:
        try:   # read from the training thread by background_cpu(); the clock is valid while this thread lives
            self._cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):
            self._cpu_clock, self._cpu_clock_failed = None, True
        self._run()

    def _run(self) -> None:
        raise NotImplementedError

    @property
    def measures_cpu(self) -> bool:
        """Whether :meth:`background_cpu` reads the background thread's own CPU clock (Linux and most Unixes). Known
        at once, before the thread has run (it then has used no CPU)."""
        return hasattr(time, "pthread_getcpuclockid") and not self._cpu_clock_failed

    def background_cpu(self) -> float:
        """CPU seconds the background thread (the writer or sender: encoding, writes, hand-offs, actor calls) has
        used so far; the last value read once the thread has ended, 0.0 before it has run and where the platform
        has no per-thread clock (:attr:`measures_cpu`). Any thread; one clock read."""
        clock = self._cpu_clock
        if clock is not None and self._thread.is_alive():
            try:
                self._cpu_seen = time.clock_gettime(clock)
            except OSError:   # the thread ended between the two calls
                pass
        return self._cpu_seen

    # -- training thread -------------------------------------------------------------------------------------
    def submit(self, item, *, close_batch: bool = False) -> None:
        """Queue a diff record or a :class:`FullState` (training thread; may block for memory)."""
        size = item.nbytes
        with self._cv:
            self._raise_if_failed()
            if self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes:
                t0 = time.perf_counter()
                self._pressure = True
                self._cv.notify_all()
                while (self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes
                       and self._error is None):
                    self._cv.wait(0.5)
                self._pressure = False
                self.stats.stall_seconds += time.perf_counter() - t0
                self._raise_if_failed()
            if self.max_queued is not None and len(self._queue) >= self.max_queued:
                t0 = time.perf_counter()
                while len(self._queue) >= self.max_queued and self._error is None:
                    self._cv.wait(0.5)
                self.stats.stall_seconds += time.perf_counter() - t0
                self.stats.queue_stalls += 1
                self._raise_if_failed()
            self._pending_bytes += size
            self._queue.append((item, size, close_batch))
            self._cv.notify_all()
        if self.drain.sync_due():
            notice, t0 = self.drain.info, time.perf_counter()
            self._wait_noticed()
            took = time.perf_counter() - t0
            self.stats.notice_syncs += 1
            self.stats.notice_sync_seconds += took
            self.drain.waited(notice, took)

    # -- drain notices (:class:`ray_ckpt.engine.drains.DrainNotice`) -------------------------------------------
    def notice(self, info: dict | None, deadline: float | None = None) -> None:
        """This process's node drains (Ray will remove it; ``deadline`` on the monotonic clock, None: none given;
        ``info`` is what :attr:`noticed` returns) or, with ``info=None``, no longer does. Any thread. From the
        notice on, the background thread hands every step over at once instead of batching it, and steps near the
        deadline wait in :meth:`submit` until they are safe (:meth:`_wait_noticed`; see
        :class:`~ray_ckpt.engine.drains.DrainNotice`)."""
        with self._cv:
            self.drain.set(info, deadline)
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the background thread ended)."""
        return self._closing or not self._thread.is_alive()

    @property
    def noticed(self) -> dict | None:
        """The drain notice in force (a copy), or None."""
        return self.drain.copy()

    @property
    def draining(self) -> bool:
        """Whether a drain notice is in force (O(1), no copy)."""
        return self.drain.active

    def safe_latency(self) -> float | None:
        """Seconds a recent hand-off took to become safe (the longest, fading), None where the sink does not
        measure it. Any thread."""
        return None

    def sync_margin(self) -> float:
        """Seconds before a notice's deadline from which every step submitted waits until it is safe (see
        :meth:`ray_ckpt.engine.drains.DrainNotice.sync_margin`). Any thread."""
        return self.drain.sync_margin()

    @property
    def drain_due(self) -> bool:
        """Whether a drain notice asks for every step to be recorded now (see
        :meth:`ray_ckpt.engine.drains.DrainNotice.every_step_due`). Training thread, O(1)."""
        return self.drain.every_step_due()

    def _wait_noticed(self) -> None:
        """Training thread, under a drain notice: return once everything submitted is safe. Here: written."""
        self.flush()

    def flush(self, timeout: float | None = None) -> None:
        """Return once everything submitted so far is handled (training thread; blocks)."""
        marker = FlushMarker()
        with self._cv:
            self._raise_if_failed()
            self._queue.append((marker, 0, True))
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.done.wait(0.2):
            with self._cv:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise WriterError("the background thread is gone")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"flush did not finish within {timeout} s")
        with self._cv:
            self._raise_if_failed()

    @property
    def failed(self) -> bool:
        """Whether the background thread failed (what :meth:`submit` and :meth:`flush` then raise)."""
        return self._error is not None

    def close(self, timeout: float | None = None) -> None:
        """Handle what was submitted (a flush), then stop the background thread. A failure is raised here only
        when no earlier call raised it: after the training thread saw the error, close just stops (training
        thread; blocks)."""
        try:
            with self._cv:
                if self._error is not None:
                    if not self._error_reported:
                        self._raise_if_failed()
                    return
            if self._thread.is_alive():
                self.flush(timeout)
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join(timeout=5)

    #: whether this process computes the data checksum of what it hands over (the Ray runtime's sender leaves it
    #: to the node's worker: :func:`ray_ckpt.format.framing.unsealed`)
    checksums_here = True

    def handoff_cpu(self, records: list) -> float:
        """This sink's encode of ``records`` (``self.impl``'s, as one batch), with the checksum where this process
        computes it, timed on the calling thread's CPU clock (training thread, at attach; see
        :meth:`Sink.handoff_cpu`)."""
        c0 = time.thread_time()
        with contextlib.nullcontext() if self.checksums_here else framing.unsealed():
            self.impl.encode_diffs(records)
        return time.thread_time() - c0

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._error_reported = True
            raise WriterError(f"checkpoint writer failed: {self._error}") from self._error

    # -- background thread -------------------------------------------------------------------------------------
    def _release(self, size: int) -> None:
        with self._cv:
            self._pending_bytes -= size
            self._cv.notify_all()

    def _fail(self, e: BaseException, current=None) -> None:
        """Record the error, unblock every waiter (flush markers included); later calls raise it."""
        log.error("ray_ckpt: background thread failed: %s", e)
        with self._cv:
            self._error = e
            for it, _, _ in self._queue:
                if isinstance(it, FlushMarker):
                    it.done.set()
            self._queue.clear()
            self._cv.notify_all()
        if isinstance(current, FlushMarker):
            current.done.set()


class AsyncWriter(BoundedSink):
    def __init__(self, storage, generation: int, impl, *, max_pending_bytes: int, write_retries: int = 3,
                 write_timeout: float = 300.0, info: dict | None = None,
                 on_commit: Callable[[Manifest], None] | None = None, index: list | None = None,
                 keep_fulls: int = 0, lease=None, max_batch_delay: float | None = None):
        super().__init__(max_pending_bytes, f"ray_ckpt-writer-g{generation}")
        self.storage = storage
        self.generation = generation
        self.write_retries = write_retries
        self._retry_policy = RetryPolicy(budget_s=write_timeout, min_attempts=write_retries)
        self.impl = impl
        self.info = dict(info or {})
        self.on_commit = on_commit
        #: committed manifests known to this writer (those of earlier generations + its own): rolled up into the
        #: lineage index after every full; None: write no index
        self._index = list(index) if index is not None else None
        #: > 0: after each full, chains older than the keep_fulls newest fulls are deleted (needs the index list)
        self.keep_fulls = keep_fulls
        #: the writer lease (:mod:`ray_ckpt.engine.lease`), renewed before commits; None: no lease
        self.lease = lease
        self._index_clock = lineage_index.RewriteClock()   # when a full also rewrites the lineage index
        self._batch: list = []
        #: seconds a partial batch may wait for more records before it is written (None: until the policy closes
        #: it); bounds what a crash loses in time as well as in steps
        self.max_batch_delay = max_batch_delay
        self._batch_t0 = 0.0
        self._thread.start()

    # -- writer thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing and not (self._pressure and self._batch):
                    if self._batch and self.max_batch_delay is not None:
                        left = self._batch_t0 + self.max_batch_delay - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
                    else:
                        self._cv.wait()
                if self._closing and not self._queue:
                    return
                entry = self._queue.popleft() if self._queue else None
            try:
                if entry is None:          # pressure or an overdue partial batch, nothing queued: write it now
                    self._write_batch()
                    continue
                item, size, close_batch = entry
                if isinstance(item, FlushMarker):
                    self._write_batch()
                    item.done.set()
                elif isinstance(item, FullState):
                    self._write_batch()
                    self._write_full(item)
                    rec_fmt.recycle([item])
                    self._release(size)
                else:  # a strategy's diff record
                    if not self._batch:
                        self._batch_t0 = time.monotonic()
                    self._batch.append((item, size))
                    overdue = (self.max_batch_delay is not None
                               and time.monotonic() - self._batch_t0 >= self.max_batch_delay)
                    if overdue and not close_batch:
                        self._absorb_queued()   # what arrived during the last write goes into this one
                    if close_batch or self._pressure or overdue or self.drain.active:
                        self._write_batch()
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                self._fail(e, entry[0] if isinstance(entry, tuple) else None)
                return

    def _absorb_queued(self) -> None:
        """Writer thread: move the step records queued right behind the batch into it (up to a full, a flush
        marker or a record that closes its batch, included), so that a writer whose writes take longer than the
        steps writes what piled up as one object instead of one object per record (and never falls behind)."""
        with self._cv:
            while self._queue:
                item, size, close = self._queue[0]
                if isinstance(item, (FlushMarker, FullState)):
                    break
                self._queue.popleft()
                self._batch.append((item, size))
                if close:
                    break

    def _write_batch(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        recs = [r for r, _ in batch]
        t0 = time.perf_counter()
        for r in recs:
            rec_fmt.wait_ready(r)
        bufs, info = self.impl.encode_diffs(recs)
        self.stats.encode_seconds += time.perf_counter() - t0
        first = info.pop("first_step", recs[0].step)
        name = diff_name(self.generation, first, recs[-1].step)
        self._commit("diff", name, first, recs[-1].step, bufs, info)
        del bufs
        rec_fmt.recycle(recs)
        self.stats.steps_committed += len(recs)
        self._release(sum(s for _, s in batch))

    def _write_full(self, state: FullState) -> None:
        t0 = time.perf_counter()
        bufs = rec_fmt.encode_full(state)
        self.stats.encode_seconds += time.perf_counter() - t0
        # manifest_info: steps the overhead budget left unrecorded before this full (not a gap)
        self._commit("full", full_name(self.generation, state.step), state.step, state.step, bufs,
                     getattr(state, "manifest_info", None))

    def _commit(self, kind: str, name: str, first: int, last: int, bufs: list, info: dict | None = None) -> None:
        try:   # one container (every LowDiff object): from the data checksum its encoder computed, no pass
            crc, nbytes, alg = segments.object_crc(bufs)
        except (ValueError, KeyError, TypeError, struct.error):   # other framing: one pass over the bytes
            alg = checksum.DEFAULT
            crc, nbytes = checksum.of_buffers(alg, bufs)
        okey = object_key(name)
        manifest = Manifest(kind=kind, generation=self.generation, first_step=first, last_step=last,
                            object=okey, nbytes=nbytes, crc32=crc, crc_alg=alg, strategy=self.impl.name,
                            info={**self.info, **(info or {})})
        if self.lease is not None:   # another job took the lineage over: stop before writing anything of ours
            def renew():
                try:
                    self.lease.renew()
                except LeaseLost as e:   # an answer, not a storage failure: never retried
                    return e
                return None
            try:
                lost = self._retry_policy.call(renew, "renewing the writer lease")
            except (RetryBudgetExceeded, PermanentStorageError) as e:
                raise WriterError(str(e)) from e.__cause__
            if lost is not None:
                raise WriterError(str(lost))
        t0 = time.perf_counter()
        self._retry(lambda: self.storage.write(okey, bufs), okey)
        self._retry(lambda: self.storage.write(manifest.key, manifest.to_json()), manifest.key)
        self.stats.write_seconds += time.perf_counter() - t0
        self.stats.objects_written += 1
        self.stats.bytes_written += nbytes
        if kind == "diff":
            self.stats.diff_bytes += nbytes
        else:
            self.stats.full_bytes += nbytes
        prev = self.stats.last_committed_step
        self.stats.last_committed_step = last if prev is None else max(prev, last)
        if self._index is not None:
            self._index.append(manifest)
            if kind == "full":
                collected = self.keep_fulls > 0 and self._collect()
                now = time.monotonic()
                if self._index_clock.due(now, force=collected):
                    cpu0 = time.thread_time()
                    try:
                        lineage_index.write_index(self.storage, self._index)
                    except Exception as e:  # noqa: BLE001 - the index is a cache: readers fall back to listing
                        log.warning("ray_ckpt: could not write the lineage index: %s", e)
                    self._index_clock.done(now, time.thread_time() - cpu0)
        if self.on_commit is not None:
            self.on_commit(manifest)

    def _collect(self) -> bool:
        """Writer thread, after a full: delete what only serves steps before the ``keep_fulls`` newest fulls of the
        current timeline (the coordinator's rule, :func:`ray_ckpt.lineage.gc_cutoff`), and abandoned branches.
        A failure is logged, never raised: garbage collection must not stop checkpointing."""
        lin = Lineage(self._index)
        cutoff = gc_cutoff(lin, self.keep_fulls)
        doomed = [m for m in self._index if collectable(lin, m, cutoff)]
        if not doomed:
            return False
        try:
            # back to the newest step every rank's loop state reaches (a Ray Train group: rank_heads)
            cutoff = rank_heads.cutoff_keeping(lin, self.keep_fulls, rank_heads.group_floor(self.storage,
                                                                                             self.generation))
            doomed = [m for m in self._index if collectable(lin, m, cutoff)]
            if not doomed:
                return False
            # what is removed, before it goes (a restore of those steps says retention removed them)
            retention.note(self.storage, self.keep_fulls, cutoff, doomed)
            lineage_index.delete_committed(self.storage, doomed, missing=(ObjectNotFound,))
        except Exception as e:  # noqa: BLE001
            log.warning("ray_ckpt: garbage collection failed (%s); it is retried after the next full", e)
            return True   # some may be gone: the index must not name them
        gone = {m.name for m in doomed}
        self._index = [m for m in self._index if m.name not in gone]
        self.stats.objects_deleted += len(doomed)
        log.info("ray_ckpt: garbage-collected %d objects (keep_fulls=%d)", len(doomed), self.keep_fulls)
        return True

    def _retry(self, fn, what: str) -> None:
        try:
            self._retry_policy.call(fn, f"writing {what!r}")
        except (RetryBudgetExceeded, PermanentStorageError) as e:
            raise WriterError(str(e)) from e.__cause__