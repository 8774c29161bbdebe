"""Single-process LowDiff: bit-exact restore at every kind of step, continuation, config errors."""
from __future__ import annotations


import pytest
import torch

import ray_ckpt
from tests import _training as T


def _run(tmp_path, kind="mlp", opt_kind="adamw", steps=60, full_every=25, batch_steps=7, sched=True, total=60,
         reseed=True, **kw):
    model = T.make_model(kind)
    opt = T.make_optimizer(opt_kind, model)
    sch = T.make_scheduler(opt, total=total) if sched else None
    uri = str(tmp_path / "ckpt")
    live = {0: T.snapshot(model, opt, sch)}
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=full_every,
                               batch_steps=batch_steps, **kw, recovery_every=1, keep_fulls=0) as ck:
        for s in range(steps):
            T.train_step(kind, model, opt, sch, s, reseed=reseed)
            live[s + 1] = T.snapshot(model, opt, sch)
        assert ck.step == steps
    return uri, live


def _restore(uri, kind, opt_kind, step, sched=True, steps=60, **kw):
    model = T.make_model(kind, seed=123)  # different init: everything must come from the checkpoint
    opt = T.make_optimizer(opt_kind, model)
    sch = T.make_scheduler(opt, total=steps) if sched else None
    got = ray_ckpt.restore(uri, model, opt, scheduler=sch, step=step, **kw)
    return got, model, opt, sch


@pytest.mark.parametrize("kind,opt_kind", [("mlp", "adamw"), ("gpt", "adamw"), ("mlp_bn", "sgd")])
def test_restore_bit_exact_at_every_kind_of_step(tmp_path, kind, opt_kind):
    uri, live = _run(tmp_path, kind, opt_kind)
    for s in [0, 1, 24, 25, 26, 33, 50, 59, 60]:
        got, model, opt, sch = _restore(uri, kind, opt_kind, s)
        assert got == s
        T.assert_same(live[s], T.snapshot(model, opt, sch), f"{kind}/{opt_kind} step {s}")
    got, model, opt, sch = _restore(uri, kind, opt_kind, None)
    assert got == 60
    T.assert_same(live[60], T.snapshot(model, opt, sch), "latest")


@pytest.mark.parametrize("kind,stop", [("gpt", 37), ("mlp_do", 37), ("mlp_do", 25), ("mlp_do", 50)])
def test_continue_after_restore_matches_uninterrupted(tmp_path, kind, stop):
    """No per-step reseeding: batches are sampled with the global RNG and (mlp_do) dropout draws from it, so the
    continued run matches only if model, optimizer, scheduler *and* RNG were restored exactly. Stops inside a
    diff batch (37), at a full (25) and right after a full's batch closed (50)."""
    torch.manual_seed(2024)
    _, live = _run(tmp_path / "ref", kind, reseed=False)
    torch.manual_seed(2024)
    uri, _ = _run(tmp_path / "a", kind, steps=stop, reseed=False)
    torch.manual_seed(999)           # a fresh process's RNG: restore must bring the run's back
    model2 = T.make_model(kind, seed=5)
    opt2 = T.make_optimizer("adamw", model2)
    sch2 = T.make_scheduler(opt2, total=60)
    assert ray_ckpt.restore(uri, model2, opt2, scheduler=sch2) == stop
    with ray_ckpt.Checkpointer(uri, model2, opt2, scheduler=sch2, full_every=25, batch_steps=7, recovery_every=1, keep_fulls=0) as ck:
        assert ck.step == stop  # numbering continues from the restored step
        for s in range(stop, 60):
            T.train_step(kind, model2, opt2, sch2, s, reseed=False)
    T.assert_same(live[60], T.snapshot(model2, opt2, sch2), "continued run")
    # and the resumed generation is now the latest timeline, restorable at every step
    got, m3, o3, s3 = _restore(uri, kind, "adamw", 55)
    assert got == 55
    T.assert_same(live[55], T.snapshot(m3, o3, s3), "step 55 of the resumed generation")


class _DataPos:
    def __init__(self):
        self.pos = 0
        self.epoch = 0

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, sd):
        self.pos, self.epoch = sd["pos"], sd["epoch"]


