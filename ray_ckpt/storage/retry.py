"""Retrying storage calls through outages: exponential backoff within a time budget. Any thread, any process.

One policy for every writer (the local writer thread, the persistence workers): a storage outage shorter than
the budget costs time, never data. The caller's memory budget bounds what piles up meanwhile (the training
thread waits when it is exhausted). The first failure is logged as a WARNING, further ones at most every
``report_every`` seconds, and the recovery as a WARNING too (with how long the outage lasted).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

log = logging.getLogger("ray_ckpt")

T = TypeVar("T")


class RetryBudgetExceeded(Exception):
    """A storage call kept failing for the whole retry budget (the last error is chained)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retry for up to ``budget_s`` seconds after the first failure, sleeping ``first_delay_s`` doubled after
    each failure up to ``max_delay_s`` (each sleep scaled by a random factor in ``1 ± jitter``, so writers that
    failed together do not retry in lockstep); at least ``min_attempts`` attempts whatever the budget."""

    budget_s: float = 300.0
    first_delay_s: float = 0.05
    max_delay_s: float = 5.0
    min_attempts: int = 3
    report_every_s: float = 30.0
    jitter: float = 0.25

    def __post_init__(self):
        if self.budget_s < 0 or self.first_delay_s <= 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError(f"invalid retry policy {self}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.min_attempts < 1:
            raise ValueError(f"min_attempts must be >= 1, got {self.min_attempts}")

    def call(self, fn: Callable[[], T], what: str, *, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> T:
        """``fn()``, retried on any exception until it succeeds or the budget is spent (then
        :class:`RetryBudgetExceeded` naming ``what``, the attempts and the time, with the last error chained)."""
        t0 = None
        attempt = 0
        delay = self.first_delay_s
        last_report = None
        while True:
            attempt += 1
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - every storage failure is worth a retry within the budget
                now = clock()
                if t0 is None:
                    t0 = now
                spent = now - t0
                if attempt >= self.min_attempts and spent + delay > self.budget_s:
                    raise RetryBudgetExceeded(f"{what} failed {attempt} times over {spent:.1f} s (retry budget "
                                              f"{self.budget_s:g} s): {type(e).__name__}: {e}") from e
                if last_report is None or now - last_report >= self.report_every_s:
                    last_report = now
                    log.warning("ray_ckpt: %s failed (attempt %d, %.1f s into the outage): %s: %s; retrying for "
                                "up to %g s", what, attempt, spent, type(e).__name__, e, self.budget_s)
                sleep(delay * (1 + self.jitter * (2 * random.random() - 1)) if self.jitter else delay)
                delay = min(self.max_delay_s, delay * 2)
                continue
            if t0 is not None:
                log.warning("ray_ckpt: %s succeeded after %d attempts (%.1f s of failures)", what, attempt,
                            clock() - t0)
            return out
