"""The Ray runtime on a real 2-node local cluster: memory tier, peer replicas, durable writes, failures."""
from __future__ import annotations

import time
import uuid

import pytest
import ray
import torch

import ray_ckpt
from ray_ckpt.runtime import naming
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.runtime.coordinator import shutdown_run
from tests import _training as T

pytestmark = pytest.mark.ray


def _reference(steps, kind="mlp"):
    model = T.make_model(kind)
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    for s in range(steps):
        T.train_step(kind, model, opt, sch, s)
    return T.snapshot(model, opt, sch)


def _fresh(kind="mlp"):
    model = T.make_model(kind, seed=77)
    opt = T.make_optimizer("adamw", model)
    return model, opt, T.make_scheduler(opt)


def _assert_restores(uri, run, steps, what=""):
    """Every step of ``steps`` restores bitwise the reference state, from the memory tier (through the run's
    coordinator) and from storage alone."""
    for s in steps:
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=s, runtime="ray", run=run) == s
        T.assert_same(_reference(s), T.snapshot(m, o, sc), f"{what}memory tier step {s}")
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=s) == s  # storage only
        T.assert_same(_reference(s), T.snapshot(m, o, sc), f"{what}durable tier step {s}")


def _coord(run):
    return ray.get_actor(naming.coordinator_name(run), namespace=naming.NAMESPACE)


def _worker(run, node_id):
    return ray.get_actor(naming.worker_name(run, node_id), namespace=naming.NAMESPACE)


@pytest.fixture
def run_env(tmp_path, ray_cluster):  # noqa: F811
    run = f"t-{uuid.uuid4().hex[:8]}"
    yield run, str(tmp_path / "ckpt")
    shutdown_run(run)


def _train(uri, run, steps, start=0, model=None, opt=None, sch=None, during=None, **kw):
    if model is None:
        model = T.make_model("mlp")
        opt = T.make_optimizer("adamw", model)
        sch = T.make_scheduler(opt)
    ck = ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, runtime="ray", run=run,
                               **{"full_every": 10, "batch_steps": 4, "recovery_every": 1, "keep_fulls": 0, **kw})
    for s in range(start, steps):
        T.train_step("mlp", model, opt, sch, s)
        if during is not None:
            during(s + 1, ck)
    return ck, model, opt, sch


def test_every_step_restorable_from_memory_and_durable_tiers(run_env):
    run, uri = run_env
    ck, *_ = _train(uri, run, 30)
    ck.close()
    st = ray.get(_coord(run).status.remote())
    assert st["recoverable_step"] == 30 and st["durable_step"] == 30
    # held on both nodes: the peer reports its copies to the coordinator on its own thread, after the flush
    deadline = time.monotonic() + 30
    while st["replicated_objects"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        st = ray.get(_coord(run).status.remote())
    assert st["replicated_objects"] > 0, st
    _assert_restores(uri, run, [0, 3, 10, 17, 30])
    # the memory tier alone: wipe storage, restore from the object stores
    import shutil
    shutil.rmtree(uri)
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 30
    T.assert_same(_reference(30), T.snapshot(m, o, sc), "memory tier only")


def test_a_worker_that_cannot_map_the_trainers_memory_is_handed_the_bytes(run_env, monkeypatch):
    """The shared-memory hand-off's fallback: the node worker cannot map what the descriptors name (here a wrong
    inode, as for another process's memory), refuses the chunk, and the sender resends it and every later chunk
    with its bytes (one-step chunks with no hand-off delay: several are in flight when the first refusal comes
    back, and the later refusals are of chunks already given their bytes); every step restores bitwise from
    both tiers."""
    from ray_ckpt.runtime.trainer import arena as shared
    real = shared.SharedArena.describe

    def unmappable(self, buf):
        d = real(self, buf)
        return None if d is None else d[:3] + (d[3] + 1,) + d[4:]   # (tag, pid, fd, inode + 1, offset, size)

    monkeypatch.setattr(shared.SharedArena, "describe", unmappable)
    run, uri = run_env
    ck, *_ = _train(uri, run, 20, shared_handoff=True, batch_steps=1, handoff_delay=0.0)
    ck.flush()
    rt = ck.stats()["runtime"]
    ck.close()
    assert rt["shared_chunks"] >= 1 and rt["shared_handoff"] is False, rt   # tried, refused, fell back
    _assert_restores(uri, run, [0, 7, 20])


def test_killed_worker_comes_back_and_lineage_stays_consistent(run_env):
    run, uri = run_env
    node = ray.get_runtime_context().get_node_id()

    def during(step, ck):
        if step == 12:
            ray.kill(_worker(run, node), no_restart=False)

    t0 = time.perf_counter()
    ck, model, opt, sch = _train(uri, run, 30, during=during)
    ck.close()
    st = ray.get(_coord(run).status.remote())
    assert st["durable_step"] == 30 and st["recoverable_step"] == 30
    assert ray.get(_worker(run, node).ping.remote()) == node  # restarted, same name, same node
    # steps around the kill, inside diff batches, not only the fulls (10, 20, 30)
    for s in [9, 11, 12, 13, 15, 17, 19, 21, 26, 29, 30]:
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=s, runtime="ray", run=run) == s
        T.assert_same(_reference(s), T.snapshot(m, o, sc), f"step {s} after worker kill")
    assert ck.stats()["stall_seconds"] < time.perf_counter() - t0


