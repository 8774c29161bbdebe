"""The on-storage container: a JSON header plus raw tensor bytes, checksummed, never pickled.

Layout of one object (all integers little-endian)::

    magic        8 bytes   b"RCKPT\\x00\\x01\\x00"
    header_len   u64       length of the JSON header in bytes
    header_crc   u32       zlib.crc32 of the header bytes
    header       JSON      {"meta": <any JSON>, "tensors": [{name, dtype, shape, offset, nbytes, codec}],
                            "data_len": int, "data_crc": u32 of the data section,
                            "data_crc_alg": "crc32c" (absent: "crc32"; see ray_ckpt.format.checksum)}
    padding      to a multiple of 64 bytes
    data         the tensors' bytes, each starting at a multiple of 64 bytes of the data section

Reading validates everything before any byte is interpreted: magic, header size against the object size, header
checksum, JSON structure, every dtype against an allow-list, shapes, offsets and sizes against the data section,
and the data checksum. Any failure raises :class:`CorruptObjectError` naming the object. Decoding returns numpy
views into the object's bytes (no copy); :func:`to_torch` turns them into tensors.

Pure layer: numpy and torch only; runs in any process.
"""
from __future__ import annotations

import bisect
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ray_ckpt.format import checksum as _checksum
from ray_ckpt.format import safejson
from ray_ckpt.format.framing import ALIGN, MAGIC, MAX_HEADER_BYTES, CorruptObjectError  # noqa: F401 - re-exported
from ray_ckpt.format.framing import PREFIX as _PREFIX
from ray_ckpt.format.framing import UNSEALED as _UNSEALED
from ray_ckpt.format.framing import crc_tail as _crc_tail
from ray_ckpt.format.framing import head_buffer as _head
from ray_ckpt.format.framing import unsealed  # noqa: F401 - re-exported

MAX_TENSORS = 1_000_000
MAX_NDIM = 16

# dtype name <-> (torch dtype, numpy dtype used to carry the raw bytes)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),  # numpy has no bfloat16: carried as its raw 16 bits
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
_TORCH_TO_NAME = {t: n for n, (t, _) in _DTYPES.items()}
_ZEROS = np.zeros(ALIGN, dtype=np.uint8)   # padding between tensors (read-only: shared by every encode)
_ZEROS.flags.writeable = False


def dtype_name(dtype: torch.dtype) -> str:
    """The container's name for a torch dtype; raises TypeError for an unsupported one."""
    try:
        return _TORCH_TO_NAME[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by the checkpoint format") from None


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name][0]


