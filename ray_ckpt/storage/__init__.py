"""Storage layer: bytes only, a narrow protocol over ``str`` URIs (plain paths, ``file://``, ``s3://``).

No torch, no ray. Higher layers call :func:`open_storage` and use the :class:`StorageBackend` protocol;
every key goes through :func:`validate_key`. Everything here runs in any process and is thread-safe;
backends are picklable (ship them to Ray actors).

    >>> store = open_storage("s3://bucket/run?endpoint_override=127.0.0.1:5555&scheme=http")  # doctest: +SKIP
    >>> store.write("manifests/g000001-full-000000000025.json", b"{}")                      # doctest: +SKIP
"""
from .base import ObjectNotFound, StorageBackend, StorageError, validate_key
from .uri import SUPPORTED_SCHEMES, open_storage

__all__ = [
    "StorageBackend",
    "open_storage",
    "StorageError",
    "ObjectNotFound",
    "validate_key",
    "SUPPORTED_SCHEMES",
]
