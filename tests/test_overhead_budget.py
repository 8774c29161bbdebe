"""The overhead budget: what the policy measures in the training process and the recovery granularity it
chooses from it. No timing is asserted: the loops are made cheap or expensive by orders of magnitude (a sleep in
the step, a huge dense gradient with a budget of 0.1 %), and what is checked is the choice and its exactness."""
from __future__ import annotations

import time
import uuid

import pytest
import ray
import torch

import ray_ckpt
from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.policy import FixedFrequencyPolicy, StepContext
from tests import _training as T
from ray_ckpt.policy.budget import BudgetPolicy, StepMeter, Window, choose_durable
from ray_ckpt.runtime import lineages
from ray_ckpt.storage import open_storage


def _w(cost_ms: float, step_ms: float = 10.0, *, recorded=True, fulls=0, snapshot_ms=0.0, steps=100) -> Window:
    return Window(steps=steps, step_s=step_ms / 1e3, capture_s=cost_ms / 1e3, optimizer_s=1e-3, stall_s=0.0,
                  other_cpu_s=0.0, fulls=fulls, snapshot_s=snapshot_ms / 1e3, bytes=1e6, recorded=recorded,
                  capture_cpu_s=cost_ms / 1e3)


def _ctx(step, last_full):
    return StepContext(step=step, last_full_step=last_full, steps_in_batch=1)


def test_budget_policy_chooses_the_granularity_from_measured_windows():
    changes = []
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, on_change=changes.append)
    p.hint_full(0.002, 8e6)
    for _ in range(3):                      # every step fits: 0.2 ms of a 9.8 ms step
        p.observe(_w(0.2))
    assert (p.mode, p.k, p.recording) == ("every_step", 1, True) and not changes
    p.observe(_w(3.0))                      # 3 ms per step of a 7 ms step: over 5 %, once
    assert p.mode == "every_step" and "measuring another" in p.reason and not changes
    p.observe(_w(0.2))                      # a single window is not enough: a pause of the process (a GC)
    p.observe(_w(0.2))
    assert p.mode == "every_step" and not changes
    p.observe(_w(6.0))
    p.observe(_w(6.0))                      # over the budget in two windows in a row
    assert p.mode in ("every_k", "fulls_only") and p.k >= 2 and p.lost_work_steps == p.k
    d = p.decide(_ctx(51, 0))               # the switch: the last recorded step closes its batch
    assert d.record and d.close_batch and not p.recording
    k = p.k
    assert [p.decide(_ctx(51 + i, 51)).full for i in range(1, k + 1)] == [False] * (k - 1) + [True]
    assert not p.decide(_ctx(60, 51)).record
    p.observe(_w(0.05, recorded=False))     # the window after the switch (the last records' hand-off): not a full's
    # the fulls turn out cheap and the unrecorded steps cheaper: k follows the measured cost of a full
    p.observe(_w(0.05, recorded=False, fulls=2, snapshot_ms=1.0))
    assert p.full_cost is not None and p.fixed_cost is not None
    # every step fits again (the step got slower): a full of the switch step, then records
    p.observe(_w(3.0, step_ms=1000.0, recorded=True))
    p.step_cost = 0.001
    p.observe(_w(0.05, step_ms=1000.0, recorded=False, fulls=1, snapshot_ms=1.0))
    assert p.mode == "every_step"
    d = p.decide(_ctx(200, 190))
    assert d.full and not d.record and p.recording
    assert [c["mode"] for c in changes][0] in ("every_k", "fulls_only") and changes[-1]["mode"] == "every_step"
    assert "budget" in p.report()["reason"] or "fits" in p.report()["reason"]


def test_a_first_measurement_far_over_the_budget_leaves_every_step_at_once():
    """The run's first measured window costs over 3x the budget: no second window is recorded at that cost. A window
    as far over after windows that fitted is taken for a pause and measured again."""
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05)
    p.hint_full(0.002, 8e6)
    p.observe(_w(6.0))                      # the warm-up window (the attach full's hand-off): not used
    assert p.mode == "every_step"
    p.observe(_w(6.0))                      # 6 ms of a 4 ms step: 150 %, 30x the budget, in the first window
    assert p.mode in ("every_k", "fulls_only") and p.decide(_ctx(20, 0)).record and not p.recording
    q = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05)
    q.observe(_w(0.2))
    q.observe(_w(0.2))                      # fits
    q.observe(_w(1.0))                      # over, but not 3x the budget: measured again
    assert q.mode == "every_step"
    r = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05)
    r.observe(_w(6.0))
    r.observe(_w(0.6))                      # over, not 3x: one window is not enough
    assert r.mode == "every_step"


