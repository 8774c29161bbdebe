"""Paired, interleaved measurement of LowDiff's overhead, fine enough to resolve 1% of a step.

    .venv/bin/python -m benchmarks.paired                      # make bench-paired: GPT 10.9M, 2 ranks, ~12 min
    .venv/bin/python -m benchmarks.paired --scaling            # make bench-scaling: 10M/40M/100M x 1/2/4 workers
    .venv/bin/python -m benchmarks.paired --help

Why blocks in the same processes (:mod:`benchmarks.blocks`): :mod:`benchmarks.run` compares configurations in
separate processes, one after the other; on a shared 2-core machine two such segments differ by several percent
for reasons that have nothing to do with checkpointing, so a 1% overhead stays invisible. Here the *same processes* train two identical replicas of the
job — same seed, same batches, each with its own DDP over the same process group and the same top-k hook — and
alternate between them in blocks of ``block_steps`` steps (order A B, B A, A B, ...: linear drift cancels):

* **A** has a ``ray_ckpt.Checkpointer`` (LowDiff, ``runtime="local"``) attached on rank 0, at the library's
  default policy unless ``--full-every`` / ``--batch-steps`` pin it;
* **B** is the same training without checkpointing (the reference).

Each A block ends with ``flush()`` timed as part of the block: background encoding and writing that has not
finished when the block ends is waited for and counted, instead of spilling into the next (B) block — the
figure is an upper bound of the amortized cost (flush also closes the partial diff batch early). Each pair of
neighbouring A/B blocks gives one paired difference, in wall time and in the training thread's CPU time
(``time.thread_time`` of rank 0's training thread: the critical path, least disturbed by other work).

Estimator (:func:`benchmarks.report.stratified_overhead_ci`): blocks that hold a full checkpoint are rare
(one per ``full_every`` steps) and much slower, so the pairs are split in two strata; overhead = (1 - w) x
median(pairs without a full) + w x mean(pairs with a full), ``w`` their share; 95% CI by bootstrap (resampling
within each stratum). The median is robust to a block disturbed by other work; the full blocks enter by their
mean, so their amortized cost is not hidden by the median.

Per cell it also reports bytes persisted per step (diffs, and with fulls amortized), the training thread's
capture time per step (``stats()["capture_seconds"]``), the cost of one full checkpoint, and the time to
restore the latest step from storage into a fresh model (``ray_ckpt.restore``, median of 3).

Outputs (``--out``, default ``benchmarks/results/``): ``paired.json`` / ``.md`` / ``.png`` (or ``scaling.*``).
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

#: the scaling cells: model size at 2 workers, and worker count at 10M
SCALING = [("gpt:10m:4", 1), ("gpt:10m:4", 2), ("gpt:10m:4", 4), ("gpt:40m:2", 2), ("gpt:100m:1", 2)]


def build_parser() -> argparse.ArgumentParser:
    p = blocks.parser("python -m benchmarks.paired", __doc__, world="data-parallel processes", block_steps=10,
                      warmup=3, warmup_help="unmeasured steps of each replica first",
                      runtime="A's runtime: 'ray' starts a private one-node Ray (coordinator, node worker, replica)")
    p.add_argument("--scaling", action="store_true",
                   help=f"run the scaling cells {SCALING} (fewer blocks each; fulls every 30 steps)")
    p.add_argument("--blocks", type=int, help="A/B block pairs (default 30; 6 with --scaling)")
    p.add_argument("--full-every", type=int, help="pin the full period (default: the library's policy; 30 "
                   "with --scaling, so that every cell holds fulls)")
    p.add_argument("--batch-steps", type=int, help="pin steps per diff object (default: the library's policy)")
    p.add_argument("--hook", choices=["topk", "none"], default="topk", help="DDP hook of both replicas")
    p.add_argument("--strategies", nargs="+", choices=["lowdiff", "amber", "lowdiff-amber"], default=["lowdiff"],
                   help="A's checkpointing strategy; several: one cell each, one after the other, each paired "
                   "with its own reference blocks (LowDiff(); Amber() at its defaults: parameters within 2 %%, "
                   "moments lossless every 10 steps, computed in the training process; lowdiff-amber: LowDiff "
                   "with durable_diffs=Amber(), the same increments computed by the state tier's replica, "
                   "--runtime ray only)")
    p.add_argument("--wait-replica", action=argparse.BooleanOptionalAction, default=None,
                   help="--runtime ray: each A block ends when the state tier's replica has applied its last step "
                   "(the replica's CPU counted to A, not to the next B block; default on with --runtime ray)")
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rebuild", metavar="JSON", help="recompute the summary, md and png from a result file's raw "
                   "blocks (no training)")
    return p


# ------------------------------------------------------------------------------------------------------------
# one rank of one cell (a forked process)
# ------------------------------------------------------------------------------------------------------------
def _replica(cell: dict, device, spec: jobs.JobSpec, total: int) -> blocks.Arm:
    from benchmarks.worker import make_ddp
    job = jobs.build(spec, device, seed=cell["seed"])
    ddp = make_ddp(job.model, device, bucket_cap_mb=25.0, hook=cell["hook"], topk_ratio=cell["topk_ratio"])
    opt = jobs.make_optimizer(job.model, spec.lr, spec.kind)
    return blocks.Arm(job, ddp, opt, jobs.make_scheduler(opt, total=total), keep=("steps_s",))


def _wait_replica(ck, timeout: float = 60.0) -> None:
    """Until the state tier's replica has applied A's last step (runtime="ray"): its work (an optimizer step per
    training step, and with durable_diffs="amber" the selection pass) is counted to A's block instead of
    spilling into the next B block. Polls the replica's status (one actor call per 5 ms)."""
    import ray

    from ray_ckpt.runtime import naming
    try:
        rep = ray.get_actor(naming.replica_name(ck.run), namespace=naming.NAMESPACE)
    except ValueError:
        return   # no replica in this run (a strategy that writes its own diffs, or replica=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ray.get(rep.status.remote())
        if not st.get("ok", True) or (st.get("step") is not None and st["step"] >= ck.step):
            return
        time.sleep(0.005)
    raise TimeoutError(f"the replica did not reach step {ck.step} within {timeout} s")


