"""The container's framing constants and its error, apart from :mod:`ray_ckpt.format.container` so that code
which only frames, checks and joins encoded bytes (:mod:`ray_ckpt.format.segments`, the persistence worker actor)
imports neither torch nor the tensor codecs: such an actor starts faster and holds less memory (figures:
docs/benchmark-log.md). Pure layer; runs in any process.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import struct
import zlib

from ray_ckpt.errors import RayCkptError

MAGIC = b"RCKPT\x00\x01\x00"
ALIGN = 64
MAX_HEADER_BYTES = 64 * 1024 * 1024
PREFIX = struct.Struct("<8sQI")   #: magic, header length (u64), header checksum (u32): every object's first bytes
#: set within :func:`unsealed`: :func:`ray_ckpt.format.container.encode` leaves the data checksum out
UNSEALED: contextvars.ContextVar[bool] = contextvars.ContextVar("ray_ckpt_unsealed", default=False)
NULL_TAIL = b',"data_crc":null}'   #: how the header of a container without its data checksum ends


def crc_tail(crc: int, alg: str) -> str:
    """The header's last fields for a data checksum ``crc`` of algorithm ``alg`` (absent for zlib's CRC-32, as
    every object written before CRC-32C has it)."""
    return f',"data_crc":{crc}' + (f',"data_crc_alg":{json.dumps(alg)}' if alg != "crc32" else "")


def head_buffer(header: bytes) -> bytes:
    """An object's first buffer: the prefix, ``header`` and the padding up to the data section."""
    prefix = PREFIX.pack(MAGIC, len(header), zlib.crc32(header))
    return prefix + header + bytes((-(len(prefix) + len(header))) % ALIGN)


@contextlib.contextmanager
def unsealed():
    """Within this context (this thread or task), :func:`ray_ckpt.format.container.encode` leaves the data checksum
    out (``"data_crc":null``) for :func:`ray_ckpt.format.segments.seal` to add where the bytes are read anyway: the
    training process's sender encodes a chunk so, and the node's persistence worker seals it as it takes the bytes
    (the pass over them runs off the training process). An unsealed container is never stored: a verified read
    rejects it."""
    token = UNSEALED.set(True)
    try:
        yield
    finally:
        UNSEALED.reset(token)


class CorruptObjectError(RayCkptError, ValueError):
    """An object failed validation (bad magic, checksum mismatch, truncated, hostile header). Names the object."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"corrupt checkpoint object {name!r}: {reason}")
        self.object_name = name
        self.reason = reason
