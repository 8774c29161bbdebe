"""What one step's differential and one full checkpoint hold, and their encoding into container objects.

A :class:`StepRecord` is LowDiff's differential checkpoint of step ``s``: the gradient the optimizer consumed at
step ``s`` (after compression, all-reduce, clipping, unscaling), the param-group hyper-parameters that step used,
and the small *loop state* the training loop had after step ``s`` (param-group values as the scheduler left them,
scheduler / GradScaler / RNG / user extra state, model buffers such as BatchNorm statistics). Optimizer moments
are never stored per step: replay rebuilds them.

A :class:`FullState` is model + optimizer state after step ``s`` plus the same loop state.

Encoding runs off the training thread (writer thread or persistence actor); tensors must be on the host.
Pure layer: torch and numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_ckpt.format import container
from ray_ckpt.format.tree import TreeError, decode_tree, encode_tree


@dataclass
class GradEntry:
    """One parameter's consumed gradient: dense (``values`` has the parameter's shape) or sparse
    (``indices`` are flat positions into the parameter, ``values`` the entries there, zeros elsewhere)."""

    shape: tuple[int, ...]
    values: torch.Tensor
    indices: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        return self.indices is not None

    @property
    def nbytes(self) -> int:
        n = self.values.numel() * self.values.element_size()
        if self.indices is not None:
            n += self.indices.numel() * self.indices.element_size()
        return n

    def to_dense(self, device: torch.device | str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient as the optimizer saw it, on ``device``. Exact: sparse entries are scattered into +0.

        ``out``: a tensor of this shape and dtype on ``device`` to write into instead of allocating (a replay
        reuses one per parameter across its steps: a fresh multi-MB block costs a page fault per 4 KiB page)."""
        if out is not None and (tuple(out.shape) != self.shape or out.dtype != self.values.dtype
                                or (device is not None and out.device != torch.device(device))):
            out = None
        if self.indices is None:
            if out is not None:
                return out.copy_(self.values.reshape(self.shape))
            vals = self.values.to(device) if device is not None else self.values
            return vals.reshape(self.shape).clone() if vals is self.values else vals.reshape(self.shape)
        vals = self.values.to(device) if device is not None else self.values
        if out is None:
            out = torch.zeros(self.shape, dtype=vals.dtype, device=vals.device)
        else:
            out.zero_()
        out.view(-1).index_copy_(0, self.indices.to(device=vals.device, dtype=torch.int64), vals)
        return out

    def sparsified(self, max_density: float) -> "GradEntry":
        """A sparse copy when few entries are non-zero (bit-wise: ``-0.0`` counts as non-zero), else ``self``.

        Runs off the training thread: the scan is ``O(numel)``.
        """
        if self.indices is not None or self.values.numel() == 0:
            return self
        flat = self.values.reshape(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()]) if flat.element_size() in _INT_OF_SIZE else flat
        # most dense gradients have no zeros at all: a strided sample decides those without the O(numel) scan
        # (a wrong guess only costs bytes, never exactness)
        if flat.numel() > 4 * _SAMPLE:
            stride = flat.numel() // _SAMPLE
            dense_frac = float((bits[::stride] != 0).float().mean())
            if dense_frac > min(0.95, 2 * max_density):
                return self
        nz = torch.nonzero(bits != 0, as_tuple=False).view(-1)
        idx_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
        sparse_bytes = nz.numel() * (flat.element_size() + torch.tensor([], dtype=idx_dtype).element_size())
        if sparse_bytes > max_density * flat.numel() * flat.element_size():
            return self
        return GradEntry(self.shape, flat.index_select(0, nz), nz.to(idx_dtype))


