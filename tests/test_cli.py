"""The ray-ckpt CLI against a real lineage (as a subprocess, the way users run it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import ray_ckpt
from tests import _training as T

CLI = [sys.executable, "-m", "ray_ckpt.cli.main"]


def _lineage(uri, steps=12):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=5, batch_steps=3, recovery_every=1, keep_fulls=0):
        for s in range(steps):
            T.train_step("mlp", model, opt, None, s)


def _run(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_ls_inspect_verify(tmp_path):
    uri = tmp_path / "ckpt"
    _lineage(uri)
    r = _run("ls", uri, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["head"] == 12 and info["generations"][0]["fulls"] == [0, 5, 10]
    assert info["generations"][0]["recoverable"] == "0..12"
    r = _run("inspect", uri, "--step", 8, "--json")
    plan = json.loads(r.stdout)
    assert plan["step"] == 8 and plan["read"][0]["kind"] == "full" and plan["read"][0]["steps"] == [5, 5]
    r = _run("verify", uri, "-q")
    assert r.returncode == 0 and "verified 8/8" in r.stdout, r.stdout + r.stderr
    victim = next((uri / "objects").glob("*diff-000000000006*"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = _run("verify", uri)
    assert r.returncode == 1 and "CORRUPT" in r.stderr and victim.name in r.stdout


def test_errors_are_clear(tmp_path):
    r = _run("ls", "gopher://x/y")
    assert r.returncode == 1 and "gopher" in r.stderr
    r = _run("ls", tmp_path / "nothing")
    assert r.returncode == 1 and "no checkpoint lineage" in r.stderr and r.stdout == ""
    r = _run("ls", tmp_path, "-o", "novalue")
    assert r.returncode != 0


def test_inspect_plot_draws_generations_and_inspect_json(tmp_path):
    uri = tmp_path / "ckpt"
    _lineage(uri)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    assert ray_ckpt.restore(uri, model, opt, step=7) == 7           # a branch: generation 2 starts at step 7
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=5, batch_steps=3):
        for s in range(7, 10):
            T.train_step("mlp", model, opt, None, s)
    r = _run("inspect", uri, "--plot", tmp_path / "lineage.png", "--json")
    assert r.returncode == 0, r.stderr
    assert "2 generations" in r.stderr and json.loads(r.stdout)["generation"] == 2
    png = (tmp_path / "lineage.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
