"""Retention by default: a run keeps the chains of its two newest fulls (``keep_fulls=2``), so storage stays
bounded however long it runs; the latest and the oldest retained step restore bitwise, ``fallback`` still finds
a chain past a damaged newest full, and ``keep_fulls=0`` (argument or ``RAY_CKPT_KEEP_FULLS``) keeps every step.
runtime="local": no Ray."""
from __future__ import annotations

import pytest

import ray_ckpt
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.storage import open_storage
from tests import _training as T

STEPS, FULL_EVERY = 40, 5


@pytest.fixture(scope="module")
def ref():
    return T.reference_states(STEPS)


def _run(uri, steps=STEPS, **kw):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    kw = {"recovery_every": 1, **kw}   # every step recorded: the retained steps are every step of their chains
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=FULL_EVERY, batch_steps=2, **kw) as ck:
        for s in range(steps):
            T.train_step("mlp", model, opt, sch, s)
    return ck


def _restore(uri, step=None, **kw):
    m = T.make_model("mlp", seed=3)
    o = T.make_optimizer("adamw", m)
    sc = T.make_scheduler(o)
    got = ray_ckpt.restore(uri, m, o, scheduler=sc, step=step, **kw)
    return got, T.snapshot(m, o, sc)


def _stored(uri):
    """``(full steps, first step of every object, bytes of every object)`` on storage."""
    lineage, _ = load_lineage(open_storage(uri), use_index=False)
    ms = lineage.manifests
    return (sorted(m.last_step for m in ms if m.kind == "full"), sorted(m.first_step for m in ms),
            sum(m.nbytes for m in ms))


