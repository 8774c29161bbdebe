"""The cost model of checkpointing, fed online: running estimates (with their uncertainty) of what a checkpoint
costs and how often the run fails.

Pure (no torch, no Ray, no clock of its own: every observation carries its time), so the same model runs in the
coordinator actor (runtime="ray"), in the writer thread (runtime="local"), in the simulator and in tests.
Nothing here runs on the training thread except :meth:`CostModel.observe_step`, which is O(1).

What is estimated (:class:`CostModel`):

* step time (wall seconds per optimizer step, including the capture and any pause between steps, averaged
  over the last ~50 steps);
* a full checkpoint's cost on the training path (the host snapshot) and in the persistence tier (encode + write);
* bytes per diff step and per full;
* write bandwidth and per-request latency, per storage backend: a least-squares fit of ``seconds = latency +
  bytes / bandwidth`` over the observed writes (exponentially forgotten, so a storage that gets slower is seen);
* replay time per step and full-load time (measured during restores);
* bytes held per tier (what the last report said);
* MTBF from the failures recorded, with a user prior ``mtbf_hint``: a Gamma posterior on the failure rate
  (the prior counts as ``prior_failures`` failures seen over ``prior_failures * mtbf_hint`` seconds), with
  exponential forgetting (``half_life_s``) so that a run whose failures become frequent is seen as such.

:meth:`CostModel.inputs` freezes the current estimates into a :class:`CostInputs`, the input of
:mod:`ray_ckpt.policy.adaptive`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


class RunningEstimate:
    """Exponentially weighted mean and standard deviation of a stream (``alpha``: weight of a new sample).

    ``n`` counts samples; until a sample arrives :attr:`mean` is ``default``. O(1) per update.
    """

    __slots__ = ("alpha", "default", "n", "_mean", "_var")

    def __init__(self, default: float, alpha: float = 0.2):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha, self.default = alpha, float(default)
        self.n, self._mean, self._var = 0, float(default), 0.0

    def add(self, x: float) -> None:
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"observation must be finite, got {x}")
        self.n += 1
        if self.n == 1:
            self._mean, self._var = x, 0.0
            return
        a = max(self.alpha, 1.0 / self.n)  # the first samples weigh equally (a plain mean), then EWMA
        d = x - self._mean
        self._mean += a * d
        self._var = (1 - a) * (self._var + a * d * d)

    def add_mean(self, x: float, count: int) -> None:
        """``count`` samples whose mean is ``x`` (a window of steps measured together), as ``count`` calls of
        :meth:`add` with ``x`` would weigh them."""
        x, count = float(x), int(count)
        if count < 1:
            return
        if not math.isfinite(x):
            raise ValueError(f"observation must be finite, got {x}")
        if self.n == 0:
            self.n, self._mean, self._var = count, x, 0.0
            return
        a = max(1.0 - (1.0 - self.alpha) ** count, count / (self.n + count))
        d = x - self._mean
        self._mean += a * d
        self._var = (1 - a) * (self._var + a * d * d)
        self.n += count

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def std(self) -> float:
        return math.sqrt(max(self._var, 0.0))

    def summary(self) -> dict:
        return {"mean": self._mean, "std": self.std, "n": self.n}


class BandwidthFit:
    """``seconds = latency + bytes / bandwidth`` fitted by exponentially forgotten least squares.

    With a single object size (no spread in bytes) the latency cannot be separated from the bandwidth: the
    default latency is kept and the bandwidth is what remains. O(1) per update.
    """

    __slots__ = ("forget", "default_latency", "default_bw", "n", "_w", "_x", "_y", "_xx", "_xy")

    def __init__(self, default_latency: float, default_bw: float, forget: float = 0.9):
        self.forget, self.default_latency, self.default_bw = forget, default_latency, default_bw
        self.n, self._w, self._x, self._y, self._xx, self._xy = 0, 0.0, 0.0, 0.0, 0.0, 0.0

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes < 0 or not seconds >= 0 or not math.isfinite(seconds):
            raise ValueError(f"bad write observation: {nbytes} bytes in {seconds} s")
        f = self.forget
        x = nbytes / 1e6  # MB: keeps the sums well conditioned
        self.n += 1
        self._w = f * self._w + 1.0
        self._x = f * self._x + x
        self._y = f * self._y + seconds
        self._xx = f * self._xx + x * x
        self._xy = f * self._xy + x * seconds

    def latency_and_bandwidth(self) -> tuple[float, float]:
        if self.n == 0:
            return self.default_latency, self.default_bw
        w = self._w
        mx, my = self._x / w, self._y / w
        vx = self._xx / w - mx * mx
        if vx > 1e-12 * max(1.0, mx * mx) and self.n >= 3:
            slope = (self._xy / w - mx * my) / vx          # s per MB
            lat = my - slope * mx
            if slope > 0 and lat >= 0:
                return lat, 1e6 / slope
            if slope > 0:  # negative intercept: noise; all of it is bandwidth
                return 0.0, 1e6 * mx / my if my > 0 else self.default_bw
        lat = min(self.default_latency, my)
        rest = my - lat
        bw = (mx * 1e6) / rest if rest > 0 and mx > 0 else self.default_bw
        return lat, bw


@dataclass(frozen=True, kw_only=True)
class CostInputs:
    """The numbers the policy optimizes over (seconds, bytes). A frozen snapshot of :class:`CostModel`."""

    step_s: float                 #: seconds per training step (without checkpointing)
    full_block_s: float           #: a full checkpoint's time on the training thread (host snapshot)
    full_persist_s: float         #: a full checkpoint's time in the persistence tier (encode + write)
    diff_block_s: float = 0.0     #: per-step capture time on the training thread (same for every policy)
    diff_bytes: float = 0.0       #: bytes of one step's diff
    full_bytes: float = 0.0       #: bytes of one full checkpoint
    write_latency_s: float = 0.0  #: per-object (request) latency of the storage
    write_bw: float = 1e9         #: storage write bandwidth, bytes/s
    replay_s: float = 0.0         #: seconds to replay one step during recovery
    load_s: float = 0.0           #: seconds to load the full checkpoint during recovery
    restart_s: float = 0.0        #: seconds to detect a failure and restart the workers
    mtbf_s: float = 86400.0       #: mean time between failures, seconds
    background_cost: float = 0.0  #: fraction of persistence-tier time that slows training (shared cores, I/O)
    mtbf_failures: float = 0.0    #: failures behind the MTBF estimate (prior included; its weight)

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostInputs.{k} must be a finite number >= 0, got {v!r}")
        if self.step_s <= 0 or self.mtbf_s <= 0 or self.write_bw <= 0:
            raise ValueError("step_s, mtbf_s and write_bw must be > 0")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CostModel:
    """Running estimates of every cost (see the module docstring). Not thread-safe: one owner (the coordinator
    actor, or the writer thread) feeds it; :meth:`observe_step` is the only call made from the training thread
    and only touches the step-time estimate.

    Defaults (used until something is observed) describe an unknown run conservatively: 1 s steps, free fulls,
    10 ms requests at 100 MB/s, replay as slow as a step, a restart of 30 s.
    """

    mtbf_hint: float = 86400.0        #: prior MTBF, seconds
    prior_failures: float = 1.0       #: weight of the prior, in failures
    half_life_s: float = 7 * 86400.0  #: failures and exposure older than this count half
    background_cost: float = 0.25     #: see CostInputs.background_cost
    restart_s: float = 30.0           #: default restart time until a restore is measured
    started_at: float = 0.0           #: time the run started (exposure is counted from here)
    #: wall time per step over the last ~50 steps (alpha 0.02), pauses (evaluation, stalls) amortized: the
    #: conversion of a checkpoint interval between seconds and steps. A fast estimate made a periodic pause swing
    #: the chosen interval several-fold (each swing down took a full at once)
    step: RunningEstimate = field(default_factory=lambda: RunningEstimate(1.0, alpha=0.02))
    full_block: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0))
    full_persist: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0))
    diff_block: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0))
    diff_bytes: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0))
    full_bytes: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0))
    replay: RunningEstimate = field(default_factory=lambda: RunningEstimate(-1.0))   # -1: unknown (= a step)
    load: RunningEstimate = field(default_factory=lambda: RunningEstimate(-1.0))     # -1: unknown (from bw)
    restart: RunningEstimate = field(default_factory=lambda: RunningEstimate(-1.0))  # -1: unknown (default)
    #: optimizer.step() alone, measured on the training thread: what replaying one step costs until a restore
    #: measures the replay itself
    optimizer_step: RunningEstimate = field(default_factory=lambda: RunningEstimate(-1.0, alpha=0.02))
    #: CPU per step of the training process outside its training thread (writer / sender thread, Ray's threads)
    other_cpu: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0, alpha=0.02))
    writes: dict = field(default_factory=dict)       #: backend name -> BandwidthFit
    memory: dict = field(default_factory=dict)       #: tier name -> bytes last reported
    failures: list = field(default_factory=list)     #: failure times (the latest 1000)
    _n_disc: float = 0.0                              # discounted failure count
    _exp_disc: float = 0.0                            # discounted exposure, seconds
    _t_disc: float | None = None                      # time of the last discount update
    backend: str = "storage"                          #: the backend whose fit the inputs use

    def __post_init__(self):
        if not self.mtbf_hint > 0:
            raise ValueError(f"mtbf_hint must be > 0 seconds, got {self.mtbf_hint}")
        if self.prior_failures <= 0:
            raise ValueError(f"prior_failures must be > 0, got {self.prior_failures}")
        if self.half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")
        if not 0 <= self.background_cost <= 1:
            raise ValueError(f"background_cost must be in [0, 1], got {self.background_cost}")

    # -- observations ----------------------------------------------------------------------------------------
    def observe_step(self, seconds: float) -> None:
        """Wall time of one training step (training thread; O(1))."""
        if seconds > 0:
            self.step.add(seconds)

    def observe_trainer(self, *, steps: int, step_s: float, capture_s: float, optimizer_s: float,
                        other_cpu_s: float, wall_s: float = 0.0, **_ignored) -> None:
        """A window of ``steps`` training steps measured in the training process (per-step means, seconds: wall
        time ``wall_s`` with pauses, else ``step_s``; capture hooks, ``optimizer.step()`` alone, the process's CPU outside the training thread): from
        :class:`ray_ckpt.policy.budget.StepMeter`. Any thread that owns the model."""
        if steps < 1 or not step_s > 0:
            return
        self.step.add_mean(wall_s if wall_s > 0 else step_s, steps)   # pauses amortized (see the field)
        self.diff_block.add_mean(capture_s, steps)
        if optimizer_s > 0:
            self.optimizer_step.add_mean(optimizer_s, steps)
        self.other_cpu.add_mean(other_cpu_s, steps)

    def observe_commit(self, *, kind: str, nbytes: int, write_s: float, steps: int = 1,
                       encode_s: float = 0.0, block_s: float | None = None, backend: str | None = None) -> None:
        """One object committed to storage: ``kind`` "full" or "diff" holding ``steps`` steps, ``nbytes``
        written in ``write_s`` seconds (data + manifest), after ``encode_s`` seconds of encoding; ``block_s``:
        the training thread's time for it (the full's snapshot, or the diff's capture per step)."""
        if kind not in ("full", "diff"):
            raise ValueError(f"kind must be 'full' or 'diff', got {kind!r}")
        name = backend or self.backend
        fit = self.writes.get(name)
        if fit is None:
            fit = self.writes[name] = BandwidthFit(0.01, 1e8)
        fit.add(nbytes, write_s)
        if kind == "full":
            self.full_bytes.add(nbytes)
            self.full_persist.add(write_s + encode_s)
            if block_s is not None:
                self.full_block.add(block_s)
        else:
            self.diff_bytes.add(nbytes / max(1, steps))
            if block_s is not None:
                self.diff_block.add(block_s)

    def observe_restore(self, *, load_s: float, replay_steps: int, replay_s: float,
                        restart_s: float | None = None) -> None:
        """A recovery: the full loaded in ``load_s``, ``replay_steps`` replayed in ``replay_s`` seconds."""
        self.load.add(load_s)
        if replay_steps > 0:
            self.replay.add(replay_s / replay_steps)
        if restart_s is not None:
            self.restart.add(restart_s)

    def observe_memory(self, tier: str, nbytes: int) -> None:
        """Bytes a tier (``"writer"``, ``"worker:<node>"``, ``"replica"`` ...) holds now."""
        self.memory[tier] = int(nbytes)

    def observe_failure(self, at: float) -> None:
        """A failure (worker death, node loss, restart) at time ``at`` (seconds, same clock as ``started_at``)."""
        self._advance(at)
        self._n_disc += 1.0
        self.failures.append(at)
        del self.failures[:-1000]

    def _advance(self, now: float) -> None:
        t = self.started_at if self._t_disc is None else self._t_disc
        dt = max(0.0, now - t)
        lam = math.log(2) / self.half_life_s
        f = math.exp(-lam * dt)
        self._n_disc *= f
        self._exp_disc = self._exp_disc * f + (1 - f) / lam
        self._t_disc = max(t, now)

    # -- estimates -------------------------------------------------------------------------------------------
    def mtbf(self, now: float) -> tuple[float, float]:
        """``(mean, weight)``: posterior mean MTBF at time ``now`` and the failures it rests on (prior
        included). Its relative uncertainty is about ``1/sqrt(weight)``."""
        n, e = self._n_disc, self._exp_disc
        t = self.started_at if self._t_disc is None else self._t_disc
        if now > t:  # exposure since the last update, discounted as _advance would (without mutating)
            lam = math.log(2) / self.half_life_s
            f = math.exp(-lam * (now - t))
            n, e = n * f, e * f + (1 - f) / lam
        k = self.prior_failures + n
        return (self.prior_failures * self.mtbf_hint + e) / k, k

    def inputs(self, now: float) -> CostInputs:
        """The current estimates as :class:`CostInputs` (unknowns take their documented fallbacks)."""
        lat, bw = self.writes[self.backend].latency_and_bandwidth() if self.backend in self.writes \
            else (0.01, 1e8)
        step = self.step.mean
        full_bytes = self.full_bytes.mean
        mtbf, weight = self.mtbf(now)
        return CostInputs(
            step_s=step, full_block_s=self.full_block.mean, full_persist_s=self.full_persist.mean,
            diff_block_s=self.diff_block.mean, diff_bytes=self.diff_bytes.mean, full_bytes=full_bytes,
            write_latency_s=lat, write_bw=bw,
            replay_s=self.replay.mean if self.replay.n else (self.optimizer_step.mean if self.optimizer_step.n
                                                             else step),
            load_s=self.load.mean if self.load.n else lat + full_bytes / bw,
            restart_s=self.restart.mean if self.restart.n else self.restart_s,
            mtbf_s=mtbf, background_cost=self.background_cost, mtbf_failures=weight)

    def uncertainty(self, now: float) -> dict:
        """``{estimate: {mean, std, n}}`` for reports."""
        out = {k: getattr(self, k).summary() for k in ("step", "full_block", "full_persist", "diff_block",
                                                         "diff_bytes", "full_bytes", "replay", "load", "restart",
                                                         "optimizer_step", "other_cpu")}
        c = self.inputs(now)   # what the model uses where nothing was measured directly yet, and from what
        if not self.replay.n:
            out["replay"] = {"mean": c.replay_s, "std": 0.0, "n": 0,
                             "source": "optimizer.step() measured on the training thread" if self.optimizer_step.n
                             else "assumed a training step (nothing measured yet)"}
        if not self.load.n:
            out["load"] = {"mean": c.load_s, "std": 0.0, "n": 0,
                           "source": "full bytes / measured write bandwidth (no restore measured yet)"}
        if not self.restart.n:
            out["restart"] = {"mean": c.restart_s, "std": 0.0, "n": 0, "source": "restart_s default"}
        mtbf, weight = self.mtbf(now)
        out["mtbf"] = {"mean": mtbf, "std": mtbf / math.sqrt(weight), "n": len(self.failures)}
        for name, fit in self.writes.items():
            lat, bw = fit.latency_and_bandwidth()
            out[f"write[{name}]"] = {"latency_s": lat, "bandwidth": bw, "n": fit.n}
        if self.memory:
            out["memory"] = dict(self.memory)
        return out
