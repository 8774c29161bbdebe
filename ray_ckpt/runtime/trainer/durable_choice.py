"""``durable_diffs="auto"``: which diff chunks the durable tier gets, chosen from the node worker's measured write
bandwidth and the rate of diff bytes handed over (:func:`ray_ckpt.policy.budget.choose_durable`): every one
("all"), or only what the fulls do not cover ("fulls", held in memory meanwhile).

Runs on the sender thread (:class:`ray_ckpt.runtime.trainer.sink.RaySink`): about every :data:`BANDWIDTH_S` one
asynchronous ``stats`` call to the worker, never waited for (:class:`ray_ckpt.runtime.calls.Calls`: a unit test
passes futures).
"""
from __future__ import annotations

import logging

from ray_ckpt.policy.budget import choose_durable
from ray_ckpt.runtime.calls import RAY, Calls

log = logging.getLogger("ray_ckpt")

BANDWIDTH_S = 2.0      # how often the sender reads the node worker's write figures


class DurableChoice:
    def __init__(self, mode: str, run: str = "", calls: Calls = RAY) -> None:
        self.run = run
        self.auto = mode == "auto"           #: the mode is chosen per chunk
        self.choice = "all" if self.auto else mode   #: the mode of the next diff chunks
        self.reason = "write bandwidth not measured yet" if self.auto else "set by the user"
        self.write_bw: float | None = None   #: the node worker's measured storage write bandwidth, bytes/s
        self._calls = calls
        self._ref = None
        self._t = 0.0
        self._prev: tuple | None = None      # (time, worker bytes, worker write seconds, diff bytes handed over)

    def info(self) -> dict:
        """What a diff chunk's manifest info says of the mode (``durable_diffs="fulls"`` while the bandwidth does
        not carry every diff), for "auto"; the other modes are in the sink's info already."""
        return {"durable_diffs": "fulls"} if self.auto and self.choice == "fulls" else {}

    def stats(self) -> dict:
        return {"mode": self.choice, "auto": self.auto, "write_bandwidth": self.write_bw, "reason": self.reason}

    def measure(self, now: float, worker, diff_bytes: int) -> None:
        """Read the worker's write figures about every :data:`BANDWIDTH_S` (``diff_bytes``: handed over so far),
        derive its write bandwidth and choose the mode of the next diff chunks. Never waits."""
        if self._ref is None:
            if now - self._t >= BANDWIDTH_S:
                self._t = now
                try:
                    self._ref = worker.stats.remote()
                except Exception:  # noqa: BLE001
                    self._ref = None
            return
        if not self._calls.ready([self._ref]):
            return
        ref, self._ref = self._ref, None
        try:
            w = self._calls.get(ref)
        except Exception as e:  # noqa: BLE001 - a restarting worker: ask again later
            log.debug("ray_ckpt: worker stats unavailable: %s", e)
            return
        cur = (now, w.get("bytes_written", 0), w.get("write_seconds", 0.0), diff_bytes)
        prev, self._prev = self._prev, cur
        if prev is None or cur[0] <= prev[0]:
            return
        dbytes, dsec = cur[1] - prev[1], cur[2] - prev[2]
        if dbytes >= 1 << 20 and dsec > 0.01:
            bw = dbytes / dsec
            self.write_bw = bw if self.write_bw is None else 0.5 * self.write_bw + 0.5 * bw
        rate = (cur[3] - prev[3]) / (cur[0] - prev[0])
        choice, self.reason = choose_durable(self.choice, diff_rate=rate, write_bw=self.write_bw)
        if choice != self.choice:
            log.info("ray_ckpt: durable_diffs=auto -> %s for run %r: %s", choice, self.run, self.reason)
            self.choice = choice
