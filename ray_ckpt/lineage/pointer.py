"""The pointer file of a Ray Train checkpoint: ``{"storage_uri", "run", "step"}``, naming a lineage and a step.

Ray Train keeps the checkpoints its workers report; ray_ckpt's are tiny directories holding only this file
(:data:`~ray_ckpt.lineage.layout.POINTER_FILE`), while the state itself lives in the lineage it names.
"""
from __future__ import annotations

import json
import os

from ray_ckpt.lineage.layout import POINTER_FILE


def read_pointer(checkpoint) -> dict | None:
    """The pointer (``{"storage_uri", "run", "step"}``) in a checkpoint reported by
    :func:`ray_ckpt.train.attach` (anything with ``as_directory()``); None when it holds no pointer file.
    Calling process."""
    with checkpoint.as_directory() as d:
        path = os.path.join(d, POINTER_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)


def write_pointer(directory: str, pointer: dict) -> None:
    """Write the pointer file into ``directory`` (a checkpoint directory about to be reported). Training
    worker."""
    with open(os.path.join(directory, POINTER_FILE), "w") as f:
        json.dump(pointer, f)
