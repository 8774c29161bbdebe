"""Subprocess for the crash-consistency test: trains and checkpoints until it is SIGKILLed."""
import sys

import torch

import ray_ckpt
from tests import _training as T

if __name__ == "__main__":
    uri = sys.argv[1]
    torch.set_num_threads(1)
    model = T.MLP(d_in=32, hidden=512, d_out=8)  # ~280k params: writes take long enough to be cut
    torch.manual_seed(0)
    model = T.MLP(d_in=32, hidden=512, d_out=8)
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, full_every=10, batch_steps=3)
    for s in range(10_000):
        T.train_step("mlp", model, opt, None, s)
        print(f"step {s + 1} committed {ck.last_committed_step}", flush=True)
