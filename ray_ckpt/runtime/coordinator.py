"""Coordinator: the run's lineage across tiers, generations, the frequency policy, recovery plans and GC.

One detached, named actor per run (``max_restarts=-1``, ``max_task_retries=-1``: calls made while it restarts
wait for the new instance). It keeps, for every known object, its manifest, whether it is durable, and which
live nodes hold it in their object store. Its state is derivable: a restarted coordinator rebuilds it from the
committed manifests on storage and from the inventories of the live PersistenceWorkers, which keep buffering
meanwhile.

A step is **recoverable** when some chain reaching it consists of objects that are durable or held on a live
node; it is **durable** when such a chain is on storage alone. Both heads are reported separately.

Self-healing (none of it depends on Ray Train):

* a worker that restarts (or a node that dies) loses what it held; objects it received that are held by a
  peer only are persisted from the peer at once, and the training process's sender resends what no other node
  held (it keeps every chunk until it is safe);
* the steps of the current generation must form an unbroken sequence: a step that no object covers and no
  hand-off in flight brings, for longer than a short grace period, is a **gap** (:mod:`ray_ckpt.runtime.gaps`) —
  logged as a WARNING naming the steps, kept in :meth:`Coordinator.status`, visible on storage as uncovered steps
  (``ray-ckpt ls``), and closed by asking the trainer for a full checkpoint at its next step
  (:meth:`Coordinator.control`);
* the state tier's replica reports its progress (:meth:`Coordinator.replica_progress`); while it is healthy and
  close behind, the trainer takes no full checkpoints (the replica writes them), otherwise the trainer does.

The actor is a shell: each remote method hands the call to one of the parts in
:mod:`ray_ckpt.runtime.coordination` (lineage state, healing, replica health, restore planner, garbage
collector, run clock, adaptive tuning, drains, report pacing, metrics, lease), which it builds and wires in its
constructor. All methods run in the coordinator actor's thread (Ray runs its calls one at a time) and are called
remotely (from training processes, workers, the replica, the driver-side callback, tests), except where a
docstring says otherwise.
"""
from __future__ import annotations

import logging
import threading
import time

import ray

from ray_ckpt.config import CheckpointConfig
from ray_ckpt.engine.lease import Lease, describe, read_lease
from ray_ckpt.lineage import Lineage, Manifest, range_difference
from ray_ckpt.runtime import drain as drain_watch
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.coordination.clock import RunClock
from ray_ckpt.runtime.coordination.cluster import RayCluster
from ray_ckpt.runtime.coordination.collector import GarbageCollector
from ray_ckpt.runtime.coordination.drains import Drains
from ray_ckpt.runtime.coordination.healing import Healing
from ray_ckpt.runtime.coordination.planner import PLAN_REFS_PATIENCE_S, PLAN_REFS_TIMEOUT_S, RestorePlanner
from ray_ckpt.runtime.coordination.replicas import Replica, ReplicaHealth
from ray_ckpt.runtime.coordination.reporting import (MIN_REPORT_INTERVAL_S, REPORT_CALLS_PER_S, LeaseKeeper,
                                                     MetricsGate, ReportPacing)
from ray_ckpt.runtime.coordination.state import CHEAP_S, COST_FACTOR, LineageState, RunRef
from ray_ckpt.runtime.coordination.tuning import AdaptiveTuning
from ray_ckpt.runtime.placement import prefer_node

log = logging.getLogger("ray_ckpt")

#: importable from here as before (the benchmarks and tests read them; they live with the part that uses them)
__all__ = ["Coordinator", "CoordinatorHost", "get_or_create_coordinator", "shard_runs", "shutdown_job",
           "shutdown_run", "COST_FACTOR", "CHEAP_S", "REPORT_CALLS_PER_S", "MIN_REPORT_INTERVAL_S",
           "PLAN_REFS_TIMEOUT_S", "PLAN_REFS_PATIENCE_S"]
_Replica = Replica   # its name before the split (benchmarks/coordinator_scale.py imports it)