def test_killed_coordinator_rebuilds_lineage(run_env):
    run, uri = run_env

    def during(step, ck):
        if step == 15:   # no flush first: steps in flight when it dies must reach the restarted coordinator
            ray.kill(_coord(run), no_restart=False)

    ck, *_ = _train(uri, run, 25, during=during)
    ck.close()
    st = ray.get(_coord(run).status.remote())
    assert st["durable_step"] == 25 and st["recoverable_step"] == 25
    assert st["started_at"] > 0 and st["generation"] == 1
    for s in [5, 11, 13, 14, 15, 16, 18, 25]:  # steps from before, around and after the restart
        m, o, sc = _fresh()
        assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=s, runtime="ray", run=run) == s
        T.assert_same(_reference(s), T.snapshot(m, o, sc), f"step {s}")


@ray.remote(num_cpus=1, resources={"node2": 0.01})
class _Trainer:
    """Trains on the second node and checkpoints through that node's PersistenceWorker."""

    def train(self, uri, run, steps):
        import torch
        torch.set_num_threads(1)
        ck, *_ = _train(uri, run, steps)
        ck._capture.flush_pending()
        ck._sink.flush()  # held in memory (and durable) on this node, replicated to the head
        st = ray.get(_coord(run).status.remote())
        return st, ray.get_runtime_context().get_node_id()


def test_node_removal_loses_nothing_reported_recoverable(run_env, ray_cluster):  # noqa: F811
    run, uri = run_env
    node = ray_cluster.add_node(num_cpus=1, object_store_memory=200 << 20, resources={"node2": 1})
    ray_cluster.wait_for_nodes()
    # pin the trainer on the new node (the other 'node2' node is busy with num_cpus=2 worth of capacity)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    trainer = _Trainer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
    st, trained_on = ray.get(trainer.train.remote(uri, run, 22))
    assert trained_on == node.node_id
    reported = st["recoverable_step"]
    assert reported == 22
    ray_cluster.remove_node(node)
    deadline = time.time() + 30
    while time.time() < deadline and any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        time.sleep(0.2)
    st = ray.get(_coord(run).status.remote())
    assert st["recoverable_step"] >= reported
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == reported
    T.assert_same(_reference(reported), T.snapshot(m, o, sc), "after node removal")


