"""Worker bodies for the FSDP2 (sharded state) tests: gloo processes spawned by tests/test_sharded.py; an assert
fails the process and so the test. References are written to the test's folder as torch.save files."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import ray_ckpt
from tests import _training as T

KIND = "gpt"          # TinyGPT: embeddings, attention blocks, LayerNorm, LM head (uneven shards at 3 ranks)
STEPS = 20
FULL_EVERY = 6
BATCH = 4
CHECK = [0, 5, 6, 13, 18, 20]
RESUME_AT = 13


def fsdp_model(seed: int):
    from torch.distributed.fsdp import fully_shard
    model = T.make_model(KIND, seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt, total=STEPS)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def local_snapshot(model, opt, sch) -> dict:
    """This rank's shards of everything a restore must reproduce (deep copies)."""
    osd = opt.state_dict()
    return {"model": {k: _local(v).detach().clone() for k, v in model.state_dict().items()},
            "opt": {"state": {i: {k: _local(v).clone() for k, v in st.items()} for i, st in osd["state"].items()},
                    "param_groups": [dict(g) for g in osd["param_groups"]]},
            "sched": sch.state_dict()}


def global_snapshot(model, opt) -> dict:
    """The gathered global state (a collective: every rank calls it)."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    osd = opt.state_dict()
    return {"model": {k: full(v).detach() for k, v in model.state_dict().items()},
            "opt": {i: {k: full(v) for k, v in st.items()} for i, st in osd["state"].items()}}


def _train_recording(model, opt, sch, rank) -> tuple[dict, dict]:
    """Train STEPS steps; this rank's shards and the gathered global state before the first and after every step
    (collective: every rank calls it)."""
    local = {0: local_snapshot(model, opt, sch)}
    glob = {0: global_snapshot(model, opt)}
    for s in range(STEPS):
        T.train_step(KIND, model, opt, sch, s, rank)
        local[s + 1] = local_snapshot(model, opt, sch)
        glob[s + 1] = global_snapshot(model, opt)
    return local, glob


def train_and_restore(rank, world, port, uri, out):
    """World 2: train STEPS steps with a Checkpointer on every rank; restore each CHECK step into fresh FSDP2
    objects (bitwise against this rank's live shards); resume from RESUME_AT with a new Checkpointer attached,
    train to the end and check the continuation and the new generation's latest step."""
    with T.dist_group(rank, world, port):
        model, opt, sch = fsdp_model(0)
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=FULL_EVERY, batch_steps=BATCH,
                                   policy="fixed", keep_fulls=0)
        assert ck.shard_spec is not None and ck.shard_spec.world == world
        local, glob = _train_recording(model, opt, sch, rank)
        ck.close()
        torch.save(local, os.path.join(out, f"local-{rank}.pt"))
        if rank == 0:
            torch.save(glob, os.path.join(out, "global.pt"))
        dist.barrier()
        for s in CHECK:
            m2, o2, s2 = fsdp_model(99)
            assert ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=s) == s
            T.assert_same(local[s], local_snapshot(m2, o2, s2), f"rank {rank} step {s}")
        m2, o2, s2 = fsdp_model(42)
        assert ray_ckpt.restore(uri, m2, o2, scheduler=s2) == STEPS   # latest
        T.assert_same(local[STEPS], local_snapshot(m2, o2, s2), f"rank {rank} latest")
        dist.barrier()   # every rank has read the lineage before any rank writes a new generation
        # continuation: restore RESUME_AT, attach again (a new generation of every shard lineage), train on
        m3, o3, s3 = fsdp_model(7)
        assert ray_ckpt.restore(uri, m3, o3, scheduler=s3, step=RESUME_AT) == RESUME_AT
        with ray_ckpt.Checkpointer(uri, m3, o3, scheduler=s3, full_every=FULL_EVERY, batch_steps=BATCH,
                                   policy="fixed", keep_fulls=0):
            for s in range(RESUME_AT, STEPS):
                T.train_step(KIND, m3, o3, s3, s, rank)
        T.assert_same(local[STEPS], local_snapshot(m3, o3, s3), f"rank {rank} continued from {RESUME_AT}")
        dist.barrier()   # every rank's shard lineage is closed (complete) before any rank reads the latest step
        m4, o4, s4 = fsdp_model(5)
        assert ray_ckpt.restore(uri, m4, o4, scheduler=s4) == STEPS
        T.assert_same(local[STEPS], local_snapshot(m4, o4, s4), f"rank {rank} latest after the continuation")
        dist.barrier()


