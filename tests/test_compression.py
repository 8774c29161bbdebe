"""DDP compression hooks (top-k, int8): selection unit tests and a 2-process gloo run.

The distributed part spawns its processes once per module (a file:// rendezvous: no port to collide on), runs
every scenario in them, saves what each rank saw, and the tests below compare the ranks' results, and the results
of the same training under different DDP bucket layouts (the hooks compress per parameter, so they must agree).
"""
from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ray_ckpt.compression import Int8State, TopKState, int8_hook, select_topk, topk_count, topk_hook
from ray_ckpt.engine import grad_support as support
from tests import _training as T

RATIO = 0.01
STEPS = 3
SMALL_SAMPLE = 256  # buckets above 4 * 256 elements take the sampled path
BUCKET_CAP_MB = 0.005  # ~1.3k floats: four buckets (of 4-8k elements) for the MLP below


# ------------------------------------------------------------------------------------------------------------
# selection alone
# ------------------------------------------------------------------------------------------------------------


def _exact_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k).indices.sort().values


def test_topk_count():
    assert topk_count(10_000, 0.01) == 100
    assert topk_count(10_001, 0.01) == 101
    assert topk_count(5, 0.01) == 1
    assert topk_count(3, 1.0) == 3


def test_exact_selection_picks_largest_magnitudes():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=gen)
    k = 500
    got = select_topk(x, k, sampled=False)
    assert got.dtype == torch.int64 and got.numel() == k
    assert torch.equal(got, _exact_reference(x, k))
    assert torch.all(got[1:] > got[:-1])  # sorted, unique


@pytest.mark.parametrize("scale", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_sampled_selection_bounds(scale, ratio):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(400_000, generator=gen)
    if scale == "heavy_tailed":
        x = x * torch.exp(3 * torch.randn(400_000, generator=gen))
    k = topk_count(x.numel(), ratio)
    got = select_topk(x, k, sampled=True, sample_size=4096)
    assert got.numel() <= k
    assert got.numel() >= 0.95 * k
    assert torch.all(got[1:] > got[:-1])
    # whenever the candidates cover k, the trimmed result is the exact top-k
    if got.numel() == k:
        assert torch.equal(got, _exact_reference(x, k))


def test_sampled_selection_is_deterministic_for_a_seed():
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    a = select_topk(x, 3000, sample_size=1024, seed=7)
    b = select_topk(x, 3000, sample_size=1024, seed=7)
    assert torch.equal(a, b)


def test_selection_ties_nan_and_sparse_inputs():
    # ties are broken by position, so the choice is a function of the values alone
    assert select_topk(torch.ones(20), 5, sampled=False).tolist() == [0, 1, 2, 3, 4]
    # NaN / inf are kept (AMP's overflow check must still see them)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    x[5], x[7] = float("nan"), float("inf")
    for sampled in (True, False):
        got = select_topk(x, 2000, sampled=sampled, sample_size=1024).tolist()
        assert 5 in got and 7 in got and len(got) <= 2000
    # fewer non-zeros than k: exactly the non-zeros, never a zero
    z = torch.zeros(200_000)
    z[::1000] = torch.randn(200, generator=torch.Generator().manual_seed(5)) + 10
    for sampled in (True, False):
        got = select_topk(z, 2000, sampled=sampled, sample_size=1024)
        if sampled:
            assert torch.equal(got, torch.nonzero(z).squeeze(1))
        else:  # exact mode fills up to k with zeros, by position
            assert got.numel() == 2000 and set(torch.nonzero(z).squeeze(1).tolist()) <= set(got.tolist())


def test_selection_with_scratch_buffer():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(6))
    scratch = torch.empty_like(x)
    for sampled in (True, False):
        assert torch.equal(select_topk(x, 1000, sampled=sampled, sample_size=1024, out=scratch),
                           select_topk(x, 1000, sampled=sampled, sample_size=1024))


def test_state_validation():
    with pytest.raises(ValueError):
        TopKState(ratio=0.0)
    with pytest.raises(ValueError):
        TopKState(ratio=1.5)
    with pytest.raises(ValueError):
        select_topk(torch.ones(3), 0)


