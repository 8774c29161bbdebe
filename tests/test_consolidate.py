"""Consolidation of sharded (FSDP2) state: the shard lineages of 2 gloo ranks gathered, in this single process
(no process group), into an unsharded model and optimizer (restore) and into the export formats (ray-ckpt
export: torch, safetensors, DCP), bitwise against the gathered state of the run; the CLI's inspect, verify and gc
on a sharded root; a root opened in a way that cannot work says what it holds."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

import ray_ckpt
from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.engine import consolidate, shard_chains, shard_layout
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.storage import open_storage
from tests import _fsdp_worker as W, _training as T


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-rank FSDP2 run (TinyGPT, AdamW, a scheduler; a full every 6 steps, diffs in batches of 4) and the
    gathered global state of each of its steps."""
    d = tmp_path_factory.mktemp("consol")
    uri = str(d / "ckpt")
    T.spawn(W.train_checkpointed, args=(2, T.free_port(), uri, str(d)), nprocs=2)
    load = lambda name: torch.load(os.path.join(d, name), weights_only=False)   # noqa: E731
    assert torch.distributed.is_available() and not torch.distributed.is_initialized()   # this process: no group
    return {"uri": uri, "dir": d, "glob": load("global.pt"), "sched": load("sched.pt"), "groups": load("groups.pt")}


def _plain(seed=99):
    model = T.make_model(W.KIND, seed)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt, total=W.STEPS)


def _check(run, step, model, opt, sch, what):
    want = run["glob"][step]
    T.assert_same(want["model"], {k: v.detach() for k, v in model.state_dict().items()}, f"{what} model")
    osd = opt.state_dict()
    T.assert_same(want["opt"], osd["state"], f"{what} optimizer state")     # exp_avg, exp_avg_sq, step
    T.assert_same(run["groups"][step], osd["param_groups"], f"{what} param groups")
    if sch is not None:
        T.assert_same(run["sched"][step], sch.state_dict(), f"{what} scheduler")


@pytest.mark.procs
def test_restore_into_a_plain_model_bitwise_latest_and_older(run):
    for step in (None, 13, 6, 5):     # the latest; diffs after a full; a full; diffs of the first chain
        model, opt, sch = _plain()
        got = ray_ckpt.restore(run["uri"], model, opt, scheduler=sch, step=step)
        assert got == (W.STEPS if step is None else step)
        _check(run, got, model, opt, sch, f"step {got}")
    # training goes on from the consolidated state like an unsharded run: one step, finite and different
    before = {k: v.clone() for k, v in model.state_dict().items()}
    T.train_step(W.KIND, model, opt, sch, 5)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.procs
