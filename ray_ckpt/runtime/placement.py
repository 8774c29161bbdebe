"""Actor placement options shared by the runtime's detached actors. Any process connected to Ray."""
from __future__ import annotations

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# Ray 2.60 ignores *soft* NodeAffinity for an actor that requests no resources at all (num_cpus=0 and nothing
# else): on a multi-node ray.cluster_utils.Cluster such an actor lands on other nodes. One byte of the node's
# "memory" resource makes the request non-empty, and the affinity is then honoured, while never competing with
# trainers for CPUs or GPUs.
_NOMINAL_MEMORY = 1


def prefer_node(node_id: str) -> dict:
    """Actor options that prefer ``node_id`` and fall back to any node when it is gone (soft affinity)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True), "memory": _NOMINAL_MEMORY}