def restore_at_world(rank, world, port, uri, out, steps):
    """Another world size: restore each of ``steps`` and compare the gathered global state with the saved
    world's, bitwise; then the latest step."""
    with T.dist_group(rank, world, port):
        glob = torch.load(os.path.join(out, "global.pt"), weights_only=False)
        for s in list(steps) + [None]:
            m2, o2, s2 = fsdp_model(99)
            got = ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=s)
            assert got == (STEPS if s is None else s), (got, s)
            g = global_snapshot(m2, o2)
            T.assert_same(glob[got], g, f"world {world} rank {rank} step {got}")
            assert s2.state_dict()["last_epoch"] == got
        dist.barrier()


def missing_shard(rank, world, port, uri, out, expect):
    """A lineage where rank 1 lacks its newest diff: the latest step restored is the newest every rank holds,
    and the step only rank 0 holds is refused."""
    with T.dist_group(rank, world, port):
        local = torch.load(os.path.join(out, f"local-{rank}.pt"), weights_only=False)
        m2, o2, s2 = fsdp_model(99)
        assert ray_ckpt.restore(uri, m2, o2, scheduler=s2) == expect
        T.assert_same(local[expect], local_snapshot(m2, o2, s2), f"rank {rank} step {expect}")
        m3, o3, s3 = fsdp_model(98)
        try:
            ray_ckpt.restore(uri, m3, o3, scheduler=s3, step=STEPS)
        except ray_ckpt.NoCheckpointError as e:
            assert "every rank" in str(e), e
        else:
            raise AssertionError(f"step {STEPS} restored although rank 1 does not hold it")
        dist.barrier()


