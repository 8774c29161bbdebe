"""Checksummed but malformed content (a buggy or hostile writer can checksum anything): only CorruptObjectError,
ManifestError or NoCheckpointError may escape — never RecursionError, AttributeError, TypeError, KeyError.

The unit tests below failed on the code before the limits and type checks were added (RecursionError for deep
nesting, TypeError for an unhashable dtype, AttributeError for a list where a dict belongs, ValueError for an
unknown strategy); the fuzz test mutates a real checkpoint's objects and manifests, re-checksummed so that the
mutations get past the checksums and reach the parsers.
"""
from __future__ import annotations

import json
import os
import random
import struct
import zlib

import pytest
import torch

import ray_ckpt
from ray_ckpt.format import container, records, segments
from ray_ckpt.lineage import ManifestError
from ray_ckpt.lineage.index import IndexError_, decode_index
from ray_ckpt.lineage.manifest import Manifest
from tests import _training as T

ALLOWED = (ray_ckpt.CorruptObjectError, ray_ckpt.ManifestError, ray_ckpt.NoCheckpointError)
_PREFIX = struct.Struct("<8sQI")
DEEP = 20_000


def _object(header: bytes, data: bytes = b"") -> bytes:
    """A container object around ``header`` with valid magic, lengths and checksums."""
    head = _PREFIX.pack(container.MAGIC, len(header), zlib.crc32(header)) + header
    head += b"\0" * ((-len(head)) % container.ALIGN)
    return head + data


def _deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def test_deeply_nested_object_header_is_a_corrupt_object():
    obj = _object(('{"tensors": [], "data_len": 0, "meta": ' + _deep() + '}').encode())
    with pytest.raises(ray_ckpt.CorruptObjectError, match="nested too deeply"):
        container.decode(obj, "objects/x")
    with pytest.raises(ray_ckpt.CorruptObjectError):
        segments.split(obj + obj, "objects/x")


def test_wrong_types_in_a_header_are_a_corrupt_object():
    entry = {"name": "t", "dtype": ["float32"], "shape": [1], "offset": 0, "nbytes": 4}   # unhashable dtype
    obj = _object(json.dumps({"tensors": [entry], "data_len": 4, "data_crc": zlib.crc32(b"\0" * 4),
                              "meta": None}).encode(), b"\0" * 4)
    with pytest.raises(ray_ckpt.CorruptObjectError, match="dtype"):
        container.decode(obj, "objects/x")


def test_wrong_types_in_a_diff_header_are_a_corrupt_object():
    meta = {"kind": "diff", "steps": [{"step": 1, "grads": [], "buffers": ["not", "a", "dict"],
                                       "hparams": None, "loop": None}]}
    data = container.encode_bytes(meta, {})
    with pytest.raises(ray_ckpt.CorruptObjectError, match="malformed diff batch"):
        records.decode_steps(data, "objects/d")


def test_deeply_nested_or_oversized_manifest_is_a_manifest_error():
    with pytest.raises(ManifestError, match="nested too deeply"):
        Manifest.from_json(('{"info": ' + _deep() + '}').encode())
    with pytest.raises(ManifestError, match="limit"):
        Manifest.from_json(b'{"info": "' + b"x" * (2 << 20) + b'"}')
    with pytest.raises(IndexError_, match="nested too deeply"):
        decode_index(('{"format": 1, "x": ' + _deep() + '}').encode())


def test_unknown_strategy_in_a_manifest_is_a_manifest_error(tmp_path):
    from ray_ckpt.engine.strategy import impl_by_name
    with pytest.raises(ManifestError, match="strategy"):
        impl_by_name("zstd-magic")
    uri = str(tmp_path / "ckpt")
    _checkpoint(uri)
    mdir = os.path.join(uri, "manifests")
    for n in os.listdir(mdir):
        d = json.loads(open(os.path.join(mdir, n), "rb").read())
        if d["kind"] == "diff":
            d["strategy"] = "zstd-magic"
            open(os.path.join(mdir, n), "w").write(json.dumps(d))
    _drop_index(uri)
    model, opt = _fresh()
    with pytest.raises(ALLOWED):
        ray_ckpt.restore(uri, model, opt, step=7)


