"""What recording a step costs the training process, next to a copy of its bytes; and what handing over a full
costs it, next to ``torch.save``.

    .venv/bin/python -m benchmarks.handoff [--quick] [--sizes 2.7 13 44 topk] [--runtimes local ray]
                                           [--rounds N] [--block N] [--out benchmarks/results] [--name handoff]

Cells: per gradient size, dense MLPs 784-h-h-10 (SGD with momentum, batch 64, ``torch.set_num_threads(1)``) with
2.7 MB (h=512, Ray Train's Fashion-MNIST example), 12.9 MB (h=1440) and 44.0 MB (h=2944) of float32 gradients,
and ``topk``: the 2.7 MB model in DDP over a 1-rank gloo group with ray_ckpt's top-k hook (1 %), so only the kept
values and their positions are recorded; each for ``runtime="local"`` and ``runtime="ray"`` (a private one-node
Ray started inside the cell's process). Every cell runs in a process of its own; see
:mod:`benchmarks.handoff_cell` for what one measures (two replicas, paired ABBA rounds of checkpointed and
plain blocks, the copy floors, the fulls).

The summary, per cell: the mean over rounds, with a bootstrap 95 % interval (:func:`benchmarks.budget.mean_ci`),
of the extra CPU per recorded step of the whole process (the background work a checkpointed block leaves for the
plain block counted as checkpointing's; the naive block difference beside it) and of the training thread; where
the process's extra CPU went, by thread; the copy floors (cache-hot, rotating over 16 buffers) and the ratio
extra / copy for both; the issue's target ``2 x copy + 0.2 ms`` (with the rotating copy, and with the hot one):
``met`` when the interval of the per-round margin ``extra - target`` is below 0, ``missed`` when above,
``undecided`` when it straddles 0. Fulls (dense cells): the training thread's blocking wall time and CPU of a full
taken through the capture and handed to the sink, the process's CPU until the sink has handed it over (written
with ``runtime="local"``, answered by the node's worker with ``runtime="ray"``: the sender thread's CPU
included), against ``torch.save`` of the same state to a local file (and its fsync), with ratios.

Outputs: ``<name>.json`` (every cell's raw per-round figures, the summaries, load averages, git commit, date),
``<name>.md`` (the tables, also printed) and ``<name>.png``. ``--quick``: the 2.7 MB model, both runtimes, 4
short rounds (the smoke test's; ~1-2 min).
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
from benchmarks import report

#: the issue's target: the extra CPU of a recorded step at most 2 x the copy of its bytes + 0.2 ms
TARGET_FACTOR, TARGET_ADD_S = 2.0, 0.2e-3
#: per size: steps per block, rounds, copies per floor measurement, fulls
DEFAULTS = {"2.7": (100, 10, 64, 6), "13": (40, 8, 32, 4), "44": (16, 8, 16, 3), "topk": (50, 10, 64, 0)}
SIZES = list(DEFAULTS)


def _cells(args) -> list[dict]:
    out = []
    for size in args.sizes:
        block, rounds, copy_reps, full_reps = DEFAULTS[size]
        if args.quick:
            block, rounds, copy_reps, full_reps = 40, 4, 16, 2 if full_reps else 0
        for runtime in args.runtimes:
            out.append({"size": size, "runtime": runtime, "block": args.block or block,
                        "rounds": args.rounds or rounds, "copy_reps": copy_reps, "full_reps": full_reps,
                        "warm_steps": 100 if args.quick else 300, "warm_s": 2.0 if args.quick else 5.0,
                        "warm_max_s": 20.0 if args.quick else 60.0,
                        "object_store_mb": 2048})
    return out


def _run_cell(cell: dict, tmp: str) -> dict:
    """Run one cell in a process of its own (``--child``) and read its result."""
    d = tempfile.mkdtemp(prefix=f"{cell['size']}-{cell['runtime']}-", dir=tmp)
    cell = dict(cell, dir=d, result=os.path.join(d, "result.json"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [harness.REPO, os.environ.get("PYTHONPATH")] if p)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    short = None
    if cell["runtime"] == "ray":
        short = tempfile.mkdtemp(prefix="ho-", dir="/tmp")   # AF_UNIX socket paths: at most 107 bytes
        os.makedirs(os.path.join(short, "ray"))
        env["RAY_TMPDIR"] = cell["ray_tmp"] = short
    path = os.path.join(d, "cell.json")
    with open(path, "w") as f:
        json.dump(cell, f)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.handoff", "--child", path], env=env,
                                cwd=harness.REPO)
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()   # our own child, by its handle
            proc.wait(30)
        res = harness.read_json(cell["result"]) or {"error": f"no result (exit code {proc.returncode})"}
    finally:
        if short:
            shutil.rmtree(short, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
    res.update(size=cell["size"], runtime=cell["runtime"], wall_s=time.monotonic() - t0,
               settings={k: cell[k] for k in ("block", "rounds", "copy_reps", "full_reps", "warm_steps", "warm_s",
                                                        "warm_max_s")})
    return res


# ------------------------------------------------------------------------------------------------------------
# the summary
# ------------------------------------------------------------------------------------------------------------
def _ci(xs: list) -> list:
    from benchmarks.budget import mean_ci
    return list(mean_ci(xs))


def _verdict(ci: list) -> str:
    """``met`` / ``missed`` / ``undecided``: the interval of a margin ``[mean, lo, hi]`` below 0, above it, or
    across it."""
    v = report.ci_verdict(ci[1:], 0.0)
    return "undecided" if v == "inconclusive" else v


def summarize(res: dict) -> dict:
    """The summary of one cell's raw rounds and fulls (seconds; ratios)."""
    rounds = res["rounds"]
    s: dict = {k: _ci([r[k] for r in rounds]) for k in
               ("extra_s", "extra_naive_s", "extra_thread_s", "copy_hot_s", "copy_rot_s")}
    s["plain_step_s"] = statistics.fmean(r["plain"]["wall_s"] / r["steps"] for r in rounds)
    s["ck_step_s"] = statistics.fmean(r["ck"]["wall_s"] / r["steps"] for r in rounds)
    for floor in ("hot", "rot"):
        s[f"ratio_{floor}"] = _ci([r["extra_s"] / r[f"copy_{floor}_s"] for r in rounds])
        s[f"thread_ratio_{floor}"] = _ci([r["extra_thread_s"] / r[f"copy_{floor}_s"] for r in rounds])
        margin = _ci([r["extra_s"] - (TARGET_FACTOR * r[f"copy_{floor}_s"] + TARGET_ADD_S) for r in rounds])
        s[f"target_{floor}"] = {"target_s": TARGET_FACTOR * s[f"copy_{floor}_s"][0] + TARGET_ADD_S,
                                "margin_s": margin, "verdict": _verdict(margin)}
    names = {k for r in rounds for k in r["threads"]}
    s["threads"] = dict(sorted(((k, statistics.fmean(r["threads"].get(k, 0.0) for r in rounds)) for k in names),
                               key=lambda kv: -abs(kv[1])))
    fulls = res.get("fulls") or []
    if fulls:
        f = {k: _ci([x[k] for x in fulls]) for k in ("ck_block_wall_s", "ck_block_thread_s", "ck_process_s",
                                                      "ck_wall_s", "save_cpu_s", "save_wall_s",
                                                      "save_fsync_wall_s")}
        f["cpu_ratio"] = _ci([x["ck_process_s"] / x["save_cpu_s"] for x in fulls])
        f["block_wall_ratio"] = _ci([x["ck_block_wall_s"] / x["save_wall_s"] for x in fulls])
        f["full_bytes"], f["save_bytes"] = fulls[0]["ck_full_bytes"], fulls[0]["save_bytes"]
        f["reps"] = len(fulls)
        s["fulls"] = f
    return s


