"""One configuration in Ray Train: ``attach(..., config=CheckpointConfig(...))`` and ``RayCkptCallback(...,
config=...)`` resolve as a Checkpointer does; the callback's explicit fields reach every worker through the run's
coordinator, a worker's own config wins over them, and the coordinator shows the config in force."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

import ray_ckpt
import ray_ckpt.train
from tests import _training as T

pytestmark = pytest.mark.ray

STEPS = 6


def train_loop(config: dict) -> None:
    """Attach with the test's worker config (if any); save what this rank and the coordinator hold. Ray Train
    worker."""
    import ray
    import ray.train
    import ray.train.torch
    from ray_ckpt.runtime import lineages
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = T.make_model("mlp")
    net = ray.train.torch.prepare_model(model)
    opt = T.make_optimizer("adamw", model)
    mine = config["worker_config"].get(str(rank))
    session = ray_ckpt.train.attach(net, opt, report_every=0,
                                    config=ray_ckpt.CheckpointConfig(**mine) if mine is not None else None)
    for s in range(session.start_step, STEPS):
        T.train_step("mlp", net, opt, None, s, rank)
    got = {"session": session.config.as_dict()}
    if session.checkpointer is not None:
        got["checkpointer"] = session.checkpointer.config.as_dict()
        got["coordinator"] = ray.get(lineages.coordinator(session.run).status.remote(), timeout=60)["config"]
    if session.loop_recorder is not None:
        got["recorder_delay"] = session.loop_recorder.sink.max_batch_delay
    session.close()
    torch.save(got, os.path.join(config["out"], f"rank{rank}.pt"))


def _fit(tmp_path, callback, worker_config: dict) -> list[dict]:
    """``worker_config``: ``{"<rank>": fields of that rank's own CheckpointConfig}`` (a rank not named attaches
    without one)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out = tmp_path / "out"
    out.mkdir()
    trainer = TorchTrainer(
        train_loop, train_loop_config={"out": str(out), "worker_config": worker_config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"cfg-{uuid.uuid4().hex[:6]}", storage_path=str(tmp_path / "ray_train"),
                             callbacks=[callback]))
    result = trainer.fit()
    assert result.error is None, result.error
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_a_workers_config_drives_its_rank_and_the_callbacks_reaches_the_others(tmp_path, ray_cluster, monkeypatch):
    """The callback's config (``config=`` and keyword overrides) reaches every worker; rank 0's own config wins
    over it for rank 0 and the run (the coordinator shows it); rank 1, attached without one, gets the callback's."""
    monkeypatch.delenv("RAY_CKPT_KEEP_FULLS", raising=False)
    cb = ray_ckpt.train.RayCkptCallback(tmp_path / "ckpt", config=ray_ckpt.CheckpointConfig(keep_fulls=5),
                                        handoff_delay=0.3)
    ranks = _fit(tmp_path, cb, worker_config={"0": {"overhead_budget": 0.02, "keep_fulls": 3}})
    rank0, rank1 = ranks
    for where in ("checkpointer", "coordinator", "session"):
        assert (rank0[where]["overhead_budget"], rank0[where]["keep_fulls"]) == (0.02, 3), (where, rank0[where])
    assert rank0["checkpointer"]["handoff_delay"] == 0.3 == rank1["session"]["handoff_delay"]
    assert rank1["recorder_delay"] == 0.3 and rank1["session"]["keep_fulls"] == 5
