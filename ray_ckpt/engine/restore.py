"""Recovery: resolve a plan from the committed lineage, read and verify every object, then replay.

Runs in the process that owns the model and optimizer (the training worker, or a CLI/test process).
Everything is read and verified (size, checksum, structure) before the first tensor of the live objects is
touched, so a corrupt checkpoint never leaves a half-restored model behind.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_ckpt.engine import amber_tier
from ray_ckpt.engine.lineage_io import load_lineage
from ray_ckpt.engine.loopstate import RESTORED_STEP_ATTR, apply_loop, check_not_attached
from ray_ckpt.engine.strategy import decode_object, impl_by_name
from ray_ckpt.format import checksum
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.format.records import FullState
from ray_ckpt.lineage import Lineage, Manifest, ManifestError, NoCheckpointError, Plan
from ray_ckpt.storage import ObjectNotFound

log = logging.getLogger("ray_ckpt")


@dataclass
class LoadedChain:
    """A verified plan's contents: the full state and the step records to replay, in order."""

    plan: Plan
    full: FullState
    records: list  #: the strategy's diff records, in step order
    tier: str | None = None  #: None: the exact lineage; "amber": the Amber tier of a LowDiff+ run (bounded error)

    @property
    def step(self) -> int:
        return self.plan.step


def plan_restore(storage, step: int | None, lineage: Lineage | None = None, *, strict: bool = True
                 ) -> tuple[Plan, Lineage, list[str]]:
    """Resolve ``step`` (None = latest) from the lineage (read with the index when there is one). The plan's
    manifests that came from the index are re-read from storage (their commit markers): when one is gone
    (garbage-collected) or differs, the lineage is rebuilt from a full listing. Requests: the index's
    bounded count plus one per object of the plan."""
    bad: list[str] = []
    if lineage is None:
        lineage, bad = load_lineage(storage, strict=strict)
    plan = lineage.resolve(step)
    copies = getattr(lineage, "from_index", set())
    for m in plan.objects:
        if m.name not in copies:
            continue
        try:
            same = Manifest.from_json(storage.read(m.key), m.key) == m
        except (ObjectNotFound, ManifestError):
            same = False
        if not same:
            log.info("ray_ckpt: the lineage index is stale (%s); listing every manifest", m.name)
            lineage, bad = load_lineage(storage, strict=strict, use_index=False)
            return lineage.resolve(step), lineage, bad
    return plan, lineage, bad


def read_object(storage, m: Manifest, reader: Callable[[Manifest], Any] | None = None) -> Any:
    """The bytes of ``m``'s object, verified against the manifest's size and checksum."""
    data = reader(m) if reader is not None else storage.read(m.object)
    n = memoryview(data).nbytes
    if n != m.nbytes:
        raise CorruptObjectError(m.object, f"size {n} bytes, manifest says {m.nbytes} (truncated or replaced)")
    try:
        crc = checksum.compute(m.crc_alg, data)
    except ValueError as e:      # an algorithm this version does not know
        raise CorruptObjectError(m.object, str(e)) from None
    if crc != m.crc32:
        raise CorruptObjectError(m.object, "checksum mismatch with its manifest")
    return data


def load_chain(storage, plan: Plan, reader: Callable[[Manifest], Any] | None = None) -> LoadedChain:
    """Read, verify and decode every object of ``plan``; keep only the records the replay needs."""
    full = rec_fmt.decode_full(read_object(storage, plan.full, reader), plan.full.object)
    if full.step != plan.full.last_step:
        raise CorruptObjectError(plan.full.object, f"holds step {full.step}, manifest says {plan.full.last_step}")
    records: list = []
    for m in plan.diffs:
        batch = decode_object(impl_by_name(m.strategy), read_object(storage, m, reader), m.object)
        steps = [r.step for r in batch]
        if not steps or steps != sorted(set(steps)) or steps[0] < m.first_step or steps[-1] != m.last_step:
            raise CorruptObjectError(m.object, f"holds steps {steps[:3]}..., manifest says "
                                               f"{m.first_step}..{m.last_step}")
        records.extend(r for r in batch if full.step < r.step <= plan.step
                       and (not records or r.step > records[-1].step))
    if plan.step != (records[-1].step if records else full.step):
        raise NoCheckpointError(f"diffs after step {full.step} do not reach step {plan.step}")
    return LoadedChain(plan, full, records)


