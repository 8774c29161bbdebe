"""Why a step is not recoverable, in words: the message of :class:`ray_ckpt.NoCheckpointError` when a
restore asks for a step no chain of the current timeline reaches (:meth:`ray_ckpt.lineage.Lineage.resolve`).

Two causes are told apart from what the lineage records, not guessed from step numbers:

* **left unrecorded by the overhead budget**: a full taken after steps the budget's every-k mode did not record
  names them in its manifest (``info["unrecorded_from"]``, ``info["recovery_every"]``,
  :mod:`ray_ckpt.engine.capture`); the message says so and names the recovery points around the step;
* **removed by retention**: garbage collection (``keep_fulls``, ``ray-ckpt gc``) wrote what it removed in the
  lineage's retention record (:mod:`ray_ckpt.lineage.retention`) before deleting it; the message names the
  setting and the oldest step kept.

Anything else (a step past the newest, before the lineage's first full, of an abandoned branch, or lost) keeps
the plain message. Pure: works on a :class:`~ray_ckpt.lineage.Lineage` given by the caller; any process.
"""
from __future__ import annotations


def explain(lineage, step: int, retention=None) -> str:
    """The message for ``step``, which ``lineage`` does not reach on its current timeline. ``retention``: the
    lineage's :class:`~ray_ckpt.lineage.retention.Retention` record, or None."""
    head = f"(latest recoverable step: {lineage.head()})"
    unrecorded = _unrecorded(lineage, step)
    if unrecorded is not None:
        k, since = unrecorded
        every = f"a full every {k} steps" if isinstance(k, int) else "a full every few steps"
        return (f"step {step} was not recorded: {every} was recorded from step {since} on (the overhead budget's "
                f"choice when recording every step did not fit overhead_budget, or recovery_every), and the steps "
                f"between those fulls were never written; {_around(lineage, step, retention)} {head}")
    if retention is not None and retention.removed(step):
        oldest = _oldest(lineage)
        return (f"step {step} is not recoverable: steps before {retention.kept_from} were removed by retention "
                f"({retention.setting()}); the oldest step kept is "
                f"{oldest if oldest is not None else retention.kept_from} {head}")
    return f"step {step} is not recoverable on the current timeline {head}"


def _unrecorded(lineage, step: int) -> tuple[int | None, int] | None:
    """``(k, since)`` when a full of the current timeline says ``step`` was left unrecorded by the overhead
    budget: ``k`` its ``recovery_every``, ``since`` the step its run of every-k fulls began at (the last recorded
    step, or the attach full, before the first of them). None otherwise."""
    for m in lineage.manifests:
        u = _mark(m)
        if u is None or not u <= step < m.last_step:
            continue
        cap = lineage.timeline_cap(m.generation)
        if cap is not None and m.last_step > cap:
            continue       # a full of an abandoned branch
        marked = {f.last_step: _mark(f) for f in lineage.manifests
                  if f.generation == m.generation and _mark(f) is not None}
        since = u - 1
        while marked.get(since) is not None and marked[since] <= since:   # the previous every-k full
            since = marked[since] - 1
        k = m.info.get("recovery_every")
        return (k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None), since
    return None


def _mark(m) -> int | None:
    """The ``unrecorded_from`` a full's manifest names (the first step left unrecorded before it), or None."""
    if m.kind != "full" or not isinstance(m.info, dict):
        return None
    u = m.info.get("unrecorded_from")
    return u if isinstance(u, int) and not isinstance(u, bool) and 0 <= u <= m.last_step else None


def _around(lineage, step: int, retention) -> str:
    """The recovery points of the current timeline nearest ``step``, before and after it, in words."""
    before = after = None
    for gen in lineage.generations:
        for lo, hi in lineage.reachable_ranges(gen):
            if lo < step:
                before = min(hi, step - 1) if before is None else max(before, min(hi, step - 1))
            if hi > step:
                low = max(lo, step + 1)
                after = low if after is None else min(after, low)
    if before is None:
        first = "no recovery point before it is kept"
        if retention is not None and retention.removed_from < step:
            first += (f" (steps before {retention.kept_from} were removed by retention: {retention.setting()})")
    else:
        first = f"step {before} before it"
    last = f"step {after} after it" if after is not None else "none after it"
    return f"the nearest recovery points are {first} and {last}"


def _oldest(lineage) -> int | None:
    """The lowest step the current timeline reaches, or None."""
    lows = [r[0][0] for r in (lineage.reachable_ranges(g) for g in lineage.generations) if r]
    return min(lows) if lows else None
