"""Capture on the training thread: what a strategy needs from each optimizer step, at the cost of a copy.

:class:`CaptureBase` holds what every strategy shares (hooks, loop state, finalization, full snapshots) and
:class:`HostPool` the host buffers it copies into; the strategies' captures build on it: LowDiff's (the consumed
gradients, below) in :mod:`ray_ckpt.engine.lowdiff`, Amber's in :mod:`ray_ckpt.engine.amber`. The loop state
it reads comes from :mod:`ray_ckpt.engine.loopstate`.

Call order (all on the training thread, inside the user's loop; nothing to call per step)::

    optimizer.step()  ─► pre-hook   : take the consumed gradient of each parameter (O(k) gather of the support
                                      a compression hook published, else a host copy of the dense gradient)
                                      and the param-group hyper-parameters the step will use
                      ─► post-hook  : RNG states, user extra state, model buffers → a *pending* record
    next pre-hook / flush()          : scheduler, GradScaler and param-group values as the loop left them
                                      (after its scheduler.step() / scaler.update()) → the pending record is
                                      finalized and handed to the sink. Without a scheduler or scaler the
                                      record is finalized in the post-hook already.
    a second scaler.update()         : the next iteration was skipped by the GradScaler (inf/NaN gradients):
                                      the pending record is finalized before that update runs.

The scheduler is read, never wrapped: its ``state_dict()`` stays exactly the user's. The price of reading it
at the next step is latency: with a scheduler, step ``s`` reaches the sink when step ``s+1`` starts (or at
``flush()``), so a crash between the two loses at most that one step.

A full snapshot (a host copy of model + optimizer state) is taken when the policy says so, right after the
record of that step is finalized. Encoding, sparsifying, checksumming and writing happen in the sink
(a writer thread or a Ray actor), never here.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from ray_ckpt.engine.dtensor import local
from ray_ckpt.engine.loopstate import ATTACHED_ATTR, as_stateful, group_values, rng_state, set_rng_state
from ray_ckpt.engine.optim_layout import FINGERPRINT_KEY, ShadowError, fingerprint, optimizer_layout
from ray_ckpt.format.container import Packed, dtype_name
from ray_ckpt.format.framing import ALIGN
from ray_ckpt.engine.sink import Sink
from ray_ckpt.format.records import FullState, GradEntry
from ray_ckpt.policy import FrequencyPolicy, StepContext, StepDecision


# ------------------------------------------------------------------------------------------------------------
#: a pooled buffer at least this large lives in the sink's shared memory when it has some (a smaller one is carried
#: with the chunk's other small buffers: ``ray_ckpt.runtime.trainer.transport.SMALL_BUFFER``)
SHARED_MIN_BYTES = 64 << 10


class HostPool:
    """Recycled host buffers for the dense copies a capture takes every step (CPU training).

    A fresh tensor per captured gradient costs its allocation and a page fault per 4 KiB page on first touch
    (glibc hands large blocks back to the kernel when they are freed), several times the cost of a copy into a
    buffer already in memory (figures: docs/benchmark-log.md). The capture
    takes a buffer with :meth:`take`; the record carries the buffers it took, and its sink gives them back with
    :func:`ray_ckpt.format.records.recycle` once nothing reads them any more (written, or held on two nodes). A
    record never recycled (an error, a closed sink) is garbage-collected.

    Thread-safe: taken on the training thread, given back on a background thread. At most ``max_bytes`` of free
    buffers are kept (the capture's ``pool_bytes``, the Checkpointer's ``max_pending_bytes``: the buffers in flight are bounded by
    the same figure, so the pool never holds more than the sink may).
    """

    def __init__(self, max_bytes: int = 256 << 20, allocate: Callable | None = None):
        self.max_bytes = max_bytes
        #: ``allocate(nbytes) -> (uint8 tensor, handle) | None``: memory for a new buffer (a sink's shared memory:
        #: its buffers are named to the node's worker, not copied); None, or no ``allocate``: heap memory
        self.allocate = allocate
        self.free_bytes = 0
        self._free: dict = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._shared: set = set()   # ids of the buffers in the sink's memory: always kept (never freed there)
        self.allocated = 0      #: buffers allocated (a miss)
        self.reused = 0         #: buffers taken from the pool (a hit)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reused += 1
                t = free.pop()
                self.free_bytes -= t.numel() * t.element_size()
                return t
            self.allocated += 1
        n = math.prod(shape) * dtype.itemsize
        got = self.allocate(n) if self.allocate is not None and n >= SHARED_MIN_BYTES else None
        if got is None:
            return torch.empty(shape, dtype=dtype)
        t = got[0].view(dtype).view(shape)
        with self._lock:
            self._shared.add(id(t))
        return t

    def give(self, tensors: list) -> None:
        with self._lock:
            for t in tensors:
                n = t.numel() * t.element_size()
                if id(t) in self._shared or self.free_bytes + n <= self.max_bytes:
                    self._free[(tuple(t.shape), t.dtype)].append(t)
                    self.free_bytes += n


class PackedGrads:
    """One step's dense gradients in ONE host buffer, laid out as the checkpoint container lays consecutive tensors
    out (each at an offset aligned to the format's ``ALIGN``, zero bytes between them): the capture fills it with one
    ``torch._foreach_copy_``, the encoder hands the whole buffer over as one payload (:class:`ray_ckpt.format.
    container.Packed`) and the Ray runtime as one array — no work per tensor after the copy. The views, the
    :class:`GradEntry` objects and the encoder's description are built once per buffer and reused with it.

    ``flat`` may lie in a sink's shared memory (the Ray runtime's: the sender then names it to the node's worker
    instead of carrying its bytes, :mod:`ray_ckpt.runtime.shared`).
    """

    __slots__ = ("flat", "array", "views", "entries", "nbytes", "_items")

    def __init__(self, layout: "PackedLayout", flat: torch.Tensor):
        self.flat, self.nbytes = flat, layout.nbytes
        self.array = flat.numpy()        # the same memory, as the encoder hands it over
        self.views = [flat[o:o + n].view(dt).view(shape) for shape, dt, o, n in layout.items]
        self.entries = [GradEntry(shape, v) for (shape, _, _, _), v in zip(layout.items, self.views)]
        self._items = [(shape, dtype_name(dt), o, n) for shape, dt, o, n in layout.items]

    def packed(self, prefix: str) -> Packed:
        """The container's view of this buffer for the record ``prefix`` (``s<step>``): one tensor per
        parameter, named as :func:`ray_ckpt.format.records.encode_steps` names a dense gradient."""
        return Packed(self.array, [(f"{prefix}/g{i}/v", dt, (math.prod(shape),), o, n)
                                   for i, (shape, dt, o, n) in enumerate(self._items)])


class PackedLayout:
    """Where each parameter's gradient goes in a :class:`PackedGrads` buffer (``items``: ``(shape, dtype, byte
    offset, nbytes)`` per parameter, in order); ``nbytes`` is the buffer's size, a multiple of ``ALIGN``."""

    def __init__(self, params: list):
        self.items, off = [], 0
        for p in params:
            n = p.numel() * p.element_size()
            self.items.append((tuple(p.shape), p.dtype, off, n))
            off += n + (-n) % ALIGN
        self.nbytes = max(off, ALIGN)


