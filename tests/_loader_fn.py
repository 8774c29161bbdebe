"""The epoch-shaped train_loop_per_worker of the Ray Train loader and rank-death tests (importable by Ray workers):
an MLP with Dropout, SGD with momentum, ``prepare_model`` + ``prepare_data_loader`` over a plain shuffling
``DataLoader`` (``config["generator"]``: with a generator of its own, seeded with it, as Ray Train's Fashion-MNIST
quickstart's users write it), the epoch loop of the Ray Train guide; optionally the top-k hook with error feedback. :func:`reference_worker` runs the same loop in torch.multiprocessing gloo ranks, without Ray
Train and without ray_ckpt (``DistributedDataParallel`` and a ``DistributedSampler`` loader, as
``prepare_model``/``prepare_data_loader`` build them on CPU): the uninterrupted run to compare with."""
from __future__ import annotations

import glob
import os
import time

import torch

ROWS, BATCH, EPOCHS = 256, 16, 3      # 2 workers: 128 rows each, 8 batches per epoch, 24 steps


def _data():
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(ROWS, 32, generator=g), torch.randint(0, 10, (ROWS,), generator=g))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(64, 10))


def _topk(net):
    from ray_ckpt import compression
    state = compression.TopKState(ratio=0.05, error_feedback=True)
    net.register_comm_hook(state, compression.topk_hook)
    return state


def _train(net, opt, data, *, rank, start, config, kill=None, preempted=None):
    """The epoch loop from ``start`` (``config["epochs"]`` epochs, default :data:`EPOCHS`); returns the step reached.
    ``config["progress"]``: after every step, write the steps this rank completed in this attempt to
    ``<out>/progress-<rank>-<start>`` and, once ``preempted()`` first returns a notice, that notice and the step
    to ``<out>/notice-<rank>-<start>.json``."""
    import json

    import torch.nn.functional as F
    step = start
    progress = os.path.join(config["out"], f"progress-{rank}-{start}") if config.get("progress") else None
    noticed = False
    for _epoch in data.epochs(config.get("epochs", EPOCHS), start_step=start):
        for x, y in data:
            if kill is not None and step == config.get("kill_at") and rank == config.get("kill_rank"):
                kill(config["out"])
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if progress is not None:
                with open(progress, "w") as f:
                    f.write(str(step))
                notice = preempted() if preempted is not None and not noticed else None
                if notice is not None:
                    noticed = True
                    with open(os.path.join(config["out"], f"notice-{rank}-{start}.json"), "w") as f:
                        json.dump({"step": step, "notice": notice}, f)
            time.sleep(config.get("step_sleep", 0))
    return step


def _final(out, rank, start, restored, step, data, model, opt, restore_s=0.0, startup=None) -> None:
    from tests import _training as T
    torch.save({"rank": rank, "start": start, "restored": restored, "step": step, "restore_s": restore_s,
                "startup": dict(startup or {}),
                "epoch": (data.epoch, data.position), "state": T.snapshot(model, opt), "rng": torch.get_rng_state()},
               os.path.join(out, f"final-{rank}-{time.time_ns()}.pt"))


def epoch_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader

    import ray_ckpt.train
    from tests._train_fn import _kill_once

    torch.set_num_threads(1)
    if "handoff_delay" in config:   # this worker's ray_ckpt config (the environment is the workers' own)
        os.environ["RAY_CKPT_HANDOFF_DELAY"] = str(config["handoff_delay"])
    os.environ.update(config.get("env", {}))
    rank = ray.train.get_context().get_world_rank()
    ds = _data()
    model = _model()
    net = ray.train.torch.prepare_model(model)
    topk = _topk(net) if config.get("topk") else None
    torch.manual_seed(100 + rank)                       # each rank's own dropout stream
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ray.train.torch.prepare_data_loader(DataLoader(ds, batch_size=BATCH, shuffle=True,
                                                            generator=_generator(config)))
    data = ray_ckpt.train.ResumableLoader(loader)
    storage = None
    if config.get("gate"):   # the lineage on a storage that refuses writes while the gate file exists
        from tests._gated_storage import GatedBackend
        storage = GatedBackend(*config["gate"])
    session = ray_ckpt.train.attach(net, opt, extra_state=data, report_every=0, compression_state=topk,
                                    storage_uri=storage)
    if config.get("progress"):
        with open(os.path.join(config["out"], f"node-{rank}-{session.start_step}"), "w") as f:
            f.write(ray.get_runtime_context().get_node_id())
    step = _train(net, opt, data, rank=rank, start=session.start_step, config=config, kill=_kill_once,
                  preempted=session.preempted)
    session.close()
    _final(config["out"], rank, session.start_step, session.restored, step, data, model, opt,
           session.restore_seconds, session.startup)


def _generator(config: dict):
    """The loader's own generator (``config["generator"]``: its seed), or None: the global RNG."""
    seed = config.get("generator")
    return None if seed is None else torch.Generator().manual_seed(seed)


def reference_worker(rank: int, world: int, port: int, configs: list) -> None:
    """torch.multiprocessing entry: each config of ``configs`` in turn (``out``, ``topk``), the loop of
    :func:`epoch_loop` uninterrupted, without Ray Train or ray_ckpt; writes the final state like it."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    import ray_ckpt.train
    from tests import _training as T

    with T.dist_group(rank, world, port):
        for config in configs:
            ds = _data()
            model = _model()
            net = DistributedDataParallel(model)
            if config.get("topk"):
                _topk(net)
            torch.manual_seed(100 + rank)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            loader = DataLoader(ds, batch_size=BATCH, shuffle=False, sampler=DistributedSampler(ds, shuffle=True),
                                generator=_generator(config))
            data = ray_ckpt.train.ResumableLoader(loader)
            step = _train(net, opt, data, rank=rank, start=0, config=config)
            _final(config["out"], rank, 0, False, step, data, model, opt)


def fit(ckpt, name: str, config: dict, *, storage_path, full_every: int, batch_steps: int, failure_config=None,
        label_selector=None):
    """Driver: :func:`epoch_loop` under Ray Train (2 CPU workers; ``failure_config``, default one restart allowed;
    ``label_selector`` as ScalingConfig takes it) with ray_ckpt's callback writing to ``ckpt``; the Result."""
    import ray_ckpt.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        epoch_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1},
                                     label_selector=label_selector),
        run_config=RunConfig(name=name, storage_path=str(storage_path),
                             failure_config=failure_config or FailureConfig(max_failures=1),
                             callbacks=[ray_ckpt.train.RayCkptCallback(ckpt, full_every=full_every,
                                                                       batch_steps=batch_steps)]))
    return trainer.fit()


def read_finals(out) -> dict:
    """Driver: each rank's final record of the last attempt under ``out``, by rank."""
    got = [torch.load(p, weights_only=True) for p in glob.glob(os.path.join(str(out), "final-*.pt"))]
    assert len(got) == 2, [(d["rank"], d["start"]) for d in got]     # one final per rank: the last attempt's
    return {d["rank"]: d for d in got}
