"""Every on-storage name of a run, in one place.

``<root>/objects/<name>.rckpt``   the data of a full checkpoint or of a batch of step diffs (written first)
``<root>/manifests/<name>.json``  its manifest; its existence is the commit (written last)

``<name>`` is ``g<generation>-full-<step>`` or ``g<generation>-diff-<first>-<last>`` with zero-padded
numbers, so a sorted listing is in step order. A *generation* is one attach of a Checkpointer to the root;
a later generation supersedes earlier ones from its start step on (a resumed or branched run).
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
