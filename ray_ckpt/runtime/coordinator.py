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
  peer only are persisted from the peer at once (:meth:`_heal`), and the training process's sender resends
  what no other node held (it keeps every chunk until it is safe);
* the steps of the current generation must form an unbroken sequence: a step that no object covers and no
  hand-off in flight brings, for longer than a short grace period, is a **gap** (:mod:`ray_ckpt.runtime.gaps`) —
  logged as a WARNING naming the steps, kept in :meth:`status`, visible on storage as uncovered steps
  (``ray-ckpt ls``), and closed by asking the trainer for a full checkpoint at its next step (:meth:`control`);
* the state tier's replica reports its progress (:meth:`replica_progress`); while it is healthy and close
  behind, the trainer takes no full checkpoints (the replica writes them), otherwise the trainer does.

All methods run in the coordinator actor and are called remotely (from training processes, workers, the
driver-side callback, tests).
"""
from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import ray

from ray_ckpt.config import CheckpointConfig
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.lineage import Lineage, Manifest, NoCheckpointError, collectable, gc_cutoff, range_difference
from ray_ckpt.lineage.manifest import lazy_diffs
from ray_ckpt.policy import FixedFrequencyPolicy
from ray_ckpt.policy import adaptive as _adaptive
from ray_ckpt.lineage import index as _lineage_index
from ray_ckpt.engine.lease import Lease, LeaseLost, describe, read_lease
from ray_ckpt.runtime import metrics as _metrics
from ray_ckpt.runtime import drain as drain_watch
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.gaps import GapWatch
from ray_ckpt.runtime.placement import prefer_node
from ray_ckpt.storage import StorageError
from ray_ckpt.lineage import drains as drain_records
from ray_ckpt.lineage import retention

log = logging.getLogger("ray_ckpt")


#: the periodic figures (control, metrics, gap checks) are recomputed at most once per this many times the CPU
#: their last computation took: they are linear in the run's objects, which grow with a long run, so their CPU
#: share stays near 1/COST_FACTOR while their age grows (figures: docs/benchmark-log.md)
COST_FACTOR = 50.0
#: below this many CPU seconds a periodic computation is redone every time, as in a short run
CHEAP_S = 0.005
#: the worker update calls per second this actor asks of all its reporting workers together: each call costs the
#: actor a fixed overhead besides its messages, so a wide job's workers report less often each (their reports
#: batched into fewer calls) instead of one call per node every MIN_REPORT_INTERVAL_S (docs/scale.md)
REPORT_CALLS_PER_S = 200.0
#: the shortest report interval a worker is asked for (seconds): a narrow job's coordinator lags by at most this
MIN_REPORT_INTERVAL_S = 0.05
#: a node that sent no update for this long no longer counts towards the report interval
_REPORTER_TTL_S = 5.0
#: how long a restore plan waits for the holders' object references (then once more, this long, for objects
#: held only in memory): held reports carry none (see Coordinator._plan_refs)
PLAN_REFS_TIMEOUT_S = 5.0
PLAN_REFS_PATIENCE_S = 20.0
#: manifests parsed from the same bytes (an origin's report and its peer's report of the same chunk) are reused
_PARSED_CACHE = 4096


@dataclass
class _Entry:
    manifest: Manifest
    durable: bool = False
    holders: dict = field(default_factory=dict)  # node_id -> [ObjectRef], or [None]: asked at a plan
    origin: str | None = None                    # node whose worker received it from the trainer


@dataclass
class _Replica:
    generation: int
    step: int
    node: str
    ok: bool
    reason: str = ""
    updated: float = field(default_factory=time.time)


def _num(v) -> float:
    """``v`` as a non-negative finite float (0 otherwise): a figure of a trainer report."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0