class _Upkeep:
    """What an actor's own threads ask of it, for each lineage it serves (:meth:`_each`: a run's coordinator
    serves itself, a :class:`CoordinatorHost` every shard lineage it holds): metrics and lease heartbeats from
    the ticker thread (:meth:`_tick`), drains from the drain watch's thread (:mod:`ray_ckpt.runtime.drain`).
    The threads call these as actor calls, so they run in the actor's thread, between its other calls."""

    def _each(self) -> list:
        return [self]

    def _tick(self) -> None:
        """Ticker thread: asks this actor to publish its metrics once a second and to check/renew the lease."""
        me = None
        ticks = 0
        while True:
            time.sleep(1.0)
            ticks += 1
            try:
                me = me or ray.get_runtime_context().current_actor
                me.publish_metrics.remote()
                if ticks % 5 == 0:   # a small read every 5 s, a heartbeat write every ttl/3
                    me.renew_lease.remote()
            except Exception:  # noqa: BLE001 - not an actor (tests build the class directly) or shutting down
                return

    def publish_metrics(self) -> None:
        """Each lineage's figures as Ray metrics, when reports arrived since the last time, else every 15 s
        (:class:`~ray_ckpt.runtime.coordination.reporting.MetricsGate`); about once a second, from the ticker."""
        for c in self._each():
            c.metrics.publish(lambda c=c: c.status(max_age=1.0))

    def renew_lease(self) -> None:
        """Heartbeat of each lineage's writer lease (at most once a ``ttl/3``). A lease another job took over is
        logged as an ERROR and shown in ``status()`` (``lease_lost``)."""
        for c in self._each():
            c.leasing.renew()

    def release_lease(self) -> None:
        """Delete each lineage's lease (end of the run or job)."""
        for c in self._each():
            c.leasing.release()

    def drains_changed(self, drains: dict) -> None:
        """The GCS drain state changed to ``drains`` (``{node: deadline_ms}``; from the drain watch): each
        lineage records and announces new drains (:meth:`~ray_ckpt.runtime.coordination.drains.Drains.changed`).
        The training processes hear of it through :meth:`Coordinator.control`."""
        for c in self._each():
            c.drains.changed(drains)

    def drain_progress(self) -> bool:
        """Account for every open drain of each lineage (each poll of the drain watch while one is open); returns
        whether a drain is still open."""
        return any([c.drains.progress() for c in self._each()])


