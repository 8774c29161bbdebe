"""The train_loop_per_worker of the Ray Train end-to-end tests (importable by Ray workers)."""
from __future__ import annotations

import json
import os
import signal
import time

import torch


def _write_progress(out: str, step: int, world: int) -> None:
    """Rank 0's progress, read by tests that act at a step (remove a node...): written atomically."""
    with open(os.path.join(out, "progress.tmp"), "w") as f:
        json.dump({"step": step, "world": world}, f)
    os.replace(os.path.join(out, "progress.tmp"), os.path.join(out, "progress.json"))


def _kill_once(out: str) -> None:
    """SIGKILL this worker the first time it gets here in a run (the marker file survives the restart)."""
    marker = os.path.join(out, "killed")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch

    import ray_ckpt.train
    from ray_ckpt import compression
    from tests import _training as T

    torch.set_num_threads(1)
    os.environ.update(config.get("env", {}))   # this worker's ray_ckpt knobs (e.g. RAY_CKPT_RECOVERY_EVERY)
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
    # every rank records what it restored (and, below, where it ended): the tests compare each rank's state
    torch.save({"step": session.start_step, "world": world, "rank": rank, "restored": session.restored,
                "restore_seconds": session.restore_seconds, "state": T.snapshot(model, opt, sched)},
               os.path.join(out, f"start-{attempt}.pt"))
    for s in range(session.start_step, steps):
        if s == config.get("kill_at") and rank == config.get("kill_rank", 1):
            _kill_once(out)
        T.train_step(kind, net, opt, sched, s, rank)
        if rank == 0:
            _write_progress(out, s + 1, world)
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
    session.close()
    torch.save({"step": steps, "world": world, "rank": rank, "state": T.snapshot(model, opt, sched)},
               os.path.join(out, f"final-{attempt}.pt"))


def reference_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """torch.multiprocessing entry (``tests._training.spawn``): :func:`train_loop`'s run uninterrupted, without Ray
    Train or ray_ckpt, in a gloo group of ``world`` ranks (``DistributedDataParallel``, as ``prepare_model`` builds
    it on CPU, with the same top-k hook); rank 0 saves its state after every step as ``<out>/ref-<step>.pt``."""
    from torch.nn.parallel import DistributedDataParallel

    from ray_ckpt import compression
    from tests import _training as T

    with T.dist_group(rank, world, port):
        model = T.make_model("mlp")
        net = DistributedDataParallel(model)
        if world > 1:
            net.register_comm_hook(compression.TopKState(ratio=0.01), compression.topk_hook)
        opt = T.make_optimizer("adamw", model)
        sched = T.make_scheduler(opt, total=steps)
        for s in range(steps):
            T.train_step("mlp", net, opt, sched, s, rank)
            if rank == 0:
                torch.save(T.snapshot(model, opt, sched), os.path.join(out, f"ref-{s + 1}.pt"))


def continuation_loop(config: dict) -> None:
    """The product's promise in one loop (issue #13): DDP on 2 ranks, top-k with error feedback, dropout, batches
    sampled with each rank's global RNG, a scheduler, a CPU GradScaler with skipped iterations; the iteration
    counter is the data position (extra state), so skipped iterations are resumed too. Writes each rank's
    complete final state (model, optimizer, scheduler, scaler, RNG, residuals, position)."""
    import ray.train
    import ray.train.torch

    import ray_ckpt.train
    from ray_ckpt import compression
    from tests import _training as T

    torch.set_num_threads(1)
    os.environ.update(config.get("env", {}))   # this worker's ray_ckpt knobs (e.g. RAY_CKPT_RECOVERY_EVERY)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    iters, out, skips = config["iters"], config["out"], set(config["skips"])
    model = T.make_model("mlp_do")
    torch.manual_seed(1000 + rank)                       # each rank's own streams from here on
    net = ray.train.torch.prepare_model(model)
    topk = compression.TopKState(ratio=0.05, error_feedback=True)
    net.register_comm_hook(topk, compression.topk_hook)
    opt = T.make_optimizer("adamw", model)
    sched = T.make_scheduler(opt, total=iters)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    pos = T.Position()
    session = ray_ckpt.train.attach(net, opt, scheduler=sched, scaler=scaler, extra_state=pos,
                                    compression_state=topk, full_every=10, batch_steps=4, report_every=10)
    torch.save({"rank": rank, "step": session.start_step, "pos": pos.pos, "restored": session.restored},
               os.path.join(out, f"start-{os.getpid()}-{time.time_ns()}.pt"))
    while pos.pos < iters:
        i = pos.pos
        if i == config.get("kill_at") and rank == config.get("kill_rank", 1):
            _kill_once(out)
        pos.pos += 1
        loss = T.loss_fn("mlp_do", net, T.sample_batch("mlp_do", rank))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if i in skips:                                   # an overflow after the all-reduce: every rank skips
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        sched.step()
        time.sleep(config.get("step_sleep", 0.0))
    session.close()
    residuals = compression.ResidualState(topk, net).state_dict()["residuals"]
    torch.save({"rank": rank, "world": world, "state": T.snapshot(model, opt, sched),
                "scaler": scaler.state_dict(), "rng": torch.get_rng_state(), "pos": pos.pos,
                "residuals": {k: v.clone() for k, v in residuals.items()}},
               os.path.join(out, f"final-{rank}.pt"))


