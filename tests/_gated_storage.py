"""A local storage backend whose durable writes fail while a gate file exists: a storage that cannot take a write
before a deadline, for the drain tests. Picklable (shipped to the persistence actors); the gate is a path on this
machine, which every node of a local test cluster shares."""
from __future__ import annotations

import os

from ray_ckpt.storage.local import LocalBackend

#: what the gate blocks: the lineage's data and commits and the drain records (the lease, the index and the
#: policy report are still written, as they would be to a storage that is only slow for large objects)
GATED = ("objects/", "manifests/", "drains/")


class GatedBackend(LocalBackend):
    def __init__(self, root: str, gate: str):
        super().__init__(root)
        self.gate = gate

    def __reduce__(self):
        return (GatedBackend, (self.root, self.gate))

    def write(self, key, data):
        if key.startswith(GATED) and os.path.exists(self.gate):
            raise ConnectionError(f"storage unreachable while {self.gate} exists (test gate)")
        return super().write(key, data)
