"""Amber's increments: which elements of a tensor changed significantly since their *last saved value*, the
compact encodings of those elements, and the diff objects that hold them.

Pure layer (torch, numpy, zstandard): every function runs in any process, on the tensors' own device, with
vectorized torch ops — on the host numpy's where it is several times faster (the selection test, positions,
bitmaps, counts) — and no Python loop over elements (long tensors go in blocks of :data:`BLOCK` elements,
which bounds temporaries and keeps them in cache).

Selection rule (:func:`significant`), for a tensor ``x`` against its last saved value ``r``, relative threshold
``τ`` and absolute floor ``a``: element ``i`` is written when

    bits(x_i) ≠ bits(r_i)   and   not ( |x_i − r_i| < τ·|r_i| + a )

so every element that is *not* written satisfies ``|x_i − r_i| ≤ τ·|r_i| + a`` **in exact arithmetic**, where
``r_i`` is what a restore returns. The test is computed in float32 (float64 for float64 tensors; bfloat16 and
float16 are widened exactly) with a slightly tightened bound ``τ(1−2⁻²⁰)·|r| + a(1−2⁻²⁰)`` (float64: ``2⁻⁴⁰``),
which absorbs every rounding of the test: rounding is monotonic, so a computed difference below the computed
bound (a float) means the exact difference is below it too, and the tightened bound rounds to at most the real
one. Where the product ``τ·|r|`` is subnormal its rounding can exceed that margin, by at most half the
subnormal spacing 2⁻¹⁴⁹ (float64: 2⁻¹⁰⁷⁴); the comparison is strict and both sides are then multiples of that
spacing, so an unwritten difference is at least one spacing below the rounded bound, i.e. below the exact one.
``a`` must be 0 or at least 1e-30 (a normal number). NaN, ±inf and ``r = 0`` are handled by the same
expression: an element saved as 0 (with ``a = 0``) is written on any change; a NaN or infinite new value, or a
change away from an infinite saved value, is always written. ``τ = a = 0`` is the lossless rule: every bit
change is written.

Encodings of the written elements of one tensor (:class:`SlotDelta`), chosen per tensor and increment:

* ``sparse``  int32 (int64 beyond 2³¹ elements) flat indices + the new values;
* ``mask``    a packed bitmap of the written positions (n/8 bytes) + the new values;
* ``dense``   all values (when most elements are written);
* ``xor``     XOR of the bit patterns against the last saved value (zero where not written), split into byte
              planes (all low bytes, then the next ...), each compressed with zstandard or stored raw when it
              does not compress; applying it needs the exact last saved value, which a restore has by
              construction;
* ``new``     the whole tensor, for a tensor that has no saved value yet (e.g. Adam moments created by the
              first step) or whose shape/dtype changed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_ckpt.format import container
from ray_ckpt.format.tree import TreeError, decode_tree, encode_tree

BLOCK = 1 << 18            #: elements per block of the selection test (its temporaries stay in the CPU's cache,
                           #: faster than blocks 16 times larger)
DEVICE_BLOCK = 1 << 22     #: ... on a GPU (fewer kernel launches; the temporaries live in device memory)
PROBE = 1 << 16            #: bytes of an XOR byte plane compressed to decide whether it compresses at all
PROBE_GAIN = 0.9           #: a plane is compressed only when its probe shrinks below this fraction: a plane
                           #: saving 3 % (float32 mantissa noise) costs as long to compress as one saving 70 %
MAX_THRESHOLD = 0.25       #: the largest relative threshold for which the bound argument above holds
ENCODINGS = ("sparse", "mask", "dense", "xor", "new")
SLOT_KINDS = ("p", "o")    #: a parameter (by optimizer order), or one optimizer-state tensor of a parameter

_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as an integer tensor of the same element size (a view, no copy)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


# ------------------------------------------------------------------------------------------------------------
# selection
def _bound_constants(dtype: torch.dtype, thr: float, atol: float) -> tuple[torch.dtype, float, float]:
    """(compute dtype, tightened τ, tightened atol)."""
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    shrink = 1 - (2.0**-40 if cdt == torch.float64 else 2.0**-20)
    return cdt, thr * shrink, atol * shrink


def significant(x: torch.Tensor, ref: torch.Tensor, thr: float, atol: float = 0.0) -> torch.Tensor:
    """Flat bool mask of the elements of ``x`` the rule writes (see the module docstring). ``x`` and ``ref``
    have the same shape and dtype and live on the same device; neither is modified.

    Seven vectorized passes per block of :data:`BLOCK` elements (difference, its magnitude, the bound, the
    strict comparison, the bit comparison, their combination), with ~1 MB temporaries; no clamp or special
    case for infinities, NaN or subnormal products: the strict comparison covers them (module docstring)."""
    xf, rf = x.reshape(-1), ref.reshape(-1)
    if (thr == 0 and atol == 0) or not xf.is_floating_point():
        return bits(xf) != bits(rf)
    cdt, t, a = _bound_constants(xf.dtype, thr, atol)
    if xf.device.type == "cpu":
        return _significant_host(xf, rf, cdt, t, a)
    return _significant_device(xf, rf, cdt, t, a)


def _significant_device(xf: torch.Tensor, rf: torch.Tensor, cdt: torch.dtype, t: float, a: float) -> torch.Tensor:
    """:func:`significant` as torch ops on the tensors' device (CUDA: one kernel per pass and block)."""
    out = torch.empty(xf.numel(), dtype=torch.bool, device=xf.device)
    blk = BLOCK if xf.device.type == "cpu" else DEVICE_BLOCK
    for lo in range(0, xf.numel(), blk):
        xs, rs = xf[lo:lo + blk], rf[lo:lo + blk]
        xc, rc = xs.to(cdt), rs.to(cdt)
        d = torch.sub(xc, rc).abs_()
        b = rc.abs().mul_(t)
        if a:
            b.add_(a)
        # |x-r| < bound is False for NaN on either side, and for an infinite saved value (inf < inf): written
        keep = torch.lt(d, b)
        o = out[lo:lo + blk]
        torch.ne(bits(xs), bits(rs), out=o)
        torch.gt(o, keep, out=o)          # differ and not keep (bools: True > False only)
    return out


