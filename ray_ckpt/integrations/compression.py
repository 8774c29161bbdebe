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

A broken exchange. Each rank's payload starts with a 64-byte header (magic, sender rank, world size, the
state's backward-pass count, bucket index, bucket size, payload size, and a checksum of the rest: the wrapping
sum of its int64 words). The callback first takes the all_gather's own outcome (``Future.then`` runs it even when
the collective failed, e.g. a peer gone or a timeout, and the output buffer was then never written), then checks
every rank's header and checksum and, for top-k, that every index lies in the bucket: one pass over the gathered
bytes, no extra collective. On any failure it raises :class:`CompressionExchangeError` before writing the bucket
or publishing anything, and marks every parameter of that backward pass failed in
:mod:`ray_ckpt.engine.grad_support`, so ``backward()`` raises and a LowDiff capture refuses the step even when
the loop steps anyway. A payload corrupted at its sender is seen by every rank at that step; one corrupted as a
single rank receives it only by that rank, whose peers then fail at their next exchange (their own step was
computed from intact payloads). The hook state is not rolled back (error-feedback residuals already gave up what
was sent): restore from the last checkpoint.

Performance. :func:`select_topk` avoids ``torch.topk`` over a large parameter (it takes a slow partial-sort path
on CPU at k = 1% of a multi-million-element tensor): the k-th largest magnitude is estimated from a fixed random
sample and the (few) elements above it are trimmed to exactly k. The hooks loop over the parameters of a bucket
(not over elements); a parameter of ``n`` elements is sampled with ``min(sample_size, max(4096, n // 64))``
positions, and parameters of at most four times that are selected exactly. On CPU each hook keeps one scratch
buffer per bucket (about 1.25x the bucket's bytes for top-k, 1x for int8) because a fresh large allocation there
costs page faults every step; on other devices temporaries come from the caching allocator and are freed after
the hook.
"""

import functools
import math
import threading
import weakref

import torch
import torch.distributed as dist

from ray_ckpt.engine import grad_support as support
from ray_ckpt.errors import RayCkptError

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

DEFAULT_SAMPLE_SIZE = 65536
"""Sample size of the sampled threshold estimate: about ``ratio * 65536`` sampled elements (655 at 1%) lie
above the estimated threshold, a ~4% relative error on the selected count, covered by a 3-sigma margin."""

_EXACT_BELOW_FACTOR = 4
"""Tensors of at most ``_EXACT_BELOW_FACTOR * sample_size`` elements use the exact selection (cheap at that size)."""

_MIN_PARAM_SAMPLE = 4096
_PARAM_SAMPLE_DIVISOR = 64


def _param_sample_size(numel: int, sample_size: int) -> int:
    """Sample size the hooks use for one parameter (or its part of the aggregate) of ``numel`` elements.

    ``min(sample_size, max(4096, numel // 64))``: a function of ``numel`` alone (never of the bucket), small
    enough that the sample costs little next to the passes over the parameter, so parameters of up to
    ``4 * 4096`` elements are selected exactly and larger ones sample about 1/64 of their elements.
    """
    return min(sample_size, max(_MIN_PARAM_SAMPLE, numel // _PARAM_SAMPLE_DIVISOR))


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


@functools.lru_cache(maxsize=128)
def _sample_positions(numel: int, size: int, seed: int, device: torch.device) -> torch.Tensor:
    """The sampled positions ``floor(u * numel)`` (int64, non-decreasing) of a tensor of ``numel`` elements."""
    u = _sorted_uniform(size, seed, device)
    return (u * numel).to(torch.int64).clamp_(max=numel - 1)


@functools.lru_cache(maxsize=32)
def _smallest_positive(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The smallest positive value of ``dtype`` (a subnormal), as a 0-dim tensor on ``device``."""
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.nextafter(zero, zero + 1)


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

    sample_mag = mag.index_select(0, _sample_positions(n, sample_size, seed, flat.device))
    expected = sample_size * k / n  # sampled elements expected above the true k-th magnitude
    floor = _smallest_positive(mag.dtype, mag.device)  # zeros are never selected
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


class CompressionExchangeError(RayCkptError, RuntimeError):
    """A compression hook's exchange failed (the process group's error: a peer gone, a timeout) or delivered a
    payload that does not check out (short or shifted, stale, out of step, corrupted, an index out of range).

    Raised in the callback of the hook's future (a process-group thread), on every rank that sees the failure,
    before anything of the bucket is aggregated, written or published: DDP re-raises it from ``backward()`` as a
    ``RuntimeError`` whose message carries this one (the exception type does not cross torch's futures), so the
    optimizer step of that backward pass does not run. The hook's state keeps it (``state.failure``), and a
    LowDiff capture raises it from ``optimizer.step()`` if the loop catches the error and steps anyway.

    Attributes: ``rank`` and ``world`` (this rank and the group's size), ``backward_pass`` (the hook state's
    count of backward passes, from 0), ``bucket`` (DDP's bucket index), ``peers`` (the ranks whose payload was
    at fault; empty when the process group itself failed) and ``reason``.
    """

    def __init__(self, reason: str, *, rank: int, world: int, backward_pass: int, bucket: int,
                 peers: tuple[int, ...] = ()) -> None:
        self.reason, self.rank, self.world = reason, rank, world
        self.backward_pass, self.bucket, self.peers = backward_pass, bucket, tuple(peers)
        super().__init__(
            f"gradient exchange of backward pass {backward_pass} (bucket {bucket}) failed on rank {rank} of "
            f"{world}: {reason}. No gradient of this backward pass was applied; restore from the last checkpoint")


_MAGIC = 0x52434B5047524431  # b"RCKPGRD1"
_HEADER_WORDS = 8  # int64: magic, sender rank, world, backward pass, bucket index, bucket numel, body bytes, checksum
_HEADER_BYTES = 8 * _HEADER_WORDS
_HEADER_FIELDS = ("magic", "sender rank", "world size", "backward pass", "bucket index", "bucket size",
                  "payload size")


class _Exchanges:
    """One hook state's exchange bookkeeping: the backward-pass count each header carries, the parameters that
    the current pass exchanged so far, and the latest failure. Autograd thread (:meth:`begin`) and process-group
    threads (the rest).

    The count restarts when the state is used with another process group (or rank, or world size): every rank
    of a group counts the same passes when each created its state before the group's first backward pass.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failure: BaseException | None = None
        self._failed_pass: int | None = None
        self._group_key: tuple | None = None
        self._pass = -1
        self._params: list[torch.Tensor] = []

    def begin(self, group, world: int, rank: int, bucket_index: int, params: list[torch.Tensor]) -> int:
        """A bucket's exchange starts (DDP calls the hooks of a backward pass in bucket order, from 0): its
        backward pass."""
        key = (id(dist.group.WORLD if group is None else group), world, rank)
        with self.lock:
            if key != self._group_key:
                self._group_key, self._pass, self._params, self._failed_pass = key, -1, [], None
            if bucket_index == 0:
                self._pass += 1
                self._params = []
            self._params.extend(params)
            return self._pass

    def fail(self, error: BaseException, backward_pass: int, params: list[torch.Tensor]) -> None:
        """A bucket's exchange failed: mark every parameter this backward pass exchanged so far failed in
        :mod:`ray_ckpt.engine.grad_support` (later buckets of the pass mark theirs in :meth:`settle`). The first
        failure of a pass is the one kept and raised by the capture."""
        with self.lock:
            if self._failed_pass != backward_pass:
                self.failure, self._failed_pass = error, backward_pass
            support.withdraw(self._params if backward_pass == self._pass else params, self.failure)

    def settle(self, backward_pass: int, params: list[torch.Tensor], publish=None) -> None:
        """A bucket's exchange checked out: ``publish()`` its support (or withdraw any stale entry), unless an
        exchange of the same backward pass failed: then its parameters are marked failed too. A callback that
        completes after the next backward pass began (only after a failure made ``backward()`` return early)
        leaves the support alone."""
        with self.lock:
            if backward_pass != self._pass:
                return
            if self._failed_pass == backward_pass:
                support.withdraw(params, self.failure)
            elif publish is not None:
                publish()
            else:
                support.withdraw(params)


def _header_rows(world: int, backward_pass: int, bucket_index: int, n: int, body_bytes: int) -> torch.Tensor:
    """The header fields (all but the checksum) expected from each rank, as a CPU ``(world, 7)`` int64 tensor.
    Autograd thread (the hook)."""
    return torch.tensor([[_MAGIC, r, world, backward_pass, bucket_index, n, body_bytes] for r in range(world)],
                        dtype=torch.int64)


def _seal(payload: torch.Tensor, expected: torch.Tensor, rank: int) -> None:
    """Write this rank's header into the first ``_HEADER_BYTES`` of ``payload``: its row of ``expected`` and the
    checksum of the body (the sum of its int64 words, wrapping: exact modulo 2**64 in any order, and any single
    flipped bit changes it). Autograd thread."""
    words = payload[:_HEADER_BYTES].view(torch.int64)
    words[:7].copy_(expected[rank])
    torch.sum(payload[_HEADER_BYTES:].view(torch.int64), dim=0, keepdim=True, out=words[7:])


def _check(gathered: torch.Tensor, expected: torch.Tensor, rank: int, backward_pass: int, bucket_index: int,
           indices: torch.Tensor | None = None, n: int = 0) -> None:
    """Raise :class:`CompressionExchangeError` unless every rank's gathered payload checks out: its header is
    the expected one and its body matches its checksum; the top-k ``indices`` (contiguous, int64, ``world * kp``
    of them, rank by rank) must lie in ``[0, n]`` (``n`` pads). One pass over the gathered bytes, one over the
    indices, one host sync; the cause is worked out only on failure. Process-group thread (the hook's
    callback)."""
    world = gathered.shape[0]
    words = gathered[:, :_HEADER_BYTES].view(torch.int64)
    sums = gathered[:, _HEADER_BYTES:].view(torch.int64).sum(dim=1)
    bounds = None if indices is None else torch.aminmax(indices)
    if gathered.device.type != "cpu":  # one host sync
        seen = torch.cat([words.reshape(-1), sums] + ([] if bounds is None else [torch.stack(bounds)])).cpu()
        words, sums = seen[: world * _HEADER_WORDS].view(world, _HEADER_WORDS), seen[world * _HEADER_WORDS:][:world]
        bounds = None if bounds is None else (seen[-2], seen[-1])
    ok = torch.equal(words[:, :7], expected) and torch.equal(words[:, 7], sums)
    if ok and bounds is not None:
        ok = 0 <= int(bounds[0]) and int(bounds[1]) <= n
    if ok:
        return
    rows = torch.cat([words.cpu(), sums.cpu().unsqueeze(1)], dim=1)
    if indices is not None:
        per_rank = indices.view(world, -1)
        rows = torch.cat([rows, per_rank.amin(dim=1).cpu().unsqueeze(1), per_rank.amax(dim=1).cpu().unsqueeze(1)],
                         dim=1)
    problems, peers = [], []
    for r, row in enumerate(rows.tolist()):
        want = expected[r].tolist()
        if row[0] != _MAGIC:
            problem = f"no valid header in rank {r}'s payload (a short, shifted or foreign payload)"
        elif row[1:7] != want[1:7]:
            field = next(i for i in range(1, 7) if row[i] != want[i])
            problem = f"rank {r}'s payload has {_HEADER_FIELDS[field]} {row[field]}, expected {want[field]}"
            if field == 3:
                problem += " (a stale payload, or ranks out of step)"
        elif row[7] != row[8]:
            problem = f"rank {r}'s payload fails its checksum (corrupted)"
        elif indices is not None and not (row[9] >= 0 and row[10] <= n):
            problem = f"rank {r}'s payload holds indices in [{row[9]}, {row[10]}], outside [0, {n}]"
        else:
            continue
        problems.append(problem)
        peers.append(r)
    raise CompressionExchangeError("; ".join(problems), rank=rank, world=world, backward_pass=backward_pass,
                                   bucket=bucket_index, peers=tuple(peers))


def _received(fut: torch.futures.Future, rank: int, world: int, backward_pass: int, bucket_index: int) -> None:
    """Raise :class:`CompressionExchangeError` when the exchange's future holds the process group's error.

    ``Future.then`` runs its callback whether or not the future failed; without this, the callback would read
    an output buffer the collective never wrote. Process-group thread (the hook's callback)."""
    try:
        fut.value()
    except Exception as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CompressionExchangeError(f"the process group's all_gather failed (a peer gone or timed out?): "
                                       f"{detail}", rank=rank, world=world, backward_pass=backward_pass,
                                       bucket=bucket_index) from e


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
        if grad.numel() == 0:  # no data pointer to place it by; its (empty) support is trivially publishable
            layout.append((param, running, 0, True))
            continue
        delta = grad.data_ptr() - base
        inside = delta >= 0 and delta % size == 0 and delta // size + grad.numel() <= n
        offset = delta // size if inside else running
        layout.append((param, offset, grad.numel(), inside and grad.is_contiguous()))
        running = offset + grad.numel()
    return layout


def _gaps(layout, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of the bucket buffer covered by no parameter (none in practice)."""
    gaps, pos = [], 0
    for _, offset, numel, _ in sorted(layout, key=lambda entry: entry[1]):
        if offset > pos:
            gaps.append((pos, offset))
        pos = max(pos, offset + numel)
    if pos < n:
        gaps.append((pos, n))
    return gaps


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
            support.withdraw([param])  # drop any stale entry: the capture falls back to the dense gradient


class _Scratch:
    """Scratch tensors kept per bucket (CPU only), replaced when the bucket's layout key changes.

    Their contents never outlive one hook call, so they do not affect results: only the bucket's layout
    (which DDP may rebuild) decides whether one is reused.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, dict[int, tuple[tuple, torch.Tensor]]] = {}

    def get(self, name: str, index: int, key: tuple, numel: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        with self._lock:
            table = self._tables.setdefault(name, {})
            entry = table.get(index)
            if entry is None or entry[0] != key:
                entry = (key, torch.empty(numel, dtype=dtype, device=device))
                table[index] = entry
        return entry[1]

    def forget_after(self, last_index: int) -> None:
        """Drop the tensors of buckets past the last one (DDP's rebuild may leave fewer buckets)."""
        with self._lock:
            for table in self._tables.values():
                for index in [i for i in table if i > last_index]:
                    del table[index]


def _layout_key(flat: torch.Tensor, layout) -> tuple:
    return (flat.numel(), flat.dtype, flat.device, tuple((id(p), off, num) for p, off, num, _ in layout))


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
        self._scratch = _Scratch()  # CPU only: |acc| of the selection and its candidate mask, per bucket
        self._exchanges = _Exchanges()

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
            acc, k, sampled=state.sampled, sample_size=_param_sample_size(numel, state.sample_size),
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
    :func:`_seal`; padded with (index ``flat.numel()``, value 0): the padding index lies in no parameter.
    Autograd thread."""
    n = flat.numel()
    value_bytes = kp * flat.element_size()
    payload = torch.empty(_HEADER_BYTES + value_bytes + kp * (4 if index_dtype == torch.int32 else 8),
                          dtype=torch.uint8, device=flat.device)
    payload_values = payload[_HEADER_BYTES : _HEADER_BYTES + value_bytes].view(flat.dtype)
    payload_indices = payload[_HEADER_BYTES + value_bytes :].view(index_dtype)
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
    world, rank = _group_info(group)
    buffer = bucket.buffer()
    flat = buffer.view(-1)
    n = flat.numel()
    device = flat.device
    index = bucket.index()
    layout = _bucket_layout(bucket, buffer)
    params = [param for param, _, _, _ in layout]
    backward_pass = state._exchanges.begin(group, world, rank, index, params)
    ks = [state.k_for(numel) for _, _, numel, _ in layout]
    if bucket.is_last():
        state._scratch.forget_after(index)
    mag_scratch = mask_scratch = None
    if device.type == "cpu":  # a fresh large CPU allocation costs page faults on every step
        key = _layout_key(flat, layout)
        mag_scratch = state._scratch.get("mag", index, key, n, flat.dtype, device)
        mask_scratch = state._scratch.get("mask", index, key, n, torch.bool, device)

    sampled, sample_size = state.sampled, state.sample_size
    local_indices, local_values = _select_local(state, flat, layout, ks, rank, mag_scratch, mask_scratch)
    kp = _round_up(max(1, sum(ks)), 8)  # keeps both byte views aligned
    index_dtype = torch.int32 if n < 2**31 - 1 else torch.int64
    value_bytes = kp * flat.element_size()
    payload = _pack(local_indices, local_values, kp, index_dtype, flat)
    expected = _header_rows(world, backward_pass, index, n, payload.numel() - _HEADER_BYTES)
    _seal(payload, expected, rank)
    gathered, fut = _gather_bytes(payload, world, group)
    acc_dtype = _acc_dtype(flat.dtype)
    union_seed = state.seed
    bounds = torch.tensor([[off for _, off, _, _ in layout], [off + num for _, off, num, _ in layout]],
                          dtype=torch.int64, device=device)
    exchanges = state._exchanges

    def aggregate(done: torch.futures.Future) -> torch.Tensor:
        try:
            _received(done, rank, world, backward_pass, index)
            all_indices = gathered[:, _HEADER_BYTES + value_bytes :].view(index_dtype).reshape(-1).to(torch.int64)
            _check(gathered, expected, rank, backward_pass, index, all_indices, n)
            selected = combine(all_indices)
        except BaseException as error:
            exchanges.fail(error, backward_pass, params)
            raise
        exchanges.settle(backward_pass, params, functools.partial(_publish, layout, selected))
        return buffer

    def combine(all_indices: torch.Tensor) -> torch.Tensor:
        """Aggregate the checked payloads into ``flat``; the kept (sorted) flat bucket indices."""
        all_values = gathered[:, _HEADER_BYTES : _HEADER_BYTES + value_bytes].view(flat.dtype)  # (world, kp)
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
            chosen = select_topk(part, k, sampled=sampled, sample_size=_param_sample_size(hi - lo, sample_size),
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
        self._scratch = _Scratch()  # CPU only: one float32 buffer per bucket
        self._exchanges = _Exchanges()

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
    world, rank = _group_info(group)
    buffer = bucket.buffer()
    flat = buffer.view(-1)
    n = flat.numel()
    device = flat.device
    index = bucket.index()
    layout = _bucket_layout(bucket, buffer)
    params = [param for param, _, _, _ in layout]
    backward_pass = state._exchanges.begin(group, world, rank, index, params)
    segments = [(offset, numel) for _, offset, numel, _ in layout if numel > 0]
    gaps = _gaps(layout, n)
    if bucket.is_last():
        state._scratch.forget_after(index)
    key = _layout_key(flat, layout)

    def work() -> torch.Tensor:  # a float32 buffer of the bucket's size
        if device.type == "cpu":  # a fresh large CPU allocation costs page faults on every step
            return state._scratch.get("work", index, key, n, torch.float32, device)
        return torch.empty(n, dtype=torch.float32, device=device)

    x = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
    q_bytes = _round_up(n, 4)  # keeps the float32 scales aligned
    body_bytes = _round_up(q_bytes + 4 * len(segments), 8)  # keeps every rank's header aligned in the gather
    payload = torch.empty(_HEADER_BYTES + body_bytes, dtype=torch.uint8, device=device)
    body = payload[_HEADER_BYTES:]
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
    expected = _header_rows(world, backward_pass, index, n, body_bytes)
    _seal(payload, expected, rank)
    gathered, fut = _gather_bytes(payload, world, group)
    exchanges = state._exchanges

    def aggregate(done: torch.futures.Future) -> torch.Tensor:
        try:
            _received(done, rank, world, backward_pass, index)
            _check(gathered, expected, rank, backward_pass, index)
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
            row = gathered[r, _HEADER_BYTES:]
            values.copy_(row[:n].view(torch.int8))
            scales_r = row[q_bytes : q_bytes + 4 * len(segments)].view(torch.float32)
            for p, (off, num) in enumerate(segments):
                values[off : off + num].mul_(scales_r[p])
            total.add_(values)
        total.div_(world)
        if total is not flat:
            flat.copy_(total)

    return fut.then(aggregate)
