"""The public entry points ``Checkpointer`` and ``restore``: capture (engine) → a sink → storage.

Everything here runs in the training process. ``runtime="local"`` uses the engine's writer thread and needs no
Ray; ``runtime="ray"`` swaps in the Ray runtime's sink (persistence actors, coordinator), imported lazily so
that the local path never imports Ray. This module sits above ``engine`` and ``runtime``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any

import torch

from ray_ckpt.config import Amber, CheckpointConfig, LowDiff, Runtime
from ray_ckpt.engine.attachment import Attachment
from ray_ckpt.engine.loopstate import ATTACHED_ATTR, RESTORED_STEP_ATTR, check_not_attached
from ray_ckpt.engine.restore import apply_chain, resolve_and_load
from ray_ckpt.engine.strategy import impl_for
from ray_ckpt.engine.targets import check_params, unwrap
from ray_ckpt.engine.runtimes import LocalRuntime, TrainerRuntime
from ray_ckpt.lineage.layout import POINTER_FILE
from ray_ckpt.lineage.pointer import read_pointer
from ray_ckpt.policy.budget import BudgetPolicy
from ray_ckpt import storage as _storage
from ray_ckpt.engine import consolidate as _consolidate
from ray_ckpt.engine import metering
from ray_ckpt.engine import shard_layout as _layout
from ray_ckpt.engine.sharded import restore_sharded

log = logging.getLogger("ray_ckpt")


class Checkpointer:
    """Checkpoint every optimizer step of a training loop to ``uri``; attach once, then train as usual.

    ``runtime="ray"`` hands captured steps to this node's PersistenceWorker actor (memory tier, peer replica,
    durable writes) and registers them with the run's coordinator (``run`` names it; default: derived from
    ``uri``); Ray must be initialized. ``runtime="local"`` writes from a thread of this process. Either string
    or a :class:`~ray_ckpt.config.Runtime`; anything else raises ValueError saying what is accepted.

    Runs in the training process. Construction takes the first full checkpoint (step ``start_step``, by default
    the step a preceding :func:`restore` returned, else 0) and installs hooks on ``optimizer`` (and wraps
    ``scheduler.step``); from then on each ``optimizer.step()`` is captured (a copy at most) and written by a
    background thread in batches of ``batch_steps`` steps, with a full checkpoint every ``full_every`` steps.
    With ``runtime="ray"`` the constructor returns once that first full is held on two nodes (durable on a
    one-node cluster), except when it restates what the lineage already holds that way: right after a
    :func:`restore` of ``start_step`` from this ``uri`` (unsharded) whose chain was durable or held on two nodes
    (``ray_ckpt.train.attach`` after a restart), the full is secured in the background while training goes on;
    a crash meanwhile restores that same step, bitwise, from the earlier generation.

    The knobs: ``config``, a :class:`~ray_ckpt.CheckpointConfig`, and keyword overrides of its fields
    (``full_every``, ``batch_steps``, ``max_pending_bytes``, ``capture_rng``, ``memory_budget``, ``keep_fulls``,
    ``replica``, ``handoff_delay``, ``policy``, ``mtbf_hint``, ``durable_diffs``, ``write_timeout``, or any other
    field). For each knob, from lowest to highest precedence: the default, the ``RAY_CKPT_<FIELD>`` environment
    variable, a field ``config`` was constructed with, a keyword override that is not None (see
    :meth:`CheckpointConfig.resolve`). An unknown (misspelled) knob raises TypeError naming the closest one.
    ``self.config`` is the config in force.

    ``extra_state``, ``scheduler`` and ``scaler`` are objects with ``state_dict()``/``load_state_dict()``; the
    same objects are given to :func:`restore`. Use as a context manager or call :meth:`close`.

    One writer per lineage: a second Checkpointer (another job) on the same ``uri`` raises
    :class:`ray_ckpt.LeaseError` naming the holder, unless ``takeover=True`` (take over a lease
    whose job is gone; logged). With ``runtime="ray"`` the lease belongs to the run; with ``runtime="local"``
    and ``run`` given it is shared by the writers of that run (a restarted worker group continues). An attach
    that fails halfway releases what it took (lease, writer thread, hooks).

    Sharded state (FSDP2 ``fully_shard``: parameters are DTensor shards on a 1-D mesh): create a Checkpointer on
    every rank; each writes its own shard lineage below ``uri`` (``shards/w<world>/r<rank>/``) with LowDiff, and
    :func:`restore` on every rank of any world size restores the newest step all saved ranks hold, resharding
    when the world size changed (see :mod:`ray_ckpt.engine.sharded`). With ``runtime="ray"`` every shard lineage
    is a shard run (``run`` + ``:shard-w<world>-r<rank>``) of the job's one coordinator, node workers and replicas
    (O(nodes) actors, see docs/sharded.md).
    HSDP (a 2-D (replicate, shard) mesh): replica 0 of every shard writes its lineage; on the other replicas the
    Checkpointer only counts steps (``last_committed_step`` stays None). ``strategy=Amber()`` works on sharded
    state with ``runtime="local"``.

    ``durable_diffs`` (``runtime="ray"``): what the durable tier gets besides the fulls — ``"auto"`` (default:
    ``"all"`` while the measured storage bandwidth allows, else ``"fulls"``), ``"all"`` (every step's record), ``"fulls"`` (step records stay in memory on two nodes), or ``"amber"`` / an
    ``Amber(...)`` (LowDiff with the replica: as ``"fulls"``, and the state tier's replica writes Amber increments
    of its own state, so that every step restores from storage alone within the Amber bound; the trainer sends
    nothing more for them; see :mod:`ray_ckpt.engine.amber_tier`).

    Storage writes are retried with backoff for ``write_timeout`` seconds (default 300): an outage shorter than
    that costs time (the training thread waits once ``max_pending_bytes`` is held), never data; beyond it
    the next step raises :class:`WriterError`.

    ``policy="adaptive"`` (default) lets the policy choose ``full_every``/``batch_steps`` online from measured
    costs and failures (``mtbf_hint``: prior MTBF in seconds); values given explicitly are kept, and
    :meth:`policy_report` / ``stats()["policy"]`` say what it would choose and why. ``policy="fixed"``: never.

    ``overhead_budget`` (default 0.05): the share of the step time checkpointing may cost this process, measured
    on the training thread; beyond it LowDiff records a full every k steps instead of every step
    (``self.budget``, ``stats()["granularity"]``: the mode, k, the lost-work bound and why).
    """

    def __init__(self, uri: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 scheduler: Any = None, scaler: Any = None, extra_state: Any = None, strategy: Any = None,
                 config: CheckpointConfig | None = None, runtime: str | Runtime = "local", run: str | None = None,
                 storage_options: dict | None = None, start_step: int | None = None, takeover: bool = False,
                 **overrides):
        model = unwrap(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.shard_spec = check_params(optimizer)
        self.strategy = strategy if strategy is not None else LowDiff()
        impl = impl_for(self.strategy)
        self.runtime = Runtime.of(runtime)
        self._rt = rt = runtime_for(self.runtime)
        _check_sharded_support(impl, self.shard_spec, rt)
        self.config, durable_amber = _resolve_config(config, overrides, rt, impl, self.shard_spec)
        self.storage, run = _open_lineage(uri, storage_options, run, self.shard_spec, rt)
        self.uri = self.storage.describe()
        self._start_step = start_step = _first_step(optimizer, start_step)
        restated = _restored_safe(optimizer, self.uri, start_step)
        if getattr(optimizer, ATTACHED_ATTR, None) is not None:   # before anything is acquired
            raise RuntimeError("this optimizer already has a ray_ckpt capture attached; close() it first")
        self._att = Attachment(owner=f"Checkpointer of {self.uri} (runtime={self.runtime})")
        #: seconds of this attach's phases; the overhead budget's choice (None on a non-writing HSDP replica)
        self.startup: dict = {}
        self.budget: BudgetPolicy | None = None
        if self.shard_spec is not None and not self.shard_spec.writes:
            self._follow_replica(optimizer, run, start_step)   # HSDP: replica 0 of this shard writes it
            return
        with self._att.releasing_on_error():   # a failure below leaves nothing held (lease, writer thread, hooks)
            policy = self._attach_sink(impl, run, _attach_info(optimizer, start_step, durable_amber), takeover)
            t1 = time.perf_counter()
            policy = self._make_budget(policy, impl, start_step)
            self._capture = self._att.hold_capture(impl.make_capture(
                model, optimizer, self._sink, policy, start_step=start_step, scheduler=scheduler, scaler=scaler,
                extra_state=extra_state, capture_rng=self.config.capture_rng, fingerprint_every=self._fp_every(),
                pool_bytes=self.config.max_pending_bytes))
            self._first_full(policy, start_step, restated, t1)
        self._att.hold_watch(_watch_drains(rt, self._sink))   # stopped on release, even by __del__
        log.info("ray_ckpt: attached to %s (generation %d, start step %d)", self.uri, self.generation, start_step)

    def _follow_replica(self, optimizer, run, start_step: int) -> None:
        """A rank whose shard replica 0 writes (HSDP, see :mod:`ray_ckpt.engine.hsdp`): no lease, no writer, no
        capture; the step is counted. Training thread."""
        from ray_ckpt.engine.hsdp import NoWrites, ReplicaFollower
        self.run, self.generation = run, None
        self._capture = self._att.hold_capture(ReplicaFollower(optimizer, start_step, self.config.full_every,
                                                               self.config.batch_steps))
        self._sink = self._att.hold_sink(NoWrites())
        log.info("ray_ckpt: replica %d of shard %d (HSDP) writes nothing; replica 0 writes %s",
                 self.shard_spec.replica, self.shard_spec.rank, self.uri)

    def _attach_sink(self, impl, run, info: dict, takeover: bool):
        """The lease (local) or the coordinator (Ray), the generation and the sink of this attach, held by the
        attachment (:meth:`ray_ckpt.engine.runtimes.TrainerRuntime.attach`); returns the frequency policy.
        Training thread."""
        t0 = time.perf_counter()
        got = self._rt.attach(self.storage, impl, self._att, run=run, config=self.config, info=info,
                              takeover=takeover)
        self.run, self.generation, self._sink = got.run, got.generation, got.sink
        #: seconds of this attach's phases (runtime="ray": coordinator, replica, node_worker; first_full)
        self.startup = dict(got.sink.startup or {"sink": time.perf_counter() - t0})
        return got.policy

    def _make_budget(self, policy, impl, start_step: int) -> BudgetPolicy:
        """The overhead budget over the cost model's policy: LowDiff may leave steps unrecorded (a full every k
        steps); other strategies and sharded state are measured only. A restart (Ray Train's, or a resumed run)
        starts at the granularity the previous attempt measured. Training thread, at attach."""
        self.budget = budget = BudgetPolicy(policy, self.config.overhead_budget,
                                            granular=impl.name == "lowdiff" and self.shard_spec is None,
                                            max_k=self.config.max_full_every, on_change=self._budget_changed,
                                            draining=lambda: self._sink.drain_due, pin=self.config.recovery_every)
        if budget.pin:
            log.info("ray_ckpt: %s", budget.reason)
        elif start_step > 0 and budget.granular and budget.budget > 0:
            previous = self._sink.previous_granularity()
            if previous is not None and budget.resume(previous):
                log.info("ray_ckpt: overhead budget %.1f %%: %s", 100 * budget.budget, budget.reason)
        return budget

    def _fp_every(self) -> int:
        """Steps between fingerprints of the trainer's state for the state tier's replica (0: no replica)."""
        return self.config.fingerprint_every if self._sink.replica_enabled else 0

    def _first_full(self, policy: BudgetPolicy, start_step: int, restated: bool, t1: float) -> None:
        """Hand the attach full over and secure it as the runtime promises
        (:meth:`~ray_ckpt.engine.runtimes.TrainerRuntime.secure_first_full`). Training thread, at attach."""
        if self.shard_spec is not None:
            self._capture.sharding = _layout.sharding_info(self.shard_spec)
        calibrated = metering.calibrate(self._capture, self._sink, policy, self.startup)
        self._capture.meter = metering.step_meter(self._sink, self._on_window, first_short=calibrated)
        self._sink.attach_capture(self._capture, start_step)   # (the Ray sender publishes its metrics)
        full = self._capture.snapshot_now()   # (coarse when resumed in the every-k mode)
        policy.hint_full(self._capture.last_snapshot_seconds or 0.0, full.nbytes)
        self._sink.submit(full)
        t2 = time.perf_counter()
        unsharded = self.shard_spec is None
        self._rt.secure_first_full(self._sink, restated=restated and unsharded,
                                   first_state=start_step == 0 and self.generation == 1 and unsharded)
        t3 = time.perf_counter()
        self.startup["first_full"] = t3 - t1
        self.startup["first_full.wait_safe"] = t3 - t2

    def _on_window(self, w) -> None:
        """Training thread, once a measurement window: the overhead budget decides; with runtime="local" the
        cost model gets the window (with runtime="ray" the sender ships it to the coordinator)."""
        self.budget.observe(w)
        self._rt.on_window(w)

    def _budget_changed(self, report: dict) -> None:
        """Training thread: the overhead budget changed the recovery granularity."""
        log.info("ray_ckpt: overhead budget %.1f %%: recovery points %s (lost-work bound %d steps): %s",
                 100 * report["overhead_budget"],
                 "every step" if report["mode"] == "every_step" else f"every {report['k']} steps (fulls)",
                 report["lost_work_steps"], report["reason"])

    def policy_report(self) -> dict | None:
        """What the adaptive policy decides and why (None with policy="fixed"). Any thread."""
        return self._rt.policy_report(self.storage, self.run)

    @property
    def step(self) -> int:
        """Optimizer steps taken (since 0 of the run, counting a restored prefix)."""
        return self._capture.step

    @property
    def last_committed_step(self) -> int | None:
        """The highest step whose diff or full object is committed: written (``runtime="local"``) or handed to the
        node's persistence worker (``runtime="ray"``; ``stats()["runtime"]["held_step"]``: the newest step the
        worker acknowledged, which survives a crash of this process). Any thread."""
        return self._sink.stats.last_committed_step

    def flush(self, timeout: float | None = None) -> None:
        """Make every step captured so far durable. Training thread; blocks."""
        self._att.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the drain watch, detach the hooks, stop the writer and release the lease (each even when
        an earlier one fails). Idempotent."""
        self._att.close(timeout)

    def preempted(self) -> dict | None:
        """The drain notice of this process's node, or None: ``{"node", "deadline_ms", "remaining_s"}``
        (``deadline_ms`` in Unix milliseconds; both None when Ray gave no deadline). Any thread; no call to
        Ray (a Ray Train worker may call it on one rank only, unlike ``ray.train.get_preemption_info()``).

        Ray marks a node as draining when it is about to be preempted or removed (``ray drain-node``, the
        autoscaler, a cloud's preemption handler). Nothing needs to be done about it: from the notice on every
        step is handed over (written, with ``runtime="local"``) at once, and in the last seconds before the
        deadline each step returns only once it is safe, so the process can be killed at the deadline without
        losing a captured step; with ``runtime="ray"`` the run's actors make what the node holds safe on the
        nodes that stay. Use this to act yourself, e.g. stop early and ``close()``. Needs a process connected
        to Ray (always None otherwise)."""
        return self._sink.noticed

    def stats(self) -> dict:
        """Counters for logs and benchmarks (training process). ``durable_lag_steps``: steps captured but not yet
        committed (``runtime="local"``: written; ``runtime="ray"``: handed to the persistence tier, whose
        ``runtime.restorable`` says what is durable). ``runtime="ray"`` adds the node worker's and
        the replica's figures (one actor call each): ``write_seconds``/``durable_bytes`` are the worker's
        durable writes, ``encode_seconds`` the sender thread's encode + hand-off time. With Amber, ``amber``
        counts the fulls its chain policy asked for (``early_fulls``: a merged increment grew too large) and the
        merge requests (``merges``). ``startup``: seconds of this attach's phases (``runtime="ray"``: the
        coordinator's generation, the replica's and the node worker's start; ``first_full``: the attach full,
        captured and safe)."""
        s = self._sink.stats
        committed = s.last_committed_step
        out = {"step": self.step, "generation": self.generation, "last_committed_step": committed,
               # nothing committed yet: the attach full itself is pending too
               "durable_lag_steps": self.step - (committed if committed is not None else self._start_step - 1),
               "objects_written": s.objects_written, "bytes_written": s.bytes_written,
               "diff_bytes": s.diff_bytes, "full_bytes": s.full_bytes, "stall_seconds": s.stall_seconds,
               "write_seconds": s.write_seconds, "encode_seconds": s.encode_seconds,
               "capture_seconds": self._capture.capture_seconds, "pending_bytes": self._sink.pending_bytes,
               "trainer_fulls": self._capture.full_snapshots,
               "full_every": self._capture.policy.full_every, "batch_steps": self._capture.policy.batch_steps,
               "policy": self.policy_report(), "startup": dict(self.startup),
               "granularity": self.budget.report() if self.budget is not None else None}
        meter = getattr(self._capture, "meter", None)
        if meter is not None and meter.last is not None:   # the training process's latest measured window
            out["granularity"]["window"] = meter.last.to_dict()
        if hasattr(self._capture, "early_fulls"):   # Amber: why fulls were taken, and the merged increments
            out["amber"] = {"early_fulls": self._capture.early_fulls, "merges": self._capture.merges}
        rt = self._sink.runtime_stats()
        if rt is not None:
            w = rt.get("worker", {})
            out.update(write_seconds=w.get("write_seconds", 0.0), durable_bytes=w.get("bytes_written", 0),
                       durable_objects=w.get("objects_written", 0), runtime=rt)
            if "durable_diffs" in rt:
                out["durable_diffs"] = rt["durable_diffs"]
        if isinstance(out["policy"], dict):   # the decisions made in this process, next to the cost model's
            out["policy"]["granularity"] = out["granularity"]
            if "durable_diffs" in out:
                out["policy"]["durable_diffs"] = out["durable_diffs"]
        return out

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort: never leave hooks on a live optimizer
        att = getattr(self, "_att", None)   # absent when __init__ raised before attaching
        try:
            if att is not None:
                att.release(timeout=5)
        except Exception:  # noqa: BLE001
            pass