def _significant_host(xf: torch.Tensor, rf: torch.Tensor, cdt: torch.dtype, t: float, a: float) -> torch.Tensor:
    """:func:`significant` on the host: the same seven passes as numpy ufuncs into preallocated block buffers
    (faster than the torch expression: no temporaries allocated per pass)."""
    xf, rf = xf.detach(), rf.detach()
    n = xf.numel()
    out = np.empty(n, dtype=np.bool_)
    m = min(n, BLOCK)
    ndt = np.float64 if cdt == torch.float64 else np.float32
    widen = xf.dtype not in (torch.float32, torch.float64)     # bfloat16 / float16: widened exactly per block
    xw = torch.empty(m if widen else 0, dtype=cdt)
    rw = torch.empty(m if widen else 0, dtype=cdt)
    d, b, keep = np.empty(m, ndt), np.empty(m, ndt), np.empty(m, np.bool_)
    xi, ri = bits(xf).numpy(), bits(rf).numpy()
    xn, rn = (None, None) if widen else (xf.numpy(), rf.numpy())
    tc, ac = ndt(t), ndt(a)
    with np.errstate(all="ignore"):   # inf - inf, NaN: handled by the comparison, not worth a warning
        for lo in range(0, n, BLOCK):
            hi = min(n, lo + BLOCK)
            L = hi - lo
            if widen:
                xs, rs = xw[:L].copy_(xf[lo:hi]).numpy(), rw[:L].copy_(rf[lo:hi]).numpy()
            else:
                xs, rs = xn[lo:hi], rn[lo:hi]
            dd, bb, kk, o = d[:L], b[:L], keep[:L], out[lo:hi]
            np.abs(np.subtract(xs, rs, out=dd), out=dd)
            np.multiply(np.abs(rs, out=bb), tc, out=bb)
            if a:
                np.add(bb, ac, out=bb)
            np.less(dd, bb, out=kk)            # False for NaN on either side and for inf < inf
            np.not_equal(xi[lo:hi], ri[lo:hi], out=o)
            np.greater(o, kk, out=o)           # differ and not keep
    return torch.from_numpy(out)