def test_extra_state_rng_and_scheduler_restored(tmp_path):
    import random
    import numpy as np
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    data = _DataPos()
    seen = {}
    with ray_ckpt.Checkpointer(tmp_path, model, opt, scheduler=sch, extra_state=data, full_every=10,
                               batch_steps=3, recovery_every=1, keep_fulls=0) as ck:
        for s in range(15):
            data.pos += 8
            T.train_step("mlp", model, opt, sch, s)
            seen[s + 1] = (torch.rand(3), random.random(), np.random.rand(), data.pos)
            # draws after the step: restore must give the RNG as it was right after optimizer.step()
    data2 = _DataPos()
    m2 = T.make_model("mlp", seed=3)
    o2 = T.make_optimizer("adamw", m2)
    s2 = T.make_scheduler(o2)
    assert ray_ckpt.restore(tmp_path, m2, o2, scheduler=s2, extra_state=data2, step=12) == 12
    t, r, n, pos = seen[12]
    assert data2.pos == pos
    assert s2.last_epoch == 12
    assert o2.param_groups[0]["lr"] == sch.lr_lambdas[0](12) * 3e-3
    assert torch.equal(torch.rand(3), t) and random.random() == r and np.random.rand() == n


def test_python_rng_restored_when_the_loop_draws_from_it_only_now_and_then(tmp_path):
    """The capture reuses the converted Python RNG words while they do not change: a restore at a step
    right after a draw, and at steps between draws, must each give the generator as it was at that step."""
    import random
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    random.seed(1234)
    seen = {}
    with ray_ckpt.Checkpointer(tmp_path, model, opt, full_every=100, batch_steps=4, recovery_every=1, keep_fulls=0):
        for s in range(12):
            if s in (4, 8, 9):
                random.random()           # the loop draws at these steps only
            T.train_step("mlp", model, opt, None, s)
            seen[s + 1] = random.getstate()
    for step in (3, 4, 5, 6, 9, 10, 11, 12):
        random.seed(99)                   # anything else: the restore must install the step's own state
        m2 = T.make_model("mlp", seed=3)
        o2 = T.make_optimizer("adamw", m2)
        assert ray_ckpt.restore(tmp_path, m2, o2, step=step) == step
        assert random.getstate() == seen[step], step


def test_sizes_and_stats(tmp_path):
    uri, _ = _run(tmp_path, "mlp", steps=10, full_every=5, batch_steps=5)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "manifests").iterdir())
    assert files == ["g000001-diff-000000000001-000000000005.json", "g000001-diff-000000000006-000000000010.json",
                     "g000001-full-000000000000.json", "g000001-full-000000000005.json",
                     "g000001-full-000000000010.json"]


def test_bad_configuration_is_refused(tmp_path):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with pytest.raises(ValueError, match="full_every"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, full_every=0)
    with pytest.raises(TypeError, match="optimizer"):
        ray_ckpt.Checkpointer(tmp_path, model, object())
    with pytest.raises(TypeError, match="state_dict"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, extra_state=object())
    with pytest.raises(ray_ckpt.NoCheckpointError):
        ray_ckpt.restore(tmp_path / "empty", model, opt)
    with ray_ckpt.Checkpointer(tmp_path, model, opt):
        with pytest.raises(RuntimeError, match="already has"):
            ray_ckpt.Checkpointer(tmp_path, model, opt)
        with pytest.raises(RuntimeError, match="restore first"):
            ray_ckpt.restore(tmp_path, model, opt)


def test_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_CKPT_FULL_EVERY", "3")
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(tmp_path, model, opt) as ck:
        assert ck.config.full_every == 3
    with ray_ckpt.Checkpointer(tmp_path / "b", model, opt, full_every=4) as ck:
        assert ck.config.full_every == 4  # explicit wins
    monkeypatch.setenv("RAY_CKPT_BATCH_STEPS", "many")
    with pytest.raises(ValueError, match="RAY_CKPT_BATCH_STEPS"):
        ray_ckpt.Checkpointer(tmp_path / "c", model, opt)


