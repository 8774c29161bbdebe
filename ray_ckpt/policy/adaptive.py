"""The adaptive checkpoint policy: choose the full-checkpoint interval and the diff batch size that minimise the
expected time lost per hour, from the running cost model (:mod:`ray_ckpt.policy.cost`).

Pure: no torch, no Ray. Where things run: :meth:`AdaptivePolicy.decide` on the training thread (O(1): it only
compares the step with the two current integers); :class:`PolicyTuner` (observations, :func:`optimize`) in the
coordinator actor (runtime="ray") or the writer thread (runtime="local"), never on the training thread.

Model (``N`` = steps between durable fulls, ``B`` = steps per diff object, ``T`` = step time, ``M`` = MTBF)::

    lost/hour = 3600 * [ overhead + recovery / M ]
    overhead  = (c_f + k*p_f) / (N*T)                    full: training-thread snapshot + k * persistence time
              + (c_d + k*(lat/B + d/bw)) / T             per-step capture + k * per-object write cost
    recovery  = R + L + c_f + k*p_f                      restart, load the full, re-attach (takes a full)
              + r*N/2                                    replay: on average half an interval of steps
              + T*B/2 + lat + B*d/bw                     lost steps: half a batch, plus the batch in flight

with ``k`` the share of persistence-tier time that slows training (background_cost: shared cores and I/O).
Minimising ``c/(N*T) + r*N/(2M)`` over ``N`` gives ``N*T = sqrt(2*c*M*T/r)``: with replay as slow as
re-execution (``r = T``) and ``c = c_f + k*p_f`` this is Young's interval ``sqrt(2*C*M)``; LowDiff's replay is
faster than a training step (``r < T``), so the optimum interval is longer by ``sqrt(T/r)``.

Constraints: ``1 <= B <= N <= max_full_every``; memory: ``B*d + F <= memory_budget`` (captured bytes not yet
durable); requests: ``2*(1/B + 1/N)*3600/T <= request_budget`` PUTs per hour (object + manifest); throughput:
the persistence tier's time per step ``p_f/N + lat/B + d/bw`` at most ``max_utilization*T`` (else it falls
behind and the training thread stalls).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ray_ckpt.lineage.layout import POLICY_REPORT_KEY
from ray_ckpt.policy.cost import CostInputs, CostModel
from ray_ckpt.policy.frequency import StepContext, StepDecision


# -- the model --------------------------------------------------------------------------------------------------
def expected_loss(c: CostInputs, full_every: int, batch_steps: int) -> dict:
    """Expected lost seconds per hour of ``(full_every, batch_steps)`` under ``c``, with its parts."""
    n, b = float(full_every), float(min(batch_steps, full_every))
    k = c.background_cost
    full_cost = c.full_block_s + k * c.full_persist_s
    overhead = full_cost / (n * c.step_s) + (c.diff_block_s + k * (c.write_latency_s / b
                                                                   + c.diff_bytes / c.write_bw)) / c.step_s
    lag = c.write_latency_s + b * c.diff_bytes / c.write_bw
    recovery = (c.restart_s + c.load_s + full_cost + c.replay_s * n / 2 + c.step_s * b / 2 + lag)
    return {"lost_s_per_hour": 3600.0 * (overhead + recovery / c.mtbf_s),
            "overhead_s_per_hour": 3600.0 * overhead,
            "failure_s_per_hour": 3600.0 * recovery / c.mtbf_s,
            "recovery_s": recovery}


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval (seconds of work between checkpoints) for a checkpoint
    costing ``checkpoint_s`` and exponential failures with mean ``mtbf_s`` (Daly 2006, FGCS 22(3)); it reduces
    to Young's ``sqrt(2*C*M)`` (1974) for small ``C/M``."""
    if checkpoint_s <= 0:
        return math.inf
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def young_daly_full_every(c: CostInputs, max_full_every: int = 100_000) -> int:
    """Young/Daly's interval in steps, from the full's cost on the training path and the MTBF."""
    t = young_daly_interval(c.full_block_s + c.background_cost * c.full_persist_s, c.mtbf_s)
    return int(min(max_full_every, max(1, round(t / c.step_s)))) if math.isfinite(t) else max_full_every


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Constraints of :func:`optimize` (0 = none)."""

    max_full_every: int = 10_000
    max_batch_steps: int = 1000
    memory_budget: float = 0.0        #: bytes of captured-but-not-durable state allowed
    request_budget: float = 0.0       #: storage PUT requests per hour allowed
    max_utilization: float = 0.8      #: of the persistence tier


@dataclass(frozen=True)
class PolicyChoice:
    """A decision: the interval and batch, the loss it expects, the inputs it was made from and why."""

    full_every: int
    batch_steps: int
    lost_s_per_hour: float
    young_daly_full_every: int
    reason: str
    inputs: CostInputs
    feasible: bool = True

    def to_dict(self) -> dict:
        return {"full_every": self.full_every, "batch_steps": self.batch_steps,
                "lost_s_per_hour": self.lost_s_per_hour, "young_daly_full_every": self.young_daly_full_every,
                "reason": self.reason, "feasible": self.feasible, "inputs": self.inputs.to_dict()}


def _violation(c: CostInputs, lim: Limits, n: int, b: int) -> float:
    """0 when ``(n, b)`` meets every limit, else the sum of relative excesses."""
    v = 0.0
    if lim.memory_budget > 0:
        v += max(0.0, (b * c.diff_bytes + c.full_bytes) / lim.memory_budget - 1)
    if lim.request_budget > 0:
        v += max(0.0, 2 * (1 / b + 1 / n) * 3600 / c.step_s / lim.request_budget - 1)
    if lim.max_utilization > 0:
        busy = c.full_persist_s / n + c.write_latency_s / b + c.diff_bytes / c.write_bw
        v += max(0.0, busy / (lim.max_utilization * c.step_s) - 1)
    return v


def _grid(hi: int, around: list[float]) -> list[int]:
    pts = {1, hi}
    x = 1.0
    while x < hi:
        pts.add(int(round(x)))
        x *= 1.08
    for a in around:
        if math.isfinite(a):
            for d in range(-3, 4):
                pts.add(int(round(a)) + d)
    return sorted(p for p in pts if 1 <= p <= hi)


def _loss(c: CostInputs, n: float, b: float) -> float:
    """:func:`expected_loss`'s total, inlined (the optimizer evaluates it a few hundred times)."""
    k = c.background_cost
    full_cost = c.full_block_s + k * c.full_persist_s
    per_b = c.diff_bytes / c.write_bw
    overhead = full_cost / (n * c.step_s) + (c.diff_block_s + k * (c.write_latency_s / b + per_b)) / c.step_s
    recovery = (c.restart_s + c.load_s + full_cost + c.replay_s * n / 2 + c.step_s * b / 2
                + c.write_latency_s + b * per_b)
    return 3600.0 * (overhead + recovery / c.mtbf_s)


