"""GapWatch (ray_ckpt/runtime/gaps.py): when the coordinator may call steps lost — never while a hand-off of them
is in flight to a live node's worker, and only after the grace period. No Ray."""
from __future__ import annotations

from ray_ckpt.lineage import Manifest, diff_name, object_key
from ray_ckpt.runtime.gaps import GapWatch
from ray_ckpt.runtime.reports import pack_reports


def _diff(first, last, gen=1):
    name = diff_name(gen, first, last)
    return Manifest(kind="diff", generation=gen, first_step=first, last_step=last, object=object_key(name),
                    nbytes=1, crc32=0, strategy="lowdiff")


HOLE = [11, 12, 13, 14, 15]   # steps 11..15 uncovered: steps 16.. were reported held before them


def test_a_hole_is_declared_only_after_the_grace_period_and_once():
    w = GapWatch(grace_s=2.0)
    assert w.overdue(1, HOLE, now=100.0) == []
    assert w.overdue(1, HOLE, now=101.9) == []
    assert w.overdue(1, HOLE, now=102.0) == HOLE
    assert w.declare(1, HOLE, when=5.0) == [(11, 15)]
    assert w.overdue(1, HOLE, now=110.0) == []          # declared already
    assert w.untold(1) == [(11, 15)] and w.untold(1) == []
    assert w.gaps == [{"generation": 1, "first": 11, "last": 15, "time": 5.0, "told": True}]


def test_a_hole_that_closes_within_the_grace_period_is_forgotten():
    w = GapWatch(grace_s=2.0)
    w.overdue(1, HOLE, now=100.0)
    assert w.overdue(1, [], now=101.0) == []             # the chunk's held report arrived
    assert w.overdue(1, HOLE, now=102.5) == []           # a new hole there starts a new grace period
    assert w.overdue(1, HOLE, now=104.5) == HOLE


def test_steps_in_flight_are_never_declared_however_long_the_hand_off_takes():
    """The reported case: a chunk whose ray.put waits seconds for a full object store while a later chunk is held."""
    w = GapWatch(grace_s=2.0)
    w.receiving("A", [_diff(11, 15)])
    for t in (100.0, 103.0, 130.0):
        assert w.overdue(1, HOLE, now=t, alive={"A"}) == []
    w.received("A", [diff_name(1, 11, 15)])              # held: the hole closes
    assert w.overdue(1, [], now=131.0) == [] and not w.arriving()


def test_a_hand_off_that_ends_without_the_chunk_starts_the_grace_period_then():
    w = GapWatch(grace_s=2.0)
    w.receiving("A", [_diff(11, 15)])
    assert w.overdue(1, HOLE, now=100.0, alive={"A"}) == []
    w.received("A", [diff_name(1, 11, 15)])              # not_received: the call failed
    assert w.overdue(1, HOLE, now=110.0) == []           # a hole from now on
    assert w.overdue(1, HOLE, now=112.0) == HOLE


def test_a_hand_off_to_a_restarted_worker_or_a_dead_node_brings_nothing():
    w = GapWatch(grace_s=2.0)
    w.receiving("A", [_diff(11, 13)])
    w.receiving("B", [_diff(14, 15)])
    w.overdue(1, HOLE, now=100.0, alive={"A", "B"})
    assert w.overdue(1, HOLE, now=103.0, alive={"A"}) == []   # B's node just died: its grace starts now
    assert w.overdue(1, HOLE, now=105.0, alive={"A"}) == [14, 15]
    w.node_reset("A")                                         # A's worker restarted
    assert w.overdue(1, HOLE, now=106.0, alive={"A"}) == [14, 15]   # (not declared in this test)
    assert w.overdue(1, HOLE, now=108.0, alive={"A"}) == HOLE


def test_only_the_hand_offs_of_the_same_generation_count():
    w = GapWatch(grace_s=2.0)
    w.receiving("A", [_diff(11, 15, gen=2)])
    w.overdue(1, HOLE, now=100.0)
    assert w.overdue(1, HOLE, now=102.0) == HOLE


def test_checks_are_paced_by_their_cost_unless_forced():
    w = GapWatch()
    assert w.due(10.0)
    assert not w.due(10.3)
    assert w.due(10.3, force=True)
    w.cost = 0.1
    assert not w.due(14.0, cost_factor=50.0) and w.due(15.4, cost_factor=50.0)


def test_receiving_reports_join_the_calls_first_one_and_keep_the_held_runs_whole():
    a, b = _diff(1, 2), _diff(3, 4)
    msgs = [("receiving", [a]), ("held", a, None, "n"), ("receiving", [b]), ("held", b, None, "n"),
            ("not_received", ["x"]), ("release", ["p"]), ("release", ["q"])]
    assert pack_reports(msgs) == [("receiving", [a, b]), ("held_batch", [(a, None, "n"), (b, None, "n")]),
                                  ("not_received", ["x"]), ("release", ["p", "q"])]
    assert pack_reports([("held", a, None, "n")]) == [("held", a, None, "n")]
