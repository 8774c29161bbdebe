"""The reliability suite (issue #12): faults injected for real (storage outages through a proxy, SIGKILLs of
training processes at seeded random points, two writers on one lineage, killed actors), each recovery checked
bitwise against the uninterrupted run. ``make test`` runs the short variants; ``make reliability`` runs the
long ones (``--run-long``) and prints the table of :func:`record`ed outcomes."""
from __future__ import annotations

import json
import os

#: rows recorded in this pytest process (printed by tests/conftest.py's terminal summary)
ROWS: list[dict] = []


def record(fault: str, *, trials: int, recovered: int, bitwise: int, steps_lost: list[int],
           max_stall_s: float | None = None) -> None:
    """One line of the reliability table: ``trials`` injections of ``fault``, how many recovered, how many of
    those were bitwise equal to the uninterrupted run, the steps each lost, the longest training stall."""
    row = {"fault": fault, "trials": trials, "recovered": recovered, "bitwise_equal": bitwise,
           "max_steps_lost": max(steps_lost) if steps_lost else 0, "steps_lost": steps_lost,
           "max_stall_s": max_stall_s}
    ROWS.append(row)
    out = os.environ.get("RAY_CKPT_RELIABILITY_JSON")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| fault | trials | recovered | bitwise-equal | steps lost (max) | max stall |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        stall = "-" if r["max_stall_s"] is None else f"{r['max_stall_s']:.1f} s"
        lines.append(f"| {r['fault']} | {r['trials']} | {r['recovered']} | {r['bitwise_equal']} | "
                     f"{r['max_steps_lost']} | {stall} |")
    return "\n".join(lines)
