"""One restore step for all ranks (issue #13, item 2): world rank 0 decides, every rank restores that step, and a
rank that cannot restore it fails the restore on every rank. Two real gloo processes, runtime="local"."""
from __future__ import annotations

import json
import shutil
import traceback

import pytest

import ray_ckpt
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.api import open_uri
from ray_ckpt.engine.rankloop import rank_loop_head
from ray_ckpt.integrations.agreement import agreed_restore
from tests import _training as T


def _lineage(path, steps):
    """A lineage with steps 0..steps of the MLP loop (full every 5)."""
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    with ray_ckpt.Checkpointer(str(path), model, opt, scheduler=sch, full_every=5, batch_steps=2,
                               policy="fixed", recovery_every=1):
        for s in range(steps):
            T.train_step("mlp", model, opt, sch, s)


def _worker(rank, world, port, cases, out):
    """Each case ``(uris, bad_rank)`` in turn, in one process group: agreed_restore into a fresh model."""
    T.init_dist(rank, world, port)
    results = []
    for uris, bad_rank in cases:
        try:
            model = T.make_model("mlp", seed=50 + rank)
            if rank == bad_rank:   # a model whose shapes do not match the checkpoint: this rank cannot load it
                model.fc1 = type(model.fc1)(model.fc1.in_features, model.fc1.out_features + 1)
            opt = T.make_optimizer("adamw", model)
            sch = T.make_scheduler(opt)
            try:
                step, restored = agreed_restore(open_uri(uris[rank]), model, opt, scheduler=sch, runtime="local")
                res = {"step": step, "restored": restored,
                       "w": T.snapshot(model, opt, sch)["model"]["fc1.weight"].sum().item()}
            except Exception as e:  # noqa: BLE001
                res = {"error": type(e).__name__, "message": str(e)}
        except Exception:  # noqa: BLE001
            res = {"crash": traceback.format_exc()}
        results.append(res)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    T.close_dist()


@pytest.mark.procs
def test_agreement_failure_and_fresh_start(tmp_path):
    """Four cases in one 2-process group (one spawn keeps the suite short):
    1. rank 1 sees a lineage that reaches further (as when a commit lands while the ranks resolve "latest"):
       it still restores rank 0's step, and both hold the same state;
    2. a rank that cannot restore the agreed step fails the restore on every rank;
    3. no lineage: every rank starts from scratch;
    4. rank 0 cannot resolve a step (every manifest unreadable): every rank fails, saying so;
    5. the latest diff object is corrupt: every rank falls back to the same earlier step (fallback=True)."""
    a, b, empty, broken, bad_diff = (tmp_path / n for n in ("a", "b", "empty", "broken", "bad_diff"))
    _lineage(a, 12)
    _lineage(b, 17)          # the same deterministic run, 5 steps further: steps 0..12 are identical
    empty.mkdir()
    shutil.copytree(a, broken)
    for p in broken.rglob("*"):
        if p.is_file() and p.parent.name == "manifests":
            p.write_bytes(b"{not json")
    shutil.copytree(a, bad_diff)
    last = sorted((bad_diff / "objects").glob("*diff*"))[-1]   # names sort in step order
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    first_bad = int(last.name.split("-")[2])
    cases = [([str(a), str(b)], -1), ([str(a), str(a)], 1), ([str(empty)] * 2, -1), ([str(broken), str(a)], -1),
             ([str(bad_diff)] * 2, -1)]
    out = str(tmp_path / "res")
    T.spawn(_worker, args=(2, T.free_port(), cases, out), nprocs=2)
    res = list(zip(*(json.load(open(f"{out}.{r}")) for r in range(2))))   # per case: (rank 0, rank 1)
    assert not any("crash" in r for case in res for r in case), res
    agreed, bad, fresh, unresolved, fell_back = res
    assert [r.get("step") for r in fell_back] == [first_bad - 1] * 2, (first_bad, fell_back)
    assert fell_back[0]["w"] == fell_back[1]["w"]
    assert [r.get("step") for r in agreed] == [12, 12], agreed
    assert agreed[0]["restored"] and agreed[1]["restored"] and agreed[0]["w"] == agreed[1]["w"], agreed
    assert [r.get("error") for r in bad] == ["RestoreError", "RestoreError"], bad
    assert all("rank(s) [1]" in r["message"] and "step 12" in r["message"] for r in bad), bad
    assert [(r.get("step"), r.get("restored")) for r in fresh] == [(0, False), (0, False)], fresh
    assert [r.get("error") for r in unresolved] == ["RestoreError", "RestoreError"], unresolved
    assert all("rank 0 could not resolve" in r["message"] for r in unresolved), unresolved