def _watch_drains(rt: TrainerRuntime, sink):
    """In a process connected to Ray: a watch that turns drain notices into the sink's notice — this node's drain
    (when the runtime does not hear of it otherwise: ``watches_node_drains``) and, in a Ray Train worker, a
    preemption of any node of the worker group. None without Ray. Never imports Ray itself. Training thread, at
    attach."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray_ckpt.runtime.trainer.drain_watch import watch_sink
    return watch_sink(sink, node=rt.watches_node_drains)


def _resolve_config(config: CheckpointConfig | None, overrides: dict, rt: TrainerRuntime, impl,
                    shard_spec) -> tuple[CheckpointConfig, Amber | None]:
    """A Checkpointer's config in force (:meth:`CheckpointConfig.resolve`) and the Amber settings of
    ``durable_diffs="amber"`` (an ``Amber(...)`` given as ``durable_diffs``, else the defaults; None for the other
    modes), checked against the runtime, the strategy and the sharding. Training process."""
    amber = overrides.get("durable_diffs")
    if isinstance(amber, Amber):
        overrides = {**overrides, "durable_diffs": "amber"}
    else:
        amber = None
    resolved = CheckpointConfig.resolve(config, **overrides)
    rt.check_config(resolved)
    durable_amber = _durable_amber(amber, resolved, impl, shard_spec)
    return rt.resolve_config(resolved, shard_spec), durable_amber


def _open_lineage(uri, storage_options: dict | None, run: str | None, shard_spec, rt: TrainerRuntime):
    """``(storage, run)`` of an attach: for sharded (FSDP2) state this rank's shard lineage (see
    :mod:`ray_ckpt.engine.sharded`) and, with ``runtime="ray"``, its shard run (its lineage of the job's
    coordinator, node workers and replicas: :mod:`ray_ckpt.runtime.lineages`). Training process."""
    storage = open_uri(uri, storage_options)
    if shard_spec is None:
        return storage, run
    if shard_spec.writes:   # HSDP: the replicas > 0 write nothing, not even the marker
        _layout.mark_world(storage, shard_spec)
    run = rt.lineage_run(storage, run, shard_spec)
    return _layout.shard_storage(storage, shard_spec.world, shard_spec.rank), run


#: set on an optimizer by an unsharded :func:`restore`: ``{"uri", "step", "safe"}`` of the state it installed
#: (``safe``: every object of its chain was durable or held on two nodes); read once by the next attach
_RESTORED_FROM_ATTR = "_ray_ckpt_restored_from"


def _restored_safe(optimizer: torch.optim.Optimizer, uri: str, start_step: int) -> bool:
    """Whether ``optimizer`` holds the state that :func:`restore` installed from the lineage at ``uri`` at
    ``start_step``, and that state's chain was durable or held on two nodes: an attach of that step restates
    what the lineage already holds safe. The mark is consumed (only the first attach after a restore reads it).
    Training thread."""
    got = getattr(optimizer, _RESTORED_FROM_ATTR, None)
    if got is None:
        return False
    delattr(optimizer, _RESTORED_FROM_ATTR)
    return got["uri"] == uri and got["step"] == start_step and got["safe"]


def _first_step(optimizer: torch.optim.Optimizer, start_step: int | None) -> int:
    """The step an attach starts at: ``start_step``, else the step a preceding :func:`restore` returned, else 0."""
    if start_step is None:
        start_step = getattr(optimizer, RESTORED_STEP_ATTR, 0)
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    return start_step


def _attach_info(optimizer: torch.optim.Optimizer, start_step: int, durable_amber: Amber | None) -> dict:
    """The ``info`` of an attach's manifests."""
    info = {"num_params": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
            "optimizer": type(optimizer).__name__, "start_step": start_step}
    if durable_amber is not None:   # the replica computes the Amber tier's increments with these settings
        info["durable_amber"] = dataclasses.asdict(durable_amber)
    return info


