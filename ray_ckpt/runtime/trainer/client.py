"""Training-process helpers of the Ray runtime: attach a Checkpointer's sink, restore through the coordinator.

Both run in the process that trains (a Ray Train worker, or any process connected to Ray).
"""
from __future__ import annotations

import logging
import threading
import time

import ray

from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.restore import LoadedChain
from ray_ckpt.lineage import NoCheckpointError
from ray_ckpt.runtime import lineages, naming
from ray_ckpt.runtime.coordinator import get_or_create_coordinator
from ray_ckpt.runtime.peer_ring import ring_after
from ray_ckpt.runtime.plan_reader import load_plan
from ray_ckpt.runtime.replica import get_or_create_replica
from ray_ckpt.runtime.trainer.sink import RaySink
from ray_ckpt.runtime.worker import OBJECT_STORE_SHARE, get_or_create_worker, object_store_capacity

log = logging.getLogger("ray_ckpt")


class PhaseClock:
    """Seconds spent in the named phases of a start-up, in order (``mark(name)`` ends the phase running since the
    previous mark). Any thread; no Ray."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> float:
        now = time.perf_counter()
        took = now - self._t
        self.phases[name] = self.phases.get(name, 0.0) + took
        self._t = now
        return took


def _require_ray() -> None:
    if not ray.is_initialized():
        raise RuntimeError("runtime='ray' needs a connected Ray (call ray.init(...) first, or run inside a Ray "
                           "task, actor or Ray Train worker)")


def run_name(storage, run: str | None) -> str:
    return run or naming.default_run_name(storage.describe())


def shard_lineage_run(root, run: str | None, world: int, rank: int) -> str:
    """The shard run of rank ``rank`` of ``world`` of the sharded job at storage root ``root`` (named ``run``,
    or after the root): what its Checkpointer attaches to and restores read through (the job's hosts,
    :mod:`ray_ckpt.runtime.lineages`). Any process."""
    from ray_ckpt.engine.shard_layout import shard_run
    return shard_run(run_name(root, run), world, rank)


def attach_sink(storage, impl, *, run: str | None, config, info: dict, takeover: bool = False):
    """``(run, generation, policy, sink)`` for a Checkpointer attaching with runtime='ray'. With
    ``config.replica`` and a LowDiff strategy, the run's state-tier replica is created (on the next node in
    ring order, this one on a one-node cluster) before the attach full is handed over, so it starts from it.
    The fields ``config`` gives explicitly become the run's (:meth:`~ray_ckpt.runtime.coordinator.Coordinator.run_config`). Training
    process."""
    _require_ray()
    clock = PhaseClock()
    run = run_name(storage, run)
    coord = get_or_create_coordinator(run, storage, config=config, takeover=takeover)
    # this trainer's explicit knobs (keep_fulls, ...) win over those the run's coordinator was created with
    generation, policy, _ = ray.get([coord.new_generation.remote(), coord.get_policy.remote(),
                                     coord.run_config.remote(config.explicit)])
    clock.mark("coordinator")
    # this node's persistence worker starts now, its process in parallel with the replica's (RaySink finds it
    # by name and waits for it); each actor start is a new process that imports its modules (seconds)
    start_node_worker(run, storage, config)
    replica = config.replica and impl.name == "lowdiff"
    if replica:
        _start_replica(run, storage, coord, generation, full_every=policy.full_every,
                       max_lag=config.max_replica_lag)
    clock.mark("replica")
    sink = RaySink(run, storage, impl, generation, config=config, info=info, replica=replica)
    clock.mark("node_worker")
    sink.startup = clock.phases
    return run, generation, policy, sink


#: replica actors that :func:`prestart` created in this process and no attach has placed yet (their placement is
#: still checked, as for a replica the attach creates itself)
_prestarted: set[str] = set()


def start_node_worker(run: str, storage, config):
    """This node's persistence worker of ``run``, created if missing, without waiting for its process to start;
    the ring peer's too (the worker the first chunk's copy goes to: created only then, its process start held the
    first copies, and so a ``flush``/``close`` of a short run, 1.8 s here). Training process."""
    me = ray.get_runtime_context().get_node_id()
    worker = get_or_create_worker(run, me, storage, config.memory_budget, config.write_timeout)
    peer = _ring_peer(me)
    if peer is not None:
        try:
            get_or_create_worker(run, peer, storage, config.memory_budget, config.write_timeout)
        except Exception as e:  # noqa: BLE001 - an optimization only: the worker creates its peer when it copies
            log.info("ray_ckpt: could not start the peer node's persistence worker ahead of the first copy (%s)", e)
    return worker


def prestart(run: str, storage, *, config, lowdiff: bool, full_every: int) -> None:
    """Start the actors an attach of ``run`` from this node will use (this node's persistence worker and, with
    ``config.replica`` and ``lowdiff``, the state-tier replica on the ring peer), without waiting for them: their
    processes start (seconds each: Python, Ray, torch) while the caller does other work, e.g. while the ranks
    of a Ray Train group agree on the step to restore. The attach then finds them by name; a replica started
    here is placed as if the attach had created it. Actors that exist are left as they are. Training process
    (world rank 0), connected to Ray."""
    _require_ray()
    start_node_worker(run, storage, config)
    if config.replica and lowdiff:
        _, created = get_or_create_replica(run, _replica_node(), storage, full_every=full_every,
                                           max_lag=config.max_replica_lag)
        if created:   # the name _place_replica looks for (a shard run's: the replica host of this node)
            _prestarted.add(lineages.replica_host_name(lineages.job_of(run), ray.get_runtime_context().get_node_id())
                            if lineages.is_shard_run(run) else naming.replica_name(run))


def _start_replica(run: str, storage, coord, generation: int, *, full_every: int, max_lag: int) -> None:
    """Find or create the run's replica (on the ring peer) so that the attach full reaches it, and check where
    it runs in a daemon thread (:func:`_place_replica`): its process takes seconds to start, which the attach
    does not wait for. One created here that landed on this node is placed again, and the coordinator asks the
    trainer for a full for the new one to start from. Training process (rank 0), at attach."""
    first = _get_replica(run, storage, full_every=full_every, max_lag=max_lag)

    def check() -> None:
        try:
            replica = _place_replica(run, storage, full_every=full_every, max_lag=max_lag, first=first)
            if replica is not first[0]:
                coord.request_full.remote(generation, "the state-tier replica was placed again")
        except Exception as e:  # noqa: BLE001 - the run goes on without its replica; restores read the lineage
            log.warning("ray_ckpt: could not check where the state-tier replica of run %r runs: %s", run, e)

    threading.Thread(target=check, name="ray_ckpt-replica-place", daemon=True).start()


def _get_replica(run: str, storage, *, full_every: int, max_lag: int):
    """``(handle, created)``: the run's replica, created on the ring peer if missing (or by :func:`prestart` for
    this attach, which counts as created: not yet placed). Training process."""
    replica, created = get_or_create_replica(run, _replica_node(), storage, full_every=full_every, max_lag=max_lag)
    me = ray.get_runtime_context().get_node_id()
    name = (lineages.replica_host_name(lineages.job_of(run), me) if lineages.is_shard_run(run)
            else naming.replica_name(run))
    if name in _prestarted:
        _prestarted.discard(name)
        created = True
    return replica, created


def _place_replica(run: str, storage, *, full_every: int, max_lag: int, attempts: int = 3, first=None):
    """The run's replica handle, on a peer node when one is alive (``first``: the ``(handle, created)`` of a
    lookup already made). Training process (rank 0): a daemon thread of the attach.

    Soft node affinity may put a new replica on this node even though the peer is alive (seen on a loaded
    2-core cluster right after nodes joined or left); a replica there dies with the trainer's node, so a replica
    this attach has just created is re-placed, up to ``attempts`` times, before a WARNING says where it stayed.
    An existing replica is never moved: it may hold the live state."""
    me = ray.get_runtime_context().get_node_id()
    shard = lineages.is_shard_run(run)
    name = lineages.replica_host_name(lineages.job_of(run), me) if shard else naming.replica_name(run)
    for attempt in range(attempts):
        replica, created = first if first is not None and attempt == 0 else _get_replica(
            run, storage, full_every=full_every, max_lag=max_lag)
        where = ray.get(replica.ping.remote())
        peers = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != me]
        if where != me or not peers:
            return replica
        # a shard run's replica host serves every rank of this node: re-placed only while it serves this one alone
        if shard and created:
            created = ray.get(replica.host.lineages.remote()) == [run]
        if not created or attempt == attempts - 1:
            break
        log.info("ray_ckpt: replica of run %r landed on the trainer's node %s instead of a peer; placing it "
                 "again", run, me[:8])
        ray.kill(getattr(replica, "host", replica), no_restart=True)
        _wait_name_free(name)
    log.warning("ray_ckpt: the state-tier replica of run %r runs on the trainer's node %s (its peer was "
                "unavailable when it was placed): losing this node loses the replica too; restores then "
                "use the durable chain", run, me[:8])
    return replica


def _wait_name_free(name: str, timeout: float = 10.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=naming.NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def _ring_peer(me: str) -> str | None:
    """The alive node after ``me`` in ring order by node id (None when alone): where the persistence worker of
    ``me`` sends its copies."""
    others = ring_after(me, [n["NodeID"] for n in ray.nodes() if n.get("Alive")])
    return others[0] if others else None


def _replica_node() -> str:
    """The node after this one in ring order (a peer that survives this node), or this node when alone."""
    me = ray.get_runtime_context().get_node_id()
    return _ring_peer(me) or me


def node_share(budget: int, ranks_on_node: int) -> int:
    """The memory budget of one of ``ranks_on_node`` shard runs whose workers share this node's object store
    (sharded FSDP2 state with runtime='ray'): ``budget`` capped to the share a worker may fill
    (:data:`~ray_ckpt.runtime.worker.OBJECT_STORE_SHARE`), divided among the ranks; at least 64 MiB. Training
    process, connected to Ray."""
    _require_ray()
    capacity = object_store_capacity(ray.get_runtime_context().get_node_id())
    if capacity:
        budget = min(budget, int(capacity * OBJECT_STORE_SHARE))
    return max(budget // max(1, ranks_on_node), 64 << 20)


def policy_report(storage, run: str | None = None, timeout: float = 30.0) -> dict | None:
    """The coordinator's adaptive-policy report (None without a coordinator). Training process / driver."""
    coord = coordinator(storage, run)
    return None if coord is None else ray.get(coord.policy_report.remote(), timeout=timeout)


