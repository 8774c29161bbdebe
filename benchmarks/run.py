"""Benchmark harness: ray_ckpt against the checkpointing users have today, side by side.

    .venv/bin/python -m benchmarks.run --mode quick|full [--out benchmarks/results]
    .venv/bin/python -m benchmarks.run --smoke                       # CI smoke test (< 90 s)

Every configuration (:mod:`benchmarks.configs`) trains the same job (same seed, same batches) in ``world``
data-parallel processes (DDP; gloo on CPU, nccl on CUDA). Configurations run *interleaved*: round 1 runs
A B C ..., round 2 the same list rotated by one, ..., so drift of a shared machine hits every configuration
alike. Each segment is a fresh pair of processes forked from this one (cheap: torch is already imported here,
and nothing here touches torch compute or Ray, so the fork is clean). The Ray Train baseline runs in one
``TorchTrainer.fit()`` per job with its own reference inside (see :mod:`benchmarks.raytrain`).

Then, for every configuration that checkpoints, one more segment is killed (SIGKILL of rank 0) right after a
random step R, a fresh process restores the latest state, and ``steps lost = R - restored step``.

Outputs (``--out``): ``bench_<mode>.json`` (raw samples + summary), ``bench_<mode>.md`` (tables, date, machine),
``bench_<mode>.png`` (overhead and bytes per step per configuration).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time

from benchmarks import configs, harness, jobs, segments, worker

MODES = {
    # CI smoke test: every configuration, one tiny job, one round, a few steps
    "smoke": dict(jobs=["gpt:tiny:4"], rounds=1, steps=8, warmup=2, recover_repeats=1, fail_trials=1),
    # quick: both jobs, small sizes (< ~3 min on 2 cores)
    "quick": dict(jobs=["gpt:tiny:8", "cnn:tiny:16"], rounds=2, steps=12, warmup=3, recover_repeats=2,
                  fail_trials=1),
    # fast steps: Ray Train's Fashion-MNIST MLP at ~100 steps/s, where per-step fixed cost shows;
    # many short interleaved rounds so that the paired-round confidence interval is tight enough to judge
    "fast": dict(jobs=["mlp:fmnist:32:0.001"], rounds=6, steps=150, warmup=30, recover_repeats=1, fail_trials=0,
                 configs=["none", "torch_save_1", "dcp_async", "lowdiff_dense", "lowdiff_dense_ray",
                          "lowdiff_dense_ray_fulls", "topk_none", "lowdiff_topk", "lowdiff_topk_ray"]),
    # full: GPT ~10.9M params and the small CNN
    "full": dict(jobs=["gpt:10m:4", "cnn:small:32"], rounds=3, steps=10, warmup=2, recover_repeats=3,
                 fail_trials=1),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(MODES), default="quick")
    p.add_argument("--smoke", action="store_true", help="same as --mode smoke")
    p.add_argument("--out", default=harness.RESULTS)
    p.add_argument("--jobs", nargs="+", type=harness.parse_job, help="kind:size:batch[:lr] (gpt presets: tiny "
                   "small 10m 25m; cnn sizes: tiny small base); default per mode")
    p.add_argument("--configs", nargs="+", help=f"subset of {[c.name for c in configs.CONFIGS]} (references "
                   "are added automatically)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int, help="measured steps per segment")
    p.add_argument("--warmup", type=int, help="unmeasured steps at the start of each segment")
    p.add_argument("--world", type=int, default=2, help="data-parallel processes")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores // world)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--full-every", type=int, help="LowDiff/Amber full checkpoint period (default: --steps, "
                   "so each segment holds exactly one in-loop full)")
    p.add_argument("--batch-steps", type=int, help="LowDiff/Amber steps per diff object (default: ray_ckpt's)")
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--raytrain-poll-s", type=float, default=0.1,
                   help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for the Ray Train baseline (Ray's default: 2.0)")
    p.add_argument("--recover-repeats", type=int)
    p.add_argument("--fail-trials", type=int, help="crash-and-restore trials per configuration and job")
    p.add_argument("--fail-jobs", type=int, default=1, help="how many jobs (in order) get the crash trials")
    p.add_argument("--object-store-mb", type=int, default=1536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-timeout", type=float, default=900.0)
    p.add_argument("--workdir", help="scratch directory (default: a fresh one under /tmp, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return p


def resolve(args) -> argparse.Namespace:
    if args.smoke:
        args.mode = "smoke"
    preset = MODES[args.mode]
    for k, v in preset.items():
        if getattr(args, k, None) is None:
            setattr(args, k, [harness.parse_job(j) for j in v] if k == "jobs" else v)
    args.threads = harness.threads_per_rank(args.threads, args.world)
    if args.full_every is None:
        args.full_every = args.steps  # one in-loop full per segment, inside the measured window
    if not args.warmup < args.full_every <= args.warmup + args.steps:
        print(f"[bench] note: full_every={args.full_every} puts no full checkpoint inside the measured steps "
              f"{args.warmup + 1}..{args.warmup + args.steps}", flush=True)
    if args.batch_steps is None:
        from ray_ckpt.config import CheckpointConfig
        args.batch_steps = CheckpointConfig().batch_steps
    wanted = args.configs or [c.name for c in configs.CONFIGS]
    for n in list(wanted):
        wanted.append(configs.get(n).reference)
    selected = [c for c in configs.CONFIGS if c.name in set(wanted)]
    args.skipped = {}
    if any(c.saver == "amber" for c in selected):
        import ray_ckpt
        if not hasattr(ray_ckpt, "Amber"):
            args.skipped["amber"] = "ray_ckpt.Amber does not exist in this ray_ckpt (skipped)"
            selected = [c for c in selected if c.saver != "amber"]
    args.selected = selected
    return args


# ------------------------------------------------------------------------------------------------------------
class Orchestrator:
    def __init__(self, args):
        self.args = args
        self.root = args.workdir or tempfile.mkdtemp(prefix="rcb", dir="/tmp")  # short: Ray socket paths
        os.makedirs(self.root, exist_ok=True)
        self.host = None   # the private Ray (harness.RayHost) when a configuration needs one
        self.segments: list[dict] = []
        self.failures: list[dict] = []
        self.errors: list[dict] = []
        self.counter = 0
        self.t_start = time.time()
        self.log = harness.logger("bench", self.t_start)

    # -- segments ------------------------------------------------------------------------------------------
    def seg_dict(self, job: jobs.JobSpec, cfg: configs.Config, rnd: int, **extra) -> dict:
        self.counter += 1
        d = os.path.join(self.root, f"s{self.counter:04d}")
        os.makedirs(d)
        a = self.args
        seg = {"dir": d, "job": job.to_dict(), "config": cfg.name, "round": rnd, "world": a.world,
               "threads": a.threads, "device": a.device, "steps": a.steps, "warmup": a.warmup, "seed": a.seed,
               "full_every": a.full_every, "batch_steps": a.batch_steps, "topk_ratio": a.topk_ratio,
               "bucket_cap_mb": a.bucket_cap_mb, "recover_repeats": a.recover_repeats,
               "run": f"bench-{os.path.basename(self.root)}-{self.counter}", "repo": harness.REPO,
               "ray_address": self.host.address if self.host else None, "rounds": a.rounds,
               "raytrain_poll_s": a.raytrain_poll_s}
        seg.update(extra)
        return seg

    def run_segment(self, job, cfg, rnd, keep: bool = True) -> None:
        # recovery is timed in the first round only (repeated recover_repeats times there)
        seg = self.seg_dict(job, cfg, rnd, measure_recovery=keep and rnd == 0)
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        procs = [harness.spawn(worker.segment_main, (r, seg)) for r in range(self.args.world)]
        finished = harness.reap(procs, self.args.segment_timeout)
        ranks, errs = harness.rank_results(seg["dir"], self.args.world)
        if not finished or any(r is None for r in ranks):
            err = {"job": job.name, "config": cfg.name, "round": rnd, "timed_out": not finished, "errors": errs}
            self.errors.append(err)
            self.log(f"  {job.name} {cfg.name} round {rnd}: FAILED {json.dumps(err)[:2000]}")
        elif not keep:
            self.log(f"  {job.name:10s} settle segment ({cfg.name}) done in {time.perf_counter() - t0:.1f} s")
        else:
            r0 = ranks[0]
            self.segments.append({"job": job.name, "config": cfg.name, "round": rnd, "launcher": "mp",
                                  "ranks": ranks, "loadavg": [load0, os.getloadavg()[0]]})
            med = sorted(r0["step_s"])[len(r0["step_s"]) // 2]
            ph = " ".join(f"{k} {v:.1f}" for k, v in r0.get("phase_s", {}).items())
            self.log(f"  {job.name:10s} r{rnd} {cfg.name:17s} median step {med * 1e3:8.1f} ms  "
                     f"drain {r0['drain_s']:.2f} s  ({time.perf_counter() - t0:.1f} s: {ph})")
        shutil.rmtree(seg["dir"], ignore_errors=True)

    def run_raytrain(self, job) -> None:
        seg = self.seg_dict(job, configs.get("raytrain_report"), -1)
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        p = harness.spawn(__import__("benchmarks.raytrain", fromlist=["driver_main"]).driver_main, (seg,))
        harness.reap([p], self.args.segment_timeout * max(1, self.args.rounds))
        drv = harness.read_json(os.path.join(seg["dir"], "raytrain_driver.json")) or {"error": "driver did not report"}
        ranks = [harness.read_json(os.path.join(seg["dir"], f"raytrain_rank{r}.json")) for r in range(self.args.world)]
        if drv.get("error") or any(r is None for r in ranks):
            self.errors.append({"job": job.name, "config": "raytrain", "driver": drv})
            self.log(f"  {job.name} Ray Train: FAILED {json.dumps(drv)[:2000]}")
        else:
            for i, s0 in enumerate(ranks[0]["segments"]):
                per_rank = []
                for r in ranks:
                    s = dict(r["segments"][i])
                    s["peak_rss"] = s["peak_rss_train"] = r["peak_rss"]
                    per_rank.append(s)
                self.segments.append({"job": job.name, "config": s0["config"], "round": s0["round"],
                                      "launcher": "raytrain", "ranks": per_rank, "fit_s": drv.get("fit_s"),
                                      "loadavg": [load0, os.getloadavg()[0]]})
            self.log(f"  {job.name} Ray Train fit: {drv.get('fit_s', 0):.1f} s "
                     f"({time.perf_counter() - t0:.1f} s with start-up)")
        shutil.rmtree(seg["dir"], ignore_errors=True)

    def run_failure(self, job, cfg, trial, rng) -> None:
        a = self.args
        fail_at = rng.randint(a.warmup + 1, a.warmup + a.steps)
        seg = self.seg_dict(job, cfg, -1, fail_at=fail_at, recover_repeats=1)
        procs = [harness.spawn(worker.segment_main, (r, seg)) for r in range(a.world)]
        procs[0].join(a.segment_timeout)
        for p in procs:  # rank 0 killed itself at fail_at; the others wait on it forever: end them
            if p.is_alive():
                p.kill()
            p.join(10)
        reached = harness.read_json(os.path.join(seg["dir"], "reached.json"))
        rec = None
        if reached is not None:
            p = harness.spawn(worker.recover_main, (seg,))
            harness.reap([p], a.segment_timeout)
            rec = harness.read_json(os.path.join(seg["dir"], "recovered.json"))
        if reached is None or rec is None or rec.get("error"):
            _, errs = harness.rank_results(seg["dir"], a.world)
            self.errors.append({"job": job.name, "config": cfg.name, "failure_trial": trial, "reached": reached,
                                "recovered": rec, "errors": errs})
            self.log(f"  {job.name} {cfg.name} crash test: FAILED reached={reached} rec={rec} "
                     f"{json.dumps(errs)[:1500]}")
        else:
            lost = reached["reached"] - rec["restored"]
            self.failures.append({"job": job.name, "config": cfg.name, "trial": trial, "fail_at": fail_at,
                                  "reached": reached["reached"], "restored": rec["restored"], "lost": lost,
                                  "recover_s": rec["recover_s"]})
            self.log(f"  {job.name:10s} crash {cfg.name:17s} at step {reached['reached']:3d}: restored "
                     f"{rec['restored']:3d}, lost {lost} (restore {rec['recover_s']:.2f} s)")
        shutil.rmtree(seg["dir"], ignore_errors=True)

    # -- the whole run ------------------------------------------------------------------------------------------
    def run_job(self, job, mp_cfgs, rt: bool) -> None:
        """One job: a settle segment, the interleaved rounds, Ray Train's fit, the crash trials."""
        a = self.args
        self.log(f"job {job.name} (batch {job.batch}/rank): {len(mp_cfgs)} configurations x {a.rounds} "
                 f"rounds x ({a.warmup}+{a.steps}) steps")
        jobs.preload(job)  # read once here; the forked segments share it
        self.run_segment(job, mp_cfgs[0], -1, keep=False)  # discarded: lets the machine settle
        for rnd in range(a.rounds):
            k = rnd % len(mp_cfgs)
            for cfg in mp_cfgs[k:] + mp_cfgs[:k]:
                self.run_segment(job, cfg, rnd)
        if rt:
            self.run_raytrain(job)
        rng = random.Random(f"{a.seed}-{job.name}")
        for trial in range(a.fail_trials if a.jobs.index(job) < a.fail_jobs else 0):
            for cfg in a.selected:
                if cfg.fail_test and cfg.launcher == "mp":
                    self.run_failure(job, cfg, trial, rng)

    def run(self) -> dict:
        a = self.args
        mp_cfgs = [c for c in a.selected if c.launcher == "mp"]
        rt = any(c.launcher == "raytrain" for c in a.selected)
        try:
            with contextlib.ExitStack() as stack:
                if rt or any(c.ray for c in a.selected):
                    self.log("starting a private Ray cluster")
                    # Ray's socket paths must stay under 108 characters: its temp dir is short, whatever --workdir is
                    ray_tmp = tempfile.mkdtemp(prefix="rcr", dir="/tmp")
                    stack.callback(shutil.rmtree, ray_tmp, ignore_errors=True)
                    self.host = stack.enter_context(harness.private_ray(ray_tmp, 2 * a.world + 2, a.object_store_mb))
                    self.log(f"Ray at {self.host.address}")
                for job in a.jobs:
                    self.run_job(job, mp_cfgs, rt)
        finally:
            if not a.keep:
                shutil.rmtree(self.root, ignore_errors=True)
        return {"segments": self.segments, "failures": self.failures, "errors": self.errors,
                "wall_s": time.time() - self.t_start}


