"""Smoke test of ``python -m benchmarks.handoff --quick``: the 2.7 MB model, both runtimes (``runtime="ray"`` on a
private Ray started in the cell's process), a few paired rounds, the fulls; the JSON's structure and that its
figures are finite (positive where they must be). Never asserts a timing against another."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

# under `long` (make reliability): the harness of a benchmark, not what users run
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.long]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_handoff_benchmark_quick(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH")] if p)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.handoff", "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    result = json.loads((out / "handoff.json").read_text())
    assert (out / "handoff.png").stat().st_size > 0 and (out / "handoff.md").stat().st_size > 0
    assert result["git_commit"] and result["date"] and len(result["loadavg_start"]) == 3
    assert len(result["loadavg_end"]) == 3
    cells = result["cells"]
    assert [(c["size"], c["runtime"]) for c in cells] == [("2.7", "local"), ("2.7", "ray")], log
    for c in cells:
        assert "error" not in c, c.get("traceback", c.get("error"))
        rounds = c["rounds"]
        assert len(rounds) == c["settings"]["rounds"] == 4
        for r in rounds:
            assert r["steps"] == c["settings"]["block"]
            for block in (r["ck"], r["plain"]):
                assert block["process_s"] > 0 and block["thread_s"] > 0 and block["wall_s"] > 0
            assert r["copy_hot_s"] > 0 and r["copy_rot_s"] > 0
            assert all(_finite(r[k]) for k in ("extra_s", "extra_naive_s", "extra_thread_s"))
            assert "training thread" in r["threads"]
        assert c["grad_bytes"] > 2_000_000 and c["record_bytes_per_step"] > 0 and c["floor_bytes"] > 0
        s = c["summary"]
        for k in ("extra_s", "extra_naive_s", "extra_thread_s", "ratio_hot", "ratio_rot"):
            assert len(s[k]) == 3 and all(_finite(x) for x in s[k]) and s[k][1] <= s[k][2], k
        for k in ("copy_hot_s", "copy_rot_s"):
            assert all(x > 0 for x in s[k]), k
        for floor in ("hot", "rot"):
            t = s[f"target_{floor}"]
            assert t["target_s"] > 0 and t["verdict"] in ("met", "missed", "undecided")
        f = s["fulls"]
        assert f["reps"] == len(c["fulls"]) == 2 and f["full_bytes"] > 0 and f["save_bytes"] > 0
        for k in ("ck_block_wall_s", "ck_block_thread_s", "ck_process_s", "save_cpu_s", "save_wall_s",
                  "cpu_ratio", "block_wall_ratio"):
            assert all(_finite(x) and x > 0 for x in f[k]), k
