"""Worker body for the 2-process gloo DDP exactness tests (spawned; asserts raise in the parent)."""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ray_ckpt
from ray_ckpt import compression
from tests import _training as T

STEPS = 60
CHECK_STEPS = [0, 1, 24, 25, 26, 40, 59, 60]
RESUME_AT = 37


def _ddp(kind, opt_kind, hook, seed=0):
    model = T.make_model(kind, seed)
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets even for tiny models
    if hook == "topk":
        ddp.register_comm_hook(compression.TopKState(ratio=0.01), compression.topk_hook)
    elif hook == "int8":
        ddp.register_comm_hook(compression.Int8State(), compression.int8_hook)
    opt = T.make_optimizer(opt_kind, model)
    sch = T.make_scheduler(opt, total=STEPS)
    return ddp, model, opt, sch


def _comparable(snap, model, rank):
    """What must match on this rank: everything on rank 0; on other ranks everything but model buffers, which
    DDP overwrites from rank 0 at each forward and then updates with this rank's own batch."""
    if rank == 0:
        return snap
    buffers = {n for n, _ in model.named_buffers()}
    return {**snap, "model": {k: v for k, v in snap["model"].items() if k not in buffers}}


def run_case(rank, world, uri, kind, opt_kind, hook, out):
    ddp, model, opt, sch = _ddp(kind, opt_kind, hook)
    live = {0: T.snapshot(model, opt, sch)}
    ck = ray_ckpt.Checkpointer(uri, ddp, opt, scheduler=sch, full_every=25, batch_steps=8, recovery_every=1, keep_fulls=0) if rank == 0 else None
    for s in range(STEPS):
        T.train_step(kind, ddp, opt, sch, s, rank)
        live[s + 1] = T.snapshot(model, opt, sch)
    if ck is not None:
        ck.close()
        stats = ck.stats()
        out.update({"diff_bytes": stats["diff_bytes"], "full_bytes": stats["full_bytes"],
                    "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
    torch.distributed.barrier()
    # every rank restores into fresh objects and compares with its own live state (grads are identical)
    for s in CHECK_STEPS:
        m2 = T.make_model(kind, seed=99)
        o2 = T.make_optimizer(opt_kind, m2)
        s2 = T.make_scheduler(o2, total=STEPS)
        assert ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=s) == s
        T.assert_same(_comparable(live[s], model, rank), _comparable(T.snapshot(m2, o2, s2), model, rank),
                      f"{kind}/{opt_kind}/{hook} rank {rank} step {s}")
    # continuation: restore step RESUME_AT into fresh DDP objects on both ranks, train to the end
    ddp2, m2, o2, s2 = _ddp(kind, opt_kind, hook, seed=42)
    assert ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=RESUME_AT) == RESUME_AT
    torch.distributed.barrier()
    ck2 = ray_ckpt.Checkpointer(uri, ddp2, o2, scheduler=s2, full_every=25, batch_steps=8, recovery_every=1, keep_fulls=0) if rank == 0 else None
    for s in range(RESUME_AT, STEPS):
        T.train_step(kind, ddp2, o2, s2, s, rank)
    if ck2 is not None:
        assert ck2.step == STEPS
        ck2.close()
    T.assert_same(_comparable(live[STEPS], model, rank), _comparable(T.snapshot(m2, o2, s2), model, rank),
                  f"{kind}/{opt_kind}/{hook} continued, rank {rank}")
    torch.distributed.barrier()


def main(rank, world, port, root, cases, results_path):
    import json
    results = {}
    with T.dist_group(rank, world, port):
        for kind, opt_kind, hook in cases:
            out = {}
            run_case(rank, world, f"{root}/{kind}-{opt_kind}-{hook}", kind, opt_kind, hook, out)
            results[f"{kind}/{opt_kind}/{hook}"] = out
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
