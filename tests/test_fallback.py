"""``fallback=True`` falls back (issue #12, item 4): missing, corrupt and malformed objects alike cost steps, never
the restore, and never lead to a step of a superseded branch; it works with runtime="ray" too."""
from __future__ import annotations

import uuid

import pytest
import ray

import ray_ckpt
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.storage import ObjectNotFound, open_storage
from tests import _training as T


def _run(uri, steps, start=0, model=None, opt=None, sch=None, **kw):
    if model is None:
        model = T.make_model("mlp")
        opt = T.make_optimizer("adamw", model)
        sch = T.make_scheduler(opt)
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=10, batch_steps=4, policy="fixed",
                               start_step=start, **kw, recovery_every=1, keep_fulls=0):
        for s in range(start, steps):
            T.train_step("mlp", model, opt, sch, s)
    return model, opt, sch


def _restore(uri, step=None, **kw):
    m = T.make_model("mlp", seed=3)
    o = T.make_optimizer("adamw", m)
    sc = T.make_scheduler(o)
    got = ray_ckpt.restore(uri, m, o, scheduler=sc, step=step, **kw)
    return got, T.snapshot(m, o, sc)


def _manifest(uri, pred):
    lineage, _ = load_lineage(open_storage(uri))
    return next(m for m in lineage.manifests if pred(m))


def test_a_missing_object_falls_back_to_the_latest_good_step(tmp_path):
    uri = str(tmp_path / "ckpt")
    ref = T.reference_states(30)
    _run(uri, 30)
    diff = _manifest(uri, lambda m: m.kind == "diff" and m.first_step <= 25 <= m.last_step)
    open_storage(uri).delete(diff.object)
    with pytest.raises(ObjectNotFound):
        _restore(uri, step=27)
    got, state = _restore(uri, step=27, fallback=True)
    assert got == diff.first_step - 1                  # the last step before the missing batch
    T.assert_same(ref[got], state, "fallback over a missing object")


def test_a_corrupt_full_in_a_newer_branch_never_returns_the_abandoned_branch(tmp_path):
    """Branch: steps 0..30, then a resume from step 12 that ran to 20. Its fulls (12, 20) are then corrupted:
    the latest good step is 12 of the first run (the state the branch started from), never 30 of the abandoned
    timeline."""
    uri = str(tmp_path / "ckpt")
    ref = T.reference_states(30)
    _run(uri, 30)
    m, o, sc = T.make_model("mlp", seed=4), None, None
    o = T.make_optimizer("adamw", m)
    sc = T.make_scheduler(o)
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=12) == 12
    _run(uri, 20, start=12, model=m, opt=o, sch=sc)
    storage = open_storage(uri)
    lineage, _ = load_lineage(storage)
    fulls = [x for x in lineage.manifests if x.kind == "full" and x.generation == 2]
    assert sorted(x.last_step for x in fulls) == [12, 20]
    for full in fulls:               # both of the branch's fulls: no step of it is restorable any more
        data = bytearray(storage.read(full.object))
        data[len(data) // 2] ^= 0xFF
        storage.write(full.object, bytes(data))
    with pytest.raises(ray_ckpt.CorruptObjectError):
        _restore(uri)
    got, state = _restore(uri, fallback=True)
    assert got == 12
    T.assert_same(ref[12], state, "fallback to the branch point")


@pytest.mark.ray
def test_fallback_works_with_the_ray_runtime(tmp_path, ray_cluster):  # noqa: F811
    """The coordinator's plan reads a corrupt object from storage (a restarted run: no memory tier): with
    fallback the restore goes on to the latest good step; without, it raises."""
    from ray_ckpt.runtime.coordinator import get_or_create_coordinator, shutdown_run
    uri = str(tmp_path / "ckpt")
    run = f"fb-{uuid.uuid4().hex[:8]}"
    ref = T.reference_states(30)
    try:
        _run(uri, 30, runtime="ray", run=run, replica=False)
        shutdown_run(run)   # memory tier gone; a new coordinator plans from the durable lineage alone
        coord = get_or_create_coordinator(run, open_storage(uri),
                                          config=CheckpointConfig.resolve(full_every=10, batch_steps=4))
        assert ray.get(coord.status.remote(), timeout=60)["durable_step"] == 30
        diff = _manifest(uri, lambda m: m.kind == "diff" and m.first_step <= 25 <= m.last_step)
        storage = open_storage(uri)
        data = bytearray(storage.read(diff.object))
        data[-1] ^= 0xFF
        storage.write(diff.object, bytes(data))
        with pytest.raises(ray_ckpt.CorruptObjectError):
            _restore(uri, step=27, runtime="ray", run=run)
        got, state = _restore(uri, step=27, runtime="ray", run=run, fallback=True)
        assert got == diff.first_step - 1
        T.assert_same(ref[got], state, "ray runtime fallback")
    finally:
        shutdown_run(run)
