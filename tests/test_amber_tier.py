"""The Amber durable tier of a LowDiff+ run (``durable_diffs="amber"``, issue #17 items 2-3).

The state tier's replica computes Amber increments from its own copy of the state and writes them below
``tiers/amber/``. Tested for real: a ``runtime="ray"`` LowDiff run on a local Ray, the same run with
``strategy=Amber`` computed in the training process (``runtime="local"``) as the reference, and restores from
storage alone compared with the uninterrupted run.
"""
from __future__ import annotations

import json
import uuid

import pytest
import torch

import ray_ckpt
from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.engine import amber_tier
from ray_ckpt.engine import gc as _gc
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.restore import read_object
from ray_ckpt.engine.strategy import decode_object, impl_by_name
from ray_ckpt.format.delta import encode_records
from ray_ckpt.runtime.coordinator import shutdown_run
from ray_ckpt.storage import open_storage
from ray_ckpt.lineage.layout import INDEX_KEY
from tests import _training as T
from tests.test_state_tier import _fresh, _wait_delegated, _wait_replica_at

STEPS, FULL_EVERY = 24, 10


def _config() -> ray_ckpt.Amber:
    # no merges and no early fulls: the trainer-side reference then takes its fulls where the replica does
    return ray_ckpt.Amber(threshold=0.02, merge_after=0, full_ratio=None)


def _records(storage, manifests) -> dict:
    out = {}
    for m in manifests:
        if m.kind == "diff":
            for r in decode_object(impl_by_name(m.strategy), read_object(storage, m), m.object):
                out[r.step] = r
    return out


def _trainee():
    """The model, optimizer and scheduler of the reference run (``T.reference_states``)."""
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt)


def _bytes(rec) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in encode_records([rec]))


def _restore(uri, step):
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=step) == step
    return T.snapshot(m, o, sc)


@pytest.fixture
def run_env(tmp_path, ray_cluster):  # noqa: F811
    run = f"at-{uuid.uuid4().hex[:8]}"
    yield run, str(tmp_path / "ckpt")
    shutdown_run(run)


