"""Ray Train conventions (issue #16): the run's own storage by default and refusal of another run's lineage,
a final pointer at close, the user's metrics kept in Result.metrics, ``ray_ckpt.restore(result.checkpoint)``,
and a StatefulDataLoader epoch loop resumed mid-epoch bit for bit after a SIGKILL."""
from __future__ import annotations

import glob
import os
import uuid

import pytest
import torch

import ray_ckpt
import ray_ckpt.train
from tests import _training as T
from tests._train_fn import LOADER_BATCH, LOADER_EPOCHS, LOADER_ROWS, loader_loop, loader_training

pytestmark = pytest.mark.ray

TOTAL = LOADER_EPOCHS * LOADER_ROWS // LOADER_BATCH   # 48 steps, 16 per epoch


def _fit(storage_path, name, config, callback):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        loader_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(storage_path), failure_config=FailureConfig(max_failures=1),
                             callbacks=[callback]))
    return trainer.fit()


def _finals(out):
    return sorted((torch.load(p, weights_only=False) for p in glob.glob(str(out / "final-*.pt"))),
                  key=lambda d: d["start"]["step"])


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, ray_cluster):
    """A run killed mid-epoch (step 21: epoch 1, batch 5), with the callback's default storage location."""
    tmp = tmp_path_factory.mktemp("conv")
    out = tmp / "out"
    out.mkdir()
    name = f"loader-{uuid.uuid4().hex[:6]}"
    result = _fit(tmp / "ray_train", name, {"out": str(out), "kill_at": 21, "step_sleep": 0.02},
                  ray_ckpt.train.RayCkptCallback(full_every=10, batch_steps=4))
    reference = loader_training(lambda *a: None, {})
    return tmp, name, out, result, reference


def test_stateful_dataloader_resumes_mid_epoch_bitwise(killed_run):
    tmp, name, out, result, reference = killed_run
    assert result.error is None, result.error
    assert os.path.exists(out / "killed")
    finals = _finals(out)
    assert len(finals) == 1 and finals[0]["start"]["restored"], [f["start"] for f in finals]
    resumed = finals[0]["start"]["step"]
    assert 12 <= resumed <= 21 and resumed % 16 != 0, resumed       # mid-epoch (epoch 1)
    assert finals[0]["step"] == TOTAL == reference["step"]
    T.assert_same(reference["state"], finals[0]["state"], f"resumed at step {resumed}: final state")


def test_default_location_final_pointer_user_metrics_and_restore_from_result(killed_run):
    tmp, name, out, result, reference = killed_run
    lineage = tmp / "ray_train" / name / "ray_ckpt"
    assert (lineage / "manifests").is_dir() and (lineage / "run.json").exists()
    # the last report is the pointer at close (48 is not a multiple of report_every=10): it names step 48 and
    # carries the user's latest metrics (reported at step 45), not ray_ckpt's alone
    assert result.metrics["ray_ckpt_step"] == TOTAL
    assert result.metrics["my_step"] == 45 and {"loss", "epoch"} <= set(result.metrics), result.metrics
    pointer = ray_ckpt.train.read_pointer(result.checkpoint)
    assert pointer["step"] == TOTAL and pointer["run"] == name
    model = T.make_model("mlp", seed=9)
    opt = T.make_optimizer("adamw", model)
    assert ray_ckpt.restore(result.checkpoint, model, opt) == TOTAL
    T.assert_same({"model": reference["state"]["model"], "opt": reference["state"]["opt"]},
                  {"model": model.state_dict(), "opt": opt.state_dict()}, "restore(result.checkpoint)")


# long: two more fits (~20 s); make test checks the refusal itself in tests/test_runtime_ray.py and
# tests/reliability/test_lease.py
@pytest.mark.long
def test_another_run_is_refused_unless_it_adopts(killed_run):
    tmp, name, out, result, reference = killed_run
    lineage = tmp / "ray_train" / name / "ray_ckpt"
    out2 = tmp / "out2"
    out2.mkdir()
    other = f"other-{uuid.uuid4().hex[:6]}"
    try:
        r = _fit(tmp / "ray_train", other, {"out": str(out2)}, ray_ckpt.train.RayCkptCallback(lineage))
        message = str(r.error)
    except Exception as e:  # noqa: BLE001 - Ray Train raises controller errors from fit()
        message = str(e)
    assert f"holds the checkpoints of run {name!r}" in message, message
    assert not glob.glob(str(out2 / "final-*.pt"))                  # nothing trained
    r = _fit(tmp / "ray_train", other, {"out": str(out2)}, ray_ckpt.train.RayCkptCallback(lineage, adopt=True))
    assert r.error is None, r.error
    finals = _finals(out2)
    assert finals and finals[0]["start"] == {"step": TOTAL, "restored": True}
    T.assert_same(reference["state"], finals[0]["state"], "adopted run")
    # a resumed run that took no step still reports its pointer at close
    assert ray_ckpt.train.read_pointer(r.checkpoint)["step"] == TOTAL


def test_callback_warns_that_its_credentials_do_not_reach_the_workers(caplog):
    """Credentials given to the callback stay with it (no actor hands them out): it says so, naming the option
    names (never the values), so a worker's AccessDenied is not a mystery."""
    import logging
    with caplog.at_level(logging.WARNING, logger="ray_ckpt"):
        ray_ckpt.train.RayCkptCallback("s3://bucket/run", storage_options={
            "endpoint_override": "127.0.0.1:9", "scheme": "http", "access_key": "AKID", "secret_key": "s3cr3t"})
    assert "access_key, secret_key" in caplog.text and "attach()" in caplog.text
    assert "s3cr3t" not in caplog.text and "AKID" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ray_ckpt"):
        ray_ckpt.train.RayCkptCallback("s3://bucket/run", storage_options={"endpoint_override": "127.0.0.1:9"})
    assert "credentials" not in caplog.text
