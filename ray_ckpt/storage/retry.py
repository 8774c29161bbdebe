"""Retrying storage calls through outages: exponential backoff within a time budget. Any thread, any process.

One policy for every writer (the local writer thread, the persistence workers): a storage outage shorter than
the budget costs time, never data. The caller's memory budget bounds what piles up meanwhile (the training
thread waits when it is exhausted). The first failure is logged as a WARNING, further ones at most every
``report_every`` seconds, and the recovery as a WARNING too (with how long the outage lasted).
"""
from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ray_ckpt.storage.base import StorageError

log = logging.getLogger("ray_ckpt")

T = TypeVar("T")


class RetryBudgetExceeded(StorageError):
    """A storage call kept failing for the whole retry budget (the last error is chained)."""


class PermanentStorageError(StorageError):
    """A storage call failed in a way waiting does not fix (permission denied, read-only, disk full, no such
    bucket): raised at once, the original error chained."""


_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                     errno.EISDIR}
_PERMANENT_MARKERS = ("ACCESS_DENIED", "AccessDenied", "NO_SUCH_BUCKET", "NoSuchBucket", "InvalidAccessKeyId",
                      "SignatureDoesNotMatch")


def permanent_cause(e: BaseException) -> BaseException | None:
    """The error in ``e``'s chain (``e`` itself, or what it was raised from) that retrying cannot fix, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (PermissionError, IsADirectoryError, NotADirectoryError)):
            return e
        if isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS:
            return e
        if any(m in str(e) for m in _PERMANENT_MARKERS):
            return e
        e = e.__cause__ or e.__context__
    return None


def is_permanent(e: BaseException) -> bool:
    """Whether ``e`` (or an error it was raised from) is one that retrying cannot fix."""
    return permanent_cause(e) is not None


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
        """``fn()``, retried on transient errors until it succeeds or the budget is spent (then
        :class:`RetryBudgetExceeded` naming ``what``, the attempts and the time, with the last error chained).
        Errors waiting cannot fix (:func:`is_permanent`) raise :class:`PermanentStorageError` at once."""
        t0 = None
        attempt = 0
        delay = self.first_delay_s
        last_report = None
        while True:
            attempt += 1
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - every transient storage failure is retried within the budget
                cause = permanent_cause(e)
                if cause is not None:
                    why = "" if cause is e else f" ({type(cause).__name__}: {cause})"
                    raise PermanentStorageError(f"{what} failed: {type(e).__name__}: {e}{why}; not retried: "
                                                "waiting does not fix it") from e
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
