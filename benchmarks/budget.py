"""The overhead budget on the Fashion-MNIST-shaped loop: mean step-time overhead (95 % CI), the granularity the
policy chose, the lost-work bound, bytes per step and the training process's CPU per step, both runtimes.

    .venv/bin/python -m benchmarks.budget [--jobs fmnist gpt:small:1] [--workers 1 2] [--placements shared pinned]
                                          [--runtimes local ray] [--rounds 20] [--block 50] [--out benchmarks/results]

The loops: ``fmnist``, Ray Train's Fashion-MNIST example shape (784-512-512-10 MLP, SGD with momentum, dense
gradients, batch 64 of synthetic 28x28 images), and any job of :mod:`benchmarks.jobs` (``gpt:small:1``: the GPT
example, AdamW), ``torch.set_num_threads(1)`` per process; one process, or ``--workers 2`` DDP ranks (gloo, rank 0
checkpoints, as in the plain loop). ``--placements pinned`` runs the training process on core 0 and the private
Ray (every actor) on core 1: the spare host cores of a GPU node (one worker only: two ranks and Ray on two cores
leave no core to give Ray alone). Each runtime runs in a forked process
(``runtime="ray"`` connected to a private one-node Ray started by :mod:`benchmarks.harness`) that holds two
replicas of the model: one attached to a ``Checkpointer`` with the defaults (``overhead_budget=0.05``), one
not. After a baseline phase (the plain replica alone: CPU per step without checkpointing) and a settling phase
(the policy measures and chooses), blocks of ``--block`` steps alternate between the two replicas; each pair of
blocks gives one overhead sample ``mean step(checkpointed) / mean step(plain) - 1``, and the mean of the samples
gets a bootstrap 95 % interval. The training process's CPU per checkpointed step is the process's CPU over the
alternating phase, less the plain replica's steps at the baseline's CPU per step, over the checkpointed steps
(so work the background threads do while the plain replica trains counts too).

Blocks are ``--block`` steps for ``fmnist`` and ``--block-s`` seconds of plain steps for the other jobs.
Outputs: ``budget.json`` (samples and summary), ``budget.md`` (table, date, machine), ``budget.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from benchmarks import harness


def build_mlp(seed: int):
    """The Fashion-MNIST-shaped MLP and its SGD optimizer (seeded)."""
    import torch
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    return m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)


def _ce(m, x, y):
    import torch
    return torch.nn.functional.cross_entropy(m(x), y)


def timed_steps(m, opt, data, n: int, loss_fn=None) -> list[float]:
    """``n`` training steps over ``data`` (``loss_fn(model, x, y)``, default cross-entropy of ``m(x)``); each
    step's wall seconds. Training thread."""
    loss_fn = loss_fn or _ce
    out = []
    for i in range(n):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        loss = loss_fn(m, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(time.perf_counter() - t0)
    return out


def paired_rounds(ck: tuple, plain: tuple, data, n: int, rounds: int, loss_fn=None) -> dict:
    """``rounds`` pairs of ``n``-step blocks, the checkpointed replica ``ck`` = (model, optimizer) and the ``plain``
    one in alternating order (ABBA): per round the overhead sample (ck mean step / plain mean step - 1) and both
    means; the training thread's CPU in the ck blocks; the steps of each. Training thread."""
    out = {"samples": [], "ck_means": [], "pl_means": [], "thread_ck": 0.0, "ck_steps": 0, "pl_steps": 0}
    for r in range(rounds):
        means = {}
        for which in ([0, 1] if r % 2 == 0 else [1, 0]):
            if which == 0:
                c = time.thread_time()
                ts = timed_steps(*ck, data, n, loss_fn)
                out["thread_ck"] += time.thread_time() - c
                out["ck_steps"] += n
            else:
                ts = timed_steps(*plain, data, n, loss_fn)
                out["pl_steps"] += n
            means[which] = statistics.fmean(ts)
        out["samples"].append(means[0] / means[1] - 1)
        out["ck_means"].append(means[0])
        out["pl_means"].append(means[1])
    return out


def _workload(cell: dict, rank: int):
    """The two replicas (plain, checkpointed: each ``(model, optimizer)``), 16 batches and the loss of the cell's
    job, identical on every rank (seeded); DDP-wrapped when the cell has more than one worker. Training process."""
    import torch
    if cell["job"] == "fmnist":
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
                for _ in range(16)]
        plain, ck, loss_fn = build_mlp(0), build_mlp(0), None
    else:
        from benchmarks import jobs
        spec = harness.parse_job(cell["job"])
        reps = []
        for _ in range(2):
            job = jobs.build(spec, torch.device("cpu"), seed=0)
            reps.append((job.model, jobs.make_optimizer(job.model, spec.lr, spec.kind)))
        plain, ck, loss_fn = reps[0], reps[1], job.loss_fn
        data = [job.batch(i, rank, torch.device("cpu")) for i in range(16)]
    if cell["world"] > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        plain, ck = (DDP(plain[0]), plain[1]), (DDP(ck[0]), ck[1])
    return plain, ck, data, loss_fn


