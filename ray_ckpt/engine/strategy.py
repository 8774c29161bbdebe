"""The seam between the engine and a checkpointing strategy (LowDiff, Amber, ...).

A strategy implementation decides what a step's differential record is (capture), how a batch of records is
encoded into one object (codec), and how records bring a full checkpoint forward to the target step
(``advance``). Full checkpoints, the writer, the lineage, storage and the loop state are shared.

Where each call runs:
  ``make_capture``               training thread, once at attach
  ``encode_diffs``               writer thread / persistence actor, once per diff object
  ``decode_diffs`` / ``advance`` the restoring process
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from ray_ckpt.config import LowDiff
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format import segments
from ray_ckpt.lineage.manifest import ManifestError


class StrategyImpl(Protocol):
    name: str

    def make_capture(self, model, optimizer, sink, policy, **kwargs) -> Any: ...

    def encode_diffs(self, records: list) -> tuple[list, dict]:
        """Container buffers of one diff object, and facts for its manifest's ``info`` (e.g. ``atomic``)."""

    def decode_diffs(self, data, name: str, *, verify: bool = True, copy: bool = True) -> list:
        """The records of one container. ``verify=False``: skip the data checksum (bytes handed over in memory,
        checksummed where they were encoded); ``copy=False``: tensors may be read-only views of ``data``."""

    def advance(self, records: list, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                full_step: int) -> None:
        """Bring model/optimizer from the full checkpoint at ``full_step`` to ``records[-1].step``."""


class LowDiffImpl:
    """LowDiff: records are consumed gradients; ``advance`` replays them through the optimizer."""

    name = "lowdiff"

    def __init__(self, config: LowDiff):
        self.config = config

    def make_capture(self, model, optimizer, sink, policy, **kwargs):
        from ray_ckpt.engine.capture import LowDiffCapture
        return LowDiffCapture(model, optimizer, sink, policy, capture_buffers=self.config.capture_buffers,
                              **kwargs)

    def encode_diffs(self, records: list) -> tuple[list, dict]:
        return rec_fmt.encode_steps(records, max_density=self.config.max_sparse_density), {}

    def decode_diffs(self, data, name: str, *, verify: bool = True, copy: bool = True) -> list:
        return rec_fmt.decode_steps(data, name, verify=verify, copy=copy)

    def advance(self, records, model, optimizer, full_step: int) -> None:
        from ray_ckpt.engine.capture import apply_group_values
        steps = [r.step for r in records]
        if steps != list(range(full_step + 1, full_step + 1 + len(records))):
            raise ValueError(f"LowDiff replay needs every step after {full_step}; got {steps[:5]}...")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # gradient tensors reused from step to step, as a training loop's zero_grad(set_to_none=False) does: only
        # for torch's own optimizers, which never keep a reference to a gradient (another might alias it in its
        # state, where training handed it a fresh tensor each step)
        reuse = type(optimizer).__module__.startswith("torch.optim.") and len(records) > 1
        grad_bufs: list = [None] * len(params)
        try:
            for rec in records:
                if len(rec.grads) != len(params):
                    raise ValueError(f"step {rec.step} recorded {len(rec.grads)} parameters, the optimizer has "
                                     f"{len(params)}: restore into the same model and optimizer layout")
                apply_group_values(optimizer, rec.hparams)
                for i, (p, g) in enumerate(zip(params, rec.grads)):
                    if g is None:
                        p.grad = None
                    elif tuple(p.shape) != g.shape:
                        raise ValueError(f"step {rec.step}: gradient of shape {g.shape} for a parameter of "
                                         f"shape {tuple(p.shape)}")
                    else:
                        p.grad = g.to_dense(p.device, out=grad_bufs[i])
                        if reuse:
                            grad_bufs[i] = p.grad
                optimizer.step()
        finally:
            for p in params:
                p.grad = None


_REGISTRY: dict[str, Any] = {"lowdiff": (LowDiff, LowDiffImpl)}


def register(name: str, config_cls: type, impl_cls: type) -> None:
    """Make a strategy known to the engine (its config class and implementation)."""
    _REGISTRY[name] = (config_cls, impl_cls)


_builtins_loaded = False


def _load_builtins() -> None:
    """Import the modules that register the built-in strategies (Amber, per-rank loop state) on first use, so
    that whichever module a process imported first, every strategy is known when an object is decoded."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        import ray_ckpt.engine.amber  # noqa: F401
        import ray_ckpt.engine.rankloop  # noqa: F401


def impl_for(strategy: Any) -> StrategyImpl:
    """The implementation for a strategy config object (``ray_ckpt.LowDiff()``, ``ray_ckpt.Amber()``...)."""
    _load_builtins()
    for config_cls, impl_cls in _REGISTRY.values():
        if isinstance(strategy, config_cls):
            return impl_cls(strategy)
    known = ", ".join(c.__name__ for c, _ in _REGISTRY.values())
    raise TypeError(f"strategy must be one of {known} (e.g. ray_ckpt.LowDiff()), got {type(strategy).__name__}")


def decode_object(impl: StrategyImpl, data, name: str, *, verify: bool = True, copy: bool = True) -> list:
    """The records of a diff object: every segment (see :mod:`ray_ckpt.format.segments`) decoded in order.
    ``data``: the object's bytes, or its buffers as the object store holds them (decoded without joining).
    ``verify``/``copy``: see :meth:`StrategyImpl.decode_diffs` (the state-tier replica reads each chunk once,
    straight from the object store: no second checksum pass, no copy before the replay's own).
    Any process that reads objects (restore, replica, CLI)."""
    out: list = []
    for seg in (segments.split_parts(data, name) if isinstance(data, (list, tuple)) else segments.split(data, name)):
        out.extend(impl.decode_diffs(seg, name, verify=verify, copy=copy))
    return out


def impl_by_name(name: str) -> StrategyImpl:
    """The implementation that decodes objects written with strategy ``name`` (default settings)."""
    _load_builtins()
    try:
        config_cls, impl_cls = _REGISTRY[name]
    except KeyError:
        raise ManifestError(f"objects were written with strategy {name!r:.80}, which this ray_ckpt does not "
                            "know") from None
    return impl_cls(config_cls())