def test_topk_diff_bytes_are_a_small_fraction(tmp_path):
    """Top-k 1% (world size 1 DDP, the hook's support path): bytes per step diff <= 2.5% of parameter bytes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.gpt import GPT, ByteBatches, GPTConfig, stdlib_corpus
    from ray_ckpt import compression
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    with T.leaving_group():
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("small"))
        ddp = DDP(model)
        ddp.register_comm_hook(compression.TopKState(ratio=0.01), compression.topk_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = ByteBatches(stdlib_corpus(1 << 20), 64, 4)
        steps = 6
        with ray_ckpt.Checkpointer(tmp_path / "ck", ddp, opt, full_every=steps, batch_steps=steps, recovery_every=1, keep_fulls=0) as ck:
            for s in range(steps):
                x, y = data.get(s)
                opt.zero_grad()
                logits = ddp(x)
                torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).backward()
                opt.step()
        st = ck.stats()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_step = st["diff_bytes"] / steps
    assert per_step <= 0.025 * param_bytes, (per_step, param_bytes)
    # a full checkpoint with AdamW moments (step 6) is ~3x the parameters: a diff is >100x smaller
    full = (tmp_path / "ck" / "objects" / "g000001-full-000000000006.rckpt").stat().st_size
    assert full > 2.9 * param_bytes and full / per_step > 100
    print(f"top-k 1% diff: {per_step / param_bytes:.2%} of parameter bytes, 1/{full / per_step:.0f} of a full "
          f"checkpoint")


def test_recycled_capture_buffers_keep_every_step_exact(tmp_path):
    """The dense gradient copies go into recycled host buffers: one buffer per step holding every gradient (the
    capture's PackedPool, steps 1-20), or one per gradient (HostPool, the general path, steps 21-40); a buffer is
    reused only after its step was written, so every step still restores bit for bit while the pools are hit."""
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    uri = str(tmp_path / "ckpt")
    live = {0: T.snapshot(model, opt)}
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=1000, batch_steps=2, recovery_every=1, keep_fulls=0) as ck:
        packed = ck._capture._packed_pool
        assert packed is not None
        for s in range(40):
            if s == 20:
                ck._capture._packed_pool = None   # the general path from here on
            T.train_step("mlp", model, opt, None, s)
            live[s + 1] = T.snapshot(model, opt)
            if s % 5 == 4:
                ck.flush()    # written: their buffers go back to the pool before the next steps take some
        assert packed.reused > 0 and packed.allocated < 20
        pool = ck._capture._copy.pool
        assert pool.reused > 0 and pool.allocated < 20 * len(list(model.parameters()))
    for s in range(41):
        got, m2, o2, _ = _restore(uri, "mlp", "adamw", s, sched=False)
        assert got == s
        T.assert_same(live[s], T.snapshot(m2, o2), f"step {s}")


def test_recycled_full_buffers_keep_every_full_exact(tmp_path):
    """Full snapshots go into one full's worth of recycled host buffers (the capture's full pool): a buffer is
    reused only after its full was written, so every full restores bit for bit on its own while the pool is hit
    and no more than one full's bytes are kept."""
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    uri = str(tmp_path / "ckpt")
    live = {0: T.snapshot(model, opt)}
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=2, batch_steps=1, recovery_every=1, keep_fulls=0) as ck:
        for s in range(12):
            T.train_step("mlp", model, opt, None, s)
            live[s + 1] = T.snapshot(model, opt)
            ck.flush()    # each full written before the next is taken: its buffers go back to the pool
        pool = ck._capture._copy.full_pool
        n_tensors = len(model.state_dict()) + sum(len(v) for v in opt.state_dict()["state"].values())
        assert pool.reused >= 4 * n_tensors, (pool.reused, n_tensors)
        one_full = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
            t.numel() * t.element_size() for st in opt.state_dict()["state"].values() for t in st.values())
        assert pool.free_bytes <= pool.max_bytes <= one_full + 64 * n_tensors
    for s in range(0, 13, 2):   # each full alone (its diffs are not needed): the restore reads the full itself
        got, m2, o2, _ = _restore(uri, "mlp", "adamw", s, sched=False)
        assert got == s
        T.assert_same(live[s], T.snapshot(m2, o2), f"full of step {s}")


class _AliasingSGD(torch.optim.SGD):
    """An optimizer outside torch.optim that keeps a reference to each gradient it consumed."""

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                self.state.setdefault(p, {}).setdefault("seen", []).append(p.grad)
        return super().step(closure)