# ------------------------------------------------------------------------------------------------------------
# distributed run (spawned gloo processes)
# ------------------------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _recording(hook, state, log: dict):
    """Wrap ``hook``: per bucket, record its size, k, non-zeros after aggregation, parameters and layout."""

    def wrapped(st, bucket):
        buffer = bucket.buffer()
        n = buffer.numel()
        base, size = buffer.data_ptr(), buffer.element_size()
        offsets = [(g.data_ptr() - base) // size for g in bucket.gradients()]
        cumulative = [0]
        for g in bucket.gradients()[:-1]:
            cumulative.append(cumulative[-1] + g.numel())
        consecutive = offsets == cumulative and all(g.is_contiguous() for g in bucket.gradients())
        params = [id(p) for p in bucket.parameters()]
        index = bucket.index()
        fut = hook(st, bucket)

        def record(f):
            out = f.value()
            log[index] = {"numel": n, "nnz": int(torch.count_nonzero(out)), "params": params,
                          "consecutive": consecutive}
            return out

        return fut.then(record)

    return wrapped


def _run(rank: int, name: str, make_state, hook, group, raw: bool = False, bucket_cap_mb: float = BUCKET_CAP_MB,
         fresh_at: tuple[int, ...] = (), **ddp_kwargs) -> dict:
    """``STEPS`` SGD steps of the MLP under DDP with ``hook``; ``fresh_at``: steps before which the model is
    copied into a freshly constructed DDP (new state, new optimizer: plain SGD has no state), like a restore.
    A fresh DDP model uses its initial bucket layout for its first iteration, not the rebuilt one."""
    log: dict = {}

    def wrap(model):
        ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
        state = make_state(group)
        # raw: the hook itself, so DDP's signature check of register_comm_hook sees its annotations
        ddp.register_comm_hook(state, hook if raw else _recording(hook, state, log))
        return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05)

    model = _mlp()
    ddp, state, opt = wrap(model)
    steps = []
    support.clear()
    for step in range(STEPS):
        if step in fresh_at:
            model = copy.deepcopy(model)
            ddp, state, opt = wrap(model)
        params = list(model.parameters())
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        reference = copy.deepcopy(model)  # the local (uncompressed) gradient of this rank
        nn.functional.cross_entropy(reference(x), y).backward()
        log.clear()
        nn.functional.cross_entropy(ddp(x), y).backward()
        supports = {id(p): support.take(p) for p in params}
        steps.append({
            "grads": [p.grad.detach().clone() for p in params],
            "local": [p.grad.detach().clone() for p in reference.parameters()],
            "supports": [supports[id(p)] for p in params],
            "buckets": {i: dict(b) for i, b in log.items()},
            "param_ids": [id(p) for p in params],
            # the bucket layout, as positions in model.parameters(): comparable across model copies
            "layout": [[[id(p) for p in params].index(pid) for pid in log[i]["params"]] for i in sorted(log)],
        })
        opt.step()
        opt.zero_grad()
    result = {"steps": steps}
    if isinstance(state, TopKState):
        assert all(state.k_for(p.numel()) == topk_count(p.numel(), RATIO) for p in params)
        residuals = [state.residual(p) for p in params]
        assert all(r is None for r in residuals) or all(r.numel() == p.numel() for r, p in zip(residuals, params))
        result["residuals"] = [None if r is None else r.clone() for r in residuals]
        result["residual_nnz"] = sum(int(torch.count_nonzero(r)) for r in residuals if r is not None)
    return result