def test_a_calibration_at_attach_decides_at_the_first_short_window():
    """The cost of a recorded step measured at attach decides as soon as the first window gives the step time:
    over the budget, a full every k steps from the first window on (no window records every step at full cost
    first); within it, every step. A pinned granularity, a budget of 0 and a resumed attempt take no calibration;
    the step meter's first window closes after its ``min_steps`` steps when told so."""
    changes = []
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, on_change=changes.append)
    p.hint_full(0.002, 8e6)
    assert p.wants_calibration and p.calibrate(0.003)            # 3 ms per recorded step
    assert p.mode == "every_step" and "calibrated at attach" in p.reason and not changes
    p.observe(_w(0.2, step_ms=10.0))                              # the first window: a 9.8 ms step, 5 % = 0.49 ms
    assert p.mode in ("every_k", "fulls_only") and p.k >= 2 and "calibrated at attach" in changes[0]["reason"]
    assert p.decide(_ctx(9, 0)).record and not p.recording        # the switch: the last recorded step
    assert not p.wants_calibration and not p.calibrate(0.003)     # once only
    q = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05)
    assert q.calibrate(0.0002)                                    # 0.2 ms of a 9.8 ms step: fits
    q.observe(_w(0.2, step_ms=10.0))
    assert q.mode == "every_step" and "every step recorded" in q.reason and q.calibrated is None
    for pinned in (BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, pin=1),
                   BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.0),
                   BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, granular=False)):
        assert not pinned.wants_calibration and not pinned.calibrate(1.0)
    r = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05)
    assert r.resume({"mode": "every_k", "k": 7, "budget": 0.05}) and not r.calibrate(1.0) and r.k == 7
    t = {"cpu": (0.0, 0.0)}
    got = []
    m = StepMeter(clock=None, cpu=lambda: t["cpu"], window_s=1.0, min_steps=4, on_window=got.append,
                  first_short=True)
    for _ in range(3):
        m.tick(0.01, 0.001, 0.002)
    assert m.tick(0.01, 0.001, 0.002) is not None and len(got) == 1   # 40 ms, not a second: the first only
    assert all(m.tick(0.01, 0.001, 0.002) is None for _ in range(20))


def _win(other_ms: float, *, fulls=0, snapshot_ms=0.0, steps=10, recorded=False, step_ms=10.0) -> Window:
    return Window(steps=steps, step_s=step_ms / 1e3, capture_s=0.1e-3 + snapshot_ms / 1e3 / steps, optimizer_s=1e-3,
                  stall_s=0.0, other_cpu_s=other_ms / 1e3, fulls=fulls, snapshot_s=snapshot_ms / 1e3, bytes=1e6,
                  recorded=recorded, capture_cpu_s=0.1e-3 + snapshot_ms / 1e3 / steps)


def test_a_fulls_cost_is_its_own_not_the_background_threads_idle_or_the_switch_tail():
    """What a full costs is measured from the unrecorded windows: not the hand-off of the last recorded steps that
    runs on after the switch (nor the attach full's, in the warm-up window), and not the background thread's CPU
    that every window has whatever k is (that is a per-step cost); otherwise a long interval, whose fulls seem
    dearer by the idle CPU of all its windows, shortens itself window after window."""
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    p.hint_full(0.01, 40e6)
    p.observe(_win(0.0, recorded=True))                 # warm-up
    for _ in range(2):
        p.observe(_win(5.0, recorded=True, step_ms=15.0))   # every step: 5 ms of background CPU, far over budget
    assert p.mode != "every_step"
    p.decide(_ctx(30, 0))                               # the last recorded step
    p.observe(_win(30.0))                               # the tail: 300 ms of hand-off of the recorded steps
    assert p.full_cost is None
    for _ in range(3):                                  # quiet windows: 0.2 ms per step of polls
        p.observe(_win(0.2))
    p.observe(_win(0.2 + 2.0, fulls=1, snapshot_ms=10.0))   # a full: 10 ms snapshot + 20 ms hand-off
    assert p.full_cost == pytest.approx(0.030, rel=1e-6), p.report()
    assert p.fixed_cost == pytest.approx(0.1e-3 + 0.2e-3, rel=0.3), p.report()


def test_the_budget_outranks_the_cost_models_full_interval():
    """A full costs so much that only an interval longer than the cost model's (every 20 steps) keeps the budget:
    the policy takes that longer interval and says why, instead of staying at 20 steps over the budget."""
    p = BudgetPolicy(FixedFrequencyPolicy(20, 10), 0.05, max_k=10_000)
    p.hint_full(0.015, 8e6)
    for _ in range(3):    # the first window is not used; then two over the budget
        p.observe(_w(3.0))                                   # every step: 3 ms of a 7 ms step
    p.decide(_ctx(51, 0))
    for _ in range(2):                                       # unrecorded: 0.05 ms a step, a full 15 ms
        p.observe(_w(0.2, recorded=False, fulls=1, snapshot_ms=15.0))
    allowed = 0.05 * p.base_s
    assert p.mode == "fulls_only" and p.k > 20, p.report()
    assert p.full_cost / p.k + p.fixed_cost <= allowed       # the interval chosen keeps the budget
    finest = p.full_cost / (allowed - p.fixed_cost)
    assert p.k <= 1.25 * finest + 1                          # and is the finest that does, within the hysteresis
    assert "budget decides" in p.reason and p.lost_work_steps == p.k


