"""The state tier: one replica actor per run that keeps the training state itself (LowDiff+).

The node's PersistenceWorker forwards every chunk it receives (the attach full, then the step records) to this
actor. A thread applies them in step order to a :class:`ray_ckpt.engine.shadow.ShadowState` — restore's own
replay — so the replica is at most a few steps behind the trainer. It

* materializes the policy's full checkpoints from its own state, encodes and writes them: the trainer takes no
  fulls while the replica is healthy and names the steps it delegated in each chunk's manifest
  (``info["replica_fulls"]``), so every full has exactly one writer;
* hands its state over for zero-replay recovery of the latest step (:meth:`snapshot`);
* reports its progress to the coordinator, which decides whether the trainer may delegate fulls to it.

Placement: the node after the trainer's in ring order (a peer node, which survives the trainer node's loss),
the trainer's own node on a one-node cluster; soft affinity, so a restarted replica lands on a live node. A
restarted replica rebuilds itself off the training thread from the newest full plus the held or durable diffs
(the coordinator's plan). It says so loudly when it cannot follow (an optimizer it cannot rebuild, a
fingerprint mismatch, a backlog beyond ``max_lag`` steps) and the trainer takes fulls again — never silent loss.

Where it runs: a detached, named Ray actor (``max_restarts=-1``, threaded); all methods are called remotely.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import ray

from ray_ckpt.config import Amber
from ray_ckpt.engine import amber_tier
from ray_ckpt.engine.amber import ShadowAmber
from ray_ckpt.engine.lineage_io import unhide
from ray_ckpt.engine.optim_layout import FINGERPRINT_KEY, ShadowError
from ray_ckpt.engine.shadow import ShadowState
from ray_ckpt.engine.strategy import decode_object, impl_by_name
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format import segments
from ray_ckpt.lineage import Manifest, full_name, object_key
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.buffers import as_buffers, join
from ray_ckpt.runtime.plan_reader import load_plan

log = logging.getLogger("ray_ckpt")

#: :meth:`ReplicaActor.snapshot` stops waiting for the replica to reach the restored step after this long
#: without progress (one application of a step on a large model takes well under a second).
SNAPSHOT_STALL_S = 2.0


def _none_answer() -> None:
    return None


def resets(full: Manifest, at: tuple[int, int] | None, pending: tuple[int, int] | None) -> bool:
    """Whether a trainer's ``full`` fed to the replica restarts it from that full: when it is of a newer
    generation than the replica's state ``at`` (``(generation, step)``; None: no usable state) or ahead of it
    (a full after a gap), and newer than the full a restart is already pending from (``pending``, same form).

    Feeds do not arrive in the order the worker sent them: the actor runs up to ``max_concurrency`` calls at
    once, and after a restart Ray delivers the calls sent meanwhile in one burst. A reset drops the queued chunks
    up to its full, so an older full arriving after a newer one must not replace the newer pending reset: the
    replica would restart from the older full with the chunks after it already dropped, behind the trainer
    with nothing queued, and wait for chunks that never come. Pure; called in :meth:`ReplicaActor.feed`."""
    key = _key(full)
    if pending is not None and key <= pending:
        return False
    return at is None or full.generation > at[0] or (full.generation == at[0] and full.last_step > at[1])


def _key(m: Manifest) -> tuple[int, int]:
    return m.generation, m.last_step


class ReplicaActor:
    def __init__(self, run: str, storage, full_every: int, max_lag: int):
        self.run = run
        self.storage = storage
        self.full_every = full_every
        self.max_lag = max_lag
        self.node_id = ray.get_runtime_context().get_node_id()
        self.shadow: ShadowState | None = None
        self.generation: int | None = None
        self.ok = True
        self.reason = ""
        self._cv = threading.Condition()
        self._queue: dict[int, tuple[Manifest, object]] = {}   # first_step -> chunk of the current generation
        self._reset: tuple[Manifest, object] | None = None
        #: ``(generation, step)`` of the full the replica thread is restarting from (None: none)
        self._resetting: tuple[int, int] | None = None
        # a restarted replica catches up from the lineage; a new one is fed the attach full
        self._rebuild = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self._stats = {"applied_steps": 0, "apply_seconds": 0.0, "fulls_written": 0, "full_seconds": 0.0,
                       "full_bytes_written": 0,
                       "snapshots": 0, "snapshots_shared": 0, "rebuilds": 0, "rebuilds_skipped": 0,
                       # durable_diffs="amber": increments computed from the shadow, written to the Amber tier
                       "amber_increments": 0, "amber_objects": 0, "amber_bytes_written": 0, "amber_seconds": 0.0}
        self._amber: ShadowAmber | None = None
        self._amber_cfg: dict | None = None
        self._coordinator = None
        #: bumped under the lock whenever the shadow's state changes (installed, or a chunk applied)
        self._version = 0
        #: ``(version, answer)`` of the last :meth:`snapshot`: every caller at that state gets the same object
        self._snap: tuple[int, dict] | None = None
        threading.Thread(target=self._loop, daemon=True, name="ray_ckpt-replica").start()

    # -- remote API ------------------------------------------------------------------------------------------
    def feed(self, manifest_json: bytes, refs: list) -> None:
        """A chunk received by a persistence worker (a full, or step records). Returns at once."""
        m = Manifest.from_json(manifest_json)
        with self._cv:
            if m.kind == "full":
                if m.info.get("computed_on") == "replica":
                    return
                at = None if self.shadow is None or not self.ok else (self.generation, self.shadow.step)
                # the newest full a restart is pending from or under way from
                pending = max([k for k in (self._resetting, self._reset and _key(self._reset[0])) if k], default=None)
                if resets(m, at, pending):
                    self._reset = (m, refs[0])
                    self._queue = {k: v for k, v in self._queue.items() if v[0].generation == m.generation
                                   and v[0].last_step > m.last_step}
                    self._rebuild = False
            elif self.generation is None or m.generation >= self.generation:
                self._queue[m.first_step] = (m, refs[0])
                if len(self._queue) > self.max_lag:
                    self._fail_locked(f"{len(self._queue)} chunks behind (more than max_replica_lag); rebuilding")
                    self._queue = {}
                    self._rebuild = True
            self._cv.notify_all()

    def snapshot(self, generation: int, step: int | None = None, stall_s: float = SNAPSHOT_STALL_S) -> dict | None:
        """The state of ``generation`` as one encoded full (no checksum: a memory hand-off) put in the object
        store by this actor: ``{"step", "ref", "nbytes"}``, or None when the replica cannot provide it.

        With ``step`` (the step being restored), first wait while the replica is behind it and still advancing:
        its state is that step a few applications later, and each step it applies is one the restoring process
        would otherwise replay itself, on the same code path and no faster. The wait ends when it reaches
        ``step``, fails, or applies nothing for ``stall_s`` seconds (a missing chunk: the caller then replays
        the rest from the records); the snapshot is whatever step it reached.

        One copy: the encoded parts are views of the shadow's tensors, and ``ray.put`` of that list copies each
        straight into the object store (under the lock: the shadow must not advance meanwhile); the restoring
        process decodes them from there without joining (``container.decode`` takes a list of parts).

        One object per state: callers that find the shadow unchanged since the last snapshot (the ranks of a
        group restoring the same step, a prefetch ahead of them: :func:`ray_ckpt.runtime.trainer.client.prefetch_snapshot`)
        get that snapshot's reference again, ``"shared": True``, instead of another encode and put; the replica
        drops its reference when its state next changes."""
        with self._cv:
            last, since = None, time.monotonic()
            while (step is not None and self.shadow is not None and self.ok and self.generation == generation
                   and self.shadow.step < step and time.monotonic() - since < stall_s):
                if self.shadow.step != last:
                    last, since = self.shadow.step, time.monotonic()
                self._cv.wait(0.1)
            if self.shadow is None or not self.ok or self.generation != generation:
                return None
            if self._snap is not None and self._snap[0] == self._version:
                self._stats["snapshots_shared"] += 1
                return {**self._snap[1], "shared": True}
            t0 = time.perf_counter()
            bufs = [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8)
                    for b in rec_fmt.encode_full(self.shadow.snapshot(), checksum=False)]
            n = sum(b.nbytes for b in bufs)
            at = self.shadow.step
            ref = ray.put(bufs)
            del bufs
            answer = {"step": at, "ref": ref, "nbytes": n}
            self._snap = (self._version, answer)
        self._stats["snapshots"] += 1
        self._stats["snapshot_seconds"] = time.perf_counter() - t0
        return answer

    def status(self) -> dict:
        with self._cv:
            return {"node": self.node_id, "generation": self.generation,
                    "step": None if self.shadow is None else self.shadow.step, "ok": self.ok,
                    "reason": self.reason, "queued_chunks": len(self._queue), **self._stats}

    def ping(self) -> str:
        return self.node_id

    # -- replica thread ----------------------------------------------------------------------------------------
    def _coord(self):
        if self._coordinator is None:
            self._coordinator = lineages.coordinator(self.run)
        return self._coordinator

    def _fail_locked(self, reason: str) -> None:
        if self.ok:
            log.warning("ray_ckpt replica: %s", reason)
        self.ok, self.reason = False, reason
        self._progress()

    def _progress(self) -> None:
        if self.generation is None:
            return
        try:
            self._coord().replica_progress.remote(self.generation, -1 if self.shadow is None else self.shadow.step,
                                                  self.node_id, self.ok, self.reason)
        except Exception:  # noqa: BLE001 - the coordinator restarts; the next report gets through
            self._coordinator = None

    def _loop(self) -> None:
        # the first optimizer built in a process imports torch._dynamo (seconds on a busy machine): do it now,
        # while the attach full is on its way, not when the first chunk is waiting
        import torch._dynamo  # noqa: F401
        idle_since = time.monotonic()
        while True:
            with self._cv:
                job = None
                if self._reset is not None:
                    job, self._reset = ("reset", self._reset), None
                    self._resetting = _key(job[1][0])
                elif self.shadow is not None and self.ok and (self.shadow.step + 1) in self._queue:
                    job = ("apply", self._queue.pop(self.shadow.step + 1))
                elif self.shadow is not None and self.ok:
                    # drop chunks we are already past (a resend); catch up when a chunk is missing too long
                    for k in [k for k, v in self._queue.items() if v[0].last_step <= self.shadow.step]:
                        del self._queue[k]
                    if self._queue and time.monotonic() - idle_since > 3.0:
                        job = ("rebuild", None)
                elif self._rebuild:
                    job = ("rebuild", None)
                if job is None:
                    self._cv.wait(0.2)
                    continue
            try:
                if job[0] == "reset":
                    m, ref = job[1]
                    full = rec_fmt.decode_full(join(ray.get(ref)), m.object)
                    shadow = ShadowState(full)
                    self._amber_base(m, shadow)
                    self._install(shadow, m.generation)
                elif job[0] == "apply":
                    self._apply(*job[1])
                else:
                    self._rebuild_from_lineage()
                idle_since = time.monotonic()
            except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError) as e:
                # the worker holding that chunk died: its resend (or a rebuild from the lineage) follows
                log.info("ray_ckpt replica: chunk unavailable (%s); waiting for it again", type(e).__name__)
            except ShadowError as e:
                with self._cv:
                    self.shadow = None
                    self._fail_locked(str(e))
            except Exception as e:  # noqa: BLE001 - never die silently: report and wait for the next full
                log.exception("ray_ckpt replica: failed")
                with self._cv:
                    self.shadow = None
                    self._fail_locked(f"{type(e).__name__}: {e}")
            if job[0] == "reset":
                with self._cv:
                    self._resetting = None
            if job[0] == "rebuild":
                time.sleep(0.5)

    def _install(self, shadow: ShadowState, generation: int) -> None:
        with self._cv:
            self.shadow, self.generation = shadow, generation
            self._version += 1
            self._snap = None
            self.ok, self.reason = True, ""
            self._rebuild = False
        self._progress()

    def _apply(self, m: Manifest, ref) -> None:
        # the sender checksummed these bytes when it encoded them and every restore from storage verifies them
        # again; here they come straight from the object store, so no second pass over them (a third of this
        # thread's CPU with dense gradients), and no copy before the replay's own (views are only read).
        # A replay that went wrong anyway is caught by the trainer's fingerprints.
        records = decode_object(impl_by_name(m.strategy), as_buffers(ray.get(ref)), m.object, verify=False,
                                copy=False)
        t0 = time.perf_counter()
        amber = self._amber_for(m)
        with self._cv:
            shadow = self.shadow
            records = [r for r in records if r.step > shadow.step]
            if records:   # the state changes: a snapshot taken before no longer describes it
                self._version += 1
                self._snap = None
            # stop at each full the trainer delegated to us, to write it from this exact state (the trainer
            # names them in the chunk's manifest: one writer per full, never two)
            fulls = set(m.info.get("replica_fulls", []))
            increments: list = []
            while records:
                if amber is not None:   # one step at a time: each step's increment is taken from its state
                    cut = 1
                else:
                    cut = next((i + 1 for i, r in enumerate(records) if r.step in fulls), len(records))
                shadow.apply(records[:cut])
                self._stats["applied_steps"] += cut
                full = shadow.step in fulls
                if amber is not None:
                    rec = records[cut - 1]
                    loop = {k: v for k, v in rec.loop.items() if k != FINGERPRINT_KEY}
                    t1 = time.perf_counter()
                    inc = amber.step(shadow, loop, rec.buffers, full=full)
                    self._stats["amber_seconds"] += time.perf_counter() - t1
                    if inc is not None:
                        increments.append(inc)
                    if full:   # later increments build on this full: they go to an object of their own
                        self._write_increments(increments, m.generation)
                        increments = []
                if full:
                    self._write_full(shadow, m.generation)
                records = records[cut:]
            self._write_increments(increments, m.generation)
            self._cv.notify_all()  # a snapshot may be waiting for this step
        self._stats["apply_seconds"] += time.perf_counter() - t0
        self._progress()

    # -- the Amber tier (durable_diffs="amber") ------------------------------------------------------------------
    def _amber_for(self, m: Manifest) -> ShadowAmber | None:
        """The Amber encoder the chunk's run asks for (``info["durable_amber"]``: its settings), or None. A new or
        changed setting starts unbased: its increments begin at the next full this replica writes."""
        cfg = m.info.get("durable_amber")
        if cfg is None:
            self._amber = self._amber_cfg = None
            return None
        if cfg != self._amber_cfg:
            self._amber, self._amber_cfg = ShadowAmber(Amber(**cfg)), cfg
        return self._amber

    def _amber_base(self, m: Manifest, shadow: ShadowState) -> None:
        """The replica is (re)installed from the full ``m``: the Amber tier's increments build on it."""
        amber = self._amber_for(m)
        if amber is not None:
            amber.rebase(shadow)

    def _write_increments(self, increments: list, generation: int) -> None:
        """One object of the Amber tier (replica thread, state lock held)."""
        if not increments:
            return
        t0 = time.perf_counter()
        m = amber_tier.write_increments(self.storage, generation, increments, self._amber.config)
        self._stats["amber_increments"] += len(increments)
        self._stats["amber_objects"] += 1
        self._stats["amber_bytes_written"] += m.nbytes
        self._stats["amber_seconds"] += time.perf_counter() - t0

    def _write_full(self, shadow: ShadowState, generation: int) -> None:
        """Encode and write the full of the current step (replica thread, state lock held)."""
        t0 = time.perf_counter()
        bufs = rec_fmt.encode_full(shadow.snapshot())
        crc, n, alg = segments.object_crc(bufs)
        name = full_name(generation, shadow.step)
        m = Manifest(kind="full", generation=generation, first_step=shadow.step, last_step=shadow.step,
                     object=object_key(name), nbytes=n, crc32=crc, crc_alg=alg, strategy=shadow.strategy,
                     info={"computed_on": "replica", "trainer_device": shadow.layout.get("device", "cpu")})
        self.storage.write(m.object, bufs)
        self.storage.write(m.key, m.to_json())
        unhide(self.storage, m)   # after a fall-back to trainer fulls, this full may come after a later one
        self._stats["fulls_written"] += 1
        self._stats["full_bytes_written"] += n
        self._stats["full_seconds"] += time.perf_counter() - t0
        self._coord().update.remote(self.node_id, [("durable", m.to_json(), [m.name])])

    def _rebuild_from_lineage(self) -> None:
        """Newest full + held/durable diffs of the run's latest recoverable step (off the training thread). Not
        while the run's overhead budget records a full every k steps: no record follows them, and the first full
        that records follow resets this replica anyway (a rebuild would only read and decode the whole state)."""
        try:
            mode = (ray.get(self._coord().granularity.remote(), timeout=60) or {}).get("mode")
        except Exception as e:  # noqa: BLE001 - a coordinator that cannot tell (a shard host, restarting): rebuild
            log.debug("ray_ckpt replica: granularity unknown (%s)", e)
            mode = None
        if mode in ("every_k", "fulls_only"):
            with self._cv:
                self._rebuild = False
            self._stats["rebuilds_skipped"] += 1
            log.info("ray_ckpt replica: run %r records a full every k steps: no rebuild until records follow a "
                     "full", self.run)
            return
        plan = ray.get(self._coord().plan.remote(None), timeout=60)
        if "error" in plan:
            with self._cv:
                self._rebuild = False  # nothing to rebuild from yet: the next full resets us
            return
        chain, _ = load_plan(self.storage, plan)
        shadow = ShadowState(chain.full)
        shadow.apply(chain.records)
        if self._amber is not None:
            # this state is not a full's: the Amber tier resumes at the next full this replica writes
            self._amber.reset()
        self._stats["rebuilds"] += 1
        log.info("ray_ckpt replica: rebuilt at step %d of generation %d", shadow.step, plan["generation"])
        self._install(shadow, plan["generation"])


