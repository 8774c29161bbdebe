"""Small deterministic training jobs shared by the tests (no pytest imports: also used in subprocesses)."""
from __future__ import annotations

import contextlib
import copy
import math
import os
import socket

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, d_out=8, batchnorm=False, dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.out(self.drop(F.gelu(self.fc2(F.gelu(self.bn(self.fc1(x)))))))


class TinyGPT(nn.Module):
    """A byte-level GPT-style decoder: token + position embeddings, causal self-attention blocks, LM head."""

    def __init__(self, vocab=256, d=32, layers=2, heads=2, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.ln(x))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "mlp_bn":
        return MLP(batchnorm=True)
    if kind == "mlp_do":                      # dropout: exact only when the RNG is restored exactly
        return MLP(dropout=0.3)
    if kind == "gpt":
        return TinyGPT()
    raise ValueError(kind)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    raise ValueError(kind)


def make_scheduler(opt, warmup=10, total=60):
    def lr_lambda(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def batch(kind: str, step: int, rank: int = 0, bs: int = 8):
    g = torch.Generator().manual_seed(100_003 * step + rank)
    if kind.startswith("mlp"):
        x = torch.randn(bs, 32, generator=g)
        y = torch.randint(0, 8, (bs,), generator=g)
        return x, y
    x = torch.randint(0, 256, (bs, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_fn(kind: str, model, xb):
    x, y = xb
    out = model(x)
    if kind.startswith("mlp"):
        return F.cross_entropy(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


DATASET = 512   # sample_batch draws indices into a fixed synthetic dataset of this many rows


def sample_batch(kind: str, rank: int = 0, bs: int = 8):
    """A batch whose rows are drawn with the *global* torch RNG (as a shuffling sampler does): a restored run
    reads the same rows only when the RNG state was restored exactly."""
    idx = torch.randint(0, DATASET, (bs,))
    g = torch.Generator().manual_seed(4242 + rank)
    if kind.startswith("mlp"):
        xs, ys = torch.randn(DATASET, 32, generator=g), torch.randint(0, 8, (DATASET,), generator=g)
        return xs[idx], ys[idx]
    tokens = torch.randint(0, 256, (DATASET, 17), generator=g)[idx]
    return tokens[:, :-1], tokens[:, 1:]


def train_step(kind, model, opt, sched, step, rank=0, clip=1.0, reseed=True):
    """One iteration of a typical loop; ``step`` is the 0-based index of the optimizer step being taken.
    ``reseed=False``: no per-step seeding; the batch is sampled with the global RNG (``sample_batch``) and
    dropout draws from it too, so only an exactly restored RNG continues the run bit for bit."""
    if reseed:
        torch.manual_seed(7919 * step + rank)  # per-step seeding (exercises the RNG path only)
        xb = batch(kind, step, rank)
    else:
        xb = sample_batch(kind, rank)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(kind, model, xb)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    if sched is not None:
        sched.step()
    return float(loss.detach())


def reference_states(steps: int, kind: str = "mlp") -> list:
    """The uninterrupted run's state after every step 0..steps (model, AdamW, the default scheduler)."""
    model = make_model(kind)
    opt = make_optimizer("adamw", model)
    sch = make_scheduler(opt)
    out = [snapshot(model, opt, sch)]
    for s in range(steps):
        train_step(kind, model, opt, sch, s)
        out.append(snapshot(model, opt, sch))
    return out


class Position:
    """A loop's data position as ``extra_state``: the iteration to run next."""

    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, d):
        self.pos = int(d["pos"])


def snapshot(model, opt, sched=None) -> dict:
    """A deep copy of everything restore must reproduce."""
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "sched": copy.deepcopy(sched.state_dict()) if sched is not None else None}


def assert_same(a: dict, b: dict, what: str = "") -> None:
    """Bitwise equality of two snapshots (torch.equal on every tensor, == on every scalar)."""
    _eq(a, b, what or "state")


def _eq(x, y, path):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor), f"{path}: tensor vs {type(y).__name__}"
        assert x.dtype == y.dtype and x.shape == y.shape, f"{path}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        assert torch.equal(x, y), f"{path}: tensors differ (max abs diff {(x.double() - y.double()).abs().max()})"
    elif isinstance(x, dict):
        xk = {k for k in x if k != "step" or not callable(x[k])}
        yk = {k for k in y if k != "step" or not callable(y[k])}
        assert xk == yk, f"{path}: keys {sorted(map(str, xk ^ yk))} differ"
        for k in xk:
            _eq(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), f"{path}: length {len(x)} vs {len(y)}"
        for i, (u, v) in enumerate(zip(x, y)):
            _eq(u, v, f"{path}[{i}]")
    elif callable(x):
        pass
    else:
        assert x == y or (x != x and y != y), f"{path}: {x!r} != {y!r}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


#: True in a rank process started by :func:`spawn` (set by :func:`_as_caller`)
_SPAWNED_RANK = False


def close_dist(*, together: bool = True) -> None:
    """Leave the gloo group (every process of the tests that joined one leaves through here, in that process).

    ``together`` (the default): after a barrier, so that no rank leaves while a peer still works on a collective
    with it (a rank that exits while its peer still talks to it can abort in gloo's threads: "terminate called
    without an active exception"). ``together=False``: at once, for a rank whose peers are gone or may be blocked
    elsewhere (a barrier would wait for them until gloo's timeout).

    In a rank process of :func:`spawn` the group is not destroyed: the process ends right after its function
    (``os._exit``, as a forkserver's child does) and gloo's group object with it, its destructor never run. That
    destructor deadlocked twice at the end of a DDP rank function (gloo's own group ends when the last
    reference goes, here DDP's, when the function's locals were freed after ``destroy_process_group``): it joins
    gloo's worker threads with the GIL held, and one of them waited for the GIL to free the tensors of DDP's last
    allgather, finished (the barrier had returned) but not yet released. Elsewhere (the test process, a Ray
    actor) the group is destroyed."""
    try:
        if together:
            torch.distributed.barrier()
    finally:
        if not _SPAWNED_RANK:
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def leaving_group():
    """``with leaving_group():`` the body in the process group this process has joined, which it then leaves
    through :func:`close_dist`: together when the body returned; at once when it raised (its peers may be
    blocked in another collective, or gone), the error re-raised."""
    try:
        yield
    except BaseException:
        close_dist(together=False)
        raise
    close_dist()


@contextlib.contextmanager
def dist_group(rank: int, world: int, port: int):
    """``with dist_group(rank, world, port):`` the body in a gloo group of ``world`` ranks (:func:`init_dist`),
    left as :func:`leaving_group` leaves it."""
    init_dist(rank, world, port)
    with leaving_group():
        yield


# Rank processes for the tests come from a forkserver that imported these once per session, instead of a fresh
# interpreter per rank (torch.multiprocessing.spawn): on 2 cores each fresh rank spends ~2 s of CPU importing torch.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp", "ray_ckpt", "ray_ckpt.api",
            "tests._training"]


