"""Names of the runtime's Ray actors. A *run* is one lineage (one storage root); its actors are named after it
so that any process of the run (training workers, the driver, a restarted driver) finds the same ones. The shard
runs of a sharded job have no actors of their own: the job's hosts serve them (:mod:`ray_ckpt.runtime.lineages`,
which names those)."""
from __future__ import annotations

import hashlib

from ray_ckpt.lineage.layout import SHARD_RUN_TAG

NAMESPACE = "ray_ckpt"


def default_run_name(storage_uri: str) -> str:
    """Runs are keyed by their storage root unless the user names them."""
    return "run-" + hashlib.sha1(storage_uri.encode()).hexdigest()[:12]


def actor_prefix(run: str) -> str:
    """What the names of every actor of ``run`` start with."""
    return f"ray_ckpt:{run}:"


def coordinator_name(run: str) -> str:
    return actor_prefix(run) + "coordinator"


def worker_prefix(run: str) -> str:
    return actor_prefix(run) + "worker:"


def worker_name(run: str, node_id: str) -> str:
    return worker_prefix(run) + node_id


def replica_name(run: str) -> str:
    """The run's state-tier replica actor (one per run)."""
    return actor_prefix(run) + "replica"


def shard_runs(run: str, actor_names) -> list[str]:
    """The shard runs of ``run`` (sharded FSDP2 state with runtime='ray', named by
    :func:`ray_ckpt.engine.shard_layout.shard_run`) that have actors of their own among ``actor_names`` (e.g. from
    ``ray.util.list_named_actors``), sorted: the per-rank actors of earlier versions (the shard runs of a job are
    served by its hosts now: :func:`ray_ckpt.runtime.coordinator.shard_runs` lists them)."""
    head = f"ray_ckpt:{run}{SHARD_RUN_TAG}"
    out = set()
    for name in actor_names:
        if name.startswith(head):
            tail = name[len(head):]          # w00002-r00000:coordinator / :replica / :worker:<node>
            out.add(f"{run}{SHARD_RUN_TAG}{tail.split(':', 1)[0]}")
    return sorted(out)
