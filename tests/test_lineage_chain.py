"""Chain resolution at scale: ``Lineage.reachable_steps`` and the plans it leads to are linear sweeps now (the
coordinator asks several times a second over every object of a run). Checked against the original brute-force
definition on random lineages: overlapping memory/durable copies, gaps, atomic (merged Amber) objects, several
fulls and generations."""
from __future__ import annotations

import random

import pytest

from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.lineage.chain import Lineage, NoCheckpointError, range_difference


def _m(gen, kind, first, last, atomic=False):
    name = full_name(gen, last) if kind == "full" else diff_name(gen, first, last)
    return Manifest(kind=kind, generation=gen, first_step=first, last_step=last, object=object_key(name),
                    nbytes=1, crc32=0, info={"atomic": True} if atomic else {})


def _reachable_reference(lin: Lineage, gen: int) -> list[int]:
    """The definition, by exhaustive search (quadratic): what the sweep must reproduce exactly."""
    cap = lin.timeline_cap(gen)
    ms = lin._gens.get(gen, [])
    diffs = [m for m in ms if m.kind == "diff"]
    interest = {d.first_step for d in diffs} | {d.last_step + 1 for d in diffs}
    steps: set[int] = set()
    for full in (m for m in ms if m.kind == "full"):
        steps.add(full.last_step)
        todo, seen = [full.last_step + 1], {full.last_step + 1}
        while todo:
            p = todo.pop()
            for d in diffs:
                if not d.first_step <= p <= d.last_step:
                    continue
                if d.info.get("atomic"):
                    steps.add(d.last_step)
                    nxt = [d.last_step + 1]
                else:
                    steps.update(range(p, d.last_step + 1))
                    nxt = [q for q in interest if p < q <= d.last_step + 1]
                for q in nxt:
                    if q not in seen:
                        seen.add(q)
                        todo.append(q)
    return sorted(s for s in steps if cap is None or s <= cap)


def _chain_reference(lin: Lineage, gen: int, full: int, target: int | None) -> list:
    diffs = [m for m in lin._gens.get(gen, []) if m.kind == "diff"
             and (target is None or not m.info.get("atomic") or m.last_step <= target)]
    chain, nxt = [], full + 1
    while True:
        best = None
        for d in diffs:
            if d.first_step <= nxt <= d.last_step and (best is None or d.last_step > best.last_step):
                best = d
        if best is None or (target is not None and nxt > target):
            break
        chain.append(best)
        nxt = best.last_step + 1
    return chain


def _uncovered_reference(lin: Lineage, gen: int) -> list[int]:
    ms = lin._gens.get(gen, [])
    start = lin.start_of(gen)
    if start is None:
        return []
    covered = {s for m in ms for s in range(m.first_step, m.last_step + 1)}
    return [s for s in range(start, max(covered)) if s not in covered]


def _plan_full_reference(lin: Lineage, gen: int, step: int) -> int:
    """The latest full <= step whose chain reaches step (the rule the plan must follow)."""
    best = None
    for f in (m.last_step for m in lin._gens[gen] if m.kind == "full" and m.last_step <= step):
        used = [d for d in _chain_reference(lin, gen, f, step) if d.first_step <= step]
        hi = used[-1].last_step if used else f
        if hi >= step and (not used or not used[-1].info.get("atomic") or used[-1].last_step == step):
            best = f if best is None else max(best, f)
    return best


def _random_lineage(rng: random.Random) -> list[Manifest]:
    out = []
    for gen in range(1, rng.randint(1, 3) + 1):
        start = rng.randint(0, 30)
        top = start + rng.randint(0, 120)
        fulls = {start} | {rng.randint(start, top) for _ in range(rng.randint(0, 3))}
        out += [_m(gen, "full", s, s) for s in sorted(fulls)]
        s = start + 1
        while s <= top:                          # the memory tier's chunks, some lost (gaps)
            n = rng.randint(1, 12)
            if rng.random() > 0.1:
                out.append(_m(gen, "diff", s, s + n - 1))
            s += n
        for _ in range(rng.randint(0, 8)):       # durable batches overlapping them, atomic merged objects
            a = rng.randint(start - 2, top)
            b = a + rng.randint(0, 25)
            out.append(_m(gen, "diff", max(a, 1), max(b, a, 1), atomic=rng.random() < 0.4))
    return out


