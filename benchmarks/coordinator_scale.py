"""How the coordinator's periodic work grows with the length of a run.

A run checkpointing every step at 100 steps/s in 10-step chunks gives the coordinator 10 objects a second:
36,000 after an hour. Its periodic calls (the sender's ``control`` and the metrics' ``status``, each about once a
second; a gap check with every worker update, at most every 0.5 s) look at all of them. This measures, for
lineages of increasing length (a full every 150 steps, every chunk held by the driver's node, fulls durable):

* the time of a fresh ``status()`` (what ``ray_ckpt inspect``-like callers and plans pay);
* the coordinator's CPU share in a simulated steady state: worker updates at 20 Hz adding half a chunk each,
  ``control`` and ``publish_metrics`` once a second, for ``--seconds``;
* the time of ``Lineage.head()`` and of a ``resolve()`` near the end, on the same manifests.

The coordinator class runs in this process (as in the tests), on a private local Ray (for the node list).
Writes ``coordinator_scale.json``, ``.md`` and ``.png`` to ``--out``.

    .venv/bin/python -m benchmarks.coordinator_scale [--chunks 1000,10000,36000] [--seconds 10] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import tempfile
import time

from benchmarks import report
from ray_ckpt.config import CheckpointConfig


def _manifest(kind: str, first: int, last: int) -> bytes:
    from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
    name = full_name(1, last) if kind == "full" else diff_name(1, first, last)
    return Manifest(kind=kind, generation=1, first_step=first, last_step=last, object=object_key(name), nbytes=1,
                    crc32=0, strategy="lowdiff").to_json()


class _Feeder:
    """Worker updates as the coordinator receives them: ``held`` chunks, ``durable`` fulls every 150 steps."""

    def __init__(self, coord, node: str):
        self.coord, self.node, self.step = coord, node, 0
        coord.update(node, [("durable", _manifest("full", 0, 0), [])])

    def to_chunks(self, n: int) -> None:
        msgs = []
        while self.step < 10 * n:
            msgs.append(("held", _manifest("diff", self.step + 1, self.step + 10), None, self.node))
            self.step += 10
            if self.step % 150 == 0:
                msgs.append(("durable", _manifest("full", self.step, self.step), []))
        self.coord.update(self.node, msgs)


def measure(chunks: list[int], seconds: float) -> list[dict]:
    import ray
    from ray_ckpt.lineage import Lineage
    from ray_ckpt.runtime.coordinator import Coordinator, _Replica
    from ray_ckpt.storage import open_storage

    rows = []
    tmp = tempfile.mkdtemp(prefix="ray_ckpt-coord-")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             _temp_dir=os.path.join(tmp, "ray"), configure_logging=False)
    try:
        coord = Coordinator("coordinator-scale", open_storage(os.path.join(tmp, "ckpt")),
                            CheckpointConfig(full_every=150, batch_steps=10, keep_fulls=0))
        node = ray.get_runtime_context().get_node_id()
        feed = _Feeder(coord, node)
        for n in sorted(chunks):
            t0 = time.perf_counter()
            feed.to_chunks(n)
            coord.replica = _Replica(1, feed.step - 5, node, True)
            print(f"[coordinator_scale] {n} chunks ({feed.step} steps) fed in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            t0 = time.perf_counter()
            st = coord.status()
            status_s = time.perf_counter() - t0
            assert st["recoverable_step"] == feed.step, st["recoverable_step"]
            lin = Lineage([e.manifest for e in coord.entries.values()])
            t0 = time.perf_counter()
            head = lin.head()
            head_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            plan = lin.resolve(feed.step - 5)
            resolve_s = time.perf_counter() - t0
            assert head == feed.step and plan.step == feed.step - 5
            # the steady state: 100 steps/s in 10-step chunks -> an update every 50 ms with half a chunk on
            # average; the sender's control and the metrics once a second
            c0, t_end, last, k = time.thread_time(), time.monotonic() + seconds, 0.0, 0
            while time.monotonic() < t_end:
                k += 1
                if k % 2 == 0:
                    feed.to_chunks(feed.step // 10 + 1)
                else:
                    coord.update(node, [])
                if time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    coord.control(1)
                    coord.publish_metrics()
                time.sleep(0.05)
            cpu = (time.thread_time() - c0) / seconds
            rows.append({"chunks": n, "steps": 10 * n, "status_s": status_s, "head_s": head_s,
                         "resolve_s": resolve_s, "steady_cpu_share": cpu,
                         "view_age_s": coord.status(max_age=1.0)["view_age_s"]})
            print(f"[coordinator_scale] {n} chunks: status {1e3 * status_s:.1f} ms, head {1e3 * head_s:.1f} ms, "
                  f"resolve {1e3 * resolve_s:.1f} ms, steady-state CPU {100 * cpu:.1f}% of a core", flush=True)
    finally:
        ray.shutdown()
    return rows


def markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = [f"# Coordinator work against the run's length — {meta['date']}, {meta['machine']}", "",
             "Fresh `status()`, `Lineage.head()`, `resolve()` near the end, and the coordinator's CPU share in a "
             f"simulated steady state ({meta['seconds_per_size']:.0f} s: worker updates at 20 Hz, control and metrics "
             "once a second); 10-step chunks, a full every 150 steps.", "",
             "| chunks | steps | status() ms | head() ms | resolve() ms | steady-state CPU, % of a core | view age s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['chunks']:,} | {r['steps']:,} | {1e3 * r['status_s']:.1f} | {1e3 * r['head_s']:.1f} | "
                     f"{1e3 * r['resolve_s']:.1f} | {100 * r['steady_cpu_share']:.1f} | {r['view_age_s']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    rows = result["rows"]
    fig, ax = report.pyplot().subplots(1, 2, figsize=(9, 3.5))
    steps = [r["steps"] for r in rows]
    for key, label in (("status_s", "status()"), ("head_s", "head()"), ("resolve_s", "resolve()")):
        ax[0].plot(steps, [1e3 * r[key] for r in rows], "o-", label=label)
    ax[0].set_xlabel("steps in the lineage")
    ax[0].set_ylabel("ms per call")
    ax[0].legend()
    ax[1].plot(steps, [100 * r["steady_cpu_share"] for r in rows], "o-")
    ax[1].set_xlabel("steps in the lineage")
    ax[1].set_ylabel("coordinator CPU, % of a core")
    fig.tight_layout()
    report.save_figure(fig, path)


def write(rows: list[dict], out: str, seconds: float) -> None:
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
            "seconds_per_size": seconds}
    report.write_result(os.path.join(out, "coordinator_scale"), {"meta": meta, "rows": rows}, markdown, plot,
                        echo=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="1000,10000,36000", help="lineage lengths in 10-step chunks")
    ap.add_argument("--seconds", type=float, default=10.0, help="steady-state seconds per length")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "coordinator_scale"))
    a = ap.parse_args(argv)
    chunks = [int(x) for x in a.chunks.split(",") if x.strip()]
    if not chunks or min(chunks) < 1:
        ap.error("--chunks needs positive integers, e.g. 1000,10000")
    if a.seconds <= 0:
        ap.error("--seconds must be > 0")
    rows = measure(chunks, a.seconds)
    write(rows, a.out, a.seconds)
    print(f"[coordinator_scale] wrote {a.out}/coordinator_scale.{{json,md,png}}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