def _replay_records(n, seed=0):
    from ray_ckpt.format.records import GradEntry, StepRecord
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (8, 64)]
    recs = []
    for s in range(1, n + 1):
        grads = []
        for i, sh in enumerate(shapes):
            v = torch.randn(sh, generator=g)
            if i == 2 and s % 2:   # a sparse entry every other step
                idx = torch.randperm(v.numel(), generator=g)[:20].sort().values.to(torch.int32)
                grads.append(GradEntry(sh, v.reshape(-1)[idx.long()].clone(), idx))
            else:
                grads.append(GradEntry(sh, v))
        recs.append(StepRecord(step=s, grads=grads, hparams=[{"lr": 0.01 * s, "momentum": 0.9}], loop={}))
    return shapes, recs


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, _AliasingSGD])
def test_replay_reuses_gradient_tensors_only_where_exact(opt_cls):
    """advance() writes each step's gradients into the previous step's tensors for torch's own optimizers (no
    fresh multi-MB block per step), and hands every step fresh tensors to one that might keep them; both replays
    end bitwise where a replay with a fresh tensor per gradient does."""
    from ray_ckpt.engine.lowdiff import LowDiffImpl
    shapes, recs = _replay_records(6)

    def fresh_params():
        torch.manual_seed(1)
        return [torch.nn.Parameter(torch.randn(sh)) for sh in shapes]

    ref = fresh_params()
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for r in recs:
        ref_opt.param_groups[0].update(r.hparams[0])
        for p, e in zip(ref, r.grads):
            p.grad = e.to_dense().clone()
        ref_opt.step()

    params = fresh_params()
    opt = opt_cls(params, lr=0.1, momentum=0.9)
    LowDiffImpl(ray_ckpt.LowDiff()).advance(recs, None, opt, 0)
    for a, b in zip(params, ref):
        assert torch.equal(a.detach(), b.detach())
    assert all(p.grad is None for p in params)
    if opt_cls is _AliasingSGD:
        seen = opt.state[params[0]]["seen"]
        assert len({id(t) for t in seen}) == len(recs)          # a fresh tensor per step
        for t, r in zip(seen, recs):
            assert torch.equal(t, r.grads[0].to_dense())          # still that step's values


def test_a_lineage_checksummed_with_crc32_restores_and_continues(tmp_path, monkeypatch):
    """Objects written before CRC-32C (zlib's CRC-32, manifests without ``crc_alg``) restore bit-exact; the run
    continues on the same lineage with CRC-32C objects, and restores across both kinds are exact and verified."""
    import json

    from ray_ckpt.format import checksum
    monkeypatch.setattr(checksum, "DEFAULT", "crc32")
    uri, live = _run(tmp_path, "mlp", "adamw", steps=30, full_every=25, batch_steps=4)
    mdir = tmp_path / "ckpt" / "manifests"
    for p in mdir.glob("*.json"):            # as a ray_ckpt before CRC-32C wrote them (and can read them)
        d = json.loads(p.read_text())
        assert "crc_alg" not in d and d["format"] == 1
    monkeypatch.setattr(checksum, "DEFAULT", "crc32c")
    for s in (0, 10, 27, 30):
        got, model, opt, sch = _restore(uri, "mlp", "adamw", s)
        assert got == s
        T.assert_same(live[s], T.snapshot(model, opt, sch), f"crc32 lineage step {s}")
    got, model, opt, sch = _restore(uri, "mlp", "adamw", None)
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=25, batch_steps=4, recovery_every=1, keep_fulls=0) as ck:
        for s in range(30, 40):
            T.train_step("mlp", model, opt, sch, s)
        assert ck.step == 40
    algs = {(d.get("crc_alg", "crc32"), d["format"]) for d in (json.loads(p.read_text()) for p in mdir.glob("*.json"))}
    assert algs == {("crc32", 1), ("crc32c", 2)}   # a version before CRC-32C refuses format 2: "upgrade ray_ckpt"
    want = T.snapshot(model, opt, sch)
    got, model, opt, sch = _restore(uri, "mlp", "adamw", None)
    assert got == 40
    T.assert_same(want, T.snapshot(model, opt, sch), "continued on CRC-32C")
    obj = next(p for p in (tmp_path / "ckpt" / "objects").glob("*.rckpt") if "g000002" in p.name)
    raw = bytearray(obj.read_bytes())
    raw[-5] ^= 0x10
    obj.write_bytes(bytes(raw))
    with pytest.raises(ray_ckpt.CorruptObjectError):   # a CRC-32C object is verified as well
        _restore(uri, "mlp", "adamw", 40, fallback=False)
