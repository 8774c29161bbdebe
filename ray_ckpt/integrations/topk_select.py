"""Top-k selection of the compression hooks: which elements of one tensor a top-k hook keeps. Pure torch, one
process, no process group; it runs in the training process, in the autograd thread (each rank's local selection
inside :func:`ray_ckpt.integrations.compression.topk_hook`) and in a process-group thread (the selection over the
aggregate, in the hook's callback).

:func:`select_topk` avoids ``torch.topk`` over a large parameter (it takes a slow partial-sort path on CPU at k = 1%
of a multi-million-element tensor): the k-th largest magnitude is estimated from a fixed random sample and the
(few) elements above it are trimmed to exactly k. The hooks select per parameter; a parameter of ``n`` elements is
sampled with ``min(sample_size, max(4096, n // 64))`` positions (:func:`param_sample_size`), and parameters of at
most four times that are selected exactly. Every selection is a pure function of the tensor's values, the sample
size and the seed, so every rank computes the same one from the same input.
"""

import functools
import math

import torch

__all__ = ["DEFAULT_SAMPLE_SIZE", "param_sample_size", "select_topk", "topk_count"]

DEFAULT_SAMPLE_SIZE = 65536
"""Sample size of the sampled threshold estimate: about ``ratio * 65536`` sampled elements (655 at 1%) lie
above the estimated threshold, a ~4% relative error on the selected count, covered by a 3-sigma margin."""

_EXACT_BELOW_FACTOR = 4
"""Tensors of at most ``_EXACT_BELOW_FACTOR * sample_size`` elements use the exact selection (cheap at that size)."""

_MIN_PARAM_SAMPLE = 4096
_PARAM_SAMPLE_DIVISOR = 64


def param_sample_size(numel: int, sample_size: int) -> int:
    """Sample size the hooks use for one parameter (or its part of the aggregate) of ``numel`` elements.

    ``min(sample_size, max(4096, numel // 64))``: a function of ``numel`` alone (never of the bucket), small
    enough that the sample costs little next to the passes over the parameter, so parameters of up to
    ``4 * 4096`` elements are selected exactly and larger ones sample about 1/64 of their elements.
    """
    return min(sample_size, max(_MIN_PARAM_SAMPLE, numel // _PARAM_SAMPLE_DIVISOR))


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
