"""Ray Data helpers of the ResumableShard tests (importable by Ray workers): the dataset (a few thousand rows with
derived features and a seeded shuffle), and :func:`split_epochs`, which consumes the splits of a
``streaming_split`` in threads of the driver the way Ray Train's workers consume theirs."""
from __future__ import annotations

import threading

ROWS = 2048


def make_dataset(*, seed=7, reseed=False, unseeded=False, rows: int = ROWS, blocks: int = 16):
    """Driver: ``range(rows)`` → features ``x`` (8 floats derived from the id), label ``y`` → a random shuffle
    (``seed``; ``reseed``: a new order every execution, ``RandomSeedConfig(reseed_after_execution=True)``;
    ``unseeded``: no seed)."""
    import numpy as np
    import ray

    def features(b):
        ids = b["id"]
        x = np.stack([np.sin(ids * (k + 1) * 0.01) for k in range(8)], axis=1).astype("float32")
        return {"id": ids, "x": x, "y": (ids % 10).astype("int64")}

    ds = ray.data.range(rows, override_num_blocks=blocks).map_batches(features)
    if unseeded:
        return ds.random_shuffle()
    if reseed:
        from ray.data._internal.random_config import RandomSeedConfig
        return ds.random_shuffle(seed=RandomSeedConfig(seed=seed, reseed_after_execution=True))
    return ds.random_shuffle(seed=seed)


def split_epochs(ds, n: int, consume) -> list:
    """Driver: ``ds.streaming_split(n, equal=True)``; ``consume(i, iterator)`` runs in a thread per split (they
    share the coordinator's epoch barrier); returns their results by split."""
    its = ds.streaming_split(n, equal=True)
    out: list = [None] * n
    errors: list = []

    def run(i):
        try:
            out[i] = consume(i, its[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the driver
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


BATCH, EPOCHS = 32, 2     # 2 workers: 1024 rows each, 32 batches per epoch, 64 steps


def train_loop(config: dict) -> None:
    """Ray Train worker: a dropout MLP over ``get_dataset_shard("train")`` through ``ResumableShard``; every step
    appends ``<step> <epoch> <ids...>`` to ``<out>/ids-<rank>-<start>.txt`` (world rank 0 also writes the progress
    file the node-removal helper reads); rank ``kill_rank`` SIGKILLs itself once before step ``kill_at``; the final
    state goes to ``<out>/final-<rank>-<start>.pt``."""
    import os
    import time

    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    import ray_ckpt.train
    from tests import _training as T
    from tests._train_fn import _kill_once, _write_progress

    torch.set_num_threads(1)
    os.environ.update(config.get("env", {}))
    ctx = ray.train.get_context()
    rank, world, out = ctx.get_world_rank(), ctx.get_world_size(), config["out"]
    data = ray_ckpt.train.ResumableShard(ray.train.get_dataset_shard("train"), batch_size=BATCH)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 10))
    net = ray.train.torch.prepare_model(model)
    torch.manual_seed(100 + rank)                       # each rank's own dropout stream
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session = ray_ckpt.train.attach(net, opt, extra_state=data, report_every=0)
    start = step = session.start_step
    with open(os.path.join(out, f"ids-{rank}-{start}.txt"), "a") as ids:
        for epoch in data.epochs(config.get("epochs", EPOCHS), start_step=start):
            for batch in data:
                if step == config.get("kill_at") and rank == config.get("kill_rank"):
                    _kill_once(out)
                loss = F.cross_entropy(net(batch["x"]), batch["y"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                ids.write(f"{step} {epoch} {' '.join(map(str, batch['id'].tolist()))}\n")
                ids.flush()
                if rank == 0:
                    _write_progress(out, step, world)
                time.sleep(config.get("step_sleep", 0))
    session.close()
    torch.save({"rank": rank, "world": world, "start": start, "step": step, "skip_s": data.skip_seconds,
                "warning": data.order_warning(),
                "restarted_epoch": data.restarted_epoch, "state": T.snapshot(model, opt), "rng": torch.get_rng_state()},
               os.path.join(out, f"final-{rank}-{start}.pt"))


def read_ids(out, rank: int, start: int, *, before: int | None = None) -> dict:
    """Driver: ``{epoch: [ids...]}`` rank ``rank`` trained in the attempt that started at ``start`` (steps up to
    ``before`` only, when given: the steps the restore kept)."""
    import os
    got: dict = {}
    with open(os.path.join(str(out), f"ids-{rank}-{start}.txt")) as f:
        for line in f:
            step, epoch, *ids = map(int, line.split())
            if before is None or step <= before:
                got.setdefault(epoch, []).extend(ids)
    return got


def fit(ds, out, name: str, storage_path, *, workers=2, resource: str | None = None, config: dict | None = None,
        max_failures: int = 1):
    """Driver: :func:`train_loop` under Ray Train with ``datasets={"train": ds}`` (``workers``: a count or a
    (min, max) range; ``resource``: a custom resource each worker needs) and ray_ckpt's callback; the Result."""
    import ray_ckpt.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    per_worker = {"CPU": 1, **({resource: 1} if resource else {})}
    trainer = TorchTrainer(
        train_loop, train_loop_config={"out": str(out), **(config or {})}, datasets={"train": ds},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker=per_worker),
        run_config=RunConfig(name=name, storage_path=str(storage_path),
                             failure_config=FailureConfig(max_failures=max_failures),
                             callbacks=[ray_ckpt.train.RayCkptCallback(str(out) + "-ckpt", full_every=20,
                                                                       batch_steps=10)]))
    return trainer.fit()
