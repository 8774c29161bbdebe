"""The benchmarks' process machinery, written once: job specs, the imports done before forking, forked rank
processes (JSON in: a dict each rank receives; JSON out: ``result_rank<r>.json`` or ``error_rank<r>.json``),
reaping them, their process group, and a private local Ray the ranks connect to.

Runs in the orchestrating process of every benchmark (``benchmarks.run``, ``benchmarks.paired``,
``benchmarks.fsdp``), except :func:`rank_main`, :func:`init_process_group` and :func:`connect_ray`, which run in a
forked rank process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

from benchmarks import jobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
#: the namespace every benchmark process joins the private Ray in
RAY_NAMESPACE = "ray_ckpt_bench"


def parse_job(s: str) -> jobs.JobSpec:
    """``kind:size:batch[:lr]``, e.g. ``gpt:10m:4`` or ``cnn:small:32``."""
    parts = s.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"job must be kind:size:batch[:lr], got {s!r}")
    spec = jobs.JobSpec(parts[0], parts[1], int(parts[2]), *(float(p) for p in parts[3:]))
    if spec.kind not in ("gpt", "cnn", "mlp"):
        raise argparse.ArgumentTypeError(f"job kind must be gpt, cnn or mlp, got {spec.kind!r}")
    return spec


def threads_per_rank(threads: int | None, world: int) -> int:
    """``threads`` when given, else the machine's cores shared out among ``world`` ranks (at least 1)."""
    return threads or max(1, (os.cpu_count() or 1) // world)


def preimport() -> None:
    """Import here, once, what the ranks would otherwise import after every fork: DDP's constructor alone
    pulls in torch._dynamo (sympy, ...), 10 s per process on a busy 2-core machine. Imports start no threads
    (checked), so forking stays clean; nothing here initializes Ray or runs torch compute."""
    import threading

    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.profiler  # noqa: F401

    import examples.gpt  # noqa: F401
    import ray_ckpt  # noqa: F401
    import ray_ckpt.compression  # noqa: F401
    try:
        import ray.train.torch  # noqa: F401
        import ray_ckpt.runtime.trainer.client  # noqa: F401
        import ray_ckpt.runtime.coordinator  # noqa: F401
    except ImportError:
        pass
    if threading.active_count() != 1:
        print(f"[bench] warning: {threading.active_count()} threads before forking", flush=True)


def logger(prefix: str, start: float | None = None):
    """A ``log(msg)`` printing ``[prefix <clock>] msg``: seconds since ``start`` when given, else the time of day."""
    def log(msg: str) -> None:
        clock = f"{time.time() - start:7.1f}s" if start is not None else time.strftime("%H:%M:%S")
        print(f"[{prefix} {clock}] {msg}", flush=True)
    return log


# ------------------------------------------------------------------------------------------------------------
# forked rank processes
# ------------------------------------------------------------------------------------------------------------
_FORK = mp.get_context("fork")


def spawn(target, args) -> mp.Process:
    """Fork one process running ``target(*args)`` (the orchestrator has imported torch; see :func:`preimport`)."""
    p = _FORK.Process(target=target, args=args, daemon=False)
    p.start()
    return p


def reap(procs, timeout, grace: float = 20.0) -> bool:
    """Wait for ``procs``; once one fails, give the others ``grace`` seconds (they may wait on it in a
    collective forever), then end them. False when something had to be killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        for p in procs:
            p.join(0.2)
    ok = not any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()  # our own child, by its handle
            p.join(10)
    return ok


def process_main(directory: str, body, name: str, error_name: str | None = None, out: dict | None = None) -> None:
    """The body of a process forked by a benchmark: ``body(out)`` fills the dict ``out``; it is written as JSON to
    ``directory/name``, or with the error and its traceback to ``directory/error_name`` (default: ``name``); then
    the process exits at once (1 when ``out`` holds an error, else 0; no atexit handlers of the parent's)."""
    out = {} if out is None else out
    try:
        body(out)
    except BaseException as e:  # noqa: BLE001 - reported to the orchestrator
        import traceback
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        name = error_name or name
    with open(os.path.join(directory, name), "w") as f:
        json.dump(out, f)
    os._exit(1 if out.get("error") else 0)


def rank_main(rank: int, directory: str, body) -> None:
    """:func:`process_main` of a rank: ``directory/result_rank<rank>.json`` or ``error_rank<rank>.json``."""
    process_main(directory, body, f"result_rank{rank}.json", f"error_rank{rank}.json", {"rank": rank})


def read_json(path):
    """The JSON in ``path``, or None when it is missing or unreadable (a process that died before writing)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rank_results(directory: str, world: int) -> tuple[list, list]:
    """``(results, errors)`` of ``world`` ranks that wrote into ``directory``: the result of each rank (None where
    it wrote none) and the error reports that were written."""
    results = [read_json(os.path.join(directory, f"result_rank{r}.json")) for r in range(world)]
    errors = [read_json(os.path.join(directory, f"error_rank{r}.json")) for r in range(world)]
    return results, [e for e in errors if e]


def _ranked(rank: int, body, cell: dict) -> None:
    rank_main(rank, cell["dir"], lambda out: body(rank, cell, out))


def run_ranks(body, cell: dict, timeout: float) -> list[dict]:
    """Fork ``cell["world"]`` ranks, each running ``body(rank, cell, out)`` (``out``: its JSON result), and reap
    them. Per rank: its result, its error report, or ``{"rank": r, "error": ...}`` when it wrote neither (killed
    or timed out)."""
    procs = [spawn(_ranked, (r, body, cell)) for r in range(cell["world"])]
    reap(procs, timeout)
    d = cell["dir"]
    return [read_json(os.path.join(d, f"result_rank{r}.json"))
                      or read_json(os.path.join(d, f"error_rank{r}.json"))
                      or {"rank": r, "error": "no result (killed or timed out)"} for r in range(cell["world"])]


# ------------------------------------------------------------------------------------------------------------
# inside a rank
# ------------------------------------------------------------------------------------------------------------
def init_process_group(cell: dict, rank: int, backend: str = "gloo") -> None:
    """Rank process: join the cell's process group (a file store in the cell's directory)."""
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"file://{cell['dir']}/pg_store", rank=rank,
                            world_size=cell["world"])


def close_process_group() -> None:
    """Rank process: leave the process group together (a barrier, then destroy): a rank that exits while its peer
    still talks to it aborts the peer."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def pin_prefix(core: int | None) -> list:
    """The command prefix that runs a process on ``core`` alone (``taskset``), or [] when ``core`` is None or the
    machine cannot (one core, no taskset)."""
    if core is None or not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        return []
    return ["taskset", "-c", str(core)]


def connect_ray(address: str) -> None:
    """Rank process: connect to the benchmark's private Ray (once)."""
    import ray
    if not ray.is_initialized():
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False, configure_logging=False)


