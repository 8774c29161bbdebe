"""A Ray Train driver script for the driver-restart test: connects to an existing cluster and trains."""
import os
import sys
from pathlib import Path

import ray

if __name__ == "__main__":
    address, tmp, name, steps = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    ray.init(address=address, namespace="ray_ckpt_tests", log_to_driver=False)
    from tests.test_ray_train_e2e import _fit
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    result = _fit(tmp, name, {"kind": "mlp", "steps": steps, "out": str(out), "step_sleep": 0.1})
    print("DONE", result.error, flush=True)
    os._exit(0)
