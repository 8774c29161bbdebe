"""Exact mid-epoch resumption of a Ray Data shard (``ray.train.get_dataset_shard``) under ray_ckpt.

:class:`ResumableShard` iterates a ``ray.data.DataIterator`` (the shard Ray Train hands each worker, or a
dataset's ``iterator()``) with ``iter_torch_batches`` and is given to ``extra_state`` (of
:func:`ray_ckpt.train.attach`, a :class:`~ray_ckpt.Checkpointer` or :func:`ray_ckpt.restore`). Its state — the
epoch, the batches and rows the loop took in it, whether the epoch ended, the world size — rides on each rank's
loop state, recorded with every captured step; after a restore the next pass continues the interrupted epoch at
the next batch.

What makes a shard's order reproducible in Ray 2.60 (read in ``ray/data`` and ``ray/train``, and tested:
``tests/test_ray_data_order.py``):

* Ray Train splits each dataset with ``streaming_split(world_size, equal=True, locality_hints=<worker nodes>)``
  (``ray.train.DataConfig.configure``). The split (``OutputSplitter``) gives each bundle, in the order bundles
  reach it, to the split with the fewest rows so far — unless a split's node holds a buffered bundle (locality),
  which depends on where blocks landed. ``preserve_order=True`` makes bundles reach it in the dataset's order and
  turns the locality preference off (``OutputSplitter.start``): the split is then a function of the row order and
  the block sizes. Without it, map tasks that finish in another order (a ``map_batches`` after the last shuffle)
  hand each rank other rows from one run to the next (measured).
* ``random_shuffle(seed=int)``, ``randomize_block_order(seed=int)``: the same order at every execution (epoch).
  With ``RandomSeedConfig(seed, reseed_after_execution=True)`` or a file shuffle ``FileShuffleConfig(seed=...)``
  (which reseeds by default) the seed combines with the dataset context's execution index, which Ray Data counts
  up after each execution: a restarted worker group builds a new split coordinator whose count starts again, so
  after a restore the wrapper sets it to ``<the count at the coordinator's start> + epoch`` before the
  coordinator's first execution (world rank 0, one actor call, only for such plans); Ray counts on from there as
  in the uninterrupted run. Unseeded shuffles (``seed=None``, ``shuffle="files"``)
  differ at every execution: nothing can resume them exactly.
* ``local_shuffle_buffer_size``: exact with ``local_shuffle_seed`` (the buffer reseeds at every pass).
* The number of workers: the split depends on it. A group restarted at another size cannot tell which of the
  interrupted epoch's rows the old ranks consumed (see *Elastic*).

Runs in the training process (a Ray Train worker or a plain loop); it asks the split's coordinator actor for the
dataset's plan once (world rank 0) and, for plans that reseed per execution, sets its execution index once after
a restore.
"""
from __future__ import annotations

import builtins
import itertools
import logging
import time
import types
from typing import Any, Iterable, Iterator

from ray_ckpt.integrations.epochs import EpochLoop

log = logging.getLogger("ray_ckpt")

#: ``iter_torch_batches`` keywords that shape the batches: a restore into another value is refused
SHAPE_KWARGS = ("batch_size", "drop_last", "local_shuffle_buffer_size", "local_shuffle_seed")


def _inspect_dataset(ds) -> dict:
    """What decides whether ``ds``'s order repeats: its context's ``preserve_order`` and execution index, and the
    problems of its plan (unseeded shuffles), plus whether a seed reseeds per execution. Runs where the dataset
    lives (the split coordinator actor, through ``__ray_call__``, or the training process); imports inside, so
    that the function travels by value."""
    ctx = ds._context
    problems, reseeds = [], False
    stack, seen = [ds._logical_plan.dag], set()
    while stack:
        op = stack.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        stack.extend(getattr(op, "input_dependencies", None) or [])
        name = type(op).__name__
        seed_config = getattr(op, "seed_config", None)
        if name in ("RandomShuffle", "RandomizeBlocks") and seed_config is not None:
            api = "random_shuffle" if name == "RandomShuffle" else "randomize_block_order"
            if seed_config.seed is None:
                problems.append(f"{api}() without a seed (give it seed=<int>)")
            elif seed_config.reseed_after_execution:
                reseeds = True
        shuffles = [getattr(getattr(op, "datasource", None), "_shuffle", None)]
        factory = getattr(op, "shuffle_config_factory", None)   # ListFiles: shuffle="files" draws a seed per call
        if callable(factory):
            first, again = factory(), factory()
            unseeded = first is not None and getattr(first, "seed", None) != getattr(again, "seed", None)
            shuffles.append("files" if unseeded else first)
        for shuffle in shuffles:
            if shuffle is None:
                continue
            seed = getattr(shuffle, "seed", None)
            if shuffle == "files" or (not isinstance(shuffle, str) and seed is None):
                problems.append("a file shuffle without a seed (read with shuffle=FileShuffleConfig(seed=<int>))")
            elif getattr(shuffle, "reseed_after_execution", False):
                reseeds = True
    return {"preserve_order": bool(ctx.execution_options.preserve_order), "execution_idx": int(ctx._execution_idx),
            "problems": problems, "reseeds": reseeds}


