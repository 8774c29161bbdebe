"""Read a coordinator's restore plan: each object from the memory tier (a live holder's object store) when one has
it, else from storage, optionally starting from a state-tier replica's snapshot.

Below both of its callers: :func:`ray_ckpt.runtime.trainer.client.load_via_coordinator` (the training process restoring)
and :class:`ray_ckpt.runtime.replica.ReplicaActor` (a restarted replica rebuilding itself). Any process connected
to Ray.
"""
from __future__ import annotations

import dataclasses
import logging

import ray
import torch

from ray_ckpt.engine.restore import LoadedChain, load_chain, read_object
from ray_ckpt.engine.strategy import decode_object, impl_by_name
from ray_ckpt.format import records as rec_fmt
from ray_ckpt.lineage import Manifest, Plan
from ray_ckpt.runtime.buffers import join

log = logging.getLogger("ray_ckpt")


def load_plan(storage, plan: dict, *, timeout: float = 60.0, snapshot: dict | None = None
              ) -> tuple[LoadedChain, dict] | None:
    """Load a coordinator plan: each object from a live holder's object store when one has it, else from
    storage. With ``snapshot`` (a replica's state at a step the plan reaches), start from it and read only the
    records after it. Returns ``(chain, tiers)``; ``tiers["replayed"]`` is the number of records to replay,
    ``tiers["unsafe"]`` the number of the plan's objects that were neither durable nor held on two nodes when
    the coordinator planned (0: the restored step survives the loss of any one node), ``tiers["source"]`` where
    the state came from (:func:`source`). None when the plan carries references only after the replica's step
    (``refs_after``, a ``replica_first`` plan) and the snapshot cannot serve it: ask for the whole plan. Any
    process connected to Ray."""
    manifests = [Manifest.from_json(o["manifest"]) for o in plan["objects"]]
    refs = {m.name: o["refs"] for m, o in zip(manifests, plan["objects"])}
    tiers = {"memory": 0, "durable": 0, "replica": 0,
             "unsafe": sum(1 for o in plan["objects"] if not o.get("durable") and o.get("holders", len(o["refs"])) < 2)}

    def reader(m: Manifest):
        for ref in refs.get(m.name, []):
            try:
                data = join(ray.get(ref, timeout=timeout))
                tiers["memory"] += 1
                return memoryview(data).cast("B")
            except Exception as e:  # noqa: BLE001 - the holder died: try the next one, then storage
                log.info("ray_ckpt: memory copy of %s unavailable (%s)", m.name, e)
        tiers["durable"] += 1
        return storage.read(m.object)

    p = Plan(step=plan["step"], generation=plan["generation"], full=manifests[0], diffs=tuple(manifests[1:]))
    after = plan.get("refs_after")   # a replica_first plan: references only of the objects after that step
    fits = snapshot is not None and p.full.last_step <= snapshot["step"] <= p.step
    if fits and (after is None or snapshot["step"] >= after):
        data = ray.get(snapshot["ref"], timeout=timeout)
        # one copy of each tensor: the model's are read-only views of the object store (load_state_dict copies
        # them into the parameters); the optimizer and loop state, which the optimizer keeps, are cloned
        full = rec_fmt.decode_full(data, "<replica snapshot>", verify=False, copy=False)
        full = dataclasses.replace(full, optimizer=_owned(full.optimizer), loop=_owned(full.loop))
        later = tuple(m for m in p.diffs if m.last_step > full.step)
        records = []
        for m in later:
            batch = decode_object(impl_by_name(m.strategy), read_object(storage, m, reader), m.object)
            records.extend(r for r in batch if full.step < r.step <= p.step
                           and (not records or r.step > records[-1].step))
        if (records[-1].step if records else full.step) == p.step:
            tiers["replica"] = 1
            tiers["replayed"] = len(records)
            tiers["source"] = source(tiers)
            synthetic = Plan(step=p.step, generation=p.generation, full=p.full, diffs=later)
            return LoadedChain(synthetic, full, records), tiers
        log.warning("ray_ckpt: the replica's records do not reach step %d; restoring from the chain", p.step)
    if after is not None:
        return None
    chain = load_chain(storage, p, reader)
    tiers["replayed"] = len(chain.records)
    tiers["source"] = source(tiers)
    return chain, tiers


def source(tiers: dict) -> str:
    """Where a loaded plan's state came from: ``"replica"`` (the state-tier replica's state, plus the records
    after it), ``"memory"`` (every object from a live node's object store), ``"storage"`` (every object from
    storage) or ``"memory+storage"``."""
    if tiers.get("replica"):
        return "replica"
    if not tiers.get("memory"):
        return "storage"
    return "memory+storage" if tiers.get("durable") else "memory"


def _owned(tree):
    """``tree`` with every tensor cloned (writable memory of this process), structure kept."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _owned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_owned(v) for v in tree)
    return tree