def _as_caller(rank: int, env: dict, cwd: str, fn, *args) -> None:
    """A rank process: the caller's environment and working directory as of the ``spawn`` call (a forkserver's
    child inherits the server's, set when it started), then ``fn(rank, *args)``. SIGUSR1 prints every thread's
    Python stack to stderr (what :func:`spawn` does before it kills ranks that overran)."""
    import faulthandler
    import signal
    global _SPAWNED_RANK
    _SPAWNED_RANK = True
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)


#: the longest a group of test ranks may take (the longest takes ~20 s here): past it the ranks are killed and
#: the test fails, instead of the suite hanging on a rank stuck in a collective or in a group's teardown
SPAWN_TIMEOUT_S = 300.0


def spawn(fn, args: tuple = (), nprocs: int = 1, *, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``'s contract (``fn(rank, *args)`` in ``nprocs``
    processes; raises if one fails), the processes forked from a forkserver that preloaded torch and ray_ckpt.
    Raises ``TimeoutError`` (the ranks killed) when they have not all ended after ``timeout_s``. In the test
    process."""
    import multiprocessing
    import signal
    import time

    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload(_PRELOAD)    # read when the forkserver starts (the first call)
    ctx = mp.start_processes(_as_caller, args=(dict(os.environ), os.getcwd(), fn, *args), nprocs=nprocs,
                             join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):      # raises (the other ranks terminated) when a rank failed
        if time.monotonic() > deadline:
            alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for rank in alive:             # where each is stuck, on the test's stderr
                os.kill(ctx.processes[rank].pid, signal.SIGUSR1)
            time.sleep(2.0)
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(10)
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)}: ranks {alive} of {nprocs} still running after "
                               f"{timeout_s:.0f} s (killed)")