def test_restore_fallback_and_what_cannot_work_is_refused(run, tmp_path):
    uri = run["uri"]
    # a step that is not complete on every rank / does not exist: NoCheckpointError saying what the root holds
    with pytest.raises(ray_ckpt.NoCheckpointError, match=r"every rank .*world size 2: latest recoverable step "
                                                          r"per rank \[20, 20\]"):
        ray_ckpt.restore(uri, *_plain()[:2], step=W.STEPS + 5)
    # one rank's shard lineage into a plain model: refused, naming the root
    with pytest.raises(ValueError, match="shard lineage of rank 1 of 2"):
        ray_ckpt.restore(os.path.join(uri, "shards/w00002/r00001"), *_plain()[:2])
    # a model or optimizer the saved state does not fit: refused before anything is written
    other = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(other.parameters())
    w = other.weight.detach().clone()
    with pytest.raises(ValueError, match="does not fit this model"):
        ray_ckpt.restore(uri, other, opt)
    assert torch.equal(other.weight, w)
    model, _, _ = _plain()
    with pytest.raises(ValueError, match="does not fit this optimizer: it was saved from torch.optim.adamw:AdamW"):
        ray_ckpt.restore(uri, model, torch.optim.SGD(model.parameters(), lr=0.1))
    # rank 1's newest diff object is corrupt: fallback gathers the newest step complete and readable on every rank
    bad = tmp_path / "bad"
    shutil.copytree(uri, bad)
    st = open_storage(str(bad))
    newest = sorted(k for k in st.list("shards/w00002/r00001/objects/") if "-diff-" in k)[-1]
    data = bytearray(st.read(newest))
    data[len(data) // 2] ^= 0xFF
    st.write(newest, bytes(data))
    expect = int(newest.rsplit("-", 2)[-2]) - 1
    with pytest.raises(ray_ckpt.CorruptObjectError):
        ray_ckpt.restore(str(bad), *_plain()[:2])
    model, opt, sch = _plain()
    assert ray_ckpt.restore(str(bad), model, opt, scheduler=sch, fallback=True) == expect
    _check(run, expect, model, opt, sch, f"fallback step {expect}")


@pytest.mark.procs
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_cli_export_of_a_sharded_root_loads_bitwise(run, tmp_path, fmt, capsys):
    out = tmp_path / fmt
    assert cli_main(["export", run["uri"], str(out), "--step", "15", "--format", fmt, "-q", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 15 and info["consolidated_from_world"] == 2
    if fmt == "torch":      # plain torch.load, as a user would
        got = torch.load(out / "checkpoint.pt", weights_only=False)
        osd = got["optimizer"]
    elif fmt == "safetensors":
        from safetensors.torch import load_file
        got = {"model": load_file(out / "model.safetensors")}
        osd = ray_ckpt.load_export(out)["optimizer"]
    else:                   # DCP into a plain model's state dict, one process
        import torch.distributed.checkpoint as dcp
        model, _, _ = _plain()
        sd = {"model": model.state_dict()}
        with warnings.catch_warnings():   # "no process group: loading in one process" is what we mean
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=str(out))
        got = sd
        osd = ray_ckpt.load_export(out)["optimizer"]
    T.assert_same(run["glob"][15]["model"], got["model"], f"{fmt} model")
    T.assert_same(run["glob"][15]["opt"], osd["state"], f"{fmt} optimizer state")
    # and the export loads into a plain model and optimizer
    model, opt, _ = _plain()
    ex = ray_ckpt.load_export(out)
    model.load_state_dict(ex["model"])
    opt.load_state_dict(ex["optimizer"])
    T.assert_same(run["glob"][15]["opt"], opt.state_dict()["state"], f"{fmt} loaded optimizer")


@pytest.mark.procs
def test_cli_inspect_verify_restore_gc_on_a_sharded_root(run, tmp_path, capsys):
    root = tmp_path / "gc"
    shutil.copytree(run["uri"], root)
    uri = str(root)
    capsys.readouterr()
    assert cli_main(["inspect", uri, "--json", "--step", "13"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["step"] == 13 and plan["world"] == 2 and [r["rank"] for r in plan["ranks"]] == [0, 1]
    for r in plan["ranks"]:   # full 12 + the diffs 13..
        assert [o["kind"] for o in r["read"]] == ["full", "diff"] and r["read"][0]["steps"] == [12, 12]
        assert r["read"][0]["object"].startswith(f"shards/w00002/r{r['rank']:05d}/objects/")
    assert cli_main(["verify", uri, "-q"]) == 0
    text = capsys.readouterr().out
    n = sum(len(st.list("manifests/")) for st in (shard_layout.shard_storage(open_storage(uri), 2, r) for r in (0, 1)))
    assert f"verified {n}/{n} objects" in text
    assert cli_main(["restore", uri, str(tmp_path / "r"), "-q"]) == 0
    capsys.readouterr()
    got = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)
    assert got["step"] == W.STEPS
    T.assert_same(run["glob"][W.STEPS]["model"], got["model"], "restore model")
    # gc keeps the 2 newest fulls of every rank (12, 18): steps >= 12 stay restorable, bitwise
    assert cli_main(["gc", uri, "--keep-fulls", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kept_from_step"] == 12 and res["objects"]
    assert all(o.startswith("shards/w00002/r0000") for o in res["objects"])
    assert {o.split("/")[2] for o in res["objects"]} == {"r00000", "r00001"}
    st = open_storage(uri)
    lins = [load_lineage(shard_layout.shard_storage(st, 2, r))[0] for r in (0, 1)]
    assert min(shard_chains.common_steps(lins)) == 12 and shard_chains.agreed_step(lins, None) == W.STEPS
    model, opt, sch = _plain()
    assert ray_ckpt.restore(uri, model, opt, scheduler=sch, step=12) == 12
    _check(run, 12, model, opt, sch, "step 12 after gc")
    assert cli_main(["verify", uri, "-q"]) == 0


@pytest.mark.procs
def test_gc_never_collects_a_step_that_a_lagging_rank_still_needs(run, tmp_path, capsys):
    """Rank 1 lags (its lineage ends at its full of step 12; rank 0 reaches 20, with a full at 18): with
    --keep-fulls 1 rank 0 alone would keep only from 18, and step 12, the newest complete on every rank, would be
    lost."""
    root = tmp_path / "lag"
    shutil.copytree(run["uri"], root)
    st = open_storage(str(root))
    r1 = shard_layout.shard_storage(st, 2, 1)
    for key in r1.list("manifests/"):
        if int(key.split("/")[-1].split("-")[2].split(".")[0]) > 12:    # g<gen>-<kind>-<first>[-<last>].json
            r1.delete(key)
    r1.delete("lineage/index.json") if r1.exists("lineage/index.json") else None
    assert cli_main(["gc", str(root), "--keep-fulls", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kept_from_step"] == 12 and res["objects"]
    model, opt, sch = _plain()
    assert ray_ckpt.restore(str(root), model, opt, scheduler=sch) == 12
    _check(run, 12, model, opt, sch, "step 12 after gc with a lagging rank")


def test_fsdp2_restore_of_a_root_without_shards_says_what_is_there(tmp_path):
    """No saved world: the error says so, and that an unsharded lineage is there (restore it unsharded)."""
    uri = str(tmp_path / "plain")
    model, opt, _ = _plain()
    with ray_ckpt.Checkpointer(uri, model, opt, policy="fixed", keep_fulls=0):
        pass
    with pytest.raises(ray_ckpt.NoCheckpointError, match="no shard lineages there; it holds an unsharded lineage"):
        shard_chains.choose_world(open_storage(uri), None)
    assert consolidate.consolidates(open_storage(uri)) == []
