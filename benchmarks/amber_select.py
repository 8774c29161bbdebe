"""Amber's selection pass against the machine's memory bandwidth.

    .venv/bin/python -m benchmarks.amber_select [--size 10m] [--repeats 7] [--out benchmarks/results]

Trains the GPT example (``--size``, AdamW) for a few steps, then times, on one thread (the writer thread's
situation), over the tracked state of one step (parameters + AdamW moments, the state Amber compares):

* **copy** — ``dst.copy_(src)`` of every tracked tensor into preallocated buffers: the memcpy bound (reads and
  writes each byte once, like the selection pass must at least read it);
* **mask** — :func:`ray_ckpt.format.delta.significant` alone, with the parameters' threshold on every tensor
  (the comparison with the saved values);
* **encode** — :meth:`AmberEncoder.encode_step`, the whole writer-side pass as the pipeline runs it: the mask,
  the selected elements gathered and encoded, the saved values updated. Three situations, each from a fresh
  encoder per repeat so that each repeat does the same work: the first step after a full (every saved value
  is the full's; the masks of what changed since the full are built), a step in a chain (one increment since
  the full; the moments, wholly changed already, need no mask any more), and a step in a chain without the
  moments (``optimizer_every`` > 1: on 9 of 10 steps by default the moments are not compared) — with their
  average per step over the ``optimizer_every`` schedule.

Throughput = tracked-state bytes read / seconds (median of ``--repeats``); the ratio to a copy of the same
bytes is the figure the goal (within 4x of memcpy) is read on. Configurations: ``Amber()``
(parameters at 2%, sparse encoding; AdamW moments lossless, XOR + zstd) and ``Amber(threshold=0)`` (all
lossless). Writes
``amber_select.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks import jobs, report
from ray_ckpt.config import Amber
from ray_ckpt.engine.amber import AmberEncoder
from ray_ckpt.format.delta import AmberRecord, significant


def tracked(model, opt) -> dict:
    snap = {}
    params = list(model.parameters())
    for i, p in enumerate(params):
        snap[("p", i, None)] = p.detach().clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                snap[("o", i, k)] = v.detach().clone()
    return snap


def median_time(fn, repeats: int, setup=None) -> float:
    out = []
    for _ in range(repeats):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        fn(arg)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="training steps before the measured pair")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = jobs.JobSpec("gpt", args.size, args.batch)
    job = jobs.build(spec, torch.device("cpu"))
    opt = jobs.make_optimizer(job.model, spec.lr)
    snaps = []
    for step in range(args.steps + 1):
        if step >= args.steps - 1:
            snaps.append(tracked(job.model, opt))   # the state before the last two training steps ...
        x, y = job.batch(step, 0, "cpu")
        opt.zero_grad(set_to_none=True)
        job.loss(job.model, x, y).backward()
        opt.step()
    cur = tracked(job.model, opt)
    before, prev = snaps                               # ... and before the last one
    nbytes = sum(t.numel() * t.element_size() for t in cur.values())
    dst = {k: torch.empty_like(v) for k, v in cur.items()}

    def copy(_):
        for k, v in cur.items():
            dst[k].copy_(v)

    rows = [{"what": "copy (memcpy bound)", "seconds": median_time(copy, args.repeats)}]
    for thr in (0.02, 0.0):
        cfg = Amber(threshold=thr)       # default otherwise: AdamW moments lossless (XOR + zstd)

        def mask(_, thr=thr):
            for k, v in cur.items():
                significant(v, prev[k], thr)

        def fresh(cfg=cfg):              # the first step after a full: every saved value is the full's
            enc = AmberEncoder(cfg)
            enc.rebase(args.steps, {k: v.clone() for k, v in prev.items()})
            return enc

        def chained(cfg=cfg):            # a step in a chain: the full one step earlier, one increment since
            enc = AmberEncoder(cfg)
            enc.rebase(args.steps - 1, {k: v.clone() for k, v in before.items()})
            enc.encode_step(AmberRecord(step=args.steps, loop={}, buffers={}, snap=dict(prev)))
            return enc

        written = {}

        def encode(enc, only=None, tag=""):
            snap = {k: v for k, v in cur.items() if only is None or k[0] == only}
            out = enc.encode_step(AmberRecord(step=args.steps + 1, loop={}, buffers={}, snap=snap))
            written[tag] = (sum(d.count for d in out.deltas), sum(d.nbytes for d in out.deltas),
                            sum(v.numel() for v in snap.values()),
                            sum(v.numel() * v.element_size() for v in snap.values()))

        def row(what, seconds, tag):
            el, by, tracked_el, tracked_b = written[tag]
            return {"what": what, "seconds": seconds, "written_fraction": el / tracked_el, "increment_bytes": by,
                    "bytes": tracked_b}

        label = (f"parameters τ={thr:g}" + (" (lossless: XOR + zstd)" if thr == 0 else " (sparse)")
                 + ", moments lossless")
        rows.append({"what": f"mask alone, τ={thr:g} on every tensor", "seconds": median_time(mask, args.repeats)})
        rows.append(row(f"encode_step, Amber(threshold={thr:g}), first step after a full: {label}",
                        median_time(lambda e: encode(e, tag="first"), args.repeats, fresh), "first"))
        t_all = median_time(lambda e: encode(e, tag="all"), args.repeats, chained)
        rows.append(row(f"encode_step, Amber(threshold={thr:g}), a step in a chain: {label}", t_all, "all"))
        every = cfg.resolved_optimizer_every
        if every > 1:
            t_p = median_time(lambda e: encode(e, only="p", tag="p"), args.repeats, chained)
            rows.append(row(f"encode_step, Amber(threshold={thr:g}), a step in a chain without the moments "
                            f"({every - 1} of {every} steps: optimizer_every={every})", t_p, "p"))
            rows.append({"what": f"Amber(threshold={thr:g}) per step on average ({every - 1} without the moments, "
                                 f"1 with)", "seconds": ((every - 1) * t_p + t_all) / every,
                         "bytes": ((every - 1) * written["p"][3] + written["all"][3]) / every})
    base = rows[0]["seconds"]
    for r in rows:                       # each row against a copy of the bytes it reads (copy time scales)
        b = r.setdefault("bytes", nbytes)
        r["gb_per_s"] = b / r["seconds"] / 1e9
        r["x_copy"] = r["seconds"] / (base * b / nbytes)
    result = {"date": report.now(), "machine": report.machine_info("cpu"), "size": args.size, "tracked_bytes": nbytes,
              "tensors": len(cur), "repeats": args.repeats, "steps": args.steps, "rows": rows}
    report.write_result(os.path.join(args.out, "amber_select"), result, markdown)
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Amber selection pass vs memcpy — GPT {result['size']}", "",
             f"- date: {result['date']}; machine: {m.get('cpu')}, {m.get('cores')} cores; 1 thread; torch "
             f"{m.get('torch')}",
             f"- tracked state of one step: {result['tracked_bytes'] / 1e6:.1f} MB in {result['tensors']} tensors "
             f"(parameters + AdamW moments), after {result['steps']} training steps (a step where the moments are "
             f"compared: every `optimizer_every` steps); median of {result['repeats']}", "",
             "| pass | ms | MB read | GB/s | × copy of those bytes | elements written | increment |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        wf = r.get("written_fraction")
        lines.append(f"| {r['what']} | {1e3 * r['seconds']:.1f} | {r['bytes'] / 1e6:.1f} | {r['gb_per_s']:.2f} "
                     f"| {r['x_copy']:.2f} "
                     f"| {'' if wf is None else report.pct(100 * wf, '.2f')} "
                     f"| {'' if 'increment_bytes' not in r else '%.1f MB' % (r['increment_bytes'] / 1e6)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