def test_a_budget_no_granularity_meets_falls_back_to_the_cost_models_fulls():
    """Even an unrecorded step costs more than the budget: recovery points at the cost model's full interval (the
    coarsest granularity it chose for failures), never a longer interval that loses more work and still misses."""
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    p.hint_full(0.002, 8e6)
    for _ in range(3):    # the first window is not used; then two over the budget
        p.observe(_w(3.0))                                   # every step: 3 ms of a 7 ms step
    assert p.mode in ("every_k", "fulls_only") and p.k <= 100
    p.decide(_ctx(51, 0))
    p.observe(_w(2.0, recorded=False))                           # (the switch's tail: not a full's cost)
    p.observe(_w(2.0, recorded=False, fulls=1, snapshot_ms=1.0))   # unrecorded steps alone: 2 ms of an 8 ms step
    assert (p.mode, p.k, p.lost_work_steps) == ("fulls_only", 100, 100), p.report()
    assert "cannot be met" in p.reason and "100 steps" in p.reason


def test_a_restarted_attempt_resumes_the_granularity_it_measured():
    """A restart keeps the granularity the previous attempt measured (its state, through the coordinator) instead
    of recording every step again until it has measured the same costs; the costs keep being measured."""
    a = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    a.hint_full(0.002, 8e6)
    for _ in range(3):    # the first window is not used; then two over the budget
        a.observe(_w(3.0))                                   # every step: 3 ms of a 7 ms step
    a.decide(_ctx(51, 0))
    a.observe(_w(0.05, recorded=False, fulls=2, snapshot_ms=1.0))
    state = a.state()
    assert state["mode"] in ("every_k", "fulls_only") and state["step_cost"] == pytest.approx(3e-3)

    b = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    assert b.resume(state)
    assert (b.mode, b.k, b.recording) == (a.mode, a.k, False) and "previous attempt" in b.reason
    assert b.report()["lost_work_steps"] == a.k and b.changes[-1]["mode"] == a.mode
    k = b.k   # the attach full was step 80: the next full k steps later, nothing recorded between
    assert [b.decide(_ctx(80 + i, 80)).full for i in range(1, k + 1)] == [False] * (k - 1) + [True]
    assert not any(b.decide(_ctx(80 + i, 80 + k)).record for i in range(1, 3))
    for _ in range(2):                # its windows are unrecorded: still over the budget, so it stays
        b.observe(_w(0.05, recorded=False, fulls=1, snapshot_ms=1.0))
    assert b.mode != "every_step"
    b.step_cost = 1e-5                # (every step would now fit): records resume, from a full
    b.observe(_w(0.05, recorded=False, fulls=1, snapshot_ms=1.0))
    assert b.mode == "every_step" and b.decide(_ctx(200, 190)).full and b.recording

    for other in (BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.02),                 # another budget
                  BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, granular=False)):   # only measured
        assert not other.resume(state) and other.mode == "every_step" and other.recording
    for bad in (None, {}, dict(state, mode="every_step"), dict(state, k=1), dict(state, k="3"),
                dict(state, step_cost=float("nan")), dict(state, k=10_001)):
        c = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
        assert not c.resume(bad) and (c.mode, c.k, c.recording) == ("every_step", 1, True)


def test_a_run_that_fails_often_gets_no_coarser_recovery_points_than_young_daly():
    """The budget alone would space fulls far apart; with the run's observed time between failures (the coordinator
    hands it to the next attempt) the interval stops at Young/Daly's sqrt(2 C M), where a longer one would lose
    more work per failure than its fulls save."""
    state = {"mode": "fulls_only", "k": 120, "budget": 0.05, "step_cost": 3e-3, "full_cost": 0.01,
             "fixed_cost": 0.0, "base_s": 0.01}
    free = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    assert free.resume(state) and free.k == 120                  # no failure seen: the budget's interval
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    assert p.resume(dict(state, mtbf_s=2.0))
    # sqrt(2 * 0.01 s * 2 s) = 0.2 s = 20 steps of 10 ms
    assert (p.mode, p.k, p.lost_work_steps) == ("every_k", 20, 20) and "fails every 2 s" in p.reason, p.reason
    # the choice as the steps go on keeps the cap: fulls of 10 ms at 0.05 % of a 10 ms step would ask for 2000
    p.budget = 0.0005
    p.observe(_w(0.001, recorded=False, fulls=1, snapshot_ms=10.0))
    p.observe(_w(0.001, recorded=False, fulls=1, snapshot_ms=10.0))
    assert p.k <= 20 + 1, p.report()
    # a first attempt hears of no failure (mtbf_s None): resume() still takes the MTBF of a state without a mode
    q = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000)
    assert not q.resume({"mtbf_s": 3.0}) and q.mtbf_s == 3.0 and q.mode == "every_step"


