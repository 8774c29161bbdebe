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


# long: ~65 s with its reference run (make test's 20-minute bound); make test keeps the resume logic
# (tests/test_resumable_shard.py, tests/test_ray_data_order.py) and the guide's example under Ray Train
@pytest.mark.ray
@pytest.mark.long
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


@pytest.mark.ray
@pytest.mark.long     # ~3 min here under load: Ray Train's start-up timeout after the node loss dominates
def test_node_lost_mid_epoch_restarts_the_epoch_at_the_new_size(tmp_path, ray_cluster, preserve_order):
    """2 workers on two elastic nodes, ``num_workers=(1, 2)``; one node removed in epoch 1: the group restarts with
    1 worker at the last step every rank recorded; epoch 1 restarts at its first batch at the new size (the guide's
    promise: Ray Data splits it anew, so the rows the old ranks consumed in it cannot be told apart): epoch 0 was
    trained exactly once by the two ranks, epoch 1 exactly once by the remaining rank after the resize."""
    from tests.test_ray_train_e2e import add_elastic_nodes, remove_node_at
    nodes = add_elastic_nodes(ray_cluster, "rdelastic")
    out = tmp_path / "out"
    out.mkdir()
    t, removed = remove_node_at(ray_cluster, nodes[1], out, KILL_AT)
    try:
        result = fit(make_dataset(), out, f"rd-elastic-{uuid.uuid4().hex[:6]}", tmp_path / "rt", workers=(1, 2),
                     resource="rdelastic", max_failures=3,
                     config={"step_sleep": 0.1, "env": {"RAY_CKPT_RECOVERY_EVERY": "1", "RAY_CKPT_HANDOFF_DELAY": "0"}})
    finally:
        t.join(timeout=5)
        ray_cluster.remove_node(nodes[0])
    assert result.error is None, result.error
    assert removed.get("at", 0) >= KILL_AT, removed
    finals = _finals(out)
    assert len(finals) == 1, sorted(finals)                     # one rank finished: the world-1 group's
    (rank, start), got = next(iter(finals.items()))
    assert rank == 0 and got["world"] == 1
    assert PER_EPOCH < start < 2 * PER_EPOCH, start             # restored mid-epoch 1
    assert got["restarted_epoch"] == {"epoch": 1, "rows": (start - PER_EPOCH) * BATCH, "world": (2, 1)}
    assert got["step"] == start + ROWS // BATCH                 # the whole epoch 1 at the new size
    before = _merge(*(read_ids(out, r, 0, before=start) for r in (0, 1)))
    _epochs_once(before, [0])
    after = read_ids(out, 0, start)
    assert sorted(after) == [1]
    _epochs_once(after, [1])
    print(f"node removed at step {removed['at']}; resumed at step {start} with 1 worker: epoch 1 restarted "
          f"({got['restarted_epoch']['rows']} rows of it trained again by rank 0, as many by rank 1)")
