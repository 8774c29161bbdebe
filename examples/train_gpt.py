"""Train a byte-level GPT on the Python standard library's sources with Ray Train, checkpointing EVERY step with
ray_ckpt LowDiff (top-k 1% compressed DDP, or FSDP2 with ``--fsdp``: every rank checkpoints its shard). Works
locally, under ``ray job submit``, and on a cluster.

    python examples/train_gpt.py --steps 200 --storage /tmp/ray_ckpt_gpt
    python examples/train_gpt.py --fsdp --steps 200 --storage /tmp/ray_ckpt_gpt_fsdp
    python examples/train_gpt.py --storage s3://bucket/gpt -o endpoint_override=127.0.0.1:9000 -o scheme=http
    ray job submit --address http://HEAD:8265 --working-dir . -- python examples/train_gpt.py --storage s3://...

Run it again with the same ``--name`` and ``--storage`` and it resumes from the latest step: after a worker
failure Ray Train restarts the worker group and ``attach`` restores the exact state; after a driver restart the
lineage (memory tier if the run's actors are still alive, storage otherwise) is picked up the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_loop(cfg: dict) -> None:
    """Runs in each Ray Train worker."""
    import ray.train
    import ray.train.torch
    import torch

    import ray_ckpt.train
    from examples.gpt import GPT, ByteBatches, GPTConfig, stdlib_corpus, warmup_cosine
    from ray_ckpt import compression

    torch.set_num_threads(cfg["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(cfg["preset"]))
    if cfg["fsdp"]:
        # FSDP2: parameters become DTensor shards (one per rank); ray_ckpt captures each rank's gradient shard
        from torch.distributed.fsdp import fully_shard
        model.to(ray.train.torch.get_device())
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        net = model
    else:
        net = ray.train.torch.prepare_model(model)
        if world > 1 and cfg["topk"] > 0:
            net.register_comm_hook(compression.TopKState(ratio=cfg["topk"]), compression.topk_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, warmup=max(1, cfg["steps"] // 10), total=cfg["steps"])
    data = ByteBatches(stdlib_corpus(cfg["corpus_mb"] << 20), model.config.seq, cfg["batch"])
    # the storage comes from the callback as a URI without credentials: credentials given with --storage-option
    # reach the workers in train_loop_config (Ray Train pickles it); node credentials (AWS_*, profile, instance
    # role) need nothing
    session = ray_ckpt.train.attach(net, opt, scheduler=sched, full_every=cfg["full_every"],
                                    batch_steps=cfg["batch_steps"], storage_options=cfg["storage_options"])
    if rank == 0:
        verb = "resuming at" if session.restored else "starting at"
        print(f"[ray_ckpt] {verb} step {session.start_step} on {world} workers "
              f"(restore took {session.restore_seconds:.2f} s)", flush=True)
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    for step in range(session.start_step, cfg["steps"]):
        x, y = (t.to(dev) for t in data.get(step, rank))
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y) if world == 1 or cfg["fsdp"] else _ddp_loss(net, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if rank == 0 and (step + 1) % cfg["log_every"] == 0:
            dt = (time.perf_counter() - t0) / cfg["log_every"]
            t0 = time.perf_counter()
            print(f"step {step + 1:5d}  loss {loss.item():.4f}  {dt * 1000:.0f} ms/step", flush=True)
    session.close()
    # with FSDP2 a forward pass is collective: every rank evaluates
    heldout = data.heldout_loss(model) if rank == 0 or cfg["fsdp"] else None
    if rank == 0:
        stats = session.checkpointer.stats()
        print("[ray_ckpt] " + json.dumps({"final_step": cfg["steps"], "heldout_loss": heldout,
                                          "diff_bytes": stats["diff_bytes"], "full_bytes": stats["full_bytes"],
                                          "bytes_of": "rank 0's shard" if cfg["fsdp"] else "the model"}),
              flush=True)


def _ddp_loss(net, x, y):
    import torch.nn.functional as F
    logits = net(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", required=True, help="lineage root: a path, file://..., or s3://bucket/prefix")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="S3 options, e.g. endpoint_override=127.0.0.1:9000, scheme=http")
    p.add_argument("--name", default="gpt-stdlib", help="run name: the same name resumes the same lineage")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--min-workers", type=int, default=None, help="elastic: continue with as few as this many")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--preset", default="small", help="model size: tiny, small, 10m, 25m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--topk", type=float, default=0.01, help="top-k ratio of the DDP hook (0: dense)")
    p.add_argument("--full-every", type=int, default=50)
    p.add_argument("--batch-steps", type=int, default=10)
    p.add_argument("--corpus-mb", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP: sharded state, "
                   "each rank checkpoints its shard (dense gradients; --topk is ignored)")
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    args = p.parse_args(argv)

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_ckpt.train

    options = dict(kv.split("=", 1) for kv in args.storage_option)
    if args.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=args.address or os.environ["RAY_ADDRESS"])
    else:
        ray.init(address="local", include_dashboard=False)
    workers = args.workers if args.min_workers is None else (args.min_workers, args.workers)
    cfg = {k: getattr(args, k) for k in ("steps", "preset", "batch", "lr", "topk", "full_every", "batch_steps",
                                         "corpus_mb", "threads", "log_every", "fsdp")}
    cfg["storage_options"] = options
    trainer = TorchTrainer(
        train_loop, train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=args.use_gpu),
        run_config=RunConfig(name=args.name, failure_config=FailureConfig(max_failures=args.max_failures),
                             callbacks=[ray_ckpt.train.RayCkptCallback(args.storage, storage_options=options,
                                                                       full_every=args.full_every,
                                                                       batch_steps=args.batch_steps)]))
    result = trainer.fit()
    if result.error:
        print(f"training failed: {result.error}", file=sys.stderr)
        return 1
    pointer = ray_ckpt.train.read_pointer(result.checkpoint) if result.checkpoint else None
    print(f"[ray_ckpt] done; latest pointer: {pointer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