def _body(cell: dict, out: dict, rank: int = 0) -> None:
    """One row, in a training process (one rank of ``cell["world"]``): baseline, settling, paired blocks."""
    import torch
    torch.set_num_threads(1)
    if cell.get("pin") is not None:
        os.sched_setaffinity(0, {cell["pin"]})
    import ray_ckpt
    if cell["world"] > 1:
        harness.init_process_group(cell, rank)
    if cell["runtime"] == "ray" and rank == 0:   # (only rank 0 checkpoints: the other ranks need no Ray)
        harness.connect_ray(cell["address"])
    (plain, popt), (ckm, copt), data, loss_fn = _workload(cell, rank)
    timed_steps(plain, popt, data, 20 if cell["job"] != "fmnist" else 100, loss_fn)   # warm-up
    w = statistics.fmean(timed_steps(plain, popt, data, 10, loss_fn))
    block = cell["block"] if cell["job"] == "fmnist" else max(3, round(cell["block_s"] / w))
    if cell["world"] > 1:                                                   # every rank runs the same blocks
        t = torch.tensor([block])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        block = int(t)
    rounds = cell["rounds"]
    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    base_steps = 4 * block
    timed_steps(plain, popt, data, base_steps, loss_fn)
    base_cpu = (time.process_time() - p0) / base_steps
    base_thread = (time.thread_time() - t0) / base_steps
    base_wall = (time.perf_counter() - w0) / base_steps
    kw = {"runtime": cell["runtime"], "overhead_budget": cell["budget"]}
    if cell["runtime"] == "ray":
        kw["run"] = cell["run"]
    # the plain loop's convention under DDP: rank 0 checkpoints the (replicated) state, the other ranks only train
    ck = ray_ckpt.Checkpointer(cell["uri"], ckm, copt, **kw) if rank == 0 else None
    settle = max(1, round(cell["settle_s"] / (block * base_wall)))
    if cell["world"] > 1:                                                   # (the same number on every rank)
        t = torch.tensor([settle])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        settle = int(t)
    for _ in range(settle):                                              # the policy measures and settles
        timed_steps(ckm, copt, data, block, loss_fn)
    s0 = ck.stats() if ck else None
    p0 = time.process_time()
    r = paired_rounds((ckm, copt), (plain, popt), data, block, rounds, loss_fn)
    proc = time.process_time() - p0
    samples, thread_ck, ck_steps, pl_steps = r["samples"], r["thread_ck"], r["ck_steps"], r["pl_steps"]
    if cell["world"] > 1:
        harness.close_process_group()
    if ck is None:
        out.update(samples=samples, base_cpu_s=base_cpu, cpu_per_step_s=(proc - pl_steps * base_cpu) / ck_steps)
        return
    s1 = ck.stats()
    ck.close()
    gran = s1["granularity"]
    out.update(job=cell["job"], world=cell["world"], placement=cell["placement"],
               runtime=cell["runtime"], budget=cell["budget"], samples=samples, block=block,
               base_step_s=base_wall, base_cpu_s=base_cpu,
               base_thread_cpu_s=base_thread,
               cpu_per_step_s=(proc - pl_steps * base_cpu) / ck_steps, thread_cpu_per_step_s=thread_ck / ck_steps,
               bytes_per_step=(s1["bytes_written"] - s0["bytes_written"]) / ck_steps,
               durable_bytes_per_step=((s1.get("durable_bytes", 0) - s0.get("durable_bytes", 0)) / ck_steps
                                       if "durable_bytes" in s1 else None),
               mode=gran["mode"], k=gran["k"], lost_work_steps=gran["lost_work_steps"], reason=gran["reason"],
               changes=gran["changes"], measured_overhead=gran["measured_overhead"],
               durable_diffs=s1.get("durable_diffs"), steps=s1["step"],
               estimates={k: s1["policy"]["estimates"].get(k) for k in ("step", "replay", "other_cpu", "diff_block")}
               if isinstance(s1.get("policy"), dict) else None)