def coordinator(storage, run: str | None = None):
    """The run's coordinator handle, or None when it does not exist."""
    try:
        return lineages.coordinator(run_name(storage, run))
    except ValueError:
        return None


def resolve_step(storage, step: int | None, *, run: str | None = None, timeout: float = 60.0,
                 use_coordinator: bool = True, at_or_before: bool = False) -> tuple[int, int]:
    """``(step, generation)`` a restore of ``step`` (None = latest recoverable; ``at_or_before``: the newest
    recoverable step at or before ``step``) reads, as the run's coordinator plans it (from storage alone when the
    run has no coordinator, or ``use_coordinator=False``). Raises NoCheckpointError. Any process."""
    coord = coordinator(storage, run) if use_coordinator and ray.is_initialized() else None
    if coord is None:
        lineage, _ = load_lineage(storage)
        if at_or_before and step is not None:
            found = lineage.latest_at_or_before(step)
            if found is None:
                raise NoCheckpointError(f"no step at or before {step} is recoverable on the current timeline")
            step = found
        plan = lineage.resolve(step)
        return plan.step, plan.generation
    plan = ray.get(coord.plan.remote(step, at_or_before), timeout=timeout)
    if "error" in plan:
        raise NoCheckpointError(plan["error"])
    return plan["step"], plan["generation"]


