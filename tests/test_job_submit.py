"""`ray job submit` of the example against a Ray head started here with `ray start` (own ports, own temp dir,
auth disabled consistently, stopped by PID — never the CLI's global stop, which would kill every Ray here)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests import _training as T

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _pids_using(marker: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(d))
        except OSError:
            pass
    return [p for p in pids if p != os.getpid()]


@pytest.fixture
def ray_head():
    tmp = tempfile.mkdtemp(prefix="rcj", dir="/tmp")
    # PATH: the job's `python` must be this environment's, as on a cluster whose nodes installed ray_ckpt
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", ""), "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
    env.pop("RAY_ADDRESS", None)
    # every port explicit: another Ray on the machine (a benchmark, a developer's) must not collide with ours
    gcs, dash, agent, agent_grpc, metrics, rtenv, nm, om, client = (T.free_port() for _ in range(9))
    cmd = [os.path.join(BIN, "ray"), "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rtenv}", f"--node-manager-port={nm}",
           f"--object-manager-port={om}", f"--ray-client-server-port={client}",
           "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--temp-dir={tmp}/ray", "--num-cpus=5",
           "--memory=6000000000", "--object-store-memory=300000000", "--disable-usage-stats"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dash}", env, tmp
    finally:
        pids = _pids_using(tmp)
        for p in pids:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 5   # what ignores SIGTERM that long is killed
        while time.time() < deadline and _pids_using(tmp):
            time.sleep(0.3)
        for p in _pids_using(tmp):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def _ray(env, *args, timeout=600):
    return subprocess.run([os.path.join(BIN, "ray"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _submit_and_wait(ray_head, jobs: dict) -> dict:
    """Submit the example once per ``jobs`` entry (name: (storage, extra args)), all at once (their start-ups
    overlap); wait for every job to succeed; return each job's log."""
    address, env, tmp = ray_head
    runtime_env = {"working_dir": ROOT, "excludes": [".venv", ".git", "benchmarks/results", "*.pt", "*.png"]}
    ids = {}
    for name, (storage, extra) in jobs.items():
        cmd = ["job", "submit", f"--address={address}", f"--runtime-env-json={json.dumps(runtime_env)}",
               f"--submission-id={name}-{os.getpid()}", "--no-wait", "--",
               "python", "examples/train_gpt.py", "--steps", "8", "--preset", "tiny", "--workers", "2",
               "--storage", str(storage), "--full-every", "4", "--batch-steps", "2", "--corpus-mb", "1",
               "--log-every", "4", "--name", name, *extra]
        deadline = time.time() + 120
        while True:  # the head's dashboard agent needs a moment after `ray start` before it accepts jobs
            r = _ray(env, *cmd)
            if "No available agent" not in r.stdout + r.stderr or time.time() > deadline:
                break
            time.sleep(2)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        ids[name] = f"{name}-{os.getpid()}"
    # `ray job logs --follow` returns when its job has ended
    tails = {n: subprocess.Popen([os.path.join(BIN, "ray"), "job", "logs", f"--address={address}", "--follow", i],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n, i in ids.items()}
    logs = {n: p.communicate(timeout=600)[0] for n, p in tails.items()}
    for name, i in ids.items():
        st = _ray(env, "job", "status", f"--address={address}", i, timeout=120)
        assert "succeeded" in st.stdout.lower(), (name, st.stdout[-2000:], logs[name][-4000:])
    return logs


def test_ray_job_submit_trains_and_writes_lineage(ray_head, tmp_path):
    """The example as is."""
    jobs = {"job-test": (tmp_path / "ckpt", [])}
    logs = _submit_and_wait(ray_head, jobs)
    assert "[ray_ckpt] starting at step 0" in logs["job-test"], logs["job-test"][-4000:]
    from ray_ckpt.engine.lineage_io import load_lineage
    from ray_ckpt.storage import open_storage
    lineage, _ = load_lineage(open_storage(str(jobs["job-test"][0])))
    assert lineage.head() == 8 and lineage.reachable_steps(1)[-1] == 8
    # the defaults: the chains of the two newest fulls are kept (keep_fulls=2), older ones collected
    assert 1 <= len([m for m in lineage.manifests if m.kind == "full"]) <= 2


@pytest.mark.long   # make test covers FSDP2 under Ray Train in tests/test_sharded_ray_train.py
def test_ray_job_submit_fsdp_writes_every_ranks_shard_lineage(ray_head, tmp_path):
    """The example with FSDP2 (--fsdp): every rank writes its shard lineage; both reach the last step."""
    jobs = {"job-fsdp": (tmp_path / "ckpt_fsdp", ["--fsdp"])}
    _submit_and_wait(ray_head, jobs)
    from ray_ckpt.engine import shard_chains, shard_layout
    from ray_ckpt.engine.lineage_io import load_lineage
    from ray_ckpt.storage import open_storage
    s2 = open_storage(str(jobs["job-fsdp"][0]))
    assert shard_layout.saved_worlds(s2) == [2]
    for rank in range(2):
        lin, _ = load_lineage(shard_layout.shard_storage(s2, 2, rank))
        assert lin.head() == 8 and lin.reachable_steps(1) == list(range(9)), rank
    assert shard_chains.choose_world(s2, None) == (2, [8])
