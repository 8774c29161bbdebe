"""The lineage index: planning a restore with a bounded number of storage requests (local and moto S3)."""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ray_ckpt
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.restore import plan_restore, resolve_and_load
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.lineage import index as lineage_index
from ray_ckpt.lineage.layout import INDEX_KEY


class CountingStorage:
    """Delegates to a backend and counts every call (each is at least one storage request)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = collections.Counter()
        if hasattr(inner, "list_after"):
            self.list_after = self._list_after

    def _count(self, name):
        self.calls[name] += 1

    def read(self, key):
        self._count("read")
        return self.inner.read(key)

    def list(self, prefix=""):
        self._count("list")
        return self.inner.list(prefix)

    def _list_after(self, prefix, start_after=""):
        self._count("list_after")
        return self.inner.list_after(prefix, start_after)

    def write(self, key, data):
        self._count("write")
        return self.inner.write(key, data)

    def exists(self, key):
        self._count("exists")
        return self.inner.exists(key)

    def size(self, key):
        self._count("size")
        return self.inner.size(key)

    def delete(self, key):
        self._count("delete")
        return self.inner.delete(key)

    def describe(self):
        return self.inner.describe()

    @property
    def total(self):
        return sum(self.calls.values())


def _manifest(gen, kind, first, last):
    name = full_name(gen, last) if kind == "full" else diff_name(gen, first, last)
    return Manifest(kind=kind, generation=gen, first_step=first, last_step=last, object=object_key(name),
                    nbytes=10, crc32=0, created=0.0)


def _run(steps, tail, full_every=100, batch=10, gen=1):
    """Manifests of a run of ``steps`` steps (fulls every ``full_every``, diff objects of ``batch`` steps),
    then ``tail`` more diff objects committed after the last full."""
    ms = [_manifest(gen, "full", 0, 0)]
    for s in range(batch, steps + 1, batch):
        ms.append(_manifest(gen, "diff", s - batch + 1, s))
        if s % full_every == 0:
            ms.append(_manifest(gen, "full", s, s))
    before = list(ms)
    for i in range(tail):
        s = steps + (i + 1) * batch
        ms.append(_manifest(gen, "diff", s - batch + 1, s))
    return before, ms


def _store(storage, manifests, index_of):
    client = getattr(storage, "_list_client", lambda: None)()
    if client is not None:  # S3: one PUT per manifest (cheap setup; pyarrow's writer adds requests)
        root = f"{storage.prefix}/" if storage.prefix else ""
        put = lambda m: client.put_object(Bucket=storage.bucket, Key=root + m.key, Body=m.to_json())  # noqa: E731
    else:
        put = lambda m: storage.write(m.key, m.to_json())  # noqa: E731
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(put, manifests))
    lineage_index.write_index(storage, index_of)


def _plan_requests(storage):
    """Plan a restore of the latest step as ``restore`` does (index, newer manifests, the plan's manifests
    re-checked), counting the storage calls."""
    counting = CountingStorage(storage)
    plan, _, bad = plan_restore(counting, None, strict=False)
    return counting, plan, bad


@pytest.mark.s3
@pytest.mark.parametrize("batch,full_every", [(50, 500), pytest.param(10, 100, marks=pytest.mark.slow)])
def test_planning_on_s3_is_bounded_at_10000_steps(s3_server, batch, full_every):
    """10,000 committed steps; the default variant writes 220 manifests (batch 50), the slow one 1,100."""
    from ray_ckpt.storage import open_storage

    counts = {}
    for steps in (1_000, 10_000):
        bucket = s3_server.make_bucket(f"lineage-index-{steps}-{batch}")
        storage = open_storage(f"{bucket}/run", **s3_server.options)
        before, ms = _run(steps, tail=5, full_every=full_every, batch=batch)
        _store(storage, ms, before)
        counting, plan, bad = _plan_requests(storage)
        assert not bad
        assert plan.step == steps + 5 * batch and plan.full.last_step == steps and len(plan.diffs) == 5
        counts[steps] = counting.total
        print(f"{steps} steps: {dict(counting.calls)}")
        assert counting.total < 20, counting.calls
        assert counting.calls["list"] == 0  # only bounded listings (after the watermarks)
    # the request count does not grow with the number of steps
    assert counts[10_000] == counts[1_000], counts
    # without the index a plan reads every manifest (1,105 with batch 10, 225 with batch 50)
    assert len([k for k in storage.list("manifests/") if k.endswith(".json")]) == len(ms) >= 10_000 // batch


def test_index_never_hides_newer_objects(tmp_path):
    from ray_ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "s"))
    before, ms = _run(300, tail=3)
    _store(storage, ms, before)
    lin, _ = load_lineage(storage)
    assert lin.resolve(None).step == 330
    # committed after the index: a new full and diffs of generation 1, then a new generation
    late = [_manifest(1, "diff", 331, 340), _manifest(1, "full", 340, 340), _manifest(2, "full", 340, 340),
            _manifest(2, "diff", 341, 345)]
    for m in late:
        storage.write(m.key, m.to_json())
    lin, _ = load_lineage(storage)
    plan = lin.resolve(None)
    assert (plan.step, plan.generation, plan.full.name) == (345, 2, full_name(2, 340))
    full_listing, _ = load_lineage(storage, use_index=False)
    assert sorted(m.name for m in lin.manifests) == sorted(m.name for m in full_listing.manifests)


def test_an_object_committed_behind_the_index_is_never_hidden(tmp_path):
    """After a persistence worker restarts, its peer writes the chunks it held of it while the run goes on: an
    index written at a later full may already be past them. The coordinator's index stops its watermarks below
    objects it knows may still be committed, and a late writer deletes an index that hides its object
    (the state-tier test with a killed worker lost steps 9-12 to storage-only restores before: CI flake)."""
    from ray_ckpt.engine.lineage_io import unhide
    from ray_ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "s"))
    before, ms = _run(30, tail=0, full_every=10, batch=4)  # fulls 0, 20 (every 10 at batch 4: 20 only), diffs
    late = _manifest(1, "diff", 31, 34)        # held by a peer, not committed yet
    after = [_manifest(1, "diff", 35, 38), _manifest(1, "full", 38, 38)]
    for m in ms + after:
        storage.write(m.key, m.to_json())
    everything = ms + after + [late]

    # 1. the coordinator knows the late object is pending: the index's diff watermark stays below it
    lineage_index.write_index(storage, ms + after, pending=[late])
    index = lineage_index.decode_index(storage.read(INDEX_KEY))
    assert index[1]["g000001-diff"] < late.key and index[1]["g000001-full"] == after[-1].key
    storage.write(late.key, late.to_json())
    assert not lineage_index.hides(index, late) and not unhide(storage, late)
    lin, _ = load_lineage(storage)
    assert sorted(m.name for m in lin.manifests) == sorted(m.name for m in everything)

    # 2. an index written without that knowledge hides it; the late writer's unhide deletes it
    storage.delete(late.key)
    lineage_index.write_index(storage, ms + after)
    storage.write(late.key, late.to_json())
    lin, _ = load_lineage(storage)
    assert late.name not in {m.name for m in lin.manifests}          # what went wrong before
    assert unhide(storage, late) and not storage.exists(INDEX_KEY)
    lin, _ = load_lineage(storage)
    assert sorted(m.name for m in lin.manifests) == sorted(m.name for m in everything)

    # 3. a pending object of an older generation: the index covers that generation, readers list the newer one
    gen2 = [_manifest(2, "full", 38, 38), _manifest(2, "diff", 39, 42)]
    for m in gen2:
        storage.write(m.key, m.to_json())
    storage.delete(late.key)
    lineage_index.write_index(storage, ms + after + gen2, pending=[late])
    index = lineage_index.decode_index(storage.read(INDEX_KEY))
    assert index[0] == 1 and not lineage_index.hides(index, late)
    storage.write(late.key, late.to_json())
    lin, _ = load_lineage(storage)
    assert sorted(m.name for m in lin.manifests) == sorted(m.name for m in everything + gen2)
    assert lin.resolve(None).step == 42
    # an index of generation 2 that does not list the late generation-1 object hides it
    lineage_index.write_index(storage, ms + after + gen2)
    assert lineage_index.hides(lineage_index.decode_index(storage.read(INDEX_KEY)), late)


def test_missing_or_broken_index_falls_back_to_listing(tmp_path):
    from ray_ckpt.storage import open_storage

    storage = open_storage(str(tmp_path / "s"))
    before, ms = _run(200, tail=2)
    for m in ms:
        storage.write(m.key, m.to_json())
    counting = CountingStorage(storage)
    lin, _ = load_lineage(counting)  # no index yet
    assert lin.resolve(None).step == 220 and counting.calls["list"] == 1
    for junk in (b"{not json", b'{"format": 99}', b'{"format": 1, "generation": 1, "watermarks": '
                                                    b'{"g000001-diff": "../../etc"}, "manifests": []}'):
        storage.write(INDEX_KEY, junk)
        lin, _ = load_lineage(storage)
        assert lin.resolve(None).step == 220 and len(lin.manifests) == len(ms)


def _train(ck_kwargs, uri, steps, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with ray_ckpt.Checkpointer(uri, model, opt, **ck_kwargs) as ck:
        for i in range(steps):
            opt.zero_grad()
            model(torch.full((2, 4), float(i))).sum().backward()
            opt.step()
        assert ck.step == steps
    return model, opt


def test_local_writer_rolls_the_index_and_restore_uses_it(tmp_path):
    from ray_ckpt.storage import open_storage

    uri = str(tmp_path / "ck")
    model, opt = _train(dict(full_every=6, batch_steps=2, recovery_every=1, keep_fulls=0), uri, 15)
    storage = open_storage(uri)
    assert storage.exists(INDEX_KEY)
    _, _, indexed = lineage_index.decode_index(storage.read(INDEX_KEY))
    assert max(m.last_step for m in indexed if m.kind == "full") == 12
    m2 = torch.nn.Linear(4, 3)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
    assert ray_ckpt.restore(uri, m2, o2) == 15
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    # a stale index (objects garbage-collected behind its back): the restore falls back to listing
    lin, _ = load_lineage(storage)
    plan = lin.resolve(None)
    stale_full = full_name(1, 12)
    storage.delete(f"manifests/{stale_full}.json")
    storage.delete(object_key(stale_full))
    chain = resolve_and_load(storage, None, fallback=False)
    assert chain.step == 15 and chain.plan.full.last_step == 6 and plan.full.last_step == 12


def test_the_index_is_rewritten_at_every_cheap_full_then_by_its_cost():
    """A long run's index costs tens of ms to hundreds (every manifest, at every full): rewritten at every full
    while cheap, then at most once per COST_FACTOR times what the last rewrite took, and always when forced
    (garbage collection deleted objects the last index names)."""
    RewriteClock = lineage_index.RewriteClock
    clock = RewriteClock()
    assert clock.due(0.0)
    clock.done(10.0, 0.001)                           # cheap: the next full rewrites it again
    assert clock.due(10.002)
    clock.done(20.0, 0.5)                             # 0.5 s of CPU: not before 20 + 0.5 * COST_FACTOR
    assert not clock.due(20.0 + 0.5 * RewriteClock.COST_FACTOR - 0.1)
    assert clock.due(20.0 + 0.5 * RewriteClock.COST_FACTOR)
    assert clock.due(21.0, force=True)
