"""The public entry points ``Checkpointer`` and ``restore``: capture (engine) → a sink → storage.

Everything here runs in the training process. ``runtime="local"`` uses the engine's writer thread and needs no
Ray; ``runtime="ray"`` swaps in the Ray runtime's sink (persistence actors, coordinator), imported lazily so
that the local path never imports Ray. This module sits above ``engine`` and ``runtime``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from ray_ckpt.config import Amber, CheckpointConfig, LowDiff
from ray_ckpt.engine.lease import Lease
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.loopstate import ATTACHED_ATTR, RESTORED_STEP_ATTR, check_not_attached
from ray_ckpt.engine.restore import apply_chain, resolve_and_load
from ray_ckpt.engine.strategy import impl_for
from ray_ckpt.engine.writer import AsyncWriter
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import ManifestError
from ray_ckpt.storage.base import ObjectNotFound
from ray_ckpt.policy import FixedFrequencyPolicy
from ray_ckpt.policy.adaptive import AdaptivePolicy, make_tuner, publish_report
from ray_ckpt import storage as _storage
from ray_ckpt.engine import sharded as _sharded

log = logging.getLogger("ray_ckpt")


class Checkpointer:
    """Checkpoint every optimizer step of a training loop to ``uri``; attach once, then train as usual.

    ``runtime="ray"`` hands captured steps to this node's PersistenceWorker actor (memory tier, peer replica,
    durable writes) and registers them with the run's coordinator (``run`` names it; default: derived from
    ``uri``); Ray must be initialized. ``runtime="local"`` writes from a thread of this process.

    Runs in the training process. Construction takes the first full checkpoint (step ``start_step``, by default
    the step a preceding :func:`restore` returned, else 0) and installs hooks on ``optimizer`` (and wraps
    ``scheduler.step``); from then on each ``optimizer.step()`` is captured (a copy at most) and written by a
    background thread in batches of ``batch_steps`` steps, with a full checkpoint every ``full_every`` steps.

    ``extra_state``, ``scheduler`` and ``scaler`` are objects with ``state_dict()``/``load_state_dict()``; the
    same objects are given to :func:`restore`. Use as a context manager or call :meth:`close`.

    One writer per lineage: a second Checkpointer (another job) on the same ``uri`` raises
    :class:`~ray_ckpt.engine.lease.LeaseError` naming the holder, unless ``takeover=True`` (take over a lease
    whose job is gone; logged). With ``runtime="ray"`` the lease belongs to the run; with ``runtime="local"``
    and ``run`` given it is shared by the writers of that run (a restarted worker group continues).

    Sharded state (FSDP2 ``fully_shard``: parameters are DTensor shards on a 1-D mesh): create a Checkpointer on
    every rank; each writes its own shard lineage below ``uri`` (``shards/w<world>/r<rank>/``) with LowDiff, and
    :func:`restore` on every rank of any world size restores the newest step all saved ranks hold, resharding
    when the world size changed (see :mod:`ray_ckpt.engine.sharded`). With ``runtime="ray"`` every shard lineage
    is a run of its own (``run`` + ``:shard-w<world>-r<rank>``): its coordinator, node workers and replica.

    ``durable_diffs`` (``runtime="ray"``): what the durable tier gets besides the fulls — ``"all"`` (default:
    every step's record), ``"fulls"`` (step records stay in memory on two nodes), or ``"amber"`` / an
    ``Amber(...)`` (LowDiff with the replica: as ``"fulls"``, and the state tier's replica writes Amber increments
    of its own state, so that every step restores from storage alone within the Amber bound; the trainer sends
    nothing more for them; see :mod:`ray_ckpt.engine.amber_tier`).

    Storage writes are retried with backoff for ``write_timeout`` seconds (default 300): an outage shorter than
    that costs time (the training thread waits once ``max_pending_bytes`` is held), never data; beyond it
    the next step raises :class:`WriterError`.

    ``policy="adaptive"`` (default) lets the policy choose ``full_every``/``batch_steps`` online from measured
    costs and failures (``mtbf_hint``: prior MTBF in seconds); values given explicitly are kept, and
    :meth:`policy_report` / ``stats()["policy"]`` say what it would choose and why. ``policy="fixed"``: never.
    """

    def __init__(self, uri: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 scheduler: Any = None, strategy: Any = None, full_every: int | None = None,
                 batch_steps: int | None = None, extra_state: Any = None, scaler: Any = None,
                 storage_options: dict | None = None, start_step: int | None = None,
                 max_pending_bytes: int | None = None, capture_rng: bool | None = None,
                 runtime: str = "local", run: str | None = None, memory_budget: int | None = None,
                 keep_fulls: int | None = None, replica: bool | None = None, handoff_delay: float | None = None,
                 policy: str | None = None, mtbf_hint: float | None = None,
                 durable_diffs: str | Amber | None = None, write_timeout: float | None = None, takeover: bool = False):
        model = _unwrap(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        shard_spec = _check_params(optimizer)
        strategy = strategy if strategy is not None else LowDiff()
        impl = impl_for(strategy)
        durable_amber_cfg = None
        if isinstance(durable_diffs, Amber):
            durable_amber_cfg, durable_diffs = durable_diffs, "amber"
        if runtime not in ("local", "ray"):
            raise ValueError(f"runtime must be 'local' (a writer thread in this process) or 'ray' (persistence "
                             f"actors), got {runtime!r}")
        if shard_spec is not None:
            _check_sharded_support(impl)
        self.config = CheckpointConfig.resolve(full_every=full_every, batch_steps=batch_steps,
                                               max_pending_bytes=max_pending_bytes, capture_rng=capture_rng,
                                               memory_budget=memory_budget, keep_fulls=keep_fulls,
                                               replica=replica, handoff_delay=handoff_delay,
                                               policy=policy, mtbf_hint=mtbf_hint, durable_diffs=durable_diffs,
                                               write_timeout=write_timeout)
        if self.config.durable_diffs != "all" and runtime != "ray":
            raise ValueError(f"durable_diffs={self.config.durable_diffs!r} needs runtime='ray' (a memory tier on "
                             f"two nodes); runtime={runtime!r} writes every step")
        durable_amber = _durable_amber(durable_amber_cfg, self.config, impl, shard_spec)
        self.runtime = runtime
        self.strategy = strategy
        self.storage = open_uri(uri, storage_options)
        self.shard_spec = shard_spec
        if shard_spec is not None:   # FSDP2: this rank's shard lineage (see ray_ckpt.engine.sharded)
            _sharded.mark_world(self.storage, shard_spec)
            self.storage = _sharded.shard_storage(self.storage, shard_spec.world, shard_spec.rank)
            if runtime == "ray":     # a run per shard lineage: its coordinator, node workers and replica
                run = _sharded.shard_run(run, shard_spec.world, shard_spec.rank)
                if memory_budget is None:   # the node's object store is shared by the shard runs of its ranks
                    from ray_ckpt.runtime.client import node_share
                    self.config = dataclasses.replace(self.config, memory_budget=node_share(
                        self.config.memory_budget, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
        self.uri = self.storage.describe()
        if start_step is None:
            start_step = getattr(optimizer, RESTORED_STEP_ATTR, 0)
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        info = {"num_params": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
                "optimizer": type(optimizer).__name__, "start_step": start_step}
        if durable_amber is not None:   # the replica computes the Amber tier's increments with these settings
            info["durable_amber"] = dataclasses.asdict(durable_amber)
        if getattr(optimizer, ATTACHED_ATTR, None) is not None:   # before anything is acquired
            raise RuntimeError("this optimizer already has a ray_ckpt capture attached; close() it first")
        self._tuner = None
        self._lease = None
        self._writer = None
        try:
            policy = self._attach_sink(impl, run, info, takeover)
            fp_every = self.config.fingerprint_every if getattr(self._writer, "replica_enabled", False) else 0
            self._capture = impl.make_capture(model, optimizer, self._writer, policy, start_step=start_step,
                                              scheduler=scheduler, scaler=scaler, extra_state=extra_state,
                                              capture_rng=self.config.capture_rng, fingerprint_every=fp_every)
            self._capture._copy.pool.max_bytes = self.config.max_pending_bytes
            if shard_spec is not None:
                self._capture.sharding = _sharded.sharding_info(shard_spec)
        except BaseException:      # bad arguments found late: nothing stays held (writer thread, lease)
            if self._writer is not None:
                self._writer.close()
            if self._lease is not None:
                self._lease.release()
            raise
        attach_capture = getattr(self._writer, "attach_capture", None)
        if attach_capture is not None:  # runtime="ray": the sender publishes the capture's Ray metrics
            attach_capture(self._capture, start_step)
        self._closed = False
        self._start_step = start_step
        try:
            self._writer.submit(self._capture.snapshot_now())
            if runtime == "ray":  # held on two nodes (durable on a one-node cluster) when attach returns
                self._writer.wait_safe()
        except BaseException:
            self._capture.detach()
            self._writer.close()
            if self._lease is not None:
                self._lease.release()
            raise
        log.info("ray_ckpt: attached to %s (generation %d, start step %d)", self.storage.describe(),
                 self.generation, start_step)

    def _attach_sink(self, impl, run, info: dict, takeover: bool):
        """The lease (local), the generation and the sink of this attach; returns the frequency policy."""
        if self.runtime == "local":
            self._lease = Lease(self.storage, run=run)   # shared by the writers of one run (Ray Train restarts)
            self._lease.acquire(takeover=takeover)      # one writer per lineage (LeaseError names the holder)
            lineage, _ = load_lineage(self.storage, strict=False)
            self.generation = lineage.next_generation()
            policy = self._local_policy()
            self._writer = AsyncWriter(self.storage, self.generation, impl,
                                       max_pending_bytes=self.config.max_pending_bytes,
                                       write_retries=self.config.write_retries,
                                       write_timeout=self.config.write_timeout, info=info,
                                       index=lineage.manifests, keep_fulls=self.config.keep_fulls,
                                       lease=self._lease,
                                       on_commit=self._observe_commit if self._tuner is not None else None)
            return policy
        from ray_ckpt.runtime.client import attach_sink
        self.run, self.generation, policy, self._writer = attach_sink(
            self.storage, impl, run=run, config=self.config, info=info, takeover=takeover)
        return policy

    def _local_policy(self):
        """runtime="local": the frequency policy; with policy="adaptive" a tuner fed by the writer thread."""
        c = self.config
        if c.policy == "fixed":
            return FixedFrequencyPolicy(c.full_every, c.batch_steps)
        policy = AdaptivePolicy(c.full_every, c.batch_steps, pinned=c.pinned, clock=time.perf_counter)
        self._tuner = make_tuner(c.full_every, c.batch_steps, pinned=c.pinned, mtbf_hint=c.mtbf_hint,
                                 background_cost=c.background_cost, request_budget=c.request_budget,
                                 max_full_every=c.max_full_every, memory_budget=c.max_pending_bytes,
                                 started_at=time.time(), policy=policy)
        self._seen = (0.0, 0.0)
        return policy

    def _observe_commit(self, m) -> None:
        """Writer thread, after each commit: feed the cost model, re-decide (rate-limited), publish changes."""
        st = self._writer.stats
        write_s, encode_s = st.write_seconds - self._seen[0], st.encode_seconds - self._seen[1]
        self._seen = (st.write_seconds, st.encode_seconds)
        capture = getattr(self, "_capture", None)
        block = capture.last_snapshot_seconds if (m.kind == "full" and capture is not None) else None
        self._tuner.observe_commit(kind=m.kind, nbytes=m.nbytes, write_s=write_s, encode_s=encode_s,
                                   steps=m.last_step - m.first_step + 1, block_s=block)
        self._tuner.model.observe_memory("writer", self._writer.pending_bytes)
        before = len(self._tuner.history)
        now = time.time()
        self._tuner.decide(now)
        if len(self._tuner.history) != before:
            publish_report(self.storage, self._tuner.report(now))

    def policy_report(self) -> dict | None:
        """What the adaptive policy decides and why (None with policy="fixed"). Any thread."""
        if self._tuner is not None:
            return self._tuner.report(time.time())
        if self.runtime == "ray":  # the coordinator owns the policy
            from ray_ckpt.runtime.client import policy_report
            return policy_report(self.storage, self.run)
        return None

    @property
    def step(self) -> int:
        """Optimizer steps taken (since 0 of the run, counting a restored prefix)."""
        return self._capture.step

    @property
    def last_committed_step(self) -> int | None:
        """The highest step whose diff or full object is committed (durable)."""
        return self._writer.stats.last_committed_step

    def flush(self, timeout: float | None = None) -> None:
        """Make every step captured so far durable. Training thread; blocks."""
        self._capture.flush_pending()
        self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, detach the hooks and stop the writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._capture.flush_pending()
            self._writer.close(timeout)
        finally:
            self._capture.detach()
            if self._lease is not None:
                self._lease.release()

    def stats(self) -> dict:
        """Counters for logs and benchmarks (training process). ``durable_lag_steps``: steps captured but not yet
        committed (``runtime="local"``: written; ``runtime="ray"``: handed to the persistence tier, whose
        ``runtime.restorable`` says what is durable). ``runtime="ray"`` adds the node worker's and
        the replica's figures (one actor call each): ``write_seconds``/``durable_bytes`` are the worker's
        durable writes, ``encode_seconds`` the sender thread's encode + hand-off time. With Amber, ``amber``
        counts the fulls its chain policy asked for (``early_fulls``: a merged increment grew too large) and the
        merge requests (``merges``)."""
        s = self._writer.stats
        committed = s.last_committed_step
        out = {"step": self.step, "generation": self.generation, "last_committed_step": committed,
               # nothing committed yet: the attach full itself is pending too
               "durable_lag_steps": self.step - (committed if committed is not None else self._start_step - 1),
               "objects_written": s.objects_written, "bytes_written": s.bytes_written,
               "diff_bytes": s.diff_bytes, "full_bytes": s.full_bytes, "stall_seconds": s.stall_seconds,
               "write_seconds": s.write_seconds, "encode_seconds": s.encode_seconds,
               "capture_seconds": self._capture.capture_seconds, "pending_bytes": self._writer.pending_bytes,
               "trainer_fulls": self._capture.full_snapshots,
               "full_every": self._capture.policy.full_every, "batch_steps": self._capture.policy.batch_steps,
               "policy": self.policy_report()}
        if hasattr(self._capture, "early_fulls"):   # Amber: why fulls were taken, and the merged increments
            out["amber"] = {"early_fulls": self._capture.early_fulls, "merges": self._capture.merges}
        runtime_stats = getattr(self._writer, "runtime_stats", None)
        if runtime_stats is not None:
            rt = runtime_stats()
            w = rt.get("worker", {})
            out.update(write_seconds=w.get("write_seconds", 0.0), durable_bytes=w.get("bytes_written", 0),
                       durable_objects=w.get("objects_written", 0), runtime=rt)
        return out

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort: never leave hooks on a live optimizer
        try:
            if not self._closed:
                self._capture.detach()
                self._writer.close(timeout=5)
                if self._lease is not None:
                    self._lease.release()
        except Exception:  # noqa: BLE001
            pass


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
            runtime: str = "local", run: str | None = None) -> int:
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
    nodes where they are held (memory tier), from storage otherwise; without a coordinator it reads storage.

    Sharded (FSDP2) ``model``/``optimizer``: call on every rank; each restores its shards of ``step`` (None: the
    newest step every saved rank holds; a step one rank lacks raises NoCheckpointError) from storage, at the saved
    world size or resharded to this one. No collectives: every rank decides from storage alone — with
    ``runtime="ray"`` from storage and the shard runs' coordinators (memory tier; a shard's replica gives its
    state at the step without replay).
    """
    t0 = time.perf_counter()
    model = _unwrap(model)
    check_not_attached(optimizer)
    shard_spec = _check_params(optimizer)
    uri, step = _from_pointer(uri, step)
    storage = open_uri(uri, storage_options)
    if shard_spec is not None:
        memory = None
        if runtime == "ray":
            from ray_ckpt.runtime.client import ShardedMemoryTier
            memory = ShardedMemoryTier(run)
        elif runtime != "local":
            raise ValueError(f"runtime must be 'local' or 'ray', got {runtime!r}")
        out = _sharded.restore_sharded(storage, model, optimizer, shard_spec, step=step, scheduler=scheduler,
                                       scaler=scaler, extra_state=extra_state, fallback=fallback,
                                       restore_rng=restore_rng, memory=memory)
        dt = time.perf_counter() - t0
        log.info("ray_ckpt: restored step %d (sharded) from %s in %.3f s%s", out, storage.describe(), dt,
                 "" if memory is None else f" (shard objects: {memory.tiers})")
        if memory is not None:
            from ray_ckpt.runtime.client import record_restore
            record_restore(storage, run, dt)
        return out
    chain = None
    if runtime == "ray":
        from ray_ckpt.runtime.client import load_via_coordinator
        try:
            got = load_via_coordinator(storage, step, run=run)
        except (CorruptObjectError, ManifestError, ObjectNotFound) as e:
            if not fallback:
                raise
            log.warning("ray_ckpt: the coordinator's plan failed (%s); falling back to storage", e)
            got = None
        if got is not None:
            chain, tiers = got
            log.info("ray_ckpt: plan read %d objects from the memory tier, %d from storage", tiers["memory"],
                     tiers["durable"])
    elif runtime != "local":
        raise ValueError(f"runtime must be 'local' or 'ray', got {runtime!r}")
    if chain is None:
        chain = resolve_and_load(storage, step, fallback=fallback)
    out = apply_chain(chain, model, optimizer, scheduler=scheduler, scaler=scaler, extra_state=extra_state,
                      restore_rng=restore_rng)
    dt = time.perf_counter() - t0
    log.info("ray_ckpt: restored step %d (full %d + %d diffs) from %s in %.3f s", out, chain.full.step,
             len(chain.records), storage.describe(), dt)
    if runtime == "ray":
        from ray_ckpt.runtime.client import record_restore
        record_restore(storage, run, dt)
    return out


POINTER_FILE = "ray_ckpt_pointer.json"


def read_pointer(checkpoint) -> dict | None:
    """The pointer (``{"storage_uri", "run", "step"}``) in a checkpoint reported by
    :func:`ray_ckpt.train.attach` (anything with ``as_directory()``); None when it holds no pointer file."""
    import json
    with checkpoint.as_directory() as d:
        path = os.path.join(d, POINTER_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)


def write_pointer(directory: str, pointer: dict) -> None:
    """Write the pointer file into ``directory`` (a checkpoint directory about to be reported)."""
    import json
    with open(os.path.join(directory, POINTER_FILE), "w") as f:
        json.dump(pointer, f)


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


def _check_params(optimizer: torch.optim.Optimizer) -> "_sharded.ShardSpec | None":
    """The sharding of the optimizer's parameters (FSDP2 DTensor shards), None for plain tensors (replicated
    state, as with DDP); refuses, at attach/restore, other tensor subclasses and unsupported sharding, which
    would fail later in a background thread with a less clear error. Training process."""
    spec = _sharded.spec_of(optimizer)
    if spec is not None:
        return spec
    for group in optimizer.param_groups:
        for p in group["params"]:
            kind = type(p.data)
            if kind is not torch.Tensor:
                raise NotImplementedError(f"ray_ckpt checkpoints parameters that are plain torch.Tensors or "
                                          f"FSDP2 DTensor shards; this optimizer holds a "
                                          f"{kind.__module__}.{kind.__name__}")
    return None


def _check_sharded_support(impl) -> None:
    """What sharded (FSDP2) state supports so far: LowDiff (dense gradient shards)."""
    if impl.name != "lowdiff":
        raise NotImplementedError(f"sharded (FSDP2) state is checkpointed with LowDiff; {impl.name!r} is not "
                                  f"supported for it yet")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state is checkpointed: DistributedDataParallel is unwrapped (its ``module``)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def open_uri(uri, storage_options: dict | None = None):
    """A StorageBackend for a URI / path, or ``uri`` itself when it already is a backend."""
    if callable(getattr(uri, "write", None)) and callable(getattr(uri, "read", None)):
        if storage_options:
            raise ValueError("storage_options apply to a URI, not to an opened storage backend")
        return uri
    return _storage.open_storage(os.fspath(uri), **(storage_options or {}))
