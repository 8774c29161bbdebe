"""FSDP2 under Ray Train with RayCkptCallback (issue #15): a SIGKILLed worker, the group restarted, training
continues bit for bit; then the run resumed by a new driver at fewer workers (2 -> 1), resharded, bitwise; and
(long) Ray Train's elastic path after a node loss, resharded 2 -> 1."""
from __future__ import annotations

import glob
import uuid

import pytest
import ray
import torch

import ray_ckpt.train
from ray_ckpt.engine import shard_layout
from ray_ckpt.runtime import lineages, naming
from tests import _fsdp_worker as W, _training as T
from tests._train_fn import fsdp_loop

pytestmark = pytest.mark.ray


def _fit(tmp, name, config, num_workers, max_failures):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        fsdp_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(tmp / "ray_train"),
                             failure_config=FailureConfig(max_failures=max_failures),
                             callbacks=[ray_ckpt.train.RayCkptCallback(tmp / "ckpt", full_every=W.FULL_EVERY,
                                                                       batch_steps=W.BATCH)]))
    return trainer.fit()


def _records(out, kind):
    return sorted((torch.load(p, weights_only=False) for p in glob.glob(str(out / f"{kind}-*.pt"))),
                  key=lambda d: d["step"])


# long (~45 s, two Ray Train restarts): make test restores sharded state at other world sizes without Ray Train
# (tests/test_sharded.py, tests/test_hsdp.py) and runs sharded jobs on Ray (tests/test_sharded_ray.py,
# tests/test_sharded_ray_job.py)
@pytest.mark.long
def test_fsdp2_killed_worker_and_resume_at_fewer_workers(tmp_path, ray_cluster):  # noqa: F811
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    T.spawn(W.reference, args=(2, T.free_port(), str(ref_dir), W.STEPS), nprocs=2)
    reference = torch.load(ref_dir / "global.pt", weights_only=False)

    name = f"fsdp-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "out"
    out.mkdir()
    result = _fit(tmp_path, name, {"steps": W.STEPS, "out": str(out), "kill_at": 12}, num_workers=2,
                  max_failures=1)
    assert result.error is None, result.error
    assert (out / "killed").exists()
    starts = _records(out, "start")
    resumed = [d for d in starts if d["restored"]]
    assert len(resumed) == 1 and resumed[0]["world"] == 2, [(d["step"], d["restored"]) for d in starts]
    step = resumed[0]["step"]
    assert W.FULL_EVERY <= step <= 12, step
    T.assert_same(reference[step], resumed[0]["state"], f"restored step {step}")
    finals = _records(out, "final")
    assert [d["step"] for d in finals] == [W.STEPS]
    # runtime="ray": every shard lineage was checkpointed through a shard run of the job's one coordinator (and
    # its node hosts), whose actors the callback stopped when the run finished
    assert finals[0]["shard_runs"] == [shard_layout.shard_run(name, 2, r) for r in range(2)], finals[0]["shard_runs"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert naming.shard_runs(name, names) == [] and lineages.host_names(name, names) == []
    T.assert_same(reference[W.STEPS], finals[0]["state"], "final state after the restart")

    # a new driver, one worker, sharded_runtime="local" (a writer thread per rank, no shard runs): the latest
    # step restored from the 2-rank shards in storage, then training goes on
    out2 = tmp_path / "out2"
    out2.mkdir()
    result = _fit(tmp_path, name, {"steps": W.STEPS + 3, "out": str(out2), "sharded_runtime": "local"},
                  num_workers=1, max_failures=0)
    assert result.error is None, result.error
    (start,) = _records(out2, "start")
    assert start["restored"] and start["world"] == 1 and start["step"] == W.STEPS
    T.assert_same(reference[W.STEPS], start["state"], "resharded 2 -> 1")
    (final,) = _records(out2, "final")
    assert final["step"] == W.STEPS + 3 and final["world"] == 1 and final["shard_runs"] == []


@pytest.mark.long   # ~2 min: nodes added and removed; make reliability runs it
def test_fsdp2_node_removed_elastic_run_reshards_and_continues(tmp_path, ray_cluster):  # noqa: F811
    """Ray Train's elastic path (num_workers=(1, 2)): a node of a 2-worker FSDP2 run is removed, the group
    restarts with one worker, attach reshards the 2-rank shards to 1 and training goes on to the end."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tests.test_ray_train_e2e import _progress, add_elastic_nodes, remove_node_at
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    steps = 40
    T.spawn(W.reference, args=(2, T.free_port(), str(ref_dir), steps), nprocs=2)
    reference = torch.load(ref_dir / "global.pt", weights_only=False)
    nodes = add_elastic_nodes(ray_cluster, "elastic_fsdp")
    out = tmp_path / "out"
    out.mkdir()
    t, removed = remove_node_at(ray_cluster, nodes[1], out, 12)
    trainer = TorchTrainer(
        fsdp_loop, train_loop_config={"steps": steps, "out": str(out), "step_sleep": 0.1},
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1, "elastic_fsdp": 1}),
        run_config=RunConfig(name=f"fsdp-elastic-{uuid.uuid4().hex[:6]}", storage_path=str(tmp_path / "rt"),
                             failure_config=FailureConfig(max_failures=3),
                             callbacks=[ray_ckpt.train.RayCkptCallback(tmp_path / "ckpt", full_every=W.FULL_EVERY,
                                                                       batch_steps=W.BATCH)]))
    result = trainer.fit()
    t.join(timeout=5)
    ray_cluster.remove_node(nodes[0])
    assert result.error is None, result.error
    assert "at" in removed, ("the run never reached step 12 with 2 workers", _progress(out))
    resumed = [d for d in _records(out, "start") if d["restored"]]
    assert resumed and all(d["world"] == 1 for d in resumed), [(d["step"], d["world"]) for d in resumed]
    step = resumed[0]["step"]
    assert removed["at"] - 2 * W.BATCH <= step <= removed["at"], (step, removed)
    T.assert_same(reference[step], resumed[0]["state"], f"resharded 2 -> 1 at step {step}")
    (final,) = _records(out, "final")
    assert final["step"] == steps and final["world"] == 1