def _argmin_int(f, hi: int, around: float) -> int:
    """The integer in ``[1, hi]`` minimising the unimodal ``f``, searched near ``around`` and on a log grid."""
    cands = _grid(hi, [around])
    best = min(cands, key=f)
    lo_, hi_ = max(1, int(best / 1.1) - 1), min(hi, int(best * 1.1) + 2)
    return min(range(lo_, hi_ + 1), key=f)


def optimize(c: CostInputs, limits: Limits = Limits()) -> PolicyChoice:
    """The ``(full_every, batch_steps)`` of least :func:`expected_loss` within ``limits`` (when nothing fits,
    the least violation, marked ``feasible=False``).

    The loss is a sum of a term in ``N`` and a term in ``B``: each is minimised on its own (closed-form
    neighbourhood + log grid + integer refinement); only when that pair breaks a limit does a 2-D search over
    the grid run, which costs more: the constrained case is the slow one.
    """
    k = c.background_cost
    cf = c.full_block_s + k * c.full_persist_s
    n_star = math.sqrt(2 * cf * c.mtbf_s / (c.step_s * max(c.replay_s, 1e-12))) if cf > 0 else math.inf
    per_b = c.step_s / 2 + c.diff_bytes / c.write_bw      # recovery seconds per batch step, per failure
    b_star = math.sqrt(k * c.write_latency_s * c.mtbf_s / c.step_s / per_b) if per_b > 0 else math.inf
    bmax = min(limits.max_batch_steps, limits.max_full_every)
    n = _argmin_int(lambda n: _loss(c, n, 1.0), limits.max_full_every, n_star)
    b = _argmin_int(lambda b: _loss(c, n, b), min(bmax, n), b_star)
    if _violation(c, limits, n, b) > 0:
        ns = _grid(limits.max_full_every, [n_star, n])
        bs = _grid(bmax, [b_star, b])

        def key(nb):
            return (_violation(c, limits, *nb), _loss(c, *nb))

        best = min(((n_, b_) for n_ in ns for b_ in bs if b_ <= n_), key=key)
        for _ in range(50):  # coordinate refinement on integers
            n0, b0 = best
            cands = [(n_, b0) for n_ in range(max(b0, int(n0 / 1.1) - 1),
                                              min(limits.max_full_every, int(n0 * 1.1) + 2) + 1)]
            cands += [(n0, b_) for b_ in range(max(1, int(b0 / 1.1) - 1), min(n0, bmax, int(b0 * 1.1) + 2) + 1)]
            nxt = min(cands + [best], key=key)
            if nxt == best:
                break
            best = nxt
        n, b = best
    viol = _violation(c, limits, n, b)
    yd = young_daly_full_every(c, limits.max_full_every)
    return PolicyChoice(full_every=n, batch_steps=b, lost_s_per_hour=_loss(c, n, b), young_daly_full_every=yd,
                        reason=_reason(c, limits, n, b, yd, viol), inputs=c, feasible=viol == 0)


