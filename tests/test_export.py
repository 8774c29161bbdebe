"""Export (safetensors, PyTorch DCP, torch.save), CLI restore and gc: bitwise round trips without model code."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import ray_ckpt
from ray_ckpt.engine.export import ExportError
from tests import _training as T

CLI = [sys.executable, "-m", "ray_ckpt.cli.main"]
STEPS = 12


def _run(*args):
    """``ray-ckpt *args`` in this process (tests/test_cli.py and the terminal tests below run it as a subprocess):
    its exit status and what it wrote to stdout and stderr."""
    import contextlib
    import io

    from ray_ckpt.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:      # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["ray-ckpt", *map(str, args)], rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """A TinyGPT + AdamW + scheduler lineage (fulls at 0, 5, 10) and the uninterrupted run's states."""
    uri = tmp_path_factory.mktemp("export") / "ckpt"
    model = T.make_model("gpt")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=5, batch_steps=3, recovery_every=1, keep_fulls=0):
        for s in range(STEPS):
            T.train_step("gpt", model, opt, sch, s)
    return uri, T.reference_states(STEPS, "gpt")


def _check(loaded: dict, ref: dict, what: str, loop: bool = True):
    T.assert_same({"model": loaded["model"], "opt": loaded["optimizer"]}, {"model": ref["model"], "opt": ref["opt"]},
                  what)
    if loop:
        T.assert_same(loaded["loop"]["scheduler"], ref["sched"], f"{what} scheduler")


@pytest.mark.parametrize("fmt", ["safetensors", "dcp", "torch"])
def test_export_round_trips_bitwise(gpt_run, tmp_path, fmt):
    uri, ref = gpt_run
    out = tmp_path / fmt
    info = ray_ckpt.export(uri, out, step=8, format=fmt)          # full 5 + 3 replayed steps
    assert info["step"] == 8 and info["format"] == fmt and (out / "ray_ckpt_export.json").exists()
    loaded = ray_ckpt.load_export(out)
    assert loaded["step"] == 8
    _check(loaded, ref[8], f"{fmt} step 8", loop=fmt != "safetensors")
    # into live objects: the same as the uninterrupted run
    model = T.make_model("gpt", seed=1)
    opt = T.make_optimizer("adamw", model)
    model.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    T.assert_same({"model": model.state_dict(), "opt": opt.state_dict()}, {"model": ref[8]["model"],
                                                                           "opt": ref[8]["opt"]}, f"{fmt} live")


def test_safetensors_loads_with_the_ecosystems_tools(gpt_run, tmp_path):
    from safetensors.torch import load_file
    uri, ref = gpt_run
    ray_ckpt.export(uri, tmp_path / "st")                          # latest step, default format
    fresh = T.make_model("gpt", seed=3)
    fresh.load_state_dict(load_file(str(tmp_path / "st" / "model.safetensors")), strict=True)
    T.assert_same(fresh.state_dict(), ref[STEPS]["model"], "safetensors.load_file")


def test_the_examples_gpt_exports_to_safetensors_and_loads_strict(tmp_path):
    """The README's model (examples/gpt.py) trained a few steps: its export loads into a fresh GPT."""
    from safetensors.torch import load_file

    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ray_ckpt.Checkpointer(tmp_path / "c", model, opt, full_every=4, batch_steps=2):
        for s in range(6):
            x = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            model.loss(x[:, :-1], x[:, 1:]).backward()
            opt.step()
    ray_ckpt.export(tmp_path / "c", tmp_path / "st")
    fresh = GPT(cfg)
    fresh.load_state_dict(load_file(str(tmp_path / "st" / "model.safetensors")), strict=True)
    T.assert_same(fresh.state_dict(), model.state_dict(), "examples.gpt via safetensors")


