"""Nested Python state (state dicts, RNG states, scheduler and user state) ⇄ JSON + named tensors.

A tree may hold ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``, ``tuple``, ``dict`` (any keys of those
scalar types), ``torch.Tensor`` and numeric ``numpy`` arrays and scalars. Tensors and arrays are moved out into
a flat ``{name: tensor}`` mapping (stored by :mod:`ray_ckpt.format.container`) and referenced from the JSON by
name. Tuples, non-string dict keys and numpy dtypes are tagged so a round trip restores the exact types: the
optimizer's ``betas`` stay a tuple, its integer state keys stay integers. Nothing is ever pickled; decoding
builds only the types listed above.

Pure layer; runs in any process.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ray_ckpt.errors import RayCkptError

_TAG = "__rc"  # every non-list container is a dict with this key: {"__rc": kind, ...}
_NUMPY_KINDS = set("biufc?")
#: values stored as themselves, tested by exact type first (most of a loop state's nodes: hyperparameters, step
#: counters); subclasses (numpy scalars are float/int subclasses, bool is an int) take the checked path
_PLAIN = frozenset((str, int, bool, type(None)))
_PLAIN_JSON = frozenset((str, int, bool, float, type(None)))   # decoding: JSON floats are plain (no NaN tag)


class TreeError(RayCkptError, TypeError):
    """The tree holds a value the format cannot store, or a stored tree is malformed."""


def encode_tree(tree: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """Return the JSON-able form of ``tree``; tensors are added to ``tensors`` under ``prefix``-based names.

    Tensors must already be on the CPU (the capture copies them there). Raises :class:`TreeError` naming the
    path of an unsupported value.
    """
    counter = [0]

    def new_name() -> str:
        name = f"{prefix}#{counter[0]}"
        counter[0] += 1
        if name in tensors:
            raise TreeError(f"tensor name collision {name!r}")
        return name

    def enc(x: Any, path: str) -> Any:
        t = type(x)
        if t in _PLAIN or (t is float and math.isfinite(x)):
            return x
        if isinstance(x, np.generic):  # before the scalars: np.float64 is a float subclass
            if x.dtype.kind not in _NUMPY_KINDS:
                raise TreeError(f"{path}: numpy scalar of dtype {x.dtype} cannot be stored")
            return {_TAG: "S", "dtype": x.dtype.str, "v": enc(x.item(), path)}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            if math.isfinite(x):
                return x
            return {_TAG: "f", "v": repr(x)}
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise TreeError(f"{path}: tensor on {x.device}; copy to host before encoding")
            name = new_name()
            tensors[name] = x.detach()
            return {_TAG: "T", "n": name}
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in _NUMPY_KINDS:
                raise TreeError(f"{path}: numpy dtype {x.dtype} cannot be stored")
            name = new_name()
            raw = np.ascontiguousarray(x)
            tensors[name] = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
            return {_TAG: "A", "n": name, "dtype": raw.dtype.str, "shape": list(raw.shape)}
        if isinstance(x, tuple):
            return {_TAG: "t", "v": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise TreeError(f"{path}: dict key of type {type(k).__name__} cannot be stored")
                tv = type(v)   # a plain value needs neither a call nor its path (used only in errors)
                items.append([k if type(k) is str else enc(k, path),
                              v if tv in _PLAIN or (tv is float and math.isfinite(v)) else enc(v, f"{path}.{k}")])
            return {_TAG: "d", "v": items}
        if isinstance(x, torch.dtype):
            return {_TAG: "dt", "v": str(x).removeprefix("torch.")}
        raise TreeError(f"{path or '<root>'}: values of type {type(x).__name__} cannot be checkpointed "
                        f"(supported: None, bool, int, float, str, list, tuple, dict, torch.Tensor, numpy arrays)")

    return enc(tree, "")


def decode_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_tree`. Tensors referenced by name are taken from ``tensors`` (not copied)."""

    def dec(x: Any) -> Any:
        if type(x) in _PLAIN_JSON:   # what json.loads builds for scalars: exactly these types
            return x
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict) or _TAG not in x:
            raise TreeError(f"malformed tree node {x!r:.100}")
        kind = x[_TAG]
        if kind == "T":
            try:
                return tensors[x["n"]]
            except (KeyError, TypeError):
                raise TreeError(f"tree references missing tensor {x.get('n')!r:.100}") from None
        if kind == "A":
            dt = np.dtype(_checked_dtype(x.get("dtype")))
            t = tensors.get(x.get("n"))
            if t is None:
                raise TreeError(f"tree references missing array {x.get('n')!r:.100}")
            shape = x.get("shape")
            raw = t.numpy()
            if not isinstance(shape, list) or raw.nbytes != dt.itemsize * math.prod(shape):
                raise TreeError("array size does not match its shape")
            return raw.view(dt).reshape(shape).copy()
        if kind == "S":
            return np.dtype(_checked_dtype(x.get("dtype"))).type(dec(x.get("v")))
        if kind == "f":
            v = x.get("v")
            if v not in ("inf", "-inf", "nan"):
                raise TreeError(f"bad float literal {v!r:.20}")
            return float(v)
        if kind == "t":
            return tuple(dec(v) for v in _list(x.get("v")))
        if kind == "d":
            out = {}
            for pair in _list(x.get("v")):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise TreeError("malformed dict entry")
                k, v = pair
                if type(k) is not str:
                    k = dec(k)
                    if not (k is None or isinstance(k, (bool, int, float, str))):
                        raise TreeError("malformed dict key")
                out[k] = v if type(v) in _PLAIN_JSON else dec(v)
            return out
        if kind == "dt":
            v = x.get("v")
            dt = getattr(torch, v, None) if isinstance(v, str) and v.isidentifier() else None
            if not isinstance(dt, torch.dtype):
                raise TreeError(f"unknown torch dtype {v!r:.30}")
            return dt
        raise TreeError(f"unknown tree node kind {kind!r:.30}")

    return dec(obj)


def _list(v: Any) -> list:
    if not isinstance(v, list):
        raise TreeError("malformed tree: expected a list")
    return v


def _checked_dtype(s: Any) -> str:
    if not isinstance(s, str) or len(s) > 8:
        raise TreeError(f"bad numpy dtype {s!r:.20}")
    try:
        dt = np.dtype(s)
    except TypeError:
        raise TreeError(f"bad numpy dtype {s!r:.20}") from None
    if dt.kind not in _NUMPY_KINDS or dt.hasobject:
        raise TreeError(f"numpy dtype {s!r} is not allowed")
    return s