def _replica_counters(st: dict) -> dict:
    return (st.get("runtime") or {}).get("replica") or {}


def _drop_exact_records(uri: str) -> None:
    """Delete the main lineage's step records (and its index) from a local checkpoint directory: what storage holds
    when a LowDiff+ run's memory tier is lost before its records were written (benchmark of the Amber tier)."""
    from ray_ckpt.engine.lineage_io import load_lineage
    from ray_ckpt.lineage.layout import INDEX_KEY
    from ray_ckpt.storage import open_storage
    storage = open_storage(uri)
    for m in load_lineage(storage, use_index=False)[0].manifests:
        if m.kind == "diff":
            storage.delete(m.key)
            storage.delete(m.object)
    if storage.exists(INDEX_KEY):
        storage.delete(INDEX_KEY)


def _checkpointer(rank: int, cell: dict, a: blocks.Arm):
    """Rank 0: A's ``Checkpointer`` (its strategy, the pinned policy knobs, runtime "local" or the private Ray);
    its attach-time full written. None on the other ranks."""
    import ray_ckpt
    if rank != 0:
        return None
    pinned = {kk: cell[kk] for kk in ("full_every", "batch_steps") if cell.get(kk)}
    if cell.get("strategy") == "lowdiff-amber":
        pinned["durable_diffs"] = ray_ckpt.Amber()
    rt = {"runtime": "local"}
    if cell.get("ray_address"):
        harness.connect_ray(cell["ray_address"])
        rt = {"runtime": "ray", "run": f"paired-{cell.get('strategy', 'lowdiff')}"}
    strategy = ray_ckpt.Amber() if cell.get("strategy") == "amber" else ray_ckpt.LowDiff()
    ck = ray_ckpt.Checkpointer(_uri(cell), a.net, a.opt, scheduler=a.sched, strategy=strategy, **rt, **pinned)
    ck.flush()
    return ck


