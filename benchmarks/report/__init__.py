"""What every benchmark's report shares, written once: the paired-difference statistics (median or stratified
estimate with a percentile-bootstrap 95% interval, verdicts on an interval), the machine and date a result is
stamped with, the markdown formatting of figures and targets, the bar-with-interval plot, and writing a result
as ``<base>.json`` / ``.md`` / ``.png``.

Runs in the orchestrating process of a benchmark (and in ``python -m benchmarks.report``, which rebuilds a
``benchmarks.run`` result from its raw samples). Each benchmark configures it with its own summary, markdown and
plot: :mod:`benchmarks.segments` (``benchmarks.run``), :mod:`benchmarks.paired`, :mod:`benchmarks.fsdp`.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics

BOOTSTRAP_RESAMPLES = 10000


# ------------------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------------------
def paired_median_ci(xs: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
                     ) -> tuple[float, tuple[float, float]] | None:
    """The median of the paired differences ``xs`` (one per round: the configuration's mean step against its
    reference's in the same round) and its 95% percentile-bootstrap confidence interval (``resamples`` resamples
    of the rounds, fixed seed): :func:`stratified_overhead_ci` without a rare stratum. Robust to a round
    disturbed by other work on the machine, which moves a mean and a Student-t interval a lot. None with fewer
    than three rounds (a bootstrap of two is no interval)."""
    xs = [x for x in xs if x is not None]
    return stratified_overhead_ci(xs, [False] * len(xs), resamples, seed)


def stratified_overhead_ci(pairs: list[float], rare: list[bool], resamples: int = BOOTSTRAP_RESAMPLES,
                           seed: int = 0) -> tuple[float, tuple[float, float]] | None:
    """Amortized overhead from paired block differences ``pairs`` (%), where ``rare[i]`` marks a block that holds
    a rare, costly event (a full checkpoint): ``(1 - w) * median(common) + w * mean(rare)``, ``w`` = the rare
    blocks' share. The median keeps a block disturbed by other work from moving the figure; the mean over the
    rare blocks keeps their cost in it (a plain median would drop it). 95% CI: percentile bootstrap, resampling
    each stratum on its own (fixed seed). None with fewer than three common blocks."""
    import random as _random
    common = [p for p, r in zip(pairs, rare) if not r]
    hot = [p for p, r in zip(pairs, rare) if r]
    if len(common) < 3:
        return None
    w = len(hot) / len(pairs)

    def stat(c, h):
        return (1 - w) * statistics.median(c) + (w * sum(h) / len(h) if h else 0.0)

    rng = _random.Random(seed)
    vals = sorted(stat([common[rng.randrange(len(common))] for _ in common],
                       [hot[rng.randrange(len(hot))] for _ in hot]) for _ in range(resamples))
    return stat(common, hot), (vals[int(0.025 * (resamples - 1))], vals[int(0.975 * (resamples - 1))])


def overhead_fields(pairs: list[float], rare: list[bool] | None = None) -> dict:
    """The JSON fields of one overhead from its paired differences (%): ``pairs_pct``, and with three pairs or
    more ``overhead_pct`` and ``ci95_pct`` (stratified by ``rare`` when given, else the median)."""
    est = stratified_overhead_ci(pairs, rare) if rare is not None else paired_median_ci(pairs)
    out = {"pairs_pct": pairs}
    if est is not None:
        out["overhead_pct"], out["ci95_pct"] = est[0], list(est[1])
    return out


def ci_verdict(ci, limit: float) -> str:
    """``met`` when the whole interval is at or below ``limit``, ``missed`` when it is all above, else
    ``inconclusive``."""
    if ci is None:
        return "inconclusive"
    return "met" if ci[1] <= limit else ("missed" if ci[0] > limit else "inconclusive")


def lowdiff_overhead_targets(basis: str, overhead: float, ci, pairs: int, width: bool = True) -> dict:
    """The two targets of LowDiff top-k's overhead on one metric (``basis``): at its default policy <= 1% of step
    time, judged on the interval's upper bound; and (``width``) the interval no wider than +-0.5% of step time."""
    t = {f"lowdiff_topk_overhead_le_1pct_{basis}_ci95": {"overhead_pct": overhead, "ci95_pct": ci,
                                                         "verdict": ci_verdict(ci, 1.0)}}
    if width:
        half = (ci[1] - ci[0]) / 2
        t[f"lowdiff_topk_ci95_halfwidth_le_0.5pct_{basis}"] = {"halfwidth_pct": half, "pairs": pairs,
                                                               "verdict": "met" if half <= 0.5 else "missed"}
    return t


