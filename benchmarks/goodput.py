"""Goodput under failures: ray_ckpt against Ray Train's own checkpointing, on the same cluster and the same
seeded failures.

Ray Train ``TorchTrainer``, 2 CPU workers (gloo DDP) on a private multi-node ``ray.cluster_utils.Cluster`` (a head
without trainer slots and ``--nodes`` one-CPU trainer nodes, one more than the workers, so a lost node has a
spare), training the GPT example (``--job``, batches fixed by step and rank) for ``--steps`` steps. Arms:

* ``ref`` — the failure-free reference: the same loop, no checkpointing, no faults. Its wall time is the
  denominator of ETTR. After its last step it also measures what the native arm's save costs the training loop
  (``torch.save`` + ``ray.train.report(checkpoint=..., ASYNC)``, ``--calibrate`` times) and one
  ``ray.train.get_preemption_info()`` call.
* ``ray_ckpt`` — ``RayCkptCallback()`` + ``ray_ckpt.train.attach(model, optimizer, scheduler=...)`` as the docs
  show: ``runtime="ray"`` (memory tier, replica), default policy.
* ``native`` — Ray Train's own path: every N steps ``torch.save`` of model + optimizer + scheduler and
  ``ray.train.report(metrics, checkpoint=..., ASYNC)`` to the same ``storage_path``; N by Young/Daly,
  ``sqrt(2 C M)`` with C the save cost measured in ``ref`` and M the schedule's MTBF; resume from
  ``ray.train.get_checkpoint()``; ``ray.train.get_preemption_info()`` every step and a just-in-time report on the
  notice, as Ray's docs recommend.

The failure schedule (:func:`make_schedule`) is seeded and identical for every arm: per fault its kind (a
SIGKILLed worker, a removed node that a new node replaces ``--rejoin-s`` later, a preemption: a GCS drain notice
with reason PREEMPTION and a ``--deadline-s`` deadline, the node removed at the deadline), its target rank, and its
gap in wall seconds, counted from the first step after the previous recovery (failures strike a running job), so
every arm meets the same faults after the same running time, whatever its recovery costs.

Every rank logs timestamps from the train loop (loop entered, state restored, every step); a controller callback
logs Ray Train's state changes; the driver logs each fault. From them, per arm: ETTR (failure-free time / wall
time from the first loop entry to the last step), steps lost per failure, time to recover per failure (fault ->
first step after it) split into detection (fault -> the controller leaves RUNNING), Ray Train restart (-> the new
loop is entered), restore (-> model built and state restored) and first step; checkpoint overhead (mean step
interval against ``ref``'s, stalls included: what throughput pays); the time the arm's checkpointing cost the run
(its wall time minus ``ref``'s minus Ray Train's own detection and restart of every failure: overhead, restores,
first steps and redone steps, the part a checkpointing system decides, free of the restarts' noise); the paired
ETTR difference per seed (ray_ckpt minus native, same schedule); durable bytes per step (every file seen under the run's storage, sampled each
``--poll-s``), and whether the final model + optimizer state is bitwise ``ref``'s (``torch.equal``).

    python -m benchmarks.goodput [--seeds 0 1 2] [--steps 500] [--quick] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
import uuid

from benchmarks import harness, jobs, report

REPO = harness.REPO
ARMS = ("ref", "ray_ckpt", "native")
KINDS = ("kill", "node", "preempt")
#: controller states that mean Ray Train has noticed a failure and is tearing the group down
_DETECTED = {"RestartingState", "ReschedulingState", "ResizingState", "ErroredState", "ShuttingDownState"}


# ------------------------------------------------------------------------------------------------------------
# pure parts (unit-tested without Ray)
# ------------------------------------------------------------------------------------------------------------
def make_schedule(seed: int, n: int, mean_gap_s: float, min_gap_s: float, max_gap_s: float,
                  world: int = 2, kinds: tuple = KINDS) -> list[dict]:
    """``n`` faults: kinds as evenly spread as ``n`` allows (then shuffled), a target rank each, and gaps drawn
    from an exponential of mean ``mean_gap_s`` clipped to ``[min_gap_s, max_gap_s]``. Same seed, same list."""
    if n < 0 or not 0 < min_gap_s <= max_gap_s:
        raise ValueError("need n >= 0 and 0 < min_gap_s <= max_gap_s")
    rng = random.Random(seed)
    ks = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(ks)
    return [{"i": i, "kind": k, "rank": rng.randrange(world),
             "gap_s": round(min(max_gap_s, max(min_gap_s, rng.expovariate(1.0 / mean_gap_s))), 2)}
            for i, k in enumerate(ks)]


def mtbf(schedule: list[dict]) -> float:
    """The schedule's mean time between failures (its mean gap, running seconds)."""
    return statistics.fmean(f["gap_s"] for f in schedule) if schedule else math.inf


def young_daly_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Young/Daly's checkpoint interval ``sqrt(2 C M)`` in whole steps (at least 1)."""
    if save_s <= 0 or step_s <= 0 or not mtbf_s > 0:
        raise ValueError("save cost, step time and MTBF must be positive")
    return max(1, round(math.sqrt(2.0 * save_s * mtbf_s) / step_s))


def ettr(ref_s: float, wall_s: float) -> float:
    """Effective training time ratio: failure-free time / the arm's wall time to its last step."""
    return ref_s / wall_s


