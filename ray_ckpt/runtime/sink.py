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
import time
import zlib

import numpy as np
import ray

from ray_ckpt.engine.writer import BoundedSink, WriterError, _Flush
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format.records import FullState
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.runtime.worker import get_or_create_worker

log = logging.getLogger("ray_ckpt")

_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class RaySink(BoundedSink):
    def __init__(self, run: str, storage, impl, generation: int, *, max_pending_bytes: int, batch_steps: int,
                 memory_budget: int, info: dict | None = None, max_inflight: int = 4,
                 submit_retries: int = 20):
        super().__init__(max_pending_bytes, f"ray_ckpt-sender-g{generation}")
        self.run, self.storage, self.impl, self.generation = run, storage, impl, generation
        self.batch_steps = batch_steps
        self.memory_budget = memory_budget
        self.info = dict(info or {})
        self.max_inflight = max_inflight
        self.submit_retries = submit_retries
        self.node_id = ray.get_runtime_context().get_node_id()
        self.worker = get_or_create_worker(run, self.node_id, storage, memory_budget)
        ray.get(self.worker.ping.remote())  # started and ready before the first step is handed over
        self.handoff_seconds = 0.0  # sender-thread time to encode and hand objects to the worker
        self._thread.start()

    # -- sender thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        inflight: collections.deque = collections.deque()
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing and not self._queue:
                    return
                item, size, _ = self._queue.popleft()
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
                self._fail(e, item)
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
        self._release(size)

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
