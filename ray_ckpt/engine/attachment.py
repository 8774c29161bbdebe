"""What one attach holds, released in one place: the writer lease, the sink (its background thread) and the
capture (its hooks on the optimizer).

A :class:`~ray_ckpt.Checkpointer` and a :class:`~ray_ckpt.engine.rankloop.RankLoopRecorder` take these one by one
while they attach; whatever was taken is released, newest first, whether the attach fails halfway
(:meth:`Attachment.releasing_on_error`), the loop ends (:meth:`Attachment.close`) or the owner is collected
(:meth:`Attachment.release`). Runs in the training process (the owner's thread); no Ray.

Every attachment not released yet is listed by :func:`open_attachments`, so that a harness can close what a
failed or careless caller left running — the test suite does, naming the owner, before it shuts Ray down. The
list holds weak references, and still finds every Checkpointer left open: one its caller dropped stays alive
while its optimizer does (the capture's hooks lead back to it), and one that is collected released its attachment
(``Checkpointer.__del__``). A collected :class:`~ray_ckpt.engine.rankloop.RankLoopRecorder` (no ``__del__``)
leaves the list while its writer thread ends only with the process.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator

log = logging.getLogger("ray_ckpt")

#: the attachments of this process not released yet (weak references: see open_attachments)
_OPEN: "weakref.WeakSet[Attachment]" = weakref.WeakSet()


def open_attachments() -> list["Attachment"]:
    """The attachments of this process not released yet, each naming its owner (:attr:`Attachment.owner`): live
    ones only (see the module docstring). For a harness that must leave nothing running (a sink's thread, a drain
    watch) when a caller did not close: it calls :meth:`Attachment.release` on each. Any thread."""
    return [a for a in list(_OPEN) if not a.closed]


class Attachment:
    """The lease, sink and capture of one attach. Training thread.

    Release order is the reverse of acquisition: the capture's hooks come off the optimizer, the sink's
    thread stops (after handling what it was given), then the lease is released. Every step runs even when an
    earlier one raises; releasing twice does nothing."""

    def __init__(self, owner: str = "") -> None:
        self.sink: Any = None
        self.capture: Any = None
        self.lease: Any = None
        self.closed = False
        #: who holds it, in words (e.g. ``"Checkpointer of file:///ckpt (runtime=ray)"``): names it in reports
        self.owner = owner
        self._stack = contextlib.ExitStack()
        self._timeout: float | None = None
        _OPEN.add(self)

    def take_lease(self, lease, *, takeover: bool = False):
        """Acquire ``lease`` (a :class:`~ray_ckpt.engine.lease.Lease`; raises LeaseError naming the holder)
        and hold it until released. Returns it."""
        lease.acquire(takeover=takeover)
        self.lease = lease
        self._stack.callback(lease.release)
        return lease

    def hold_sink(self, sink):
        """Hold ``sink`` (an engine writer or the Ray runtime's sink, its thread started): closed on release,
        within the timeout given to :meth:`close` / :meth:`release`. Returns it."""
        self.sink = sink
        self._stack.callback(lambda: sink.close(self._timeout))
        return sink

    def hold_capture(self, capture):
        """Hold ``capture`` (installed on its optimizer): detached on release. Returns it."""
        self.capture = capture
        self._stack.callback(capture.detach)
        return capture

    def hold_watch(self, watch):
        """Hold ``watch`` (a drain watch of the sink, anything with ``stop()``; None: nothing): stopped on
        release, before the sink closes. Returns it."""
        if watch is not None:
            self._stack.callback(watch.stop)
        return watch

    @contextlib.contextmanager
    def releasing_on_error(self) -> Iterator["Attachment"]:
        """Around an attach: when the block raises, everything taken so far is released and the block's error
        propagates (an error of the release itself is logged, not raised over it)."""
        try:
            yield self
        except BaseException:
            try:
                self.release()
            except Exception as e:  # noqa: BLE001 - the attach's own error is the one to see
                log.warning("ray_ckpt: releasing a failed attach: %s", e)
            raise

    def flush(self, timeout: float | None = None) -> None:
        """Finalize the pending record and wait until the sink has handled every step so far. Blocks."""
        self.capture.flush_pending()
        self.sink.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finalize the pending record, then release everything (the sink closes after handling what it
        holds: a flush). Idempotent."""
        if self.closed:
            return
        try:   # a failed sink takes nothing more: its error was raised already, or the sink's close raises it
            if self.capture is not None and not self.sink.failed:
                self.capture.flush_pending()
        finally:
            self.release(timeout)

    def release(self, timeout: float | None = None) -> None:
        """Release everything held, newest first, each step even when an earlier one raised (the last error is
        raised after all ran). ``timeout``: seconds the sink's close may wait. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        self._timeout = timeout
        self._stack.close()
