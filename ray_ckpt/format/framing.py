"""The container's framing constants and its error, apart from :mod:`ray_ckpt.format.container` so that code
which only frames, checks and joins encoded bytes (:mod:`ray_ckpt.format.segments`, the persistence worker actor)
imports neither torch nor the tensor codecs: such an actor starts faster and holds less memory (figures:
docs/benchmark-log.md). Pure layer; runs in any process.
"""
from __future__ import annotations

import struct

from ray_ckpt.errors import RayCkptError

MAGIC = b"RCKPT\x00\x01\x00"
ALIGN = 64
MAX_HEADER_BYTES = 64 * 1024 * 1024
PREFIX = struct.Struct("<8sQI")   #: magic, header length (u64), header checksum (u32): every object's first bytes


class CorruptObjectError(RayCkptError, ValueError):
    """An object failed validation (bad magic, checksum mismatch, truncated, hostile header). Names the object."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"corrupt checkpoint object {name!r}: {reason}")
        self.object_name = name
        self.reason = reason