# ------------------------------------------------------------------------------------------------------------
# a private local Ray
# ------------------------------------------------------------------------------------------------------------
class RayHost:
    """The orchestrator's handle on a private local Ray, hosted by the process ``python -m benchmarks.rayhost``:
    ``start()``, ``.address``, ``stop()``."""

    def __init__(self, temp_dir: str, num_cpus: int, object_store_bytes: int, pin: int | None = None):
        self.temp_dir, self.num_cpus, self.osm, self.pin = temp_dir, num_cpus, object_store_bytes, pin
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout: float = 120.0) -> str:
        os.makedirs(os.path.join(self.temp_dir, "ray"), exist_ok=True)
        env = dict(os.environ)
        env["RAY_TMPDIR"] = self.temp_dir  # where a plain ray.init() would look: ours, not /tmp/ray
        self.log = open(os.path.join(self.temp_dir, "rayhost.log"), "wb")
        self.proc = subprocess.Popen(pin_prefix(self.pin) + [sys.executable, "-m", "benchmarks.rayhost", os.path.join(self.temp_dir, "ray"),
                                      str(self.num_cpus), str(self.osm)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip().startswith(b"{"):
                break
            if self.proc.poll() is not None:
                break
        if not line.strip().startswith(b"{"):
            self.stop()
            try:
                with open(os.path.join(self.temp_dir, "rayhost.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
            except OSError:
                tail = ""
            raise RuntimeError(f"the benchmark's Ray cluster did not start:\n{tail}")
        self.address = json.loads(line)["address"]
        return self.address

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait(timeout=10)
        self.proc = None
        self.log.close()


@contextlib.contextmanager
def private_ray(temp_dir: str, num_cpus: int, object_store_mb: int, pin: int | None = None):
    """Orchestrator: a private one-node Ray, started before the ranks fork (they connect to its address; nothing
    Ray in this process), stopped on exit; with ``pin``, all its processes run on that core alone. Yields the
    :class:`RayHost` (``.address``)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # a private cluster; every process that joins agrees
    host = RayHost(temp_dir, num_cpus=num_cpus, object_store_bytes=object_store_mb << 20, pin=pin)
    host.start()
    try:
        yield host
    finally:
        host.stop()
