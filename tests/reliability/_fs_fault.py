"""A training process on a file system that refuses writes (run by tests/reliability/test_fs_faults.py inside a
private mount namespace, where the checkpoint folder is a read-only bind mount or a tiny tmpfs).

``python -m tests.reliability._fs_fault MODE URI OUT`` with MODE

* ``restore``: restore the latest step into a fresh model (reads only) and save the state to OUT;
* ``attach``: attach a Checkpointer (expected to fail: the error goes to OUT as JSON);
* ``train`` / ``train-ray``: train (``runtime="local"`` / ``"ray"``) until the writer fails (the disk fills up),
  record the error and the steps, then restore the latest step in storage in a fresh model and save both states
  to OUT.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

import ray_ckpt
from tests import _training as T


def main(mode: str, uri: str, out: str) -> None:
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    if mode == "restore":
        step = ray_ckpt.restore(uri, model, opt)
        torch.save({"step": step, "state": T.snapshot(model, opt)}, out)
        return
    if mode == "attach":
        t0 = time.monotonic()
        try:
            ray_ckpt.Checkpointer(uri, model, opt, full_every=5, batch_steps=2).close()
            res = {"error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        with open(out, "w") as f:
            json.dump(res, f)
        return
    # train: the disk fills up
    states = {0: T.snapshot(model, opt)}
    error, failed_at = None, None
    t0 = time.monotonic()
    kw = {}
    if mode == "train-ray":   # Ray started inside the namespace: its actors see the same small file system
        import tempfile

        import ray
        ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False,
                 _temp_dir=tempfile.mkdtemp(prefix="ray_fs_fault_"))
        kw = {"runtime": "ray", "run": "fs-fault", "replica": False, "batch_steps": 10}
    ck = ray_ckpt.Checkpointer(uri, model, opt, full_every=1000, policy="fixed", recovery_every=1,
                             **{"batch_steps": 1, **kw})
    try:
        for s in range(int(os.environ.get("FS_FAULT_STEPS", "400"))):
            T.train_step("mlp", model, opt, None, s)
            states[s + 1] = T.snapshot(model, opt)
    except ray_ckpt.WriterError as e:
        error, failed_at = str(e), ck.step
    seconds = time.monotonic() - t0
    ray_res = {}
    if mode == "train-ray":   # the memory tier still holds what storage refused (while the run's actors live)
        time.sleep(1.0)       # the workers report what they hold every 50 ms
        m3 = T.make_model("mlp", seed=2)
        o3 = T.make_optimizer("adamw", m3)
        ray_res["restored_ray"] = ray_ckpt.restore(uri, m3, o3, runtime="ray", run="fs-fault")
        ray_res["live_ray"], ray_res["state_ray"] = states.get(ray_res["restored_ray"]), T.snapshot(m3, o3)
    try:
        ck.close()
    except ray_ckpt.WriterError:
        pass
    from ray_ckpt.storage.base import TMP_PREFIX
    torn = [os.path.join(d, f) for d, _, files in os.walk(uri) for f in files if f.startswith(TMP_PREFIX)]
    m2 = T.make_model("mlp", seed=1)
    o2 = T.make_optimizer("adamw", m2)
    restored = ray_ckpt.restore(uri, m2, o2)   # from storage alone: what survives the whole cluster
    res = {"error": error, "failed_at": failed_at, "seconds": seconds, "restored": restored,
           "live": states.get(restored), "state": T.snapshot(m2, o2), "torn": torn}
    torch.save({**res, **ray_res}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