class Coordinator:
    def __init__(self, run: str, storage, config: CheckpointConfig, hosted: bool = False):
        self.run = run
        #: the run's config: as its creator resolved it (the callback, or the first attach), with the fields each
        #: attaching trainer gave explicitly (:meth:`adopt_config`); :meth:`get_config` hands it to the workers
        self.config = config
        full_every, batch_steps = config.full_every, config.batch_steps
        self.max_replica_lag = config.max_replica_lag
        self.replica: _Replica | None = None
        self.gap_watch = GapWatch()   # holes, hand-offs in flight, declared gaps (see _check_gaps)
        self._want_full: set[int] = set()                # generations whose trainer must take a full now
        self._granularity: dict | None = None           # the overhead budget's state in the latest trainer report
        self._down: list[list] = []                      # [failure time, the next attach's time or None]
        self._running_since: float | None = None         # the trainer's first measured window (its steps began)
        #: durable_only -> (when, CPU seconds it took, the view): periodic callers reuse a view (see _lineage)
        self._views: dict[bool, tuple[float, float, Lineage]] = {}
        self._view_counts = (0, 0)    # objects held by a live node, by two or more: counted with the view
        self._index_clock = _lineage_index.RewriteClock()
        self._nodes_cache: tuple[float, set[str]] | None = None   # (when, alive node ids), see _alive_nodes
        self.keep_fulls = config.keep_fulls  # > 0: garbage-collect chains older than that many durable fulls
        self._gc_floor: tuple[int, int] | None = None   # (generation, step) of the last GC's oldest kept full
        self.storage = storage
        self.policy = FixedFrequencyPolicy(full_every, batch_steps)
        self.entries: dict[str, _Entry] = {}
        self.failures: list[dict] = []
        self.events: list[dict] = []
        self._last_generation = 0
        self._lazy_gens: set[int] = set()   # generations with durable_diffs="fulls"
        self.started_at = time.time()
        self._metrics = _metrics.CounterDeltas({"run": run})
        self._metrics_t = 0.0
        self.lease = Lease(storage, run=run)   # taken by get_or_create_coordinator; renewed here
        self.lease_lost: str | None = None
        self._lease_failing = False   # the last renewal met a storage error (logged once as a WARNING)
        self._changes = 0            # reports and failures seen (publish_metrics computes only after changes)
        self._published_changes = -1
        self._reporters: dict[str, float] = {}   # node -> when its last update arrived (see report_interval)
        self._reporters_pruned = 0.0
        self._parsed: dict[bytes, Manifest] = {}   # manifest bytes -> Manifest (insertion order: oldest first)
        # hosted (a shard lineage of a job's CoordinatorHost): the host's one ticker and drain watch serve it
        if not hosted:
            threading.Thread(target=self._tick, daemon=True, name="ray_ckpt-metrics").start()
        self.drains: dict[str, dict] = {}        # node -> its drain record (lineage/drains.py), see drains_changed
        self._draining: dict[str, int] = {}      # the GCS drain state: node -> deadline ms (0: none)
        self._drain_watch = None if hosted else drain_watch.start_coordinator_watch(run)
        # the adaptive policy: fed by commits and failures; pinned values never change
        self.tuner = _adaptive.make_tuner(full_every, batch_steps, started_at=self.started_at,
                                          **config.policy_options())
        self._rebuild()

    # -- state ---------------------------------------------------------------------------------------------------
    def _refresh_durable(self) -> None:
        """Add every committed manifest on storage (a worker that died may have written objects whose reports
        it never sent)."""
        lineage, bad = load_lineage(self.storage, strict=False)
        for key in bad:
            log.warning("ray_ckpt coordinator: ignoring malformed manifest %s", key)
        for m in lineage.manifests:
            e = self.entries.get(m.name)
            if e is None:
                self.entries[m.name] = _Entry(m, durable=True)
            else:
                e.durable = True
        self._last_generation = max([self._last_generation] + [m.generation for m in lineage.manifests])

    def _rebuild(self) -> None:
        self._refresh_durable()
        for node in sorted(lineages.worker_nodes(self.run)):
            if node not in self._alive_nodes():
                continue
            try:
                inv = ray.get(lineages.worker(self.run, node).inventory.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001
                log.warning("ray_ckpt coordinator: the worker of run %r on node %s did not answer: %s",
                            self.run, node[:12], e)
                continue
            for mjson, refs, durable in inv:
                self._add(Manifest.from_json(mjson), node, refs, durable)

    def _add(self, m: Manifest, node: str | None, refs, durable: bool, origin: str | None = None) -> None:
        e = self.entries.get(m.name)
        if e is None:
            e = self.entries[m.name] = _Entry(m)
        e.durable = e.durable or durable
        if origin is not None and e.origin is None:
            e.origin = origin
        if node is not None and refs:
            e.holders[node] = refs
        self._last_generation = max(self._last_generation, m.generation)
        if lazy_diffs(m):
            self._lazy_gens.add(m.generation)

    def _durable_floor(self, gen: int) -> int | None:
        """``durable_diffs="fulls"``: the newest durable full of ``gen`` — the steps before it need not be held
        (not a gap when released). None for generations that write every diff."""
        if gen not in self._lazy_gens:
            return None
        return max((e.manifest.last_step for e in self.entries.values() if e.durable
                    and e.manifest.kind == "full" and e.manifest.generation == gen), default=None)

    def _cover(self, gen: int, step: int) -> None:
        """Tell the workers holding lazy diffs of ``gen`` that a durable full at ``step`` covers them."""
        alive = self._alive_nodes()
        nodes = {n for e in self.entries.values() if e.manifest.generation == gen and e.manifest.kind == "diff"
                 and e.manifest.last_step <= step and not e.durable for n in e.holders if n in alive}
        for node in nodes:
            try:
                lineages.worker(self.run, node).cover.remote(gen, step)
            except ValueError:
                pass

    def _alive_nodes(self, max_age: float = 0.0) -> set[str]:
        """The alive nodes; ``max_age > 0`` accepts an answer that old (the periodic calls — control, metrics —
        ask ~3 times a second and ``ray.nodes()`` was a sixth of this actor's CPU; plans always ask afresh)."""
        now = time.monotonic()
        cached = self._nodes_cache
        if max_age > 0 and cached is not None and now - cached[0] <= max_age:
            return cached[1]
        alive = self.alive_node_ids()
        self._nodes_cache = (now, alive)
        return alive

    def alive_node_ids(self) -> set[str]:
        """The ids of the cluster's alive nodes, asked of Ray now (callers cache it: :meth:`_alive_nodes`).
        Coordinator actor; the scale benchmark's subclass adds its simulated nodes."""
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def _worker_handles(self, nodes) -> dict:
        """``{node: handle}`` of the run's persistence workers on ``nodes`` that exist: one listing of the named
        actors, then a lookup only of those (a wide job's worker starts each ask every node: one failed lookup
        per node without a worker cost a round trip to Ray's control store each)."""
        named = lineages.worker_nodes(self.run)
        out = {}
        for node in nodes:
            if node in named:
                try:
                    out[node] = lineages.worker(self.run, node)
                except ValueError:
                    pass
        return out

    def _lineage(self, durable_only: bool = False, max_age: float = 0.0) -> Lineage:
        """The lineage of what storage holds (``durable_only``) or of what storage or a live node holds.

        ``max_age > 0`` (the periodic callers) accepts how old the list of alive nodes may be, and a view built
        less than ``COST_FACTOR`` times its CPU cost ago once that cost exceeds ``CHEAP_S``: a long run's views
        cost tens of ms, and rebuilding them several times a second would grow this actor's CPU with the run.
        Plans and explicit status calls (``max_age=0``) always get a fresh view."""
        now = time.monotonic()
        cached = self._views.get(durable_only)
        if (max_age > 0 and cached is not None and cached[1] > CHEAP_S
                and now - cached[0] <= COST_FACTOR * cached[1]):
            return cached[2]
        # no need to ask which nodes are alive for durable_only (ray.nodes() was the most of this actor's CPU)
        alive = None if durable_only else self._alive_nodes(max_age)
        cpu0 = time.thread_time()   # the view's own cost (ray.nodes() has its own cache)
        counts = None
        # a step a plan cannot reach is explained from the retention record (read only then)
        removed = functools.partial(retention.read, self.storage)
        if alive is None:
            lin = Lineage([e.manifest for e in self.entries.values() if e.durable], retention=removed)
        else:
            ms, held, twice = [], 0, 0
            for e in self.entries.values():
                live = sum(1 for n in e.holders if n in alive) if e.holders else 0
                held += live > 0
                twice += live >= 2
                if e.durable or live:
                    ms.append(e.manifest)
            lin, counts = Lineage(ms, retention=removed), (held, twice)
        lin.head()   # the sweep every periodic caller needs, timed with the build (the view keeps its result)
        self._views[durable_only] = (now, time.thread_time() - cpu0, lin)
        if counts is not None:
            self._view_counts = counts
        return lin

    # -- reports from workers ----------------------------------------------------------------------------------------
    def update(self, node_id: str, msgs: list) -> float:
        """A worker's messages, in the order it produced them (one call per report interval per worker: 50 ms
        in a narrow job). A manifest comes as a :class:`Manifest` (workers) or as its JSON bytes (the replica,
        older workers); ``("held_batch", [(manifest, ref, origin), ...])`` is a run of ``held`` messages packed
        by the worker (:func:`ray_ckpt.runtime.reports.pack_reports`). Returns the report interval the worker
        should keep to (:meth:`report_interval`)."""
        for msg in msgs:
            kind = msg[0]
            if kind in ("held", "held_batch"):
                for mjson, ref, origin in (msg[1:],) if kind == "held" else msg[1]:
                    m = self._manifest(mjson)
                    self._add(m, node_id, [ref], False, origin)
                    self.gap_watch.received(node_id, (m.name,))
            elif kind == "receiving":   # hand-offs begun: their steps are in flight, not lost
                self.gap_watch.receiving(node_id, [self._manifest(m) for m in msg[1]])
            elif kind == "not_received":
                self.gap_watch.received(node_id, msg[1])
            elif kind == "durable":
                self.report_durable(msg[1], msg[2])
            elif kind == "release":
                self.release(node_id, msg[1])
            elif kind == "started":   # ("started", node[, first incarnation])
                self.worker_started(node_id, fresh=len(msg) > 2 and bool(msg[2]))
        self._check_gaps()
        self._changes += 1
        return self.report_interval(node_id)

    def _manifest(self, mjson) -> Manifest:
        """A reported manifest: as the worker sent it (a :class:`Manifest`), or ``Manifest.from_json`` of its
        bytes (older workers, the replica), reusing the parse of the same bytes (a chunk is reported by its
        origin and by its peer)."""
        if isinstance(mjson, Manifest):
            return mjson
        m = self._parsed.pop(mjson, None)
        if m is None:
            m = Manifest.from_json(mjson)
            if len(self._parsed) >= _PARSED_CACHE:
                del self._parsed[next(iter(self._parsed))]
        self._parsed[mjson] = m
        return m

    def report_interval(self, node_id: str | None = None) -> float:
        """How often (seconds) each reporting worker should call :meth:`update`: ``MIN_REPORT_INTERVAL_S``, or
        the nodes that reported within ``_REPORTER_TTL_S`` divided by ``REPORT_CALLS_PER_S`` when more, so
        that the calls into this actor stay near ``REPORT_CALLS_PER_S`` however wide the job (its view lags
        by about one interval). ``node_id``: the node whose update arrived now. Coordinator actor."""
        now = time.monotonic()
        if node_id is not None:
            self._reporters[node_id] = now
        if now - self._reporters_pruned > 1.0:
            self._reporters_pruned = now
            for n in [n for n, t in self._reporters.items() if now - t > _REPORTER_TTL_S]:
                del self._reporters[n]
        return max(MIN_REPORT_INTERVAL_S, len(self._reporters) / REPORT_CALLS_PER_S)

    def publish_metrics(self) -> None:
        """The run's lineage figures as Ray metrics (:mod:`ray_ckpt.runtime.metrics`): called about once a second
        by the actor's own ticker thread (as an actor call, so it runs between the other calls, never
        concurrently); computed only when reports arrived since the last time, else every 15 s."""
        now = time.monotonic()
        if self._changes == self._published_changes and now - self._metrics_t < 15.0:
            return
        self._metrics_t, self._published_changes = now, self._changes
        try:
            _metrics.coordinator_metrics(self.status(max_age=1.0), self._metrics)
        except Exception as e:  # noqa: BLE001 - metrics never break the coordinator
            log.debug("ray_ckpt coordinator: metrics not published: %s", e)

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

    def renew_lease(self) -> None:
        """Heartbeat of the run's writer lease (at most once a ``ttl/3``). A lease another job took over is
        logged as an ERROR and shown in :meth:`status` (``lease_lost``)."""
        if self.lease_lost is not None:
            return
        try:
            self.lease.renew()
            if self._lease_failing:
                log.warning("ray_ckpt coordinator: the writer lease is renewed again")
            self._lease_failing = False
        except LeaseLost as e:
            self.lease_lost = str(e)
            log.error("ray_ckpt coordinator: %s", e)
        except StorageError as e:   # an outage: the next tick retries (the lease outlives a few missed heartbeats)
            log.log(logging.INFO if self._lease_failing else logging.WARNING,
                    "ray_ckpt coordinator: storage error renewing the writer lease (%s); retrying", e)
            self._lease_failing = True
        except Exception as e:  # noqa: BLE001 - not a storage fault: a bug, logged with its type; the next tick retries
            log.error("ray_ckpt coordinator: lease renewal failed (%s: %s); retrying", type(e).__name__, e)

    def release_lease(self) -> None:
        """Delete the run's lease (end of the run)."""
        self.lease.release()

    def report(self, manifest_json: bytes, node_id: str, refs: list, durable: bool) -> None:
        self._add(Manifest.from_json(manifest_json), node_id, refs, durable)

    def report_durable(self, manifest_json, covers: list[str]) -> None:
        """An object was committed to storage; ``covers`` are the memory-tier objects it makes durable.
        ``manifest_json``: its manifest's bytes, or the :class:`Manifest` itself."""
        m = self._manifest(manifest_json)
        if self._collected_already(m):
            return
        self._add(m, None, None, True)
        for n in covers:
            if n in self.entries and n != m.name:
                self.entries[n].durable = True  # its steps are durable (inside the batch object)
        if m.kind == "full" and m.generation in self._lazy_gens:
            self._cover(m.generation, m.last_step)
        deleted: list[str] = []
        if m.kind == "full" and self.keep_fulls > 0:
            deleted = self.gc(self.keep_fulls)
            if deleted:
                log.info("ray_ckpt coordinator: garbage-collected %d objects older than the %d newest fulls",
                         len(deleted), self.keep_fulls)
        now = time.monotonic()
        # the lineage index: roll the durable manifests up at a full (after GC: no stale names; not at every full
        # of a long run, see RewriteClock)
        if m.kind == "full" and self._index_clock.due(now, force=bool(deleted)):
            cpu0 = time.thread_time()
            try:
                # objects still held and not durable may be committed later, some out of order (a peer
                # persisting a lost worker's chunks): no watermark may pass them
                _lineage_index.write_index(self.storage, [e.manifest for e in self.entries.values() if e.durable],
                                           pending=[e.manifest for e in self.entries.values() if not e.durable])
            except Exception as e:  # noqa: BLE001 - a cache: readers fall back to listing
                log.warning("ray_ckpt coordinator: could not write the lineage index: %s", e)
            self._index_clock.done(now, time.thread_time() - cpu0)
        _adaptive.observe_manifest_commit(self.tuner, kind=m.kind, first_step=m.first_step,
                                          last_step=m.last_step, nbytes=m.nbytes, created=m.created,
                                          now=time.time())
        self._decide()   # the policy re-optimizes when due

    def _collected_already(self, m: Manifest) -> bool:
        """A diff committed after GC dropped its steps (its write was in flight when GC ran, so GC could not
        delete it): delete it now, or it would stay on storage until the next full's GC, forever at a run's end.
        Only within the generation GC last ran on (a newer one may branch anywhere: the next GC decides)."""
        floor = self._gc_floor
        if (floor is None or m.kind == "full" or m.generation != floor[0] or self._last_generation != floor[0]
                or m.last_step >= floor[1]):
            return False
        try:
            self.storage.delete(m.key)      # manifest first, as in gc
            self.storage.delete(m.object)
        except Exception as e:  # noqa: BLE001 - kept as an entry: the next GC deletes it
            log.warning("ray_ckpt coordinator: could not delete %s, written after GC collected its steps: %s",
                        m.name, e)
            return False
        log.info("ray_ckpt coordinator: deleted %s, written after GC collected its steps", m.name)
        return True

    def release(self, node_id: str, names: list[str]) -> None:
        for n in names:
            e = self.entries.get(n)
            if e is not None:
                e.holders.pop(node_id, None)
                if not e.holders and not e.durable:
                    del self.entries[n]

    def worker_started(self, node_id: str, fresh: bool = False) -> None:
        """A (re)started worker holds nothing: forget its old object references, persist what only a peer
        still holds of what it had received. ``fresh``: the worker's first incarnation — when no object known
        here was held by or received on that node either, there is nothing to heal and no report it could have
        lost (the storage listing is not read again: a wide job's start re-read it once per node)."""
        known = any(e.origin == node_id or node_id in e.holders for e in self.entries.values())
        self.drop_node(node_id)
        if fresh and not known:
            return
        self._refresh_durable()
        self._heal(node_id)

    def _heal(self, lost: str) -> None:
        """Objects received by ``lost`` that are not durable and still held by a live peer: the peer writes
        them to storage now (the sender resends what no peer held).

        Asked of every live node's worker (:meth:`PersistenceWorker.persist_origin`), not only of the holders
        this coordinator knows: a peer reports a replica it holds within ~50 ms, and ``lost``'s sender may have
        dropped the chunk as safe (held on two nodes) before that report arrived — so the peer decides from what it
        holds, never from this possibly older view."""
        for node, worker in self._worker_handles(n for n in self._alive_nodes() if n != lost).items():
            worker.persist_origin.remote(lost)
            log.info("ray_ckpt coordinator: node %s persists what it holds of lost node %s", node[:8], lost[:8])

    def _forget_dead_nodes(self) -> None:
        alive = self._alive_nodes()
        dead = {n for e in self.entries.values() for n in e.holders if n not in alive}
        for node in dead:
            self.drop_node(node)
            self._heal(node)

    # -- gaps ------------------------------------------------------------------------------------------------------
    def _check_gaps(self, force: bool = False) -> None:
        """Declare lost the steps of the current generation that no object covers and no hand-off in flight to
        a live node brings, past the grace period (:class:`~ray_ckpt.runtime.gaps.GapWatch` decides): logged,
        kept for :meth:`status`, told to the trainer with a full asked of it (:meth:`control`)."""
        watch, now = self.gap_watch, time.monotonic()
        if not watch.due(now, force, COST_FACTOR):
            return
        cpu0 = time.thread_time()
        gen = self._last_generation
        holes = Lineage([e.manifest for e in self.entries.values() if e.manifest.generation == gen]
                        ).uncovered_steps(gen)
        watch.cost = time.thread_time() - cpu0
        floor = self._durable_floor(gen)
        if floor is not None:
            holes = [s for s in holes if s > floor]
        new = watch.overdue(gen, holes, now, self._alive_nodes(1.0) if watch.arriving() else None)
        if not new:
            return
        if not force:   # before calling it a gap: commits whose reports a dead worker never sent
            self._refresh_durable()
            self._check_gaps(force=True)
            return
        for first, last in watch.declare(gen, new, time.time()):
            log.warning("ray_ckpt coordinator: run %r lost steps %d..%d of generation %d (held nowhere, not "
                        "durable, none in flight): they cannot be restored; asking the trainer for a full "
                        "checkpoint now", self.run, first, last, gen)
        self._want_full.add(gen)

    # -- the state tier --------------------------------------------------------------------------------------------
    def replica_progress(self, generation: int, step: int, node: str, ok: bool, reason: str = "") -> None:
        """The replica applied the records of ``generation`` up to ``step`` (or failed: ``ok=False``)."""
        prev = self.replica
        if not ok and (prev is None or prev.ok):
            log.warning("ray_ckpt coordinator: the state-tier replica of run %r stopped (%s); the trainer takes "
                        "full checkpoints again", self.run, reason)
        self.replica = _Replica(generation, step, node, ok, reason)

    def _ask_replica(self) -> None:
        """A restarted coordinator does not know the replica's progress until its next report: ask it."""
        try:
            replica = lineages.replica(self.run)
            st = ray.get(replica.status.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - no replica (or it is restarting): restore from the chain
            log.debug("ray_ckpt coordinator: no replica status (%s)", e)
            return
        if st.get("generation") is not None and st.get("step") is not None:
            self.replica = _Replica(st["generation"], st["step"], st["node"], st["ok"], st.get("reason", ""))

    def _replica_usable(self, gen: int, max_age: float = 0.0) -> bool:
        r = self.replica
        if r is None or not r.ok or r.generation != gen or r.node not in self._alive_nodes(max_age):
            return False
        head = self._lineage(max_age=max_age).head()
        return head is None or head - r.step <= self.max_replica_lag

    def control(self, generation: int, trainer: dict | None = None) -> dict:
        """For the training process's sender (polled about once a second): ``want_full`` — take a full at the
        next step (consumed); ``delegate`` — the replica materializes the policy's fulls. ``trainer``: the
        training thread's latest measured window (step time, capture, optimizer step, other CPU per step), fed
        to the adaptive policy's cost model."""
        self._observe_trainer(trainer)
        want = generation in self._want_full
        self._want_full.discard(generation)
        return {"want_full": want, "delegate": self._replica_usable(generation, max_age=1.0),
                "gaps": self.gap_watch.untold(generation), "draining": dict(self._draining)}

    def control_many(self, requests: list) -> list:
        """:meth:`control` for several senders in one call: ``requests`` is ``[(run, generation, [trainer
        reports]), ...]`` (a node's worker host relays its ranks' asks, :meth:`PersistenceWorker.control`);
        answers in the same order. A run's coordinator answers every request itself (the run names only route in
        :meth:`CoordinatorHost.control_many`)."""
        out = []
        for _run, generation, trainers in requests:
            for t in trainers:
                self._observe_trainer(t)
            out.append(self.control(generation))
        return out

    def granularity(self) -> dict | None:
        """The overhead budget's state in the trainer's latest report (``BudgetPolicy.state``), kept for the run's
        next attempt, with ``mtbf_s``: the run's observed mean running time between worker-group failures (its time
        since its trainer's first steps, less each failure's time to the next attach, over the failures recorded;
        absent before the first). None when there is neither.
        Remote (a training process at attach)."""
        out = dict(self._granularity or {})
        if self.failures:
            now = time.time()
            for d in self._down:          # an attach after a failure: the run is up again
                if d[1] is None:
                    d[1] = now
            since = self._running_since or self.started_at
            running = now - since - sum(up - max(down, since) for down, up in self._down if up > since)
            out["mtbf_s"] = max(1e-3, running) / len(self.failures)
        return out or None

    def _observe_trainer(self, trainer: dict | None) -> None:
        if trainer:
            if self._running_since is None:   # steps began about a window before (not the start-up before them)
                self._running_since = time.time() - _num(trainer.get("steps")) * _num(trainer.get("wall_s"))
            trainer = dict(trainer)
            g = trainer.pop("granularity", None)
            if isinstance(g, dict):
                self._granularity = g
            try:
                self.tuner.observe_trainer(**trainer)
                self._decide()
            except (TypeError, ValueError) as e:   # a malformed report must not fail the control call
                log.debug("ray_ckpt coordinator: trainer report ignored: %s", e)

    def request_full(self, generation: int, reason: str) -> None:
        """Ask the trainer of ``generation`` for a full at its next step (e.g. the replica restarted)."""
        log.info("ray_ckpt coordinator: full checkpoint requested: %s", reason)
        self._want_full.add(generation)

    def drop_node(self, node_id: str) -> list[str]:
        """Forget what ``node_id`` held and was receiving; returns names now neither durable nor held anywhere."""
        self.gap_watch.node_reset(node_id)
        lost = []
        for name, e in list(self.entries.items()):
            if e.holders.pop(node_id, None) is not None and not e.holders and not e.durable:
                del self.entries[name]
                lost.append(name)
        return lost

    # -- node drains (preemption notices, runtime/drain.py) ---------------------------------------------------------
    def drains_changed(self, drains: dict) -> None:
        """The GCS drain state changed to ``drains`` (``{node: deadline_ms}``; from this actor's drain watch).

        A new drain is logged (WARNING), recorded on storage (``drains/``, shown by ``ray-ckpt ls``) and told to
        every live node worker (:meth:`PersistenceWorker.drain_notice`: peers among the nodes that stay, the
        draining node writes what it holds at once, chunks whose second copy is there are copied elsewhere); a
        state-tier replica on a draining node is restarted elsewhere (Ray places nothing new on a draining
        node) and rebuilds itself from the lineage. The training processes hear of it through :meth:`control`."""
        self._draining = {str(n): int(d or 0) for n, d in drains.items()}
        now_ms = int(time.time() * 1000)
        new = [n for n in self._draining if n not in self.drains or self.drains[n]["status"] == "cancelled"]
        for node, rec in self.drains.items():
            if node not in self._draining and rec["status"] in ("draining", "safe") \
                    and node in self._alive_nodes():
                rec["status"] = "cancelled"
                rec["settled"] = True
                self._write_drain(rec)
        for node in new:
            deadline = self._draining[node]
            prior = None if node in self.drains else drain_records.find_open(self.storage, node, deadline)
            if prior is not None:   # this coordinator restarted during the drain: its record goes on
                self.drains[node] = prior
                log.info("ray_ckpt coordinator: run %r: node %s is still draining: continuing its drain record",
                         self.run, node[:12])
                continue
            gen = self._last_generation
            self.drains[node] = rec = {"node": node, "noticed_ms": now_ms, "deadline_ms": deadline,
                                       "generation": gen, "status": "draining",
                                       "held": [], "durable": [], "peer": [], "unsafe": [],
                                       # the newest step durable at the notice: what the node receives past it
                                       # counts as held there even when it is written before the next poll
                                       "durable_before": max((e.manifest.last_step for e in self.entries.values()
                                                              if e.durable and e.manifest.generation == gen),
                                                             default=-1)}
            log.warning("ray_ckpt coordinator: run %r: node %s is draining (%s): making the steps it holds safe on "
                        "the nodes that stay", self.run, node[:12],
                        f"deadline in {deadline / 1000.0 - now_ms / 1000.0:.1f} s" if deadline else "no deadline")
            self._write_drain(rec)
        if not new:
            return
        for node in self._alive_nodes():
            worker = drain_watch.worker_handle(self.run, node)
            if worker is not None:
                worker.drain_notice.remote(self._draining)
        self._move_replica()
        self.drain_progress()

    def _move_replica(self) -> None:
        """A state-tier replica on a draining node is restarted on a node that stays (soft affinity: Ray avoids
        draining nodes) and rebuilds itself from the lineage; the trainer takes fulls meanwhile."""
        if self.replica is None:
            self._ask_replica()
        r = self.replica
        if r is None or r.node not in self._draining:
            return
        try:
            handle = lineages.replica(self.run)
        except ValueError:
            return
        log.warning("ray_ckpt coordinator: run %r: the state-tier replica is on draining node %s: restarting it on "
                    "a node that stays (it rebuilds from the lineage; the trainer takes fulls meanwhile)",
                    self.run, r.node[:12])
        # a shard lineage's replica moves with its host (the replicas of the ranks of one node)
        ray.kill(getattr(handle, "host", handle), no_restart=False)
        self.replica = _Replica(r.generation, r.step, r.node, False, "moving off a draining node")

    def drain_progress(self) -> bool:
        """Account for every open drain (each poll of the drain watch while one is open): which of the steps the
        draining node holds (not durable) are durable, held on a node that stays, or neither; the record on
        storage is rewritten when that changes. Once the node is gone, what only a surviving node holds is
        written to storage (:meth:`_heal`) and the record closes when nothing is left to make durable (or after
        a minute). Returns whether a drain is still open."""
        if not any(not rec.get("settled") or rec.get("unwritten") for rec in self.drains.values()):
            return False
        alive = self._alive_nodes()
        if any(n not in alive for n, rec in self.drains.items() if not rec.get("settled")):
            self._forget_dead_nodes()   # the drained node is gone: survivors persist what they hold of it
        durable_lin = self._lineage(True)
        staying = {n for n in alive if n not in self._draining}
        safe_lin = Lineage([e.manifest for e in self.entries.values()
                            if e.durable or any(n in staying for n in e.holders)])
        open_any = False
        for node, rec in self.drains.items():
            if rec.get("settled"):
                if rec.get("unwritten"):
                    self._write_drain(rec)
                    open_any = open_any or bool(rec.get("unwritten"))
                continue
            gen = rec["generation"]
            # what it holds, and (once it is gone, the last reports before that included) what it received
            since = rec.get("durable_before", float("inf"))   # (a record of an older coordinator: none)
            held = _union([], [(e.manifest.first_step, e.manifest.last_step) for e in self.entries.values()
                               if (node in e.holders or e.origin == node) and e.manifest.generation == gen
                               and (not e.durable or e.manifest.first_step > since)])
            held = _union(rec["held"], held)
            floor = self._durable_floor(gen)   # durable_diffs="fulls": a durable full covers the steps before it
            if floor is not None:
                held = range_difference(held, [(0, floor)])
            durable = _intersect(held, durable_lin.reachable_ranges(gen))
            rest = range_difference(held, durable)
            peer = _intersect(rest, safe_lin.reachable_ranges(gen))
            unsafe = range_difference(rest, peer)
            before = {k: rec[k] for k in ("held", "durable", "peer", "unsafe", "status")}
            rec.update(held=[list(r) for r in held], durable=[list(r) for r in durable],
                       peer=[list(r) for r in peer], unsafe=[list(r) for r in unsafe])
            if node in alive:
                rec["status"] = "safe" if not unsafe else "draining"
            else:
                if rec["status"] != "node gone":
                    rec["gone_ms"] = int(time.time() * 1000)
                    (log.warning if unsafe else log.info)(
                        "ray_ckpt coordinator: run %r: %s", self.run, drain_records.describe({**rec,
                                                                                              "status": "node gone"}))
                rec["status"] = "node gone"
                if not peer or time.time() * 1000 - rec["gone_ms"] > 60_000:
                    rec["settled"] = True
            changed = before != {k: rec[k] for k in before}
            if before["status"] != "safe" and rec["status"] == "safe":
                log.info("ray_ckpt coordinator: run %r: %s", self.run, drain_records.describe(rec))
            if changed or rec.get("unwritten"):
                self._write_drain(rec)
            open_any = open_any or not rec.get("settled")
        return open_any

    def _write_drain(self, rec: dict) -> None:
        """The drain record on storage (a failed write is retried at the next poll)."""
        rec["updated_ms"] = int(time.time() * 1000)
        try:
            drain_records.write_record(self.storage, {k: v for k, v in rec.items() if k != "unwritten"})
            rec.pop("unwritten", None)
        except Exception as e:  # noqa: BLE001 - storage outage: the record is written when it is back
            rec["unwritten"] = True
            log.info("ray_ckpt coordinator: drain record not written yet: %s", e)

    def drain_status(self) -> dict:
        """``{node: record}`` of the drains this coordinator saw (what ``drains/`` on storage says)."""
        return {n: {k: v for k, v in rec.items() if k != "unwritten"} for n, rec in self.drains.items()}

    # -- API for training processes and the driver ----------------------------------------------------------------
    def new_generation(self) -> int:
        self._last_generation += 1
        return self._last_generation

    def set_storage(self, storage) -> None:
        """Adopt the storage named by the driver-side callback (same root: a no-op after a restart)."""
        if storage.describe() != self.storage.describe():
            raise ValueError(f"run {self.run!r} already checkpoints to {self.storage.describe()}, "
                             f"not {storage.describe()}: use another run name")
        self.storage = storage

    def storage_uri(self) -> str:
        """The run's storage as ``describe()``: a URI with its connection options and never its credentials
        (no actor method hands out a backend: callers open the URI with their own credentials)."""
        return self.storage.describe()

    def get_config(self) -> CheckpointConfig:
        """The run's config (:attr:`config`); its :attr:`~ray_ckpt.CheckpointConfig.explicit` fields are what
        :func:`ray_ckpt.train.attach` resolves the workers' configs over."""
        return self.config

    def adopt_config(self, given: dict) -> None:
        """An attaching trainer's explicit fields (its ``config.explicit``) win over the run's: ``keep_fulls`` and
        ``max_replica_lag`` apply from now on; the adaptive policy keeps the knobs it was created with (its
        history is built on them). :meth:`status` shows the result under ``config``."""
        self.config = self.config.with_given(given)
        self.keep_fulls, self.max_replica_lag = self.config.keep_fulls, self.config.max_replica_lag

    def get_policy(self) -> FixedFrequencyPolicy:
        """The frequency policy for a (re)attaching Checkpointer: the adaptive policy's choice in force."""
        return FixedFrequencyPolicy(*self.tuner.current())

    def _decide(self, publish: bool = False) -> None:
        """The adaptive policy: re-optimize when due; publish the report to storage when the decision changed (or
        ``publish``: a failure was recorded)."""
        before = len(self.tuner.history)
        now = time.time()
        self.tuner.decide(now)
        if publish or len(self.tuner.history) != before:
            log.info("ray_ckpt coordinator: policy -> full_every=%d batch_steps=%d: %s",
                     *self.tuner.current(), self.tuner.choice.reason)
            _adaptive.publish_report(self.storage, self.tuner.report(now))

    def policy_report(self) -> dict:
        """What the adaptive policy decides, from which estimates, and why."""
        self._decide()
        return self.tuner.report(time.time())

    def record_failure(self, info: dict) -> None:
        """A worker-group failure (from the Ray Train callback): input for adaptive policies."""
        self.failures.append({"time": time.time(), **info})
        self._down.append([self.failures[-1]["time"], None])
        self.tuner.observe_failure(self.failures[-1]["time"])
        self._decide(publish=True)
        self._changes += 1

    def record_event(self, info: dict) -> None:
        """Other run events (resizes...), kept for status and policies."""
        self.events.append({"time": time.time(), **info})

    def plan(self, step: int | None = None, at_or_before: bool = False) -> dict:
        """The recovery plan for ``step`` (None = latest recoverable; ``at_or_before``: the newest recoverable step
        at or before ``step``): the manifests to read, in order, and for each the object references of live
        holders (memory tier; empty = read from durable storage).

        The chain starts from the newest full that reaches the step; a chain held wholly in memory is preferred
        among equally short ones, and every held object is read from memory. When the
        state-tier replica is usable and its state lies in the plan's chain (at or after the full, at or before
        the step: the latest, or a step named explicitly, e.g. the one the ranks of a group agreed on),
        ``replica`` names the step whose state the replica can hand over: the restore then reads only the
        records after it (the client checks again that the snapshot it gets lies in that range)."""
        self._forget_dead_nodes()
        if at_or_before and step is not None:
            found = self._lineage().latest_at_or_before(step)
            if found is None:
                self._refresh_durable()
                found = self._lineage().latest_at_or_before(step)
            if found is None:
                return {"error": f"no step at or before {step} is recoverable on the current timeline"}
            step = found
        alive = self._alive_nodes()
        memory = Lineage([e.manifest for e in self.entries.values() if any(n in alive for n in e.holders)])
        try:
            mem_plan = memory.resolve(step)
        except NoCheckpointError:
            mem_plan = None
        try:
            p = self._lineage().resolve(step)
        except NoCheckpointError:
            self._refresh_durable()
            try:
                p = self._lineage().resolve(step)
            except NoCheckpointError as err:
                return {"error": str(err)}
        # a chain held wholly in memory is preferred when it starts from a full as new as the best chain's (no more
        # records to replay); a newer full that is only durable (the replica writes its fulls straight to storage)
        # wins over a longer memory chain: one read of a full costs less than replaying the steps between them.
        # Objects of the chosen plan that are held are read from memory either way.
        if (mem_plan is not None and mem_plan.step == p.step and mem_plan.generation == p.generation
                and mem_plan.full.last_step >= p.full.last_step):
            p = mem_plan
        refs = self._plan_refs([self.entries[m.name] for m in p.objects], alive)
        sources = []
        for m in p.objects:
            e = self.entries[m.name]
            sources.append({"manifest": m.to_json(), "durable": e.durable, "refs": refs.get(m.name, [])})
        out = {"step": p.step, "generation": p.generation, "objects": sources}
        if self.replica is None:
            self._ask_replica()
        r = self.replica
        if self._replica_usable(p.generation) and p.full.last_step <= r.step <= p.step:
            out["replica"] = {"step": r.step, "node": r.node}
        return out

    def _plan_refs(self, entries: list, alive: set[str]) -> dict:
        """``{name: [ObjectRef, ...]}``: for each of ``entries`` one reference per live holder. ``held`` reports
        carry none (a reference in every report cost this actor Ray's borrower bookkeeping per message, plans are
        rare): the holders are asked, one call per node (:meth:`holder_refs`); a reference that came with the
        entry (a rebuild's inventory, a ``persist`` announcement) is used as it is."""
        out: dict[str, list] = {}
        ask: dict[str, list[str]] = {}
        for e in entries:
            name = e.manifest.name
            for node, refs in e.holders.items():
                if node not in alive:
                    continue
                if refs and refs[0] is not None:
                    out.setdefault(name, []).append(refs[0])
                else:
                    ask.setdefault(node, []).append(name)
        got = self.holder_refs(ask) if ask else {}
        for node, names in ask.items():
            answer = got.get(node) or {}
            for name in names:
                out.setdefault(name, []).extend(answer.get(name, [])[:1])
        # an object held only in memory whose holders did not answer in time (a loaded node): ask those again,
        # longer — storage has no copy of it to fall back to
        late = {node: [n for n in names if n not in out or not out[n]]
                for node, names in ask.items() if node not in got}
        late = {node: names for node, names in late.items()
                if any(not self.entries[n].durable for n in names)}
        if late:
            for node, answer in self.holder_refs(late, timeout=PLAN_REFS_PATIENCE_S).items():
                for name, refs in answer.items():
                    out.setdefault(name, []).extend(refs[:1])
        return out

    def holder_refs(self, ask: dict, timeout: float = PLAN_REFS_TIMEOUT_S) -> dict:
        """``{node: {name: [ObjectRef]}}`` of the objects ``ask`` names per node, from the run's persistence
        workers there (all asked at once); a worker that does not answer within ``timeout`` gives none (its
        objects are read from another holder or from storage). Coordinator actor; the scale benchmark's
        subclass answers for its simulated nodes."""
        calls = {node: w.holder_refs.remote(ask[node]) for node, w in self._worker_handles(ask).items()}
        out = {}
        if calls:
            ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout)
        for node, ref in calls.items():
            try:
                out[node] = ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - restarting, gone or slow: no memory copy from it
                log.info("ray_ckpt coordinator: node %s gave no object references for a plan: %s", node[:12], e)
        return out

    def status(self, max_age: float = 0.0) -> dict:
        """The lineage's figures. ``max_age``: how old the view of alive nodes and of the lineage may be (0: fresh;
        the periodic metrics pass 1 s and may get an older view of a long run, see :meth:`_lineage`);
        ``view_age_s`` says how old it is."""
        anywhere, durable = self._lineage(False, max_age), self._lineage(True, max_age)
        view_age = time.monotonic() - min(self._views[False][0], self._views[True][0])
        heads = {"recoverable_step": anywhere.head(), "durable_step": durable.head()}
        r = self.replica
        return {**heads, "objects": len(self.entries), "gaps": list(self.gap_watch.gaps),
                "replica": None if r is None else {"generation": r.generation, "step": r.step, "node": r.node,
                                                   "ok": r.ok, "reason": r.reason,
                                                   "lag": (heads["recoverable_step"] or 0) - r.step},
                "memory_objects": self._view_counts[0], "replicated_objects": self._view_counts[1],
                "generation": self._last_generation, "failures": len(self.failures),
                "restorable": self._restorable(durable, anywhere), "started_at": self.started_at,
                "lease_lost": self.lease_lost, "view_age_s": round(view_age, 3), "config": self.config.as_dict()}

    def restorable(self, max_age: float = 0.0) -> dict:
        """Which steps of the current generation restore from which tier: ``{"durable": ranges (storage alone),
        "memory": ranges (only while the memory tier holds them)}``, ranges as ``[[first, last], ...]``."""
        return self._restorable(self._lineage(True, max_age), self._lineage(max_age=max_age))

    def _restorable(self, durable_lineage: Lineage, lineage: Lineage) -> dict:
        gen = self._last_generation
        durable = durable_lineage.reachable_ranges(gen)
        return {"generation": gen, "durable": [list(r) for r in durable],
                "memory": [list(r) for r in range_difference(lineage.reachable_ranges(gen), durable)]}

    def unpersisted(self) -> dict:
        """``{node_id: [names]}``: objects not yet durable, by a live holder (to promote after a node loss)."""
        alive = self._alive_nodes()
        out: dict[str, list[str]] = {}
        for name, e in self.entries.items():
            if not e.durable:
                live = sorted(n for n in e.holders if n in alive)
                if live:
                    out.setdefault(live[0], []).append(name)
        return out

    def gc(self, keep_fulls: int = 2) -> list[str]:
        """Delete chains older than the ``keep_fulls`` newest full checkpoints of the current timeline, from
        storage and from the memory tier. Returns the deleted object names."""
        lin = self._lineage(durable_only=True)  # only durable fulls count as kept
        cutoff = gc_cutoff(lin, keep_fulls)
        if cutoff is not None:
            self._gc_floor = (cutoff.generation, cutoff.last_step)
        doomed = [e for e in self.entries.values() if collectable(lin, e.manifest, cutoff)]
        if not doomed:
            return []
        # what is removed, before it goes (a restore of those steps says retention removed them)
        retention.note(self.storage, keep_fulls, cutoff, [e.manifest for e in doomed])
        deleted = []
        for e in doomed:
            m = e.manifest
            if e.durable:
                self.storage.delete(m.key)      # manifest first: the object is uncommitted from here on
                self.storage.delete(m.object)
            for node in list(e.holders):
                try:
                    lineages.worker(self.run, node).release.remote([m.name])
                except ValueError:
                    pass
            del self.entries[m.name]
            deleted.append(m.name)
        try:  # the ranks' loop-state lineages (ranks/<r>/) and the Amber tier (tiers/amber/) by the same rule
            # imported here: they bring torch, which this actor needs for nothing else (a faster, leaner start)
            from ray_ckpt.engine import amber_tier
            from ray_ckpt.engine import gc as _gc
            _gc.collect_ranks(self.storage, lin, cutoff)
            amber_tier.collect(self.storage, lin, cutoff)
        except Exception as e:  # noqa: BLE001 - retried at the next full
            log.warning("ray_ckpt coordinator: could not collect per-rank loop state or the Amber tier: %s", e)
        return deleted


_remote_cls = None


def _union(a: list, b: list) -> list[tuple[int, int]]:
    """The union of two lists of step ranges, as sorted disjoint ranges."""
    out: list[tuple[int, int]] = []
    for x, y in sorted([tuple(r) for r in a] + [tuple(r) for r in b]):
        if out and x <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def _intersect(a: list, b: list) -> list[tuple[int, int]]:
    """The steps in both ``a`` and ``b`` (lists of ranges)."""
    return range_difference(_union(a, []), range_difference(_union(a, []), _union(b, [])))


def _head_node_affinity():
    """Options preferring the head node (soft): it lives as long as the cluster, so losing a worker node (the usual failure)
    does not also restart the coordinator and drop what it knows only in memory (holders, the replica's
    progress). Falls back to Ray's default placement when the head is unknown or full."""
    for n in ray.nodes():
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
            return prefer_node(n["NodeID"])
    return {}


class CoordinatorHost(lineages.LineageHost):
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
        rec = read_lease(c.storage) if c.lease.enabled else {"run": run}
        if rec is None or rec.get("run") != run:
            c.lease_lost = f"not renewed: the lease of {c.storage.describe()} is not run {run!r}'s"
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
                self._reporting = (now, sum(len(c._reporters) for c in self._each()))
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
        if c.storage.describe() != storage_uri:
            raise ValueError(f"shard run {run!r} checkpoints to {c.storage.describe()}, not {storage_uri}: "
                             f"use another run name")
        if c.lease_lost is not None and (read_lease(c.storage) or {}).get("run") == run:
            c.lease_lost = None

    _tick = Coordinator._tick

    def publish_metrics(self) -> None:
        for c in self._each():
            c.publish_metrics()

    def renew_lease(self) -> None:
        for c in self._each():
            c.renew_lease()

    def release_lease(self) -> None:
        """Delete every lineage's lease (end of the job)."""
        for c in self._each():
            c.release_lease()

    def drains_changed(self, drains: dict) -> None:
        for c in self._each():
            c.drains_changed(drains)

    def drain_progress(self) -> bool:
        return any([c.drain_progress() for c in self._each()])

    def worker_host_started(self, node_id: str) -> None:
        """The job's worker host on ``node_id`` restarted: it holds nothing for any lineage (as a restarted
        worker of a run tells its coordinator)."""
        for c in self._each():
            c.worker_started(node_id)


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
