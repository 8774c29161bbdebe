"""One interface for the runtimes ``Checkpointer`` and ``restore`` run on, and the local one.

:class:`TrainerRuntime` states what the public entry points ask of a runtime: check and complete the config,
name the lineage's run, make the sink of an attach (lease or coordinator, generation, frequency policy), secure the
attach full, report the policy, plan and record a restore. :class:`LocalRuntime` (``runtime="local"``) is the
engine's writer thread in this process; the Ray runtime (``runtime="ray"``) is
``ray_ckpt.runtime.trainer.ray_runtime.RayRuntime``, imported only when asked for (``ray_ckpt.api`` picks one by
:class:`~ray_ckpt.config.Runtime`), so that the local path never imports Ray.

Everything here runs in the training process (or the process calling ``restore``), on its calling thread unless a
method says otherwise. Call order of an attach::

    check_strategy → check_config → resolve_config → lineage_run → attach → (the attach full is submitted) → secure_first_full
    → on_window (each measured window) / policy_report (any time)

and of a restore: ``sharded_memory`` or ``load_plan``, then ``record_restore``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray_ckpt.config import CheckpointConfig, Runtime
from ray_ckpt.engine.lease import Lease
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.sink import Sink
from ray_ckpt.engine.writer import AsyncWriter
from ray_ckpt.policy import FixedFrequencyPolicy
from ray_ckpt.policy.adaptive import CommitFeed


@dataclass
class Attached:
    """What :meth:`TrainerRuntime.attach` made: the run, the generation, the frequency policy and the sink (held
    by the attachment, which closes it on release)."""

    run: str | None
    generation: int
    policy: Any
    sink: Sink


class TrainerRuntime:
    """What ``Checkpointer`` and ``restore`` ask of a runtime (see the module docstring). Training process."""

    kind: Runtime
    #: whether this process watches its own node's drains (a ``runtime="ray"`` sink hears of them from the
    #: coordinator instead)
    watches_node_drains: bool = True

    def check_strategy(self, impl, shard_spec) -> None:
        """Raise when this runtime does not support ``impl`` for ``shard_spec`` (None: unsharded state)."""

    def check_config(self, config: CheckpointConfig) -> None:
        """Raise when ``config`` asks for what this runtime does not do."""

    def resolve_config(self, config: CheckpointConfig, shard_spec) -> CheckpointConfig:
        """``config`` completed for this runtime and ``shard_spec`` (None: unsharded state)."""
        return config

    def lineage_run(self, storage, run: str | None, shard_spec) -> str | None:
        """The run an attach or restore of this (shard) lineage belongs to."""
        return run

    def attach(self, storage, impl, attachment, *, run: str | None, config: CheckpointConfig, info: dict,
               takeover: bool) -> Attached:
        """Take what an attach needs (held by ``attachment``: released on failure or close) and make its sink."""
        raise NotImplementedError

    def secure_first_full(self, sink: Sink, *, restated: bool, first_state: bool) -> None:
        """Return once the attach full just submitted is as safe as this runtime promises at attach (``restated``:
        it restates a step the lineage already holds safe; ``first_state``: a run's first state). Default:
        nothing to wait for (a written step is durable once the writer commits it)."""

    def on_window(self, window) -> None:
        """A measured window of the training thread (:class:`ray_ckpt.policy.budget.Window`). Training thread."""

    def policy_report(self, storage, run: str | None) -> dict | None:
        """What the adaptive policy decides and why (None with policy="fixed"). Any thread."""
        return None

    def sharded_memory(self, run: str | None) -> Any:
        """The memory tier sharded restores read through (None: storage alone)."""
        return None

    def load_plan(self, storage, step: int | None, *, run: str | None, fallback: bool) -> tuple[Any, dict] | None:
        """``(chain, tiers)`` of an unsharded restore planned by this runtime, or None: resolve it from storage.
        ``tiers``: ``"source"`` (where the state came from: ``"replica"``, ``"memory"``, ``"storage"``,
        ``"memory+storage"``), ``"replayed"`` (records replayed), ``"unsafe"`` (objects of the plan neither durable
        nor held on two nodes)."""
        return None

    def record_restore(self, storage, run: str | None, seconds: float) -> None:
        """A finished restore (metrics)."""


class LocalRuntime(TrainerRuntime):
    """``runtime="local"``: a writer thread of this process (:class:`~ray_ckpt.engine.writer.AsyncWriter`) under a
    lease of the lineage; with ``policy="adaptive"`` the cost model is fed here (:class:`CommitFeed`)."""

    kind = Runtime.LOCAL

    def __init__(self) -> None:
        self.feed: CommitFeed | None = None

    def check_config(self, config: CheckpointConfig) -> None:
        if config.durable_diffs not in ("all", "auto"):
            raise ValueError(f"durable_diffs={config.durable_diffs!r} needs runtime='ray' (a memory tier on "
                             f"two nodes); runtime={self.kind.value!r} writes every step")

    def attach(self, storage, impl, attachment, *, run: str | None, config: CheckpointConfig, info: dict,
               takeover: bool) -> Attached:
        # one writer per lineage (LeaseError names the holder), shared by the writers of one run (Ray Train restarts)
        lease = attachment.take_lease(Lease(storage, run=run), takeover=takeover)
        lineage, _ = load_lineage(storage, strict=False)
        generation = lineage.next_generation()
        c, att = config, attachment
        # policy="adaptive": tuned in the writer thread after each commit (the callback holds no Checkpointer)
        self.feed = feed = CommitFeed(storage, c.full_every, c.batch_steps, **c.policy_options()) \
            if c.policy == "adaptive" else None
        sink = att.hold_sink(AsyncWriter(
            storage, generation, impl, max_pending_bytes=c.max_pending_bytes,
            write_retries=c.write_retries, write_timeout=c.write_timeout, info=info, index=lineage.manifests,
            keep_fulls=c.keep_fulls, lease=lease,
            on_commit=(lambda m: feed.observe(m, att.sink, att.capture)) if feed is not None else None))
        policy = feed.policy if feed is not None else FixedFrequencyPolicy(c.full_every, c.batch_steps)
        return Attached(run, generation, policy, sink)

    def on_window(self, window) -> None:
        if self.feed is not None:
            self.feed.observe_window(window)

    def policy_report(self, storage, run: str | None) -> dict | None:
        return self.feed.report() if self.feed is not None else None
