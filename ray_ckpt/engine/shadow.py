"""The shadow state: a CPU replica of model + optimizer state, advanced record by record with restore's replay.

LowDiff+ (the LowDiff variant whose persistence tier holds a CPU replica of the training state): instead of
holding step records and replaying them at recovery, the persistence tier keeps the training state itself and
applies each record as it arrives, with **the same** code that a restore runs
(:func:`ray_ckpt.engine.restore.load_full` and :func:`~ray_ckpt.engine.restore.replay`). Recovery of the latest
step then needs the shadow's state plus the few records it has not applied yet, and full checkpoints are
encoded from the shadow instead of being snapshotted in the training process.

The shadow needs no model code: a full checkpoint taken at attach records the optimizer class and, for every
optimizer parameter, its state-dict keys (:attr:`FullState.layout`); the shadow builds the optimizer over plain
tensors from that. Tied parameters (one tensor under several keys) stay one tensor.

Exactness: on CPU the replay executes the same kernels on the same values as the trainer's step, so the shadow
is bitwise the trainer's state. When the trainer computes elsewhere (CUDA), the last bits may differ; the
trainer ships a :func:`fingerprint` of its parameters with some records and :meth:`ShadowState.apply` reports
a mismatch, after which the runtime stops trusting the shadow (trainer fulls again).

Runs wherever it is built (the state tier's replica actor; tests). No Ray.
"""
from __future__ import annotations

import importlib

import torch

from ray_ckpt.engine.optim_layout import FINGERPRINT_KEY, ShadowError, fingerprint
from ray_ckpt.engine.restore import load_full, replay
from ray_ckpt.format.records import FullState


class _TensorModule:
    """The part of ``nn.Module`` that :func:`load_full` and :func:`replay` use, over a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], param_keys: set[str]):
        self._t = tensors
        self._params = param_keys

    def load_state_dict(self, sd: dict) -> None:
        missing = set(self._t) - set(sd)
        extra = set(sd) - set(self._t)
        if missing or extra:
            raise ShadowError(f"state dict keys differ: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
        with torch.no_grad():
            for k, v in sd.items():
                self._t[k].copy_(v)

    def named_buffers(self):
        return [(k, v) for k, v in self._t.items() if k not in self._params]

    def state_dict(self) -> dict:
        return {k: v.detach() for k, v in self._t.items()}


def _import_class(path: str):
    mod, _, qual = path.partition(":")
    if not mod or not qual:
        raise ShadowError(f"bad optimizer class path {path!r}")
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ShadowError(f"cannot import the optimizer class {path!r} here: {e}") from None
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise ShadowError(f"{path!r} is not a torch.optim.Optimizer")
    return obj


def rebuild(full: FullState, device: torch.device | str = "cpu"
            ) -> tuple[_TensorModule, torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """Model (a :class:`_TensorModule` keyed by state-dict names) and optimizer over copies of ``full``'s
    tensors on ``device``, loaded with :func:`load_full`, without the user's code: from :attr:`FullState.layout`.
    Returns the optimizer's parameters too (in ``param_groups`` order). Used by the shadow, offline export and
    sharded restores (:mod:`ray_ckpt.engine.sharded`, on the training device)."""
    if full.layout is None:
        raise ShadowError("the full checkpoint has no layout (taken by an older ray_ckpt)")
    cls = _import_class(full.layout["optimizer_class"])
    tensors = {k: v.detach().to(device).clone() for k, v in full.model.items()}
    params: list[torch.nn.Parameter] = []
    param_keys: set[str] = set()
    for names in full.layout["param_names"]:
        if any(n not in tensors for n in names):
            raise ShadowError(f"parameter {names[0]!r} is not in the full checkpoint's model state")
        p = torch.nn.Parameter(tensors[names[0]], requires_grad=True)
        for n in names:                       # tied parameters: one tensor under every key
            tensors[n] = p
            param_keys.add(n)
        params.append(p)
    groups = full.optimizer.get("param_groups", [])
    if sum(len(g["params"]) for g in groups) != len(params):
        raise ShadowError("the optimizer's param groups do not match the recorded parameters")
    try:
        optimizer = cls([{**{k: v for k, v in g.items() if k != "params"},
                          "params": [params[i] for i in g["params"]]} for g in groups])
    except Exception as e:  # noqa: BLE001 - an optimizer whose constructor needs more than its groups
        raise ShadowError(f"cannot rebuild {full.layout['optimizer_class']} from its param groups: {e}") from e
    model = _TensorModule(tensors, param_keys)
    load_full(full, model, optimizer)
    return model, optimizer, params


class ShadowState:
    """Model + optimizer state on the CPU of this process, at :attr:`step`, advanced by :meth:`apply`."""

    def __init__(self, full: FullState, strategy: str = "lowdiff"):
        if strategy != "lowdiff":
            raise ShadowError(f"the state tier follows LowDiff step records, not {strategy!r} increments")
        self.strategy = strategy
        self.layout = full.layout
        self.model, self.optimizer, self.params = rebuild(full)
        self.step = full.step
        self.loop = dict(full.loop)

    def apply(self, records: list) -> None:
        """Advance by ``records`` (consecutive, starting at ``step + 1``). A record carrying a trainer
        fingerprint is checked right after it is applied; a mismatch raises :class:`ShadowError` and leaves
        the shadow at that step (its state is then not the trainer's)."""
        start = 0
        for i, rec in enumerate(records):
            if FINGERPRINT_KEY in rec.loop:
                self._advance(records[start:i + 1])
                start = i + 1
                want = rec.loop[FINGERPRINT_KEY]
                got = fingerprint(self.params)
                if not torch.equal(got, want.to(got.device)):
                    raise ShadowError(f"step {rec.step}: the replayed state differs from the trainer's "
                                      f"(fingerprint mismatch); the trainer computes on {self.layout.get('device')}")
        self._advance(records[start:])

    def _advance(self, records: list) -> None:
        if not records:
            return
        if records[0].step != self.step + 1:
            raise ShadowError(f"the shadow is at step {self.step}; got records from step {records[0].step}")
        self.loop = replay(self.strategy, records, self.model, self.optimizer, self.step, self.loop)
        self.step = records[-1].step

    def snapshot(self) -> FullState:
        """The current state as a full checkpoint (tensors are the shadow's own: encode before the next apply)."""
        return FullState(step=self.step, model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                         loop={k: v for k, v in self.loop.items() if k != FINGERPRINT_KEY}, layout=self.layout)

    @property
    def nbytes(self) -> int:
        return self.snapshot().nbytes