# ------------------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------------------
def _ms(ci, spec=".2f") -> str:
    return "–" if not ci else f"{1e3 * ci[0]:{spec}} [{1e3 * ci[1]:{spec}}, {1e3 * ci[2]:{spec}}]"


def _x(ci) -> str:
    return "–" if not ci else f"{ci[0]:.1f} [{ci[1]:.1f}, {ci[2]:.1f}]"


def _label(c: dict) -> str:
    return f"{'top-k 1 % (2.7 MB)' if c['size'] == 'topk' else c['size'] + ' MB'} {c['runtime']}"


def markdown(result: dict) -> str:
    cells = [c for c in result["cells"] if "summary" in c]
    lines = [f"# What recording a step costs the training process ({result['date']})", "",
             f"`{result['command']}` at {result['git_commit']}; {result['machine']['cores']} cores "
             f"({result['machine']['cpu']}), load average {_load(result['loadavg_start'])} at the start, "
             f"{_load(result['loadavg_end'])} at the end (a shared machine). Every step recorded "
             "(`overhead_budget=0`, other knobs at their defaults). ms per recorded step: the mean over paired "
             "rounds [bootstrap 95 % interval]. *extra process*: the process's CPU (a checkpointed block's "
             "background work left for the plain block counted as checkpointing's; *naive*: the blocks' "
             "difference); *copy hot / rotating*: `torch._foreach_copy_` of the recorded bytes into the same "
             "buffers / 16 buffers in turn; *target* `2 x copy + 0.2 ms`, verdict from the interval of the "
             "per-round margin.", "",
             "| cell | recorded B/step | plain step | extra process | naive | extra training thread | copy hot | "
             "copy rotating | extra / hot | extra / rotating | target (rot.) | verdict | target (hot) | verdict |",
             "|---|---:|---:|---|---|---|---|---|---|---|---:|---|---:|---|"]
    for c in cells:
        s = c["summary"]
        lines.append(
            f"| {_label(c)} | {report.nbytes(c['record_bytes_per_step'])} | {1e3 * s['plain_step_s']:.2f} | "
            f"{_ms(s['extra_s'])} | {_ms(s['extra_naive_s'])} | {_ms(s['extra_thread_s'])} | "
            f"{_ms(s['copy_hot_s'], '.3f')} | {_ms(s['copy_rot_s'], '.3f')} | {_x(s['ratio_hot'])} | "
            f"{_x(s['ratio_rot'])} | {1e3 * s['target_rot']['target_s']:.2f} | {s['target_rot']['verdict']} | "
            f"{1e3 * s['target_hot']['target_s']:.2f} | {s['target_hot']['verdict']} |")
    lines += ["", "Where the extra process CPU went (ms per recorded step, mean over rounds; the training thread "
              "and the threads that existed before the Checkpointer: paired difference; the threads born with "
              "it: all their CPU):", ""]
    for c in cells:
        th = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in c["summary"]["threads"].items() if abs(v) >= 5e-6)
        lines.append(f"- {_label(c)} ({c['fulls_in_rounds']} trainer fulls in the rounds, batch_steps "
                     f"{c['batch_steps']}): {th}")
    fulls = [c for c in cells if "fulls" in c["summary"]]
    if fulls:
        lines += ["", "Fulls (model + optimizer state), ms: a full through the capture (`snapshot_now` + the sink's "
                  "`submit`: what it blocks the training thread, wall and its CPU; *process CPU until handed "
                  "over*: from `snapshot_now` until the sink has written it (`local`) or the node's worker has "
                  "answered its hand-off (`ray`), every thread) vs `torch.save` of the same state to a local "
                  "file (wall = CPU, the training thread; fsync after it). Ratios per interleaved pair.", "",
                  "| cell | full | blocks training thread (wall) | its CPU | process CPU until handed over | "
                  "torch.save CPU | torch.save wall | + fsync wall | CPU ratio | blocking wall ratio |",
                  "|---|---:|---|---|---|---|---|---|---|---|"]
        for c in fulls:
            f = c["summary"]["fulls"]
            lines.append(f"| {_label(c)} | {report.nbytes(f['full_bytes'])} | {_ms(f['ck_block_wall_s'], '.1f')} | "
                         f"{_ms(f['ck_block_thread_s'], '.1f')} | {_ms(f['ck_process_s'], '.1f')} | "
                         f"{_ms(f['save_cpu_s'], '.1f')} | {_ms(f['save_wall_s'], '.1f')} | "
                         f"{_ms(f['save_fsync_wall_s'], '.1f')} | {_x2(f['cpu_ratio'])} | "
                         f"{_x2(f['block_wall_ratio'])} |")
    errors = [f"{_label(c)}: {c['error']}" for c in result["cells"] if "error" in c]
    return "\n".join(lines + ([""] + [f"- error: {e}" for e in errors] if errors else [])) + "\n"


