"""One cell of :mod:`benchmarks.handoff`, in its own process: what recording a step (and handing over a full)
costs this training process, next to a copy of the same bytes.

The process holds two replicas of the cell's model: one attached to ``Checkpointer(uri, ..., runtime=...,
overhead_budget=0)`` (every step recorded; every other knob at its default), one plain. With ``runtime="ray"``
it first starts a private one-node Ray of its own (``ray.init(address="local", num_cpus=2, ...)``, in a temp
dir of its own). Phases, all on the training (main) thread:

1. baseline: plain steps (warm caches; the thread list before the Checkpointer exists);
2. attach, then warm-up: checkpointed steps until ``warm_steps`` steps or ``warm_s`` seconds (whichever first,
   at least 40 steps), so that the capture's buffer pools hold what the steady state needs; then the sink is
   drained (untimed), so no warm-up work spills into the rounds;
3. ``rounds`` rounds: a block of ``block`` checkpointed steps and a block of ``block`` plain steps, in ABBA order,
   then the copy floors; after the last round the sink is drained again, and what its threads spend on that
   drain is counted in the last round;
4. fulls (dense cells): ``full_reps`` interleaved pairs of a full taken through the capture and handed to the sink
   vs ``torch.save`` of the same state to a local file, after one untimed warm-up pair.

Per block: ``time.process_time()`` (the process), ``time.thread_time()`` (the training thread), wall time, and
every thread's CPU (``/proc/self/task/<tid>/schedstat``, nanoseconds), split into threads that existed before
the Checkpointer (Ray's, gloo's: *old*) and threads born after it (the writer or sender thread and the other
ray_ckpt threads: *new*). Per round, with ``n`` steps a block:

- ``extra_naive_s`` = (process CPU of the checkpointed block - that of the plain block) / n;
- ``extra_s`` = ``extra_naive_s`` + (2 x the new threads' CPU in the plain block + their CPU outside both blocks)
  / n: the background work a checkpointed block leaves behind (its last batch, written or handed over while the
  plain block runs) is checkpointing's, not the plain replica's. Over the rounds it counts every CPU second of
  the new threads, once, on the checkpointed steps;
- ``extra_thread_s`` = (training-thread CPU of the checkpointed block - that of the plain block) / n;
- ``threads``: where ``extra_s`` went, per thread name: the training thread's paired difference, the old
  threads' paired difference, the new threads' whole CPU in the round;
- ``copy_hot_s`` / ``copy_rot_s``: one ``torch._foreach_copy_`` of the step's recorded bytes into buffers already
  in memory, the same destination every time (cache-hot) or cycling over 16 (rotating); training-thread CPU,
  the mean of ``copy_reps`` copies. Dense: every gradient; top-k: each parameter's kept values (float32) and
  their positions (int32, as the writer stores them).
"""
from __future__ import annotations

import os
import threading
import time

from benchmarks import harness

#: size key -> (hidden width of the 784-h-h-10 MLP, top-k DDP hook)
MODELS = {"2.7": (512, False), "13": (1440, False), "44": (2944, False), "topk": (512, True)}
#: the top-k hook's ratio (LowDiff records ~1 % of the gradient)
TOPK_RATIO = 0.01
#: destinations the rotating copy cycles over
ROT_BUFFERS = 16


def build(hidden: int, seed: int = 0):
    """The Fashion-MNIST-shaped MLP 784-hidden-hidden-10 (as :func:`benchmarks.budget.build_mlp` at 512) and its
    SGD optimizer with momentum (seeded)."""
    import torch
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, hidden), torch.nn.ReLU(),
                            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    return m