class Coordinator(_Upkeep):
    """A run's coordinator: the actor's state is its parts (see the module docstring), each call is handed to one.

    ``hosted``: a shard lineage of a job's :class:`CoordinatorHost`, whose one ticker and drain watch serve it."""

    #: the replica's progress, as :attr:`replicas` holds it (benchmarks/coordinator_scale.py sets it)
    replica = property(lambda self: self.replicas.replica, lambda self, r: setattr(self.replicas, "replica", r))

    def __init__(self, run: str, storage, config: CheckpointConfig, hosted: bool = False):
        self.run = run
        #: the run's config: as its creator resolved it (the callback, or the first attach), with the fields each
        #: attaching trainer gave explicitly, handed to the workers (:meth:`run_config`)
        self.config = config
        self.target = RunRef(run, storage)   # its storage, shared by every part (see set_storage)
        self.cluster = RayCluster(run, self.alive_node_ids)
        self.state = state = LineageState(self.target, self.cluster.alive)
        self.entries = state.entries      # the same dict (tests and the scale benchmarks read it)
        self._lineage = state.lineage     # the scale benchmark's coordinator reads its views
        self.healing = Healing(run, state, self.cluster)
        self.replicas = ReplicaHealth(run, config.max_replica_lag, self.cluster.replica_status,
                                      self.cluster.restart_replica)
        self.planner = RestorePlanner(state, self.healing, self.replicas, self.cluster.alive, self.holder_refs)
        self.collector = GarbageCollector(state, self.cluster.release)
        self.clock = RunClock()
        self.tuning = AdaptiveTuning(self.target, config.full_every, config.batch_steps, self.clock.started_at,
                                     config.policy_options())
        self.pacing = ReportPacing()
        self.metrics = MetricsGate(run)
        self.leasing = LeaseKeeper(Lease(storage, run=run))   # taken by get_or_create_coordinator; renewed here
        self.drains = Drains(state, self.cluster.alive, self.cluster.drain_notice, self.replicas.move_off,
                             self.healing.forget_dead_nodes, lambda: self.collector.floor)
        if not hosted:
            threading.Thread(target=self._tick, daemon=True, name="ray_ckpt-metrics").start()
        self._drain_watch = None if hosted else drain_watch.start_coordinator_watch(run)
        # the state from storage and from the live workers' inventories (a restarted coordinator's too)
        state.refresh_durable()
        for node, inv in self.cluster.inventories():
            for mjson, refs, durable in inv:
                state.add(Manifest.from_json(mjson), node, refs, durable)

    # -- reports from workers, the replica and the trainers -------------------------------------------------------
    def update(self, node_id: str, msgs: list) -> float:
        """A worker's messages, in the order it produced them (one call per report interval per worker). A
        manifest comes as a :class:`Manifest` (workers) or as its JSON bytes (the replica, older workers);
        ``("held_batch", [(manifest, ref, origin), ...])`` is a run of ``held`` messages packed by the worker
        (:func:`ray_ckpt.runtime.reports.pack_reports`). Returns the report interval the worker should keep to
        (:class:`~ray_ckpt.runtime.coordination.reporting.ReportPacing`)."""
        state, watch = self.state, self.healing.gap_watch
        for msg in msgs:
            kind = msg[0]
            if kind in ("held", "held_batch"):
                for mjson, ref, origin in (msg[1:],) if kind == "held" else msg[1]:
                    m = state.manifest(mjson)
                    watch.received(node_id, (m.name,))
                    if self.collector.stale(m):   # GC collected its steps meanwhile: the holder lets it go
                        self.cluster.release([node_id], [m.name])
                    else:
                        state.add(m, node_id, [ref], False, origin)
            elif kind == "receiving":   # hand-offs begun: their steps are in flight, not lost
                watch.receiving(node_id, [state.manifest(m) for m in msg[1]])
            elif kind == "not_received":
                watch.received(node_id, msg[1])
            elif kind == "durable":
                self.report_durable(msg[1], msg[2])
            elif kind == "release":
                state.release(node_id, msg[1])
            elif kind == "started":   # ("started", node[, first incarnation])
                self.healing.worker_started(node_id, fresh=len(msg) > 2 and bool(msg[2]))
        self.healing.check_gaps()
        self.metrics.changed()
        return self.pacing.interval(node_id)

    def report(self, manifest_json: bytes, node_id: str, refs: list, durable: bool) -> None:
        """``node_id`` holds an object (with its references) or made it durable."""
        self.state.add(Manifest.from_json(manifest_json), node_id, refs, durable)

    def report_durable(self, manifest_json, covers: list[str]) -> None:
        """An object was committed to storage; ``covers`` are the memory-tier objects it makes durable.
        ``manifest_json``: its manifest's bytes, or the :class:`Manifest` itself. A full also covers lazy diffs
        before it, triggers GC (``keep_fulls``) and may roll up the lineage index."""
        state = self.state
        m = state.manifest(manifest_json)
        if self.collector.collected_already(m):
            return
        state.add(m, None, None, True)
        state.mark_durable(covers, but=m.name)   # their steps are durable (inside the batch object)
        if m.kind == "full":
            if m.generation in state.lazy_gens:   # the workers holding its lazy diffs may let them go
                holders = state.lazy_holders(m.generation, m.last_step, self.cluster.alive())
                self.cluster.cover(holders, m.generation, m.last_step)
            keep = self.config.keep_fulls
            deleted = self.collector.gc(keep) if keep > 0 else []
            if deleted:
                log.info("ray_ckpt coordinator: garbage-collected %d objects older than the %d newest fulls",
                         len(deleted), keep)
            # after GC: no stale names; not at every full of a long run (see RewriteClock)
            state.write_index(force=bool(deleted))
        self.tuning.observe_commit(m)   # the policy re-optimizes when due

    def replica_progress(self, generation: int, step: int, node: str, ok: bool, reason: str = "") -> None:
        """The replica applied the records of ``generation`` up to ``step`` (or failed: ``ok=False``)."""
        self.replicas.progress(generation, step, node, ok, reason)

    def control(self, generation: int, trainer: dict | None = None) -> dict:
        """For the training process's sender (polled about once a second): ``want_full`` — take a full at the
        next step (consumed); ``delegate`` — the replica materializes the policy's fulls; ``gaps`` not told
        yet; ``draining`` nodes. ``trainer``: the training thread's latest measured window (step time, capture,
        optimizer step, other CPU per step), fed to the run clock and the adaptive policy's cost model."""
        self.clock.observe_trainer(trainer)
        self.tuning.observe_trainer(trainer)
        return {"want_full": self.healing.take_want_full(generation),
                "delegate": self.replicas.usable(generation, lambda: self.cluster.alive(1.0),
                                                 lambda: self.state.lineage(max_age=1.0).head()),
                "gaps": self.healing.gap_watch.untold(generation), "draining": dict(self.drains.draining)}

    def control_many(self, requests: list) -> list:
        """:meth:`control` for several senders in one call: ``requests`` is ``[(run, generation, [trainer
        reports]), ...]`` (a node's worker host relays its ranks' asks, :meth:`PersistenceWorker.control`);
        answers in the same order. A run's coordinator answers every request itself (the run names only route in
        :meth:`CoordinatorHost.control_many`)."""
        out = []
        for _run, generation, trainers in requests:
            for t in trainers:
                self.clock.observe_trainer(t)
                self.tuning.observe_trainer(t)
            out.append(self.control(generation))
        return out

    def request_full(self, generation: int, reason: str) -> None:
        """Ask the trainer of ``generation`` for a full at its next step (e.g. the replica restarted)."""
        self.healing.request_full(generation, reason)

    # -- API for training processes and the driver ----------------------------------------------------------------
    def granularity(self) -> dict | None:
        """The overhead budget's state in the trainer's latest report, kept for the run's next attempt, with
        ``mtbf_s`` once a failure was recorded (:meth:`RunClock.granularity`). From a training process at attach."""
        return self.clock.granularity()

    def new_generation(self) -> int:
        """A new generation (a training attempt's timeline) begins; returns its number."""
        self.state.last_generation += 1
        return self.state.last_generation

    def set_storage(self, storage) -> None:
        """Adopt the storage named by the driver-side callback (same root: a no-op after a restart)."""
        current = self.target.storage
        if storage.describe() != current.describe():
            raise ValueError(f"run {self.run!r} already checkpoints to {current.describe()}, "
                             f"not {storage.describe()}: use another run name")
        self.target.storage = storage

    def storage_uri(self) -> str:
        """The run's storage as ``describe()``: a URI with its connection options and never its credentials
        (no actor method hands out a backend: callers open the URI with their own credentials)."""
        return self.target.storage.describe()

    def run_config(self, given: dict | None = None) -> CheckpointConfig:
        """The run's config, after adopting ``given`` (an attaching trainer's or the callback's explicit fields,
        ``config.explicit``), which win from then on: ``keep_fulls`` and ``max_replica_lag`` apply at once; the
        adaptive policy keeps the knobs it was created with (its history is built on them). Its explicit fields
        are what :func:`ray_ckpt.train.attach` resolves the workers' configs over; :meth:`status` shows it."""
        if given:
            self.config = self.config.with_given(given)
            self.replicas.max_lag = self.config.max_replica_lag
        return self.config

    def get_policy(self):
        """The frequency policy for a (re)attaching Checkpointer: the adaptive policy's choice in force."""
        return self.tuning.policy()

    def policy_report(self) -> dict:
        """What the adaptive policy decides, from which estimates, and why."""
        return self.tuning.report()

    def record_failure(self, info: dict) -> None:
        """A worker-group failure (from the Ray Train callback): input for adaptive policies and the MTBF."""
        self.tuning.observe_failure(self.clock.record_failure(info))
        self.metrics.changed()

    def record_event(self, info: dict) -> None:
        """Other run events (resizes...), kept for status and policies."""
        self.clock.record_event(info)

    # -- restores, figures, GC -------------------------------------------------------------------------------------
    def plan(self, step: int | None = None, at_or_before: bool = False, replica_first: bool = False) -> dict:
        """The recovery plan for ``step`` (None = latest recoverable; ``at_or_before``: the newest recoverable step
        at or before ``step``): the manifests to read, in order, and for each the object references of live
        holders (memory tier; empty = read from durable storage); ``replica`` names the step whose state the
        state-tier replica can hand over; ``replica_first``: then only the objects after it get references
        (:class:`~ray_ckpt.runtime.coordination.planner.RestorePlanner`)."""
        return self.planner.plan(step, at_or_before, replica_first)

    def holder_refs(self, ask: dict, timeout: float = PLAN_REFS_TIMEOUT_S) -> dict:
        """``{node: {name: [ObjectRef]}}`` of the objects ``ask`` names per node, from the run's persistence
        workers there (all asked at once); a worker that does not answer within ``timeout`` gives none (its
        objects are read from another holder or from storage). Called in the actor by a plan; the scale
        benchmark's subclass answers for its simulated nodes."""
        return self.cluster.holder_refs(ask, timeout)

    def alive_node_ids(self) -> set[str]:
        """The ids of the cluster's alive nodes, asked of Ray now (the cluster part caches it:
        :meth:`RayCluster.alive`). Called in the actor; the scale benchmark's subclass adds its simulated
        nodes."""
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def status(self, max_age: float = 0.0) -> dict:
        """The lineage's figures. ``max_age``: how old the view of alive nodes and of the lineage may be (0: fresh;
        the periodic metrics pass 1 s and may get an older view of a long run, see
        :meth:`LineageState.lineage`); ``view_age_s`` says how old it is."""
        state = self.state
        anywhere, durable = state.lineage(False, max_age), state.lineage(True, max_age)
        view_age = state.view_age()
        heads = {"recoverable_step": anywhere.head(), "durable_step": durable.head()}
        return {**heads, "objects": len(state.entries), "gaps": list(self.healing.gap_watch.gaps),
                "replica": self.replicas.status(heads["recoverable_step"]),
                "memory_objects": state.view_counts[0], "replicated_objects": state.view_counts[1],
                "generation": state.last_generation, "failures": len(self.clock.failures),
                "restorable": _restorable(state.last_generation, durable, anywhere),
                "started_at": self.clock.started_at, "lease_lost": self.leasing.lost,
                "view_age_s": round(view_age, 3), "config": self.config.as_dict()}

    def restorable(self, max_age: float = 0.0) -> dict:
        """Which steps of the current generation restore from which tier: ``{"durable": ranges (storage alone),
        "memory": ranges (only while the memory tier holds them)}``, ranges as ``[[first, last], ...]``."""
        return _restorable(self.state.last_generation, self.state.lineage(True, max_age),
                           self.state.lineage(max_age=max_age))

    def unpersisted(self) -> dict:
        """``{node_id: [names]}``: objects not yet durable, by a live holder (to promote after a node loss)."""
        return self.state.unpersisted(self.cluster.alive())

    def gc(self, keep_fulls: int = 2) -> list[str]:
        """Delete chains older than the ``keep_fulls`` newest full checkpoints of the current timeline, from
        storage and from the memory tier. Returns the deleted object names."""
        return self.collector.gc(keep_fulls)

    def drain_status(self) -> dict:
        """``{node: record}`` of the drains this coordinator saw (what ``drains/`` on storage says)."""
        return self.drains.status()


