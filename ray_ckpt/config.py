"""All tunables in one place: the strategies' settings, :class:`CheckpointConfig` (the knobs of a Checkpointer,
each with a ``RAY_CKPT_*`` environment override, resolved by :meth:`CheckpointConfig.resolve`) and
:class:`Runtime`. Pure: no torch, no Ray.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from dataclasses import dataclass, fields
from enum import StrEnum

_GiB = 1 << 30


def _env(name: str, default, cast):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


@dataclass(kw_only=True, frozen=True)
class LowDiff:
    """LowDiff: each step's consumed (aggregated, compressed) gradient is that step's differential checkpoint.

    Recovery loads the last full checkpoint and replays the gradients through the optimizer: bit-exact on the
    same device type with a deterministic optimizer.
    """

    #: a dense gradient is stored sparse (index + value) when that is smaller than this fraction of its dense
    #: bytes; 0 disables the scan (it runs off the training thread, O(numel)).
    max_sparse_density: float = 0.5
    #: copy model buffers (BatchNorm statistics ...) into every step record: they change in forward, not in
    #: the optimizer, so replay cannot rebuild them.
    capture_buffers: bool = True

    name = "lowdiff"

    def __post_init__(self):
        if not 0.0 <= self.max_sparse_density <= 1.0:
            raise ValueError(f"max_sparse_density must be in [0, 1], got {self.max_sparse_density}")


@dataclass(kw_only=True, frozen=True)
class Amber:
    """Amber: selective incremental checkpoints of model (and optimizer) state, error-bounded or lossless.

    Every captured step (every optimizer step by default, like LowDiff) writes an *increment*: the elements of
    each tracked tensor whose change since their **last saved value** ``r`` exceeds the bound,
    ``|x − r| > τ·|r| + atol``. Comparing with the last saved value (not the previous step) writes slow drift
    once it accumulates, so a restore at any checkpointed step ``t`` returns, for every element,

        |restored − true_t| ≤ τ·|restored| + atol        (restored = the element's last saved value)

    relative to the *restored* value, in exact arithmetic (the selection test is computed with a tightened
    bound that absorbs float rounding; see :mod:`ray_ckpt.format.delta`). ``τ`` is ``threshold`` for
    parameters (the threshold in force for the layer in adaptive mode, never above ``max_threshold``) and
    ``optimizer_threshold`` for optimizer state under ``optimizer_state="threshold"``. Elements saved as 0 are
    written on any change unless ``atol > 0``. Scalars (Adam's step counters) and integer tensors are always
    compared bit-exactly. ``threshold=0`` (``atol=0``, no budget) is lossless: restores are bit-exact.

    Selection, encoding and merging run where the diff objects are encoded (the writer thread), never on the
    training thread, which only copies the tracked tensors to host memory. Merged increments (every element
    written since the full, latest value wins; one atomic object) bound what a recovery reads; a cost policy
    (:class:`ray_ckpt.policy.merge.CostChainPolicy`) decides when to merge and when a new full is cheaper.
    Measured figures behind the defaults: benchmarks/results/amber_table.md.
    """

    #: relative threshold τ for parameters, in [0, 0.25]: an element is written when it moved more than τ of
    #: its last saved magnitude. 0 (with atol 0 and no budget) = lossless, bit-exact restores.
    threshold: float = 0.02
    #: absolute floor added to the bound (>= 1e-30 when set): elements near 0 are written only when they
    #: move more than this. 0: an element saved as 0 is written on any change.
    atol: float = 0.0
    #: optimizer state tensors (Adam moments, momentum): "lossless" (bit-exact increments on the
    #: ``optimizer_every`` schedule), "threshold" (the parameters' rule with ``optimizer_threshold``, on the same
    #: schedule), or "full" (only in full checkpoints: a restore returns the moments of the latest full).
    #: Step counters are exact in every mode. Default: lossless every 10 steps (see the figures above).
    optimizer_state: str = "lossless"
    #: τ for optimizer state under "threshold" (in [0, 0.25]); None: the same as ``threshold``
    optimizer_threshold: float | None = None
    #: compare the optimizer state at every this many steps only (and at fulls); in between a restore returns
    #: it as of the latest such step. None: 1 when the parameters are lossless (bit-exact restores at every
    #: step), else 10.
    optimizer_every: int | None = None
    #: adaptive per-layer thresholds: the byte budget of one increment, as a fraction of the parameters'
    #: full bytes (e.g. 0.01). Each layer's threshold is then chosen per increment from its drift statistics
    #: (see ray_ckpt.engine.amber), between ``threshold`` and ``max_threshold``. None: fixed threshold.
    budget_fraction: float | None = None
    #: adaptive mode: the largest threshold a layer may get, in (0, 0.25]; the error bound's cap
    max_threshold: float = 0.1
    #: how written elements are encoded: "sparse" (indices or a bitmap, plus values), "xor" (XOR with the
    #: last saved bits, byte planes, zstandard), or "auto": xor for bit-exact tensors and for 2-byte dtypes
    #: (bfloat16, float16), sparse for lossy 4- and 8-byte ones (same size there, and faster)
    encoding: str = "auto"
    #: zstandard level of the "xor" encoding (1 = fastest)
    zstd_level: int = 1
    #: merge the increments since the full into one object once this many diff objects follow the full (or
    #: the latest merge), or earlier when the chain is mostly overwritten elements; 0 disables merging
    merge_after: int = 4
    #: take a new full checkpoint once a merged increment would reach this fraction of a full's bytes;
    #: None: fulls only on the ``full_every`` schedule
    full_ratio: float | None = 0.5
    #: copy model buffers (BatchNorm statistics ...) into every increment, exactly
    capture_buffers: bool = True

    name = "amber"

    def __post_init__(self):
        def rel(name, v, allow_none=False):
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 0.25:
                raise ValueError(f"{name} must be a relative threshold in [0, 0.25] (0.02 = 2%), got {v!r}")

        rel("threshold", self.threshold)
        rel("optimizer_threshold", self.optimizer_threshold, allow_none=True)
        if not (self.atol == 0 or 1e-30 <= self.atol < float("inf")):
            raise ValueError(f"atol must be 0 or a finite value >= 1e-30, got {self.atol!r}")
        if self.optimizer_state not in ("threshold", "lossless", "full"):
            raise ValueError(f"optimizer_state must be 'lossless', 'threshold' or 'full', got "
                             f"{self.optimizer_state!r}")
        if self.optimizer_every is not None:
            if isinstance(self.optimizer_every, bool) or not isinstance(self.optimizer_every, int) \
                    or self.optimizer_every < 1:
                raise ValueError(f"optimizer_every must be an integer >= 1 or None, got {self.optimizer_every!r}")
            if self.optimizer_state == "full":
                raise ValueError("optimizer_every applies to optimizer_state 'lossless' or 'threshold'; with 'full' "
                                 "the optimizer state is only in full checkpoints")
        if self.optimizer_threshold is not None and self.optimizer_state != "threshold":
            raise ValueError(f"optimizer_threshold applies to optimizer_state='threshold' (it is "
                             f"{self.optimizer_state!r}): pass both")
        if self.budget_fraction is not None:
            if not 0.0 < self.budget_fraction <= 1.0:
                raise ValueError(f"budget_fraction must be in (0, 1] (a fraction of the parameters' full bytes), "
                                 f"got {self.budget_fraction!r}")
            if not 0.0 < self.max_threshold <= 0.25:
                raise ValueError(f"max_threshold must be in (0, 0.25], got {self.max_threshold!r}")
            if self.max_threshold < self.threshold:
                raise ValueError(f"max_threshold ({self.max_threshold}) is below threshold ({self.threshold}): "
                                 f"in adaptive mode threshold is the smallest a layer's threshold may get")
        if self.encoding not in ("auto", "sparse", "xor"):
            raise ValueError(f"encoding must be 'auto', 'sparse' or 'xor', got {self.encoding!r}")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in [1, 22], got {self.zstd_level}")
        if self.merge_after < 0:
            raise ValueError(f"merge_after must be >= 0 (0 disables merging), got {self.merge_after}")
        if self.full_ratio is not None and not self.full_ratio > 0:
            raise ValueError(f"full_ratio must be > 0 or None, got {self.full_ratio}")

    @property
    def lossless(self) -> bool:
        """Parameters are compared bit-exactly."""
        return self.threshold == 0 and self.atol == 0 and self.budget_fraction is None

    @property
    def resolved_optimizer_state(self) -> str:
        return self.optimizer_state

    @property
    def resolved_optimizer_every(self) -> int:
        if self.optimizer_every is not None:
            return self.optimizer_every
        return 1 if self.lossless else 10


class Runtime(StrEnum):
    """Where a Checkpointer's captured steps go, and where :func:`ray_ckpt.restore` reads from. The plain strings
    (``"local"``, ``"ray"``) are accepted wherever a Runtime is; :meth:`of` checks a choice once, at the entry
    point."""

    #: a writer thread in the training process writes to storage; no Ray
    LOCAL = "local", "a writer thread in this process; no Ray"
    #: the persistence actors (node workers, coordinator, state-tier replica) hold and write the steps
    RAY = "ray", "the persistence actors; Ray initialized"

    def __new__(cls, value: str, means: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.means = means
        return member

    @classmethod
    def of(cls, value) -> "Runtime":
        """``value`` (a Runtime or its string) as a Runtime; ValueError saying what is accepted. Any thread."""
        try:
            return cls(value)
        except ValueError:
            accepted = " or ".join(f"{r.value!r} ({r.means})" for r in cls)
            raise ValueError(f"runtime must be {accepted}, got {value!r}") from None


def _note_given(cls):
    """Let each instance know which fields its constructor was given (:attr:`CheckpointConfig.given`)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kw):
        init(self, **kw)
        object.__setattr__(self, "_given", frozenset(kw))

    cls.__init__ = __init__
    return cls


@_note_given
@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Knobs of a :class:`ray_ckpt.Checkpointer` (``Checkpointer(..., config=CheckpointConfig(full_every=50))``).

    Every field has a ``RAY_CKPT_<FIELD>`` environment override; :meth:`resolve` says which source wins. A
    config remembers the fields it was constructed with (:attr:`given`): only those win over the environment
    (``dataclasses.replace`` passes every field, so its result gives them all)."""

    #: take a full checkpoint every this many optimizer steps (and always at attach)
    full_every: int = 100
    #: steps per diff object written to storage (one object amortizes the write latency)
    batch_steps: int = 10
    #: bytes of captured-but-not-yet-durable state allowed in memory; the training thread waits beyond it
    max_pending_bytes: int = 1 * _GiB
    #: capture torch / CUDA / Python / numpy RNG states with every step
    capture_rng: bool = True
    #: attempts per storage write at least, whatever ``write_timeout`` says
    write_retries: int = 3
    #: seconds a failing storage write is retried (exponential backoff, 0.05 s doubling up to 5 s) before the
    #: writer reports an error: a storage outage shorter than this costs time (the training thread waits once
    #: ``max_pending_bytes`` is held), never data
    write_timeout: float = 300.0
    #: runtime="ray": bytes each node's PersistenceWorker may hold in the object store (durable objects are
    #: released oldest first beyond it; the newest full is kept). Capped, with a warning, at 60% of the node's
    #: object store: a budget the object store cannot hold makes Ray spill held chunks to disk and read them back
    #: (spilling costs more CPU per step than all of ray_ckpt's own work)
    memory_budget: int = 2 * _GiB
    #: keep only the chains of the newest this-many durable full checkpoints of the current timeline (older fulls
    #: and their diffs, and abandoned branches, are deleted: by the coordinator from storage and memory with
    #: runtime="ray", by the writer thread after each full with runtime="local"). The default, 2, keeps every
    #: step from the second-newest full on (a restore that falls back past a damaged newest full still has a
    #: chain), so storage stays within about two full intervals; 0 keeps everything
    keep_fulls: int = 2
    #: runtime="ray": the longest a captured step waits in the training process before it is handed to the
    #: node's persistence worker (seconds). Steps are handed over ``batch_steps`` at a time or after this
    #: delay, whichever comes first: one actor call per chunk, not per step. A crash of the training process
    #: loses at most that chunk.
    handoff_delay: float = 0.2
    #: runtime="ray", LowDiff: keep a live CPU replica of the training state in the persistence tier (the
    #: state tier): it writes the full checkpoints (the trainer takes none after attach while the replica
    #: keeps up) and restores of the latest step replay (almost) nothing
    replica: bool = True
    #: runtime="ray": the replica may fall this many steps behind the trainer; beyond it the trainer takes
    #: full checkpoints itself until the replica catches up (and a backlog of more chunks than this is dropped
    #: and rebuilt from the lineage)
    max_replica_lag: int = 100
    #: runtime="ray" with a replica: every this many steps the trainer ships a fingerprint of its parameters
    #: (16 elements per tensor) that the replica compares bitwise with its own state; 0 disables
    fingerprint_every: int = 50
    #: runtime="ray": which diffs the durable tier gets (default "auto", below). "all": every step's record is
    #: written, so any step restores from storage alone, even after the whole cluster is lost — the product's
    #: promise, at the price of writing every step (a dense gradient's bytes per step). "fulls": diffs stay in
    #: memory on two nodes (the trainer node's worker and its peer) and only full checkpoints are written; a diff is
    #: written only under memory pressure, on flush/close, or when its second copy is lost. Restorable: any step the
    #: memory tier still holds, and from storage the fulls (plus whatever was flushed). Losing both nodes loses the
    #: steps since the last durable full (a gap: logged, shown by ``ray-ckpt ls``, closed by a full).
    #: "amber" (LowDiff with the state tier's replica; ``Checkpointer`` also takes an ``Amber(...)`` for its
    #: settings): as "fulls", and the replica writes Amber increments of its own state after every step to the
    #: durable tier (``tiers/amber/``, see :mod:`ray_ckpt.engine.amber_tier`), so that every step also restores
    #: from storage alone, within the Amber bound, when its exact records are not there.
    #: "auto" (the default): "all" while the storage's measured write bandwidth carries every step's diff with room
    #: to spare (at most :data:`ray_ckpt.policy.budget.DURABLE_SHARE` of it), else "fulls", chosen per chunk by
    #: the run's coordinator from its measurements and stated in ``stats()["policy"]["durable_diffs"]``;
    #: runtime="local" writes every step (no memory tier).
    durable_diffs: str = "auto"
    #: "adaptive": full_every/batch_steps are chosen online from measured costs and recorded failures
    #: (:mod:`ray_ckpt.policy.adaptive`), starting from the values above; explicit full_every/batch_steps (argument
    #: or env) pin those values and the policy only reports what it would choose. "fixed": never change them.
    policy: str = "adaptive"
    #: prior mean time between failures, seconds (the adaptive policy's estimate until failures are seen)
    mtbf_hint: float = 86400.0
    #: share of persistence-tier time (background encode/write) that slows training (shared cores and I/O)
    background_cost: float = 0.25
    #: storage PUT requests per hour the adaptive policy may cause (0: no limit)
    request_budget: float = 0.0
    #: the adaptive policy's longest full-checkpoint interval, steps
    max_full_every: int = 10_000
    #: values given explicitly (keyword, config or env): the adaptive policy does not change them. Set by resolve().
    pinned: frozenset = frozenset()
    #: the share of the step time checkpointing may cost the training process (capture on the training thread,
    #: the process's other CPU, stalls), measured online: while recording every step costs more, the policy
    #: records a full every k steps instead (the lost-work bound becomes k steps; see docs/policy.md,
    #: "Overhead budget"). 0: no budget, every step recorded
    overhead_budget: float = 0.05
    #: pins the recovery granularity instead of letting ``overhead_budget`` choose it. 0 (default): the budget
    #: chooses; 1: every step recorded (as ``overhead_budget=0``, the budget only measures); k >= 2: a full
    #: checkpoint every k steps and no per-step records (the budget's ``every_k`` mode, whatever the measured
    #: cost; lost-work bound k steps). A drain notice still records every step until its deadline. LowDiff
    #: with unsharded state only (other strategies and sharded state always record every step)
    recovery_every: int = 0
    #: runtime="ray": the capture's per-step gradient buffers live in memory shared with the node's persistence
    #: worker, which copies them into the object store itself (the training process makes no second copy; see
    #: ray_ckpt.runtime.shared). Falls back to handing the bytes over where the worker cannot map that memory
    shared_handoff: bool = True

    def __post_init__(self):
        if self.policy not in ("adaptive", "fixed"):
            raise ValueError(f"policy must be 'adaptive' or 'fixed', got {self.policy!r}")
        if not self.mtbf_hint > 0:
            raise ValueError(f"mtbf_hint must be > 0 seconds, got {self.mtbf_hint}")
        if not 0 <= self.background_cost <= 1:
            raise ValueError(f"background_cost must be in [0, 1], got {self.background_cost}")
        if self.request_budget < 0:
            raise ValueError(f"request_budget must be >= 0 (0: no limit), got {self.request_budget}")
        if self.max_full_every < 1:
            raise ValueError(f"max_full_every must be >= 1, got {self.max_full_every}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1 (a full checkpoint every N steps), got {self.full_every}")
        if self.batch_steps < 1:
            raise ValueError(f"batch_steps must be >= 1, got {self.batch_steps}")
        if self.max_pending_bytes < 1 << 20:
            raise ValueError(f"max_pending_bytes must be at least 1 MiB, got {self.max_pending_bytes}")
        if self.keep_fulls < 0:
            raise ValueError(f"keep_fulls must be >= 0 (0 keeps every checkpoint), got {self.keep_fulls}")
        if self.memory_budget < 1 << 20:
            raise ValueError(f"memory_budget must be at least 1 MiB, got {self.memory_budget}")
        if self.write_retries < 1:
            raise ValueError(f"write_retries must be >= 1, got {self.write_retries}")
        if not 0 <= self.write_timeout <= 86400:
            raise ValueError(f"write_timeout must be in [0, 86400] seconds, got {self.write_timeout}")
        if not 0 <= self.handoff_delay <= 60:
            raise ValueError(f"handoff_delay must be in [0, 60] seconds, got {self.handoff_delay}")
        if self.max_replica_lag < 1:
            raise ValueError(f"max_replica_lag must be >= 1 step, got {self.max_replica_lag}")
        if self.durable_diffs not in ("auto", "all", "fulls", "amber"):
            raise ValueError(f"durable_diffs must be 'auto' ('all' while the storage bandwidth allows, else "
                             f"'fulls'), 'all' (every step written), 'fulls' (diffs held in memory "
                             f"on two nodes, fulls written) or 'amber' (as 'fulls', plus Amber increments "
                             f"computed by the state tier's replica; or pass an Amber(...)), got "
                             f"{self.durable_diffs!r}")
        if not (isinstance(self.overhead_budget, (int, float)) and 0 <= self.overhead_budget < 10):
            raise ValueError(f"overhead_budget must be a share of the step time in [0, 10) (0.05: 5 %; 0: no "
                             f"budget), got {self.overhead_budget!r}")
        if not (isinstance(self.recovery_every, int) and self.recovery_every >= 0):
            raise ValueError(f"recovery_every must be an int >= 0 (0: the overhead budget chooses; 1: every step; "
                             f"k >= 2: a full every k steps), got {self.recovery_every!r}")
        if self.fingerprint_every < 0:
            raise ValueError(f"fingerprint_every must be >= 0 (0 disables), got {self.fingerprint_every}")

    def policy_options(self) -> dict:
        """Keyword options of :func:`ray_ckpt.policy.adaptive.make_tuner` (policy="fixed" pins both values)."""
        pinned = {"full_every", "batch_steps"} if self.policy == "fixed" else set(self.pinned)
        return {"pinned": frozenset(pinned), "mtbf_hint": self.mtbf_hint, "background_cost": self.background_cost,
                "request_budget": self.request_budget, "max_full_every": self.max_full_every,
                "memory_budget": float(self.max_pending_bytes)}

    @property
    def given(self) -> frozenset:
        """The fields set explicitly: those passed to the constructor or, on a config from :meth:`resolve`, by a
        keyword override or the config object (not by the environment)."""
        return self.__dict__.get("_given", frozenset())

    @property
    def explicit(self) -> dict:
        """``{field: value}`` of the fields in :attr:`given`: what travels to another process (a run's coordinator
        hands it to the Ray Train workers), whose own environment and defaults fill in the rest. Any thread."""
        return {n: getattr(self, n) for n in sorted(self.given) if n != "pinned"}

    def as_dict(self) -> dict:
        """Every field's value (``pinned`` as a sorted list): the config in force, for reports. Any thread."""
        return {f.name: sorted(self.pinned) if f.name == "pinned" else getattr(self, f.name) for f in fields(self)}

    def with_given(self, given: dict) -> "CheckpointConfig":
        """A copy with the fields of ``given`` set and counted as given (they win wherever the copy is resolved
        again); ``full_every``/``batch_steps`` among them are pinned. The other fields keep their values, wherever
        they came from. Any thread."""
        pinned = self.pinned | ({"full_every", "batch_steps"} & set(given))
        out = dataclasses.replace(self, **given, pinned=frozenset(pinned))
        object.__setattr__(out, "_given", self.given | frozenset(given))
        return out

    @classmethod
    def resolve(cls, config: "CheckpointConfig | None" = None, /, *, base: dict | None = None,
                **overrides) -> "CheckpointConfig":
        """The config in force, field by field, from these sources; each wins over the ones above it:

        1. the default;
        2. the ``RAY_CKPT_<FIELD>`` environment variable, when set and not empty (parsed as the field's type);
        3. ``base``: fields another party gave explicitly (a Ray Train run's, from the ``config`` of its
           ``RayCkptCallback``, which the run's coordinator holds: :func:`ray_ckpt.train.attach`);
        4. the fields ``config`` was constructed with (:attr:`given`; the defaults it merely holds do not count);
        5. the keyword ``overrides`` that are not None.

        ``full_every``/``batch_steps`` set by 2-5 are pinned: the adaptive policy keeps them and only reports what
        it would choose. An override (or a ``base`` key) that names no field raises TypeError naming the closest
        one. Any thread."""
        names = [f.name for f in fields(cls) if f.name != "pinned"]
        unknown = [n for n in (*overrides, *(base or {})) if n not in names]
        if unknown:
            raise TypeError("; ".join(_unknown(n, names) for n in unknown))
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        given = dict(base or {})
        given.update((n, getattr(config, n)) for n in (config.given if config is not None else ()) if n != "pinned")
        given.update((n, v) for n, v in overrides.items() if v is not None)
        kw, pinned = {}, set(config.pinned if config is not None else ())
        for name, default in ((f.name, f.default) for f in fields(cls) if f.name != "pinned"):
            env = f"RAY_CKPT_{name.upper()}"
            kw[name] = given[name] if name in given else _env(env, default, _CASTS.get(type(default), str))
            if name in ("full_every", "batch_steps") and (name in given or os.environ.get(env)):
                pinned.add(name)
        out = cls(**kw, pinned=frozenset(pinned))
        object.__setattr__(out, "_given", frozenset(given))
        return out


def _unknown(name: str, names: list) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; the options are {', '.join(names)}"
    return f"unknown checkpoint option {name!r}{hint}"


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(s)


_bool.__name__ = "bool"

_CASTS = {bool: _bool, int: int, float: float}
