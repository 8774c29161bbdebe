"""The user's objects a checkpoint is taken of, checked once at attach/restore: the model whose state is
checkpointed (DistributedDataParallel unwrapped) and the kind of the optimizer's parameters (plain tensors or
FSDP2 DTensor shards). Training process."""
from __future__ import annotations

import torch

from ray_ckpt.engine import shard_layout


def check_params(optimizer: torch.optim.Optimizer) -> "shard_layout.ShardSpec | None":
    """The sharding of the optimizer's parameters (FSDP2 DTensor shards), None for plain tensors (replicated
    state, as with DDP); refuses, at attach/restore, other tensor subclasses and unsupported sharding, which
    would fail later in a background thread with a less clear error. Training process."""
    spec = shard_layout.spec_of(optimizer)
    if spec is not None:
        return spec
    for group in optimizer.param_groups:
        for p in group["params"]:
            kind = type(p.data)
            if kind is not torch.Tensor:
                raise NotImplementedError(f"ray_ckpt checkpoints parameters that are plain torch.Tensors or "
                                          f"FSDP2 DTensor shards; this optimizer holds a "
                                          f"{kind.__module__}.{kind.__name__}")
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state is checkpointed: DistributedDataParallel is unwrapped (its ``module``). Training
    process."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model