def refused(rank, world, port, uri, out):
    """What sharded state does not support yet is refused at attach, before anything is written: Amber with
    runtime="ray", and tensor-parallel / Partial placements (the error names the placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    with T.dist_group(rank, world, port):
        model, opt, sch = fsdp_model(0)
        try:
            ray_ckpt.Checkpointer(uri, model, opt, strategy=ray_ckpt.Amber(), runtime="ray", keep_fulls=0)
        except NotImplementedError as e:
            assert "Amber" in str(e) and "FSDP2" in str(e) and "runtime='local'" in str(e), e
        else:
            raise AssertionError("Amber accepted for sharded state with runtime='ray'")
        mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        tp = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh2, [Shard(0), Shard(1)]))
        partial = torch.nn.Parameter(DTensor.from_local(torch.randn(4), init_device_mesh("cpu", (1,)), [Partial()]))
        for p, what in ((tp, "(Shard(dim=0), Shard(dim=1))"), (partial, "Partial")):
            m = torch.nn.Module()
            m.w = p
            try:
                ray_ckpt.Checkpointer(uri, m, torch.optim.SGD([p], lr=0.1), keep_fulls=0)
            except NotImplementedError as e:
                assert what in str(e) and "not supported" in str(e), e
            else:
                raise AssertionError(f"{what} accepted for sharded state")
        assert not os.path.exists(uri) or not os.listdir(uri), os.listdir(uri)


def reference(rank, world, port, out, steps):
    """The uninterrupted run without checkpointing: the gathered global state after every step (rank 0 saves)."""
    with T.dist_group(rank, world, port):
        model, opt, sch = fsdp_model(0)
        glob = {0: global_snapshot(model, opt)}
        for s in range(steps):
            T.train_step(KIND, model, opt, sch, s, rank)
            glob[s + 1] = global_snapshot(model, opt)
        if rank == 0:
            torch.save(glob, os.path.join(out, "global.pt"))
        dist.barrier()


def corrupt_shard_agreement(rank, world, port, uri, out, expect):
    """Rank 1's newest diff object is corrupt: each rank restores with fallback, rank 1 falls back further, and
    the agreement brings both ranks to the step rank 1 reached (bitwise)."""
    from ray_ckpt.integrations.agreement import sharded_agreed_restore
    with T.dist_group(rank, world, port):
        local = torch.load(os.path.join(out, f"local-{rank}.pt"), weights_only=False)
        m2, o2, s2 = fsdp_model(99)
        assert sharded_agreed_restore(uri, m2, o2, scheduler=s2) == (expect, True)
        T.assert_same(local[expect], local_snapshot(m2, o2, s2), f"rank {rank} agreed step {expect}")
        dist.barrier()


@contextlib.contextmanager
def _ray(address):
    """Connected to the test session's Ray cluster at ``address`` for the body."""
    import ray
    ray.init(address=address, namespace="ray_ckpt_tests", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def ray_train_and_restore(rank, world, port, uri, out, address, run):
    """World 2 with ``runtime="ray"`` and ``durable_diffs="fulls"``: each rank's shard lineage is a run of its own
    (coordinator, node worker, replica) and its diffs stay in memory on two nodes. While the Checkpointers are
    still attached, storage alone restores an older step, and every rank restores the latest step through the
    shard runs: from each shard's replica, nothing replayed, bitwise; an older step bitwise too; then the
    lineage is closed."""
    from ray_ckpt.engine.shard_layout import spec_of
    from ray_ckpt.engine.sharded import restore_sharded
    from ray_ckpt.runtime.trainer.client import ShardedMemoryTier
    from ray_ckpt.runtime.worker import OBJECT_STORE_SHARE
    from ray_ckpt.storage import open_storage
    with T.dist_group(rank, world, port), _ray(address):
        model, opt, sch = fsdp_model(0)
        os.environ["LOCAL_WORLD_SIZE"] = "2"   # as Ray Train / torchrun set it: both ranks on one node
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=FULL_EVERY, batch_steps=BATCH,
                                   policy="fixed", runtime="ray", run=run, durable_diffs="fulls", keep_fulls=0)
        # the two shard runs' workers share the node's object store (300 MiB in the test cluster): 60 % of it, halved
        # the node's share of its 300 MiB object store, split between its two ranks, at least 64 MiB each
        assert ck.stats()["runtime"]["worker"]["memory_budget"] == max(int((300 << 20) * OBJECT_STORE_SHARE) // 2,
                                                                       64 << 20)
        local, glob = _train_recording(model, opt, sch, rank)
        torch.save(local, os.path.join(out, f"local-{rank}.pt"))
        if rank == 0:
            torch.save(glob, os.path.join(out, "global.pt"))
        ck._capture.flush_pending()
        ck._sink.wait_safe()      # handed over and held (not necessarily durable)
        dist.barrier()
        m1, o1, s1 = fsdp_model(41)
        older = ray_ckpt.restore(uri, m1, o1, scheduler=s1)      # storage alone: fulls only, no diffs yet
        assert older < STEPS, older
        T.assert_same(local[older], local_snapshot(m1, o1, s1), f"rank {rank} step {older} from storage")
        m2, o2, s2 = fsdp_model(42)
        tier = ShardedMemoryTier(run)
        assert restore_sharded(open_storage(uri), m2, o2, spec_of(o2), scheduler=s2,
                               memory=tier) == STEPS
        T.assert_same(local[STEPS], local_snapshot(m2, o2, s2), f"rank {rank} latest from the replica")
        assert tier.tiers["replica"] == 1 and tier.tiers["replayed"] == 0, tier.tiers
        m3, o3, s3 = fsdp_model(43)
        assert ray_ckpt.restore(uri, m3, o3, scheduler=s3, step=RESUME_AT, runtime="ray", run=run) == RESUME_AT
        T.assert_same(local[RESUME_AT], local_snapshot(m3, o3, s3), f"rank {rank} step {RESUME_AT}")
        dist.barrier()
        ck.close()
        dist.barrier()