def _uri(cell: dict) -> str:
    return os.path.join(cell["dir"], "ckpt")


def _cell(rank: int, cell: dict, out: dict) -> None:
    """One rank of one cell (a forked process): replicas A and B, A's checkpointer on rank 0, the blocks; on
    rank 0 also A's counters and the restores."""
    import torch
    import torch.distributed as dist
    spec, total = blocks.start(rank, cell, cell["blocks"])
    k, nb, w = cell["block_steps"], cell["blocks"], cell["warmup"]
    dev = torch.device("cpu")
    a = _replica(cell, dev, spec, total)
    b = _replica(cell, dev, spec, total)
    ck = _checkpointer(rank, cell, a)
    if ck is not None:
        a.keep += ("flush_s",)

        def end():
            ck.flush()
            if cell.get("wait_replica"):
                _wait_replica(ck)
        a.end = end
    arms = {"a": a, "b": b}
    blocks.warm_up(arms, w, rank, dev)
    st0 = ck.stats() if ck else {}
    out["blocks"] = blocks.run_blocks(arms, [("a", "b"), ("b", "a")], nb, w, k, rank, dev,
                                      fulls=(lambda: ck.stats()["trainer_fulls"]) if ck else None)
    for bl in out["blocks"]:
        bl["first"] = bl.pop("order")[0]
    if ck is not None:
        out.update(_counters(st0, ck.stats(), nb * k), policy=ck.policy_report())
        ck.close()
        _restores(cell, spec, total, a, out)
    out["param_count"] = sum(p.numel() for p in a.job.model.parameters())
    out["wait_replica"] = bool(cell.get("wait_replica"))
    out["full_ckpt_bytes"] = jobs.full_state_bytes(a.job.model, a.opt)
    dist.barrier()


def _counters(st0: dict, st: dict, steps: int) -> dict:
    """What A's checkpointer did over the measured ``steps`` (``Checkpointer.stats()`` before and after)."""
    r1, r0 = _replica_counters(st), _replica_counters(st0)
    n_full = st["trainer_fulls"] - st0["trainer_fulls"]
    out = dict(
        diff_bytes_per_step=(st["diff_bytes"] - st0["diff_bytes"]) / steps,
        full_bytes_per_step=(st["full_bytes"] - st0["full_bytes"]) / steps,
        bytes_per_full=(st["full_bytes"] - st0["full_bytes"]) / n_full if n_full else None,
        capture_ms_per_step=1e3 * (st["capture_seconds"] - st0["capture_seconds"]) / steps,
        encode_ms_per_step=1e3 * (st.get("encode_seconds", 0.0) - st0.get("encode_seconds", 0.0)) / steps,
        # runtime="ray": the sender thread's CPU (encoding, checksum, hand-off), the training process's
        # background work; the writer thread of runtime="local" is not timed
        sender_cpu_ms_per_step=(1e3 * ((st.get("runtime") or {}).get("sender_cpu_seconds", 0.0)
                                       - (st0.get("runtime") or {}).get("sender_cpu_seconds", 0.0)) / steps
                                if st.get("runtime") else None),
        fulls=n_full,
        replica_fulls=(r1.get("fulls_written", 0) - r0.get("fulls_written", 0)) if st.get("runtime") else None,
        amber_early_fulls=(st["amber"]["early_fulls"] - st0["amber"]["early_fulls"]) if "amber" in st else None)
    if "apply_seconds" in r1:
        # the replica's wall time (perf_counter, under its lock) per training step (apply, fulls and Amber
        # included) and Amber's share
        out["replica_apply_ms_per_step"] = 1e3 * (r1["apply_seconds"] - r0.get("apply_seconds", 0.0)) / steps
        out["replica_amber_ms_per_step"] = 1e3 * (r1.get("amber_seconds", 0.0) - r0.get("amber_seconds", 0.0)) / steps
        n_inc = r1.get("amber_increments", 0) - r0.get("amber_increments", 0)
        if n_inc:
            out["amber_increments"] = n_inc
            out["amber_bytes_per_increment"] = (r1["amber_bytes_written"] - r0.get("amber_bytes_written", 0)) / n_inc
    return out


