"""Names of the runtime's Ray actors. A *run* is one lineage (one storage root); its actors are named after it
so that any process of the run (training workers, the driver, a restarted driver) finds the same ones."""
from __future__ import annotations

import hashlib

NAMESPACE = "ray_ckpt"


def default_run_name(storage_uri: str) -> str:
    """Runs are keyed by their storage root unless the user names them."""
    return "run-" + hashlib.sha1(storage_uri.encode()).hexdigest()[:12]


def coordinator_name(run: str) -> str:
    return f"ray_ckpt:{run}:coordinator"


def worker_prefix(run: str) -> str:
    return f"ray_ckpt:{run}:worker:"


def worker_name(run: str, node_id: str) -> str:
    return worker_prefix(run) + node_id


def replica_name(run: str) -> str:
    """The run's state-tier replica actor (one per run)."""
    return f"ray_ckpt:{run}:replica"
