"""The Amber durable tier of a LowDiff+ run (``durable_diffs="amber"``): bounded-error increments next to the lineage.

A ``runtime="ray"`` LowDiff run with ``durable_diffs="amber"`` keeps its exact gradient stream in the memory tier
(held on two nodes, applied by the state tier's replica: exact recovery while the cluster holds it) and gives the
durable tier, besides the full checkpoints, **Amber increments computed by the replica from its own state**
(:class:`ray_ckpt.engine.amber.ShadowAmber`) — the trainer sends only the gradient records and copies nothing
for them. A restore from storage alone then reaches every step the replica encoded, within the Amber bound
(``|restored − true| ≤ τ·|restored| + atol`` per element, bit-exact with ``threshold=0``), where the fulls alone
would reach only the fulls.

Layout: the increments are a lineage of their own below ``tiers/amber/`` (objects and manifests named as in the
main lineage), so nothing that reads the main lineage (plans, gaps, the index, the coordinator) ever mixes them
with the exact diffs. Each manifest's ``info["base_step"]`` names the full of the main lineage its increments
build on. Rules:

* a step the main lineage reaches (full + exact diffs) restores from there, exactly — always preferred;
* otherwise (or, for the latest step, when the tier reaches a newer step of the current timeline) from the
  base full plus the tier's increments, with a WARNING naming the bound;
* garbage collection deletes the tier's increments that the main lineage's cutoff makes collectable and those
  whose base full is gone.

Runs wherever its callers run: :func:`write_increments` in the state tier's replica actor, the rest in restoring
processes, the CLI and the coordinator's GC. No Ray.
"""
from __future__ import annotations

import dataclasses
import logging

from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.format import segments
from ray_ckpt.format.delta import encode_records
from ray_ckpt.lineage import Lineage, Manifest, NoCheckpointError, Plan, collectable, diff_name, object_key
from ray_ckpt.lineage.layout import MANIFESTS_DIR, TIER_DIR, parse_name
from ray_ckpt.lineage import index as lineage_index
from ray_ckpt.storage import ObjectNotFound
from ray_ckpt.storage.prefixed import PrefixedStorage

log = logging.getLogger("ray_ckpt")

TIER = "amber"


def tier_storage(storage) -> PrefixedStorage:
    """The view of ``storage`` holding the Amber tier's objects and manifests."""
    return PrefixedStorage(storage, TIER_DIR)


def write_increments(storage, generation: int, records: list, config) -> Manifest:
    """Encode consecutive Amber increments (one base full) into one object of the tier and commit it (object, then
    manifest). ``config``: the :class:`ray_ckpt.Amber` they were computed with (recorded: it states the bound).
    The state tier's replica, in its thread."""
    if not records:
        raise ValueError("no increments to write")
    bases = {r.base_step for r in records}
    if len(bases) != 1:
        raise ValueError(f"one object of the Amber tier builds on one full; got bases {sorted(bases)}")
    bufs = encode_records(records)
    crc, n, alg = segments.object_crc(bufs)
    name = diff_name(generation, records[0].step, records[-1].step)
    m = Manifest(kind="diff", generation=generation, first_step=records[0].step, last_step=records[-1].step,
                 object=object_key(name), nbytes=n, crc32=crc, crc_alg=alg, strategy="amber",
                 info={"tier": TIER, "base_step": records[0].base_step, "computed_on": "replica",
                       "lossless": all(r.lossless for r in records), "amber": dataclasses.asdict(config)})
    ts = tier_storage(storage)
    ts.write(m.object, bufs)
    ts.write(m.key, m.to_json())
    return m


def tier_manifests(storage) -> list[Manifest]:
    """Every committed manifest of the tier (malformed ones are logged and skipped). One listing; the tier keeps no
    index (GC bounds it: increments of collected fulls go with them)."""
    lin, bad = load_lineage(tier_storage(storage), strict=False, use_index=False)
    for key in bad:
        log.warning("ray_ckpt: ignoring malformed manifest %s of the Amber tier", key)
    return list(lin.manifests)


def tier_lineage(main: Lineage, increments: list[Manifest]) -> Lineage:
    """The tier's increments with the fulls of ``main`` they build on (chains never cross another full)."""
    bases = {(m.generation, m.info.get("base_step")) for m in increments}
    fulls = [m for m in main.manifests if m.kind == "full" and (m.generation, m.last_step) in bases]
    return Lineage([*fulls, *increments])


