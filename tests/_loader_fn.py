"""The epoch-shaped train_loop_per_worker of the ResumableLoader Ray Train test (importable by Ray workers): an MLP
with Dropout, SGD with momentum, ``prepare_model`` + ``prepare_data_loader`` over a plain shuffling ``DataLoader``
without a generator of its own, the epoch loop of the Ray Train guide."""
from __future__ import annotations

import os
import time

import torch

ROWS, BATCH, EPOCHS = 256, 16, 3      # 2 workers: 128 rows each, 8 batches per epoch, 24 steps


def epoch_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import ray_ckpt.train
    from tests import _training as T
    from tests._train_fn import _kill_once

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    g = torch.Generator().manual_seed(11)
    ds = TensorDataset(torch.randn(ROWS, 32, generator=g), torch.randint(0, 10, (ROWS,), generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 10))
    net = ray.train.torch.prepare_model(model)
    torch.manual_seed(100 + rank)                       # each rank's own dropout stream
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ray.train.torch.prepare_data_loader(DataLoader(ds, batch_size=BATCH, shuffle=True))
    data = ray_ckpt.train.ResumableLoader(loader)
    session = ray_ckpt.train.attach(net, opt, extra_state=data, report_every=0)
    step = session.start_step
    for _epoch in data.epochs(EPOCHS, start_step=session.start_step):
        for x, y in data:
            if step == config.get("kill_at") and rank == config.get("kill_rank"):
                _kill_once(config["out"])
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            time.sleep(config.get("step_sleep", 0))
    session.close()
    torch.save({"rank": rank, "start": session.start_step, "restored": session.restored, "step": step,
                "epoch": (data.epoch, data.position), "state": T.snapshot(model, opt), "rng": torch.get_rng_state()},
               os.path.join(config["out"], f"final-{rank}-{time.time_ns()}.pt"))
