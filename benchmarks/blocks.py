"""Paired, interleaved blocks in the same processes, written once (``benchmarks.paired``, ``benchmarks.fsdp``).

Identical replicas of a job (same seed, same batches) live in the same rank processes; each is an :class:`Arm`:
the replica plus what it does after each step and at the end of its block. They take turns in blocks of ``k``
steps, the order of a round taken from a rotating list of orders (A B, B A, ... or all permutations of three),
so that drift of a shared machine cancels. Each block is timed in wall time and in the training thread's CPU
time (``time.thread_time``), its end (a flush, waiting for a save) included. Every round gives one paired
difference per arm against the reference arm (:func:`overheads`, with the estimators of
:mod:`benchmarks.report`).

Runs in the forked rank processes (:func:`run_block`, :func:`warm_up`, :func:`run_blocks`) and in the
orchestrator (:func:`overheads`).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks import harness, jobs, report


def parser(prog: str, doc: str, *, world: str, block_steps: int, warmup: int, warmup_help: str,
           runtime: str) -> argparse.ArgumentParser:
    """Orchestrator: the options every block benchmark takes (the job, its ranks, the blocks, threads, the runtime
    and its private Ray, the timeout, the output folder); ``world``, ``warmup_help``, ``runtime``: help texts."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="gpt:10m:4", help="kind:size:batch[:lr] (see benchmarks.run --help)")
    p.add_argument("--world", type=int, default=2, help=world)
    p.add_argument("--block-steps", type=int, default=block_steps, help="steps per block")
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--threads", type=int, help="torch threads per rank (default: max(1, cores // world))")
    p.add_argument("--runtime", choices=["local", "ray"], default="local", help=runtime)
    p.add_argument("--object-store-mb", type=int, default=1024, help="the private Ray's object store (--runtime ray)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per cell, seconds")
    p.add_argument("--out", default=harness.RESULTS)
    return p


@dataclass
class Arm:
    """One replica of the job in a rank process and what it does around its steps."""

    job: Any                                         # a :class:`benchmarks.jobs.Job` (batches, loss)
    net: Any                                         # what the forward pass goes through (DDP, an FSDP2 model)
    opt: Any
    sched: Any
    after_step: Callable[[int], None] | None = None  # training thread, after each step (the step count)
    end: Callable[[], None] | None = None            # the block's end, timed inside the block (flush, wait)
    keep: tuple[str, ...] = ()                       # extra block fields to record: "steps_s", "flush_s"


def start(rank: int, cell: dict, rounds: int) -> tuple[jobs.JobSpec, int]:
    """Rank process: torch's threads and the cell's process group; the job and its steps in all (the warm-up and
    ``rounds`` blocks)."""
    import torch
    torch.set_num_threads(cell["threads"])
    harness.init_process_group(cell, rank)
    return jobs.JobSpec(**cell["job"]), cell["warmup"] + rounds * cell["block_steps"]


def run_block(arm: Arm, first: int, n: int, rank: int, device) -> dict:
    """Train ``arm`` for steps ``first .. first + n - 1`` and end its block. Returns the block's wall time ``s``,
    the training thread's CPU ``cpu_s``, the per-step wall times ``steps_s`` and the end's share ``flush_s``."""
    t0, c0 = time.perf_counter(), time.thread_time()
    steps = []
    for step in range(first, first + n):
        ts = time.perf_counter()
        arm.job.train_step(arm.net, arm.opt, arm.sched, step, rank, device)
        if arm.after_step is not None:
            arm.after_step(step + 1)
        steps.append(time.perf_counter() - ts)
    tf = time.perf_counter()
    if arm.end is not None:
        arm.end()
    t1 = time.perf_counter()
    return {"s": t1 - t0, "cpu_s": time.thread_time() - c0, "steps_s": steps, "flush_s": t1 - tf}


def warm_up(arms: dict[str, Arm], steps: int, rank: int, device) -> None:
    """The unmeasured first ``steps`` steps of every arm, one after the other (in ``arms``' order)."""
    for arm in arms.values():
        run_block(arm, 0, steps, rank, device)


def run_blocks(arms: dict[str, Arm], orders: list[tuple[str, ...]], rounds: int, first: int, k: int, rank: int,
               device, fulls: Callable[[], int] | None = None) -> list[dict]:
    """``rounds`` rounds of one block of ``k`` steps per arm, from step ``first``; round ``i`` runs the arms in
    ``orders[i % len(orders)]``. Barriers before and after. Per round: ``<arm>_s``, ``<arm>_cpu_s`` and the arm's
    ``keep`` fields, ``order``, and ``full``: whether the counter ``fulls`` (full checkpoints taken) grew."""
    import torch.distributed as dist
    blocks = []
    dist.barrier()
    for i in range(rounds):
        start = first + i * k
        fulls0 = fulls() if fulls is not None else 0
        order = orders[i % len(orders)]
        res = {name: run_block(arms[name], start, k, rank, device) for name in order}
        block = {}
        for name, arm in arms.items():
            for key in ("s", "cpu_s") + arm.keep:
                block[f"{name}_{key}"] = res[name][key]
        block["order"] = "".join(order)
        block["full"] = bool(fulls is not None and fulls() > fulls0)
        blocks.append(block)
    dist.barrier()
    return blocks


def overheads(blocks: list[dict], arm: str, ref: str, stratified: bool) -> dict:
    """Orchestrator: the paired overheads of ``arm`` against ``ref`` (%, per block pair), in wall time (``wall_*``)
    and in the training thread's CPU (``thread_cpu_*``): ``<basis>_pairs_pct``, ``<basis>_overhead_pct`` and
    ``<basis>_ci95_pct`` (:func:`benchmarks.report.overhead_fields`; with ``stratified``, the blocks holding a
    full checkpoint are the rare stratum)."""
    out = {}
    rare = [b["full"] for b in blocks] if stratified else None
    for basis, suffix in (("wall", "_s"), ("thread_cpu", "_cpu_s")):
        d = [100 * (b[arm + suffix] / b[ref + suffix] - 1) for b in blocks]
        out.update({f"{basis}_{k}": v for k, v in report.overhead_fields(d, rare).items()})
    return out