def _restorable(gen: int, durable_lineage: Lineage, lineage: Lineage) -> dict:
    """``{"generation", "durable", "memory"}``: the step ranges of ``gen`` restorable from storage alone, and
    those only the memory tier holds."""
    durable = durable_lineage.reachable_ranges(gen)
    return {"generation": gen, "durable": [list(r) for r in durable],
            "memory": [list(r) for r in range_difference(lineage.reachable_ranges(gen), durable)]}


_remote_cls = None


def _head_node_affinity():
    """Options preferring the head node (soft): it lives as long as the cluster, so losing a worker node (the usual failure)
    does not also restart the coordinator and drop what it knows only in memory (holders, the replica's
    progress). Falls back to Ray's default placement when the head is unknown or full."""
    for n in ray.nodes():
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
            return prefer_node(n["NodeID"])
    return {}


class CoordinatorHost(_Upkeep, lineages.LineageHost):
    """The coordinator of a sharded job (:mod:`ray_ckpt.runtime.lineages`): one :class:`Coordinator` per shard
    lineage of the job, each with its own state, lease and policy, opened by :meth:`open_lineage` (or, after a
    restart of this actor, by the first call naming it: it rebuilds from storage and the workers' inventories
    as a restarted coordinator does). One ticker thread publishes every lineage's metrics and renews their
    leases; one drain watch tells every lineage of node drains. Calls run one at a time, as in a run's
    coordinator. Coordinator host actor; its methods are called remotely."""

    def __init__(self, job: str, root, config: CheckpointConfig):
        self._host_init(job)
        self.root = root
        self._config = config   # each lineage's Coordinator starts from it
        self._reporting = (0.0, 0)   # (when counted, workers reporting to any lineage), see lineage_call
        threading.Thread(target=self._tick, daemon=True, name="ray_ckpt-metrics").start()
        self._drain_watch = drain_watch.start_coordinator_watch(job)

    def _lineage(self, run: str, opening: bool):
        return super()._lineage(run, True)   # any call may (re)open a lineage of the job

    def _open(self, run: str) -> Coordinator:
        c = Coordinator(run, lineages.lineage_storage(self.root, run), self._config, hosted=True)
        # opened by a call that is not its attach (this host restarted, or a restore plans from it): it renews
        # the lineage's lease only while the lease is its run's (else a restore's plan would log a lost lease)
        storage = c.target.storage
        rec = read_lease(storage) if c.leasing.lease.enabled else {"run": run}
        if rec is None or rec.get("run") != run:
            c.leasing.lost = f"not renewed: the lease of {storage.describe()} is not run {run!r}'s"
            log.info("ray_ckpt coordinator: lineage %r opened without its lease (%s)", run,
                     "none" if rec is None else describe(rec))
        return c

    def _each(self) -> list:
        return list(self._lineages.values())

    def lineage_call(self, run: str, method: str, args: tuple = (), kwargs: dict | None = None):
        """As :meth:`LineageHost.lineage_call`; an ``update`` answers the report interval that keeps the calls
        of every lineage's workers together near ``REPORT_CALLS_PER_S`` (each lineage counts only its own
        reporters: 2 nodes per lineage would let a 1,024-rank job make 40,000 calls a second)."""
        out = super().lineage_call(run, method, args, kwargs)
        if method == "update":
            now = time.monotonic()
            if now - self._reporting[0] > 1.0:
                self._reporting = (now, sum(len(c.pacing.reporters) for c in self._each()))
            out = max(out, self._reporting[1] / REPORT_CALLS_PER_S)
        return out

    def control_many(self, requests: list) -> list:
        """:meth:`Coordinator.control_many` routed per lineage: one call per node's worker host per relay
        interval for all its ranks (an answer is None for a lineage that failed). Coordinator host actor."""
        out = []
        for run, generation, trainers in requests:
            try:
                out.append(self._lineage(run, True).control_many([(run, generation, trainers)])[0])
            except Exception as e:  # noqa: BLE001 - one lineage's failure must not fail the node's others
                log.debug("ray_ckpt coordinator: control of %r failed: %s", run, e)
                out.append(None)
        return out

    def open_lineage(self, run: str, storage_uri: str) -> None:
        """Open lineage ``run`` for an attach, which has taken its lease (:func:`get_or_create_coordinator`):
        renewed from now on."""
        c = self._lineage(run, True)
        storage = c.target.storage
        if storage.describe() != storage_uri:
            raise ValueError(f"shard run {run!r} checkpoints to {storage.describe()}, not {storage_uri}: "
                             f"use another run name")
        if c.leasing.lost is not None and (read_lease(storage) or {}).get("run") == run:
            c.leasing.lost = None

    def worker_host_started(self, node_id: str) -> None:
        """The job's worker host on ``node_id`` restarted: it holds nothing for any lineage (as a restarted
        worker of a run tells its coordinator)."""
        for c in self._each():
            c.healing.worker_started(node_id)


