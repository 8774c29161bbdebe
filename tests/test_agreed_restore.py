"""One restore step for all ranks (issue #13, item 2): world rank 0 decides, every rank restores that step, and a
rank that cannot restore it fails the restore on every rank. Two real gloo processes, runtime="local"."""
from __future__ import annotations

import json
import shutil
import traceback

import torch.multiprocessing as mp

import ray_ckpt
from ray_ckpt.api import open_uri
from ray_ckpt.integrations.ray_train import agreed_restore
from tests import _training as T


def _lineage(path, steps):
    """A lineage with steps 0..steps of the MLP loop (full every 5)."""
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    with ray_ckpt.Checkpointer(str(path), model, opt, scheduler=sch, full_every=5, batch_steps=2,
                               policy="fixed"):
        for s in range(steps):
            T.train_step("mlp", model, opt, sch, s)


def _worker(rank, world, port, uris, out, bad_rank):
    T.init_dist(rank, world, port)
    try:
        model = T.make_model("mlp", seed=50 + rank)
        if rank == bad_rank:   # a model whose shapes do not match the checkpoint: this rank cannot load it
            model = T.make_model("mlp", seed=50 + rank)
            model.fc1 = type(model.fc1)(model.fc1.in_features, model.fc1.out_features + 1)
        opt = T.make_optimizer("adamw", model)
        sch = T.make_scheduler(opt)
        try:
            step, restored = agreed_restore(open_uri(uris[rank]), model, opt,
                                            scheduler=sch, runtime="local")
            res = {"step": step, "restored": restored, "w": T.snapshot(model, opt, sch)["model"]["fc1.weight"]
                   .sum().item()}
        except Exception as e:  # noqa: BLE001
            res = {"error": type(e).__name__, "message": str(e)}
    except Exception:  # noqa: BLE001
        res = {"crash": traceback.format_exc()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)


def _run(tmp_path, uris, bad_rank=-1):
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(2, T.free_port(), uris, out, bad_rank), nprocs=2, join=True)
    res = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert not any("crash" in r for r in res), res
    return res


def test_every_rank_restores_the_step_rank_0_resolved(tmp_path):
    """Rank 1 sees a lineage that reaches further (as when a commit lands while the ranks resolve "latest"):
    it still restores rank 0's step, and both hold the same state."""
    a, b = tmp_path / "a", tmp_path / "b"
    _lineage(a, 12)
    _lineage(b, 17)          # the same deterministic run, 5 steps further: steps 0..12 are identical
    res = _run(tmp_path, [str(a), str(b)])
    assert [r.get("step") for r in res] == [12, 12], res
    assert res[0]["restored"] and res[1]["restored"] and res[0]["w"] == res[1]["w"], res


def test_a_rank_that_cannot_restore_fails_the_restore_on_every_rank(tmp_path):
    a = tmp_path / "a"
    _lineage(a, 8)
    res = _run(tmp_path, [str(a), str(a)], bad_rank=1)
    assert [r.get("error") for r in res] == ["RestoreError", "RestoreError"], res
    assert all("rank(s) [1]" in r["message"] and "step 8" in r["message"] for r in res), res


def test_no_lineage_starts_every_rank_from_scratch(tmp_path):
    (tmp_path / "empty").mkdir()
    res = _run(tmp_path, [str(tmp_path / "empty")] * 2)
    assert [(r.get("step"), r.get("restored")) for r in res] == [(0, False), (0, False)], res


def test_rank_0_failing_to_resolve_fails_every_rank(tmp_path):
    a = tmp_path / "a"
    _lineage(a, 6)
    broken = tmp_path / "broken"
    shutil.copytree(a, broken)
    for p in broken.rglob("*"):          # every manifest unreadable: rank 0 cannot resolve a step
        if p.is_file() and p.parent.name == "manifests":
            p.write_bytes(b"{not json")
    res = _run(tmp_path, [str(broken), str(a)])
    assert [r.get("error") for r in res] == ["RestoreError", "RestoreError"], res
    assert all("rank 0 could not resolve" in r["message"] for r in res), res