def _fmt_s(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def _reason(c: CostInputs, lim: Limits, n: int, b: int, yd: int, viol: float) -> str:
    k = c.background_cost
    parts = [f"full every {n} steps (Young/Daly: {yd}): a full costs {_fmt_s(c.full_block_s)} on the training "
             f"thread + {k:g} x {_fmt_s(c.full_persist_s)} in the persistence tier; replay {_fmt_s(c.replay_s)}/step "
             f"vs a {_fmt_s(c.step_s)} step; MTBF {_fmt_s(c.mtbf_s)} (weight {c.mtbf_failures:.1f} failures)",
             f"batch {b} steps: {_fmt_s(c.write_latency_s)} per object at {c.write_bw / 1e6:.0f} MB/s, "
             f"{c.diff_bytes / 1e3:.1f} kB/step"]
    if n >= lim.max_full_every:
        parts.append(f"interval capped at max_full_every={lim.max_full_every}")
    if viol > 0:
        parts.append("NO choice meets the limits (memory/requests/throughput): least violation taken")
    elif lim.request_budget > 0 or lim.memory_budget > 0:
        parts.append("within the memory/request budgets")
    e = expected_loss(c, n, b)
    parts.append(f"expected loss {e['lost_s_per_hour']:.1f} s/h ({e['overhead_s_per_hour']:.1f} overhead + "
                 f"{e['failure_s_per_hour']:.1f} failures)")
    return "; ".join(parts)


# -- the policy the capture consults ------------------------------------------------------------------------------
class AdaptivePolicy:
    """A :class:`~ray_ckpt.policy.frequency.FrequencyPolicy` whose ``full_every``/``batch_steps`` are updated by
    :meth:`apply` (from a :class:`PolicyTuner`, off the training thread). ``decide`` runs on the training thread:
    O(1), the fixed rule with the current values, plus one step-time observation for the tuner.

    ``pinned`` names the values the user set explicitly: they never change; the tuner's choice is only reported.
    """

    def __init__(self, full_every: int, batch_steps: int, *, pinned: frozenset = frozenset(),
                 clock=None):
        if full_every < 1 or batch_steps < 1:
            raise ValueError(f"full_every and batch_steps must be >= 1, got {full_every}, {batch_steps}")
        unknown = set(pinned) - {"full_every", "batch_steps"}
        if unknown:
            raise ValueError(f"only full_every and batch_steps can be pinned, not {sorted(unknown)}")
        self.full_every, self.batch_steps, self.pinned = full_every, batch_steps, frozenset(pinned)
        self.tuner: PolicyTuner | None = None
        self._clock = clock
        self._last_t: float | None = None

    def decide(self, ctx: StepContext) -> StepDecision:
        """Training thread, once per step: O(1)."""
        if self.tuner is not None and self._clock is not None:
            t = self._clock()
            if self._last_t is not None:
                self.tuner.model.observe_step(t - self._last_t)
            self._last_t = t
        n, b = self.full_every, self.batch_steps
        full = ctx.step % n == 0 or ctx.step - ctx.last_full_step >= n
        return StepDecision(full=full, close_batch=full or ctx.steps_in_batch >= b)

    def apply(self, choice: PolicyChoice) -> None:
        """Adopt ``choice`` for what is not pinned (any thread: two int stores)."""
        if "full_every" not in self.pinned:
            self.full_every = choice.full_every
        if "batch_steps" not in self.pinned:
            self.batch_steps = max(1, min(choice.batch_steps, self.full_every))

    def __getstate__(self):  # shipped to training processes without the tuner and its clock
        return {"full_every": self.full_every, "batch_steps": self.batch_steps, "pinned": self.pinned}

    def __setstate__(self, s):
        self.__init__(s["full_every"], s["batch_steps"], pinned=s["pinned"])


#: a new choice within this factor of the one in force is not adopted (unless a failure or restore arrived)
HYSTERESIS = 1.25


def _near(new: int, old: int) -> bool:
    return old / HYSTERESIS <= new <= old * HYSTERESIS or abs(new - old) <= 1


@dataclass
class PolicyTuner:
    """Feeds a :class:`CostModel` and re-optimizes; the owner (coordinator or writer thread) calls it.

    Call order: ``observe_*`` as events arrive; :meth:`decide` (re-optimizes when enough is known:
    ``min_commits`` commits, at most every ``min_interval_s`` unless a failure arrived) returns the current
    :class:`PolicyChoice` and applies it to ``policy`` when one is attached; a new choice within
    :data:`HYSTERESIS` of the one in force is not adopted, unless a failure or a restore made it due.
    :meth:`report` for stats/inspect.
    """

    model: CostModel
    limits: Limits = Limits()
    full_every: int = 100
    batch_steps: int = 10
    pinned: frozenset = frozenset()
    min_commits: int = 3
    min_interval_s: float = 5.0
    policy: AdaptivePolicy | None = None
    history: list = field(default_factory=list)  #: the latest decisions that changed something
    choice: PolicyChoice | None = None
    _commits: int = 0
    _dirty: bool = False
    _last_opt: float = -math.inf

    def __post_init__(self):
        if self.policy is not None:
            self.policy.tuner = self

    # -- observations ---------------------------------------------------------------------------------------
    def observe_commit(self, **kw) -> None:
        """See :meth:`CostModel.observe_commit`."""
        self.model.observe_commit(**kw)
        self._commits += 1

    def observe_failure(self, at: float) -> None:
        self.model.observe_failure(at)
        self._dirty = True

    def observe_trainer(self, **window) -> None:
        """A window measured in the training process (see :meth:`CostModel.observe_trainer`); the first one
        makes a choice made from the defaults due at once (its step time was a placeholder)."""
        first = self.model.step.n == 0
        self.model.observe_trainer(**window)
        if first and self.choice is not None and self.model.step.n > 0:
            self._dirty = True

    def observe_restore(self, **kw) -> None:
        self.model.observe_restore(**kw)
        self._dirty = True

    # -- decisions ------------------------------------------------------------------------------------------
    def decide(self, now: float, force: bool = False) -> PolicyChoice | None:
        """Re-optimize if due; returns the current choice (None until enough was observed)."""
        due = force or self._dirty or now - self._last_opt >= self.min_interval_s
        if self._commits < self.min_commits and not force and not self._dirty:
            return self.choice
        if not due:
            return self.choice
        dirty, self._dirty, self._last_opt = self._dirty, False, now
        c = optimize(self.model.inputs(now), self.limits)
        if self.pinned:
            n = self.full_every if "full_every" in self.pinned else c.full_every
            b = self.batch_steps if "batch_steps" in self.pinned else c.batch_steps
            applied = replace(c, full_every=n, batch_steps=min(b, n),
                              lost_s_per_hour=expected_loss(c.inputs, n, min(b, n))["lost_s_per_hour"],
                              reason=f"pinned by the user ({', '.join(sorted(self.pinned))}); the policy would "
                                     f"choose full_every={c.full_every}, batch_steps={c.batch_steps}: {c.reason}")
        else:
            applied = c
        prev = self.choice
        if prev is not None and not force and not dirty:
            # hysteresis, per value: the expected loss is flat near the optimum (Young/Daly's square root), while
            # every change of full_every can take a full at once; small moves of the estimates change nothing
            n = prev.full_every if _near(applied.full_every, prev.full_every) else applied.full_every
            b = prev.batch_steps if _near(applied.batch_steps, prev.batch_steps) else applied.batch_steps
            if (n, b) == (prev.full_every, prev.batch_steps):
                return prev
            if (n, b) != (applied.full_every, applied.batch_steps):
                b = min(b, n)
                applied = replace(applied, full_every=n, batch_steps=b,
                                  lost_s_per_hour=expected_loss(applied.inputs, n, b)["lost_s_per_hour"],
                                  reason=f"{applied.reason}; kept "
                                         + ("full_every" if n == prev.full_every else "batch_steps")
                                         + f" (within {HYSTERESIS:g}x of the value in force)")
        changed = (prev is None or applied.full_every != prev.full_every
                   or applied.batch_steps != prev.batch_steps)
        self.choice = applied
        self.full_every, self.batch_steps = applied.full_every, applied.batch_steps
        if changed:
            self.history.append({"time": now, "full_every": applied.full_every,
                                 "batch_steps": applied.batch_steps, "reason": applied.reason})
            del self.history[:-20]
        if self.policy is not None:
            self.policy.apply(applied)
        return applied

    def current(self) -> tuple[int, int]:
        """``(full_every, batch_steps)`` in force."""
        return self.full_every, self.batch_steps

    def report(self, now: float) -> dict:
        """What the policy decided, from what, and why (JSON-able): for ``stats()`` and ``ray-ckpt inspect``."""
        c = self.choice
        out = {"full_every": self.full_every, "batch_steps": self.batch_steps,
               "pinned": sorted(self.pinned), "failures_seen": len(self.model.failures),
               "estimates": self.model.uncertainty(now), "history": list(self.history)}
        if c is None:
            out["reason"] = (f"defaults until {self.min_commits} commits are observed "
                             f"({self._commits} so far)")
        else:
            out.update(reason=c.reason, lost_s_per_hour=c.lost_s_per_hour,
                       young_daly_full_every=c.young_daly_full_every, feasible=c.feasible,
                       inputs=c.inputs.to_dict())
        return out


# -- glue for the owners (coordinator actor, local writer thread) and readers (stats, CLI) ---------------------


def make_tuner(full_every: int, batch_steps: int, *, pinned=frozenset(), mtbf_hint: float = 86400.0,
               background_cost: float = 0.25, request_budget: float = 0.0, max_full_every: int = 10_000,
               memory_budget: float = 0.0, started_at: float = 0.0,
               policy: AdaptivePolicy | None = None) -> PolicyTuner:
    """A :class:`PolicyTuner` from the :class:`~ray_ckpt.config.CheckpointConfig` knobs (any process)."""
    model = CostModel(mtbf_hint=mtbf_hint, background_cost=background_cost, started_at=started_at)
    limits = Limits(max_full_every=max_full_every, max_batch_steps=min(1000, max_full_every),
                    memory_budget=memory_budget, request_budget=request_budget)
    return PolicyTuner(model, limits=limits, full_every=full_every, batch_steps=batch_steps,
                       pinned=frozenset(pinned), policy=policy)


class CommitFeed:
    """runtime="local": the adaptive policy inside the training process, fed by the writer thread's commits.

    :attr:`policy` goes to the capture (its ``decide`` runs on the training thread, O(1)). :meth:`observe` is the
    writer's commit callback (writer thread): it feeds the cost model the persistence time spent since the previous
    commit, re-decides (rate-limited, :meth:`PolicyTuner.decide`) and publishes the report to ``storage`` when the
    choice changed. ``options``: the keywords of :func:`make_tuner` (``CheckpointConfig.policy_options()``). Built
    at attach, in the training thread."""

    def __init__(self, storage, full_every: int, batch_steps: int, *, pinned=frozenset(), **options):
        # the step time comes from the training thread's measurement windows (:meth:`observe_window`)
        self.policy = AdaptivePolicy(full_every, batch_steps, pinned=pinned)
        self.tuner = make_tuner(full_every, batch_steps, pinned=pinned, started_at=time.time(), policy=self.policy,
                                **options)
        self.storage = storage
        self._seen = (0.0, 0.0)

    def observe(self, m, sink, capture=None) -> None:
        """Writer thread: manifest ``m`` was committed by ``sink`` (its cumulative ``stats`` and its
        ``pending_bytes`` are read); ``capture``: the attach's capture (None while it is built), whose
        ``last_snapshot_seconds`` is what a full blocked the training thread."""
        st = sink.stats
        write_s, encode_s = st.write_seconds - self._seen[0], st.encode_seconds - self._seen[1]
        self._seen = (st.write_seconds, st.encode_seconds)
        block = capture.last_snapshot_seconds if (m.kind == "full" and capture is not None) else None
        self.tuner.observe_commit(kind=m.kind, nbytes=m.nbytes, write_s=write_s, encode_s=encode_s,
                                  steps=m.last_step - m.first_step + 1, block_s=block)
        self.tuner.model.observe_memory("writer", sink.pending_bytes)
        before = len(self.tuner.history)
        now = time.time()
        self.tuner.decide(now)
        if len(self.tuner.history) != before:
            publish_report(self.storage, self.tuner.report(now))

    def observe_window(self, w) -> None:
        """Training thread: a measured window of steps (:class:`ray_ckpt.policy.budget.Window`) for the cost
        model: step time, capture, the optimizer step (replay) and the process's other CPU per step."""
        self.tuner.observe_trainer(**w.to_dict())

    def report(self) -> dict:
        """:meth:`PolicyTuner.report` now. Any thread."""
        return self.tuner.report(time.time())


def observe_manifest_commit(tuner: PolicyTuner, *, kind: str, first_step: int, last_step: int, nbytes: int,
                            created: float, now: float) -> None:
    """Coordinator: a durable commit report. The persistence-tier time is taken as ``now - created`` (the
    manifest is made when the object is encoded; clocks of one cluster are assumed synchronized)."""
    tuner.observe_commit(kind=kind, nbytes=nbytes, write_s=max(0.0, now - created),
                         steps=last_step - first_step + 1)


def publish_report(storage, report: dict) -> None:
    """Write ``report`` to :data:`POLICY_REPORT_KEY` (best effort: a failure is returned to no one)."""
    import json

    try:
        storage.write(POLICY_REPORT_KEY, json.dumps(report, default=str, sort_keys=True).encode())
    except Exception:  # noqa: BLE001 - a report must never fail a commit or a failure record
        pass


def read_report(storage) -> dict | None:
    """The published policy report, or None (missing or unreadable). CLI / any process."""
    import json

    try:
        d = json.loads(storage.read(POLICY_REPORT_KEY))
    except Exception:  # noqa: BLE001
        return None
    return d if isinstance(d, dict) else None