def count(mask: torch.Tensor) -> int:
    """The number of True (or non-zero) elements (bool masks on the host: numpy's SIMD ``count_nonzero``,
    faster than torch's, which beats a bool ``sum``; integers: torch's, which is faster there)."""
    if mask.device.type == "cpu" and mask.dtype == torch.bool:
        return int(np.count_nonzero(mask.detach().reshape(-1).numpy()))
    return int(torch.count_nonzero(mask))


def drift_ratios(x: torch.Tensor, ref: torch.Tensor, idx: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """``max(|x−r| − a, 0) / |r|`` at the flat positions ``idx`` (float64; 0/0 → 0, x/0 → inf): the smallest
    threshold under which each sampled element would not be written."""
    xs = x.reshape(-1).index_select(0, idx).double()
    rs = ref.reshape(-1).index_select(0, idx).double()
    num = (xs - rs).abs_().sub_(atol).clamp_(min=0)
    ratio = num / rs.abs()
    return torch.nan_to_num(ratio, nan=math.inf, posinf=math.inf).masked_fill_(num == 0, 0.0)


# ------------------------------------------------------------------------------------------------------------
# bit packing
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool → uint8, 8 positions per byte, least significant bit first (numpy's SIMD ``packbits`` on the
    host: far faster than the torch expression, which serves other devices)."""
    n = mask.numel()
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.reshape(-1).numpy(), bitorder="little"))
    m = mask.reshape(-1).to(torch.uint8)
    if n % 8:
        m = torch.cat([m, m.new_zeros(8 - n % 8)])
    return (m.view(-1, 8) << _shifts(m.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.reshape(-1).numpy(), count=n, bitorder="little").view(np.bool_))
    return ((packed.reshape(-1, 1) >> _shifts(packed.device)) & 1).view(-1)[:n].bool()


def flat_indices(mask: torch.Tensor) -> torch.Tensor:
    """int64 positions of the True elements of a flat bool mask, ascending. On the host numpy's
    ``flatnonzero`` (faster than ``torch.nonzero`` at middling densities, where the latter mispredicts)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.reshape(-1).numpy()))
    return torch.nonzero(mask.reshape(-1), as_tuple=False).view(-1)


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return s


# ------------------------------------------------------------------------------------------------------------
# one tensor's delta
@dataclass
class SlotDelta:
    """The written elements of one tracked tensor at one increment.

    ``slot`` is ``"p"`` (parameter ``index`` in optimizer order) or ``"o"`` (optimizer state ``key`` of
    parameter ``index``). ``parts`` holds the encoded tensors: ``i`` indices, ``m`` packed mask, ``v`` values,
    ``z`` compressed XOR planes. ``count`` is the number of elements written; ``thr`` the relative threshold in
    force for this tensor (None: lossless rule)."""

    slot: str
    index: int
    key: str | None
    enc: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    count: int
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    thr: float | None = None
    planes: list | None = None         #: xor: per byte plane [stored bytes, stored raw]
    _xor: torch.Tensor | None = None   #: decompressed XOR planes (decode validates them; apply uses them)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def slot_id(self) -> tuple:
        return (self.slot, self.index, self.key)


