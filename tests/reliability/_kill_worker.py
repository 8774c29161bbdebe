"""A training process for the kill trials (tests/reliability/test_kill_trials.py): trains the shared MLP job with
runtime="ray" against a running Ray cluster and SIGKILLs itself at the point the trial names. Prints the number
of optimizer steps completed before each kill point, and the newest step the node's persistence worker had
acknowledged by then (``held``), so the test knows what was lost and what had to survive."""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import ray
    import torch

    import ray_ckpt
    from tests import _training as T

    torch.set_num_threads(1)
    ray.init(address=cfg["address"], namespace="ray_ckpt_tests", log_to_driver=False)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt)
    start = 0
    if cfg.get("resume"):
        start = ray_ckpt.restore(cfg["uri"], model, opt, scheduler=sch, runtime="ray", run=cfg["run"])

    def kill_after(delay: float) -> None:
        def go():
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=go, daemon=True).start()

    rng = random.Random(cfg["seed"])
    where, at = cfg["where"], cfg["at"]
    if where == "attach":                       # during the first full (the attach checkpoint)
        print(json.dumps({"done": start}), flush=True)
        kill_after(rng.uniform(0.0, 0.05))
    ck = ray_ckpt.Checkpointer(cfg["uri"], model, opt, scheduler=sch, runtime="ray", run=cfg["run"],
                               full_every=cfg["full_every"], batch_steps=1, handoff_delay=0.0,
                               recovery_every=cfg.get("recovery_every", 1))
    def held() -> int | None:
        return ck.stats()["runtime"]["held_step"]

    for s in range(start, cfg["steps"]):
        if s == at and where == "step":
            print(json.dumps({"done": s, "held": held()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        T.train_step("mlp", model, opt, sch, s)
        time.sleep(cfg.get("step_sleep", 0.05))
        if s + 1 == at and where == "flush":     # during a flush
            print(json.dumps({"done": s + 1, "held": held()}), flush=True)
            kill_after(rng.uniform(0.0, 0.02))
            ck.flush()
            time.sleep(5)
    ck.close()
    print(json.dumps({"done": cfg["steps"], "finished": True}), flush=True)


if __name__ == "__main__":
    main()
