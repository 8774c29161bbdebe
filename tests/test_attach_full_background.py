"""The attach full after a restore (runtime="ray"): it restates a step the lineage already holds on two nodes or
durably, so the Checkpointer no longer waits for it to be secured (a restart of a Ray Train group starts training
that much sooner), and a crash before it is secured still restores that step, bitwise, from the earlier
generation. A fresh run's attach waits until its node's worker holds the full (which outlives a crash of the
process); any other attach (a start step that is not the restored one) still returns only once its full is held on
two nodes.

The attach full's hand-off to the node's persistence worker is held back by a gate (the sender thread waits in
``RaySink._handoff``), standing for a full not yet handed over or not yet copied to a second node when the
training process dies."""
from __future__ import annotations

import threading
import uuid

import pytest

import ray_ckpt
from ray_ckpt.runtime.coordinator import shutdown_run
from ray_ckpt.runtime.trainer.sink import RaySink
from tests import _training as T

pytestmark = pytest.mark.ray

CFG = {"full_every": 50, "batch_steps": 2, "handoff_delay": 0}


def _objects(seed=0):
    model = T.make_model("mlp", seed=seed)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt)


def _reference(steps):
    model, opt, sch = _objects()
    for s in range(steps):
        T.train_step("mlp", model, opt, sch, s)
    return T.snapshot(model, opt, sch)


@pytest.fixture
def run_env(tmp_path, ray_cluster):
    run = f"bg-{uuid.uuid4().hex[:8]}"
    yield run, str(tmp_path / "ckpt")
    shutdown_run(run)


@pytest.fixture
def gated_fulls(monkeypatch):
    """Full hand-offs wait while the gate is closed (it starts open); ``events`` records, in order, each full
    let through."""
    gate, events = threading.Event(), []
    gate.set()
    original = RaySink._handoff

    def handoff(self, items, full=False):
        if full:
            gate.wait(300)
            events.append("full handed over")
        return original(self, items, full)

    monkeypatch.setattr(RaySink, "_handoff", handoff)
    yield gate, events
    gate.set()


def _attach_in_thread(events, *args, **kwargs):
    box = {}

    def attach():
        box["ck"] = ray_ckpt.Checkpointer(*args, runtime="ray", **CFG, **kwargs)
        events.append("attached")

    t = threading.Thread(target=attach, daemon=True)
    t.start()
    return t, box


def _attach_waiting(gate, events, *args, **kwargs):
    """A Checkpointer attached while the gate holds its full back: it must return only after the full went
    through (then held on two nodes)."""
    events.clear()
    gate.clear()
    t, box = _attach_in_thread(events, *args, **kwargs)
    t.join(1.0)          # (a Checkpointer that did not wait would have returned by now on a quiet machine)
    gate.set()
    t.join(120)
    assert not t.is_alive()
    assert events[:2] == ["full handed over", "attached"], events
    return box["ck"]


def _first_run(gate, events, uri, run, steps):
    """A fresh attach (it waits until its node's worker holds its full), ``steps`` steps, close (every step
    durable)."""
    model, opt, sch = _objects()
    ck = _attach_waiting(gate, events, uri, model, opt, scheduler=sch, run=run)
    for s in range(steps):
        T.train_step("mlp", model, opt, sch, s)
    ck.close()


def test_a_crash_before_the_restated_full_is_secured_restores_the_restored_step_bitwise(run_env, gated_fulls):
    run, uri = run_env
    gate, events = gated_fulls
    _first_run(gate, events, uri, run, 6)
    gate.clear()   # from here on the gate holds the restart's attach full back
    events.clear()
    model, opt, sch = _objects(seed=5)
    assert ray_ckpt.restore(uri, model, opt, scheduler=sch, runtime="ray", run=run) == 6
    t, box = _attach_in_thread(events, uri, model, opt, scheduler=sch, run=run)
    t.join(120)
    try:
        assert not t.is_alive(), "the attach waited for a full that restates a step the lineage holds durably"
        assert events == ["attached"]           # its full is still held back
        for s in range(6, 8):                   # steps 7 and 8, queued behind that full
            T.train_step("mlp", model, opt, sch, s)
        # the training process "dies" here: nothing of the new generation was handed over. A restore gets step 6
        # from the earlier generation, bitwise what was restored (and what the uninterrupted run had at step 6)
        m, o, sc = _objects(seed=9)
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 6
        T.assert_same(_reference(6), T.snapshot(m, o, sc), "step 6 after a crash before the attach full was secured")
    finally:
        gate.set()                              # the full goes through; the new generation continues from it
        t.join(120)
        box["ck"].close()
    assert events == ["attached", "full handed over"]
    m, o, sc = _objects(seed=9)
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 8
    T.assert_same(_reference(8), T.snapshot(m, o, sc), "step 8 of the new generation")


def test_an_attach_at_another_step_than_the_restored_one_waits_for_its_full(run_env, gated_fulls):
    run, uri = run_env
    gate, events = gated_fulls
    _first_run(gate, events, uri, run, 4)
    model, opt, sch = _objects()
    assert ray_ckpt.restore(uri, model, opt, scheduler=sch, runtime="ray", run=run) == 4
    T.train_step("mlp", model, opt, sch, 4)   # step 5: a state the lineage does not hold
    _attach_waiting(gate, events, uri, model, opt, scheduler=sch, run=run, start_step=5).close()


def test_a_fresh_runs_attach_waits_only_until_its_nodes_worker_holds_its_full(run_env, monkeypatch):
    """A run's first state (step 0, a lineage holding nothing) is waited for until this node's persistence worker
    holds it (it outlives a crash of the process; its second copy follows in the background); an attach of a later
    generation at a step no restore installed still waits until its full is held on two nodes."""
    run, uri = run_env
    calls = []

    def spy(name):
        original = getattr(RaySink, name)

        def wait(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
        return wait

    for name in ("wait_safe", "wait_received"):
        monkeypatch.setattr(RaySink, name, spy(name))
    model, opt, sch = _objects()
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, **CFG)
    assert calls == ["wait_received"] and ck.generation == 1
    for s in range(4):
        T.train_step("mlp", model, opt, sch, s)
    ck.close()
    m, o, sc = _objects(seed=9)
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run, step=0) == 0
    T.assert_same(_reference(0), T.snapshot(m, o, sc), "the fresh run's attach full")
    calls.clear()
    assert ray_ckpt.restore(uri, model, opt, scheduler=sch, runtime="ray", run=run) == 4
    T.train_step("mlp", model, opt, sch, 4)   # step 5: a state the lineage does not hold
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run, start_step=5, **CFG)
    assert calls == ["wait_safe"] and ck.generation == 2
    ck.close()