_host_cls = None


def get_or_create_coordinator(run: str, storage, *, config: CheckpointConfig, takeover: bool = False):
    """The run's coordinator (created detached if missing, with ``config``, the caller's resolved config: the
    frequency policy's start, retention, the replica's lag; an existing one keeps its own). Any process connected
    to Ray.

    Creating it takes the lineage's writer lease for the run (:mod:`ray_ckpt.engine.lease`): when another job
    writes ``storage``, :class:`ray_ckpt.LeaseError` names it here, in the caller (``takeover``
    replaces a gone job's lease). The coordinator renews the lease and :func:`shutdown_run` releases it.

    A shard run (:func:`ray_ckpt.runtime.lineages.is_shard_run`) gets its lineage of the job's
    :class:`CoordinatorHost` (a :class:`~ray_ckpt.runtime.lineages.LineageHandle`, called as the actor is):
    one coordinator actor per sharded job, whatever its number of ranks."""
    global _remote_cls
    if lineages.is_shard_run(run):
        return _shard_coordinator(run, storage, takeover=takeover, config=config)
    name = naming.coordinator_name(run)
    try:
        return ray.get_actor(name, namespace=naming.NAMESPACE)
    except ValueError:
        pass
    Lease(storage, run=run).acquire(takeover=takeover)
    if _remote_cls is None:
        _remote_cls = ray.remote(Coordinator)
    return _remote_cls.options(name=name, namespace=naming.NAMESPACE, lifetime="detached", get_if_exists=True,
                       max_restarts=-1, max_task_retries=-1, num_cpus=0,
                       **_head_node_affinity()).remote(run, storage, config)