def encoded_size(n: int, k: int, elem: int) -> tuple[str, int]:
    """The smallest of the sparse / mask / dense encodings of ``k`` of ``n`` elements of ``elem`` bytes."""
    isz = 4 if n < 2**31 else 8
    options = [("sparse", k * (isz + elem)), ("mask", (n + 7) // 8 + k * elem), ("dense", n * elem)]
    return min(options, key=lambda o: o[1])


def encode_selected(slot_id: tuple, x: torch.Tensor, mask: torch.Tensor, k: int, *,
                    thr: float | None = None) -> tuple[SlotDelta, torch.Tensor | None, torch.Tensor | None]:
    """Encode the elements of ``x`` under ``mask`` (``k`` of them) as sparse / mask / dense, whichever is
    smallest. Returns the delta and ``(idx, vals)`` for updating the saved copy (``idx`` None: dense, ``vals``
    is all of ``x``)."""
    xf = x.reshape(-1)
    n = xf.numel()
    enc, _ = encoded_size(n, k, xf.element_size())
    kind, index, key = slot_id
    d = SlotDelta(kind, index, key, enc, tuple(x.shape), x.dtype, k, thr=thr)
    if enc == "sparse":
        idx = flat_indices(mask)
        vals = xf.index_select(0, idx)
        d.parts = {"i": idx.to(torch.int32) if n < 2**31 else idx, "v": vals}
        return d, idx, vals
    if enc == "mask":
        # indices + index_select: several times faster than masked_select on the host, and the
        # indices serve the caller's update of its saved values (index_copy_ instead of a masked scatter)
        idx = flat_indices(mask)
        vals = xf.index_select(0, idx)
        d.parts = {"m": pack_bits(mask), "v": vals}
        return d, idx, vals
    d.parts = {"v": xf}
    return d, None, xf


def xor_bits(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Flat XOR of the bit patterns of ``x`` and ``ref`` (zero where they are bitwise equal): the lossless
    rule's change set (``count(xor_bits(x, r))`` elements written) and :func:`encode_xor`'s input in one pass."""
    return bits(x.reshape(-1)) ^ bits(ref.reshape(-1))


def encode_xor(slot_id: tuple, x: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None, k: int, *,
               level: int, thr: float | None = None, xb: torch.Tensor | None = None) -> SlotDelta:
    """XOR of the bit patterns against ``ref`` (zero outside ``mask``), split into byte planes (plane ``j`` =
    byte ``j`` of every element), each compressed with zstandard, or stored raw when a 64 KiB probe shows it
    does not compress by at least 10 % (the low mantissa bytes of float32 changes are noise: compressing them
    costs time and saves nothing). ``xb``: :func:`xor_bits` of ``x`` and ``ref`` when the caller has it (it
    is then modified in place under ``mask``).

    One pass per plane: each plane is gathered once (a strided copy into the output, or into a scratch
    plane that zstandard reads); the output is one buffer, no joins."""
    import zstandard
    if xb is None:
        xb = xor_bits(x, ref)
    if mask is not None:
        xb.mul_(mask)
    es = x.element_size()
    n = x.numel()
    u8 = xb.view(torch.uint8).view(-1, es).cpu()
    cctx = zstandard.ZstdCompressor(level=level)
    out = torch.empty(es * n, dtype=torch.uint8)
    scratch = torch.empty(n, dtype=torch.uint8) if n >= 4096 else None
    pos, planes = 0, []
    for j in range(es):
        col = u8[:, j]
        if scratch is None:   # short tensors: no probe, always compressed (tiny, and often all zero)
            plane = col.contiguous()
            raw = False
        else:
            probe = col[:PROBE].contiguous().numpy()
            raw = len(cctx.compress(probe.data)) > PROBE_GAIN * probe.nbytes
            plane = out[pos:pos + n] if raw else scratch
            plane.copy_(col)
        if not raw:
            seg = cctx.compress(plane.numpy().data)
            if len(seg) >= n:    # did not compress after all: raw (the output never outgrows es x n bytes)
                raw = True
                out[pos:pos + n].copy_(plane)
            else:
                out[pos:pos + len(seg)].numpy()[:] = np.frombuffer(seg, dtype=np.uint8)
        size = n if raw else len(seg)
        planes.append([size, bool(raw)])
        pos += size
    z = out[:pos].clone() if pos < out.numel() // 2 else out[:pos]   # do not hold twice the increment's bytes
    kind, index, key = slot_id
    return SlotDelta(kind, index, key, "xor", tuple(x.shape), x.dtype, k, parts={"z": z}, thr=thr, planes=planes)


def encode_new(slot_id: tuple, x: torch.Tensor) -> SlotDelta:
    kind, index, key = slot_id
    return SlotDelta(kind, index, key, "new", tuple(x.shape), x.dtype, x.numel(), parts={"v": x.reshape(-1)})


def apply_delta(d: SlotDelta, target: torch.Tensor) -> None:
    """Write the delta into ``target`` (in place, on ``target``'s device). ``target`` holds the last saved
    value the delta was taken against (required for ``xor``); shape and dtype must match."""
    if tuple(target.shape) != d.shape or target.dtype != d.dtype:
        raise ValueError(f"delta for {d.slot}{d.index}{'/' + d.key if d.key else ''} has shape {d.shape} "
                         f"{d.dtype}, the live tensor {tuple(target.shape)} {target.dtype}: restore into the same "
                         f"model and optimizer layout")
    flat = target.view(-1)
    dev = target.device
    if d.enc == "sparse":
        flat.index_copy_(0, d.parts["i"].to(dev, torch.int64), d.parts["v"].to(dev))
    elif d.enc == "mask":
        flat.index_copy_(0, flat_indices(unpack_bits(d.parts["m"].to(dev), d.numel)), d.parts["v"].to(dev))
    elif d.enc in ("dense", "new"):
        flat.copy_(d.parts["v"].reshape(-1))
    elif d.enc == "xor":
        planes = d._xor if d._xor is not None else _decompress_xor(d, "<delta>")
        es = target.element_size()
        xb = planes.view(es, -1).t().contiguous() if es > 1 else planes
        b = bits(flat)
        b.bitwise_xor_(xb.view(-1).view(b.dtype).to(dev))
    else:  # pragma: no cover - decode refuses unknown encodings
        raise ValueError(f"unknown delta encoding {d.enc!r}")


def _decompress_xor(d: SlotDelta, name: str) -> torch.Tensor:
    """The XOR byte planes of ``d`` as one uint8 tensor of ``es × n`` bytes (plane after plane), validated:
    every plane must hold exactly ``n`` bytes, and a compressed frame must say so before it is inflated."""
    import zstandard
    n = d.numel
    es = torch.empty(0, dtype=d.dtype).element_size()
    planes = d.planes
    if not isinstance(planes, list) or len(planes) != es:
        raise container.CorruptObjectError(name, f"XOR delta needs {es} byte planes, has {planes!r:.60}")
    raw_all = d.parts["z"].numpy()
    out = np.empty((es, n), dtype=np.uint8)
    pos = 0
    for j, entry in enumerate(planes):
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], int)
                or isinstance(entry[0], bool) or entry[0] < 0 or not isinstance(entry[1], bool)):
            raise container.CorruptObjectError(name, f"bad XOR plane entry {entry!r:.60}")
        size, raw = entry
        seg = raw_all[pos:pos + size]
        if seg.nbytes != size:
            raise container.CorruptObjectError(name, "XOR planes overrun their data")
        pos += size
        if raw:
            if size != n:
                raise container.CorruptObjectError(name, f"raw XOR plane of {size} bytes, the tensor needs {n}")
            out[j] = seg
            continue
        data = seg.tobytes()
        try:
            want = zstandard.frame_content_size(data)
        except zstandard.ZstdError as e:
            raise container.CorruptObjectError(name, f"bad XOR frame: {e}") from None
        if want != n:
            raise container.CorruptObjectError(name, f"XOR frame holds {want} bytes, the tensor needs {n}")
        try:
            plane = zstandard.ZstdDecompressor().decompress(data, max_output_size=n)
        except zstandard.ZstdError as e:
            raise container.CorruptObjectError(name, f"bad XOR frame: {e}") from None
        if len(plane) != n:
            raise container.CorruptObjectError(name, f"XOR frame decompressed to {len(plane)} bytes, expected {n}")
        out[j] = np.frombuffer(plane, dtype=np.uint8)
    if pos != raw_all.nbytes:
        raise container.CorruptObjectError(name, "XOR delta has trailing bytes")
    return torch.from_numpy(out.reshape(-1))


# ------------------------------------------------------------------------------------------------------------
@dataclass
class AmberRecord:
    """One Amber increment (``kind="step"``: the elements of step ``step`` that the rule wrote), a merged
    increment (``kind="merged"``: every element written since the full at ``base_step``, latest value, taken at
    ``step``), or a request to write one (``kind="merge_request"``, capture → encoder).

    Captured records carry ``snap`` (host copies of every tracked tensor, by slot) until the encoder turns them
    into ``deltas``; decoded records carry ``deltas``. ``loop`` and ``buffers`` are the loop state and model
    buffers after ``step`` (stored exactly, like LowDiff's)."""

    step: int
    kind: str = "step"
    loop: dict = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: Any = None
    base_step: int | None = None          #: the full checkpoint the deltas build on
    first_step: int | None = None         #: merged: the first step the object covers
    lossless: bool = False                #: every tracked tensor was compared bit-exactly
    deltas: list[SlotDelta] | None = None
    opt_misc: dict = field(default_factory=dict)   #: non-tensor optimizer state {param index: {key: value}}
    thresholds: dict[int, float] = field(default_factory=dict)  #: adaptive mode: τ in force per parameter
    # capture → encoder only (never stored):
    snap: dict[tuple, torch.Tensor] | None = None
    base: tuple[int, dict] | None = None  #: (step, snap) of the full the encoder must start from
    rebase: bool = False                  #: a full is taken at this step: it becomes the base afterwards

    @property
    def nbytes(self) -> int:
        n = 4096 + sum(b.numel() * b.element_size() for b in self.buffers.values())
        for group in (self.snap, self.base[1] if self.base else None):
            if group:
                n += sum(t.numel() * t.element_size() for t in group.values())
        if self.deltas:
            n += sum(d.nbytes for d in self.deltas)
        return n


def encode_records(records: list[AmberRecord]) -> list:
    """Container buffers of one Amber diff object (records already encoded into deltas)."""
    tensors: dict[str, torch.Tensor] = {}
    metas = []
    for rec in records:
        if rec.deltas is None:
            raise ValueError(f"record of step {rec.step} has not been encoded")
        p = f"s{rec.step}{'m' if rec.kind == 'merged' else ''}"
        dm = []
        for j, d in enumerate(rec.deltas):
            names = {}
            for part, t in d.parts.items():
                tensors[f"{p}/d{j}{part}"] = t.reshape(-1)
                names[part] = f"{p}/d{j}{part}"
            dm.append({"slot": d.slot, "index": d.index, "key": d.key, "enc": d.enc, "shape": list(d.shape),
                       "dtype": container.dtype_name(d.dtype), "count": d.count, "thr": d.thr, "parts": names,
                       "planes": d.planes})
        buf_meta = {}
        for j, (name, b) in enumerate(rec.buffers.items()):
            tensors[f"{p}/b{j}"] = b
            buf_meta[name] = f"{p}/b{j}"
        metas.append({"step": rec.step, "kind": rec.kind, "base_step": rec.base_step,
                      "first_step": rec.first_step, "lossless": bool(rec.lossless), "deltas": dm,
                      "buffers": buf_meta, "thresholds": [[int(i), float(t)] for i, t in rec.thresholds.items()],
                      "loop": encode_tree(rec.loop, tensors, f"{p}/l"),
                      "opt_misc": encode_tree(rec.opt_misc, tensors, f"{p}/o")})
    return container.encode({"kind": "amber", "records": metas}, tensors)


def _int(v, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise TreeError(f"{what} = {v!r:.40} is not an integer >= {lo}")
    return v


def decode_records(data, name: str, *, verify: bool = True) -> list[AmberRecord]:
    """Validate and decode an Amber diff object. Every delta is checked against its shape (index range and
    order, mask length and population, XOR frame size) before anything is applied. ``verify=False`` skips only
    the data checksum (an in-memory hand-off checksummed where it was encoded)."""
    meta, tensors = container.decode_tensors(data, name, verify=verify)
    try:
        if not isinstance(meta, dict) or meta.get("kind") != "amber" or not isinstance(meta.get("records"), list):
            raise TreeError("not an Amber diff object")
        out = []
        for rm in meta["records"]:
            step = _int(rm["step"], "step")
            kind = rm["kind"]
            if kind not in ("step", "merged"):
                raise TreeError(f"unknown record kind {kind!r:.20}")
            base = _int(rm["base_step"], "base_step")
            first = rm["first_step"]
            if kind == "merged":
                first = _int(first, "first_step")
                if not base <= first <= step:
                    raise TreeError(f"merged record: base {base}, first {first}, step {step}")
            elif first is not None or base >= step:
                raise TreeError(f"step record {step} on base {base}")
            deltas = [_decode_delta(dm, tensors, name) for dm in rm["deltas"]]
            thresholds = {_int(i, "threshold index"): float(t) for i, t in rm["thresholds"]}
            out.append(AmberRecord(step=step, kind=kind, base_step=base, first_step=first,
                                   lossless=bool(rm["lossless"]), deltas=deltas, thresholds=thresholds,
                                   loop=decode_tree(rm["loop"], tensors),
                                   opt_misc=decode_tree(rm["opt_misc"], tensors),
                                   buffers={n: tensors[k] for n, k in rm["buffers"].items()}))
        return out
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        if isinstance(e, container.CorruptObjectError):
            raise
        raise container.CorruptObjectError(name, f"malformed Amber diff object: {e}") from None


def _decode_delta(dm: dict, tensors: dict[str, torch.Tensor], name: str) -> SlotDelta:
    slot, enc = dm["slot"], dm["enc"]
    if slot not in SLOT_KINDS or enc not in ENCODINGS:
        raise TreeError(f"bad delta slot/encoding {slot!r:.10}/{enc!r:.10}")
    key = dm["key"]
    if (slot == "p") != (key is None) or (key is not None and not isinstance(key, str)):
        raise TreeError("bad delta key")
    shape = tuple(_int(s, "shape") for s in dm["shape"])
    dtype = container.torch_dtype(dm["dtype"])
    n = math.prod(shape)
    count = _int(dm["count"], "count")
    thr = dm["thr"]
    if thr is not None:
        thr = float(thr)
    parts = {k: tensors[v] for k, v in dm["parts"].items()}
    need = {"sparse": {"i", "v"}, "mask": {"m", "v"}, "dense": {"v"}, "new": {"v"}, "xor": {"z"}}[enc]
    if set(parts) != need:
        raise TreeError(f"{enc} delta with parts {sorted(parts)}")
    v = parts.get("v")
    if v is not None and v.dtype != dtype:
        raise TreeError(f"values of dtype {v.dtype}, delta says {dtype}")
    d = SlotDelta(slot, _int(dm["index"], "index"), key, enc, shape, dtype, count, parts, thr,
                  planes=dm.get("planes"))
    if enc == "sparse":
        i = parts["i"]
        if i.dtype not in (torch.int32, torch.int64) or i.numel() != count or v.numel() != count:
            raise TreeError("sparse delta: index/value count mismatch")
        if count and (int(i[0]) < 0 or int(i[-1]) >= n or (count > 1 and not bool((i[1:] > i[:-1]).all()))):
            raise TreeError("sparse delta: indices out of range or not increasing")
    elif enc == "mask":
        m = parts["m"]
        if m.dtype != torch.uint8 or m.numel() != (n + 7) // 8 or v.numel() != count:
            raise TreeError("mask delta: bad mask size or value count")
        if int(unpack_bits(m, n).sum()) != count:
            raise TreeError("mask delta: mask population differs from the value count")
    elif enc in ("dense", "new"):
        if v.numel() != n:
            raise TreeError(f"{enc} delta: {v.numel()} values for {n} elements")
    else:
        if parts["z"].dtype != torch.uint8:
            raise TreeError("xor delta: compressed planes must be bytes")
        d._xor = _decompress_xor(d, name)
    return d
