"""The Ray sink's parts that need no Ray (they run on the sender thread of the training process): the transport to
the node's worker, the control poll and the durable-mode choice. Actor calls are faked: a handle's ``.remote``
returns a future, answered at once or when the test says so."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

from ray_ckpt.lineage import Manifest, diff_name, object_key
from ray_ckpt.runtime.trainer.control_poll import CONTROL_S, RELAY_WAIT_S, ControlPoll
from ray_ckpt.runtime.trainer.durable_choice import BANDWIDTH_S, DurableChoice
from ray_ckpt.runtime.trainer.transport import MAX_INFLIGHT, SMALL_BUFFER, Chunk, Transport, coalesce


class FutureCalls:
    def ready(self, refs):
        return [r for r in refs if r.done()]

    def get(self, ref, timeout=None):
        return ref.result(timeout)

    def up(self):
        return True


def _answered(value):
    f = Future()
    f.set_result(value)
    return f


def _method(fn):
    return SimpleNamespace(remote=fn)


class FakeWorker:
    """Holds what it is handed; answers ``safe`` with what the test marks safe; ``incarnation`` changes on a
    restart (it then holds nothing). ``hold_answers``: submit answers wait until the test sets them."""

    def __init__(self, incarnation="i1"):
        self.incarnation, self.held, self.safe, self.pending = incarnation, [], [], []
        self.hold_answers = False
        self.submit = _method(self._submit)
        self.poll = _method(lambda gen: _answered(self._answer()))
        self.flush = _method(lambda: _answered({}))

    def _answer(self):
        out, self.safe = {"node": "n" * 12, "incarnation": self.incarnation, "safe": self.safe, "error": None}, []
        return out

    def _submit(self, manifest_json, arrays, batch_steps, sealed=True):
        self.held.append(Manifest.from_json(manifest_json).name)
        if self.hold_answers:
            self.pending.append(Future())
            return self.pending[-1]
        return _answered(self._answer())


def _chunk(step, size=8):
    m = Manifest(kind="diff", generation=1, first_step=step, last_step=step,
                 object=object_key(diff_name(1, step, step)), nbytes=4, crc32=0, strategy="lowdiff")
    return Chunk(m, [np.zeros(4, np.uint8)], size, [])


def _transport(worker, released):
    return Transport(worker, generation=1, batch_steps=1, storage_uri="file:///x", release=released.append,
                     worker_of=lambda: worker, calls=FutureCalls())


def test_the_transport_keeps_chunks_until_safe_and_resends_them_to_a_restarted_worker():
    w, released = FakeWorker(), []
    t = _transport(w, released)
    a, b = _chunk(1), _chunk(2)
    t.send(a)
    t.send(b)
    t.drain()
    assert list(t.unsafe) == [a.manifest.name, b.manifest.name] and t.incarnation == "i1"
    w.safe = [a.manifest.name]
    t.poll()
    assert list(t.unsafe) == [b.manifest.name] and released == [8] and t.safe_latency is not None
    w.incarnation, w.held = "i2", []                    # the worker restarted: it holds nothing
    t.poll()
    assert w.held == [b.manifest.name] and t.restarts_seen == 1 and t.resent_chunks == 1
    w.safe = [b.manifest.name]
    t.wait_safe(timeout=5)
    assert not t.unsafe and released == [8, 8]


def test_the_transport_waits_for_the_oldest_answer_beyond_its_in_flight_limit():
    w, released = FakeWorker(), []
    w.hold_answers = True
    t = _transport(w, released)
    for s in range(MAX_INFLIGHT):
        t.send(_chunk(s + 1))
    assert len(t.inflight) == MAX_INFLIGHT
    t.reap()                                             # nothing answered: never waits
    assert len(t.inflight) == MAX_INFLIGHT and t.held_step is None   # handed over, not yet held
    w.pending[0].set_result(w._answer())
    t.reap()
    assert len(t.inflight) == MAX_INFLIGHT - 1 and t.poll_t > 0 and t.held_step == 1


def test_coalesce_joins_small_buffers_and_hands_large_ones_over_as_they_are():
    big = np.ones(SMALL_BUFFER, np.uint8)
    out = coalesce([b"head", b"ab", b"cd", big, b"ef"])
    assert [bytes(o[:4]) for o in out[:2]] == [b"head", b"abcd"] and out[2].base is not None and len(out) == 4
    assert coalesce([b"h", b"x", b"y"], shared={}) and coalesce([b"h", big], shared={id(big): "desc"})[1] == "desc"


def test_the_control_poll_falls_back_from_a_silent_relay_to_the_coordinator():
    relay_calls, direct = [], []
    worker = SimpleNamespace(control=_method(lambda gen, rep: relay_calls.append(Future()) or relay_calls[-1]))
    coord = SimpleNamespace(control=_method(lambda gen, rep: direct.append(
        _answered({"delegate": True, "want_full": True, "gaps": [], "draining": {"n2": 9}})) or direct[-1]))
    drains = []
    cp = ControlPoll("r", 1, coord, worker=lambda: worker, report=lambda: None, on_draining=drains.append,
                     relay=True, calls=FutureCalls())
    cp.poll(now=100.0)
    assert len(relay_calls) == 1 and cp.via is worker          # asked the node's worker
    cp.poll(now=100.0 + CONTROL_S)                              # one ask in flight at most
    assert len(relay_calls) == 1 and not direct
    cp.poll(now=100.0 + RELAY_WAIT_S + 0.1)                     # the relay does not answer: ask directly, now
    assert len(direct) == 1 and cp.via is None
    cp.poll(now=100.0 + RELAY_WAIT_S + 0.2)
    assert cp.state == {"want_full": True, "delegate": True} and drains == [{"n2": 9}]
    assert cp.asks == {"relayed": 0, "direct": 1}


def test_the_durable_choice_holds_diffs_back_when_the_bandwidth_does_not_carry_them():
    stats = []
    worker = SimpleNamespace(stats=_method(lambda: stats.pop(0)))
    d = DurableChoice("auto", "r", calls=FutureCalls())
    assert d.info() == {} and d.choice == "all"
    for i, (written, secs, diffs) in enumerate([(0, 0.0, 0), (10 << 20, 1.0, 100 << 20)]):
        stats.append(_answered({"bytes_written": written, "write_seconds": secs}))
        now = 10.0 + i * 2 * BANDWIDTH_S
        d.measure(now, worker, diffs)        # asks
        d.measure(now + 0.1, worker, diffs)  # reads the answer
    assert d.write_bw == 10 << 20 and d.choice == "fulls" and d.info() == {"durable_diffs": "fulls"}
    assert DurableChoice("fulls").info() == {} and DurableChoice("all").stats()["reason"] == "set by the user"


def test_a_full_in_the_arena_is_named_not_carried_and_its_buffers_are_kept_for_the_next():
    """A full's tensors taken from a pool backed by the sink's shared memory lie in the arena: the hand-off names
    them by descriptor (large ones; small buffers are carried), and the worker's side reads the same bytes from
    the descriptor. Given back, they are kept whatever the pool's byte bound (the arena never frees them)."""
    import torch

    from ray_ckpt.engine.capture import SHARED_MIN_BYTES, HostPool
    from ray_ckpt.runtime import shared
    from ray_ckpt.runtime.trainer.arena import SharedArena
    arena = SharedArena(8 << 20)
    pool = HostPool(max_bytes=0, allocate=arena.allocate)
    big = pool.take(torch.Size([SHARED_MIN_BYTES // 4, 2]), torch.float32)
    small = pool.take(torch.Size([10]), torch.float32)
    big.copy_(torch.arange(big.numel(), dtype=torch.float32).view_as(big))
    small.fill_(3.0)
    heap = np.ones(SMALL_BUFFER, np.uint8)
    raw = [b"head", big.numpy().reshape(-1).view(np.uint8), small.numpy().view(np.uint8), heap]
    out = coalesce(raw, describe=arena.describe)
    assert shared.is_descriptor(out[1]) and not any(shared.is_descriptor(o) for o in out[2:]), out
    assert arena.describe(small.numpy()) is None    # under SHARED_MIN_BYTES: heap memory
    assert arena.describe(heap) is None and arena.describe(b"bytes") is None
    assert bytes(shared.resolve([out[1]])[0]) == bytes(raw[1])
    pool.give([big, small])
    assert pool.take(big.shape, big.dtype) is big      # kept although max_bytes=0: it lives in the arena
    assert pool.take(small.shape, small.dtype) is not small   # a heap buffer beyond the bound: dropped
    arena.close()
