"""A discrete-event simulator of a checkpointed run under a failure trace: what a policy costs in lost time and
bytes written. Pure (no torch, no Ray); runs in tests and in ``benchmarks/policy_sim.py``.

The simulated run follows ray_ckpt's semantics (the same ones :func:`ray_ckpt.policy.adaptive.expected_loss`
models, but counted event by event instead of averaged):

* attach takes a full checkpoint (``c_f + k*p_f`` seconds on the time line, ``F`` bytes); then every step takes
  ``T + c_d + k*d/bw`` seconds; a diff object closes every ``B`` steps (and at every full) and costs ``k*lat``
  on the time line; a full every ``N`` steps costs ``c_f + k*p_f``;
* a closed batch is durable ``lat + bytes/bw`` seconds after it closed; a full is taken as durable at once;
* a failure loses everything after the newest durable point; recovery takes ``R + L + r*(steps replayed)`` and
  a new attach (a full); a failure during recovery starts the recovery again;
* useful work = durable steps x ``T``; lost time = wall time - useful work (checkpoint overhead included).

Policies are *choosers* called at every (re)start and at each full at most every ``redecide_s`` seconds:
``chooser(now, failures_so_far) -> (full_every, batch_steps)``.

Failure traces: :func:`exponential_trace` (stationary, what Young/Daly assume) and :func:`llama3_bursty_trace`,
built from the failure statistics Meta published for the Llama 3 405B pre-training (see its docstring).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from ray_ckpt.policy.cost import CostInputs, CostModel


@dataclass(frozen=True)
class SimResult:
    wall_s: float
    useful_steps: int
    failures: int
    fulls: int
    diff_objects: int
    bytes_written: float
    decisions: int

    def lost_s_per_hour(self, step_s: float) -> float:
        return 3600.0 * (self.wall_s - self.useful_steps * step_s) / self.wall_s


# -- traces ----------------------------------------------------------------------------------------------------
def exponential_trace(mtbf_s: float, horizon_s: float, seed: int = 0) -> list[float]:
    """Failure times of a Poisson process with mean ``mtbf_s`` over ``[0, horizon_s)``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append(t)


#: Llama 3 405B pre-training, 54-day snapshot on 16,384 H100 GPUs: 466 job interruptions, 47 planned and 419
#: unexpected (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, 2024, section 3.3.4 and Table 5).
#: Of the 419: faulty GPU 148, GPU HBM3 memory 72, GPU SRAM memory 19, GPU system processor 17 (256 GPU-local
#: hardware failures); network switch/cable 35; software bugs, host maintenance, NICs, NCCL watchdog timeouts,
#: silent data corruption and others make up the remaining 128.
LLAMA3_DAYS = 54
LLAMA3_UNEXPECTED = 419
LLAMA3_GPU_LOCAL = 148 + 72 + 19 + 17


def llama3_bursty_trace(horizon_s: float, seed: int = 0, *, rate_scale: float = 1.0, burst_size: float = 4.0,
                        burst_spread_s: float = 900.0) -> list[float]:
    """A bursty trace with the Llama 3 run's published mean rate and root-cause mix (``LLAMA3_*`` above).

    The paper publishes counts per cause over 54 days, not timestamps; the clustering is our assumption,
    stated here: the 256 GPU-local hardware failures arrive as independent (Poisson) singletons; the other
    163 (network, software, host, ...) arrive in bursts of geometric size with mean ``burst_size``, their
    members spread exponentially (mean ``burst_spread_s``) after the burst's start: a switch or a bad software
    push interrupts the job repeatedly until fixed. ``rate_scale`` multiplies both rates (e.g. a smaller
    cluster fails less often). Mean time between failures: 54 d / 419 = 3.09 h at ``rate_scale=1``.
    """
    rng = random.Random(seed)
    span = LLAMA3_DAYS * 86400.0
    single_rate = rate_scale * LLAMA3_GPU_LOCAL / span
    burst_rate = rate_scale * (LLAMA3_UNEXPECTED - LLAMA3_GPU_LOCAL) / burst_size / span
    out = exponential_trace(1.0 / single_rate, horizon_s, seed=rng.randrange(1 << 30))
    p = 1.0 / burst_size
    for start in exponential_trace(1.0 / burst_rate, horizon_s, seed=rng.randrange(1 << 30)):
        n = 1
        while rng.random() > p:
            n += 1
        t = start
        for _ in range(n):
            if t < horizon_s:
                out.append(t)
            t += rng.expovariate(1.0 / burst_spread_s)
    return sorted(out)


