"""Amber: selective incremental checkpoints of model and optimizer state (see :class:`ray_ckpt.Amber`).

Where each part runs::

    training thread   AmberCapture: after each optimizer.step(), a host copy of every tracked tensor
                      (parameters, optimizer state per ``optimizer_state``) → AmberRecord(snap) → sink.
                      At a batch close it consults the chain policy (merge now? a full instead?) and may
                      submit a merge request. Full checkpoints reuse the step's host copies.
    writer thread     AmberImpl.encode_diffs → AmberEncoder: compares each tensor with its last saved value
                      (kept here, in host memory), selects, encodes (sparse / mask / dense / xor), updates the
                      saved values, and answers merge requests with one merged increment (atomic object
                      covering base..step: every element written since the full, latest value).
    restoring process AmberImpl.advance: applies the increments (or the merged one) on the tensors' device.

The encoder is stateful: one encoder sees one capture's records in step order (the engine's writer thread,
or the Ray runtime's sender thread, both in the training process). Records built on different fulls cannot be
mixed in one replay unless the increments before the later full were lossless: :meth:`AmberImpl.advance`
refuses such a chain (it only arises when a full checkpoint is missing or corrupt).

Per-layer adaptive thresholds (``budget_fraction`` set). The budget of one increment is
``budget_fraction × (the parameters' full bytes)``; each parameter tensor (a layer's weight or bias) gets the
share of its own bytes, i.e. a target of ``k_l`` elements (the most that fit its share as sparse or bitmap
encoding). For every increment, the encoder draws the layer's *drift ratios* ``max(|x−r|−atol, 0)/|r|`` on a
fixed random sample of up to 16384 elements and takes the threshold in force as their ``1 − k_l/n_l``
quantile, clamped to ``[threshold, max_threshold]``: the smallest threshold whose written elements fit the
layer's share, judged from the statistics of what exceeds it. The whole layer is then selected with exactly
that threshold, so the bound ``|restored − true| ≤ τ_l(t)·|restored| + atol`` holds for every element with
the threshold ``τ_l(t) ≤ max_threshold`` in force at step ``t`` (recorded per layer in each increment, see
:attr:`AmberRecord.thresholds`). When even ``max_threshold`` selects more than the share, the bound wins and the
increment exceeds the budget. Optimizer state keeps its fixed rule.
"""
from __future__ import annotations

import collections
import time
from types import SimpleNamespace
from typing import Any

import torch

from ray_ckpt.config import Amber
from ray_ckpt.engine.capture import CaptureBase
from ray_ckpt.format.delta import (AmberRecord, apply_delta, count, decode_records, drift_ratios, encode_new,
                                   encode_records, encode_selected, encode_xor, encoded_size, significant,
                                   xor_bits)
from ray_ckpt.format.records import FullState
from ray_ckpt.policy import StepDecision
from ray_ckpt.policy.merge import ChainContext, CostChainPolicy

SAMPLE = 16384  #: elements per layer whose drift statistics set the adaptive threshold


def _is_exact_slot(t: torch.Tensor) -> bool:
    """Scalars (step counters) and integer tensors are always compared bit-exactly."""
    return not t.is_floating_point() or t.numel() <= 1