SCENARIOS = {
    # name: (state factory taking the group, hook, which group: "default" | "explicit", DDP kwargs)
    "topk_sampled": (lambda g: TopKState(ratio=RATIO, sample_size=SMALL_SAMPLE), topk_hook, "default", {}),
    "topk_exact": (lambda g: TopKState(g, ratio=RATIO, sampled=False), topk_hook, "explicit", {}),
    "topk_view": (lambda g: TopKState(g, ratio=RATIO, sample_size=SMALL_SAMPLE), topk_hook, "explicit",
                  {"gradient_as_bucket_view": True}),
    "topk_ef": (lambda g: TopKState(g, ratio=RATIO, error_feedback=True, sample_size=SMALL_SAMPLE), topk_hook,
                "explicit", {}),
    "int8": (lambda g: Int8State(g), int8_hook, "explicit", {}),
    # the same training under other bucket layouts: one bucket, or a fresh DDP (initial layout) at steps 1 and 2
    "topk_sampled_one_bucket": (lambda g: TopKState(ratio=RATIO, sample_size=SMALL_SAMPLE), topk_hook, "default",
                                {"bucket_cap_mb": 25}),
    "topk_sampled_fresh": (lambda g: TopKState(ratio=RATIO, sample_size=SMALL_SAMPLE), topk_hook, "default",
                           {"fresh_at": (1, 2)}),
    "topk_exact_one_bucket": (lambda g: TopKState(g, ratio=RATIO, sampled=False), topk_hook, "explicit",
                              {"bucket_cap_mb": 25}),
    "topk_ef_one_bucket": (lambda g: TopKState(g, ratio=RATIO, error_feedback=True, sample_size=SMALL_SAMPLE),
                           topk_hook, "explicit", {"bucket_cap_mb": 25}),
    "int8_one_bucket": (lambda g: Int8State(g), int8_hook, "explicit", {"bucket_cap_mb": 25}),
    "int8_fresh": (lambda g: Int8State(g), int8_hook, "explicit", {"fresh_at": (1, 2)}),
    "topk_raw": (lambda g: TopKState(ratio=RATIO, sample_size=SMALL_SAMPLE), topk_hook, "default", {"raw": True}),
    "int8_raw": (lambda g: Int8State(), int8_hook, "default", {"raw": True}),
}
SOLO_SCENARIOS = {  # on a one-rank subgroup: world size 1
    "solo_topk_exact": (lambda g: TopKState(g, ratio=RATIO, sampled=False), topk_hook),
    "solo_topk_sampled": (lambda g: TopKState(g, ratio=RATIO, sample_size=SMALL_SAMPLE), topk_hook),
    "solo_int8": (lambda g: Int8State(g), int8_hook),
}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with T.leaving_group():
        everyone = dist.new_group(list(range(world)))
        solo = dist.new_group([0])  # collective: every rank creates it, only rank 0 is a member
        results = {}
        for name, (make_state, hook, which, ddp_kwargs) in SCENARIOS.items():
            group = None if which == "default" else everyone
            results[name] = _run(rank, name, make_state, hook, group, **ddp_kwargs)
        if rank == 0:
            for name, (make_state, hook) in SOLO_SCENARIOS.items():
                results[name] = _run(rank, name, make_state, hook, solo)
        dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        T.spawn(_worker, args=(world, init_file, tmp), nprocs=world)
        yield [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_topk_steps(result: dict, rank_results: list[dict] | None = None) -> None:
    """Bounds and support of every step of one rank's top-k run; values against the local gradients."""
    for s, step in enumerate(result["steps"]):
        buckets = step["buckets"]
        assert buckets, "the hook did not run"
        total_numel = sum(b["numel"] for b in buckets.values())
        assert total_numel == sum(g.numel() for g in step["grads"])
        total_nnz = 0
        support_of = dict(zip(step["param_ids"], step["supports"]))
        grad_of = dict(zip(step["param_ids"], step["grads"]))
        for b in buckets.values():
            assert b["consecutive"], "bucket gradients are not consecutive contiguous views of the buffer"
            k = sum(topk_count(grad_of[pid].numel(), RATIO) for pid in b["params"])  # per parameter, summed
            assert b["nnz"] <= k
            total_nnz += b["nnz"]
            published = 0
            for pid in b["params"]:
                idx = support_of[pid]
                assert idx is not None and idx.dtype == torch.int64
                nonzero = torch.nonzero(grad_of[pid].view(-1)).squeeze(1)
                assert torch.isin(nonzero, idx).all(), "a non-zero gradient position is missing from the support"
                assert torch.all(idx[1:] > idx[:-1])
                assert idx.numel() == 0 or (0 <= int(idx[0]) and int(idx[-1]) < grad_of[pid].numel())
                assert idx.numel() <= topk_count(grad_of[pid].numel(), RATIO)  # layer-wise: k_p per parameter
                published += idx.numel()
            assert published <= k
        total_k = sum(topk_count(g.numel(), RATIO) for g in step["grads"])
        assert total_nnz <= total_k
        assert total_nnz >= 0.9 * total_k  # ~ ratio * numel, parameter by parameter
        assert abs(total_nnz - RATIO * total_numel) <= 0.1 * RATIO * total_numel + len(step["grads"])
        if rank_results is not None:  # every kept value is the rank-ordered mean of the ranks that sent it
            for p, g in enumerate(step["grads"]):
                locals_ = [rr["steps"][s]["local"][p] for rr in rank_results]
                world = len(locals_)
                options = []
                for mask in range(1, 2**world):
                    total = torch.zeros_like(g)
                    for r in range(world):
                        if mask >> r & 1:
                            total = total + locals_[r]
                    options.append(total / world)
                ok = torch.zeros_like(g, dtype=torch.bool)
                for option in options:
                    ok |= g == option
                assert ok[g != 0].all()


def _assert_identical_across_ranks(a: dict, b: dict) -> None:
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        for ga, gb in zip(sa["grads"], sb["grads"], strict=True):
            assert torch.equal(ga, gb)


@pytest.mark.parametrize("name", ["topk_sampled", "topk_exact", "topk_view", "topk_ef", "int8", "topk_raw",
                                  "int8_raw", "topk_sampled_one_bucket", "topk_sampled_fresh",
                                  "topk_exact_one_bucket", "topk_ef_one_bucket", "int8_one_bucket", "int8_fresh"])
@pytest.mark.procs
def test_gradients_bitwise_identical_across_ranks(runs, name):
    _assert_identical_across_ranks(runs[0][name], runs[1][name])


@pytest.mark.procs
@pytest.mark.parametrize("name", ["topk_sampled", "topk_exact", "topk_view"])
def test_topk_bounds_support_and_values(runs, name):
    last = runs[0][name]["steps"][-1]["buckets"]  # after DDP's rebuild: several buckets, all on the sampled path
    assert len(last) >= 3 and all(b["numel"] > 4 * SMALL_SAMPLE for b in last.values())
    for r in range(2):
        _check_topk_steps(runs[r][name], [runs[0][name], runs[1][name]])


@pytest.mark.parametrize("name, other", [
    ("topk_sampled", "topk_sampled_one_bucket"), ("topk_sampled", "topk_sampled_fresh"),
    ("topk_exact", "topk_exact_one_bucket"), ("topk_ef", "topk_ef_one_bucket"),
    ("int8", "int8_one_bucket"), ("int8", "int8_fresh")])
@pytest.mark.procs
def test_results_independent_of_bucket_layout(runs, name, other):
    """The same training under two bucket layouts gives bitwise identical gradients (and supports, residuals).

    ``*_one_bucket`` keeps every parameter in one bucket (after DDP's rebuild in reverse order) where the base
    run has four buckets; ``*_fresh`` copies the model into a freshly constructed DDP before steps 1 and 2, whose
    first iteration uses DDP's initial layout (one bucket, model order) where the long-running model uses its
    rebuilt one (four buckets): what a run restored from a checkpoint does. Compression per bucket would select
    and scale differently.
    """
    for r in range(2):
        a, b = runs[r][name], runs[r][other]
        for s, (sa, sb) in enumerate(zip(a["steps"], b["steps"], strict=True)):
            for p, (ga, gb) in enumerate(zip(sa["grads"], sb["grads"], strict=True)):
                assert torch.equal(ga, gb), f"{name} vs {other}: rank {r} step {s} parameter {p} differs"
            for ia, ib in zip(sa["supports"], sb["supports"], strict=True):
                assert (ia is None and ib is None) or torch.equal(ia, ib)
        # step 0 runs DDP's initial layout (one bucket) in both; steps 1 and 2 ran under different layouts
        assert [sa["layout"] != sb["layout"] for sa, sb in zip(a["steps"], b["steps"])] == [False, True, True]
        if "residuals" in a:  # error feedback: the residual belongs to the parameter, whatever its bucket
            for ra, rb in zip(a["residuals"], b["residuals"], strict=True):
                assert (ra is None and rb is None) or torch.equal(ra, rb)


@pytest.mark.procs
def test_raw_hooks_registered_directly(runs):
    """The unwrapped hooks pass DDP's annotation check and give the same gradients as the recorded runs."""
    for r in range(2):
        for raw, recorded in (("topk_raw", "topk_sampled"), ("int8_raw", "int8")):
            for a, b in zip(runs[r][raw]["steps"], runs[r][recorded]["steps"], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))
                if raw == "topk_raw":
                    for g, idx in zip(a["grads"], a["supports"], strict=True):
                        assert torch.isin(torch.nonzero(g.view(-1)).squeeze(1), idx).all()