def test_a_diff_committed_after_gc_collected_its_steps_is_deleted(ray_cluster, tmp_path):  # noqa: F811
    """GC drops an entry whose write is in flight (not durable yet); the worker then commits it. Its report must
    delete it: before, it stayed on storage until the next full's GC, and for good after a run's last full."""
    from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
    from ray_ckpt.runtime import coordinator as C
    from ray_ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "ckpt"))

    def man(kind, first, last, write=True):
        name = full_name(1, last) if kind == "full" else diff_name(1, first, last)
        m = Manifest(kind=kind, generation=1, first_step=first, last_step=last, object=object_key(name),
                     nbytes=1, crc32=0, strategy="lowdiff")
        if write:
            storage.write(m.object, [b"x"])
            storage.write(m.key, m.to_json())
        return m

    node = ray.get_runtime_context().get_node_id()
    coord = C.Coordinator(f"t-{uuid.uuid4().hex[:8]}", storage, CheckpointConfig(full_every=10, batch_steps=4, keep_fulls=2))
    for f in (0, 10):
        coord.update(node, [("durable", man("full", f, f).to_json(), [])])
    late = [man("diff", 1, 4, write=False), man("diff", 11, 14, write=False)]
    coord.update(node, [("held", m.to_json(), None, node) for m in late])
    coord.update(node, [("durable", man("full", 20, 20).to_json(), [])])   # GC: keeps fulls 10 and 20
    assert late[0].name not in coord.entries and late[1].name in coord.entries
    assert not storage.exists(man("full", 0, 0, write=False).key)
    for m in late:                         # the in-flight writes commit now
        storage.write(m.object, [b"x"])
        storage.write(m.key, m.to_json())
        coord.update(node, [("durable", m.to_json(), [m.name])])
    assert not storage.exists(late[0].key) and not storage.exists(late[0].object)
    assert late[0].name not in coord.entries
    assert storage.exists(late[1].key) and coord.entries[late[1].name].durable   # past the kept full: kept
    assert coord.status()["durable_step"] == 20


def test_a_chunk_handed_over_again_is_held_and_written_once(ray_cluster, tmp_path):  # noqa: F811
    """A hand-off sent again to the same incarnation (its first call's answer was lost: a call Ray retried, or
    the sender's resend) is not queued again: before, the written step was laid into the next batch too and
    storage held two objects of it (a suite run saw ``[(1, 4), (1, 1)]``). It is reported safe again."""
    from ray_ckpt.lineage import Manifest, diff_name, object_key
    from ray_ckpt.runtime.worker import PersistenceWorker
    from ray_ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "ckpt"))
    w = PersistenceWorker(f"t-{uuid.uuid4().hex[:8]}", storage, 64 << 20, durable_delay=3600.0)

    def chunk(step):
        name = diff_name(1, step, step)
        return Manifest(kind="diff", generation=1, first_step=step, last_step=step, object=object_key(name),
                        nbytes=8, crc32=0, strategy="lowdiff")

    first = chunk(1)
    w.submit(first.to_json(), [b"12345678"], batch_steps=4, replicate=False)
    w.flush(timeout=30)                    # step 1 written alone
    assert storage.exists(first.key)
    w.poll(1)
    got = w.submit(first.to_json(), [b"12345678"], batch_steps=4, replicate=False)   # again
    assert first.name in got["safe"]
    for s in (2, 3, 4):
        w.submit(chunk(s).to_json(), [b"12345678"], batch_steps=4, replicate=False)
    w.flush(timeout=30)
    keys = sorted(k for k in storage.list("manifests/") if "-diff-" in k)
    assert [k.rsplit("/", 1)[-1].split(".")[0] for k in keys] == [diff_name(1, 1, 1), diff_name(1, 2, 4)], keys
    assert w.stats()["received_again"] == 1 and w.stats()["received"] == 4


def test_a_chunk_released_before_it_was_written_is_safe_for_its_sender(ray_cluster, tmp_path):  # noqa: F811
    """The coordinator's GC may release a diff the worker has not written yet (a newer durable full took its
    place). The sender waits for every chunk it handed over to be reported safe; before, such a chunk never was,
    and the sender's close() failed with 'chunks could not be made durable'. Now it is reported safe at once, and
    it is not written (the GC that released it has deleted what it covers)."""
    from ray_ckpt.lineage import Manifest, diff_name, object_key
    from ray_ckpt.runtime.worker import PersistenceWorker
    from ray_ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "ckpt"))
    w = PersistenceWorker(f"t-{uuid.uuid4().hex[:8]}", storage, 64 << 20, durable_delay=3600.0)
    name = diff_name(1, 61, 64)
    m = Manifest(kind="diff", generation=1, first_step=61, last_step=64, object=object_key(name), nbytes=8,
                 crc32=0, strategy="lowdiff")
    assert name not in w.submit(m.to_json(), [b"12345678"], batch_steps=100, replicate=False)["safe"]
    w.release([name])
    assert name in w.poll(1)["safe"]
    w.flush(timeout=30)
    assert not storage.exists(m.object) and not storage.exists(m.key)
    assert w.stats()["queued_chunks"] == 0


