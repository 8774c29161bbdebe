"""One benchmark *segment*: the training job under one configuration, in ``world`` data-parallel processes.

Runs in processes forked by :mod:`benchmarks.run` (one per rank, :func:`benchmarks.harness.rank_main`). Each
segment builds a fresh model, optimizer, scheduler and DDP wrapper (identical on every run: same seed, same
batches), trains ``warmup + steps`` steps with the configuration's saver called after every optimizer step, then
drains the saver (waits for everything in flight), and rank 0 measures recovery. Results are written as JSON
into the segment's directory.

Savers (what a configuration does after each step) live here too; every one implements::

    __init__(ctx)        after the model/optimizer/DDP exist, before the first step (every rank)
    after_step(step)     training thread, after optimizer.step() and scheduler.step()
    finish() -> dict     drain: wait until every checkpoint taken is on storage; byte counts
    recovery(ctx) -> dict   rank 0, process group gone: time the restores this saver offers (fresh objects)
    recover_latest(ctx) -> int   (classmethod, a fresh process after a crash) restore the latest state, its step
"""
from __future__ import annotations

import copy
import gc
import glob
import json
import os
import resource
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks import configs, harness, jobs

# ------------------------------------------------------------------------------------------------------------
# process helpers
# ------------------------------------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux ``clear_refs`` 5); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """RSS high-water mark of this process (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pick_device(kind: str, rank: int) -> torch.device:
    """``auto``: cuda:<rank % count> when CUDA is available, else cpu."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.path.getsize(os.path.join(root, fn))
            except OSError:
                pass
    return total


@dataclass
class Ctx:
    """What a saver sees: the segment's description and the live training objects."""

    seg: dict
    rank: int
    world: int
    device: torch.device
    cfg: configs.Config
    job: Any = None
    ddp: Any = None
    model: Any = None
    opt: Any = None
    sched: Any = None

    @property
    def dir(self) -> str:
        return self.seg["dir"]

    @property
    def total_steps(self) -> int:
        return self.seg["warmup"] + self.seg["steps"]

    @property
    def full_every(self) -> int:
        return self.cfg.full_every or self.seg["full_every"]

    def fresh(self, seed: int = 99):
        """A fresh model, optimizer and scheduler (as a restarted process would build them)."""
        spec = jobs.JobSpec(**self.seg["job"])
        model = jobs.build_model(spec, self.device, seed=seed)
        opt = jobs.make_optimizer(model, spec.lr, spec.kind)
        return model, opt, jobs.make_scheduler(opt, total=self.total_steps)


def timed(ctx: Ctx, fn, repeats: int) -> tuple[float, Any, list[float]]:
    """Median seconds of ``fn(model, optimizer, scheduler)`` on fresh objects (built outside the timing) over
    ``repeats`` runs, its last result, and every sample."""
    samples, out = [], None
    for _ in range(max(1, repeats)):
        fresh = ctx.fresh()
        t0 = time.perf_counter()
        out = fn(*fresh)
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2], out, samples


# ------------------------------------------------------------------------------------------------------------
# savers
# ------------------------------------------------------------------------------------------------------------
class Saver:
    def __init__(self, ctx: Ctx):
        self.ctx = ctx

    def after_step(self, step: int) -> None:
        pass

    def finish(self) -> dict:
        return {"bytes_loop": 0, "saves": 0}

    def recovery(self, ctx: Ctx) -> dict:
        return {}

    def aux_cpu_seconds(self) -> float:
        """CPU seconds used so far by helper processes this saver relies on (Ray actors); 0 if none."""
        return 0.0

    def aux_cpu_roles(self) -> dict:
        """CPU seconds used so far per helper role (e.g. ``{"replica": s}``); empty if none."""
        return {}

    @classmethod
    def recover_latest(cls, ctx: Ctx) -> int:
        raise NotImplementedError


