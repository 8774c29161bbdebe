"""The overhead budget on the Fashion-MNIST-shaped loop: mean step-time overhead (95 % CI), the granularity the
policy chose, the lost-work bound, bytes per step and the training process's CPU per step, both runtimes.

    .venv/bin/python -m benchmarks.budget [--rounds 20] [--block 50] [--out benchmarks/results]

The loop: Ray Train's Fashion-MNIST example shape (784-512-512-10 MLP, SGD with momentum, dense gradients, batch
64 of synthetic 28x28 images), one process, ``torch.set_num_threads(1)``. Each runtime runs in a forked process
(``runtime="ray"`` connected to a private one-node Ray started by :mod:`benchmarks.harness`) that holds two
replicas of the model: one attached to a ``Checkpointer`` with the defaults (``overhead_budget=0.05``), one
not. After a baseline phase (the plain replica alone: CPU per step without checkpointing) and a settling phase
(the policy measures and chooses), blocks of ``--block`` steps alternate between the two replicas; each pair of
blocks gives one overhead sample ``mean step(checkpointed) / mean step(plain) - 1``, and the mean of the samples
gets a bootstrap 95 % interval. The training process's CPU per checkpointed step is the process's CPU over the
alternating phase, less the plain replica's steps at the baseline's CPU per step, over the checkpointed steps
(so work the background threads do while the plain replica trains counts too).

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


def timed_steps(m, opt, data, n: int) -> list[float]:
    """``n`` training steps over ``data``; each step's wall seconds."""
    import torch
    out = []
    for i in range(n):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(time.perf_counter() - t0)
    return out


def paired_rounds(ck: tuple, plain: tuple, data, n: int, rounds: int) -> dict:
    """``rounds`` pairs of ``n``-step blocks, the checkpointed replica ``ck`` = (model, optimizer) and the ``plain``
    one in alternating order (ABBA): per round the overhead sample (ck mean step / plain mean step - 1) and both
    means; the training thread's CPU in the ck blocks; the steps of each. Training thread."""
    out = {"samples": [], "ck_means": [], "pl_means": [], "thread_ck": 0.0, "ck_steps": 0, "pl_steps": 0}
    for r in range(rounds):
        means = {}
        for which in ([0, 1] if r % 2 == 0 else [1, 0]):
            if which == 0:
                c = time.thread_time()
                ts = timed_steps(*ck, data, n)
                out["thread_ck"] += time.thread_time() - c
                out["ck_steps"] += n
            else:
                ts = timed_steps(*plain, data, n)
                out["pl_steps"] += n
            means[which] = statistics.fmean(ts)
        out["samples"].append(means[0] / means[1] - 1)
        out["ck_means"].append(means[0])
        out["pl_means"].append(means[1])
    return out