def _restores(cell: dict, spec: jobs.JobSpec, total: int, a: blocks.Arm, out: dict) -> None:
    """Rank 0, A's checkpointer closed: restore the latest step into fresh objects (median of 3) and check it
    against replica A: bitwise (LowDiff), or within Amber's stated bound; with the Amber tier (lowdiff-amber) the
    same step again from that tier alone."""
    import torch

    import ray_ckpt
    uri, dev = _uri(cell), torch.device("cpu")

    def restore_latest():
        """Median of 3 restores of the latest step into fresh objects: seconds, step, the last restored job."""
        samples = []
        for _ in range(3):
            job = jobs.build(spec, dev, seed=99)
            opt = jobs.make_optimizer(job.model, spec.lr, spec.kind)
            sched = jobs.make_scheduler(opt, total=total)
            t0 = time.perf_counter()
            got = ray_ckpt.restore(uri, job.model, opt, scheduler=sched)
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[1], got, job

    def within(job, cfg) -> bool:
        """|restored - true| <= threshold * |restored| + atol for every parameter element (Amber's bound)."""
        return all(bool(((p.double() - q.double()).abs() <= cfg.threshold * p.double().abs() + cfg.atol).all())
                   for p, q in zip(job.model.parameters(), a.job.model.parameters()))

    out["restore_latest_s"], step, job = restore_latest()
    out["restored_step"] = step
    # exactness, while we are here: the restored replica is A's state bitwise (LowDiff), or within the
    # stated bound (Amber's defaults: atol 0)
    out["restore_bitwise"] = all(torch.equal(p, q) for p, q in zip(job.model.parameters(), a.job.model.parameters()))
    if cell.get("strategy") == "amber":
        out["restore_within_bound"] = within(job, ray_ckpt.Amber())
    if cell.get("strategy") == "lowdiff-amber":
        # the same latest step from the Amber tier alone (base full + the replica's increments): the exact
        # step records deleted from storage, as if both copies in memory were lost before they were written
        _drop_exact_records(uri)
        out["restore_tier_s"], tstep, job = restore_latest()
        out["restore_tier_step"] = tstep
        out["restore_tier_within_bound"] = tstep == step and within(job, ray_ckpt.Amber())


# ------------------------------------------------------------------------------------------------------------
def summarize(cell: dict, r0: dict) -> dict:
    bl_list = r0["blocks"]
    out = {"job": cell["job"], "world": cell["world"], "threads": cell["threads"], "blocks": len(bl_list),
           "block_steps": cell["block_steps"], "step_s_ref_median": report.median(
               [bl["b_s"] / cell["block_steps"] for bl in bl_list]),
           **{k: r0.get(k) for k in ("param_count", "full_ckpt_bytes", "diff_bytes_per_step", "full_bytes_per_step",
                                     "bytes_per_full", "capture_ms_per_step", "fulls", "restore_latest_s",
                                     "restored_step", "restore_bitwise", "restore_within_bound", "policy",
                                     "encode_ms_per_step", "sender_cpu_ms_per_step", "amber_early_fulls",
                                     "replica_fulls", "replica_apply_ms_per_step", "replica_amber_ms_per_step",
                                     "amber_increments", "amber_bytes_per_increment", "restore_tier_s",
                                     "restore_tier_step", "restore_tier_within_bound", "wait_replica")},
           "strategy": cell.get("strategy") or "lowdiff", "runtime": cell.get("runtime") or "local"}
    out.update(blocks.overheads(bl_list, "a", "b", stratified=True))
    # one full's cost as the checkpointer measured it (its cost model): the snapshot on the training thread and
    # the encode + write in the background; and how much of that a block's flush still waited for
    est = ((r0.get("policy") or {}).get("estimates") or {})
    if est.get("full_block", {}).get("n"):
        out["full_snapshot_ms"] = 1e3 * est["full_block"]["mean"]
        out["full_persist_s"] = est["full_persist"]["mean"]
    fl = [bl["a_flush_s"] for bl in bl_list if bl["full"] and "a_flush_s" in bl]
    if fl:
        out["full_flush_s"] = sum(fl) / len(fl)
    out["raw_blocks"] = bl_list
    bps = (r0.get("diff_bytes_per_step") or 0) + (r0.get("full_bytes_per_step") or 0)
    out["bytes_per_step"] = bps
    if r0.get("full_ckpt_bytes"):
        out["fraction_of_full"] = bps / r0["full_ckpt_bytes"]
    return out


