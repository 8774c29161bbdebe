"""DDP communication hooks that compress gradients: top-k sparsification and int8 quantization.

LowDiff's premise is that training already exchanges a small *aggregated compressed gradient* every step; these
hooks are that compression, and the top-k hook additionally publishes, per parameter, the positions of its
non-zero aggregated gradient (:mod:`ray_ckpt.engine.support`) so the capture can gather ``O(k)`` values instead of
scanning dense gradients.

Usage, in every training process, once, after wrapping the model::

    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    ddp.register_comm_hook(TopKState(ratio=0.01), topk_hook)      # or: Int8State(), int8_hook

Where things run. DDP calls the hook from the autograd thread once per bucket, as soon as every gradient of the
bucket is ready; the hook selects locally, launches one asynchronous ``all_gather`` and returns a future chained on
it. The aggregation runs in the callback of that future (a process-group thread), and DDP waits for every bucket's
future before ``backward()`` returns, then copies the result into ``param.grad``. So after ``backward()`` every
rank holds **bitwise identical** gradients, and for top-k the support of every parameter is published.

Determinism. Every rank gathers the same bytes from every rank and runs the same torch ops on them in the same
order (sum rank by rank in rank order, ties broken by position, no atomics whose order matters), so the aggregate
is bitwise identical on all ranks: what LowDiff's bit-exact replay needs. It is deterministic for a given device
type and torch build; a CPU and a CUDA run are not expected to agree bitwise.

Performance. :func:`select_topk` avoids ``torch.topk`` over the whole bucket (it takes a slow partial-sort path on
CPU at k = 1% of a multi-million-element tensor): the k-th largest magnitude is estimated from a fixed random sample
and the (few) elements above it are trimmed to exactly k. On CPU the hook keeps one scratch buffer per bucket
(about 1.25x the bucket's bytes) because a fresh large allocation there costs page faults every step; on other
devices temporaries come from the caching allocator and are freed after the hook.
"""

import functools
import math
import threading

import torch
import torch.distributed as dist

from ray_ckpt.engine import support

__all__ = [
    "DEFAULT_SAMPLE_SIZE",
    "Int8State",
    "TopKState",
    "int8_hook",
    "select_topk",
    "topk_count",
    "topk_hook",
]

DEFAULT_SAMPLE_SIZE = 65536
"""Sample size of the sampled threshold estimate: about ``ratio * 65536`` sampled elements (655 at 1%) lie
above the estimated threshold, a ~4% relative error on the selected count, covered by a 3-sigma margin."""

_EXACT_BELOW_FACTOR = 4
"""Tensors of at most ``_EXACT_BELOW_FACTOR * sample_size`` elements use the exact selection (cheap at that size)."""


# --------------------------------------------------------------------------------------------------------------
# selection (pure, single process)
# --------------------------------------------------------------------------------------------------------------


def topk_count(numel: int, ratio: float) -> int:
    """k for a tensor of ``numel`` elements: ``max(1, ceil(ratio * numel))``, at most ``numel``."""
    return min(numel, max(1, math.ceil(ratio * numel)))


@functools.lru_cache(maxsize=64)
def _sorted_uniform(size: int, seed: int, device: torch.device) -> torch.Tensor:
    """``size`` sorted float64 uniforms in [0, 1), a pure function of ``(size, seed)`` on any device.

    Drawn once on CPU with a seeded generator and cached per device: a sample of a tensor of ``n`` elements is
    ``floor(u * n)``, non-decreasing (memory-friendly gather) and the same on every call with the same seed.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    u = torch.rand(size, generator=gen, dtype=torch.float64)
    return u.sort().values.to(device)


def _nan_to_inf(mag: torch.Tensor) -> torch.Tensor:
    """Magnitudes with NaN ranked as the largest (so a NaN gradient is kept and AMP can still see it)."""
    return torch.nan_to_num(mag, nan=math.inf, posinf=math.inf)


def _topk_mask(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of exactly ``min(k, numel)`` largest entries of the 1-D ``mag`` (no NaN).

    Ties at the k-th value are broken by position (lowest first), so the mask is a pure function of the values,
    independent of how ``torch.topk`` orders ties: every rank computes the same mask from the same input.
    """
    m = mag.numel()
    if k >= m:
        return torch.ones(m, dtype=torch.bool, device=mag.device)
    kth = torch.topk(mag, k, sorted=False).values.min()
    greater = mag > kth
    equal = mag == kth
    need = k - greater.sum()
    return greater | (equal & (equal.cumsum(0) <= need))


