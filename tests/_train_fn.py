"""The train_loop_per_worker of the Ray Train end-to-end tests (importable by Ray workers)."""
from __future__ import annotations

import json
import os
import signal
import time

import torch


def train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch

    import ray_ckpt.train
    from ray_ckpt import compression
    from tests import _training as T

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    kind, steps, out = config["kind"], config["steps"], config["out"]
    model = T.make_model(kind)
    net = ray.train.torch.prepare_model(model)
    if world > 1:
        net.register_comm_hook(compression.TopKState(ratio=0.01), compression.topk_hook)
    opt = T.make_optimizer("adamw", model)
    sched = T.make_scheduler(opt, total=steps)
    session = ray_ckpt.train.attach(net, opt, scheduler=sched, full_every=10, batch_steps=4, report_every=10)
    attempt = f"{int(time.time() * 1000)}-{os.getpid()}"
    if rank == 0:
        torch.save({"step": session.start_step, "world": world, "restored": session.restored,
                    "restore_seconds": session.restore_seconds, "state": T.snapshot(model, opt, sched)},
                   os.path.join(out, f"start-{attempt}.pt"))
    for s in range(session.start_step, steps):
        if s == config.get("kill_at") and rank == config.get("kill_rank", 1):
            marker = os.path.join(out, "killed")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        T.train_step(kind, net, opt, sched, s, rank)
        if rank == 0:
            if config.get("snap_all"):
                torch.save(T.snapshot(model, opt, sched), os.path.join(out, f"ref-{s + 1}.pt"))
            with open(os.path.join(out, "progress.tmp"), "w") as f:
                json.dump({"step": s + 1, "world": world}, f)
            os.replace(os.path.join(out, "progress.tmp"), os.path.join(out, "progress.json"))
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
    session.close()
    if rank == 0:
        torch.save({"step": steps, "world": world, "state": T.snapshot(model, opt, sched)},
                   os.path.join(out, f"final-{attempt}.pt"))
