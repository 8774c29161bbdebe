"""Take a step out of ray_ckpt: materialize it without the user's code and write it in the ecosystem's formats.

:func:`materialize` resolves a step, reads and verifies its objects, rebuilds model and optimizer from the
layout every full records (:func:`ray_ckpt.engine.shadow.rebuild`: tensors keyed by state-dict name, the
optimizer class and its param groups) and replays the step records with restore's replay. :func:`export`
writes the result; :func:`load_export` reads any of the formats back into the same structure:

=============  ==========================================================================================
``safetensors``  ``model.safetensors`` (state-dict keys; tied parameters under each of their keys, loadable with
                 ``safetensors.torch.load_file`` + ``load_state_dict(strict=True)``) and ``optimizer.safetensors``
                 (tensors ``state.<i>.<key>`` as ``optimizer.state_dict()`` keys them; param groups, the
                 parameter names of each index and non-tensor state in the ``ray_ckpt`` metadata entry)
``dcp``          a PyTorch Distributed Checkpoint directory (``torch.distributed.checkpoint.load``, one process
                 or many): ``{"model": state dict, "optimizer": FQN-keyed optimizer state as
                 ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns it,
                 "ray_ckpt": {"step", "loop"}}``
``torch``        ``checkpoint.pt``: ``torch.save`` of ``{"step", "model", "optimizer", "param_names", "loop"}``
                 (``optimizer`` exactly as ``optimizer.state_dict()``; ``loop``: scheduler, scaler, RNG, extra state)
=============  ==========================================================================================

Every format also writes ``ray_ckpt_export.json`` (source, step, generation, strategy, format). The output
directory is written under a temporary name and renamed into place: a crash never leaves a partial export.

The root of sharded (FSDP2) state exports the unsharded state: every saved rank's shards of the step gathered
(:func:`ray_ckpt.engine.consolidate.gather_sharded`; the files are those of an unsharded run, and
``ray_ckpt_export.json`` adds ``consolidated_from_world``). One rank's shard lineage (``<root>/shards/...``) is
refused: it is not a whole model.

Runs in the calling process (CLI or user code); the output is on the CPU (a CUDA run's shards replay on a GPU
where this process has one); no Ray.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_ckpt.engine import consolidate, shard_layout
from ray_ckpt.engine.loopstate import apply_loop
from ray_ckpt.engine.optim_layout import ShadowError
from ray_ckpt.engine.restore import replay, resolve_and_load
from ray_ckpt.engine.shadow import rebuild
from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage.layout import INFO_FILE

log = logging.getLogger("ray_ckpt")

FORMATS = ("safetensors", "dcp", "torch")
_REPLAY_CHUNK = 16

#: ``progress(phase, done, total)``: phase is "read" (objects), "replay" (steps) or, for sharded state, "gather"
#: (saved ranks)
Progress = Callable[[str, int, int], None]


class ExportError(RayCkptError, ValueError):
    """The step cannot be exported (no layout in its full, an optimizer this process cannot import, a bad
    output path or format)."""


@dataclass
class Materialized:
    """One step's training state rebuilt without model code (CPU tensors)."""

    step: int
    generation: int
    strategy: str
    model: dict[str, torch.Tensor]        #: state-dict keys; tied parameters: one tensor under each key
    optimizer: dict                       #: as ``optimizer.state_dict()``: ``state`` keyed by parameter index
    param_names: list[list[str]]          #: per optimizer parameter index: its state-dict key(s)
    loop: dict                            #: scheduler / scaler / RNG / extra state / param-group values
    optimizer_class: str
    consolidated_from: int | None = None  #: sharded state: the saved world size whose shards were gathered

    def fqn_optimizer(self) -> dict:
        """The optimizer state keyed by parameter name (first key of tied parameters), the layout of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``."""
        names = [n[0] for n in self.param_names]
        return {"state": {names[i]: v for i, v in self.optimizer["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                 for g in self.optimizer["param_groups"]]}


def materialize(storage, step: int | None = None, *, fallback: bool = False,
                progress: Progress | None = None) -> Materialized:
    """Resolve ``step`` (None = latest), read and verify its objects, rebuild and replay. Calling process."""
    if consolidate.consolidates(storage):   # the root of sharded (FSDP2) state: every rank's shards gathered
        return _materialize_sharded(storage, step, fallback, progress)
    chain = _load(storage, step, fallback, progress)
    full = chain.full
    own = shard_layout.shard_of(full.layout)
    if own is not None:
        raise ExportError(f"{storage.describe()} is the shard lineage of rank {own.get('rank')} of {own.get('world')} "
                          f"(FSDP2), not a whole model: export the root (the URI above shards/), which gathers every "
                          f"rank's shards into the unsharded state")
    if full.layout is None:
        raise ExportError(f"the full checkpoint of step {full.step} records no optimizer layout (it was taken by "
                          f"an older ray_ckpt, or an optimizer parameter is not a model parameter): restore it "
                          f"into your model with ray_ckpt.restore and save it from there")
    try:
        model, optimizer, _ = rebuild(full)
    except ShadowError as e:
        raise ExportError(str(e)) from e
    strategies = {m.strategy for m in chain.plan.diffs} or {"lowdiff"}
    if len(strategies) > 1:
        raise ExportError(f"a chain mixes strategies {sorted(strategies)}")
    strategy = strategies.pop()
    loop, records, done = full.loop, chain.records, 0
    # LowDiff records replay in chunks (progress); Amber increments are applied in one call (merged increments
    # are checked against the whole chain)
    chunk = _REPLAY_CHUNK if strategy == "lowdiff" else max(1, len(records))
    with torch.no_grad():
        while done < len(records):
            part = records[done:done + chunk]
            loop = replay(strategy, part, model, optimizer, full.step if done == 0 else records[done - 1].step, loop)
            done += len(part)
            if progress is not None:
                progress("replay", done, len(records))
    apply_loop(loop, optimizer, restore_rng=False)  # param-group values as the scheduler left them
    sd = optimizer.state_dict()
    return Materialized(step=chain.step, generation=chain.plan.generation, strategy=strategy,
                        model=model.state_dict(), optimizer=sd, param_names=[list(n) for n in full.layout["param_names"]],
                        loop={k: v for k, v in loop.items() if k != "fingerprint"},
                        optimizer_class=full.layout["optimizer_class"])


def _materialize_sharded(storage, step, fallback, progress) -> Materialized:
    """:func:`materialize` of a sharded root: the saved shards of the step gathered
    (:func:`ray_ckpt.engine.consolidate.gather_sharded`), on the CPU."""
    try:
        g = consolidate.gather_sharded(storage, step, fallback=fallback, progress=progress)
    except ShadowError as e:
        raise ExportError(str(e)) from e
    return Materialized(step=g.step, generation=g.generation, strategy="lowdiff", model=g.model,
                        optimizer=g.optimizer, param_names=[list(n) for n in g.layout["param_names"]], loop=g.loop,
                        optimizer_class=g.layout["optimizer_class"], consolidated_from=g.world)


def _load(storage, step, fallback, progress):
    if progress is None:
        return resolve_and_load(storage, step, fallback=fallback)
    counter = {"n": 0}

    def reader(m):
        data = storage.read(m.object)
        counter["n"] += 1
        progress("read", counter["n"], 0)
        return data

    return resolve_and_load(storage, step, fallback=fallback, reader=reader)


# ------------------------------------------------------------------------------------------------------------
def export(storage, out: str | os.PathLike, *, step: int | None = None, fmt: str = "safetensors",
           fallback: bool = False, overwrite: bool = False, progress: Progress | None = None) -> dict:
    """Materialize ``step`` and write it to the directory ``out`` in ``fmt`` (see the module docstring).
    Returns the export's description (also written to ``ray_ckpt_export.json``). Calling process."""
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not overwrite:
        raise ExportError(f"{out} exists and is not an empty directory (overwrite=True / --force replaces it)")
    t0 = time.perf_counter()
    state = materialize(storage, step, fallback=fallback, progress=progress)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        files = _WRITERS[fmt](state, tmp)
        info = {"format": fmt, "files": files, "source": storage.describe(), "step": state.step,
                "generation": state.generation, "strategy": state.strategy,
                "optimizer_class": state.optimizer_class, "exported_at": time.time()}
        if state.consolidated_from is not None:
            info["consolidated_from_world"] = state.consolidated_from
        with open(os.path.join(tmp, INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)
        if os.path.exists(out):
            shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("ray_ckpt: exported step %d of %s as %s to %s in %.2f s", state.step, storage.describe(), fmt, out,
             time.perf_counter() - t0)
    return info


def _write_torch(state: Materialized, d: str) -> list[str]:
    torch.save({"step": state.step, "model": state.model, "optimizer": state.optimizer,
                "param_names": state.param_names, "loop": state.loop}, os.path.join(d, "checkpoint.pt"))
    return ["checkpoint.pt"]


def _write_dcp(state: Materialized, d: str) -> list[str]:
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # "no process group: saving from one process" is what we mean here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state.model, "optimizer": state.fqn_optimizer(),
                  "ray_ckpt": {"step": state.step, "loop": state.loop}}, checkpoint_id=d)
    return sorted(os.listdir(d))


def _write_safetensors(state: Materialized, d: str) -> list[str]:
    from safetensors.torch import save_file
    seen: set[int] = set()
    model = {}
    for k, t in state.model.items():  # safetensors refuses shared storage: a tied tensor is written per key
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        model[k] = t.contiguous() if key not in seen else t.clone().contiguous()
        seen.add(key)
    save_file(model, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt", "ray_ckpt_step": str(state.step)})
    tensors, misc = {}, {}
    for i, st in state.optimizer["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{i}.{key}"] = v.contiguous()
            else:
                misc.setdefault(str(i), {})[key] = _jsonable(v, f"optimizer state {i}.{key}")
    meta = {"step": state.step, "optimizer_class": state.optimizer_class, "param_names": state.param_names,
            "param_groups": _jsonable(state.optimizer["param_groups"], "param_groups"), "non_tensor_state": misc}
    save_file(tensors, os.path.join(d, "optimizer.safetensors"),
              metadata={"format": "pt", "ray_ckpt": json.dumps(meta)})
    return ["model.safetensors", "optimizer.safetensors"]


_WRITERS = {"torch": _write_torch, "dcp": _write_dcp, "safetensors": _write_safetensors}


def _jsonable(x: Any, what: str) -> Any:
    """JSON for safetensors metadata; tuples are tagged so that they load back as tuples (Adam's ``betas``)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple):
        return {"__tuple__": [_jsonable(v, what) for v in x]}
    if isinstance(x, list):
        return [_jsonable(v, what) for v in x]
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {k: _jsonable(v, what) for k, v in x.items()}
    raise ExportError(f"{what}: {type(x).__name__} cannot be written to safetensors metadata; use --format torch "
                      f"or dcp")


def _from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_from_json(v) for v in x["__tuple__"])
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


# ------------------------------------------------------------------------------------------------------------
def load_export(path: str | os.PathLike) -> dict:
    """An export written by :func:`export`, in any format, as ``{"step", "model", "optimizer", "param_names",
    "loop"}`` (``optimizer`` keyed as ``optimizer.state_dict()``; ``loop`` is None for safetensors, which
    holds model and optimizer only). Calling process.

    The ``torch`` and ``dcp`` formats hold the loop state (RNG states with numpy arrays, scheduler and user
    extra state) in pickle form, as ``torch.save`` and DCP do; they are read with ``torch.load(weights_only=True)``
    allowing only tensors, containers, numbers and numpy arrays, so no code from the file runs. Loading
    ``safetensors`` never executes code."""
    path = os.fspath(path)
    try:
        with open(os.path.join(path, INFO_FILE)) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{path} is not a ray_ckpt export (no {INFO_FILE})") from None
    fmt = info.get("format")
    if fmt == "torch":
        return _load_weights_only(os.path.join(path, "checkpoint.pt"))
    if fmt == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file
        model = load_file(os.path.join(path, "model.safetensors"))
        opt_path = os.path.join(path, "optimizer.safetensors")
        with safe_open(opt_path, "pt") as f:
            meta = json.loads(f.metadata()["ray_ckpt"])
        tensors = load_file(opt_path)
        state: dict[int, dict] = {}
        for name, t in tensors.items():
            _, i, key = name.split(".", 2)
            state.setdefault(int(i), {})[key] = t
        for i, vals in meta["non_tensor_state"].items():
            state.setdefault(int(i), {}).update(_from_json(vals))
        _tie(model, meta["param_names"])
        return {"step": meta["step"], "model": model, "param_names": meta["param_names"], "loop": None,
                "optimizer": {"state": dict(sorted(state.items())), "param_groups": _from_json(meta["param_groups"])}}
    if fmt == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        import tempfile
        import warnings
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp_to_torch_save(path, os.path.join(tmp, "x.pt"))
            sd = _load_weights_only(os.path.join(tmp, "x.pt"))
        osd = sd["optimizer"]
        names = [g for grp in osd["param_groups"] for g in grp["params"]]
        index = {n: i for i, n in enumerate(names)}
        return {"step": sd["ray_ckpt"]["step"], "model": sd["model"], "loop": sd["ray_ckpt"]["loop"],
                "param_names": None,
                "optimizer": {"state": {index[n]: v for n, v in osd["state"].items()},
                              "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                               for g in osd["param_groups"]]}}
    raise ExportError(f"{path}: unknown export format {fmt!r}")


def _load_weights_only(file: str):
    """``torch.load`` with ``weights_only=True`` (no arbitrary code runs): tensors, containers, numbers and the
    numpy arrays and dtypes the loop state holds (RNG states), allowed explicitly."""
    import numpy as np
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:   # numpy < 2
        from numpy.core.multiarray import _reconstruct
    allowed = [np.ndarray, np.dtype, _reconstruct]
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32", "uint8", "int32", "bool")]
    with torch.serialization.safe_globals(allowed):
        return torch.load(file, weights_only=True)


def _tie(model: dict, param_names: list[list[str]]) -> None:
    """Tied parameters share one tensor again after a safetensors load (they were written once per key)."""
    for names in param_names:
        for n in names[1:]:
            if n in model and names[0] in model:
                model[n] = model[names[0]]
