"""Loop state: what a training loop holds besides model and optimizer state, taken at capture and put back at restore.

RNG streams (:func:`rng_state`, :func:`set_rng_state`, and :func:`derive_rng` for a rank that has none of its own),
the user's extra state (:func:`as_stateful`, :class:`StatefulGroup`), the optimizer's param-group values
(:func:`group_values`, :func:`apply_group_values`), and the restored step's loop state as a whole
(:func:`apply_loop`). The markers a capture and a restore leave on the optimizer (:data:`ATTACHED_ATTR`,
:data:`RESTORED_STEP_ATTR`) live here too, so that both sides read them from one place.

Everything runs in the training process: captures on the training thread, restores before training goes on.
"""
from __future__ import annotations

import array
import hashlib
import random
from typing import Any, Callable

import numpy as np
import torch

#: attribute set on an optimizer while a capture is attached to it (the capture itself)
ATTACHED_ATTR = "_ray_ckpt_capture"
#: attribute set on an optimizer by a restore (the restored step)
RESTORED_STEP_ATTR = "_ray_ckpt_restored_step"


def check_not_attached(optimizer: torch.optim.Optimizer) -> None:
    """Refuse to restore into an optimizer that a capture is attached to (training process)."""
    if getattr(optimizer, ATTACHED_ATTR, None) is not None:
        raise RuntimeError("restore into an optimizer that has a Checkpointer attached would checkpoint the "
                           "replayed steps again: restore first, then attach")


class StatefulGroup:
    """Several stateful objects given as ``extra_state={"loader": loader, "epoch": counter, ...}`` (each with
    ``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``), checkpointed as one."""

    def __init__(self, members: dict):
        for k, v in members.items():
            if not (callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))):
                raise TypeError(f"extra_state[{k!r}] must have state_dict() and load_state_dict() methods, "
                                f"got {type(v).__name__}")
        self.members = dict(members)

    def state_dict(self) -> dict:
        return {k: v.state_dict() for k, v in self.members.items()}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self.members) - set(state))
        if missing:
            raise ValueError(f"the checkpoint's extra state has no entry for {missing} (it holds {sorted(state)})")
        for k, v in self.members.items():
            v.load_state_dict(state[k])

    def reset_for_new_rank(self) -> None:
        """Forwarded to the members that define it (see :func:`ray_ckpt.train.agreed_restore`)."""
        for v in self.members.values():
            hook = getattr(v, "reset_for_new_rank", None)
            if callable(hook):
                hook()


def as_stateful(extra_state: Any) -> Any:
    """``extra_state`` as one object with ``state_dict``/``load_state_dict``: a dict of stateful objects becomes
    a :class:`StatefulGroup`; anything else is returned as is."""
    if isinstance(extra_state, dict):
        return StatefulGroup(extra_state)
    return extra_state


#: the Python RNG words of the last :func:`rng_state` call and their uint32 array. Most loops never draw from
#: ``random``: comparing the 625 words is then cheaper than converting them again, more so inside a training step.
#: The array is shared by the records that hold it; nothing writes into it.
_py_words: tuple[tuple, Any] = ((), None)
_U32 = "I" if array.array("I").itemsize == 4 else "L"


def _python_words(words: tuple) -> np.ndarray:
    global _py_words
    last, arr = _py_words
    if words != last:
        # the Mersenne Twister words as uint32 (a third of the bytes of JSON integers, every step)
        arr = np.frombuffer(array.array(_U32, words), dtype=np.uint32)
        _py_words = (words, arr)
    return arr


def rng_state() -> dict:
    """All RNG states a training loop typically draws from (training thread)."""
    version, words, gauss = random.getstate()
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": (version, _python_words(words), gauss),
                          "numpy": np.random.get_state()}
    if torch.cuda.is_initialized():   # (False without CUDA; is_available() costs a driver query)
        # the generator of the device this process trains on, not of every visible GPU: another rank (or the
        # same rank after a restart) may see a different number of devices
        st["cuda"] = {"state": torch.cuda.get_rng_state(torch.cuda.current_device())}
    return st


def set_rng_state(st: dict) -> None:
    """Install RNG states taken by :func:`rng_state` (training thread). The CUDA state goes to this process's
    current device; a checkpoint without one leaves the CUDA generators alone."""
    torch.set_rng_state(st["torch"])
    random.setstate(_as_python_random_state(st["python"]))
    np.random.set_state(st["numpy"])
    cuda = st.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, dict):
            torch.cuda.set_rng_state(cuda["state"], torch.cuda.current_device())
        else:  # written by an earlier version: one state per device visible to the capturing process
            for i, s in enumerate(list(cuda)[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


def _as_python_random_state(s: Any) -> tuple:
    # random.getstate() = (version, tuple_of_625_ints, gauss_next); the words are stored as a uint32 array
    return (s[0], tuple(int(w) for w in s[1]), s[2])


def group_values(optimizer: torch.optim.Optimizer, copy: Callable[[Any], Any]) -> list[dict]:
    """Every param group's values except its parameters, each passed through ``copy`` (training thread)."""
    return [{k: copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_group_values(optimizer: torch.optim.Optimizer, values: list[dict]) -> None:
    """Set param-group hyper-parameters, copying into existing tensors so their device is kept."""
    if len(values) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint has {len(values)} param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for g, vals in zip(optimizer.param_groups, values):
        for k, v in vals.items():
            cur = g.get(k)
            if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                cur.copy_(v)
            else:
                g[k] = v


def apply_loop(loop: dict, optimizer, *, scheduler: Any = None, scaler: Any = None, extra_state: Any = None,
               restore_rng: bool = True) -> None:
    """Param-group values, scheduler, scaler, extra state and RNG of a restored step (training process)."""
    if "groups" in loop:
        apply_group_values(optimizer, loop["groups"])
    if scheduler is not None:
        if "scheduler" not in loop:
            raise ValueError("the checkpoint has no scheduler state (it was taken without a scheduler)")
        scheduler.load_state_dict(loop["scheduler"])
    if scaler is not None:
        if "scaler" not in loop:
            raise ValueError("the checkpoint has no GradScaler state (it was taken without one)")
        scaler.load_state_dict(loop["scaler"])
    extra_state = as_stateful(extra_state)
    if extra_state is not None:
        if "extra" not in loop:
            raise ValueError("the checkpoint has no extra state (it was taken without extra_state)")
        extra_state.load_state_dict(loop["extra"])
    if restore_rng and "rng" in loop:
        set_rng_state(loop["rng"])


def derive_rng(rank: int) -> int:
    """Seed this process's RNG streams (torch CPU and current CUDA device, Python, NumPy) from the current torch
    CPU RNG state (rank 0's, just restored) and ``rank``: a rank that has no saved loop state of its own gets
    streams that differ from every other rank's and are the same at every restore. Returns the seed."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + int(rank).to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    torch.manual_seed(seed)   # also seeds every CUDA device
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    return seed
