"""What a rank > 0's loop-state recorder costs its training thread, per step, by hand-off cadence.

Three replicas of the issue's Fashion-MNIST MLP (784-512-512-10 with Dropout, SGD momentum, batch 64, synthetic
data) in one process, one thread of torch each: ``none`` (no recorder), ``batched`` (the recorder writing in
batches of ``batch_steps`` or after 0.2 s: the default ``handoff_delay``) and ``per_step`` (``handoff_delay=0``:
every record written as it is captured). They take turns in blocks of ``--block-steps`` steps, the order rotating
every round so that drift of a shared machine cancels; each block's wall time and training-thread CPU time
(``time.thread_time``) give one paired difference per round against ``none``; the figures are the median of the
rounds with a 95% percentile-bootstrap interval (:mod:`benchmarks.report`). The recorder's writer thread writes
to a local directory (``--dir``).

Runs as ``python -m benchmarks.rank_loop_cost [--rounds 30] [--out benchmarks/results/rank_loop_cost]``; writes
``<out>.json``, ``.md`` and ``.png``.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from benchmarks import report

ORDERS = [("none", "batched", "per_step"), ("per_step", "none", "batched"), ("batched", "per_step", "none")]


class _Arm:
    def __init__(self, name: str, root: str, delay: float | None, batch_steps: int):
        from ray_ckpt.api import open_uri
        from ray_ckpt.engine.rankloop import RankLoopRecorder
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 512), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.2), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.2), torch.nn.Linear(512, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
        self.rec, self.dir = None, f"{root}/{name}"
        if delay is not None:
            self.rec = RankLoopRecorder(open_uri(f"{root}/{name}"), 1, self.model, self.opt, main_generation=1,
                                        start_step=0, batch_steps=batch_steps, full_every=1000,
                                        max_batch_delay=delay)

    def block(self, n: int) -> dict:
        import torch.nn.functional as F
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            loss = F.cross_entropy(self.model(self.x), self.y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return {"s": time.perf_counter() - t0, "cpu_s": time.thread_time() - c0}

    def close(self) -> dict:
        if self.rec is None:
            return {}
        self.rec.close()
        import os
        objects = [f for _, _, fs in os.walk(self.dir) for f in fs if "diff" in f]
        return {"diff_files": len(objects)}   # data objects and their manifests


def run(rounds: int, k: int, warmup: int, root: str, batch_steps: int) -> dict:
    torch.set_num_threads(1)
    arms = {"none": _Arm("none", root, None, batch_steps), "batched": _Arm("batched", root, 0.2, batch_steps),
            "per_step": _Arm("per_step", root, 0.0, batch_steps)}
    for a in arms.values():
        a.block(warmup)
    blocks = []
    for i in range(rounds):
        res = {name: arms[name].block(k) for name in ORDERS[i % len(ORDERS)]}
        blocks.append({f"{n}_{key}": v for n, r in res.items() for key, v in r.items()})
    counters = {name: a.close() for name, a in arms.items()}
    out = {"date": report.now(), "machine": report.machine_info("cpu"), "rounds": rounds, "block_steps": k,
           "warmup_steps": warmup, "batch_steps": batch_steps, "blocks": blocks, "counters": counters,
           "step_ms_none": 1000 * report.median([b["none_s"] for b in blocks]) / k}
    for arm, ref in (("batched", "none"), ("per_step", "none"), ("per_step", "batched")):
        for basis, suffix in (("wall", "_s"), ("thread_cpu", "_cpu_s")):
            d = [100 * (b[arm + suffix] / b[ref + suffix] - 1) for b in blocks]
            out[f"{arm}_vs_{ref}_{basis}"] = report.overhead_fields(d)
            us = [1e6 * (b[arm + suffix] - b[ref + suffix]) / k for b in blocks]
            out[f"{arm}_vs_{ref}_{basis}_us"] = report.overhead_fields(us)
    return out


def markdown(r: dict) -> str:
    lines = [f"# Rank loop recorder: cost per step on the training thread ({r['date']})", "",
             f"MLP 784-512-512-10, batch 64, {r['rounds']} rounds of {r['block_steps']} steps per arm, "
             f"batch_steps={r['batch_steps']}; median step without a recorder {r['step_ms_none']:.2f} ms.", "",
             "| arm vs reference | wall per step | training-thread CPU per step |", "|---|---|---|"]
    for arm, ref in (("batched", "none"), ("per_step", "none"), ("per_step", "batched")):
        cells = []
        for basis in ("wall", "thread_cpu"):
            f, us = r[f"{arm}_vs_{ref}_{basis}"], r[f"{arm}_vs_{ref}_{basis}_us"]
            ci = us.get("ci95_pct")
            cells.append(f"{report.pct(f.get('overhead_pct'))} {report.interval(f.get('ci95_pct'))}; "
                         f"{report.fmt(us.get('overhead_pct'), '+.0f')} µs"
                         + (f" [{ci[0]:+.0f}, {ci[1]:+.0f}]" if ci else ""))
        lines.append(f"| {arm} vs {ref} | {cells[0]} | {cells[1]} |")
    lines += ["", f"objects written: {r['counters']}", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["batched vs none", "per_step vs none", "per_step vs batched"]
    keys = [("batched", "none"), ("per_step", "none"), ("per_step", "batched")]
    vals = [r[f"{a}_vs_{b}_thread_cpu_us"].get("overhead_pct", 0.0) for a, b in keys]
    cis = [r[f"{a}_vs_{b}_thread_cpu_us"].get("ci95_pct") for a, b in keys]
    report.ci_bars(ax, vals, cis, color="tab:blue")
    ax.set_xticks(range(3), names)
    ax.set_ylabel("training-thread CPU per step (µs)")
    ax.axhline(0, color="black", lw=0.5)
    fig.tight_layout()
    report.save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.rank_loop_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block-steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-steps", type=int, default=10)
    p.add_argument("--dir", default=None, help="where the recorders write (default: a temporary directory)")
    p.add_argument("--out", default="benchmarks/results/rank_loop_cost")
    p.add_argument("--rebuild", action="store_true", help="rewrite <out>.md and .png from <out>.json")
    a = p.parse_args(argv)
    if a.rebuild:
        import json
        with open(a.out + ".json") as f:
            report.write_result(a.out, json.load(f), markdown, plot)
        return 0
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        result = run(a.rounds, a.block_steps, a.warmup, root, a.batch_steps)
    report.write_result(a.out, result, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
