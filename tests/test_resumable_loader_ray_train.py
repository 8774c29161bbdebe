"""ResumableLoader under Ray Train: the guide's epoch loop (2 CPU workers, prepare_model + prepare_data_loader over
a plain shuffling DataLoader without a generator of its own, Dropout, SGD with momentum) with a worker SIGKILLed
mid-epoch resumes mid-epoch and every rank ends bitwise in the uninterrupted run's state (model, optimizer, RNG)."""
from __future__ import annotations

import uuid

import pytest
import torch

from tests import _training as T
from tests._loader_fn import BATCH, EPOCHS, ROWS, fit, read_finals

# the same loop and kill with a Ray Train reference fit: tests/test_rank_death_ray_train.py covers it in `make test`
# (a gloo reference, both ranks, dense and top-k); this one runs with the long tests
pytestmark = [pytest.mark.ray, pytest.mark.long]

PER_EPOCH = ROWS // 2 // BATCH     # 8


def _fit(tmp, name, config):
    return fit(tmp / f"ckpt-{name}", name, config, storage_path=tmp / "ray_train", full_every=10, batch_steps=2)


def test_worker_killed_mid_epoch_resumes_bitwise(tmp_path, ray_cluster):
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    ref_out.mkdir()
    out.mkdir()
    result = _fit(tmp_path, f"loader-ref-{uuid.uuid4().hex[:6]}", {"out": str(ref_out)})
    assert result.error is None, result.error
    result = _fit(tmp_path, f"loader-kill-{uuid.uuid4().hex[:6]}",
                  {"out": str(out), "kill_at": 13, "kill_rank": 1, "step_sleep": 0.02})   # epoch 1, batch 5
    assert result.error is None, result.error
    assert (out / "killed").exists()
    reference, finals = read_finals(ref_out), read_finals(out)
    assert sorted(reference) == sorted(finals) == [0, 1]
    for rank in (0, 1):
        ref, got = reference[rank], finals[rank]
        assert not ref["restored"] and got["restored"], (ref["restored"], got["restored"])
        assert PER_EPOCH < got["start"] < 2 * PER_EPOCH, got["start"]      # resumed mid-epoch 1
        assert got["step"] == ref["step"] == EPOCHS * PER_EPOCH
        assert got["epoch"] == ref["epoch"] == (EPOCHS - 1, PER_EPOCH)
        T.assert_same(ref["state"], got["state"], f"rank {rank}")
        assert torch.equal(ref["rng"], got["rng"]), f"rank {rank}: RNG"
