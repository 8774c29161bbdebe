"""Amber: the error bound on random trajectories (fixed and adaptive thresholds), lossless bit-exactness,
merged == unmerged chains, optimizer-state modes, bf16, codecs, the chain policy and configuration errors."""
from __future__ import annotations

import math
import os

import pytest
import torch

import ray_ckpt
from ray_ckpt.engine.restore import resolve_and_load
from ray_ckpt.format import delta as D
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import MANIFESTS_DIR, Manifest
from ray_ckpt.policy.merge import ChainContext, CostChainPolicy
from ray_ckpt.storage import open_storage
from tests import _training as T


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention (the training and writer threads share 2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------------------
# random trajectories
class Walk(torch.nn.Module):
    """Parameters with every regime the rule must handle: slow drift, noise, zeros, sign flips, constants."""

    def __init__(self, seed: int, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(48, 40, generator=g) * 0.05
        b = torch.randn(300, generator=g)
        b[:60] = 0.0                                    # elements saved as exactly 0
        b[60:70] = 1e-30                                # tiny magnitudes
        self.a = torch.nn.Parameter(a.to(dtype))
        self.b = torch.nn.Parameter(b.to(dtype))
        self.c = torch.nn.Parameter(torch.tensor([0.5], dtype=dtype))   # one element: always exact


class RandomWalkOptimizer(torch.optim.Optimizer):
    """Moves every element by a random-walk regime fixed per element; keeps a 'mom' state and a step counter."""

    def __init__(self, params, seed: int):
        super().__init__(params, {"lr": 1.0})
        self.g = torch.Generator().manual_seed(seed + 1)
        self.regime = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["mom"] = torch.randn(p.shape, generator=self.g)
                    self.regime[p] = torch.randint(0, 6, p.shape, generator=self.g)
                st["step"] += 1
                z = torch.randn(p.shape, generator=self.g)
                r = self.regime[p]
                x = p.double()
                new = torch.where(r == 0, x * 1.004 + 1e-5 * z, x)                 # slow drift that accumulates
                new = torch.where(r == 1, x * (1 + 0.01 * z), new)                  # small noise
                new = torch.where(r == 2, x * (1 + 0.05 * z), new)                  # large noise
                new = torch.where(r == 3, x + 1e-3 * z * (torch.rand(p.shape, generator=self.g) < 0.3), new)
                flip = torch.rand(p.shape, generator=self.g) < 0.05
                new = torch.where((r == 5) & flip, -x, new)                         # sign flips
                p.copy_(new.to(p.dtype))                                            # regime 4: constant
                st["mom"].mul_(0.9).add_(z.to(st["mom"].dtype), alpha=0.1)


def _state(model, opt):
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "opt": {i: {k: v.clone() for k, v in st.items()}
                    for i, st in enumerate(opt.state.get(p, {}) for p in model.parameters())}}


def _excess(restored: torch.Tensor, true: torch.Tensor, thr: float, atol: float) -> float:
    """max(|restored − true| − (thr·|restored| + atol)) in float64; <= 0 means the bound holds everywhere."""
    r, x = restored.double(), true.double()
    return float(((r - x).abs() - (thr * r.abs() + atol)).max())


def _chain(uri, step):
    return resolve_and_load(open_storage(str(uri)), step, fallback=False)


@pytest.mark.parametrize("mode,seed", [("fixed", 0), ("fixed", 1), ("fixed", 2), ("adaptive", 0),
                                       ("adaptive", 1), ("atol", 0)])
def test_bound_holds_at_every_checkpointed_step(tmp_path, seed, mode):
    thr, opt_thr, atol = 0.02, 0.05, 0.0
    kw = {}
    if mode == "adaptive":
        thr = 0.005
        kw = {"budget_fraction": 0.02, "max_threshold": 0.08}
    if mode == "atol":
        atol = 1e-3
    cfg = ray_ckpt.Amber(threshold=thr, atol=atol, optimizer_state="threshold", optimizer_threshold=opt_thr,
                         optimizer_every=1, merge_after=2, **kw)
    model = Walk(seed)
    opt = RandomWalkOptimizer(model.parameters(), seed)
    steps = 36
    live = {0: _state(model, opt)}
    with ray_ckpt.Checkpointer(tmp_path, model, opt, strategy=cfg, full_every=16, batch_steps=3, keep_fulls=0) as ck:
        for s in range(steps):
            opt.step()
            live[s + 1] = _state(model, opt)
        assert ck._capture.merges > 0
    stale = 0
    for s in range(steps + 1):
        m2 = Walk(seed + 100)
        o2 = RandomWalkOptimizer(m2.parameters(), seed)
        assert ray_ckpt.restore(tmp_path, m2, o2, step=s) == s
        got = _state(m2, o2)
        chain = _chain(tmp_path, s)
        taus = chain.records[-1].thresholds if chain.records else {}
        for i, (name, true) in enumerate(live[s]["model"].items()):
            rest = got["model"][name]
            if true.numel() == 1 or not chain.records:
                assert torch.equal(rest, true), f"step {s} {name}: exact slot differs"
                continue
            tau = thr
            if mode == "adaptive":
                tau = taus[i]
                assert thr <= tau <= 0.08
            assert _excess(rest, true, tau, atol) <= 0, f"step {s} {name}: bound violated (tau={tau})"
            stale += int((rest != true).sum())
        for i, st in live[s]["opt"].items():
            if not st:
                continue
            assert torch.equal(got["opt"][i]["step"], st["step"])
            assert _excess(got["opt"][i]["mom"], st["mom"], opt_thr, atol) <= 0, f"step {s} mom {i}"
    assert stale > 0  # the test is not vacuous: restores do return stale (bounded) values


def test_adaptive_thresholds_track_the_budget(tmp_path):
    model = Walk(3)
    opt = RandomWalkOptimizer(model.parameters(), 3)
    cfg = ray_ckpt.Amber(threshold=0.0, budget_fraction=0.05, max_threshold=0.25, optimizer_state="full")
    with ray_ckpt.Checkpointer(tmp_path, model, opt, strategy=cfg, full_every=1000, batch_steps=5) as ck:
        for _ in range(30):
            opt.step()
    hist = [h for h in ck._capture.encoder.history if h["kind"] == "step"]
    budget = 0.05 * sum(p.numel() * p.element_size() for p in model.parameters())
    later = [h["param_bytes"] for h in hist[10:]]
    # the budget holds on average (sampled quantiles; the bound wins when even max_threshold selects more)
    assert sum(later) / len(later) <= 1.5 * budget


# ------------------------------------------------------------------------------------------------------------
# real training: lossless, merged, optimizer modes, bf16
def _train(uri, cfg, kind="mlp", steps=30, full_every=12, batch_steps=4, dtype=None, seed=0):
    model = T.make_model(kind, seed)
    if dtype is not None:
        model = model.to(dtype)
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt, total=steps)
    live = {0: T.snapshot(model, opt, sch)}
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, strategy=cfg, full_every=full_every,
                               batch_steps=batch_steps, keep_fulls=0) as ck:
        for s in range(steps):
            T.train_step(kind, model, opt, sch, s)
            live[s + 1] = T.snapshot(model, opt, sch)
        stats = {**ck.stats()["amber"], **ck.stats()}
    return live, stats