@pytest.mark.parametrize("seed", range(300))
def test_sweeps_match_the_definition(seed):
    rng = random.Random(seed)
    lin = Lineage(_random_lineage(rng))
    for gen in lin.generations:
        steps = lin.reachable_steps(gen)
        assert steps == _reachable_reference(lin, gen)
        ranges = lin.reachable_ranges(gen)
        assert all(a[1] + 1 < b[0] for a, b in zip(ranges, ranges[1:]))     # disjoint, not adjacent, sorted
        lo = min([m.first_step for m in lin._gens[gen]], default=0) - 2
        assert [s for s in range(lo, max(steps, default=lo) + 3) if lin.reaches(gen, s)] == steps
        assert lin.uncovered_steps(gen) == _uncovered_reference(lin, gen)
        for full in (m.last_step for m in lin._gens[gen] if m.kind == "full"):
            for target in (None, *rng.sample(range(0, 200), 5)):
                got = lin._chains(gen, target)[full]
                assert [m.name for m in got] == [m.name for m in _chain_reference(lin, gen, full, target)]
        for step in steps:
            plan = lin.plan_in(gen, step)
            assert plan.step == step and plan.full.last_step == _plan_full_reference(lin, gen, step)
            replay = [plan.full.last_step]
            for d in plan.diffs:
                assert d.first_step <= replay[-1] + 1 <= d.last_step
                replay.append(d.last_step if d.info.get("atomic") else min(d.last_step, step))
            assert replay[-1] == step
    try:
        head = lin.head()
    except NoCheckpointError:
        head = None
    assert head is None or head in lin.reachable_steps(max(g for g in lin.generations if lin.reachable_steps(g)))


def test_a_long_run_is_linear():
    """100,000 steps in 10-step memory chunks plus 100-step durable batches, one full: the coordinator's figures
    (head, restorable ranges) come from linear sweeps (the brute-force definition above needs hours for this)."""
    ms = [_m(1, "full", 0, 0)]
    ms += [_m(1, "diff", s, s + 9) for s in range(1, 100_001, 10)]
    ms += [_m(1, "diff", s, s + 99) for s in range(1, 100_001, 100)]
    lin = Lineage(ms)
    assert lin.head() == 100_000
    assert lin.reachable_steps(1) == list(range(0, 100_001))
    assert lin.plan_in(1, 99_999).diffs[-1].last_step == 100_000


def test_a_long_run_with_a_full_every_100_steps_is_linear():
    """100,000 steps, a full every 100 steps (1,000 fulls), 10-step chunks, one lost chunk: reachability was
    swept once per full (O(fulls x steps): 55 s for head() at 360,000 steps, measured) and a plan built every
    full's chain; now one sweep from every full at once, and a plan tries the nearest full first."""
    ms = [_m(1, "full", s, s) for s in range(0, 100_001, 100)]
    ms += [_m(1, "diff", s, s + 9) for s in range(1, 100_001, 10) if s != 50_041]
    lin = Lineage(ms)
    assert lin.head() == 100_000
    assert lin.reachable_ranges(1) == [(0, 50_040), (50_100, 100_000)]
    assert lin.uncovered_steps(1) == list(range(50_041, 50_051))
    assert not lin.reaches(1, 50_041) and lin.reaches(1, 50_100)
    plan = lin.resolve(99_999)
    assert plan.full.last_step == 99_900 and [d.last_step for d in plan.diffs][-1] == 100_000
    with pytest.raises(NoCheckpointError, match="50099 is not recoverable"):
        lin.resolve(50_099)


@pytest.mark.parametrize("a,b,want", [
    ([(0, 10)], [], [(0, 10)]),
    ([(0, 10)], [(0, 10)], []),
    ([(0, 10)], [(3, 4), (7, 7)], [(0, 2), (5, 6), (8, 10)]),
    ([(0, 3), (6, 9)], [(2, 7)], [(0, 1), (8, 9)]),
    ([(5, 6)], [(0, 1), (9, 12)], [(5, 6)]),
    ([(0, 2), (4, 6)], [(-5, 100)], []),
])
def test_range_difference(a, b, want):
    assert range_difference(a, b) == want
    brute = sorted({s for lo, hi in a for s in range(lo, hi + 1)} - {s for lo, hi in b for s in range(lo, hi + 1)})
    assert [s for lo, hi in want for s in range(lo, hi + 1)] == brute


def test_latest_at_or_before_maps_an_unrecorded_step_to_the_recovery_point_before_it():
    """Every-k recording (fulls at 0, 5, 10, 13 with nothing recorded between them), a newer generation branched at
    10 with records after it: the newest recoverable step at or before a step, on the current timeline (a rank's
    loop state may reach a step the main lineage did not record; the group then restores the point before it)."""
    lin = Lineage([_m(1, "full", 0, 0), _m(1, "full", 5, 5), _m(1, "full", 10, 10), _m(1, "full", 13, 13),
                   _m(2, "full", 10, 10), _m(2, "diff", 11, 12)])
    got = {s: lin.latest_at_or_before(s) for s in (0, 3, 5, 9, 10, 11, 12, 13, 20)}
    assert got == {0: 0, 3: 0, 5: 5, 9: 5, 10: 10, 11: 11, 12: 12, 13: 12, 20: 12}, got   # 13 of gen 1: superseded
    assert Lineage([_m(1, "full", 4, 4)]).latest_at_or_before(3) is None
