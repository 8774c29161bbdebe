"""Ray Train integration, controller side: ``RayCkptCallback`` in ``RunConfig(callbacks=[...])``.

Tested with Ray 2.60 (Train V2); ``pyproject.toml`` pins ``ray[train]>=2.60,<2.61`` because the callback uses
Ray Train's developer API ``ControllerCallback``. Hooks used, and where they run:

=========================================================  ====================================================
``ControllerCallback.after_controller_start``              controller actor: create the run's coordinator
``ControllerCallback.before_controller_execute_failure_decision``  controller: record the failure, persist the
                                                           replicas of objects whose node was lost (in a
                                                           thread: the controller's loop goes on)
``ControllerCallback.before_controller_execute_resize_decision``   controller: record the resize (elastic)
``WorkerGroupCallback.after_worker_group_start``            controller: after a restart onto a node without
                                                           the run's persistence worker, start it (in a
                                                           thread) while the train loop starts
``ControllerCallback.after_controller_finish``             controller: flush every persistence worker, then
                                                           (unless ``keep_runtime``) stop the run's actors
``ray.train.report`` (from ``attach``'s step hook)          every worker, every ``report_every`` steps: a tiny
                                                           *pointer* checkpoint naming the lineage head
                                                           (:mod:`ray_ckpt.integrations.train_session`)
=========================================================  ====================================================

Per-step state never goes through ``ray.train.report`` (it commits only at the controller's polls); it goes
through the Ray runtime (PersistenceWorker actors + coordinator).

Every failure or resize restarts the whole worker group; each new worker calls
:func:`~ray_ckpt.integrations.train_session.attach` again, which restores the latest recoverable step (from the
memory tier where possible) into the user's objects, on every rank (:mod:`ray_ckpt.integrations.agreement`), and
tells the loop where to resume (``session.start_step``).
"""
from __future__ import annotations

import json
import logging
import os
import threading

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from ray_ckpt import storage as _storage
from ray_ckpt.storage.s3_options import SECRET_OPTIONS
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.lineage import MANIFESTS_DIR
from ray_ckpt.lineage.layout import RUN_MARKER
from ray_ckpt.runtime import lineages
from ray_ckpt.runtime.trainer.client import prefetch_snapshot
from ray_ckpt.runtime.coordinator import get_or_create_coordinator, shard_runs, shutdown_run
from ray_ckpt.runtime.worker import get_or_create_worker

log = logging.getLogger("ray_ckpt")


