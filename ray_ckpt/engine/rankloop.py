"""Per-rank loop state: each rank's RNG states and ``extra_state``, step by step, next to the run's lineage.

Model and optimizer state are replicated across data-parallel ranks, so world rank 0's lineage holds them once.
What is *not* replicated is each rank's loop state: its RNG streams (dropout masks, the shuffling sampler) and its
``extra_state`` (its data position). Every rank other than 0 records its own, with the same capture machinery
(:class:`ray_ckpt.engine.lowdiff.LoopCapture`: a record per optimizer step, taken in the post-step hook, a copy
of a few KB) into its own small lineage below ``<root>/ranks/<rank>/``, written by a writer thread of that rank
(:class:`RankLoopRecorder`).

Each rank lineage generation is tagged with the *main* generation (rank 0's attach) it belongs to, so a restore
only uses loop state recorded alongside the main chain it restores. The rules at a restore (see
:func:`ray_ckpt.train.agreed_restore`):

* the step restored on every rank is at most the last step every rank of that generation has recorded;
* a rank with a record of that step gets its own RNG and extra state back, bitwise;
* a rank that has none (it was not part of the saved world: the group grew) keeps rank 0's extra state and
  derives its RNG streams deterministically from rank 0's restored state and its rank
  (:func:`ray_ckpt.engine.loopstate.derive_rng`).

Where calls run: :class:`RankLoopRecorder` and :func:`apply_rank_loop` in the rank's training process (the
writer in its thread); :func:`rank_loop_head` and :func:`load_rank_loop` in any process.
"""
from __future__ import annotations

import logging
from typing import Any

from ray_ckpt.engine.attachment import Attachment
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.rank_heads import (MAIN_GENERATION, generation_lineage, rank_loop_head,  # noqa: F401
                                       rank_storage)
from ray_ckpt.engine.loopstate import apply_loop
from ray_ckpt.engine.lowdiff import LoopCapture, LoopImpl, LoopOnly
from ray_ckpt.engine.restore import load_chain
from ray_ckpt.engine.writer import AsyncWriter
from ray_ckpt.lineage import NoCheckpointError
from ray_ckpt.policy import FixedFrequencyPolicy

log = logging.getLogger("ray_ckpt")

class RankLoopRecorder:
    """Records rank ``rank``'s loop state for every optimizer step of ``optimizer``. Training process of the rank.

    Attaching writes the loop state at ``start_step`` synchronously (so a restart always finds the start of the
    generation); later records go through a writer thread in batches of ``batch_steps`` or what arrived within
    ``max_batch_delay`` seconds, whichever comes first, with a loop-state full every ``full_every`` steps.
    :func:`ray_ckpt.train.attach` gives it the run's ``handoff_delay`` as ``max_batch_delay``: the cadence rank 0
    hands its step records to the node's persistence worker at, so each rank's loop state keeps pace with the
    step records (the step a restore can agree on is bounded by every rank's written loop state: a batch held
    back longer would cost the whole group those steps after a crash). With ``max_batch_delay=0`` each record is
    written as soon as it is captured; records that arrive while a write is in flight go into the next write
    together, so a writer on slow storage never falls behind by more than one write. Call :meth:`close` at the
    end of training (flushes)."""

    def __init__(self, storage, rank: int, model, optimizer, *, main_generation: int, start_step: int,
                 extra_state: Any = None, full_every: int = 100, batch_steps: int = 10,
                 max_pending_bytes: int = 64 << 20, max_batch_delay: float | None = 0.2):
        self.rank = rank
        self.storage = rank_storage(storage, rank)
        lineage, _ = load_lineage(self.storage, strict=False)
        self.generation = lineage.next_generation()
        self.main_generation = main_generation
        impl = LoopImpl(LoopOnly())
        self._att = Attachment(owner=f"RankLoopRecorder of rank {rank} of {self.storage.describe()}")
        with self._att.releasing_on_error():
            sink = self._att.hold_sink(AsyncWriter(
                self.storage, self.generation, impl, max_pending_bytes=max_pending_bytes,
                info={MAIN_GENERATION: int(main_generation), "rank": rank}, index=lineage.manifests,
                max_batch_delay=max_batch_delay))
            self._capture = self._att.hold_capture(LoopCapture(
                model, optimizer, sink, FixedFrequencyPolicy(full_every, batch_steps), start_step=start_step,
                extra_state=extra_state))
            sink.submit(self._capture.snapshot_now())
            sink.flush()

    @property
    def step(self) -> int:
        return self._capture.step

    @property
    def sink(self):
        """The writer of this rank's loop state (a drain notice goes to it: see ``BoundedSink.notice``)."""
        return self._att.sink

    def flush(self, timeout: float | None = None) -> None:
        self._att.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._att.close(timeout)


def rank_loop_recorded(storage, rank: int, main_generation: int) -> bool:
    """Whether rank ``rank`` recorded any loop state while attached to main generation ``main_generation`` (it was
    part of that world), restorable or not. Any process."""
    return bool(generation_lineage(storage, rank, main_generation).manifests)


def load_rank_loop(storage, rank: int, main_generation: int, step: int) -> dict:
    """Rank ``rank``'s loop state after ``step`` of main generation ``main_generation`` (of the rank's timeline
    when that generation does not reach back to ``step``). Raises NoCheckpointError when it was not recorded.
    Any process."""
    lineage = generation_lineage(storage, rank, main_generation)
    try:
        plan = lineage.resolve(step)
    except NoCheckpointError:   # a step of an earlier generation (a fallback went back past this one's start)
        lineage, _ = load_lineage(rank_storage(storage, rank), strict=False)
        plan = lineage.resolve(step)
    if plan.step != step:
        raise NoCheckpointError(f"rank {rank} has no loop state of step {step} (generation {main_generation})")
    chain = load_chain(rank_storage(storage, rank), plan)
    return chain.records[-1].loop if chain.records else chain.full.loop


def apply_rank_loop(loop: dict, *, extra_state: Any = None, restore_rng: bool = True) -> None:
    """Install a rank's own loop state (after the replicated state was restored). Training process. A rank's
    loop state holds no param groups, scheduler or scaler, so :func:`apply_loop` sets extra state and RNG only."""
    apply_loop(loop, None, extra_state=extra_state, restore_rng=restore_rng)
