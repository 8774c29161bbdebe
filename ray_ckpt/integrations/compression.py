"""DDP communication hooks that compress gradients: top-k sparsification and int8 quantization.

LowDiff's premise is that training already exchanges a small *aggregated compressed gradient* every step; these
hooks are that compression, and the top-k hook additionally publishes, per parameter, the positions of its
non-zero aggregated gradient (:mod:`ray_ckpt.engine.grad_support`) so the capture can gather ``O(k)`` values instead of
scanning dense gradients.

Usage, in every training process, once, after wrapping the model::

    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    ddp.register_comm_hook(TopKState(ratio=0.01), topk_hook)      # or: Int8State(), int8_hook

Where things run. DDP calls the hook from the autograd thread once per bucket, as soon as every gradient of the
bucket is ready; the hook selects locally, launches one asynchronous ``all_gather`` and returns a future chained on
it. The aggregation runs in the callback of that future (a process-group thread), and DDP waits for every bucket's
future before ``backward()`` returns, then copies the result into ``param.grad``. So after ``backward()`` every
rank holds **bitwise identical** gradients, and for top-k the support of every parameter is published.

Layer-wise compression. Both hooks compress each *parameter* of a bucket on its own (top-k keeps
``k = ratio * param numel`` of every parameter; int8 uses one scale per parameter), never the bucket as a whole.
DDP's bucket layout is not stable: it rebuilds its buckets after the first iteration (in gradient-ready order),
so a freshly constructed DDP model (a restore from a checkpoint, an elastic restart) uses another layout for its
first iteration than the long-running model did at that step, and ``bucket_cap_mb`` changes it too. Because
every selection, scale, sample and error-feedback residual is a function of one parameter's values alone, the
aggregated gradient does not depend on the layout: a run restored from a checkpoint continues bit for bit like
the uninterrupted run.

Determinism. Every rank gathers the same bytes from every rank and runs the same torch ops on them in the same
order (sum rank by rank in rank order, ties broken by position, no atomics whose order matters), so the aggregate
is bitwise identical on all ranks: what LowDiff's bit-exact replay needs. It is deterministic for a given device
type and torch build; a CPU and a CUDA run are not expected to agree bitwise.

A broken exchange: every payload travels behind a checked header, and a failed or corrupted exchange raises
:class:`~ray_ckpt.integrations.grad_exchange.CompressionExchangeError` from ``backward()`` before anything of the
bucket is applied or published (:mod:`ray_ckpt.integrations.grad_exchange`). The selection of the top-k hook is
:func:`ray_ckpt.integrations.topk_select.select_topk`; the hooks loop over the parameters of a bucket, never over
its elements.
"""

import functools
import math
import threading
import weakref

import torch
import torch.distributed as dist

from ray_ckpt.integrations.grad_exchange import (
    Exchanges,
    HEADER_BYTES,
    Scratch,
    bucket_layout,
    check,
    gather_bytes,
    group_info,
    header_rows,
    layout_gaps,
    layout_key,
    publish_selected,
    received,
    round_up,
    seal,
)
from ray_ckpt.integrations.topk_select import DEFAULT_SAMPLE_SIZE, param_sample_size, select_topk, topk_count

