"""What the overhead budget measures in the training process: its per-step meter, and the calibration at attach
that gives its first decision (:mod:`ray_ckpt.policy.budget`). Both run on the training thread, at attach; the
meter's clocks are then read once a window.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from ray_ckpt.engine.sink import Sink
from ray_ckpt.format.records import recycle
from ray_ckpt.policy.budget import BudgetPolicy, StepMeter

#: sample records timed at attach; the least is taken (the first pays for its buffers' first touch)
CALIBRATION_TRIES = 3
#: at most this many steps in the batch a sample record's hand-off is encoded in (the policy's ``batch_steps``)
MAX_BATCH = 16


def step_meter(sink: Sink, on_window, first_short: bool = False) -> StepMeter:
    """The training thread's per-step measurements for the overhead budget (CPU clocks read once a window). The
    other CPU is the sink's background thread's own clock: the process's other threads (gloo's or NCCL's, data
    loaders', Ray's) work for training as much without checkpointing. Without a per-thread clock: the process's CPU
    outside the training thread (conservative). ``first_short``: the first window closes after the meter's
    ``min_steps`` steps (a calibrated cost waits only for the step time)."""
    st = sink.stats
    if sink.measures_cpu:
        def cpu():
            return sink.background_cpu(), time.thread_time(), run_queue_wait()
    else:
        def cpu():
            t = time.thread_time()
            return time.process_time() - t, t, run_queue_wait()
    return StepMeter(clock=time.perf_counter, cpu=cpu, counters=lambda: (st.stall_seconds, st.bytes_written),
                     on_window=on_window, first_short=first_short)


def run_queue_wait() -> float:
    """Seconds the calling thread has waited for a core (Linux schedstat; 0.0 elsewhere). Training thread."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def calibrate(capture: Any, sink: Sink, policy: BudgetPolicy, startup: dict | None = None) -> bool:
    """What recording one step costs, timed before the first step on the training thread's CPU clock: the capture
    of a sample record (``capture.sample_record()``: the parameters standing in for the gradients) and the sink's
    hand-off work on it (``sink.handoff_cpu``: its encode, and the checksum where this process computes it, in a
    batch of the policy's ``batch_steps`` such records, per record), the least of :data:`CALIBRATION_TRIES`. The overhead budget's first decision comes from it
    (:meth:`BudgetPolicy.calibrate`); True when it will. ``startup`` gets ``"calibration"`` (seconds per step).
    Not in it: the actor calls and storage writes, whose share per step the windows measure afterwards. Training
    thread, at attach."""
    if not policy.wants_calibration:
        return False
    batch = max(1, min(MAX_BATCH, int(getattr(policy, "batch_steps", 1) or 1)))
    best = None
    for _ in range(CALIBRATION_TRIES):
        c0 = time.thread_time()
        rec = capture.sample_record()
        if rec is None:
            return False
        try:
            capture_s = time.thread_time() - c0
            # a batch of the record's steps, as the sink encodes them together: its per-object costs shared
            cost = capture_s + sink.handoff_cpu([dataclasses.replace(rec, step=rec.step + i)
                                                 for i in range(batch)]) / batch
        finally:
            recycle([rec])
        best = cost if best is None else min(best, cost)
    if startup is not None:
        startup["calibration"] = best
    return policy.calibrate(best)
