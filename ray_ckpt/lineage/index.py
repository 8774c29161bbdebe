"""The lineage index: every committed manifest rolled up into one object at each full checkpoint, so that a
restore or attach plans with a bounded number of storage requests instead of one read per manifest.

Layout: ``<root>/lineage/index.json`` (:data:`INDEX_KEY`) holds the manifests committed when it was written
and, per *stream* of the newest generation it covers (``g<gen>-diff`` and ``g<gen>-full``), the newest manifest
key it holds (the *watermark*).

Crash consistency: the index is a cache of committed manifests, written (atomically) only after the manifests
it lists are committed. A reader loads it, then lists only what is newer than it: the manifests of the index's
newest generation after each stream's watermark (names sort in step order within a stream) and everything of
later generations, and reads those. An object committed *out of order* — one whose key sorts at or below the
watermark of an index that does not list it, or of an older generation than the index's — would be hidden, and
those exist: after a persistence worker restarts or a node is lost, a peer writes the replicas it held of the
lost worker's chunks while the run goes on (a full and an index may already be past them), and the replica's
fulls interleave with the trainer's after the replica recovered. Two rules keep every commit visible:

* the index writer (the coordinator) never puts a watermark at or above an object it knows may still be
  committed (``pending`` of :func:`encode_index`), and while such an object belongs to an older generation the
  index covers that generation only (readers list every later one);
* a writer that may commit out of order makes the object known to the coordinator before it commits (the
  worker's ``persist``), and after committing deletes an index that hides it (:func:`hides`;
  :func:`ray_ckpt.engine.lineage_io.unhide`), so that readers list every manifest until the next index.

A missing, unreadable, malformed or newer-format index makes readers fall back to
listing every manifest; an index that names an object deleted since (garbage collection) surfaces as a missing
object on load, and callers then fall back to listing too (:func:`ray_ckpt.engine.restore.resolve_and_load`).

Requests to plan: 1 read + 3 lists + one read per manifest committed after the index (at most the
objects of one full interval), independent of the run's length. Pure: no torch, no Ray. Runs in any process.
"""
from __future__ import annotations

import json

from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage import layout
from ray_ckpt.lineage.layout import INDEX_KEY
from ray_ckpt.lineage.manifest import Manifest, ManifestError

INDEX_FORMAT = 1


class IndexError_(RayCkptError, ValueError):
    """The index object is malformed (readers fall back to listing)."""


def _stream(m: Manifest) -> str:
    return f"g{m.generation:06d}-{m.kind}"


def encode_index(manifests, pending=()) -> bytes:
    """The index object for ``manifests`` (every committed one the writer knows of). ``pending``: objects that
    may still be committed (held, not durable yet): the index's generation is at most the oldest of theirs
    (readers list every later generation) and each stream's watermark stays below the first of them, so that a
    reader lists them once they are committed."""
    ms = sorted(manifests, key=lambda m: m.key)
    newest = min([max((m.generation for m in ms), default=0)] + [p.generation for p in pending])
    cap: dict[str, str] = {}
    for p in pending:
        if p.generation == newest and (_stream(p) not in cap or p.key < cap[_stream(p)]):
            cap[_stream(p)] = p.key
    marks: dict[str, str] = {}
    for m in ms:
        s = _stream(m)
        if m.generation == newest and (s not in cap or m.key < cap[s]):
            marks[s] = max(marks.get(s, ""), m.key)
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


class RewriteClock:
    """When an index writer rewrites the index at a full. Encoding every manifest is linear in the run (a long
    run's index costs a noticeable share of a CPU to rewrite): at every full while a
    rewrite costs under :attr:`CHEAP_S` of the writing thread's CPU, then at most once per :attr:`COST_FACTOR`
    times that CPU cost (its CPU share stays near 1/COST_FACTOR; readers list the manifests committed after it,
    see above), and always when ``force`` is set (garbage collection deleted objects the last index names).
    CPU, not wall time: waiting for a slow store costs no CPU and must not make a short run's index stale."""

    COST_FACTOR = 20.0
    CHEAP_S = 0.005

    def __init__(self):
        self.t, self.cost = 0.0, 0.0

    def due(self, now: float, force: bool = False) -> bool:
        return force or self.cost <= self.CHEAP_S or now - self.t >= self.COST_FACTOR * self.cost

    def done(self, at: float, cpu_seconds: float) -> None:
        """A rewrite started at ``at`` (the clock ``due`` is given) and used ``cpu_seconds`` of CPU."""
        self.t, self.cost = at, cpu_seconds


def write_index(storage, manifests, pending=()) -> None:
    """Roll ``manifests`` (every committed manifest the caller knows) up into the index object. Call after
    the newest of them is committed, e.g. right after a full's manifest (writer thread, coordinator actor).
    ``pending``: objects that may still be committed (see :func:`encode_index`)."""
    storage.write(INDEX_KEY, encode_index(manifests, pending))


def hides(index: tuple[int, dict, list], m: Manifest) -> bool:
    """Whether a reader of the decoded ``index`` (:func:`decode_index`) would miss the committed ``m``: the index
    does not list it and ``m`` is of an older generation, or sorts at or below its stream's watermark."""
    gen, marks, manifests = index
    if m.generation > gen or any(x.name == m.name for x in manifests):
        return False
    return m.generation < gen or m.key <= marks.get(_stream(m), "")


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