def test_memory_budget_releases_durable_objects(run_env):
    run, uri = run_env
    model = T.MLP(d_in=32, hidden=512, d_out=8)  # dense diffs of ~1.1 MB: 2 MiB hold one or two
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(uri, model, opt, runtime="ray", run=run, full_every=10, batch_steps=2,
                               memory_budget=2 << 20, strategy=ray_ckpt.LowDiff(max_sparse_density=0), recovery_every=1, keep_fulls=0) as ck:
        for s in range(14):
            T.train_step("mlp", model, opt, None, s)
    node = ray.get_runtime_context().get_node_id()
    st = ray.get(_worker(run, node).stats.remote())
    # what stays: the newest full (~3.4 MB, always kept) and objects not yet durable; the rest was released
    assert st["released"] > 0 and st["held_objects"] <= 6, st
    assert ray.get(_coord(run).status.remote())["durable_step"] == 14
    m = T.MLP(d_in=32, hidden=512, d_out=8)
    o = T.make_optimizer("adamw", m)
    assert ray_ckpt.restore(uri, m, o, runtime="ray", run=run) == 14  # released objects come from storage
    assert ck.stats()["step"] == 14


def test_gc_keeps_the_newest_fulls(run_env):
    run, uri = run_env
    ck, *_ = _train(uri, run, 27, keep_fulls=2)
    ck.close()
    # automatic GC runs when a full becomes durable; an object that turned durable later is collected by the
    # next pass (idempotent), which is what a later full (or this explicit call) does
    ray.get(_coord(run).gc.remote(2))
    import os
    # the state-tier replica writes the fulls the trainer delegated to it on its own, after close() (every step
    # is durable by then through its diffs): its write of a full may still be under way (a .tmp- file; seen once)
    want = ["g000001-full-000000000010.json", "g000001-full-000000000020.json"]
    deadline = time.monotonic() + 30
    while True:
        names = sorted(os.listdir(os.path.join(uri, "manifests")))
        settled = not any(n.startswith(".tmp-") for n in names)
        if (settled and [n for n in names if "full" in n] == want) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
        ray.get(_coord(run).gc.remote(2))
    assert [n for n in names if "full" in n] == want, names
    assert all(int(n.split("-")[-1][:12]) >= 10 for n in names), names  # nothing that ends before the kept chains
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, step=13, runtime="ray", run=run) == 13
    T.assert_same(_reference(13), T.snapshot(m, o, sc), "after gc")
    with pytest.raises(ray_ckpt.NoCheckpointError):
        ray_ckpt.restore(uri, *_fresh()[:2], step=5)


