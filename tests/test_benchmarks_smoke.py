"""Smoke test of the benchmark harness: ``python -m benchmarks.run --smoke`` end to end (a configuration of each
kind, every configuration, and the smallest that still takes every path: a baseline and LowDiff through the Ray
runtime; the crash-and-restore trials, the JSON / markdown / PNG outputs), all under ``long``. Never asserts
timings."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# under `long` (make reliability): the benchmark harness, not what users run (make test: 23 s of its ~17 min)
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.long]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the smallest (a baseline and LowDiff through the Ray runtime), one configuration of each saver kind and runtime,
# and every configuration, the Ray Train ones included
SMALLEST = ["torch_save_1", "lowdiff_topk_ray"]
SUBSET = ["torch_save_1", "dcp_async", "lowdiff_topk", "lowdiff_topk_ray", "amber"]


@pytest.mark.parametrize("subset", [SMALLEST, pytest.param(SUBSET, marks=pytest.mark.long, id="subset"),
                                    pytest.param(None, marks=pytest.mark.long, id="every-config")],
                         ids=lambda s: "smallest" if s == SMALLEST else "subset" if s else "every-config")
def test_benchmark_smoke(tmp_path, subset):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(out),
                           "--workdir", str(tmp_path / "w"), *(["--configs", *subset] if subset else [])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log

    result = json.loads((out / "bench_smoke.json").read_text())
    assert (out / "bench_smoke.md").stat().st_size > 0
    assert (out / "bench_smoke.png").stat().st_size > 0
    assert result["errors"] == [], log

    from benchmarks import configs
    chosen = {c.name for c in configs.CONFIGS if subset is None or c.name in subset}
    chosen |= {configs.get(n).reference for n in chosen}      # the references each configuration is compared to
    expected = chosen - set(result["settings"]["skipped"])
    got = result["jobs"]["gpt-tiny"]["configs"]
    assert set(got) == expected, log
    for name, s in got.items():
        assert s["median_step_s"] > 0 and s["mean_step_s"] > 0, name
        assert s["samples"] == result["settings"]["steps"] * result["settings"]["rounds"], name
        if configs.get(name).saver not in ("none",):
            assert s["bytes_per_step"] > 0, name
            assert s["fraction_of_full"] > 0, name
        if configs.get(name).launcher == "mp":   # rank 0's garbage collector over the measured steps
            assert s["gc_ms_per_step"] >= 0 and len(s["gc_collections_per_1000_steps"]) == 3, name
    # every checkpointing configuration took part in the crash-and-restore trial and restored a step <= reached
    for name in expected:
        c = configs.get(name)
        if c.fail_test and c.launcher == "mp":
            trials = got[name]["crash_trials"]
            assert trials and all(0 <= t["restored"] <= t["reached"] for t in trials), name
    lowdiff = got["lowdiff_topk_ray"]["recovery"]
    assert {"memory_latest", "durable_latest"} <= set(lowdiff)
    md = (out / "bench_smoke.md").read_text()
    assert "LowDiff top-k (ray)" in md and "torch" in md and "Python garbage collector" in md


def test_coordinator_scale_smoke(tmp_path):
    """``python -m benchmarks.coordinator_scale`` end to end on two short lineages (its own private Ray):
    exact heads and plans on every size (asserted inside), the three outputs, one row per size."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "coord"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.coordinator_scale", "--chunks", "300,600",
                           "--seconds", "1", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log
    rows = json.loads((out / "coordinator_scale.json").read_text())["rows"]
    assert [r["steps"] for r in rows] == [3000, 6000], log
    assert all(r["status_s"] > 0 and 0 <= r["steady_cpu_share"] for r in rows)
    assert (out / "coordinator_scale.md").read_text().count("\n| ") == 2 + 1   # header + 2 rows
    assert (out / "coordinator_scale.png").stat().st_size > 0
