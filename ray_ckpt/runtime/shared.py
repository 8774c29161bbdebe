"""Shared memory between a training process and its node's persistence worker: the hand-off of captured gradients
without a copy in the training process (Linux).

The capture copies each step's dense gradients into one buffer (:class:`ray_ckpt.engine.capture.PackedGrads`). With
the Ray runtime that buffer is carved out of a :class:`~ray_ckpt.runtime.trainer.arena.SharedArena` — an anonymous memory file (``memfd``) the
training process maps — and the chunk handed to the worker names it by a small descriptor instead of carrying its
bytes: the worker maps the same memory (:func:`resolve`, through ``/proc/<pid>/fd/<fd>``) and its ``ray.put``
makes the object-store copy on the worker's core. Without it, the training process pays that copy, an order of
magnitude more CPU than the capture's own copy of the same bytes into a recycled buffer (figures:
docs/benchmark-log.md; ``benchmarks/train_cpu.py``, "ray.put copy" and "capture copy").

A buffer is reused only once the chunk that named it is safe (held on two nodes or durable): the worker copies it
before it answers, and a restarted worker reads it again from the same memory when the sender resends the chunk.
The memory goes away with the training process (nothing named on a file system, nothing to clean up after a
crash); a worker drops its mapping of a process that is gone the next time it maps another.

Where this does not work (no ``memfd_create``, no access to the trainer's ``/proc`` entry, the worker on another
node), :func:`resolve` raises :class:`SharedMemoryUnavailable` and the sender falls back to handing the bytes over
(:class:`ray_ckpt.runtime.trainer.sink.RaySink`).

This module is the protocol both sides share (the descriptor, :class:`SharedMemoryUnavailable`) and the persistence
worker's side (:func:`resolve`); the training process's side, the arena, is :mod:`ray_ckpt.runtime.trainer.arena`.
"""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from ray_ckpt.errors import RayCkptError

#: the first element of a descriptor in a chunk's buffer list
TAG = "ray_ckpt.shm"
ALIGN = 4096


class SharedMemoryUnavailable(RayCkptError, RuntimeError):
    """The persistence worker cannot map the training process's shared memory (it then sends the bytes)."""


# -- persistence worker ----------------------------------------------------------------------------------------
_maps: dict = {}          # (pid, fd, inode) -> mmap
_maps_lock = threading.Lock()
_MAX_MAPS = 16


def is_descriptor(b) -> bool:
    return type(b) is tuple and len(b) == 6 and b[0] == TAG


def resolve(bufs: list) -> list:
    """The buffers of a handed-over chunk with each shared-memory descriptor replaced by a read-only view of that
    memory (persistence worker, before its ``ray.put``). Raises :class:`SharedMemoryUnavailable`."""
    if not any(is_descriptor(b) for b in bufs):
        return bufs
    return [_view(b) if is_descriptor(b) else b for b in bufs]


def _view(d: tuple) -> np.ndarray:
    _, pid, fd, ino, off, n = d
    key = (pid, fd, ino)
    with _maps_lock:
        mm = _maps.get(key)
        if mm is None:
            _sweep()
            try:
                f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
            except OSError as e:
                raise SharedMemoryUnavailable(f"cannot open the training process's shared memory: {e}") from None
            try:
                st = os.fstat(f)
                if st.st_ino != ino:
                    raise SharedMemoryUnavailable("the training process's shared memory is gone")
                mm = mmap.mmap(f, st.st_size, prot=mmap.PROT_READ)
            except OSError as e:
                raise SharedMemoryUnavailable(f"cannot map the training process's shared memory: {e}") from None
            finally:
                os.close(f)
            _maps[key] = mm
    if off + n > len(mm):
        raise SharedMemoryUnavailable(f"a descriptor beyond the shared memory ({off}+{n} > {len(mm)})")
    return np.frombuffer(mm, dtype=np.uint8, count=n, offset=off)


def _sweep() -> None:
    """Drop the mappings of training processes that are gone (or closed their arena), and the oldest beyond
    ``_MAX_MAPS``. Called with the lock held, when a new arena is mapped."""
    for key in list(_maps):
        pid, fd, ino = key
        try:
            alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == ino
        except OSError:
            alive = False
        if not alive or len(_maps) > _MAX_MAPS:
            mm = _maps.pop(key)
            try:
                mm.close()
            except BufferError:   # a view is still in use: the mapping goes with its last view
                pass