LOADER_ROWS, LOADER_BATCH, LOADER_EPOCHS = 128, 8, 3


def loader_training(session_factory, config: dict) -> dict:
    """An epoch loop over torchdata's StatefulDataLoader (shuffled) with the loader and the epoch counter as
    extra state; reports the user's metrics every 5 steps through ``session.report`` when there is one.
    ``session_factory(model, opt, extra_state)`` attaches (Ray Train) or returns None (the reference).
    Returns the final state."""
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tests import _training as T

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    ds = TensorDataset(torch.randn(LOADER_ROWS, 32, generator=g), torch.randint(0, 8, (LOADER_ROWS,), generator=g))
    # StatefulDataLoader's shuffling sampler seeds its own generator from the global RNG when it is built, and
    # saves that generator's state with the loader's: seed first (as a reproducible job does)
    torch.manual_seed(5)
    loader = StatefulDataLoader(ds, batch_size=LOADER_BATCH, shuffle=True)
    epoch = T.Position()
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    session = session_factory(model, opt, {"loader": loader, "epoch": epoch})
    step = session.start_step if session is not None else 0
    while epoch.pos < LOADER_EPOCHS:
        for x, y in loader:
            if session is not None and step == config.get("kill_at"):
                _kill_once(config["out"])
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            if session is not None:
                if step % 5 == 0:
                    session.report({"loss": float(loss), "epoch": epoch.pos, "my_step": step})
                time.sleep(config.get("step_sleep", 0))
        epoch.pos += 1
    if session is not None:
        session.close()
    return {"step": step, "state": T.snapshot(model, opt)}


def loader_loop(config: dict) -> None:
    import ray.train

    import ray_ckpt.train

    def attach(model, opt, extra):
        return ray_ckpt.train.attach(model, opt, extra_state=extra, full_every=10, batch_steps=4, report_every=10)

    session_start = {}

    def factory(model, opt, extra):
        s = attach(model, opt, extra)
        session_start.update(step=s.start_step, restored=s.restored)
        return s

    out = loader_training(factory, config)
    attempt = f"{int(time.time() * 1000)}-{os.getpid()}"
    torch.save({**out, "start": session_start, "rank": ray.train.get_context().get_world_rank()},
               os.path.join(config["out"], f"final-{attempt}.pt"))


def fsdp_loop(config: dict) -> None:
    """FSDP2 (fully_shard TinyGPT, AdamW, a scheduler) under Ray Train with the callback: every rank checkpoints
    its shard. Rank 0 saves the gathered global state at the start (restored or not) and at the end."""
    import ray.train

    import ray_ckpt.train
    from tests import _fsdp_worker as W, _training as T

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    steps, out = config["steps"], config["out"]
    model, opt, sched = W.fsdp_model(0)
    session = ray_ckpt.train.attach(model, opt, scheduler=sched, full_every=W.FULL_EVERY, batch_steps=W.BATCH,
                                    report_every=W.FULL_EVERY, sharded_runtime=config.get("sharded_runtime", "ray"))
    attempt = f"{int(time.time() * 1000)}-{os.getpid()}"
    g = W.global_snapshot(model, opt)   # collective
    if rank == 0:
        torch.save({"step": session.start_step, "world": world, "restored": session.restored, "state": g},
                   os.path.join(out, f"start-{attempt}.pt"))
    for s in range(session.start_step, steps):
        if s == config.get("kill_at") and rank == 1:
            _kill_once(out)
        T.train_step(W.KIND, model, opt, sched, s, rank)
        if rank == 0:
            _write_progress(out, s + 1, world)
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
    import ray

    from ray_ckpt.runtime.coordinator import shard_runs
    runs = shard_runs(session.run) if ray.is_initialized() else []
    session.close()
    g = W.global_snapshot(model, opt)
    if rank == 0:
        torch.save({"step": steps, "world": world, "state": g, "shard_runs": runs},
                   os.path.join(out, f"final-{attempt}.pt"))
