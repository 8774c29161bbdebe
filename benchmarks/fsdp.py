"""FSDP2 every-step checkpointing: ray_ckpt's shard lineages vs PyTorch DCP ``async_save`` every step vs none,
interleaved in the same processes.

    .venv/bin/python -m benchmarks.fsdp                 # make bench-fsdp: GPT 10.9M, 2 gloo ranks, ~10 min
    .venv/bin/python -m benchmarks.fsdp --quick         # a smoke run (small GPT, 3 rounds)
    .venv/bin/python -m benchmarks.fsdp --runtime ray   # ray_ckpt through shard runs on a private local Ray
    .venv/bin/python -m benchmarks.fsdp --replicas 2    # HSDP: a (2, world) mesh, 2 x world gloo ranks

Design (as :mod:`benchmarks.paired`): the same gloo processes train three identical FSDP2 replicas of the GPT
example (``fully_shard`` per block and at the root; same seed, same batches, AdamW, a scheduler) and take turns
in blocks of ``block_steps`` steps, the order rotating through all six permutations so that drift cancels:

* **ray_ckpt**: a ``ray_ckpt.Checkpointer`` on every rank (its shard lineage, LowDiff, ``runtime="local"`` —
  or with ``--runtime ray`` a shard run per rank on a private one-node Ray, served by the job's coordinator,
  node worker host and replica host —
  the library's default policy), each block ending with a timed ``flush()`` (everything captured is written
  before the block's clock stops: an upper bound of the amortized cost);
* **dcp**: ``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, optimizer)`` after every step
  on every rank (its own gloo group for the planning collectives, as torchtitan does), each save waiting for the
  previous one; the block ends when its last save completed;
* **none**: the same training without checkpointing (the reference).

Each round gives one paired difference per checkpointing arm against ``none`` (wall time of the block, and CPU
time of rank 0's training thread). ray_ckpt's rounds that hold a full checkpoint form a rare stratum
(:func:`benchmarks.report.stratified_overhead_ci`); DCP's are homogeneous (:func:`benchmarks.report.
paired_median_ci`). Also: bytes persisted per step (all ranks), and a restore of the latest step from ray_ckpt's
shards into fresh FSDP2 objects, checked bitwise (``torch.equal``) against the live replica.

With ``--replicas R`` (HSDP) every replica is ``fully_shard``ed on a ``(R, world)`` (replicate, shard) mesh of
``R x world`` ranks: replica 0 of each shard writes its lineage, the other replicas write nothing, so the bytes
persisted per step (summed over every rank) are those of the 1-D run of ``world`` ranks, not ``R`` times them;
DCP's planner deduplicates the replicas too.

Outputs (``--out``, default ``benchmarks/results/``): ``fsdp.json`` / ``.md`` / ``.png`` (``fsdp_hsdp*`` with
``--replicas``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

from benchmarks import blocks, harness, jobs, report

ORDERS = [("r", "n", "d"), ("d", "n", "r"), ("n", "d", "r"), ("r", "d", "n"), ("d", "r", "n"), ("n", "r", "d")]
ARMS = {"r": "ray_ckpt", "d": "dcp", "n": "none"}


def build_parser() -> argparse.ArgumentParser:
    p = blocks.parser("python -m benchmarks.fsdp", __doc__, world="FSDP2 ranks (gloo processes)", block_steps=5,
                      warmup=2, warmup_help="steps per arm before the first round",
                      runtime="ray_ckpt's runtime: 'ray' starts a private one-node Ray for the shard runs' actors")
    p.add_argument("--rounds", type=int, default=12, help="rounds of three blocks (one per arm)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 2 steps, small GPT unless --job (a smoke run)")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: replicas of every shard (a (replicas, world) mesh of replicas x world ranks)")
    return p


def _replica(spec: jobs.JobSpec, total: int, seed: int, mesh_shape: tuple | None = None) -> blocks.Arm:
    """One FSDP2 replica of the job: ``fully_shard`` per block and at the root, on the default 1-D mesh or (HSDP)
    a (replicate, shard) mesh of ``mesh_shape``."""
    import torch
    from torch.distributed.fsdp import fully_shard
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("replicate", "shard"))
    job = jobs.build(spec, torch.device("cpu"), seed=seed)
    for block in job.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(job.model, mesh=mesh)
    opt = jobs.make_optimizer(job.model, spec.lr, spec.kind)
    return blocks.Arm(job, job.model, opt, jobs.make_scheduler(opt, total=total))


def _worker(rank: int, cell: dict, out: dict) -> None:
    """One FSDP2 rank (a forked process): the three replicas, ray_ckpt's checkpointer and DCP's saver, the blocks,
    the byte counts of every rank, and a restore of the shards checked bitwise."""
    import torch
    import torch.distributed as dist

    import ray_ckpt
    from benchmarks.worker import AsyncDCP
    spec, total = blocks.start(rank, cell, cell["rounds"])
    k, rounds, w = cell["block_steps"], cell["rounds"], cell["warmup"]
    shape = cell.get("mesh")
    writers = cell["world"] // (shape[0] if shape else 1)   # replica 0 of every shard writes it
    arms = {a: _replica(spec, total, seed=0, mesh_shape=shape) for a in "rnd"}
    uri = os.path.join(cell["dir"], "ckpt")
    rt = {}
    if cell.get("ray_address"):
        harness.connect_ray(cell["ray_address"])
        rt = {"runtime": "ray", "run": "fsdp-bench"}
    r, d = arms["r"], arms["d"]
    ck = ray_ckpt.Checkpointer(uri, r.net, r.opt, scheduler=r.sched, **rt)
    ck.flush()
    saver = AsyncDCP(os.path.join(cell["dir"], "dcp"), rank)
    r.end = ck.flush
    d.after_step = lambda step: saver.save(d.net, d.opt, step)
    d.end = saver.wait
    dev = torch.device("cpu")
    blocks.warm_up(arms, w, rank, dev)
    ck.flush()
    st0 = ck.stats()
    bytes0, saves0 = saver.bytes, saver.saves
    out["blocks"] = blocks.run_blocks(arms, ORDERS, rounds, w, k, rank, dev,
                                      fulls=lambda: ck.stats()["trainer_fulls"])
    ck.flush()   # runtime="ray": what the workers and the replica hold is durable before the counters are read
    st = ck.stats()
    steps = rounds * k
    mine = torch.tensor([a - b for a, b in zip(_persisted(st, bool(rt)), _persisted(st0, bool(rt)))]
                        + [float(st["capture_seconds"] - st0["capture_seconds"])], dtype=torch.float64)
    dist.all_reduce(mine)   # every rank's shard: the bytes of the whole step
    out.update(diff_bytes_per_step=float(mine[0]) / steps, full_bytes_per_step=float(mine[1]) / steps,
               fulls=float(mine[2]) / writers,   # per shard (each rank's policy takes its own)
               capture_ms_per_step=1e3 * float(mine[3]) / steps / writers,
               dcp_bytes_per_step=(saver.bytes - bytes0) / max(1, saver.saves - saves0))
    ck.close()
    dist.barrier()
    _restore(spec, total, uri, rt, r, out, shape)
    out["param_count"] = sum(p.numel() for p in r.net.parameters())
    if rt:
        out["runtime_stats"] = st.get("runtime")
    saver.wait()
    dist.barrier()
    dist.destroy_process_group()
    if rt:
        import ray
        ray.shutdown()


def _restore(spec: jobs.JobSpec, total: int, uri: str, rt: dict, live: blocks.Arm, out: dict,
             mesh_shape: tuple | None = None) -> None:
    """Rank process: restore the latest step from the shards into fresh FSDP2 objects, bitwise against replica r
    (on this rank, and on every rank: a collective)."""
    import torch
    import torch.distributed as dist

    import ray_ckpt
    from ray_ckpt.engine.dtensor import local
    fresh = _replica(spec, total, seed=99, mesh_shape=mesh_shape)
    t0 = time.perf_counter()
    out["restored_step"] = ray_ckpt.restore(uri, fresh.net, fresh.opt, scheduler=fresh.sched, **rt)
    out["restore_latest_s"] = time.perf_counter() - t0
    out["restore_bitwise"] = all(torch.equal(local(p), local(q))
                                 for p, q in zip(fresh.net.parameters(), live.net.parameters())) and all(
        torch.equal(local(a), local(b))
        for sa, sb in zip(fresh.opt.state.values(), live.opt.state.values()) for a, b in zip(sa.values(), sb.values()))
    ok = torch.tensor([1 if out["restore_bitwise"] else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    out["restore_bitwise_all_ranks"] = bool(ok.item())


def _persisted(st: dict, ray_runtime: bool) -> tuple[float, float, float]:
    """``(diff bytes, full bytes, fulls)`` this rank's lineage has written (``Checkpointer.stats()``): the writer's,
    or with runtime="ray" its node worker's and its replica's (which takes the fulls)."""
    if not ray_runtime:
        return float(st["diff_bytes"]), float(st["full_bytes"]), float(st["trainer_fulls"])
    rt = st.get("runtime", {})   # none on an HSDP replica that writes nothing
    w, r = rt.get("worker", {}), rt.get("replica", {})
    return (float(w.get("diff_bytes_written", 0)),
            float(w.get("full_bytes_written", 0) + r.get("full_bytes_written", 0)),
            float(st["trainer_fulls"] + r.get("fulls_written", 0)))


def summarize(cell: dict, r0: dict) -> dict:
    bl_list = r0["blocks"]
    out = {"job": cell["job"], "world": cell["world"], "mesh": cell.get("mesh"), "threads": cell["threads"],
           "rounds": len(bl_list),
           "block_steps": cell["block_steps"], "runtime": cell.get("runtime", "local"),
           "step_s_ref_median": report.median([b["n_s"] / cell["block_steps"] for b in bl_list]),
           **{k: r0.get(k) for k in ("param_count", "diff_bytes_per_step", "full_bytes_per_step", "capture_ms_per_step",
                                     "fulls", "dcp_bytes_per_step", "restored_step", "restore_latest_s",
                                     "restore_bitwise_all_ranks")}}
    for arm in "rd":   # ray_ckpt's rounds holding a full are a rare stratum; DCP's rounds are all alike
        out.update({f"{ARMS[arm]}_{k}": v for k, v in blocks.overheads(bl_list, arm, "n", arm == "r").items()})
    out["ray_ckpt_bytes_per_step"] = (r0.get("diff_bytes_per_step") or 0) + (r0.get("full_bytes_per_step") or 0)
    steps = len(bl_list) * cell["block_steps"]
    out["bytes_per_full"] = (r0["full_bytes_per_step"] * steps / r0["fulls"]) if r0.get("fulls") else None
    out["raw_blocks"] = bl_list
    return out


def _overhead(c, key):
    v = c.get(key + "_overhead_pct")
    return "–" if v is None else f"{report.pct(v)} {report.interval(c[key + '_ci95_pct'])}"


def markdown(result: dict) -> str:
    m, c = result["machine"], result["cell"]
    mb = 1e6
    lines = ["# ray_ckpt FSDP2 benchmark: every-step checkpoints of sharded state", "",
             f"{result['date']} · {m.get('cpu', '?')} · {m.get('cores', '?')} cores · torch {m.get('torch', '?')} · "
             f"{result['wall_s'] / 60:.1f} min", "",
             f"GPT {c['job']['size']} ({c['param_count'] / 1e6:.1f}M parameters), FSDP2 on {c['world']} gloo ranks"
             + (f" (HSDP: a {c['mesh'][0]}x{c['mesh'][1]} (replicate, shard) mesh)" if c.get("mesh") else "") + " x "
             f"{c['threads']} thread(s), AdamW; {c['rounds']} rounds of 3 blocks x {c['block_steps']} steps "
             f"(order rotating); reference step {c['step_s_ref_median']:.3f} s.", "",
             "| every step | overhead, wall (median, 95% CI) | training-thread CPU | bytes persisted per step |",
             "|---|---:|---:|---:|",
             f"| ray_ckpt shards (LowDiff, runtime={c.get('runtime', 'local')!r}, default policy; {c['fulls']:g} "
             f"fulls per shard) | {_overhead(c, 'ray_ckpt_wall')} | "
             f"{_overhead(c, 'ray_ckpt_thread_cpu')} | {c['ray_ckpt_bytes_per_step'] / mb:.2f} MB "
             f"({(c['diff_bytes_per_step'] or 0) / mb:.2f} MB diffs"
             + (f"; a full {c['bytes_per_full'] / mb:.0f} MB" if c.get("bytes_per_full") else "") + ") |",
             f"| DCP async_save | {_overhead(c, 'dcp_wall')} | {_overhead(c, 'dcp_thread_cpu')} | "
             f"{(c['dcp_bytes_per_step'] or 0) / mb:.2f} MB |", "",
             f"Hooks on the training thread: {c['capture_ms_per_step']:.1f} ms per step and rank. Restore of the latest "
             f"step ({c['restored_step']}) from the shards into fresh FSDP2 objects: {c['restore_latest_s']:.2f} s, "
             f"bitwise on every rank: {'yes' if c['restore_bitwise_all_ranks'] else 'NO'}."]
    if result.get("errors"):
        lines += ["", "Errors: " + json.dumps(result["errors"])[:2000]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = report.pyplot()
    c = result["cell"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, vals, cis = [], [], []
    for arm in ("ray_ckpt", "dcp"):
        for basis in ("wall", "thread_cpu"):
            v = c.get(f"{arm}_{basis}_overhead_pct")
            if v is None:
                continue
            labels.append(f"{arm}\n{basis}")
            vals.append(v)
            cis.append(c[f"{arm}_{basis}_ci95_pct"])
    report.ci_bars(ax, vals, cis, capsize=4,
                   color=["tab:green" if lab.startswith("ray") else "tab:gray" for lab in labels])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("overhead vs no checkpoint, % (95% CI)")
    ax.set_title(f"FSDP2, checkpoint every step: GPT {c['job']['size']}, {c['world']} ranks"
                 + (f" (HSDP {c['mesh'][0]}x{c['mesh'][1]})" if c.get("mesh") else ""))
    fig.tight_layout()
    report.save_figure(fig, path)


def resolve(args) -> jobs.JobSpec:
    """Apply ``--quick`` and check the options; the job."""
    if args.quick:   # a smoke run; --job still applies when given
        if args.job == build_parser().get_default("job"):
            args.job = "gpt:small:4"
        args.rounds, args.block_steps, args.warmup = 3, 2, 1
    for name in ("rounds", "block_steps", "world", "replicas"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.rounds < 3:
        raise SystemExit("--rounds must be >= 3 (a confidence interval needs three pairs)")
    spec = harness.parse_job(args.job)
    if spec.kind != "gpt":
        raise SystemExit("the FSDP2 benchmark shards the GPT example's blocks: --job gpt:<size>:<batch>")
    return spec


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    spec = resolve(args)
    harness.preimport()
    d = tempfile.mkdtemp(prefix="ray_ckpt_fsdp_")
    ranks = args.world * args.replicas
    cell = {"dir": d, "job": spec.to_dict(), "world": ranks,
            "mesh": [args.replicas, args.world] if args.replicas > 1 else None,
            "threads": harness.threads_per_rank(args.threads, ranks), "rounds": args.rounds,
            "block_steps": args.block_steps, "warmup": args.warmup, "runtime": args.runtime}
    with contextlib.ExitStack() as stack:
        if args.runtime == "ray":
            cell["ray_address"] = stack.enter_context(harness.private_ray(
                os.path.join(d, "rayhost"), ranks + 2, args.object_store_mb)).address
        jobs.preload(spec)
        harness.logger("fsdp")(f"GPT {spec.size}, {ranks} ranks{' (HSDP)' if args.replicas > 1 else ''}: "
                               f"{args.rounds} rounds x 3 blocks x "
                               f"{args.block_steps} steps")
        t0 = time.perf_counter()
        res = harness.run_ranks(_worker, cell, args.timeout)
    shutil.rmtree(d, ignore_errors=True)
    errors = [x for x in res if "error" in x]
    result = {"date": report.now(), "machine": report.machine_info("cpu"), "settings": vars(args), "errors": errors,
              "wall_s": time.perf_counter() - t0,
              "cell": summarize(cell, res[0]) if "error" not in res[0] else None}
    base = os.path.join(args.out, ("fsdp_quick" if args.quick else "fsdp") + ("_hsdp" if args.replicas > 1 else "")
                        + ("_ray" if args.runtime == "ray" else ""))
    if result["cell"] is not None:
        report.write_result(base, result, markdown, plot)
    else:
        report.write_result(base, result)
        print(json.dumps(errors, indent=1)[:4000], flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
