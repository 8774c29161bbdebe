"""ray_ckpt: per-iteration, bit-exact differential checkpointing for distributed PyTorch training on Ray.

Public API (everything else is private and may change):

* :class:`Checkpointer` / :func:`restore` — attach to a training loop / recover (training process);
* :func:`export` / :func:`load_export` — a step as safetensors, PyTorch DCP or ``torch.save`` files, without
  the model's code (calling process);
* :class:`LowDiff` — the strategy (gradient reuse), :class:`Amber` — selective incremental checkpoints
  (error-bounded or lossless), :class:`CheckpointConfig` — the knobs;
* :mod:`ray_ckpt.compression` — DDP communication hooks (top-k, int8) whose output LowDiff reuses;
* errors: :class:`CorruptObjectError`, :class:`NoCheckpointError`, :class:`ManifestError`, :class:`WriterError`.
"""
from ray_ckpt.config import Amber, CheckpointConfig, LowDiff
from ray_ckpt.api import Checkpointer, export, load_export, restore
from ray_ckpt.engine import amber as _amber  # noqa: F401  (registers the Amber strategy)
from ray_ckpt.engine import rankloop as _rankloop  # noqa: F401  (registers per-rank loop-state objects)
from ray_ckpt.engine.writer import WriterError
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.lineage import ManifestError, NoCheckpointError

__version__ = "0.1.0"

__all__ = ["Checkpointer", "restore", "export", "load_export", "LowDiff", "Amber", "CheckpointConfig", "CorruptObjectError",
           "NoCheckpointError", "ManifestError", "WriterError", "__version__"]