__all__ = ["Int8State", "ResidualState", "TopKState", "int8_hook", "topk_hook"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half-precision buckets in float32 (the sum of ranks may overflow float16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# --------------------------------------------------------------------------------------------------------------
# top-k
# --------------------------------------------------------------------------------------------------------------


class TopKState:
    """State of :func:`topk_hook`; one per DDP model, created in the training process.

    Args:
        process_group: group to aggregate over; ``None`` is the default group (the one DDP uses by default,
            so pass DDP's group when DDP was given one).
        ratio: fraction of each parameter kept, ``k = max(1, ceil(ratio * param numel))``; the aggregated
            gradient of a parameter has at most ``k`` non-zeros (so a bucket has at most the sum of its
            parameters' ``k``).
        error_feedback: keep, per parameter, the part of the local (gradient + residual) that this rank did not
            send, and add it to the next step's gradient (the standard residual of top-k SGD). Costs one
            buffer of the gradient's size per parameter. The residual belongs to the parameter, not to a
            bucket, so it survives DDP's bucket rebuild (after the first iteration). Residuals are per rank and
            are checkpointed only through :class:`ResidualState` (a dense copy per step and rank).
        sampled: estimate each parameter's local selection threshold from a sample (see :func:`select_topk`)
            instead of an exact ``torch.topk`` over it.
        sample_size: the largest sample per parameter; a parameter of ``n`` elements samples
            ``min(sample_size, max(4096, n // 64))`` positions, and is selected exactly when ``n`` is at most
            four times that.
        seed: seed of the sample; rank ``r`` uses ``seed + r`` for its local selection and every rank uses
            ``seed`` for the (identical) selection over the aggregate, so results are reproducible. The sampled
            positions depend only on the seed and the number of elements, never on the bucket.
    """

    def __init__(
        self,
        process_group=None,
        ratio: float = 0.01,
        error_feedback: bool = False,
        sampled: bool = True,
        sample_size: int = DEFAULT_SAMPLE_SIZE,
        seed: int = 0,
    ) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        if sample_size < 1:
            raise ValueError(f"sample_size must be positive, got {sample_size}")
        self.process_group = process_group
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.sampled = bool(sampled)
        self.sample_size = int(sample_size)
        self.seed = int(seed)
        self._lock = threading.Lock()
        # id(param) -> (weakref to param, flat residual in the bucket's memory order): keyed by parameter, so
        # independent of the bucket layout
        self._residuals: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._scratch = Scratch()  # CPU only: |acc| of the selection and its candidate mask, per bucket
        self._exchanges = Exchanges()

    @property
    def failure(self) -> BaseException | None:
        """The latest failed exchange of this state (a :class:`CompressionExchangeError`), or ``None``."""
        return self._exchanges.failure

    def k_for(self, numel: int) -> int:
        """Elements kept for a parameter of ``numel`` elements (``topk_count``; 0 for an empty parameter)."""
        return topk_count(numel, self.ratio)

    def residual(self, param: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback residual of ``param`` (flat, the bucket's dtype), or ``None`` when it has none."""
        with self._lock:
            entry = self._residuals.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def _residual_for(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``param``'s residual, shaped like its flat bucket gradient ``grad``; zeros when new or mismatched."""
        with self._lock:
            entry = self._residuals.get(id(param))
            tensor = None if entry is None or entry[0]() is not param else entry[1]
            if tensor is None or tensor.shape != grad.shape or tensor.dtype != grad.dtype \
                    or tensor.device != grad.device:
                for key in [key for key, (ref, _) in self._residuals.items() if ref() is None]:
                    del self._residuals[key]  # parameters that no longer exist
                tensor = torch.zeros_like(grad)
                self._residuals[id(param)] = (weakref.ref(param), tensor)
        return tensor


class ResidualState:
    """The error-feedback residuals of a :class:`TopKState` as loop state to checkpoint, optionally bundled with
    the loop's own ``extra`` state: pass it as ``extra_state`` (``Checkpointer``/``restore``; ``attach`` builds
    it when given ``compression_state=``). Training process.

    Residuals are per rank: each rank's are captured with its own loop state (rank 0 in the main lineage, other
    ranks in theirs, see :mod:`ray_ckpt.engine.rankloop`) and restored to it, so a restored run compresses
    exactly like the uninterrupted one. The price: one dense copy of the residuals (the size of the gradients)
    per step and rank, written with each step's record. ``state_dict()`` keys residuals by parameter name
    (``model.named_parameters()``); a parameter without a residual yet is absent."""

    def __init__(self, state: TopKState, model: torch.nn.Module, extra=None):
        if not isinstance(state, TopKState):
            raise TypeError(f"state must be a TopKState, got {type(state).__name__}")
        if not state.error_feedback:
            raise ValueError("this TopKState has error_feedback=False: it keeps no residuals to checkpoint")
        if extra is not None and not (callable(getattr(extra, "state_dict", None))
                                      and callable(getattr(extra, "load_state_dict", None))):
            raise TypeError(f"extra must have state_dict() and load_state_dict(), got {type(extra).__name__}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        self.state, self.extra = state, extra
        self._params = dict(model.named_parameters())

    def state_dict(self) -> dict:
        residuals = {}
        for name, p in self._params.items():
            r = self.state.residual(p)
            if r is not None:
                residuals[name] = r
        return {"residuals": residuals, "extra": None if self.extra is None else self.extra.state_dict()}

    def reset_for_new_rank(self) -> None:
        """A rank that joined the group (elastic growth) owes nothing yet: its residuals start at zero, and the
        bundled extra state's own ``reset_for_new_rank()`` runs when it has one."""
        with self.state._lock:
            self.state._residuals.clear()
        hook = getattr(self.extra, "reset_for_new_rank", None)
        if callable(hook):
            hook()

    def load_state_dict(self, sd: dict) -> None:
        residuals = sd["residuals"]
        unknown = set(residuals) - set(self._params)
        if unknown:
            raise ValueError(f"residuals for parameters this model does not have: {sorted(unknown)[:5]}")
        with self.state._lock:
            self.state._residuals.clear()
            for name, r in residuals.items():
                p = self._params[name]
                if r.numel() != p.numel():
                    raise ValueError(f"residual of {name} has {r.numel()} elements, the parameter {p.numel()}")
                self.state._residuals[id(p)] = (weakref.ref(p),
                                                r.detach().reshape(-1).to(device=p.device, dtype=p.dtype,
                                                                          copy=True))
        if self.extra is not None:
            if sd.get("extra") is None:
                raise ValueError("the checkpoint holds no extra state for the bundled extra object")
            self.extra.load_state_dict(sd["extra"])


def _select_local(state: TopKState, flat: torch.Tensor, layout, ks: list[int], rank: int,
                  mag_scratch: torch.Tensor | None, mask_scratch: torch.Tensor | None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's top-``k_p`` of each parameter's ``|gradient (+ residual)|`` in the bucket's ``flat`` buffer:
    ``(indices into flat, values)`` per parameter with ``k_p > 0``; with error feedback, the residual keeps what
    was not sent. Autograd thread (inside :func:`topk_hook`)."""
    local_indices, local_values = [], []
    for (param, offset, numel, _), k in zip(layout, ks):
        if k == 0:
            continue
        grad = flat[offset : offset + numel]
        if state.error_feedback:
            residual = state._residual_for(param, grad)
            acc = residual.add_(grad)  # residual now holds gradient + old residual
        else:
            residual, acc = None, grad
        chosen = select_topk(
            acc, k, sampled=state.sampled, sample_size=param_sample_size(numel, state.sample_size),
            seed=state.seed + rank,
            out=None if mag_scratch is None else mag_scratch[offset : offset + numel],
            mask_out=None if mask_scratch is None else mask_scratch[offset : offset + numel])
        local_values.append(acc.index_select(0, chosen))
        if residual is not None:
            residual.index_fill_(0, chosen, 0)  # what was sent is no longer owed
        local_indices.append(chosen.add_(offset))
    return local_indices, local_values


def _pack(local_indices: list[torch.Tensor], local_values: list[torch.Tensor], kp: int, index_dtype: torch.dtype,
          flat: torch.Tensor) -> torch.Tensor:
    """This rank's all_gather payload: ``[header | values (kp) | indices (kp)]`` as bytes, the header left to
    :func:`seal`; padded with (index ``flat.numel()``, value 0): the padding index lies in no parameter.
    Autograd thread."""
    n = flat.numel()
    value_bytes = kp * flat.element_size()
    payload = torch.empty(HEADER_BYTES + value_bytes + kp * (4 if index_dtype == torch.int32 else 8),
                          dtype=torch.uint8, device=flat.device)
    payload_values = payload[HEADER_BYTES : HEADER_BYTES + value_bytes].view(flat.dtype)
    payload_indices = payload[HEADER_BYTES + value_bytes :].view(index_dtype)
    m = sum(chosen.numel() for chosen in local_indices)
    if m:
        torch.cat(local_values, out=payload_values[:m])
        payload_indices[:m].copy_(torch.cat(local_indices))
    payload_values[m:] = 0
    payload_indices[m:] = n
    return payload


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: layer-wise top-k sparsified, deterministic mean of the bucket.

    On every rank, for each parameter ``p`` of the bucket (its segment of the bucket buffer): select the local
    top-``k_p`` of ``|gradient (+ residual)|`` with ``k_p = topk_count(numel_p, ratio)`` (:func:`select_topk`);
    all-gather the bucket's ``(indices, values)``, padded to ``sum k_p``, behind a checked header (one uint8
    all_gather; a broken exchange raises :class:`CompressionExchangeError`, see the module docstring); sum rank
    by rank in rank order into the union of the gathered indices; keep, per parameter, the top-``k_p`` of that
    sum (ties by position); divide by the world size and write it densely (zeros elsewhere) into the bucket buffer, which
    is the future's value. Then publish, for each parameter, the sorted int64 flat indices of its kept elements
    to :mod:`ray_ckpt.engine.grad_support`. Each parameter's aggregated gradient has at most ``k_p`` non-zeros; each
    is the mean over all ranks of the values of the ranks that selected that position (the others count as
    zero). Every step of this is a function of each parameter's own values, so the result does not depend on
    how DDP laid the parameters out in buckets.
    """
    group = state.process_group
    world, rank = group_info(group)
    buffer = bucket.buffer()
    flat = buffer.view(-1)
    n = flat.numel()
    device = flat.device
    index = bucket.index()
    layout = bucket_layout(bucket, buffer)
    params = [param for param, _, _, _ in layout]
    backward_pass = state._exchanges.begin(group, world, rank, index, params)
    ks = [state.k_for(numel) for _, _, numel, _ in layout]
    if bucket.is_last():
        state._scratch.forget_after(index)
    mag_scratch = mask_scratch = None
    if device.type == "cpu":  # a fresh large CPU allocation costs page faults on every step
        key = layout_key(flat, layout)
        mag_scratch = state._scratch.get("mag", index, key, n, flat.dtype, device)
        mask_scratch = state._scratch.get("mask", index, key, n, torch.bool, device)

    sampled, sample_size = state.sampled, state.sample_size
    local_indices, local_values = _select_local(state, flat, layout, ks, rank, mag_scratch, mask_scratch)
    kp = round_up(max(1, sum(ks)), 8)  # keeps both byte views aligned
    index_dtype = torch.int32 if n < 2**31 - 1 else torch.int64
    value_bytes = kp * flat.element_size()
    payload = _pack(local_indices, local_values, kp, index_dtype, flat)
    expected = header_rows(world, backward_pass, index, n, payload.numel() - HEADER_BYTES)
    seal(payload, expected, rank)
    gathered, fut = gather_bytes(payload, world, group)
    acc_dtype = _acc_dtype(flat.dtype)
    union_seed = state.seed
    bounds = torch.tensor([[off for _, off, _, _ in layout], [off + num for _, off, num, _ in layout]],
                          dtype=torch.int64, device=device)
    exchanges = state._exchanges

    def aggregate(done: torch.futures.Future) -> torch.Tensor:
        try:
            received(done, rank, world, backward_pass, index)
            all_indices = gathered[:, HEADER_BYTES + value_bytes :].view(index_dtype).reshape(-1).to(torch.int64)
            check(gathered, expected, rank, backward_pass, index, all_indices, n)
            selected = combine(all_indices)
        except BaseException as error:
            exchanges.fail(error, backward_pass, params)
            raise
        exchanges.settle(backward_pass, params, functools.partial(publish_selected, layout, selected))
        return buffer

    def combine(all_indices: torch.Tensor) -> torch.Tensor:
        """Aggregate the checked payloads into ``flat``; the kept (sorted) flat bucket indices."""
        all_values = gathered[:, HEADER_BYTES : HEADER_BYTES + value_bytes].view(flat.dtype)  # (world, kp)
        union, inverse = torch.unique(all_indices, sorted=True, return_inverse=True)
        sums = torch.zeros(union.numel(), dtype=acc_dtype, device=device)
        for r in range(world):  # rank order: the same float additions on every rank
            sums.index_add_(0, inverse[r * kp : (r + 1) * kp], all_values[r].to(acc_dtype))
        # exact zeros (the padding at index n, cancellation) are not support
        keep = sums != 0
        cuts = torch.searchsorted(union, bounds).tolist()  # each parameter's part of the union; one host sync
        for k, lo, hi in zip(ks, cuts[0], cuts[1]):
            if hi - lo <= k:  # the ranks chose at most k_p positions together: all stay
                continue
            part = sums[lo:hi]
            chosen = select_topk(part, k, sampled=sampled, sample_size=param_sample_size(hi - lo, sample_size),
                                 seed=union_seed)
            part_keep = keep[lo:hi]
            chosen_keep = part_keep.index_select(0, chosen)
            part_keep.zero_()
            part_keep.index_copy_(0, chosen, chosen_keep)
        kept = torch.nonzero(keep).squeeze(1)
        selected = union.index_select(0, kept)  # sorted: union is sorted and kept is increasing
        flat.zero_()
        flat.index_copy_(0, selected, (sums.index_select(0, kept) / world).to(flat.dtype))
        return selected

    return fut.then(aggregate)


# --------------------------------------------------------------------------------------------------------------
# int8
# --------------------------------------------------------------------------------------------------------------


class Int8State:
    """State of :func:`int8_hook`.

    Args:
        process_group: group to aggregate over; ``None`` is the default group.
    """

    def __init__(self, process_group=None) -> None:
        self.process_group = process_group
        self._scratch = Scratch()  # CPU only: one float32 buffer per bucket
        self._exchanges = Exchanges()

    @property
    def failure(self) -> BaseException | None:
        """The latest failed exchange of this state (a :class:`CompressionExchangeError`), or ``None``."""
        return self._exchanges.failure


def int8_hook(state: Int8State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: layer-wise int8-quantized, deterministic mean of the bucket.

    Per rank and parameter ``p`` (its segment ``x_p`` of the bucket): ``scale_p = max|x_p| / 127`` (1 when
    ``x_p`` is all zeros), ``q = round(x_p / scale_p)`` clamped to [-127, 127] as int8; one all_gather of the
    bucket's ``(q, scales)`` behind a checked header (a broken exchange raises :class:`CompressionExchangeError`);
    every rank dequantizes and sums in rank order (in float32 for half-precision
    buckets), then divides by the world size. Dense: publishes no support. Error per element of ``p`` is at most
    ``max|x_p,r| / 254`` per rank before averaging. One scale per parameter, never per bucket, so the result
    does not depend on how DDP laid the parameters out in buckets.
    """
    group = state.process_group
    world, rank = group_info(group)
    buffer = bucket.buffer()
    flat = buffer.view(-1)
    n = flat.numel()
    device = flat.device
    index = bucket.index()
    layout = bucket_layout(bucket, buffer)
    params = [param for param, _, _, _ in layout]
    backward_pass = state._exchanges.begin(group, world, rank, index, params)
    segments = [(offset, numel) for _, offset, numel, _ in layout if numel > 0]
    gaps = layout_gaps(layout, n)
    if bucket.is_last():
        state._scratch.forget_after(index)
    key = layout_key(flat, layout)

    def work() -> torch.Tensor:  # a float32 buffer of the bucket's size
        if device.type == "cpu":  # a fresh large CPU allocation costs page faults on every step
            return state._scratch.get("work", index, key, n, torch.float32, device)
        return torch.empty(n, dtype=torch.float32, device=device)

    x = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
    q_bytes = round_up(n, 4)  # keeps the float32 scales aligned
    body_bytes = round_up(q_bytes + 4 * len(segments), 8)  # keeps every rank's header aligned in the gather
    payload = torch.empty(HEADER_BYTES + body_bytes, dtype=torch.uint8, device=device)
    body = payload[HEADER_BYTES:]
    scales = body[q_bytes : q_bytes + 4 * len(segments)].view(torch.float32)
    if segments:
        absmax = torch.stack([torch.linalg.vector_norm(x[off : off + num], ord=math.inf) for off, num in segments])
        scale = absmax / 127.0
        torch.where(scale > 0, scale, torch.ones_like(scale), out=scales)
    scaled = work()
    for p, (off, num) in enumerate(segments):
        torch.div(x[off : off + num], scales[p], out=scaled[off : off + num])
    for start, end in gaps:
        scaled[start:end] = 0
    scaled.round_().clamp_(-127, 127)
    body[:n].view(torch.int8).copy_(scaled)
    body[n:q_bytes] = 0
    body[q_bytes + 4 * len(segments) :] = 0
    expected = header_rows(world, backward_pass, index, n, body_bytes)
    seal(payload, expected, rank)
    gathered, fut = gather_bytes(payload, world, group)
    exchanges = state._exchanges

    def aggregate(done: torch.futures.Future) -> torch.Tensor:
        try:
            received(done, rank, world, backward_pass, index)
            check(gathered, expected, rank, backward_pass, index)
            combine()
        except BaseException as error:
            exchanges.fail(error, backward_pass, params)
            raise
        exchanges.settle(backward_pass, params)
        return buffer

    def combine() -> None:
        """Dequantize and average the checked payloads into ``flat``."""
        total = flat if flat.dtype == torch.float32 else torch.empty(n, dtype=torch.float32, device=device)
        total.zero_()
        values = work()
        for r in range(world):  # rank order: the same float additions on every rank
            row = gathered[r, HEADER_BYTES:]
            values.copy_(row[:n].view(torch.int8))
            scales_r = row[q_bytes : q_bytes + 4 * len(segments)].view(torch.float32)
            for p, (off, num) in enumerate(segments):
                values[off : off + num].mul_(scales_r[p])
            total.add_(values)
        total.div_(world)
        if total is not flat:
            flat.copy_(total)

    return fut.then(aggregate)