class PackedPool:
    """Recycled :class:`PackedGrads` buffers of one layout (training thread takes, a background thread gives back,
    as :class:`HostPool`). At most ``limit.max_bytes`` of free buffers are kept (``limit``: the capture's
    :class:`HostPool`, bounded by its ``pool_bytes``). ``allocate(nbytes) -> (zeroed uint8 tensor, handle) |
    None`` provides the memory of a new buffer (a sink's shared memory); None, or no ``allocate``: heap memory."""

    def __init__(self, layout: PackedLayout, limit: Any = None, allocate: Callable | None = None):
        self.layout, self.allocate = layout, allocate
        self._limit = limit if limit is not None else HostPool()   # an object whose max_bytes bounds the free list
        self._free: list = []
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def take(self) -> PackedGrads:
        with self._lock:
            if self._free:
                self.reused += 1
                return self._free.pop()
            self.allocated += 1
        got = self.allocate(self.layout.nbytes) if self.allocate is not None else None
        if got is not None:
            return PackedGrads(self.layout, got[0])
        # zeroed: the padding between tensors is part of the checksummed object (the copies never write it)
        return PackedGrads(self.layout, torch.zeros(self.layout.nbytes, dtype=torch.uint8))

    def give(self, buffers: list) -> None:
        with self._lock:
            for b in buffers:
                if (len(self._free) + 1) * self.layout.nbytes <= self._limit.max_bytes:
                    self._free.append(b)


