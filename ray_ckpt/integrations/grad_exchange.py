"""The byte exchange under the DDP compression hooks (:mod:`ray_ckpt.integrations.compression`): one checked
all_gather per bucket, the backward-pass bookkeeping of a hook state, the bucket's parameter layout and its
per-bucket scratch. Training process: the autograd thread (each hook: layout, sealing, launching the all_gather)
and a process-group thread (the hook's callback: receiving and checking).

A broken exchange. Each rank's payload starts with a 64-byte header (magic, sender rank, world size, the state's
backward-pass count, bucket index, bucket size, payload size, and a checksum of the rest: the wrapping sum of its
int64 words; :func:`seal`). The callback first takes the all_gather's own outcome (:func:`received`:
``Future.then`` runs it even when the collective failed, e.g. a peer gone or a timeout, and the output buffer was
then never written), then checks every rank's header and checksum and, for top-k, that every index lies in the
bucket (:func:`check`): one pass over the gathered bytes, no extra collective. On any failure it raises
:class:`CompressionExchangeError` before writing the bucket or publishing anything, and marks every parameter of
that backward pass failed in :mod:`ray_ckpt.engine.grad_support` (:class:`Exchanges`), so ``backward()`` raises
and a LowDiff capture refuses the step even when the loop steps anyway. A payload corrupted at its sender is seen
by every rank at that step; one corrupted as a single rank receives it only by that rank, whose peers then fail at
their next exchange (their own step was computed from intact payloads). The hook state is not rolled back
(error-feedback residuals already gave up what was sent): restore from the last checkpoint.

Scratch. On CPU each hook keeps one scratch buffer per bucket (:class:`Scratch`; about 1.25x the bucket's bytes
for top-k, 1x for int8) because a fresh large allocation there costs page faults every step; on other devices
temporaries come from the caching allocator and are freed after the hook.
"""

import threading

import torch
import torch.distributed as dist

from ray_ckpt.engine import grad_support as support
from ray_ckpt.errors import RayCkptError

__all__ = [
    "CompressionExchangeError",
    "Exchanges",
    "HEADER_BYTES",
    "Scratch",
    "bucket_layout",
    "check",
    "gather_bytes",
    "group_info",
    "header_rows",
    "layout_gaps",
    "layout_key",
    "publish_selected",
    "received",
    "round_up",
    "seal",
]

def group_info(process_group) -> tuple[int, int]:
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; pyproject admits torch >= 2.3
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_bytes(payload: torch.Tensor, world: int, process_group) -> tuple[torch.Tensor, torch.futures.Future]:
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
HEADER_BYTES = 8 * _HEADER_WORDS
_HEADER_FIELDS = ("magic", "sender rank", "world size", "backward pass", "bucket index", "bucket size",
                  "payload size")


class Exchanges:
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


def header_rows(world: int, backward_pass: int, bucket_index: int, n: int, body_bytes: int) -> torch.Tensor:
    """The header fields (all but the checksum) expected from each rank, as a CPU ``(world, 7)`` int64 tensor.
    Autograd thread (the hook)."""
    return torch.tensor([[_MAGIC, r, world, backward_pass, bucket_index, n, body_bytes] for r in range(world)],
                        dtype=torch.int64)


def seal(payload: torch.Tensor, expected: torch.Tensor, rank: int) -> None:
    """Write this rank's header into the first ``HEADER_BYTES`` of ``payload``: its row of ``expected`` and the
    checksum of the body (the sum of its int64 words, wrapping: exact modulo 2**64 in any order, and any single
    flipped bit changes it). Autograd thread."""
    words = payload[:HEADER_BYTES].view(torch.int64)
    words[:7].copy_(expected[rank])
    torch.sum(payload[HEADER_BYTES:].view(torch.int64), dim=0, keepdim=True, out=words[7:])


def check(gathered: torch.Tensor, expected: torch.Tensor, rank: int, backward_pass: int, bucket_index: int,
           indices: torch.Tensor | None = None, n: int = 0) -> None:
    """Raise :class:`CompressionExchangeError` unless every rank's gathered payload checks out: its header is
    the expected one and its body matches its checksum; the top-k ``indices`` (contiguous, int64, ``world * kp``
    of them, rank by rank) must lie in ``[0, n]`` (``n`` pads). One pass over the gathered bytes, one over the
    indices, one host sync; the cause is worked out only on failure. Process-group thread (the hook's
    callback)."""
    world = gathered.shape[0]
    words = gathered[:, :HEADER_BYTES].view(torch.int64)
    sums = gathered[:, HEADER_BYTES:].view(torch.int64).sum(dim=1)
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


def received(fut: torch.futures.Future, rank: int, world: int, backward_pass: int, bucket_index: int) -> None:
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


def bucket_layout(bucket, buffer: torch.Tensor) -> list[tuple[torch.Tensor, int, int, bool]]:
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


def layout_gaps(layout, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of the bucket buffer covered by no parameter (none in practice)."""
    gaps, pos = [], 0
    for _, offset, numel, _ in sorted(layout, key=lambda entry: entry[1]):
        if offset > pos:
            gaps.append((pos, offset))
        pos = max(pos, offset + numel)
    if pos < n:
        gaps.append((pos, n))
    return gaps


def publish_selected(layout, selected: torch.Tensor) -> None:
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


class Scratch:
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


def layout_key(flat: torch.Tensor, layout) -> tuple:
    return (flat.numel(), flat.dtype, flat.device, tuple((id(p), off, num) for p, off, num, _ in layout))
