"""One writer per lineage (issue #12 item 3): the writer lease, with two real processes, on local storage and S3."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ray_ckpt
from ray_ckpt.engine.lease import Lease, LeaseError
from ray_ckpt.lineage.layout import LEASE_KEY
from ray_ckpt.storage import open_storage
from tests import _training as T
from tests.reliability import record

HOLDER = r"""
import sys, time, torch
sys.path.insert(0, {root!r})
import ray_ckpt
from tests import _training as T
model = T.make_model("mlp"); opt = T.make_optimizer("adamw", model)
ck = ray_ckpt.Checkpointer({uri!r}, model, opt, full_every=2, batch_steps=1)
print("attached", flush=True)
s = 0
try:
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        T.train_step("mlp", model, opt, None, s); s += 1
        ck.flush()
        print("step", s, flush=True)
except ray_ckpt.WriterError as e:
    print("WriterError:", e, flush=True)
    sys.exit(3)
"""


def _holder(uri):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=root, uri=str(uri))], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "attached", p.stderr.read()
    return p


def _step(p) -> str:
    p.stdin.write("go\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def _attach(uri, **kw):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    return ray_ckpt.Checkpointer(uri, model, opt, full_every=2, batch_steps=1, **kw), model, opt


def test_second_writer_is_refused_then_takes_over_explicitly(tmp_path):
    uri = tmp_path / "ckpt"
    a = _holder(uri)
    try:
        assert _step(a) == "step 1"
        with pytest.raises(LeaseError, match=f"pid {a.pid}") as e:
            _attach(uri)
        assert "takeover=True" in str(e.value) and "ray-ckpt lease" in str(e.value)
        ck, model, opt = _attach(uri, takeover=True)               # explicit: the old writer is fenced off
        T.train_step("mlp", model, opt, None, 0)
        ck.flush()
        out = _step(a)                                             # its next commit finds the lease taken
        assert out.startswith("WriterError:") and f"pid {os.getpid()}" in out, out
        rc = a.wait(timeout=60)
        assert rc == 3, (rc, a.stderr.read()[-3000:])
        ck.close()
        assert not (uri / LEASE_KEY).exists()                       # released at close
        record("second writer on one lineage: refused, then explicit takeover", trials=1, recovered=1, bitwise=1,
               steps_lost=[0])
    finally:
        a.kill()


def test_a_crashed_writer_on_this_host_does_not_block_the_restart(tmp_path, caplog):
    uri = tmp_path / "ckpt"
    a = _holder(uri)
    assert _step(a) == "step 1"
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=30)
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    assert ray_ckpt.restore(uri, model, opt) == 1
    with caplog.at_level("WARNING", logger="ray_ckpt"):
        with ray_ckpt.Checkpointer(uri, model, opt, full_every=2, batch_steps=1):
            pass
    assert any("no longer running on this host" in r.getMessage() for r in caplog.records)


def test_a_stale_lease_of_another_host_needs_an_explicit_release(tmp_path):
    uri = tmp_path / "ckpt"
    storage = open_storage(str(uri))
    storage.write(LEASE_KEY, json.dumps({"owner": "x", "host": "gpu-node-7", "pid": 4242, "ttl": 60,
                                         "heartbeat": time.time() - 3600}).encode())
    with pytest.raises(LeaseError, match="gpu-node-7.*stale"):
        _attach(uri)
    cli = [sys.executable, "-m", "ray_ckpt.cli.main", "lease", str(uri)]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gpu-node-7" in r.stdout and "stale" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cli + ["--release"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "released" in r.stderr
    ck, *_ = _attach(uri)
    ck.close()


def test_conditional_writes_on_both_backends(storage_uri):
    """create-only and compare-and-swap (local: under a file lock; S3: If-None-Match / If-Match over HTTP)."""
    storage = storage_uri.open()
    assert storage.create("lease.json", b"a") is True
    assert storage.create("lease.json", b"b") is False
    data, v1 = storage.read_versioned("lease.json")
    assert data == b"a"
    assert storage.replace_if("lease.json", b"c", v1) is True
    assert storage.replace_if("lease.json", b"d", v1) is False          # stale version: refused
    assert storage.read("lease.json") == b"c"
    one, two = Lease(storage), Lease(storage)
    storage.delete("lease.json")
    one.acquire()
    with pytest.raises(LeaseError):
        two.acquire()
    one.release()
    two.acquire()
    two.release()
    assert not storage.exists("lease.json")