@pytest.mark.procs
def test_topk_error_feedback(runs):
    for r in range(2):
        result = runs[r]["topk_ef"]
        assert result["residual_nnz"] > 0
        _check_topk_steps(result)
    # the residual changes what is sent: after the first step it differs from the plain run
    plain, ef = runs[0]["topk_sampled"]["steps"][-1]["grads"], runs[0]["topk_ef"]["steps"][-1]["grads"]
    assert any(not torch.equal(a, b) for a, b in zip(plain, ef))


@pytest.mark.procs
def test_int8_close_to_true_mean(runs):
    for s in range(STEPS):
        steps = [runs[r]["int8"]["steps"][s] for r in range(2)]
        for p, got in enumerate(steps[0]["grads"]):
            mean = (steps[0]["local"][p] + steps[1]["local"][p]) / 2
            # one scale per rank and parameter: each rank's error is at most half a step, max|x_p,r| / 254
            bound = sum(float(step["local"][p].abs().max()) for step in steps)
            assert torch.all((got - mean).abs() <= bound / 254 / 2 * (1 + 1e-5) + 1e-12)
        got = torch.cat([g.view(-1) for g in steps[0]["grads"]])
        mean = sum(torch.cat([g.view(-1) for g in step["local"]]) for step in steps) / 2
        # one absmax scale per parameter (not per bucket): a small-gradient layer is not quantized with the
        # step of the largest layer of its bucket, so the relative error stays small
        assert torch.linalg.vector_norm(got - mean) / torch.linalg.vector_norm(mean) < 0.05
    for r in range(2):
        assert all(s["supports"] == [None] * len(s["supports"]) for s in runs[r]["int8"]["steps"])


@pytest.mark.procs
def test_world_size_one(runs):
    assert set(SOLO_SCENARIOS) <= set(runs[0]) and not set(SOLO_SCENARIOS) & set(runs[1])
    for name in ("solo_topk_exact", "solo_topk_sampled"):
        _check_topk_steps(runs[0][name], [runs[0][name]])
    # exact top-k of a world of one keeps each parameter's own k largest, unchanged
    for step in runs[0]["solo_topk_exact"]["steps"]:
        for g, local in zip(step["grads"], step["local"]):
            k = topk_count(g.numel(), RATIO)
            assert int(torch.count_nonzero(g)) == k
            assert torch.equal(torch.nonzero(g.view(-1)).squeeze(1), _exact_reference(local.view(-1), k))
            assert torch.equal(g.view(-1)[g.view(-1) != 0], local.view(-1)[g.view(-1) != 0])
    for step in runs[0]["solo_int8"]["steps"]:
        for g, local in zip(step["grads"], step["local"]):
            scale = float(local.abs().max()) / 127  # this parameter's scale
            assert torch.all((g - local).abs() <= scale / 2 * (1 + 1e-5))