def _scrape(run: str) -> dict:
    """``{metric name: value}`` of every ray_ckpt metric with ``run="<run>"`` on every node's metrics endpoint
    (values of one name summed over its other labels, e.g. nodes)."""
    import re
    import urllib.request
    out: dict = {}
    for n in ray.nodes():
        if not n.get("Alive") or not n.get("MetricsExportPort"):
            continue
        try:
            txt = urllib.request.urlopen(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics",
                                         timeout=5).read().decode()
        except OSError:
            continue
        for line in txt.splitlines():
            m = re.match(r'^(ray_ray_ckpt_\w+)\{(.*)\} (\S+)$', line)
            if m and f'run="{run}"' in m.group(2) and 'le="' not in m.group(2):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def test_runtime_state_is_exported_as_ray_metrics(run_env):
    """Trainer, node workers and coordinator publish through ray.util.metrics; the nodes' Prometheus endpoints
    serve them (scraped here over HTTP)."""
    run, uri = run_env
    ck, *_ = _train(uri, run, 30, during=lambda s, ck: time.sleep(0.04))
    ck.flush()
    time.sleep(1.5)                                   # one more publish of the sender after the last step
    ck.close()
    m, o, sc = _fresh()
    assert ray_ckpt.restore(uri, m, o, scheduler=sc, runtime="ray", run=run) == 30
    want = {"ray_ray_ckpt_steps_total": 30, "ray_ray_ckpt_capture_seconds_count": 30,
            "ray_ray_ckpt_durable_step": 30, "ray_ray_ckpt_recoverable_step": 30,
            "ray_ray_ckpt_restores_total": 1, "ray_ray_ckpt_restore_seconds_count": 1}
    deadline = time.monotonic() + 90                  # Ray exports application metrics every ~10 s
    got = {}
    while time.monotonic() < deadline:
        got = _scrape(run)
        if all(got.get(k) == v for k, v in want.items()) and got.get("ray_ray_ckpt_written_bytes_total", 0) > 0:
            break
        time.sleep(2)
    assert all(got.get(k) == v for k, v in want.items()), {k: got.get(k) for k in want}
    assert got["ray_ray_ckpt_written_bytes_total"] > 0 and got["ray_ray_ckpt_written_objects_total"] > 0
    assert got["ray_ray_ckpt_capture_seconds_sum"] > 0 and "ray_ray_ckpt_memory_bytes" in got
    assert got.get("ray_ray_ckpt_durable_lag_steps") == 0 and got.get("ray_ray_ckpt_gaps") == 0


def test_two_runs_on_one_lineage_the_second_is_refused(run_env):
    from ray_ckpt.engine.lease import LeaseError
    run, uri = run_env
    ck, *_ = _train(uri, run, 3)
    ck.close()
    other = f"{run}-other"
    with pytest.raises(LeaseError, match=f"run {run!r}"):
        _train(uri, other, 2)
    shutdown_run(run)                                  # the end of the first run releases its lease
    ck, *_ = _train(uri, other, 2)
    ck.close()
    shutdown_run(other)



@ray.remote(num_cpus=0)
class _Sealer:
    """A process that opens S3 storage with explicit credentials and pickles it (sealing them)."""

    def pickled(self, uri, options):
        import pickle as _pickle

        import ray_ckpt.runtime  # noqa: F401 - registers the secret channel, as every runtime process does
        from ray_ckpt.storage import open_storage
        return _pickle.dumps(open_storage(uri, **options))


@pytest.mark.s3
def test_s3_credentials_reach_the_actors_sealed_never_in_arguments(s3_uri, ray_cluster, monkeypatch, caplog):
    """With explicit S3 credentials the actors write (their backends were rebuilt from a sealed ObjectRef);
    a pickled backend holds no secret; the coordinator hands out a URI without credentials; a backend whose
    sealing process exited falls back, with a WARNING, to the unpickling process's own credentials."""
    import logging
    import pickle

    secret = s3_uri.options["secret_key"]
    run = f"t-{uuid.uuid4().hex[:8]}"
    try:
        ck, model, opt, sch = _train(s3_uri.uri, run, 6, storage_options=s3_uri.options, full_every=5,
                                     batch_steps=2)
        ck.flush()
        store = s3_uri.open()
        blob = pickle.dumps(store)
        assert secret.encode() not in blob and b"secret_key" not in blob
        assert pickle.loads(blob).read(store.list("manifests/")[0])  # secrets opened from the object store
        coord = _coord(run)
        assert not hasattr(coord, "get_storage")
        uri = ray.get(coord.storage_uri.remote())
        assert secret not in uri and "endpoint_override" in uri
        ck.close()
        m, o, sc = _fresh()
        assert ray_ckpt.restore(s3_uri.uri, m, o, scheduler=sc, storage_options=s3_uri.options) == 6
        T.assert_same(_reference(6), T.snapshot(m, o, sc), "restored from what the actors wrote to S3")
    finally:
        shutdown_run(run)
    # The sealing process exits: its object (the secrets) is gone with it.
    sealer = _Sealer.remote()
    blob = ray.get(sealer.pickled.remote(s3_uri.uri, s3_uri.options))
    assert secret.encode() not in blob
    ray.kill(sealer, no_restart=True)
    time.sleep(1.0)
    from ray_ckpt.runtime import secrets
    monkeypatch.setattr(secrets, "OPEN_TIMEOUT_S", 2.0)   # an owner that exited is not reported: the wait times out
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="ray_ckpt"):
        orphan = pickle.loads(blob)
    assert "sealed by a process that has exited" in caplog.text
    assert "secret_key" not in orphan.options and orphan.describe() == s3_uri.open().describe()