def _set_execution_idx(ds, value: int) -> None:
    """The execution index the next execution of ``ds`` seeds reseeding shuffles with (where ``ds`` lives)."""
    ds._context._execution_idx = int(value)


def _on_base_dataset(coordinator, fn, *args):
    """``fn`` on a split coordinator's dataset (in that actor)."""
    return fn(coordinator._base_dataset, *args)


def _by_value(fn):
    """A copy of ``fn`` (builtins only) that pickles by value: the actor it runs in (the split coordinator, started
    by Ray Train) need not import ray_ckpt — when it cannot, Ray 2.60 leaves the call hanging rather than failing."""
    return types.FunctionType(fn.__code__, {"__builtins__": builtins}, fn.__name__)


class _SkipRows:
    """Builds a ``DataIterator`` over ``inner``'s next pass minus its first ``rows`` rows: whole bundles are dropped
    by their metadata (their blocks are never fetched here), the one that straddles the position is sliced by a
    remote task (Ray Data's own block split), so batches form from the remaining rows exactly as they did in the
    uninterrupted pass. Training process."""

    @staticmethod
    def make(inner, rows: int):
        from ray.data.iterator import DataIterator
        from ray.data._internal.execution.operators.output_splitter import _split

        class SkipRows(DataIterator):
            def _to_ref_bundle_iterator(self):
                bundles, stats, executor = inner._to_ref_bundle_iterator()
                return self._skipping(bundles), stats, executor

            @staticmethod
            def _skipping(bundles):
                left = rows
                for bundle in bundles:
                    if left > 0:
                        n = bundle.num_rows()
                        if n <= left:
                            left -= n
                            continue
                        bundle = _split(bundle, left)[1]
                        left = 0
                    yield bundle

            def _on_iteration_end(self, executor) -> None:
                inner._on_iteration_end(executor)

            def stats(self) -> str:
                return inner.stats()

            def schema(self):
                return inner.schema()

            def get_context(self):
                return inner.get_context()

            def _get_dataset_tag(self):
                return inner._get_dataset_tag()

        return SkipRows()


