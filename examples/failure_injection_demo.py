"""Failure-injection demo (``make demo``): train, kill things, recover, and prove nothing was lost.

Starts an embedded local Ray cluster (a head and two worker nodes, each with its own object store; no outside
cluster needed), then trains a byte-level GPT on the Python standard library's sources with Ray Train on 2
workers, checkpointing EVERY step with ray_ckpt LowDiff over top-k 1% compressed DDP. While it trains, the demo

1. SIGKILLs a training worker process at a random step (twice, different ranks),
2. removes a whole node at a later random step (the run continues elastically on the remaining node),

and at the end proves, against an uninterrupted reference run with the same seeds, that every resumed state
is bitwise the reference state at that step, and that the final state is bitwise what the lineage restores.
It prints a table: failures injected, steps lost per failure, seconds to recover, and the bytes written
compared with full checkpoints every step. Exit status 0 only if every check passed.

    python examples/failure_injection_demo.py [--steps 40] [--seed 0]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP_SLEEP = 0.15  # seconds per step on top of compute: the demo's steps stay well above the hand-off cost


# ------------------------------------------------------------------------------------------------- workers --
def train_loop(cfg: dict) -> None:
    """Runs in each Ray Train worker."""
    import ray.train
    import ray.train.torch
    import torch

    import ray_ckpt.train
    from examples.gpt import GPT, ByteBatches, GPTConfig, stdlib_corpus, warmup_cosine
    from ray_ckpt import compression

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out = cfg["out"]
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    net = ray.train.torch.prepare_model(model)
    if world > 1:
        net.register_comm_hook(compression.TopKState(ratio=0.01), compression.topk_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, warmup=5, total=cfg["steps"])
    data = ByteBatches(stdlib_corpus(1 << 20), model.config.seq, 8)
    session = ray_ckpt.train.attach(net, opt, scheduler=sched, full_every=10, batch_steps=5)
    with open(os.path.join(out, f"pid-{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "start": session.start_step, "world": world,
                   "restored": session.restored, "time": time.time()}, f)
    if rank == 0 and cfg.get("snapshots"):
        marker = os.path.join(out, "started")
        if os.path.exists(marker):   # a restart (the first start of the run is not a resume)
            tag = f"{session.start_step}-{world}-{time.time_ns()}"
            _save(out, f"resume-{tag}.pt", model, opt, sched)
            with open(os.path.join(out, f"restore-{tag}.json"), "w") as f:
                json.dump({"seconds": session.restore_seconds}, f)
        else:
            open(marker, "w").close()
    for step in range(session.start_step, cfg["steps"]):
        torch.manual_seed(1000 * step + rank)
        x, y = data.get(step, rank)
        opt.zero_grad(set_to_none=True)
        logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if rank == 0:
            if cfg.get("reference"):
                _save(out, f"ref-{step + 1}.pt", model, opt, sched)
            with open(os.path.join(out, "progress.tmp"), "w") as f:
                json.dump({"step": step + 1, "world": world, "time": time.time()}, f)
            os.replace(os.path.join(out, "progress.tmp"), os.path.join(out, "progress.json"))
        time.sleep(STEP_SLEEP)
    session.close()
    if rank == 0:
        _save(out, "final.pt", model, opt, sched)
        st = session.checkpointer.stats() if session.checkpointer else {}
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"world": world, "stats": {k: v for k, v in st.items() if isinstance(v, (int, float))}}, f)


def _save(out, name, model, opt, sched):
    import copy

    import torch
    torch.save({"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                "sched": copy.deepcopy(sched.state_dict())}, os.path.join(out, name))


# -------------------------------------------------------------------------------------------------- driver --
def _equal(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _fit(cluster_tmp, name, cfg, callbacks, num_workers):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        train_loop, train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": 1, "trainer": 1}),
        run_config=RunConfig(name=name, storage_path=os.path.join(cluster_tmp, "ray_train"),
                             failure_config=FailureConfig(max_failures=5), callbacks=callbacks))
    return trainer.fit()


def _progress(out) -> dict:
    try:
        with open(os.path.join(out, "progress.json")) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return {"step": 0, "world": 0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ray_ckpt failure-injection demo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=None, help="seed of the failure schedule (default: random)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10_000)
    rng = random.Random(seed)
    n = args.steps
    kills = sorted(rng.sample(range(4, n // 2), 2))
    node_loss = rng.randrange(n // 2 + 3, n - 5)
    t_start = time.time()

    tmp = tempfile.mkdtemp(prefix="rckdemo", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # after the node loss, Ray 2.60's elastic policy still counts the lost node and first tries the old group size
    # until this start-up timeout (60 s by default) expires; groups start in seconds here (README: elastic restarts)
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in [root, os.environ.get("PYTHONPATH")] if x)

    import ray
    import torch
    from ray.cluster_utils import Cluster

    import ray_ckpt
    import ray_ckpt.train
    from examples.gpt import GPT, GPTConfig, warmup_cosine

    print(f"ray_ckpt failure-injection demo (seed {seed}): {n} steps, worker kills at steps {kills}, "
          f"node loss at step {node_loss}")
    print("starting an embedded Ray cluster: head + 2 worker nodes ...", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 200 << 20, "temp_dir": os.path.join(tmp, "ray"),
        "include_dashboard": False,
        # detect a lost node in ~2 s instead of Ray's default ~30 s (the demo measures recovery, not detection)
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4}})
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=200 << 20, resources={"trainer": 1})
             for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    ok = True
    try:
        ref_out = os.path.join(tmp, "reference")
        os.makedirs(ref_out)
        print("1/3 uninterrupted reference run, 2 workers, a snapshot after every step ...", flush=True)
        t0 = time.time()
        r = _fit(tmp, "reference", {"steps": n, "out": ref_out, "reference": True},
                 [ray_ckpt.train.RayCkptCallback(os.path.join(tmp, "ref_ckpt"))], 2)
        if r.error:
            raise RuntimeError(f"reference run failed: {r.error}")
        print(f"    done in {time.time() - t0:.0f} s")

        out = os.path.join(tmp, "demo")
        os.makedirs(out)
        storage = os.path.join(tmp, "ckpt")
        events: list[dict] = []

        def injector():
            plan = [("kill", kills[0], 1), ("kill", kills[1], 0), ("node", node_loss, None)]
            for kind, at, rank in plan:
                while _progress(out)["step"] < at:
                    if time.time() - t_start > 600:
                        return
                    time.sleep(0.02)
                seen = _progress(out)
                if kind == "kill":
                    with open(os.path.join(out, f"pid-{rank}.json")) as f:
                        pid = json.load(f)["pid"]
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.time()
                    time.sleep(0.5)   # the surviving rank may still finish the step it was in
                    seen = max(seen, _progress(out), key=lambda p: p["step"])
                    events.append({"what": f"SIGKILL rank {rank} (pid {pid})", "at": seen["step"],
                                   "time": t_kill})
                else:
                    victim = nodes[1]
                    cluster.remove_node(victim)
                    events.append({"what": "node removed", "at": seen["step"], "time": time.time()})
                # wait until the run is training again past the restore
                while _progress(out)["step"] <= seen["step"] and time.time() - t_start < 600:
                    time.sleep(0.02)

        print("2/3 demo run with failure injection, elastic 1..2 workers, LowDiff every step ...", flush=True)
        th = threading.Thread(target=injector, daemon=True)
        th.start()
        t0 = time.time()
        r = _fit(tmp, "demo", {"steps": n, "out": out, "snapshots": True},
                 [ray_ckpt.train.RayCkptCallback(storage, full_every=10, batch_steps=5, keep_runtime=True)],
                 (1, 2))
        th.join(timeout=5)
        if r.error:
            raise RuntimeError(f"demo run failed: {r.error}")
        print(f"    done in {time.time() - t0:.0f} s")

        print("3/3 checking against the reference ...", flush=True)
        resumes = []   # every restart of the worker group, in the order they happened
        for path in glob.glob(os.path.join(out, "resume-*.pt")):
            step, world, ns = map(int, os.path.basename(path)[7:-3].split("-"))
            resumes.append((ns, step, world, path))
        resumes.sort()
        rows = []
        for ev, (_, step, world, path) in zip(events, resumes):
            ref = torch.load(os.path.join(ref_out, f"ref-{step}.pt"), weights_only=True)
            got = torch.load(path, weights_only=True)
            same = _equal(ref, got)
            ok &= same
            with open(path[:-3].replace("resume-", "restore-") + ".json") as f:
                restore_s = json.load(f)["seconds"]
            rows.append((ev["what"], ev["at"], step, ev["at"] - step, world, same, restore_s))
        # recovery time: from each failure to the first step trained after it
        times = _recovery_times(out, events)
        final = torch.load(os.path.join(out, "final.pt"), weights_only=True)
        m = GPT(GPTConfig.preset("tiny"))
        o = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
        s = warmup_cosine(o, warmup=5, total=n)
        got = ray_ckpt.restore(storage, m, o, scheduler=s, runtime="ray", run="demo")
        restored_final = {"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()}
        final_ok = got == n and _equal(final, restored_final)
        ok &= final_ok and len(rows) == len(events) == 3
        written = sum(os.path.getsize(f) for f in glob.glob(os.path.join(storage, "objects", "*")))
        full_size = max(os.path.getsize(f) for f in glob.glob(os.path.join(storage, "objects", "*full*")))
        steps_trained = n + sum(max(0, r_[3]) for r_ in rows)

        print()
        print("| failure injected | at step | resumed at | steps lost | workers after | seconds to recover "
              "| of which restore | state == reference |")
        print("|---|---|---|---|---|---|---|---|")
        for (what, at, step, lost, world, same, restore_s), secs in zip(rows, times):
            print(f"| {what} | {at} | {step} | {lost} | {world} | {secs:.1f} | {restore_s:.2f} | "
                  f"{'yes' if same else 'NO'} |")
        print("(recovery = failure detection + Ray Train restarting the worker group + restore; after a node loss "
              "Ray Train first waits for the old group size until RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S = "
              f"{os.environ['RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S']} s expires)")
        print()
        print(f"final step {got}: restored-from-lineage state == live final state: {'yes' if final_ok else 'NO'}")
        diffs = glob.glob(os.path.join(storage, "objects", "*diff*"))
        diff_bytes = sum(os.path.getsize(f) for f in diffs)
        print(f"per-step diff: {diff_bytes / steps_trained / 1024:.1f} KiB on average vs a {full_size / 1024:.0f} KiB "
              f"full checkpoint (tiny demo model; top-k 1% sparse on 2 workers, dense after the resize to 1 worker, "
              f"which has no DDP and so no compression hook)")
        print(f"bytes written: {written / 2**20:.1f} MiB (fulls every 10 steps + a diff every step) vs "
              f"{steps_trained * full_size / 2**20:.1f} MiB for a full checkpoint every step "
              f"({steps_trained * full_size / max(1, written):.1f}x more)")
        print(f"total demo time {time.time() - t_start:.0f} s")
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        try:
            from ray_ckpt.runtime.coordinator import shutdown_run
            for run in ("demo", "reference"):
                shutdown_run(run)
        except Exception:  # noqa: BLE001
            pass
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _recovery_times(out, events) -> list[float]:
    """Seconds from each injected failure to the restored state being written by the new worker group (the
    restore itself, the worker-group restart by Ray Train and the failure detection all included)."""
    res = sorted(os.path.getmtime(p) for p in glob.glob(os.path.join(out, "resume-*.pt")))  # restarts only
    return [max(0.0, t - ev["time"]) for ev, t in zip(events, res)]


if __name__ == "__main__":
    sys.exit(main())