def settings(args) -> dict:
    return {"mode": args.mode, "jobs": [j.to_dict() for j in args.jobs], "configs": [c.name for c in args.selected],
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "world": args.world,
            "threads": args.threads, "device": args.device, "full_every": args.full_every,
            "batch_steps": args.batch_steps, "topk_ratio": args.topk_ratio, "bucket_cap_mb": args.bucket_cap_mb,
            "raytrain_poll_s": args.raytrain_poll_s, "recover_repeats": args.recover_repeats,
            "fail_trials": args.fail_trials, "fail_jobs": args.fail_jobs, "seed": args.seed, "skipped": args.skipped,
            "object_store_mb": args.object_store_mb}


def main(argv=None) -> int:
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (our Ray cluster, scratch dir)
    args = resolve(build_parser().parse_args(argv))
    harness.preimport()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private cluster; every process that joins agrees
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.makedirs(args.out, exist_ok=True)
    for name, why in args.skipped.items():
        print(f"[bench] {name}: {why}", flush=True)
    raw = Orchestrator(args).run()
    result = segments.build(raw, settings(args), configs.CONFIGS)
    paths = segments.write_all(result, args.out, args.mode)
    for p in paths:
        print(f"[bench] wrote {p}", flush=True)
    print(open(paths[1]).read() if len(paths) > 1 else "", flush=True)
    return 1 if raw["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
