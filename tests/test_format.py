"""Pure layers: container, tree codec, manifests, chain resolution (no Ray, no storage)."""
from __future__ import annotations

import dataclasses
import json
import math
import pickle
import random
import struct
import zlib

import numpy as np
import pytest
import torch

from ray_ckpt.format import container
from ray_ckpt.format.container import CorruptObjectError
from ray_ckpt.format.tree import TreeError, decode_tree, encode_tree
from ray_ckpt.lineage import Lineage, Manifest, ManifestError, NoCheckpointError, diff_name, full_name, object_key


def test_container_round_trip_all_dtypes():
    ts = {
        "f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
        "f64": torch.randn(7, dtype=torch.float64), "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8), "b": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3), "negzero": torch.tensor([-0.0, 0.0]),
    }
    data = container.encode_bytes({"hello": [1, 2.5]}, ts)
    meta, out = container.decode_tensors(data, "x")
    assert meta == {"hello": [1, 2.5]}
    for k, t in ts.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:10], "truncated"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"x", "truncated"),
    (lambda b: b"XXXXXXXX" + b[8:], "bad magic"),
    (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "data checksum"),
    (lambda b: b[:30] + bytes([b[30] ^ 1]) + b[31:], "header checksum"),
])
def test_container_detects_corruption(mutate, reason):
    data = container.encode_bytes({}, {"w": torch.randn(100)})
    with pytest.raises(CorruptObjectError, match=reason) as e:
        container.decode(mutate(data), "objects/x.rckpt")
    assert "objects/x.rckpt" in str(e.value)


def _forge(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    prefix = struct.pack("<8sQI", container.MAGIC, len(h), zlib.crc32(h))
    pad = (-(len(prefix) + len(h))) % 64
    return prefix + h + bytes(pad) + data


@pytest.mark.parametrize("entry", [
    {"name": "a", "dtype": "object", "shape": [1], "offset": 0, "nbytes": 8},
    {"name": "a", "dtype": "float32", "shape": [2**40, 2**40], "offset": 0, "nbytes": 64},
    {"name": "a", "dtype": "float32", "shape": [16], "offset": 32, "nbytes": 64},
    {"name": "a", "dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 64},
    {"name": "a", "dtype": "float32", "shape": [16], "offset": -64, "nbytes": 64},
])
def test_container_refuses_hostile_headers(entry):
    data = bytes(64)
    forged = _forge({"meta": {}, "tensors": [entry], "data_len": 64, "data_crc": zlib.crc32(data)}, data)
    with pytest.raises(CorruptObjectError):
        container.decode(forged, "hostile")


def test_container_refuses_absurd_header_length():
    forged = struct.pack("<8sQI", container.MAGIC, 2**60, 0) + bytes(100)
    with pytest.raises(CorruptObjectError, match="header length"):
        container.decode(forged, "hostile")


def test_pickle_payload_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Evil())
    with pytest.raises(CorruptObjectError, match="bad magic"):
        container.decode(payload, "evil.pt")
    assert not marker.exists()


def test_tree_round_trip_exact_types():
    tree = {"betas": (0.9, 0.95), 3: [1, None, True, "s"], "inf": math.inf, "nan": [math.nan],
            "t": torch.arange(4.0), "np": np.arange(5, dtype=np.uint32), "nps": np.float64(2.5),
            "rng": random.getstate(), "nprng": np.random.get_state(), "dt": torch.float16, 1.5: -0.0}
    tensors: dict = {}
    enc = encode_tree(tree, tensors, "p")
    text = json.dumps(enc)
    out = decode_tree(json.loads(text), tensors)
    assert out["betas"] == (0.9, 0.95) and isinstance(out["betas"], tuple)
    assert out[3] == [1, None, True, "s"]
    assert out["inf"] == math.inf and math.isnan(out["nan"][0])
    assert torch.equal(out["t"], tree["t"])
    assert out["np"].dtype == np.uint32 and (out["np"] == tree["np"]).all()
    assert out["nps"] == 2.5 and isinstance(out["nps"], np.float64)
    assert out["rng"][1] == tree["rng"][1] or tuple(out["rng"][1]) == tree["rng"][1]
    assert out["nprng"][0] == "MT19937" and (out["nprng"][1] == tree["nprng"][1]).all()
    assert out["dt"] is torch.float16
    assert math.copysign(1, out[1.5]) == -1


def test_tree_refuses_unknown_types():
    with pytest.raises(TreeError, match="a.b"):
        encode_tree({"a": {"b": object()}}, {}, "p")
    with pytest.raises(TreeError):
        decode_tree({"__rc": "A", "n": "x", "dtype": "O", "shape": [1]}, {"x": torch.zeros(8, dtype=torch.uint8)})
    with pytest.raises(TreeError):
        decode_tree({"__rc": "dt", "v": "__class__"}, {})


# ------------------------------------------------------------------------------------------------------------
def _m(gen, kind, a, b=None, **info):
    b = a if b is None else b
    name = full_name(gen, a) if kind == "full" else diff_name(gen, a, b)
    return Manifest(kind=kind, generation=gen, first_step=a, last_step=b, object=object_key(name), nbytes=1,
                    crc32=0, info=info)


def test_chain_resolution_picks_latest_full_and_contiguous_diffs():
    ms = [_m(1, "full", 0), _m(1, "diff", 1, 5), _m(1, "diff", 6, 10), _m(1, "full", 10), _m(1, "diff", 11, 13)]
    lin = Lineage(ms)
    p = lin.resolve(None)
    assert p.step == 13 and p.full.last_step == 10 and [d.first_step for d in p.diffs] == [11]
    p = lin.resolve(7)
    assert p.full.last_step == 0 and [d.last_step for d in p.diffs] == [5, 10]
    assert lin.resolve(10).diffs == ()
    # a gap: diffs 6..10 missing -> steps 6..9 unreachable, 10.. via the full at 10
    lin = Lineage(ms, exclude=[diff_name(1, 6, 10)])
    with pytest.raises(NoCheckpointError):
        lin.resolve(7)
    assert lin.resolve(12).full.last_step == 10
    assert lin.reachable_steps(1) == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13]


