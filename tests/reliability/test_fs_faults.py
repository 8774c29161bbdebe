"""Read-only and full file systems for real (issue #12 item 2): the checkpoint folder is a read-only bind mount,
or a tmpfs too small for the run, inside a private mount namespace (``unshare -m``: needs root or
CAP_SYS_ADMIN; skipped with the reason otherwise). Root ignores file permissions, so chmod cannot stand in."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ray_ckpt
from tests import _training as T
from tests.reliability import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _namespace_available(tmp_path) -> str | None:
    """Why a private mount namespace with a read-only bind mount cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    d = tmp_path / "probe"
    d.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount --bind {d} {d} && mount -o remount,bind,ro {d} && ! touch {d}/x"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot make a read-only bind mount: {r.stderr.strip()[:200]}"


def _in_namespace(setup: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``_fs_fault`` with ``args`` after ``setup`` (shell mount commands) in a private mount namespace."""
    cmd = " ".join([sys.executable, "-m", "tests.reliability._fs_fault", *args])
    return subprocess.run(["unshare", "-m", "sh", "-c", f"{setup} && exec {cmd}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def namespaces(tmp_path):
    why = _namespace_available(tmp_path)
    if why:
        pytest.skip(why)


def test_read_only_checkpoints_restore_and_refuse_a_writer_clearly(tmp_path, namespaces):
    """A lineage on a read-only file system still restores bitwise (restore writes nothing); attaching a writer to
    it fails at once with an error that names the path and the cause."""
    ck_dir = tmp_path / "ckpt"
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(str(ck_dir), model, opt, full_every=5, batch_steps=2):
        for s in range(8):
            T.train_step("mlp", model, opt, None, s)
    live = T.snapshot(model, opt)
    ro = f"mount --bind {ck_dir} {ck_dir} && mount -o remount,bind,ro {ck_dir}"

    out = tmp_path / "restored.pt"
    r = _in_namespace(ro, "restore", str(ck_dir), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert got["step"] == 8
    T.assert_same(live, got["state"], "restored from a read-only file system")

    out = tmp_path / "attach.json"
    r = _in_namespace(ro, "attach", str(ck_dir), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["error"] is not None and "Read-only file system" in res["error"], res
    assert str(ck_dir) in res["error"], res
    assert res["seconds"] < 10, res         # at once, not after the write retry budget
    record("read-only file system (attach refused, restore works)", trials=1, recovered=1, bitwise=1,
           steps_lost=[0])


@pytest.mark.parametrize("runtime", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_full_disk_fails_the_training_thread_and_keeps_the_last_committed_step(tmp_path, namespaces, runtime):
    """A 3 MiB tmpfs fills up during training: the training thread gets a WriterError naming the cause (local:
    within a few steps; ray: once the node's worker reaches the failed write, seconds later — meanwhile the steps
    are held in memory), no retries for minutes, nothing torn visible, the last committed step restores bitwise
    from storage alone, and with ``runtime="ray"`` the memory tier still restores the step the error stopped."""
    ck_dir = tmp_path / "ckpt"
    ck_dir.mkdir()
    out = tmp_path / "full.pt"
    r = _in_namespace(f"mount -t tmpfs -o size=3m tmpfs {ck_dir}", "train" if runtime == "local" else "train-ray",
                      str(ck_dir), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = torch.load(out, weights_only=False)
    assert res["error"] is not None and "No space left on device" in res["error"], res["error"]
    assert str(ck_dir) in res["error"], res["error"]
    assert res["seconds"] < 60, res["seconds"]
    assert res["torn"] == []                 # the failed write left no partial file behind
    assert 0 < res["restored"] <= res["failed_at"]
    T.assert_same(res["live"], res["state"], f"step {res['restored']} from storage after the disk filled up")
    if runtime == "local":
        lost = res["failed_at"] - res["restored"]
        assert lost <= 5, (res["failed_at"], res["restored"])
    else:
        lost = res["failed_at"] - res["restored_ray"]
        # at most what was not handed over: the chunk being collected and batch_steps (10) queued records
        assert 0 <= lost <= 20, (res["failed_at"], res["restored_ray"])
        T.assert_same(res["live_ray"], res["state_ray"], f"step {res['restored_ray']} from the memory tier")
    record(f"disk full (tmpfs, runtime={runtime})", trials=1, recovered=1, bitwise=1, steps_lost=[lost])