class ResumableShard(EpochLoop):
    """A Ray Data shard iterated with ``iter_torch_batches`` that resumes an interrupted epoch exactly. Build it
    from what ``ray.train.get_dataset_shard`` returns, give it to ``extra_state`` and loop::

        data = ResumableShard(ray.train.get_dataset_shard("train"), batch_size=32)
        session = ray_ckpt.train.attach(model, optimizer, extra_state=data)
        for epoch in data.epochs(num_epochs, start_step=session.start_step):
            for batch in data:        # a dict of tensors; after a restore: the rest of the interrupted epoch
                ...

    Training process (a Ray Train worker, or a plain loop over ``ds.iterator()``); not thread-safe.

    ``iter_kwargs`` are ``iter_torch_batches``'s (``batch_size``, ``dtypes``, ``device``, ``collate_fn``,
    ``drop_last``, ``local_shuffle_buffer_size``, ``local_shuffle_seed``, ``prefetch_batches``); each pass
    (``iter(data)``) is one epoch, that is one execution of the dataset. The wrapper looks one batch ahead (so
    that the step taking an epoch's last batch records that the epoch ended) and otherwise passes the batches
    through unchanged.

    **State** (``state_dict``, with every captured step, ~200 bytes): epoch, batches and rows taken in it, whether
    it ended, world size and rank, the batch-shaping keywords. **After a restore** at the same world size the next
    pass re-executes the interrupted epoch and continues after the consumed rows: without a local shuffle buffer
    it skips them *without reading them* (whole blocks dropped by their metadata, one block sliced remotely); with
    one it reads and drops the consumed batches (the buffer's draws depend on them). Exact — the resumed epoch
    bitwise the uninterrupted one — when the order is reproducible (module docstring: ``preserve_order=True``,
    seeded shuffles, a seeded local shuffle); otherwise it resumes at the right count of rows and
    :meth:`order_warning` (logged at attach by world rank 0) names the setting that would make it exact.

    **Elastic**: a group restarted at another size gets another split, and which rows of the interrupted epoch the
    old ranks consumed cannot be told from the new one. An epoch that ended continues with the next epoch at the
    new size (exact: no row lost or repeated); an epoch interrupted mid-way restarts from its first batch at the
    new size, with a WARNING naming the rows consumed in it before the resize (they are trained again in it).

    **Refused**: a restore into other batch-shaping keywords (ValueError), ``epochs(..., start_step=s)`` with
    ``s > 0`` when the wrapper was not restored (it was not given to ``extra_state``).
    """

    def __init__(self, shard: Any, **iter_kwargs):
        if not callable(getattr(shard, "iter_torch_batches", None)):
            raise TypeError(f"ResumableShard wraps a ray.data.DataIterator (ray.train.get_dataset_shard(...)), got "
                            f"{type(shard).__name__}")
        self.shard = shard
        self.kwargs = {"batch_size": 256, **iter_kwargs}
        self._shape = {k: self.kwargs.get(k) for k in SHAPE_KWARGS}
        self._split_idx = getattr(shard, "_output_split_idx", None)
        self._world = int(shard.world_size()) if callable(getattr(shard, "world_size", None)) else 1
        self._rank = 0 if self._split_idx is None else int(self._split_idx)
        self._plan: dict | None = None
        if self._rank == 0:   # one look at the plan: the warning at attach, reseeding plans' execution index
            self._plan = self._call(_inspect_dataset)
        self._epoch, self._position, self._rows, self._ended, self._started = 0, 0, 0, False, False
        self._restored = self._resume = False
        self._passes = 0   # passes started by this wrapper (this process)
        self._planned: int | None = None
        self._resized: tuple | None = None
        self._other_rank: tuple | None = None
        self.skip_seconds: float | None = None   #: seconds the last resumed pass took to reach its position
        #: set when a group restarted at another size restarted the interrupted epoch: its number, the rows this
        #: rank had consumed in it, (old, new) world size
        self.restarted_epoch: dict | None = None

    # -- the dataset, where it lives --------------------------------------------------------------------------
    def _call(self, fn, *args):
        """``fn(dataset, *args)`` on the shard's dataset: in the split coordinator actor, or here."""
        coord = getattr(self.shard, "_coord_actor", None)
        if coord is not None:
            import ray
            return ray.get(coord.__ray_call__.remote(_by_value(_on_base_dataset), _by_value(fn), *args))
        ds = getattr(self.shard, "_base_dataset", None)
        if ds is None:
            raise TypeError(f"ResumableShard cannot find the dataset behind {type(self.shard).__name__}")
        return fn(ds, *args)

    def order_warning(self) -> str | None:
        """Why this shard's order may not repeat after a restart, with the setting that would fix it, or None
        (world rank 0 knows; the other ranks return None). :func:`ray_ckpt.train.attach` logs it once, as a
        WARNING, on world rank 0."""
        if self._plan is None:
            return None
        fixes = list(self._plan["problems"])
        if not self._plan["preserve_order"] and self._world > 1:
            fixes.append("ray.data.DataContext.get_current().execution_options.preserve_order is False (set it to "
                         "True on the driver before building the TorchTrainer: the split then follows the dataset's "
                         "order rather than task completion order and block locality)")
        if self.kwargs.get("local_shuffle_buffer_size") and self.kwargs.get("local_shuffle_seed") is None:
            fixes.append("local_shuffle_buffer_size without local_shuffle_seed (give local_shuffle_seed=<int>)")
        if not fixes:
            return None
        return ("ray_ckpt: the Ray Data order of this run does not repeat across executions, so a resumed epoch "
                "continues at the right count of rows but not with the rows the uninterrupted run would have "
                "trained: " + "; ".join(fixes))

    # -- the loop's side ------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Batches taken in the current (or last) pass, counting those before a restore."""
        return self._position

    @property
    def rows(self) -> int:
        """Rows taken in the current (or last) pass, counting those before a restore."""
        return self._rows

    def _next_epoch(self) -> int:
        if not self._started or (self._resume and not self._ended):
            return self._epoch
        return self._epoch + 1

    def __iter__(self) -> Iterator:
        self._check_own_state()
        epoch = self._planned if self._planned is not None else self._next_epoch()
        self._planned = None
        skip = 0
        if self._resume and not self._ended and epoch == self._epoch:
            skip = self._rows
            if self._resized is not None:
                old, new = self._resized
                log.warning("ray_ckpt: the group restarted at %d workers (was %d) in the middle of epoch %d: Ray Data "
                            "splits the epoch anew, so the rows the old ranks consumed in it cannot be told apart; "
                            "epoch %d restarts at its first batch (rank %d had consumed %d rows of it: they are "
                            "trained again)", new, old, epoch, epoch, self._rank, self._rows)
                self.restarted_epoch = {"epoch": epoch, "rows": self._rows, "world": (old, new)}
                skip = 0
        self._resume, self._resized = False, None
        self._epoch, self._started, self._ended = epoch, True, False
        self._position, self._rows = (self._position, self._rows) if skip else (0, 0)
        if self._restored and not self._passes and epoch and self._plan is not None and self._plan["reseeds"]:
            # this group's split coordinator counts executions from its start; the uninterrupted run's was at
            # `epoch` more when this epoch began (one execution per epoch). Set once, before this coordinator's
            # first execution: later, Ray's own count-up after each execution may land after any set of ours
            self._call(_set_execution_idx, self._plan["execution_idx"] + epoch)
        self._passes += 1
        t0 = time.perf_counter()
        batches = iter(self._batches(skip))
        nxt = next(batches, _END)
        if skip:
            self.skip_seconds = time.perf_counter() - t0
            log.info("ray_ckpt: rank %d resumed epoch %d after %d rows in %.2f s (%s)", self._rank, epoch, skip,
                     self.skip_seconds, "read and dropped: local shuffle buffer"
                     if self.kwargs.get("local_shuffle_buffer_size") else "skipped without reading them")
        while nxt is not _END:
            batch, nxt = nxt, next(batches, _END)
            self._position += 1
            self._rows += _num_rows(batch, self.kwargs["batch_size"])
            self._ended = nxt is _END
            yield batch
        self._ended = True

    def _batches(self, skip_rows: int) -> Iterable:
        if not skip_rows:
            return self.shard.iter_torch_batches(**self.kwargs)
        if self.kwargs.get("local_shuffle_buffer_size"):   # the buffer's draws depend on the rows: replay them
            bs = self.kwargs["batch_size"]
            it = iter(self.shard.iter_torch_batches(**self.kwargs))
            for _ in itertools.islice(it, -(-skip_rows // bs)):
                pass
            return it
        return _SkipRows.make(self.shard, skip_rows).iter_torch_batches(**self.kwargs)

    def _check_own_state(self) -> None:
        if self._other_rank is not None:
            saved, own = self._other_rank
            raise ValueError(f"ResumableShard cannot resume: the restored position is rank {saved}'s and this is rank "
                             f"{own}")

    # -- checkpointed state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position (training thread, at every captured step)."""
        return {"epoch": self._epoch, "position": self._position, "rows": self._rows, "ended": self._ended,
                "started": self._started, "world": self._world, "rank": self._rank, "shape": dict(self._shape)}

    def load_state_dict(self, state: dict) -> None:
        """Take a restored step's position; the next pass continues from it (training process, before the loop).
        Raises ValueError when the batch-shaping keywords differ from the checkpoint's."""
        saved = state["shape"]
        changed = {k: (saved.get(k), v) for k, v in self._shape.items() if saved.get(k) != v}
        if changed:
            what = ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise ValueError(f"ResumableShard cannot resume exactly: its batches differ from the checkpoint's ({what})")
        self._epoch, self._position, self._rows = int(state["epoch"]), int(state["position"]), int(state["rows"])
        self._ended, self._started = bool(state["ended"]), bool(state["started"])
        world = int(state["world"])
        # under Ray Train every rank first loads rank 0's state, then its own over it; a rank that joined keeps rank 0's
        self._resized = (world, self._world) if world != self._world else None
        same_world_other_rank = world == self._world and int(state["rank"]) != self._rank
        self._other_rank = (int(state["rank"]), self._rank) if same_world_other_rank else None
        self._restored, self._planned = True, None
        self._resume = self._started


_END = object()


def _num_rows(batch: Any, default: int) -> int:
    """Rows of a batch: the length of its first column (a dict of tensors), or of the batch itself."""
    first = next(iter(batch.values()), None) if isinstance(batch, dict) else batch
    try:
        return len(first)
    except TypeError:
        return default


__all__ = ["ResumableShard"]
