"""A restore of a step that is not recoverable says why: removed by retention (naming ``keep_fulls`` and the oldest
step kept), or never recorded because the overhead budget recorded a full every k steps (naming the recovery
points around it) — with runtime="local", through the Ray coordinator's plan, and in the CLI. Each test sets the
knobs it needs: every step recorded (``recovery_every=1``) or a full every k steps (``recovery_every=k``, what the
overhead budget chooses when recording every step costs too much)."""
from __future__ import annotations

import re
import time
import uuid

import pytest
import ray

import ray_ckpt
from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.lineage import Lineage, Manifest, NoCheckpointError, full_name, object_key
from ray_ckpt.lineage import retention
from ray_ckpt.storage import open_storage
from tests import _training as T

STEPS, FULL_EVERY, K = 30, 10, 5


def _train(ck, model, opt, sch, steps=STEPS):
    for s in range(steps):
        T.train_step("mlp", model, opt, sch, s)


def _job():
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt)


def _restore(uri, step, **kw):
    m = T.make_model("mlp", seed=3)
    o = T.make_optimizer("adamw", m)
    return ray_ckpt.restore(uri, m, o, scheduler=T.make_scheduler(o), step=step, **kw)


RETENTION = re.compile(r"step 17 is not recoverable: steps before 20 were removed by retention \(keep_fulls=2 keeps "
                       r"the chains of the 2 newest fulls; keep_fulls=0 or RAY_CKPT_KEEP_FULLS=0 keeps every step\); "
                       r"the oldest step kept is 20 \(latest recoverable step: 30\)")
UNRECORDED = re.compile(r"step 17 was not recorded: a full every 5 steps was recorded from step 0 on "
                        r".*the nearest recovery points are step 15 before it and step 20 after it "
                        r"\(latest recoverable step: 30\)")


def test_a_step_removed_by_retention_says_so(tmp_path, capsys):
    uri = str(tmp_path / "ck")
    model, opt, sch = _job()
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=FULL_EVERY, keep_fulls=2,
                               recovery_every=1) as ck:
        _train(ck, model, opt, sch)
    rec = retention.read(open_storage(uri))
    assert (rec.keep_fulls, rec.kept_from, rec.removed_from, rec.by) == (2, 20, 0, retention.BY_SETTING)
    with pytest.raises(NoCheckpointError, match=RETENTION):
        _restore(uri, 17)
    with pytest.raises(NoCheckpointError, match=r"step 40 is not recoverable on the current timeline"):
        _restore(uri, 40)                               # never there: the plain message
    assert _restore(uri, 20) == 20                      # the oldest step kept
    assert cli_main(["inspect", uri, "--step", "17"]) == 1
    assert RETENTION.search(capsys.readouterr().err)
    assert cli_main(["restore", uri, str(tmp_path / "out"), "--step", "17", "-q"]) == 1
    assert RETENTION.search(capsys.readouterr().err)


def test_ray_ckpt_gc_names_itself_as_the_retention(tmp_path, capsys):
    uri = str(tmp_path / "ck")
    model, opt, sch = _job()
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=FULL_EVERY, keep_fulls=0,
                               recovery_every=1) as ck:
        _train(ck, model, opt, sch)
    assert retention.read(open_storage(uri)) is None    # keep_fulls=0: nothing removed, nothing recorded
    assert _restore(uri, 5) == 5
    assert cli_main(["gc", uri, "--keep-fulls", "1", "-q"]) == 0
    capsys.readouterr()
    with pytest.raises(NoCheckpointError, match=r"step 5 is not recoverable: steps before 30 were removed by "
                                                r"retention \(`ray-ckpt gc --keep-fulls 1` kept the chains of the 1 "
                                                r"newest fulls\); the oldest step kept is 30"):
        _restore(uri, 5)