def targets(cells: list[dict]) -> dict:
    """The targets on the main cell (the first): <= 1% judged on the CI's upper bound, and the CI no
    wider than +-0.5% of step time; bitwise restores everywhere."""
    t = {}
    c = cells[0]
    if c.get("strategy", "lowdiff") == "lowdiff" and c.get("hook", "topk") == "topk":
        for basis in ("wall", "thread_cpu"):
            ci = c.get(f"{basis}_ci95_pct")
            if ci is not None:
                t.update(report.lowdiff_overhead_targets(basis, c[f"{basis}_overhead_pct"], ci, c["blocks"]))
    lossless = [x for x in cells if x.get("strategy", "lowdiff") in ("lowdiff", "lowdiff-amber")]
    if lossless:
        t["restores_bitwise"] = {"cells": len(lossless),
                                 "verdict": "met" if all(x.get("restore_bitwise") for x in lossless) else "missed"}
    amber = [x for x in cells if x.get("strategy") == "amber"]
    if amber:
        t["amber_restores_within_bound"] = {
            "cells": len(amber), "verdict": "met" if all(x.get("restore_within_bound") for x in amber) else "missed"}
    tier = [x for x in cells if x.get("strategy") == "lowdiff-amber"]
    if tier:
        t["amber_tier_restores_within_bound"] = {
            "cells": len(tier), "verdict": "met" if all(x.get("restore_tier_within_bound") for x in tier) else "missed"}
    # Amber's overhead on the trainer <= LowDiff dense's + 1 point; the two cells have separate
    # intervals (each paired with its own reference), so: met when Amber's upper bound is below LowDiff's lower
    # bound + 1, missed when Amber's lower bound is above LowDiff's upper bound + 1, inconclusive otherwise
    dense = [x for x in lossless if x.get("hook") == "none" and x.get("strategy", "lowdiff") == "lowdiff"]
    for name, cand in (("amber", amber), ("amber_tier", tier)):
        if not (cand and dense):
            continue
        for basis in ("wall", "thread_cpu"):
            a_ci, l_ci = cand[0].get(f"{basis}_ci95_pct"), dense[0].get(f"{basis}_ci95_pct")
            if a_ci and l_ci:
                verdict = ("met" if a_ci[1] <= l_ci[0] + 1 else "missed" if a_ci[0] > l_ci[1] + 1
                           else "inconclusive")
                t[f"{name}_overhead_le_lowdiff_dense_plus_1pct_{basis}"] = {
                    "amber_pct": cand[0][f"{basis}_overhead_pct"], "amber_ci95_pct": a_ci,
                    "lowdiff_dense_pct": dense[0][f"{basis}_overhead_pct"], "lowdiff_dense_ci95_pct": l_ci,
                    "verdict": verdict}
    return t