def test_slow_steps_are_handed_over_on_arrival_not_after_handoff_delay(run_env):
    """Records that arrive further apart than ``handoff_delay`` would batch nothing by waiting: the sender hands
    each over at once, so a crash loses only the step still being captured (measured in the benchmark's kill
    trials: 2 steps lost with 1.3 s steps before, see README)."""
    run, uri = run_env
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, runtime="ray", run=run, full_every=100, batch_steps=10,
                               handoff_delay=3.0, recovery_every=1, keep_fulls=0)
    for s in range(3):
        if s:
            time.sleep(3.5)   # slower than handoff_delay
        T.train_step("mlp", model, opt, None, s)
    t0 = time.monotonic()
    while (ck.last_committed_step or 0) < 3 and time.monotonic() - t0 < 2.5:
        time.sleep(0.05)
    waited = time.monotonic() - t0
    assert ck.last_committed_step == 3, (ck.last_committed_step, waited)   # before handoff_delay (3 s) elapsed
    ck.close()


def test_amber_through_the_ray_runtime(run_env):
    """Amber's increments go through the node worker (held, replicated, written) like LowDiff's records:
    lossless Amber restores every step bitwise from memory and from storage; lossy Amber within its bound."""
    run, uri = run_env
    ck, *_ = _train(uri, run, 26, strategy=ray_ckpt.Amber(threshold=0))
    ck.close()
    st = ray.get(_coord(run).status.remote())
    assert st["recoverable_step"] == 26 and st["durable_step"] == 26
    _assert_restores(uri, run, [7, 10, 13, 26], "Amber lossless, ")
    shutdown_run(run)

    lossy_uri, lossy_run = uri + "-lossy", run + "-lossy"
    try:
        ck, *_ = _train(lossy_uri, lossy_run, 26, strategy=ray_ckpt.Amber(threshold=0.02))
        ck.close()
        ref = _reference(26)["model"]
        m, o, sc = _fresh()
        assert ray_ckpt.restore(lossy_uri, m, o, scheduler=sc) == 26
        stale = 0
        for k, true in ref.items():
            got = m.state_dict()[k].double()
            assert bool(((got - true.double()).abs() <= 0.02 * got.abs()).all()), k   # the stated bound
            stale += int((got != true.double()).sum())
        assert stale > 0   # not vacuous: some elements restore their last saved (older) value
    finally:
        shutdown_run(lossy_run)


def test_chunks_of_two_checksum_algorithms_merge_into_one_verified_object(run_env, monkeypatch):
    """The worker lays consecutive chunks end to end into one object and combines their checksums. One sender
    process uses one algorithm, but the worker does not rely on it: chunks of two algorithms (CRC-32C, and CRC-32
    as a process without the hardware CRC-32C writes) do not combine, so the merged object is checksummed in one
    pass, and every step in it restores verified and exact."""
    import json
    import pathlib

    from ray_ckpt.format import checksum
    run, uri = run_env
    node = ray.get_runtime_context().get_node_id()
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, runtime="ray", run=run, full_every=100, batch_steps=4,
                               handoff_delay=0.02, replica=False, recovery_every=1, keep_fulls=0)
    live = {}
    for s in range(4):
        monkeypatch.setattr(checksum, "DEFAULT", "crc32c" if s < 2 else "crc32")   # read when a chunk is encoded
        time.sleep(0.05)   # slower than handoff_delay: each step is handed over alone, as one chunk
        T.train_step("mlp", model, opt, None, s)
        live[s + 1] = T.snapshot(model, opt)
        t0 = time.monotonic()   # this step's chunk is encoded and received before the algorithm changes
        while ray.get(_worker(run, node).stats.remote())["received"] < s + 2 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
    ck.close()
    diffs = [json.loads(p.read_text()) for p in (pathlib.Path(uri) / "manifests").glob("*.json")]
    diffs = [d for d in diffs if d["kind"] == "diff"]
    # one object of the four one-step chunks (written within the worker's durable_delay of 2 s)
    assert [(d["first_step"], d["last_step"]) for d in diffs] == [(1, 4)], diffs
    assert diffs[0].get("crc_alg", "crc32") in checksum.ALGORITHMS
    for s in (1, 2, 3, 4):
        m, o = _fresh()[:2]
        assert ray_ckpt.restore(uri, m, o, step=s) == s
        T.assert_same(live[s], T.snapshot(m, o), f"step {s} of the merged object")