def mean_ci(xs: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The mean and a bootstrap 95 % percentile interval."""
    rnd = random.Random(seed)
    n = len(xs)
    ms = sorted(statistics.fmean(rnd.choices(xs, k=n)) for _ in range(resamples))
    return statistics.fmean(xs), ms[int(0.025 * resamples)], ms[int(0.975 * resamples) - 1]


def _cells(args) -> list[dict]:
    """The rows to run: job x workers x placement x runtime x budget (``pinned`` only for one worker: two ranks
    and Ray on two cores leave no core to give Ray alone)."""
    out = []
    for job in args.jobs:
        for world in args.workers:
            for placement in args.placements:
                if placement == "pinned" and world > 1:
                    continue
                for runtime in args.runtimes:
                    for budget in args.budgets:
                        out.append({"job": job, "world": world, "placement": placement, "runtime": runtime,
                                    "budget": budget})
    return out


def _label(c: dict) -> str:
    return f"{c['job']} x{c['world']} {c['placement']} {c['runtime']} b={c['budget']:g}"


def _run_cell(cell: dict, d: str) -> dict:
    """Orchestrator: fork the cell's training process(es) and collect rank 0's result (rank 1's CPU beside it)."""
    if cell["world"] == 1:
        proc = harness.spawn(harness.process_main, (d, lambda out: _body(cell, out), "result.json"))
        harness.reap([proc], timeout=1800)
        return harness.read_json(os.path.join(d, "result.json")) or {"error": "no result"}
    res = harness.run_ranks(lambda rank, c, out: _body(c, out, rank), dict(cell, dir=d), timeout=1800)
    bad = [r for r in res if "error" in r]
    if bad:
        return {"error": bad[0]["error"], "traceback": bad[0].get("traceback", "")}
    out = dict(res[0])
    out["rank_cpu_per_step_s"] = [r["cpu_per_step_s"] for r in res]
    out["rank_base_cpu_s"] = [r["base_cpu_s"] for r in res]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", nargs="+", default=["fmnist"],
                   help="fmnist (the MLP loop) and/or kind:size:batch of benchmarks.jobs, e.g. gpt:small:4")
    p.add_argument("--workers", nargs="+", type=int, default=[1], help="data-parallel ranks (DDP, gloo) per row")
    p.add_argument("--placements", nargs="+", default=["shared"], choices=["shared", "pinned"],
                   help="shared: every process on every core; pinned: the training process on core 0, Ray on core 1")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=50, help="steps per block of the fmnist loop")
    p.add_argument("--block-s", type=float, default=0.5, help="seconds per block of the other jobs (plain steps)")
    p.add_argument("--settle", type=float, default=20.0, help="seconds the policy measures before the blocks")
    p.add_argument("--runtimes", nargs="+", default=["local", "ray"])
    p.add_argument("--budgets", nargs="+", type=float, default=[0.05],
                   help="overhead_budget values (0: every step recorded, to see the per-step cost itself)")
    p.add_argument("--out", default=harness.RESULTS)
    p.add_argument("--name", default="budget", help="basename of the outputs")
    args = p.parse_args(argv)
    log = harness.logger("budget")
    harness.preimport()
    for job in args.jobs:
        if job != "fmnist":
            from benchmarks import jobs
            jobs.preload(harness.parse_job(job))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        for n, cell in enumerate(_cells(args)):
            d = os.path.join(tmp, f"cell{n}")
            os.makedirs(d)
            cell.update(uri=os.path.join(d, "ckpt"), block=args.block, block_s=args.block_s, rounds=args.rounds,
                        settle_s=args.settle, run=f"bench-budget-{os.getpid()}-{n}",
                        pin=0 if cell["placement"] == "pinned" else None)
            log(_label(cell))
            if cell["runtime"] == "ray":
                short = tempfile.mkdtemp(prefix="bb-", dir="/tmp")   # AF_UNIX socket paths: at most 107 bytes
                try:
                    with harness.private_ray(short, num_cpus=2, object_store_mb=512,
                                             pin=1 if cell["placement"] == "pinned" else None) as host:
                        cell["address"] = host.address
                        res = _run_cell(cell, d)
                except RuntimeError as e:   # Ray did not start (an overloaded machine): the row says so
                    res = {"error": str(e).splitlines()[0]}
                finally:
                    shutil.rmtree(short, ignore_errors=True)
            else:
                res = _run_cell(cell, d)
            if "error" in res:
                log(f"{_label(cell)} failed: {res['error']}\n{res.get('traceback', '')}")
                rows.append({k: cell[k] for k in ("job", "world", "placement", "runtime", "budget")}
                            | {"error": res["error"]})
                continue
            m, lo, hi = mean_ci(res["samples"])
            res.update(overhead_mean=m, overhead_ci=[lo, hi], load=os.getloadavg())
            log(f"{_label(cell)}: mean overhead {100 * m:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}], "
                f"{res['mode']} k={res['k']}, {res['bytes_per_step'] / 1e3:.0f} kB/step, CPU/step "
                f"{1e3 * res['cpu_per_step_s']:.2f} ms (plain {1e3 * res['base_cpu_s']:.2f} ms), "
                f"step {1e3 * res['base_step_s']:.1f} ms, block {res['block']}; "
                f"measured {res['measured_overhead']}: {res['reason']}")
            rows.append(res)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": _machine(),
              "args": vars(args), "rows": rows}
    base = os.path.join(args.out, args.name)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    _write_md(result, base + ".md")
    _plot(rows, base + ".png")
    log(f"wrote {base}.json, .md, .png")
    return 0 if all("error" not in r for r in rows) else 1


