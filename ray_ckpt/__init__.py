"""ray_ckpt: per-iteration, bit-exact differential checkpointing for distributed PyTorch training on Ray.

Public API (everything else is private and may change):

* :class:`Checkpointer` / :func:`restore` — attach to a training loop / recover (training process);
* :func:`export` / :func:`load_export` — a step as safetensors, PyTorch DCP or ``torch.save`` files, without
  the model's code (calling process);
* :class:`LowDiff` — the strategy (gradient reuse), :class:`Amber` — selective incremental checkpoints
  (error-bounded or lossless), :class:`CheckpointConfig` — the knobs;
* :mod:`ray_ckpt.compression` — DDP communication hooks (top-k, int8) whose output LowDiff reuses;
* errors: every exception ray_ckpt raises derives from :class:`RayCkptError` (and keeps its builtin base:
  ``ValueError``, ``RuntimeError``...): :class:`NoCheckpointError`, :class:`CorruptObjectError`,
  :class:`ManifestError`, :class:`WriterError`, :class:`LeaseError`, :class:`LeaseLost`, :class:`RestoreError`,
  :class:`StorageError`, :class:`ObjectNotFound`, :class:`ExportError`, :class:`CompressionExchangeError`.
"""
import importlib

__version__ = "0.1.0"

# name -> the module that defines it, imported on first use (PEP 562): ``import ray_ckpt`` stays light, and the
# run's actors (``ray_ckpt.runtime.worker``, ``...coordinator``), which import this package first, never load torch
_LAZY = {
    "Checkpointer": "ray_ckpt.api", "restore": "ray_ckpt.api", "export": "ray_ckpt.api",
    "load_export": "ray_ckpt.api",
    "LowDiff": "ray_ckpt.config", "Amber": "ray_ckpt.config", "CheckpointConfig": "ray_ckpt.config",
    "RayCkptError": "ray_ckpt.errors",
    "WriterError": "ray_ckpt.engine.writer",
    "CorruptObjectError": "ray_ckpt.format.framing",
    "ManifestError": "ray_ckpt.lineage", "NoCheckpointError": "ray_ckpt.lineage",
    "LeaseError": "ray_ckpt.engine.lease", "LeaseLost": "ray_ckpt.engine.lease",
    "StorageError": "ray_ckpt.storage.base", "ObjectNotFound": "ray_ckpt.storage.base",
    "ExportError": "ray_ckpt.engine.export",
    # these two load Ray Train / torch.distributed on first use (also ray_ckpt.train / ray_ckpt.compression's)
    "RestoreError": "ray_ckpt.integrations.agreement",
    "CompressionExchangeError": "ray_ckpt.integrations.grad_exchange",
}

# the exception classes among the public names (all derive from RayCkptError)
_ERRORS = ("RayCkptError", "NoCheckpointError", "CorruptObjectError", "ManifestError", "WriterError", "LeaseError",
          "LeaseLost", "RestoreError", "StorageError", "ObjectNotFound", "ExportError", "CompressionExchangeError")

__all__ = ["Checkpointer", "restore", "export", "load_export", "LowDiff", "Amber", "CheckpointConfig", *_ERRORS,
           "__version__"]


_SUBMODULES = {"api", "cli", "compression", "config", "engine", "errors", "format", "integrations", "lineage",
               "policy", "runtime", "storage", "train"}


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
