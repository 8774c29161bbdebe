"""Checkpoint lineage on storage: naming, manifests (the commit markers), chain resolution. No torch, no Ray."""
from ray_ckpt.lineage.layout import (MANIFESTS_DIR, OBJECTS_DIR, diff_name, full_name, manifest_key,
                                     object_key)
from ray_ckpt.lineage.manifest import Manifest, ManifestError
from ray_ckpt.lineage.chain import Lineage, NoCheckpointError, Plan, collectable, gc_cutoff, range_difference

__all__ = ["MANIFESTS_DIR", "OBJECTS_DIR", "diff_name", "full_name", "manifest_key", "object_key",
           "Manifest", "ManifestError", "Lineage", "NoCheckpointError", "Plan", "collectable", "gc_cutoff",
           "range_difference"]