def median(xs):
    """The median of the values of ``xs`` that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------------------------------------------------
# what a result is stamped with
# ------------------------------------------------------------------------------------------------------------
def now() -> str:
    """The local date and time, to the second, with its offset (every result's ``date``)."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info(device: str = "auto") -> dict:
    info = {"cpu": "unknown", "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    import torch
    info["torch"] = torch.__version__
    try:
        import ray
        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = None
    try:
        import ray_ckpt
        info["ray_ckpt"] = ray_ckpt.__version__
    except ImportError:
        pass
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    return info


# ------------------------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------------------------
def fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def pct(x, spec="+.1f"):
    """A percentage (already x 100): ``+1.2%``; ``–`` for None."""
    return "–" if x is None else f"{format(x, spec)}%"


def interval(ci, spec="+.1f"):
    """A 95% interval of percentages: ``[+0.1, +2.3]%``; ``–`` for None."""
    return "–" if not ci else f"[{format(ci[0], spec)}, {format(ci[1], spec)}]%"


def nbytes(n):
    """A byte count in B / KB / MB / GB (powers of 1024)."""
    if n is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _val(v) -> str:
    """A target's value for the markdown: floats to 3 significant digits, lists of floats too."""
    if isinstance(v, float):
        return fmt(v, ".3g")
    if isinstance(v, list) and v and all(isinstance(x, float) for x in v):
        return "[" + ", ".join(fmt(x, ".3g") for x in v) + "]"
    return str(v)


def target_lines(targets: dict) -> list[str]:
    """Markdown bullets of targets: their figures, and the verdict (bold unless met)."""
    out = []
    for k, v in targets.items():
        vals = ", ".join(f"{kk}={_val(vv)}" for kk, vv in v.items() if kk != "verdict")
        verd = v["verdict"] if v["verdict"] == "met" else f"**{v['verdict']}**"
        out.append(f"- {k}: {vals} — {verd}")
    return out


def error_lines(errors: list) -> list[str]:
    return ["", "## Errors", ""] + [f"- `{json.dumps(e)[:600]}`" for e in errors] if errors else []


# ------------------------------------------------------------------------------------------------------------
# plots and files
# ------------------------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str) -> None:
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def ci_bars(ax, values: list[float], cis: list, horizontal: bool = False, **bar) -> None:
    """Bars of ``values`` at 0, 1, ... (top to bottom when ``horizontal``) with their 95% intervals ``cis`` as
    error bars (a missing interval: none); ``bar``: matplotlib's ``bar``/``barh`` keywords."""
    cis = [ci or [v, v] for v, ci in zip(values, cis)]
    err = [[v - lo for v, (lo, _) in zip(values, cis)], [hi - v for v, (_, hi) in zip(values, cis)]]
    if horizontal:
        ax.barh(list(range(len(values)))[::-1], values, xerr=err, **bar)
    else:
        ax.bar(list(range(len(values))), values, yerr=err, **bar)


def write_result(base: str, result: dict, markdown=None, plot=None, echo: bool = True) -> list[str]:
    """Write ``result`` to ``<base>.json``, ``markdown(result)`` to ``<base>.md`` and ``plot(result, path)`` to
    ``<base>.png`` (each when given); print the markdown when ``echo``. Returns the paths written."""
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    paths = [base + ".json"]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1, default=str)
    if markdown is not None:
        paths.append(base + ".md")
        text = markdown(result)
        with open(paths[-1], "w") as f:
            f.write(text)
        if echo:
            print(text, flush=True)
    if plot is not None:
        paths.append(base + ".png")
        plot(result, paths[-1])
    return paths