def test_a_step_the_overhead_budget_left_unrecorded_says_so(tmp_path, capsys):
    uri = str(tmp_path / "ck")
    model, opt, sch = _job()
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=1000, keep_fulls=0,
                               recovery_every=K) as ck:
        _train(ck, model, opt, sch)
    fulls = sorted((m.last_step, m.info.get("unrecorded_from")) for m in load_lineage(open_storage(uri))[0].manifests
                   if m.kind == "full")
    assert fulls == [(0, None)] + [(s, s - K + 1) for s in range(K, STEPS + 1, K)], fulls
    with pytest.raises(NoCheckpointError, match=UNRECORDED):
        _restore(uri, 17)
    assert _restore(uri, 15) == 15 and _restore(uri, 20) == 20      # the points it names restore
    assert cli_main(["inspect", uri, "--step", "17"]) == 1
    assert UNRECORDED.search(capsys.readouterr().err)


def test_unrecorded_and_removed_are_told_from_the_manifests_not_the_numbers():
    """Pure: a full every 5 steps from step 12 on (after recorded steps), one generation; the retention record
    only explains steps it says were removed."""
    def full(step, unrecorded_from=None, k=5):
        info = {} if unrecorded_from is None else {"unrecorded_from": unrecorded_from, "recovery_every": k}
        return Manifest(kind="full", generation=1, first_step=step, last_step=step, object=object_key(
            full_name(1, step)), nbytes=1, crc32=0, info=info)

    from ray_ckpt.lineage import diff_name
    diff = Manifest(kind="diff", generation=1, first_step=11, last_step=12, object=object_key(diff_name(1, 11, 12)),
                    nbytes=1, crc32=0)
    lin = Lineage([full(10), diff, full(17, 13), full(22, 18)])
    assert re.search(r"step 19 was not recorded: a full every 5 steps was recorded from step 12 on "
                     r".*step 17 before it and step 22 after it", lin.why_not(19))
    assert "not recoverable on the current timeline" in lin.why_not(40)
    assert "not recoverable on the current timeline" in lin.why_not(5)       # no record: nothing known removed
    rec = retention.Retention(keep_fulls=2, kept_from=10, removed_from=0)
    lin = Lineage([full(10), diff, full(17, 13), full(22, 18)], retention=lambda: rec)
    assert "removed by retention" in lin.why_not(5) and "the oldest step kept is 10" in lin.why_not(5)
    assert "removed by retention" not in lin.why_not(40)
    assert retention.decode(rec.to_json()) == rec and retention.decode(b"{") is None


# -- runtime="ray": the coordinator's plan says the same -------------------------------------------------------------
@pytest.mark.ray
def test_through_the_coordinators_plan(tmp_path, ray_cluster):  # noqa: F811
    from ray_ckpt.runtime import lineages
    from ray_ckpt.runtime.coordinator import shutdown_run
    runs = [f"err-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        uri = str(tmp_path / "kept")
        model, opt, sch = _job()
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=runs[0],
                                   full_every=FULL_EVERY, keep_fulls=2, replica=False, recovery_every=1)
        _train(ck, model, opt, sch)
        ck.flush()
        # the coordinator collects when it hears that the full of step 30 is durable: after flush() returned, soon
        deadline = time.monotonic() + 60
        while getattr(retention.read(open_storage(uri)), "kept_from", None) != 20:
            assert time.monotonic() < deadline, "the coordinator did not collect"
            time.sleep(0.1)
        plan = ray.get(lineages.coordinator(runs[0]).plan.remote(17))
        assert RETENTION.search(plan.get("error", "")), plan
        with pytest.raises(NoCheckpointError, match=RETENTION):
            _restore(uri, 17, runtime="ray", run=runs[0])
        ck.close()

        uri = str(tmp_path / "every-k")
        model, opt, sch = _job()
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=runs[1], full_every=1000,
                                   keep_fulls=0, replica=False, recovery_every=K)
        _train(ck, model, opt, sch)
        ck.flush()
        plan = ray.get(lineages.coordinator(runs[1]).plan.remote(17))
        assert UNRECORDED.search(plan.get("error", "")), plan
        with pytest.raises(NoCheckpointError, match=UNRECORDED):
            _restore(uri, 17, runtime="ray", run=runs[1])
        ck.close()
    finally:
        for run in runs:
            shutdown_run(run)
