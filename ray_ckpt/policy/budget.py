"""The overhead budget: measure what checkpointing costs the training process per step, and choose the recovery
granularity that keeps that cost within a share of the step time.

Pure (no torch, no Ray); the clocks are passed in. Where things run:

* :class:`StepMeter` on the training thread: :meth:`StepMeter.tick` once per optimizer step (a few float
  additions); every ``window_s`` seconds it reads the CPU clocks once and closes a *window* (:class:`Window`):
  mean step wall time, the capture hooks' time, the optimizer step's own time (what a LowDiff replay of one step
  costs), stalls, and the CPU checkpointing's background thread spent per step (the writer or sender: encoding,
  writes, hand-offs, actor calls). Its own clock, not the rest of the process: the process's other threads
  (gloo's or NCCL's communication threads, data loaders, Ray's own) work for training as much without
  checkpointing.
* :class:`BudgetPolicy`, a :class:`~ray_ckpt.policy.frequency.FrequencyPolicy` wrapping the cost-model policy:
  ``decide`` on the training thread (O(1)), :meth:`BudgetPolicy.observe` at each window close (O(1)).

The cost of a window is ``capture + other CPU`` per step (stalls are inside the capture: the hooks wait in
``submit``); the step without checkpointing is ``step - capture``. The fraction is ``cost / (step - capture)``.
Counting all of the background thread's CPU is conservative: on a machine with spare cores it runs beside the
training thread for free; on a loaded one (or under the interpreter lock) it does not.

Granularity (:attr:`BudgetPolicy.mode`):

* ``every_step`` — LowDiff: a record per step (the consumed gradient), the cost-model policy's fulls; the
  lost-work bound is one step;
* ``every_k`` — the measured per-step cost breaks the budget: no per-step records; a full checkpoint every
  ``k`` steps, taken by the trainer (the smallest ``k`` whose measured cost per step fits); every full is an
  exact recovery point, the steps between them are not recoverable (lost-work bound ``k`` steps);
* ``fulls_only`` — as ``every_k`` where ``k`` reaches the full interval the cost model chose for failures
  (nothing finer than its fulls fits the budget): ``k`` is longer when that is what meets the budget (up to
  ``max_k``), and the cost model's interval when no interval meets it.

A switch to ``every_step`` takes a full at once (the records start from it); a switch away closes the diff
batch. ``k`` follows the measured cost of a full (its snapshot on the training thread, and the process's other
CPU while fulls are handed over) with a hysteresis of 1.25x.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ray_ckpt.policy.frequency import StepContext, StepDecision

#: a step that took longer than this many times the previous window's mean step is a pause: its excess is not
#: step time (evaluation, a checkpoint of something else between steps)
PAUSE_FACTOR = 10.0
#: a choice of k within this factor of the one in force is not adopted
K_HYSTERESIS = 1.25
#: every_step is chosen again when its last measured cost is below this share of the budget
RETURN_SHARE = 0.8
#: every_step is left only when the cost of recording every step is over the budget in this many consecutive
#: windows: a single window can hold a pause of the whole process (a garbage collection in the writer thread)
OVER_WINDOWS = 2
#: ... or in one, when no window fitted the budget yet and it costs this many times the budget (a run's first
#: measurement: each further window recorded at such a cost is a large share of its steps paid for nothing)
FAR_OVER = 3.0


@dataclass(frozen=True)
class Window:
    """Per-step means over one measurement window (seconds, bytes)."""

    steps: int
    step_s: float          #: wall time between consecutive optimizer steps
    capture_s: float       #: the capture hooks on the training thread, wall time (stalls and full snapshots included)
    optimizer_s: float     #: the optimizer step itself (what replaying one step costs)
    stall_s: float         #: of capture_s, waiting for room in the sink (backpressure)
    other_cpu_s: float     #: CPU of checkpointing's background thread (writer or sender) per step
    fulls: int             #: full snapshots taken on the training thread in the window
    snapshot_s: float      #: their total time (inside capture_s)
    bytes: float           #: bytes handed to the sink per step
    recorded: bool         #: whether the window's steps were recorded (LowDiff records)
    #: the training thread's CPU in the capture hooks (without the time it was preempted or waited)
    capture_cpu_s: float = 0.0
    #: wall time per step with the pauses and waits for a core included (the cost model's step: pauses amortized)
    wall_s: float = 0.0

    @property
    def cost_s(self) -> float:
        """Checkpointing's cost to the training process per step: the hooks' CPU, the stalls, the other CPU."""
        return min(self.capture_s, self.capture_cpu_s + self.stall_s) + self.other_cpu_s

    @property
    def base_s(self) -> float:
        """The step without checkpointing (at least 1 µs)."""
        return max(1e-6, self.step_s - self.capture_s)

    @property
    def overhead(self) -> float:
        return self.cost_s / self.base_s

    def to_dict(self) -> dict:
        return {**asdict(self), "cost_s": self.cost_s, "base_s": self.base_s, "overhead": self.overhead}


class StepMeter:
    """Measures the training process's per-step figures (training thread; see the module docstring).

    ``clock``: wall seconds (perf_counter); ``cpu``: ``() -> (background_cpu, this_thread_cpu[, this_thread_waited])``,
    cumulative seconds: checkpointing's background CPU (its writer or sender thread), the training thread's CPU and
    the seconds this thread waited for a core, where the system tells (not counted as step time); ``counters``:
    ``() -> (stall_seconds, bytes_handed_over)`` of the sink (cumulative). ``on_window`` gets each
    :class:`Window` (training thread)."""

    def __init__(self, *, clock, cpu, counters=None, window_s: float = 1.0, min_steps: int = 8, on_window=None,
                 first_short: bool = False):
        self.clock, self.cpu, self.counters = clock, cpu, counters
        self.window_s, self.min_steps = window_s, min_steps
        #: the first window closes after ``min_steps`` steps, whatever their time: it gives the step time a
        #: calibrated cost is compared with (:meth:`BudgetPolicy.calibrate`)
        self.first_short = first_short
        self.on_window = on_window
        self.last: Window | None = None        #: the latest window closed
        self.windows = 0
        self.pauses = 0                        #: steps whose wall time counted as a pause (see PAUSE_FACTOR)
        self.recording = True                  #: set by the capture: whether the current steps are recorded
        self._reset(first=True)

    def _reset(self, first: bool = False) -> None:
        self._n = 0
        self._wall = self._hook = self._opt = self._snap = self._hook_cpu = self._paused = 0.0
        self._fulls = 0
        self._mixed = False
        self._t0 = None if first else self._t0
        self._cpu0 = self.cpu()
        self._ctr0 = self.counters() if self.counters is not None else (0.0, 0.0)

    def full(self, seconds: float) -> None:
        """A full snapshot took ``seconds`` on the training thread (inside the hooks)."""
        self._fulls += 1
        self._snap += seconds

    def tick(self, wall_s: float, hook_s: float, optimizer_s: float, hook_cpu_s: float | None = None
             ) -> Window | None:
        """One optimizer step: ``wall_s`` since the previous step, ``hook_s`` in the capture hooks (``hook_cpu_s``
        of the training thread's CPU; None: as ``hook_s``), ``optimizer_s`` in ``optimizer.step()`` itself.
        Returns the window it closed, if any."""
        self._n += 1
        typical = self.last.step_s if self.last is not None else None
        if typical is not None and wall_s > PAUSE_FACTOR * typical:
            # a pause between steps (evaluation, a checkpoint of something else, another model's steps): not step
            # time; the step itself is taken as typical
            self._paused += wall_s - typical
            self.pauses += 1
        self._wall += wall_s
        self._hook += hook_s
        self._hook_cpu += hook_s if hook_cpu_s is None else hook_cpu_s
        self._opt += optimizer_s
        if self._n < self.min_steps or (self._wall - self._paused < self.window_s
                                        and not (self.first_short and self.windows == 0)):
            return None
        c1 = self.cpu()
        b1, b0 = c1[0], self._cpu0[0]
        # the training thread's time waiting for a core (preempted: an oversubscribed machine), when the clock
        # gives it: not step time either, or the budget would be measured against a step the machine slowed
        waited = max(0.0, c1[2] - self._cpu0[2]) if len(c1) > 2 and len(self._cpu0) > 2 else 0.0
        if self._wall > 0:   # the waits during pauses are not the steps' (read once a window: pro rata)
            waited *= (self._wall - self._paused) / self._wall
        waited = min(waited, 0.9 * max(0.0, self._wall - self._paused - self._hook))
        stall1, bytes1 = self.counters() if self.counters is not None else (0.0, 0.0)
        stall0, bytes0 = self._ctr0
        n = self._n
        w = Window(steps=n, step_s=(self._wall - self._paused - waited) / n, capture_s=self._hook / n, optimizer_s=self._opt / n,
                   stall_s=max(0.0, stall1 - stall0) / n,
                   other_cpu_s=max(0.0, b1 - b0) / n, fulls=self._fulls, snapshot_s=self._snap,
                   bytes=max(0.0, bytes1 - bytes0) / n, recorded=self.recording, capture_cpu_s=self._hook_cpu / n,
                   wall_s=self._wall / n)
        self.last = w
        self.windows += 1
        self._reset()
        if self.on_window is not None:
            self.on_window(w)
        return w


class BudgetPolicy:
    """The overhead budget over a frequency policy (``inner``: the cost model's fulls and batches).

    ``decide`` on the training thread, O(1); :meth:`observe` (a closed :class:`Window`) on the training thread
    at most once a window. ``budget``: the share of the step time checkpointing may cost (0 turns the budget
    off: every step is recorded). ``granular``: whether the capture can leave steps unrecorded (LowDiff);
    other strategies are only measured. ``max_k``: the longest interval between recovery points.
    ``on_change(report)``: called when the granularity changes (training thread). ``draining()``: whether a drain
    notice (a preemption) asks for every step to be recorded now (O(1), read once per step; the sink's
    ``drain_due``: within a margin of the deadline): from then on every step is recorded whatever it costs, so
    that the steps up to the deadline are recovery points (zero loss); a withdrawn notice brings back the
    granularity from before it. ``pin`` (``recovery_every``): 0 lets the budget choose; 1 records every step; k >= 2
    records a full every k steps from the start, whatever the windows measure (drain notices still apply)."""

    def __init__(self, inner, budget: float, *, granular: bool = True, max_k: int = 10_000, warmup: int = 1,
                 on_change=None, draining=None, pin: int = 0):
        if not 0 <= budget < 10:
            raise ValueError(f"overhead_budget must be in [0, 10), got {budget}")
        if not (isinstance(pin, int) and pin >= 0):
            raise ValueError(f"recovery_every must be an int >= 0, got {pin!r}")
        self.inner, self.budget, self.granular, self.max_k = inner, budget, granular, max_k
        self.warmup = warmup
        self.on_change = on_change
        self.mode = "every_step"
        self.k = 1
        self.recording = True            #: whether the capture copies the next step's gradients
        self._switch_to: str | None = None
        self.step_cost: float | None = None   #: cost per step of recording every step (seconds, latest measured)
        self.full_cost: float | None = None   #: cost of one trainer full (seconds of training-process time)
        self.base_s: float | None = None
        self.overhead: float | None = None    #: the latest window's measured fraction
        self.reason = "measuring (every step recorded until a window of steps is measured)"
        self.changes: list = []
        self._seen = 0
        self._snapshot_hint: float | None = None
        self._bytes_hint: float | None = None
        self._bytes_per_step: float | None = None
        self._k_cost, self._k_fulls = 0.0, 0
        #: cost per step of an unrecorded step (its loop state, for the full it may become), seconds
        self.fixed_cost: float | None = None
        self._unmet = False   #: the latest choice found no interval (up to max_k) that meets the budget
        self._allowed = 0.0   #: the cost per step the budget allowed at the latest choice (seconds)
        self._cf_used = 0.0   #: the cost of a full the latest choice assumed (seconds)
        #: the run's observed mean time between failures (seconds; from its previous attempt, see resume): k is
        #: never longer than the Young/Daly interval it gives, where lost work outweighs the fulls saved
        self.mtbf_s: float | None = None
        self._over = 0        #: consecutive windows whose every-step cost broke the budget
        self._fitted = False  #: a window recorded every step within the budget (after the warm-up)
        self._tail = False    #: the next unrecorded window follows a switch away from every_step
        self._quiet = False   #: the latest unrecorded window held no full
        #: the background thread's CPU per step while no full is handed over (seconds; its polls and reports)
        self._idle_other: float | None = None
        #: what recording one step costs, measured at attach (:meth:`calibrate`; seconds), or None
        self.calibrated: float | None = None
        self._pre_drain: tuple | None = None   #: (mode, k) when a drain notice came
        self.draining = draining
        self._drained = False  #: every step recorded because of a drain notice (until it is withdrawn)
        #: the granularity pinned by recovery_every (0: the budget chooses; only for a granular capture)
        self.pin = pin if granular else 0
        if self.pin == 1:
            self.reason = "recovery_every=1: every step recorded (the budget only measures)"
        elif self.pin >= 2:
            self.mode, self.k, self.recording = "every_k", self.pin, False
            self.reason = f"recovery_every={self.pin}: a full every {self.pin} steps (pinned; the budget only measures)"
            self.changes.append({"mode": self.mode, "k": self.k, "reason": self.reason})

    # the cost model's values, for stats() and the capture
    @property
    def full_every(self) -> int:
        return self.k if self.mode != "every_step" else self.inner.full_every

    @property
    def batch_steps(self) -> int:
        return self.inner.batch_steps

    @property
    def lost_work_steps(self) -> int:
        return max(1, self.k)

    # -- across restarts ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What the next attempt of this run starts from (:meth:`resume`): the granularity in force and the costs
        it was chosen on (JSON-able, small). Any thread."""
        mode, k = self._pre_drain if self._drained and self._pre_drain is not None else (self.mode, self.k)
        # (under a drain notice: the granularity measured before it, which the attempt after the drain resumes)
        return {"mode": mode, "k": k, "budget": self.budget, "step_cost": self.step_cost,
                "full_cost": self.full_cost, "fixed_cost": self.fixed_cost, "base_s": self.base_s}

    def resume(self, state: dict | None) -> bool:
        """Start from a previous attempt's :meth:`state` (training thread, before the first step): a run that
        restarts keeps the granularity it measured instead of recording every step again until it has measured
        the same costs once more (after a restart every step is dearer: fulls are secured, the replica catches
        up). Ignored (False) with another budget, a strategy that is only measured, or a malformed state. The
        costs are measured again as the steps go on: every_step returns as before, when the recorded steps'
        cost (the one remembered, until every step is recorded again) fits."""
        mtbf = (state or {}).get("mtbf_s")
        if isinstance(mtbf, (int, float)) and math.isfinite(mtbf) and mtbf > 0:
            self.mtbf_s = float(mtbf)
        if not state or not self.granular or self.budget <= 0 or self.pin or state.get("budget") != self.budget:
            return False
        mode, k = state.get("mode"), state.get("k")
        if mode not in ("every_k", "fulls_only") or not isinstance(k, int) or not 2 <= k <= self.max_k:
            return False
        for name in ("step_cost", "full_cost", "fixed_cost", "base_s"):
            v = state.get(name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                return False
        self.step_cost, self.full_cost = state.get("step_cost"), state.get("full_cost")
        self.fixed_cost, self.base_s = state.get("fixed_cost"), state.get("base_s")
        fk = self._failure_k(self.full_cost)
        if fk is not None and fk < k:
            k = fk
            mode = "fulls_only" if k >= self._k_cap() else "every_k"
        self.mode, self.k, self.recording = mode, k, False
        why = "resumed from the run's previous attempt"
        if self.step_cost is not None and self.base_s:
            why += (f": every step cost {_ms(self.step_cost)} of a {_ms(self.base_s)} step "
                    f"({_pct(self.step_cost / self.base_s)} > budget {_pct(self.budget)})")
        self.reason = f"{why}: a full every {k} steps" + self._failure_note(k)
        self.changes.append({"mode": mode, "k": k, "reason": self.reason})
        return True

    def _failure_k(self, full_cost: float | None) -> int | None:
        """The interval (steps) that balances a full's cost against the work a failure loses when the run fails
        every ``mtbf_s`` seconds (Young/Daly, ``sqrt(2 C M)``), at least 2; None while no failure was seen or a
        cost is unknown."""
        cf = full_cost if full_cost else self._snapshot_hint
        if not self.mtbf_s or not cf or not self.base_s:
            return None
        return max(2, round(math.sqrt(2.0 * cf * self.mtbf_s) / self.base_s))

    def _failure_note(self, k: int) -> str:
        fk = self._failure_k(self._cf_used or self.full_cost)
        if fk is None or k != fk:
            return ""
        return (f" (no coarser: the run fails every {self.mtbf_s:.0f} s; Young/Daly from a full's cost gives {fk} "
                "steps, and a longer interval would lose more work than its fulls save)")

    def hint_full(self, snapshot_s: float, nbytes: float) -> None:
        """The attach full: ``snapshot_s`` on the training thread for ``nbytes`` (training thread)."""
        self._snapshot_hint, self._bytes_hint = snapshot_s, nbytes

    @property
    def wants_calibration(self) -> bool:
        """Whether :meth:`calibrate` would be used (the budget chooses, and has not chosen yet)."""
        return self.granular and self.budget > 0 and not self.pin and self.mode == "every_step" and not self._seen

    def calibrate(self, step_cost: float) -> bool:
        """What recording one step costs the training process, measured at attach before the first step (one
        capture of the state's bytes and its hand-off's encode, timed on the training thread: see
        ``Checkpointer``). The first decision then comes from it, at the close of the first window — short: its
        steps give the step time (:class:`StepMeter` ``first_short``) — instead of from windows that record every
        step at full cost: over the budget, a full every k steps from there; within it, every step, as measured on
        (the windows that follow correct either). Ignored (False) when the budget does not choose (0, pinned, a
        strategy only measured) or a previous attempt's granularity was resumed. Training thread."""
        if not self.wants_calibration or not step_cost >= 0:
            return False
        self.calibrated = self.step_cost = float(step_cost)
        self.reason = f"calibrated at attach: a recorded step costs {_ms(step_cost)} (measuring the step time)"
        return True

    def _first_decision(self) -> None:
        """The first window's step time against the calibrated cost (see :meth:`calibrate`)."""
        cost, allowed = self.calibrated, self.budget * self.base_s
        self.calibrated = None
        why = (f"calibrated at attach: a recorded step costs {_ms(cost)} of a {_ms(self.base_s)} step "
               f"({_pct(cost / self.base_s)}")
        if cost <= allowed:
            self.reason = f"{why}, budget {_pct(self.budget)}): every step recorded"
            return
        self._set(self._k_for(allowed), f"{why} > budget {_pct(self.budget)})")
        self._switch_to = "every_k"
        self._tail = True     # the next unrecorded window still hands over the last recorded steps

    # -- training thread, per step ---------------------------------------------------------------------------
    def decide(self, ctx: StepContext) -> StepDecision:
        self._check_drain()
        record = self.recording
        switch, self._switch_to = self._switch_to, None
        if switch == "every_step":            # records resume after a full of this very step
            self.recording = True
            return StepDecision(full=True, close_batch=True, record=False)
        if not record:
            k = self.k
            return StepDecision(full=ctx.step - ctx.last_full_step >= k, close_batch=True, record=False)
        d = self.inner.decide(ctx)
        if switch is not None:                # the last recorded step: its batch goes now
            self.recording = False
            return StepDecision(full=d.full, close_batch=True, record=True)
        return d

    def needs_state(self, step: int, last_full_step: int) -> bool:
        """Whether step ``step``'s loop state must be captured (training thread, post-step hook, O(1)): always
        while recording; in the every-k modes only where a full may be taken (due, or a switch pending). A full
        that comes due anyway at a step captured without it (a full the coordinator asks for) is taken at the
        next step."""
        self._check_drain()
        return self.recording or self._switch_to is not None or step - last_full_step >= self.k

    def _check_drain(self) -> None:
        if self.draining is not None and self.draining() != self._drained:
            self._drain_changed()

    def _drain_changed(self) -> None:
        """A drain notice came (every step is recorded from this step on: a full of it, then its successors'
        records; :meth:`state` keeps the granularity from before it, which the attempt after the drain resumes) or
        went (that granularity again, or, when every step was recorded before, the budget's next windows).
        Training thread."""
        self._drained = not self._drained
        if not self._drained:
            self._over = 0
            before, self._pre_drain = self._pre_drain, None
            if before is not None and before[0] != "every_step" and self.recording:
                self._switch_to = "every_k"    # back to the interval measured before the notice
                self._tail = True
                self._change(before[0], before[1], f"drain notice withdrawn: a full every {before[1]} steps again")
            else:
                self.reason = "drain notice withdrawn: every step recorded until the budget measures a window"
            return
        self._pre_drain = (self.mode, self.k) if self._switch_to != "every_step" else None
        why = "drain notice: this node goes away at a deadline; every step recorded until then (zero loss)"
        if self._switch_to == "every_k":      # about to leave every_step: stays
            self._switch_to = None
            self._change("every_step", 1, why)
        elif not self.recording and self._switch_to is None:
            self._switch_to = "every_step"    # a full of this step, then a record of each one after it
            self._change("every_step", 1, why)
        else:
            self.reason = why

    # -- training thread, once a window ------------------------------------------------------------------------
    def observe(self, w: Window) -> None:
        self._seen += 1
        self.overhead = w.overhead
        if w.recorded and w.fulls == 0 and w.bytes > 0:
            self._bytes_per_step = w.bytes
        self.base_s = w.base_s if self.base_s is None else 0.7 * self.base_s + 0.3 * w.base_s
        if w.recorded:   # every step recorded: the mode's whole cost per step (its periodic fulls included)
            if self._seen > self.warmup:
                self.step_cost = w.cost_s if self.step_cost is None else 0.5 * self.step_cost + 0.5 * w.cost_s
            if w.fulls and self.full_cost is None:
                self._snapshot_hint = w.snapshot_s / w.fulls
        elif self._seen <= self.warmup or self._tail:
            # unrecorded, but the background thread still hands over what came before (the attach full, the last
            # recorded steps): not the cost of this mode's fulls
            self._tail = False
            self._quiet = True    # (the next window's background CPU is its own)
        else:            # unrecorded steps: the loop state's capture on every step (fixed), the rest is the fulls'
            # the background thread's CPU in a window without a full after one without a full either: what it
            # spends per step whatever k is (its polls and reports), not a full's (counted per step, as fixed)
            idle_window = w.fulls == 0 and self._quiet
            if idle_window:
                self._idle_other = (w.other_cpu_s if self._idle_other is None
                                    else 0.5 * self._idle_other + 0.5 * w.other_cpu_s)
            self._quiet = w.fulls == 0
            idle = self._idle_other or 0.0
            fixed = max(0.0, (w.cost_s - w.other_cpu_s) * w.steps - w.snapshot_s) / w.steps + idle
            self.fixed_cost = fixed if self.fixed_cost is None else 0.5 * self.fixed_cost + 0.5 * fixed
            # (accumulated until a full is seen; a window after a full's may hold the rest of its hand-off)
            self._k_cost += w.snapshot_s + (0.0 if idle_window else max(0.0, w.other_cpu_s - idle) * w.steps)
            self._k_fulls += w.fulls
            if self._k_fulls:
                c = self._k_cost / self._k_fulls
                self.full_cost = c if self.full_cost is None else 0.5 * self.full_cost + 0.5 * c
                self._k_cost, self._k_fulls = 0.0, 0
        if self.calibrated is not None and not self._drained and self.mode == "every_step":
            self._first_decision()
            return
        if self._seen <= self.warmup or self.budget <= 0 or not self.granular or self.pin:
            if self.pin:
                pass   # the reason set at construction (or by a drain notice) stands
            elif self.budget <= 0:
                self.reason = "overhead_budget=0: every step recorded"
            elif not self.granular:
                self.reason = "measured only: this strategy records every step"
            return
        allowed = self.budget * self.base_s
        if self._drained:                     # every step recorded until the node is gone or the notice withdrawn
            return
        if self.mode == "every_step":
            fits = self.step_cost is None or self.step_cost <= allowed
            self._fitted = self._fitted or w.cost_s <= allowed
            if fits or not w.cost_s > allowed:   # (over on average only: a pause fading out of the average)
                self._over = 0
                cost = self.step_cost or w.cost_s
                self.reason = (f"every step fits: {_ms(cost)} per step of {_ms(self.base_s)} "
                               f"({_pct(cost / self.base_s)}, budget {_pct(self.budget)})" if fits else
                               f"every step costs {_ms(self.step_cost)} on average, {_ms(w.cost_s)} in the latest "
                               f"window of a {_ms(self.base_s)} step: measuring another")
                return
            self._over += 1
            far = not self._fitted and w.cost_s > FAR_OVER * allowed and self.step_cost > FAR_OVER * allowed
            if self._over < OVER_WINDOWS and not far:   # one window may hold a pause of the whole process
                self.reason = (f"every step costs {_ms(self.step_cost)} of a {_ms(self.base_s)} step, over the "
                               f"budget in {self._over} window: measuring another")
                return
            k = self._k_for(allowed)
            self._set(k, f"every step costs {_ms(self.step_cost)} of a {_ms(self.base_s)} step "
                         f"({_pct(self.step_cost / self.base_s)} > budget {_pct(self.budget)})")
            self._switch_to = "every_k"
            self._tail = True     # the next unrecorded window still hands over the last recorded steps
            return
        if self.step_cost is not None and self.step_cost <= RETURN_SHARE * allowed:
            self._switch_to = "every_step"
            self._change("every_step", 1, f"every step fits again: {_ms(self.step_cost)} per step of "
                                          f"{_ms(self.base_s)} ({_pct(self.step_cost / self.base_s)})")
            return
        k = self._k_for(allowed)
        if not (self.k / K_HYSTERESIS <= k <= self.k * K_HYSTERESIS or abs(k - self.k) <= 1):
            full = (_ms(self.full_cost) if self.full_cost is not None
                    else f"{_ms(self._cf_used)} (estimated: no full measured yet)")
            self._set(k, f"a full costs {full} of training-process time, an unrecorded step "
                         f"{_ms(self.fixed_cost or 0.0)}")

    def _k_for(self, allowed: float) -> int:
        cf = self.full_cost
        if cf is None:   # not measured as such yet: the attach snapshot, plus the other CPU in proportion to bytes
            cf = self._snapshot_hint or 0.0
            if self._bytes_hint and self._bytes_per_step and self.step_cost is not None:
                cf += self.step_cost * self._bytes_hint / self._bytes_per_step
            cf = max(cf, self.step_cost or 0.0)
        self._cf_used = cf
        room = allowed - (self.fixed_cost or 0.0)   # what the fulls may cost per step
        self._allowed = allowed
        if room <= 0:      # no interval meets the budget: the cost model's fulls (see _k_cap)
            self._unmet = True
            fk = self._failure_k(cf)
            return self._k_cap() if fk is None else min(self._k_cap(), fk)
        k = max(2, math.ceil(cf / room))
        self._unmet = k > self.max_k
        k = int(min(self.max_k, k))
        fk = self._failure_k(cf)
        return k if fk is None else min(k, fk)

    def _k_cap(self) -> int:
        """The fulls the cost model chose for failures (its Young/Daly-style interval), never beyond ``max_k``: the
        interval taken when no interval meets the budget (the unrecorded steps alone break it), since a longer one
        would lose more work and still miss. When the budget is met only by a longer interval, the budget decides
        (up to ``max_k``): it is the user's promise."""
        fe = getattr(self.inner, "full_every", None)
        return max(2, min(self.max_k, int(fe))) if fe else self.max_k

    def _set(self, k: int, why: str) -> None:
        cap = self._k_cap()
        mode = "fulls_only" if k >= cap else "every_k"
        if self._unmet and k == cap and k < self.max_k:
            why += (f" (the budget cannot be met: an unrecorded step alone costs {_ms(self.fixed_cost or 0.0)} of "
                    f"the {_ms(self._allowed)} per step it allows, {_pct(self.budget)} of a {_ms(self.base_s or 0.0)} "
                    f"step; recovery points at the cost model's full interval, {cap} steps)")
        elif self._unmet:
            why += f" (the budget cannot be met within max_full_every={self.max_k} steps)"
        elif k > cap:
            why += (f" (coarser than the cost model's full interval of {cap} steps: the budget decides; "
                    f"a failure loses up to {k} steps)")
        self._change(mode, k, f"{why}: a full every {k} steps" + self._failure_note(k))

    def _change(self, mode: str, k: int, why: str) -> None:
        self.mode, self.k = mode, k
        self.reason = why
        self.changes.append({"mode": mode, "k": k, "reason": why})
        del self.changes[:-20]
        if self.on_change is not None:
            self.on_change(self.report())

    def report(self) -> dict:
        """The granularity in force and why (JSON-able). Any thread."""
        return {"mode": self.mode, "k": self.k, "lost_work_steps": self.lost_work_steps,
                "overhead_budget": self.budget, "measured_overhead": self.overhead,
                "step_cost_s": self.step_cost, "full_cost_s": self.full_cost,
                "unrecorded_step_cost_s": self.fixed_cost, "base_step_s": self.base_s,
                "reason": self.reason, "changes": list(self.changes)}

    # forwarded to the cost-model policy (stats, the local feed)
    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


# -- writes in proportion ------------------------------------------------------------------------------------------
#: durable_diffs="auto" writes every step's diff while that needs at most this share of the storage's measured
#: write bandwidth (the rest is left to fulls, other runs and bursts)
DURABLE_SHARE = 0.25
#: diffs at fewer bytes per second than this are always written (the bandwidth measured from a trickle of small
#: objects is mostly their per-request latency, and such a trickle never crowds a storage)
MIN_DURABLE_RATE = 8e6


def choose_durable(current: str, *, diff_rate: float, write_bw: float | None) -> tuple[str, str]:
    """``(mode, reason)`` of ``durable_diffs="auto"``: ``"all"`` while the diffs handed over (``diff_rate``,
    bytes/s) need at most :data:`DURABLE_SHARE` of the measured write bandwidth (``write_bw``, bytes/s; None:
    not measured yet, so ``current`` stays), else ``"fulls"`` (the memory tier on two nodes plus the fulls); back
    to ``"all"`` below half that share. Any thread; pure."""
    if write_bw is None or write_bw <= 0:
        return current, "write bandwidth not measured yet"
    need = diff_rate / write_bw
    text = (f"diffs need {diff_rate / 1e6:.1f} MB/s of a measured {write_bw / 1e6:.0f} MB/s "
            f"({100 * need:.0f} %, limit {100 * DURABLE_SHARE:.0f} %)")
    if diff_rate < MIN_DURABLE_RATE:
        return "all", text + f"; under {MIN_DURABLE_RATE / 1e6:.0f} MB/s: always written"
    if current == "all" and need > DURABLE_SHARE:
        return "fulls", text
    if current == "fulls" and need < DURABLE_SHARE / 2:
        return "all", text
    return current, text