def _durable_amber(given: Amber | None, config: CheckpointConfig, impl, shard_spec) -> Amber | None:
    """The Amber settings of ``durable_diffs="amber"`` (None for the other modes), checked against the run."""
    if config.durable_diffs != "amber":
        return None
    if impl.name != "lowdiff":
        raise ValueError(f"durable_diffs='amber' gives a LowDiff run's durable tier Amber increments computed by "
                         f"the state tier's replica; strategy {impl.name!r} writes its own diffs (with "
                         f"strategy=Amber() the increments already are the durable diffs)")
    if not config.replica:
        raise ValueError("durable_diffs='amber' needs the state tier's replica (replica=True): it computes the "
                         "increments from its copy of the state")
    if shard_spec is not None:
        raise ValueError("durable_diffs='amber' is not supported for sharded (FSDP2) state: each shard run's "
                         "replica would need the whole layout; use durable_diffs='all' or 'fulls'")
    return given if given is not None else Amber()


def restore(uri: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
            step: int | None = None, extra_state: Any = None, scaler: Any = None,
            storage_options: dict | None = None, fallback: bool = False, restore_rng: bool = True,
            runtime: str | Runtime = "local", run: str | None = None) -> int:
    """Restore ``model``, ``optimizer`` (and scheduler, scaler, extra state, RNG) to ``step`` (None = latest
    committed) from ``uri``; returns the restored step. Runs in the calling (training) process.

    ``uri`` may also be a Ray Train ``Checkpoint`` reported by :func:`ray_ckpt.train.attach` (e.g.
    ``result.checkpoint`` after ``trainer.fit()``): a pointer naming the lineage and a step, which is restored
    unless ``step`` is given (``storage_options`` still carry credentials: the pointer holds none).

    The result is what the training loop had right before its ``(step+1)``-th ``optimizer.step()``.
    With ``fallback=True`` a missing or corrupt object or a malformed manifest is logged and skipped, and the
    latest good step at or before the request (on the same timeline) is restored instead of raising; with
    ``runtime="ray"`` a plan that fails that way is retried from storage.

    ``runtime="ray"`` asks the run's coordinator for the plan and reads objects from the object store of live
    nodes where they are held (memory tier), from storage otherwise; without a coordinator it reads storage. Its
    INFO log record has ``ray_ckpt_restore``: ``{"step", "source" (replica, memory, storage), "replayed", ...}``.

    Sharded (FSDP2) ``model``/``optimizer``: call on every rank; each restores its shards of ``step`` (None: the
    newest step every saved rank holds; a step one rank lacks raises NoCheckpointError) from storage, at the saved
    world size or resharded to this one. No collectives: every rank decides from storage alone — with
    ``runtime="ray"`` from storage and the shard runs' coordinators (memory tier; a shard's replica gives its
    state at the step without replay).

    An unsharded ``model``/``optimizer`` (plain tensors, any device, no process group needed) restored from a
    sharded root is consolidated: the saved shards of ``step`` (None: the newest step every saved rank holds;
    ``fallback`` as above) are gathered into the full state, bitwise the run's, with rank 0's loop state (see
    :func:`ray_ckpt.engine.consolidate.restore_consolidated`).
    """
    t0 = time.perf_counter()
    rt = runtime_for(Runtime.of(runtime))
    model = unwrap(model)
    check_not_attached(optimizer)
    shard_spec = check_params(optimizer)
    uri, step = _from_pointer(uri, step)
    storage = open_uri(uri, storage_options)
    if shard_spec is not None:
        memory = rt.sharded_memory(run)
        out = restore_sharded(storage, model, optimizer, shard_spec, step=step, scheduler=scheduler,
                                       scaler=scaler, extra_state=extra_state, fallback=fallback,
                                       restore_rng=restore_rng, memory=memory)
        dt = time.perf_counter() - t0
        log.info("ray_ckpt: restored step %d (sharded) from %s in %.3f s%s", out, storage.describe(), dt,
                 "" if memory is None else f" (shard objects: {memory.tiers})")
        rt.record_restore(storage, run, dt)
        return out
    if _consolidate.consolidates(storage):   # a sharded root into an unsharded model: gather the saved shards
        return _restore_consolidated(storage, model, optimizer, step=step, scheduler=scheduler, scaler=scaler,
                                     extra_state=extra_state, fallback=fallback, restore_rng=restore_rng,
                                     rt=rt, run=run, t0=t0)
    chain, tiers = rt.load_plan(storage, step, run=run, fallback=fallback) or (None, {"source": "storage"})
    if chain is None:
        chain = resolve_and_load(storage, step, fallback=fallback)
    _refuse_one_shard(chain, storage)
    out = apply_chain(chain, model, optimizer, scheduler=scheduler, scaler=scaler, extra_state=extra_state,
                      restore_rng=restore_rng)
    # what a Checkpointer attached next to this optimizer needs to know (see _restored_safe)
    setattr(optimizer, _RESTORED_FROM_ATTR, {"uri": storage.describe(), "step": out, "safe": not tiers.get("unsafe")})
    dt, src, n = time.perf_counter() - t0, tiers["source"], len(chain.records)
    log.info("ray_ckpt: restored step %d from %s (%s: state of step %d + %d records replayed) in %.3f s", out,
             storage.describe(), src, chain.full.step, n, dt, extra={"ray_ckpt_restore": {
                 "step": out, "source": src, "from_step": chain.full.step, "replayed": n, "seconds": dt}})
    rt.record_restore(storage, run, dt)
    return out


