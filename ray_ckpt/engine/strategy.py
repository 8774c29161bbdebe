"""The seam between the engine and a checkpointing strategy (LowDiff, Amber, ...).

A strategy implementation decides what a step's differential record is (capture), how a batch of records is
encoded into one object (codec), and how records bring a full checkpoint forward to the target step
(``advance``). Full checkpoints, the writer, the lineage, storage and the loop state are shared.

Where each call runs:
  ``make_capture``               training thread, once at attach
  ``encode_diffs``               writer thread / persistence actor, once per diff object
  ``decode_diffs`` / ``advance`` the restoring process

This module holds the protocol and the registry only: the built-in strategies (:mod:`ray_ckpt.engine.lowdiff`,
:mod:`ray_ckpt.engine.amber`) are named in a table and imported on first use; others are added with
:func:`register`.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

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


#: the built-in strategies: name -> (config class, implementation class) as ``"module:attr"``. A lazy plugin
#: table: this seam imports no implementation (they build on the capture machinery and the codecs); each is
#: imported on first use, so a process that decodes one strategy's objects imports only that strategy.
_BUILTINS: dict[str, tuple[str, str]] = {
    "lowdiff": ("ray_ckpt.config:LowDiff", "ray_ckpt.engine.lowdiff:LowDiffImpl"),
    "amber": ("ray_ckpt.config:Amber", "ray_ckpt.engine.amber:AmberImpl"),
    "loop": ("ray_ckpt.engine.lowdiff:LoopOnly", "ray_ckpt.engine.lowdiff:LoopImpl"),   # ranks' loop state
}
#: name -> (config class, implementation class) of every strategy loaded or registered so far
_REGISTRY: dict[str, tuple[type, type]] = {}


def register(name: str, config_cls: type, impl_cls: type) -> None:
    """Make a strategy known to the engine (its config class and implementation)."""
    _REGISTRY[name] = (config_cls, impl_cls)


def _load(path: str) -> Any:
    """The object a ``"module:attr"`` path of the lazy plugin table :data:`_BUILTINS` names (imported here)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _entry(name: str) -> tuple[type, type] | None:
    """``(config class, implementation class)`` of strategy ``name``, a built-in loaded on first use; None if
    unknown."""
    if name not in _REGISTRY and name in _BUILTINS:
        config_path, impl_path = _BUILTINS[name]
        _REGISTRY[name] = (_load(config_path), _load(impl_path))
    return _REGISTRY.get(name)


def impl_for(strategy: Any) -> StrategyImpl:
    """The implementation for a strategy config object (``ray_ckpt.LowDiff()``, ``ray_ckpt.Amber()``...)."""
    for name in _BUILTINS:
        _entry(name)
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
    entry = _entry(name)
    if entry is None:
        raise ManifestError(f"objects were written with strategy {name!r:.80}, which this ray_ckpt does not "
                            "know")
    config_cls, impl_cls = entry
    return impl_cls(config_cls())