# -- per-rank loop state (#13 item 1) ------------------------------------------------------------------------
def _group_worker(rank, world, port, uri, out, start_fresh, until, abandon_rank1, ef="off"):  # noqa: C901
    """A 2-rank DDP loop with dropout and RNG-driven sampling per rank: restore (agreed), attach (rank 0 the
    Checkpointer, rank 1 its loop recorder), train to ``until``; write each rank's final state and RNG."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ray_ckpt.integrations.train_session import record_rank_loop as _record_rank_loop
    T.init_dist(rank, world, port)
    res = {}
    try:
        model = T.make_model("mlp_do")         # (seeds 0: the same initial weights on every rank)
        torch.manual_seed(1000 + rank)           # then each rank's own streams
        ddp = DDP(model)
        opt = T.make_optimizer("adamw", model)
        sch = T.make_scheduler(opt)
        data = _Pos()
        extra = data
        if ef != "off":        # top-k with error feedback; "exact": its residuals are checkpointed per rank
            from ray_ckpt import compression
            topk = compression.TopKState(ratio=0.05, error_feedback=True)
            ddp.register_comm_hook(topk, compression.topk_hook)
            if ef == "exact":
                extra = compression.ResidualState(topk, ddp, data)
        storage = open_uri(uri)
        start = 0
        if not start_fresh:
            torch.manual_seed(77 + rank)         # a fresh process: restore must bring the run's streams back
            start, restored = agreed_restore(storage, ddp, opt, scheduler=sch, extra_state=extra, runtime="local")
            res["start"] = start
        ck = None
        if rank == 0:
            ck = ray_ckpt.Checkpointer(storage, model, opt, scheduler=sch, extra_state=extra, start_step=start,
                                       full_every=5, batch_steps=4, policy="fixed", recovery_every=1)
        # abandoning: rank 1's records go out only in batches of 4 (the longest handoff_delay: no time-based write
        # within the test), so the steps after the last full batch are surely unwritten when its process exits
        rec = _record_rank_loop(storage, rank, ddp, opt, ck, start=start, extra_state=extra,
                                config=CheckpointConfig.resolve(full_every=5, batch_steps=4, handoff_delay=60.0
                                                                if abandon_rank1 else None))
        for s in range(start, until):
            data.pos += 1
            T.train_step("mlp_do", ddp, opt, sch, s, rank, reseed=False)
        if ck is not None:
            ck.close()
        if rec is not None and not abandon_rank1:
            rec.close()
        res.update(step=until, pos=data.pos, rng=torch.get_rng_state().tolist()[:64], reset=data.reset,
                   w=model.out.weight.detach().reshape(-1)[:8].tolist(),
                   probe=torch.rand(4).tolist())
    except Exception:  # noqa: BLE001
        res = {"crash": traceback.format_exc()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    if abandon_rank1 and rank == 1:
        import os
        os._exit(0)      # the process dies with its last batch of loop records unwritten
    T.close_dist(together=not abandon_rank1)     # abandoned: no barrier, rank 1 is gone


class _Pos:
    def __init__(self):
        self.pos = 0
        self.reset = False

    def reset_for_new_rank(self):   # the user hook a rank new to the group gets
        self.reset = True

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, d):
        self.pos = d["pos"]


def _group(tmp_path, uri, tag, start_fresh, until, abandon_rank1=False, ef="off", world=2):
    out = str(tmp_path / tag)
    T.spawn(_group_worker, args=(world, T.free_port(), uri, out, start_fresh, until, abandon_rank1, ef),
             nprocs=world)
    res = [json.load(open(f"{out}.{r}")) for r in range(world)]
    assert not any("crash" in r for r in res), res
    return res


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    """The uninterrupted 23-step run of the 2-rank loop (shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("plain-ref")
    return _group(tmp, str(tmp / "ref"), "ref", True, 23)


@pytest.mark.procs
def test_each_rank_continues_with_its_own_rng_and_extra_state(tmp_path, plain_reference):
    ref = plain_reference
    assert ref[0]["probe"] != ref[1]["probe"]          # the ranks' streams differ: per-rank state matters
    uri = str(tmp_path / "ckpt")
    _group(tmp_path, uri, "a", True, 13)
    got = _group(tmp_path, uri, "b", False, 23)
    assert [r["start"] for r in got] == [13, 13]
    for r in range(2):
        for key in ("pos", "rng", "w", "probe"):
            assert got[r][key] == ref[r][key], f"rank {r}: {key} differs from the uninterrupted run"


@pytest.mark.procs
def test_a_rank_whose_last_loop_records_were_lost_pulls_the_group_back(tmp_path, plain_reference):
    """Rank 1 dies with its last records unwritten (rank 0 made all 14 steps durable): every rank restores the
    last step rank 1 recorded, and the continued run still equals the uninterrupted one on every rank."""
    ref = plain_reference
    uri = str(tmp_path / "ckpt")
    _group(tmp_path, uri, "a", True, 14, abandon_rank1=True)
    # rank 1 wrote its loop records in batches of 4 only: the last ones were lost; the group must agree on the
    # last step it recorded (rank 0 made all 14 durable)
    recorded = rank_loop_head(open_uri(uri), 1, 1)
    assert recorded is not None and recorded < 14, recorded        # its last records were lost
    got = _group(tmp_path, uri, "b", False, 23)
    starts = [r["start"] for r in got]
    assert starts == [recorded, recorded], (starts, recorded)
    for r in range(2):
        for key in ("pos", "rng", "w", "probe"):
            assert got[r][key] == ref[r][key], f"rank {r}: {key} differs from the uninterrupted run"


@pytest.mark.procs
def test_error_feedback_residuals_are_restored_per_rank(tmp_path):
    """Top-k with error feedback: each rank's residual is part of its loop state (ResidualState), so the
    continued run equals the uninterrupted one on every rank; without it, the same restore diverges."""
    ref = _group(tmp_path, str(tmp_path / "ref"), "ref", True, 23, ef="exact")
    _group(tmp_path, str(tmp_path / "c1"), "a", True, 13, ef="exact")
    got = _group(tmp_path, str(tmp_path / "c1"), "b", False, 23, ef="exact")
    assert [r["start"] for r in got] == [13, 13]
    for r in range(2):
        for key in ("pos", "rng", "w", "probe"):
            assert got[r][key] == ref[r][key], f"rank {r}: {key} differs from the uninterrupted run"
    # the control: residuals not checkpointed (restored as zeros) -> the weights diverge
    _group(tmp_path, str(tmp_path / "c2"), "c", True, 13, ef="lossy")
    lossy = _group(tmp_path, str(tmp_path / "c2"), "d", False, 23, ef="lossy")
    assert lossy[0]["w"] != ref[0]["w"]


@pytest.mark.procs
def test_a_rank_new_to_the_group_derives_its_streams_deterministically(tmp_path):
    """1 rank grows to 2: rank 1 has no loop state of its own; it keeps rank 0's extra state, runs the user's
    reset_for_new_rank() hook, and derives RNG streams that differ from rank 0's and are the same at every
    restore of the same checkpoint."""
    a, b = tmp_path / "a", tmp_path / "b"
    _group(tmp_path, str(a), "one", True, 10, world=1)
    shutil.copytree(a, b)
    first = _group(tmp_path, str(a), "x", False, 16)
    second = _group(tmp_path, str(b), "y", False, 16)
    assert [r["start"] for r in first] == [r["start"] for r in second] == [10, 10]
    assert first[1]["reset"] and not first[0]["reset"]
    assert first[1]["rng"] == second[1]["rng"] and first[1]["probe"] == second[1]["probe"]
    assert first[1]["probe"] != first[0]["probe"]
    assert first[0]["w"] == second[0]["w"]


def test_rank_loop_state_is_written_within_max_batch_delay_not_only_per_batch(tmp_path):
    """A rank's loop records are written once the partial batch is ``max_batch_delay`` old: the step a group
    can agree on after a crash trails the training by that delay, not by up to ``batch_steps`` steps (the
    failure demo lost 4 steps per restart with ``batch_steps=5``)."""
    import time

    from ray_ckpt.engine.rankloop import RankLoopRecorder, rank_loop_head

    storage = open_uri(str(tmp_path / "ck"))
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    rec = RankLoopRecorder(storage, 1, model, opt, main_generation=1, start_step=0, batch_steps=10,
                           max_batch_delay=0.2)
    for s in range(3):
        T.train_step("mlp", model, opt, None, s)
    deadline = time.monotonic() + 10
    while rank_loop_head(storage, 1, 1) != 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank_loop_head(storage, 1, 1) == 3      # 3 of a batch of 10, written for their age
    rec.close()


def test_a_rank_of_the_saved_world_without_restorable_loop_state_is_warned_about(tmp_path, caplog):
    """A rank that recorded loop state in the restored generation but has none that restores the agreed step (its
    records lost or collected) cannot continue bit for bit: said at WARNING, not as a new rank's INFO line."""
    import logging

    from ray_ckpt.engine.rankloop import RankLoopRecorder, rank_loop_recorded
    from ray_ckpt.integrations.agreement import _restore_own_loop

    storage = open_uri(str(tmp_path / "ck"))
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    RankLoopRecorder(storage, 1, model, opt, main_generation=1, start_step=0, max_batch_delay=0).close()
    assert rank_loop_recorded(storage, 1, 1) and not rank_loop_recorded(storage, 1, 2)
    assert not rank_loop_recorded(storage, 2, 1)
    with caplog.at_level(logging.INFO, logger="ray_ckpt"):
        _restore_own_loop(storage, 1, 1, 30, recorded=False, extra_state=None)   # of the world, step 30 lost
        _restore_own_loop(storage, 2, 1, 30, recorded=False, extra_state=None)   # new to the group
    levels = {r.message.split()[2]: r.levelname for r in caplog.records if r.message.startswith("ray_ckpt: rank")}
    assert levels == {"1": "WARNING", "2": "INFO"}, caplog.text
    assert "does NOT continue bit for bit" in caplog.text


def test_explain_loss_names_the_recovery_point_before_the_step_every_rank_recorded():
    from ray_ckpt.integrations.agreement import explain_loss
    lost, why = explain_loss(135, [None, 130], 126, 130)
    assert lost == 9 and "rank 1 recorded its loop state only up to step 130" in why
    assert "no recovery point between step 126 and step 130" in why, why