def ray_restore_at_world(rank, world, port, uri, out, address, run):
    """Another world size with ``runtime="ray"``: every saved shard is loaded through its shard run (replica),
    resharded, and the gathered global state equals the saved world's, bitwise."""
    with T.dist_group(rank, world, port), _ray(address):
        glob = torch.load(os.path.join(out, "global.pt"), weights_only=False)
        m2, o2, s2 = fsdp_model(99)
        assert ray_ckpt.restore(uri, m2, o2, scheduler=s2, runtime="ray", run=run) == STEPS
        T.assert_same(glob[STEPS], global_snapshot(m2, o2), f"world {world} rank {rank} latest")
        dist.barrier()


def train_checkpointed(rank, world, port, uri, out):
    """Train STEPS steps with a Checkpointer on every rank and nothing else; rank 0 saves the gathered global
    state of every step (``global.pt``: what a consolidation must reproduce) and the loop state of the run."""
    with T.dist_group(rank, world, port):
        model, opt, sch = fsdp_model(0)
        with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=FULL_EVERY, batch_steps=BATCH,
                                   policy="fixed", keep_fulls=0):
            local, glob = _train_recording(model, opt, sch, rank)
        if rank == 0:
            torch.save(glob, os.path.join(out, "global.pt"))
            torch.save({s: local[s]["sched"] for s in local}, os.path.join(out, "sched.pt"))
            torch.save({s: local[s]["opt"]["param_groups"] for s in local}, os.path.join(out, "groups.pt"))
        dist.barrier()


# -- HSDP: a 2-D (replicate, shard) mesh ------------------------------------------------------------------------
HSDP_STEPS = 9
HSDP_FULL_EVERY = 5
HSDP_CHECK = (7, HSDP_STEPS)   # the steps the HSDP restores compare (a full at 5, diffs after it)


def hsdp_model(seed: int, shape: tuple[int, int]):
    """TinyGPT under HSDP: ``fully_shard`` per block and at the root on a (replicate, shard) mesh of ``shape``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = T.make_model(KIND, seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt, total=HSDP_STEPS)


def hsdp_train_killed(rank, world, port, uri, out):
    """2x2 HSDP: a Checkpointer on every rank (replica 0 of each shard writes it, replica 1 writes nothing but
    counts steps); train HSDP_STEPS steps, save this rank's shards and the gathered state at HSDP_CHECK, make
    everything captured durable, then every rank dies (``os._exit``: no close, no lease release)."""
    T.init_dist(rank, world, port)     # the ranks die at the end: never left
    model, opt, sch = hsdp_model(0, (2, 2))
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=HSDP_FULL_EVERY, batch_steps=BATCH,
                               policy="fixed", keep_fulls=0)
    spec = ck.shard_spec
    assert (spec.world, spec.replicas) == (2, 2) and (spec.replica, spec.rank) == divmod(rank, 2), spec
    local, glob = {}, {}
    for s in range(HSDP_STEPS):
        T.train_step(KIND, model, opt, sch, s, rank)
        if s + 1 in HSDP_CHECK:
            local[s + 1] = local_snapshot(model, opt, sch)
            glob[s + 1] = global_snapshot(model, opt)
    ck.flush()
    assert ck.step == HSDP_STEPS
    st = ck.stats()
    if spec.replica:
        assert ck.last_committed_step is None and st["bytes_written"] == 0 and st["trainer_fulls"] == 0, st
    else:
        assert ck.last_committed_step == HSDP_STEPS and st["bytes_written"] > 0, st
    torch.save(local, os.path.join(out, f"hsdp-local-{rank}.pt"))
    if rank == 0:
        torch.save(glob, os.path.join(out, "hsdp-global.pt"))
    dist.barrier()
    os._exit(0)   # killed: nothing closed, the writer leases stay taken


def hsdp_restore(rank, world, port, uri, out, shape, steps):
    """Restore each of ``steps`` (None: the latest) on an HSDP mesh of ``shape`` and compare bitwise: at the
    saved 2x2 shape each rank's own shards (replicas read the shard of their shard coordinate) and the
    scheduler; at any shape the gathered global state with the saved run's."""
    with T.dist_group(rank, world, port):
        glob = torch.load(os.path.join(out, "hsdp-global.pt"), weights_only=False)
        saved = torch.load(os.path.join(out, f"hsdp-local-{rank}.pt"), weights_only=False) \
            if tuple(shape) == (2, 2) else None
        for s in steps:
            m2, o2, s2 = hsdp_model(99, tuple(shape))
            got = ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=s)
            assert got == (HSDP_STEPS if s is None else s), (got, s)
            if saved is not None:
                T.assert_same(saved[got], local_snapshot(m2, o2, s2), f"2x2 rank {rank} step {got}")
            T.assert_same(glob[got], global_snapshot(m2, o2), f"{shape} rank {rank} step {got}")
            assert s2.state_dict()["last_epoch"] == got
        dist.barrier()