def breakdown(fault: dict, steps: list, events: list, states: list) -> dict:
    """One fault's cost from the logs: ``steps`` [(t, step)] of rank 0, ``events`` [(t, kind, payload)] of rank 0
    (``enter``, ``restored``), ``states`` [(t, state)] of the controller. Times in seconds since the epoch;
    phases None where the log lacks them (e.g. the run ended first)."""
    tf = fault["t"]
    before = [s for t, s in steps if t <= tf]
    out = {"kind": fault["kind"], "rank": fault["rank"], "last_step": max(before) if before else 0}
    t_detect = next((t for t, s in states if t >= fault.get("t_notice", tf) and s in _DETECTED), None)
    if t_detect is not None and t_detect < tf:   # a preemption: Ray Train acts at the deadline, not before
        t_detect = tf
    t_enter = next((t for t, k, _ in events if k == "enter" and t > tf), None)
    rest = next(((t, p) for t, k, p in events if k == "restored" and t_enter is not None and t >= t_enter), None)
    t_first = next((t for t, _ in steps if rest is not None and t > rest[0]), None)
    out["restored_step"] = rest[1]["start"] if rest else None
    out["steps_lost"] = None if rest is None else max(0, out["last_step"] - rest[1]["start"])
    marks = [tf, t_detect, t_enter, rest[0] if rest else None, t_first]
    for name, a, b in zip(("detection_s", "restart_s", "restore_s", "first_step_s"), marks, marks[1:]):
        out[name] = None if a is None or b is None else round(b - a, 3)
    out["recovery_s"] = None if t_first is None else round(t_first - tf, 3)
    if rest:
        out["attach_phases"] = rest[1].get("phases")
        out["restore_marks"] = rest[1].get("marks")   # the restore column's parts (loop entered -> restored)
    return out


def spread(xs: list) -> dict:
    """Mean, min, max and (n >= 2) the sample standard deviation of ``xs`` (Nones dropped)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "mean": None, "min": None, "max": None, "sd": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "sd": statistics.stdev(xs) if len(xs) > 1 else None}


# ------------------------------------------------------------------------------------------------------------
# the train loop (Ray Train worker) and the controller callback (Ray Train controller)
# ------------------------------------------------------------------------------------------------------------
class _Log:
    """A rank's JSON-lines log, appended and flushed line by line (read by the driver while it runs)."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def __call__(self, **rec) -> None:
        self.f.write(json.dumps(rec) + "\n")


def _gc_clock() -> list:
    """``[seconds]``: the time this process has spent in Python's garbage collector since the call, kept current
    by a ``gc.callbacks`` hook (a collection holds the interpreter lock: the training thread waits; Ray asks every
    worker of a node for one when that node's object store fills). Any thread."""
    import gc
    acc, t0 = [0.0], [0.0]

    def hook(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            acc[0] += time.perf_counter() - t0[0]
    gc.callbacks.append(hook)
    return acc


def train_loop(cfg: dict) -> None:
    """``train_loop_per_worker`` of every arm: one attempt of one rank. Ray Train worker."""
    entered = time.time()
    import ray
    import ray.train
    import ray.train.torch
    import torch
    from ray.train import Checkpoint, CheckpointUploadMode

    torch.set_num_threads(1)
    gc_s = _gc_clock()
    marks, last = {}, [entered]   # the "restore" column's parts: seconds of each, in order

    def mark(name: str) -> None:
        now = time.time()
        marks[name] = round(now - last[0], 4)
        last[0] = now

    mark("imports")
    rank = ray.train.get_context().get_world_rank()
    log = _Log(os.path.join(cfg["out"], f"rank{rank}.jsonl"))
    log(ev="enter", t=entered, pid=os.getpid(), node=ray.get_runtime_context().get_node_id())
    spec = jobs.JobSpec(**cfg["job"])
    job = jobs.build(spec, "cpu", seed=0)
    model = job.model
    mark("build")
    net = ray.train.torch.prepare_model(model)
    mark("prepare_model")
    opt = jobs.make_optimizer(model, spec.lr, spec.kind)
    sched = jobs.make_scheduler(opt, cfg["steps"])
    arm, steps, every = cfg["arm"], cfg["steps"], cfg.get("every", 0)
    session, start, phases = None, 0, None
    if arm == "ray_ckpt":
        import ray_ckpt.train
        mark("import_ray_ckpt")
        session = ray_ckpt.train.attach(net, opt, scheduler=sched)
        start, phases = session.start_step, dict(session.startup)
        mark("attach")
    elif arm == "native":
        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                st = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            start = st["step"]
        mark("load")
    log(ev="restored", t=time.time(), start=start, phases=phases, marks=marks)
    scratch = tempfile.mkdtemp(prefix="gp", dir=cfg["out"])   # Ray Train deletes each save's folder once uploaded
    saves = [0]

    def save(step: int, mode) -> tuple[float, int]:
        """torch.save on rank 0 and the (collective) report; its seconds on this rank and the bytes saved."""
        t = time.perf_counter()
        ck, n = None, 0
        if rank == 0:
            d = tempfile.mkdtemp(prefix="c", dir=scratch)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": step}, os.path.join(d, "state.pt"))
            n = os.path.getsize(os.path.join(d, "state.pt"))
            ck = Checkpoint.from_directory(d)
        saves[0] += 1   # the same directory name on every rank, a new one for each save of this attempt
        ray.train.report({"step": step}, checkpoint=ck, checkpoint_dir_name=f"s{step:06d}_from{start}_{saves[0]}",
                         checkpoint_upload_mode=mode)
        return time.perf_counter() - t, n

    jit_done = False
    budget = getattr(getattr(session, "checkpointer", None), "budget", None)   # ray_ckpt's rank 0: the policy
    gran = None
    for step in range(start, steps):
        job.train_step(net, opt, sched, step, rank, "cpu")
        rec = {"s": step + 1, "gc": round(gc_s[0], 4)}
        if budget is not None and (budget.mode, budget.k) != gran:   # the recovery granularity, when it changes
            gran = (budget.mode, budget.k)
            rec["gran"] = {"mode": budget.mode, "k": budget.k, "reason": budget.reason}
            meter = getattr(session.checkpointer._capture, "meter", None)   # the window it decided on
            if meter is not None and meter.last is not None:
                rec["gran"]["window"] = {k: round(v, 6) if isinstance(v, float) else v
                                         for k, v in meter.last.to_dict().items()}
        if arm == "native":
            t = time.perf_counter()
            info = ray.train.get_preemption_info()        # a barrier across the group, as Ray's docs use it
            rec["pi"] = round(time.perf_counter() - t, 5)
            if info is not None and not jit_done:          # the just-in-time checkpoint on the notice
                rec["c"], rec["b"] = save(step + 1, CheckpointUploadMode.SYNC)
                rec["jit"] = jit_done = True
            elif every and (step + 1) % every == 0:
                rec["c"], rec["b"] = save(step + 1, CheckpointUploadMode.ASYNC)
        rec["t"] = time.time()
        log(**rec)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(cfg["out"], "final.pt"))
    if arm == "ref" and cfg.get("calibrate"):
        costs = [save(steps, CheckpointUploadMode.ASYNC) for _ in range(cfg["calibrate"])]
        pis = []
        for _ in range(cfg["calibrate"]):
            t = time.perf_counter()
            ray.train.get_preemption_info()
            pis.append(time.perf_counter() - t)
        log(ev="calibration", t=time.time(), save_s=[c for c, _ in costs], bytes=costs[-1][1], preemption_info_s=pis)
    if session is not None:
        session.close()