# ------------------------------------------------------------------------------------------------------------
def _fresh(seed=0):
    torch.manual_seed(seed)
    model = T.MLP(d_in=32, hidden=64, d_out=8)
    return model, T.make_optimizer("adamw", model)


def _checkpoint(uri, steps=9):
    model, opt = _fresh()
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=5, batch_steps=2, recovery_every=1, keep_fulls=0):
        for s in range(steps):
            T.train_step("mlp", model, opt, None, s)


def _drop_index(uri):
    for root, _, files in os.walk(uri):
        for f in files:
            if f.startswith("index"):
                os.remove(os.path.join(root, f))


def _files(uri):
    out = []
    for root, _, files in os.walk(uri):
        out += [os.path.join(root, f) for f in files]
    return sorted(out)


_JUNK = [None, True, -1, 2**70, 1.5, "x", "", [], {}, [1, [2, [3]]], {"a": {"b": {}}}]


def _mutate_json(value, rng):
    """A structural mutation somewhere inside ``value``: a field replaced, dropped or retyped."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        k = rng.choice(sorted(value))
        r = rng.random()
        if r < 0.2:
            del value[k]
        elif r < 0.5:
            value[k] = rng.choice(_JUNK)
        else:
            value[k] = _mutate_json(value[k], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        value[i] = _mutate_json(value[i], rng) if rng.random() < 0.6 else rng.choice(_JUNK)
        return value
    return rng.choice(_JUNK)


def _mutate_object(data: bytes, rng) -> bytes:
    """Mutate the (first) header of a container object and re-checksum it, or flip/truncate raw bytes."""
    r = rng.random()
    if r < 0.15:
        return data[:rng.randrange(len(data))]
    if r < 0.3:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    magic, hlen, _ = _PREFIX.unpack_from(data, 0)
    header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
    start = _PREFIX.size + hlen
    start += (-start) % container.ALIGN
    rest = data[start:]
    header = _mutate_json(header, rng)
    return _object(json.dumps(header).encode(), rest)


def _run_fuzz(tmp_path, n, seed):
    uri = str(tmp_path / "ckpt")
    _checkpoint(uri)
    _drop_index(uri)
    pristine = {p: open(p, "rb").read() for p in _files(uri)}
    objects = [p for p in pristine if "/objects/" in p]
    manifests = [p for p in pristine if "/manifests/" in p]
    assert objects and manifests
    rng = random.Random(seed)
    outcomes = {"ok": 0}
    for i in range(n):
        for p, b in pristine.items():
            if open(p, "rb").read() != b:
                open(p, "wb").write(b)
        if rng.random() < 0.6:
            p = rng.choice(objects)
            open(p, "wb").write(_mutate_object(pristine[p], rng))
        else:
            p = rng.choice(manifests)
            d = json.loads(pristine[p])
            open(p, "wb").write(json.dumps(_mutate_json(d, rng)).encode() if rng.random() < 0.8
                                else pristine[p][:rng.randrange(len(pristine[p]))])
        model, opt = _fresh(seed=1)
        step = rng.choice([None, 0, 3, 5, 7, 9])
        try:
            ray_ckpt.restore(uri, model, opt, step=step, fallback=rng.random() < 0.3)
            outcomes["ok"] += 1
        except ALLOWED as e:
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"mutation {i} (seed {seed}) of {os.path.relpath(p, uri)} escaped as "
                                 f"{type(e).__name__}: {e}") from e
    # the mutations reached the parsers: both outcomes occur
    assert outcomes["ok"] > 0 and sum(v for k, v in outcomes.items() if k != "ok") > 0, outcomes


def test_fuzzed_objects_and_manifests_raise_only_checkpoint_errors(tmp_path):
    _run_fuzz(tmp_path, 300, seed=13)


@pytest.mark.long
def test_fuzzed_objects_and_manifests_raise_only_checkpoint_errors_long(tmp_path):
    _run_fuzz(tmp_path, 10_000, seed=7)