class GCMeter:
    """Time the interpreter's garbage collector spends in this process while :attr:`on`: total, longest pause and
    collections per generation. A collection runs on whichever thread allocated last (holding the interpreter lock):
    the objects a checkpointer keeps alive per step make collections more frequent, and a full (generation 2)
    collection walks every tracked object of the process (400K in the MLP job: the model, torch, Ray)."""

    def __init__(self):
        self.on = False
        self.seconds = 0.0
        self.longest = 0.0
        self.counts = [0, 0, 0]
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self.longest = max(self.longest, dt)
        self.counts[info["generation"]] += 1

    def result(self) -> dict:
        gc.callbacks.remove(self._callback)
        return {"gc_s": self.seconds, "gc_longest_s": self.longest, "gc_collections": list(self.counts)}


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _full_state(model, opt, sched, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": step}


def _torch_load_into(path: str, model, opt, sched) -> int:
    sd = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    sched.load_state_dict(sd["scheduler"])
    return int(sd["step"])


class TorchFileSaver(Saver):
    """A saver whose checkpoint is one ``torch.save`` file, ``FILE`` in the segment's directory (rank 0)."""

    FILE = ""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.path = os.path.join(ctx.dir, self.FILE)

    def recovery(self, ctx):
        return _torch_load_recovery(ctx, self.path)

    @classmethod
    def recover_latest(cls, ctx):
        m, o, s = ctx.fresh()
        path = os.path.join(ctx.dir, cls.FILE)
        return _torch_load_into(path, m, o, s) if os.path.exists(path) else 0


class TorchSave(TorchFileSaver):
    """``torch.save`` of the full state every ``every`` steps (rank 0), temp file + ``os.replace``."""

    FILE = "torch_save.pt"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.bytes = 0
        self.saves = 0

    def after_step(self, step):
        if self.ctx.rank != 0 or step % self.ctx.cfg.every:
            return
        tmp = self.path + ".tmp"
        torch.save(_full_state(self.ctx.model, self.ctx.opt, self.ctx.sched, step), tmp)
        os.replace(tmp, self.path)
        self.bytes += os.path.getsize(self.path)
        self.saves += 1

    def finish(self):
        return {"bytes_loop": self.bytes, "saves": self.saves}


def _torch_load_recovery(ctx, path):
    if not os.path.exists(path):  # no save inside the loop (fewer steps than the period)
        return {}

    t, step, samples = timed(ctx, lambda m, o, s: _torch_load_into(path, m, o, s), ctx.seg["recover_repeats"])
    return {"torch_load": {"seconds": t, "step": step, "samples": samples}}


class CheckFreq(TorchFileSaver):
    """CheckFreq-style two-phase checkpoint: snapshot to preallocated host buffers (after the previous persist
    finished), then persist with ``torch.save`` in a background thread. Rank 0."""

    FILE = "checkfreq.pt"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.buffers: dict[str, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.bytes = 0
        self.saves = 0
        self.stall = 0.0
        self.error: BaseException | None = None

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                                  pin_memory=t.device.type == "cuda")
        buf.copy_(t.detach(), non_blocking=True)
        return buf

    def _snapshot(self, step: int) -> dict:
        model, opt, sched = self.ctx.model, self.ctx.opt, self.ctx.sched
        msd = {k: self._copy(f"m.{k}", v) for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        state = {pid: {k: (self._copy(f"o.{pid}.{k}", v) if isinstance(v, torch.Tensor) else v)
                       for k, v in st.items()} for pid, st in osd["state"].items()}
        sync(self.ctx.device)
        return {"model": msd, "optimizer": {"state": state, "param_groups": copy.deepcopy(osd["param_groups"])},
                "scheduler": sched.state_dict(), "step": step}

    def _persist(self, snap: dict) -> None:
        try:
            tmp = self.path + ".tmp"
            torch.save(snap, tmp)
            os.replace(tmp, self.path)
            self.bytes += os.path.getsize(self.path)
            self.saves += 1
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def _wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            raise RuntimeError(f"checkfreq persist failed: {self.error}") from self.error

    def after_step(self, step):
        if self.ctx.rank != 0 or step % self.ctx.cfg.every:
            return
        t0 = time.perf_counter()
        self._wait()  # the snapshot buffers are reused: the previous persist must be done
        self.stall += time.perf_counter() - t0
        snap = self._snapshot(step)
        self.thread = threading.Thread(target=self._persist, args=(snap,), daemon=True)
        self.thread.start()

    def finish(self):
        self._wait()
        return {"bytes_loop": self.bytes, "saves": self.saves, "stall_seconds": self.stall}


class AsyncDCP:
    """``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, optimizer)`` into
    ``root/step_<step>``, each save first waiting for the previous one's future (``stall`` counts that wait), the
    two latest kept. Every rank of the default group (its own gloo group for the planning collectives, as
    torchtitan does); rank 0 counts the bytes on storage. Training thread of a rank process."""

    def __init__(self, root: str, rank: int, every: int = 1):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        self.dcp, self.get_state_dict = dcp, get_state_dict
        self.group = dist.new_group(backend="gloo")
        self.root, self.rank, self.every = root, rank, every
        self.fut = None
        self.fut_step = None
        self.bytes = 0
        self.saves = 0
        self.stall = 0.0

    def dir(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:07d}")

    def wait(self) -> None:
        """Until the save in flight (if any) is on storage."""
        if self.fut is None:
            return
        self.fut.result()
        if self.rank == 0:
            self.bytes += dir_bytes(self.dir(self.fut_step))
            shutil.rmtree(self.dir(self.fut_step - 2 * self.every), ignore_errors=True)  # keep the two latest
        self.saves += 1
        self.fut = None

    def save(self, model, opt, step: int, extra: dict | None = None) -> None:
        """Wait for the previous save, then start one of ``model`` and ``opt`` (and ``extra``) at ``step``."""
        t0 = time.perf_counter()
        self.wait()
        self.stall += time.perf_counter() - t0
        msd, osd = self.get_state_dict(model, opt)
        out = self.dcp.async_save({"model": msd, "optim": osd, **(extra or {})}, checkpoint_id=self.dir(step),
                                  process_group=self.group)
        self.fut = getattr(out, "upload_completion", out)  # AsyncSaveResponse in newer torch, else a Future
        self.fut_step = step


class DCPAsync(Saver):
    """:class:`AsyncDCP` every ``every`` steps on every rank, the step in the state."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.root = os.path.join(ctx.dir, "dcp")
        self.writer = AsyncDCP(self.root, ctx.rank, ctx.cfg.every)

    def after_step(self, step):
        if step % self.ctx.cfg.every:
            return
        self.writer.save(self.ctx.ddp, self.ctx.opt, step, {"step": step})

    def finish(self):
        self.writer.wait()
        w = self.writer
        return {"bytes_loop": w.bytes, "saves": w.saves, "stall_seconds": w.stall}

    @staticmethod
    def _latest(root: str) -> str | None:
        done = sorted(d for d in glob.glob(os.path.join(root, "step_*")) if os.path.exists(os.path.join(d, ".metadata")))
        return done[-1] if done else None

    @classmethod
    def _load(cls, path, m, o, s):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(m, o)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=path, no_dist=True)
        set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
        return int(state["step"])

    def recovery(self, ctx):
        path = self._latest(self.root)
        if path is None:
            return {}
        t, step, samples = timed(ctx, lambda m, o, s: self._load(path, m, o, s), ctx.seg["recover_repeats"])
        return {"dcp_load": {"seconds": t, "step": step, "samples": samples}}

    @classmethod
    def recover_latest(cls, ctx):
        path = cls._latest(os.path.join(ctx.dir, "dcp"))
        return cls._load(path, *ctx.fresh()) if path else 0


class LowDiffSaver(Saver):
    """``ray_ckpt.Checkpointer`` on rank 0 (its hooks do the work; nothing to call per step)."""

    runtime = "local"
    extra_kwargs: dict = {}

    @classmethod
    def strategy(cls):
        import ray_ckpt
        return ray_ckpt.LowDiff()

    def __init__(self, ctx):
        super().__init__(ctx)
        self.ck = None
        if ctx.rank != 0:
            return
        import ray_ckpt
        seg = ctx.seg
        self.uri = os.path.join(ctx.dir, "ckpt")
        self.ck = ray_ckpt.Checkpointer(self.uri, ctx.ddp, ctx.opt, scheduler=ctx.sched, strategy=self.strategy(),
                                        full_every=ctx.full_every, batch_steps=seg["batch_steps"],
                                        runtime=self.runtime, run=seg.get("run"), **self.extra_kwargs)
        # the attach-time full (step 0: model only, the optimizer has no state yet) is written before the first
        # step, so that the loop's byte counts hold only what the loop itself persisted
        self.ck.flush()
        self.attach_full_bytes = self.ck.stats()["full_bytes"]

    def finish(self):
        if self.ck is None:
            return {"bytes_loop": 0, "saves": 0}
        self.ck.flush()
        st = self.ck.stats()
        self.ck.close()
        total = self.ctx.total_steps
        fe = self.ctx.full_every
        in_loop_fulls = total // fe  # the policy's fulls at multiples of full_every
        loop_full = st["full_bytes"] - self.attach_full_bytes
        per_full = loop_full / in_loop_fulls if in_loop_fulls else None
        return {"bytes_loop": st["diff_bytes"] + loop_full, "saves": total,
                "diff_bytes": st["diff_bytes"], "full_bytes": st["full_bytes"], "full_object_bytes": per_full,
                "attach_full_bytes": self.attach_full_bytes, "in_loop_fulls": in_loop_fulls, "stats": st}

    def _restore(self, ctx, step, runtime, m, o, s):
        import ray_ckpt
        return ray_ckpt.restore(self.uri, m, o, scheduler=s, step=step, runtime=runtime, run=ctx.seg.get("run"))

    def recovery(self, ctx):
        """Latest step, and the longest chain (the step before the first in-loop full: full_every-1 diffs)."""
        fe, total = ctx.full_every, ctx.total_steps
        points = {"latest": None, "chain": min(fe - 1, total)}
        if fe <= total:
            points["full"] = fe
        tiers = ["durable"] + (["memory"] if self.runtime == "ray" else [])
        out = {}
        for _ in range(max(1, ctx.seg["recover_repeats"])):
            for tier in tiers:  # alternate the tiers so drift cancels
                for pname, step in points.items():
                    fresh = ctx.fresh()
                    t0 = time.perf_counter()
                    got = self._restore(ctx, step, "ray" if tier == "memory" else "local", *fresh)
                    dt = time.perf_counter() - t0
                    e = out.setdefault(f"{tier}_{pname}", {"samples": [], "step": got})
                    e["samples"].append(dt)
        for e in out.values():
            e["seconds"] = sorted(e["samples"])[len(e["samples"]) // 2]
        return out

    @classmethod
    def recover_latest(cls, ctx):
        """The latest recoverable step; 0 (start over from the initial state) when nothing is committed."""
        import ray_ckpt
        m, o, s = ctx.fresh()
        try:
            return ray_ckpt.restore(os.path.join(ctx.dir, "ckpt"), m, o, scheduler=s, runtime=cls.runtime,
                                    run=ctx.seg.get("run"))
        except ray_ckpt.NoCheckpointError:
            return 0


class LowDiffRaySaver(LowDiffSaver):
    runtime = "ray"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.actor_pids: dict[str, int] = {}
        self.replica_lag: list[int] = []
        self._sampling = False
        if ctx.rank == 0:
            import ray
            from ray_ckpt.runtime import naming
            node = ray.get_runtime_context().get_node_id()
            for role, name in (("worker", naming.worker_name(ctx.seg["run"], node)),
                               ("coordinator", naming.coordinator_name(ctx.seg["run"])),
                               ("replica", naming.replica_name(ctx.seg["run"]))):
                try:
                    h = ray.get_actor(name, namespace=naming.NAMESPACE)
                    self.actor_pids[role] = ray.get(h.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
                except Exception:  # noqa: BLE001 - accounting only
                    pass
            if "replica" in self.actor_pids:   # the replica's lag behind the trainer, sampled twice a second
                import threading
                self._sampling = True
                # the replica's own status (a lock and a dict), not the coordinator's (which computes the lineage's
                # figures): the sampler must not add to the cost it measures
                self._replica = ray.get_actor(naming.replica_name(ctx.seg["run"]), namespace=naming.NAMESPACE)
                self._sampler = threading.Thread(target=self._sample_lag, daemon=True)
                self._sampler.start()

    def _sample_lag(self):
        import ray
        while self._sampling:
            try:
                rep = ray.get(self._replica.status.remote(), timeout=10)
                if rep.get("ok") and rep.get("step") is not None and self.ck is not None:
                    self.replica_lag.append(max(0, self.ck.step - rep["step"]))
            except Exception:  # noqa: BLE001 - accounting only
                pass
            time.sleep(0.5)

    def finish(self):
        self._sampling = False
        out = super().finish()
        if self.replica_lag:
            out["replica_lag"] = self.replica_lag
        return out

    def aux_cpu_roles(self) -> dict:
        out = {}
        for role, pid in self.actor_pids.items():
            try:
                out[role] = proc_cpu_seconds(pid)
            except OSError:
                pass
        return out

    def aux_cpu_seconds(self) -> float:
        return sum(self.aux_cpu_roles().values())

    def recovery(self, ctx):
        out = super().recovery(ctx)
        # the physical limit of a restore: copying the state's bytes once (every tensor of the model and
        # optimizer state cloned), measured in the same process right after the restores
        m, o, s = ctx.fresh()
        self._restore(ctx, None, "local", m, o, s)
        tensors = [t for t in m.state_dict().values() if torch.is_tensor(t)]
        tensors += [t for st in o.state_dict()["state"].values() for t in st.values() if torch.is_tensor(t)]
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            copies = [t.clone() for t in tensors]
            samples.append(time.perf_counter() - t0)
            del copies
        out["copy_state"] = {"samples": samples, "step": None, "seconds": sorted(samples)[len(samples) // 2]}
        return out


class LowDiffRayFullsSaver(LowDiffRaySaver):
    extra_kwargs = {"durable_diffs": "fulls"}


class LowDiffRayTrainerFullsSaver(LowDiffRaySaver):
    extra_kwargs = {"replica": False}


class AmberSaver(LowDiffSaver):
    @classmethod
    def strategy(cls):
        import ray_ckpt
        return ray_ckpt.Amber()


SAVERS: dict[str, type[Saver]] = {"none": Saver, "torch_save": TorchSave, "checkfreq": CheckFreq,
                                  "dcp_async": DCPAsync, "lowdiff": LowDiffSaver, "lowdiff_ray": LowDiffRaySaver,
                                  "lowdiff_ray_fulls": LowDiffRayFullsSaver,
                                  "lowdiff_ray_trainer_fulls": LowDiffRayTrainerFullsSaver,
                                  "amber": AmberSaver}


# ------------------------------------------------------------------------------------------------------------
# the training loop of a segment
# ------------------------------------------------------------------------------------------------------------
def make_ddp(model, device, *, bucket_cap_mb: float, hook: str, topk_ratio: float) -> DDP:
    """``model`` in DDP (the default process group), with the top-k 1% hook when ``hook == "topk"``."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb)
    if hook == "topk":
        from ray_ckpt.compression import TopKState, topk_hook
        ddp.register_comm_hook(TopKState(ratio=topk_ratio), topk_hook)
    return ddp


def build_training(ctx: Ctx) -> None:
    seg = ctx.seg
    ctx.job = jobs.build(jobs.JobSpec(**seg["job"]), ctx.device, seed=seg["seed"])
    ctx.model = ctx.job.model
    ctx.ddp = make_ddp(ctx.model, ctx.device, bucket_cap_mb=seg["bucket_cap_mb"], hook=ctx.cfg.hook,
                       topk_ratio=seg["topk_ratio"])
    ctx.opt = jobs.make_optimizer(ctx.model, ctx.job.spec.lr, ctx.job.spec.kind)
    ctx.sched = jobs.make_scheduler(ctx.opt, total=ctx.total_steps)


def segment_main(rank: int, seg: dict) -> None:
    """Entry of one forked rank process. Writes ``result_rank<r>.json`` (or ``error_rank<r>.json``)."""
    harness.rank_main(rank, seg["dir"], lambda out: _segment(rank, seg, out))


def _segment(rank: int, seg: dict, out: dict) -> None:
    t_fork = time.perf_counter()
    phase = out["phase_s"] = {}
    out["pid"] = os.getpid()
    reset_peak_rss()
    torch.set_num_threads(seg["threads"])
    world = seg["world"]
    device = pick_device(seg["device"], rank)
    cfg = configs.get(seg["config"])
    ctx = Ctx(seg=seg, rank=rank, world=world, device=device, cfg=cfg)
    harness.init_process_group(seg, rank, "nccl" if device.type == "cuda" else "gloo")
    if cfg.ray and rank == 0:
        harness.connect_ray(seg["ray_address"])
    build_training(ctx)
    saver = SAVERS[cfg.saver](ctx)
    phase["setup"] = time.perf_counter() - t_fork
    fail_at = seg.get("fail_at")
    times, thread_cpu = [], []
    gcm = GCMeter()
    dist.barrier()
    for step in range(ctx.total_steps):
        if step == seg["warmup"]:  # start of the measured window: CPU of this process and of helper actors
            cpu0, aux0, roles0 = time.process_time(), saver.aux_cpu_seconds(), saver.aux_cpu_roles()
            gcm.on = True
        t0, c0 = time.perf_counter(), time.thread_time()
        ctx.job.train_step(ctx.ddp, ctx.opt, ctx.sched, step, rank, device)
        saver.after_step(step + 1)
        sync(device)
        times.append(time.perf_counter() - t0)
        thread_cpu.append(time.thread_time() - c0)
        if fail_at is not None and rank == 0 and step + 1 == fail_at:
            with open(os.path.join(seg["dir"], "reached.json"), "w") as f:
                json.dump({"reached": step + 1}, f)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)  # a crash right after step `fail_at`: nothing is flushed
    gcm.on = False
    out.update(gcm.result())
    t0 = time.perf_counter()
    info = saver.finish()
    out["drain_s"] = time.perf_counter() - t0
    # CPU of the measured window, including the drain: work deferred to background threads/actors counts
    out["cpu_s"] = time.process_time() - cpu0
    out["aux_cpu_s"] = saver.aux_cpu_seconds() - aux0
    out["aux_cpu_roles_s"] = {k: v - roles0.get(k, 0.0) for k, v in saver.aux_cpu_roles().items()}
    out["thread_cpu_step_s"] = thread_cpu[seg["warmup"]:]
    dist.barrier()
    phase["train"] = sum(times) + out["drain_s"]
    out["step_s"] = times[seg["warmup"]:]
    out["warmup_s"] = times[:seg["warmup"]]
    out.update(info)
    out["full_ckpt_bytes"] = jobs.full_state_bytes(ctx.model, ctx.opt)
    out["param_count"] = sum(p.numel() for p in ctx.model.parameters())
    out["peak_rss_train"] = peak_rss_bytes()
    if rank == 0 and seg.get("measure_recovery", True):  # no collectives; the other ranks wait below
        t0 = time.perf_counter()
        out["recovery"] = saver.recovery(ctx)
        phase["recovery"] = time.perf_counter() - t0
    out["peak_rss"] = peak_rss_bytes()
    if cfg.ray and rank == 0:
        from ray_ckpt.runtime.coordinator import shutdown_run
        shutdown_run(seg["run"])
    dist.barrier()
    # no destroy_process_group(): tearing gloo down after a peer left can hang in ~ProcessGroupGloo (seen
    # here); segment_main ends the process with os._exit right after writing the result
    phase["total"] = time.perf_counter() - t_fork


def recover_main(seg: dict) -> None:
    """Entry of the process that recovers after an injected crash: restore the latest state, report its step
    (``recovered.json``)."""
    harness.process_main(seg["dir"], lambda out: _recover(seg, out), "recovered.json")


def _recover(seg: dict, out: dict) -> None:
    torch.set_num_threads(seg["threads"])
    cfg = configs.get(seg["config"])
    device = pick_device(seg["device"], 0)
    ctx = Ctx(seg=seg, rank=0, world=seg["world"], device=device, cfg=cfg)
    if cfg.ray:
        harness.connect_ray(seg["ray_address"])
    t0 = time.perf_counter()
    out["restored"] = SAVERS[cfg.saver].recover_latest(ctx)
    out["recover_s"] = time.perf_counter() - t0
    if cfg.ray:
        from ray_ckpt.runtime.coordinator import shutdown_run
        shutdown_run(seg["run"])
