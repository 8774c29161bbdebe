"""The benchmark report's statistics (pure functions; no training, no timing assertions)."""
from __future__ import annotations

import math

import pytest

from benchmarks import report, segments


def test_paired_median_ci_is_the_median_with_a_bootstrap_interval_around_it():
    xs = [0.4, -0.2, 0.1, 0.3, 0.0, 0.2, 25.0]      # one round disturbed by other work on the machine
    med, (lo, hi) = report.paired_median_ci(xs)
    assert med == pytest.approx(0.2)
    assert lo <= med <= hi and hi < 1.0              # the outlier moves neither the median nor the interval much
    mean = sum(xs) / len(xs)
    assert mean > 3.0                                # ... where the mean (a Student-t centre) would say +3.7%
    assert report.paired_median_ci(xs) == (med, (lo, hi))       # fixed seed: reproducible
    assert report.paired_median_ci([1.0, 2.0]) is None and report.paired_median_ci([]) is None
    med, (lo, hi) = report.paired_median_ci([4.0] * 40)          # no spread: a point
    assert (med, lo, hi) == (4.0, 4.0, 4.0)
    # more rounds of the same spread give a narrower interval
    import random
    rng = random.Random(1)
    few = [rng.gauss(0.5, 2.0) for _ in range(8)]
    many = few + [rng.gauss(0.5, 2.0) for _ in range(120)]
    w = lambda ci: ci[1][1] - ci[1][0]  # noqa: E731
    assert w(report.paired_median_ci(many)) < w(report.paired_median_ci(few))


def test_ci_verdict_calls_met_or_missed_only_when_the_interval_is_on_one_side():
    assert report.ci_verdict((1.0, 9.0), 10.0) == "met"
    assert report.ci_verdict((11.0, 30.0), 10.0) == "missed"
    assert report.ci_verdict((5.0, 15.0), 10.0) == "inconclusive"
    assert report.ci_verdict(None, 10.0) == "inconclusive"


def test_the_fast_steps_targets_are_judged_on_the_interval():
    summ = {"lowdiff_topk_ray": {"overhead_paired_median_pct": 6.0, "overhead_ci95_pct": [2.0, 9.5]},
            "lowdiff_dense_ray": {"overhead_paired_median_pct": 30.0, "overhead_ci95_pct": [20.0, 40.0]}}
    t = segments.targets(summ)
    assert t["lowdiff_topk_ray_overhead_le_10pct_ci95"]["verdict"] == "met"
    assert t["lowdiff_dense_ray_overhead_le_25pct_ci95"]["verdict"] == "inconclusive"


def test_the_lowdiff_target_reads_the_upper_bound_and_the_resolution_the_interval_width():
    rounds = [0.1] * 12
    summ = {"lowdiff_topk": {"overhead_paired_median_pct": 0.3, "overhead_ci95_pct": [-0.2, 0.8],
                             "overhead_paired_rounds_pct": rounds,
                             "overhead_thread_cpu_paired_median_pct": 0.9, "overhead_thread_cpu_ci95_pct": [0.2, 1.6],
                             "overhead_thread_cpu_paired_rounds_pct": rounds},
            "torch_save_1": {"overhead_ci95_pct": [40.0, 60.0]}}
    t = segments.targets(summ)
    assert t["lowdiff_topk_overhead_le_1pct_wall_ci95"]["verdict"] == "met"
    assert t["lowdiff_topk_ci95_halfwidth_le_0.5pct_wall"]["verdict"] == "met"
    assert t["lowdiff_topk_overhead_le_1pct_train_thread_cpu_ci95"]["verdict"] == "inconclusive"
    assert t["lowdiff_topk_ci95_halfwidth_le_0.5pct_train_thread_cpu"]["verdict"] == "missed"
    # 40 / 0.8 = 50x at worst: met; judged on the intervals, never on the point figures
    assert t["10x_less_than_torch_save_1_wall"]["verdict"] == "met"
    assert t["10x_less_than_torch_save_1_wall"]["ratio_low"] == pytest.approx(50.0)


def test_stratified_overhead_keeps_the_rare_full_blocks_in_the_figure():
    common = [0.2, 0.1, 0.3, 0.2, 0.0, 0.4, 0.2, 0.1, 30.0]   # one block disturbed by other work
    pairs = common + [20.0]                                   # one block of ten holds a full checkpoint
    rare = [False] * len(common) + [True]
    est, (lo, hi) = report.stratified_overhead_ci(pairs, rare)
    assert est == pytest.approx(0.9 * 0.2 + 0.1 * 20.0)      # a plain median (0.2) would hide the full
    assert lo <= est <= hi
    assert report.stratified_overhead_ci(pairs, rare) == (est, (lo, hi))   # fixed seed
    # no rare block: the median of the paired differences
    est, _ = report.stratified_overhead_ci(common, [False] * len(common))
    assert est == pytest.approx(0.2)
    assert report.stratified_overhead_ci([1.0, 2.0, 50.0], [False, False, True]) is None


def test_a_run_where_every_segment_failed_still_writes_its_report(tmp_path):
    """The errors are the result then: the JSON, the markdown (with them) and a figure that says so are written."""
    from benchmarks import configs, run
    args = run.resolve(run.build_parser().parse_args(["--mode", "fast", "--configs", "none", "--out", str(tmp_path)]))
    err = {"job": "mlp-fmnist", "config": "none", "round": 0, "errors": [{"rank": 0, "error": "NameError: boom"}]}
    raw = {"segments": [], "failures": [], "errors": [err], "wall_s": 1.0}
    result = segments.build(raw, run.settings(args), configs.CONFIGS)
    paths = segments.write_all(result, str(tmp_path), "fast")
    assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "md", "png"]
    assert all((tmp_path / p.rsplit("/", 1)[1]).stat().st_size > 0 for p in paths)
    assert "NameError: boom" in (tmp_path / "bench_fast.md").read_text()
