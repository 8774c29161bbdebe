"""DTensor helpers (FSDP2): a sharded tensor's local shard, for code that handles plain and sharded tensors alike.

Torch-only; any process. The import of ``torch.distributed.tensor`` waits for the first tensor that is not a plain
one (a captured gradient of an unsharded model never pays for it, and torch built without distributed works).
"""
from __future__ import annotations

from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    # a plain tensor (the hot path: every captured gradient) never needs the import
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage); any other tensor as is."""
    if type(t) is torch.Tensor:   # the hot path (host copies of every captured tensor): no second call
        return t
    return t.to_local() if is_dtensor(t) else t
