"""When to take a full checkpoint and when to close a diff batch.

Called on the training thread once per optimizer step, so decisions are O(1) and allocate nothing big.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, kw_only=True)
class StepContext:
    step: int                 #: the optimizer step just completed
    last_full_step: int       #: step of the latest full checkpoint taken
    steps_in_batch: int       #: records in the current, not yet written, diff batch (including this one)
    failures: int = 0         #: failures seen by the run so far (for adaptive policies)


@dataclass(frozen=True)
class StepDecision:
    full: bool                #: take a full checkpoint at this step
    close_batch: bool         #: write the current diff batch now
    #: hand this step's record to the sink (False: the overhead budget leaves the step unrecorded; only a full
    #: of it is a recovery point)
    record: bool = True


class FrequencyPolicy(Protocol):
    def decide(self, ctx: StepContext) -> StepDecision: ...


@dataclass(frozen=True)
class FixedFrequencyPolicy:
    """Full every ``full_every`` steps (at multiples of it), a diff object every ``batch_steps`` steps."""

    full_every: int
    batch_steps: int

    def decide(self, ctx: StepContext) -> StepDecision:
        full = ctx.step % self.full_every == 0 or ctx.step - ctx.last_full_step >= self.full_every
        return StepDecision(full=full, close_batch=full or ctx.steps_in_batch >= self.batch_steps)