class RayCkptCallback(ControllerCallback, WorkerGroupCallback):
    """Driver-side half of the integration: ``RunConfig(callbacks=[RayCkptCallback("s3://bucket/run")])``.

    Created on the driver, pickled to the Ray Train controller actor, where its hooks run (see the module
    docstring). ``storage_uri``/``storage_options`` name the lineage's storage; without ``storage_uri`` it is the
    run's own place, ``<RunConfig.storage_path>/<RunConfig.name>/ray_ckpt`` (:func:`default_location`). A lineage
    belongs to the run (name) that created it: a run with another name pointed at it is refused with an error,
    unless ``adopt=True`` (continue that lineage under this run's name, taking over its writer lease).
    ``keep_runtime=True`` leaves the coordinator and persistence workers alive after the run (to restore from their
    memory tier later).

    The knobs, as :class:`ray_ckpt.Checkpointer` takes them: ``config``, a :class:`~ray_ckpt.CheckpointConfig`, and
    keyword overrides of its fields (``full_every``, ``batch_steps``, ``keep_fulls``, ``mtbf_hint``, or any other),
    resolved on the driver by :meth:`CheckpointConfig.resolve` (default < ``RAY_CKPT_*`` environment < fields the
    config was built with < overrides; an unknown knob raises TypeError naming the closest). The run's coordinator
    is created with the result (the adaptive policy's knobs, retention, the replica's lag), and the fields given
    explicitly reach every worker: :func:`ray_ckpt.train.attach` resolves its own config over them (a worker's
    explicit config and overrides win).
    """

    def __init__(self, storage_uri: str | os.PathLike | None = None, *, storage_options: dict | None = None,
                 config: CheckpointConfig | None = None, keep_runtime: bool = False, run: str | None = None,
                 adopt: bool = False, **overrides):
        self.storage_uri = os.fspath(storage_uri) if storage_uri is not None else None
        self.storage_options = dict(storage_options or {})
        self.config = CheckpointConfig.resolve(config, **overrides)
        self.keep_runtime = keep_runtime
        self.run = run
        self.adopt = adopt
        if self.storage_uri is not None:  # fail fast on a bad URI, on the driver
            _storage.open_storage(self.storage_uri, **self.storage_options)
        given = sorted(k for k in self.storage_options if k in SECRET_OPTIONS and self.storage_options[k])
        if given:
            log.warning("ray_ckpt: RayCkptCallback got credentials (%s) in storage_options; they are not forwarded "
                        "to the training workers (no actor hands credentials out): pass the same storage_options "
                        "to ray_ckpt.train.attach(), or give the nodes credentials (AWS_* environment, profile, "
                        "instance role)", ", ".join(given))
        self.failures = 0

    # -- controller side ---------------------------------------------------------------------------------------
    def after_controller_start(self, train_run_context) -> None:
        run = self.run or train_run_context.run_config.name
        self.run = run
        if self.storage_uri is None:
            self.storage_uri = default_location(train_run_context.run_config)
        storage = _storage.open_storage(self.storage_uri, **self.storage_options)
        self._storage = storage
        claim_run(storage, run, adopt=self.adopt)
        coord = get_or_create_coordinator(run, storage, config=self.config, takeover=self.adopt)
        # an existing coordinator (a restarted driver of a run kept alive) takes this callback's explicit knobs too
        ray.get([coord.set_storage.remote(storage), coord.run_config.remote(self.config.explicit)])
        log.info("ray_ckpt: run %r checkpoints to %s", run, storage.describe())

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        self.failures += 1
        coord = self._coord()
        if coord is None:
            return
        try:
            coord.record_failure.remote({"decision": str(failure_decision), "failures": self.failures})
        except Exception as e:  # noqa: BLE001 - never break Ray Train's failure handling
            log.warning("ray_ckpt: could not record the failure: %s", e)
        # the writes take as long as the storage does (a storage outage: minutes): never in the controller's loop,
        # which must restart the group meanwhile (at a preemption's deadline, the group is ended only after this)
        threading.Thread(target=self._persist_orphans, args=(coord,), daemon=True,
                         name="ray_ckpt-persist-orphans").start()

    def _persist_orphans(self, coord) -> None:
        """Controller actor, a thread of its own: the objects only one node holds are written (see
        :func:`persist_orphans`), for the run and each shard run."""
        try:
            persist_orphans(self.run, coord)
            for shard in _shard_runs(self.run):   # FSDP2 with runtime="ray": each shard lineage's run
                shard_coord = lineages.coordinator(shard)
                persist_orphans(shard, shard_coord)
        except Exception as e:  # noqa: BLE001
            log.warning("ray_ckpt: could not persist the objects held by one node only after a failure: %s", e)

    def after_worker_group_start(self, worker_group) -> None:
        """Controller actor, once the worker group's actors are up (before the train loop runs): when the run's
        persistence workers are in use (a restart), start the one of world rank 0's node if that node has none — a
        replacement node after a node loss — from a thread, without waiting: its process (Python, Ray, torch:
        seconds) then starts while the workers build and wrap their model, instead of inside ``attach``. Each
        worker also starts pulling the replica's snapshot ahead of its restore (:meth:`_prefetch`)."""
        storage = getattr(self, "_storage", None)
        if self.run is None or storage is None:
            return
        try:
            node = next(w.metadata.node_id for w in worker_group.get_workers()
                        if w.distributed_context.world_rank == 0)
        except Exception as e:  # noqa: BLE001 - Ray Train's internals: an optimization only
            log.info("ray_ckpt: no world rank 0 in the new worker group (%s)", e)
            return
        threading.Thread(target=self._start_node_worker, args=(storage, node), daemon=True,
                         name="ray_ckpt-node-worker-start").start()
        threading.Thread(target=self._prefetch, args=(worker_group.get_workers(),), daemon=True,
                         name="ray_ckpt-prefetch-start").start()

    def _prefetch(self, workers: list) -> None:
        """Controller actor, a thread of its own: when the run has a state-tier replica (a restart), every worker
        starts pulling the replica's snapshot of the latest step into its node's object store
        (:func:`~ray_ckpt.runtime.trainer.client.prefetch_snapshot`), so that the restore in ``attach`` reads it locally.
        Not waited for; best effort."""
        try:
            lineages.replica(self.run)
        except Exception:  # noqa: BLE001 - no replica (a first start, a sharded run): nothing to pull
            return
        for w in workers:
            try:
                w.execute_async(prefetch_snapshot, self.run)
            except Exception as e:  # noqa: BLE001 - Ray Train's internals: an optimization only
                log.info("ray_ckpt: could not start a snapshot prefetch on a worker (%s)", e)
                return

    def _start_node_worker(self, storage, node: str) -> None:
        """Controller actor, a thread of its own: the run's persistence worker on ``node``, created (not waited
        for) when the run has workers elsewhere but none there. Best effort: ``attach`` creates it otherwise."""
        try:
            nodes = lineages.worker_nodes(self.run)
            if nodes and node not in nodes:
                get_or_create_worker(self.run, node, storage, self.config.memory_budget, self.config.write_timeout)
                log.info("ray_ckpt: starting the persistence worker of run %r on node %s for the new worker group",
                         self.run, node[:12])
        except Exception as e:  # noqa: BLE001
            log.info("ray_ckpt: could not start the persistence worker on node %s ahead of attach: %s", node[:12], e)

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        coord = self._coord()
        if coord is not None:
            coord.record_event.remote({"resize": getattr(resize_decision, "num_workers", None)})

    def after_controller_finish(self, result) -> None:
        if self.run is None:
            return
        runs = [self.run] + _shard_runs(self.run)   # FSDP2 with runtime="ray": a shard run per lineage too
        try:
            for run in runs:
                flush_run(run)
        finally:
            if not self.keep_runtime:
                for run in runs:
                    shutdown_run(run)

    def _coord(self):
        try:
            return lineages.coordinator(self.run)
        except (ValueError, TypeError):
            return None


