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
import importlib

__version__ = "0.1.0"

# name -> the module that defines it, imported on first use (PEP 562): ``import ray_ckpt`` stays light, and the
# run's actors (``ray_ckpt.runtime.worker``, ``...coordinator``), which import this package first, never load torch
_LAZY = {
    "Checkpointer": "ray_ckpt.api", "restore": "ray_ckpt.api", "export": "ray_ckpt.api",
    "load_export": "ray_ckpt.api",
    "LowDiff": "ray_ckpt.config", "Amber": "ray_ckpt.config", "CheckpointConfig": "ray_ckpt.config",
    "WriterError": "ray_ckpt.engine.writer",
    "CorruptObjectError": "ray_ckpt.format.framing",
    "ManifestError": "ray_ckpt.lineage", "NoCheckpointError": "ray_ckpt.lineage",
}

__all__ = ["Checkpointer", "restore", "export", "load_export", "LowDiff", "Amber", "CheckpointConfig", "CorruptObjectError",
           "NoCheckpointError", "ManifestError", "WriterError", "__version__"]


_SUBMODULES = {"api", "cli", "compression", "config", "engine", "format", "integrations", "lineage", "policy",
               "runtime", "storage", "train"}


def __getattr__(name: str):
    if name in _SUBMODULES:   # ``import ray_ckpt; ray_ckpt.train.RayCkptCallback`` as with eager imports
        return importlib.import_module(f"ray_ckpt.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
