"""HSDP (a 2-D (replicate, shard) device mesh): what a Checkpointer holds on a rank that writes nothing.

Replica 0 of every shard writes the shard's lineage (:mod:`ray_ckpt.engine.sharded`); the other replicas hold
the same parameter, gradient and optimizer-state bytes, so their Checkpointer neither captures nor writes: it
counts optimizer steps (``Checkpointer.step``) and stands in for the capture and the sink of an attach.
Training process of such a rank; no thread, no storage access.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ray_ckpt.engine.loopstate import ATTACHED_ATTR
from ray_ckpt.engine.sink import Sink, WriterStats


class ReplicaFollower:
    """The capture of a non-writing HSDP replica: an optimizer step post-hook that counts steps (the optimizer
    is marked attached, as by a capture, so a restore into it while attached is refused). Training thread."""

    capture_seconds = 0.0
    full_snapshots = 0

    def __init__(self, optimizer: torch.optim.Optimizer, start_step: int, full_every: int, batch_steps: int):
        if getattr(optimizer, ATTACHED_ATTR, None) is not None:
            raise RuntimeError("this optimizer already has a ray_ckpt capture attached; close() it first")
        self.optimizer = optimizer
        self.step = start_step
        self.policy = SimpleNamespace(full_every=full_every, batch_steps=batch_steps)
        self._handle = optimizer.register_step_post_hook(self._count)
        setattr(optimizer, ATTACHED_ATTR, self)

    def _count(self, *_args) -> None:
        self.step += 1

    def flush_pending(self) -> None:
        """Nothing is pending: this rank records nothing."""

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if getattr(self.optimizer, ATTACHED_ATTR, None) is self:
            delattr(self.optimizer, ATTACHED_ATTR)


class NoWrites(Sink):
    """The sink of a non-writing HSDP replica: nothing is handed over, so nothing is committed by this rank
    (``stats.last_committed_step`` stays None; replica 0 of the shard commits it). Training process."""

    def __init__(self) -> None:
        self.stats = WriterStats()

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for."""

    def close(self, timeout: float | None = None) -> None:
        """Nothing to stop."""
