"""The training process's own CPU per step under ``runtime="ray"``, next to the copies it must make, for two code
trees side by side (before / after a change), in paired blocks.

    .venv/bin/python -m benchmarks.train_cpu --arms before=/path/to/old/tree after=. [--pairs 3] [--rounds 10]
                                             [--block 50] [--out benchmarks/results] [--name train_cpu]

The loop is :mod:`benchmarks.budget`'s (Ray Train's Fashion-MNIST example shape: 784-512-512-10 MLP, SGD with
momentum, dense gradients, batch 64, ``torch.set_num_threads(1)``), with ``overhead_budget=0``: every step is
recorded, so what is measured is the per-step cost itself.

Each *block* runs one arm (a tree holding a ``ray_ckpt`` package) in a fresh private one-node Ray whose processes
are pinned to core 1 (``taskset``; the spare host cores of a GPU node) and a training process pinned to core 0,
both importing that arm's ``ray_ckpt`` (``PYTHONPATH``). Blocks run in pairs, in ABBA order, so that the arms
see the same drift of a shared machine. Inside a block the training process holds two replicas of the model:
one attached to a ``Checkpointer(runtime="ray", overhead_budget=0)``, one not; after a baseline phase (the plain
replica alone) and a settling phase, ``--rounds`` pairs of ``--block`` steps alternate between them.

Per block it reports:

- the training process's CPU per checkpointed step (``time.process_time`` over the alternating phase, less the
  plain replica's steps at the baseline's CPU per step) and the training thread's (``time.thread_time``), next
  to the plain loop's;
- the CPU of each thread of the training process over the alternating phase (``/proc/self/task/*/stat``,
  grouped by thread name: the training thread, the sender, Ray's threads), per checkpointed step;
- the mean step time, checkpointed and plain, and the overhead ``mean(ck) / mean(plain) - 1`` per round;
- the floor: the capture copy (every gradient into a buffer already in memory) and the hand-off copy
  (``ray.put`` of one contiguous buffer of the gradients' size), CPU per step.

The summary gives, per arm, the mean over blocks with a bootstrap 95 % interval, and the paired difference
(after - before) over the pairs. Outputs: ``<name>.json``, ``<name>.md``, ``<name>.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------------------
# the training process
# ------------------------------------------------------------------------------------------------------------
def _thread_cpu() -> dict:
    """CPU seconds of each thread of this process, summed by thread name (Linux; {} elsewhere)."""
    out: dict = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1:s.rindex(")")]
        fields = s[s.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if tid == str(os.getpid()):
            name = "training thread"
        out[name] = out.get(name, 0.0) + cpu
    return out


def _child(cell: dict) -> dict:
    import numpy as np
    import ray
    import torch
    torch.set_num_threads(1)
    import ray_ckpt
    from benchmarks.budget import build_mlp, paired_rounds, timed_steps
    harness.connect_ray(cell["address"])
    out: dict = {"arm": cell["arm"], "ray_ckpt": ray_ckpt.__file__,
                 "actor_ray_ckpt": ray.get(ray.remote(_where).remote()),
                 "affinity": sorted(os.sched_getaffinity(0))}
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(16)]
    plain, popt = build_mlp(0)
    ckm, copt = build_mlp(0)
    block, rounds = cell["block"], cell["rounds"]
    timed_steps(plain, popt, data, 100)                                     # warm-up (and gradients to copy)

    # the floor: the copies a checkpointed step must make
    grads = [p.grad for p in plain.parameters()]
    bufs = [torch.empty_like(x) for x in grads]
    nbytes = sum(x.numel() * x.element_size() for x in grads)
    reps = 300
    c0 = time.thread_time()
    for _ in range(reps):
        for b, x in zip(bufs, grads):
            b.copy_(x)
    out["capture_copy_s"] = (time.thread_time() - c0) / reps
    flat = np.empty(nbytes, dtype=np.uint8)
    flat[:] = 1
    c0 = time.process_time()
    for _ in range(reps // 3):
        ref = ray.put(flat)
        del ref
    out["put_copy_s"] = (time.process_time() - c0) / (reps // 3)
    out["grad_bytes"] = nbytes

    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    base_steps = 4 * block
    timed_steps(plain, popt, data, base_steps)
    base_cpu = (time.process_time() - p0) / base_steps
    out.update(base_cpu_s=base_cpu, base_thread_cpu_s=(time.thread_time() - t0) / base_steps,
               base_step_s=(time.perf_counter() - w0) / base_steps)
    ck = ray_ckpt.Checkpointer(cell["uri"], ckm, copt, runtime="ray", overhead_budget=0.0,
                               run=f"bench-train-cpu-{os.getpid()}")
    deadline = time.monotonic() + cell["settle_s"]
    while time.monotonic() < deadline:
        timed_steps(ckm, copt, data, block)
    s0 = ck.stats()
    th0 = _thread_cpu()
    p0 = time.process_time()
    r = paired_rounds((ckm, copt), (plain, popt), data, block, rounds)
    proc = time.process_time() - p0
    samples, ck_means, pl_means = r["samples"], r["ck_means"], r["pl_means"]
    thread_ck, ck_steps, pl_steps = r["thread_ck"], r["ck_steps"], r["pl_steps"]
    th1 = _thread_cpu()
    s1 = ck.stats()
    if cell.get("profile_s"):
        out["profile"] = _profile(lambda: timed_steps(ckm, copt, data, block), cell["profile_s"])
    ck.close()
    threads = {k: (th1.get(k, 0.0) - th0.get(k, 0.0)) / ck_steps for k in th1}
    # the plain replica's steps ran on the training thread too: take them out at the baseline's thread CPU
    threads["training thread"] = threads.get("training thread", 0.0) - pl_steps * out["base_thread_cpu_s"] / ck_steps
    out.update(samples=samples, ck_step_s=statistics.fmean(ck_means), plain_step_s=statistics.fmean(pl_means),
               cpu_per_step_s=(proc - pl_steps * base_cpu) / ck_steps, thread_cpu_per_step_s=thread_ck / ck_steps,
               threads_per_step_s={k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                                   if abs(v) >= 1e-6},
               steps=s1["step"], bytes_per_step=(s1["bytes_written"] - s0["bytes_written"]) / ck_steps,
               chunks=(s1.get("runtime") or {}).get("chunks_sent"),
               shared_chunks=(s1.get("runtime") or {}).get("shared_chunks"),   # handed over by descriptor
               loadavg=os.getloadavg())
    return out


def _profile(run_block, seconds: float, top: int = 30) -> dict:
    """Per thread: its CPU over ``seconds`` of checkpointed blocks and the functions it spent it in (yappi, CPU
    clock: own time ``tsub`` and inclusive ``ttot``, seconds per call site summed). {} without yappi."""
    try:
        import yappi
    except ImportError:
        return {}
    yappi.set_clock_type("cpu")
    yappi.clear_stats()
    yappi.start(builtins=True, profile_threads=True)
    steps, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        run_block()
        steps += 1
    yappi.stop()
    out = {}
    for th in yappi.get_thread_stats():
        fs = yappi.get_func_stats(filter={"ctx_id": th.id})
        rows = sorted(((f.tsub, f.ttot, f.ncall, f"{f.name} ({os.path.basename(f.module)}:{f.lineno})") for f in fs),
                      reverse=True)
        out[f"{th.name}#{th.id}"] = {"cpu_s": th.ttot, "blocks": steps,
                                     "own": [list(r) for r in rows[:top]],
                                     "inclusive": [list(r) for r in sorted(rows, key=lambda r: -r[1])[:top]]}
    yappi.clear_stats()
    return out


def _where() -> str:
    import ray_ckpt
    return ray_ckpt.__file__


def _child_main(path: str) -> int:
    with open(path) as f:
        cell = json.load(f)
    try:
        res = _child(cell)
    except BaseException as e:  # noqa: BLE001 - reported to the orchestrator
        import traceback
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(cell["result"], "w") as f:
        json.dump(res, f)
    os._exit(0)


# ------------------------------------------------------------------------------------------------------------
# the orchestrator
# ------------------------------------------------------------------------------------------------------------
def _block_run(arm: str, tree: str, tmp: str, args, log) -> dict:
    d = tempfile.mkdtemp(prefix=f"{arm}-", dir=tmp)
    env = dict(os.environ)
    tree = os.path.abspath(tree)
    env["PYTHONPATH"] = tree if tree == _HERE else f"{tree}:{_HERE}"
    env.setdefault("RAY_AUTH_MODE", "disabled")
    short = tempfile.mkdtemp(prefix="tc-", dir=args.ray_tmp)   # AF_UNIX socket paths: at most 107 bytes
    os.makedirs(os.path.join(short, "ray"), exist_ok=True)
    env_ray = dict(env, RAY_TMPDIR=short)
    ray_log = open(os.path.join(d, "rayhost.log"), "wb")
    host = subprocess.Popen(harness.pin_prefix(1) + [sys.executable, "-m", "benchmarks.rayhost", os.path.join(short, "ray"), "2",
                                       str(512 << 20)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=ray_log, env=env_ray, cwd=tmp)
    try:
        line = b""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = host.stdout.readline()
            if line.strip().startswith(b"{") or host.poll() is not None:
                break
        if not line.strip().startswith(b"{"):
            return {"arm": arm, "error": "the private Ray did not start"}
        cell = {"arm": arm, "address": json.loads(line)["address"], "uri": os.path.join(d, "ckpt"),
                "block": args.block, "rounds": args.rounds, "settle_s": args.settle,
                "result": os.path.join(d, "result.json"), "profile_s": args.profile}
        with open(os.path.join(d, "cell.json"), "w") as f:
            json.dump(cell, f)
        child = subprocess.Popen(harness.pin_prefix(0) + [sys.executable, "-m", "benchmarks.train_cpu", "--child",
                                            os.path.join(d, "cell.json")], env=env, cwd=tmp)
        try:
            child.wait(timeout=900)
        except subprocess.TimeoutExpired:
            child.kill()   # our own child, by its handle
            child.wait(10)
        return harness.read_json(cell["result"]) or {"arm": arm, "error": "no result"}
    finally:
        try:
            host.stdin.close()
            host.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            host.kill()   # our own child, by its handle
            host.wait(10)
        ray_log.close()
        shutil.rmtree(short, ignore_errors=True)


def _ci(xs: list) -> list:
    from benchmarks.budget import mean_ci
    return list(mean_ci(xs)) if len(xs) > 1 else [xs[0], xs[0], xs[0]]


_FIELDS = ("cpu_per_step_s", "thread_cpu_per_step_s", "ck_step_s", "plain_step_s", "overhead", "base_cpu_s",
           "capture_copy_s", "put_copy_s")


def summarize(blocks: list, arms: list) -> dict:
    ok = [b for b in blocks if "error" not in b]
    for b in ok:
        b["overhead"] = statistics.fmean(b["samples"])
    out: dict = {}
    for arm in arms:
        mine = [b for b in ok if b["arm"] == arm]
        if not mine:
            continue
        s = {f: _ci([b[f] for b in mine]) for f in _FIELDS}
        names = {k for b in mine for k in b["threads_per_step_s"]}
        s["threads"] = {k: statistics.fmean(b["threads_per_step_s"].get(k, 0.0) for b in mine) for k in names}
        s["blocks"] = len(mine)
        out[arm] = s
    if len(arms) == 2:
        a, b = arms
        pa = [x for x in ok if x["arm"] == a]
        pb = [x for x in ok if x["arm"] == b]
        n = min(len(pa), len(pb))
        if n:
            out["paired_diff"] = {f: _ci([pb[i][f] - pa[i][f] for i in range(n)]) for f in _FIELDS}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--arms", nargs="+", default=[f"current={_HERE}"], help="name=tree holding ray_ckpt")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--profile", type=float, default=0.0,
                   help="seconds of checkpointed steps profiled with yappi (CPU clock, every thread) after the "
                        "measured phase of each block (0: none)")
    p.add_argument("--out", default=harness.RESULTS)
    p.add_argument("--name", default="train_cpu")
    p.add_argument("--ray-tmp", default="/tmp", help="where each block's Ray keeps its files (a short path)")
    args = p.parse_args(argv)
    if args.child:
        return _child_main(args.child)
    log = harness.logger("train_cpu")
    os.makedirs(args.out, exist_ok=True)
    arms = [a.split("=", 1) for a in args.arms]
    names = [a for a, _ in arms]
    blocks = []
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-train-cpu-") as tmp:
        for i in range(args.pairs):
            for arm, tree in (arms if i % 2 == 0 else arms[::-1]):
                res = _block_run(arm, tree, tmp, args, log)
                res.setdefault("arm", arm)
                res["pair"] = i
                if "error" in res:
                    log(f"{arm} pair {i}: {res['error']}\n{res.get('traceback', '')}")
                else:
                    log(f"{arm} pair {i}: process CPU/step {1e3 * res['cpu_per_step_s']:.2f} ms (plain "
                        f"{1e3 * res['base_cpu_s']:.2f}), training thread {1e3 * res['thread_cpu_per_step_s']:.2f} "
                        f"ms, step {1e3 * res['ck_step_s']:.2f} vs {1e3 * res['plain_step_s']:.2f} ms; threads "
                        + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in list(res["threads_per_step_s"].items())[:6]))
                blocks.append(res)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
              "loadavg_start": load0, "loadavg_end": os.getloadavg(), "args": vars(args), "arms": dict(arms),
              "blocks": blocks, "summary": summarize(blocks, names)}
    base = os.path.join(args.out, args.name)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    _write_md(result, base + ".md")
    _plot(result, base + ".png")
    log(f"wrote {base}.json, .md, .png")
    return 0 if all("error" not in b for b in blocks) else 1


def _ms(ci) -> str:
    return f"{1e3 * ci[0]:.2f} [{1e3 * ci[1]:.2f}, {1e3 * ci[2]:.2f}]"


def _write_md(result: dict, path: str) -> None:
    s = result["summary"]
    lines = [f"# Training-process CPU per step, runtime=\"ray\", every step recorded ({result['date']})", "",
             f"{result['cpus']} CPUs; load average {result['loadavg_start']} at the start, {result['loadavg_end']} "
             "at the end (a shared machine: the intervals carry that noise). Ray pinned to core 1, the training "
             "process to core 0. Means over blocks, bootstrap 95 % intervals, ms per step.", "",
             "| arm | blocks | process CPU/ckpt step | training thread CPU | plain CPU/step | mean step (ckpt) | "
             "mean step (plain) | overhead | capture copy | ray.put copy |", "|---|---:|---|---|---|---|---|---|---|---|"]
    for arm, v in s.items():
        if arm == "paired_diff":
            continue
        o = v["overhead"]
        lines.append(f"| {arm} | {v['blocks']} | {_ms(v['cpu_per_step_s'])} | {_ms(v['thread_cpu_per_step_s'])} | "
                     f"{_ms(v['base_cpu_s'])} | {_ms(v['ck_step_s'])} | {_ms(v['plain_step_s'])} | "
                     f"{100 * o[0]:+.0f} % [{100 * o[1]:+.0f}, {100 * o[2]:+.0f}] | {_ms(v['capture_copy_s'])} | "
                     f"{_ms(v['put_copy_s'])} |")
    if "paired_diff" in s:
        d = s["paired_diff"]
        lines += ["", f"Paired difference ({' - '.join(reversed(list(result['arms'])))}), per pair of blocks: process "
                  f"CPU/step {_ms(d['cpu_per_step_s'])} ms, training thread {_ms(d['thread_cpu_per_step_s'])} ms, "
                  f"mean checkpointed step {_ms(d['ck_step_s'])} ms."]
    lines += ["", "CPU per checkpointed step by thread of the training process (ms; the training thread net of the "
              "plain replica's steps):", ""]
    for arm, v in s.items():
        if arm != "paired_diff":
            lines.append(f"- {arm}: " + ", ".join(f"{k} {1e3 * x:.2f}" for k, x in
                                                 sorted(v["threads"].items(), key=lambda kv: -kv[1]) if abs(x) >= 5e-6))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = {k: v for k, v in result["summary"].items() if k != "paired_diff"}
    if not s:
        return
    fields = [("cpu_per_step_s", "process CPU / ckpt step"), ("thread_cpu_per_step_s", "training thread CPU"),
              ("base_cpu_s", "plain step CPU"), ("capture_copy_s", "capture copy"), ("put_copy_s", "ray.put copy")]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    w = 0.8 / len(s)
    for j, (arm, v) in enumerate(s.items()):
        xs = [i + j * w for i in range(len(fields))]
        ms = [1e3 * v[f][0] for f, _ in fields]
        err = [[1e3 * (v[f][0] - v[f][1]) for f, _ in fields], [1e3 * (v[f][2] - v[f][0]) for f, _ in fields]]
        ax.bar(xs, ms, w, yerr=err, capsize=4, label=arm)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(fields))], [lbl for _, lbl in fields], fontsize=8)
    ax.set_ylabel("ms per step (95 % CI)")
    ax.set_title("training process, runtime=\"ray\", every step recorded", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