@pytest.mark.ray
def test_replica_increments_equal_the_trainers_and_restore_within_the_bound(run_env, tmp_path, capsys):
    run, uri = run_env
    ref = T.reference_states(STEPS)
    cfg = _config()

    # the reference: the same run with Amber computed in the training process
    local_uri = str(tmp_path / "local")
    m, o, sc = _trainee()
    with ray_ckpt.Checkpointer(local_uri, m, o, scheduler=sc, strategy=cfg, full_every=FULL_EVERY, batch_steps=4,
                               policy="fixed", keep_fulls=0):
        for s in range(STEPS):
            T.train_step("mlp", m, o, sc, s)

    # LowDiff+: the trainer sends gradient records only; the replica computes the increments
    m, o, sc = _trainee()
    ck = ray_ckpt.Checkpointer(uri, m, o, scheduler=sc, runtime="ray", run=run, full_every=FULL_EVERY,
                               batch_steps=4, policy="fixed", durable_diffs=cfg, keep_fulls=0, recovery_every=1)
    _wait_delegated(ck)
    for s in range(STEPS):
        T.train_step("mlp", m, o, sc, s)
    ck.flush()
    _wait_replica_at(run, STEPS)
    replica = ck.stats()["runtime"]["replica"]
    assert replica["amber_increments"] == STEPS and replica["amber_objects"] >= 3, replica
    assert ck.stats()["trainer_fulls"] == 1
    ck.close()

    storage, local = open_storage(uri), open_storage(local_uri)
    main, _ = load_lineage(storage)
    assert sorted(x.last_step for x in main.manifests if x.kind == "full") == [0, 10, 20]
    tier = amber_tier.tier_manifests(storage)
    assert {x.info["base_step"] for x in tier} == {0, 10, 20}

    # identical increments: bytes of every step's record, persistence tier vs training process
    got = _records(amber_tier.tier_storage(storage), tier)
    want = _records(local, load_lineage(local)[0].manifests)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in got:
        assert got[s].base_step == want[s].base_step == (s - 1) // FULL_EVERY * FULL_EVERY, s
        assert _bytes(got[s]) == _bytes(want[s]), f"step {s}: the replica's increment differs"

    # the exact lineage holds the fulls and the step records flush() wrote: those steps restore bitwise from it
    exact = set(main.reachable_steps(main.generations[-1]))
    assert {0, 10, 20} <= exact, sorted(exact)
    for s in (7, 23):
        if s in exact:
            T.assert_same(ref[s], _restore(uri, s), f"step {s} from the exact lineage")

    # every other step restores from the Amber tier — and, once the exact step records are gone too (a cluster
    # lost before they were written), every step: the same values as the trainer-side Amber chain, within the
    # bound of the true state
    for x in main.manifests:
        if x.kind == "diff":
            storage.delete(x.key)
    if storage.exists(INDEX_KEY):
        storage.delete(INDEX_KEY)
    for s in range(1, STEPS + 1):
        tier_state, local_state = _restore(uri, s), _restore(local_uri, s)
        T.assert_same(local_state, tier_state, f"step {s}: Amber tier vs trainer-side Amber")
        for k, v in tier_state["model"].items():
            true = ref[s]["model"][k]
            err = (v.double() - true.double()).abs()
            assert torch.all(err <= cfg.threshold * v.double().abs()), f"step {s} {k}: bound violated"
        # loop state and step counters are exact
        assert tier_state["sched"] == ref[s]["sched"]
        assert all(torch.equal(a["step"], b["step"]) for a, b in
                   zip(tier_state["opt"]["state"].values(), ref[s]["opt"]["state"].values()))
        if s % FULL_EVERY == 0:
            T.assert_same(ref[s], tier_state, f"step {s} is a full")

    assert cli_main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert "durable_diffs=amber" in out and "Amber tier (tiers/amber/)" in out and "steps 0..24" in out, out
    assert "GAP" not in out and "24 from the Amber tier" in out, out
    assert cli_main(["inspect", uri, "--step", "13", "--json"]) == 0
    got_plan = json.loads(capsys.readouterr().out)
    assert got_plan["tier"] == "amber" and got_plan["read"][0]["steps"] == [10, 10], got_plan
    assert all(r["object"].startswith("tiers/amber/") for r in got_plan["read"][1:])

    # garbage collection keeps the tier's increments of the kept fulls only
    res = _gc.collect(storage, keep_fulls=1)
    assert res.kept_from_step == 20
    assert {x.info["base_step"] for x in amber_tier.tier_manifests(storage)} == {20}
    T.assert_same(_restore(local_uri, 23), _restore(uri, 23), "step 23 after gc")


def test_durable_amber_is_refused_where_it_cannot_work(tmp_path):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with pytest.raises(ValueError, match="needs runtime='ray'"):
        ray_ckpt.Checkpointer(str(tmp_path), model, opt, durable_diffs=ray_ckpt.Amber())
    with pytest.raises(ValueError, match="strategy 'amber' writes its own diffs"):
        ray_ckpt.Checkpointer(str(tmp_path), model, opt, runtime="ray", strategy=ray_ckpt.Amber(),
                              durable_diffs="amber")
    with pytest.raises(ValueError, match="needs the state tier's replica"):
        ray_ckpt.Checkpointer(str(tmp_path), model, opt, runtime="ray", replica=False, durable_diffs="amber")
    with pytest.raises(ValueError, match="durable_diffs must be"):
        ray_ckpt.Checkpointer(str(tmp_path), model, opt, runtime="ray", durable_diffs="amberish")


def test_an_unbased_shadow_encoder_resumes_at_the_next_full(tmp_path):
    """After a replica rebuild (state not a full's) no increment is written until a full rebases the encoder."""
    from ray_ckpt.engine.amber import ShadowAmber
    from ray_ckpt.engine.shadow import ShadowState
    model, opt, sch = _trainee()
    with ray_ckpt.Checkpointer(str(tmp_path / "c"), model, opt, scheduler=sch, keep_fulls=0) as ck:
        full = ck._capture.snapshot_now()
    shadow, amber = ShadowState(full), ShadowAmber(_config())
    assert amber.step(shadow, {}, {}) is None and amber.base_step is None
    assert amber.step(shadow, {}, {}, full=True) is None and amber.base_step == shadow.step
    T.train_step("mlp", model, opt, sch, 0)
    shadow.model.load_state_dict(model.state_dict())
    shadow.step += 1
    assert amber.step(shadow, {}, {}) is not None