def _body(cell: dict, out: dict) -> None:
    import torch
    torch.set_num_threads(1)
    import ray_ckpt
    if cell["runtime"] == "ray":
        harness.connect_ray(cell["address"])
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(16)]
    plain, popt = build_mlp(0)
    ckm, copt = build_mlp(0)
    block, rounds = cell["block"], cell["rounds"]
    timed_steps(plain, popt, data, 100)                                     # warm-up
    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    base_steps = 4 * block
    timed_steps(plain, popt, data, base_steps)
    base_cpu = (time.process_time() - p0) / base_steps
    base_thread = (time.thread_time() - t0) / base_steps
    base_wall = (time.perf_counter() - w0) / base_steps
    kw = {"runtime": cell["runtime"], "overhead_budget": cell["budget"]}
    if cell["runtime"] == "ray":
        kw["run"] = f"bench-budget-{os.getpid()}"
    ck = ray_ckpt.Checkpointer(cell["uri"], ckm, copt, **kw)
    deadline = time.monotonic() + cell["settle_s"]
    while time.monotonic() < deadline:                                  # the policy measures and settles
        timed_steps(ckm, copt, data, block)
    s0 = ck.stats()
    p0 = time.process_time()
    r = paired_rounds((ckm, copt), (plain, popt), data, block, rounds)
    proc = time.process_time() - p0
    samples, thread_ck, ck_steps, pl_steps = r["samples"], r["thread_ck"], r["ck_steps"], r["pl_steps"]
    s1 = ck.stats()
    ck.close()
    gran = s1["granularity"]
    out.update(runtime=cell["runtime"], budget=cell["budget"], samples=samples, base_step_s=base_wall, base_cpu_s=base_cpu,
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--settle", type=float, default=20.0, help="seconds the policy measures before the blocks")
    p.add_argument("--runtimes", nargs="+", default=["local", "ray"])
    p.add_argument("--budgets", nargs="+", type=float, default=[0.05],
                   help="overhead_budget values (0: every step recorded, to see the per-step cost itself)")
    p.add_argument("--out", default=harness.RESULTS)
    p.add_argument("--name", default="budget", help="basename of the outputs")
    args = p.parse_args(argv)
    log = harness.logger("budget")
    harness.preimport()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        for runtime, budget in [(r, b) for r in args.runtimes for b in args.budgets]:
            d = os.path.join(tmp, f"{runtime}-{budget}")
            os.makedirs(d)
            cell = {"runtime": runtime, "uri": os.path.join(d, "ckpt"), "block": args.block,
                    "rounds": args.rounds, "settle_s": args.settle, "budget": budget}

            def run_one():
                proc = harness.spawn(harness.process_main, (d, lambda out: _body(cell, out), "result.json"))
                harness.reap([proc], timeout=1800)
                return harness.read_json(os.path.join(d, "result.json")) or {"error": "no result"}

            log(f"runtime={runtime} overhead_budget={budget}")
            if runtime == "ray":
                short = tempfile.mkdtemp(prefix="bb-", dir="/tmp")   # AF_UNIX socket paths: at most 107 bytes
                try:
                    with harness.private_ray(short, num_cpus=2, object_store_mb=512) as host:
                        cell["address"] = host.address
                        res = run_one()
                except RuntimeError as e:   # Ray did not start (an overloaded machine): the row says so
                    res = {"error": str(e).splitlines()[0]}
                finally:
                    shutil.rmtree(short, ignore_errors=True)
            else:
                res = run_one()
            if "error" in res:
                log(f"runtime={runtime} failed: {res['error']}\n{res.get('traceback', '')}")
                rows.append({"runtime": runtime, "budget": budget, "error": res["error"]})
                continue
            m, lo, hi = mean_ci(res["samples"])
            res.update(overhead_mean=m, overhead_ci=[lo, hi])
            log(f"runtime={runtime}: mean overhead {100 * m:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}], "
                f"{res['mode']} k={res['k']}, {res['bytes_per_step'] / 1e3:.0f} kB/step, CPU/step "
                f"{1e3 * res['cpu_per_step_s']:.2f} ms (plain {1e3 * res['base_cpu_s']:.2f} ms); "
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
    lines = [f"# Overhead budget, Fashion-MNIST-shaped loop ({result['date']})", "",
             f"Machine: {result['machine']['cpus']} CPUs, load average at the end {result['machine']['loadavg_at_end']}"
             " (shared with other jobs while it ran: the intervals carry that noise).", "",
             "| runtime | budget | mean step overhead [95 % CI] | granularity | lost-work bound | bytes/step | "
             "process CPU/step (plain) | training thread CPU/step (plain) | durable_diffs |",
             "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['runtime']} | {r['budget']} | error: {r['error']} | | | | | | |")
            continue
        lo, hi = r["overhead_ci"]
        dd = (r.get("durable_diffs") or {}).get("mode", "all (local)")
        lines.append(f"| {r['runtime']} | {r['budget']} | {100 * r['overhead_mean']:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}] | "
                     f"{r['mode']} (k={r['k']}) | {r['lost_work_steps']} steps | {r['bytes_per_step'] / 1e3:.0f} kB | "
                     f"{1e3 * r['cpu_per_step_s']:.2f} ms ({1e3 * r['base_cpu_s']:.2f} ms) | "
                     f"{1e3 * r['thread_cpu_per_step_s']:.2f} ms ({1e3 * r['base_thread_cpu_s']:.2f} ms) | {dd} |")
    lines += ["", "Reasons:"] + [f"- {r['runtime']} (budget {r['budget']}): {r.get('reason', r.get('error'))}"
                                 for r in result["rows"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(ok))
    ms = [100 * r["overhead_mean"] for r in ok]
    err = [[100 * (r["overhead_mean"] - r["overhead_ci"][0]) for r in ok],
           [100 * (r["overhead_ci"][1] - r["overhead_mean"]) for r in ok]]
    ax.bar(xs, ms, yerr=err, capsize=6, color="#4c72b0")
    ax.axhline(5.0, color="#c44e52", ls="--", label="budget 5 %")
    ax.set_xticks(list(xs), [f"{r['runtime']} b={r['budget']:g}\n{r['mode']} k={r['k']}" for r in ok])
    ax.set_ylabel("mean step-time overhead, % (95 % CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
