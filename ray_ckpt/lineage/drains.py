"""Drain records: what a node drain (a preemption notice) did to a run's steps, on storage next to the lineage.

The run's coordinator (:mod:`ray_ckpt.runtime.drain`) writes one record per drain under
:data:`~ray_ckpt.lineage.layout.DRAINS_DIR` when it sees the notice and again as the steps the node held are
made safe, and once more when the node is gone. ``ray-ckpt ls`` prints them (:func:`describe`). A record is
plain JSON::

    {"node": <node id>, "noticed_ms": <unix ms>, "deadline_ms": <unix ms, 0: none>, "generation": <int>,
     "status": "draining" | "safe" | "node gone" | "cancelled", "updated_ms": <unix ms>,
     "held": [[first, last], ...],      steps the node held that were not durable when it was noticed or after
     "durable": [[first, last], ...],   of those: durable on storage
     "peer": [[first, last], ...],      not durable, held on a node that stays (the memory tier restores them)
     "unsafe": [[first, last], ...],    neither (only the draining node held them; lost once it is gone)
     "durable_before": <step>}          the newest step of the generation durable at the notice (what the node
                                        received past it counts as held, even if written before it was seen)

Pure (no Ray, no torch): any process.
"""
from __future__ import annotations

import json
import time

from ray_ckpt.lineage.layout import DRAINS_DIR

#: a drain record is a few hundred bytes; anything far larger under drains/ is not one
_MAX_RECORD_BYTES = 1 << 20


def record_key(node: str, noticed_ms: int) -> str:
    """The storage key of the record of ``node``'s drain noticed at ``noticed_ms`` (sorts by time)."""
    return f"{DRAINS_DIR}{int(noticed_ms):013d}-{node}.json"


def write_record(storage, record: dict) -> None:
    """Write (or replace) ``record``. Caller's thread; raises what the storage raises."""
    storage.write(record_key(record["node"], record["noticed_ms"]), json.dumps(record, sort_keys=True).encode())


def read_records(storage) -> list[dict]:
    """Every drain record under the root, oldest first; unreadable ones are skipped."""
    out = []
    try:
        keys = sorted(k for k in storage.list(DRAINS_DIR) if k.endswith(".json"))
    except Exception:  # noqa: BLE001 - no drains folder: no drains
        return []
    for key in keys:
        try:
            data = storage.read(key)
            if len(data) > _MAX_RECORD_BYTES:
                continue
            rec = json.loads(data)
        except Exception:  # noqa: BLE001 - a torn or foreign file: not a record
            continue
        if isinstance(rec, dict) and "node" in rec and "noticed_ms" in rec:
            out.append(rec)
    return out


def find_open(storage, node: str, deadline_ms: int) -> dict | None:
    """The newest record on storage of a drain of ``node`` with this deadline (0: none) that is still open
    ("draining" or "safe"), or None. A coordinator that restarted during a drain continues that record instead
    of writing a second one for the same drain (a drain is its node and its deadline). Any process."""
    for rec in reversed(read_records(storage)):
        if rec["node"] == node and int(rec.get("deadline_ms") or 0) == int(deadline_ms or 0) \
                and rec.get("status") in ("draining", "safe"):
            return rec
    return None


def ranges_text(ranges) -> str:
    """``[[1, 4], [7, 7]]`` as ``1..4, 7``; ``none`` when empty."""
    if not ranges:
        return "none"
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


def count(ranges) -> int:
    return sum(b - a + 1 for a, b in ranges)


def describe(rec: dict) -> str:
    """One line for ``ray-ckpt ls`` and the log: when, the deadline, and how much was made safe."""
    noticed = rec["noticed_ms"] / 1000.0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(noticed))
    deadline = rec.get("deadline_ms") or 0
    dl = f"deadline +{max(0.0, deadline / 1000.0 - noticed):.1f} s" if deadline else "no deadline"
    held = rec.get("held", [])
    unsafe = rec.get("unsafe", [])
    head = (f"drain of node {rec['node'][:12]} noticed {when} UTC ({dl}), generation {rec.get('generation')}: "
            f"{rec.get('status', '?')}; ")
    if not held:
        return head + "it held no step that was not durable"
    text = (head + f"{count(held)} steps held there not durable ({ranges_text(held)}): made durable "
            f"{ranges_text(rec.get('durable', []))}; on a node that stays (memory tier) {ranges_text(rec.get('peer', []))}")
    if unsafe:
        gone = rec.get("status") == "node gone"
        text += f"; NOT made safe{' (lost)' if gone else ' yet'}: {ranges_text(unsafe)}"
    else:
        text += f"; all {count(held)} safe"
    return text
