"""Checksums of stored objects: CRC-32C for what is written now, zlib's CRC-32 for objects written before.

Every byte a training process hands over is checksummed once — by the node's persistence worker as it takes a
chunk (:func:`ray_ckpt.format.segments.seal`; the sender encodes it unsealed), or by the local writer thread as it
encodes — and verified on every read from storage. On dense records that pass was the largest
single cost of the sender thread: CRC-32C (Castagnoli) through the ``crc32c`` package's SSE4.2 / ARMv8
instructions runs several times faster than zlib's CRC-32 (figures: docs/benchmark-log.md); both release the
interpreter lock on large buffers. Both are reflected 32-bit CRCs with the same
pre- and post-inversion, so the checksum of a concatenation is computed from its parts' checksums
(:func:`combine`): the persistence worker lays chunks end to end into one object without a pass over the bytes.

Which algorithm an object uses is recorded where its checksum is: a container header's ``data_crc_alg`` and a
manifest's ``crc_alg`` (absent = ``"crc32"``, so every object written before reads unchanged). Writers use
:data:`DEFAULT`: CRC-32C where the package has its hardware implementation, else CRC-32 (a software CRC-32C
would be slower than zlib's).

Pure layer: no torch or Ray; runs in any process.
"""
from __future__ import annotations

import zlib

try:
    import crc32c as _crc32c
except ImportError:   # a declared dependency; without it objects are written with zlib's CRC-32
    _crc32c = None

CRC32 = "crc32"      #: zlib.crc32 (objects written before CRC-32C; the fallback)
CRC32C = "crc32c"    #: CRC-32C (Castagnoli)
ALGORITHMS = (CRC32, CRC32C)

#: the algorithm objects are written with (see the module docstring)
DEFAULT = CRC32C if _crc32c is not None and getattr(_crc32c, "hardware_based", False) else CRC32

# reflected polynomials
_POLY = {CRC32: 0xEDB88320, CRC32C: 0x82F63B78}


def compute(alg: str, data, value: int = 0) -> int:
    """The checksum ``alg`` of ``data`` (any contiguous buffer), continuing from ``value`` (the checksum of
    the bytes before ``data``)."""
    if alg == CRC32C:
        if _crc32c is None:
            raise RuntimeError("this object is checksummed with CRC-32C: install the 'crc32c' package "
                               "(a dependency of ray_ckpt) to verify it")
        return _crc32c.crc32c(data, value)
    if alg == CRC32:
        return zlib.crc32(data, value)
    raise ValueError(f"unknown checksum algorithm {alg!r:.40} (known: {', '.join(ALGORITHMS)})")


def of_buffers(alg: str, bufs) -> tuple[int, int]:
    """``(checksum, nbytes)`` of the concatenation of ``bufs`` (one pass over the bytes)."""
    crc, n = 0, 0
    for b in bufs:
        crc = compute(alg, b, crc)
        n += memoryview(b).nbytes
    return crc, n


def check_alg(alg) -> str:
    """``alg`` when it names a known algorithm, else ValueError (for values read from headers and manifests)."""
    if alg not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {alg!r:.40} (known: {', '.join(ALGORITHMS)})")
    return alg


# -- the checksum of a concatenation from its parts' --------------------------------------------------------------
# A reflected CRC is a polynomial remainder over GF(2). Appending len2 bytes to a message multiplies its register
# by x^(8·len2) modulo the polynomial; the CRC of the appended part is then XORed in (the pre- and post-inversions
# cancel). So crc(A‖B) = crc(A)·x^(8·len(B)) mod P  ⊕  crc(B). The power is built by square-and-multiply over the
# bits of 8·len(B): O(log len) products of 32-bit polynomials, well under a millisecond in Python.
_TOP = 1 << 31  # the reflected representation of x^0


def _mulmod(a: int, b: int, poly: int) -> int:
    """a·b modulo the polynomial ``poly`` (reflected bit order)."""
    m = _TOP
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return p


def _squares(poly: int) -> list[int]:
    """x^(2^k) mod P for k = 0..63 (reflected): successive squares of x (x itself is 1 << 30 in reflected order)."""
    out = [1 << 30]
    for _ in range(63):
        out.append(_mulmod(out[-1], out[-1], poly))
    return out


_X2K = {alg: _squares(poly) for alg, poly in _POLY.items()}


def _x8n(n: int, alg: str) -> int:
    """x^(8·n) mod P."""
    poly, x2k = _POLY[alg], _X2K[alg]
    p = _TOP  # 1
    k = 3  # 8·n = n·2^3: start at the square for bit 3
    while n:
        if n & 1:
            p = _mulmod(x2k[k & 63], p, poly)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int, alg: str = CRC32) -> int:
    """``compute(alg, A + B)`` from ``crc1 = compute(alg, A)``, ``crc2 = compute(alg, B)`` and ``len2 = len(B)``."""
    check_alg(alg)
    if len2 < 0:
        raise ValueError("len2 must be >= 0")
    if len2 == 0:
        return crc1
    return _mulmod(_x8n(len2, alg), crc1, _POLY[alg]) ^ crc2
