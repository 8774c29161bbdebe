"""kill -9 of a training process at seeded random points: during the attach full, between steps, during a flush,
in both recording modes. Every recovery must equal the uninterrupted run at the restored step, bitwise, and restore
at least the newest step the node's persistence worker had acknowledged before the kill (runtime="ray": a step
held by the worker survives its trainer). What may be lost is what the training process still had: the record
being encoded, the sender's queue (``max(2, batch_steps)`` records) and the hand-offs not yet answered
(``MAX_INFLIGHT``) — ``UNACKED`` records, each a step when every step is recorded (``recovery_every=1``), each a
full of k steps in the budget's every-k mode (``recovery_every=k``), plus the k - 1 steps after the newest full."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid

import pytest
import ray

import ray_ckpt
from ray_ckpt.runtime.coordinator import shutdown_run
from ray_ckpt.runtime.trainer.transport import MAX_INFLIGHT
from tests import _training as T
from tests.reliability import record

pytestmark = pytest.mark.ray

STEPS = 20
#: the recording modes, as ``recovery_every``: every step, and a full every EVERY_K steps
EVERY_K = 5
RECORDING = {"every_step": 1, "every_k": EVERY_K}
#: records a training process may hold unacknowledged (batch_steps=1): one being encoded, the sender's queue, the
#: hand-offs in flight
UNACKED = 1 + 2 + MAX_INFLIGHT
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` kill points: the first during the attach full, the second during a flush, the rest between steps at
    seeded random steps."""
    rng = random.Random(seed)
    plan = [("attach", 0), ("flush", rng.randint(2, STEPS - 2))]
    plan += [("step", rng.randint(1, STEPS - 1)) for _ in range(max(0, n - 2))]
    return plan[:n]


@pytest.fixture(scope="module")
def reference():
    return T.reference_states(STEPS)


def _trial(tmp_path, where: str, at: int, seed: int, reference, address, recovery_every: int
           ) -> tuple[bool, bool, int, int | None]:
    """(recovered, bitwise, steps lost, the step restored short of the newest acknowledged one or None)."""
    run = f"kill-{uuid.uuid4().hex[:8]}"
    uri = str(tmp_path / run)
    cfg = {"address": address, "uri": uri, "run": run, "where": where, "at": at,
           "seed": seed, "steps": STEPS, "full_every": 5, "recovery_every": recovery_every}
    env = {**os.environ, "PYTHONPATH": ROOT}
    try:
        p = subprocess.run([sys.executable, "-m", "tests.reliability._kill_worker", json.dumps(cfg)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == -9, f"{where}@{at}: exit {p.returncode}\n{p.stderr[-3000:]}"
        said = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")][-1]
        done, held = said["done"], said.get("held")
        model, opt = T.make_model("mlp", seed=3), None
        opt = T.make_optimizer("adamw", model)
        sch = T.make_scheduler(opt)
        try:
            got = ray_ckpt.restore(uri, model, opt, scheduler=sch, runtime="ray", run=run)
        except ray_ckpt.NoCheckpointError:
            # killed before the attach full was held anywhere: nothing was trained, nothing is lost
            return where == "attach", where == "attach", 0, None
        bitwise = True
        try:
            T.assert_same(reference[got], T.snapshot(model, opt, sch), f"{where}@{at}: restored step {got}")
        except AssertionError:
            bitwise = False
        return True, bitwise, done - got, (got if held is not None and got < held else None)
    finally:
        shutdown_run(run)


def _trials(tmp_path, reference, address, n: int, seed: int, fault: str, recording: str = "every_step"):
    k = RECORDING[recording]
    rows = [(where, at, *_trial(tmp_path, where, at, seed + i, reference, address, k)) for i, (where, at) in
            enumerate(_plan(n, seed))]
    record(f"{fault} ({recording})", trials=n, recovered=sum(r[2] for r in rows), bitwise=sum(r[3] for r in rows),
           steps_lost=[r[4] for r in rows])
    for where, at, recovered, bitwise, lost, short in rows:
        assert recovered and bitwise, f"kill {where}@{at} ({recording}): recovered={recovered} bitwise={bitwise}"
        assert short is None, f"kill {where}@{at} ({recording}): restored step {short}, short of a step the " \
                              f"persistence worker had acknowledged"
        assert lost <= UNACKED * k + k - 1, f"kill {where}@{at} ({recording}): {lost} steps lost"


@pytest.mark.parametrize("recording", sorted(RECORDING))
def test_kill_trials_short(tmp_path, reference, ray_cluster, recording):
    _trials(tmp_path, reference, ray_cluster.address, 3, seed=7, recording=recording,
            fault="kill -9 training process (attach, flush, random step)")


@pytest.mark.long
@pytest.mark.parametrize("recording", sorted(RECORDING))
def test_kill_trials_20(tmp_path, reference, ray_cluster, recording):
    _trials(tmp_path, reference, ray_cluster.address, 20, seed=2026, recording=recording,
            fault="kill -9 training process at 20 seeded points")
