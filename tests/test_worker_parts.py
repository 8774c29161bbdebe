"""The persistence worker's parts that need no Ray: its write queue, control relay, held store, peer ring and
report channel (call answers faked by futures)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.runtime.control_relay import ControlRelay
from ray_ckpt.runtime.held_store import Held, HeldStore
from ray_ckpt.runtime.peer_ring import PeerRing
from ray_ckpt.runtime.report_channel import ReportChannel
from ray_ckpt.runtime.write_queue import LAZY_GRACE_S, WriteQueue, merged_manifest


def _diff(first, last, **info):
    name = diff_name(1, first, last)
    return Manifest(kind="diff", generation=1, first_step=first, last_step=last, object=object_key(name), nbytes=4,
                    crc32=0, strategy="lowdiff", info=info)


def _held(ms, age=0.0, peer=None):
    now = time.monotonic()
    return {m.name: SimpleNamespace(received=now - age, peer=peer) for m in ms}


def test_fulls_first_then_a_run_of_consecutive_diffs_once_it_holds_batch_steps():
    q = WriteQueue(durable_delay=3600.0)
    a, b, c = _diff(1, 2), _diff(3, 4), _diff(6, 6)
    full = Manifest(kind="full", generation=1, first_step=0, last_step=0, object=object_key(full_name(1, 0)),
                    nbytes=4, crc32=0, strategy="lowdiff")
    for m in (a, b, c):
        q.add(m, batch_steps=4)
    q.add(full, batch_steps=4)
    held = _held([a, b, c])
    assert q.next_job(held, urgent=False, peer_node="p") == ("full", full)
    assert q.next_job(held, urgent=False, peer_node="p") == ("diffs", [a, b])   # 4 steps, consecutive
    assert q.next_job(held, urgent=False, peer_node="p") is None                # 6 alone: waits for more
    assert q.next_job(held, urgent=True, peer_node="p") == ("diffs", [c]) and not q.any()


def test_a_lazy_diff_is_written_only_when_its_second_copy_is_missing():
    q = WriteQueue()
    m = _diff(1, 1, durable_diffs="fulls")
    q.add(m, batch_steps=1)
    assert q.next_job(_held([m], age=LAZY_GRACE_S + 1, peer="p"), urgent=False, peer_node="p") is None
    assert q.next_job(_held([m], age=LAZY_GRACE_S + 1, peer="gone"), urgent=False, peer_node="p") == ("diffs", [m])
    q.add(m, batch_steps=1)
    q.cover(1, 1)                                   # a durable full covers it: never written
    assert not q.any()


def test_a_failed_job_goes_back_at_the_head():
    q = WriteQueue(durable_delay=0.0)
    a, b = _diff(1, 1), _diff(2, 2)
    q.add(a, 1)
    q.add(b, 1)
    job = q.next_job(_held([a, b]), urgent=False, peer_node="")
    q.requeue(*job)
    assert q.next_job(_held([a, b]), urgent=False, peer_node="") == job


def test_merged_manifest_spans_the_chunks():
    m = merged_manifest([_diff(1, 2), _diff(3, 4)], [b"aaaa", b"bbbb"])
    assert (m.first_step, m.last_step, m.nbytes) == (1, 4, 8) and m.name == diff_name(1, 1, 4)


def test_the_control_relay_delivers_a_wanted_full_once_and_forwards_trainer_reports():
    r = ControlRelay()
    assert r.ask(1, {"w": 1}) is None                               # no answer yet: the sender asks directly
    assert r.requests() == {1: [{"w": 1}]}
    r.answered(1, None, [{"w": 1}])                                 # the ask failed: its reports go next time
    assert r.requests() == {1: [{"w": 1}]}
    r.answered(1, {"delegate": True, "want_full": True, "gaps": [(3, 4)]}, [])
    got = r.ask(1, None)
    assert got["delegate"] and got["want_full"] and got["gaps"] == [(3, 4)]
    assert not r.ask(1, None)["want_full"]                           # delivered once


class FutureCalls:
    """Call answers as futures: a call answered is a future with its result set."""

    def ready(self, refs):
        return [r for r in refs if r.done()]

    def get(self, ref, timeout=None):
        return ref.result(timeout)


def _answered(value):
    f = Future()
    f.set_result(value)
    return f


def _full(step, gen=1):
    return Manifest(kind="full", generation=gen, first_step=step, last_step=step, object=object_key(full_name(gen, step)),
                    nbytes=4, crc32=0, strategy="lowdiff")


def test_the_held_store_releases_durable_chunks_oldest_first_but_keeps_the_newest_full():
    store = HeldStore(budget=10)
    f0, d1, f2 = _full(0), _diff(1, 1), _full(2)
    for m in (f0, d1, f2):
        store.put(Held(m, object(), 4, durable=True, replica=False))
    store.put(Held(_diff(3, 3), object(), 4, durable=False, replica=False))   # 16 bytes held, 10 allowed
    assert store.release_for_budget() == [f0.name, d1.name]                  # the newest full (f2) stays
    assert store.nbytes == 8 and not store.over_budget
    store.budget = 4
    assert store.release_for_budget() == [] and store.over_budget             # nothing releasable: the caller waits


def test_the_held_store_tells_the_sender_what_became_safe_once():
    store = HeldStore(budget=1 << 20)
    a, b, lazy = _diff(1, 1), _diff(2, 2), _diff(3, 3, durable_diffs="fulls")
    for m in (a, b, lazy):
        store.put(Held(m, object(), 4, durable=False, replica=False))
    store.put(Held(_diff(9, 9), object(), 4, durable=False, replica=True, origin="other"))
    store.mark_safe([a.name], peer="p")
    assert store.get(a.name).peer == "p"
    assert store.mark_durable([a.name, b.name]) == {"p": [a.name]}            # a's replica on p is releasable
    store.mark_safe([b.name])
    assert store.cover(1, 5) == [lazy.name]                                   # a covered lazy diff is safe too
    assert store.take_safe(1) == [a.name, b.name, lazy.name] and store.take_safe(1) == []
    assert store.replicas_of("other") == [_diff(9, 9).name]
    c = _diff(4, 4)
    store.put(Held(c, object(), 4, durable=False, replica=False))
    assert store.release([c.name]) == [c]                                     # released unwritten: safe, not written
    assert store.take_safe(1) == [c.name] and store.get(c.name) is None


class _Peer:
    def __init__(self, node):
        self.node, self.sent = node, []
        self.hold_replica = SimpleNamespace(remote=self._hold)

    def _hold(self, manifest_json, refs, origin):
        self.sent.append(Manifest.from_json(manifest_json).name)
        return _answered(self.node != "refuses")


def test_the_peer_ring_chooses_the_next_node_that_stays_and_collects_acknowledgements():
    peers = {n: _Peer(n) for n in ("a", "c", "d")}
    gcs = {"c": 0}
    ring = PeerRing("b", threading.Condition(), alive=lambda: ["d", "a", "b", "c"], worker_of=peers.__getitem__,
                    replica_of=lambda: None, draining=lambda: dict(gcs), calls=FutureCalls())
    peer, node = ring.peer()
    assert node == "d" and peer is peers["d"]                                 # c drains: skipped
    ring.copy(peer, node, _diff(1, 1), object())
    assert ring.copying() == {_diff(1, 1).name}
    assert ring.acknowledged() == [(_diff(1, 1).name, "d")] and not ring.copies
    assert ring.notice({"b": 123}) is True and ring.drain_self                 # this node drains
    assert ring.notice({"b": 123}) is False
    gcs["d"] = 5
    ring.notice({"c": 0, "d": 5})
    assert ring.peer()[1] == "a"                                              # chosen again: c and d drain
    ring.copy(peers["a"], "a", _diff(2, 2), object())
    peers["a"].node = "refuses"
    ring.copy(peers["a"], "a", _diff(3, 3), object())
    assert ring.acknowledged() == [(_diff(2, 2).name, "a")]                  # a refused copy is no acknowledgement


def test_the_report_channel_sends_one_call_at_a_time_and_adopts_the_answered_interval():
    calls = []

    class Coordinator:
        def __init__(self):
            self.update = SimpleNamespace(remote=self._update)

        def _update(self, node, msgs):
            calls.append(Future())
            calls[-1].msgs = msgs
            return calls[-1]

    ch = ReportChannel("n1", threading.Condition(), Coordinator, calls=FutureCalls())
    ch.add(("receiving", []))
    assert not ch.idle()
    assert ch.send(ch.take(busy=ch.unanswered())) and ch.idle() and len(calls) == 1
    ch.add(("not_received", ["x"]))
    assert ch.take(busy=ch.unanswered()) == [] and ch.pending                 # unanswered: the messages wait
    calls[0].set_result(0.5)                                                   # answered, asking for 0.5 s
    ch.take_interval()
    assert ch.interval == 0.5
    assert ch.send(ch.take(busy=ch.unanswered())) and calls[1].msgs == [("not_received", ["x"])]
    calls[1].set_result(None)
    ch.await_delivery(ch.last, deadline=time.monotonic() + 1)                 # answered: returns at once
    assert not ch.send([])                                                     # nothing to send: no call


def test_a_hand_off_never_waits_for_a_replica_lookup(monkeypatch):
    """The replica's handle is looked up once for the hand-offs, then renewed by the report thread only: a lookup
    blocks while the replica's actor restarts (moved off a draining node), and a hand-off that waited for it held
    the training process's sender back for seconds, past a drain's deadline (tests/test_drain.py flaked)."""
    from ray_ckpt.runtime import peer_ring
    lookups = []

    def replica_of():
        lookups.append(1)
        return f"replica-{len(lookups)}"

    ring = PeerRing("b", threading.Condition(), alive=lambda: ["a", "b"], worker_of=lambda n: None,
                    replica_of=replica_of, draining=dict, calls=FutureCalls())
    assert ring.replica() == "replica-1" and len(lookups) == 1                 # the first hand-off looks it up
    monkeypatch.setattr(peer_ring, "REPLICA_CACHE_S", 0.0)
    assert ring.replica() == "replica-1" and len(lookups) == 1                 # later hand-offs never do
    ring.refresh_replica()                                                     # the report thread renews it
    assert ring.replica() == "replica-2" and len(lookups) == 2
