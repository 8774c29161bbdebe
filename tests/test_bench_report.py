"""The benchmark report's statistics (pure functions; no training, no timing assertions)."""
from __future__ import annotations

import math

import pytest

from benchmarks import report


def test_ci95_uses_student_t_of_the_paired_rounds():
    lo, hi = report.ci95([1.0, 2.0, 3.0])          # mean 2, sd 1, t(2) = 4.303
    h = 4.303 / math.sqrt(3)
    assert lo == pytest.approx(2 - h) and hi == pytest.approx(2 + h)
    assert report.ci95([5.0]) is None and report.ci95([]) is None
    lo, hi = report.ci95([4.0] * 40)                # no spread: a point
    assert lo == pytest.approx(4.0) and hi == pytest.approx(4.0)


def test_ci_verdict_calls_met_or_missed_only_when_the_interval_is_on_one_side():
    assert report.ci_verdict((1.0, 9.0), 10.0) == "met"
    assert report.ci_verdict((11.0, 30.0), 10.0) == "missed"
    assert report.ci_verdict((5.0, 15.0), 10.0) == "inconclusive"
    assert report.ci_verdict(None, 10.0) == "inconclusive"


def test_the_fast_steps_targets_are_judged_on_the_interval():
    summ = {"lowdiff_topk_ray": {"overhead_paired_mean_pct": 6.0, "overhead_ci95_pct": [2.0, 9.5]},
            "lowdiff_dense_ray": {"overhead_paired_mean_pct": 30.0, "overhead_ci95_pct": [20.0, 40.0]}}
    t = report.targets(summ)
    assert t["lowdiff_topk_ray_overhead_le_10pct_ci95"]["verdict"] == "met"
    assert t["lowdiff_dense_ray_overhead_le_25pct_ci95"]["verdict"] == "inconclusive"
