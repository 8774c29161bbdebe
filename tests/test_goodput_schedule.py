"""The goodput benchmark's pure parts: the seeded failure schedule, Young/Daly, ETTR and the per-failure breakdown
read from the logs (no Ray, no training, no timing assertions)."""
from __future__ import annotations

import math

import pytest

from benchmarks import goodput


def test_the_schedule_is_seeded_balanced_and_clipped():
    a = goodput.make_schedule(3, 6, mean_gap_s=7.0, min_gap_s=4.0, max_gap_s=12.0)
    assert a == goodput.make_schedule(3, 6, mean_gap_s=7.0, min_gap_s=4.0, max_gap_s=12.0)   # same seed, same list
    assert a != goodput.make_schedule(4, 6, mean_gap_s=7.0, min_gap_s=4.0, max_gap_s=12.0)
    assert sorted(f["kind"] for f in a) == ["kill", "kill", "node", "node", "preempt", "preempt"]
    assert all(4.0 <= f["gap_s"] <= 12.0 and f["rank"] in (0, 1) for f in a)
    assert [f["i"] for f in a] == list(range(6))
    assert goodput.mtbf(a) == pytest.approx(sum(f["gap_s"] for f in a) / 6)
    assert goodput.mtbf([]) == math.inf
    with pytest.raises(ValueError):
        goodput.make_schedule(0, 3, 7.0, min_gap_s=5.0, max_gap_s=4.0)


def test_young_daly_and_ettr():
    # sqrt(2 * 0.05 s * 8 s) = 0.894 s = 8.9 steps of 0.1 s
    assert goodput.young_daly_steps(0.05, 8.0, 0.1) == 9
    assert goodput.young_daly_steps(1e-6, 1.0, 10.0) == 1          # never less than every step
    with pytest.raises(ValueError):
        goodput.young_daly_steps(0.0, 8.0, 0.1)
    assert goodput.ettr(60.0, 80.0) == pytest.approx(0.75)
    s = goodput.spread([0.9, None, 0.8, 1.0])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.9) and (s["min"], s["max"]) == (0.8, 1.0)
    assert goodput.spread([None])["mean"] is None


def test_the_breakdown_splits_fault_to_first_step_into_its_phases():
    steps = [(100.0 + 0.1 * i, i + 1) for i in range(20)]                 # steps 1..20 until t=101.9
    steps += [(110.0 + 0.1 * i, 16 + i) for i in range(5)]                # resumed at 15: 16.. from t=110
    events = [(99.0, "enter", {}), (99.5, "restored", {"start": 0}),
              (108.0, "enter", {}), (109.5, "restored", {"start": 15, "phases": {"restore": 1.0}})]
    states = [(99.2, "RunningState"), (103.0, "RestartingState"), (104.0, "SchedulingState"), (108.5, "RunningState")]
    b = goodput.breakdown({"kind": "kill", "rank": 1, "t": 102.0}, steps, events, states)
    assert b["last_step"] == 20 and b["restored_step"] == 15 and b["steps_lost"] == 5
    assert (b["detection_s"], b["restart_s"], b["restore_s"], b["first_step_s"]) == \
        pytest.approx((1.0, 5.0, 1.5, 0.5))
    assert b["recovery_s"] == pytest.approx(8.0) and b["attach_phases"] == {"restore": 1.0}
    # a preemption: the controller preempts at the notice but restarts at the deadline (the fault time)
    p = goodput.breakdown({"kind": "preempt", "rank": 0, "t": 102.0, "t_notice": 98.0}, steps, events,
                          [(98.5, "PreemptingState"), (102.5, "RestartingState")])
    assert p["detection_s"] == pytest.approx(0.5)
    # the run ended before it recovered: phases unknown, not zero
    late = goodput.breakdown({"kind": "node", "rank": 0, "t": 200.0}, steps, events, states)
    assert late["recovery_s"] is None and late["steps_lost"] is None and late["last_step"] == 20


def test_step_intervals_leave_out_recoveries_and_warm_up():
    """A restart that lost no step continues the step count: its interval is cut at the controller's state change,
    not counted as a step; the first 3 intervals of each attempt are warm-up."""
    steps = [(float(t), t) for t in range(10)] + [(40.0 + i, 10 + i) for i in range(8)]   # 9 -> 10 spans 30 s
    states = [(-1.0, "SchedulingState"), (0.0, "RunningState"), (20.0, "RestartingState"), (39.5, "RunningState")]
    iv = goodput.step_intervals({"steps": steps, "states": states})
    assert max(iv) == 1.0 and len(iv) == (9 - 3) + (7 - 3)
    assert 31.0 in goodput._intervals(steps)   # without the cuts the recovery would count as a step
    run = {"wall_s": 100.0, "recovery": [{"detection_s": 1.0, "restart_s": 20.0}]}
    assert goodput.checkpointing_cost(run, {"wall_s": 60.0}) == 19.0
    assert goodput.checkpointing_cost({"wall_s": None, "recovery": []}, {"wall_s": 60.0}) is None


def test_gc_time_sums_each_attempts_clock():
    """Each attempt's ``gc`` clock starts at 0: a rank's total is the last value of every attempt, summed."""
    recs = [{"ev": "enter"}, {"s": 1, "gc": 0.1}, {"s": 2, "gc": 0.3},
            {"ev": "enter"}, {"ev": "restored"}, {"s": 2, "gc": 0.05}, {"s": 3, "gc": 0.2}]
    g = goodput.gc_time(recs)
    assert g["s"] == pytest.approx(0.5) and g["steps"] == 4 and g["per_step_s"] == pytest.approx(0.125)
    assert goodput.gc_time([]) == {"s": 0.0, "steps": 0, "per_step_s": None}


def test_gc_clock_counts_collections():
    import gc
    before = list(gc.callbacks)
    clock = goodput._gc_clock()
    try:
        junk = [[] for _ in range(200_000)]
        for j in junk:
            j.append(j)      # cycles: the collection has work to do
        del junk
        gc.collect()
        assert clock[0] > 0
    finally:
        gc.callbacks[:] = before
