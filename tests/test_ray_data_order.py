"""ResumableShard over a real ``streaming_split`` (the split Ray Train uses: ``equal=True``), consumed by threads
of the driver as Ray Train's workers consume theirs: an epoch interrupted mid-way and continued from the recorded
position in a *new* split coordinator (as a restarted worker group gets) gives every split the rows of the
uninterrupted run, in order, for a seeded shuffle, a shuffle reseeded at every execution (the wrapper sets the
execution index) and a seeded local shuffle buffer; non-reproducible settings are named in one WARNING at attach
(world rank 0); the skip's cost is printed."""
from __future__ import annotations

import logging
import time

import pytest

from tests._ray_data_fn import make_dataset, split_epochs

EPOCHS, STOP = 3, (1, 13)      # interrupted in epoch 1 after 13 batches


@pytest.fixture
def preserve_order():
    from ray.data import DataContext
    ctx = DataContext.get_current()
    old = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    yield
    ctx.execution_options.preserve_order = old


def _runs(kw: dict, **ds_kw):
    """The uninterrupted ids per split and epoch; the interrupted run's, continued in a new coordinator; the
    continued passes' seconds to their position."""
    from ray_ckpt.train import ResumableShard

    def full(i, it):
        d = ResumableShard(it, **kw)
        return [[b["id"].tolist() for b in d] for _ in d.epochs(EPOCHS)]

    def first(i, it):
        d = ResumableShard(it, **kw)
        ids: list = []
        for e in d.epochs(EPOCHS):
            ids.append([])
            for b in d:
                ids[-1].append(b["id"].tolist())
                if (e, d.position) == STOP:
                    return ids, d.state_dict()

    ref = split_epochs(make_dataset(**ds_kw), 2, full)
    cut = split_epochs(make_dataset(**ds_kw), 2, first)

    def second(i, it):
        d = ResumableShard(it, **kw)
        d.load_state_dict(cut[i][1])
        return [[b["id"].tolist() for b in d] for _ in d.epochs(EPOCHS, start_step=1)], d.skip_seconds

    cont = split_epochs(make_dataset(**ds_kw), 2, second)
    resumed = []
    for i in range(2):
        before, after = cut[i][0], cont[i][0]
        resumed.append(before[:-1] + [before[-1] + after[0]] + after[1:])
    return ref, resumed, [c[1] for c in cont]


@pytest.mark.ray
@pytest.mark.parametrize("case", ["seeded", "reseeded", "local_shuffle"])
def test_resumed_epoch_in_a_new_coordinator_is_the_uninterrupted_one(ray_cluster, preserve_order, case):
    kw = {"batch_size": 32}
    if case == "local_shuffle":
        kw.update(local_shuffle_buffer_size=100, local_shuffle_seed=3)
    ref, resumed, skip_s = _runs(kw, reseed=case == "reseeded")
    for i in range(2):
        assert len(ref[i]) == EPOCHS and all(len(e) == 32 for e in ref[i])
        assert resumed[i] == ref[i], f"split {i}"
    if case == "reseeded":
        assert ref[0][0] != ref[0][1]        # the shuffle differs per epoch: the execution index was set
    print(f"{case}: seconds to the position (batch {STOP[1]} of epoch {STOP[0]}) per split: "
          f"{[round(s, 2) for s in skip_s]}")


@pytest.mark.ray
def test_skip_cost_without_reading_against_reading(ray_cluster, preserve_order, request):
    """Seconds from a pass's start to its first remaining batch: no skip, skipped by metadata (the wrapper), and
    read-and-dropped (``iter_torch_batches`` + ``islice``), position 960 of 1024 rows; the same rows remain either
    way. Alternating 3 times with ``--run-long`` (the figures in docs/ray-train.md), once in make test."""
    import itertools

    from ray_ckpt.integrations.ray_data import _SkipRows

    def timed(mode):
        def consume(i, it):
            t0 = time.perf_counter()
            if mode == "metadata":
                batches = iter(_SkipRows.make(it, 960).iter_torch_batches(batch_size=32))
            else:
                batches = iter(it.iter_torch_batches(batch_size=32))
                if mode == "read":
                    for _ in itertools.islice(batches, 30):
                        pass
            first = next(batches)
            seconds = time.perf_counter() - t0
            rest = [first["id"].tolist()] + [b["id"].tolist() for b in batches]
            return seconds, rest
        return split_epochs(make_dataset(), 2, consume)

    seconds: dict = {"none": [], "metadata": [], "read": []}
    rows: dict = {}
    for _ in range(3 if request.config.getoption("--run-long") else 1):
        for mode in seconds:
            got = timed(mode)
            seconds[mode] += [s for s, _ in got]
            rows[mode] = [r for _, r in got]
    for i in range(2):                         # the same remaining batches either way
        assert rows["metadata"][i] == rows["read"][i] == rows["none"][i][30:]
    med = {m: sorted(v)[len(v) // 2] for m, v in seconds.items()}
    print(f"seconds to the first remaining batch (median of {len(seconds['none'])}): {med}")


@pytest.mark.ray
def test_non_reproducible_order_is_reported_once_at_attach(ray_cluster, caplog, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from ray_ckpt.engine.loopstate import as_stateful
    from ray_ckpt.integrations.train_session import _log_restore
    from ray_ckpt.train import ResumableShard

    def shards(ds, **kw):
        its = ds.streaming_split(2, equal=True)   # built, never iterated: the coordinator holds the plan
        return [ResumableShard(it, batch_size=32, **kw) for it in its]

    from ray.data import DataContext
    ctx = DataContext.get_current()
    old, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, False   # Ray's default
    try:
        s0, s1 = shards(make_dataset(unseeded=True), local_shuffle_buffer_size=64)
    finally:
        ctx.execution_options.preserve_order = old
    warning = s0.order_warning()
    assert "random_shuffle() without a seed" in warning
    assert "preserve_order is False" in warning
    assert "local_shuffle_seed" in warning
    assert s1.order_warning() is None                 # world rank 0 reports, once
    def ours():
        return [r for r in caplog.records if r.name == "ray_ckpt"]

    with caplog.at_level(logging.WARNING, logger="ray_ckpt"):
        _log_restore(1, 0, False, 0.0, {"data": s1})
        assert not ours()
        _log_restore(0, 0, False, 0.0, as_stateful({"data": s0, "other": s1}))   # as attach gives it
    assert [r.levelname for r in ours()] == ["WARNING"], ours()
    assert ours()[0].getMessage() == warning

    pq.write_table(pa.table({"id": list(range(100))}), str(tmp_path / "part.parquet"))
    f0, _ = shards(ray.data.read_parquet(str(tmp_path), shuffle="files"))
    assert "FileShuffleConfig(seed=<int>)" in f0.order_warning()
    from ray.data import FileShuffleConfig
    g0, _ = shards(ray.data.read_parquet(str(tmp_path), shuffle=FileShuffleConfig(seed=3)).random_shuffle(seed=1))
    seeded = g0.order_warning() or ""        # (None: nothing to warn of, e.g. preserve_order on in this process)
    assert "FileShuffleConfig" not in seeded and "random_shuffle" not in seeded
