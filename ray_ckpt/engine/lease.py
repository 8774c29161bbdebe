"""One writer per lineage: a lease object at ``<root>/lease.json``.

Two jobs writing one URI would each take "largest generation + 1" and interleave their objects; restores then
return states of neither run. So a writer holds a lease: created with a create-only write (``O_EXCL``-like
under a file lock for local storage, ``If-None-Match: *`` on S3), renewed (heartbeat) and checked with
compare-and-swap writes (``If-Match``), deleted when the writer closes. A second writer fails at attach with
:class:`LeaseError` naming the holder (host, pid, run, last heartbeat); a lease left by a crashed job is taken
over only when asked (``takeover=True``, or ``ray-ckpt lease URI --release``), never silently; the one
exception is a holder that ran on this host and whose process is gone (certain, logged): a job restarted after a
crash on the same machine continues without ceremony. A writer whose lease was taken over notices at its next
renewal and stops writing (:class:`LeaseLost`).

Holders: with ``runtime="local"`` the :class:`~ray_ckpt.Checkpointer` (its writer thread renews); with
``runtime="ray"`` the run (the coordinator renews, once a ``ttl/3``); every Checkpointer of the same run shares
it, so Ray Train restarts and resizes need no takeover. Runs in the process of the holder; no Ray.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage.layout import LEASE_KEY
from ray_ckpt.storage import ObjectNotFound, StorageError

log = logging.getLogger("ray_ckpt")

DEFAULT_TTL = 60.0


class LeaseError(RayCkptError, RuntimeError):
    """Another writer holds the lineage's lease."""


class LeaseLost(RayCkptError, RuntimeError):
    """This writer's lease was taken over by another writer: it must stop writing."""