def test_a_long_runs_figures_stay_exact_and_periodic_callers_reuse_their_view(
        ray_cluster, tmp_path, monkeypatch):  # noqa: F811
    """A coordinator that has seen 200,000 steps (20,000 ten-step chunks held in memory, one lost, a durable full
    every 150 steps): a fresh status is exact. Before the one-sweep lineage its head alone took minutes, and the
    periodic calls (control, metrics: several a second) saturated the actor after ~30,000 steps. Periodic callers
    (``max_age > 0``) reuse a view once building it costs more than ``CHEAP_S``, and status says how old it is."""
    from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
    from ray_ckpt.runtime import coordinator as C
    from ray_ckpt.storage import open_storage

    def man(kind, first, last):
        name = full_name(1, last) if kind == "full" else diff_name(1, first, last)
        return Manifest(kind=kind, generation=1, first_step=first, last_step=last, object=object_key(name),
                        nbytes=1, crc32=0, strategy="lowdiff").to_json()

    def feed(first_chunk, last_chunk, lost=()):
        msgs = []
        for c in range(first_chunk, last_chunk + 1):
            a, b = 10 * c + 1, 10 * c + 10
            if c not in lost:
                msgs.append(("held", man("diff", a, b), None, node))
            if b % 150 == 0:
                msgs.append(("durable", man("full", b, b), []))
        coord.update(node, msgs)

    node = ray.get_runtime_context().get_node_id()
    coord = C.Coordinator(f"t-{uuid.uuid4().hex[:8]}", open_storage(str(tmp_path / "ckpt")),
                          CheckpointConfig(full_every=150, batch_steps=10, keep_fulls=0))
    coord.update(node, [("durable", man("full", 0, 0), [])])
    feed(0, 19_999, lost={7_000})                      # steps 70,001..70,010 held nowhere
    st = coord.status()
    assert st["recoverable_step"] == 200_000 and st["durable_step"] == 199_950
    assert st["memory_objects"] == 19_999 and st["replicated_objects"] == 0
    durable = st["restorable"]["durable"]
    assert durable[:2] == [[0, 0], [150, 150]] and len(durable) == 200_000 // 150 + 1
    memory = st["restorable"]["memory"]
    assert memory[0] == [1, 149] and [69_901, 70_000] in memory and [70_051, 70_199] in memory
    assert not any(lo <= 70_005 <= hi for lo, hi in memory + durable)   # the lost chunk, until the next full

    from ray_ckpt.runtime.coordination import state as views   # where the views are built and cached
    monkeypatch.setattr(views, "CHEAP_S", 0.0)         # any view counts as expensive ...
    monkeypatch.setattr(views, "COST_FACTOR", 1e9)     # ... and stays valid for this test
    assert coord.status(max_age=1.0)["recoverable_step"] == 200_000   # builds the periodic view
    feed(20_000, 20_009)
    periodic, fresh = coord.status(max_age=1.0), coord.status()
    assert periodic["recoverable_step"] == 200_000 and periodic["view_age_s"] >= 0
    assert fresh["recoverable_step"] == 200_100 and fresh["memory_objects"] == 20_009