def _x2(ci) -> str:
    return "–" if not ci else f"{ci[0]:.2f} [{ci[1]:.2f}, {ci[2]:.2f}]"


def _load(x) -> str:
    return "/".join(f"{v:.1f}" for v in x) if x else "–"


def plot(result: dict, path: str) -> None:
    """Per size, bars of the extra CPU per recorded step (process, training thread) with their intervals next to
    the copy floors, and the target line; below, fulls through the capture vs torch.save."""
    plt = report.pyplot()
    cells = [c for c in result["cells"] if "summary" in c]
    if not cells:
        return
    sizes = list(dict.fromkeys(c["size"] for c in cells))
    fulls = [c for c in cells if "fulls" in c["summary"]]
    fig = plt.figure(figsize=(max(7.0, 3.6 * len(sizes) + 1), 7.5 if fulls else 4.0))
    grid = fig.add_gridspec(2 if fulls else 1, len(sizes))
    bars = [("extra_s", "extra, process"), ("extra_thread_s", "extra, training thread"),
            ("copy_hot_s", "copy (hot)"), ("copy_rot_s", "copy (rotating)")]
    for j, size in enumerate(sizes):
        ax = fig.add_subplot(grid[0, j])
        mine = [c for c in cells if c["size"] == size]
        w = 0.8 / len(bars)
        for i, c in enumerate(mine):
            s = c["summary"]
            for k, (key, lbl) in enumerate(bars):
                v = [1e3 * x for x in s[key]]
                ax.bar(i + (k - 1.5) * w, v[0], w, yerr=[[v[0] - v[1]], [v[2] - v[0]]], capsize=3,
                       color=f"C{k}", label=lbl if i == 0 else None)
            ax.hlines(1e3 * s["target_rot"]["target_s"], i - 0.45, i + 0.45, colors="k", linestyles="--",
                      label="2 x copy (rot.) + 0.2 ms" if i == 0 else None)
        ax.set_xticks(range(len(mine)), [c["runtime"] for c in mine])
        ax.set_title(_label(mine[0]).rsplit(" ", 1)[0], fontsize=9)
        ax.set_ylabel("ms per recorded step (95 % CI)" if j == 0 else "")
        if j == 0:
            ax.legend(fontsize=7)
    if fulls:
        ax = fig.add_subplot(grid[1, :])
        keys = [("ck_block_wall_s", "full: blocks training thread"), ("ck_process_s", "full: process CPU, handed over"),
                ("save_cpu_s", "torch.save CPU"), ("save_fsync_wall_s", "torch.save + fsync wall")]
        w = 0.8 / len(keys)
        for i, c in enumerate(fulls):
            f = c["summary"]["fulls"]
            for k, (key, lbl) in enumerate(keys):
                v = [1e3 * x for x in f[key]]
                ax.bar(i + (k - 1.5) * w, v[0], w, yerr=[[v[0] - v[1]], [v[2] - v[0]]], capsize=3,
                       color=f"C{k + 4}", label=lbl if i == 0 else None)
        ax.set_xticks(range(len(fulls)), [_label(c) for c in fulls], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms per full (95 % CI)")
        ax.legend(fontsize=7)
    fig.suptitle(f"recording a step vs copying its bytes ({result['date'][:16]}, {result['git_commit']})", fontsize=10)
    fig.tight_layout()
    report.save_figure(fig, path)


# ------------------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------------------
def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=harness.REPO, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=harness.REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="the 2.7 MB model, both runtimes, 4 short rounds")
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=None, help="default: all (--quick: 2.7)")
    p.add_argument("--runtimes", nargs="+", choices=["local", "ray"], default=["local", "ray"])
    p.add_argument("--rounds", type=int, default=None, help="paired rounds per cell (default: per size)")
    p.add_argument("--block", type=int, default=None, help="steps per block (default: per size)")
    p.add_argument("--out", default=harness.RESULTS)
    p.add_argument("--name", default="handoff", help="basename of the outputs")
    args = p.parse_args(argv)
    if args.child:
        from benchmarks import handoff_cell
        return handoff_cell.child_main(args.child)
    args.sizes = args.sizes or (["2.7"] if args.quick else SIZES)
    log = harness.logger("handoff")
    result = {"date": report.now(), "git_commit": _git_commit(), "loadavg_start": os.getloadavg(),
              "command": "python -m benchmarks.handoff " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": vars(args), "target": f"extra <= {TARGET_FACTOR:g} x copy + {1e3 * TARGET_ADD_S:g} ms",
              "cells": []}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        for cell in _cells(args):
            log(f"{_label(cell)}: {cell['rounds']} rounds x {cell['block']} steps")
            res = _run_cell(cell, tmp)
            if "error" in res:
                log(f"{_label(cell)} failed: {res['error']}\n{res.get('traceback', '')}")
            else:
                res["summary"] = s = summarize(res)
                log(f"{_label(cell)}: extra {_ms(s['extra_s'], '.3f')} ms/step (training thread "
                    f"{_ms(s['extra_thread_s'], '.3f')}), copy hot {1e3 * s['copy_hot_s'][0]:.3f} rotating "
                    f"{1e3 * s['copy_rot_s'][0]:.3f} ms; target (rot.) {s['target_rot']['verdict']}; "
                    f"{res['wall_s']:.0f} s")
            result["cells"].append(res)
    result.update(loadavg_end=os.getloadavg(), wall_s=time.monotonic() - t0, machine=report.machine_info("cpu"))
    base = os.path.join(args.out, args.name)
    paths = report.write_result(base, result, markdown=markdown, plot=plot)
    log(f"wrote {', '.join(paths)} ({result['wall_s']:.0f} s)")
    return 0 if all("error" not in c for c in result["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