def _restore_consolidated(storage, model, optimizer, *, rt: TrainerRuntime, run: str | None, t0: float,
                          **kw) -> int:
    """:func:`restore` of an unsharded model from a sharded root (see
    :func:`ray_ckpt.engine.consolidate.restore_consolidated`); with ``runtime="ray"`` through the shard runs. Calling
    process."""
    memory = rt.sharded_memory(run)
    out = _consolidate.restore_consolidated(storage, model, optimizer, memory=memory, **kw)
    dt = time.perf_counter() - t0
    log.info("ray_ckpt: restored step %d (consolidated from sharded state) from %s in %.3f s", out,
             storage.describe(), dt)
    rt.record_restore(storage, run, dt)
    return out


def _refuse_one_shard(chain, storage) -> None:
    """An unsharded restore of one rank's shard lineage (``<root>/shards/w<W>/r<R>``) would load a shard as the
    whole model: refused, saying what to open instead."""
    sharding = _layout.shard_of(chain.full.layout)
    if sharding is not None:
        raise ValueError(f"{storage.describe()} is the shard lineage of rank {sharding.get('rank')} of "
                         f"{sharding.get('world')} (FSDP2): it holds that rank's shards only. Restore the root (the "
                         f"URI above shards/) instead: into an unsharded model it gathers every rank's shards, into "
                         f"FSDP2 models (every rank) it restores each rank's")


