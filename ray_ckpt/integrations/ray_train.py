"""Ray Train integration: ``attach`` (worker side) and ``RayCkptCallback`` (controller side).

Tested with Ray 2.60 (Train V2); ``pyproject.toml`` pins ``ray[train]>=2.60,<2.61`` because the callback uses
Ray Train's developer API ``ControllerCallback``. Hooks used, and where they run:

=========================================================  ====================================================
``ControllerCallback.after_controller_start``              controller actor: create the run's coordinator
``ControllerCallback.before_controller_execute_failure_decision``  controller: record the failure, persist the
                                                           replicas of objects whose node was lost
``ControllerCallback.before_controller_execute_resize_decision``   controller: record the resize (elastic)
``ControllerCallback.after_controller_finish``             controller: flush every persistence worker, then
                                                           (unless ``keep_runtime``) stop the run's actors
``ray.train.report`` (from ``attach``'s step hook)          every worker, every ``report_every`` steps: a tiny
                                                           *pointer* checkpoint naming the lineage head
=========================================================  ====================================================

Per-step state never goes through ``ray.train.report`` (it commits only at the controller's polls); it goes
through the Ray runtime (PersistenceWorker actors + coordinator).

Every failure or resize restarts the whole worker group; each new worker calls :func:`attach` again, which
restores the latest recoverable step (from the memory tier where possible) into the user's objects, on every
rank, and tells the loop where to resume (``session.start_step``).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.train.v2._internal.execution.callback import ControllerCallback

from ray_ckpt import storage as _storage
from ray_ckpt.storage.uri import SECRET_OPTIONS
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.api import Checkpointer, _check_params, _unwrap, read_pointer, restore, write_pointer
from ray_ckpt.lineage import NoCheckpointError
from ray_ckpt.runtime import naming
from ray_ckpt.runtime.coordinator import get_or_create_coordinator, shutdown_run

log = logging.getLogger("ray_ckpt")


class RayCkptCallback(ControllerCallback):
    """Driver-side half of the integration: ``RunConfig(callbacks=[RayCkptCallback("s3://bucket/run")])``.

    Created on the driver, pickled to the Ray Train controller actor, where its hooks run (see the module
    docstring). ``storage_uri``/``storage_options`` name the lineage's storage; without ``storage_uri`` it is the
    run's own place, ``<RunConfig.storage_path>/<RunConfig.name>/ray_ckpt`` (:func:`default_location`). A lineage
    belongs to the run (name) that created it: a run with another name pointed at it is refused with an error,
    unless ``adopt=True`` (continue that lineage under this run's name, taking over its writer lease). ``full_every``/``batch_steps``
    the frequency policy the coordinator hands to the workers; ``keep_fulls`` > 0 garbage-collects chains older
    than that many durable full checkpoints; ``mtbf_hint`` (seconds) is the adaptive policy's prior MTBF (the
    coordinator adapts ``full_every``/``batch_steps`` unless they are given); ``keep_runtime=True`` leaves the coordinator
    and persistence workers alive after the run (to restore from their memory tier later).
    """

    def __init__(self, storage_uri: str | os.PathLike | None = None, *, storage_options: dict | None = None,
                 full_every: int | None = None, batch_steps: int | None = None, keep_runtime: bool = False,
                 run: str | None = None, keep_fulls: int | None = None, mtbf_hint: float | None = None,
                 adopt: bool = False):
        self.storage_uri = os.fspath(storage_uri) if storage_uri is not None else None
        self.storage_options = dict(storage_options or {})
        self.config = CheckpointConfig.resolve(full_every=full_every, batch_steps=batch_steps,
                                               keep_fulls=keep_fulls, mtbf_hint=mtbf_hint)
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
        claim_run(storage, run, adopt=self.adopt)
        coord = get_or_create_coordinator(run, storage, full_every=self.config.full_every,
                                          batch_steps=self.config.batch_steps, keep_fulls=self.config.keep_fulls,
                                          policy_options=self.config.policy_options(), takeover=self.adopt)
        ray.get(coord.set_storage.remote(storage))
        log.info("ray_ckpt: run %r checkpoints to %s", run, storage.describe())

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        self.failures += 1
        coord = self._coord()
        if coord is None:
            return
        try:
            coord.record_failure.remote({"decision": str(failure_decision), "failures": self.failures})
            persist_orphans(self.run, coord)
            for shard in _shard_runs(self.run):   # FSDP2 with runtime="ray": each shard lineage's run
                shard_coord = ray.get_actor(naming.coordinator_name(shard), namespace=naming.NAMESPACE)
                persist_orphans(shard, shard_coord)
        except Exception as e:  # noqa: BLE001 - never break Ray Train's failure handling
            log.warning("ray_ckpt: could not record the failure: %s", e)

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        coord = self._coord()
        if coord is not None:
            coord.record_event.remote({"resize": getattr(resize_decision, "num_workers", None)})

    def after_controller_finish(self, result) -> None:
        if self.run is None:
            return
        runs = [self.run] + _shard_runs(self.run)   # FSDP2 with runtime="ray": a run per shard lineage too
        try:
            for run in runs:
                flush_run(run)
        finally:
            if not self.keep_runtime:
                for run in runs:
                    shutdown_run(run)

    def _coord(self):
        try:
            return ray.get_actor(naming.coordinator_name(self.run), namespace=naming.NAMESPACE)
        except (ValueError, TypeError):
            return None


RUN_MARKER = "run.json"


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
    """Record that the lineage at ``storage`` belongs to ``run`` (``run.json`` at its root), or refuse: a lineage
    created by another run name is not silently resumed by this one (``adopt=True`` takes it over). Controller
    (callback) or worker (:func:`attach` with ``storage_uri``)."""
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
    from ray_ckpt.lineage import MANIFESTS_DIR
    return not storage.list(MANIFESTS_DIR)


def _shard_runs(run: str) -> list[str]:
    """The shard runs of ``run`` with live actors (sharded FSDP2 state, runtime='ray'). Any process."""
    names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors(all_namespaces=True)]
    return naming.shard_runs(run, names)


def flush_run(run: str, timeout: float = 300.0) -> None:
    """Wait until every persistence worker of ``run`` has made what it holds durable. Any process."""
    workers = [ray.get_actor(a["name"], namespace=naming.NAMESPACE)
               for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(naming.worker_prefix(run))]
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    calls = [w.flush.remote() for w in workers]
    done, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
    for c in done:
        try:
            ray.get(c)
        except Exception as e:  # noqa: BLE001 - a worker of a dead node
            log.warning("ray_ckpt: a persistence worker could not flush: %s", e)
    del alive


def persist_orphans(run: str, coord) -> list[str]:
    """After a node loss: ask live holders to persist objects that exist only in memory. Any process."""
    todo = ray.get(coord.unpersisted.remote(), timeout=60)
    written = []
    for node, names in todo.items():
        try:
            w = ray.get_actor(naming.worker_name(run, node), namespace=naming.NAMESPACE)
            written += ray.get(w.persist.remote(names), timeout=300)
        except Exception as e:  # noqa: BLE001
            log.warning("ray_ckpt: node %s could not persist %d objects: %s", node[:8], len(names), e)
    return written


# ------------------------------------------------------------------------------------------------------------
@dataclass
class TrainSession:
    """What :func:`attach` returns to the training loop (one per worker process)."""

    start_step: int                     #: the step to resume from (0 on a fresh run)
    restored: bool                      #: True when state was restored from the lineage
    run: str
    storage_uri: str
    world_rank: int
    checkpointer: Checkpointer | None   #: rank 0 (every rank with sharded state): captures every step
    restore_seconds: float = 0.0
    loop_recorder: Any = None           #: ranks > 0 of a group: records this rank's RNG and extra state
    report_every: int = 0               #: pointer reports every this many steps (0: only at close)
    step: int = 0                       #: optimizer steps taken (counting the restored prefix)
    last_metrics: dict = field(default_factory=dict)   #: the latest metrics given to :meth:`report`
    _reported_step: int | None = None
    _hooks: list = field(default_factory=list)
    _closed: bool = False

    def report(self, metrics: dict, checkpoint: Any = None, **kwargs) -> None:
        """``ray.train.report`` with the lineage pointer attached: use it in place of ``ray.train.report`` (same
        arguments; call it on every rank, as Ray Train requires). The metrics get ``ray_ckpt_step`` added and are
        kept: ray_ckpt's own pointer reports (every ``report_every`` steps and at :meth:`close`) carry the latest
        ones, so ``Result.metrics`` and ``best_checkpoints`` see the user's metrics. On world rank 0 the pointer
        file goes into the reported checkpoint (``checkpoint``, a local directory checkpoint, when given; a new
        one otherwise). Training worker."""
        self.last_metrics = dict(metrics)
        self._report(checkpoint, **kwargs)

    def _report(self, checkpoint: Any = None, **kwargs) -> None:
        metrics = {**self.last_metrics, "ray_ckpt_step": self.step}
        self._reported_step = self.step
        if self.world_rank != 0:
            ray.train.report(metrics, checkpoint=checkpoint, **kwargs)
            return
        pointer = {"storage_uri": self.storage_uri, "run": self.run, "step": self.step}
        if checkpoint is not None:
            if not os.path.isdir(str(checkpoint.path)):
                raise ValueError("TrainSession.report adds the ray_ckpt pointer to a checkpoint in a local "
                                 "directory; this one is at " + str(checkpoint.path))
            write_pointer(str(checkpoint.path), pointer)
            ray.train.report(metrics, checkpoint=checkpoint, **kwargs)
            return
        with tempfile.TemporaryDirectory() as d:
            write_pointer(d, pointer)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d), **kwargs)

    def close(self, timeout: float | None = None, *, report: bool = True) -> None:
        """End of training: make every captured step durable, detach, and (``report``) report a final pointer
        naming the last step, with the latest metrics, unless that step was just reported. Call on every rank
        (the final report is collective, as every ``ray.train.report``)."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        try:
            if self.checkpointer is not None:
                self.checkpointer.close(timeout)
        finally:
            if self.loop_recorder is not None:
                self.loop_recorder.close(timeout)
        if report and self._reported_step != self.step:
            self._report()

    def __enter__(self) -> "TrainSession":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(report=exc_type is None)   # an exception: no collective report (other ranks may not come)


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
           strategy: Any = None, extra_state: Any = None, scaler: Any = None,
           storage_uri: str | os.PathLike | None = None, storage_options: dict | None = None,
           run: str | None = None, report_every: int | None = None, full_every: int | None = None,
           batch_steps: int | None = None, compression_state: Any = None,
           sharded_runtime: str = "ray") -> TrainSession:
    """Attach ray_ckpt inside ``train_loop_per_worker``; call on every worker after building (and wrapping)
    the model and optimizer. Runs in the Ray Train worker process.

    On a fresh run it returns ``start_step == 0``. When the run already has a lineage (Ray Train restarted the
    worker group after a failure or resize, or the whole driver was restarted with the same run name), every
    rank restores model, optimizer, scheduler, scaler and extra state to the latest recoverable step and
    ``start_step`` is that step: the loop continues with its ``(start_step+1)``-th optimizer step. The step is
    decided once, by world rank 0, and restored on every rank (see :func:`agreed_restore`); when any rank
    cannot restore it, every rank raises :class:`RestoreError`.
    World rank 0 then captures every optimizer step; every rank reports a pointer checkpoint every
    ``report_every`` steps (default: ``full_every``; 0: none) and at :meth:`TrainSession.close`, so
    ``Result.checkpoint`` names the lineage head (``ray_ckpt.restore(result.checkpoint, model, optimizer)``
    restores it). Report your own metrics with :meth:`TrainSession.report` (in place of ``ray.train.report``):
    they are kept in every pointer report, never replaced.

    ``extra_state``: an object with ``state_dict``/``load_state_dict`` or a dict of them, e.g.
    ``{"loader": StatefulDataLoader(...), "epoch": counter}`` to resume mid-epoch.

    The storage comes from :class:`RayCkptCallback` (via the run's coordinator) unless ``storage_uri`` is given;
    its credentials do not come along (no actor hands them out): each worker resolves its own, from
    ``storage_options`` or its node's AWS environment, profile or instance role.
    Every rank gets its own RNG and extra state back: ranks > 0 record theirs next to the lineage (see
    :mod:`ray_ckpt.engine.rankloop`). ``compression_state``: the :class:`~ray_ckpt.compression.TopKState` of the
    DDP comm hook; with ``error_feedback=True`` each rank's residuals are checkpointed with its loop state
    (:class:`~ray_ckpt.compression.ResidualState`: a dense copy per step and rank), so compression after a
    restore matches the uninterrupted run.
    ``sharded_runtime`` (FSDP2 models, where every rank checkpoints its shard): ``"ray"`` — a shard run per rank
    (its coordinator on the head node, its node worker, its replica); ``"local"`` — each rank writes its shard
    lineage from a thread of its process, no actors per rank (cheaper with many ranks; restores from storage).
    """
    from ray_ckpt.engine.loopstate import as_stateful
    if sharded_runtime not in ("ray", "local"):   # refused before any actor or file is created
        raise ValueError(f"sharded_runtime must be 'ray' or 'local', got {sharded_runtime!r}")
    extra_state = as_stateful(extra_state)
    if compression_state is not None and getattr(compression_state, "error_feedback", False):
        from ray_ckpt.integrations.compression import ResidualState
        extra_state = ResidualState(compression_state, model, extra_state)
    ctx = ray.train.get_context()
    run = run or ctx.get_experiment_name()
    rank = ctx.get_world_rank()
    storage = _resolve_storage(run, storage_uri, storage_options)
    config = CheckpointConfig.resolve(full_every=full_every, batch_steps=batch_steps)
    coord = get_or_create_coordinator(run, storage, full_every=config.full_every,
                                      batch_steps=config.batch_steps)
    policy = ray.get(coord.get_policy.remote())
    sharded = _check_params(optimizer) is not None
    t0 = time.perf_counter()
    if sharded:
        start, restored = sharded_agreed_restore(storage, model, optimizer, scheduler=scheduler,
                                                 extra_state=extra_state, scaler=scaler, run=run,
                                                 runtime=sharded_runtime)
    else:
        start, restored = agreed_restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state,
                                         scaler=scaler, run=run)
    restore_seconds = time.perf_counter() - t0
    if restored:
        log.info("ray_ckpt: rank %d restored step %d in %.2f s", rank, start, restore_seconds)
    ck = recorder = None
    if sharded:
        # FSDP2: every rank checkpoints its own shard lineage (with its own loop state): through a run of its own
        # (its coordinator, its node's persistence worker, its replica) or from a thread of its process; the run
        # (or, locally, the writer lease) is the experiment's, so a restarted worker group continues
        ck = Checkpointer(storage, model, optimizer, scheduler=scheduler, strategy=strategy,
                          extra_state=extra_state, scaler=scaler, start_step=start, runtime=sharded_runtime,
                          run=run, full_every=policy.full_every, batch_steps=policy.batch_steps)
    else:
        if rank == 0:
            ck = Checkpointer(storage, model, optimizer, scheduler=scheduler,
                              strategy=strategy, extra_state=extra_state, scaler=scaler,
                              start_step=start, runtime="ray", run=run,
                              full_every=policy.full_every, batch_steps=policy.batch_steps)
        recorder = _record_rank_loop(storage, rank, model, optimizer, ck, start=start, extra_state=extra_state,
                                     full_every=policy.full_every, batch_steps=policy.batch_steps)
    every = policy.full_every if report_every is None else report_every
    session = TrainSession(start_step=start, restored=restored, run=run,
                           storage_uri=storage.describe(), world_rank=rank, checkpointer=ck,
                           restore_seconds=restore_seconds, loop_recorder=recorder, report_every=every,
                           step=start)
    session._hooks.append(optimizer.register_step_post_hook(_pointer_hook(session)))
    return session


