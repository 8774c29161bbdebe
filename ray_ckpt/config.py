"""All tunables in one place. An explicit argument wins over a ``RAY_CKPT_*`` environment variable, which wins
over the default. Pure: no torch, no Ray.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

_GiB = 1 << 30


def _env(name: str, default, cast):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


@dataclass(kw_only=True, frozen=True)
class LowDiff:
    """LowDiff: each step's consumed (aggregated, compressed) gradient is that step's differential checkpoint.

    Recovery loads the last full checkpoint and replays the gradients through the optimizer: bit-exact on the
    same device type with a deterministic optimizer.
    """

    #: a dense gradient is stored sparse (index + value) when that is smaller than this fraction of its dense
    #: bytes; 0 disables the scan (it runs off the training thread, O(numel)).
    max_sparse_density: float = 0.5
    #: copy model buffers (BatchNorm statistics ...) into every step record: they change in forward, not in
    #: the optimizer, so replay cannot rebuild them.
    capture_buffers: bool = True

    name = "lowdiff"

    def __post_init__(self):
        if not 0.0 <= self.max_sparse_density <= 1.0:
            raise ValueError(f"max_sparse_density must be in [0, 1], got {self.max_sparse_density}")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Knobs of a :class:`ray_ckpt.Checkpointer`. Every field has a ``RAY_CKPT_<FIELD>`` env override."""

    #: take a full checkpoint every this many optimizer steps (and always at attach)
    full_every: int = 100
    #: steps per diff object written to storage (one object amortizes the write latency)
    batch_steps: int = 10
    #: bytes of captured-but-not-yet-durable state allowed in memory; the training thread waits beyond it
    max_pending_bytes: int = 1 * _GiB
    #: capture torch / CUDA / Python / numpy RNG states with every step
    capture_rng: bool = True
    #: attempts per storage write before the writer reports an error
    write_retries: int = 3
    #: runtime="ray": bytes each node's PersistenceWorker may hold in the object store (durable objects are
    #: released oldest first beyond it; the newest full is kept)
    memory_budget: int = 2 * _GiB

    def __post_init__(self):
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1 (a full checkpoint every N steps), got {self.full_every}")
        if self.batch_steps < 1:
            raise ValueError(f"batch_steps must be >= 1, got {self.batch_steps}")
        if self.max_pending_bytes < 1 << 20:
            raise ValueError(f"max_pending_bytes must be at least 1 MiB, got {self.max_pending_bytes}")
        if self.memory_budget < 1 << 20:
            raise ValueError(f"memory_budget must be at least 1 MiB, got {self.memory_budget}")
        if self.write_retries < 1:
            raise ValueError(f"write_retries must be >= 1, got {self.write_retries}")

    @classmethod
    def resolve(cls, **explicit) -> "CheckpointConfig":
        """Build a config: explicit (non-None) arguments, then ``RAY_CKPT_*`` env vars, then defaults."""
        kw = {}
        for f in fields(cls):
            if explicit.get(f.name) is not None:
                kw[f.name] = explicit[f.name]
                continue
            cast = {bool: _bool, int: int, float: float}.get(type(f.default), str)
            kw[f.name] = _env(f"RAY_CKPT_{f.name.upper()}", f.default, cast)
        unknown = set(explicit) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown checkpoint options: {sorted(unknown)}")
        return cls(**kw)


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(s)


_bool.__name__ = "bool"
