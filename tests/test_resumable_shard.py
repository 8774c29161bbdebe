"""ResumableShard's bookkeeping without Ray (a stand-in shard of rank 1, which never asks the coordinator): the
position it records, an epoch that ended continuing with the next one, a resized group restarting the interrupted
epoch, and the refusals. Real Ray Data: tests/test_ray_data_order.py, tests/test_ray_data_ray_train.py."""
from __future__ import annotations

import pytest
import torch

from ray_ckpt.train import ResumableShard


class FakeShard:
    """What ResumableShard uses of a split iterator: ``iter_torch_batches``, ``world_size()``, the split index."""

    def __init__(self, rows: int = 10, world: int = 2, split: int = 1):
        self.rows, self.world, self._output_split_idx = rows, world, split

    def world_size(self) -> int:
        return self.world

    def iter_torch_batches(self, *, batch_size, **kw):
        ids = torch.arange(self.rows)
        return [{"id": ids[i:i + batch_size]} for i in range(0, self.rows, batch_size)]


def _ids(data, num_epochs=2, start_step=None, stop=None):
    out = []
    for e in data.epochs(num_epochs, start_step=start_step):
        for b in data:
            out.append((e, b["id"].tolist()))
            if stop == (e, data.position):
                return out
    return out


def test_records_the_position_and_an_ended_epoch():
    data = ResumableShard(FakeShard(), batch_size=4)
    got = _ids(data, stop=(0, 3))
    assert got[-1] == (0, [8, 9])
    st = data.state_dict()   # the step that took the epoch's last batch knows that the epoch ended (look-ahead)
    assert (st["epoch"], st["position"], st["rows"], st["ended"], st["world"]) == (0, 3, 10, True, 2)
    again = ResumableShard(FakeShard(), batch_size=4)
    again.load_state_dict(st)
    assert _ids(again, start_step=3) == [(1, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (1, [8, 9])]   # the next epoch


def test_a_resized_group_restarts_the_interrupted_epoch(caplog):
    data = ResumableShard(FakeShard(), batch_size=4)
    _ids(data, stop=(1, 1))
    st = data.state_dict()
    assert (st["epoch"], st["position"], st["rows"], st["ended"]) == (1, 1, 4, False)
    resized = ResumableShard(FakeShard(rows=20, world=1), batch_size=4)   # (split index 1: no coordinator to ask)
    resized.load_state_dict(st)
    with caplog.at_level("WARNING", logger="ray_ckpt"):
        got = _ids(resized, start_step=5)
    assert [e for e, _ in got] == [1] * 5 and got[0][1] == [0, 1, 2, 3]      # epoch 1 from its first batch
    assert resized.restarted_epoch == {"epoch": 1, "rows": 4, "world": (2, 1)}
    assert any("restarts at its first batch" in r.getMessage() for r in caplog.records)


def test_refusals():
    data = ResumableShard(FakeShard(), batch_size=4)
    st = data.state_dict()
    with pytest.raises(ValueError, match="batch_size: 4 then, 8 now"):
        ResumableShard(FakeShard(), batch_size=8).load_state_dict(st)
    with pytest.raises(RuntimeError, match="was not restored"):
        next(ResumableShard(FakeShard(), batch_size=4).epochs(2, start_step=3))
    with pytest.raises(TypeError, match="DataIterator"):
        ResumableShard([1, 2, 3])
    other = dict(st, rank=0)   # another rank's position at the same world size (rank 0's, loaded first)
    mine = ResumableShard(FakeShard(), batch_size=4)
    mine.load_state_dict(other)
    with pytest.raises(ValueError, match="rank 0's"):
        next(mine.epochs(2))
    mine.load_state_dict(st)   # then its own, as agreed_restore does: fine
    assert next(mine.epochs(2)) == 0
