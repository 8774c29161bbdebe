"""The full-checkpoint control a node's worker relays for its ranks (shard runs): each rank's sender asks its
node's worker instead of the coordinator, and the node's worker host asks the coordinator once per
``CONTROL_RELAY_S`` for all its lineages. No Ray: a :class:`ControlRelay` per lineage's worker, called under
that worker's lock — by the rank's sender (:meth:`ask`, a remote call) and by the host's control thread
(:meth:`requests`, :meth:`answered`).
"""
from __future__ import annotations

import time

#: a sharded job's worker host asks the coordinator for its lineages' control this often (one call per node
#: instead of one per rank every 0.5 s: the sender's _CONTROL_S)
CONTROL_RELAY_S = 0.5
#: a relayed control answer older than this is not handed out (the sender asks the coordinator itself); a
#: generation not asked for that long is no longer asked for
CONTROL_STALE_S = 5.0


class ControlRelay:
    """Per generation: when its sender last asked, the trainer reports to forward, and the coordinator's latest
    answer (``want_full`` and gaps kept until delivered once)."""

    def __init__(self) -> None:
        self._ctl: dict[int, dict] = {}

    def ask(self, generation: int, trainer: dict | None) -> dict | None:
        """The latest answer for ``generation`` (``want_full`` and ``gaps`` delivered once), None while none is
        younger than :data:`CONTROL_STALE_S`; ``trainer`` is forwarded with the next ask."""
        st = self._ctl.setdefault(generation, {"asked": 0.0, "trainers": [], "answer": None, "at": 0.0,
                                               "want_full": False, "gaps": []})
        st["asked"] = time.monotonic()
        if trainer:
            st["trainers"].append(trainer)
        if st["answer"] is None or time.monotonic() - st["at"] > CONTROL_STALE_S:
            return None
        out = dict(st["answer"], want_full=st["want_full"], gaps=st["gaps"])
        st["want_full"], st["gaps"] = False, []
        return out

    def requests(self) -> dict:
        """``{generation: [trainer reports]}`` of the generations asked for within :data:`CONTROL_STALE_S` (the
        reports taken); a generation not asked for a minute, with nothing left to deliver, is forgotten."""
        now = time.monotonic()
        out = {}
        for gen, st in list(self._ctl.items()):
            if now - st["asked"] > CONTROL_STALE_S:
                if now - st["asked"] > 60.0 and not st["want_full"] and not st["gaps"]:
                    del self._ctl[gen]
                continue
            out[gen], st["trainers"] = st["trainers"], []
        return out

    def answered(self, generation: int, answer: dict | None, trainers: list) -> None:
        """The coordinator's answer for ``generation``; ``answer=None``: the ask failed, its ``trainers`` go
        with the next one."""
        st = self._ctl.get(generation)
        if st is None:
            return
        if answer is None:
            st["trainers"][:0] = trainers
            return
        st["answer"] = {"delegate": answer.get("delegate", False), "draining": answer.get("draining") or {}}
        st["at"] = time.monotonic()
        st["want_full"] = st["want_full"] or bool(answer.get("want_full"))
        st["gaps"] = st["gaps"] + list(answer.get("gaps") or [])
