"""The continuation test (issue #13): kill a rank through Ray Train, recover, train to the end; every rank's whole
state (model, optimizer, scheduler, GradScaler, RNG, error-feedback residuals, data position) equals the
uninterrupted run's bitwise. Loop: tests/_train_fn.py::continuation_loop."""
from __future__ import annotations

import glob
import uuid

import pytest
import torch

import ray_ckpt.train
from tests import _training as T
from tests._train_fn import continuation_loop

pytestmark = pytest.mark.ray

ITERS = 26
SKIPS = [6, 13, 14]          # GradScaler-skipped iterations (two in a row at 13, 14)


def _fit(tmp, config):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out = tmp / "out"
    out.mkdir()
    trainer = TorchTrainer(
        continuation_loop, train_loop_config={"iters": ITERS, "skips": SKIPS, "out": str(out), **config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"cont-{uuid.uuid4().hex[:6]}", storage_path=str(tmp / "ray_train"),
                             failure_config=FailureConfig(max_failures=2),
                             callbacks=[ray_ckpt.train.RayCkptCallback(tmp / "ckpt", full_every=10,
                                                                       batch_steps=4)]))
    result = trainer.fit()
    assert result.error is None, result.error
    finals = {r: torch.load(out / f"final-{r}.pt", weights_only=True) for r in range(2)}
    starts = [torch.load(p, weights_only=True) for p in glob.glob(str(out / "start-*.pt"))]
    pointer = ray_ckpt.train.read_pointer(result.checkpoint)      # Result.checkpoint names the last step
    assert pointer["storage_uri"].endswith("ckpt") and pointer["step"] == ITERS - len(SKIPS)   # reported at close
    return finals, starts


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_cluster):  # noqa: F811
    finals, _ = _fit(tmp_path_factory.mktemp("cont-ref"), {})
    assert not torch.equal(finals[0]["rng"], finals[1]["rng"])   # per-rank streams really differ
    return finals


# 11: the step right after the full at 10; 18: inside a diff batch, after the two skipped iterations. Both under
# `long` (make reliability): make test kills a rank under Ray Train in tests/test_rank_death_ray_train.py (each
# rank, dense and top-k, every rank's state bitwise), tests/test_ray_train_conventions.py (the callback, the
# result's pointer) and resumes GradScaler-skipped iterations and error-feedback residuals bitwise in
# tests/test_exact_resume.py and tests/test_agreed_restore.py
@pytest.mark.long
@pytest.mark.parametrize("kill_at", [11, 18])
@pytest.mark.parametrize("recovery_every", [1, 4])       # every step recorded; a full every 4 steps
def test_killed_rank_recovers_and_every_rank_ends_bitwise_equal(tmp_path, uninterrupted, kill_at, recovery_every):
    finals, starts = _fit(tmp_path, {"kill_at": kill_at, "kill_rank": 1, "step_sleep": 0.05,
                                     "env": {"RAY_CKPT_RECOVERY_EVERY": str(recovery_every)}})
    restored = [s for s in starts if s["restored"]]
    assert sorted(s["rank"] for s in restored) == [0, 1], starts        # Ray Train restarted the group once
    assert len({(s["step"], s["pos"]) for s in restored}) == 1, restored  # one step and position for all ranks
    for r in range(2):
        ref, got = uninterrupted[r], finals[r]
        assert got["pos"] == ITERS
        T.assert_same(ref["state"], got["state"], f"rank {r} model/optimizer/scheduler (kill at {kill_at})")
        assert ref["scaler"] == got["scaler"], (r, ref["scaler"], got["scaler"])
        assert torch.equal(ref["rng"], got["rng"]), f"rank {r}: RNG differs"
        assert ref["residuals"].keys() == got["residuals"].keys()
        for k in ref["residuals"]:
            assert torch.equal(ref["residuals"][k], got["residuals"][k]), f"rank {r}: residual of {k} differs"
