"""RaySink: the training process's side of the Ray runtime (replaces the engine's AsyncWriter).

Call order, all in the training process::

    submit(item)   training thread: queue the captured item; blocks while queued + in-flight bytes exceed the
                   budget (backpressure)
    sender thread  encodes each item into one object (a full, or one step's diff), hands it to this node's
                   PersistenceWorker (``worker.submit``), keeps at most ``max_inflight`` calls outstanding and
                   resubmits when the worker restarted (the worker is detached and restarts on failure)
    flush()        training thread: waits until every item is held by the worker, then until it is durable

A step is *recoverable* as soon as the worker acknowledged it (held in the node's object store and reported to
the coordinator); ``last_committed_step`` counts those. Durability follows asynchronously in the worker.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import ray

from ray_ckpt.engine.writer import WriterError, WriterStats
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format.records import FullState
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.runtime.worker import get_or_create_worker

log = logging.getLogger("ray_ckpt")

_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class RaySink:
    def __init__(self, run: str, storage, impl, generation: int, *, max_pending_bytes: int, batch_steps: int,
                 memory_budget: int, info: dict | None = None, max_inflight: int = 4,
                 submit_retries: int = 20):
        self.run, self.storage, self.impl, self.generation = run, storage, impl, generation
        self.max_pending_bytes = max_pending_bytes
        self.batch_steps = batch_steps
        self.memory_budget = memory_budget
        self.info = dict(info or {})
        self.max_inflight = max_inflight
        self.submit_retries = submit_retries
        self.node_id = ray.get_runtime_context().get_node_id()
        self.worker = get_or_create_worker(run, self.node_id, storage, memory_budget)
        ray.get(self.worker.ping.remote())  # started and ready before the first step is handed over
        self.stats = WriterStats()
        self.handoff_seconds = 0.0  # sender-thread time to encode and hand objects to the worker
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._error: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"ray_ckpt-sender-g{generation}")
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------------------------
    def submit(self, item, *, close_batch: bool = False) -> None:
        size = item.nbytes
        with self._cv:
            self._raise_if_failed()
            if self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes:
                t0 = time.perf_counter()
                while (self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes
                       and self._error is None):
                    self._cv.wait(0.5)
                self.stats.stall_seconds += time.perf_counter() - t0
                self._raise_if_failed()
            self._pending_bytes += size
            self._queue.append((item, size))
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        marker = _Flush()
        with self._cv:
            self._raise_if_failed()
            self._queue.append((marker, 0))
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.done.wait(0.2):
            with self._cv:
                self._raise_if_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"flush did not finish within {timeout} s")
        with self._cv:
            self._raise_if_failed()

    def close(self, timeout: float | None = None) -> None:
        try:
            if self._thread.is_alive():
                self.flush(timeout)
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join(timeout=5)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WriterError(f"ray_ckpt sender failed: {self._error}") from self._error

    # -- sender thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        inflight: collections.deque = collections.deque()
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing and not self._queue:
                    return
                item, size = self._queue.popleft()
            try:
                if isinstance(item, _Flush):
                    while inflight:
                        self._settle(inflight.popleft())
                    self._call_worker(lambda w: w.flush.remote(), "flush")
                    item.done.set()
                    continue
                t0 = time.perf_counter()
                manifest, data = self._encode(item)
                ref = self.worker.submit.remote(manifest.to_json(), data, self.batch_steps)
                self.handoff_seconds += time.perf_counter() - t0
                inflight.append((ref, manifest, data, size))
                while len(inflight) > self.max_inflight:
                    self._settle(inflight.popleft())
                if not self._queue:  # idle: acknowledge what is done without blocking on the rest
                    while inflight and _ready(inflight[0][0]):
                        self._settle(inflight.popleft())
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                log.error("ray_ckpt sender failed: %s", e)
                with self._cv:
                    self._error = e
                    for it, _ in self._queue:
                        if isinstance(it, _Flush):
                            it.done.set()
                    self._queue.clear()
                    self._cv.notify_all()
                if isinstance(item, _Flush):
                    item.done.set()
                return

    def _encode(self, item) -> tuple[Manifest, np.ndarray]:
        if isinstance(item, FullState):
            bufs, info = rec_fmt.encode_full(item), {}
            kind, first, last = "full", item.step, item.step
            name = full_name(self.generation, item.step)
        else:
            rec_fmt.wait_ready(item)
            bufs, info = self.impl.encode_diffs([item])
            kind, last = "diff", item.step
            first = info.pop("first_step", item.step)
            name = diff_name(self.generation, first, last)
        data = np.concatenate([np.frombuffer(b, dtype=np.uint8) for b in bufs])
        m = Manifest(kind=kind, generation=self.generation, first_step=first, last_step=last,
                     object=object_key(name), nbytes=int(data.nbytes), crc32=zlib.crc32(data),
                     strategy=self.impl.name, info={**self.info, **info})
        return m, data

    def _settle(self, entry) -> None:
        """Wait for one submit; resubmit to the restarted worker if the call failed with the actor."""
        ref, manifest, data, size = entry
        for attempt in range(self.submit_retries):
            try:
                ray.get(ref)
                break
            except _RETRYABLE as e:
                log.warning("ray_ckpt: persistence worker unavailable (%s); resubmitting %s", e, manifest.name)
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
                self.worker = get_or_create_worker(self.run, self.node_id, self.storage, self.memory_budget)
                ref = self.worker.submit.remote(manifest.to_json(), data, self.batch_steps)
        else:
            raise WriterError(f"could not hand {manifest.name} to the persistence worker")
        st = self.stats
        st.objects_written += 1
        st.bytes_written += manifest.nbytes
        if manifest.kind == "diff":
            st.diff_bytes += manifest.nbytes
            st.steps_committed += manifest.last_step - manifest.first_step + 1
        else:
            st.full_bytes += manifest.nbytes
        prev = st.last_committed_step
        st.last_committed_step = manifest.last_step if prev is None else max(prev, manifest.last_step)
        with self._cv:
            self._pending_bytes -= size
            self._cv.notify_all()

    def _call_worker(self, fn, what: str):
        for attempt in range(self.submit_retries):
            try:
                return ray.get(fn(self.worker))
            except _RETRYABLE as e:
                log.warning("ray_ckpt: persistence worker unavailable during %s (%s); retrying", what, e)
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
                self.worker = get_or_create_worker(self.run, self.node_id, self.storage, self.memory_budget)
        raise WriterError(f"persistence worker unavailable for {what}")


def _ready(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
