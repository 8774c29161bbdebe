"""The optimizer's layout and a fingerprint of its parameters: what lets a process without the user's model code
rebuild and check the training state.

:func:`optimizer_layout` is recorded with every full checkpoint (training process, at attach); the shadow state
(:mod:`ray_ckpt.engine.shadow`), offline export and sharded restores rebuild the optimizer from it.
:func:`fingerprint` is a small bitwise sample of the parameters, shipped by the trainer with some step records
(:data:`FINGERPRINT_KEY` in their loop state) and compared by the shadow after replaying them.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ray_ckpt.engine.dtensor import local
from ray_ckpt.errors import RayCkptError

#: the loop-state key of a step record's parameter fingerprint
FINGERPRINT_KEY = "fingerprint"
_FP_PER_TENSOR = 16


class ShadowError(RayCkptError, RuntimeError):
    """The shadow cannot follow this training state (unknown optimizer, missing layout, diverged replay)."""


def optimizer_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What :class:`ray_ckpt.engine.shadow.ShadowState` needs to rebuild ``optimizer`` without user code
    (training process, at attach)."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    param_names = []
    device = "cpu"
    for g in optimizer.param_groups:
        for p in g["params"]:
            names = names_of.get(id(p))
            if not names:
                raise ShadowError("an optimizer parameter is not a parameter of the model")
            param_names.append(names)
            device = p.device.type
    cls = type(optimizer)
    return {"optimizer_class": f"{cls.__module__}:{cls.__qualname__}", "param_names": param_names,
            "device": device}


def fingerprint(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """A small bitwise sample of parameter values (up to 16 evenly spaced elements per tensor) as uint8, on the
    parameters' device. Equal fingerprints are necessary for equal states; the sample is the same on every
    process for the same shapes."""
    parts = []
    for p in params:
        flat = local(p.detach()).reshape(-1)   # FSDP2: this rank's shard (what its replica holds)
        n = flat.numel()
        if n == 0:
            continue
        step = max(1, n // _FP_PER_TENSOR)
        parts.append(flat[::step][:_FP_PER_TENSOR].contiguous().view(torch.uint8))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(parts)

