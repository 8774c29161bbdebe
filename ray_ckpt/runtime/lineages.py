"""One set of Ray actors per job for sharded state: the job's shard lineages share them.

Sharded (FSDP2) state checkpoints one lineage per rank (:mod:`ray_ckpt.engine.sharded`); with ``runtime="ray"``
each lineage is a *shard run* named ``<job>:shard-w<world>-r<rank>`` (:func:`ray_ckpt.engine.shard_layout.shard_run`).
A shard run has no actors of its own. Its job's actors host it, one of each per job or per node:

* one **coordinator host** per job (``ray_ckpt:<job>:shards:coordinator``) holds one
  :class:`~ray_ckpt.runtime.coordinator.Coordinator` per shard lineage (memory tier, gaps, GC, policy, drains
  per lineage, as for an unsharded run);
* one **worker host** per node (``ray_ckpt:<job>:shards:worker:<node>``) holds one
  :class:`~ray_ckpt.runtime.worker.PersistenceWorker` per lineage that this node's ranks write or whose chunks
  it replicates for a peer;
* one **replica host** per node that runs ranks (``ray_ckpt:<job>:shards:replica:<node>``, placed on that node's
  ring peer) holds the state-tier :class:`~ray_ckpt.runtime.replica.ReplicaActor` of each of those ranks.

So a job of ``R`` ranks on ``N`` nodes has at most ``1 + 2 N`` such actors, not ``3 R``. Every lineage keeps its
own state, its own lease and its own storage prefix: a host only routes a call to the lineage it names
(:meth:`LineageHost.lineage_call`). A handle to one hosted lineage (:class:`LineageHandle`) is called as the
actor of an unsharded run is (``handle.plan.remote(step)``), so the code that drives a run does not change.

A host that restarts (``max_restarts=-1``) has lost its lineages' in-memory state, as a restarted per-run actor
had: each lineage is opened again, from its name alone (the job's storage root and the shard prefix the name
encodes), at the first call that may open it, and rebuilds itself as a restarted actor of an unsharded run
does (the coordinator from storage and the workers' inventories, a replica from the lineage).

Unsharded runs keep one actor of each kind per run, named as before (:mod:`ray_ckpt.runtime.naming`).
Everything here runs in any process connected to Ray; the host mixin runs in its actor.
"""
from __future__ import annotations

import re
import threading

import ray

from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage.layout import SHARD_RUN_TAG, SHARDS_DIR
from ray_ckpt.runtime import naming

_SHARD_RE = re.compile(r"^w(\d{5})-r(\d{5})$")


class UnknownLineage(RayCkptError, ValueError):
    """A host was asked about a lineage it does not hold (raised in the host; a caller sees a RayTaskError that
    is also a ValueError, as for an actor that does not exist)."""


def is_shard_run(run: str) -> bool:
    """Whether ``run`` names a shard lineage (``<job>:shard-w<world>-r<rank>``)."""
    return SHARD_RUN_TAG in run


def job_of(run: str) -> str:
    """The job of a shard run (the part before ``:shard-``); an unsharded run is its own job."""
    return run.split(SHARD_RUN_TAG, 1)[0]


def shard_of(run: str) -> tuple[int, int]:
    """``(world, rank)`` of a shard run's name. Raises ValueError for another name."""
    m = _SHARD_RE.match(run.split(SHARD_RUN_TAG, 1)[1]) if is_shard_run(run) else None
    if m is None:
        raise ValueError(f"{run!r} is not the name of a shard run (<job>{SHARD_RUN_TAG}w<world>-r<rank>)")
    return int(m.group(1)), int(m.group(2))


def shard_prefix(run: str) -> str:
    """The storage prefix of a shard run's lineage below its job's root (as
    :func:`ray_ckpt.engine.shard_layout.shard_prefix`, which the tests compare with this)."""
    world, rank = shard_of(run)
    return f"{SHARDS_DIR}w{world:05d}/r{rank:05d}/"


def root_storage(storage, run: str):
    """The job's storage root, given the storage of its shard lineage ``run`` (a view below the root)."""
    prefix = shard_prefix(run)
    if getattr(storage, "prefix", None) != prefix or getattr(storage, "base", None) is None:
        raise ValueError(f"the storage of shard run {run!r} must be its view {prefix!r} of the job's root, got "
                         f"{storage.describe() if hasattr(storage, 'describe') else storage!r}")
    return storage.base


def lineage_storage(root, run: str):
    """The storage of lineage ``run`` of a job whose root is ``root``."""
    from ray_ckpt.storage.prefixed import PrefixedStorage
    return PrefixedStorage(root, shard_prefix(run))


# -- names of the hosts ------------------------------------------------------------------------------------------
def _hosts_run(job: str) -> str:
    """The hosts of a job are named as the actors of a run called ``<job>:shards`` (:mod:`naming`)."""
    return f"{job}:shards"


def coordinator_host_name(job: str) -> str:
    return naming.coordinator_name(_hosts_run(job))


def worker_host_prefix(job: str) -> str:
    return naming.worker_prefix(_hosts_run(job))


def worker_host_name(job: str, node_id: str) -> str:
    return naming.worker_name(_hosts_run(job), node_id)


def replica_host_prefix(job: str) -> str:
    return naming.replica_name(_hosts_run(job)) + ":"


def replica_host_name(job: str, trainer_node: str) -> str:
    """The replica host serving the ranks of ``trainer_node`` (it runs on that node's ring peer)."""
    return replica_host_prefix(job) + trainer_node


