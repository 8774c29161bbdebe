"""The buffers of a held object: a chunk the persistence workers keep in the object store, as ``ray.get`` returns it.

A held chunk is a list of uint8 arrays (the hand-off layout of :mod:`ray_ckpt.runtime.trainer.sink`) or one array. Used
by the workers, the replica and the plan reader; numpy only (the workers' processes import no torch). Any
process; pure functions (:func:`taken` maps a trainer's shared memory).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ray_ckpt.format import segments
from ray_ckpt.lineage import Manifest
from ray_ckpt.runtime import shared


def as_buffers(value) -> list:
    """The buffers of a held object as ``ray.get`` returns them (a list of arrays, or one array)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def join(value):
    """One contiguous buffer of a held object (a copy only when it has several parts)."""
    parts = as_buffers(value)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])


def taken(m: Manifest, buffers, sealed: bool) -> tuple[list, Manifest, int]:
    """``(buffers, manifest, nbytes)`` of a chunk a training process handed over as ``buffers`` (arrays, and
    descriptors of its shared memory, read in place here) under manifest ``m``: its size checked against the
    manifest, and, ``sealed=False``, sealed (:func:`ray_ckpt.format.segments.seal`; the manifest then gets the
    sealed object's size and checksum). The persistence worker, as it takes the chunk."""
    bufs = shared.resolve(as_buffers(buffers))
    nbytes = sum(memoryview(b).nbytes for b in bufs)
    if nbytes != m.nbytes:
        raise ValueError(f"chunk {m.name} arrived with {nbytes} bytes, its manifest says {m.nbytes}")
    if not sealed:
        bufs = segments.seal(bufs)
        crc, nbytes, alg = segments.object_crc(bufs)
        m = dataclasses.replace(m, nbytes=nbytes, crc32=crc, crc_alg=alg)
    return bufs, m, nbytes
