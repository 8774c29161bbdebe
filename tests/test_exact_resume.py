"""Exact resume of the loop state around GradScaler-skipped iterations (issue #13, item 3), runtime="local".

A skipped iteration (inf gradients: ``scaler.step`` does not call ``optimizer.step()``) still changes the scaler
(``update()`` backs the scale off), the scheduler and the data position. Each step's record must describe one
moment, the end of that step's own iteration, so that a run restored there replays the skipped iteration exactly
as the uninterrupted run did, and ends bitwise equal to it.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ray_ckpt
from tests import _training as T

ITERS = 24
SKIPS = {4, 9, 10, 17}          # iterations whose loss is inf (9 and 10: two skips in a row)


def _objects(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    return model, opt, sched, scaler, T.Position()


def _iteration(model, opt, sched, scaler, pos):
    """One loop iteration in the AMP recipe's order: scaler.step, scaler.update, then scheduler.step."""
    i = pos.pos
    pos.pos += 1
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = ((model(x) - y) ** 2).mean()      # dropout draws from the global torch RNG
    if i in SKIPS:
        loss = loss * float("inf")
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


def _state(model, opt, sched, scaler, pos):
    return {**T.snapshot(model, opt, sched), "scaler": copy.deepcopy(scaler.state_dict()),
            "pos": pos.pos, "rng": torch.get_rng_state()}


def _reference():
    """State at the end of every iteration in which an optimizer step happened, keyed by step (0 = start)."""
    objs = _objects()
    torch.manual_seed(123)
    by_step, taken = {0: _state(*objs)}, []
    objs[1].register_step_post_hook(lambda *a: taken.append(1))
    for _ in range(ITERS):
        before = len(taken)
        _iteration(*objs)
        if len(taken) != before:
            by_step[len(taken)] = _state(*objs)
    return by_step, _state(*objs)


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _checkpointed_run(uri):
    objs = _objects()
    torch.manual_seed(123)
    model, opt, sched, scaler, pos = objs
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sched, scaler=scaler, extra_state=pos,
                               full_every=5, batch_steps=3, policy="fixed", recovery_every=1, keep_fulls=0) as ck:
        for _ in range(ITERS):
            _iteration(*objs)
        assert scaler.__dict__.get("update") is not None   # wrapped while attached
    assert "update" not in scaler.__dict__                  # unwrapped at close
    return ck.step


def _restored(uri, step):
    model, opt, sched, scaler, pos = _objects(seed=99)
    torch.manual_seed(7)
    got = ray_ckpt.restore(uri, model, opt, scheduler=sched, scaler=scaler, extra_state=pos, step=step)
    assert got == step
    return model, opt, sched, scaler, pos


def test_every_step_restores_the_end_of_its_own_iteration(tmp_path, reference):
    by_step, _ = reference
    uri = str(tmp_path / "ckpt")
    steps = _checkpointed_run(uri)
    assert steps == ITERS - len(SKIPS) == max(by_step)
    for s in range(steps + 1):
        T.assert_same(by_step[s], _state(*_restored(uri, s)), f"step {s}")


@pytest.mark.parametrize("step", [3, 4, 7, 8, 12])   # 3: right before a skip; 7: before two; 5/10: fulls nearby
def test_a_run_restored_before_a_skipped_iteration_ends_bitwise_equal(tmp_path, reference, step):
    _, final = reference
    uri = str(tmp_path / "ckpt")
    _checkpointed_run(uri)
    objs = _restored(uri, step)
    while objs[4].pos < ITERS:
        _iteration(*objs)
    T.assert_same(final, _state(*objs), f"final state after resuming at step {step}")


def test_detach_leaves_the_scaler_as_it_was(tmp_path):
    model, opt, sched, scaler, pos = _objects()
    ck = ray_ckpt.Checkpointer(str(tmp_path / "c"), model, opt, scheduler=sched, scaler=scaler)
    ck.close()
    assert "update" not in scaler.__dict__ and scaler.update.__func__ is torch.amp.GradScaler.update
