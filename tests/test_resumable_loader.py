"""ResumableLoader in a plain loop (one process, runtime="local"): a run stopped at a step and restored into a fresh
model, optimizer and loader ends bitwise where the uninterrupted run ends (model, optimizer, global RNG, the
loader's own generator), mid-epoch, at an epoch's end and at step 0, with a generator-less shuffling loader, one
with its own generator, a DistributedSampler (a rank of two, no process group) and loader workers; consumed
batches are not loaded again; what it cannot resume exactly is refused. A naive resume (a fresh iterator, the
consumed batches skipped with next()) sees the same batches and still ends elsewhere: the base-seed draw."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import ray_ckpt
from ray_ckpt.train import ResumableLoader

ROWS, BATCH, EPOCHS = 96, 16, 3


class Rows(Dataset):
    """Fixed rows; counts the rows it loads (in this process)."""

    def __init__(self, rows: int = ROWS):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(rows, 8, generator=g)
        self.y = torch.randint(0, 4, (rows,), generator=g)
        self.loads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loads += 1
        return self.x[i], self.y[i]


def _loader(kind: str, ds: Dataset, batch: int = BATCH) -> DataLoader:
    if kind == "shuffle":
        return DataLoader(ds, batch_size=batch, shuffle=True)
    if kind == "generator":
        return DataLoader(ds, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(7))
    if kind in ("dist0", "dist1"):
        sampler = DistributedSampler(ds, num_replicas=2, rank=int(kind[-1]), shuffle=True, seed=0)
        return DataLoader(ds, batch_size=batch, sampler=sampler)
    if kind == "workers":
        return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=2)
    if kind == "unbatched":                 # no batch sampler: the sampler's indices are the steps
        return DataLoader(ds, batch_size=None, shuffle=True)
    raise AssertionError(kind)


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _train(model, opt, data: ResumableLoader, start: int, stop: int | None = None, seen: list | None = None) -> int:
    step = start
    if step == stop:
        return step
    for _epoch in data.epochs(EPOCHS, start_step=start):
        for x, y in data:
            if seen is not None:
                seen.append(x.clone())
            _step(model, opt, x, y)
            step += 1
            if step == stop:
                return step
    return step


def _final(model, opt, loader) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
            "rng": torch.get_rng_state(), "gen": None if loader.generator is None else loader.generator.get_state()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    assert a["opt"]["state"].keys() == b["opt"]["state"].keys()
    for i, st in a["opt"]["state"].items():
        assert st.keys() == b["opt"]["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(v, b["opt"]["state"][i][k]), (i, k)
    assert torch.equal(a["rng"], b["rng"])
    assert (a["gen"] is None) == (b["gen"] is None)
    if a["gen"] is not None:
        assert torch.equal(a["gen"], b["gen"])


def _uninterrupted(kind: str, seen: list | None = None) -> tuple[dict, int]:
    model, opt = _build()
    loader = _loader(kind, Rows())
    steps = _train(model, opt, ResumableLoader(loader), 0, seen=seen)
    return _final(model, opt, loader), steps


_REFERENCES: dict = {}


def _reference(kind: str) -> tuple[dict, int, list]:
    """The uninterrupted run's final state, its steps and the batches it trained on (computed once per kind)."""
    if kind not in _REFERENCES:
        seen: list = []
        final, steps = _uninterrupted(kind, seen)
        _REFERENCES[kind] = (final, steps, seen)
    return _REFERENCES[kind]


def _stopped_at(kind: str, stop: int, uri: str) -> None:
    """Train to ``stop`` with a Checkpointer, close it, drop everything."""
    model, opt = _build()
    data = ResumableLoader(_loader(kind, Rows()))
    ck = ray_ckpt.Checkpointer(uri, model, opt, extra_state=data, runtime="local", full_every=4, batch_steps=2)
    assert _train(model, opt, data, 0, stop=stop) == stop
    ck.close()


def _uri(tmp_path) -> str:
    return (tmp_path / "ck").as_uri()