def tier_steps(main: Lineage, increments: list[Manifest]) -> dict[int, list[int]]:
    """``{generation: steps}`` the tier restores on the current timeline (``main``'s supersession rules)."""
    return _reach(main, tier_lineage(main, increments))


def _reach(main: Lineage, lin: Lineage) -> dict[int, list[int]]:
    out = {}
    for gen in lin.generations:
        cap = main.timeline_cap(gen)
        steps = [s for s in lin.reachable_steps(gen) if cap is None or s <= cap]
        if steps:
            out[gen] = steps
    return out


def _newest_listed(storage) -> tuple[int, int] | None:
    """``(generation, last step)`` of the newest object the tier lists (names only: one listing, no reads)."""
    best = None
    for key in tier_storage(storage).list(MANIFESTS_DIR):
        parsed = parse_name(key[len(MANIFESTS_DIR):-len(".json")]) if key.endswith(".json") else None
        if parsed is not None and (best is None or (parsed[0], parsed[3]) > best):
            best = (parsed[0], parsed[3])
    return best


def plan(storage, main: Lineage, step: int | None) -> Plan | None:
    """The tier's plan for ``step`` (None: latest) when the main lineage cannot serve it (``step``) or the tier
    reaches a newer step of the current timeline (latest); None otherwise or without a tier. Reads the tier's
    manifests only then (a restore the exact lineage serves costs one listing, or nothing)."""
    if step is None:
        newest = _newest_listed(storage)
        head = next(((g, steps[-1]) for g in sorted(main.generations, reverse=True)
                     for steps in [main.reachable_steps(g)] if steps), None)
        if newest is None or (head is not None and head >= newest):
            return None     # the exact lineage is as new: exact wins
    else:
        try:
            main.resolve(step)
            return None
        except NoCheckpointError:
            pass
    increments = tier_manifests(storage)
    lin = tier_lineage(main, increments) if increments else None
    reach = _reach(main, lin) if lin is not None else {}
    if not reach:
        return None
    if step is None:
        gen = max(reach)
        step = reach[gen][-1]
        if head is not None and head >= (gen, step):
            return None
    else:
        # the newest generation that started at or before ``step`` owns it (the main lineage's rule)
        gen = next((g for g in sorted(main.generations, reverse=True)
                    if main.start_of(g) is not None and main.start_of(g) <= step), None)
        if gen is None or step not in reach.get(gen, []):
            return None
    return lin.plan_in(gen, step)


def reader(storage, main_reader=None):
    """Reads the objects of a tier plan: its full from the main lineage (with ``main_reader`` when given), its
    increments from the tier."""
    ts = tier_storage(storage)

    def read(m: Manifest):
        if m.info.get("tier") == TIER:
            return ts.read(m.object)
        return main_reader(m) if main_reader is not None else storage.read(m.object)
    return read


def bound_text(m: Manifest) -> str:
    """The error bound an increment states, for logs and the CLI."""
    cfg = m.info.get("amber") or {}
    if m.info.get("lossless"):
        return "bit-exact (lossless increments)"
    tau = cfg.get("max_threshold") if cfg.get("budget_fraction") else cfg.get("threshold")
    return f"|restored - true| <= {tau}*|restored| + {cfg.get('atol', 0.0)} per element"


def garbage(storage, main: Lineage, cutoff) -> list[Manifest]:
    """The tier's manifests that only serve collected steps, or whose base full is collected (the main lineage's
    rule, :func:`ray_ckpt.lineage.collectable`)."""
    fulls = {(m.generation, m.last_step): m for m in main.manifests if m.kind == "full"}
    doomed = []
    for m in tier_manifests(storage):
        base = fulls.get((m.generation, m.info.get("base_step")))
        if collectable(main, m, cutoff) or (base is not None and collectable(main, base, cutoff)):
            doomed.append(m)
    return doomed


def collect(storage, main: Lineage, cutoff) -> int:
    """Delete :func:`garbage` (manifest first). Returns the number of objects deleted."""
    doomed = garbage(storage, main, cutoff)
    if doomed:
        lineage_index.delete_committed(tier_storage(storage), doomed, missing=(ObjectNotFound,))
    return len(doomed)