def _state_log_callback(path: str):
    """A Ray Train controller callback that appends ``{"t", "state"}`` at each change of the controller's state."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class StateLog(ControllerCallback):
        def __init__(self, path):
            self.path = path

        def after_controller_state_update(self, previous_state, current_state):
            if type(previous_state) is type(current_state):
                return
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": time.time(), "state": type(current_state).__name__}) + "\n")

    return StateLog(path)


# ------------------------------------------------------------------------------------------------------------
# the driver: cluster, fault injector, one fit per arm
# ------------------------------------------------------------------------------------------------------------
def _read_jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:   # a line being written
            pass
    return out


class Cluster:
    """The private cluster: a head (no ``trainer`` resource: Ray Train's controller, ray_ckpt's coordinator) and
    ``nodes`` trainer nodes with 1 CPU each. Driver."""

    def __init__(self, tmp: str, nodes: int, log, store_mb: int = 200):
        import ray
        from ray.cluster_utils import Cluster as RayCluster
        self.log, self.want, self.store_mb = log, nodes, store_mb
        for attempt in range(3):   # a loaded machine can miss Ray's start-up deadlines
            try:
                self.c = RayCluster(initialize_head=True, head_node_args={
                    "num_cpus": 2, "object_store_memory": store_mb << 20, "temp_dir": os.path.join(tmp, "ray"),
                    "include_dashboard": False})
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
                log(f"the cluster did not start ({e}); trying again")
                if attempt == 2:
                    raise
        self.trainers: list = []
        self.top_up()
        ray.init(address=self.c.address, namespace=harness.RAY_NAMESPACE, log_to_driver=False)

    def add(self):
        node = self.c.add_node(num_cpus=1, object_store_memory=self.store_mb << 20, resources={"trainer": 1})
        self.trainers.append(node)
        return node

    def top_up(self) -> None:
        while len(self.trainers) < self.want:
            self.add()
        try:
            self.c.wait_for_nodes(timeout=120)
        except TimeoutError:   # a node drained by a preemption the run outlived, or one that never came up
            live = set(self.c.global_state._live_node_ids())
            gone = [n for n in self.trainers if n.node_id not in live]
            self.log(f"nodes: {len(live)} alive, {len(self.c.list_all_nodes())} expected after 120 s; replacing "
                     f"{len(gone)} trainer node(s) that are not alive")
            for n in gone:
                self.remove(n)
            while len(self.trainers) < self.want:
                self.add()
            self.c.wait_for_nodes(timeout=180)

    def node_of(self, node_id: str):
        return next((n for n in self.trainers if n.node_id == node_id), None)

    def remove(self, node) -> None:
        self.trainers.remove(node)
        self.c.remove_node(node)

    def drain(self, node_id: str, deadline_s: float) -> None:
        """The GCS call ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` and the autoscaler make."""
        import ray
        from ray.core.generated import autoscaler_pb2
        gcs = ray._raylet.GcsClient(address=self.c.address)
        ok, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                 "spot preemption (benchmark)", int((time.time() + deadline_s) * 1000))
        if not ok:
            raise RuntimeError(f"drain of {node_id[:12]} refused: {why}")

    def shutdown(self) -> None:
        import ray
        ray.shutdown()
        self.c.shutdown()


class Injector:
    """Fires ``schedule`` at one arm's run: fault i when the run has stepped ``gap_s`` seconds since its first
    step after fault i-1 (since its first step for i = 0); brings replacement nodes in ``rejoin_s`` after a loss;
    samples the run's storage for the bytes written. Driver, main thread (Ray's ``Cluster.add_node`` installs
    signal handlers: it works in the main thread only)."""

    def __init__(self, cluster: Cluster, out: str, schedule: list, storage: list, a, log):
        self.log = log
        self.cluster, self.out, self.schedule, self.storage, self.a = cluster, out, schedule, storage, a
        self.stop_evt = threading.Event()
        self.faults: list = []
        self.files: dict = {}
        self.errors: list = []
        self.rejoins: list = []   # times at which a replacement node joins

    def _up_since(self, since: float) -> float | None:
        """When rank 0's first attempt entered after ``since`` took its first step (None: not yet). A step the old
        attempt logs after the fault does not count."""
        recs = _read_jsonl(os.path.join(self.out, "rank0.jsonl"))
        entered = next((i for i, r in enumerate(recs) if r.get("ev") == "enter" and r["t"] > since), None)
        if entered is None:
            return None
        return next((r["t"] for r in recs[entered:] if "s" in r), None)

    def _who(self, rank: int, since: float) -> dict | None:
        enters = [r for r in _read_jsonl(os.path.join(self.out, f"rank{rank}.jsonl"))
                  if r.get("ev") == "enter" and r["t"] > since]
        return enters[-1] if enters else None

    def _sample_storage(self) -> None:
        for root in self.storage:
            for d, _, names in os.walk(root):
                for n in names:
                    p = os.path.join(d, n)
                    try:
                        self.files[p] = max(self.files.get(p, 0), os.path.getsize(p))
                    except OSError:
                        pass

    def _wait(self, until: float) -> bool:
        """Sleep until ``until`` (time.time()) doing the chores; False when stopped."""
        while time.time() < until:
            if self.stop_evt.wait(min(self.a.poll_s, max(0.0, until - time.time()))):
                return False
            self._chores()
        return not self.stop_evt.is_set()

    def _chores(self) -> None:
        now = time.time()
        for t in [t for t in self.rejoins if t <= now]:
            self.rejoins.remove(t)
            try:
                self.cluster.add()
            except Exception as e:  # noqa: BLE001 - a loaded machine can miss Ray's start-up deadline: again
                self.log(f"a replacement node did not start ({e!r}); trying again")
                self.rejoins.append(now + 1.0)
        self._sample_storage()

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported in the result, the fit goes on
            self.errors.append(repr(e))
            self.log(f"fault injection stopped: {e!r}")
        finally:
            while self.rejoins and not self.stop_evt.is_set():
                self._wait(min(self.rejoins))

    def _run(self) -> None:
        since = 0.0   # faults strike after the first step that follows the previous one
        for f in self.schedule:
            while True:
                up = self._up_since(since)
                who = self._who(f["rank"], since)
                if up is not None and who is not None:
                    break
                if not self._wait(time.time() + self.a.poll_s):
                    return
            if not self._wait(up + f["gap_s"]):
                return
            who = self._who(f["rank"], since)
            rec = dict(f, node=who["node"], pid=who["pid"])
            if f["kind"] == "kill":
                rec["t"] = time.time()
                os.kill(who["pid"], signal.SIGKILL)
            else:
                node = self.cluster.node_of(who["node"])
                if node is None:
                    raise RuntimeError(f"fault {f['i']}: rank {f['rank']} runs on no trainer node "
                                       f"({who['node'][:12]})")
                if f["kind"] == "preempt":
                    rec["t_notice"] = time.time()
                    self.cluster.drain(who["node"], self.a.deadline_s)
                    if not self._wait(rec["t_notice"] + self.a.deadline_s):
                        return
                rec["t"] = time.time()
                self.cluster.remove(node)
                self.rejoins.append(time.time() + self.a.rejoin_s)
            self.faults.append(rec)
            self.log(f"fault {f['i']}: {f['kind']} of rank {f['rank']} (node {who['node'][:8]})")
            since = rec["t"]
        while self._wait(time.time() + 1.0):
            pass


def fit_arm(cluster: Cluster, tmp: str, arm: str, seed: int, schedule: list, a, every: int = 0) -> dict:
    """One ``TorchTrainer.fit()`` of ``arm`` under ``schedule`` (none for ``ref``); its logs, parsed. Driver."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out = tempfile.mkdtemp(prefix=f"{arm}-{seed}-", dir=tmp)
    name = f"gp-{arm}-{seed}-{uuid.uuid4().hex[:6]}"
    storage_path = os.path.join(tmp, "storage")
    callbacks = [_state_log_callback(os.path.join(out, "controller.jsonl"))]
    if arm == "ray_ckpt":
        import ray_ckpt.train
        callbacks.append(ray_ckpt.train.RayCkptCallback())   # the lineage goes to <storage_path>/<name>/ray_ckpt
    cfg = {"out": out, "arm": arm, "steps": a.steps, "job": harness.parse_job(a.job).to_dict(), "every": every,
           "calibrate": a.calibrate if arm == "ref" else 0}
    trainer = TorchTrainer(
        train_loop, train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1, "trainer": 1}),
        run_config=RunConfig(name=name, storage_path=storage_path, callbacks=callbacks,
                             failure_config=FailureConfig(max_failures=4 * len(schedule) + 2),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    inj = Injector(cluster, out, schedule, [os.path.join(storage_path, name)], a, cluster.log)
    box: dict = {}

    def fit() -> None:   # Ray Train's fit() runs in a thread (it supports that), the faults in the main thread
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the main thread
            box["exc"] = e
        finally:
            inj.stop_evt.set()

    t0 = time.time()
    th = threading.Thread(target=fit, daemon=True, name="goodput-fit")
    th.start()
    inj.run()
    th.join()
    fit_s = time.time() - t0
    if "exc" in box:
        raise box["exc"]
    result = box["result"]
    inj._sample_storage()
    cluster.top_up()
    rank0 = _read_jsonl(os.path.join(out, "rank0.jsonl"))
    states = [(r["t"], r["state"]) for r in _read_jsonl(os.path.join(out, "controller.jsonl"))]
    steps = [(r["t"], r["s"]) for r in rank0 if "s" in r]
    events = [(r["t"], r["ev"], r) for r in rank0 if "ev" in r]
    enters = [t for t, k, _ in events if k == "enter"]
    last = next((t for t, s in steps if s == a.steps), None)
    res = {"arm": arm, "seed": seed, "run": name, "fit_s": fit_s, "every": every,
           "error": None if result.error is None else repr(result.error), "injector_errors": inj.errors,
           "t0": enters[0] if enters else None, "t_last": last,
           "wall_s": (last - enters[0]) if last and enters else None,
           "faults": inj.faults, "steps": [[round(t, 3), s] for t, s in steps], "states": states,
           "durable_bytes": sum(inj.files.values()), "durable_files": len(inj.files),
           "attempts": len(enters)}
    res["recovery"] = [breakdown(f, steps, events, states) for f in inj.faults]
    res["step_intervals_s"] = step_intervals(res)
    res["granularity"] = [{"s": r["s"], **r["gran"]} for r in rank0 if "gran" in r]
    res["gc"] = {str(k): gc_time(_read_jsonl(os.path.join(out, f"rank{k}.jsonl"))) for k in range(2)}
    if arm == "native":
        res["saves"] = [{"s": r["s"], "c": r["c"], "b": r["b"], "jit": r.get("jit", False)} for r in rank0 if "c" in r]
        res["preemption_info_s"] = [r["pi"] for r in rank0 if "pi" in r]
    cal = next((p for _, k, p in events if k == "calibration"), None)
    if cal:
        res["calibration"] = {k: cal[k] for k in ("save_s", "bytes", "preemption_info_s")}
    final = os.path.join(out, "final.pt")
    res["final"] = final if os.path.exists(final) else None
    return res


def gc_time(records: list) -> dict:
    """A rank's time in Python's garbage collector over all its attempts (the ``gc`` clock of each attempt's last
    step, summed) and per step run."""
    total, last, steps = 0.0, 0.0, 0
    for r in records:
        if r.get("ev") == "enter":
            total, last = total + last, 0.0
        elif "s" in r:
            last, steps = r.get("gc", 0.0), steps + 1
    total += last
    return {"s": round(total, 3), "steps": steps, "per_step_s": round(total / steps, 5) if steps else None}


def _intervals(steps: list, cuts: list = ()) -> list:
    """Seconds between consecutive steps of one attempt, the first 3 of each attempt left out (warm-up). An
    attempt ends where the step count does not grow by one or where an interval spans one of ``cuts`` (the
    controller's state changes: a restart that lost no step continues the count, but its interval is a
    recovery, not a step)."""
    out, run = [], 0
    cuts = sorted(cuts)
    for (t0, s0), (t1, s1) in zip(steps, steps[1:]):
        spans = any(t0 < c <= t1 for c in cuts)
        run = run + 1 if s1 == s0 + 1 and not spans else 0
        if run > 3:
            out.append(round(t1 - t0, 4))
    return out


def step_intervals(run: dict) -> list:
    """:func:`_intervals` of a run's rank-0 steps, cut at the controller's state changes after the first."""
    return _intervals(run["steps"], [t for t, _ in run.get("states", [])[1:]])


def bitwise(a_path: str | None, b_path: str | None) -> bool | None:
    """Whether two final states hold the same keys and ``torch.equal`` tensors (None if one is missing)."""
    if not a_path or not b_path:
        return None
    import torch
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return x == y
    return same(a, b)


# ------------------------------------------------------------------------------------------------------------
# summary, markdown, plot
# ------------------------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """Per arm, over the seeds: ETTR, steps lost, recovery phases per fault kind, overhead, bytes, bitwise."""
    ref = {r["seed"]: r for r in runs if r["arm"] == "ref"}
    iv = {id(r): step_intervals(r) for r in runs}
    ref_step = {s: statistics.fmean(iv[id(r)]) for s, r in ref.items() if iv[id(r)]}
    out = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        rec = [x for r in rs for x in r["recovery"]]
        cell = {"seeds": [r["seed"] for r in rs],
                "ettr": spread([ettr(ref[r["seed"]]["wall_s"], r["wall_s"]) if r["wall_s"] and r["seed"] in ref
                                and ref[r["seed"]]["wall_s"] else None for r in rs]),
                "wall_s": spread([r["wall_s"] for r in rs]),
                "faults": spread([len(r["faults"]) for r in rs]),
                "steps_lost": spread([x["steps_lost"] for x in rec]),
                "steps_lost_total": spread([sum(x["steps_lost"] or 0 for x in r["recovery"]) for r in rs]),
                "recovery_s": spread([x["recovery_s"] for x in rec]),
                "bitwise": [r.get("bitwise") for r in rs],
                "durable_bytes_per_step": spread([r["durable_bytes"] / r["steps_done"] for r in rs
                                                  if r.get("steps_done")]),
                "overhead": spread([statistics.fmean(iv[id(r)]) / ref_step[r["seed"]] - 1
                                    for r in rs if iv[id(r)] and r["seed"] in ref_step]),
                "checkpointing_s": spread([checkpointing_cost(r, ref.get(r["seed"])) for r in rs]),
                "errors": [e for r in rs for e in ([r["error"]] if r["error"] else []) + r["injector_errors"]]}
        by_kind = {}
        for k in KINDS:
            xs = [x for x in rec if x["kind"] == k]
            if xs:
                by_kind[k] = {ph: spread([x[ph] for x in xs]) for ph in
                              ("steps_lost", "detection_s", "restart_s", "restore_s", "first_step_s", "recovery_s")}
        cell["by_kind"] = by_kind
        marks = [x["restore_marks"] for x in rec if x.get("restore_marks")]
        cell["restore_parts_s"] = {k: spread([m.get(k) for m in marks]) for k in dict.fromkeys(
            k for m in marks for k in m)}
        if arm == "ray_ckpt":   # the recovery granularity the overhead budget chose (rank 0, every change)
            cell["max_k"] = [max([g["k"] for g in r.get("granularity", [])] or [None], key=lambda k: k or 0)
                             for r in rs]
        if arm == "ray_ckpt":   # ray_ckpt's own share of "restore": attach's phases after each restart
            phases = [x["attach_phases"] for x in rec if x.get("attach_phases")]
            cell["attach_after_restart_s"] = {k: spread([p.get(k) for p in phases]) for k in dict.fromkeys(
                ["total", "restore", "checkpointer.first_full", "rank_loop"] + [k for p in phases for k in p])}
        if arm == "native":
            cell["every"] = [r["every"] for r in rs]
            cell["save_s"] = spread([x["c"] for r in rs for x in r.get("saves", []) if not x["jit"]])
            cell["preemption_info_s"] = spread([x for r in rs for x in r.get("preemption_info_s", [])])
        out[arm] = cell
    if "ray_ckpt" in out and "native" in out:   # paired by seed: the same schedule, the same load period
        e = {a: {r["seed"]: ettr(ref[r["seed"]]["wall_s"], r["wall_s"]) for r in runs
                 if r["arm"] == a and r["wall_s"] and r["seed"] in ref and ref[r["seed"]]["wall_s"]}
             for a in ("ray_ckpt", "native")}
        c = {a: {r["seed"]: checkpointing_cost(r, ref.get(r["seed"])) for r in runs if r["arm"] == a}
             for a in ("ray_ckpt", "native")}
        seeds = sorted(set(e["ray_ckpt"]) & set(e["native"]))
        out["paired"] = {"seeds": seeds,
                         "ettr_diff": [e["ray_ckpt"][k] - e["native"][k] for k in seeds],
                         "checkpointing_s_diff": [None if c["ray_ckpt"].get(k) is None or c["native"].get(k) is None
                                                  else c["ray_ckpt"][k] - c["native"][k] for k in seeds]}
    return out


def checkpointing_cost(run: dict, ref: dict | None) -> float | None:
    """Seconds the arm's checkpointing cost ``run``: its wall time minus the failure-free ``ref``'s, minus Ray
    Train's own share of each failure (detection and restart, which no checkpointing changes). What is left is
    the per-step overhead, the restores, the first steps and the steps done again. None when a figure is
    missing."""
    if not run.get("wall_s") or not ref or not ref.get("wall_s"):
        return None
    rt = 0.0
    for x in run["recovery"]:
        if x.get("detection_s") is None or x.get("restart_s") is None:
            return None
        rt += x["detection_s"] + x["restart_s"]
    return run["wall_s"] - ref["wall_s"] - rt


def _pm(c: dict, spec=".3f") -> str:
    if not c or c.get("mean") is None:
        return "–"
    s = format(c["mean"], spec)
    if c["n"] > 1:
        s += f" [{format(c['min'], spec)}, {format(c['max'], spec)}]"
    return s


def markdown(result: dict) -> str:
    m, s = result["settings"], result["summary"]
    lines = [f"# Goodput under failures — {result['date']}", "",
             f"{result['machine'].get('cpu')}, {result['machine'].get('cores')} cores (shared; load average "
             f"{result['load_before']} before, {result['load_after']} after), Ray {result['machine'].get('ray')}. "
             f"Ray Train `TorchTrainer`, 2 CPU workers (gloo) on a `Cluster` of a head + {m['nodes']} one-CPU "
             f"trainer nodes, {m.get('object_store_mb', 200)} MiB of object store each; job `{m['job']}` ({result.get('params', 0):,} parameters), {m['steps']} steps; "
             f"seeds {m['seeds']}; {m['faults']} faults per run ({', '.join(KINDS)}), gaps of mean {m['mean_gap_s']} s "
             f"running time; a lost node is replaced after {m['rejoin_s']} s; preemption deadline {m['deadline_s']} s. "
             "Mean [min, max] over the seeds (per-failure figures: over every failure of every seed).", "",
             "| arm | ETTR | steps lost / failure | recovery s / failure | checkpointing s / run | overhead / step "
             "| durable bytes / step | final state bitwise = ref |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for arm, c in ((a, c) for a, c in s.items() if a != "paired"):
        bw = [b for b in c["bitwise"] if b is not None]
        ov, by = c["overhead"]["mean"], c["durable_bytes_per_step"]["mean"]
        if arm == "ref":   # the reference: no failure, no checkpoint (its bytes are the native arm's calibration)
            lines.append(f"| ref | 1 (by definition; wall {_pm(c['wall_s'], '.1f')} s) | – | – | – | – | – | – |")
            continue
        lines.append(f"| {arm} | {_pm(c['ettr'])} | {_pm(c['steps_lost'], '.1f')} | {_pm(c['recovery_s'], '.1f')} | "
                     f"{_pm(c.get('checkpointing_s', {}), '.1f')} | {report.pct(None if ov is None else 100 * ov)} | {report.nbytes(by) if by else '–'} | "
                     f"{sum(1 for b in bw if b)}/{len(bw)} |")
    pair = s.get("paired")
    if pair and pair["seeds"]:
        d, cd = pair["ettr_diff"], [x for x in pair["checkpointing_s_diff"] if x is not None]
        lines += ["", f"Paired by seed {pair['seeds']} (ray_ckpt minus native): ETTR "
                  + ", ".join(f"{x:+.3f}" for x in d) + f" (ahead in {sum(x > 0 for x in d)} of {len(d)})"
                  + ("; checkpointing s / run " + ", ".join(f"{x:+.1f}" for x in cd) if cd else "")
                  + ". *Checkpointing s / run*: wall time minus ref's minus Ray Train's detection and restart of "
                  "every failure (overhead, restores, first steps, redone steps)."]
    nat = s.get("native")
    if nat:
        lines += ["", f"Native arm: a checkpoint every N = {nat['every']} steps (Young/Daly, per seed) from save "
                  f"cost C = {[round(x, 3) for x in result['calibration']['save_s']]} s (measured in `ref`, the "
                  f"training loop's blocking time of torch.save + report) and the schedule's MTBF "
                  f"{[round(x, 2) for x in result['calibration']['mtbf_s']]} s; in the run a save took "
                  f"{_pm(nat['save_s'])} s, a `get_preemption_info()` {_pm(nat['preemption_info_s'], '.4f')} s."]
    ks = s.get("ray_ckpt", {}).get("max_k")
    if ks and any(k is not None for k in ks):
        lines += ["", f"ray_ckpt's recovery granularity (the overhead budget's choice, rank 0): the longest interval "
                  f"between recovery points per seed {ks} steps (1: every step; a run records each change under "
                  "`granularity`)."]
    gcs = {arm: [r["gc"] for r in result["runs"] if r["arm"] == arm and r.get("gc")] for arm in ARMS}
    if any(gcs.values()):
        lines += ["", "Python's garbage collector per step (ms, rank 0 / rank 1, mean over the seeds; a collection "
                  "holds the interpreter lock, and Ray asks every worker for one when a node's object store "
                  "fills): " + "; ".join(
                      f"{arm} " + " / ".join(f"{1e3 * statistics.fmean(g[k]['per_step_s'] for g in v):.1f}"
                                             for k in ("0", "1"))
                      for arm, v in gcs.items() if v) + "."]
    att = s.get("ray_ckpt", {}).get("attach_after_restart_s")
    if att:
        lines += ["", f"ray_ckpt's share of each restart (`attach` after a restore, s): total {_pm(att['total'], '.2f')}, "
                  f"of which restore {_pm(att['restore'], '.2f')} and the attach full "
                  f"{_pm(att['checkpointer.first_full'], '.2f')} (`TrainSession.startup`)."]
    parts = [(arm, c["restore_parts_s"]) for arm, c in s.items() if arm != "paired" and c.get("restore_parts_s")]
    if parts:
        lines += ["", "The restore column part by part (s, rank 0, loop entered -> restored; mean [min, max] over the "
                  "failures):", ""]
        lines += [f"- {arm}: " + ", ".join(f"{k} {_pm(v, '.2f')}" for k, v in p.items()) for arm, p in parts]
    if att:
        lines += ["- ray_ckpt `attach` phases: " + ", ".join(f"{k} {_pm(v, '.2f')}" for k, v in att.items()
                                                              if v.get("n"))]
    lines += ["", "## Time to recover, per failure kind (s; fault -> first step after it)", "",
              "| arm | kind | n | steps lost | detection | Ray Train restart | restore | first step | total |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, c in ((a, c) for a, c in s.items() if a != "paired"):
        for k, ph in c["by_kind"].items():
            lines.append(f"| {arm} | {k} | {ph['recovery_s']['n']} | {_pm(ph['steps_lost'], '.1f')} | "
                         + " | ".join(_pm(ph[x], ".2f") for x in ("detection_s", "restart_s", "restore_s",
                                                                   "first_step_s", "recovery_s")) + " |")
    errs = [e for a, c in s.items() if a != "paired" for e in c["errors"]]
    if errs:
        lines += ["", "Errors:"] + [f"- {e}" for e in errs]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """Step against wall time, one line per arm (the first seed), faults marked on each arm's line."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    seed = result["settings"]["seeds"][0]
    marks = {"kill": "x", "node": "v", "preempt": "D"}
    for r in (r for r in result["runs"] if r["seed"] == seed):
        if not r["steps"] or r["t0"] is None:
            continue
        xs, ys = [t - r["t0"] for t, _ in r["steps"]], [s for _, s in r["steps"]]
        line, = ax.plot(xs, ys, ".", markersize=1.5, label=f"{r['arm']} (wall {r['wall_s'] or 0:.0f} s)")
        for f in r["faults"]:
            done = [s for t, s in r["steps"] if t <= f["t"]]
            ax.plot(f["t"] - r["t0"], done[-1] if done else 0, marks[f["kind"]], color=line.get_color(),
                    markersize=7, markerfacecolor="none")
    for k, mk in marks.items():
        ax.plot([], [], mk, color="k", markerfacecolor="none", label=k)
    ax.set_xlabel("wall seconds since the first loop entry")
    ax.set_ylabel("steps completed (rank 0)")
    ax.set_title(f"Goodput under a seeded failure schedule (seed {seed})")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    report.save_figure(fig, path)


DEFINITIONS = {
    "ettr": "ref's wall time / the arm's, each from rank 0's first loop entry to its last step",
    "steps_lost": "rank 0's last completed step before the fault minus the step the next attempt restored",
    "detection_s": "fault -> Ray Train's controller leaves RUNNING (a preemption: its deadline)",
    "restart_s": "-> rank 0's train loop entered again",
    "restore_s": "-> model built and state restored (attach / get_checkpoint + torch.load)",
    "first_step_s": "-> the first step after the restore completed",
    "overhead": "mean step interval (warm, within an attempt; stalls included) / ref's - 1",
    "checkpointing_s": "wall time - ref's wall time - Ray Train's detection and restart of every failure",
    "paired": "per seed, ray_ckpt's figure minus native's (same schedule)",
    "durable_bytes": "sum of the sizes of every file seen under the run's storage (sampled every --poll-s)"}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--job", default="gpt:small:1", help="kind:size:batch of benchmarks.jobs (a GPT preset)")
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--mean-gap-s", type=float, default=5.0, help="mean running seconds between faults")
    ap.add_argument("--min-gap-s", type=float, default=3.0)
    ap.add_argument("--max-gap-s", type=float, default=8.0)
    ap.add_argument("--deadline-s", type=float, default=4.0, help="a preemption's notice to its removal")
    ap.add_argument("--rejoin-s", type=float, default=3.0, help="a lost node's replacement joins this much later")
    ap.add_argument("--nodes", type=int, default=3, help="trainer nodes (2 workers + spares)")
    ap.add_argument("--object-store-mb", type=int, default=1024, help="each node's object store (MiB)")
    ap.add_argument("--calibrate", type=int, default=5, help="saves timed at the end of ref (the native arm's C)")
    ap.add_argument("--poll-s", type=float, default=0.1)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, 120 steps, 3 faults")
    ap.add_argument("--out", default=harness.RESULTS)
    ap.add_argument("--label", default="goodput")
    ap.add_argument("--tmp", default="/tmp", help="where the private Ray's temp folder goes (keep the path short)")
    ap.add_argument("--rebuild", metavar="JSON", help="only rewrite the md and png of an earlier result")
    a = ap.parse_args(argv)
    if a.rebuild:
        with open(a.rebuild) as f:
            result = json.load(f)
        result["summary"] = summarize(result["runs"])
        report.write_result(a.rebuild[:-len(".json")], result, markdown, plot)
        return 0
    if a.quick:
        a.seeds, a.steps, a.faults = a.seeds[:1], 120, 3
    if "ref" not in a.arms:
        ap.error("the ref arm is needed (ETTR's denominator and the native arm's save cost)")
    harness.parse_job(a.job)
    log = harness.logger("goodput", time.time())
    tmp = tempfile.mkdtemp(prefix="gp", dir=a.tmp)   # short: Ray's socket paths must stay < 108 characters
    os.makedirs(os.path.join(tmp, "ray"))
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "25")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, os.environ.get("PYTHONPATH")] if p)
    jobs.preload(harness.parse_job(a.job))
    load_before, t_start = _load(), time.time()
    runs, cal = [], {"save_s": [], "mtbf_s": [], "preemption_info_s": []}
    base = os.path.join(a.out, a.label + ("_quick" if a.quick and a.label == "goodput" else ""))
    params = sum(p.numel() for p in jobs.build_model(harness.parse_job(a.job), "cpu").parameters())
    loads = [load_before]

    def write(done: list) -> None:
        """The result so far (after every seed: a run cut short keeps the seeds it finished)."""
        result = {"date": report.now(), "machine": report.machine_info("cpu"), "wall_s": time.time() - t_start,
                  "load_before": load_before, "load_after": _load(), "load_per_run": loads[1:], "params": params,
                  "seeds_done": done,
                  "settings": {k: getattr(a, k) for k in ("seeds", "steps", "job", "faults", "mean_gap_s",
                                                          "min_gap_s", "max_gap_s", "deadline_s", "rejoin_s",
                                                          "nodes", "calibrate", "arms", "quick",
                                                          "object_store_mb")},
                  "env": {k: os.environ[k] for k in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
                                                      "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S",
                                                      "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")},
                  "schedules": {s: make_schedule(s, a.faults, a.mean_gap_s, a.min_gap_s, a.max_gap_s)
                                for s in a.seeds},
                  "calibration": cal, "runs": runs, "summary": summarize(runs), "definitions": DEFINITIONS}
        report.write_result(base, result, markdown, plot, echo=False)

    cluster = Cluster(tmp, a.nodes, log, a.object_store_mb)
    try:
        for i, seed in enumerate(a.seeds):
            sched = make_schedule(seed, a.faults, a.mean_gap_s, a.min_gap_s, a.max_gap_s)
            log(f"seed {seed}: schedule " + ", ".join(f"{f['kind']}@+{f['gap_s']}s(r{f['rank']})" for f in sched))
            ref = fit_arm(cluster, tmp, "ref", seed, [], a)
            seed_runs = [ref]
            loads.append(_load())
            c = statistics.median(ref["calibration"]["save_s"])
            step_s = statistics.fmean(ref["step_intervals_s"])
            every = young_daly_steps(c, mtbf(sched), step_s) if sched else 0   # no faults: no periodic save
            cal["save_s"].append(c)
            cal["mtbf_s"].append(mtbf(sched))
            cal["preemption_info_s"].append(statistics.median(ref["calibration"]["preemption_info_s"]))
            log(f"seed {seed}: ref {ref['wall_s']:.1f} s, step {step_s * 1000:.0f} ms, save {c * 1000:.0f} ms, "
                f"MTBF {mtbf(sched):.1f} s -> native saves every {every} steps (load {loads[-1]})")
            others = [x for x in ("ray_ckpt", "native") if x in a.arms]
            if i % 2:
                others.reverse()
            for arm in others:
                r = fit_arm(cluster, tmp, arm, seed, sched, a, every=every if arm == "native" else 0)
                seed_runs.append(r)
                loads.append(_load())
                log(f"seed {seed}: {arm} wall {r['wall_s'] or float('nan'):.1f} s, {len(r['faults'])} faults, "
                    f"lost {[x['steps_lost'] for x in r['recovery']]}, recovery "
                    f"{[x['recovery_s'] for x in r['recovery']]} s, error {r['error']} (load {loads[-1]})")
            for r in seed_runs:
                r["bitwise"] = None if r["arm"] == "ref" else bitwise(r["final"], ref["final"])
                r["steps_done"] = sum(1 for x, y in zip(r["steps"], r["steps"][1:]) if y[1] == x[1] + 1) + 1 \
                    if r["steps"] else 0
            for r in seed_runs:
                r.pop("final", None)
            runs.extend(seed_runs)
            write(a.seeds[:i + 1])
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    with open(base + ".md") as f:
        print(f.read(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