def test_a_drain_notice_records_every_step_until_it_is_withdrawn():
    """A preemption notice outranks the budget: from the notice on every step is a recovery point (a full of the
    step it came at, then a record of each step after it) whatever that costs, so that a node removed at the
    deadline loses no step; once the notice is withdrawn the budget decides again."""
    notice = {"on": False}
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000, draining=lambda: notice["on"])
    state = {"mode": "every_k", "k": 20, "budget": 0.05, "step_cost": 3e-3, "full_cost": 0.002,
             "fixed_cost": 0.0, "base_s": 0.01}
    assert p.resume(state) and not p.recording
    assert not p.needs_state(81, 80) and not p.decide(_ctx(81, 80)).full          # every_k: step 81 unrecorded
    notice["on"] = True
    assert p.needs_state(82, 80)                     # the step of the notice keeps its loop state: a full of it
    d = p.decide(_ctx(82, 80))
    assert d.full and not d.record and p.recording and (p.mode, p.k) == ("every_step", 1)
    assert "drain notice" in p.reason and p.changes[-1]["mode"] == "every_step"
    assert all(p.decide(_ctx(s, 82)).record for s in range(83, 90))
    for _ in range(4):                               # far over the budget: stays while the notice is in force
        p.observe(_w(3.0))
        assert p.mode == "every_step" and p.recording and p.decide(_ctx(90, 82)).record
    notice["on"] = False                             # withdrawn: the budget decides again
    p.needs_state(91, 82)
    assert "withdrawn" in p.reason
    p.observe(_w(3.0))
    p.observe(_w(3.0))
    assert p.mode in ("every_k", "fulls_only")
    # the granularity from before a notice is what the next attempt resumes, and what a withdrawn notice restores
    d = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000, draining=lambda: notice["on"])
    notice["on"] = False
    assert d.resume(state) and (d.mode, d.k) == ("every_k", 20)
    notice["on"] = True
    assert d.needs_state(101, 100) and d.decide(_ctx(101, 100)).full and d.recording
    assert (d.state()["mode"], d.state()["k"]) == ("every_k", 20)          # not every_step: resumed after the drain
    notice["on"] = False
    d.needs_state(102, 101)
    assert (d.mode, d.k) == ("every_k", 20) and "withdrawn" in d.reason
    assert d.decide(_ctx(102, 101)).record and not d.recording             # the last record, then unrecorded
    assert not d.decide(_ctx(103, 101)).record
    # a notice while the switch away from every_step is pending cancels it
    q = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.05, max_k=10_000, draining=lambda: notice["on"])
    for _ in range(3):
        q.observe(_w(3.0))
    assert q.mode != "every_step" and q.recording     # the last recorded step is still to come
    notice["on"] = True
    assert q.needs_state(5, 0)
    assert q.decide(_ctx(5, 0)).record and q.recording and q.mode == "every_step"
    assert q.decide(_ctx(6, 0)).record


def test_budget_zero_and_bad_values():
    p = BudgetPolicy(FixedFrequencyPolicy(100, 10), 0.0)
    for _ in range(3):
        p.observe(_w(50.0))
    assert p.mode == "every_step" and "overhead_budget=0" in p.reason
    with pytest.raises(ValueError, match="overhead_budget"):
        ray_ckpt.CheckpointConfig(overhead_budget=-0.1)
    with pytest.raises(ValueError, match="overhead_budget"):
        ray_ckpt.CheckpointConfig(overhead_budget=float("nan"))


def test_budget_env_knob(monkeypatch):
    monkeypatch.setenv("RAY_CKPT_OVERHEAD_BUDGET", "0.02")
    assert ray_ckpt.CheckpointConfig.resolve().overhead_budget == 0.02
    monkeypatch.setenv("RAY_CKPT_OVERHEAD_BUDGET", "lots")
    with pytest.raises(ValueError, match="RAY_CKPT_OVERHEAD_BUDGET"):
        ray_ckpt.CheckpointConfig.resolve()


