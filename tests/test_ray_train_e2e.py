"""End to end with Ray Train's TorchTrainer: failures, elastic resize, driver restart — bit-exact resumes."""
from __future__ import annotations

import glob
import os
import threading
import time
import uuid

import pytest
import ray
import torch

import ray_ckpt.train
from tests import _training as T
from tests._train_fn import train_loop
from tests.ray_cluster import ray_cluster  # noqa: F401

pytestmark = pytest.mark.ray

STEPS = 30


def _fit(tmp, name, config, num_workers=2, max_failures=2, storage=None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        train_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(tmp / "ray_train"),
                             failure_config=FailureConfig(max_failures=max_failures),
                             callbacks=[ray_ckpt.train.RayCkptCallback(storage or tmp / "ckpt", full_every=10,
                                                                       batch_steps=4)]))
    return trainer.fit()


def _load(path):
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):  # noqa: F811
    """An uninterrupted 2-worker run with a snapshot after every step."""
    out = tmp_path_factory.mktemp("ref")
    _fit(out, f"ref-{uuid.uuid4().hex[:6]}", {"kind": "mlp", "steps": STEPS, "out": str(out), "snap_all": True})
    return {s: _load(out / f"ref-{s}.pt") for s in range(1, STEPS + 1)}


def test_sigkilled_worker_resumes_bit_exact(tmp_path, reference):
    out = tmp_path / "out"
    out.mkdir()
    result = _fit(tmp_path, f"kill-{uuid.uuid4().hex[:6]}",
                  {"kind": "mlp", "steps": STEPS, "out": str(out), "kill_at": 17})
    assert result.error is None
    starts = sorted((_load(p) for p in glob.glob(str(out / "start-*.pt"))), key=lambda d: d["step"])
    assert [d["restored"] for d in starts] == [False, True]
    resumed = starts[1]["step"]
    assert 16 <= resumed <= 17  # the kill came before step 18's optimizer.step: at most one step lost
    T.assert_same(reference[resumed], starts[1]["state"], f"restored step {resumed}")
    final = _load(glob.glob(str(out / "final-*.pt"))[0])
    T.assert_same(reference[STEPS], final["state"], "final state after the failure")
    pointer = ray_ckpt.train.read_pointer(result.checkpoint)
    assert pointer["step"] == STEPS and pointer["storage_uri"].endswith("ckpt")