class RestoreError(RuntimeError):
    """The ranks of a worker group could not all restore the step they agreed on (raised on every rank)."""


def agreed_restore(storage, model, optimizer, *, scheduler=None, extra_state=None, scaler=None,
                   run: str | None = None, runtime: str = "ray") -> tuple[int, bool]:
    """Restore every rank of the process group to **one** step; returns ``(step, restored)``. Runs in each
    training process (every rank calls it; it is collective when ``torch.distributed`` is initialized).

    World rank 0 resolves the latest recoverable step of the main lineage once; every other rank says up to
    which step it has recorded its own loop state (RNG, extra state; :mod:`ray_ckpt.engine.rankloop`) for that
    generation; the step restored is the smallest of these, the same on every rank (so neither a commit landing
    while the ranks resolve nor a rank whose last records were lost can split the group across steps). Every
    rank restores model, optimizer, scheduler and scaler of that step from the main lineage, then its *own*
    RNG and extra state from its rank lineage; a rank that was not part of the saved world keeps rank 0's extra
    state (then calls ``extra_state.reset_for_new_rank()`` when it has one: the user's hook to adapt it, e.g. to
    a new data shard) and derives its RNG from rank 0's and its rank (:func:`~ray_ckpt.engine.rankloop.
    derive_rng`, logged).
    The ranks then exchange their outcome: when any rank failed, every rank raises :class:`RestoreError`
    naming the failed ranks (a group never trains from mixed states). A run without a lineage starts from
    scratch on every rank: ``(0, False)``. Without a process group (or a group of one) this is a plain
    :func:`ray_ckpt.restore` of the latest step. ``runtime`` as in :func:`ray_ckpt.restore` (``"local"``:
    storage only, no Ray needed)."""
    import torch.distributed as dist
    from ray_ckpt.engine import rankloop
    from ray_ckpt.engine.loopstate import derive_rng
    from ray_ckpt.runtime.client import resolve_step
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not group:
        try:   # fallback as below: a missing or corrupt object costs steps (each logged), not the run
            return restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state,
                           scaler=scaler, runtime=runtime, run=run, fallback=True), True
        except NoCheckpointError as e:
            log.info("ray_ckpt: run %r starts from scratch (%s)", run, e)
            return 0, False
    rank, world = dist.get_rank(), dist.get_world_size()
    decision: list = [None]
    if rank == 0:
        try:
            decision[0] = ("step", *resolve_step(storage, None, run=run, use_coordinator=runtime == "ray"))
        except NoCheckpointError as e:
            decision[0] = ("fresh", str(e), None)
        except Exception as e:  # noqa: BLE001 - told to every rank below, then raised there
            decision[0] = ("error", f"{type(e).__name__}: {e}", None)
    dist.broadcast_object_list(decision, src=0)
    kind, value, generation = decision[0]
    if kind == "error":
        raise RestoreError(f"rank 0 could not resolve the step to restore: {value}")
    if kind == "fresh":
        log.info("ray_ckpt: run %r starts from scratch (%s)", run, value)
        return 0, False
    head = None
    if rank > 0:
        try:
            head = ("ok", rankloop.rank_loop_head(storage, rank, generation))
        except Exception as e:  # noqa: BLE001
            head = ("error", f"{type(e).__name__}: {e}")
    heads: list = [None] * world
    dist.all_gather_object(heads, head)
    bad = {r: h[1] for r, h in enumerate(heads) if h is not None and h[0] == "error"}
    if bad:
        raise RestoreError("could not read the loop state of rank(s) "
                           + "; ".join(f"{r}: {e}" for r, e in sorted(bad.items())))
    recorded = [h[1] for h in heads if h is not None and h[1] is not None]
    step = min([value, *recorded])
    if step != value:
        log.warning("ray_ckpt: restoring step %d, not the latest %d: a rank recorded its loop state only up to "
                    "step %d", step, value, step)
    target, gots = step, [step]
    for _ in range(_AGREE_ROUNDS):
        error, got = None, None
        try:   # fallback: a missing or corrupt object costs steps, not the run (logged loudly below)
            got = restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state, scaler=scaler,
                          step=target, runtime=runtime, run=run, fallback=True)
        except Exception as e:  # noqa: BLE001 - exchanged with the other ranks, then raised on all
            error = f"{type(e).__name__}: {e}"
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, (got, error))
        _raise_failed(outcomes, f"restore of step {target}")
        gots = sorted({g for g, _ in outcomes})
        if len(gots) == 1:
            break
        target = gots[0]   # a rank fell back further (it read a bad object): every rank goes there
    else:
        raise RestoreError(f"the ranks could not agree on a step to restore (they reached {gots})")
    restored = gots[0]
    if restored != step:
        log.error("ray_ckpt: restored step %d instead of %d: objects were missing or corrupt (logged above); "
                  "the steps in between are recomputed", restored, step)
    error = None
    try:
        if rank > 0 and heads[rank][1] is not None:
            rankloop.apply_rank_loop(rankloop.load_rank_loop(storage, rank, generation, restored),
                                     extra_state=extra_state)
        elif rank > 0:
            seed = derive_rng(rank)
            hook = getattr(extra_state, "reset_for_new_rank", None)
            if callable(hook):
                hook()
            log.info("ray_ckpt: rank %d has no loop state of its own in generation %d (it was not part of the "
                     "saved world): extra state is rank 0's%s, RNG derived from rank 0's (seed %d)", rank,
                     generation, " (then reset_for_new_rank())" if callable(hook) else "", seed)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    outcomes = [None] * world
    dist.all_gather_object(outcomes, (restored, error))
    _raise_failed(outcomes, f"restore of rank loop state at step {restored}")
    return restored, True


