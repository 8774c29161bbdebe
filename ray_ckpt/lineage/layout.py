"""Every on-storage name of a run, in one place.

``<root>/objects/<name>.rckpt``   the data of a full checkpoint or of a batch of step diffs (written first)
``<root>/manifests/<name>.json``  its manifest; its existence is the commit (written last)

``<name>`` is ``g<generation>-full-<step>`` or ``g<generation>-diff-<first>-<last>`` with zero-padded
numbers, so a sorted listing is in step order. A *generation* is one attach of a Checkpointer to the root;
a later generation supersedes earlier ones from its start step on (a resumed or branched run).

Next to them, under the same root: the lineage index, the retention record and the policy report (``lineage/``),
the writer lease, the loop-state lineages of ranks > 0 (``ranks/``), the shard lineages of sharded state
(``shards/``) and the Amber tier (``tiers/amber/``); each of those sub-lineages names its objects and manifests as
above. Two names here are not
keys under the root: the description file of an export directory, and the tag in the name of a shard run.
"""
from __future__ import annotations

import re

OBJECTS_DIR = "objects/"
MANIFESTS_DIR = "manifests/"
OBJECT_SUFFIX = ".rckpt"
MANIFEST_SUFFIX = ".json"
#: the newest manifest format this version reads and writes: 2 = objects checksummed with CRC-32C (``crc_alg``);
#: a manifest of a CRC-32 object is still written as format 1, readable by versions before CRC-32C
FORMAT_VERSION = 2

#: the lineage index: the committed manifests rolled up into one object (:mod:`ray_ckpt.lineage.index`)
INDEX_KEY = "lineage/index.json"
#: what garbage collection (``keep_fulls``, ``ray-ckpt gc``) removed: written before it deletes anything, read when
#: a restore asks for a step that is gone (:mod:`ray_ckpt.lineage.retention`)
RETENTION_KEY = "lineage/retention.json"
#: the adaptive policy's latest report (:mod:`ray_ckpt.policy.adaptive`; ``ray-ckpt inspect`` shows it)
POLICY_REPORT_KEY = "lineage/policy.json"
#: the lineage's writer lease (:mod:`ray_ckpt.engine.lease`)
LEASE_KEY = "lease.json"
#: rank ``r``'s loop-state lineage (``r >= 1``) is below ``ranks/<r>/`` (:mod:`ray_ckpt.engine.rankloop`)
RANKS_DIR = "ranks/"
#: sharded (FSDP2) state: rank ``r``'s shard lineage at world size ``w`` below ``shards/w<w>/r<r>/`` (5 digits
#: each), and a marker ``shards/world-<w>.json`` per saved world size (:mod:`ray_ckpt.engine.sharded`)
SHARDS_DIR = "shards/"
#: the Amber tier of a LowDiff+ run: a lineage of increments of its own (:mod:`ray_ckpt.engine.amber_tier`)
TIER_DIR = "tiers/amber/"
#: node drains (preemption notices) seen by the run's coordinator: one record per drain, ``drains/<ms>-<node>.json``,
#: saying which steps the draining node held and how they were made safe (:mod:`ray_ckpt.lineage.drains`)
DRAINS_DIR = "drains/"
#: the description file in an export directory (:mod:`ray_ckpt.engine.export`; not a key under the root)
INFO_FILE = "ray_ckpt_export.json"
#: between a run's name and ``w<world>-r<rank>`` in the name of a shard run (the Ray runtime's run of one shard
#: lineage, see :func:`ray_ckpt.engine.shard_layout.shard_run`; a name of actors, not a key under the root)
SHARD_RUN_TAG = ":shard-"

_NAME_RE = re.compile(r"^g(\d{6})-(full-(\d{12})|diff-(\d{12})-(\d{12}))$")
OBJECT_KEY_RE = re.compile(r"^objects/g\d{6}-(full-\d{12}|diff-\d{12}-\d{12})\.rckpt$")
MANIFEST_KEY_RE = re.compile(r"^manifests/g\d{6}-(full-\d{12}|diff-\d{12}-\d{12})\.json$")


def full_name(generation: int, step: int) -> str:
    return f"g{generation:06d}-full-{step:012d}"


def diff_name(generation: int, first: int, last: int) -> str:
    return f"g{generation:06d}-diff-{first:012d}-{last:012d}"


def object_key(name: str) -> str:
    return f"{OBJECTS_DIR}{name}{OBJECT_SUFFIX}"


def manifest_key(name: str) -> str:
    return f"{MANIFESTS_DIR}{name}{MANIFEST_SUFFIX}"


def parse_name(name: str) -> tuple[int, str, int, int] | None:
    """``(generation, kind, first_step, last_step)`` for a valid object name, else ``None``."""
    m = _NAME_RE.match(name)
    if not m:
        return None
    gen = int(m.group(1))
    if m.group(3) is not None:
        s = int(m.group(3))
        return gen, "full", s, s
    return gen, "diff", int(m.group(4)), int(m.group(5))

#: in each checkpoint directory a Ray Train worker reports (not below the lineage root): a JSON pointer
#: ``{"storage_uri", "run", "step"}`` naming the lineage and the step it had reached
POINTER_FILE = "ray_ckpt_pointer.json"
#: at the lineage root: the Ray Train run (name) that owns the lineage, JSON ``{"run", "adopted_from"}``
RUN_MARKER = "run.json"
