"""Smoke test of the FSDP2 benchmark (``python -m benchmarks.fsdp --quick``): three FSDP2 replicas in the same
gloo processes (ray_ckpt shards, DCP async_save, none), rotating blocks; the outputs and a bitwise restore of
the shards. Never asserts timings."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# under `long` (make reliability): the harness of a benchmark, not what users run
pytestmark = [pytest.mark.slow, pytest.mark.procs, pytest.mark.long]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fsdp_benchmark_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp", "--quick", "--job", "gpt:tiny:4",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    result = json.loads((out / "fsdp_quick.json").read_text())
    assert result["errors"] == [], log
    c = result["cell"]
    assert c["rounds"] == 3 and len(c["ray_ckpt_wall_pairs_pct"]) == 3 and len(c["dcp_wall_pairs_pct"]) == 3
    for key in ("ray_ckpt_wall", "dcp_wall", "ray_ckpt_thread_cpu", "dcp_thread_cpu"):
        lo, hi = c[key + "_ci95_pct"]
        assert lo <= c[key + "_overhead_pct"] <= hi
    # the gradient shards of every rank: at most about the parameters' bytes per step (rows of the embedding that
    # no token used are zero and stored sparse); DCP writes the whole state (parameters and both AdamW moments)
    param_bytes = 4 * c["param_count"]
    assert 0 < c["diff_bytes_per_step"] <= 1.2 * param_bytes, (c["diff_bytes_per_step"], param_bytes)
    assert c["dcp_bytes_per_step"] > 2.5 * param_bytes
    assert c["restore_bitwise_all_ranks"] is True and c["restored_step"] == 1 + 3 * 2   # warm-up + every block
    assert (out / "fsdp_quick.md").stat().st_size > 0 and (out / "fsdp_quick.png").stat().st_size > 0