def _shard_coordinator(run: str, storage, *, takeover: bool, config: CheckpointConfig):
    """The lineage ``run`` of its job's coordinator host (created detached, head node preferred, if missing),
    opened with its lease taken. Any process connected to Ray (the training process of a rank, at attach)."""
    global _host_cls
    job = lineages.job_of(run)
    name = lineages.coordinator_host_name(job)
    try:
        host = ray.get_actor(name, namespace=naming.NAMESPACE)
    except ValueError:
        host = None
    # the lease at every attach (shared with the run's earlier attaches): the lineage may have been opened
    # without it (a restore planned from it, or this host restarted after the job's lease was released)
    Lease(storage, run=run).acquire(takeover=takeover)
    if host is None:
        if _host_cls is None:
            _host_cls = ray.remote(CoordinatorHost)
        host = _host_cls.options(name=name, namespace=naming.NAMESPACE, lifetime="detached", get_if_exists=True,
                                 max_restarts=-1, max_task_retries=-1, num_cpus=0,
                                 **_head_node_affinity()).remote(job, lineages.root_storage(storage, run), config)
    ray.get(host.open_lineage.remote(run, storage.describe()), timeout=120)
    return lineages.LineageHandle(host, run)


def shard_runs(job: str, timeout: float = 30.0) -> list[str]:
    """The shard lineages that the coordinator host of ``job`` holds (none without a host). Any process."""
    try:
        host = ray.get_actor(lineages.coordinator_host_name(job), namespace=naming.NAMESPACE)
        return ray.get(host.lineages.remote(), timeout=timeout)
    except ValueError:
        return []


