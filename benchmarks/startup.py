"""Where ``ray_ckpt.train.attach`` spends its seconds at start-up and after a restart, under Ray Train.

Ray Train ``TorchTrainer`` with 2 CPU workers trains the Fashion-MNIST quickstart's shape (a 784-512-512-10 MLP
with Dropout, SGD with momentum, batch 64 per worker, ``prepare_model``; synthetic data) with ray_ckpt attached
as the README says (``RayCkptCallback`` + ``ray_ckpt.train.attach``, defaults). Rank 1 raises once at
``--fail-at`` (0: never), so Ray Train restarts the worker group and every fit gives one fresh start-up and one
restart.
Every rank records, per attempt, the seconds of ``import ray_ckpt.train``, of ``attach`` and of each of its
phases (:attr:`ray_ckpt.train.TrainSession.startup`: the same figures as attach's INFO log line), and how long
after ``fit()`` its loop began (Ray Train's own worker-group start, for scale).

``--repeats`` fits, each a new run on a new private local Ray (``--nodes`` nodes of ``ray.cluster_utils.Cluster``,
2 CPUs each). The summary gives, per phase, the median over the fits and its 95% percentile-bootstrap interval
(with three fits or more). Writes ``<label>.json``, ``.md`` and ``.png`` to ``--out``. To compare two checkouts,
run it from each (Ray's workers import ray_ckpt from the driver's working directory), alternating, with
``--arm NAME --repeats 1``, then ``--combine`` the JSON files into one table.

    .venv/bin/python -m benchmarks.startup [--repeats 3] [--steps 40] [--fail-at 20] [--nodes 1] [--arm NAME]
    .venv/bin/python -m benchmarks.startup --combine A.json B.json ... [--out DIR] [--label NAME]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import tempfile
import time
import uuid

from benchmarks import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = 512
BATCH = 64


def train_loop(cfg: dict) -> None:
    """``train_loop_per_worker``: one attempt of one rank; writes ``attempt-<rank>-<pid>.json`` to ``cfg["out"]``."""
    entered = time.time()
    t = time.perf_counter()
    import ray_ckpt.train
    import_s = time.perf_counter() - t
    import ray.train
    import ray.train.torch
    import torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(HIDDEN, 10))
    net = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    t = time.perf_counter()
    session = ray_ckpt.train.attach(net, opt)
    attach_s = time.perf_counter() - t
    record = {"rank": rank, "pid": os.getpid(), "restored": session.restored, "start_step": session.start_step,
              "entered": entered, "import_s": import_s, "attach_s": attach_s, "phases": dict(getattr(session, "startup", {})),
              "params": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(cfg["out"], f"attempt-{rank}-{os.getpid()}.json"), "w") as f:
        json.dump(record, f)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(session.start_step, cfg["steps"]):
        marker = os.path.join(cfg["out"], "failed")
        if cfg["fail_at"] and step == cfg["fail_at"] and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"injected failure at step {step} (the benchmark's restart)")
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    session.close()


def fit(tmp: str, steps: int, fail_at: int) -> dict:
    """One ``TorchTrainer.fit()``: a fresh start-up and (at ``fail_at``) one restart. Driver."""
    import ray_ckpt.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out = tempfile.mkdtemp(prefix="out", dir=tmp)
    name = f"startup-{uuid.uuid4().hex[:8]}"
    trainer = TorchTrainer(
        train_loop, train_loop_config={"out": out, "steps": steps, "fail_at": fail_at},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=os.path.join(tmp, "ray_train"),
                             failure_config=FailureConfig(max_failures=1),
                             callbacks=[ray_ckpt.train.RayCkptCallback(os.path.join(tmp, name))]))
    t0 = time.time()
    result = trainer.fit()
    wall = time.time() - t0
    if result.error is not None:
        raise RuntimeError(f"fit failed: {result.error}")
    attempts = []
    for path in glob.glob(os.path.join(out, "attempt-*.json")):
        with open(path) as f:
            a = json.load(f)
        a["since_fit_s"] = a.pop("entered") - t0
        attempts.append(a)
    attempts.sort(key=lambda a: a["since_fit_s"])
    return {"run": name, "fit_s": wall, "attempts": attempts}


def summarize(fits: list[dict]) -> dict:
    """Per ``start``/``restart`` and rank: each figure's values over the fits, median and 95% interval."""
    out: dict = {}
    for f in fits:
        for a in f["attempts"]:
            kind = "restart" if a["restored"] else "start"
            cell = out.setdefault(f"{kind}_rank{a['rank']}", {})
            figures = {"attach_s": a["attach_s"], "import_s": a["import_s"], "since_fit_s": a["since_fit_s"],
                       **{f"phase.{k}": v for k, v in a["phases"].items()}}
            for k, v in figures.items():
                cell.setdefault(k, {"values": []})["values"].append(v)
    for cell in out.values():
        for fig in cell.values():
            est = report.paired_median_ci(fig["values"])
            fig["median"] = report.median(fig["values"])
            if est is not None:
                fig["ci95"] = list(est[1])
    return out