# -- the simulator --------------------------------------------------------------------------------------------
def simulate(trace: list[float], horizon_s: float, c: CostInputs,
             chooser: Callable[[float, int], tuple[int, int]], *, redecide_s: float = 3600.0) -> SimResult:
    """Run the policy ``chooser`` against failure ``trace`` for ``horizon_s`` seconds (see the module docs)."""
    k = c.background_cost
    full_cost = c.full_block_s + k * c.full_persist_s
    per_step = c.step_s + c.diff_block_s + k * c.diff_bytes / c.write_bw
    close_cost = k * c.write_latency_s
    fails = [t for t in trace if t < horizon_s] + [math.inf]
    fi = 0
    now = 0.0
    useful = fulls = objects = decisions = 0
    written = 0.0
    replay_steps = 0            # steps the next (re)start replays
    restarting = False
    while now < horizon_s:
        # -- (re)start: recovery (after a failure), then attach = a full checkpoint
        start = now
        dur = (c.restart_s + c.load_s + c.replay_s * replay_steps if restarting else 0.0) + full_cost
        if fails[fi] < start + dur:     # failed again during recovery: start over, same durable state
            now = fails[fi]
            fi += 1
            restarting = True
            continue
        now = start + dur
        fulls += 1
        written += c.full_bytes
        restarting, replay_steps = False, 0
        n, b = chooser(now, fi)
        decisions += 1
        last_decision = now
        # -- run cycles of n steps until the next failure or the horizon
        while True:
            b = max(1, min(b, n))
            closes = n // b + (1 if n % b else 0)
            cycle = n * per_step + closes * close_cost + full_cost
            end = min(fails[fi], horizon_s)
            if now + cycle <= end:  # whole cycles: jump them (re-deciding at a full when due)
                m = int((end - now) // cycle)
                if now + m * cycle - last_decision >= redecide_s and m > 1:
                    m = max(1, int((last_decision + redecide_s - now) // cycle) + 1)
                now += m * cycle
                useful += m * n
                fulls += m
                objects += m * closes
                written += m * (c.full_bytes + n * c.diff_bytes)
                if now - last_decision >= redecide_s:
                    n2, b2 = chooser(now, fi)
                    decisions += 1
                    last_decision = now
                    n, b = n2, b2
                continue
            # the cycle is cut by a failure (or the horizon) at `end`
            t = end - now
            done = min(n, int(t // (per_step + close_cost / b)) + 1)
            while done > 0 and done * per_step + (done // b) * close_cost > t:
                done -= 1
            nclosed = done // b
            objects += nclosed
            written += nclosed * b * c.diff_bytes
            lag = c.write_latency_s + b * c.diff_bytes / c.write_bw
            durable = 0
            for j in range(nclosed, 0, -1):  # newest closed batch already durable at `end`
                if j * b * per_step + j * close_cost + lag <= t:
                    durable = j * b
                    break
            now = end
            if end >= horizon_s:
                useful += durable
                break
            useful += durable
            replay_steps = durable
            restarting = True
            fi += 1
            break
    return SimResult(wall_s=now if now > 0 else horizon_s, useful_steps=useful, failures=fi, fulls=fulls,
                     diff_objects=objects, bytes_written=written, decisions=decisions)


def fixed_chooser(full_every: int, batch_steps: int) -> Callable[[float, int], tuple[int, int]]:
    return lambda now, failures: (full_every, batch_steps)


def tuned_model(c: CostInputs, *, mtbf_hint: float, half_life_s: float = 7 * 86400.0,
                prior_failures: float = 1.0) -> CostModel:
    """A :class:`CostModel` that has observed exactly the costs of ``c`` (MTBF excepted: it starts from
    ``mtbf_hint`` and learns from the failures it is told about)."""
    m = CostModel(mtbf_hint=mtbf_hint, half_life_s=half_life_s, prior_failures=prior_failures,
                  background_cost=c.background_cost, restart_s=c.restart_s)
    for _ in range(3):
        m.observe_step(c.step_s)
        full_bytes = max(c.full_bytes, 1.0)
        diff_bytes = max(c.diff_bytes * 10, full_bytes * 1e-3)
        for nb in (full_bytes, diff_bytes):
            m.observe_commit(kind="full" if nb == full_bytes else "diff", nbytes=int(nb),
                             write_s=c.write_latency_s + int(nb) / c.write_bw, steps=10,
                             block_s=c.full_block_s if nb == full_bytes else c.diff_block_s)
    # exact values (the fit above gives latency/bandwidth; the means below are set directly)
    for est, v in ((m.full_persist, c.full_persist_s), (m.full_bytes, c.full_bytes), (m.diff_bytes, c.diff_bytes),
                   (m.full_block, c.full_block_s), (m.diff_block, c.diff_block_s)):
        est.n, est._mean, est._var = 1, float(v), 0.0
    m.observe_restore(load_s=c.load_s, replay_steps=1, replay_s=c.replay_s, restart_s=c.restart_s)
    return m


def adaptive_chooser(c: CostInputs, trace: list[float], *, mtbf_hint: float, limits=None,
                     half_life_s: float = 7 * 86400.0) -> Callable[[float, int], tuple[int, int]]:
    """The adaptive policy as the simulator sees it: a :class:`~ray_ckpt.policy.adaptive.PolicyTuner` that knows
    the costs of ``c`` and learns the MTBF online from the failures of ``trace`` that happened before ``now``."""
    from ray_ckpt.policy.adaptive import Limits, PolicyTuner

    tuner = PolicyTuner(tuned_model(c, mtbf_hint=mtbf_hint, half_life_s=half_life_s),
                        limits=limits or Limits(), min_commits=0)
    seen = [0]

    def choose(now: float, failures: int) -> tuple[int, int]:
        while seen[0] < failures:
            tuner.observe_failure(trace[seen[0]])
            seen[0] += 1
        ch = tuner.decide(now, force=True)
        return ch.full_every, ch.batch_steps

    return choose