def markdown(result: dict) -> str:
    m, st = result["machine"], result["settings"]
    lines = [f"# ray_ckpt paired benchmark{' — scaling' if st['scaling'] else ''}", "",
             f"- date: {result['date']}",
             f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('mem_gb', '?')} GB RAM; "
             f"torch {m.get('torch')}, ray_ckpt {m.get('ray_ckpt')}",
             f"- design: two identical replicas in the same processes, alternating blocks of {st['block_steps']} "
             f"steps (A B, B A, ...); A = {'/'.join(st.get('strategies') or ['lowdiff'])} ({st['hook']} hook, "
             f"runtime={st.get('runtime', 'local')!r}, rank 0) with "
             f"{'full_every=%s' % st['full_every'] if st['full_every'] else 'the default policy'}"
             f"{', batch_steps=%s' % st['batch_steps'] if st['batch_steps'] else ''}, each A block ends with a timed "
             f"flush(){' and the replica catching up with its last step' if st.get('wait_replica') else ''}; "
             "B = the same without checkpointing; per pair: A / B - 1",
             f"- wall time: {result['wall_s'] / 60:.1f} min", "",
             "| job | A | params | workers x threads | pairs | ref step ms | wall overhead | 95% CI "
             "| train-thread CPU overhead | 95% CI | full: snapshot ms / write s / waited s | hooks ms/step "
             "| sender CPU ms/step "
             "| bytes/step (diffs) "
             "| bytes/step (with fulls) | % of full | restore latest s | exact |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in result["cells"]:
        ci = c.get("wall_ci95_pct")
        tci = c.get("thread_cpu_ci95_pct")
        lines.append(
            f"| {c['job']['kind']}-{c['job']['size']} (batch {c['job']['batch']}) "
            f"| {c.get('strategy', 'lowdiff')}, {c.get('runtime', 'local')} "
            f"| {report.fmt((c.get('param_count') or 0) / 1e6, '.1f')}M | {c['world']} x {c['threads']} "
            f"| {c['blocks']} ({c.get('fulls', 0)} with a full) "
            f"| {report.fmt((c.get('step_s_ref_median') or 0) * 1e3, '.0f')} "
            f"| {report.pct(c.get('wall_overhead_pct'))} | {report.interval(ci, '+.2f')} "
            f"| {report.pct(c.get('thread_cpu_overhead_pct'))} | {report.interval(tci, '+.2f')} "
            f"| {report.fmt(c.get('full_snapshot_ms'), '.0f')} / {report.fmt(c.get('full_persist_s'), '.2f')} / "
            f"{report.fmt(c.get('full_flush_s'), '.2f')} | {report.fmt(c.get('capture_ms_per_step'), '.2f')} "
            f"| {report.fmt(c.get('sender_cpu_ms_per_step'), '.1f')} "
            f"| {report.nbytes(c.get('diff_bytes_per_step'))} | {report.nbytes(c.get('bytes_per_step'))} "
            f"| {report.fmt(100 * c['fraction_of_full'] if c.get('fraction_of_full') else None, '.2f')} "
            f"| {report.fmt(c.get('restore_latest_s'), '.3f')} | {_exact(c)} |")
    ray_cells = [c for c in result["cells"] if c.get("replica_apply_ms_per_step") is not None]
    if ray_cells:
        lines += ["", "The state tier's replica (runtime='ray'):", "",
                  "| A | replica, wall ms per training step in its apply (fulls and Amber included) | of which Amber selection + write | fulls "
                  "by the replica | Amber increments | bytes / increment (% of a full) | restore latest from the "
                  "Amber tier alone s | within bound |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for c in ray_cells:
            bpi = c.get("amber_bytes_per_increment")
            frac = f" ({100 * bpi / c['full_ckpt_bytes']:.1f} %)" if bpi and c.get("full_ckpt_bytes") else ""
            lines.append(
                f"| {c.get('strategy', 'lowdiff')} | {report.fmt(c.get('replica_apply_ms_per_step'), '.1f')} "
                f"| {report.fmt(c.get('replica_amber_ms_per_step'), '.1f')} | {c.get('replica_fulls')} "
                f"| {c.get('amber_increments') or '–'} | {report.nbytes(bpi) if bpi else '–'}{frac} "
                f"| {report.fmt(c.get('restore_tier_s'), '.3f')} "
                f"| {'–' if c.get('restore_tier_within_bound') is None else ('yes' if c['restore_tier_within_bound'] else 'NO')} |")
    lines += ["", "Targets (first row):", ""]
    lines += report.target_lines(result["targets"]) + report.error_lines(result["errors"])
    lines += ["", "Definitions: *overhead* = (1 - w) x median of the paired block differences without a full "
                  "checkpoint + w x their mean over the blocks holding one (w = their share), 95% CI by stratified "
                  "bootstrap (10,000 resamples); *wall* = block wall time incl. A's flush; *train-thread CPU* = "
                  "time.thread_time of rank 0's training thread over the block; *sender CPU* (runtime='ray') = "
                  "the CPU time of the training process's sender thread (encoding, checksum, hand-off to the node "
                  "worker) per measured step of A; *full* = one full checkpoint: the "
                  "snapshot on the training thread and the encode + write in the background (the checkpointer's own "
                  "cost model, mean), and what the flush at the end of a block holding a full still waited for; "
                  "*restore latest* = ray_ckpt.restore from storage "
                  "into a fresh model + optimizer, median of 3; *exact* = that restore equals replica A's "
                  "parameters (torch.equal: bitwise), or (Amber) every parameter element lies within the stated "
                  "bound |restored - true| <= threshold x |restored|."]
    return "\n".join(lines) + "\n"


def _exact(c: dict) -> str:
    if c.get("restore_bitwise"):
        return "bitwise"
    if c.get("restore_within_bound"):
        return "within bound"
    return "NO"


def plot(result: dict, path: str) -> None:
    plt = report.pyplot()
    cells = result["cells"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    names = [f"{c['job']['size']}\n{c['world']} workers" for c in cells]
    x = list(range(len(cells)))
    for ax, basis, title in ((axes[0], "wall", "wall"), (axes[1], "thread_cpu", "training-thread CPU")):
        v = [c.get(f"{basis}_overhead_pct") or 0.0 for c in cells]
        report.ci_bars(ax, v, [c.get(f"{basis}_ci95_pct") for c in cells], color="tab:green", alpha=0.75,
                       capsize=4)
        ax.axhline(1.0, color="tab:red", ls=":", lw=0.9, label="1% target")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xticks(x)
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel("overhead vs the same training without checkpointing, %")
        ax.set_title(f"LowDiff overhead ({title}), 95% CI")
        ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(x, [(c.get("capture_ms_per_step") or 0) for c in cells], "o-",
            label="ms/step in the checkpointer's hooks (training thread)")
    ax.plot(x, [1e3 * (c.get("restore_latest_s") or 0) for c in cells], "s-", label="restore latest, ms")
    ax.plot(x, [(c.get("bytes_per_step") or 0) / 1e6 for c in cells], "^-", label="MB persisted per step")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(names, fontsize=8)
    ax.set_title("how the costs grow")
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_figure(fig, path)


# ------------------------------------------------------------------------------------------------------------
def run_cell(spec: jobs.JobSpec, world: int, args, workdir: str, log, strategy: str = "lowdiff",
             ray_address: str | None = None) -> tuple[dict | None, dict | None]:
    d = tempfile.mkdtemp(prefix=f"{spec.name}-w{world}-", dir=workdir)
    cell = {"dir": d, "job": spec.to_dict(), "world": world, "threads": harness.threads_per_rank(args.threads, world),
            "blocks": args.blocks, "block_steps": args.block_steps, "warmup": args.warmup, "hook": args.hook,
            "topk_ratio": args.topk_ratio, "seed": args.seed, "full_every": args.full_every,
            "batch_steps": args.batch_steps, "strategy": strategy, "runtime": args.runtime,
            "ray_address": ray_address, "wait_replica": bool(args.wait_replica)}
    jobs.preload(spec)
    t0 = time.perf_counter()
    res = harness.run_ranks(_cell, cell, args.timeout)
    shutil.rmtree(d, ignore_errors=True)
    errs = [x for x in res if "error" in x]
    if errs:
        log(f"{spec.name} x{world} {strategy}: FAILED {json.dumps(errs)[:1500]}")
        return None, {"job": spec.name, "world": world, "strategy": strategy, "errors": errs}
    s = summarize(cell, res[0])
    s["hook"] = args.hook
    log(f"{spec.name} x{world} {strategy}: {len(res[0]['blocks'])} pairs in {time.perf_counter() - t0:.0f} s; wall "
        f"{s.get('wall_overhead_pct', float('nan')):+.2f}% {s.get('wall_ci95_pct')}, thread CPU "
        f"{s.get('thread_cpu_overhead_pct', float('nan')):+.2f}% {s.get('thread_cpu_ci95_pct')}")
    return s, None


def write(result: dict, base: str) -> None:
    report.write_result(base, result, markdown, plot if result["cells"] else None)


def rebuild(path: str) -> None:
    """Re-summarize a result file from the raw blocks it holds and rewrite its md and png."""
    with open(path) as f:
        result = json.load(f)
    cells = []
    for c in result["cells"]:
        r0 = {**c, "blocks": c["raw_blocks"]}
        s = summarize({k: c.get(k) for k in ("job", "world", "threads", "block_steps", "strategy", "runtime")}, r0)
        s["hook"] = c.get("hook") or result["settings"].get("hook", "topk")
        cells.append(s)
    result["cells"] = cells
    result["targets"] = targets(cells) if cells else {}
    write(result, os.path.splitext(path)[0])


def resolve(args) -> list[tuple[jobs.JobSpec, int]]:
    """Fill in the defaults that depend on other options; the cells ``(job, world)`` to run."""
    if args.blocks is None:
        args.blocks = 6 if args.scaling else 30
    if "lowdiff-amber" in args.strategies and args.runtime != "ray":
        raise SystemExit("--strategies lowdiff-amber (durable_diffs=Amber(), computed by the state tier's replica) "
                         "needs --runtime ray")
    if args.wait_replica is None:
        args.wait_replica = args.runtime == "ray"
    if args.scaling and args.full_every is None:
        args.full_every = 30
    for name in ("blocks", "block_steps", "world"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return ([(harness.parse_job(j), w) for j, w in SCALING] if args.scaling
            else [(harness.parse_job(args.job), args.world)])


def result_name(args) -> str:
    """``paired`` / ``scaling``, with the strategies, ``_dense`` (no hook) and ``_ray`` where they differ."""
    name = "scaling" if args.scaling else "paired"
    if args.strategies != ["lowdiff"] or args.hook != "topk":
        name += "_" + "_".join(args.strategies) + ("_dense" if args.hook == "none" else "")
    if args.runtime == "ray":
        name += "_ray"
    return name


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.rebuild:
        rebuild(args.rebuild)
        return 0
    cells = resolve(args)
    harness.preimport()
    workdir = tempfile.mkdtemp(prefix="ray_ckpt_paired_")
    log = harness.logger("paired")
    t0 = time.perf_counter()
    out, errors = [], []
    try:
        with contextlib.ExitStack() as stack:
            ray_address = None
            if args.runtime == "ray":
                ray_address = stack.enter_context(harness.private_ray(
                    os.path.join(workdir, "rayhost"), max(cells[0][1], 1) + 2, args.object_store_mb)).address
            for spec, world in cells:
                for strategy in args.strategies:
                    log(f"{spec.name} batch {spec.batch}/rank x{world} workers, {strategy} ({args.runtime}): "
                        f"{args.blocks} block pairs of {args.block_steps} steps")
                    s, err = run_cell(spec, world, args, workdir, log, strategy, ray_address)
                    if s is not None:
                        out.append(s)
                    if err is not None:
                        errors.append(err)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    settings = {k: getattr(args, k) for k in ("scaling", "blocks", "block_steps", "warmup", "full_every",
                                              "batch_steps", "hook", "topk_ratio", "seed", "strategies", "runtime",
                                              "wait_replica")}
    result = {"date": report.now(), "machine": report.machine_info("cpu"), "settings": settings, "cells": out,
              "errors": errors, "wall_s": time.perf_counter() - t0, "targets": targets(out) if out else {}}
    write(result, os.path.join(args.out, result_name(args)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
