"""Chain resolution at scale: ``Lineage.reachable_steps`` and the plans it leads to are linear sweeps now (the
coordinator asks several times a second over every object of a run). Checked against the original brute-force
definition on random lineages: overlapping memory/durable copies, gaps, atomic (merged Amber) objects, several
fulls and generations."""
from __future__ import annotations

import random

import pytest

from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.lineage.chain import Lineage, NoCheckpointError


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
        for full in (m.last_step for m in lin._gens[gen] if m.kind == "full"):
            for target in (None, *rng.sample(range(0, 200), 5)):
                got = lin._chains(gen, target)[full]
                assert [m.name for m in got] == [m.name for m in _chain_reference(lin, gen, full, target)]
        for step in steps:
            plan = lin.plan_in(gen, step)
            assert plan.step == step and plan.full.last_step <= step
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
