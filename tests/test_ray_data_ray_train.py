"""Ray Data under Ray Train, resumed with ``ResumableShard``: 2 CPU workers, ``datasets={"train": ds}`` (2048 rows,
derived features, ``random_shuffle(seed=7)``, ``preserve_order=True``), a dropout MLP, 2 epochs of 32 batches per
rank. Rank 1 SIGKILLed mid-epoch 1: every row of each epoch is trained exactly once (the ids each rank consumed
in the steps the restore kept, then after it) and the final model, optimizer and RNG are bitwise the
uninterrupted run's (computed once, under Ray Train, and shared). A node lost mid-epoch 1 (2 → 1 workers): the
interrupted epoch restarts at the new size, as the guide says: epoch 0 was trained once by the 2 ranks, epoch 1
once by the remaining one after the resize."""
from __future__ import annotations

import glob
import os
import uuid

import pytest
import torch

from tests import _training as T
from tests._ray_data_fn import BATCH, EPOCHS, ROWS, fit, make_dataset, read_ids

PER_EPOCH = ROWS // 2 // BATCH      # 32
KILL_AT = PER_EPOCH + 13            # epoch 1, batch 13


@pytest.fixture
def preserve_order():
    """The driver's DataContext with ``preserve_order=True`` (Ray Train's split takes it from there)."""
    from ray.data import DataContext
    ctx = DataContext.get_current()
    old = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    yield
    ctx.execution_options.preserve_order = old


def _finals(out) -> dict:
    got = {}
    for p in glob.glob(os.path.join(str(out), "final-*.pt")):
        d = torch.load(p, weights_only=False)
        got[(d["rank"], d["start"])] = d
    return got


def _epochs_once(ids: dict, epochs, rows_per_epoch: int = ROWS) -> None:
    """Each epoch's ids are every row exactly once."""
    for e in epochs:
        assert sorted(ids.get(e, [])) == list(range(rows_per_epoch)), (e, len(ids.get(e, [])))


def _merge(*parts: dict) -> dict:
    out: dict = {}
    for p in parts:
        for e, ids in p.items():
            out.setdefault(e, []).extend(ids)
    return out


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """The uninterrupted run (2 workers under Ray Train): each rank's final record."""
    from ray.data import DataContext
    ctx = DataContext.get_current()
    old, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
    try:
        tmp = tmp_path_factory.mktemp("ray-data-ref")
        out = tmp / "out"
        out.mkdir()
        result = fit(make_dataset(), out, f"rd-ref-{uuid.uuid4().hex[:6]}", tmp / "rt")
    finally:
        ctx.execution_options.preserve_order = old
    assert result.error is None, result.error
    finals = _finals(out)
    assert sorted(finals) == [(0, 0), (1, 0)], sorted(finals)
    _epochs_once(_merge(read_ids(out, 0, 0), read_ids(out, 1, 0)), range(EPOCHS))
    return {r: finals[(r, 0)] for r in (0, 1)}


@pytest.mark.ray
def test_worker_killed_mid_epoch_resumes_ray_data_bitwise(tmp_path, reference, ray_cluster, preserve_order):
    out = tmp_path / "out"
    out.mkdir()
    env = {"RAY_CKPT_RECOVERY_EVERY": "1", "RAY_CKPT_HANDOFF_DELAY": "0"}
    result = fit(make_dataset(), out, f"rd-kill-{uuid.uuid4().hex[:6]}", tmp_path / "rt",
                 config={"kill_at": KILL_AT, "kill_rank": 1, "step_sleep": 0.02, "env": env})
    assert result.error is None, result.error
    assert (out / "killed").exists()
    finals = _finals(out)
    starts = {start for (_, start) in finals}
    assert len(starts) == 1, sorted(finals)
    start = starts.pop()
    assert start in (KILL_AT - 1, KILL_AT), start                     # at most one step lost
    trained = _merge(*(read_ids(out, r, 0, before=start) for r in (0, 1)),
                     *(read_ids(out, r, start) for r in (0, 1)))
    _epochs_once(trained, range(EPOCHS))                               # no row twice, none skipped
    for rank in (0, 1):
        got, ref = finals[(rank, start)], reference[rank]
        assert got["step"] == ref["step"] == EPOCHS * PER_EPOCH
        T.assert_same(ref["state"], got["state"], f"rank {rank}")
        assert torch.equal(ref["rng"], got["rng"]), f"rank {rank}: RNG"
        assert got["skip_s"] is not None and got["skip_s"] > 0
        print(f"rank {rank} resumed at step {start}: reached its position (batch {start - PER_EPOCH} of epoch 1) "
              f"in {got['skip_s']:.2f} s")
    assert finals[(0, start)]["warning"] is None                       # a reproducible setting: no warning