def _cell(fig: dict | None) -> str:
    if fig is None:
        return "–"
    ci = fig.get("ci95")
    return f"{fig['median']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# ray_ckpt.train.attach start-up — {meta['date']}, {meta['machine']}", "",
             f"Ray Train, 2 CPU workers on {meta['nodes']} node(s), MLP 784-512-512-10 ({meta['params']:,} "
             f"parameters), SGD momentum, defaults; up to {meta['repeats']} fits per arm, each a fresh "
             f"start and, where rank 1 fails once (at step {meta['fail_at']}; 0: never), a restart. Median over "
             "the fits [95% bootstrap "
             "interval], seconds. `phase.*`: the phases of `TrainSession.startup` (attach's INFO log line); "
             "`since_fit_s`: when the loop began after `fit()` (Ray Train's own start, for scale)."]
    for arm, summary in result["summary"].items():
        lines += ["", f"## {arm}", "", "| figure | " + " | ".join(summary) + " |",
                  "|---|" + "---:|" * len(summary)]
        names: list = []
        for cell in summary.values():
            names += [k for k in cell if k not in names]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(_cell(cell.get(name)) for cell in summary.values()) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """Stacked bars: attach's phases (median over the fits) per arm, start/restart and rank."""
    bars = [(f"{arm}\n{cell}", figs) for arm, summary in result["summary"].items() for cell, figs in summary.items()]
    phases: list = []
    for _, figs in bars:
        phases += [k for k in figs if k.startswith("phase.") and k != "phase.total"
                   and not k.startswith("phase.checkpointer.") and k not in phases]
    fig, ax = report.pyplot().subplots(figsize=(max(6, 1.3 * len(bars)), 4))
    bottoms = [0.0] * len(bars)
    for ph in phases:
        vals = [figs.get(ph, {}).get("median") or 0.0 for _, figs in bars]
        ax.bar(range(len(bars)), vals, bottom=bottoms, label=ph[len("phase."):])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    totals = [figs.get("attach_s", {}).get("median") or 0.0 for _, figs in bars]
    ax.plot(range(len(bars)), totals, "k_", markersize=18, label="attach (total)")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b for b, _ in bars], fontsize=7)
    ax.set_ylabel("seconds (median over fits)")
    ax.set_title("ray_ckpt.train.attach: where the seconds go")
    ax.legend(fontsize=7)
    fig.tight_layout()
    report.save_figure(fig, path)


def cluster_fit(tmp: str, nodes: int, steps: int, fail_at: int) -> dict:
    """One fit on a new private Ray cluster of ``nodes`` nodes. Its Ray processes import ray_ckpt as this
    process does: Ray puts the driver's working directory first on their ``sys.path``."""
    import ray
    from ray.cluster_utils import Cluster
    for attempt in range(3):   # a loaded machine can miss Ray's start-up deadlines (its agents start late)
        try:
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 2, "object_store_memory": 300 << 20, "temp_dir": os.path.join(tmp, "ray"),
                "include_dashboard": False})
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
            print(f"[startup] the cluster did not start ({e}); trying again", flush=True)
            if attempt == 2:
                raise
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=2, object_store_memory=300 << 20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="ray_ckpt_bench", log_to_driver=False)
        return fit(tmp, steps, fail_at)
    finally:
        ray.shutdown()
        cluster.shutdown()


def combine(paths: list[str]) -> dict:
    """One result from the results of several runs (``--arm`` names each run's checkout): their fits per arm."""
    fits: dict = {}
    meta = None
    for path in sorted(paths):
        with open(path) as f:
            r = json.load(f)
        meta = meta or dict(r["meta"])
        for arm, fs in r["fits"].items():
            fits.setdefault(arm, []).extend(fs)
    meta["repeats"] = max(len(fs) for fs in fits.values())
    fail_at = set()
    for path in paths:
        with open(path) as f:
            fail_at.add(json.load(f)["meta"]["fail_at"])
    meta["fail_at"] = sorted(fail_at) if len(fail_at) > 1 else fail_at.pop()
    meta["combined_from"] = sorted(os.path.basename(p) for p in paths)
    meta["arms"] = sorted(fits)
    return {"meta": meta, "fits": fits, "summary": {arm: summarize(fs) for arm, fs in fits.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fail-at", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--arm", default="current", help="the name of this checkout's results (to compare checkouts: "
                    "run each from its own directory, alternating, then --combine)")
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="only combine the results of earlier runs")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "startup"))
    ap.add_argument("--label", default="startup", help="base name of the result files")
    ap.add_argument("--tmp", default="/tmp", help="where the private Ray's temp folder goes (keep the path short)")
    a = ap.parse_args(argv)
    if a.combine:
        report.write_result(os.path.join(a.out, a.label), combine(a.combine), markdown, plot)
        return 0
    if a.repeats < 1 or not 0 <= a.fail_at < a.steps or a.nodes < 1:
        ap.error("need --repeats >= 1, 0 <= --fail-at < --steps (0: no restart) and --nodes >= 1")
    tmp = tempfile.mkdtemp(prefix="su", dir=a.tmp)   # short: Ray's socket paths must stay < 108 characters
    os.makedirs(os.path.join(tmp, "ray"))
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, os.environ.get("PYTHONPATH")] if p)
    fits: list = []
    try:
        for i in range(a.repeats):
            f = cluster_fit(tmp, a.nodes, a.steps, a.fail_at)
            fits.append(f)
            print(f"[startup] {a.arm} fit {i + 1}/{a.repeats}: " + "; ".join(
                f"{'restart' if x['restored'] else 'start'} rank {x['rank']} attach {x['attach_s']:.2f} s"
                for x in f["attempts"]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    params = next((x["params"] for f in fits for x in f["attempts"]), 0)
    meta = {"date": report.now(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "nodes": a.nodes, "repeats": a.repeats, "steps": a.steps,
            "fail_at": a.fail_at, "params": params, "arms": [a.arm], "checkout": REPO}
    result = {"meta": meta, "fits": {a.arm: fits}, "summary": {a.arm: summarize(fits)}}
    report.write_result(os.path.join(a.out, a.label), result, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