def resolve_and_load(storage, step: int | None, *, fallback: bool,
                     reader: Callable[[Manifest], Any] | None = None,
                     lineage: Lineage | None = None) -> LoadedChain:
    """Resolve ``step`` (None = latest) and load it; with ``fallback``, skip missing and corrupt objects (and
    malformed manifests) alike and take the latest good step at or before the request on the same timeline
    (never a step of a superseded generation), logging what was skipped."""
    bad_manifests: list[str] = []
    indexed = lineage is None
    if lineage is None:
        lineage, bad_manifests = load_lineage(storage, strict=not fallback)
        try:  # re-checks the plan's manifests that came from the index (rebuilds the lineage if stale)
            _, lineage, bad_manifests = plan_restore(storage, step, lineage, strict=not fallback)
        except NoCheckpointError:
            pass  # resolved again below (with fallback rules)
    for key in bad_manifests:
        log.warning("ray_ckpt: ignoring malformed manifest %s", key)
    chain = _load_from_amber_tier(storage, lineage, step, fallback, reader)
    if chain is not None:
        return chain
    excluded: set[str] = set()
    while True:
        lin = Lineage(lineage.manifests, exclude=excluded, retention=lineage.retention)
        if step is None or not fallback:
            plan = lin.resolve(step)
        else:
            plan = _resolve_at_most(lin, step)
        try:
            return load_chain(storage, plan, reader)
        except ObjectNotFound:
            if indexed:
                # the index named an object deleted since (garbage collection): plan from a full listing
                log.info("ray_ckpt: the lineage index is stale; listing every manifest")
                indexed = False
                lineage, bad_manifests = load_lineage(storage, strict=not fallback, use_index=False)
                excluded = set()
                continue
            if not fallback:
                raise
            missing = [m for m in plan.objects if not storage.exists(m.object)]
            if not missing:
                raise
            for m in missing:
                log.warning("ray_ckpt: object %s of a committed step is missing; falling back to an earlier step",
                            m.object)
                excluded.add(m.name)
        except CorruptObjectError as e:
            if not fallback:
                raise
            bad = next(m for m in plan.objects if m.object == e.object_name)
            log.warning("ray_ckpt: %s; falling back to an earlier step", e)
            excluded.add(bad.name)


def _load_from_amber_tier(storage, lineage: Lineage, step: int | None, fallback: bool, reader) -> LoadedChain | None:
    """``step`` from the Amber tier of a LowDiff+ run (:mod:`ray_ckpt.engine.amber_tier`) when the exact lineage
    does not reach it (or, for the latest step, reaches only an older one); None otherwise."""
    plan = amber_tier.plan(storage, lineage, step)
    if plan is None:
        return None
    try:
        chain = load_chain(storage, plan, amber_tier.reader(storage, reader))
    except (ObjectNotFound, CorruptObjectError, NoCheckpointError) as e:
        if not fallback:
            raise
        log.warning("ray_ckpt: the Amber tier cannot restore step %d (%s); falling back to the exact lineage",
                    plan.step, e)
        return None
    chain.tier = amber_tier.TIER
    log.warning("ray_ckpt: step %d is not in the exact lineage of %s; restoring it from the Amber tier "
                "(durable_diffs='amber'): full %d + %d increments computed by the state tier's replica, within %s",
                plan.step, storage.describe(), plan.full.last_step, len(chain.records),
                amber_tier.bound_text(plan.diffs[-1]) if plan.diffs else "exact (a full)")
    return chain


def _resolve_at_most(lin: Lineage, step: int) -> Plan:
    try:
        return lin.resolve(step)
    except NoCheckpointError:
        pass
    for gen in sorted(lin.generations, reverse=True):
        steps = [s for s in lin.reachable_steps(gen) if s <= step]
        if steps:
            return lin.resolve(steps[-1])
    raise NoCheckpointError(f"no recoverable step at or before {step}")


# ------------------------------------------------------------------------------------------------------------
def apply_chain(chain: LoadedChain, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                scheduler: Any = None, scaler: Any = None, extra_state: Any = None,
                restore_rng: bool = True) -> int:
    """Load the full state into ``model``/``optimizer`` and replay the records. Returns the restored step."""
    check_not_attached(optimizer)
    full = chain.full
    load_full(full, model, optimizer)
    strategies = {m.strategy for m in chain.plan.diffs}
    if len(strategies) > 1:
        raise ValueError(f"a chain mixes strategies {sorted(strategies)}")
    loop = replay(strategies.pop() if strategies else "lowdiff", chain.records, model, optimizer, full.step,
                  full.loop)
    apply_loop(loop, optimizer, scheduler=scheduler, scaler=scaler, extra_state=extra_state,
               restore_rng=restore_rng)
    setattr(optimizer, RESTORED_STEP_ATTR, chain.step)
    return chain.step


def load_full(full: FullState, model, optimizer) -> None:
    """Model and optimizer state of a full checkpoint into live objects (restore, and the state tier's replica)."""
    model.load_state_dict(full.model)
    optimizer.load_state_dict(full.optimizer)


def replay(strategy: str, records: list, model, optimizer, from_step: int, loop: dict) -> dict:
    """Bring ``model``/``optimizer`` from ``from_step`` to ``records[-1].step`` with the strategy's replay, and
    load the model buffers of the last record. Returns the loop state of the reached step (``loop`` when
    ``records`` is empty). The one replay path: restore and the state tier's replica both call it."""
    if not records:
        return loop
    impl_by_name(strategy).advance(records, model, optimizer, from_step)
    if records[-1].buffers:
        _load_buffers(model, records[-1].buffers)
    return records[-1].loop


def _load_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    named = dict(model.named_buffers())
    for name, value in buffers.items():
        if name not in named:
            raise ValueError(f"checkpoint has buffer {name!r} that the model does not have")
        named[name].copy_(value)
