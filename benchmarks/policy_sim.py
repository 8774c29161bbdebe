"""Adaptive checkpoint policy vs fixed intervals vs Young/Daly, simulated against failure traces.

Runs on the driver machine (CLI): ``python -m benchmarks.policy_sim [--quick]``. Writes
``benchmarks/results/policy_sim.{md,json,png}``.

1. **Storage profiles**, measured here by :func:`measure_storage` (per-request latency and bandwidth from
   ``seconds = latency + bytes/bandwidth`` fitted over writes of 4 KiB and 32 MiB objects, and the read
   bandwidth of the large one): this machine's local disk and a moto S3 server on loopback; plus a documented
   slow remote profile (100 ms per request, 50 MB/s: an object store in another region over a shared link;
   an assumption, not a measurement).
2. **Training-side costs** of the model the README's benchmarks use (byte-level GPT, 10.9M parameters, AdamW,
   CPU): step 1.0 s, full checkpoint = model + AdamW moments = 131 MB, host snapshot 1.2% of a step, top-k 1%
   diff (int32 index + fp32 value) 0.87 MB per step (figures from shared/design/RAY_NOTES.md, measured on this
   machine); replay time per step measured here by :func:`measure_replay` (AdamW step on 10.9M parameters from
   a 1% sparse gradient); restart 7 s (Ray Train worker SIGKILL to resumed training, RAY_NOTES.md);
   background cost k = 0.25 (share of persistence-tier time that slows training on shared cores: an
   assumption, RAY_NOTES.md measured 8-18% step slow-down from a background writer).
3. **Failure traces**: exponential (MTBF 1 h, 6 h, 24 h) and the bursty Llama 3 trace
   (:func:`ray_ckpt.policy.simulate.llama3_bursty_trace`: 419 unexpected interruptions in 54 days, mean one
   per 3.09 h, the clustering of non-GPU causes is our assumption).
4. **Policies**: adaptive (``PolicyTuner``: knows the costs, learns the MTBF online from a 24 h prior,
   re-decides at every restart and at most hourly); fixed ``full_every`` 10 / 100 / 1000 with
   ``batch_steps=10`` (the default); Young/Daly (Daly's interval from the full's cost and the trace's *true*
   MTBF, an oracle, ``batch_steps=10``).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import report
from ray_ckpt.policy.adaptive import young_daly_full_every
from ray_ckpt.policy.cost import BandwidthFit, CostInputs
from ray_ckpt.policy.simulate import (adaptive_chooser, exponential_trace, fixed_chooser, llama3_bursty_trace,
                                      simulate)

RESULTS = Path(__file__).resolve().parent / "results"
STEP_S = 1.0
FULL_BYTES = 131e6
DIFF_BYTES = 872e3
SNAPSHOT_S = 0.012 * STEP_S
RESTART_S = 7.0
BACKGROUND = 0.25
SLOW_REMOTE = {"latency_s": 0.100, "write_bw": 50e6, "read_bw": 50e6}


def measure_storage(storage, reps: int = 4) -> dict:
    """Latency and bandwidth of ``storage`` (write fit) and its read bandwidth on a 32 MiB object."""
    fit = BandwidthFit(0.0, 1e9, forget=1.0)
    small, big = os.urandom(4096), os.urandom(32 << 20)
    for i in range(reps):
        for j, data in enumerate((small, big)):
            t0 = time.perf_counter()
            storage.write(f"probe/{i}-{j}", data)
            fit.add(len(data), time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(2):
        storage.read("probe/0-1")
    read_bw = 2 * len(big) / (time.perf_counter() - t0)
    for i in range(reps):
        for j in range(2):
            storage.delete(f"probe/{i}-{j}")
    lat, bw = fit.latency_and_bandwidth()
    return {"latency_s": lat, "write_bw": bw, "read_bw": read_bw}


def measure_replay(num_params: int = 10_900_000, density: float = 0.01, reps: int = 5) -> float:
    """Seconds per replayed step: an AdamW step on ``num_params`` parameters from a ``density`` sparse grad."""
    import torch

    p = torch.nn.Parameter(torch.zeros(num_params))
    opt = torch.optim.AdamW([p], lr=1e-3)
    k = int(num_params * density)
    times = []
    for _ in range(reps + 1):
        idx = torch.randint(0, num_params, (k,))
        t0 = time.perf_counter()
        g = torch.zeros(num_params)
        g[idx] = torch.randn(k)
        p.grad = g
        opt.step()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_moto() -> dict:
    """Start a moto S3 server on loopback (stopped by PID afterwards) and measure it."""
    from ray_ckpt.storage import open_storage
    import pyarrow.fs as pafs

    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_EC2_METADATA_DISABLED": "true"}
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        opts = dict(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="testing",
                    secret_key="testing", region="us-east-1")
        for _ in range(100):
            try:
                pafs.S3FileSystem(allow_bucket_creation=True, **opts).create_dir("policy-sim")
                break
            except OSError:
                time.sleep(0.1)
        return measure_storage(open_storage("s3://policy-sim/run", **opts))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def cost_inputs(storage: dict, replay_s: float) -> CostInputs:
    lat, bw = storage["latency_s"], storage["write_bw"]
    return CostInputs(step_s=STEP_S, full_block_s=SNAPSHOT_S, full_persist_s=lat + FULL_BYTES / bw,
                      diff_bytes=DIFF_BYTES, full_bytes=FULL_BYTES, write_latency_s=lat, write_bw=bw,
                      replay_s=replay_s, load_s=lat + FULL_BYTES / storage["read_bw"], restart_s=RESTART_S,
                      mtbf_s=86400.0, background_cost=BACKGROUND)


def traces(days: float, seed: int) -> dict:
    h = days * 86400.0
    out = {f"exponential MTBF {m} h": (exponential_trace(m * 3600.0, h, seed=seed), m * 3600.0)
           for m in (1, 6, 24)}
    tr = llama3_bursty_trace(h, seed=seed)
    out["Llama 3 bursty (3.1 h)"] = (tr, h / max(1, len(tr)))
    return out


def run(days: float, seed: int, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        from ray_ckpt.storage import open_storage
        local = measure_storage(open_storage(d))
    moto = measure_moto()
    replay_s = measure_replay(reps=2 if quick else 5)
    profiles = {"local disk": local, "moto S3 (loopback)": moto, "slow remote (documented)": SLOW_REMOTE}
    rows = []
    for pname, prof in profiles.items():
        c = cost_inputs(prof, replay_s)
        for tname, (trace, true_mtbf) in traces(days, seed).items():
            horizon = days * 86400.0
            ct = CostInputs(**{**c.to_dict(), "mtbf_s": true_mtbf})
            yd = young_daly_full_every(ct)
            policies = {"adaptive": adaptive_chooser(c, trace, mtbf_hint=86400.0),
                        "fixed 10": fixed_chooser(10, 10), "fixed 100": fixed_chooser(100, 10),
                        "fixed 1000": fixed_chooser(1000, 10), "Young/Daly": fixed_chooser(yd, 10)}
            for pol, chooser in policies.items():
                r = simulate(trace, horizon, c, chooser)
                rows.append({"profile": pname, "trace": tname, "policy": pol, "failures": r.failures,
                             "lost_s_per_hour": r.lost_s_per_hour(STEP_S),
                             "gb_written_per_day": r.bytes_written / 1e9 / (r.wall_s / 86400.0),
                             "fulls": r.fulls, "diff_objects": r.diff_objects,
                             "young_daly_full_every": yd})
    return {"profiles": profiles, "replay_s": replay_s, "days": days, "seed": seed, "rows": rows,
            "constants": {"step_s": STEP_S, "full_bytes": FULL_BYTES, "diff_bytes": DIFF_BYTES,
                          "snapshot_s": SNAPSHOT_S, "restart_s": RESTART_S, "background_cost": BACKGROUND}}


POLICIES = ["adaptive", "fixed 10", "fixed 100", "fixed 1000", "Young/Daly"]


def markdown(res: dict) -> str:
    pols = POLICIES
    lines = ["# Adaptive checkpoint policy: simulated lost time and bytes written", "",
             f"Generated by `python -m benchmarks.policy_sim` ({res['days']:g} simulated days per cell, seed "
             f"{res['seed']}). Cells: **lost seconds per hour** (checkpoint overhead + failures) / GB written per "
             f"day. Lower is better. Model: 10.9M-parameter GPT, 1.0 s steps, 131 MB full, 0.87 MB top-k diff "
             f"per step, replay {res['replay_s'] * 1e3:.0f} ms/step (measured), restart {RESTART_S:g} s.", "",
             "Storage profiles: " + "; ".join(
                 f"{k}: {v['latency_s'] * 1e3:.1f} ms/request, write {v['write_bw'] / 1e6:.0f} MB/s, read "
                 f"{v['read_bw'] / 1e6:.0f} MB/s" for k, v in res["profiles"].items()) + ".", ""]
    for pname in res["profiles"]:
        lines += [f"## {pname}", "", "| trace | failures | " + " | ".join(pols) + " | Young/Daly N |",
                  "|---|---:|" + "---:|" * len(pols) + "---:|"]
        for tname in dict.fromkeys(r["trace"] for r in res["rows"]):
            cell = {r["policy"]: r for r in res["rows"] if r["profile"] == pname and r["trace"] == tname}
            best = min(cell[p]["lost_s_per_hour"] for p in pols)
            vals = []
            for p in pols:
                v = f"{cell[p]['lost_s_per_hour']:.1f} / {cell[p]['gb_written_per_day']:.0f}"
                vals.append(f"**{v}**" if cell[p]["lost_s_per_hour"] == best else v)
            lines.append(f"| {tname} | {cell['adaptive']['failures']} | " + " | ".join(vals)
                         + f" | {cell['adaptive']['young_daly_full_every']} |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    pols = POLICIES
    try:
        plt = report.pyplot()
    except ImportError:
        return
    profs = list(res["profiles"])
    tr_names = list(dict.fromkeys(r["trace"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(profs), figsize=(5 * len(profs), 4), sharey=False)
    for ax, pname in zip(axes, profs):
        w = 0.16
        for i, p in enumerate(pols):
            ys = [next(r["lost_s_per_hour"] for r in res["rows"] if r["profile"] == pname and r["trace"] == t
                       and r["policy"] == p) for t in tr_names]
            ax.bar([j + (i - 2) * w for j in range(len(tr_names))], ys, w, label=p)
        ax.set_xticks(range(len(tr_names)), [t.replace(" MTBF", "\nMTBF").replace(" bursty", "\nbursty")
                                             for t in tr_names], fontsize=7)
        ax.set_yscale("log")
        ax.set_title(pname)
        ax.set_ylabel("lost s per hour (log)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    report.save_figure(fig, path)


def write_outputs(res: dict) -> None:
    report.write_result(str(RESULTS / "policy_sim"), res, markdown, plot)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    res = run(10.0 if a.quick else a.days, a.seed, a.quick)
    write_outputs(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