def test_default_keeps_the_two_newest_fulls_and_restores_bitwise(tmp_path, ref, monkeypatch):
    monkeypatch.delenv("RAY_CKPT_KEEP_FULLS", raising=False)   # the default (tests/conftest.py sets 0)
    assert ray_ckpt.CheckpointConfig().keep_fulls == 2
    uri = str(tmp_path / "default")
    ck = _run(uri)
    assert ck.config.keep_fulls == 2
    fulls, firsts, nbytes = _stored(uri)
    oldest = STEPS - FULL_EVERY
    assert fulls == [oldest, STEPS]                       # 9 fulls were written, 2 are kept
    assert min(firsts) == oldest                          # nothing older than the oldest kept full
    # a run twice as long keeps the same amount (bounded by the fulls kept, not by the steps run)
    uri2 = str(tmp_path / "short")
    _run(uri2, steps=STEPS // 2)
    assert nbytes <= 1.05 * _stored(uri2)[2], (nbytes, _stored(uri2)[2])
    for step in (STEPS, oldest):                          # the latest and the oldest retained step, bitwise
        got, state = _restore(uri, step=step)
        assert got == step
        T.assert_same(ref[step], state, f"step {step} of the retained range")
    with pytest.raises(ray_ckpt.NoCheckpointError):       # collected: said clearly, never a wrong state
        _restore(uri, step=oldest - 1)


def test_fallback_past_a_damaged_newest_full_uses_the_older_kept_chain(tmp_path, ref, monkeypatch):
    monkeypatch.delenv("RAY_CKPT_KEEP_FULLS", raising=False)   # the default (tests/conftest.py sets 0)
    uri = str(tmp_path / "c")
    _run(uri)
    storage = open_storage(uri)
    lineage, _ = load_lineage(storage)
    newest = max((m for m in lineage.manifests if m.kind == "full"), key=lambda m: m.last_step)
    data = bytearray(storage.read(newest.object))
    data[len(data) // 2] ^= 0xFF
    storage.write(newest.object, bytes(data))
    got, state = _restore(uri, fallback=True)
    assert STEPS - FULL_EVERY <= got <= STEPS, got      # from the older kept full's chain (or the diffs past it)
    T.assert_same(ref[got], state, "fallback within the retained chains")


def test_keep_fulls_zero_keeps_everything(tmp_path, ref, monkeypatch):
    monkeypatch.setenv("RAY_CKPT_KEEP_FULLS", "0")        # the environment, as for every knob
    uri = str(tmp_path / "all")
    ck = _run(uri)
    assert ck.config.keep_fulls == 0
    fulls, firsts, _ = _stored(uri)
    assert fulls == list(range(0, STEPS + 1, FULL_EVERY)) and min(firsts) == 0
    got, state = _restore(uri, step=1)
    assert got == 1
    T.assert_same(ref[1], state, "step 1 with keep_fulls=0")


def _with_rank_loop(uri: str, *, keep_fulls: int, rank_steps: int) -> dict:
    """Rank 0 trains ``STEPS`` steps (a full every ``FULL_EVERY``) beside a rank-1 loop recorder that records its
    first ``rank_steps`` steps, then closes; rank 1's torch RNG state after each of its steps, by step."""
    import torch

    from ray_ckpt.engine.rankloop import RankLoopRecorder
    model, other = T.make_model("mlp"), T.make_model("mlp", seed=1)
    opt, other_opt = T.make_optimizer("adamw", model), T.make_optimizer("adamw", other)
    rng = {}
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=FULL_EVERY, batch_steps=2, policy="fixed",
                               keep_fulls=keep_fulls, recovery_every=1) as ck:
        rank = RankLoopRecorder(ck.storage, 1, other, other_opt, main_generation=ck.generation, start_step=0,
                                full_every=100, batch_steps=4, max_batch_delay=0)
        for s in range(STEPS):
            T.train_step("mlp", model, opt, None, s)
            if s < rank_steps:   # rank 1's step: its loop state is the RNG after it
                T.train_step("mlp", other, other_opt, None, s)
                rng[s + 1] = torch.get_rng_state()
            if s + 1 == rank_steps:
                rank.close()
    return rng


def test_retention_keeps_the_base_of_each_ranks_loop_chain(tmp_path):
    """The main lineage's fulls may come far more often than a rank's loop-state fulls (every k steps under the
    overhead budget, against the rank's ``full_every``): collecting by the main lineage's cutoff must keep each
    rank's own full before it, or every kept step loses that rank's RNG and data position (a Ray Train group then
    resumed rank 1 with rank 0's loader position). The rank's loop state of a kept step restores bitwise."""
    import torch

    from ray_ckpt.engine import gc
    from ray_ckpt.engine.rankloop import load_rank_loop, rank_loop_head

    uri = str(tmp_path / "ck")
    rng = _with_rank_loop(uri, keep_fulls=0, rank_steps=STEPS)
    storage = open_storage(uri)
    out = gc.collect(storage, keep_fulls=2)
    assert out.kept_from_step == STEPS - FULL_EVERY and out.rank_deleted == {}, out
    assert rank_loop_head(storage, 1, 1) == STEPS
    for step in (STEPS - FULL_EVERY, STEPS):
        assert torch.equal(load_rank_loop(storage, 1, 1, step)["rng"]["torch"], rng[step]), step


def test_retention_keeps_the_steps_a_lagging_rank_lets_the_group_restore(tmp_path):
    """A rank's loop records go out in batches: when it dies, the group can only agree on its last written step.
    Retention (the writer's own as fulls are written, and ``ray-ckpt gc``) keeps the main lineage back to that step,
    so that an agreed restore still finds it: here rank 1 stops recording at step 12 while rank 0 trains on to 40
    with a full every 5 steps and ``keep_fulls=2`` — without the rule every step before 30 would be gone."""
    import torch

    from ray_ckpt.engine import gc
    from ray_ckpt.engine.rankloop import load_rank_loop, rank_loop_head

    uri, lag = str(tmp_path / "ck"), 12
    rng = _with_rank_loop(uri, keep_fulls=2, rank_steps=lag)   # (as if rank 1 died at 12, everything written)
    storage = open_storage(uri)
    assert rank_loop_head(storage, 1, 1) == lag
    lineage, _ = load_lineage(storage)
    assert lag in lineage.reachable_steps(lineage.generations[-1])      # the writer's retention kept it
    fulls = [mm.last_step for mm in lineage.manifests if mm.kind == "full"]
    assert min(fulls) == 10 and max(fulls) == STEPS, fulls    # what was before the base of step 12 did go
    out = gc.collect(storage, keep_fulls=2)                               # and the CLI's keeps it too
    assert out.deleted == [] and out.rank_deleted == {}, out
    m = T.make_model("mlp", seed=3)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(uri, m, o, step=lag) == lag
    assert torch.equal(load_rank_loop(storage, 1, 1, lag)["rng"]["torch"], rng[lag])