_SCALARS = frozenset((float, int, bool, str, type(None)))


class _HostCopier:
    """Copies tensors to host memory; for CUDA tensors asynchronously into pinned memory, with one event per
    captured item that the encoder waits on (so the training thread never synchronizes the device); dense CPU
    copies of the per-step record go into recycled buffers (:class:`HostPool`, :meth:`pooled`)."""

    def __init__(self):
        self.cuda_used = False
        self.pool = HostPool()
        #: the buffers of one full snapshot, kept for the next (sized by the first full: see :meth:`full_copier`)
        self.full_pool = HostPool(max_bytes=0)
        self._taken: list = []

    def pooled(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of the CPU tensor ``t`` in a pooled buffer (remembered for :meth:`take_pooled`); other
        devices go through :meth:`__call__` (the pinned-memory allocator of CUDA caches its blocks itself)."""
        t = local(t.detach())
        if t.device.type != "cpu":
            return self(t)
        out = self.pool.take(t.shape, t.dtype)
        out.copy_(t)
        self._taken.append(out)
        return out

    def full_copier(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], list]:
        """``(copy, taken)`` for one full snapshot: ``copy`` puts each CPU tensor into a buffer of :attr:`full_pool`
        (recorded in ``taken``; other devices go through :meth:`__call__`). A full is the whole state:
        allocating it afresh costs a page fault per page on the training thread, many times a copy into
        buffers already in memory (docs/benchmark-log.md). The sink
        gives the buffers back once the full is written or held on two nodes
        (:func:`ray_ckpt.format.records.recycle`); the pool keeps one full's worth (:meth:`keep_full`)."""
        taken: list = []

        def copy(t: torch.Tensor) -> torch.Tensor:
            t = local(t.detach())
            if t.device.type != "cpu":
                return self(t)
            out = self.full_pool.take(t.shape, t.dtype)
            out.copy_(t)
            taken.append(out)
            return out
        return copy, taken

    def keep_full(self, taken: list) -> None:
        """Let :attr:`full_pool` keep as many bytes as one full (``taken``) needs (it grows with the state)."""
        n = sum(t.numel() * t.element_size() for t in taken)
        self.full_pool.max_bytes = max(self.full_pool.max_bytes, n)

    def take_pooled(self):
        """``(pool, buffers)`` taken since the last call, for the record that holds them (or None)."""
        if not self._taken:
            return None
        taken, self._taken = self._taken, []
        return self.pool, taken

    def __call__(self, t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """A host copy of ``t``; ``fresh=True`` says ``t`` is a new tensor nobody else holds (e.g. the result of
        an ``index_select``): a CPU one is then taken as is, without a second copy. A DTensor (FSDP2) is copied
        as its local shard."""
        t = local(t.detach())
        if t.device.type == "cpu":
            if fresh and t.is_contiguous():
                return t
            return t.clone(memory_format=torch.contiguous_format)
        self.cuda_used = True
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def tree(self, x: Any, copy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
        """A host copy of a nested structure (containers copied, tensors copied to host with ``copy``, by
        default :meth:`__call__`)."""
        if type(x) in _SCALARS:   # most of a loop state: hyper-parameters, counters
            return x
        if isinstance(x, torch.Tensor):
            return (copy or self)(x)
        if isinstance(x, dict):
            return {k: self.tree(v, copy) for k, v in x.items()}
        if isinstance(x, list):
            return [self.tree(v, copy) for v in x]
        if isinstance(x, tuple):
            return tuple(self.tree(v, copy) for v in x)
        if isinstance(x, np.ndarray):
            return x.copy()
        return x

    def event(self) -> Any:
        if not self.cuda_used:
            return None
        self.cuda_used = False
        ev = torch.cuda.Event()
        ev.record()
        return ev


# ------------------------------------------------------------------------------------------------------------
class CaptureBase:
    """What every strategy's capture shares (training thread): hooks on the optimizer,
    loop state (RNG, extra state, scheduler, GradScaler, param-group values), finalization with the frequency
    policy, full snapshots and detaching. A subclass builds the step record (:meth:`_make_record`) and may take
    something before the step (:meth:`_before_step`) or add items after a record (:meth:`_after_submit`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sink: Sink,
                 policy: FrequencyPolicy, *, start_step: int, scheduler: Any = None, scaler: Any = None,
                 extra_state: Any = None, capture_rng: bool = True, capture_buffers: bool = True,
                 fingerprint_every: int = 0, pool_bytes: int | None = None):
        if getattr(optimizer, ATTACHED_ATTR, None) is not None:
            raise RuntimeError("this optimizer already has a ray_ckpt capture attached; close() it first")
        extra_state = as_stateful(extra_state)
        for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("extra_state", extra_state)):
            if obj is not None and not (callable(getattr(obj, "state_dict", None))
                                        and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{name} must have state_dict() and load_state_dict() methods, "
                                f"got {type(obj).__name__}")
        self.model, self.optimizer, self.sink, self.policy = model, optimizer, sink, policy
        self.scheduler, self.scaler, self.extra_state = scheduler, scaler, extra_state
        self.capture_rng, self.capture_buffers = capture_rng, capture_buffers
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        for p in self.params:
            if p.is_sparse:
                raise NotImplementedError("sparse parameters are not supported")
        # the model's persistent buffers, looked up once (walking the module tree every step would cost each step)
        self._buffers = list(_persistent_buffers(model)) if capture_buffers else []
        self.step = start_step
        self.last_full_step = start_step
        self.steps_in_batch = 0
        self._copy = _HostCopier()
        self._copy.full_pool.allocate = sink.host_memory   # a full's tensors in the sink's shared memory, if any
        if pool_bytes is not None:   # the buffers in flight are bounded by the sink's max_pending_bytes: so is the pool
            self._copy.pool.max_bytes = pool_bytes
        self._pending: Any = None
        self._lock = threading.RLock()
        self.capture_seconds = 0.0        # time spent in the hooks, for stats
        #: per-step hook time (pre + post), newest last; drained by the runtime's metrics (bounded)
        self.step_seconds: collections.deque = collections.deque(maxlen=4096)
        self._pre_seconds = 0.0
        self.full_snapshots = 0           # fulls snapshotted on the training thread (attach included)
        self.fingerprint_every = fingerprint_every
        self._layout: dict | None | bool = False   # False: not computed yet
        #: FSDP2: this rank's shard (:func:`ray_ckpt.engine.shard_layout.sharding_info`), recorded in every full's
        #: layout
        self.sharding: dict | None = None
        self.last_snapshot_seconds: float | None = None  # training-thread time of the latest full snapshot
        #: the overhead budget's measurements (:class:`ray_ckpt.policy.budget.StepMeter`), set by the Checkpointer
        self.meter = None
        self._last_pre_t: float | None = None   # start of the previous pre-hook (wall time between steps)
        self._hook_acc = 0.0                     # hook time since then (wall)
        self._hook_cpu = 0.0                     # and the training thread's CPU in the hooks
        self._pre_end_t = 0.0
        self._opt_s = 0.0                        # the previous optimizer.step() itself (post start - pre end)
        #: the latest step handed to the sink as a record or a full (steps after it and before the next full
        #: the overhead budget left unrecorded are named in that full's manifest)
        self.last_point = start_step
        self._full_owed = False   # a full was due at a step captured without its loop state: take it at the next
        self._handles = [optimizer.register_step_pre_hook(self._pre_hook),
                         optimizer.register_step_post_hook(self._post_hook)]
        self._updates_since_step = 0
        self._scaler_update = None
        if scaler is not None and callable(getattr(scaler, "update", None)):
            self._wrap_scaler_update(scaler)
        setattr(optimizer, ATTACHED_ATTR, self)

    def _wrap_scaler_update(self, scaler) -> None:
        """GradScaler skips: when a step's gradients hold inf/NaN, ``scaler.step`` skips ``optimizer.step()``, so
        no hook of ours runs in that iteration, yet its ``scaler.update()`` and the loop's ``scheduler.step()``
        change the loop state. The first ``update()`` after a step belongs to that step; a second one means
        the next iteration was skipped: the pending record is finalized right before it runs, so scheduler,
        scaler, RNG and extra state all describe the end of the step's own iteration (the restored run then
        replays the skipped iteration exactly as the uninterrupted one did). ``update`` is wrapped on the
        instance (GradScaler's ``state_dict`` does not include instance attributes) and unwrapped at detach."""
        original = scaler.update

        def update(*args, **kwargs):
            with self._lock:
                if self._pending is not None and self._updates_since_step >= 1:
                    self._finalize()
                self._updates_since_step += 1
            return original(*args, **kwargs)

        update.__wrapped__ = original  # type: ignore[attr-defined]
        scaler.update = update
        self._scaler_update = update

    # -- what a strategy provides ----------------------------------------------------------------------------
    def _before_step(self, optimizer) -> None:
        """Pre-step hook body (after a still-pending record was finalized). Default: nothing."""

    def _make_record(self, step: int, loop: dict, buffers: dict) -> Any:
        """The record of optimizer step ``step`` (post-step hook; ``loop`` is completed at finalization)."""
        raise NotImplementedError

    def _amend_decision(self, rec: Any, decision: StepDecision) -> StepDecision:
        """A strategy may ask for more than the frequency policy (e.g. an earlier full). Default: as is."""
        return decision

    def _after_submit(self, rec: Any, decision: StepDecision, full: FullState | None) -> None:
        """Called after ``rec`` went to the sink and before ``full`` does. Default: nothing."""

    def sample_record(self) -> Any:
        """A record as the hooks would take one for the next step, for the overhead budget's calibration at attach
        (training thread, before the first step); never handed over, its buffers go back with
        :func:`ray_ckpt.format.records.recycle`. None: this strategy has no such record (default)."""
        return None

    # -- hooks ---------------------------------------------------------------------------------------------
    def _pre_hook(self, optimizer, args, kwargs):
        t0 = time.perf_counter()
        meter = self.meter
        if meter is not None:   # the step that ended here: its wall time, hook time and optimizer time
            c0 = time.thread_time()
            if self._last_pre_t is not None:
                meter.tick(t0 - self._last_pre_t, self._hook_acc, self._opt_s, self._hook_cpu)
            self._last_pre_t, self._hook_acc, self._hook_cpu = t0, 0.0, 0.0
        with self._lock:
            self._finalize()
            if meter is not None:
                meter.recording = getattr(self.policy, "recording", True)
            self._before_step(optimizer)
        t1 = time.perf_counter()
        if meter is not None:
            self._hook_cpu += time.thread_time() - c0
        self._pre_end_t = t1
        self._pre_seconds = t1 - t0
        self._hook_acc += self._pre_seconds
        self.capture_seconds += self._pre_seconds

    def _post_hook(self, optimizer, args, kwargs):
        t0 = time.perf_counter()
        self._opt_s = t0 - self._pre_end_t
        c0 = time.thread_time() if self.meter is not None else 0.0
        with self._lock:
            step = self.step + 1
            loop = {}
            # an unrecorded step that will not be a full (the overhead budget's every-k mode) needs no loop state
            needs = getattr(self.policy, "needs_state", None)
            light = not self._full_owed and needs is not None and not needs(step, self.last_full_step)
            if self.capture_rng and not light:
                loop["rng"] = rng_state()
            if self.extra_state is not None and not light:
                loop["extra"] = self._copy.tree(self.extra_state.state_dict())
            if self.fingerprint_every and step % self.fingerprint_every == 0 and not light:
                loop[FINGERPRINT_KEY] = self._copy(fingerprint(self.params), fresh=True)
            buffers = {}
            if self.capture_buffers and not light:
                buffers = {n: self._copy(b) for n, b in self._buffers}
            self._pending = self._make_record(step, loop, buffers)
            self._pending.light = light
            self._updates_since_step = 0
            self.step = step
            if self.scheduler is None and self.scaler is None:
                self._finalize()
        dt = time.perf_counter() - t0
        self.capture_seconds += dt
        self._hook_acc += dt
        if self.meter is not None:
            self._hook_cpu += time.thread_time() - c0
        self.step_seconds.append(self._pre_seconds + dt)

    # -- finalization -----------------------------------------------------------------------------------------
    def _loop_tail(self) -> dict:
        """The part of the loop state read at finalization: as the loop left it after scheduler/scaler."""
        tail: dict[str, Any] = {"groups": group_values(self.optimizer, self._copy.tree)}
        if self.scheduler is not None:
            tail["scheduler"] = self._copy.tree(self.scheduler.state_dict())
        if self.scaler is not None:
            tail["scaler"] = self._copy.tree(self.scaler.state_dict())
        return tail

    def _finalize(self) -> None:
        with self._lock:
            rec = self._pending
            if rec is None:
                return
            self._pending = None
            rec.loop.update(self._loop_tail())
            self.steps_in_batch += 1
            decision = self.policy.decide(StepContext(step=rec.step, last_full_step=self.last_full_step,
                                                      steps_in_batch=self.steps_in_batch))
            decision = self._amend_decision(rec, decision)
            # a record without its gradients (the overhead budget skipped them) is never handed over
            record = decision.record and not getattr(rec, "unrecorded", False)
            delegated, wanted = self.sink.full_control()
            if wanted:   # the runtime asks for a full (a gap, a lost or re-placed replica): the trainer takes it
                decision = StepDecision(full=True, close_batch=True, record=decision.record)
            if decision.full and getattr(rec, "light", False):   # no loop state to make a full of: the next step
                self._full_owed = True
                decision = StepDecision(full=False, close_batch=decision.close_batch, record=decision.record)
            elif self._full_owed:
                self._full_owed = False
                wanted = True
                decision = StepDecision(full=True, close_batch=True, record=decision.record)
            gap_from = self.last_point + 1     # the first step after the latest recovery point
            if decision.full and not wanted and delegated and record and gap_from == rec.step:
                # the state tier takes this full (the clock moves) when it saw every step since the last
                # recovery point; after steps the overhead budget left unrecorded the trainer takes it
                self.last_full_step = rec.step
                rec.full_delegated = True          # the replica writes it (exactly one writer per full)
                decision = StepDecision(full=False, close_batch=decision.close_batch)
            full = None
            if decision.full:
                full = self._snapshot(rec.step, dict(rec.loop), rec)
                info = {}
                if gap_from < rec.step:   # steps left unrecorded before this full (and this step's record)
                    info = {"unrecorded_from": gap_from, "recovery_every": int(getattr(self.policy, "k", 1))}
                self._mark_coarse(full, info)
            rec.ready = self._copy.event()
            if record:
                self.sink.submit(rec, close_batch=decision.close_batch)
                self.last_point = rec.step
            if decision.close_batch or not record:
                self.steps_in_batch = 0
            self._after_submit(rec, decision, full)
            if full is not None:
                full.ready = self._copy.event() or rec.ready
                self.last_full_step = rec.step
                self.last_point = rec.step
                self.sink.submit(full)

    def _snapshot(self, step: int, loop: dict, rec: Any = None) -> FullState:
        """Host copy of model + optimizer state (``rec``: the record of ``step``, when there is one)."""
        # buffers (BatchNorm statistics) change in the forward pass: with a scheduler this runs after the next
        # step's forward, so take them from the record of `step` (copied right after its optimizer.step())
        t0 = time.perf_counter()
        early = getattr(rec, "buffers", None) or {}
        copy, taken = self._copy.full_copier()
        model_sd = {k: early[k] if k in early else copy(v) for k, v in self.model.state_dict().items()}
        opt_sd = self._copy.tree(self.optimizer.state_dict(), copy)
        self._copy.keep_full(taken)
        self.full_snapshots += 1
        self.last_snapshot_seconds = time.perf_counter() - t0  # read by the adaptive policy's cost model
        if self.meter is not None:
            self.meter.full(self.last_snapshot_seconds)
        return FullState(step=step, model=model_sd, optimizer=opt_sd, loop=loop, layout=self.layout(),
                         pooled=(self._copy.full_pool, taken) if taken else None)

    def layout(self) -> dict | None:
        """The optimizer layout recorded with every full (:func:`optimizer_layout`; None when an optimizer
        parameter is not a model parameter), computed once."""
        if self._layout is False:
            try:
                self._layout = optimizer_layout(self.model, self.optimizer)
            except ShadowError:
                self._layout = None
            if self.sharding is not None:
                if self._layout is None:
                    raise ShadowError("sharded state needs the optimizer's parameters to be the model's")
                self._layout["sharding"] = self.sharding
        return self._layout

    def _attach_loop(self) -> dict:
        loop: dict[str, Any] = {}
        rng = rng_state()
        if self.capture_rng:
            loop["rng"] = rng
        if self.extra_state is not None:
            loop["extra"] = self._copy.tree(self.extra_state.state_dict())
            # the first state_dict() of some objects draws from the global RNG (torchdata's StatefulDataLoader
            # before its first iteration seeds an iterator): attaching must not change the run it checkpoints, and
            # the RNG recorded above must be the one the loop continues with
            set_rng_state(rng)
        loop.update(self._loop_tail())
        return loop

    def snapshot_now(self) -> FullState:
        """A full snapshot of the current state (attach time). Training thread."""
        with self._lock:
            full = self._snapshot(self.step, self._attach_loop())
            self._mark_coarse(full, {})
            full.ready = self._copy.event()
            return full

    def _mark_coarse(self, full: FullState, info: dict) -> None:
        """Give ``full`` its manifest ``info``, with ``records_follow: False`` when no record follows it (the
        overhead budget's every-k mode): a coarse recovery point that the runtime only writes (no peer copy, no
        state-tier replica: see PersistenceWorker). Training thread, under the lock."""
        if not getattr(self.policy, "recording", True):
            info = {**info, "records_follow": False}
        if info:
            full.manifest_info = info

    def flush_pending(self) -> None:
        """Finalize a pending record now (flush/close); when the overhead budget left the latest steps
        unrecorded, take a full of the current state, so that a flush makes the latest step recoverable too.
        Training thread."""
        self._finalize()
        with self._lock:
            if self.last_point < self.step and not getattr(self.policy, "recording", True):
                full = self._snapshot(self.step, self._attach_loop())
                full.manifest_info = {"unrecorded_from": self.last_point + 1,
                                      "recovery_every": int(getattr(self.policy, "k", 1))}
                full.ready = self._copy.event()
                self.last_full_step = self.last_point = self.step
                self.sink.submit(full)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._scaler_update is not None and self.scaler.__dict__.get("update") is self._scaler_update:
            del self.scaler.update
        self._scaler_update = None
        if getattr(self.optimizer, ATTACHED_ATTR, None) is self:
            delattr(self.optimizer, ATTACHED_ATTR)


def _persistent_buffers(model: torch.nn.Module):
    non_persistent = set()
    for mname, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{mname}.{b}" if mname else b)
    for n, b in model.named_buffers():
        if n not in non_persistent:
            yield n, b