def host_names(job: str, actor_names) -> list[str]:
    """The hosts of ``job`` among ``actor_names`` (e.g. from ``ray.util.list_named_actors``), sorted."""
    head = naming.actor_prefix(_hosts_run(job))
    return sorted(n for n in actor_names if n.startswith(head))


def _named(prefix: str) -> list[str]:
    out = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info["name"] if isinstance(info, dict) else info
        if name.startswith(prefix):
            out.append(name)
    return out


# -- handles -----------------------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("_method", "_run", "_name")

    def __init__(self, method, run: str, name: str):
        self._method, self._run, self._name = method, run, name

    def remote(self, *args, **kwargs):
        return self._method.remote(self._run, self._name, args, kwargs)

    def options(self, **opts) -> "_Call":
        return _Call(self._method.options(**opts), self._run, self._name)


class LineageHandle:
    """One lineage of a host actor, called as an actor is: ``handle.method.remote(*args)`` runs
    ``method(*args)`` of that lineage in the host. Picklable (an actor handle and a name)."""

    __slots__ = ("host", "run")

    def __init__(self, host, run: str):
        self.host, self.run = host, run

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Call(self.host.lineage_call, self.run, name)

    def __getstate__(self):
        return (self.host, self.run)

    def __setstate__(self, state):
        self.host, self.run = state

    def __eq__(self, other) -> bool:
        return isinstance(other, LineageHandle) and other.run == self.run and other.host == self.host

    def __hash__(self) -> int:
        return hash(self.run)

    def __repr__(self) -> str:
        return f"LineageHandle({self.run!r})"


def _actor(name: str):
    return ray.get_actor(name, namespace=naming.NAMESPACE)


def coordinator(run: str):
    """The coordinator of ``run`` (its actor, or its lineage of the job's coordinator host). Raises ValueError
    when there is none."""
    if not is_shard_run(run):
        return _actor(naming.coordinator_name(run))
    return LineageHandle(_actor(coordinator_host_name(job_of(run))), run)


def worker(run: str, node_id: str):
    """The persistence worker of ``run`` on ``node_id`` (its actor, or its lineage of the job's worker host
    there; the host opens the lineage at the first call that may open it). Raises ValueError when there is
    none."""
    if not is_shard_run(run):
        return _actor(naming.worker_name(run, node_id))
    return LineageHandle(_actor(worker_host_name(job_of(run), node_id)), run)


def worker_nodes(run: str) -> set[str]:
    """The nodes that have a persistence worker of ``run`` (for a shard run: a worker host of its job)."""
    prefix = worker_host_prefix(job_of(run)) if is_shard_run(run) else naming.worker_prefix(run)
    return {name[len(prefix):] for name in _named(prefix)}


def replica(run: str, trainer_node: str | None = None):
    """The state-tier replica of ``run`` (its actor, or its lineage of the job's replica host that holds it).
    Raises ValueError when there is none. For a shard run, ``trainer_node`` names the node of the rank that
    feeds it (its replica host opens the lineage at the first chunk); without it the job's replica hosts are
    asked which of them holds the lineage (one call each: callers cache the answer)."""
    if not is_shard_run(run):
        return _actor(naming.replica_name(run))
    if trainer_node is not None:
        return LineageHandle(_actor(replica_host_name(job_of(run), trainer_node)), run)
    for name in _named(replica_host_prefix(job_of(run))):
        try:
            host = _actor(name)
            if run in ray.get(host.lineages.remote(), timeout=30):
                return LineageHandle(host, run)
        except Exception:  # noqa: BLE001 - a host that is gone or restarting holds nothing to hand over
            continue
    raise ValueError(f"no replica of shard run {run!r}")


# -- the host side -----------------------------------------------------------------------------------------------
class LineageHost:
    """Mixin of a host actor: ``self._lineages`` maps each hosted lineage's run name to its instance, opened by
    :meth:`_open` (subclasses). A call that names a lineage the host does not hold opens it when the method is
    in ``OPENING`` (what a new or restarted lineage is first asked), answers ``ABSENT[method]()`` when the
    method has an answer for "nothing here" (e.g. an empty inventory), else raises :class:`UnknownLineage`.
    Host actor."""

    OPENING: frozenset = frozenset()
    ABSENT: dict = {}

    def _host_init(self, job: str) -> None:
        self.job = job
        self._lineages: dict[str, object] = {}
        self._open_lock = threading.Lock()

    def _open(self, run: str):   # pragma: no cover - every host overrides it
        raise NotImplementedError

    def _lineage(self, run: str, opening: bool):
        got = self._lineages.get(run)
        if got is not None or not opening:
            return got
        if job_of(run) != self.job:
            raise UnknownLineage(f"lineage {run!r} is not of job {self.job!r}")
        shard_of(run)   # a shard run's name, or ValueError
        with self._open_lock:
            got = self._lineages.get(run)
            if got is None:
                got = self._lineages[run] = self._open(run)
        return got

    def lineage_call(self, run: str, method: str, args: tuple = (), kwargs: dict | None = None):
        """``method(*args, **kwargs)`` of lineage ``run`` (see the class). Host actor."""
        target = self._lineage(run, method in self.OPENING)
        if target is None:
            if method in self.ABSENT:
                return self.ABSENT[method]()
            raise UnknownLineage(f"{type(self).__name__} of job {self.job!r} holds no lineage {run!r}")
        return getattr(target, method)(*args, **(kwargs or {}))

    def lineages(self) -> list[str]:
        """The run names of the lineages this host holds, sorted."""
        return sorted(self._lineages)

    def drop_lineage(self, run: str) -> bool:
        """Forget lineage ``run`` (its state is lost; returns whether it was held)."""
        with self._open_lock:
            return self._lineages.pop(run, None) is not None

    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()
