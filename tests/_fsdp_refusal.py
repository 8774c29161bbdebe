"""Subprocess of tests/test_lowdiff_local.py: FSDP2 (fully_shard, world size 1, gloo) parameters are refused at
attach and at restore with a clear NotImplementedError. Prints OK on success."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import ray_ckpt


def main(port: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        uri = tempfile.mkdtemp()
        for call in (lambda: ray_ckpt.Checkpointer(uri, model, opt),
                     lambda: ray_ckpt.restore(uri, model, opt)):
            try:
                call()
            except NotImplementedError as e:
                assert "DTensor" in str(e) and "FSDP2" in str(e), e
            else:
                raise AssertionError("FSDP2 parameters were accepted")
        assert not os.listdir(uri), os.listdir(uri)   # refused before anything was written
    finally:
        dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
