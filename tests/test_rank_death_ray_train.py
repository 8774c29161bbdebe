"""A rank's death under Ray Train, on any rank, dense or top-k compressed, in both recording modes: the guide's epoch
loop (2 CPU workers, prepare_model + prepare_data_loader over a plain shuffling DataLoader (every-k: with a
generator of its own), ResumableLoader, Dropout, SGD with momentum) with rank 0 or rank 1 SIGKILLed mid-epoch; no surviving rank
completes a step past the kill, and every rank ends bitwise in the uninterrupted run's state (model, optimizer,
RNG). Every step recorded (``recovery_every=1``, ``handoff_delay=0``: each step's records are handed off as they
are captured): it resumes at the kill step or the one before. A full every 5 steps (``recovery_every=5``, the
overhead budget's every-k mode, default handoff delay and retention): it resumes at a full at or before the kill.

The uninterrupted runs are computed once, without Ray Train (torch.multiprocessing gloo ranks running the same
loop), and shared by the cases."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

from tests import _training as T
from tests._loader_fn import BATCH, EPOCHS, ROWS, fit, read_finals, reference_worker

PER_EPOCH = ROWS // 2 // BATCH     # 8
KILL_AT = 13                       # epoch 1, batch 5


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted dense and top-k runs, in one 2-rank gloo group."""
    tmp = tmp_path_factory.mktemp("rank-death-ref")
    configs = {mode: {"out": str(tmp / mode), "topk": mode.startswith("topk"),
                      **({"generator": GENERATOR_SEED} if mode.endswith("gen") else {})}
               for mode in ("dense", "topk", "dense-gen", "topk-gen")}
    for c in configs.values():
        os.makedirs(c["out"])
    T.spawn(reference_worker, args=(2, T.free_port(), list(configs.values())), nprocs=2)
    return {mode: read_finals(tmp / mode) for mode in configs}


def _fit(tmp, name, config):
    # batches of 10 steps: before the loop records kept pace, a rank's death cost up to this many
    return fit(tmp / "ckpt", name, config, storage_path=tmp / "ray_train", full_every=20, batch_steps=10)


#: the recording modes every recovery test runs in: every step recorded, and the overhead budget's every-k mode
#: (a full every EVERY_K steps, the steps between unrecorded), each pinned with recovery_every
EVERY_K = 5
RECORDING = {"every_step": "1", "every_k": str(EVERY_K)}
GENERATOR_SEED = 3


def _case(tmp_path, references, kill_rank, mode, recording="every_step"):
    out = tmp_path / "killed"
    out.mkdir()
    config = {"out": str(out), "kill_at": KILL_AT, "kill_rank": kill_rank, "step_sleep": 0.02,
              "topk": mode == "topk", "progress": True, "env": {"RAY_CKPT_RECOVERY_EVERY": RECORDING[recording]}}
    if recording == "every_k":   # the quickstart's shape: the prepared loader has a generator of its own
        config["generator"] = GENERATOR_SEED
        mode = f"{mode}-gen"
    if recording == "every_step":
        config["handoff_delay"] = 0   # each step handed off as captured: at most one step lost
    # (every_k: the default handoff_delay, so the ranks' loop state may trail rank 0's latest full: the group then
    # restores the recovery point before the step every rank recorded)
    result = _fit(tmp_path, f"death-{mode}-{kill_rank}-{uuid.uuid4().hex[:6]}", config)
    assert result.error is None, result.error
    assert (out / "killed").exists()
    finals = read_finals(out)
    assert sorted(finals) == [0, 1]
    first_attempt = {r: int((out / f"progress-{r}-0").read_text()) for r in (0, 1)}
    # no rank completed a step past the kill (a surviving rank's exchange with the dead one failed loudly)
    print(f"rank {kill_rank} killed at step {KILL_AT} ({mode}): the ranks completed {first_attempt}, resumed at "
          f"{[finals[r]['start'] for r in (0, 1)]}, restore {[round(finals[r].get('restore_s', -1), 2) for r in (0, 1)]} s")
    assert max(first_attempt.values()) <= KILL_AT, first_attempt
    assert first_attempt[kill_rank] == KILL_AT, first_attempt
    for rank in (0, 1):      # attach said where the restarted attempt's start-up seconds went, on every rank
        phases = finals[rank]["startup"]
        assert {"storage", "policy", "restore", "checkpointer", "rank_loop", "total"} <= set(phases), phases
        assert all(v >= 0 for v in phases.values()) and phases["total"] >= phases["checkpointer"], phases
    print("rank 0's start-up phases:", finals[0]["startup"])
    assert {"prestart", "checkpointer.replica", "checkpointer.node_worker"} <= set(finals[0]["startup"])
    for rank in (0, 1):
        ref, got = references[mode][rank], finals[rank]
        assert got["restored"], got["start"]
        if recording == "every_step":
            assert got["start"] in (KILL_AT - 1, KILL_AT), got["start"]        # at most one step lost
        else:   # a recovery point (a full) at or before the step every rank recorded
            assert 0 < got["start"] <= KILL_AT, got["start"]
        assert got["step"] == ref["step"] == EPOCHS * PER_EPOCH
        assert got["epoch"] == ref["epoch"] == (EPOCHS - 1, PER_EPOCH)
        T.assert_same(ref["state"], got["state"], f"rank {rank}")
        assert torch.equal(ref["rng"], got["rng"]), f"rank {rank}: RNG"


# three cases in `make test`: every step recorded (rank 1) and every-k (rank 0 and rank 1, the quickstart's loader
# with a generator); the other four (top-k among them: also in tests/test_continuation_e2e.py) under `long`
@pytest.mark.ray
@pytest.mark.parametrize("kill_rank,mode,recording", [
    (1, "dense", "every_step"), (0, "dense", "every_k"), (1, "dense", "every_k"),
    pytest.param(0, "topk", "every_step", marks=pytest.mark.long),
    pytest.param(0, "dense", "every_step", marks=pytest.mark.long),
    pytest.param(1, "topk", "every_step", marks=pytest.mark.long),
    pytest.param(0, "topk", "every_k", marks=pytest.mark.long)])
def test_rank_killed_mid_epoch_resumes_bitwise(tmp_path, references, ray_cluster, kill_rank, mode, recording):
    _case(tmp_path, references, kill_rank, mode, recording)