def _from_pointer(uri, step: int | None) -> tuple[Any, int | None]:
    """``(uri, step)`` named by a pointer checkpoint (anything with ``as_directory()`` holding
    :data:`POINTER_FILE`); other ``uri`` values pass through."""
    if not callable(getattr(uri, "as_directory", None)):
        return uri, step
    ptr = read_pointer(uri)
    if ptr is None:
        raise ValueError(f"{uri!r} is not a ray_ckpt pointer checkpoint (no {POINTER_FILE}): was it reported "
                         f"by ray_ckpt.train.attach?")
    return ptr["storage_uri"], (ptr["step"] if step is None else step)


def export(uri: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, format: str = "safetensors",
           storage_options: dict | None = None, fallback: bool = False, overwrite: bool = False) -> dict:
    """Write step ``step`` (None = latest) of the lineage at ``uri`` to the directory ``out`` as ``safetensors``
    (model and optimizer files), ``dcp`` (a PyTorch Distributed Checkpoint) or ``torch`` (``checkpoint.pt``),
    without the model's code (see :mod:`ray_ckpt.engine.export`). Returns what was written. ``uri`` may be a
    pointer checkpoint as in :func:`restore`. Progress is logged (logger ``ray_ckpt``). Calling process."""
    from ray_ckpt.engine import export as _export
    uri, step = _from_pointer(uri, step)
    storage = open_uri(uri, storage_options)
    last = {"t": 0.0}

    def progress(phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last["t"] >= 2.0 or (total and done == total):
            last["t"] = now
            log.info("ray_ckpt: export %s: %d%s", phase, done, f"/{total}" if total else "")

    return _export.export(storage, out, step=step, fmt=format, fallback=fallback, overwrite=overwrite,
                          progress=progress)


def load_export(path: str | os.PathLike) -> dict:
    """An export written by :func:`export` / ``ray-ckpt export``, any format: ``{"step", "model",
    "optimizer", "param_names", "loop"}`` with ``optimizer`` keyed as ``optimizer.state_dict()`` keys it, ready
    for ``model.load_state_dict`` / ``optimizer.load_state_dict``. Calling process."""
    from ray_ckpt.engine.export import load_export as _load
    return _load(path)


def _check_sharded_support(impl, shard_spec, rt: TrainerRuntime) -> None:
    """What sharded (FSDP2) state supports so far: LowDiff (dense gradient shards), and Amber (increments of
    each rank's shards, element-wise bound, so it holds for the consolidated tensors too) where the runtime
    supports it (:meth:`~ray_ckpt.engine.runtimes.TrainerRuntime.check_strategy`)."""
    if shard_spec is None:
        return
    if impl.name not in ("lowdiff", "amber"):
        raise NotImplementedError(f"sharded (FSDP2) state is checkpointed with LowDiff or Amber; {impl.name!r} is "
                                  f"not supported for it yet")
    rt.check_strategy(impl, shard_spec)


def _local_runtime() -> TrainerRuntime:
    return LocalRuntime()


def _ray_runtime() -> TrainerRuntime:
    from ray_ckpt.runtime.trainer.ray_runtime import RayRuntime   # imports Ray: only when runtime="ray" is asked for
    return RayRuntime()


#: the runtime of each :class:`~ray_ckpt.config.Runtime`, made on demand (a new one per attach or restore)
_RUNTIMES = {Runtime.LOCAL: _local_runtime, Runtime.RAY: _ray_runtime}


def runtime_for(kind: Runtime) -> TrainerRuntime:
    """The :class:`~ray_ckpt.engine.runtimes.TrainerRuntime` of ``kind`` (a new one: it holds one attach's
    state). Training process."""
    return _RUNTIMES[kind]()


def open_uri(uri, storage_options: dict | None = None):
    """A StorageBackend for a URI / path, or ``uri`` itself when it already is a backend."""
    if callable(getattr(uri, "write", None)) and callable(getattr(uri, "read", None)):
        if storage_options:
            raise ValueError("storage_options apply to a URI, not to an opened storage backend")
        return uri
    return _storage.open_storage(os.fspath(uri), **(storage_options or {}))