def default_location(run_config) -> str:
    """The lineage root of a Ray Train run when no URI is given: next to Ray Train's own files for the run,
    ``<storage_path>/<name>/ray_ckpt`` (``storage_path`` defaults to ``~/ray_results`` as in Ray Train)."""
    base = run_config.storage_path or os.path.expanduser("~/ray_results")
    if getattr(run_config, "storage_filesystem", None) is not None:
        raise ValueError("RunConfig.storage_filesystem is set: give RayCkptCallback a storage_uri (and "
                         "storage_options) for the lineage; ray_ckpt does not use pyarrow filesystem objects")
    if not run_config.name:
        raise ValueError("RunConfig.name is not set: name the run, or give RayCkptCallback a storage_uri")
    return f"{base.rstrip('/')}/{run_config.name}/ray_ckpt"


def claim_run(storage, run: str, *, adopt: bool = False) -> None:
    """Record that the lineage at ``storage`` belongs to ``run`` (:data:`~ray_ckpt.lineage.layout.RUN_MARKER` at
    its root), or refuse: a lineage created by another run name is not silently resumed by this one
    (``adopt=True`` takes it over). Controller actor (:meth:`RayCkptCallback.after_controller_start`)."""
    try:
        owner = json.loads(storage.read(RUN_MARKER)).get("run")
    except _storage.ObjectNotFound:
        owner = None
    except ValueError:
        owner = None  # unreadable marker: rewritten below
    if owner not in (None, run) and not adopt:
        raise ValueError(f"{storage.describe()} holds the checkpoints of run {owner!r}, not of run {run!r}: "
                         f"point this run at its own storage (or leave storage_uri out: the run's own place), "
                         f"or resume that lineage under the new name with RayCkptCallback(..., adopt=True)")
    if owner is None and not _is_empty(storage):
        owner = "<unnamed>"  # written by Checkpointer/an older ray_ckpt: claim it only when adopting
        if not adopt:
            raise ValueError(f"{storage.describe()} already holds checkpoints that no Ray Train run claimed: "
                             f"use another storage, or RayCkptCallback(..., adopt=True) to resume them as run "
                             f"{run!r}")
    if owner != run:
        storage.write(RUN_MARKER, json.dumps({"run": run, "adopted_from": owner}).encode())


def _is_empty(storage) -> bool:
    return not storage.list(MANIFESTS_DIR)


def _shard_runs(run: str) -> list[str]:
    """The shard runs of job ``run`` that its coordinator host holds (sharded FSDP2 state, runtime='ray'). Any
    process."""
    return shard_runs(run)


def flush_run(run: str, timeout: float = 300.0) -> None:
    """Wait until every persistence worker of ``run`` has made what it holds durable. Any process."""
    workers = []
    for node in sorted(lineages.worker_nodes(run)):
        try:
            workers.append(lineages.worker(run, node))
        except ValueError:   # gone since it was listed
            pass
    calls = [w.flush.remote() for w in workers]
    done, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
    for c in done:
        try:
            ray.get(c)
        except Exception as e:  # noqa: BLE001 - a worker of a dead node
            log.warning("ray_ckpt: a persistence worker could not flush: %s", e)


def persist_orphans(run: str, coord) -> list[str]:
    """After a node loss: ask live holders to persist objects that exist only in memory. Any process."""
    todo = ray.get(coord.unpersisted.remote(), timeout=60)
    written = []
    for node, names in todo.items():
        try:
            w = lineages.worker(run, node)
            written += ray.get(w.persist.remote(names), timeout=300)
        except Exception as e:  # noqa: BLE001
            log.warning("ray_ckpt: node %s could not persist %d objects: %s", node[:8], len(names), e)
    return written


__all__ = ["RayCkptCallback", "claim_run", "default_location", "flush_run", "persist_orphans"]
