"""The sink: what a capture hands each step to, and every member the training process calls on one.

Implementations: the engine's writer thread (:class:`ray_ckpt.engine.writer.AsyncWriter`, ``runtime="local"``),
the Ray runtime's sender (``ray_ckpt.runtime.trainer.sink.RaySink``, ``runtime="ray"``) — both through
:class:`ray_ckpt.engine.writer.BoundedSink` — and a non-writing HSDP replica's
(:class:`ray_ckpt.engine.hsdp.NoWrites`). :class:`Sink` states every member and gives the defaults of a sink that
has no such capability, so that callers (``Checkpointer``, the captures) never ask whether a sink has a member.

Call order, all in the training process::

    host_memory(nbytes)          training thread, while the capture sizes its buffers
    handoff_cpu(records)         training thread, at attach (the overhead budget's calibration)
    attach_capture(capture, s)   training thread, once, before the attach full
    previous_granularity()       training thread, at attach (a restart starts from the measured granularity)
    submit(item)                 training thread, every recorded step; may block (backpressure)
    full_control()               training thread, every step, O(1)
    drain_due                    training thread, every step, O(1) (the overhead budget)
    wait_safe() / wait_received() training thread, at attach (runtime="ray")
    notice(info, deadline)       any thread (a drain watch, the sink's own background thread)
    noticed, stats, pending_bytes, failed, closed, measures_cpu, background_cpu()   any thread
    runtime_stats()              training thread (``Checkpointer.stats``)
    flush(timeout) / close(timeout)   training thread; block
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ray_ckpt.errors import RayCkptError


class WriterError(RayCkptError, RuntimeError):
    """The background writer failed; what was captured after the last commit is not durable."""


@dataclass
class WriterStats:
    objects_written: int = 0
    bytes_written: int = 0
    diff_bytes: int = 0
    full_bytes: int = 0
    steps_committed: int = 0
    last_committed_step: int | None = None
    stall_seconds: float = 0.0          #: time the training thread waited (backpressure: memory, queue length)
    queue_stalls: int = 0               #: steps whose hand-off waited for a background thread that fell behind
    objects_deleted: int = 0            #: garbage-collected by ``keep_fulls`` (runtime="local")
    write_seconds: float = 0.0
    encode_seconds: float = 0.0
    notice_syncs: int = 0               #: steps that waited until they were safe under a drain notice
    notice_sync_seconds: float = 0.0    #: ... and how long the training thread waited for them


@dataclass
class FlushMarker:
    """A queue entry asking a sink's background thread to finish everything queued before it, then set
    ``done``. Put by the training thread (``flush``), consumed by the sink's thread. ``safe_only``: done once
    everything before it is safe (held on two nodes or durable); ``received_only``: once this node's persistence
    worker holds it (the Ray runtime's sender; a writer writes it either way)."""

    done: threading.Event = field(default_factory=threading.Event)
    safe_only: bool = False
    received_only: bool = False


class Sink:
    """Receives captured items in step order (see the module docstring for the call order). A subclass
    implements :meth:`submit`, :meth:`flush` and :meth:`close`; every other member has the default of a sink
    without that capability."""

    #: what this sink has committed (or handed over), read by ``Checkpointer.stats``
    stats: WriterStats
    #: seconds of the attach's phases that made this sink (``runtime="ray"``: coordinator, replica, node worker)
    startup: dict | None = None
    #: whether the state tier's replica takes the policy's fulls and a fingerprint of the state is sent to it
    replica_enabled: bool = False

    def submit(self, item: Any, *, close_batch: bool = False) -> None:
        """Queue a step record or a full (training thread; may block for memory)."""
        raise NotImplementedError

    def flush(self, timeout: float | None = None) -> None:
        """Return once everything submitted so far is handled (training thread; blocks)."""
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop (training thread; blocks). Idempotent."""
        raise NotImplementedError

    def wait_safe(self, timeout: float | None = 300.0) -> None:
        """Return once everything submitted so far is safe: held on two nodes, or durable (training thread).
        Default: a flush."""
        self.flush(timeout)

    def wait_received(self, timeout: float | None = 300.0) -> None:
        """Return once everything submitted so far outlives this process (training thread). Default: a flush."""
        self.flush(timeout)

    def full_control(self) -> tuple[bool, bool]:
        """``(delegated, wanted)`` (training thread, O(1)): ``delegated`` — the persistence tier materializes the
        policy's fulls itself (the state tier's replica), so the trainer takes none; ``wanted`` — take a full at
        the next step whatever the policy says (a gap in the lineage, a lost or diverged replica)."""
        return False, False

    def handoff_cpu(self, records: list) -> float:
        """CPU seconds this process spends handing ``records`` (consecutive steps' records) over beyond their
        capture, measured by doing this sink's work on them in the calling thread (their encode as one batch; the
        checksum where this process computes it), without handing them over (training thread, at attach: the
        overhead budget's calibration). Default: 0.0 (a sink that hands nothing over)."""
        return 0.0

    def host_memory(self, nbytes: int) -> Any:
        """Memory for one of the capture's per-step gradient buffers: ``(zeroed uint8 CPU tensor, handle)``, or
        None for heap memory (training thread; :class:`ray_ckpt.engine.capture.PackedPool`)."""
        return None

    def attach_capture(self, capture: Any, start_step: int) -> None:
        """The training loop's capture, whose step times and step count the sink may publish (training thread,
        once)."""

    def previous_granularity(self) -> dict | None:
        """The overhead budget's state a previous attempt of this run measured, or None (training thread, at
        attach)."""
        return None

    def runtime_stats(self) -> dict | None:
        """Figures of the persistence tier beyond :attr:`stats` (``Checkpointer.stats()["runtime"]``), or None
        (training thread)."""
        return None

    def notice(self, info: dict | None, deadline: float | None = None) -> None:
        """A drain notice of this process's node (see :class:`ray_ckpt.engine.drains.DrainNotice`), or its end.
        Any thread. Default: ignored (a sink that hands nothing over has nothing to make safe)."""

    @property
    def noticed(self) -> dict | None:
        """The drain notice in force (a copy), or None. Any thread."""
        return None

    @property
    def drain_due(self) -> bool:
        """Whether a drain notice asks for every step to be recorded now. Training thread, O(1)."""
        return False

    @property
    def measures_cpu(self) -> bool:
        """Whether :meth:`background_cpu` reads a background thread's own CPU clock."""
        return False

    def background_cpu(self) -> float:
        """CPU seconds this sink's background thread has used (0.0 without one). Any thread."""
        return 0.0

    @property
    def pending_bytes(self) -> int:
        """Bytes submitted and not yet released (written, or safe). Any thread."""
        return 0

    @property
    def failed(self) -> bool:
        """Whether the sink failed (what :meth:`submit` and :meth:`flush` then raise). Any thread."""
        return False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran. Any thread."""
        return False