_SAMPLE = 4096
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@dataclass
class StepRecord:
    """The differential checkpoint of one optimizer step (see module docstring)."""

    step: int
    grads: list[GradEntry | None]      #: per optimizer parameter (param_groups order); None = no grad
    hparams: list[dict]                #: per param group: the values step ``step`` used
    loop: dict                         #: loop state after the step (groups, scheduler, scaler, rng, extra)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: Any = None                  #: a CUDA event the encoder waits on before reading host copies
    #: ``(pool, tensors)``: recycled host buffers the grads live in, given back by the sink once nothing reads
    #: them (:func:`recycle`); None for decoded records
    pooled: Any = field(default=None, repr=False, compare=False)
    #: the capture's one buffer holding every gradient of ``grads`` back to back (an object with ``nbytes`` and
    #: ``packed(prefix) -> container.Packed``, see :class:`ray_ckpt.engine.capture.PackedGrads`); None when the
    #: gradients are separate tensors. ``grads`` are then views into it.
    packed: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            n = self.packed.nbytes
        else:
            n = sum(g.nbytes for g in self.grads if g is not None)
        return n + sum(b.numel() * b.element_size() for b in self.buffers.values()) + 4096


def recycle(items) -> None:
    """Give the pooled host buffers of captured records back to their pool (:class:`ray_ckpt.engine.capture.
    HostPool`): nothing will read them again. A sink's background thread, once a record's bytes are written or
    held on two nodes; items without pooled buffers are skipped."""
    for it in items:
        pooled = getattr(it, "pooled", None)
        if pooled:
            pool, tensors = pooled
            it.pooled = None
            pool.give(tensors)


@dataclass
class FullState:
    """Model and optimizer state after ``step`` plus the loop state: a full checkpoint."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    loop: dict
    ready: Any = None
    #: how to rebuild an optimizer over these tensors without the user's code (attach fulls):
    #: ``{"optimizer_class": "module:QualName", "param_names": [[state-dict keys of optimizer param i], ...],
    #: "device": "cpu" | "cuda" ...}``; None when unknown
    layout: dict | None = None
    #: ``(pool, tensors)``: the recycled host buffers of a captured full (as :attr:`StepRecord.pooled`)
    pooled: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.model.values())
        for st in self.optimizer.get("state", {}).values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return n + 4096


def wait_ready(item: StepRecord | FullState) -> None:
    """Block until the item's device-to-host copies are complete (no-op on CPU)."""
    if item.ready is not None:
        item.ready.synchronize()
        item.ready = None


# ------------------------------------------------------------------------------------------------------------
def encode_steps(records: list[StepRecord], *, max_density: float = 0.5, extra_meta: dict | None = None
                 ) -> list:
    """Encode a batch of step records into container buffers (sparsifying dense gradients that are mostly 0)."""
    tensors: dict[str, Any] = {}
    steps_meta = []
    dense_verdict: list | None = None   # per parameter: the batch's first packed record stayed dense
    for rec in records:
        wait_ready(rec)
        p = f"s{rec.step}"
        packed = rec.packed
        if packed is not None and max_density > 0:
            if dense_verdict is None:
                # the sparsity test is taken on the batch's first packed record and holds for the batch: a
                # parameter whose gradient is dense there is stored dense in every record of the batch (a wrong
                # guess costs bytes, never exactness), so a dense batch costs no pass per tensor per step
                dense_verdict = [g is None or g.sparsified(max_density) is g for g in rec.grads]
            if not all(dense_verdict):
                packed = None
        if packed is not None:
            tensors[f"{p}/G"] = packed.packed(p)   # one payload; stored as the separate tensors below would be
            grads_meta = [{"shape": list(g.shape), "sparse": False} for g in rec.grads]
        else:
            grads_meta = []
        for i, g in enumerate(rec.grads if packed is None else ()):
            if g is None:
                grads_meta.append(None)
                continue
            g = g.sparsified(max_density) if max_density > 0 else g
            vals = g.values
            tensors[f"{p}/g{i}/v"] = vals if vals.dim() == 1 else vals.reshape(-1)   # no new view when flat
            if g.indices is not None:
                idx = g.indices
                if idx.dtype == torch.int64 and math.prod(g.shape) < 2**31:
                    idx = idx.to(torch.int32)  # 4 bytes per index on storage (the capture hands over int64)
                tensors[f"{p}/g{i}/i"] = idx
            grads_meta.append({"shape": list(g.shape), "sparse": g.indices is not None})
        buf_meta = {}
        for j, (name, b) in enumerate(rec.buffers.items()):
            tensors[f"{p}/b{j}"] = b
            buf_meta[name] = f"{p}/b{j}"
        steps_meta.append({
            "step": rec.step, "grads": grads_meta, "buffers": buf_meta,
            "hparams": encode_tree(rec.hparams, tensors, f"{p}/h"),
            "loop": encode_tree(rec.loop, tensors, f"{p}/l"),
        })
    meta = {"kind": "diff", "steps": steps_meta, **(extra_meta or {})}
    return container.encode(meta, tensors)


