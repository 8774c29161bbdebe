"""The messages a PersistenceWorker sends its coordinator (``Coordinator.update``), in the order it produced them,
one call per report interval:

* ``("started", node, first_incarnation)``: the worker (re)started: it holds nothing; always its first message
* ``("receiving", [manifest, ...])``: it began to receive these chunks from a training process (in flight)
* ``("not_received", [name, ...])``: the call receiving these chunks failed (nothing of them is held)
* ``("held", manifest, None, origin)``: it holds the chunk (``origin``: the node that received it first)
* ``("durable", manifest, [names])``: it committed an object; ``names``: the held chunks it makes durable
* ``("release", [name, ...])``: it let these durable chunks go (its memory budget)

Runs in the worker's report thread (and the scale benchmark's simulated nodes).
"""
from __future__ import annotations

import ray


def pack_reports(msgs: list) -> list:
    """The messages of one update call with every run of consecutive ``held`` messages packed into one
    ``("held_batch", [(manifest, ref, origin), ...])``, every run of consecutive ``release`` messages joined
    into one, and every ``receiving`` message joined into the call's first one (a hand-off announced earlier is
    no less in flight; so the helds between them stay one run). The order of all other messages is kept: a
    release still follows the hold it releases. Worker's report thread, and the scale benchmark's simulated
    nodes."""
    out: list = []
    receiving = None
    for msg in msgs:
        kind = msg[0]
        if kind == "receiving" and receiving is not None:
            receiving[1].extend(msg[1])
            continue
        if kind == "receiving":
            receiving = ("receiving", list(msg[1]))
            out.append(receiving)
            continue
        last = out[-1][0] if out else None
        if kind == "held":
            if last == "held_batch":
                out[-1][1].append(msg[1:])
            else:
                out.append(("held_batch", [msg[1:]]))
        elif kind == "release" and last == "release":
            out[-1] = ("release", list(out[-1][1]) + list(msg[1]))
        else:
            out.append(msg)
    return [("held",) + o[1][0] if o[0] == "held_batch" and len(o[1]) == 1 else o for o in out]


def answered_interval(ref, current: float) -> float:
    """The report interval the coordinator asked for in its answer to the update call ``ref`` (its answers are
    ready by the next report in a narrow job), else ``current``. Never waits."""
    if ref is None:
        return current
    try:
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            got = ray.get(ready[0])
            if isinstance(got, (int, float)) and got > 0:
                return min(float(got), 10.0)
    except Exception:  # noqa: BLE001 - a restarting coordinator: keep the interval
        pass
    return current
