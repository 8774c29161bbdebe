"""Ray Train integration, worker side: :func:`attach` inside ``train_loop_per_worker`` and the
:class:`TrainSession` it returns.

Runs in each Ray Train worker process. :func:`attach` restores the latest recoverable step on every rank (the
ranks agree on it: :mod:`ray_ckpt.integrations.agreement`), then attaches a Checkpointer (world rank 0, or every
rank with sharded state) and, on the other ranks of a group, a recorder of their own loop state; an optimizer
step hook reports a tiny *pointer* checkpoint (:mod:`ray_ckpt.lineage.pointer`) every ``report_every`` steps
through ``ray.train.report``. The controller side is :mod:`ray_ckpt.integrations.train_callback`.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from ray_ckpt import storage as _storage
from ray_ckpt.api import Checkpointer, open_uri
from ray_ckpt.config import CheckpointConfig, LowDiff
from ray_ckpt.engine.loopstate import as_stateful
from ray_ckpt.engine.rankloop import RankLoopRecorder
from ray_ckpt.runtime.trainer.drain_watch import watch_sink
from ray_ckpt.engine.strategy import impl_for
from ray_ckpt.engine.targets import check_params, unwrap
from ray_ckpt.integrations.agreement import Collective, agreed_restore, sharded_agreed_restore
from ray_ckpt.integrations.compression import ResidualState
from ray_ckpt.lineage.pointer import read_pointer, write_pointer
from ray_ckpt.runtime import naming
from ray_ckpt.runtime.trainer.client import PhaseClock, prestart
from ray_ckpt.runtime.coordinator import get_or_create_coordinator

log = logging.getLogger("ray_ckpt")


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
    #: seconds :func:`attach` spent in each of its phases (``total`` included), as its INFO log line says
    startup: dict = field(default_factory=dict)
    #: this rank's config in force (:func:`attach` says where each field comes from)
    config: CheckpointConfig | None = None
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

    def preempted(self) -> dict | None:
        """This rank's drain notice, or None: ``{"node", "deadline_ms", "remaining_s", ...}`` while a node of the
        worker group drains (Ray Train restarts the whole group at the deadline), as
        :meth:`ray_ckpt.Checkpointer.preempted` says it. Every rank hears of it (rank 0 through its Checkpointer,
        the other ranks through their loop-state recorder); nothing needs to be done about it. Training worker, any
        thread; no Ray call and no collective (unlike ``ray.train.get_preemption_info()``): a rank may ask it
        alone, any number of times."""
        got = self.checkpointer.preempted() if self.checkpointer is not None else None
        if got is None and self.loop_recorder is not None:
            got = self.loop_recorder.sink.noticed
        return got

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
           run: str | None = None, report_every: int | None = None, config: CheckpointConfig | None = None,
           compression_state: Any = None, sharded_runtime: str = "ray", **overrides) -> TrainSession:
    """Attach ray_ckpt inside ``train_loop_per_worker``; call on every worker after building (and wrapping)
    the model and optimizer. Runs in the Ray Train worker process.

    On a fresh run it returns ``start_step == 0``. When the run already has a lineage (Ray Train restarted the
    worker group after a failure or resize, or the whole driver was restarted with the same run name), every
    rank restores model, optimizer, scheduler, scaler and extra state to the latest recoverable step and
    ``start_step`` is that step: the loop continues with its ``(start_step+1)``-th optimizer step.

    The knobs, as :class:`ray_ckpt.Checkpointer` takes them: ``config``, a :class:`~ray_ckpt.CheckpointConfig`, and
    keyword overrides of its fields (``full_every``, ``overhead_budget``, ``keep_fulls``, or any other), resolved
    over the fields the run's ``RayCkptCallback`` gave explicitly (:func:`run_config`). The result
    (``session.config``) drives everything this rank starts: rank 0's Checkpointer, the other ranks' loop-state
    recorders, the run's actors. The step is
    decided once, by world rank 0, and restored on every rank (see :func:`agreed_restore`); when any rank
    cannot restore it, every rank raises :class:`RestoreError`.
    World rank 0 then captures every optimizer step; every rank reports a pointer checkpoint every
    ``report_every`` steps (default: ``full_every``; 0: none) and at :meth:`TrainSession.close`, so
    ``Result.checkpoint`` names the lineage head (``ray_ckpt.restore(result.checkpoint, model, optimizer)``
    restores it). Report your own metrics with :meth:`TrainSession.report` (in place of ``ray.train.report``):
    they are kept in every pointer report, never replaced.

    ``extra_state``: an object with ``state_dict``/``load_state_dict`` or a dict of them, e.g.
    ``{"loader": StatefulDataLoader(...), "epoch": counter}`` to resume mid-epoch.

    The storage comes from :class:`RayCkptCallback` (via the run's coordinator) unless ``storage_uri`` (a URI, or
    an opened storage backend) is given;
    its credentials do not come along (no actor hands them out): each worker resolves its own, from
    ``storage_options`` or its node's AWS environment, profile or instance role.
    Every rank gets its own RNG and extra state back: ranks > 0 record theirs next to the lineage (see
    :mod:`ray_ckpt.engine.rankloop`). ``compression_state``: the :class:`~ray_ckpt.compression.TopKState` of the
    DDP comm hook; with ``error_feedback=True`` each rank's residuals are checkpointed with its loop state
    (:class:`~ray_ckpt.compression.ResidualState`: a dense copy per step and rank), so compression after a
    restore matches the uninterrupted run.
    ``sharded_runtime`` (FSDP2 models, where every rank checkpoints its shard): ``"ray"`` — a shard run per rank
    (its lineage of the job's one coordinator, its node's worker host, its node's replica host); ``"local"`` — each rank writes its shard
    lineage from a thread of its process, no actors per rank (cheaper with many ranks; restores from storage).
    """
    if sharded_runtime not in ("ray", "local"):   # refused before any actor or file is created
        raise ValueError(f"sharded_runtime must be 'ray' or 'local', got {sharded_runtime!r}")
    extra_state = as_stateful(extra_state)
    if compression_state is not None and getattr(compression_state, "error_feedback", False):
        extra_state = ResidualState(compression_state, model, extra_state)
    clock = PhaseClock()
    ctx = ray.train.get_context()
    run = run or ctx.get_experiment_name()
    rank = ctx.get_world_rank()
    storage = _resolve_storage(run, storage_uri, storage_options)
    clock.mark("storage")
    config = run_config(run, storage, config, overrides)
    clock.mark("policy")
    sharded = check_params(optimizer) is not None
    if not sharded and rank == 0:   # rank 0's actors start while the ranks agree on the step to restore
        _prestart_actors(run, storage, strategy, config)
        clock.mark("prestart")
    t0 = time.perf_counter()
    parts = PhaseClock()   # the restore's own phases (the agreement's), reported as restore.<phase>
    if sharded:
        start, restored = sharded_agreed_restore(storage, model, optimizer, scheduler=scheduler,
                                                 extra_state=extra_state, scaler=scaler, run=run,
                                                 runtime=sharded_runtime)
    else:
        start, restored = agreed_restore(storage, model, optimizer, scheduler=scheduler, extra_state=extra_state,
                                         scaler=scaler, run=run, mark=parts.mark)
    restore_seconds = time.perf_counter() - t0
    clock.mark("restore")
    _log_restore(rank, start, restored, restore_seconds, extra_state)
    ck = recorder = None
    if sharded:
        # FSDP2: every rank checkpoints its own shard lineage (with its own loop state): through its shard run
        # (the job's one coordinator, its node's worker and replica hosts) or from a thread of its process; the run
        # (or, locally, the writer lease) is the experiment's, so a restarted worker group continues
        ck = Checkpointer(storage, model, optimizer, scheduler=scheduler, strategy=strategy,
                          extra_state=extra_state, scaler=scaler, start_step=start, runtime=sharded_runtime,
                          run=run, config=config)
        clock.mark("checkpointer")
    else:
        if rank == 0:
            ck = Checkpointer(storage, model, optimizer, scheduler=scheduler,
                              strategy=strategy, extra_state=extra_state, scaler=scaler,
                              start_step=start, runtime="ray", run=run, config=config)
        clock.mark("checkpointer")
        recorder = record_rank_loop(storage, rank, model, optimizer, ck, start=start, extra_state=extra_state,
                                     config=config)
        if recorder is not None:   # Ray Train restarts every rank at a preemption's deadline: each writes in time
            watch_sink(recorder.sink, node=False)
        clock.mark("rank_loop")
    every = config.full_every if report_every is None else report_every
    session = TrainSession(start_step=start, restored=restored, run=run,
                           storage_uri=storage.describe(), world_rank=rank, checkpointer=ck,
                           restore_seconds=restore_seconds, loop_recorder=recorder, report_every=every,
                           step=start, startup=startup_phases(clock, ck, restore=parts.phases), config=config)
    log.info("ray_ckpt: rank %d attached in %s", rank, startup_line(session.startup))
    session._hooks.append(optimizer.register_step_post_hook(_pointer_hook(session)))
    return session


def _log_restore(rank: int, start: int, restored: bool, seconds: float, extra_state: Any) -> None:
    """The restore's INFO line and, on world rank 0, a WARNING for each data source whose order would not repeat
    after a restart (:func:`order_warnings`). Training worker."""
    if restored:
        log.info("ray_ckpt: rank %d restored step %d in %.2f s", rank, start, seconds)
    if rank == 0:
        for warning in order_warnings(extra_state):
            log.warning("%s", warning)


def order_warnings(extra_state: Any) -> list[str]:
    """What the data sources in ``extra_state`` (and the members of a dict of them, or of a ``ResidualState``)
    say about an order that would not repeat after a restart: each one's ``order_warning()``, where it has one
    (:class:`~ray_ckpt.integrations.ray_data.ResumableShard`). Training process."""
    found, todo, seen = [], [extra_state], set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        members = obj if isinstance(obj, dict) else getattr(obj, "members", None)
        todo.extend(members.values() if isinstance(members, dict) else ())
        todo.append(getattr(obj, "extra", None))
        check = getattr(obj, "order_warning", None)
        warning = check() if callable(check) else None
        if warning:
            found.append(warning)
    return found


def run_config(run: str, storage, config: CheckpointConfig | None, overrides: dict) -> CheckpointConfig:
    """This rank's config in force, field by field from lowest to highest precedence: the default, this process's
    ``RAY_CKPT_<FIELD>`` environment, the fields the run's ``RayCkptCallback`` gave explicitly (held by the run's
    coordinator, created here with this rank's config when there is none), the fields ``config`` was built with,
    the keyword ``overrides`` (:meth:`CheckpointConfig.resolve` with ``base``); ``full_every``/``batch_steps`` are
    the run's adaptive policy's choice in force. An unknown knob raises TypeError naming the closest. The fields it
    gives explicitly become the run's when rank 0's Checkpointer attaches (the coordinator's
    ``status()["config"]``), except the adaptive policy's knobs, which the coordinator keeps from its creation
    (give those to the callback). Training worker."""
    mine = CheckpointConfig.resolve(config, **overrides)   # an unknown knob fails here, before any actor starts
    coord = get_or_create_coordinator(run, storage, config=mine)
    policy, run_cfg = ray.get([coord.get_policy.remote(), coord.run_config.remote()])
    return CheckpointConfig.resolve(mine, base=run_cfg.explicit, full_every=policy.full_every,
                                    batch_steps=policy.batch_steps)


def _prestart_actors(run: str, storage, strategy, config: CheckpointConfig) -> None:
    """World rank 0 of a replicated-state group: start its Checkpointer's actors (this node's persistence worker,
    the replica) now, so that their processes start during the restore agreement rather than one after the
    other inside the attach. Best effort: a failure here is logged, and the attach creates them (and raises)
    as it always does. Training worker."""
    try:
        prestart(run, storage, config=config,
                 lowdiff=impl_for(strategy if strategy is not None else LowDiff()).name == "lowdiff",
                 full_every=config.full_every)
    except Exception as e:  # noqa: BLE001 - an optimization only
        log.info("ray_ckpt: could not start the run's actors ahead of the attach (%s)", e)


def startup_phases(clock: PhaseClock, ck: Checkpointer | None, restore: dict | None = None) -> dict:
    """The phases of an :func:`attach` (``clock``'s, the restore's own under ``restore.``, the Checkpointer's own
    under ``checkpointer.``) and their ``total``, in seconds. Training worker."""
    out = dict(clock.phases)
    out["total"] = sum(out.values())
    for name, seconds in (restore or {}).items():
        out[f"restore.{name}"] = seconds
    for name, seconds in (getattr(ck, "startup", None) or {}).items():
        out[f"checkpointer.{name}"] = seconds
    return out


def startup_line(phases: dict) -> str:
    """``"2.31 s (storage 0.01 s, policy 0.00 s, ...)"``: :attr:`TrainSession.startup` for the log."""
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if k != "total")
    return f"{phases.get('total', 0.0):.2f} s ({parts})"


def record_rank_loop(storage, rank, model, optimizer, ck, *, start, extra_state, config: CheckpointConfig):
    """Ranks > 0 of a process group record their own loop state, tagged with rank 0's generation (broadcast:
    collective). None on rank 0 and without a group. Training process.

    ``config`` is the rank's config in force (:func:`attach`'s): a loop-state full every ``full_every`` steps, and
    records written within ``handoff_delay`` seconds or ``batch_steps`` steps, whichever comes first: the cadence
    at which rank 0 hands its step records over, so a rank's death costs the group no more steps than rank 0's
    would."""
    group = Collective()
    if group.world == 1:
        return None
    generation = group.broadcast("share its generation", lambda: ck.generation if ck is not None else None)
    if rank == 0:
        return None
    return RankLoopRecorder(storage, rank, unwrap(model), optimizer, main_generation=generation,
                            start_step=start, extra_state=extra_state, full_every=config.full_every,
                            batch_steps=config.batch_steps, max_batch_delay=config.handoff_delay)


def _resolve_storage(run: str, storage_uri, storage_options):
    """The lineage's storage: ``storage_uri``, else the callback's (from the run's coordinator), else the one the
    run's last pointer checkpoint names. Training worker."""
    if storage_uri is not None:   # a URI, or an opened storage backend (as Checkpointer takes)
        return open_uri(storage_uri, storage_options)
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


# read_pointer: the reader of the pointer files this module reports, for ray_ckpt.train (which imports only
# from integrations)
__all__ = ["TrainSession", "attach", "order_warnings", "read_pointer", "record_rank_loop", "run_config"]