def load_via_coordinator(storage, step: int | None, *, run: str | None = None,
                         timeout: float = 60.0) -> tuple[LoadedChain, dict] | None:
    """Load the plan the coordinator gives, reading each object from a live holder's object store when one has
    it (memory tier), else from storage. Returns ``(chain, tiers)`` (``tiers["source"]``: where the state came
    from, see :func:`ray_ckpt.runtime.plan_reader.source`) or None when the run has no coordinator. Restoring
    process.

    The replica answers first: the plan is asked ``replica_first`` (the holders are asked for references only of
    the records after the replica's state, none when it is caught up); only when the replica cannot serve the
    step is the whole chain planned again, with every holder's references."""
    _require_ray()
    coord = coordinator(storage, run)
    if coord is None:
        return None
    plan = _plan(coord, step, timeout, replica_first=True)
    snap = None
    if "replica" in plan:
        try:
            replica = lineages.replica(run_name(storage, run))
            snap = ray.get(replica.snapshot.remote(plan["generation"], plan["step"]), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the replica is gone: the chain is complete without it
            log.info("ray_ckpt: replica unavailable (%s); restoring from the chain", e)
            snap = None
    try:
        got = load_plan(storage, plan, timeout=timeout, snapshot=snap)
        if got is None:   # the replica did not serve it: the whole chain, with its holders' references
            log.info("ray_ckpt: the replica cannot serve step %d; planning the whole chain", plan["step"])
            got = load_plan(storage, _plan(coord, plan["step"], timeout), timeout=timeout)
        return got
    finally:
        release_prefetch()


def _plan(coord, step: int | None, timeout: float, replica_first: bool = False) -> dict:
    """The coordinator's plan for ``step`` (see :meth:`ray_ckpt.runtime.coordinator.Coordinator.plan`); raises
    :class:`NoCheckpointError` when there is none. Restoring process."""
    plan = ray.get(coord.plan.remote(step, replica_first=replica_first), timeout=timeout)
    if "error" in plan:
        raise NoCheckpointError(plan["error"])
    return plan


#: the replica snapshot pulled ahead of a restore in this process (:func:`prefetch_snapshot`), or None
_prefetched: dict | None = None
_prefetch_lock = threading.Lock()

#: a prefetched snapshot that no restore read is released after this many seconds
PREFETCH_HOLD_S = 120.0


def prefetch_snapshot(run: str, timeout: float = 60.0, hold_s: float = PREFETCH_HOLD_S) -> bool:
    """Pull the state-tier replica's snapshot of ``run``'s latest recoverable step into this node's object
    store ahead of a restore, from a thread of this process; returns at once (True when a pull was started).

    The replica answers every :meth:`~ray_ckpt.runtime.replica.ReplicaActor.snapshot` with the same object while
    its state does not change, so a restore that follows here (:func:`load_via_coordinator`, the same step)
    reads that object from this node's store instead of across nodes: the pull overlaps with whatever this
    process does first (a Ray Train worker builds and wraps its model). Nothing else changes: the restore still
    asks the coordinator and the replica, and checks the step as always; a snapshot of another step is simply
    not used. The object is held until that restore ends, or ``hold_s`` seconds. Best effort: a run without a
    coordinator, replica or checkpoint pulls nothing. Ray Train worker, before its train loop (called by
    :class:`~ray_ckpt.integrations.train_callback.RayCkptCallback` on each worker of a restarted group)."""
    global _prefetched
    if not ray.is_initialized():
        return False
    box = {"run": run, "released": threading.Event()}
    with _prefetch_lock:
        if _prefetched is not None:
            _prefetched["released"].set()
        _prefetched = box
    threading.Thread(target=_pull_snapshot, args=(box, timeout, hold_s), daemon=True,
                     name="ray_ckpt-prefetch").start()
    return True


def _pull_snapshot(box: dict, timeout: float, hold_s: float) -> None:
    """:func:`prefetch_snapshot`'s thread: plan, snapshot, pull; then hold the parts until released."""
    global _prefetched
    run = box["run"]
    try:
        coord = lineages.coordinator(run)
        plan = ray.get(coord.plan.remote(None, replica_first=True), timeout=timeout)
        if "error" in plan or "replica" not in plan or box["released"].is_set():
            return
        snap = ray.get(lineages.replica(run).snapshot.remote(plan["generation"], plan["step"]), timeout=timeout)
        if snap is None or box["released"].is_set():
            return
        t0 = time.perf_counter()
        box["parts"] = ray.get(snap["ref"], timeout=timeout)   # the local copy stays while this holds it
        log.info("ray_ckpt: pulled the replica's snapshot of step %d of run %r (%.1f MB) in %.2f s ahead of the "
                 "restore", snap["step"], run, snap["nbytes"] / 1e6, time.perf_counter() - t0)
        box["released"].wait(hold_s)
    except Exception as e:  # noqa: BLE001 - an optimization only: the restore reads as it always does
        log.info("ray_ckpt: no snapshot pulled ahead of the restore of run %r (%s)", run, e)
    finally:
        box.pop("parts", None)
        with _prefetch_lock:
            if _prefetched is box:
                _prefetched = None


def release_prefetch() -> None:
    """Let go of the snapshot :func:`prefetch_snapshot` pulled into this process (if any): a restore read it, or
    needs it no more. Any thread."""
    with _prefetch_lock:
        box = _prefetched
    if box is not None:
        box["released"].set()
        box.pop("parts", None)


def record_restore(storage, run: str | None, seconds: float) -> None:
    """A finished restore of the run as Ray metrics (restoring process; nothing without Ray)."""
    if not ray.is_initialized():
        return
    from ray_ckpt.runtime import metrics as _metrics
    tags = {"run": run_name(storage, run)}
    _metrics.add("ray_ckpt_restores", 1, tags)
    _metrics.observe("ray_ckpt_restore_seconds", [seconds], tags)


class ShardedMemoryTier:
    """``runtime="ray"`` restores of sharded (FSDP2) state: every shard lineage is a shard run of its job (its
    lineage of the job's coordinator, node workers and replicas; :mod:`ray_ckpt.runtime.lineages`), so the steps
    a restore may take are those every shard run's coordinator plans (newer than storage while diffs are held in
    memory), and
    each shard's chain is loaded as :func:`load_via_coordinator` loads it (from its replica's state: nothing to
    replay). Shards without a live coordinator are read from storage. Training process of each rank.
    ``tiers`` counts what the loads used."""

    def __init__(self, run: str | None, timeout: float = 60.0):
        _require_ray()
        self.run = run
        self.timeout = timeout
        self.tiers = {"memory": 0, "durable": 0, "replica": 0, "replayed": 0}

    def _coordinators(self, storage, world: int) -> list | None:
        from ray_ckpt.engine.shard_layout import shard_storage
        out = []
        for rank in range(world):
            c = coordinator(shard_storage(storage, world, rank), shard_lineage_run(storage, self.run, world, rank))
            if c is None:
                return None
            out.append(c)
        return out

    def _planned(self, storage, world: int, step: int | None) -> int | None:
        """The newest step (``step`` itself when given) that every shard run of ``world`` plans, or None."""
        coords = self._coordinators(storage, world)
        if coords is None:
            return None
        try:
            plans = ray.get([c.plan.remote(step) for c in coords], timeout=self.timeout)
            if any("error" in p for p in plans):
                return None
            agreed = min(p["step"] for p in plans)
            if step is None and any(p["step"] != agreed for p in plans):   # every shard must reach the slowest's
                plans = ray.get([c.plan.remote(agreed) for c in coords], timeout=self.timeout)
                if any("error" in p or p["step"] != agreed for p in plans):
                    return None
        except (ray.exceptions.RayError, TimeoutError) as e:   # a shard run's coordinator died with its node
            log.info("ray_ckpt: the shard runs of world %d cannot plan (%s); using storage", world, e)
            return None
        return agreed

    def choose(self, storage, step: int | None, *, fallback: bool = False) -> tuple[int, list[int]]:
        """:func:`~ray_ckpt.engine.shard_chains.choose_world` with the shard runs' memory tier: a newer step that every
        shard's coordinator plans wins over what storage holds; the storage steps stay as fallbacks."""
        from ray_ckpt.engine.shard_chains import choose_world
        from ray_ckpt.engine.shard_layout import saved_worlds
        try:
            world, steps = choose_world(storage, step, strict=not fallback, at_most=fallback)
        except NoCheckpointError:
            world, steps = None, []
        best = None
        for w in saved_worlds(storage):
            s = self._planned(storage, w, step)
            if s is not None and (best is None or s > best[1]):
                best = (w, s)
        if best is not None and (not steps or best[1] >= steps[0]):
            w, s = best
            return w, [s] + [x for x in steps if x < s and w == world]
        if world is None:
            what = "any step" if step is None else f"step {step}"
            raise NoCheckpointError(f"no sharded checkpoint under {storage.describe()} holds {what} on every rank, "
                                    f"in storage or in the memory tier of its shard runs")
        return world, steps

    def load(self, storage, world: int, rank: int, step: int) -> LoadedChain:
        """Shard ``rank`` of ``world`` at ``step``: through its run's coordinator (memory tier, replica), else
        from storage."""
        from ray_ckpt.engine.shard_chains import load_shard
        from ray_ckpt.engine.shard_layout import shard_storage
        try:
            got = load_via_coordinator(shard_storage(storage, world, rank), step,
                                       run=shard_lineage_run(storage, self.run, world, rank), timeout=self.timeout)
        except NoCheckpointError:
            got = None
        except (ray.exceptions.RayError, TimeoutError) as e:   # its coordinator is gone: storage has the chain
            log.info("ray_ckpt: shard %d of world %d: no plan from its run (%s); reading storage", rank, world, e)
            got = None
        if got is None:
            return load_shard(storage, world, rank, step)
        chain, tiers = got
        for k in self.tiers:
            self.tiers[k] += tiers.get(k, 0)
        return chain