def shutdown_job(job: str) -> None:
    """The end of a sharded job with ``runtime="ray"``: release every shard lineage's lease and kill the job's
    hosts (coordinator, node workers, replicas; their memory tier is lost, storage stays). Any process."""
    try:
        host = ray.get_actor(lineages.coordinator_host_name(job), namespace=naming.NAMESPACE)
        ray.get(host.release_lease.remote(), timeout=60)
    except Exception as e:  # noqa: BLE001 - gone already, or unreachable: the leases then go stale
        log.info("ray_ckpt: job %r: shard leases not released by its coordinator (%s)", job, e)
    names = [info["name"] if isinstance(info, dict) else info
             for info in ray.util.list_named_actors(all_namespaces=True)]
    for aname in lineages.host_names(job, names):
        try:
            ray.kill(ray.get_actor(aname, namespace=naming.NAMESPACE), no_restart=True)
        except ValueError:
            pass


def shutdown_run(run: str) -> None:
    """Release the run's writer lease and kill its coordinator and persistence workers (their memory tier is
    lost; storage stays). A shard run: its job's actors serve every rank, so they stop with the job
    (:func:`shutdown_job`, which this is for any of its shard runs)."""
    if lineages.is_shard_run(run):
        shutdown_job(lineages.job_of(run))
        return
    try:
        coord = ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE)
        ray.get(coord.release_lease.remote(), timeout=30)
    except Exception as e:  # noqa: BLE001 - gone already, or unreachable: the lease then goes stale
        log.info("ray_ckpt: run %r: lease not released by its coordinator (%s)", run, e)
    for info in ray.util.list_named_actors(all_namespaces=True):
        aname = info["name"] if isinstance(info, dict) else info
        if aname in (naming.coordinator_name(run), naming.replica_name(run)) \
                or aname.startswith(naming.worker_prefix(run)):
            try:
                ray.kill(ray.get_actor(aname, namespace=naming.NAMESPACE), no_restart=True)
            except ValueError:
                pass