class ReplicaHost(lineages.LineageHost):
    """The state-tier replicas of a sharded job's ranks on one node (:mod:`ray_ckpt.runtime.lineages`), run on
    that node's ring peer: one :class:`ReplicaActor` per shard lineage, opened at attach
    (:func:`get_or_create_replica`) or by its first chunk (:meth:`~ReplicaActor.feed`; after a restart of this
    actor each lineage rebuilds itself from the lineage, as a restarted replica does). Replica host actor
    (threaded); its methods are called remotely."""

    OPENING = frozenset({"feed", "ping"})
    ABSENT = {"snapshot": _none_answer}

    def __init__(self, job: str, root, full_every: int, max_lag: int):
        self._host_init(job)
        self.root = root
        self.full_every = full_every
        self.max_lag = max_lag

    def _open(self, run: str) -> ReplicaActor:
        return ReplicaActor(run, lineages.lineage_storage(self.root, run), self.full_every, self.max_lag)

    def open_lineage(self, run: str) -> bool:
        """Open lineage ``run``; returns whether it was new here."""
        new = run not in self._lineages
        self._lineage(run, True)
        return new


_remote_cls = None
_host_cls = None


def _shard_replica(run: str, node_id: str, storage, *, full_every: int, max_lag: int):
    """``(handle, created)`` of a shard run's replica: its lineage of the replica host of the calling (the
    trainer's) node, the host created on ``node_id`` if missing. The lineage is dropped from the job's other
    replica hosts (a rank that moved to this node: its old replica's state was restored from already).
    Training process."""
    global _host_cls
    from ray_ckpt.runtime.placement import prefer_node
    job = lineages.job_of(run)
    me = ray.get_runtime_context().get_node_id()
    name = lineages.replica_host_name(job, me)
    try:
        host = ray.get_actor(name, namespace=naming.NAMESPACE)
    except ValueError:
        if _host_cls is None:
            _host_cls = ray.remote(ReplicaHost)
        host = _host_cls.options(name=name, namespace=naming.NAMESPACE, lifetime="detached", get_if_exists=True,
                                 max_restarts=-1, max_task_retries=-1, max_concurrency=16, num_cpus=0,
                                 **prefer_node(node_id)).remote(job, lineages.root_storage(storage, run),
                                                                full_every, max_lag)
    created = ray.get(host.open_lineage.remote(run), timeout=120)
    for info in ray.util.list_named_actors(all_namespaces=True):
        other = info["name"] if isinstance(info, dict) else info
        if other.startswith(lineages.replica_host_prefix(job)) and other != name:
            try:
                ray.get_actor(other, namespace=naming.NAMESPACE).drop_lineage.remote(run)
            except ValueError:
                pass
    return lineages.LineageHandle(host, run), created


def get_or_create_replica(run: str, node_id: str, storage, *, full_every: int, max_lag: int):
    """``(handle, created)``: the run's replica actor, created on ``node_id`` (soft affinity) if missing; ``created``
    says whether this call created it. Any process; for a shard run, the training process of its rank (its
    lineage of the job's :class:`ReplicaHost` of this node: one replica actor per node that runs ranks)."""
    global _remote_cls
    from ray_ckpt.runtime.placement import prefer_node
    if lineages.is_shard_run(run):
        return _shard_replica(run, node_id, storage, full_every=full_every, max_lag=max_lag)
    name = naming.replica_name(run)
    try:
        return ray.get_actor(name, namespace=naming.NAMESPACE), False
    except ValueError:
        pass
    if _remote_cls is None:
        _remote_cls = ray.remote(ReplicaActor)
    return _remote_cls.options(name=name, namespace=naming.NAMESPACE, lifetime="detached", get_if_exists=True,
                               max_restarts=-1, max_task_retries=-1, max_concurrency=4, num_cpus=0,
                               **prefer_node(node_id)).remote(run, storage, full_every, max_lag), True