def _machine() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "loadavg_at_end": load}


def _write_md(result: dict, path: str) -> None:
    a = result["args"]
    lines = [f"# Overhead budget ({result['date']})", "",
             f"Machine: {result['machine']['cpus']} CPUs, load average at the end {result['machine']['loadavg_at_end']}"
             " (a shared machine: the intervals carry its noise). `python -m benchmarks.budget --jobs "
             f"{' '.join(a['jobs'])} --workers {' '.join(map(str, a['workers']))} --placements "
             f"{' '.join(a['placements'])} --rounds {a['rounds']}`. Jobs: `fmnist` is Ray Train's Fashion-MNIST "
             "example shape (784-512-512-10 MLP, SGD momentum, batch 64); `gpt:<size>:<batch>` the GPT example "
             "(AdamW). Workers: DDP ranks (gloo), rank 0 checkpoints. Placement: `shared` every process on both "
             "cores, `pinned` the training process on core 0 and Ray on core 1. Overhead: mean step time of the "
             "checkpointed replica over the plain one, minus 1, paired blocks, bootstrap 95 % interval; CPU: rank 0's "
             "process per checkpointed step.", "",
             "| job | workers | placement | runtime | budget | mean step overhead [95 % CI] | within budget | "
             "granularity | lost-work bound | bytes/step | process CPU/step (plain) | step (plain) | durable_diffs |",
             "|---|---:|---|---|---:|---|---|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        head = (f"| {r.get('job', 'fmnist')} | {r.get('world', 1)} | {r.get('placement', 'shared')} | {r['runtime']} "
                f"| {r['budget']} |")
        if "error" in r:
            lines.append(head + f" error: {r['error']} | | | | | | | |")
            continue
        lo, hi = r["overhead_ci"]
        dd = (r.get("durable_diffs") or {}).get("mode", "all (local)")
        verdict = ("n/a (budget 0)" if r["budget"] <= 0 else "yes" if hi <= r["budget"] else
                   "no" if lo > r["budget"] else "undecided (the interval holds the budget)")
        lines.append(head + f" {100 * r['overhead_mean']:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}] | {verdict} | "
                     f"{r['mode']} (k={r['k']}) | {r['lost_work_steps']} steps | {r['bytes_per_step'] / 1e3:.0f} kB | "
                     f"{1e3 * r['cpu_per_step_s']:.2f} ms ({1e3 * r['base_cpu_s']:.2f} ms) | "
                     f"{1e3 * r['base_step_s']:.1f} ms | {dd} |")
    lines += ["", "Reasons (the policy's own words):"]
    lines += [f"- {r.get('job', 'fmnist')} x{r.get('world', 1)} {r.get('placement', 'shared')} {r['runtime']} "
              f"(budget {r['budget']}): {r.get('reason', r.get('error'))}" for r in result["rows"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(ok)), 3.6))
    xs = range(len(ok))
    ms = [100 * r["overhead_mean"] for r in ok]
    err = [[100 * (r["overhead_mean"] - r["overhead_ci"][0]) for r in ok],
           [100 * (r["overhead_ci"][1] - r["overhead_mean"]) for r in ok]]
    ax.bar(xs, ms, yerr=err, capsize=6, color="#4c72b0")
    ax.axhline(5.0, color="#c44e52", ls="--", label="budget 5 %")
    ax.set_xticks(list(xs), [f"{r.get('job', 'fmnist')} x{r.get('world', 1)}\n{r.get('placement', 'shared')} "
                             f"{r['runtime']}\n{r['mode']} k={r['k']}" for r in ok], fontsize=7)
    ax.set_ylabel("mean step-time overhead, % (95 % CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