_AGREE_ROUNDS = 3


def sharded_agreed_restore(storage, model, optimizer, *, scheduler=None, extra_state=None,
                           scaler=None, run: str | None = None, runtime: str = "local") -> tuple[int, bool]:
    """:func:`agreed_restore` for sharded (FSDP2) state: each rank restores its shards of the newest step that
    every saved rank holds (:func:`ray_ckpt.engine.sharded.restore_sharded` decides from storage alone, so every
    rank reaches the same decision; with ``runtime="ray"`` from storage and the coordinators of the shard runs of
    ``run``, whose replicas give each shard's state without replay), resharding when the world size changed; the
    ranks then exchange their outcome: a rank that fell back further (a missing or corrupt object of its shards)
    brings every rank to the step it reached; every rank raises :class:`RestoreError` unless all restored one step
    (or all start from scratch). Training process of each rank (collective when ``torch.distributed`` is
    initialized)."""
    import torch.distributed as dist
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    target = None
    for attempt in range(_AGREE_ROUNDS):
        try:   # fallback: a missing or corrupt object of this rank's shards costs steps, not the run
            outcome = ("step", restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state,
                                       scaler=scaler, runtime=runtime, run=run, step=target, fallback=True))
        except NoCheckpointError as e:
            outcome = ("fresh", str(e))
        except Exception as e:  # noqa: BLE001 - exchanged with the other ranks, then raised on all
            outcome = ("error", f"{type(e).__name__}: {e}")
        outcomes = [outcome]
        if group:
            outcomes = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, outcome)
        failed = {r: o[1] for r, o in enumerate(outcomes) if o[0] == "error"}
        if failed:
            raise RestoreError("sharded restore failed on rank(s) " + "; ".join(f"rank {r}: {e}"
                                                                              for r, e in sorted(failed.items())))
        kinds = {o[0] for o in outcomes}
        if kinds == {"fresh"} and target is None:
            log.info("ray_ckpt: sharded run starts from scratch (%s)", outcomes[0][1])
            return 0, False
        if kinds != {"step"}:
            raise RestoreError(f"the ranks could not restore one step: {outcomes}")
        steps = sorted({o[1] for o in outcomes})
        if len(steps) == 1:
            if target is not None:
                log.error("ray_ckpt: the ranks restored step %d: objects of later steps were missing or corrupt "
                          "on some rank (logged there); the steps in between are recomputed", steps[0])
            return steps[0], True
        target = steps[0]   # a rank fell back further (it read a bad object): every rank goes there
    raise RestoreError(f"the ranks could not agree on a step to restore (they reached {steps})")