def test_dcp_export_loads_with_torch_distributed_checkpoint(gpt_run, tmp_path):
    import torch.distributed.checkpoint as dcp
    uri, ref = gpt_run
    ray_ckpt.export(uri, tmp_path / "dcp", step=10, format="dcp")
    fresh = T.make_model("gpt", seed=4)
    sd = {"model": fresh.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    fresh.load_state_dict(sd["model"], strict=True)
    T.assert_same(fresh.state_dict(), ref[10]["model"], "dcp.load")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_tied_parameters_export_once_per_key_and_load_strict(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ray_ckpt.Checkpointer(tmp_path / "c", model, opt, full_every=4, batch_steps=2):
        for s in range(6):
            opt.zero_grad()
            x = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(s))
            nn.functional.cross_entropy(model(x).reshape(-1, 16), x.reshape(-1)).backward()
            opt.step()
    ray_ckpt.export(tmp_path / "c", tmp_path / "st")
    loaded = ray_ckpt.load_export(tmp_path / "st")
    assert loaded["model"]["emb.weight"] is loaded["model"]["head.weight"]     # tied again
    fresh = Tied()
    from safetensors.torch import load_file
    fresh.load_state_dict(load_file(str(tmp_path / "st" / "model.safetensors")), strict=True)
    assert torch.equal(fresh.emb.weight, model.emb.weight) and fresh.head.weight is fresh.emb.weight
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_opt.load_state_dict(loaded["optimizer"])
    T.assert_same(fresh_opt.state_dict(), opt.state_dict(), "tied optimizer")


def test_amber_lossless_chain_exports_exactly(tmp_path):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(tmp_path / "a", model, opt, strategy=ray_ckpt.Amber(threshold=0),
                               full_every=6, batch_steps=2):
        for s in range(9):
            T.train_step("mlp", model, opt, None, s)
    ray_ckpt.export(tmp_path / "a", tmp_path / "out", format="torch")
    loaded = ray_ckpt.load_export(tmp_path / "out")
    assert loaded["step"] == 9
    T.assert_same({"model": loaded["model"], "opt": loaded["optimizer"]},
                  {"model": model.state_dict(), "opt": opt.state_dict()}, "amber export")


def test_export_refuses_bad_requests(gpt_run, tmp_path):
    uri, _ = gpt_run
    with pytest.raises(ExportError, match="format"):
        ray_ckpt.export(uri, tmp_path / "x", format="onnx")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        ray_ckpt.export(uri, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    with pytest.raises(ray_ckpt.NoCheckpointError):
        ray_ckpt.export(uri, tmp_path / "y", step=999)
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob("y.tmp-*"))


def test_cli_export_restore_and_gc(gpt_run, tmp_path):
    uri, ref = gpt_run
    r = _run("restore", uri, tmp_path / "r", "--step", 7)
    assert r.returncode == 0, r.stderr
    assert "step 7" in r.stdout and r.stderr == ""                 # not a terminal: no bars
    _check(ray_ckpt.load_export(tmp_path / "r"), ref[7], "cli restore")
    r = _run("restore", uri, tmp_path / "r", "--step", 7)
    assert r.returncode == 1 and "--force" in r.stderr
    r = _run("export", uri, tmp_path / "e", "--format", "dcp", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == STEPS, r.stderr
    r = _run("export", uri, tmp_path / "n", "--step", 99)
    assert r.returncode == 1 and "99" in r.stderr

    # gc on a copy: --dry-run deletes nothing, then gc keeps what the newest fulls need
    import shutil
    gc_uri = tmp_path / "gc"
    shutil.copytree(uri, gc_uri)
    before = sorted(p.relative_to(gc_uri) for p in gc_uri.rglob("*") if p.is_file())
    r = _run("gc", gc_uri, "--keep-fulls", 2, "--dry-run")
    assert r.returncode == 0 and "would delete" in r.stdout, r.stderr
    assert sorted(p.relative_to(gc_uri) for p in gc_uri.rglob("*") if p.is_file()) == before
    r = _run("gc", gc_uri, "--keep-fulls", 2, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["kept_from_step"] == 5 and got["objects"] and not got["dry_run"]
    assert not any((gc_uri / o).exists() for o in got["objects"])
    ls = json.loads(_run("ls", gc_uri, "--json").stdout)
    assert ls["generations"][0]["fulls"] == [5, 10] and ls["generations"][0]["recoverable"] == f"5..{STEPS}"
    for step in (5, 9, STEPS):                                    # everything from the kept fulls on restores
        m = T.make_model("gpt", seed=2)
        o = T.make_optimizer("adamw", m)
        assert ray_ckpt.restore(gc_uri, m, o, step=step) == step
        T.assert_same({"model": m.state_dict(), "opt": o.state_dict()},
                      {"model": ref[step]["model"], "opt": ref[step]["opt"]}, f"after gc, step {step}")
    r = _run("gc", gc_uri, "--keep-fulls", 2)
    assert r.returncode == 0 and "nothing to collect" in r.stdout
    assert _run("gc", gc_uri, "--keep-fulls", 0).returncode == 2


def _pty_run(*args) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns (exit status, what the terminal showed)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 120)
        if not r:
            break
        try:
            data = os.read(master, 4096)
        except OSError:   # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_progress_bars_on_a_terminal_only_and_quiet(gpt_run, tmp_path):
    uri, _ = gpt_run
    rc, shown = _pty_run("export", uri, tmp_path / "p", "--format", "torch")
    assert rc == 0 and "replay" in shown and "%|" in shown, shown
    rc, shown = _pty_run("verify", uri)
    assert rc == 0 and "verify" in shown and "%|" in shown, shown
    rc, shown = _pty_run("export", uri, tmp_path / "q", "--format", "torch", "--quiet")
    assert rc == 0 and shown.strip() == "", shown


def test_branches_and_gc_keep_what_the_live_timeline_needs(tmp_path):
    """Resume from an older step, then from a step of that branch: restores pick the right branch; runtime="local"
    keep_fulls and offline gc delete older chains and abandoned branches, never a step of the live timeline."""
    from tests._training import reference_states
    uri = tmp_path / "c"
    ref = reference_states(40)

    def run(start, stop, **kw):
        model = T.make_model("mlp")
        opt = T.make_optimizer("adamw", model)
        sch = T.make_scheduler(opt)
        if start:
            assert ray_ckpt.restore(uri, model, opt, scheduler=sch, step=start) == start
        with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=5, batch_steps=2,
                                   **{"recovery_every": 1, "keep_fulls": 0, **kw}):
            for s in range(start, stop):
                T.train_step("mlp", model, opt, sch, s)

    run(0, 30)                       # generation 1: 0..30
    run(12, 25)                      # generation 2 branches at 12 (steps 13..30 of generation 1 are abandoned)
    run(18, 40, keep_fulls=2)        # generation 3 branches at 18 of generation 2; keeps 2 fulls while it runs
    ls = json.loads(_run("ls", uri, "--json").stdout)
    assert ls["head"] == 40
    for step in (35, 36, 40):        # the live timeline from the kept fulls on restores, bitwise
        m = T.make_model("mlp", seed=5)
        o = T.make_optimizer("adamw", m)
        s_ = T.make_scheduler(o)
        assert ray_ckpt.restore(uri, m, o, scheduler=s_, step=step) == step
        T.assert_same(ref[step], T.snapshot(m, o, s_), f"step {step} after gc")
    names = {p.name for p in (uri / "objects").iterdir()}
    assert not any(n.startswith("g000001-") for n in names), sorted(names)      # older chains and branches gone
    assert not any(n.startswith("g000002-") for n in names), sorted(names)
    assert sorted(n for n in names if "-full-" in n) == ["g000003-full-000000000035.rckpt",
                                                         "g000003-full-000000000040.rckpt"], sorted(names)
    r = _run("gc", uri, "--keep-fulls", 1, "--json")
    got = json.loads(r.stdout)
    assert got["kept_from_step"] == 40 and all("g000003" in o for o in got["objects"])
    m = T.make_model("mlp", seed=5)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(uri, m, o) == 40


def test_gc_collects_per_rank_loop_state_by_the_main_timeline(tmp_path):
    """ranks/<r>/ lineages (RNG and extra state of ranks > 0) are collected with the main lineage: a rank's
    manifests are judged by the main generation they recorded for, not by the rank's own generation numbers."""
    from ray_ckpt.engine.gc import collect
    from ray_ckpt.engine.rankloop import RankLoopRecorder
    uri = tmp_path / "c"
    main_m, other_m = T.make_model("mlp"), T.make_model("mlp")
    main_o, other_o = T.make_optimizer("adamw", main_m), T.make_optimizer("adamw", other_m)
    storage = ray_ckpt.api.open_uri(uri)
    RankLoopRecorder(storage, 1, other_m, other_o, main_generation=1, start_step=0,  # a stale earlier record
                     full_every=5, batch_steps=2).close()
    rank_gen_before = len(list((uri / "ranks" / "1" / "manifests").iterdir()))
    ck = ray_ckpt.Checkpointer(uri, main_m, main_o, full_every=5, batch_steps=2, recovery_every=1, keep_fulls=0)         # main generation 1
    rec = RankLoopRecorder(storage, 1, other_m, other_o, main_generation=ck.generation, start_step=0,
                           full_every=5, batch_steps=2)                                  # rank generation 2
    for s in range(16):
        T.train_step("mlp", main_m, main_o, None, s)
        T.train_step("mlp", other_m, other_o, None, s)
    ck.close()
    rec.close()
    res = collect(storage, keep_fulls=2)
    assert res.kept_from_step == 10 and res.rank_deleted[1]
    assert all(m.last_step < 10 for m in res.rank_deleted[1])
    left = sorted((m.generation, m.first_step, m.last_step) for m in
                  ray_ckpt.engine.restore.load_lineage(ray_ckpt.engine.rankloop.rank_storage(storage, 1),
                                                       use_index=False)[0].manifests)
    assert left and all(last >= 10 for _, _, last in left), left
    assert rank_gen_before > 0


KILLED_GC = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
from ray_ckpt.engine.gc import collect
from ray_ckpt.storage import open_storage
st = open_storage({uri!r})
real, n = st.delete, [0]
def delete(key):
    real(key)
    n[0] += 1
    if n[0] == {after}:          # between a manifest and its object: the collection is cut there
        os.kill(os.getpid(), signal.SIGKILL)
st.delete = delete
collect(st, keep_fulls=1)
"""


def test_a_collection_killed_midway_loses_nothing_needed(gpt_run, tmp_path):
    """SIGKILL of `gc` after a manifest was deleted and before its object: every step from the kept fulls still
    restores bitwise, `verify` passes, and the next collection finishes the job (the orphan object included)."""
    import shutil
    import signal
    uri, ref = gpt_run
    gc_uri = tmp_path / "gc"
    shutil.copytree(uri, gc_uri)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", KILLED_GC.format(root=root, uri=str(gc_uri), after=3)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    for step in (10, 11, STEPS):          # keep_fulls=1: the full at 10 and what follows
        m = T.make_model("gpt", seed=2)
        o = T.make_optimizer("adamw", m)
        assert ray_ckpt.restore(gc_uri, m, o, step=step) == step
        T.assert_same({"model": m.state_dict(), "opt": o.state_dict()},
                      {"model": ref[step]["model"], "opt": ref[step]["opt"]}, f"after a killed gc, step {step}")
    assert _run("verify", gc_uri, "-q").returncode == 0

    def names():
        return ({p.stem for p in (gc_uri / "manifests").iterdir()},
                {p.name[:-len(".rckpt")] for p in (gc_uri / "objects").iterdir()})

    manifests, objects = names()
    orphans = objects - manifests
    assert len(orphans) == 1 and not manifests - objects, (orphans, manifests - objects)   # cut mid-pair
    got = json.loads(_run("gc", gc_uri, "--keep-fulls", 1, "--json").stdout)
    assert f"objects/{orphans.pop()}.rckpt" in got["objects"]
    manifests, objects = names()
    assert objects == manifests, objects ^ manifests                 # no orphan left
    assert json.loads(_run("ls", gc_uri, "--json").stdout)["generations"][0]["fulls"] == [10]


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("touch ray_ckpt_pwned",))


def test_load_export_runs_no_code_from_a_tampered_torch_export(tmp_path, monkeypatch):
    """A torch export is read with weights_only=True: a pickled object that would run code is refused."""
    import json as _json
    import pickle as _pickle

    import torch as _torch

    from ray_ckpt.lineage.layout import INFO_FILE
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "evil"
    out.mkdir()
    (out / INFO_FILE).write_text(_json.dumps({"format": "torch"}))
    _torch.save({"step": 1, "model": {}, "loop": _Evil()}, out / "checkpoint.pt")
    with pytest.raises(_pickle.UnpicklingError):
        ray_ckpt.load_export(out)
    assert not (tmp_path / "ray_ckpt_pwned").exists()
