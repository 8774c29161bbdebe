"""The buffers of a held object: a chunk the persistence workers keep in the object store, as ``ray.get`` returns it.

A held chunk is a list of uint8 arrays (the hand-off layout of :mod:`ray_ckpt.runtime.trainer.sink`) or one array. Used
by the workers, the replica and the plan reader; numpy only (the workers' processes import no torch). Any
process; pure functions.
"""
from __future__ import annotations

import numpy as np


def as_buffers(value) -> list:
    """The buffers of a held object as ``ray.get`` returns them (a list of arrays, or one array)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def join(value):
    """One contiguous buffer of a held object (a copy only when it has several parts)."""
    parts = as_buffers(value)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])