def select_topk(
    x: torch.Tensor,
    k: int,
    *,
    sampled: bool = True,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int = 0,
    out: torch.Tensor | None = None,
    mask_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sorted int64 flat indices of (about) the ``k`` largest magnitudes of ``x``; never more than ``k``.

    Exact (``sampled=False``, or ``x`` has at most ``4 * sample_size`` elements): exactly ``min(k, numel)``
    indices, the largest ``|x|``, ties broken by position, NaN counted as largest.

    Sampled: the k-th largest ``|x|`` is estimated from ``sample_size`` positions ``floor(u * numel)`` where
    ``u`` are sorted uniforms drawn once from ``seed`` (so the sample is deterministic for a given seed and size:
    the DDP hook uses ``seed + rank``). The threshold is taken with a 3-sigma margin below the estimate, every
    element with ``|x| >= threshold`` becomes a candidate, and the candidates are trimmed to the exact top ``k``
    of them. Whenever the candidates number at least ``k`` the result is therefore *identical* to the exact
    selection; if the estimate overshoots (rare), one more pass with a 4x wider margin tops up, after which the
    result may hold fewer than ``k`` indices. It also holds fewer when ``x`` has fewer than ``k`` non-zeros
    (zeros are never selected then). NaN and inf are always candidates. Cost: a few elementwise passes over
    ``x`` plus work on ``O(k)`` candidates, versus ``torch.topk`` over all of ``x`` for the exact mode.

    ``out`` (``x``'s dtype) and ``mask_out`` (bool) are optional scratch tensors of ``x.numel()`` elements on
    ``x``'s device that receive ``|x|`` and the candidate mask; they save two allocations per call (page faults
    on CPU). ``x`` itself is never modified.
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    k = min(k, n)
    mag = torch.abs(flat, out=out.reshape(-1)) if out is not None else flat.abs()
    mag.nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN ranks as the largest: AMP's overflow check still sees it

    if not sampled or n <= _EXACT_BELOW_FACTOR * sample_size:
        return torch.nonzero(_topk_mask(mag, k)).squeeze(1)

    u = _sorted_uniform(sample_size, seed, flat.device)
    sample_mag = mag.index_select(0, (u * n).to(torch.int64).clamp_(max=n - 1))
    expected = sample_size * k / n  # sampled elements expected above the true k-th magnitude
    zero = torch.zeros((), dtype=mag.dtype, device=mag.device)
    floor = torch.nextafter(zero, zero + 1)  # smallest positive value: zeros are never selected
    mask = mask_out.reshape(-1) if mask_out is not None else None

    candidates = None
    for sigmas in (3.0, 12.0):  # first pass; the second tops up after an (unlikely) undershoot
        rank_in_sample = min(sample_size, math.ceil(expected + sigmas * math.sqrt(expected) + 1.0))
        threshold = torch.topk(sample_mag, rank_in_sample, sorted=False).values.min()
        threshold = torch.maximum(threshold, floor)
        candidates = torch.nonzero(torch.ge(mag, threshold, out=mask) if mask is not None else mag >= threshold)
        candidates = candidates.squeeze(1)
        if candidates.numel() >= k or bool(threshold <= floor):
            break
    if candidates.numel() > k:
        candidates = candidates.masked_select(_topk_mask(mag.index_select(0, candidates), k))
    return candidates


# --------------------------------------------------------------------------------------------------------------
# shared hook plumbing
# --------------------------------------------------------------------------------------------------------------


def _group_info(process_group) -> tuple[int, int]:
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; pyproject admits torch >= 2.3
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_bytes(payload: torch.Tensor, world: int, process_group) -> tuple[torch.Tensor, torch.futures.Future]:
    """Start an all_gather of the 1-D uint8 ``payload`` (same size on every rank); returns ``(out, future)``.

    ``out`` has shape ``(world, payload.numel())`` and is valid once the future completes.
    """
    out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    work = _ALL_GATHER_SINGLE(out, payload, group=process_group, async_op=True)
    return out.view(world, payload.numel()), work.get_future()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half-precision buckets in float32 (the sum of ranks may overflow float16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _bucket_layout(bucket, buffer: torch.Tensor) -> list[tuple[torch.Tensor, int, int, bool]]:
    """``(param, offset, numel, publishable)`` for each parameter of ``bucket``.

    The offset of each gradient in the bucket buffer is computed from ``data_ptr`` differences (DDP's bucket
    gradients are views of the buffer, consecutive in practice); when a gradient is not a view inside the buffer
    the cumulative numel is used. A parameter whose bucket view is not contiguous (e.g. channels_last) is not
    publishable: its flat positions in the buffer are memory order, not ``param.grad.view(-1)`` order.
    """
    params = bucket.parameters()
    grads = bucket.gradients()
    base = buffer.data_ptr()
    size = buffer.element_size()
    n = buffer.numel()
    layout = []
    running = 0
    for param, grad in zip(params, grads):
        delta = grad.data_ptr() - base
        inside = delta >= 0 and delta % size == 0 and delta // size + grad.numel() <= n
        offset = delta // size if inside else running
        layout.append((param, offset, grad.numel(), inside and grad.is_contiguous()))
        running = offset + grad.numel()
    return layout


def _publish(layout, selected: torch.Tensor) -> None:
    """Split the sorted flat bucket indices ``selected`` per parameter and publish them (support module)."""
    if not layout:
        return
    bounds = torch.tensor(
        [[off for _, off, _, _ in layout], [off + num for _, off, num, _ in layout]],
        dtype=torch.int64,
        device=selected.device,
    )
    cuts = torch.searchsorted(selected, bounds).tolist()  # one small host sync
    for (param, offset, _, publishable), lo, hi in zip(layout, cuts[0], cuts[1]):
        if publishable:
            support.publish(param, selected[lo:hi] - offset)
        else:
            support.take(param)  # drop any stale entry: the capture falls back to the dense gradient


# --------------------------------------------------------------------------------------------------------------
# top-k
# --------------------------------------------------------------------------------------------------------------


class TopKState:
    """State of :func:`topk_hook`; one per DDP model, created in the training process.

    Args:
        process_group: group to aggregate over; ``None`` is the default group (the one DDP uses by default,
            so pass DDP's group when DDP was given one).
        ratio: fraction of each bucket kept, ``k = max(1, ceil(ratio * bucket numel))``; the aggregated
            gradient of a bucket has at most ``k`` non-zeros.
        error_feedback: keep, per bucket, the part of the local (gradient + residual) that this rank did not
            send, and add it to the next step's gradient (the standard residual of top-k SGD). Costs one
            buffer of the bucket's size per bucket. The residual is reset when DDP rebuilds its buckets
            (after the first iteration) because its layout no longer matches.
        sampled: estimate the local selection threshold from a sample (see :func:`select_topk`) instead of
            an exact ``torch.topk`` over the bucket.
        sample_size: size of that sample.
        seed: seed of the sample; rank ``r`` uses ``seed + r`` for its local selection and every rank uses
            ``seed`` for the (identical) selection over the aggregate, so results are reproducible.
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
        # bucket index -> (layout key, tensor); the key detects DDP's bucket rebuild
        self._residuals: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._scratch: dict[int, tuple[tuple, torch.Tensor]] = {}  # CPU only: |acc| of the selection
        self._mask_scratch: dict[int, tuple[tuple, torch.Tensor]] = {}  # CPU only: its candidate mask

    def k_for(self, numel: int) -> int:
        """Elements kept for a bucket of ``numel`` elements."""
        return topk_count(numel, self.ratio)

    def residual(self, bucket_index: int) -> torch.Tensor | None:
        """The error-feedback residual of bucket ``bucket_index`` (flat, bucket dtype), or ``None``."""
        with self._lock:
            entry = self._residuals.get(bucket_index)
        return None if entry is None else entry[1]

    def _per_bucket(self, table: dict, index: int, key: tuple, like: torch.Tensor, zero: bool,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor shaped like ``like`` kept in ``table`` for bucket ``index``; replaced when ``key`` changed."""
        with self._lock:
            entry = table.get(index)
            if entry is None or entry[0] != key:
                fresh = torch.zeros_like(like, dtype=dtype) if zero else torch.empty_like(like, dtype=dtype)
                entry = (key, fresh)
                table[index] = entry
        return entry[1]

    def _forget_after(self, last_index: int) -> None:
        """Drop the tensors of buckets past the last one (DDP's rebuild may leave fewer buckets)."""
        with self._lock:
            for table in (self._residuals, self._scratch, self._mask_scratch):
                for index in [i for i in table if i > last_index]:
                    del table[index]


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: top-k sparsified, deterministic mean of the bucket over ``state.process_group``.

    Per bucket, on every rank: select the local top-k of ``|gradient (+ residual)|`` (:func:`select_topk`),
    all-gather ``(indices, values)`` padded to ``k`` (one uint8 all_gather), sum rank by rank in rank order into
    the union of the gathered indices, keep the top-k of that sum (ties by position), divide by the world size,
    and write it densely (zeros elsewhere) into the bucket buffer, which is the future's value. Then publish, for
    each parameter of the bucket, the sorted int64 flat indices of its kept elements to
    :mod:`ray_ckpt.engine.support`. The aggregated bucket has at most ``k`` non-zeros; each is the mean over all
    ranks of the values of the ranks that selected that position (the others count as zero).
    """
    group = state.process_group
    world, rank = _group_info(group)
    buffer = bucket.buffer()
    flat = buffer.view(-1)
    n = flat.numel()
    k = state.k_for(n)
    index = bucket.index()
    layout = _bucket_layout(bucket, buffer)
    key = (n, flat.dtype, flat.device, tuple(id(p) for p, _, _, _ in layout))
    if bucket.is_last():
        state._forget_after(index)

    if state.error_feedback:
        residual = state._per_bucket(state._residuals, index, key, flat, zero=True)
        acc = residual.add_(flat)  # residual now holds gradient + old residual
    else:
        residual = None
        acc = flat
    mag_scratch = mask_scratch = None
    if flat.device.type == "cpu":  # a fresh large CPU allocation costs page faults on every step
        mag_scratch = state._per_bucket(state._scratch, index, key, flat, zero=False)
        mask_scratch = state._per_bucket(state._mask_scratch, index, key, flat, zero=False, dtype=torch.bool)
    local = select_topk(acc, k, sampled=state.sampled, sample_size=state.sample_size, seed=state.seed + rank,
                        out=mag_scratch, mask_out=mask_scratch)
    values = acc.index_select(0, local)
    if residual is not None:
        residual.index_fill_(0, local, 0)  # what was sent is no longer owed

    # one payload per rank: [values (kp) | indices (kp)] as bytes, padded with (index 0, value 0)
    kp = _round_up(k, 8)  # keeps both byte views aligned
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    value_bytes = kp * flat.element_size()
    payload = torch.zeros(value_bytes + kp * (4 if index_dtype == torch.int32 else 8), dtype=torch.uint8,
                          device=flat.device)
    payload[:value_bytes].view(flat.dtype)[: local.numel()] = values
    payload[value_bytes:].view(index_dtype)[: local.numel()] = local.to(index_dtype)
    gathered, fut = _gather_bytes(payload, world, group)
    acc_dtype = _acc_dtype(flat.dtype)
    union_seed = state.seed
    sampled, sample_size = state.sampled, state.sample_size

    def aggregate(_: torch.futures.Future) -> torch.Tensor:
        all_values = gathered[:, :value_bytes].view(flat.dtype)  # (world, kp)
        all_indices = gathered[:, value_bytes:].view(index_dtype).reshape(-1).to(torch.int64)
        union, inverse = torch.unique(all_indices, sorted=True, return_inverse=True)
        sums = torch.zeros(union.numel(), dtype=acc_dtype, device=flat.device)
        for r in range(world):  # rank order: the same float additions on every rank
            sums.index_add_(0, inverse[r * kp : (r + 1) * kp], all_values[r].to(acc_dtype))
        keep = select_topk(sums, k, sampled=sampled, sample_size=sample_size, seed=union_seed)
        keep = keep[sums[keep] != 0]  # exact zeros (padding, cancellation) are not support
        selected = union[keep]  # sorted: union is sorted and keep is increasing
        flat.zero_()
        flat.index_copy_(0, selected, (sums[keep] / world).to(flat.dtype))
        _publish(layout, selected)
        return buffer

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


def int8_hook(state: Int8State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: int8-quantized, deterministic mean of the bucket over ``state.process_group``.

    Per rank and bucket: ``scale = max|x| / 127`` (1 when the bucket is all zeros), ``q = round(x / scale)``
    clamped to [-127, 127] as int8; one all_gather of ``(q, scale)``; every rank dequantizes and sums in rank
    order (in float32 for half-precision buckets), then divides by the world size. Dense: publishes no support.
    Error per element is at most ``max|x_r| / 254`` per rank before averaging.
    """
    group = state.process_group
    world, _ = _group_info(group)
    buffer = bucket.buffer()
    flat = buffer.view(-1)
    n = flat.numel()
    x = flat.to(torch.float32)
    scale = x.abs().max() / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(x, scale).round_().clamp_(-127, 127).to(torch.int8)

    q_bytes = _round_up(n, 4)  # keeps the float32 scale aligned
    payload = torch.empty(q_bytes + 4, dtype=torch.uint8, device=flat.device)
    payload[:n] = q.view(torch.uint8)
    payload[n:q_bytes] = 0
    payload[q_bytes:].view(torch.float32)[0] = scale
    gathered, fut = _gather_bytes(payload, world, group)

    def aggregate(_: torch.futures.Future) -> torch.Tensor:
        total = flat if flat.dtype == torch.float32 else torch.empty(n, dtype=torch.float32, device=flat.device)
        total.zero_()
        for r in range(world):  # rank order: the same float additions on every rank
            q_r = gathered[r, :n].view(torch.int8)
            scale_r = gathered[r, q_bytes:].view(torch.float32)
            total.add_(q_r.to(torch.float32) * scale_r)
        total.div_(world)
        if total is not flat:
            flat.copy_(total)
        return buffer

    return fut.then(aggregate)