def _restore(uri, kind="mlp", step=None, dtype=None, steps=30):
    model = T.make_model(kind, seed=99)
    if dtype is not None:
        model = model.to(dtype)
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt, total=steps)
    got = ray_ckpt.restore(uri, model, opt, scheduler=sch, step=step)
    return got, T.snapshot(model, opt, sch)


@pytest.mark.parametrize("encoding", ["xor", "sparse"])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_lossless_restores_bit_exact_model_and_optimizer(tmp_path, encoding, kind):
    cfg = ray_ckpt.Amber(threshold=0, encoding=encoding, merge_after=2, full_ratio=None)
    live, stats = _train(tmp_path, cfg, kind)
    assert stats["merges"] > 0
    for s in [0, 1, 5, 11, 12, 13, 20, 23, 29, 30]:
        got, snap = _restore(tmp_path, kind, s)
        assert got == s
        T.assert_same(live[s], snap, f"{kind}/{encoding} step {s}")


@pytest.mark.parametrize("threshold", [0.0, 0.02])
def test_merged_chains_restore_the_same_state_as_unmerged(tmp_path, threshold):
    plain = ray_ckpt.Amber(threshold=threshold, merge_after=0, full_ratio=None)
    merged = ray_ckpt.Amber(threshold=threshold, merge_after=1, full_ratio=None)
    _, st_plain = _train(tmp_path / "plain", plain, full_every=100)
    _, st_merged = _train(tmp_path / "merged", merged, full_every=100)
    assert st_plain["merges"] == 0 and st_merged["merges"] >= 5
    lin_keys = os.listdir(tmp_path / "merged" / MANIFESTS_DIR)
    atomic = [Manifest.from_json((tmp_path / "merged" / MANIFESTS_DIR / k).read_bytes()) for k in lin_keys]
    atomic = [m for m in atomic if m.info.get("atomic")]
    assert atomic and all(m.first_step == 0 for m in atomic)
    # the latest step is recovered from one full + one merged increment
    plan = _chain(tmp_path / "merged", None).plan
    assert plan.step == 30 and len(plan.diffs) <= 2 and plan.diffs[0].info.get("atomic")
    merged_steps = {m.last_step for m in atomic}
    for s in [1, 4, 7, 8, 13, 16, 22, 29, 30]:
        _, a = _restore(tmp_path / "plain", step=s)
        _, b = _restore(tmp_path / "merged", step=s)
        T.assert_same(a, b, f"step {s}")
        if s in merged_steps:
            assert len(_chain(tmp_path / "merged", s).plan.diffs) == 1
    assert merged_steps & {8, 12, 16, 20, 24, 28}