def test_newer_generation_supersedes_from_its_start():
    ms = [_m(1, "full", 0), _m(1, "diff", 1, 20), _m(2, "full", 8), _m(2, "diff", 9, 12)]
    lin = Lineage(ms)
    assert lin.resolve(None).step == 12 and lin.resolve(None).generation == 2
    assert lin.resolve(5).generation == 1
    assert lin.resolve(10).generation == 2
    with pytest.raises(NoCheckpointError, match="latest recoverable step: 12"):
        lin.resolve(15)  # only on the abandoned timeline of generation 1
    # generation 2's full lost: its diffs still prove it branched at 8, so generation 1 stays capped there (its
    # steps 9..20 are an abandoned timeline and must not come back)
    lin = Lineage(ms, exclude=[full_name(2, 8)])
    assert lin.resolve(None).step == 8 and lin.resolve(None).generation == 1
    with pytest.raises(NoCheckpointError):
        lin.resolve(15)
    # a later diff of generation 2 alone: the start_step its writer recorded says where it began
    ms3 = [_m(1, "full", 0), _m(1, "diff", 1, 20), _m(2, "diff", 13, 16, start_step=8)]
    assert Lineage(ms3).resolve(None).step == 8
    assert Lineage([_m(1, "full", 0), _m(1, "diff", 1, 20), _m(2, "diff", 13, 16)]).resolve(None).step == 12
    assert Lineage(ms).next_generation() == 3


@pytest.mark.parametrize("patch", [
    {"object": "../../etc/passwd"}, {"object": "objects/../x.rckpt"}, {"object": "/abs"},
    {"nbytes": 2**60}, {"kind": "evil"}, {"first_step": 5, "last_step": 1}, {"surprise": 1},
    {"generation": -1}, {"format": 99},
])
def test_hostile_manifests_are_refused(patch):
    d = _m(1, "diff", 1, 5).to_dict()
    d.update(patch)
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(d).encode(), "manifests/x.json")


def test_atomic_objects_are_used_whole_or_not_at_all():
    # steps 1..3 as single increments, plus a merged (atomic) object covering 1..3; full at 0
    ms = [_m(1, "full", 0), _m(1, "diff", 1, 1, atomic=True), _m(1, "diff", 2, 2, atomic=True),
          _m(1, "diff", 3, 3, atomic=True), _m(1, "diff", 1, 3, atomic=True)]
    lin = Lineage(ms)
    assert lin.reachable_steps(1) == [0, 1, 2, 3]
    assert [(d.first_step, d.last_step) for d in lin.resolve(3).diffs] == [(1, 3)]  # merged: one object
    assert [(d.first_step, d.last_step) for d in lin.resolve(2).diffs] == [(1, 1), (2, 2)]
    only_merged = Lineage([_m(1, "full", 0), _m(1, "diff", 1, 3, atomic=True)])
    assert only_merged.reachable_steps(1) == [0, 3]
    with pytest.raises(NoCheckpointError):
        only_merged.resolve(2)


