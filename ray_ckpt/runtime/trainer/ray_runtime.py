"""``runtime="ray"``: the Ray runtime as :class:`~ray_ckpt.engine.runtimes.TrainerRuntime` states it — the sink
hands steps to this node's persistence worker, the run's coordinator owns the lineage and the policy, restores
plan through it (memory tier). Imported by ``ray_ckpt.api`` only when ``runtime="ray"`` is asked for. Training
process (or the process calling ``restore``); it must be connected to Ray.
"""
from __future__ import annotations

import logging
import os

from ray_ckpt.config import CheckpointConfig, Runtime
from ray_ckpt.engine.runtimes import Attached, TrainerRuntime
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import ManifestError
from ray_ckpt.storage.base import ObjectNotFound
from ray_ckpt.runtime.trainer import client

log = logging.getLogger("ray_ckpt")


class RayRuntime(TrainerRuntime):
    kind = Runtime.RAY
    watches_node_drains = False   # the coordinator's control answer brings this node's drain

    def check_strategy(self, impl, shard_spec) -> None:
        if shard_spec is not None and impl.name == "amber":
            raise NotImplementedError("Amber for sharded (FSDP2) state runs with runtime='local' (each rank "
                                      "encodes its shards' increments in its writer thread); with runtime='ray' the "
                                      "shard runs' replicas are not verified for Amber increments yet: use "
                                      "runtime='local' (under Ray Train: sharded_runtime='local') or LowDiff")

    def resolve_config(self, config: CheckpointConfig, shard_spec) -> CheckpointConfig:
        if shard_spec is None or "memory_budget" in config.given:
            return config
        # the node's object store is shared by its ranks' runs
        share = client.node_share(config.memory_budget, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        return CheckpointConfig.resolve(config, memory_budget=share)

    def lineage_run(self, storage, run: str | None, shard_spec) -> str | None:
        if shard_spec is None:
            return run
        return client.shard_lineage_run(storage, run, shard_spec.world, shard_spec.rank)

    def attach(self, storage, impl, attachment, *, run: str | None, config: CheckpointConfig, info: dict,
               takeover: bool) -> Attached:
        run, generation, policy, sink = client.attach_sink(storage, impl, run=run, config=config, info=info,
                                                           takeover=takeover)
        return Attached(run, generation, policy, attachment.hold_sink(sink))

    def secure_first_full(self, sink, *, restated: bool, first_state: bool) -> None:
        """Held on two nodes (durable on a one-node cluster) when attach returns, unless it restates a step the
        lineage already holds that way (a restore just installed it): until it is secured in the background, a
        crash restores that step from the earlier generation, bitwise the same state. A run's first state waits
        only until this node's worker holds it, which outlives a crash of this process: its second copy follows
        in the background, and a node lost before that leaves nothing to restore, so the run starts again from
        its beginning."""
        if restated:
            return
        if first_state:
            sink.wait_received()
        else:
            sink.wait_safe()

    def policy_report(self, storage, run: str | None) -> dict | None:
        return client.policy_report(storage, run)   # the coordinator owns the policy

    def sharded_memory(self, run: str | None):
        return client.ShardedMemoryTier(run)

    def load_plan(self, storage, step: int | None, *, run: str | None, fallback: bool):
        try:
            got = client.load_via_coordinator(storage, step, run=run)
        except (CorruptObjectError, ManifestError, ObjectNotFound) as e:
            if not fallback:
                raise
            log.warning("ray_ckpt: the coordinator's plan failed (%s); falling back to storage", e)
            return None
        if got is None:
            return None
        chain, tiers = got
        log.info("ray_ckpt: plan read %d objects from the memory tier, %d from storage%s", tiers["memory"],
                 tiers["durable"], " and the state-tier replica's state" if tiers.get("replica") else "")
        return chain, tiers

    def record_restore(self, storage, run: str | None, seconds: float) -> None:
        client.record_restore(storage, run, seconds)