@pytest.mark.parametrize("kind,stop", [
    ("shuffle", 8),    # epoch 1, batch 2 of 6
    ("shuffle", 6),    # the end of epoch 0
    ("shuffle", 0),    # the attach-time full
    ("shuffle", 17),   # the last epoch's last batch but one
    ("generator", 9),
    ("generator", 12),   # the end of epoch 1: the loader's own generator replays its draws
    ("dist0", 4),      # 3 batches per epoch on each of 2 ranks: epoch 1, batch 1
    ("dist1", 5),
    ("dist1", 3),
    ("workers", 8),
    ("unbatched", 100),   # epoch 1, row 4 of 96
])
def test_restored_run_ends_bitwise_where_the_uninterrupted_run_ends(tmp_path, kind, stop):
    reference, total, seen_ref = _reference(kind)
    uri = _uri(tmp_path)
    _stopped_at(kind, stop, uri)

    model, opt = _build(seed=99)                 # a fresh process: other weights, another RNG
    ds = Rows()
    loader = _loader(kind, ds)
    data = ResumableLoader(loader)
    step = ray_ckpt.restore(uri, model, opt, extra_state=data)
    assert step == stop
    per_epoch = len(loader)
    if stop:
        assert (data.epoch, data.position) in {divmod(stop, per_epoch), (stop // per_epoch - 1, per_epoch)}
    assert _train(model, opt, data, step) == total
    _assert_same(_final(model, opt, loader), reference)
    if kind != "workers":          # the rows loaded after the restore: only the remaining batches'
        assert ds.loads == sum(len(x) if x.dim() > 1 else 1 for x in seen_ref[stop:])


def test_the_wrapper_leaves_an_uninterrupted_run_as_the_plain_loop_has_it():
    for kind in ("shuffle", "dist1"):
        reference, _, _ = _reference(kind)
        model, opt = _build()
        loader = _loader(kind, Rows())
        for epoch in range(EPOCHS):
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)
            for x, y in loader:
                _step(model, opt, x, y)
        _assert_same(_final(model, opt, loader), reference)


def _restored_without_the_helper(kind: str, stop: int, tmp_path):
    """A run of ``kind`` stopped after ``stop`` steps, restored into a fresh model and optimizer with a plain
    loader (no ResumableLoader): ``(model, opt, loader, restored step)``."""
    uri = _uri(tmp_path)
    _stopped_at(kind, stop, uri)
    model, opt = _build(seed=99)
    loader = _loader(kind, Rows())
    return model, opt, loader, ray_ckpt.restore(uri, model, opt)


def test_naive_resume_sees_the_same_batches_and_ends_elsewhere(tmp_path):
    """The DistributedSampler's order depends only on its seed and epoch: a fresh iterator with the consumed
    batches skipped by next() trains on the same batches, yet its base-seed draw shifts the dropout RNG."""
    kind, stop = "dist0", 4
    reference, total, seen_ref = _reference(kind)
    model, opt, loader, step = _restored_without_the_helper(kind, stop, tmp_path)
    epoch, pos = divmod(step, len(loader))
    seen: list = []
    for e in range(epoch, EPOCHS):
        loader.sampler.set_epoch(e)
        it = iter(loader)
        for _ in range(pos if e == epoch else 0):
            next(it)
        for x, y in it:
            seen.append(x.clone())
            _step(model, opt, x, y)
            step += 1
    assert step == total
    assert len(seen) == len(seen_ref) - stop and all(torch.equal(a, b) for a, b in zip(seen, seen_ref[stop:]))
    naive = _final(model, opt, loader)
    assert not torch.equal(naive["rng"], reference["rng"])
    assert any(not torch.equal(naive["model"][k], reference["model"][k]) for k in reference["model"])


def test_a_generator_less_shuffle_resumed_naively_trains_other_batches(tmp_path):
    """Without the recorded epoch-start RNG a RandomSampler's permutation is drawn from the restored step's RNG."""
    kind, stop = "shuffle", 8
    _, _, seen_ref = _reference(kind)
    model, opt, loader, step = _restored_without_the_helper(kind, stop, tmp_path)
    epoch, pos = divmod(step, len(loader))
    it = iter(loader)
    for _ in range(pos):
        next(it)
    rest = [x for x, _ in it]
    assert not all(torch.equal(a, b) for a, b in zip(rest, seen_ref[stop:]))


def test_a_restored_run_must_have_restored_the_wrapper(tmp_path):
    uri = _uri(tmp_path)
    _stopped_at("shuffle", 8, uri)
    model, opt = _build()
    data = ResumableLoader(_loader("shuffle", Rows()))
    step = ray_ckpt.restore(uri, model, opt)        # the wrapper not given to extra_state
    with pytest.raises(RuntimeError, match="was not restored: give it to extra_state"):
        next(iter(data.epochs(EPOCHS, start_step=step)))


@pytest.mark.parametrize("change,match", [
    (lambda ds: DataLoader(ds, batch_size=8, shuffle=True), "batch_size: 16 then, 8 now"),
    (lambda ds: DataLoader(Rows(80), batch_size=BATCH, shuffle=True), "samples: 96 then, 80 now"),
    (lambda ds: DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=3, rank=0)),
     "replicas: None then, 3 now"),
])
def test_a_loader_of_another_shape_is_refused_at_restore(tmp_path, change, match):
    uri = _uri(tmp_path)
    _stopped_at("shuffle", 8, uri)
    model, opt = _build()
    data = ResumableLoader(change(Rows()))
    with pytest.raises(ValueError, match=match):
        ray_ckpt.restore(uri, model, opt, extra_state=data)


