"""Gradient compression for DDP: top-k and int8 communication hooks (public names).

See :mod:`ray_ckpt.integrations.compression` for the call order and the determinism contract (the selection:
:mod:`ray_ckpt.integrations.topk_select`; the checked exchange: :mod:`ray_ckpt.integrations.grad_exchange`)::

    ddp.register_comm_hook(TopKState(ratio=0.01), topk_hook)
"""
from ray_ckpt.integrations.compression import Int8State, ResidualState, TopKState, int8_hook, topk_hook
from ray_ckpt.integrations.grad_exchange import CompressionExchangeError
from ray_ckpt.integrations.topk_select import DEFAULT_SAMPLE_SIZE, select_topk, topk_count

__all__ = [
    "DEFAULT_SAMPLE_SIZE",
    "CompressionExchangeError",
    "Int8State",
    "ResidualState",
    "TopKState",
    "int8_hook",
    "select_topk",
    "topk_count",
    "topk_hook",
]
