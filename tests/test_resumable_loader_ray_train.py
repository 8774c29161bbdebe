"""ResumableLoader under Ray Train: the guide's epoch loop (2 CPU workers, prepare_model + prepare_data_loader over
a plain shuffling DataLoader without a generator of its own, Dropout, SGD with momentum) with a worker SIGKILLed
mid-epoch resumes mid-epoch and every rank ends bitwise in the uninterrupted run's state (model, optimizer, RNG)."""
from __future__ import annotations

import glob
import uuid

import pytest
import torch

import ray_ckpt.train
from tests import _training as T
from tests._loader_fn import BATCH, EPOCHS, ROWS, epoch_loop

# the same loop and kill with a Ray Train reference fit: tests/test_rank_death_ray_train.py covers it in `make test`
# (a gloo reference, both ranks, dense and top-k); this one runs with the long tests
pytestmark = [pytest.mark.ray, pytest.mark.long]

PER_EPOCH = ROWS // 2 // BATCH     # 8


def _fit(tmp, name, config):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        epoch_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(tmp / "ray_train"),
                             failure_config=FailureConfig(max_failures=1),
                             callbacks=[ray_ckpt.train.RayCkptCallback(tmp / f"ckpt-{name}", full_every=10,
                                                                       batch_steps=2)]))
    return trainer.fit()


def _finals(out):
    got = [torch.load(p, weights_only=True) for p in glob.glob(str(out / "final-*.pt"))]
    assert len(got) == 2, [(d["rank"], d["start"]) for d in got]     # one final per rank: the last attempt's
    return {d["rank"]: d for d in got}


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
    reference, finals = _finals(ref_out), _finals(out)
    assert sorted(reference) == sorted(finals) == [0, 1]
    for rank in (0, 1):
        ref, got = reference[rank], finals[rank]
        assert not ref["restored"] and got["restored"], (ref["restored"], got["restored"])
        assert PER_EPOCH < got["start"] < 2 * PER_EPOCH, got["start"]      # resumed mid-epoch 1
        assert got["step"] == ref["step"] == EPOCHS * PER_EPOCH
        assert got["epoch"] == ref["epoch"] == (EPOCHS - 1, PER_EPOCH)
        T.assert_same(ref["state"], got["state"], f"rank {rank}")
        assert torch.equal(ref["rng"], got["rng"]), f"rank {rank}: RNG"