def threads_now() -> dict:
    """``{tid: (name, cpu seconds)}`` of this process's threads: the scheduler's run time of each
    (``/proc/self/task/<tid>/schedstat``, ns), named by the Python thread of that native id, else by the kernel
    (``comm``); the main thread is ``training thread``. {} where /proc has no schedstat."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in map(int, tids):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[tid] = ("training thread" if tid == os.getpid() else name, ns / 1e9)
    return out


def _by_name(t0: dict, t1: dict, tids) -> dict:
    """CPU seconds of ``tids`` between the snapshots ``t0`` and ``t1``, summed by thread name."""
    out: dict = {}
    for tid in tids:
        if tid in t1:
            name, s = t1[tid]
            out[name] = out.get(name, 0.0) + s - t0.get(tid, (name, 0.0))[1]
    return out


class Cell:
    """The cell's state: the two replicas, their data and loss, the thread list before the Checkpointer."""

    def __init__(self, cell: dict):
        import torch
        torch.set_num_threads(1)
        self.cell, self.n = cell, cell["block"]
        hidden, self.topk = MODELS[cell["size"]]
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
                     for _ in range(16)]
        self.models = [build(hidden), build(hidden)]
        if self.topk:
            self._ddp(cell["dir"])
        self.ck_rep, self.plain_rep = [(m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
                                       for m in self.models]
        self.old_tids: set = set()

    def _ddp(self, d: str) -> None:
        """Top-k: both replicas in DDP over a 1-rank gloo group, with ray_ckpt's top-k hook."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from ray_ckpt import compression
        dist.init_process_group("gloo", init_method=f"file://{d}/pg_store", rank=0, world_size=1)
        self.models = [DDP(m) for m in self.models]
        for m in self.models:
            m.register_comm_hook(compression.TopKState(ratio=TOPK_RATIO), compression.topk_hook)

    def steps(self, rep, n: int) -> None:
        from benchmarks.budget import timed_steps
        timed_steps(*rep, self.data, n)

    def block(self, rep) -> dict:
        """One block of ``n`` steps of ``rep``: process / training-thread CPU, wall, and the thread snapshots."""
        th0 = threads_now()
        p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        self.steps(rep, self.n)
        w1, t1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        return {"process_s": p1 - p0, "thread_s": t1 - t0, "wall_s": w1 - w0, "_th": (th0, threads_now())}

    def split(self, b: dict) -> dict:
        """A block's thread snapshots as CPU by name: ``old`` threads (before the Checkpointer, the training thread
        left out) and ``new`` ones."""
        th0, th1 = b.pop("_th")
        others = [t for t in th1 if t != os.getpid()]
        b["old"] = _by_name(th0, th1, [t for t in others if t in self.old_tids])
        b["new"] = _by_name(th0, th1, [t for t in others if t not in self.old_tids])
        return b


# ------------------------------------------------------------------------------------------------------------
# the copy floors
# ------------------------------------------------------------------------------------------------------------
def floor_sources(c: Cell) -> list:
    """The tensors one recorded step's bytes are copied from: every gradient of the plain replica (dense), or per
    parameter its kept values (float32) and their positions (int32) (top-k)."""
    import torch
    from ray_ckpt.compression import topk_count
    grads = [p.grad for p in c.plain_rep[0].parameters()]
    if not c.topk:
        return grads
    out = []
    for g in grads:
        k = topk_count(g.numel(), TOPK_RATIO)
        out += [g.reshape(-1)[:k].clone(), torch.arange(k, dtype=torch.int32)]
    return out


def copy_floor(srcs: list, hot: list, rot: list, reps: int) -> tuple[float, float]:
    """Training-thread CPU of one ``torch._foreach_copy_`` of ``srcs`` into ``hot`` (the same buffers every time)
    and into ``rot`` (cycling over its sets), the mean of ``reps`` each."""
    import torch
    t0 = time.thread_time()
    for _ in range(reps):
        torch._foreach_copy_(hot, srcs)
    t1 = time.thread_time()
    for i in range(reps):
        torch._foreach_copy_(rot[i % len(rot)], srcs)
    return (t1 - t0) / reps, (time.thread_time() - t1) / reps


# ------------------------------------------------------------------------------------------------------------
# the phases
# ------------------------------------------------------------------------------------------------------------
def drain(ck) -> None:
    """Finalize the pending record and wait until the sink has handed over everything submitted (``runtime="ray"``:
    the node's worker answered every hand-off, ``wait_received``; ``runtime="local"``: written)."""
    ck._capture.flush_pending()
    ck._sink.wait_received()


def run_rounds(c: Cell, ck, floors: tuple) -> list:
    """The paired rounds (see the module docstring); one dict per round."""
    out = []
    srcs, hot, rot = floors
    for r in range(c.cell["rounds"]):
        order = ["ck", "plain"] if r % 2 == 0 else ["plain", "ck"]
        fulls0 = ck._capture.full_snapshots
        th_start = threads_now()
        blocks = {}
        for which in order:
            blocks[which] = c.block(c.ck_rep if which == "ck" else c.plain_rep)
            if which == "ck":
                blocks[which]["fulls"] = ck._capture.full_snapshots - fulls0
        edges = (th_start, blocks[order[0]]["_th"][0], blocks[order[0]]["_th"][1], blocks[order[1]]["_th"][0],
                 blocks[order[1]]["_th"][1])
        hot_s, rot_s = copy_floor(srcs, hot, rot, c.cell["copy_reps"])
        if r == c.cell["rounds"] - 1:
            drain(ck)   # the last checkpointed block's spill: counted here, as the other rounds' in their next
        gap = _gap(c, edges, threads_now())
        out.append(_round(c, order, blocks, gap, hot_s, rot_s))
    return out


def _gap(c: Cell, edges: tuple, th_end: dict) -> dict:
    """The new threads' CPU in the round outside both blocks (before the first, between them, after the second:
    the copy floors, the final drain), by name."""
    th_start, a0, a1, b0, b1 = edges
    new = [t for t in th_end if t not in c.old_tids and t != os.getpid()]
    out: dict = {}
    for x, y in ((th_start, a0), (a1, b0), (b1, th_end)):
        for k, v in _by_name(x, y, new).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _round(c: Cell, order: list, blocks: dict, gap: dict, hot_s: float, rot_s: float) -> dict:
    n = c.n
    ck, pl = c.split(blocks["ck"]), c.split(blocks["plain"])
    naive = (ck["process_s"] - pl["process_s"]) / n
    spill = (2 * sum(pl["new"].values()) + sum(gap.values())) / n
    threads = {"training thread": (ck["thread_s"] - pl["thread_s"]) / n}
    for name in set(ck["old"]) | set(pl["old"]):
        threads[name] = threads.get(name, 0.0) + (ck["old"].get(name, 0.0) - pl["old"].get(name, 0.0)) / n
    for part in (ck["new"], pl["new"], gap):
        for name, s in part.items():
            threads[name] = threads.get(name, 0.0) + s / n
    return {"order": "-".join(order), "steps": n, "ck": ck, "plain": pl, "gap_new": gap,
            "extra_naive_s": naive, "extra_s": naive + spill, "extra_thread_s": threads["training thread"],
            "copy_hot_s": hot_s, "copy_rot_s": rot_s, "threads": threads}


def run_fulls(c: Cell, ck, path: str) -> list:
    """``full_reps`` interleaved pairs (after one untimed pair): a full taken through the capture and handed to the
    sink (``snapshot_now`` + ``submit``, as the attach does; two checkpointed steps and a drain before each, so
    every full is of a new step and nothing else is in flight), and ``torch.save`` of the same model and
    optimizer state to a local file, then its fsync (the process's CPU, and the training thread's alone:
    ``save_thread_s``)."""
    import torch
    model, opt = c.ck_rep
    module = getattr(model, "module", model)
    out = []
    for i in range(c.cell["full_reps"] + 1):
        row = {}
        for which in (("ck", "save") if i % 2 == 0 else ("save", "ck")):
            if which == "ck":
                c.steps(c.ck_rep, 2)
                drain(ck)
                row.update(_full_via_capture(ck))
            else:
                p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
                with open(f"{path}.{i}", "wb") as f:
                    torch.save({"model": module.state_dict(), "optimizer": opt.state_dict()}, f)
                    p1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
                    f.flush()
                    os.fsync(f.fileno())
                row.update(save_cpu_s=p1 - p0, save_thread_s=t1 - t0, save_wall_s=w1 - w0,
                           save_bytes=os.path.getsize(f"{path}.{i}"),
                           save_fsync_cpu_s=time.process_time() - p0, save_fsync_wall_s=time.perf_counter() - w0)
                os.unlink(f"{path}.{i}")
        if i:
            out.append(row)
    return out


def _full_via_capture(ck) -> dict:
    """One full through the capture: what it blocks the training thread (wall, its CPU, the process's CPU from
    ``snapshot_now`` to ``submit``'s return), and the process's CPU until the sink has handed it over (written
    with ``runtime="local"``; answered by the node's worker with ``runtime="ray"``), by thread."""
    cap, sink = ck._capture, ck._sink
    th0 = threads_now()
    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    full = cap.snapshot_now()
    sink.submit(full)
    w1, t1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
    sink.wait_received()
    p2, w2 = time.process_time(), time.perf_counter()
    th1 = threads_now()
    threads = _by_name(th0, th1, [t for t in th1 if t != os.getpid()])
    return {"ck_block_wall_s": w1 - w0, "ck_block_thread_s": t1 - t0, "ck_block_process_s": p1 - p0,
            "ck_process_s": p2 - p0, "ck_wall_s": w2 - w0, "ck_full_bytes": full.nbytes,
            "ck_threads": {k: v for k, v in threads.items() if v > 0}}


def _pools(ck) -> dict:
    """Buffers the capture's pools allocated (misses) and reused (hits) so far."""
    cap = ck._capture
    out = {}
    for name, pool in (("packed", getattr(cap, "_packed_pool", None)), ("copier", cap._copy.pool)):
        if pool is not None:
            out[name] = {"allocated": pool.allocated, "reused": pool.reused}
    return out


def _warm_up(c: Cell, ck) -> dict:
    """Checkpointed steps (a plain block now and then) until ``warm_steps`` steps or ``warm_s`` seconds and, from
    then on, until the capture's pools allocated no buffer for ``max(2 x batch_steps, 3 x block)`` steps (the
    steady state: every buffer a batch in collection and one being written or handed over need), at most
    ``warm_max_s`` seconds; then a drain. Returns the steps, the seconds and whether the pools were quiet."""
    chunk = min(c.n, 20)
    steps, quiet_for, last, t0 = 0, 0, None, time.monotonic()
    while True:
        c.steps(c.ck_rep, chunk)
        steps += chunk
        if steps % (4 * chunk) == 0:
            c.steps(c.plain_rep, chunk)
        allocated = sum(p["allocated"] for p in _pools(ck).values())
        quiet_for = quiet_for + chunk if allocated == last else 0
        last = allocated
        elapsed = time.monotonic() - t0
        # (no pooled buffer at all: the top-k path gathers fresh tensors, nothing to warm)
        quiet = allocated == 0 or quiet_for >= max(2 * ck._capture.policy.batch_steps, 3 * c.n)
        if (quiet and (steps >= c.cell["warm_steps"] or elapsed >= c.cell["warm_s"])) \
                or elapsed >= c.cell["warm_max_s"]:
            break
    drain(ck)
    return {"steps": steps, "seconds": time.monotonic() - t0, "pools_quiet": quiet, "allocated": allocated}


def _floors(c: Cell) -> tuple:
    """The copy floor's sources and its destinations: one set (hot) and :data:`ROT_BUFFERS` sets (rotating)."""
    import torch
    srcs = floor_sources(c)
    hot = [torch.empty_like(x) for x in srcs]
    rot = [[torch.empty_like(x) for x in srcs] for _ in range(ROT_BUFFERS)]
    for dst in [hot] + rot:   # touched once: every page already in memory
        torch._foreach_copy_(dst, srcs)
    return srcs, hot, rot


def _start_ray(cell: dict) -> None:
    """A private one-node Ray in this process (its own temp dir; never another Ray on the machine)."""
    import ray
    ray.init(address="local", _temp_dir=os.path.join(cell["ray_tmp"], "ray"), num_cpus=2,
             object_store_memory=cell["object_store_mb"] << 20, include_dashboard=False,
             namespace=harness.RAY_NAMESPACE, log_to_driver=False, configure_logging=False)


def run_cell(cell: dict) -> dict:
    """The cell (see the module docstring): its rounds, fulls and counters."""
    import ray_ckpt
    out: dict = {"size": cell["size"], "runtime": cell["runtime"], "pid": os.getpid(),
                 "loadavg_start": os.getloadavg(), "ray_ckpt": ray_ckpt.__file__}
    c = Cell(cell)
    if cell["runtime"] == "ray":
        t0 = time.monotonic()
        _start_ray(cell)
        out["ray_start_s"] = time.monotonic() - t0
    c.steps(c.plain_rep, 3 * c.n)                                           # warm-up of the plain replica
    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    c.steps(c.plain_rep, 2 * c.n)
    out.update(plain_cpu_s=(time.process_time() - p0) / (2 * c.n),
               plain_thread_s=(time.thread_time() - t0) / (2 * c.n),
               plain_step_s=(time.perf_counter() - w0) / (2 * c.n))
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in c.models[0].parameters())
    c.old_tids = set(threads_now())
    kw = {"run": f"bench-handoff-{os.getpid()}"} if cell["runtime"] == "ray" else {}
    t0 = time.monotonic()
    ck = ray_ckpt.Checkpointer(os.path.join(cell["dir"], "ckpt"), c.ck_rep[0], c.ck_rep[1],
                               runtime=cell["runtime"], overhead_budget=0, **kw)
    out["attach_s"] = time.monotonic() - t0
    try:
        out["warm_up"] = _warm_up(c, ck)
        floors = _floors(c)
        out["floor_bytes"] = sum(x.numel() * x.element_size() for x in floors[0])
        s0, pools0 = ck.stats(), _pools(ck)
        out["batch_steps_before"] = s0["batch_steps"]
        out["rounds"] = run_rounds(c, ck, floors)
        s1, out["pools"] = ck.stats(), {"before_rounds": pools0, "after_rounds": _pools(ck)}
        ck_steps = sum(r["steps"] for r in out["rounds"])
        out.update(record_bytes_per_step=(s1["bytes_written"] - s0["bytes_written"]) / ck_steps,
                   fulls_in_rounds=s1["trainer_fulls"] - s0["trainer_fulls"], full_every=s1["full_every"],
                   batch_steps=s1["batch_steps"], stall_s=s1["stall_seconds"] - s0["stall_seconds"],
                   durable_diffs=s1.get("durable_diffs"))
        if cell["full_reps"] and not c.topk:
            out["fulls"] = run_fulls(c, ck, os.path.join(cell["dir"], "torch_save"))
        out["steps"] = ck.step
    finally:
        t0 = time.monotonic()
        try:
            ck.close()
            out["close_s"] = time.monotonic() - t0
        finally:
            if cell["runtime"] == "ray":
                import ray
                ray.shutdown()
    out["loadavg_end"] = os.getloadavg()
    return out


def child_main(path: str) -> int:
    """``python -m benchmarks.handoff --child cell.json``: run the cell, write its result (or its error) to
    ``cell["result"]``, exit at once."""
    cell = harness.read_json(path)
    harness.process_main(os.path.dirname(cell["result"]), lambda out: out.update(run_cell(cell)),
                         os.path.basename(cell["result"]))
    return 0
