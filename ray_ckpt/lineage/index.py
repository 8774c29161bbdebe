"""The lineage index: every committed manifest rolled up into one object at each full checkpoint, so that a
restore or attach plans with a bounded number of storage requests instead of one read per manifest.

Layout: ``<root>/lineage/index.json`` (:data:`INDEX_KEY`) holds the manifests committed when it was written
and, per *stream* of the newest generation it covers (``g<gen>-diff`` and ``g<gen>-full``), the newest manifest
key it holds (the *watermark*).

Crash consistency: the index is a cache of committed manifests, written (atomically) only after the manifests
it lists are committed. A reader loads it, then lists only what is newer than it: the manifests of the index's
newest generation after each stream's watermark (names sort in step order within a stream) and everything of
later generations, and reads those. So the index never hides a newer committed object, provided a generation's
manifests are committed in step order per stream (true of every writer: one writer thread per generation, the
Ray worker's batches in order). A missing, unreadable, malformed or newer-format index makes readers fall back to
listing every manifest; an index that names an object deleted since (garbage collection) surfaces as a missing
object on load, and callers then fall back to listing too (:func:`ray_ckpt.engine.restore.resolve_and_load`).

Requests to plan: 1 read + 3 lists + one read per manifest committed after the index (at most the
objects of one full interval), independent of the run's length. Pure: no torch, no Ray. Runs in any process.
"""
from __future__ import annotations

import json

from ray_ckpt.lineage import layout
from ray_ckpt.lineage.manifest import Manifest, ManifestError

INDEX_KEY = "lineage/index.json"
INDEX_FORMAT = 1


class IndexError_(ValueError):
    """The index object is malformed (readers fall back to listing)."""


def _stream(m: Manifest) -> str:
    return f"g{m.generation:06d}-{m.kind}"


def encode_index(manifests) -> bytes:
    """The index object for ``manifests`` (every committed one the writer knows of)."""
    ms = sorted(manifests, key=lambda m: m.key)
    newest = max((m.generation for m in ms), default=0)
    marks: dict[str, str] = {}
    for m in ms:
        if m.generation == newest:
            marks[_stream(m)] = max(marks.get(_stream(m), ""), m.key)
    return json.dumps({"format": INDEX_FORMAT, "generation": newest, "watermarks": marks,
                       "manifests": [m.to_dict() for m in ms]}, separators=(",", ":")).encode()


def decode_index(data: bytes) -> tuple[int, dict, list[Manifest]]:
    """``(generation, watermarks, manifests)``; raises :class:`IndexError_` when malformed."""
    try:
        d = json.loads(data)
    except RecursionError:
        raise IndexError_("lineage index is nested too deeply") from None
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise IndexError_(f"lineage index is not valid JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
        raise IndexError_(f"lineage index has an unknown format {d.get('format') if isinstance(d, dict) else d!r:.40}")
    gen, marks, raw = d.get("generation"), d.get("watermarks"), d.get("manifests")
    if not isinstance(gen, int) or not isinstance(marks, dict) or not isinstance(raw, list):
        raise IndexError_("lineage index lacks generation/watermarks/manifests")
    try:
        ms = [Manifest.from_json(json.dumps(x).encode(), "<index>") for x in raw]
    except (ManifestError, TypeError, RecursionError) as e:
        raise IndexError_(f"lineage index holds a bad manifest: {e}") from None
    for stream, key in marks.items():
        if not isinstance(key, str) or not layout.MANIFEST_KEY_RE.match(key) or \
                not key.startswith(f"{layout.MANIFESTS_DIR}{stream}-"):
            raise IndexError_(f"lineage index has a bad watermark {stream!r}: {key!r:.80}")
    return gen, marks, ms


def list_after(storage, prefix: str, start_after: str) -> list[str]:
    """Keys under ``prefix`` sorting after ``start_after``: one request on backends with ``list_after``
    (S3: ListObjectsV2 StartAfter), else a listing filtered here."""
    fn = getattr(storage, "list_after", None)
    if fn is not None:
        return fn(prefix, start_after)
    return [k for k in storage.list(prefix) if k > start_after]


def newer_keys(storage, generation: int, watermarks: dict) -> list[str]:
    """Manifest keys committed after an index of ``generation`` with ``watermarks`` was written."""
    keys: list[str] = []
    for kind in ("diff", "full"):
        stream = f"g{generation:06d}-{kind}"
        prefix = f"{layout.MANIFESTS_DIR}{stream}-"
        keys += list_after(storage, prefix, watermarks.get(stream, ""))
    # later generations: every key sorting after this generation's names ("~" sorts after letters/digits)
    keys += list_after(storage, layout.MANIFESTS_DIR, f"{layout.MANIFESTS_DIR}g{generation:06d}-~")
    return sorted(k for k in set(keys) if k.endswith(layout.MANIFEST_SUFFIX))


def write_index(storage, manifests) -> None:
    """Roll ``manifests`` (every committed manifest the caller knows) up into the index object. Call after
    the newest of them is committed, e.g. right after a full's manifest (writer thread, coordinator actor)."""
    storage.write(INDEX_KEY, encode_index(manifests))


def delete_committed(storage, manifests, missing: tuple = ()) -> None:
    """Delete committed objects: each manifest first (the object is uncommitted from then on), then its object.
    Errors of the types in ``missing`` (the backend's not-found) are ignored: a collection interrupted and run
    again finds some keys gone. Garbage collection; any process."""
    for m in manifests:
        for key in (m.key, m.object):
            try:
                storage.delete(key)
            except missing:
                pass
