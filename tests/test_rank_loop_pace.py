"""A rank's loop state keeps pace with the step records: with ``handoff_delay=0`` each step's record is written
as it is captured (the steps a restore can agree on trail the training by one write, not by a batch), a writer on
slow storage coalesces what piled up during a write instead of falling behind, and the restore log says how many
steps a restore loses and why. No Ray, no process group."""
from __future__ import annotations

import threading
import time

import torch

from ray_ckpt.api import open_uri
from ray_ckpt.engine.rankloop import RankLoopRecorder, rank_loop_head
from ray_ckpt.integrations.agreement import explain_loss
from ray_ckpt.lineage import Lineage
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.rankloop import rank_storage


def _wait_head(storage, step, timeout=10.0):
    deadline = time.monotonic() + timeout
    while rank_loop_head(storage, 1, 1) != step and time.monotonic() < deadline:
        time.sleep(0.005)
    return rank_loop_head(storage, 1, 1)


def test_zero_delay_writes_each_step_as_it_is_captured(tmp_path):
    """batch_steps=10, max_batch_delay=0 (attach passes handoff_delay): the head follows every single step."""
    storage = open_uri(str(tmp_path / "ck"))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    rec = RankLoopRecorder(storage, 1, model, opt, main_generation=1, start_step=0, batch_steps=10,
                           max_batch_delay=0)
    try:
        for s in range(4):
            opt.step()
            assert _wait_head(storage, s + 1) == s + 1     # nothing waits for the rest of its batch of 10
    finally:
        rec.close()


class _SlowWrites:
    """A storage whose writes take ``delay`` seconds (counts the diff objects written)."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.diff_writes = inner, delay, 0
        self.lock = threading.Lock()

    def write(self, key, data):
        time.sleep(self.delay)
        if "/objects/" in key and "diff" in key:
            with self.lock:
                self.diff_writes += 1
        return self.inner.write(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_zero_delay_on_slow_storage_coalesces_instead_of_falling_behind(tmp_path):
    """Writes slower than the steps: the records queued during a write go into the next one, so 30 steps need
    a few objects, not 30 (one object per record would fall behind by one write per step, without bound)."""
    storage = open_uri(str(tmp_path / "ck"))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    slow = _SlowWrites(storage, 0.2)
    rec = RankLoopRecorder(slow, 1, model, opt, main_generation=1, start_step=0, batch_steps=1000,
                           full_every=1000, max_batch_delay=0)
    try:
        for _ in range(30):     # steps far faster than a write
            opt.step()
        rec.flush()
    finally:
        rec.close()
    assert rank_loop_head(storage, 1, 1) == 30
    lineage, _ = load_lineage(rank_storage(storage, 1), strict=False)
    diffs = [m for m in Lineage(lineage.manifests).manifests if m.kind == "diff"]
    assert sum(m.last_step - m.first_step + 1 for m in diffs) == 30
    assert len(diffs) < 15, [(m.first_step, m.last_step) for m in diffs]


def test_the_restore_log_counts_the_steps_lost_and_names_why():
    lost, why = explain_loss(137, [None, 130], 130)
    assert lost == 7
    assert "reached at least step 137" in why and "rank 1 recorded its loop state only up to step 130" in why
    lost, why = explain_loss(136, [None, 137, 137], 136)
    assert lost == 1 and "rank 0's step records end at step 136" in why and "rank 2 at 137" in why
    lost, why = explain_loss(40, [None, 40, None], 40)      # rank 2 was not in the saved world
    assert lost == 0 and "every rank recorded it" in why
