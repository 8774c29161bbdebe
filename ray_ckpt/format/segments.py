"""Segmented objects: one stored object made of several containers laid end to end.

A diff object on storage is a sequence of *segments*, each a complete container (:mod:`ray_ckpt.format.container`)
holding one or more step records. The training process encodes each record once, into one segment; the Ray
runtime's persistence worker then builds a batch object by laying segments end to end — no decode, no
re-encode — and computes the batch's checksum from the segments' checksums (:func:`combine_all`, no pass over
the bytes). A one-segment object is an ordinary container, so objects written before segmentation read
unchanged.

Pure layer: no torch needed; runs in any process.
"""
from __future__ import annotations

import json
import zlib

import numpy as np

from ray_ckpt.format import checksum, safejson
from ray_ckpt.format.framing import ALIGN, MAGIC, MAX_HEADER_BYTES, CorruptObjectError
from ray_ckpt.format.framing import NULL_TAIL, crc_tail, head_buffer
from ray_ckpt.format.framing import PREFIX as _PREFIX

MAX_SEGMENTS = 1_000_000


def combine_all(parts: list[tuple[int, int]], alg: str = checksum.CRC32) -> tuple[int, int]:
    """``(checksum, nbytes)`` of the concatenation of parts given as ``(checksum, nbytes)``, all of algorithm
    ``alg`` (see :func:`ray_ckpt.format.checksum.combine`)."""
    crc, n = 0, 0
    for c, ln in parts:
        crc = checksum.combine(crc, c, ln, alg) if n else c
        n += ln
    return crc, n


# -- splitting -------------------------------------------------------------------------------------------------
def split(data, name: str = "<object>") -> list[memoryview]:
    """The segments of an object (zero-copy views), each a whole container. Validates only the framing (magic,
    header length and checksum, declared data length); each segment is fully validated when decoded."""
    buf = memoryview(data).cast("B")
    total = buf.nbytes
    out: list[memoryview] = []
    pos = 0
    while pos < total:
        if len(out) >= MAX_SEGMENTS:
            raise CorruptObjectError(name, "too many segments")
        if total - pos < _PREFIX.size:
            raise CorruptObjectError(name, f"truncated segment at byte {pos}")
        magic, header_len, header_crc = _PREFIX.unpack_from(buf, pos)
        if magic != MAGIC:
            raise CorruptObjectError(name, f"bad magic at byte {pos} (not a ray_ckpt object)")
        hstart = pos + _PREFIX.size
        if header_len > MAX_HEADER_BYTES or hstart + header_len > total:
            raise CorruptObjectError(name, f"segment at byte {pos}: header length {header_len} out of bounds")
        header_bytes = bytes(buf[hstart:hstart + header_len])
        if zlib.crc32(header_bytes) != header_crc:
            raise CorruptObjectError(name, f"segment at byte {pos}: header checksum mismatch")
        try:
            data_len = safejson.loads(header_bytes).get("data_len")
        except (ValueError, AttributeError):
            raise CorruptObjectError(name, f"segment at byte {pos}: header is not a JSON object") from None
        data_start = hstart + header_len
        data_start += (-data_start) % ALIGN
        if not isinstance(data_len, int) or isinstance(data_len, bool) or data_len < 0 \
                or data_start + data_len > total:
            raise CorruptObjectError(name, f"segment at byte {pos}: truncated (declares {data_len!r:.20} data bytes)")
        end = data_start + data_len
        out.append(buf[pos:end])
        pos = end
    if not out:
        raise CorruptObjectError(name, "empty object")
    return out


def split_parts(parts: list, name: str = "<object>") -> list:
    """:func:`split` of an object given as a list of buffers (as Ray's object store returns a held chunk): one
    container in :func:`ray_ckpt.format.container.encode`'s own split (its first buffer exactly the prefix, header
    and padding) is returned whole, as ``[parts]``, for a decode without joining; anything else is joined once
    and split."""
    views = [memoryview(p).cast("B") for p in parts]
    if len(views) > 1 and views[0].nbytes >= _PREFIX.size:
        magic, header_len, _ = _PREFIX.unpack_from(views[0], 0)
        data_start = _PREFIX.size + header_len
        data_start += (-data_start) % ALIGN
        if magic == MAGIC and header_len <= MAX_HEADER_BYTES and views[0].nbytes == data_start:
            try:
                data_len = safejson.loads(bytes(views[0][_PREFIX.size:_PREFIX.size + header_len])).get("data_len")
            except (ValueError, AttributeError):
                data_len = None
            if data_len == sum(v.nbytes for v in views[1:]):
                return [views]   # the header's checksum is checked by the decode
    return split(b"".join(views) if len(views) != 1 else views[0], name)


def object_crc(bufs: list) -> tuple[int, int, str]:
    """``(checksum, nbytes, algorithm)`` of one container given as :func:`ray_ckpt.format.container.encode`
    returns it (the first buffer is prefix + header + padding, the rest the data section), without a second pass
    over the data: the header records the data section's checksum and its algorithm, computed once while
    encoding; the object's checksum uses the same algorithm."""
    head = memoryview(bufs[0]).cast("B")
    magic, header_len, _ = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise ValueError("not a container's first buffer")
    header = json.loads(bytes(head[_PREFIX.size:_PREFIX.size + header_len]))
    data_len, data_crc = header["data_len"], header["data_crc"]
    alg = checksum.check_alg(header.get("data_crc_alg", checksum.CRC32))
    n_data = sum(memoryview(b).nbytes for b in bufs[1:])
    if n_data != data_len:
        raise ValueError(f"data buffers hold {n_data} bytes, the header says {data_len}")
    return checksum.combine(checksum.compute(alg, head), data_crc, data_len, alg), head.nbytes + data_len, alg


def seal(bufs) -> list:
    """The buffers of a container encoded within :func:`ray_ckpt.format.framing.unsealed` (or the same bytes in
    other parts, the first holding exactly the prefix, header and padding, as ``encode`` returns it), with its data
    checksum: the data parts checksummed in one pass (algorithm :data:`ray_ckpt.format.checksum.DEFAULT`), a new
    first buffer (a ``uint8`` array) whose header holds it, the data parts as they are. ValueError for anything
    else. Runs where the bytes are read anyway (the persistence worker, on a chunk a training process handed over).
    """
    head = memoryview(bufs[0]).cast("B")
    if head.nbytes < _PREFIX.size:
        raise ValueError("not a container's first buffer (shorter than its prefix)")
    magic, header_len, header_crc = _PREFIX.unpack_from(head, 0)
    header = bytes(head[_PREFIX.size:_PREFIX.size + header_len])
    if magic != MAGIC or len(header) != header_len or zlib.crc32(header) != header_crc:
        raise ValueError("not a container's first buffer")
    if not header.endswith(NULL_TAIL):
        raise ValueError("the container is sealed already (its header holds a data checksum)")
    if head.nbytes != len(head_buffer(header)):
        raise ValueError("the container's first buffer holds more than its prefix, header and padding")
    alg = checksum.DEFAULT
    crc = 0
    for b in bufs[1:]:
        crc = checksum.compute(alg, b, crc)
    header = header[:-len(NULL_TAIL)] + (crc_tail(crc, alg) + "}").encode()
    return [np.frombuffer(head_buffer(header), dtype=np.uint8), *bufs[1:]]
