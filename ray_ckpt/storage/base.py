"""The storage protocol, its errors and key validation. Bytes only: no torch, no ray.

A :class:`StorageBackend` stores opaque objects under *keys* below one root URI. Keys are relative POSIX
paths (``"manifests/g000001-full-000000000025.json"``); every key that reaches a backend goes through
:func:`validate_key` first, because keys may come from manifests read back from storage (untrusted input):
a backend never touches anything outside its root.

Everything here runs in any process (driver, Ray Train worker, PersistenceWorker actor, Coordinator, CLI)
and is thread-safe.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Union, runtime_checkable

from ray_ckpt.errors import RayCkptError

#: Names (file or folder segments) starting with this prefix are reserved for in-flight writes of the local
#: backend. Such keys are refused by :func:`validate_key` and never returned by ``list()``.
TMP_PREFIX = ".tmp-"

#: Longest key accepted, in UTF-8 bytes (the S3 limit).
MAX_KEY_BYTES = 1024

#: One contiguous buffer: anything that exposes the buffer protocol (bytes, bytearray, memoryview,
#: a C-contiguous numpy array, ...).
Buffer = Union[bytes, bytearray, memoryview]
#: What ``write`` accepts: one buffer, or a sequence of buffers written in order.
Data = Union[Buffer, Sequence[Buffer]]


class StorageError(RayCkptError):
    """Base of every error raised by the storage layer; I/O errors are chained as ``__cause__``."""


class ObjectNotFound(StorageError, FileNotFoundError):
    """The object does not exist. Its message names the full URI of the key."""


def _show(key: object) -> str:
    text = repr(key)
    return text if len(text) <= 200 else text[:100] + "..." + text[-40:]


def validate_key(key: str) -> str:
    """Return ``key`` unchanged when it is a safe relative POSIX key; raise :class:`StorageError` otherwise.

    Refused: non-str, empty, absolute (leading ``/``), backslashes, empty segments (``a//b``, trailing ``/``),
    ``.`` or ``..`` segments, NUL and other control characters, more than 1024 UTF-8 bytes, and segments
    starting with the reserved temp prefix ``.tmp-``. The message names the key.

    Pure; runs anywhere, thread-safe.
    """
    if not isinstance(key, str):
        raise StorageError(f"invalid storage key {_show(key)}: must be a str, not {type(key).__name__}")
    reason = None
    if not key:
        reason = "empty"
    elif key.startswith("/"):
        reason = "absolute path (keys are relative to the storage root)"
    elif "\\" in key:
        reason = "contains a backslash"
    elif any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in key):
        reason = "contains a NUL or control character"
    else:
        try:
            n = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            reason = "not encodable as UTF-8"
        else:
            if n > MAX_KEY_BYTES:
                reason = f"longer than {MAX_KEY_BYTES} bytes ({n})"
        if reason is None:
            for seg in key.split("/"):
                if seg == "":
                    reason = "empty path segment"
                elif seg in (".", ".."):
                    reason = f"'{seg}' path segment"
                elif seg.startswith(TMP_PREFIX):
                    reason = f"segment starts with the reserved prefix {TMP_PREFIX!r}"
                if reason:
                    break
    if reason:
        raise StorageError(f"invalid storage key {_show(key)}: {reason}")
    return key


def validate_prefix(prefix: str) -> str:
    """Validate a ``list()`` prefix: ``""``, a folder (``"manifests/"``) or a key prefix (``"manifests/g00"``)."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise StorageError(f"invalid storage prefix {_show(prefix)}: must be a str")
    body = prefix[:-1] if prefix.endswith("/") else prefix
    try:
        validate_key(body)
    except StorageError as e:
        raise StorageError(f"invalid storage prefix {_show(prefix)}: {e}") from None
    return prefix


def as_buffers(data: Data) -> list[memoryview]:
    """Normalize ``write``'s ``data`` to a list of flat byte memoryviews, without copying.

    Done before any byte is written, so a bad element cannot leave a half-written object behind.
    """
    if isinstance(data, str):
        raise TypeError("storage data must be bytes-like or a sequence of bytes-like objects, not str")
    try:
        view = memoryview(data)
    except TypeError:
        view = None
    if view is not None:
        return [_flat(view)]
    if not isinstance(data, Sequence):
        raise TypeError(
            f"storage data must be bytes-like or a sequence of bytes-like objects, not {type(data).__name__}"
        )
    out = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            raise TypeError(f"storage data item {i} is a str, not bytes-like")
        try:
            out.append(_flat(item))
        except TypeError as e:
            raise TypeError(f"storage data item {i}: {e}") from None
    return out


def _flat(obj) -> memoryview:
    view = obj if isinstance(obj, memoryview) else memoryview(obj)  # TypeError when not a buffer
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise TypeError("buffer is not C-contiguous")
    return view.cast("B")


@runtime_checkable
class StorageBackend(Protocol):
    """Objects (bytes) under relative keys below one root URI. Obtain one with :func:`open_storage`.

    Where calls run: any process (driver, training worker, actor, CLI); every method is thread-safe, and a
    backend is picklable (it is rebuilt from its URI and options on unpickle, e.g. inside a Ray actor; secrets
    travel only through a secret channel, see :mod:`ray_ckpt.storage.s3`).
    There is no call order: no open/close, every call is independent.

    Every ``key`` is checked with :func:`validate_key`. A missing object on ``read``/``size`` raises
    :class:`ObjectNotFound` naming the key's full URI; any other I/O failure raises :class:`StorageError`
    naming the key, with the original exception chained.
    """

    #: The root URI it was opened with, credentials removed (local paths are made absolute: ``file:///...``).
    uri: str

    def write(self, key: str, data: Data) -> None:
        """Store ``data`` (one buffer, or a sequence of buffers written in order) as the object ``key``.

        Atomic: a concurrent or later reader sees either the previous state (no object, or the old
        object) or the whole new object, even when the writer dies mid-write. Replaces an existing object.
        """
        ...

    def read(self, key: str) -> bytes:
        """Return the whole object ``key``."""
        ...

    def size(self, key: str) -> int:
        """Return the size in bytes of the object ``key``."""
        ...

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (a folder-like prefix is not an object)."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys (relative to the root) starting with ``prefix``, recursive, sorted; never in-flight temp files.

        ``prefix`` is usually folder-like (``"manifests/"``); a partial name (``"manifests/g0000"``) also works.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove the object ``key``; a missing object is not an error."""
        ...

    def describe(self) -> str:
        """A human-readable URI of the root with its connection options, never with secrets."""
        ...

    # Conditional writes, for small coordination objects (the writer lease), not for checkpoint data:

    def create(self, key: str, data: bytes) -> bool:
        """Store ``data`` at ``key`` only if no object is there (atomically: of two concurrent creators exactly
        one succeeds). Returns False when the object exists."""
        ...

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The object and an opaque version token for :meth:`replace_if`."""
        ...

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        """Replace ``key`` only if it is still at ``version`` (compare-and-swap). Returns False otherwise."""
        ...
