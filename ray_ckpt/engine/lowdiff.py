"""LowDiff, the strategy behind :class:`ray_ckpt.LowDiff`: a step's record is the gradient its optimizer step
consumed (plus the param-group values it used); a restore replays the records through the optimizer.

Also here, as the same record format with no gradients: the loop-state lineage of each rank > 0
(:class:`LoopCapture`, :class:`LoopImpl`; recorded by :mod:`ray_ckpt.engine.rankloop`).

Where each part runs: the captures on the training thread (optimizer hooks), ``encode_diffs`` in the writer thread
or a persistence actor, ``decode_diffs`` and ``advance`` in the restoring process (or the state tier's replica).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ray_ckpt.config import LowDiff
from ray_ckpt.engine import grad_support
from ray_ckpt.engine.capture import CaptureBase, PackedLayout, PackedPool
from ray_ckpt.engine.dtensor import local
from ray_ckpt.engine.loopstate import apply_group_values, group_values, rng_state
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format.records import FullState, GradEntry, StepRecord


#: dtypes the checkpoint format stores (a gradient of another dtype takes the general path, which says so)
_PACKABLE = frozenset((torch.float64, torch.float32, torch.float16, torch.bfloat16))


class LowDiffCapture(CaptureBase):
    """Attaches LowDiff capture to an optimizer (and scheduler). Runs on the training thread."""

    def __init__(self, *args, **kwargs):
        self._consumed: tuple[list, list] | None = None   # grads + hparams taken in the pre-hook
        self._packed = None                                # the PackedGrads the pre-hook filled
        super().__init__(*args, **kwargs)
        # every parameter a plain CPU tensor: the dense gradients of a step go into one buffer with one copy call
        # (a pass per tensor in Python cost more than the copy itself for a small model)
        self._packed_pool = None
        if self.params and all(type(local(p)) is type(p) and p.device.type == "cpu" and p.layout == torch.strided
                               and p.dtype in _PACKABLE for p in self.params):
            self._packed_pool = PackedPool(PackedLayout(self.params), limit=self._copy.pool,
                                           allocate=self.sink.host_memory)

    def _take_packed(self) -> bool:
        """The fast path of the pre-hook: every gradient present, dense, on the CPU, and no compression hook
        published a support: one buffer, one ``torch._foreach_copy_``. False: take them one by one."""
        if self._packed_pool is None or grad_support.any_published():
            return False
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            return False
        buf = self._packed_pool.take()
        try:
            torch._foreach_copy_(buf.views, grads)
        except RuntimeError:   # a sparse gradient, or a layout the fast path does not know: the general path says
            self._packed_pool.give([buf])
            return False
        self._packed = buf
        return True

    def _before_step(self, optimizer) -> None:
        if not getattr(self.policy, "recording", True):   # the overhead budget leaves this step unrecorded
            self._consumed = None
            self._unrecorded = True
            return
        self._unrecorded = False
        if self._take_packed():
            self._consumed = (list(self._packed.entries), group_values(optimizer, self._copy.tree))
            return
        grads: list[GradEntry | None] = []
        for p in self.params:
            g = p.grad
            if g is None:
                grads.append(None)
                continue
            if g.is_sparse:
                raise NotImplementedError("sparse gradients (e.g. nn.Embedding(sparse=True)) are not supported")
            idx = grad_support.take(p)
            if idx is not None:
                # O(k): the values the hook kept; the published indices are handed over (int32 in the writer)
                vals = g.reshape(-1).index_select(0, idx)
                # both are fresh tensors nobody else holds: on the host, kept as they are (no copier call)
                if type(vals) is not torch.Tensor or vals.device.type != "cpu" or not idx.is_contiguous():
                    vals, idx = self._copy(vals, fresh=True), self._copy(idx, fresh=True)
                grads.append(GradEntry(tuple(p.shape), vals, idx))
            else:
                g = local(g)       # FSDP2: the gradient shard this rank's optimizer step consumes
                grads.append(GradEntry(tuple(g.shape), self._copy.pooled(g)))
        self._consumed = (grads, group_values(optimizer, self._copy.tree))

    def sample_record(self) -> StepRecord:
        """The record of a step as the hooks take it (see :meth:`CaptureBase.sample_record`), the parameters
        standing in for the gradients (same shapes, dtypes and devices): the copy into the capture's buffers, the
        RNG and loop state, the model buffers. Training thread, at attach."""
        with self._lock:
            if self._packed_pool is not None:
                packed = self._packed_pool.take()
                torch._foreach_copy_(packed.views, [p.detach() for p in self.params])
                grads, pooled = list(packed.entries), (self._packed_pool, [packed])
            else:
                packed = None
                grads = [GradEntry(tuple(local(p).shape), self._copy.pooled(p)) for p in self.params]
                pooled = self._copy.take_pooled()
            loop = {"rng": rng_state()} if self.capture_rng else {}
            loop.update(self._loop_tail())
            buffers = {n: self._copy(b) for n, b in self._buffers} if self.capture_buffers else {}
            rec = StepRecord(step=self.step + 1, grads=grads, hparams=group_values(self.optimizer, self._copy.tree),
                             loop=loop, buffers=buffers)
            rec.packed, rec.pooled = packed, pooled
            rec.ready = self._copy.event()
        return rec

    def _make_record(self, step: int, loop: dict, buffers: dict) -> StepRecord:
        if getattr(self, "_unrecorded", False):   # only a full of this step may be taken: loop state, no gradients
            rec = StepRecord(step=step, grads=[], hparams=[], loop=loop, buffers=buffers)
            rec.unrecorded = True
            return rec
        if self._consumed is None:  # step() called without our pre-hook (should not happen)
            raise RuntimeError("ray_ckpt: optimizer post-step hook ran without its pre-step hook")
        grads, hparams = self._consumed
        self._consumed = None
        rec = StepRecord(step=step, grads=grads, hparams=hparams, loop=loop, buffers=buffers)
        if self._packed is not None:
            rec.packed, self._packed = self._packed, None
            rec.pooled = (self._packed_pool, [rec.packed])
        else:
            rec.pooled = self._copy.take_pooled()
        return rec


class LowDiffImpl:
    """LowDiff: records are consumed gradients; ``advance`` replays them through the optimizer."""

    name = "lowdiff"

    def __init__(self, config: LowDiff):
        self.config = config

    def make_capture(self, model, optimizer, sink, policy, **kwargs):
        return LowDiffCapture(model, optimizer, sink, policy, capture_buffers=self.config.capture_buffers,
                              **kwargs)

    def encode_diffs(self, records: list) -> tuple[list, dict]:
        return rec_fmt.encode_steps(records, max_density=self.config.max_sparse_density), {}

    def decode_diffs(self, data, name: str, *, verify: bool = True, copy: bool = True) -> list:
        return rec_fmt.decode_steps(data, name, verify=verify, copy=copy)

    def advance(self, records, model, optimizer, full_step: int) -> None:
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


# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopOnly:
    """The strategy config of a rank loop-state lineage (records hold loop state only; no gradients)."""

    max_sparse_density: float = 0.0
    capture_buffers: bool = False


class LoopCapture(CaptureBase):
    """Captures only the loop state (RNG, extra state) of each optimizer step. Training thread of a rank > 0.

    Records are finalized in the post-step hook (no scheduler or scaler tail: those are replicated and come from
    rank 0's lineage); fulls hold the loop state alone (no model, no optimizer state)."""

    def __init__(self, model, optimizer, sink, policy, *, start_step: int, extra_state: Any = None,
                 capture_rng: bool = True):
        super().__init__(model, optimizer, sink, policy, start_step=start_step, extra_state=extra_state,
                         capture_rng=capture_rng, capture_buffers=False)

    def _make_record(self, step: int, loop: dict, buffers: dict) -> StepRecord:
        return StepRecord(step=step, grads=[], hparams=[], loop=loop)

    def _loop_tail(self) -> dict:
        return {}

    def _snapshot(self, step: int, loop: dict, rec: Any = None) -> FullState:
        self.full_snapshots += 1
        return FullState(step=step, model={}, optimizer={}, loop=loop)


class LoopImpl(LowDiffImpl):
    """Decodes rank loop-state objects (LowDiff's record format with no gradients); nothing to replay."""

    name = "loop"

    def make_capture(self, model, optimizer, sink, policy, **kwargs):
        return LoopCapture(model, optimizer, sink, policy, **kwargs)

    def advance(self, records, model, optimizer, full_step: int) -> None:
        return None   # loop state is absolute: the record of the target step is the state