# ------------------------------------------------------------------------------------------------------------
class AmberEncoder:
    """The writer-side state of one capture: the last saved value of every tracked tensor, what changed since
    the full (for merged increments), and the statistics the chain policy and the benchmarks read."""

    def __init__(self, config: Amber):
        self.cfg = config
        self.opt_mode = config.resolved_optimizer_state
        self.base_step: int | None = None
        self.ref: dict[tuple, torch.Tensor] = {}
        self.dirty: dict[tuple, torch.Tensor] = {}      # written since the full (bool, flat)
        self.dirty_count: dict[tuple, int] = {}
        self.new_slots: set[tuple] = set()              # no saved value at the full: stored whole when merged
        self.last_thresholds: dict[int, float] = {}
        self._samples: dict[tuple, torch.Tensor] = {}
        # read by the capture (chain policy) and benchmarks
        self.merged_bytes = 0
        self.chain_bytes = 0
        self.last_merged_bytes = 0
        self.encode_seconds = 0.0
        self.history: collections.deque = collections.deque(maxlen=1 << 16)

    # -- rules ---------------------------------------------------------------------------------------------
    def _lossless(self, slot: tuple, t: torch.Tensor) -> bool:
        if _is_exact_slot(t):
            return True
        if slot[0] == "p":
            return self.cfg.lossless
        if self.opt_mode == "lossless":
            return True
        return self._opt_threshold() == 0 and self.cfg.atol == 0

    def _opt_threshold(self) -> float:
        t = self.cfg.optimizer_threshold
        return self.cfg.threshold if t is None else t

    @property
    def all_lossless(self) -> bool:
        """Every tracked tensor is compared bit-exactly and the optimizer state is tracked."""
        return self.cfg.lossless and self.opt_mode != "full" and (
            self.opt_mode == "lossless" or (self._opt_threshold() == 0 and self.cfg.atol == 0))

    def _encoding(self, lossless: bool, x: torch.Tensor) -> str:
        enc = self.cfg.encoding
        if enc == "auto":
            return "xor" if lossless or x.element_size() <= 2 else "sparse"
        return enc

    def _adaptive_threshold(self, slot: tuple, x: torch.Tensor, r: torch.Tensor) -> float:
        cfg = self.cfg
        n, es = x.numel(), x.element_size()
        share = cfg.budget_fraction * n * es
        isz = 4 if n < 2**31 else 8
        k = int(max(share // (es + isz), (share - (n + 7) // 8) // es, 0))
        if k >= n:
            return float(cfg.threshold)
        idx = self._samples.get(slot)
        if idx is None or idx.device != x.device:
            if n <= SAMPLE:
                idx = torch.arange(n)
            else:
                g = torch.Generator().manual_seed(1_000_003 * slot[1] + 17)
                idx = torch.randint(0, n, (SAMPLE,), generator=g)
            idx = self._samples[slot] = idx.to(x.device)
        ratios = drift_ratios(x, r, idx, cfg.atol)
        m = ratios.numel()
        allowed = int(k * m / n)                 # sampled elements that may exceed the threshold
        q = float(torch.kthvalue(ratios.cpu(), m - allowed).values) if allowed < m else 0.0
        return float(min(max(q, cfg.threshold), cfg.max_threshold))

    # -- state -----------------------------------------------------------------------------------------------
    def rebase(self, step: int, snap: dict[tuple, torch.Tensor]) -> None:
        """The full checkpoint at ``step`` holds exactly ``snap``: it becomes every element's saved value."""
        self.base_step = step
        self.ref = {s: (t if self._lossless(s, t) else t.clone()) for s, t in snap.items()}
        self.dirty, self.dirty_count, self.new_slots = {}, {}, set()
        self.merged_bytes = self.chain_bytes = self.last_merged_bytes = 0

    def encode_step(self, rec: AmberRecord) -> AmberRecord:
        """Select and encode one captured step against the saved values; update them."""
        t0 = time.perf_counter()
        if rec.base is not None:
            self.rebase(*rec.base)
        if self.base_step is None:
            raise RuntimeError("Amber encoder has no base: the first record after attach must carry the attach "
                               "snapshot (records reached an encoder out of order)")
        deltas, thresholds = [], {}
        stats = {"p": 0, "o": 0}
        written = tracked = 0
        for slot, x in rec.snap.items():
            tracked += x.numel()
            r = self.ref.get(slot)
            lossless = self._lossless(slot, x)
            if r is None or r.shape != x.shape or r.dtype != x.dtype:
                d = encode_new(slot, x)
                self.ref[slot] = x if lossless else x.clone()
                self.new_slots.add(slot)
                self.dirty.pop(slot, None)
                self.dirty_count.pop(slot, None)
            else:
                if lossless:
                    thr, atol = 0.0, 0.0
                elif slot[0] == "p":
                    atol = self.cfg.atol
                    if self.cfg.budget_fraction is not None:
                        thr = thresholds[slot[1]] = self._adaptive_threshold(slot, x, r)
                    else:
                        thr = self.cfg.threshold
                else:
                    thr, atol = self._opt_threshold(), self.cfg.atol
                rf, xf = r.view(-1), x.reshape(-1)
                if lossless and self._encoding(lossless, x) == "xor":
                    # one XOR pass gives the change set, its count and the encoder's input; the mask is only
                    # built while the slot is not yet wholly dirty since the full (moments: after one step)
                    xb = xor_bits(x, r)
                    k = count(xb)
                    if k == 0:
                        continue
                    mask = None if self.dirty_count.get(slot) == x.numel() else xb != 0
                    d = encode_xor(slot, x, r, None, k, level=self.cfg.zstd_level, xb=xb)
                    self.ref[slot] = x
                else:
                    mask = significant(x, r, thr, atol)
                    k = count(mask)
                    if k == 0:
                        continue
                    if self._encoding(lossless, x) == "xor":
                        d = encode_xor(slot, x, r, mask, k, level=self.cfg.zstd_level, thr=thr)
                        torch.where(mask, xf, rf, out=rf)    # the saved values: one pass (masked_scatter_ is slower)
                    else:
                        d, idx, vals = encode_selected(slot, x, mask, k, thr=None if lossless else thr)
                        if lossless:
                            self.ref[slot] = x
                        elif idx is not None:
                            rf.index_copy_(0, idx, vals)
                        else:
                            rf.copy_(xf)
                if slot not in self.new_slots and mask is not None:
                    dm = self.dirty.get(slot)
                    if dm is None:
                        self.dirty[slot] = dm = mask
                    else:
                        dm.logical_or_(mask)
                    self.dirty_count[slot] = count(dm)
            deltas.append(d)
            written += d.count
            stats[d.slot] += d.nbytes
        if thresholds:
            self.last_thresholds = dict(thresholds)
        out = AmberRecord(step=rec.step, kind="step", loop=rec.loop, buffers=rec.buffers,
                          base_step=self.base_step, lossless=self.all_lossless, deltas=deltas,
                          opt_misc=rec.opt_misc, thresholds=thresholds)
        nbytes = stats["p"] + stats["o"]
        self.chain_bytes += nbytes
        self._update_merged_estimate()
        if rec.rebase:
            self.rebase(rec.step, rec.snap)
        dt = time.perf_counter() - t0
        self.encode_seconds += dt
        self.history.append({"step": rec.step, "kind": "step", "bytes": nbytes, "param_bytes": stats["p"],
                             "opt_bytes": stats["o"], "written": written, "tracked": tracked, "seconds": dt})
        return out

    def _update_merged_estimate(self) -> None:
        n = 0
        for slot, cnt in self.dirty_count.items():
            r = self.ref[slot]
            if cnt:
                n += encoded_size(r.numel(), cnt, r.element_size())[1]
        for slot in self.new_slots:
            r = self.ref[slot]
            n += r.numel() * r.element_size()
        self.merged_bytes = n

    def merged(self, req: AmberRecord) -> AmberRecord:
        """Every element written since the full, with its latest value: one increment from the full to
        ``req.step``. Values are the saved copies themselves (encoded before the next record mutates them)."""
        t0 = time.perf_counter()
        if self.base_step is None:
            raise RuntimeError("Amber encoder has no base for a merged increment")
        deltas = []
        for slot, r in self.ref.items():
            if slot in self.new_slots:
                deltas.append(encode_new(slot, r))
                continue
            m, cnt = self.dirty.get(slot), self.dirty_count.get(slot, 0)
            if m is None or cnt == 0:
                continue
            d, _, _ = encode_selected(slot, r, m, cnt)
            deltas.append(d)
        out = AmberRecord(step=req.step, kind="merged", loop=req.loop, buffers=req.buffers,
                          base_step=self.base_step, first_step=self.base_step, lossless=self.all_lossless,
                          deltas=deltas, opt_misc=req.opt_misc, thresholds=dict(self.last_thresholds))
        nbytes = sum(d.nbytes for d in deltas)
        self.last_merged_bytes = nbytes
        self.chain_bytes = 0
        dt = time.perf_counter() - t0
        self.encode_seconds += dt
        self.history.append({"step": req.step, "kind": "merged", "bytes": nbytes, "seconds": dt})
        return out


# ------------------------------------------------------------------------------------------------------------
class AmberSlots:
    """Which tensors an increment of a step holds, by *slot* — ``("p", i, None)`` for parameter ``i`` (optimizer
    order), ``("o", i, key)`` for its optimizer state tensor ``key`` — and the rule that picks them: every
    parameter at every step; optimizer tensors on the ``optimizer_every`` schedule (and at fulls), plus, once, a
    tensor the latest full does not hold (Adam's moments are created by the first step). One rule for both places
    increments are computed: the training process (:class:`AmberCapture`, host copies) and the state tier's
    replica (:class:`ShadowAmber`, its own tensors), so both select the same elements from the same values."""

    def __init__(self, config: Amber):
        self.config = config
        self.opt_mode = config.resolved_optimizer_state
        self._full_opt_slots: set[tuple] = set()   # optimizer_state="full": tensors the latest full holds
        self._sent_opt_slots: set[tuple] = set()   # ... and those created since, already sent once

    def tracked(self, params: list, optimizer, step: int | None, copy, copy_tree) -> tuple[dict, dict]:
        """``(snap, opt_misc)`` of ``step`` (None: every tracked tensor, for a full): ``copy(tensor)`` of each
        slot, and ``copy_tree`` of the non-tensor optimizer state by parameter index."""
        snap: dict[tuple, torch.Tensor] = {}
        misc: dict[int, dict] = {}
        refresh = step is None or (self.opt_mode != "full" and step % self.config.resolved_optimizer_every == 0)
        for i, p in enumerate(params):
            snap[("p", i, None)] = copy(p)
        for i, p in enumerate(params):
            st = optimizer.state.get(p)
            if not st:
                continue
            for key, v in st.items():
                if not isinstance(key, str):
                    raise TypeError(f"Amber tracks optimizer state by string keys; parameter {i} has key {key!r}")
                if isinstance(v, torch.Tensor):
                    slot = ("o", i, key)
                    if not _is_exact_slot(v) and not refresh:
                        # on its own schedule (or the full's); a tensor the full does not hold (Adam moments
                        # created by the first step) is sent once, so a restore always has every state tensor
                        if slot in self._full_opt_slots or slot in self._sent_opt_slots:
                            continue
                        self._sent_opt_slots.add(slot)
                    snap[slot] = copy(v)
                else:
                    misc.setdefault(i, {})[key] = copy_tree(v)
        return snap, misc

    def complete(self, snap: dict, params: list, optimizer, copy) -> None:
        """A full is taken at this step: add the optimizer tensors the schedule skipped, so that ``snap`` holds
        the whole tracked state (it becomes every element's saved value)."""
        if self.opt_mode == "full":
            return
        for i, p in enumerate(params):
            for key, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and ("o", i, key) not in snap:
                    snap[("o", i, key)] = copy(v)

    def note_full(self, params: list, optimizer) -> None:
        """A full holding the current optimizer state was taken."""
        self._sent_opt_slots = set()
        self._full_opt_slots = {("o", i, k) for i, p in enumerate(params)
                                for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}


# ------------------------------------------------------------------------------------------------------------
class AmberCapture(CaptureBase):
    """Training thread: a host copy of the tracked tensors per captured step (nothing else); the chain policy
    at batch closes. Full checkpoints share the step's copies."""

    def __init__(self, model, optimizer, sink, policy, *, config: Amber, encoder: AmberEncoder, **kwargs):
        self.config = config
        self.encoder = encoder
        self.opt_mode = config.resolved_optimizer_state
        self.chain_policy = CostChainPolicy(merge_after=config.merge_after, full_ratio=config.full_ratio)
        self._next_base: tuple[int, dict] | None = None
        self._merge_now = False
        self.chain_objects = 0      # diff objects closed since the full or the latest merged increment
        self.merged_objects = 0     # merged increments since the full
        self.full_bytes = 0
        self.merges = 0             # merge requests submitted (stats)
        self.early_fulls = 0        # fulls the chain policy asked for (stats)
        self.slots = AmberSlots(config)
        super().__init__(model, optimizer, sink, policy, capture_buffers=config.capture_buffers, **kwargs)

    def _tracked(self, step: int | None = None) -> tuple[dict[tuple, torch.Tensor], dict]:
        """Host copies of the tracked tensors at ``step`` (None: all of them, for a full)."""
        return self.slots.tracked(self.params, self.optimizer, step, self._copy, self._copy.tree)

    def _make_record(self, step: int, loop: dict, buffers: dict) -> AmberRecord:
        snap, misc = self._tracked(step)
        rec = AmberRecord(step=step, loop=loop, buffers=buffers, snap=snap, opt_misc=misc)
        if self._next_base is not None:
            rec.base, self._next_base = self._next_base, None
        return rec

    def _amend_decision(self, rec: AmberRecord, decision: StepDecision) -> StepDecision:
        self._merge_now = False
        enc = self.encoder
        if decision.close_batch and not decision.full:
            # the encoder's byte counts lag behind (writer thread); they describe the current chain only once
            # it has started from the latest full; until then they count as unknown (0)
            known = enc.base_step == self.last_full_step
            d = self.chain_policy.decide(ChainContext(
                step=rec.step, full_bytes=self.full_bytes, merged_bytes=enc.merged_bytes if known else 0,
                chain_objects=self.chain_objects + 1, chain_bytes=enc.chain_bytes if known else 0,
                merged_objects=self.merged_objects, last_merged_bytes=enc.last_merged_bytes if known else 0))
            if d.full:
                decision = StepDecision(full=True, close_batch=True)
                self.early_fulls += 1
            else:
                self._merge_now = d.merge
        rec.rebase = decision.full   # set before the record reaches the sink
        if decision.full:
            # the full becomes every element's saved value: the record must hold the whole tracked state
            # (optimizer tensors skipped by optimizer_every are copied now; scheduler.step left them as is)
            self.slots.complete(rec.snap, self.params, self.optimizer, self._copy)
        return decision

    def _after_submit(self, rec: AmberRecord, decision: StepDecision, full: FullState | None) -> None:
        if full is not None:
            self.chain_objects = self.merged_objects = 0
            self.full_bytes = full.nbytes
            self._note_full()
        elif decision.close_batch:
            if self._merge_now:
                req = AmberRecord(step=rec.step, kind="merge_request", loop=rec.loop, buffers=rec.buffers,
                                  opt_misc=rec.opt_misc)
                self.sink.submit(req, close_batch=True)
                self.chain_objects = 0
                self.merged_objects += 1
                self.merges += 1
            else:
                self.chain_objects += 1
        self._merge_now = False

    def _snapshot(self, step: int, loop: dict, rec: Any = None) -> FullState:
        """Model + optimizer state, sharing the host copies ``rec.snap`` already holds for this step."""
        t0 = time.perf_counter()
        shared: dict[int, torch.Tensor] = {}
        if rec is not None and rec.snap is not None:
            for (kind, i, key), t in rec.snap.items():
                p = self.params[i]
                shared[id(p if kind == "p" else self.optimizer.state[p][key])] = t

        def cp(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                s = shared.get(id(x))
                return s if s is not None else self._copy(x)
            if isinstance(x, dict):
                return {k: cp(v) for k, v in x.items()}
            if isinstance(x, list):
                return [cp(v) for v in x]
            if isinstance(x, tuple):
                return tuple(cp(v) for v in x)
            return self._copy.tree(x)

        model_sd = {k: cp(v) for k, v in self.model.state_dict(keep_vars=True).items()}
        full = FullState(step=step, model=model_sd, optimizer=cp(self.optimizer.state_dict()), loop=loop,
                         layout=self.layout())
        self.full_snapshots += 1                                # stats()["trainer_fulls"]
        self.last_snapshot_seconds = time.perf_counter() - t0  # the adaptive policy's cost model reads it
        return full

    def snapshot_now(self) -> FullState:
        """The attach full; its host copies also become the encoder's first saved values."""
        with self._lock:
            snap, _ = self._tracked()
            full = self._snapshot(self.step, self._attach_loop(), SimpleNamespace(snap=snap))
            full.ready = self._copy.event()
            self._next_base = (self.step, snap)
            self.full_bytes = full.nbytes
            self._note_full()
            return full

    def _note_full(self) -> None:
        self.slots.note_full(self.params, self.optimizer)


# ------------------------------------------------------------------------------------------------------------
class ShadowAmber:
    """Amber increments of a state advanced elsewhere: the state tier's replica (``durable_diffs="amber"``, a
    LowDiff+ run) calls :meth:`step` after applying each step record to its :class:`ShadowState`, and gets the
    increment the training process would have computed from host copies of the same values — the same slots
    (:class:`AmberSlots`), the same encoder (:class:`AmberEncoder`) — without the trainer copying anything for
    it. Increments build on the full the encoder was last rebased on (:meth:`rebase`: the full the replica was
    installed from, or a full it writes itself, ``full=True``); until then :meth:`step` returns None.

    The shadow's tensors change in place at its next step: the encoder keeps its own copies of what it retains
    (lossless slots are cloned here, lossy ones are cloned by the encoder), and the parts of a returned increment
    never alias the shadow. Runs in the replica actor's thread (any process; no Ray)."""

    def __init__(self, config: Amber):
        self.config = config
        self.encoder = AmberEncoder(config)
        self.slots = AmberSlots(config)

    @property
    def base_step(self) -> int | None:
        return self.encoder.base_step

    @staticmethod
    def _params(shadow) -> list:
        return [p for g in shadow.optimizer.param_groups for p in g["params"]]

    def _snap(self, shadow, step: int | None, full: bool) -> tuple[dict, dict, set]:
        import copy as _copy
        params = self._params(shadow)
        with torch.no_grad():
            snap, misc = self.slots.tracked(params, shadow.optimizer, step, lambda t: t.detach(), _copy.deepcopy)
            if full:
                self.slots.complete(snap, params, shadow.optimizer, lambda t: t.detach())
        live = {t.untyped_storage().data_ptr() for t in snap.values()}
        for slot, x in list(snap.items()):
            if self.encoder._lossless(slot, x):   # kept by the encoder as the saved value
                snap[slot] = x.clone()
        return snap, misc, live

    def rebase(self, shadow) -> None:
        """The shadow's current state is a full checkpoint (durable, or about to be): increments build on it."""
        snap, _, _ = self._snap(shadow, None, full=True)
        self.encoder.rebase(shadow.step, snap)
        self.slots.note_full(self._params(shadow), shadow.optimizer)

    def reset(self) -> None:
        """No base (a rebuilt replica: its state is not a full's): no increments until the next :meth:`rebase`."""
        self.encoder = AmberEncoder(self.config)
        self.slots = AmberSlots(self.config)

    def step(self, shadow, loop: dict, buffers: dict, *, full: bool = False) -> AmberRecord | None:
        """The increment of the shadow's current step (just applied; ``loop``/``buffers``: that step record's).
        ``full``: a full of this step is written too; later increments build on it."""
        if self.encoder.base_step is None:
            if full:   # unbased (a rebuilt replica): increments resume on this full
                self.rebase(shadow)
            return None
        snap, misc, live = self._snap(shadow, shadow.step, full)
        rec = AmberRecord(step=shadow.step, loop=loop, buffers=buffers, snap=snap, opt_misc=misc, rebase=full)
        out = self.encoder.encode_step(rec)
        for d in out.deltas:
            for k, v in d.parts.items():
                if v.untyped_storage().data_ptr() in live:
                    d.parts[k] = v.clone()
        if full:
            self.slots.note_full(self._params(shadow), shadow.optimizer)
        return out


# ------------------------------------------------------------------------------------------------------------
class AmberImpl:
    """The Amber strategy behind :class:`ray_ckpt.Amber` (see the module docstring)."""

    name = "amber"

    def __init__(self, config: Amber):
        self.config = config
        self.encoder = AmberEncoder(config)

    def make_capture(self, model, optimizer, sink, policy, **kwargs) -> AmberCapture:
        return AmberCapture(model, optimizer, sink, policy, config=self.config, encoder=self.encoder, **kwargs)

    def encode_diffs(self, records: list) -> tuple[list, dict]:
        """Writer thread. Captured records are selected and encoded (a lone merge request becomes a merged
        increment: an atomic object starting at the full's step); decoded records are re-packed as they are."""
        if len(records) == 1 and records[0].kind == "merge_request":
            m = self.encoder.merged(records[0])
            return encode_records([m]), {"atomic": True, "first_step": m.first_step, "base_step": m.base_step}
        if all(r.snap is None and r.deltas is not None for r in records):   # decoded: re-batching
            info: dict = {"base_step": records[0].base_step}
            if len(records) == 1 and records[0].kind == "merged":
                info.update(atomic=True, first_step=records[0].first_step)
            return encode_records(records), info
        out = [self.encoder.encode_step(r) for r in records if r.kind == "step"]
        if not out:
            raise ValueError("an Amber diff batch holds no step record")
        return encode_records(out), {"base_step": out[0].base_step}

    def decode_diffs(self, data, name: str, *, verify: bool = True, copy: bool = True) -> list:
        return decode_records(data, name, verify=verify)   # always copied: increments are applied in place

    def advance(self, records: list, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                full_step: int) -> None:
        """Apply the increments after the full at ``full_step`` (restoring process, tensors' own device)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        sd = optimizer.state_dict()
        state = sd["state"]
        base, exact, prev = full_step, True, full_step
        for rec in records:
            # a merged increment holds every element written since its full: it applies to any state of that
            # full's chain (prev >= base); a step increment applies to the state of the step before it
            if rec.kind == "merged" and rec.step <= prev:
                raise ValueError(f"merged increment of step {rec.step} after step {prev}")
            if rec.kind != "merged" and rec.step != prev + 1:
                raise ValueError(f"Amber increments after step {prev} skip to step {rec.step}")
            if rec.base_step != base:
                if not (exact and rec.base_step == prev):
                    raise ValueError(
                        f"the increments after step {rec.base_step} were taken against the full checkpoint of "
                        f"that step, which this restore does not use (it is missing or corrupt); the lossy "
                        f"increments before it cannot reproduce it: restore step {rec.base_step} or earlier")
                base = rec.base_step
            exact = exact and rec.lossless
            with torch.no_grad():
                for d in rec.deltas:
                    if d.index >= len(params):
                        raise ValueError(f"increment of step {rec.step} names parameter {d.index}; the optimizer "
                                         f"has {len(params)}: restore into the same model and optimizer layout")
                    if d.slot == "p":
                        apply_delta(d, params[d.index])
                    elif d.enc == "new":
                        state.setdefault(d.index, {})[d.key] = d.parts["v"].reshape(d.shape).clone()
                    else:
                        cur = state.get(d.index, {}).get(d.key)
                        if not isinstance(cur, torch.Tensor):
                            raise ValueError(f"increment of step {rec.step} updates optimizer state {d.key!r} of "
                                             f"parameter {d.index}, which the restored optimizer does not have")
                        apply_delta(d, cur)
            for i, vals in rec.opt_misc.items():
                state.setdefault(int(i), {}).update(vals)
            prev = rec.step
        optimizer.load_state_dict(sd)
