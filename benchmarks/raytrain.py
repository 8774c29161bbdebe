"""The Ray Train baseline: the same training loop inside ``TorchTrainer`` (``world`` Ray workers), with and
without ``ray.train.report(metrics, checkpoint=...)`` every step.

One ``fit()`` per job runs every round: inside it, segments without report ("raytrain_none", the reference)
and with report ("raytrain_report") alternate (A B, B A, ...), each with a fresh model, so drift cancels and
the worker-group start-up (tens of seconds here) is paid once. ``driver_main`` runs in a process forked by the
orchestrator, connected to the benchmark's Ray cluster; the train function writes one JSON per rank.

Report details (Ray 2.60, Train V2): ``checkpoint_upload_mode=CheckpointUploadMode.ASYNC`` (per call; Ray
deletes the local directory after the upload). Rank 0 passes ``Checkpoint.from_directory`` of a fresh temp
directory holding ``torch.save`` of model + optimizer + scheduler; other ranks report metrics only. Each
report first synchronizes the checkpoint directory name across ranks (a round trip to a Ray actor), then the
upload and the hand-over to the controller (a queue of size 1, drained once per controller poll,
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``) run in one background thread per worker.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

from benchmarks import configs, harness, jobs
from benchmarks.worker import Ctx, build_training, peak_rss_bytes, pick_device, reset_peak_rss, sync


def _ckpt_step(ckpt, rnd: int) -> int:
    """Step of the latest checkpoint Ray Train handed to the controller in round ``rnd`` (0 if none yet)."""
    if ckpt is None:
        return 0
    name = os.path.basename(str(ckpt.path).rstrip("/"))
    if not name.startswith(f"r{rnd}_s"):
        return 0
    return int(name[len(f"r{rnd}_s"):])


def train_loop(seg: dict) -> None:
    """``train_loop_per_worker``: runs in each Ray Train worker (the process group exists)."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    reset_peak_rss()
    torch.set_num_threads(seg["threads"])
    ctx_rt = ray.train.get_context()
    rank, world = ctx_rt.get_world_rank(), ctx_rt.get_world_size()
    device = pick_device(seg["device"], ctx_rt.get_local_rank())
    out = {"rank": rank, "segments": []}
    scratch = tempfile.mkdtemp(prefix="rt", dir=seg["dir"])
    for rnd in range(seg["rounds"]):
        order = ["raytrain_none", "raytrain_report"]
        if rnd % 2:
            order.reverse()
        for name in order:
            cfg = configs.get(name)
            s = dict(seg, config=name)
            ctx = Ctx(seg=s, rank=rank, world=world, device=device, cfg=cfg)
            build_training(ctx)
            report = cfg.saver == "raytrain_report"
            times, thread_cpu, lag, nbytes = [], [], [], 0
            torch.distributed.barrier()
            for step in range(ctx.total_steps):
                if step == seg["warmup"]:
                    cpu0 = time.process_time()
                t0, c0 = time.perf_counter(), time.thread_time()
                ctx.job.train_step(ctx.ddp, ctx.opt, ctx.sched, step, rank, device)
                if report:
                    ckpt = None
                    if rank == 0:
                        d = tempfile.mkdtemp(prefix="c", dir=scratch)
                        path = os.path.join(d, "state.pt")
                        torch.save({"model": ctx.model.state_dict(), "optimizer": ctx.opt.state_dict(),
                                    "scheduler": ctx.sched.state_dict(), "step": step + 1}, path)
                        nbytes += os.path.getsize(path)
                        ckpt = Checkpoint.from_directory(d)
                    ray.train.report({"step": step + 1, "round": rnd}, checkpoint=ckpt,
                                     checkpoint_dir_name=f"r{rnd}_s{step + 1}",
                                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
                sync(device)
                times.append(time.perf_counter() - t0)
                thread_cpu.append(time.thread_time() - c0)
                if report and rank == 0:
                    lag.append(step + 1 - _ckpt_step(ray.train.get_checkpoint(), rnd))
            drain = 0.0
            if report and rank == 0:
                # wait until the last report's upload is done and handed to the controller (its queue)
                t0 = time.perf_counter()
                while _ckpt_step(ray.train.get_checkpoint(), rnd) < ctx.total_steps:
                    if time.perf_counter() - t0 > 600:
                        raise TimeoutError("Ray Train uploads did not drain in 600 s")
                    time.sleep(0.01)
                drain = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            torch.distributed.barrier()
            out["segments"].append({"config": name, "round": rnd, "step_s": times[seg["warmup"]:],
                                    "warmup_s": times[:seg["warmup"]], "drain_s": drain, "cpu_s": cpu,
                                    "aux_cpu_s": 0.0, "thread_cpu_step_s": thread_cpu[seg["warmup"]:],
                                    "bytes_loop": nbytes, "saves": ctx.total_steps if report else 0,
                                    "uncommitted_lag": lag,
                                    "full_ckpt_bytes": jobs.full_state_bytes(ctx.model, ctx.opt),
                                    "param_count": sum(p.numel() for p in ctx.model.parameters())})
            del ctx
    shutil.rmtree(scratch, ignore_errors=True)
    out["peak_rss"] = peak_rss_bytes()
    with open(os.path.join(seg["dir"], f"raytrain_rank{rank}.json"), "w") as f:
        json.dump(out, f)


def driver_main(seg: dict) -> None:
    """Entry of the forked driver process: connect to the cluster, run one TorchTrainer.fit()
    (``raytrain_driver.json``)."""
    harness.process_main(seg["dir"], lambda out: _drive(seg, out), "raytrain_driver.json")


def _drive(seg: dict, out: dict) -> None:
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(seg["raytrain_poll_s"]),
           "PYTHONPATH": os.pathsep.join(p for p in [seg["repo"], os.environ.get("PYTHONPATH")] if p)}
    ray.init(address=seg["ray_address"], namespace=harness.RAY_NAMESPACE, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": env})
    use_gpu = seg["device"] == "cuda" or (seg["device"] == "auto" and torch.cuda.is_available())
    trainer = TorchTrainer(
        train_loop, train_loop_config=seg,
        scaling_config=ScalingConfig(num_workers=seg["world"], use_gpu=use_gpu, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"bench-{os.path.basename(seg['dir'])}",
                             storage_path=os.path.join(seg["dir"], "storage"),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    t0 = time.perf_counter()
    result = trainer.fit()
    out["fit_s"] = time.perf_counter() - t0
    out["error"] = None if result.error is None else repr(result.error)
    ray.shutdown()
