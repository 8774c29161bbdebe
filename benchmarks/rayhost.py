"""A private local Ray cluster for the benchmark, owned by a helper process.

``python -m benchmarks.rayhost <temp_dir> <num_cpus> <object_store_bytes>`` starts Ray with
``ray.init(address="local", _temp_dir=..., ...)`` (never attaching to another Ray on the machine), prints one
JSON line ``{"address": ...}`` and keeps the cluster up until its stdin closes; then ``ray.shutdown()`` stops
exactly the processes it started. The orchestrator forks its training processes *without* Ray state and lets
them connect to this address (a process that called ``ray.init`` must not fork workers). The orchestrator's
handle on this process is :class:`benchmarks.harness.RayHost`.
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    temp_dir, num_cpus, osm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import ray
    ctx = ray.init(address="local", _temp_dir=temp_dir, num_cpus=num_cpus, object_store_memory=osm,
                   include_dashboard=False, namespace="ray_ckpt_bench", log_to_driver=False,
                   configure_logging=False)
    print(json.dumps({"address": ctx.address_info["gcs_address"], "pid": os.getpid()}), flush=True)
    try:
        sys.stdin.read()  # until the orchestrator closes the pipe (or dies)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
