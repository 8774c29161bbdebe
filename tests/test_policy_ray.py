"""The coordinator runs the adaptive policy: injected worker failures change its decision; inspect shows it."""
from __future__ import annotations

import json
import time
import uuid

import pytest
import ray

from ray_ckpt.cli.main import main as cli_main
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.runtime.coordinator import get_or_create_coordinator, shutdown_run
from ray_ckpt.storage import open_storage

pytestmark = pytest.mark.ray


def _m(kind, first, last, nbytes, created):
    name = full_name(1, last) if kind == "full" else diff_name(1, first, last)
    return Manifest(kind=kind, generation=1, first_step=first, last_step=last, object=object_key(name),
                    nbytes=nbytes, crc32=0, created=created)


def test_failures_change_the_coordinators_decision_and_inspect_shows_it(tmp_path, ray_cluster, capsys):  # noqa: F811
    run = f"pol-{uuid.uuid4().hex[:8]}"
    uri = str(tmp_path / "ckpt")
    storage = open_storage(uri)
    # built, not resolved: full_every/batch_steps are the adaptive policy's start, not pinned
    coord = get_or_create_coordinator(run, storage, config=CheckpointConfig(full_every=100, batch_steps=10,
                                                                            mtbf_hint=86400.0))
    try:
        # commits as the persistence workers report them: a 100 MB full that took ~2 s to persist, diffs
        ray.get(coord.status.remote())  # started
        for kind, first, last, nbytes, took in [("full", 0, 0, 100_000_000, 2.0)] + [
                ("diff", s - 9, s, 1_000_000, 0.05) for s in range(10, 60, 10)]:
            m = _m(kind, first, last, nbytes, time.time() - took)
            storage.write(m.object, b"x")  # inspect's plan reads only manifests; objects exist anyway
            storage.write(m.key, m.to_json())
            ray.get(coord.report_durable.remote(m.to_json(), [m.name]))
        calm = ray.get(coord.policy_report.remote())
        assert calm["failures_seen"] == 0 and "Young/Daly" in calm["reason"]
        for i in range(20):  # the Ray Train callback records each worker-group failure this way
            coord.record_failure.remote({"decision": "RETRY", "failures": i + 1})
        stormy = ray.get(coord.policy_report.remote())
        assert stormy["failures_seen"] == 20
        assert stormy["full_every"] < calm["full_every"], (calm["full_every"], stormy["full_every"])
        assert stormy["estimates"]["mtbf"]["mean"] < calm["estimates"]["mtbf"]["mean"] / 5
        # a re-attaching Checkpointer gets the new interval
        policy = ray.get(coord.get_policy.remote())
        assert (policy.full_every, policy.batch_steps) == (stormy["full_every"], stormy["batch_steps"])
        # inspect (storage only, no cluster) shows the decision and why
        capsys.readouterr()
        assert cli_main(["inspect", uri]) == 0
        text = capsys.readouterr().out
        assert f"policy: full_every={stormy['full_every']}" in text and "20 failures seen" in text, text
        assert "MTBF" in text
        assert cli_main(["inspect", uri, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["policy"]["full_every"] == stormy["full_every"]
    finally:
        shutdown_run(run)


def test_explicit_values_pin_the_coordinators_policy(tmp_path, ray_cluster):  # noqa: F811
    run = f"pin-{uuid.uuid4().hex[:8]}"
    cfg = CheckpointConfig.resolve(full_every=50, batch_steps=5)
    assert cfg.pinned == {"full_every", "batch_steps"}
    coord = get_or_create_coordinator(run, open_storage(str(tmp_path / "c")), config=cfg)
    try:
        for i in range(20):
            coord.record_failure.remote({"failures": i + 1})
        rep = ray.get(coord.policy_report.remote())
        assert (rep["full_every"], rep["batch_steps"]) == (50, 5) and "would choose" in rep["reason"]
        p = ray.get(coord.get_policy.remote())
        assert (p.full_every, p.batch_steps) == (50, 5)
    finally:
        shutdown_run(run)
