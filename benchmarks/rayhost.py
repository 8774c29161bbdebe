"""A private local Ray cluster for the benchmark, owned by a helper process.

``python -m benchmarks.rayhost <temp_dir> <num_cpus> <object_store_bytes>`` starts Ray with
``ray.init(address="local", _temp_dir=..., ...)`` (never attaching to another Ray on the machine), prints one
JSON line ``{"address": ...}`` and keeps the cluster up until its stdin closes; then ``ray.shutdown()`` stops
exactly the processes it started. The orchestrator forks its training processes *without* Ray state and lets
them connect to this address (a process that called ``ray.init`` must not fork workers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


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


class RayHost:
    """Handle held by the orchestrator: ``start()``, ``.address``, ``stop()``."""

    def __init__(self, temp_dir: str, num_cpus: int, object_store_bytes: int):
        self.temp_dir, self.num_cpus, self.osm = temp_dir, num_cpus, object_store_bytes
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout: float = 120.0) -> str:
        os.makedirs(os.path.join(self.temp_dir, "ray"), exist_ok=True)
        env = dict(os.environ)
        env["RAY_TMPDIR"] = self.temp_dir  # where a plain ray.init() would look: ours, not /tmp/ray
        self.log = open(os.path.join(self.temp_dir, "rayhost.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.rayhost", os.path.join(self.temp_dir, "ray"),
                                      str(self.num_cpus), str(self.osm)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip().startswith(b"{"):
                break
            if self.proc.poll() is not None:
                break
        if not line.strip().startswith(b"{"):
            self.stop()
            try:
                with open(os.path.join(self.temp_dir, "rayhost.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
            except OSError:
                tail = ""
            raise RuntimeError(f"the benchmark's Ray cluster did not start:\n{tail}")
        self.address = json.loads(line)["address"]
        return self.address

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait(timeout=10)
        self.proc = None
        self.log.close()


if __name__ == "__main__":
    main()