def as_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as a numpy array of its raw bytes (no copy)."""
    if t.device.type != "cpu":
        raise ValueError("encode CPU tensors only; copy device tensors to host first")
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.dim() == 0:
        t = t.reshape(1)
    return t.numpy().reshape(-1).view(np.uint8)


@dataclass
class Packed:
    """Several tensors already laid out in one buffer as :func:`encode` would lay them out back to back: each at an
    offset (relative to the buffer) that is a multiple of ``ALIGN``, zero bytes up to the next one, the buffer's
    length a multiple of ``ALIGN``. :func:`encode` takes it as one value of its ``tensors`` mapping (the name is
    ignored: ``tensors`` names each part) and hands ``data`` over as one payload, without a pass per tensor; the
    stored object is byte for byte the one the separate tensors would give.

    ``tensors``: ``(name, dtype name, shape, offset, nbytes)`` per part, in offset order."""

    data: np.ndarray
    tensors: list


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def encode(meta: Any, tensors: Mapping[str, torch.Tensor | np.ndarray], *,
           checksum: bool = True) -> list[bytes | np.ndarray]:
    """Encode ``meta`` (JSON-able) and named CPU tensors into the container's buffers, in write order.

    ``checksum=False`` skips the data checksum (the header says ``null``): only for in-memory hand-offs that
    are decoded with ``verify=False`` at once, or (within :func:`unsealed`) sealed by :func:`ray_ckpt.format.segments.seal` before they are
    stored; never for stored objects (a verified read rejects them).

    Returns a list of buffers (header first, as ``bytes``, then each tensor's bytes and padding as flat ``uint8``
    numpy arrays: views, no copy) so the storage layer can write them without joining them into one copy.
    Neither kind is tracked by Python's garbage collector, nor are the header's pieces (built as text): a batch
    being encoded and written keeps few collectable objects alive, which keeps collections in the training process
    rare (see the README, "Fast steps, fourth pass"). Runs off the training thread (writer thread or actor).
    """
    entries: list[str] = []
    payloads: list[np.ndarray] = []
    offset = 0
    crc = 0
    alg = _checksum.DEFAULT
    checksum = checksum and not _UNSEALED.get()
    for name, t in tensors.items():
        if isinstance(t, Packed):
            n = t.data.nbytes
            if n % ALIGN:
                raise ValueError(f"a packed buffer of {n} bytes: its length must be a multiple of {ALIGN}")
            for pname, dt, shape, off, nb in t.tensors:
                if off % ALIGN or off + nb > n:
                    raise ValueError(f"packed tensor {pname!r} at offset {off} ({nb} bytes) does not fit")
                entries.append('{"name":%s,"dtype":"%s","shape":[%s],"offset":%d,"nbytes":%d}'
                               % (json.dumps(pname), dt, ",".join(map(str, shape)), offset + off, nb))
            payloads.append(t.data)
            if checksum:
                crc = _checksum.compute(alg, t.data, crc)
            offset += n
            continue
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(t))
        raw = as_numpy_bytes(t)
        n = raw.nbytes
        entries.append('{"name":%s,"dtype":"%s","shape":[%s],"offset":%d,"nbytes":%d}'
                       % (json.dumps(name), dtype_name(t.dtype), ",".join(map(str, t.shape)), offset, n))
        payloads.append(raw)
        if checksum:
            crc = _checksum.compute(alg, raw, crc)
        pad = (-n) % ALIGN
        if pad:
            zeros = _ZEROS[:pad]
            payloads.append(zeros)
            if checksum:
                crc = _checksum.compute(alg, zeros, crc)
        offset += n + pad
    tail = _crc_tail(crc, alg) if checksum else ',"data_crc":null'
    header = ('{"meta":%s,"tensors":[%s],"data_len":%d%s}'
              % (json.dumps(meta, separators=(",", ":"), allow_nan=True), ",".join(entries), offset, tail)).encode()
    out: list[bytes | np.ndarray] = [_head(header)]
    out.extend(payloads)
    return out


def encode_bytes(meta: Any, tensors: Mapping[str, torch.Tensor | np.ndarray]) -> bytes:
    """Like :func:`encode`, joined into one ``bytes`` (tests, small objects)."""
    return b"".join(bytes(b) for b in encode(meta, tensors))


def _fail(name: str, reason: str) -> CorruptObjectError:
    return CorruptObjectError(name, reason)


def decode(data: bytes | bytearray | memoryview | list, name: str = "<object>", *,
           verify: bool = True) -> tuple[Any, dict[str, np.ndarray], dict[str, TensorEntry]]:
    """Validate and decode an object. Returns ``(meta, arrays, entries)``; arrays are zero-copy numpy views.

    ``name`` is used in error messages. Raises :class:`CorruptObjectError` on anything unexpected; never
    executes code from the object and never allocates more than the object's own size.

    ``data`` may also be the list of buffers :func:`encode` returns (an object held in Ray's object store arrives
    so): each tensor is then a view of the part that holds it, without joining the parts into one copy.
    """
    if isinstance(data, (list, tuple)):
        parts = [memoryview(p).cast("B") for p in data]
        if len(parts) != 1:
            return _decode_parts(parts, name, verify)
        data = parts[0] if parts else b""
    buf = memoryview(data).cast("B")
    header, data_start, data_len = _header(buf, buf.nbytes, name)
    data_sec = buf[data_start:data_start + data_len]
    if verify and _checksum.compute(_data_alg(header, name), data_sec) != header.get("data_crc"):
        raise _fail(name, "data checksum mismatch")
    entries = _table(header, data_len, name)
    arrays: dict[str, np.ndarray] = {}
    for tname, e in entries.items():
        npdt = _DTYPES[e.dtype][1]
        count = math.prod(e.shape)
        arr = np.frombuffer(data_sec, dtype=npdt, count=count, offset=e.offset) if count else np.empty(0, npdt)
        arrays[tname] = arr.reshape(e.shape)
    return header.get("meta"), arrays, entries


def _header(buf: memoryview, total: int, name: str) -> tuple[dict, int, int]:
    """``(header, data_start, data_len)`` of an object of ``total`` bytes whose first bytes are ``buf`` (at least
    the prefix and the header), validated: magic, header checksum, data length against ``total``."""
    if buf.nbytes < _PREFIX.size:
        raise _fail(name, f"truncated: {buf.nbytes} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, header_len, header_crc = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _fail(name, "bad magic (not a ray_ckpt object; refusing to interpret it)")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > min(total, buf.nbytes):
        raise _fail(name, f"header length {header_len} exceeds the object size {total} or the limit")
    hstart = _PREFIX.size
    header_bytes = bytes(buf[hstart:hstart + header_len])
    if zlib.crc32(header_bytes) != header_crc:
        raise _fail(name, "header checksum mismatch")
    try:
        header = safejson.loads(header_bytes)
    except ValueError as e:
        raise _fail(name, f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise _fail(name, "header has no tensor table")
    data_start = hstart + header_len
    data_start += (-data_start) % ALIGN
    data_len = header.get("data_len")
    if not isinstance(data_len, int) or data_len < 0 or data_start + data_len != total:
        raise _fail(name, f"truncated or oversized: data section should be {data_len} bytes, "
                          f"object has {total - data_start}")
    return header, data_start, data_len


def _data_alg(header: dict, name: str) -> str:
    """The algorithm of the header's data checksum (validated: a hostile header names no other)."""
    try:
        return _checksum.check_alg(header.get("data_crc_alg", _checksum.CRC32))
    except ValueError as e:
        raise _fail(name, str(e)) from None


