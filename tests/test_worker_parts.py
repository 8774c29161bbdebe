"""The persistence worker's parts that need no Ray: its write queue and its control relay."""
from __future__ import annotations

import time
from types import SimpleNamespace

from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.runtime.control_relay import ControlRelay
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
