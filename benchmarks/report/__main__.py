"""``python -m benchmarks.report results/bench_<mode>.json [--out DIR]``: rebuild the summary, markdown and plot
of a ``benchmarks.run`` result from the raw samples it saved (e.g. after changing the report). Runs on the
driver machine (CLI); no training. Paired results rebuild with ``python -m benchmarks.paired --rebuild``."""
from __future__ import annotations

import argparse

from benchmarks import segments


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--out", help="folder (default: the JSON's)")
    a = p.parse_args(argv)
    for path in segments.rebuild(a.json, a.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
