"""Ray Train with the defaults: ``attach`` reports where its start-up seconds went on every rank, and the run keeps
only the chains of its two newest fulls (``keep_fulls=2``), the latest step still restoring bitwise."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

import ray_ckpt.train
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.storage import open_storage
from tests import _training as T

pytestmark = pytest.mark.ray

STEPS, FULL_EVERY = 20, 5


def train_loop(config: dict) -> None:
    """Every rank saves ``attach``'s start-up phases; rank 0 also its final state. Ray Train worker."""
    import ray.train
    import ray.train.torch
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = T.make_model("mlp")
    net = ray.train.torch.prepare_model(model)
    opt = T.make_optimizer("adamw", model)
    session = ray_ckpt.train.attach(net, opt, report_every=0)
    for s in range(session.start_step, STEPS):
        T.train_step("mlp", net, opt, None, s, rank)
    session.close()
    torch.save({"startup": session.startup, "state": T.snapshot(model, opt) if rank == 0 else None},
               os.path.join(config["out"], f"rank{rank}.pt"))


@pytest.mark.long   # make test: the phases after a restart in tests/test_rank_death_ray_train.py, keep_fulls=2 in
                    # tests/test_retention.py
def test_attach_reports_its_phases_and_the_default_keeps_two_fulls(tmp_path, ray_cluster, monkeypatch):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    monkeypatch.delenv("RAY_CKPT_KEEP_FULLS", raising=False)
    out, uri = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    trainer = TorchTrainer(
        train_loop, train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"startup-{uuid.uuid4().hex[:6]}", storage_path=str(tmp_path / "ray_train"),
                             callbacks=[ray_ckpt.train.RayCkptCallback(uri, full_every=FULL_EVERY, batch_steps=2)]))
    result = trainer.fit()
    assert result.error is None
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r, got in enumerate(ranks):
        phases = got["startup"]
        assert {"storage", "policy", "restore", "checkpointer", "rank_loop", "total"} <= set(phases), phases
        assert all(v >= 0 for v in phases.values()) and phases["total"] >= phases["checkpointer"], phases
    rank0 = ranks[0]["startup"]   # rank 0's Checkpointer: its actors, then the attach full
    assert {"prestart", "checkpointer.replica", "checkpointer.node_worker", "checkpointer.first_full"} <= set(rank0)
    lineage, _ = load_lineage(open_storage(str(uri)), use_index=False)
    fulls = sorted(m.last_step for m in lineage.manifests if m.kind == "full")
    assert len(fulls) == 2 and fulls[-1] == STEPS, fulls            # 5 fulls taken, the 2 newest kept
    assert min(m.first_step for m in lineage.manifests) >= fulls[0]
    model = T.make_model("mlp", seed=3)
    opt = T.make_optimizer("adamw", model)
    assert ray_ckpt.restore(result.checkpoint, model, opt) == STEPS
    T.assert_same(ranks[0]["state"], T.snapshot(model, opt), "latest step under the default retention")
