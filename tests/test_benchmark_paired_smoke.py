"""Smoke test of the paired benchmark (``python -m benchmarks.paired``): two replicas in the same processes,
alternating blocks, LowDiff on one; the outputs and a bitwise restore. Never asserts timings."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# under `long` (make reliability): the harness of a benchmark, not what users run
pytestmark = [pytest.mark.slow, pytest.mark.procs, pytest.mark.long]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_paired_benchmark_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.paired", "--job", "gpt:tiny:4", "--blocks", "6",
                           "--block-steps", "5", "--full-every", "10", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    result = json.loads((out / "paired.json").read_text())
    assert result["errors"] == [] and len(result["cells"]) == 1, log
    c = result["cells"][0]
    assert c["blocks"] == 6 and len(c["wall_pairs_pct"]) == 6 and len(c["thread_cpu_pairs_pct"]) == 6
    assert c["fulls"] >= 2                          # steps 10, 20, 30 fall inside the 30 measured steps of A
    assert c["wall_ci95_pct"][0] <= c["wall_overhead_pct"] <= c["wall_ci95_pct"][1]
    assert c["diff_bytes_per_step"] > 0 and c["bytes_per_step"] > c["diff_bytes_per_step"]
    assert c["restore_bitwise"] is True and c["restored_step"] == 3 + 6 * 5   # warm-up + every block of A
    assert (out / "paired.md").stat().st_size > 0 and (out / "paired.png").stat().st_size > 0
    assert "restores_bitwise" in result["targets"]


def test_paired_benchmark_compares_amber_with_lowdiff_dense(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.paired", "--job", "gpt:tiny:4", "--blocks", "4",
                           "--block-steps", "5", "--full-every", "10", "--hook", "none",
                           "--strategies", "lowdiff", "amber", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, log
    result = json.loads((out / "paired_lowdiff_amber_dense.json").read_text())
    assert result["errors"] == [] and [c["strategy"] for c in result["cells"]] == ["lowdiff", "amber"], log
    lowdiff, amber = result["cells"]
    assert lowdiff["restore_bitwise"] is True
    assert amber["restore_within_bound"] is True and amber["fulls"] >= 2   # Amber's fulls are counted
    assert amber["amber_early_fulls"] is not None and lowdiff["amber_early_fulls"] is None
    assert 0 < amber["diff_bytes_per_step"] < lowdiff["diff_bytes_per_step"]   # increments vs dense gradients
    assert result["targets"]["amber_restores_within_bound"]["verdict"] == "met"
    assert "| amber, local |" in (out / "paired_lowdiff_amber_dense.md").read_text()
