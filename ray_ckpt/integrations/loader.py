"""Exact mid-epoch resumption for a plain map-style ``DataLoader`` or Ray Train's prepared loader.

:class:`ResumableLoader` wraps the loader of an epoch-shaped training loop and is given to ``extra_state`` (of
:func:`ray_ckpt.train.attach`, a :class:`~ray_ckpt.Checkpointer` or :func:`ray_ckpt.restore`). It records, with
every captured step, the epoch, the number of batches the loop took from it in that epoch, and the RNG states the
epoch started from; after a restore it re-creates that epoch as the uninterrupted run had it and skips the
consumed batches without loading them.

Runs in the training process (a Ray Train worker or a plain loop); imports Ray only to re-wrap a loader that Ray
Train's ``prepare_data_loader`` prepared.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from ray_ckpt.integrations.epochs import EpochLoop


def _is_ray_prepared(loader: Any) -> bool:
    """True for the loader ``ray.train.torch.prepare_data_loader`` returns (it moves batches to the device)."""
    cls = type(loader)
    return cls.__name__ == "_WrappedDataLoader" and cls.__module__.startswith("ray.train")


class _SkipAhead:
    """An index sampler (or batch sampler) that draws its epoch from ``inner`` as usual, drops the first ``skip``
    entries, calls ``after_skip`` and yields the rest. Drawing the dropped entries makes the sampler's random
    draws those of the uninterrupted epoch; no sample is loaded for them (the DataLoader only sees the rest)."""

    def __init__(self, inner: Iterable, skip: int, after_skip: Callable[[], None] | None):
        self.inner, self.skip, self.after_skip = inner, skip, after_skip

    def __iter__(self) -> Iterator:
        it = iter(self.inner)
        for _ in range(self.skip):
            if next(it, _END) is _END:
                break
        if self.after_skip is not None:
            self.after_skip()
        yield from it

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


_END = object()


class ResumableLoader(EpochLoop):
    """A map-style ``DataLoader`` (or the loader ``ray.train.torch.prepare_data_loader`` returns) that resumes an
    interrupted epoch exactly. Build it where the loop builds its loader, give it to ``extra_state``, and loop::

        data = ResumableLoader(loader)
        session = ray_ckpt.train.attach(model, optimizer, extra_state=data)   # or restore(..., extra_state=data)
        for epoch in data.epochs(num_epochs, start_step=session.start_step):
            for x, y in data:                 # after a restore: the rest of the interrupted epoch
                ...

    Training process (a Ray Train worker or a plain loop); not thread-safe.

    **What it does.** Each pass (``iter(data)``) is the next epoch: it calls ``sampler.set_epoch(epoch)`` when the
    sampler has one (``DistributedSampler``; do not call it yourself), records the RNG states the epoch starts from
    and iterates the wrapped loader unchanged, so a run that is never restored is the run without the wrapper.
    Its ``state_dict()`` (taken with every captured step) holds the epoch, the number of batches the loop has
    taken in it, those RNG states (about 5 KB per generator) and the loader's shape (batches per epoch, dataset
    length, batch size, the sampler's kind, world size and rank). The restored step's position is therefore
    counted in batches, not derived from the step: gradient accumulation and optimizer steps skipped by a
    ``GradScaler`` need nothing extra (with one step per batch, ``start_step == epoch * len(data) + position``).

    **After a restore** (``load_state_dict``, called by ``attach``/``restore``) that ended mid-epoch, the next
    pass re-creates that epoch: it puts the epoch's starting RNG states back, sets the sampler's epoch, builds a
    ``DataLoader`` with the wrapped loader's settings whose index sampler draws the epoch's order as the
    uninterrupted run did and drops the consumed batches *without loading them*, then puts the global torch RNG
    back, before the first remaining batch is loaded, to the state the pass began with: the restored step's,
    as long as the loop draws no random numbers between the restore and its first pass. The batch order, the
    loader's draws from the global RNG (the workers' base seed, drawn at each epoch's start, and a generator-less
    ``RandomSampler``'s permutation seed) and the global RNG the loop continues with (dropout) are then the
    uninterrupted run's, bit for bit. A restore at an epoch's end continues with the next epoch.

    **A loader with its own generator** (``DataLoader(generator=g)``, or a sampler with ``generator=``): the
    draws come from ``g``, which a fresh process rebuilds at its seed; the wrapper records ``g``'s state at each
    epoch start and, after a restore, replays the interrupted epoch's draws (indices only, nothing loaded), so
    ``g`` continues exactly as in the uninterrupted run, at an epoch's end too. Such a generator must serve only
    this loader. Generators are found as the ``generator`` attribute of the loader, its sampler and its batch
    sampler's sampler.

    **num_workers > 0**: the order, the base seed the workers are seeded from and the training process's RNG are
    exact; the resumed epoch runs in workers of its own (started for it), which get the remaining batches
    round-robin from worker 0. ``persistent_workers=True`` is refused: its base seed is drawn once per iterator,
    which a resumed process creates in another epoch.

    **Randomness drawn while loading** (a random augmentation in ``__getitem__``) is not replayed for the skipped
    batches: in workers (``num_workers > 0``) their RNG streams then differ for the rest of the epoch; with Ray's
    prepared loader, which loads one batch ahead, the first batch after a restore is loaded again from the
    restored RNG. Exact in every case when ``__getitem__`` draws no random numbers (or derives them from the
    index); with a plain loader and ``num_workers=0`` global-RNG draws while loading are exact too.

    **Refused, with a clear error:** an ``IterableDataset``; a ``DataLoader`` subclass other than Ray's prepared
    loader (torchdata's ``StatefulDataLoader`` resumes itself: give it to ``extra_state`` directly); a restore
    whose checkpoint was taken with another loader shape (dataset length, batch size, batches per epoch, sampler
    kind or world size: a resized Ray Train group included), raised by the restore; a restored position of
    another rank (a rank that joined a resized group), raised when the loop starts; ``epochs(..., start_step=s)``
    with ``s > 0`` when no state was restored into the wrapper (it was not given to ``extra_state``).
    """

    _CHECKPOINTED = "its epoch and position are checkpointed"

    def __init__(self, loader: DataLoader):
        if not isinstance(loader, DataLoader):
            raise TypeError(f"ResumableLoader wraps a torch.utils.data.DataLoader, got {type(loader).__name__}")
        self._ray = _is_ray_prepared(loader)
        if type(loader) is not DataLoader and not self._ray:
            raise TypeError(f"ResumableLoader wraps a plain DataLoader or Ray Train's prepared loader, got the "
                            f"subclass {type(loader).__name__} (whose iteration it cannot re-create); a "
                            f"StatefulDataLoader resumes itself: give it to extra_state directly")
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError("ResumableLoader needs a map-style dataset: an IterableDataset has no index sampler "
                            "to skip consumed batches with (checkpoint its position in its own state_dict)")
        if loader.persistent_workers:
            raise ValueError("ResumableLoader refuses persistent_workers=True: the workers' base seed is then "
                             "drawn once per iterator, which a resumed process would create in another epoch "
                             "than the uninterrupted run")
        self.loader = loader
        self._generators = self._find_generators()
        self._shape = self._loader_shape()
        self._epoch = 0
        self._position = 0
        self._started = False
        self._torch_rng: torch.Tensor | None = None
        self._gen_states: list[torch.Tensor] = []
        self._restored = False
        self._resume = False          # the next pass continues the restored epoch mid-way
        self._replay_end = False      # the restored epoch ended: replay its draws of the loader's own generators
        self._planned: int | None = None
        self._other_rank: tuple | None = None   # (saved, own) when the restored state is another rank's

    # -- the loop's side ------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the current (or last) pass."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches the loop has taken in the current (or last) pass."""
        return self._position

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self._check_own_state()
        epoch = self._planned if self._planned is not None else self._next_epoch()
        self._planned = None
        if self._resume:
            if epoch != self._epoch:
                raise RuntimeError(f"the restored step is in epoch {self._epoch}, batch {self._position}, but the "
                                   f"loop asked for epoch {epoch}")
            self._resume = False
            batches = self._resumed_pass()
        else:
            batches = self._new_pass(epoch)
        for batch in batches:
            self._position += 1
            yield batch

    def _check_own_state(self) -> None:
        if self._other_rank is not None:
            saved, own = self._other_rank
            raise ValueError(f"ResumableLoader cannot resume exactly: the restored position is rank {saved}'s and "
                             f"this is rank {own} (a rank that was not part of the saved world: the group was "
                             f"resized)")

    def _next_epoch(self) -> int:
        if self._resume or not self._started:
            return self._epoch
        return self._epoch + 1

    def _new_pass(self, epoch: int) -> Iterable:
        if self._replay_end:
            self._replay_end = False
            self._replay_ended_epoch()
        self._set_sampler_epoch(epoch)
        self._epoch, self._position, self._started = epoch, 0, True
        self._torch_rng = torch.get_rng_state()
        self._gen_states = [g.get_state() for g in self._generators]
        return self.loader

    def _resumed_pass(self) -> Iterable:
        current = torch.get_rng_state()   # the restored step's (attach/restore installed it)
        self._rewind()
        return self._rebuilt(self._position, lambda: torch.set_rng_state(current))

    def _replay_ended_epoch(self) -> None:
        """The restored step ended its epoch: draw that epoch's indices again (nothing loaded) from the epoch's
        starting states, so the loader's own generators stand where the uninterrupted run left them."""
        current = torch.get_rng_state()
        self._rewind()
        for _ in self._rebuilt(len(self.loader), None, workers=False):
            raise AssertionError("an epoch that ended yielded a batch")
        torch.set_rng_state(current)

    def _rewind(self) -> None:
        torch.set_rng_state(self._torch_rng)
        for g, st in zip(self._generators, self._gen_states):
            g.set_state(st)
        self._set_sampler_epoch(self._epoch)

    def _rebuilt(self, skip: int, after_skip: Callable[[], None] | None, *, workers: bool = True) -> Iterable:
        """A DataLoader with the wrapped one's settings over the epoch minus its first ``skip`` batches; iterating
        it draws what the wrapped loader's iteration draws (base seed, then the sampler's order)."""
        src = self.loader
        kw: dict[str, Any] = dict(num_workers=src.num_workers, collate_fn=src.collate_fn, pin_memory=src.pin_memory,
                                  timeout=src.timeout, worker_init_fn=src.worker_init_fn,
                                  multiprocessing_context=src.multiprocessing_context, generator=src.generator,
                                  prefetch_factor=src.prefetch_factor,
                                  pin_memory_device=getattr(src, "pin_memory_device", ""),
                                  in_order=getattr(src, "in_order", True))
        if not workers or src.num_workers == 0:
            kw.update(num_workers=0, prefetch_factor=None, multiprocessing_context=None, timeout=0,
                      worker_init_fn=None, pin_memory=False)
        if src.batch_sampler is not None:
            dl = DataLoader(src.dataset, batch_sampler=_SkipAhead(src.batch_sampler, skip, after_skip), **kw)
        else:
            dl = DataLoader(src.dataset, batch_size=None, sampler=_SkipAhead(src.sampler, skip, after_skip), **kw)
        if self._ray and workers:
            from ray.train.torch import prepare_data_loader   # the same move to the worker's device
            dl = prepare_data_loader(dl, add_dist_sampler=False, move_to_device=True,
                                     auto_transfer=bool(getattr(src, "_auto_transfer", False)))
        return dl

    def _set_sampler_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.loader.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def _find_generators(self) -> list[torch.Generator]:
        found: list[torch.Generator] = []
        inner = getattr(self.loader.batch_sampler, "sampler", None)
        for obj in (self.loader, self.loader.sampler, inner):
            g = getattr(obj, "generator", None)
            if isinstance(g, torch.Generator) and all(g is not f for f in found):
                if g.device.type != "cpu":
                    raise ValueError(f"ResumableLoader records CPU generators; this loader draws from a "
                                     f"{g.device.type} generator")
                found.append(g)
        return found

    def _loader_shape(self) -> dict:
        s = self.loader.sampler
        return {"batches": len(self.loader), "samples": len(self.loader.dataset),
                "batch_size": self.loader.batch_size, "drop_last": bool(self.loader.drop_last),
                "sampler": type(s).__name__, "replicas": getattr(s, "num_replicas", None),
                "rank": getattr(s, "rank", None), "generators": len(self._generators)}

    # -- checkpointed state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Epoch, batches taken in it, the epoch's starting RNG states and the loader's shape (training thread,
        at every captured step)."""
        return {"epoch": self._epoch, "position": self._position, "started": self._started,
                "torch_rng": self._torch_rng, "generators": list(self._gen_states), "shape": dict(self._shape)}

    def load_state_dict(self, state: dict) -> None:
        """Take a restored step's state; the next pass continues from it. Raises ValueError when the checkpoint
        was taken with a loader of another shape; another rank's state is refused when the loop starts (training
        process, before the loop)."""
        saved = state["shape"]
        changed = {k: (saved.get(k), v) for k, v in self._shape.items() if saved.get(k) != v}
        # another rank's state is checked when the loop starts: under Ray Train every rank first loads rank 0's
        # extra state, then its own over it (a rank that was not in the saved world keeps rank 0's)
        other_rank = changed.pop("rank", None)
        if changed:
            what = ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise ValueError(f"ResumableLoader cannot resume exactly: the loader differs from the checkpoint's "
                             f"({what})")
        self._other_rank = other_rank
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._started = bool(state["started"])
        self._torch_rng = state["torch_rng"]
        self._gen_states = list(state["generators"])
        self._restored = True
        self._planned = None
        ended = self._position >= self._shape["batches"]
        self._resume = self._started and not ended
        self._replay_end = self._started and ended and bool(self._generators)


__all__ = ["ResumableLoader"]
