"""The training process's side of the shared-memory hand-off (:mod:`ray_ckpt.runtime.shared`): the arena the
capture's gradient buffers are carved from, named to the node's persistence worker by descriptors. Training process
(``allocate`` on the training thread, ``describe`` and ``close`` on the sender thread)."""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from ray_ckpt.runtime.shared import ALIGN, TAG, SharedMemoryUnavailable


class SharedArena:
    """Shared memory of one sink, carved into the capture's buffers (training process; ``allocate`` on the training
    thread, ``describe`` on the sender). Buffers are never returned: the capture's pool recycles them, so the arena
    holds at most what is in flight. Pages are backed only once touched."""

    def __init__(self, nbytes: int):
        if not hasattr(os, "memfd_create"):
            raise SharedMemoryUnavailable("os.memfd_create is not available on this platform")
        self.size = max(ALIGN, nbytes)
        self.fd = os.memfd_create("ray_ckpt-capture", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.pid, self.ino = os.getpid(), os.fstat(self.fd).st_ino
        #: the mapping's address in this process (a view exported once: :meth:`describe` locates buffers by it)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self._base = self._view.ctypes.data
        self._next = 0
        self._lock = threading.Lock()
        self.closed = False

    def allocate(self, nbytes: int):
        """``(uint8 tensor of nbytes, descriptor)`` of fresh zeroed shared memory, or None when the arena is full
        or closed (the caller takes heap memory)."""
        import torch
        with self._lock:
            if self.closed or self._next + nbytes > self.size:
                return None
            off = self._next
            self._next += nbytes + (-nbytes) % ALIGN
        t = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=off)
        return t, (TAG, self.pid, self.fd, self.ino, off, nbytes)

    def describe(self, buf):
        """The descriptor of ``buf`` (a contiguous buffer: a numpy array, a memoryview) when its bytes lie in this
        arena — a gradient buffer, a full's tensor — else None (also once closed: no worker can map it any more).
        Sender thread: the hand-off then names the memory instead of carrying its bytes."""
        if self.closed or isinstance(buf, (bytes, bytearray)):
            return None
        try:
            a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
        except (TypeError, ValueError):
            return None
        if a.size == 0 or not a.flags.c_contiguous:
            return None
        off = a.ctypes.data - self._base
        if off < 0 or off + a.nbytes > self.size:
            return None
        return (TAG, self.pid, self.fd, self.ino, off, a.nbytes)

    def close(self) -> None:
        """No more buffers; the file descriptor is closed (a worker can no longer map the arena; mappings live on
        until their buffers are garbage-collected)."""
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)
