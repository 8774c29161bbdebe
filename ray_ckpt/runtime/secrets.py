"""The secret channel of the Ray runtime: how S3 credentials reach the run's actors without being pickled.

A storage backend that holds credentials (given as keyword options, in the URI, or read from the opening
process's ``AWS_*`` environment) is shipped to the detached actors (coordinator, persistence workers, replica)
as an argument. :meth:`ray_ckpt.storage.s3.S3Backend.__reduce__` hands its secrets to :func:`seal`, which puts
them into the Ray object store once per backend object (owned by the pickling process) and returns a
:class:`SealedSecrets` holding only the ObjectRef: the actor's creation arguments (kept by the GCS for restarts,
shown by ``ray list actors --detail``) carry a random 28-byte object ID, not the secret. Only processes given
that reference read it; no actor method returns a backend or its credentials (the coordinator exposes the
storage as ``describe()``, a URI without secrets).

An object lives as long as the process that sealed it. An actor restarted after that process exited opens
nothing (:meth:`SealedSecrets.open` returns None) and falls back to its own node's AWS environment and default
credential chain (profile, instance role), with a WARNING: give the nodes credentials, or the next attach
(whose process is alive) supplies a fresh backend to new actors.

Importing this module registers the channel (``ray_ckpt.runtime`` imports it). Runs in any process.
"""
from __future__ import annotations

import logging
import pickle

import ray

from ray_ckpt.storage import s3 as _s3

log = logging.getLogger("ray_ckpt")

#: Seconds :meth:`SealedSecrets.open` waits for the object (it is small and normally local or one hop away).
OPEN_TIMEOUT_S = 30.0


class SealedSecrets:
    """A reference to secrets in the Ray object store. Picklable (as the ObjectRef only); :meth:`open` in any
    process connected to the same Ray cluster."""

    __slots__ = ("_ref",)

    def __init__(self, ref):
        self._ref = ref

    def __reduce__(self):
        return (SealedSecrets, (self._ref,))

    def __repr__(self) -> str:
        return "SealedSecrets(<ObjectRef>)"

    def open(self) -> dict | None:
        """The secrets, or None when they are unreachable (no Ray in this process, owner exited, lost)."""
        if not ray.is_initialized():  # ray.get would start a new local Ray: never
            return None
        try:
            out = ray.get(self._ref, timeout=OPEN_TIMEOUT_S)
        except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError) as e:
            log.warning("ray_ckpt: sealed S3 credentials are unreachable: %s", type(e).__name__)
            return None
        return dict(out)


def seal(secrets: dict) -> SealedSecrets:
    """Put ``secrets`` into the object store (owned by this process); called while pickling a backend."""
    if not ray.is_initialized():
        raise pickle.PicklingError("S3 credentials are carried between processes only through Ray's object "
                                   "store (they are never pickled); this process is not connected to Ray")
    return SealedSecrets(ray.put(dict(secrets)))


_s3.set_secret_channel(seal)