def test_decode_from_parts_without_joining():
    """An object held in Ray's object store arrives as encode()'s list of buffers: decoding it from those parts
    gives the same tensors as decoding the joined bytes, checks the data checksum across the parts, and falls back
    to one joined copy for any other split."""
    from ray_ckpt.format import segments
    from ray_ckpt.format.container import CorruptObjectError
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.float64),
               "e": torch.empty(0, dtype=torch.int32), "c": torch.tensor([7], dtype=torch.int64)}
    parts = container.encode({"k": 1}, tensors)
    joined = b"".join(bytes(p) for p in parts)
    meta, got = container.decode_tensors(list(parts), "parts")
    assert meta == {"k": 1}
    for k, t in tensors.items():
        assert torch.equal(got[k], t)
    # the parts are really used (no join): a tensor is a view of its own part
    _, arrays, _ = container.decode(list(parts), "parts")
    assert np.shares_memory(arrays["a"], np.frombuffer(parts[1], dtype=np.uint8))
    # a flipped byte in a data part is caught
    bad = [bytearray(p) for p in parts]
    bad[1][5] ^= 0xFF
    with pytest.raises(CorruptObjectError, match="checksum"):
        container.decode(bad, "bad")
    # another split (two halves) decodes from a joined copy, same values
    half = len(joined) // 2
    _, got2 = container.decode_tensors([joined[:half], joined[half:]], "halves")
    for k, t in tensors.items():
        assert torch.equal(got2[k], t)
    # segments: a one-container part list stays one segment of parts
    segs = segments.split_parts(list(parts), "parts")
    assert len(segs) == 1 and isinstance(segs[0], list)
    assert len(segments.split_parts([joined[:half], joined[half:]], "halves")) == 1


# -- checksums: CRC-32C for new objects, zlib's CRC-32 still read ---------------------------------------------------
@pytest.mark.parametrize("alg", ["crc32", "crc32c"])
def test_checksum_of_a_concatenation_from_its_parts(alg):
    from ray_ckpt.format import checksum, segments
    rng = random.Random(7)
    data = bytes(rng.getrandbits(8) for _ in range(5000))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(0, 4)))
        parts = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        crc, n = segments.combine_all([(checksum.compute(alg, p), len(p)) for p in parts], alg)
        assert (crc, n) == (checksum.compute(alg, data), len(data))
    assert checksum.compute("crc32", data) == zlib.crc32(data)
    assert checksum.compute("crc32c", b"123456789") == 0xE3069283     # the CRC-32C check value


def test_new_objects_use_the_fast_checksum_and_old_ones_still_decode(monkeypatch):
    from ray_ckpt.format import checksum, segments
    from ray_ckpt.lineage.manifest import CRC_ALGORITHMS
    assert CRC_ALGORITHMS == checksum.ALGORITHMS
    assert checksum.DEFAULT == "crc32c"     # the crc32c package (a dependency) has its hardware implementation here
    ts = {"w": torch.randn(300), "b": torch.arange(7)}
    for alg in ("crc32", "crc32c"):
        monkeypatch.setattr(checksum, "DEFAULT", alg)
        bufs = container.encode({"k": 1}, ts)
        data = b"".join(bytes(b) for b in bufs)
        header = json.loads(data[20:20 + struct.unpack_from("<Q", data, 8)[0]])
        assert header.get("data_crc_alg", "crc32") == alg
        crc, n, got = segments.object_crc(bufs)
        assert (crc, n, got) == (checksum.compute(alg, data), len(data), alg)
        monkeypatch.setattr(checksum, "DEFAULT", "crc32c" if alg == "crc32" else "crc32")   # the reader's default
        _, out = container.decode_tensors(data, "x")
        assert all(torch.equal(out[k], ts[k]) for k in ts)
        bad = bytearray(data)
        bad[-3] ^= 1
        with pytest.raises(CorruptObjectError, match="data checksum mismatch"):
            container.decode(bytes(bad), "x")
        with pytest.raises(CorruptObjectError, match="data checksum mismatch"):
            container.decode([bufs[0], bytes(bad[len(bufs[0]):])], "x")