def test_step_meter_windows_and_durable_choice():
    t = {"cpu": (0.0, 0.0)}
    got = []
    m = StepMeter(clock=None, cpu=lambda: t["cpu"], counters=lambda: (0.0, 0.0), window_s=0.05, min_steps=4,
                  on_window=got.append)
    for _ in range(3):
        assert m.tick(0.01, 0.001, 0.002, 0.0005) is None
    t["cpu"] = (0.01, 0.04)                 # the background thread spent 10 ms (the training thread 40 ms)
    w = m.tick(0.06, 0.001, 0.002, 0.0005)
    assert got == [w] and w.steps == 4 and w.other_cpu_s == pytest.approx(0.0025)
    assert w.cost_s == pytest.approx(0.0005 + 0.0025) and w.optimizer_s == pytest.approx(0.002)
    assert choose_durable("all", diff_rate=265e6, write_bw=500e6)[0] == "fulls"
    assert choose_durable("all", diff_rate=10e6, write_bw=500e6)[0] == "all"
    assert choose_durable("fulls", diff_rate=100e6, write_bw=500e6)[0] == "fulls"   # hysteresis
    assert choose_durable("fulls", diff_rate=10e6, write_bw=500e6)[0] == "all"
    assert choose_durable("all", diff_rate=2e6, write_bw=4e6)[0] == "all"            # a trickle: always written
    assert choose_durable("all", diff_rate=1e9, write_bw=None)[0] == "all"


# -- loops --------------------------------------------------------------------------------------------------------
def _model(width: int, seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return m, torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)


def _step(m, opt, step: int, width: int, sleep: float = 0.0):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(1, width, generator=g)
    loss = torch.tanh(m(x)).mean()
    opt.zero_grad()
    loss.backward()
    if sleep:
        time.sleep(sleep)
    opt.step()


def _train_until_two_points_past_the_switch(ck, m, opt, width: int, seconds: float) -> int:
    """Train until the budget has left every-step recording and two fulls were taken since, with a step after the
    last one (or ``seconds`` pass); the last step."""
    step, deadline, fulls_at_switch = 0, time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        step += 1
        _step(m, opt, step, width)
        if ck.budget.mode != "every_step":
            cap = ck._capture
            if fulls_at_switch is None:
                fulls_at_switch = cap.full_snapshots
            elif cap.full_snapshots >= fulls_at_switch + 2 and step > cap.last_full_step + 1:
                break
    return step


def _assert_points_restore_bitwise(uri, width, steps: list[int]):
    """Every step in ``steps`` restores to the state of an uninterrupted twin at that step (torch.equal)."""
    twin, topt = _model(width)
    done = 0
    for s in sorted(steps):
        while done < s:
            done += 1
            _step(twin, topt, done, width)
        m, opt = _model(width, seed=1)
        assert ray_ckpt.restore(uri, m, opt, step=s) == s
        for a, b in zip(m.parameters(), twin.parameters()):
            assert torch.equal(a, b), s
        got, want = opt.state_dict()["state"], topt.state_dict()["state"]
        assert got.keys() == want.keys(), s
        for i in want:
            assert all(torch.equal(got[i][k], v) for k, v in want[i].items()), s


def test_expensive_loop_records_a_full_every_k_steps_and_each_restores_bitwise(tmp_path, capsys):
    """A 16 MB dense gradient per step of a batch-1 step: recording every step costs about as much as the step
    (its copy alone), far beyond the 5 % budget, so the policy records a full every k steps (at most 300 here,
    to keep the test short); every recovery point it reports restores bitwise."""
    width, uri = 2048, str(tmp_path / "ck")
    m, opt = _model(width)
    ck = ray_ckpt.Checkpointer(uri, m, opt, overhead_budget=0.05, max_full_every=300)
    step = _train_until_two_points_past_the_switch(ck, m, opt, width, seconds=60)
    st = ck.stats()
    ck.close()
    gran = st["granularity"]
    assert gran["mode"] in ("every_k", "fulls_only"), gran
    assert gran["k"] >= 2 and gran["lost_work_steps"] == gran["k"]
    assert st["policy"]["granularity"] == gran and st["full_every"] == gran["k"]
    lineage, _ = load_lineage(open_storage(uri))
    gen = lineage.generations[-1]
    assert lineage.uncovered_steps(gen) == []            # unrecorded by choice: not a gap
    assert lineage.head() == step                        # close() took a full of the last, unrecorded step
    fulls = sorted(mm.last_step for mm in lineage.manifests if mm.kind == "full")
    assert any(mm.info.get("unrecorded_from") for mm in lineage.manifests if mm.kind == "full")
    points = lineage.reachable_steps(gen)
    # the recovery points it reports: the recorded steps and every full; the newest few and the fulls
    check = sorted(set(fulls[-3:]) | set(points[-2:]) | {points[0]})
    _assert_points_restore_bitwise(uri, width, check)
    assert cli_main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "overhead budget: recovery points every" in out and "GAP" not in out, out