# -- Amber for sharded state ------------------------------------------------------------------------------------
AMBER_STEPS = 12
AMBER_CHECK = (0, 4, 9, AMBER_STEPS)
AMBER_THR, AMBER_OPT_THR = 0.02, 0.05


def amber_config():
    return ray_ckpt.Amber(threshold=AMBER_THR, optimizer_state="threshold", optimizer_threshold=AMBER_OPT_THR,
                          optimizer_every=1, merge_after=2, full_ratio=None)   # merged increments, no early full


def _excess(restored, true, thr: float) -> float:
    """max(|restored - true| - thr·|restored|) in float64; <= 0: the bound holds for every element."""
    r, x = restored.double(), true.double()
    return float(((r - x).abs() - thr * r.abs()).max())


def assert_within_amber_bound(true: dict, got: dict, what: str) -> int:
    """The consolidated (gathered) state ``got`` is within the Amber bound of ``true`` for every element of every
    parameter and optimizer-state tensor (scalars exact). Returns how many elements differ (stale, bounded)."""
    stale = 0
    for part, thr in (("model", AMBER_THR), ("opt", AMBER_OPT_THR)):
        flat_t = true[part] if part == "model" else {(i, k): v for i, st in true[part].items() for k, v in st.items()}
        flat_g = got[part] if part == "model" else {(i, k): v for i, st in got[part].items() for k, v in st.items()}
        assert flat_t.keys() == flat_g.keys(), what
        for key, t in flat_t.items():
            g = flat_g[key]
            if t.numel() == 1 or not t.is_floating_point():
                assert torch.equal(g, t), f"{what} {part} {key}: exact slot differs"
                continue
            assert _excess(g, t, thr) <= 0, f"{what} {part} {key}: bound violated"
            stale += int((g != t).sum())
    return stale


def amber_train_restore(rank, world, port, uri, out):
    """World 2 with strategy=Amber (lossy parameters and optimizer state, merged increments): every rank writes
    its shards' increments; each restored step, gathered (consolidated), is within the bound of the live run."""
    with T.dist_group(rank, world, port):
        model, opt, sch = fsdp_model(0)
        ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, strategy=amber_config(), full_every=100,
                                   batch_steps=2, policy="fixed", keep_fulls=0)
        glob = {0: global_snapshot(model, opt)}
        for s in range(AMBER_STEPS):
            T.train_step(KIND, model, opt, sch, s, rank)
            glob[s + 1] = global_snapshot(model, opt)
        assert ck._capture.merges > 0
        ck.close()
        if rank == 0:
            torch.save(glob, os.path.join(out, "amber-global.pt"))
        dist.barrier()
        stale = 0
        for s in AMBER_CHECK:
            m2, o2, s2 = fsdp_model(99)
            assert ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=s) == s
            stale += assert_within_amber_bound(glob[s], global_snapshot(m2, o2), f"rank {rank} step {s}")
        assert stale > 0   # not vacuous: restores return stale (bounded) values
        dist.barrier()


def amber_restore_at_world(rank, world, port, uri, out):
    """Another world size: the Amber-restored shards, resharded and gathered, are within the bound."""
    with T.dist_group(rank, world, port):
        glob = torch.load(os.path.join(out, "amber-global.pt"), weights_only=False)
        for s in (AMBER_CHECK[-2], None):
            m2, o2, s2 = fsdp_model(99)
            got = ray_ckpt.restore(uri, m2, o2, scheduler=s2, step=s)
            assert got == (AMBER_STEPS if s is None else s), (got, s)
            assert_within_amber_bound(glob[got], global_snapshot(m2, o2), f"world {world} step {got}")
        dist.barrier()
