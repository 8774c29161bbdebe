"""PersistenceWorker: one Ray actor per node that holds checkpoint objects in the object store and persists them.

Data path (see ARCHITECTURE.md): the training process's sender thread calls :meth:`submit` with one encoded
object (a full checkpoint, or the diff record of one step) and its manifest. The worker

1. ``ray.put``s the bytes itself (objects put by a training worker die with it), so the step is held in this
   node's object store — the *memory tier* — and reports it to the coordinator;
2. replicates it to a peer node's worker (:meth:`hold_replica`), so losing this node loses nothing that was
   reported recoverable on two nodes;
3. writes it to durable storage from a background thread: diff records are batched ``batch_steps`` per object
   (decoded and re-encoded as one object), fulls are written as they are; each commit is reported.

Memory is bounded by ``memory_budget`` bytes: durable objects are released oldest first (the newest full is
kept); when nothing is releasable, :meth:`submit` does not return until the writer frees something, which
stalls the sender and, through its bounded queue, the training thread (backpressure, never an unbounded queue).

Where it runs: a detached, named, node-pinned actor (``max_restarts=-1``); all methods are called remotely.
The actor is threaded (``max_concurrency``) so ``submit`` / ``hold_replica`` / ``flush`` run concurrently with
the writer thread; shared state is guarded by one condition variable.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import ray

from ray_ckpt.engine.strategy import impl_by_name
from ray_ckpt.lineage import Manifest, diff_name, object_key
from ray_ckpt.runtime import naming

log = logging.getLogger("ray_ckpt")


@dataclass
class _Held:
    manifest: Manifest
    ref: ray.ObjectRef
    nbytes: int
    durable: bool
    replica: bool  # held for another node (that node's worker persists it)


class PersistenceWorker:
    def __init__(self, run: str, storage, memory_budget: int):
        self.run = run
        self.storage = storage  # a picklable StorageBackend
        self.node_id = ray.get_runtime_context().get_node_id()
        self.memory_budget = memory_budget
        self._cv = threading.Condition()
        self._held: "collections.OrderedDict[str, _Held]" = collections.OrderedDict()
        self._held_bytes = 0
        self._write_q: collections.deque = collections.deque()   # (manifest, ref, batch_steps) to persist
        self._batches: dict[int, list] = {}                      # generation -> pending diff records
        self._writing = 0
        self._error: str | None = None
        self._stats = collections.Counter()
        self._coordinator = None
        self._replica_calls: collections.deque = collections.deque()
        self._peer_cache: tuple[float, object, str] | None = None
        self._thread = threading.Thread(target=self._write_loop, daemon=True, name="ray_ckpt-persist")
        self._thread.start()
        # a restarted worker lost its objects: tell the coordinator (fire and forget; retried while it restarts)
        self._coord().worker_started.remote(self.node_id)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _coord(self):
        if self._coordinator is None:
            self._coordinator = ray.get_actor(naming.coordinator_name(self.run), namespace=naming.NAMESPACE)
        return self._coordinator

    def _hold(self, m: Manifest, ref, nbytes: int, durable: bool, replica: bool) -> None:
        with self._cv:
            old = self._held.pop(m.name, None)
            if old is not None:
                self._held_bytes -= old.nbytes
            self._held[m.name] = _Held(m, ref, nbytes, durable, replica)
            self._held_bytes += nbytes
            self._enforce_budget_locked(wait=True)

    def _enforce_budget_locked(self, wait: bool) -> None:
        """Release durable objects oldest first; optionally wait for the writer while nothing is releasable."""
        released = []
        while self._held_bytes > self.memory_budget:
            newest_full = max((h.manifest.last_step for h in self._held.values() if h.manifest.kind == "full"),
                              default=None)
            victim = next((n for n, h in self._held.items() if (h.durable or h.replica)
                           and not (h.manifest.kind == "full" and h.manifest.last_step == newest_full)), None)
            if victim is None:
                if not wait or self._error is not None or not (self._write_q or self._writing):
                    break
                t0 = time.perf_counter()
                self._cv.wait(0.5)
                self._stats["stall_seconds"] += time.perf_counter() - t0
                continue
            h = self._held.pop(victim)
            self._held_bytes -= h.nbytes
            released.append(victim)
        if released:
            self._stats["released"] += len(released)
            self._coord().release.remote(self.node_id, released)

    def _peer(self):
        """The worker of the next alive node (ring order by node id), or None on a one-node cluster."""
        now = time.monotonic()
        if self._peer_cache is not None and now - self._peer_cache[0] < 5.0:
            return self._peer_cache[1]
        alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        others = [n for n in alive if n > self.node_id] + [n for n in alive if n < self.node_id]
        peer = get_or_create_worker(self.run, others[0], self.storage, self.memory_budget) if others else None
        self._peer_cache = (now, peer, others[0] if others else "")
        return peer

    # -- remote API --------------------------------------------------------------------------------------------
    def submit(self, manifest_json: bytes, data: bytes, batch_steps: int = 1, replicate: bool = True) -> str:
        """Take one encoded object from a training process: hold, replicate, persist. Returns this node's id."""
        m = Manifest.from_json(manifest_json)
        if zlib.crc32(data) != m.crc32 or len(data) != m.nbytes:
            raise ValueError(f"object {m.name} arrived corrupted (size/crc mismatch)")
        ref = ray.put(np.frombuffer(data, dtype=np.uint8))  # this actor owns the object
        self._hold(m, ref, len(data), durable=False, replica=False)
        # acknowledged only once the coordinator knows: an acked step is reported recoverable
        ray.get(self._coord().report.remote(m.to_json(), self.node_id, [ref], False))
        if replicate:
            peer = self._peer()
            if peer is not None:
                call = peer.hold_replica.remote(m.to_json(), [ref], self.node_id)
                with self._cv:
                    self._replica_calls.append(call)
                    while len(self._replica_calls) > 64:  # bound the bookkeeping; old calls are long done
                        self._replica_calls.popleft()
        with self._cv:
            self._write_q.append((m, ref, max(1, batch_steps)))
            self._cv.notify_all()
        self._stats["received"] += 1
        self._stats["received_bytes"] += len(data)
        return self.node_id

    def hold_replica(self, manifest_json: bytes, refs: list, origin: str) -> None:
        """Keep a copy of another node's object (pulled to this node, re-put: this actor owns the copy)."""
        m = Manifest.from_json(manifest_json)
        try:
            arr = ray.get(refs[0], timeout=60)
        except Exception as e:  # noqa: BLE001 - the origin died before the copy: nothing to hold
            log.warning("ray_ckpt: replica of %s from %s lost: %s", m.name, origin, e)
            return
        ref = ray.put(np.array(arr, copy=True))
        self._hold(m, ref, arr.nbytes, durable=False, replica=True)
        ray.get(self._coord().report.remote(m.to_json(), self.node_id, [ref], False))
        self._stats["replicas"] += 1

    def persist(self, names: list[str]) -> list[str]:
        """Write held objects (replicas of a lost node) to durable storage as they are. Returns those written."""
        done = []
        for name in names:
            with self._cv:
                h = self._held.get(name)
            if h is None or h.durable:
                continue
            data = ray.get(h.ref)
            self._commit(h.manifest, [data])
            done.append(name)
        return done

    def flush(self, timeout: float = 300.0) -> dict:
        """Write every pending batch now and wait until everything received so far is durable and replicated
        (a replica whose peer died is given up: the object is durable anyway)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            calls = list(self._replica_calls)
            self._replica_calls.clear()
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=timeout)
        with self._cv:
            self._write_q.append(("flush", None, 0))
            self._cv.notify_all()
            while (self._write_q or self._writing) and self._error is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("persistence worker flush timed out")
                self._cv.wait(0.2)
            if self._error is not None:
                raise RuntimeError(f"persistence worker on node {self.node_id} failed: {self._error}")
        return self.stats()

    def inventory(self) -> list:
        """``[(manifest_json, [ref], durable)]`` of everything held (coordinator rebuild)."""
        with self._cv:
            return [(h.manifest.to_json(), [h.ref], h.durable) for h in self._held.values()]

    def release(self, names: list[str]) -> None:
        with self._cv:
            for n in names:
                h = self._held.pop(n, None)
                if h is not None:
                    self._held_bytes -= h.nbytes
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return {"node_id": self.node_id, "held_objects": len(self._held), "held_bytes": self._held_bytes,
                    "queued_writes": len(self._write_q), "error": self._error, **self._stats}

    def ping(self) -> str:
        return self.node_id

    # -- writer thread -----------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._write_q:
                    self._cv.wait()
                m, ref, batch_steps = self._write_q.popleft()
                self._writing += 1
            try:
                if m == "flush":
                    for gen in list(self._batches):
                        self._write_batch(gen)
                elif m.kind == "full":
                    self._write_batch(m.generation)
                    self._commit(m, [ray.get(ref)])
                elif m.info.get("atomic") or batch_steps <= 1:
                    self._commit(m, [ray.get(ref)])
                else:
                    batch = self._batches.setdefault(m.generation, [])
                    if batch and batch[-1][0].last_step + 1 != m.first_step:
                        self._write_batch(m.generation)  # a gap (resubmission after a restart): keep it exact
                        batch = self._batches.setdefault(m.generation, [])
                    batch.append((m, ref))
                    if len(batch) >= batch_steps:
                        self._write_batch(m.generation)
            except Exception as e:  # noqa: BLE001
                log.exception("ray_ckpt: persistence failed")
                with self._cv:
                    self._error = f"{type(e).__name__}: {e}"
            finally:
                with self._cv:
                    self._writing -= 1
                    self._cv.notify_all()

    def _write_batch(self, gen: int) -> None:
        batch = self._batches.pop(gen, [])
        if not batch:
            return
        if len(batch) == 1:
            m, ref = batch[0]
            self._commit(m, [ray.get(ref)])
            return
        impl = impl_by_name(batch[0][0].strategy)
        records = []
        for m, ref in batch:
            records.extend(impl.decode_diffs(ray.get(ref), m.object))
        bufs, info = impl.encode_diffs(records)
        first, last = batch[0][0].first_step, batch[-1][0].last_step
        name = diff_name(gen, first, last)
        crc, n = 0, 0
        for b in bufs:
            crc = zlib.crc32(b, crc)
            n += memoryview(b).nbytes
        m0 = batch[0][0]
        merged = Manifest(kind="diff", generation=gen, first_step=first, last_step=last, object=object_key(name),
                          nbytes=n, crc32=crc, strategy=m0.strategy, info={**m0.info, **info})
        self._commit(merged, bufs, covers=[m.name for m, _ in batch])

    def _commit(self, m: Manifest, bufs: list, covers: list[str] | None = None) -> None:
        t0 = time.perf_counter()
        for attempt in range(3):
            try:
                self.storage.write(m.object, bufs)
                self.storage.write(m.key, m.to_json())
                break
            except Exception:  # noqa: BLE001
                if attempt == 2:
                    raise
                time.sleep(0.1 * 4 ** attempt)
        self._stats["write_seconds"] += time.perf_counter() - t0
        self._stats["objects_written"] += 1
        self._stats["bytes_written"] += m.nbytes
        names = covers or [m.name]
        with self._cv:
            for n in names:
                h = self._held.get(n)
                if h is not None:
                    h.durable = True
            self._cv.notify_all()
        self._coord().report_durable.remote(m.to_json(), names)


def _actor_options(name: str, node_id: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return dict(name=name, namespace=naming.NAMESPACE, lifetime="detached", get_if_exists=True,
                max_restarts=-1, max_task_retries=-1, max_concurrency=8, num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


_remote_cls = None


def get_or_create_worker(run: str, node_id: str, storage, memory_budget: int):
    """The PersistenceWorker of ``node_id`` for ``run`` (created pinned to that node if missing). Any process.

    Creation is idempotent across processes (``get_if_exists``): concurrent callers get the same actor.
    """
    global _remote_cls
    name = naming.worker_name(run, node_id)
    try:
        return ray.get_actor(name, namespace=naming.NAMESPACE)
    except ValueError:
        pass
    if _remote_cls is None:
        _remote_cls = ray.remote(PersistenceWorker)
    return _remote_cls.options(**_actor_options(name, node_id)).remote(run, storage, memory_budget)
