"""Gradient support published by compression hooks, consumed by the capture.

A compression hook (for instance :func:`ray_ckpt.compression.topk_hook`) already knows, for each parameter,
which flat positions of its aggregated gradient are non-zero this step. Publishing those positions lets the
capture gather just those values (``O(k)``) instead of copying or scanning the dense gradient (``O(n)``).

Call order, per training step, all in the training process:

1. the DDP communication hook calls :func:`publish` for every parameter of its bucket (any thread);
2. DDP copies the bucket into ``param.grad``; the user may clip or unscale (scaling keeps the support);
3. the optimizer's step pre-hook installed by the capture calls :func:`take` once per parameter.

An entry is consumed by :func:`take`, so a stale support can never be applied to a later step.

A hook whose exchange failed marks the parameters of that backward pass failed instead (:func:`withdraw` with
the error): :func:`take` then raises that error, so a loop that catches the error ``backward()`` raised and calls
``optimizer.step()`` anyway does not have the step captured. The next :func:`publish` or :func:`withdraw` of
a parameter replaces its mark. Everything here is torch-only and thread-safe.
"""
from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch

_lock = threading.Lock()
# id(param) -> (weakref to param, int64 flat indices into param.grad.view(-1), or the error of a failed exchange)
_entries: dict[int, tuple[weakref.ref, torch.Tensor | BaseException]] = {}


def publish(param: torch.Tensor, flat_indices: torch.Tensor) -> None:
    """Record the flat indices (int64, sorted, unique, on any device) of ``param``'s non-zero gradient.

    Ownership of ``flat_indices`` passes to the capture (which keeps it without copying): the publisher must
    not modify it afterwards. Runs in the training process, called by a compression hook (possibly from an
    autograd thread).
    """
    if flat_indices.dtype != torch.int64 or flat_indices.dim() != 1:
        raise TypeError("flat_indices must be a 1-D int64 tensor")
    with _lock:
        _entries[id(param)] = (weakref.ref(param), flat_indices)


def withdraw(params: Iterable[torch.Tensor], error: BaseException | None = None) -> None:
    """Drop whatever was published for ``params``; with ``error``, mark them failed: :func:`take` raises
    ``error`` for each until it is published again. Training process, called by a compression hook (any
    thread)."""
    with _lock:
        for param in params:
            if error is None:
                _entries.pop(id(param), None)
            else:
                _entries[id(param)] = (weakref.ref(param), error)


def any_published() -> bool:
    """Whether any entry or failure mark is recorded (O(1), no lock: a capture that sees False takes every
    gradient dense and calls no :func:`take`; a publish racing with the step's own pre-hook cannot be for this
    step, whose backward pass is over). Training thread."""
    return bool(_entries)


def take(param: torch.Tensor) -> torch.Tensor | None:
    """Pop and return the published indices for ``param``, or ``None`` when nothing fresh was published.

    Raises the error a hook recorded with :func:`withdraw` when ``param``'s latest exchange failed; the mark
    stays until the next exchange replaces it, so every retry of the step raises. Training thread (the
    capture's optimizer pre-hook).
    """
    with _lock:
        entry = _entries.get(id(param))
        if entry is not None and not (isinstance(entry[1], BaseException) and entry[0]() is param):
            del _entries[id(param)]
    if entry is None:
        return None
    ref, idx = entry
    if ref() is not param:  # id reused by another object: the entry is stale
        return None
    if isinstance(idx, BaseException):
        raise idx
    return idx


def clear() -> None:
    """Drop every published entry and failure mark (tests, and a capture that detaches)."""
    with _lock:
        _entries.clear()
