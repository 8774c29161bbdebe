"""Training-process helpers of the Ray runtime: attach a Checkpointer's sink, restore through the coordinator.

Both run in the process that trains (a Ray Train worker, or any process connected to Ray).
"""
from __future__ import annotations

import logging

import ray

from ray_ckpt.engine.restore import LoadedChain, load_chain
from ray_ckpt.lineage import Manifest, NoCheckpointError, Plan
from ray_ckpt.runtime import naming
from ray_ckpt.runtime.coordinator import get_or_create_coordinator
from ray_ckpt.runtime.sink import RaySink

log = logging.getLogger("ray_ckpt")


def _require_ray() -> None:
    if not ray.is_initialized():
        raise RuntimeError("runtime='ray' needs a connected Ray (call ray.init(...) first, or run inside a Ray "
                           "task, actor or Ray Train worker)")


def run_name(storage, run: str | None) -> str:
    return run or naming.default_run_name(storage.describe())


def attach_sink(storage, impl, *, run: str | None, config, info: dict):
    """``(run, generation, policy, sink)`` for a Checkpointer attaching with runtime='ray'."""
    _require_ray()
    run = run_name(storage, run)
    coord = get_or_create_coordinator(run, storage, full_every=config.full_every, batch_steps=config.batch_steps,
                                      keep_fulls=config.keep_fulls,
                                      policy_options=config.policy_options())  # [policy #14]
    generation, policy = ray.get([coord.new_generation.remote(), coord.get_policy.remote()])
    sink = RaySink(run, storage, impl, generation, max_pending_bytes=config.max_pending_bytes,
                   batch_steps=config.batch_steps, memory_budget=config.memory_budget, info=info)
    return run, generation, policy, sink


def policy_report(storage, run: str | None = None, timeout: float = 30.0) -> dict | None:
    """The coordinator's adaptive-policy report (None without a coordinator). Training process / driver."""
    coord = coordinator(storage, run)
    return None if coord is None else ray.get(coord.policy_report.remote(), timeout=timeout)


def coordinator(storage, run: str | None = None):
    """The run's coordinator handle, or None when it does not exist."""
    try:
        return ray.get_actor(naming.coordinator_name(run_name(storage, run)), namespace=naming.NAMESPACE)
    except ValueError:
        return None


def load_via_coordinator(storage, step: int | None, *, run: str | None = None,
                         timeout: float = 60.0) -> tuple[LoadedChain, dict] | None:
    """Load the plan the coordinator gives, reading each object from a live holder's object store when one has
    it (memory tier), else from storage. Returns ``(chain, tiers)`` or None when the run has no coordinator."""
    _require_ray()
    coord = coordinator(storage, run)
    if coord is None:
        return None
    plan = ray.get(coord.plan.remote(step), timeout=timeout)
    if "error" in plan:
        raise NoCheckpointError(plan["error"])
    manifests = [Manifest.from_json(o["manifest"]) for o in plan["objects"]]
    refs = {m.name: o["refs"] for m, o in zip(manifests, plan["objects"])}
    tiers = {"memory": 0, "durable": 0}

    def reader(m: Manifest):
        for ref in refs.get(m.name, []):
            try:
                data = ray.get(ref, timeout=timeout)
                tiers["memory"] += 1
                return memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
            except Exception as e:  # noqa: BLE001 - the holder died: try the next one, then storage
                log.info("ray_ckpt: memory copy of %s unavailable (%s)", m.name, e)
        tiers["durable"] += 1
        return storage.read(m.object)

    p = Plan(step=plan["step"], generation=plan["generation"], full=manifests[0], diffs=tuple(manifests[1:]))
    return load_chain(storage, p, reader), tiers