def decode_steps(data, name: str, *, verify: bool = True, copy: bool = True) -> list[StepRecord]:
    """Validate and decode a batch object into step records (tensors copied out of ``data``; ``copy=False``:
    read-only views of it, for a consumer that copies what it keeps — :meth:`GradEntry.to_dense` does).
    ``verify=False`` skips the data checksum (see :func:`ray_ckpt.format.container.decode`)."""
    meta, tensors = container.decode_tensors(data, name, verify=verify, copy=copy)
    try:
        if not isinstance(meta, dict) or meta.get("kind") != "diff" or not isinstance(meta.get("steps"), list):
            raise TreeError("not a diff batch")
        out = []
        for sm in meta["steps"]:
            step = sm["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TreeError("bad step number")
            p = f"s{step}"
            grads: list[GradEntry | None] = []
            for i, gm in enumerate(sm["grads"]):
                if gm is None:
                    grads.append(None)
                    continue
                shape = tuple(int(d) for d in gm["shape"])
                vals = tensors[f"{p}/g{i}/v"]
                idx = tensors[f"{p}/g{i}/i"] if gm["sparse"] else None
                numel = 1
                for d in shape:
                    numel *= d
                if idx is None and vals.numel() != numel:
                    raise TreeError(f"step {step} grad {i}: {vals.numel()} values for shape {shape}")
                if idx is not None:
                    if idx.numel() != vals.numel() or idx.dtype not in (torch.int32, torch.int64):
                        raise TreeError(f"step {step} grad {i}: bad sparse indices")
                    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
                        raise TreeError(f"step {step} grad {i}: sparse index out of range")
                grads.append(GradEntry(shape, vals, idx))
            buffers = {n: tensors[k] for n, k in sm["buffers"].items()}
            out.append(StepRecord(step=step, grads=grads, hparams=decode_tree(sm["hparams"], tensors),
                                  loop=decode_tree(sm["loop"], tensors), buffers=buffers))
        return out
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise container.CorruptObjectError(name, f"malformed diff batch: {e}") from None


def encode_full(state: FullState, *, extra_meta: dict | None = None, checksum: bool = True) -> list:
    wait_ready(state)
    tensors: dict[str, torch.Tensor] = {}
    model_meta = {}
    for j, (name, t) in enumerate(state.model.items()):
        tensors[f"m{j}"] = t
        model_meta[name] = f"m{j}"
    meta = {"kind": "full", "step": state.step, "model": model_meta,
            "optimizer": encode_tree(state.optimizer, tensors, "o"),
            "loop": encode_tree(state.loop, tensors, "l"), **(extra_meta or {})}
    if state.layout is not None:
        meta["layout"] = state.layout
    return container.encode(meta, tensors, checksum=checksum)


def decode_full(data, name: str, *, verify: bool = True, copy: bool = True) -> FullState:
    """``verify=False, copy=False``: an in-memory hand-off (tensors may be read-only views of ``data``)."""
    meta, tensors = container.decode_tensors(data, name, verify=verify, copy=copy)
    try:
        if not isinstance(meta, dict) or meta.get("kind") != "full":
            raise TreeError("not a full checkpoint")
        model = {n: tensors[k] for n, k in meta["model"].items()}
        layout = meta.get("layout")
        if layout is not None and not _valid_layout(layout):
            raise TreeError("bad layout")
        return FullState(step=int(meta["step"]), model=model, optimizer=decode_tree(meta["optimizer"], tensors),
                         loop=decode_tree(meta["loop"], tensors), layout=layout)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise container.CorruptObjectError(name, f"malformed full checkpoint: {e}") from None


def _valid_layout(layout) -> bool:
    if not isinstance(layout, dict) or not isinstance(layout.get("optimizer_class"), str):
        return False
    names = layout.get("param_names")
    return isinstance(names, list) and all(isinstance(n, list) and n and all(isinstance(x, str) for x in n)
                                           for n in names)