def test_another_ranks_position_is_refused_when_the_loop_starts_and_replaced_by_its_own(tmp_path):
    """Under Ray Train every rank loads rank 0's extra state first, then its own over it: the rank is checked when
    the loop starts; a rank left with rank 0's position (it joined a resized group) is refused there."""
    rank0, rank1 = (tmp_path / "r0").as_uri(), (tmp_path / "r1").as_uri()
    _stopped_at("dist0", 4, rank0)
    _stopped_at("dist1", 4, rank1)
    model, opt = _build(seed=99)
    loader = _loader("dist1", Rows())
    data = ResumableLoader(loader)
    step = ray_ckpt.restore(rank0, model, opt, extra_state=data)
    with pytest.raises(ValueError, match="position is rank 0's and this is rank 1"):
        next(iter(data.epochs(EPOCHS, start_step=step)))
    with pytest.raises(ValueError, match="position is rank 0's and this is rank 1"):
        next(iter(data))
    assert ray_ckpt.restore(rank1, model, opt, extra_state=data) == step     # its own over it
    assert _train(model, opt, data, step) == _reference("dist1")[1]
    _assert_same(_final(model, opt, loader), _reference("dist1")[0])


def test_what_cannot_resume_exactly_is_refused_when_wrapped():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(TypeError, match="map-style dataset"):
        ResumableLoader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(ValueError, match="persistent_workers"):
        ResumableLoader(DataLoader(Rows(), batch_size=2, num_workers=1, persistent_workers=True))
    from torchdata.stateful_dataloader import StatefulDataLoader
    with pytest.raises(TypeError, match="StatefulDataLoader resumes itself"):
        ResumableLoader(StatefulDataLoader(Rows(), batch_size=2))
    with pytest.raises(TypeError, match="wraps a torch.utils.data.DataLoader"):
        ResumableLoader([1, 2, 3])


def test_epochs_and_position_follow_the_loop():
    data = ResumableLoader(_loader("shuffle", Rows()))
    assert list(data.epochs(0)) == []
    got = []
    for epoch in data.epochs(2):
        for i, _ in enumerate(data):
            got.append((epoch, data.epoch, data.position))
            if epoch == 0 and i == 2:
                break                           # an abandoned pass: the next one is the next epoch
    assert got[:3] == [(0, 0, 1), (0, 0, 2), (0, 0, 3)]
    assert got[3:] == [(1, 1, p) for p in range(1, 7)]
