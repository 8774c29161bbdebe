"""The base of every exception ray_ckpt raises: ``except ray_ckpt.RayCkptError`` catches any of them.

Each ray_ckpt exception derives from :class:`RayCkptError` *and* keeps its builtin base (``ValueError``,
``RuntimeError``, ``LookupError``, ``FileNotFoundError``...), so code that catches those keeps working. Pure (it
imports nothing): every layer, the leaves included, may import it. Any process.
"""
from __future__ import annotations


class RayCkptError(Exception):
    """Base of every exception raised by ray_ckpt (storage faults, corrupt or missing checkpoints, a lineage
    written by another job, a restore the ranks could not agree on, ...)."""


__all__ = ["RayCkptError"]
