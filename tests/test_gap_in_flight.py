"""Say lost only when lost: a fault-free run under object-store pressure declares no gap.

Dense 23 MB gradients (an MLP 784-2048-2048-10, SGD with momentum), every step recorded (``overhead_budget=0``),
the session cluster's 300 MB object stores. A node's worker receives chunks in concurrent calls; a ``ray.put``
into a full object store waits while Ray spills, and a later chunk was held and reported meanwhile: the
coordinator saw a hole at the earlier chunk's steps and, after its grace period, logged them as lost ("held
nowhere, never written") and asked for a full, although every one of them restored bitwise afterwards. Here one
chunk's put waits as such a put did, until a later chunk is held and twice the grace period more, so that the hole
happens in every run, while the other node's worker keeps reporting (each report makes the coordinator check for
gaps).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

import pytest
import ray
import torch

import ray_ckpt
from ray_ckpt.runtime import naming
from ray_ckpt.runtime import worker as worker_mod
from ray_ckpt.runtime.coordinator import shutdown_run

pytestmark = pytest.mark.ray

STEPS = 42
FULL_EVERY = 15
#: the first diff chunk that starts at or after this step waits in its put: past a full, so that none covers it
SLOW_FROM = FULL_EVERY + 1
PUT_WAIT_S = 4.0  # how long the put waits on once a later chunk is held: twice the coordinator's grace period


def _slow_put_worker(slow_from: int, wait_s: float):
    """A PersistenceWorker class whose ``ray.put`` of one chunk (the first diff starting at or after ``slow_from``)
    waits, as a put into a full object store does, until a chunk of later steps is held and ``wait_s`` more; it
    records which chunks of later steps were held meanwhile. Defined in a function: Ray ships it by value to the
    worker's actor process."""

    class SlowPutWorker(worker_mod.PersistenceWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._slow = threading.local()
            self._slowed = None   # the manifest of the chunk whose put waits
            self._held_meanwhile: list[str] = []
            self._waiting = False
            real_put = ray.put

            def put(value, *a, **kw):   # this actor process only; slows the chosen submit's thread only
                if getattr(self._slow, "on", False):
                    self._waiting = True
                    deadline = time.monotonic() + 60
                    while not self._held_meanwhile and time.monotonic() < deadline:
                        time.sleep(0.05)
                    time.sleep(wait_s)
                    self._waiting = False
                return real_put(value, *a, **kw)

            ray.put = put

        def submit(self, manifest_json, buffers, *args, **kwargs):
            m = worker_mod.Manifest.from_json(manifest_json)
            self._slow.on = m.kind == "diff" and m.first_step >= slow_from and self._slowed is None
            if self._slow.on:
                self._slowed = m
            try:
                return super().submit(manifest_json, buffers, *args, **kwargs)
            finally:
                self._slow.on = False

        def _hold(self, m, *args, **kwargs):
            super()._hold(m, *args, **kwargs)   # its held report is queued by now, or right after this returns
            if self._waiting and m.first_step > self._slowed.last_step:
                self._held_meanwhile.append(m.name)

        def slowed(self) -> dict:
            return {"slowed": [self._slowed.name] if self._slowed else [],
                    "held_meanwhile": list(self._held_meanwhile)}

    return SlowPutWorker


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _step(model, opt, s):
    g = torch.Generator().manual_seed(s)
    x, y = torch.randn(8, 784, generator=g), torch.randint(0, 10, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _state(model, opt):
    """Parameters and momentum buffers, copied."""
    return ([p.detach().clone() for p in model.parameters()],
            [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()])


@contextlib.contextmanager
def _other_node_reporting(run: str, every_s: float = 0.25):
    """The other node's worker reporting to the run's coordinator with nothing new, every ``every_s`` (as the
    workers of a wider job do all the time): the coordinator checks for gaps on every report, so it looks at the
    hole while the put waits, not only at the reports of this node's worker, which pause with the sender."""
    coord = ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE)
    me = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != me)
    stop = threading.Event()

    def report():
        while not stop.wait(every_s):
            ray.get(coord.update.remote(other, []))

    t = threading.Thread(target=report, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@pytest.fixture
def run_env(tmp_path, ray_cluster):  # noqa: F811
    run = f"t-{uuid.uuid4().hex[:8]}"
    yield run, str(tmp_path / "ckpt")
    shutdown_run(run)


def test_a_hand_off_waiting_for_the_object_store_is_not_a_lost_step(run_env, monkeypatch, caplog):
    run, uri = run_env
    monkeypatch.setattr(worker_mod, "_remote_cls", ray.remote(_slow_put_worker(SLOW_FROM, PUT_WAIT_S)))
    caplog.set_level(logging.WARNING, logger="ray_ckpt")
    model, opt = _model()
    ck = ray_ckpt.Checkpointer(uri, model, opt, runtime="ray", run=run, overhead_budget=0, keep_fulls=0,
                               full_every=FULL_EVERY, durable_diffs="all")
    saved = {}
    with _other_node_reporting(run):
        for s in range(STEPS):
            _step(model, opt, s)
            if (s + 1) % 3 == 0:
                saved[s + 1] = _state(model, opt)
    ck.close()
    node = ray.get_runtime_context().get_node_id()
    worker = ray.get_actor(naming.worker_name(run, node), namespace=naming.NAMESPACE)
    seen = ray.get(worker.slowed.remote())
    assert seen["slowed"] and seen["held_meanwhile"], seen   # a later chunk was held while that put waited
    status = ray.get(ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE).status.remote())
    lost = [r.getMessage() for r in caplog.records if "lost steps" in r.getMessage()]
    assert not lost and not status["gaps"], (lost, status["gaps"], seen)
    slowed = seen["slowed"][0]
    for s in sorted(saved):   # every third step, the slowed chunk's included, from storage alone
        m, o = _model()
        assert ray_ckpt.restore(uri, m, o, step=s) == s
        params, momenta = _state(m, o)
        assert all(torch.equal(a, b) for a, b in zip(params, saved[s][0])), f"parameters of step {s}"
        assert all(torch.equal(a, b) for a, b in zip(momenta, saved[s][1])), f"momentum of step {s} ({slowed})"
