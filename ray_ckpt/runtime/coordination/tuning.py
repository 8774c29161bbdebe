"""AdaptiveTuning: the run's frequency policy (full every N steps, records in batches of B) as the adaptive
tuner (:mod:`ray_ckpt.policy.adaptive`) chooses it, fed by commits, trainer reports and failures; pinned values
never change. Each changed decision is published to storage (the policy report).

Runs in the coordinator actor's thread; no Ray.
"""
from __future__ import annotations

import logging
import time

from ray_ckpt.policy import FixedFrequencyPolicy
from ray_ckpt.policy import adaptive as _adaptive
from ray_ckpt.runtime.coordination.state import RunRef

log = logging.getLogger("ray_ckpt")


class AdaptiveTuning:
    """The tuner of run ``run`` (its report goes to ``run.storage``). Coordinator actor thread."""

    def __init__(self, run: RunRef, full_every: int, batch_steps: int, started_at: float,
                 options: dict | None = None):
        self.run = run
        self.tuner = _adaptive.make_tuner(full_every, batch_steps, started_at=started_at, **(options or {}))

    def decide(self, publish: bool = False) -> None:
        """Re-optimize when due; publish the report to storage when the decision changed (or ``publish``: a
        failure was recorded)."""
        before = len(self.tuner.history)
        now = time.time()
        self.tuner.decide(now)
        if publish or len(self.tuner.history) != before:
            log.info("ray_ckpt coordinator: policy -> full_every=%d batch_steps=%d: %s",
                     *self.tuner.current(), self.tuner.choice.reason)
            _adaptive.publish_report(self.run.storage, self.tuner.report(now))

    def policy(self) -> FixedFrequencyPolicy:
        """The frequency policy in force, for a (re)attaching Checkpointer."""
        return FixedFrequencyPolicy(*self.tuner.current())

    def report(self) -> dict:
        """What the policy decides, from which estimates, and why (after a decision if one is due)."""
        self.decide()
        return self.tuner.report(time.time())

    def observe_commit(self, m) -> None:
        """An object (manifest ``m``) was committed to storage."""
        _adaptive.observe_manifest_commit(self.tuner, kind=m.kind, first_step=m.first_step,
                                          last_step=m.last_step, nbytes=m.nbytes, created=m.created,
                                          now=time.time())
        self.decide()

    def observe_trainer(self, trainer: dict | None) -> None:
        """A trainer's measured window (step time, capture, optimizer step, other CPU per step) for the cost
        model; a malformed report is ignored (it must not fail the trainer's control call)."""
        if not trainer:
            return
        window = {k: v for k, v in trainer.items() if k != "granularity"}
        try:
            self.tuner.observe_trainer(**window)
            self.decide()
        except (TypeError, ValueError) as e:
            log.debug("ray_ckpt coordinator: trainer report ignored: %s", e)

    def observe_failure(self, at: float) -> None:
        """A worker-group failure at ``at`` (wall clock): re-decide and publish."""
        self.tuner.observe_failure(at)
        self.decide(publish=True)
