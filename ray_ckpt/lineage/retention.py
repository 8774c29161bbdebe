"""Retention records: which steps garbage collection (``keep_fulls``, ``ray-ckpt gc``) removed from a lineage, on
storage next to it, so that a restore of such a step says it was removed by retention, and by which setting,
instead of only that it is not recoverable.

A lineage cannot tell this from its manifests alone: once the manifests of a chain are deleted, nothing says
those steps were ever committed (a run may as well have started later, or resumed from another lineage). So
every collector writes one record, :data:`~ray_ckpt.lineage.layout.RETENTION_KEY`, *before* it deletes anything
of the current timeline (a collection killed midway has announced what it was removing): the writer thread
(``runtime="local"``), the run's coordinator (``runtime="ray"``) and ``ray-ckpt gc``. It is plain JSON::

    {"format": 1, "keep_fulls": <K>, "by": "keep_fulls" | "ray-ckpt gc",
     "kept_from": <step of the oldest full kept>, "kept_generation": <its generation>,
     "removed_from": <the first step any collection of this lineage removed>, "updated_ms": <unix ms>}

Every step from ``removed_from`` up to ``kept_from`` (excluded) was removed by retention: a collection keeps every
step from its oldest kept full on and deletes every older chain of the current timeline. Each collection
rewrites the record (``removed_from`` is the lowest step any of them removed). Readers treat a missing or
malformed record as "nothing known to be removed". Pure (no torch, no Ray): any process.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from ray_ckpt.lineage.layout import RETENTION_KEY

RETENTION_FORMAT = 1
#: ``by`` of a record written by a running job (its ``keep_fulls`` setting, either runtime)
BY_SETTING = "keep_fulls"
#: ``by`` of a record written by ``ray-ckpt gc --keep-fulls K``
BY_CLI = "ray-ckpt gc"
#: a record is about 150 bytes; anything far larger at its key is not one
_MAX_RECORD_BYTES = 1 << 16


@dataclass(frozen=True)
class Retention:
    """What garbage collection removed from a lineage (see the module docstring)."""

    keep_fulls: int       #: the number of newest fulls whose chains the collection kept
    kept_from: int        #: the step of the oldest full kept: every step from here on was kept
    removed_from: int     #: the lowest step any collection of the lineage removed
    by: str = BY_SETTING  #: who collected: a running job's ``keep_fulls`` or ``ray-ckpt gc``
    kept_generation: int = 0
    updated_ms: int = 0

    def removed(self, step: int) -> bool:
        """Whether retention removed ``step`` (it lies in ``removed_from .. kept_from - 1``)."""
        return self.removed_from <= step < self.kept_from

    def setting(self) -> str:
        """The setting that removed the steps, in words, with how to keep them."""
        k = self.keep_fulls
        if self.by == BY_CLI:
            return f"`ray-ckpt gc --keep-fulls {k}` kept the chains of the {k} newest fulls"
        return (f"keep_fulls={k} keeps the chains of the {k} newest fulls; keep_fulls=0 or RAY_CKPT_KEEP_FULLS=0 "
                f"keeps every step")

    def to_json(self) -> bytes:
        return json.dumps({"format": RETENTION_FORMAT, **asdict(self)}, sort_keys=True).encode()


def decode(data: bytes) -> Retention | None:
    """The record in ``data``, or None when it is not a readable record of a known format."""
    if len(data) > _MAX_RECORD_BYTES:
        return None
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(d, dict) or d.get("format") != RETENTION_FORMAT:
        return None
    ints = ("keep_fulls", "kept_from", "removed_from", "kept_generation", "updated_ms")
    if any(not isinstance(d.get(k), int) or isinstance(d.get(k), bool) or d[k] < 0 for k in ints):
        return None
    if d.get("by") not in (BY_SETTING, BY_CLI):
        return None
    return Retention(**{k: d[k] for k in (*ints, "by")})


def read(storage) -> Retention | None:
    """The lineage's retention record, or None (never collected, unreadable or malformed: nothing is known to be
    removed). One read. Any process."""
    try:
        return decode(storage.read(RETENTION_KEY))
    except Exception:  # noqa: BLE001 - no record (the storage's not-found) or unreadable: nothing known
        return None


def note(storage, keep_fulls: int, cutoff, doomed, *, by: str = BY_SETTING) -> Retention | None:
    """Record, before deleting them, that a collection keeping the chains of the ``keep_fulls`` newest fulls
    (the oldest of them ``cutoff``, a :class:`~ray_ckpt.lineage.Manifest`) removes the manifests ``doomed``.
    Returns the record written, or None when the collection removes no step before ``cutoff`` (only abandoned
    branches, which no restore returns). One read and one write; raises what the storage raises. The
    collector's thread (writer thread, coordinator actor, CLI)."""
    if cutoff is None:
        return None
    removed = [m.first_step for m in doomed if m.last_step < cutoff.last_step and m.generation <= cutoff.generation]
    if not removed:
        return None
    prev = read(storage)
    first = min(removed) if prev is None else min(min(removed), prev.removed_from)
    rec = Retention(keep_fulls=keep_fulls, kept_from=cutoff.last_step, removed_from=first, by=by,
                    kept_generation=cutoff.generation, updated_ms=int(time.time() * 1000))
    storage.write(RETENTION_KEY, rec.to_json())
    return rec