def test_lossy_restore_at_several_steps_with_adamw_and_scheduler(tmp_path):
    cfg = ray_ckpt.Amber(threshold=0.02, optimizer_state="threshold", optimizer_threshold=0.1, optimizer_every=1)
    live, stats = _train(tmp_path, cfg, "gpt")
    for s in [3, 12, 17, 26, 30]:
        got, snap = _restore(tmp_path, "gpt", s)
        assert got == s
        assert snap["sched"] == live[s]["sched"]
        for k, v in live[s]["model"].items():
            assert _excess(snap["model"][k], v, 0.02, 0) <= 0, f"step {s} {k}"
        for i, st in live[s]["opt"]["state"].items():
            assert torch.equal(snap["opt"]["state"][i]["step"], st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert _excess(snap["opt"]["state"][i][key], st[key], 0.1, 0) <= 0, f"step {s} {key} {i}"
        assert snap["opt"]["param_groups"] == live[s]["opt"]["param_groups"]


def test_optimizer_state_on_the_full_schedule(tmp_path):
    cfg = ray_ckpt.Amber(threshold=0.02, optimizer_state="full", full_ratio=None)
    live, _ = _train(tmp_path, cfg, full_every=12)
    for s in [7, 12, 19]:
        _, snap = _restore(tmp_path, step=s)
        full = (s // 12) * 12
        for i, st in live[s]["opt"]["state"].items():
            assert torch.equal(snap["opt"]["state"][i]["step"], st["step"])          # counters: exact
            # moments: those of the latest full (created after the attach full: sent once, at step 1)
            T.assert_same(live[max(full, 1)]["opt"]["state"][i]["exp_avg"], snap["opt"]["state"][i]["exp_avg"])
        for k, v in live[s]["model"].items():
            assert _excess(snap["model"][k], v, 0.02, 0) <= 0


def test_optimizer_state_on_its_own_schedule(tmp_path):
    cfg = ray_ckpt.Amber(threshold=0.02, optimizer_state="lossless", optimizer_every=5, full_ratio=None)
    live, _ = _train(tmp_path, cfg, full_every=12)
    for s in [3, 9, 12, 14, 16, 23, 30]:
        _, snap = _restore(tmp_path, step=s)
        refreshed = max(5 * (s // 5), 12 * (s // 12), 1)   # latest multiple of 5, full, or creation (step 1)
        for i, st in live[s]["opt"]["state"].items():
            assert torch.equal(snap["opt"]["state"][i]["step"], st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                T.assert_same(live[refreshed]["opt"]["state"][i][key], snap["opt"]["state"][i][key], f"{s} {key}")


def test_bf16_weights(tmp_path):
    kw = dict(steps=16, full_every=8, batch_steps=3)
    live, _ = _train(tmp_path / "lossless", ray_ckpt.Amber(threshold=0), "gpt", dtype=torch.bfloat16, **kw)
    for s in [5, 10, 16]:
        _, snap = _restore(tmp_path / "lossless", "gpt", s, dtype=torch.bfloat16, steps=16)
        T.assert_same(live[s], snap, f"bf16 lossless step {s}")
    live, _ = _train(tmp_path / "lossy", ray_ckpt.Amber(threshold=0.02), "gpt", dtype=torch.bfloat16, **kw)
    for s in [5, 10, 16]:
        _, snap = _restore(tmp_path / "lossy", "gpt", s, dtype=torch.bfloat16, steps=16)
        for k, v in live[s]["model"].items():
            assert snap["model"][k].dtype == torch.bfloat16
            assert _excess(snap["model"][k], v, 0.02, 0) <= 0


def test_chain_policy_takes_a_full_when_the_merged_increment_is_large(tmp_path):
    live, stats = _train(tmp_path, ray_ckpt.Amber(threshold=0, full_ratio=0.3), full_every=1000)
    # how many depends on when the writer thread reports merged sizes (it runs concurrently): at least one
    assert stats["early_fulls"] >= 1
    fulls = [k for k in os.listdir(tmp_path / MANIFESTS_DIR) if "-full-" in k]
    assert len(fulls) == 1 + stats["early_fulls"]
    assert stats["trainer_fulls"] == len(fulls)     # Amber's snapshots are counted (attach full included)
    _, snap = _restore(tmp_path, step=30)
    T.assert_same(live[30], snap, "latest")


def test_a_missing_full_is_not_crossed_by_lossy_increments(tmp_path):
    _train(tmp_path / "lossy", ray_ckpt.Amber(threshold=0.02, full_ratio=None), full_every=12)
    (tmp_path / "lossy" / MANIFESTS_DIR / "g000001-full-000000000012.json").unlink()
    with pytest.raises(ValueError, match="restore step 12 or earlier"):
        _restore(tmp_path / "lossy", step=20)
    assert _restore(tmp_path / "lossy", step=12)[0] == 12   # reached through the older full's increments
    # lossless increments reproduce the full exactly: crossing it is exact
    live, _ = _train(tmp_path / "exact", ray_ckpt.Amber(threshold=0, full_ratio=None, merge_after=0), full_every=12)
    (tmp_path / "exact" / MANIFESTS_DIR / "g000001-full-000000000012.json").unlink()
    _, snap = _restore(tmp_path / "exact", step=20)
    T.assert_same(live[20], snap, "crossing a missing full losslessly")


# ------------------------------------------------------------------------------------------------------------
# codecs and the rule, directly
def test_significant_edge_cases():
    inf, nan = math.inf, math.nan
    ref = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, -0.0, inf, inf, nan, 1e-38, 1e-38, 2.0, -1.0])
    new = torch.tensor([1.0199, 1.0201, nan, 1e-9, -0.0, 0.0, inf, 1e30, nan, 1.1e-38, 1e-38, 1.97, 1.0])
    # saved 0 (a=0): any bit change, the sign of zero included, is written; equal NaN bits are not a change
    want = [False, True, True, True, True, True, False, True, False, True, False, False, True]
    got = D.significant(new, ref, 0.02).tolist()
    assert got == want
    assert D.significant(new, ref, 0.0).tolist() == [True, True, True, True, True, True, False, True, False,
                                                      True, False, True, True]
    # atol: small moves around 0 are not written
    assert D.significant(torch.tensor([5e-4, 2e-3]), torch.tensor([0.0, 0.0]), 0.02, 1e-3).tolist() == [False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("thr,atol", [(0.02, 0.0), (0.25, 0.0), (0.003, 0.0), (0.02, 1e-30), (0.0, 1e-3)])
def test_unwritten_elements_satisfy_the_bound_exactly(dtype, thr, atol):
    """Every element the rule leaves unwritten is within |x − r| ≤ τ·|r| + a in exact rational arithmetic,
    on values made to sit on the boundary: saved values from subnormal to huge, new values a few ulps either
    side of r·(1 ± τ) ± a, and specials. The rule must also write what is clearly outside the bound."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(7)
    fi = torch.finfo(dtype)
    mags = [fi.tiny * 2.0**-k for k in (0, 3, 10)] + [fi.tiny * 2.0**k for k in (0, 1, 5, 20)] + [1e-3, 1.0, 3.7,
                                                                                               fi.max / 8]
    r_list, x_list = [], []
    for m in mags:
        for sign in (1.0, -1.0):
            r = torch.tensor(sign * m, dtype=torch.float64).to(dtype)
            rv = float(r)
            for target in (rv * (1 + thr) + atol, rv * (1 - thr) - atol, rv * (1 - thr) + atol, rv + atol, rv):
                t = torch.tensor(target, dtype=torch.float64).to(dtype)
                for _ in range(4):      # a few ulps either side of the boundary
                    r_list.append(r)
                    x_list.append(t)
                    t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
                t = torch.tensor(target, dtype=torch.float64).to(dtype)
                for _ in range(4):
                    t = torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype))
                    r_list.append(r)
                    x_list.append(t)
    noise = torch.randn(200, generator=g, dtype=torch.float64)
    r_list += list(noise.to(dtype))
    x_list += list((noise * (1 + 4 * thr + 0.1) + 2 * atol * noise.sign()).to(dtype))   # outside every bound
    ref = torch.stack(r_list + [torch.tensor(v, dtype=dtype) for v in (math.inf, -math.inf, math.nan, 0.0)])
    x = torch.stack(x_list + [torch.tensor(v, dtype=dtype) for v in (1.0, -math.inf, math.nan, -0.0)])
    written = D.significant(x, ref, thr, atol)
    # the host (numpy) and device (torch ops) implementations of the rule agree bit for bit
    cdt, t, a = D._bound_constants(dtype, thr, atol)
    assert torch.equal(written, D._significant_device(x.reshape(-1), ref.reshape(-1), cdt, t, a))
    exact_bound_holds = 0
    for xi, ri, w in zip(x.tolist(), ref.tolist(), written.tolist()):
        if w:
            continue
        if xi == ri or (math.isnan(xi) and math.isnan(ri)):
            continue                                   # bitwise unchanged (checked below for the specials)
        assert math.isfinite(xi) and math.isfinite(ri), (xi, ri)
        lhs = abs(Fraction(xi) - Fraction(ri))
        rhs = Fraction(thr) * abs(Fraction(ri)) + Fraction(atol)
        assert lhs <= rhs, f"{dtype} thr={thr} atol={atol}: x={xi!r} r={ri!r} unwritten outside the bound"
        exact_bound_holds += 1
    if fi.eps < thr or atol:                           # (bfloat16's ulp is coarser than 0.3 %)
        assert exact_bound_holds > 20                  # boundary cases were really left unwritten
    # inf -> 1 written, -inf and NaN unchanged, +0 -> -0 written unless atol covers it
    assert written[-4:].tolist() == [True, False, False, atol == 0]
    assert bool(written[-204:-4].all())                # moved outside every bound tested: all written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_selection_and_codecs_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, 7, generator=g).to(dtype)
    x = (ref.double() * (1 + 0.03 * torch.randn(1000, 7, generator=g, dtype=torch.float64))).to(dtype)
    for density in ("sparse", "mask", "dense"):
        mask = D.significant(x, ref, {"sparse": 0.2, "mask": 0.03, "dense": 0.0}[density])
        k = int(mask.sum())
        d, _, _ = D.encode_selected(("p", 0, None), x, mask, k, thr=0.02)
        xo = D.encode_xor(("p", 0, None), x, ref, mask, k, level=1)
        for delta in (d, xo):
            rec = D.AmberRecord(step=2, base_step=1, deltas=[delta])
            back = D.decode_records(b"".join(bytes(b) for b in D.encode_records([rec])), "obj")[0].deltas[0]
            out = ref.clone()
            D.apply_delta(back, out)
            expect = torch.where(mask.view(ref.shape), x, ref)
            assert torch.equal(D.bits(out), D.bits(expect)), (dtype, density, delta.enc)
    bits = torch.rand(1001, generator=g) < 0.3
    assert torch.equal(D.unpack_bits(D.pack_bits(bits), 1001), bits)


def test_decode_refuses_malformed_deltas():
    x = torch.arange(10.0)
    d = D.SlotDelta("p", 0, None, "sparse", (10,), torch.float32, 3,
                    parts={"i": torch.tensor([7, 8, 10], dtype=torch.int32), "v": x[7:10]})   # out of range
    data = b"".join(bytes(b) for b in D.encode_records([D.AmberRecord(step=1, base_step=0, deltas=[d])]))
    with pytest.raises(CorruptObjectError, match="out of range"):
        D.decode_records(data, "obj")
    z = D.encode_xor(("p", 0, None), x, torch.zeros(10), None, 10, level=1)
    z.shape = (20,)                                               # planes too short for the claimed shape
    data = b"".join(bytes(b) for b in D.encode_records([D.AmberRecord(step=1, base_step=0, deltas=[z])]))
    with pytest.raises(CorruptObjectError, match="XOR (frame|plane)"):   # raw or compressed planes
        D.decode_records(data, "obj")


def test_chain_policy_is_pure_and_sensible():
    p = CostChainPolicy(merge_after=4, full_ratio=0.5)
    ctx = dict(step=10, full_bytes=1000, merged_bytes=100, chain_objects=1, chain_bytes=50, merged_objects=0,
               last_merged_bytes=0)
    d = p.decide(ChainContext(**ctx))
    assert not d.merge and not d.full
    d = p.decide(ChainContext(**{**ctx, "merged_bytes": 600}))
    assert d.full and not d.merge
    assert p.decide(ChainContext(**{**ctx, "chain_objects": 4})).merge
    assert p.decide(ChainContext(**{**ctx, "chain_objects": 2, "chain_bytes": 250})).merge      # mostly overwritten
    assert not p.decide(ChainContext(**{**ctx, "chain_objects": 2, "chain_bytes": 150})).merge
    assert not CostChainPolicy(merge_after=0, full_ratio=None).decide(ChainContext(**{**ctx, "chain_objects": 9})).merge


@pytest.mark.parametrize("kwargs,match", [
    ({"threshold": -0.1}, "threshold"), ({"threshold": 0.3}, "threshold"), ({"threshold": float("nan")}, "threshold"),
    ({"atol": 1e-40}, "atol"), ({"atol": -1.0}, "atol"), ({"optimizer_state": "sometimes"}, "optimizer_state"),
    ({"optimizer_state": "full", "optimizer_threshold": 0.1}, "optimizer_threshold"),
    ({"optimizer_threshold": 0.1}, "optimizer_threshold"),
    ({"optimizer_state": "threshold", "optimizer_threshold": 2.0}, "optimizer_threshold"),
    ({"optimizer_every": 0}, "optimizer_every"), ({"optimizer_state": "full", "optimizer_every": 5}, "optimizer_every"),
    ({"budget_fraction": 0.0}, "budget_fraction"),
    ({"budget_fraction": 0.01, "max_threshold": 0.01, "threshold": 0.02}, "max_threshold"),
    ({"budget_fraction": 0.01, "max_threshold": 0.5}, "max_threshold"), ({"encoding": "zip"}, "encoding"),
    ({"zstd_level": 0}, "zstd_level"), ({"merge_after": -1}, "merge_after"), ({"full_ratio": 0}, "full_ratio"),
])
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ray_ckpt.Amber(**kwargs)


def test_amber_is_public_and_accepted_by_the_checkpointer(tmp_path):
    assert "Amber" in ray_ckpt.__all__
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(tmp_path, model, opt, strategy=ray_ckpt.Amber()) as ck:
        T.train_step("mlp", model, opt, None, 0)
    assert ck.stats()["last_committed_step"] == 1
    m = Manifest.from_json(next((tmp_path / MANIFESTS_DIR).glob("*diff*")).read_bytes())
    assert m.strategy == "amber"