def test_unknown_checksum_algorithms_are_refused():
    forged = _forge({"meta": {}, "tensors": [], "data_len": 0, "data_crc": 0, "data_crc_alg": "md5"})
    with pytest.raises(CorruptObjectError, match="unknown checksum algorithm"):
        container.decode(forged, "hostile")
    m = Manifest(kind="full", generation=1, first_step=0, last_step=0, object=object_key(full_name(1, 0)),
                 nbytes=1, crc32=0)
    d = json.loads(m.to_json())
    assert "crc_alg" not in d and d["format"] == 1       # written as before CRC-32C: older versions read it
    assert Manifest.from_json(json.dumps(d).encode()).crc_alg == "crc32"
    c = json.loads(dataclasses.replace(m, crc_alg="crc32c").to_json())
    assert (c["crc_alg"], c["format"]) == ("crc32c", 2)
    assert Manifest.from_json(json.dumps(c).encode()).crc_alg == "crc32c"
    c["format"] = 3
    with pytest.raises(ManifestError, match="upgrade ray_ckpt"):
        Manifest.from_json(json.dumps(c).encode())
    d["crc_alg"] = "sha1"
    with pytest.raises(ManifestError, match="unknown checksum algorithm"):
        Manifest.from_json(json.dumps(d).encode())


def test_encoded_buffers_are_not_tracked_by_the_garbage_collector():
    """A batch waiting for its write must not add collectable objects per tensor: each one makes the collector run
    sooner in the training process, and a full collection walks every object there (README, fourth pass)."""
    import gc
    tensors = {f"s{i}/g{j}/v": torch.randn(5 + j) for i in range(3) for j in range(4)}
    tensors["idx"] = torch.arange(7, dtype=torch.int32)
    bufs = container.encode({"kind": "diff", "steps": [1, 2, 3]}, tensors)
    assert len(bufs) > len(tensors)                       # header, then every tensor and its padding
    assert not [type(b).__name__ for b in bufs if gc.is_tracked(b)]
    meta, arrays, _ = container.decode(bufs, "x")
    assert meta["steps"] == [1, 2, 3]
    assert all(np.array_equal(arrays[k], tensors[k].numpy()) for k in tensors)


def test_an_unsealed_container_is_sealed_where_its_bytes_are_read_into_the_same_object():
    """The training process's sender encodes a chunk without its data checksum (``unsealed``); the node's worker
    seals it as it takes the bytes (``segments.seal``): the sealed object is byte for byte the one a checksumming
    encode gives, in whatever parts the data arrives, and anything but an unsealed container is refused."""
    from ray_ckpt.format import segments
    from ray_ckpt.format.framing import unsealed
    tensors = {"a": torch.randn(1000), "b": torch.arange(7, dtype=torch.int64), "c": torch.ones(3, 5).double()}
    sealed = container.encode({"k": [1, 2]}, tensors)
    with unsealed():
        parts = container.encode({"k": [1, 2]}, tensors)
    assert container.encode({"k": [1, 2]}, tensors)[0] == sealed[0] != parts[0]   # (outside: checksummed again)
    with pytest.raises(CorruptObjectError, match="checksum"):   # never stored so: a verified read refuses it
        container.decode(list(parts), "unsealed")
    joined = b"".join(bytes(p) for p in sealed)
    data = b"".join(bytes(p) for p in parts[1:])
    for split in (list(parts[1:]), [data], [data[:100], data[100:]]):   # as handed over: joined small buffers
        got = segments.seal([parts[0], *split])
        assert b"".join(bytes(memoryview(p).cast("B")) for p in got) == joined
        assert segments.object_crc(got) == segments.object_crc(sealed)
    container.decode(segments.seal(list(parts)), "sealed")   # verifies
    with pytest.raises(ValueError, match="sealed already"):
        segments.seal(list(sealed))
    with pytest.raises(ValueError, match="first buffer"):
        segments.seal([b"".join(bytes(p) for p in parts)])   # the first buffer must be the head alone
    with pytest.raises(ValueError, match="first buffer"):
        segments.seal([b"not a container at all, just bytes"])
