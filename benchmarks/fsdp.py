"""FSDP2 every-step checkpointing: ray_ckpt's shard lineages vs PyTorch DCP ``async_save`` every step vs none,
interleaved in the same processes (issue #15's benchmark row).

    .venv/bin/python -m benchmarks.fsdp                 # make bench-fsdp: GPT 10.9M, 2 gloo ranks, ~10 min
    .venv/bin/python -m benchmarks.fsdp --quick         # a smoke run (small GPT, 3 rounds)
    .venv/bin/python -m benchmarks.fsdp --runtime ray   # ray_ckpt through shard runs on a private local Ray

Design (as :mod:`benchmarks.paired`): the same gloo processes train three identical FSDP2 replicas of the GPT
example (``fully_shard`` per block and at the root; same seed, same batches, AdamW, a scheduler) and take turns
in blocks of ``block_steps`` steps, the order rotating through all six permutations so that drift cancels:

* **ray_ckpt**: a ``ray_ckpt.Checkpointer`` on every rank (its shard lineage, LowDiff, ``runtime="local"`` —
  or with ``--runtime ray`` a shard run per rank on a private one-node Ray: coordinator, node worker, replica —
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

Outputs (``--out``, default ``benchmarks/results/``): ``fsdp.json`` / ``.md`` / ``.png``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

from benchmarks import jobs, report

ORDERS = [("r", "n", "d"), ("d", "n", "r"), ("n", "d", "r"), ("r", "d", "n"), ("d", "r", "n"), ("n", "r", "d")]
ARMS = {"r": "ray_ckpt", "d": "dcp", "n": "none"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="gpt:10m:4", help="gpt:size:batch[:lr] (see benchmarks.run --help)")
    p.add_argument("--world", type=int, default=2, help="FSDP2 ranks (gloo processes)")
    p.add_argument("--rounds", type=int, default=12, help="rounds of three blocks (one per arm)")
    p.add_argument("--block-steps", type=int, default=5, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="steps per arm before the first round")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores / world)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 2 steps, small GPT unless --job (a smoke run)")
    p.add_argument("--runtime", choices=("local", "ray"), default="local",
                   help="ray_ckpt's runtime: 'ray' starts a private one-node Ray for the shard runs' actors")
    p.add_argument("--object-store-mb", type=int, default=1024, help="the private Ray's object store (--runtime ray)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    return p


def _replica(spec: jobs.JobSpec, total: int, seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard
    job = jobs.build(spec, torch.device("cpu"), seed=seed)
    for block in job.model.blocks:
        fully_shard(block)
    fully_shard(job.model)
    opt = jobs.make_optimizer(job.model, spec.lr, spec.kind)
    return job, opt, jobs.make_scheduler(opt, total=total)


def worker(rank: int, cell: dict) -> None:
    from benchmarks.run import rank_main
    rank_main(rank, cell["dir"], lambda out: _worker(rank, cell, out))


def _worker(rank: int, cell: dict, out: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ray_ckpt
    from benchmarks.worker import dir_bytes
    from ray_ckpt.engine.dtensor import local
    torch.set_num_threads(cell["threads"])
    dist.init_process_group("gloo", init_method=f"file://{cell['dir']}/pg_store", rank=rank,
                            world_size=cell["world"])
    spec = jobs.JobSpec(**cell["job"])
    k, rounds, w = cell["block_steps"], cell["rounds"], cell["warmup"]
    total = w + rounds * k
    reps = {a: _replica(spec, total, seed=0) for a in "rnd"}
    uri = os.path.join(cell["dir"], "ckpt")
    rt = {}
    if cell.get("ray_address"):
        import ray
        ray.init(address=cell["ray_address"], namespace="ray_ckpt_bench", log_to_driver=False,
                 configure_logging=False)
        rt = {"runtime": "ray", "run": "fsdp-bench"}
    ck = ray_ckpt.Checkpointer(uri, reps["r"][0].model, reps["r"][1], scheduler=reps["r"][2], **rt)
    ck.flush()
    group = dist.new_group(backend="gloo")
    dcp_root = os.path.join(cell["dir"], "dcp")
    pending = {"fut": None, "step": None, "bytes": 0, "saves": 0}

    def dcp_wait():
        if pending["fut"] is None:
            return
        pending["fut"].result()
        d = os.path.join(dcp_root, f"step_{pending['step']:06d}")
        if rank == 0:
            pending["bytes"] += dir_bytes(d)
            shutil.rmtree(os.path.join(dcp_root, f"step_{pending['step'] - 2:06d}"), ignore_errors=True)
        pending["saves"] += 1
        pending["fut"] = None

    def dcp_save(model, opt, step):
        dcp_wait()
        msd, osd = get_state_dict(model, opt)
        res = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(dcp_root, f"step_{step:06d}"),
                             process_group=group)
        pending["fut"], pending["step"] = getattr(res, "upload_completion", res), step

    def run(arm: str, first: int, n: int) -> tuple[float, float]:
        job, opt, sched = reps[arm]
        t0, c0 = time.perf_counter(), time.thread_time()
        for step in range(first, first + n):
            x, y = job.batch(step, rank, torch.device("cpu"))
            loss = job.loss(job.model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if arm == "d":
                dcp_save(job.model, opt, step + 1)
        if arm == "r":
            ck.flush()
        elif arm == "d":
            dcp_wait()
        return time.perf_counter() - t0, time.thread_time() - c0

    for arm in "rnd":
        run(arm, 0, w)
    ck.flush()
    st0 = ck.stats()
    bytes0 = pending["bytes"]
    saves0 = pending["saves"]
    blocks = []
    dist.barrier()
    for i in range(rounds):
        first = w + i * k
        fulls0 = ck.stats()["trainer_fulls"]
        order = ORDERS[i % len(ORDERS)]
        res = {a: run(a, first, k) for a in order}
        blocks.append({**{f"{a}_s": res[a][0] for a in "rnd"}, **{f"{a}_cpu_s": res[a][1] for a in "rnd"},
                       "order": "".join(order), "full": ck.stats()["trainer_fulls"] > fulls0})
    dist.barrier()
    ck.flush()   # runtime="ray": what the workers and the replica hold is durable before the counters are read
    st = ck.stats()
    steps = rounds * k
    mine = torch.tensor([a - b for a, b in zip(_persisted(st, bool(rt)), _persisted(st0, bool(rt)))]
                        + [float(st["capture_seconds"] - st0["capture_seconds"])], dtype=torch.float64)
    dist.all_reduce(mine)   # every rank's shard: the bytes of the whole step
    out.update(blocks=blocks, diff_bytes_per_step=float(mine[0]) / steps, full_bytes_per_step=float(mine[1]) / steps,
               fulls=int(mine[2]) // cell["world"], capture_ms_per_step=1e3 * float(mine[3]) / steps / cell["world"],
               dcp_bytes_per_step=(pending["bytes"] - bytes0) / max(1, pending["saves"] - saves0))
    ck.close()
    dist.barrier()
    # a restore of the latest step from the shards into fresh FSDP2 objects, bitwise against replica r
    job2, opt2, sched2 = _replica(spec, total, seed=99)
    t0 = time.perf_counter()
    out["restored_step"] = ray_ckpt.restore(uri, job2.model, opt2, scheduler=sched2, **rt)
    out["restore_latest_s"] = time.perf_counter() - t0
    live = reps["r"][0].model
    out["restore_bitwise"] = all(torch.equal(local(p), local(q))
                                 for p, q in zip(job2.model.parameters(), live.parameters())) and all(
        torch.equal(local(a), local(b))
        for sa, sb in zip(opt2.state.values(), reps["r"][1].state.values()) for a, b in zip(sa.values(), sb.values()))
    ok = torch.tensor([1 if out["restore_bitwise"] else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    out["restore_bitwise_all_ranks"] = bool(ok.item())
    out["param_count"] = sum(p.numel() for p in live.parameters())
    if rt:
        out["runtime_stats"] = st.get("runtime")
    dcp_wait()
    dist.barrier()
    dist.destroy_process_group()
    if rt:
        import ray
        ray.shutdown()


def _persisted(st: dict, ray_runtime: bool) -> tuple[float, float, float]:
    """``(diff bytes, full bytes, fulls)`` this rank's lineage has written (``Checkpointer.stats()``): the writer's,
    or with runtime="ray" its node worker's and its replica's (which takes the fulls)."""
    if not ray_runtime:
        return float(st["diff_bytes"]), float(st["full_bytes"]), float(st["trainer_fulls"])
    w, r = st["runtime"].get("worker", {}), st["runtime"].get("replica", {})
    return (float(w.get("diff_bytes_written", 0)),
            float(w.get("full_bytes_written", 0) + r.get("full_bytes_written", 0)),
            float(st["trainer_fulls"] + r.get("fulls_written", 0)))


def summarize(cell: dict, r0: dict) -> dict:
    blocks = r0["blocks"]
    out = {"job": cell["job"], "world": cell["world"], "threads": cell["threads"], "rounds": len(blocks),
           "block_steps": cell["block_steps"], "runtime": cell.get("runtime", "local"),
           "step_s_ref_median": report._median([b["n_s"] / cell["block_steps"] for b in blocks]),
           **{k: r0.get(k) for k in ("param_count", "diff_bytes_per_step", "full_bytes_per_step", "capture_ms_per_step",
                                     "fulls", "dcp_bytes_per_step", "restored_step", "restore_latest_s",
                                     "restore_bitwise_all_ranks")}}
    for arm in "rd":
        for basis, suffix in (("wall", "_s"), ("thread_cpu", "_cpu_s")):
            d = [100 * (b[arm + suffix] / b["n" + suffix] - 1) for b in blocks]
            est = (report.stratified_overhead_ci(d, [b["full"] for b in blocks]) if arm == "r"
                   else report.paired_median_ci(d))
            key = f"{ARMS[arm]}_{basis}"
            out[key + "_pairs_pct"] = d
            if est is not None:
                out[key + "_overhead_pct"], out[key + "_ci95_pct"] = est[0], list(est[1])
    out["ray_ckpt_bytes_per_step"] = (r0.get("diff_bytes_per_step") or 0) + (r0.get("full_bytes_per_step") or 0)
    steps = len(blocks) * cell["block_steps"]
    out["bytes_per_full"] = (r0["full_bytes_per_step"] * steps / r0["fulls"]) if r0.get("fulls") else None
    out["raw_blocks"] = blocks
    return out


def _pct(c, key):
    v, ci = c.get(key + "_overhead_pct"), c.get(key + "_ci95_pct")
    return "–" if v is None else f"{v:+.1f} % [{ci[0]:+.1f}, {ci[1]:+.1f}]"


def markdown(result: dict) -> str:
    m, c = result["machine"], result["cell"]
    mb = 1e6
    lines = ["# ray_ckpt FSDP2 benchmark: every-step checkpoints of sharded state", "",
             f"{result['date']} · {m.get('cpu', '?')} · {m.get('cores', '?')} cores · torch {m.get('torch', '?')} · "
             f"{result['wall_s'] / 60:.1f} min", "",
             f"GPT {c['job']['size']} ({c['param_count'] / 1e6:.1f}M parameters), FSDP2 on {c['world']} gloo ranks x "
             f"{c['threads']} thread(s), AdamW; {c['rounds']} rounds of 3 blocks x {c['block_steps']} steps "
             f"(order rotating); reference step {c['step_s_ref_median']:.3f} s.", "",
             "| every step | overhead, wall (median, 95% CI) | training-thread CPU | bytes persisted per step |",
             "|---|---:|---:|---:|",
             f"| ray_ckpt shards (LowDiff, runtime={c.get('runtime', 'local')!r}, default policy; {c['fulls']} "
             f"fulls) | {_pct(c, 'ray_ckpt_wall')} | "
             f"{_pct(c, 'ray_ckpt_thread_cpu')} | {c['ray_ckpt_bytes_per_step'] / mb:.2f} MB "
             f"({(c['diff_bytes_per_step'] or 0) / mb:.2f} MB diffs"
             + (f"; a full {c['bytes_per_full'] / mb:.0f} MB" if c.get("bytes_per_full") else "") + ") |",
             f"| DCP async_save | {_pct(c, 'dcp_wall')} | {_pct(c, 'dcp_thread_cpu')} | "
             f"{(c['dcp_bytes_per_step'] or 0) / mb:.2f} MB |", "",
             f"Hooks on the training thread: {c['capture_ms_per_step']:.1f} ms per step and rank. Restore of the latest "
             f"step ({c['restored_step']}) from the shards into fresh FSDP2 objects: {c['restore_latest_s']:.2f} s, "
             f"bitwise on every rank: {'yes' if c['restore_bitwise_all_ranks'] else 'NO'}."]
    if result.get("errors"):
        lines += ["", "Errors: " + json.dumps(result["errors"])[:2000]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = result["cell"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, vals, errs = [], [], [[], []]
    for arm in ("ray_ckpt", "dcp"):
        for basis in ("wall", "thread_cpu"):
            v = c.get(f"{arm}_{basis}_overhead_pct")
            if v is None:
                continue
            lo, hi = c[f"{arm}_{basis}_ci95_pct"]
            labels.append(f"{arm}\n{basis}")
            vals.append(v)
            errs[0].append(v - lo)
            errs[1].append(hi - v)
    ax.bar(range(len(vals)), vals, yerr=errs, capsize=4,
           color=["tab:green" if lab.startswith("ray") else "tab:gray" for lab in labels])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("overhead vs no checkpoint, % (95% CI)")
    ax.set_title(f"FSDP2, checkpoint every step: GPT {c['job']['size']}, {c['world']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import datetime

    from benchmarks.run import parse_job, preimport
    args = build_parser().parse_args(argv)
    if args.quick:   # a smoke run; --job still applies when given
        if args.job == build_parser().get_default("job"):
            args.job = "gpt:small:4"
        args.rounds, args.block_steps, args.warmup = 3, 2, 1
    for name in ("rounds", "block_steps", "world"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.rounds < 3:
        raise SystemExit("--rounds must be >= 3 (a confidence interval needs three pairs)")
    spec = parse_job(args.job)
    if spec.kind != "gpt":
        raise SystemExit("the FSDP2 benchmark shards the GPT example's blocks: --job gpt:<size>:<batch>")
    preimport()
    d = tempfile.mkdtemp(prefix="ray_ckpt_fsdp_")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    cell = {"dir": d, "job": spec.to_dict(), "world": args.world, "threads": threads, "rounds": args.rounds,
            "block_steps": args.block_steps, "warmup": args.warmup, "runtime": args.runtime}
    host = None
    if args.runtime == "ray":   # started before the ranks fork (they connect to it; nothing Ray in this process)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # a private cluster; every process that joins agrees
        from benchmarks.rayhost import RayHost
        host = RayHost(os.path.join(d, "rayhost"), num_cpus=args.world + 2,
                       object_store_bytes=args.object_store_mb << 20)
        cell["ray_address"] = host.start()
    jobs.preload(spec)
    print(f"[fsdp {time.strftime('%H:%M:%S')}] GPT {spec.size}, {args.world} ranks: {args.rounds} rounds x 3 blocks "
          f"x {args.block_steps} steps", flush=True)
    t0 = time.perf_counter()
    from benchmarks.run import read_json, reap
    fork = mp.get_context("fork")
    procs = [fork.Process(target=worker, args=(r, cell)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        reap(procs, args.timeout)
    finally:
        if host is not None:
            host.stop()
    res = [read_json(os.path.join(d, f"result_rank{r}.json")) or read_json(os.path.join(d, f"error_rank{r}.json"))
           or {"rank": r, "error": "no result (killed or timed out)"} for r in range(args.world)]
    shutil.rmtree(d, ignore_errors=True)
    errors = [x for x in res if "error" in x]
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": report.machine_info("cpu"), "settings": vars(args), "errors": errors,
              "wall_s": time.perf_counter() - t0,
              "cell": summarize(cell, res[0]) if "error" not in res[0] else None}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, ("fsdp_quick" if args.quick else "fsdp") + ("_ray" if args.runtime == "ray" else ""))
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if result["cell"] is not None:
        with open(base + ".md", "w") as f:
            f.write(markdown(result))
        plot(result, base + ".png")
        print(open(base + ".md").read(), flush=True)
    else:
        print(json.dumps(errors, indent=1)[:4000], flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