def _table(header: dict, data_len: int, name: str) -> dict[str, TensorEntry]:
    """The header's tensor table, validated against the data section's length."""
    table = header["tensors"]
    if len(table) > MAX_TENSORS:
        raise _fail(name, "too many tensors")
    entries: dict[str, TensorEntry] = {}
    for e in table:
        try:
            tname, dname, shape = e["name"], e["dtype"], e["shape"]
            offset, nbytes = e["offset"], e["nbytes"]
        except (KeyError, TypeError):
            raise _fail(name, f"malformed tensor entry {e!r:.200}") from None
        if not isinstance(tname, str) or tname in entries:
            raise _fail(name, f"bad or duplicate tensor name {tname!r:.100}")
        if not isinstance(dname, str) or dname not in _DTYPES:
            raise _fail(name, f"tensor {tname!r}: dtype {dname!r:.50} is not allowed")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in shape)):
            raise _fail(name, f"tensor {tname!r}: bad shape {shape!r:.100}")
        npdt = _DTYPES[dname][1]
        count = math.prod(shape)
        if (not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0 or nbytes < 0
                or count * npdt.itemsize != nbytes or offset + nbytes > data_len):
            raise _fail(name, f"tensor {tname!r}: size/offset out of bounds")
        entries[tname] = TensorEntry(tname, dname, tuple(shape), offset, nbytes)
    return entries


def _decode_parts(parts: list[memoryview], name: str, verify: bool):
    """:func:`decode` of an object given as consecutive parts whose first holds exactly the prefix, header and
    padding (as :func:`encode`'s first buffer does); any other split, or a tensor spanning two parts, is decoded
    from one joined copy."""
    total = sum(p.nbytes for p in parts)
    head = parts[0]
    try:
        header, data_start, data_len = _header(head, total, name)
    except CorruptObjectError:
        return decode(b"".join(parts), name, verify=verify)   # another framing: the joined copy decides
    if head.nbytes != data_start:
        return decode(b"".join(parts), name, verify=verify)
    if verify:
        crc, alg = 0, _data_alg(header, name)
        for p in parts[1:]:
            crc = _checksum.compute(alg, p, crc)
        if crc != header.get("data_crc"):
            raise _fail(name, "data checksum mismatch")
    entries = _table(header, data_len, name)
    starts, pos = [], 0
    for p in parts[1:]:
        starts.append(pos)
        pos += p.nbytes
    arrays: dict[str, np.ndarray] = {}
    for tname, e in entries.items():
        npdt = _DTYPES[e.dtype][1]
        count = math.prod(e.shape)
        if not count:
            arrays[tname] = np.empty(0, npdt).reshape(e.shape)
            continue
        i = bisect.bisect_right(starts, e.offset) - 1   # the part where the tensor starts
        if i < 0 or e.offset + e.nbytes > starts[i] + parts[i + 1].nbytes:
            return decode(b"".join(parts), name, verify=False)   # it spans two parts: one joined copy
        off, p = starts[i], parts[i + 1]
        arrays[tname] = np.frombuffer(p, dtype=npdt, count=count, offset=e.offset - off).reshape(e.shape)
    return header.get("meta"), arrays, entries


def to_torch(arr: np.ndarray, dtype_name_: str, *, copy: bool = True) -> torch.Tensor:
    """A decoded array as a torch tensor of its recorded dtype (copied by default: object bytes may be read-only)."""
    tdt = _DTYPES[dtype_name_][0]
    if copy or not arr.flags.writeable:
        arr = arr.copy()
    if arr.ndim == 0 or arr.size == 0:
        t = torch.from_numpy(arr.reshape(-1))
    else:
        t = torch.from_numpy(arr)
    if tdt == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(arr.shape)


def decode_tensors(data: bytes | bytearray | memoryview, name: str = "<object>", *, verify: bool = True,
                   copy: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """Decode and return ``(meta, {name: torch.Tensor})``, tensors copied out of the buffer unless
    ``copy=False`` (then they may be read-only views: only read them, e.g. to ``load_state_dict`` from)."""
    meta, arrays, entries = decode(data, name, verify=verify)
    if copy:
        return meta, {k: to_torch(a, entries[k].dtype) for k, a in arrays.items()}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch warns about read-only numpy arrays
        return meta, {k: _view_torch(a, entries[k].dtype) for k, a in arrays.items()}


def _view_torch(arr: np.ndarray, dtype_name_: str) -> torch.Tensor:
    tdt = _DTYPES[dtype_name_][0]
    t = torch.from_numpy(arr.reshape(-1)) if arr.size else torch.empty(0, dtype=torch.from_numpy(arr).dtype)
    if tdt == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(arr.shape)


def iter_sizes(buffers: Iterable[memoryview | bytes]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


__all__: Sequence[str] = ["CorruptObjectError", "encode", "encode_bytes", "decode", "decode_tensors",
                          "to_torch", "dtype_name", "torch_dtype", "MAGIC"]