class Lease:
    """The writer lease of the lineage at ``storage`` for ``run`` (``run`` None: a plain Checkpointer, which
    shares its lease with nobody)."""

    def __init__(self, storage, *, run: str | None = None, ttl: float = DEFAULT_TTL):
        #: backends without conditional writes (test doubles, third-party backends) get no lease (logged)
        self.enabled = all(callable(getattr(storage, f, None)) for f in ("create", "read_versioned", "replace_if"))
        if not self.enabled:
            log.info("ray_ckpt: %s offers no conditional writes: no writer lease", type(storage).__name__)
        self.storage = storage
        self.run = run
        self.ttl = ttl
        self.owner = uuid.uuid4().hex
        self._version: str | None = None
        self._renewed = 0.0

    def _record(self) -> bytes:
        now = time.time()
        return json.dumps({"owner": self.owner, "run": self.run, "host": socket.gethostname(), "pid": os.getpid(),
                           "ttl": self.ttl, "heartbeat": now}).encode()

    def _current(self) -> tuple[dict | None, str | None]:
        """The lease record and its version (None, None: no lease). A storage fault raises StorageError."""
        try:
            got = self.storage.read_versioned(LEASE_KEY)
        except ObjectNotFound:
            return None, None
        except StorageError:
            raise
        except Exception as e:   # noqa: BLE001 - a backend's own error type: a storage fault all the same
            raise StorageError(f"cannot read the writer lease of {self.storage.describe()}: "
                               f"{type(e).__name__}: {e}") from e
        if not (isinstance(got, tuple) and len(got) == 2):   # a backend answering nothing (None) during an outage
            raise StorageError(f"cannot read the writer lease of {self.storage.describe()}: the storage returned "
                               f"{got!r}")
        data, version = got
        try:
            rec = json.loads(data)
            if not isinstance(rec, dict):
                raise ValueError
        except ValueError:
            rec = {"owner": "<unreadable lease>"}
        return rec, version

    def acquire(self, *, takeover: bool = False) -> None:
        """Hold the lease, or raise :class:`LeaseError` naming the holder. ``takeover=True`` replaces another
        holder's lease (logged with who held it)."""
        for _ in range(5):
            if self.storage.create(LEASE_KEY, self._record()):
                self._after_write()
                return
            cur, version = self._current()
            if cur is None:
                continue                                   # released between the two calls
            shared = self.run is not None and cur.get("run") == self.run
            dead = _holder_is_dead(cur)
            if dead:
                log.warning("ray_ckpt: the writer lease of %s was held by %s, which is no longer running on this "
                            "host: taking it over", self.storage.describe(), describe(cur))
            if not shared and not takeover and not dead:
                raise LeaseError(f"{self.storage.describe()} is being written by another job: {describe(cur)}. Two "
                                 f"writers on one lineage would corrupt it. Use another URI; or, if that job is "
                                 f"gone, take its lease over: takeover=True (Checkpointer) or "
                                 f"`ray-ckpt lease {self.storage.describe()} --release`")
            if self.storage.replace_if(LEASE_KEY, self._record(), version):
                if not shared and not dead:
                    log.warning("ray_ckpt: took over the writer lease of %s from %s", self.storage.describe(),
                                describe(cur))
                self._after_write()
                return
        raise LeaseError(f"could not acquire the writer lease of {self.storage.describe()}: it keeps changing "
                         f"(another writer is starting)")

    def _after_write(self) -> None:
        _, self._version = self._current()
        self._renewed = time.monotonic()

    def renew(self, *, force: bool = False) -> None:
        """Check that this writer still holds the lease (one small read: call it before each commit) and renew
        the heartbeat (a write, at most once a ``ttl/3`` unless ``force``). Raises :class:`LeaseLost` when
        another writer took the lease over or it was released, :class:`~ray_ckpt.StorageError` when the storage
        could not be read or written (an outage: the caller retries later). Holder's thread."""
        if not self.enabled:
            return
        cur, version = self._current()
        if cur is None or (cur.get("owner") != self.owner and not (self.run is not None
                                                                    and cur.get("run") == self.run)):
            raise LeaseLost(f"the writer lease of {self.storage.describe()} is now held by "
                            f"{describe(cur) if cur else 'nobody (released)'}: this writer stopped")
        if not force and time.monotonic() - self._renewed < self.ttl / 3:
            return
        try:
            renewed = self.storage.replace_if(LEASE_KEY, self._record(), version)
        except StorageError:
            raise
        except Exception as e:   # noqa: BLE001 - a backend's own error type: a storage fault all the same
            raise StorageError(f"cannot renew the writer lease of {self.storage.describe()}: "
                               f"{type(e).__name__}: {e}") from e
        if renewed:
            self._after_write()

    def release(self) -> None:
        """Delete the lease if this writer (or its run) still holds it. Holder's thread; never raises."""
        if not self.enabled:
            return
        try:
            cur, _ = self._current()
            if cur is not None and (cur.get("owner") == self.owner or (self.run is not None
                                                                        and cur.get("run") == self.run)):
                self.storage.delete(LEASE_KEY)
        except Exception as e:  # noqa: BLE001
            log.warning("ray_ckpt: could not release the writer lease of %s: %s", self.storage.describe(), e)


def _holder_is_dead(rec: dict) -> bool:
    """The holder ran on this host and its process is gone (certain, unlike a late heartbeat)."""
    pid = rec.get("pid")
    if rec.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def describe(rec: dict) -> str:
    """Who holds a lease, for messages."""
    age = time.time() - rec["heartbeat"] if isinstance(rec.get("heartbeat"), (int, float)) else None
    stale = age is not None and age > 3 * float(rec.get("ttl") or DEFAULT_TTL)
    who = f"host {rec.get('host')} pid {rec.get('pid')}" + (f", run {rec['run']!r}" if rec.get("run") else "")
    if age is not None:
        who += f", last heartbeat {age:.0f} s ago" + (" (stale: that job is probably gone)" if stale else "")
    return who


def read_lease(storage) -> dict | None:
    """The current lease record, or None. Any process."""
    try:
        return json.loads(storage.read(LEASE_KEY))
    except ObjectNotFound:
        return None