def test_an_expensive_loop_leaves_every_step_after_its_first_window_by_calibration(tmp_path):
    """Defaults but the budget: the calibration at attach (a sample record's capture and encode) decides at the
    first window, 8 steps in — not after seconds of windows recording every step — and the points it leaves restore
    bitwise."""
    width, uri = 256, str(tmp_path / "ck")
    m, opt = _model(width)
    ck = ray_ckpt.Checkpointer(uri, m, opt, overhead_budget=0.0001, keep_fulls=0)   # 0.01 %: nothing fits
    assert ck.startup["calibration"] > 0 and "calibrated at attach" in ck.budget.reason
    step = 0
    while ck.budget.mode == "every_step":
        step += 1
        _step(m, opt, step, width)
        assert step <= 12, ck.budget.reason
    assert "calibrated at attach" in ck.budget.changes[0]["reason"]
    for _ in range(3 * ck.budget.k):
        step += 1
        _step(m, opt, step, width)
    ck.close()
    lineage, _ = load_lineage(open_storage(uri))
    gen = lineage.generations[-1]
    recorded = [s for mm in lineage.manifests if mm.kind == "diff" for s in range(mm.first_step, mm.last_step + 1)]
    assert recorded and max(recorded) <= 12 and lineage.uncovered_steps(gen) == []
    fulls = sorted(mm.last_step for mm in lineage.manifests if mm.kind == "full")
    _assert_points_restore_bitwise(uri, width, [max(recorded), fulls[-2], step])