def _raise_failed(outcomes: list, what: str) -> None:
    failed = {r: e for r, (_, e) in enumerate(outcomes) if e is not None}
    if failed:
        raise RestoreError(f"{what} failed on rank(s) {sorted(failed)}: "
                           + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))


def _record_rank_loop(storage, rank, model, optimizer, ck, *, start, extra_state, full_every, batch_steps):
    """Ranks > 0 of a process group record their own loop state, tagged with rank 0's generation (broadcast:
    collective). None on rank 0 and without a group. Training process."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from ray_ckpt.engine.rankloop import RankLoopRecorder
    gen = [ck.generation if ck is not None else None]
    dist.broadcast_object_list(gen, src=0)
    if rank == 0:
        return None
    return RankLoopRecorder(storage, rank, _unwrap(model), optimizer, main_generation=gen[0],
                            start_step=start, extra_state=extra_state, full_every=full_every,
                            batch_steps=batch_steps)


def _resolve_storage(run: str, storage_uri, storage_options):
    if storage_uri is not None:
        return _storage.open_storage(os.fspath(storage_uri), **(storage_options or {}))
    try:
        coord = ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE)
    except ValueError:
        coord = None
    if coord is not None:  # the callback's storage, as a URI without credentials: this process brings its own
        return _storage.open_storage(ray.get(coord.storage_uri.remote()), **(storage_options or {}))
    ckpt = ray.train.get_checkpoint()
    ptr = read_pointer(ckpt) if ckpt is not None else None
    if ptr is not None:
        return _storage.open_storage(ptr["storage_uri"], **(storage_options or {}))
    raise ValueError("ray_ckpt.train.attach needs a storage: add RayCkptCallback(storage_uri) to "
                     "RunConfig(callbacks=...) or pass storage_uri=")


def _pointer_hook(session: TrainSession):
    """Counts optimizer steps; every ``report_every`` steps, a pointer report (training thread, every rank)."""
    def hook(opt, args, kwargs):
        session.step += 1
        if session.report_every and session.step % session.report_every == 0:
            session._report()

    return hook


__all__ = ["RayCkptCallback", "RestoreError", "TrainSession", "agreed_restore", "attach", "read_pointer",
           "flush_run"]
