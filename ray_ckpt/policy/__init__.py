"""Pure decisions: a context in, a decision out; the caller carries it out. No torch, no Ray."""
from ray_ckpt.policy.frequency import FixedFrequencyPolicy, FrequencyPolicy, StepContext, StepDecision

__all__ = ["FixedFrequencyPolicy", "FrequencyPolicy", "StepContext", "StepDecision"]