def test_cheap_loop_keeps_every_step(tmp_path):
    """A 200 ms step whose checkpoint costs a few hundred bytes: every step stays recorded and restorable (the
    step is long enough that the process's other threads stay far inside 5 % of it on a loaded test machine)."""
    width, uri = 8, str(tmp_path / "ck")
    m, opt = _model(width)
    with ray_ckpt.Checkpointer(uri, m, opt, overhead_budget=0.05) as ck:
        step, deadline = 0, time.monotonic() + 3.0
        while time.monotonic() < deadline or ck._capture.meter.windows < 2:
            step += 1
            _step(m, opt, step, width, sleep=0.2)
        ck.flush()
        st = ck.stats()
    assert st["granularity"]["mode"] == "every_step" and st["granularity"]["lost_work_steps"] == 1
    assert st["granularity"]["measured_overhead"] is not None
    est = st["policy"]["estimates"]
    assert est["step"]["n"] > 0 and est["step"]["mean"] > 0.05 > est["optimizer_step"]["mean"] > 0
    assert est["replay"]["source"].startswith("optimizer.step()")
    lineage, _ = load_lineage(open_storage(uri))
    assert lineage.reachable_ranges(lineage.generations[-1]) == [(0, step)]
    _assert_points_restore_bitwise(uri, width, [step // 2, step])


@pytest.mark.ray
def test_threads_that_work_for_training_are_not_charged_to_checkpointing(tmp_path):
    """A thread of the training process that computes beside the training thread (as gloo's or NCCL's
    communication threads, a data loader's or Ray's do, with or without checkpointing) is not checkpointing's cost:
    the budget counts the writer thread's own CPU, so a cheap checkpoint keeps every step although the process
    spends about a core more than the training thread."""
    import threading
    stop = threading.Event()
    spun = [0]

    def communication():   # torch releases the interpreter lock inside mm: CPU of its own thread
        a = torch.randn(192, 192)
        while not stop.is_set():
            a = torch.tanh(a @ a)
            spun[0] += 1

    busy = threading.Thread(target=communication, daemon=True, name="not-checkpointing")
    width, uri = 8, str(tmp_path / "ck")
    m, opt = _model(width)
    busy.start()
    try:
        with ray_ckpt.Checkpointer(uri, m, opt, overhead_budget=0.05) as ck:
            assert ck._sink.measures_cpu          # Linux: the writer thread's own clock
            # a 200 ms step (as in the test above): the writer's own CPU per step stays far inside 5 % of it on a
            # loaded 2-core machine where the busy thread takes a core; the busy thread's CPU per step is a whole
            # step, twenty times the budget
            step, deadline = 0, time.monotonic() + 3.0
            while time.monotonic() < deadline or ck._capture.meter.windows < 2:
                step += 1
                _step(m, opt, step, width, sleep=0.2)
            w = ck._capture.meter.last
            st = ck.stats()
    finally:
        stop.set()
        busy.join(5)
    assert spun[0] > 100                           # the other thread did run
    assert w.other_cpu_s < 0.25 * w.base_s, w      # not the other thread's core-second per second
    assert st["granularity"]["mode"] == "every_step", (st["granularity"], w)


def test_the_writer_thread_clock_is_chosen_before_the_thread_runs():
    """The meter picks its CPU measure at attach, when the writer thread may not have run yet: that it reads the
    thread's own clock must not depend on the thread having started (it then has used no CPU)."""
    from ray_ckpt.engine.writer import BoundedSink

    class NotStarted(BoundedSink):
        def _run(self):
            pass

    sink = NotStarted(max_pending_bytes=1 << 20, thread_name="not-started")
    assert sink.measures_cpu and sink.background_cpu() == 0.0


def test_estimates_are_measured_under_the_ray_runtime(tmp_path, ray_cluster):  # noqa: F811
    """runtime="ray": the coordinator's cost model gets the training thread's windows (no placeholders)."""
    from ray_ckpt.runtime.coordinator import shutdown_run
    run, uri, width = f"b-{uuid.uuid4().hex[:8]}", str(tmp_path / "ck"), 16
    m, opt = _model(width)
    try:
        with ray_ckpt.Checkpointer(uri, m, opt, runtime="ray", run=run) as ck:
            step, deadline = 0, time.monotonic() + 60
            est = None
            while time.monotonic() < deadline:
                step += 1
                _step(m, opt, step, width, sleep=0.05)   # 5 % of it: 2.5 ms, far above a 16-wide record's cost
                if step % 10 == 0:
                    est = ck.stats()["policy"]["estimates"]
                    if est["step"]["n"] > 0 and est["optimizer_step"]["n"] > 0:
                        break
            st = ck.stats()
        est = st["policy"]["estimates"]
        assert est["step"]["n"] > 0 and 0.01 < est["step"]["mean"] < 1.0
        assert est["replay"]["mean"] > 0 and est["replay"]["source"].startswith("optimizer.step()")
        assert "1.00 s step" not in st["policy"]["reason"]
        assert st["granularity"]["mode"] == "every_step"
        assert st["durable_diffs"]["mode"] == "all" and st["durable_diffs"]["auto"]
    finally:
        shutdown_run(run)


@pytest.mark.ray
def test_every_k_with_the_state_tier_replica_restores_each_point_bitwise(tmp_path, ray_cluster):  # noqa: F811
    """runtime="ray" with the state tier's replica (the default): a 4 MB dense gradient per batch-1 step breaks a
    0.5 % budget, so the policy leaves steps unrecorded and the trainer takes a full every k steps (the replica
    writes no fulls of unrecorded steps); every recovery point the lineage reports restores bitwise."""
    from ray_ckpt.runtime.coordinator import shutdown_run
    run, uri, width = f"k-{uuid.uuid4().hex[:8]}", str(tmp_path / "ck"), 1024
    m, opt = _model(width)
    t_start = time.time()
    try:
        # every recorded diff durable too (not the bandwidth's choice, "auto"), so that the lineage read from storage
        # after the run has every step the capture recorded
        ck = ray_ckpt.Checkpointer(uri, m, opt, runtime="ray", run=run, overhead_budget=0.005, max_full_every=40,
                                   durable_diffs="all", keep_fulls=0)
        step = _train_until_two_points_past_the_switch(ck, m, opt, width, seconds=25)
        coord = lineages.coordinator(run)
        deadline = time.monotonic() + 20   # the sender's reports carry the budget's state to the coordinator
        while (ray.get(coord.granularity.remote()) or {}).get("mode", "every_step") == "every_step" \
                and time.monotonic() < deadline:
            step += 1
            _step(m, opt, step, width)
        st = ck.stats()
        ck.close()
        gran = st["granularity"]
        assert gran["mode"] in ("every_k", "fulls_only") and 2 <= gran["k"] <= 40, gran
        # the every-k fulls are coarse recovery points: written, neither copied to a peer nor fed to the replica
        # (the only peer copies are of the recorded steps' chunks and the fulls that records follow)
        rt = st["runtime"]
        coarse = [mm for mm in load_lineage(open_storage(uri))[0].manifests
                  if mm.kind == "full" and mm.info.get("records_follow") is False]
        assert len(coarse) >= 2, [mm.info for mm in load_lineage(open_storage(uri))[0].manifests]
        # (None: a replica placed again after the switch, which no full is fed to while the mode holds)
        rep_step = rt["replica"]["step"]
        assert rep_step is None or rep_step < min(mm.last_step for mm in coarse), rt["replica"]
        assert gran["lost_work_steps"] == gran["k"]
        lineage, _ = load_lineage(open_storage(uri))
        gen = lineage.generations[-1]
        assert lineage.uncovered_steps(gen) == []            # unrecorded by choice: not a gap
        assert lineage.head() == step                        # close() took a full of the last, unrecorded step
        assert any(mm.info.get("unrecorded_from") for mm in lineage.manifests if mm.kind == "full")
        points = lineage.reachable_steps(gen)
        fulls = sorted(mm.last_step for mm in lineage.manifests if mm.kind == "full")
        # the run's next attempt (a Ray Train restart): it starts at the granularity the coordinator last heard,
        # not at every step
        t_fail = time.time()
        ray.get(coord.record_failure.remote({"decision": "RETRY (test)"}))   # as RayCkptCallback reports one
        time.sleep(2.0)   # the restart: not running time
        prev = ray.get(coord.granularity.remote())
        # the replica restarted meanwhile (its node lost, say) does not rebuild itself from the lineage while the run
        # records a full every k steps (no record would follow; a full that records follow resets it)
        from ray_ckpt.runtime import naming
        replica = ray.get_actor(naming.replica_name(run), namespace=naming.NAMESPACE)
        ray.kill(replica, no_restart=False)
        deadline = time.monotonic() + 60
        rst = {}
        while time.monotonic() < deadline and not rst.get("rebuilds_skipped"):
            try:
                rst = ray.get(replica.status.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - restarting
                pass
            time.sleep(0.2)
        assert rst.get("rebuilds_skipped") == 1 and rst["rebuilds"] == 0 and rst["step"] is None, rst
        m2, opt2 = _model(width, seed=1)
        at = ray_ckpt.restore(uri, m2, opt2, runtime="ray", run=run)
        ck2 = ray_ckpt.Checkpointer(uri, m2, opt2, runtime="ray", run=run, overhead_budget=0.005,
                                    max_full_every=40, durable_diffs="all", keep_fulls=0)
        g2, mtbf2 = ck2.stats()["granularity"], ck2.budget.mtbf_s
        for i in range(1, g2["k"] + 2):   # the next full comes k steps after the attach full
            _step(m2, opt2, at + i, width)
        fulls2 = ck2.stats()["trainer_fulls"]
        ck2.close()
    finally:
        shutdown_run(run)
    assert at == step and prev["mode"] in ("every_k", "fulls_only")
    assert 0 < prev["mtbf_s"] <= t_fail - t_start + 0.5      # the running time before the failure, not the restart
    # the run's observed running time between failures (it ran on from the read above to the attach)
    assert prev["mtbf_s"] <= mtbf2 <= prev["mtbf_s"] + 60   # (+ the seconds in between, however loaded)
    # the same granularity, or a finer one where the failures ask for it (Young/Daly)
    assert g2["mode"] in ("every_k", "fulls_only") and 2 <= g2["k"] <= prev["k"], g2
    assert "previous attempt" in g2["reason"], g2
    assert fulls2 >= 2, fulls2          # the attach full and one k steps later
    # the resumed attempt's attach full is coarse too (no record follows it)
    gen2 = load_lineage(open_storage(uri))[0].generations[-1]
    first2 = [mm for mm in load_lineage(open_storage(uri))[0].manifests
              if mm.kind == "full" and mm.generation == gen2 and mm.last_step == at]
    assert first2 and first2[0].info.get("records_follow") is False, [mm.info for mm in first2]
    # recorded steps (before the switch) and the fulls every k steps after it: the oldest, newest and two fulls
    # of the first attempt, and the second attempt's first full (its steps continue the same batches)
    check = set(fulls[-2:]) | set(points[-2:]) | {points[0], at + g2["k"]}
    _assert_points_restore_bitwise(uri, width, sorted(check))


def test_pinned_every_k_full_asked_at_an_unrecorded_step_keeps_its_loop_state(tmp_path):
    """``recovery_every=5`` pins a full every 5 steps from attach. A full the runtime asks for (a gap, a lost or
    re-placed replica) at an unrecorded step, whose loop state was not captured, is taken at the next step with
    its RNG and extra state: restoring it continues the dropout loop bit for bit (before, the full was taken at
    once without them, and the resumed run drew other dropout masks)."""
    uri, steps = str(tmp_path / "ck"), 14
    ref = T.make_model("mlp_do")
    ref_opt = T.make_optimizer("adamw", ref)
    pos = T.Position()
    states = {}
    for s in range(steps):
        T.train_step("mlp_do", ref, ref_opt, None, s, reseed=False)
        states[s + 1] = (T.snapshot(ref, ref_opt), torch.get_rng_state())
    m = T.make_model("mlp_do")
    opt = T.make_optimizer("adamw", m)
    with ray_ckpt.Checkpointer(uri, m, opt, recovery_every=5, extra_state=pos, keep_fulls=0) as ck:
        assert (ck.budget.mode, ck.budget.k, ck.budget.recording) == ("every_k", 5, False)
        asks = iter([False] * 6 + [True])     # asked once, at step 7's finalization (unrecorded, no loop state)
        ck._sink.full_control = lambda: (False, next(asks, False))   # the sink asks (as a runtime would)
        for s in range(steps):
            pos.pos = s + 1                    # the batch this step takes (as a loader's position)
            T.train_step("mlp_do", m, opt, None, s, reseed=False)
    lineage, _ = load_lineage(open_storage(uri))
    fulls = sorted(mm.last_step for mm in lineage.manifests if mm.kind == "full")
    assert fulls == [0, 5, 8, 13, 14], fulls        # 8: the asked full, a step after the unrecorded step 7
    assert lineage.uncovered_steps(lineage.generations[-1]) == []
    for s in (8, 13):
        m2, p2 = T.make_model("mlp_do", seed=5), T.Position()
        o2 = T.make_optimizer("adamw", m2)
        assert ray_ckpt.restore(uri, m2, o2, step=s, extra_state=p2) == s and p2.pos == s
        T.assert_same(states[s][0], T.snapshot(m2, o2), f"step {s}")
        assert torch.equal(torch.get_rng_state(), states[s][1]), f"step {s}: RNG"
