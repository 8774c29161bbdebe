"""A view of a storage backend below a key prefix (e.g. ``ranks/1/``): the same interface, keys relative to it.

Used for the per-rank loop-state lineages that live next to a run's lineage and for the shard lineages of
sharded (FSDP2) state, each a complete lineage with its own lease and index. Any process; picklable when the
wrapped backend is.
"""
from __future__ import annotations

from ray_ckpt.storage.base import validate_prefix


class PrefixedStorage:
    """Keys of this view are ``prefix + key`` in ``base``; ``list`` strips the prefix again."""

    def __init__(self, base, prefix: str):
        if not prefix.endswith("/"):
            raise ValueError(f"a storage prefix ends with '/', got {prefix!r}")
        self.base = base
        self.prefix = validate_prefix(prefix)
        self.uri = f"{getattr(base, 'uri', '').rstrip('/')}/{self.prefix.rstrip('/')}"
        if hasattr(base, "list_after"):   # a bounded listing where the backend has one (S3 StartAfter)
            self.list_after = self._list_after

    def write(self, key: str, data) -> None:
        self.base.write(self.prefix + key, data)

    def read(self, key: str) -> bytes:
        return self.base.read(self.prefix + key)

    def size(self, key: str) -> int:
        return self.base.size(self.prefix + key)

    def exists(self, key: str) -> bool:
        return self.base.exists(self.prefix + key)

    def list(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.base.list(self.prefix + prefix)]

    def _list_after(self, prefix: str, start_after: str = "") -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.base.list_after(self.prefix + prefix, self.prefix + start_after)]

    def delete(self, key: str) -> None:
        self.base.delete(self.prefix + key)

    # conditional writes (a shard lineage's writer lease)
    def create(self, key: str, data: bytes) -> bool:
        return self.base.create(self.prefix + key, data)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        return self.base.read_versioned(self.prefix + key)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        return self.base.replace_if(self.prefix + key, data, version)

    def key_uri(self, key: str) -> str:
        fn = getattr(self.base, "key_uri", None)
        return fn(self.prefix + key) if fn is not None else f"{self.uri}/{key}"

    def describe(self) -> str:
        return f"{self.base.describe()} [{self.prefix}]"

    def __eq__(self, other) -> bool:
        return isinstance(other, PrefixedStorage) and (other.base, other.prefix) == (self.base, self.prefix)

    def __hash__(self) -> int:
        return hash(("prefixed", self.base, self.prefix))
