"""The control plane against the width of a job: the real coordinator actor driven by simulated nodes.

A node of a ray_ckpt job talks to the run's coordinator through its persistence worker's report thread (one
``update`` call per report interval carrying, in order, what the worker did: ``held`` for every chunk it holds —
its own ranks' chunks as origin, its ring predecessor's as their peer copy — ``durable`` for every object it
committed (one per ``batch_steps`` steps of a rank, and each full), ``release`` when its memory budget let
durable chunks go, ``started`` once), and through each training process's sender, which polls ``control`` every
``_CONTROL_S`` (0.5 s). :class:`SimJob` emits exactly these messages for ``nodes x ranks`` training processes
stepping at ``steps_per_s`` (a chunk every ``chunk_steps`` steps, as the sender's ``handoff_delay`` makes
them), deterministically from a clock; :class:`NodeSim` actors (a few processes, each simulating many nodes)
play it in real time against the real :class:`~ray_ckpt.runtime.coordinator.Coordinator` class, in a real actor
(:class:`SimCoordinator`: the class itself plus its simulated nodes counted as alive), while the driver measures:

* the coordinator's CPU (user + system time of the actor's process, ``/proc/<pid>/stat``) and memory (RSS);
* the latency of ``control`` (as a training process sees it) and of a restore ``plan``;
* the lag of the coordinator's view: from a message's creation on a node to the answer of the call carrying it;
* the rate the simulated nodes achieved (a row whose generator fell short says so).

Workloads: ``ranks`` — every rank checkpoints its own lineage through its node's worker to the one coordinator
(sharded state with one coordinator per job; each rank's lineage is a generation of its own here, on its own
step range, since the coordinator keeps one lineage per run); ``ddp`` — what a data-parallel job sends today:
world rank 0's chunks, held on its node and on the next one, every node's worker started.

Modes: ``legacy`` — the first report path (one call per node every 50 ms, a tuple per message, manifests as
JSON the coordinator parses); ``before`` — manifests as objects, :func:`ray_ckpt.runtime.worker.pack_reports`
and the interval the coordinator answers (:meth:`~ray_ckpt.runtime.coordinator.Coordinator.report_interval`,
``REPORT_CALLS_PER_S`` calls a second in all), an object ref in every ``held`` report and a ``control`` call per
rank every 0.5 s; ``after`` — what nodes send now: ``held`` reports without object refs (a restore plan asks
the holders: :meth:`NodeSim.holder_refs` answers for the simulated nodes, one call per process) and, in the
every-rank workload, one ``control_many`` call per node every ``CONTROL_RELAY_S`` for all its ranks (the
worker host's relay; a data-parallel job's rank 0 still asks ``control`` itself), and no update call while the
node's last one is unanswered (its messages go in the next); a first incarnation's ``started`` says so (the
coordinator then re-reads no storage listing for it).

Runs on a private local Ray through :func:`benchmarks.harness.private_ray`. Writes ``scale.json``/``.md``/``.png``
(``--quick``: ``scale_quick.*``) to ``--out``.

    .venv/bin/python -m benchmarks.scale [--quick] [--nodes 8,32,128,512] [--seconds 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid

from benchmarks import harness, report

from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key
from ray_ckpt.runtime import worker as _worker
from ray_ckpt.runtime.coordinator import REPORT_CALLS_PER_S, Coordinator
from ray_ckpt.config import CheckpointConfig
from ray_ckpt.runtime.worker import CONTROL_RELAY_S

STEP_BASE = 10 ** 8          #: the step range of each rank's lineage (rank stream s: steps from s * STEP_BASE)
CONTROL_S = 0.5              #: the sender's control poll (runtime/trainer/sink.py _CONTROL_S)
BEFORE_INTERVAL_S = 0.05     #: the report interval of a worker before (runtime/report_channel.py REPORT_INTERVAL_S)
#: the report paths the simulated nodes can play (see the module docstring)
MODES = ("legacy", "before", "after")


def node_ids(n: int, tag: str = "") -> list[str]:
    """``n`` simulated node ids shaped like Ray's (56 hex digits), sorted as Ray's ring order sorts them."""
    return sorted(f"{tag}{i:08x}".ljust(56, "5") for i in range(n))


def _manifest(kind: str, gen: int, first: int, last: int) -> Manifest:
    name = full_name(gen, last) if kind == "full" else diff_name(gen, first, last)
    return Manifest(kind=kind, generation=gen, first_step=first, last_step=last, object=object_key(name),
                    nbytes=1 << 20, crc32=0, strategy="lowdiff")


class SimJob:
    """The reports of ``nodes x ranks`` training processes and their nodes' workers, from a clock.

    Rank stream ``s`` trains on node ``nodes[s // ranks]``; its chunks are held there (origin) and on the next node
    in ring order (the peer copy); its commits are one diff object per ``batch_steps`` steps (the worker lays a
    batch's chunks end to end) and a full every ``full_every`` steps; each node keeps the ``hold_chunks`` newest
    chunks of each stream and releases older durable ones (what its memory budget does in a steady state).
    ``workload="ddp"``: one stream (world rank 0), every node started. Deterministic: :meth:`emit` returns the
    ``(node, message)`` pairs of one chunk. ``refs``: what stands for the object refs (a cycle of them;
    ``["tagged"]``: the string ``"<node>:<name>"``). ``manifest_objects``: manifests travel as objects, as the
    worker sends them (else as JSON bytes, as at first). ``held_refs=False``: ``held`` reports carry None, as
    the worker sends them now (a plan asks the holders: :meth:`ref_of`). ``started_fresh``: each worker's
    ``started`` says it is a first incarnation, as workers say now."""

    def __init__(self, nodes: list[str], ranks: int, *, workload: str = "ranks", chunk_steps: int = 2,
                 batch_steps: int = 10, full_every: int = 100, hold_chunks: int = 20, refs=(None,),
                 manifest_objects: bool = False, held_refs: bool = True, started_fresh: bool = False):
        if workload not in ("ranks", "ddp"):
            raise ValueError(f"workload must be 'ranks' or 'ddp', got {workload!r}")
        self.nodes, self.ranks, self.workload = list(nodes), ranks, workload
        self.chunk_steps, self.batch_steps, self.full_every = chunk_steps, batch_steps, full_every
        self.hold_chunks = hold_chunks
        self.refs, self._ref_i = list(refs), 0
        self.held_refs = held_refs
        self.started_fresh = started_fresh
        self._wire = (lambda m: m) if manifest_objects else (lambda m: m.to_json())
        n_streams = len(nodes) * ranks if workload == "ranks" else 1
        self.streams = list(range(n_streams))
        self.step = {s: 0 for s in self.streams}            # last step emitted (relative to the stream's base)
        self.pending: dict[int, list[Manifest]] = {s: [] for s in self.streams}   # chunks since the last commit
        self.held: dict[int, list[Manifest]] = {s: [] for s in self.streams}      # held chunks, oldest first
        self.durable_names: set[str] = set()
        self.holders: dict[str, set[str]] = {}               # every object name -> nodes holding it
        self.manifests: dict[str, Manifest] = {}
        self._index = {n: i for i, n in enumerate(self.nodes)}

    # -- topology ------------------------------------------------------------------------------------------
    def generation(self, s: int) -> int:
        return 1 + s

    def base(self, s: int) -> int:
        return s * STEP_BASE

    def origin(self, s: int) -> str:
        return self.nodes[s // self.ranks] if self.workload == "ranks" else self.nodes[0]

    def peer(self, s: int) -> str | None:
        if len(self.nodes) < 2:
            return None
        i = self._index[self.origin(s)]
        return self.nodes[(i + 1) % len(self.nodes)]

    def ref_of(self, node: str, name: str):
        """The object ref ``node`` holds for ``name`` (None when it holds none): what its worker answers a plan
        (:meth:`ray_ckpt.runtime.worker.PersistenceWorker.holder_refs`)."""
        if node not in self.holders.get(name, ()):
            return None
        return f"{node}:{name}" if self.refs == ["tagged"] else self.refs[hash(name) % len(self.refs)]

    def control_request(self, node: str, job: str = "sim") -> list:
        """The ``control_many`` request of ``node``'s worker host for its ranks (every-rank workload): one
        ``(run, generation, trainer reports)`` per rank stream of the node."""
        world = len(self.nodes) * self.ranks
        return [(f"{job}:shard-w{world:05d}-r{s:05d}", self.generation(s), [])
                for s in self.streams if self.origin(s) == node]

    def _ref(self, node: str, name: str):
        if not self.held_refs:
            return None
        if self.refs == ["tagged"]:   # tests: which node's copy a plan reads
            return f"{node}:{name}"
        r = self.refs[self._ref_i % len(self.refs)]
        self._ref_i += 1
        return r

    # -- messages ----------------------------------------------------------------------------------------------
    def start(self) -> list[tuple[str, tuple]]:
        """Every worker's ``started``, then each stream's attach full (held, replicated, durable)."""
        out = [(n, ("started", n, True) if self.started_fresh else ("started", n)) for n in self.nodes]
        for s in self.streams:
            out += self._hold(s, _manifest("full", self.generation(s), self.base(s), self.base(s)))
            out += self._commit(s, _manifest("full", self.generation(s), self.base(s), self.base(s)), [])
        return out

    def _hold(self, s: int, m: Manifest) -> list[tuple[str, tuple]]:
        mj, out = self._wire(m), []
        self.manifests[m.name] = m
        for node in (self.origin(s), self.peer(s)):
            if node is not None:
                out.append((node, ("held", mj, self._ref(node, m.name), self.origin(s))))
                self.holders.setdefault(m.name, set()).add(node)
        self.held[s].append(m)
        return out

    def _commit(self, s: int, m: Manifest, covers: list[Manifest]) -> list[tuple[str, tuple]]:
        self.manifests[m.name] = m
        self.durable_names.add(m.name)
        self.durable_names.update(c.name for c in covers)
        self.holders.setdefault(m.name, set())
        return [(self.origin(s), ("durable", self._wire(m), [c.name for c in covers] or [m.name]))]

    def emit(self, s: int) -> list[tuple[str, tuple]]:
        """The next chunk of stream ``s``: its ``held`` reports, a commit when a batch is complete, a full on the
        schedule, and the releases of chunks beyond the nodes' budget."""
        gen, base = self.generation(s), self.base(s)
        first = self.step[s] + 1
        last = self.step[s] + self.chunk_steps
        self.step[s] = last
        m = _manifest("diff", gen, base + first, base + last)
        out = self._hold(s, m)
        self.pending[s].append(m)
        if sum(c.last_step - c.first_step + 1 for c in self.pending[s]) >= self.batch_steps:
            batch = self.pending[s]
            self.pending[s] = []
            merged = _manifest("diff", gen, batch[0].first_step, batch[-1].last_step) if len(batch) > 1 else batch[0]
            out += self._commit(s, merged, batch)
        if last // self.full_every > (last - self.chunk_steps) // self.full_every:
            full = _manifest("full", gen, base + last, base + last)
            out += self._hold(s, full)
            out += self._commit(s, full, [])
        held = self.held[s]
        releases: dict[str, list[str]] = {}
        while len(held) > self.hold_chunks and held[0].name in self.durable_names:
            old = held.pop(0)
            for node in sorted(self.holders.get(old.name, ())):
                releases.setdefault(node, []).append(old.name)
            self.holders[old.name] = set()
        out += [(node, ("release", names)) for node, names in releases.items()]
        return out

    # -- the brute-force figures ---------------------------------------------------------------------------
    def expected(self, alive: set[str] | None = None) -> dict:
        """The coordinator's figures counted from everything emitted: objects known, held on a live node, held on
        two; per stream the steps restorable from memory + storage and from storage alone, as ranges — by
        walking every step (no :class:`Lineage`)."""
        alive = set(self.nodes) if alive is None else alive
        live = {n: {h for h in hs if h in alive} for n, hs in self.holders.items()}
        out = {"objects": len(self.manifests), "memory_objects": sum(1 for hs in live.values() if hs),
               "replicated_objects": sum(1 for hs in live.values() if len(hs) >= 2), "streams": {}}
        for s in self.streams:
            gen = self.generation(s)
            ms = [m for m in self.manifests.values() if m.generation == gen]
            out["streams"][gen] = {
                "anywhere": _walk(ms, lambda m: m.name in self.durable_names or bool(live.get(m.name))),
                "durable": _walk(ms, lambda m: m.name in self.durable_names)}
        return out


def _walk(ms: list[Manifest], usable) -> list[list[int]]:
    """Steps restorable from ``ms`` (those ``usable``), step by step: a step is reached from a full at or before
    it when every step after the full up to it lies in a usable diff. Brute force (O(steps x objects))."""
    ms = [m for m in ms if usable(m)]
    covered = set()
    for m in ms:
        if m.kind == "diff":
            covered.update(range(m.first_step, m.last_step + 1))
    fulls = sorted(m.last_step for m in ms if m.kind == "full")
    top = max((m.last_step for m in ms), default=-1)
    steps = []
    for step in range(min(fulls, default=top + 1), top + 1):
        f = max((x for x in fulls if x <= step), default=None)
        if f is not None and all(t in covered for t in range(f + 1, step + 1)):
            steps.append(step)
    ranges: list[list[int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ranges


#: the simulated run's knobs: a full every 100 steps, 10-step chunks, no retention
_CONFIG = CheckpointConfig(full_every=100, batch_steps=10, keep_fulls=0)


class SimCoordinator(Coordinator):
    """The real coordinator class; its simulated nodes count as alive (:meth:`alive_node_ids`) until
    :meth:`sim_lose` takes one away (what Ray's node list does when a node dies). Coordinator actor (or in-process,
    in tests)."""

    def __init__(self, *args, **kwargs):
        self.sim_nodes: set[str] = set()
        self.sim_players: dict[str, object] = {}   # simulated node -> the NodeSim actor playing it
        self.sim_job: SimJob | None = None          # in-process tests: the job whose nodes answer plans
        super().__init__(*args, **kwargs)

    def holder_refs(self, ask: dict, timeout: float = 5.0) -> dict:
        """The simulated nodes' answers to a plan's ask (as their workers': the refs they hold): the NodeSim
        actors playing them are asked, one call each (in tests, :attr:`sim_job` answers in-process)."""
        real = {n: v for n, v in ask.items() if n not in self.sim_nodes}
        out = super().holder_refs(real, timeout) if real else {}
        if self.sim_job is not None:
            for node, names in ask.items():
                if node in self.sim_nodes:
                    out[node] = {n: [r] for n in names if (r := self.sim_job.ref_of(node, n)) is not None}
            return out
        import ray
        per: dict = {}
        for node, names in ask.items():
            player = self.sim_players.get(node)
            if player is not None:
                per.setdefault(player, {})[node] = names
        calls = [p.holder_refs.remote(sub) for p, sub in per.items()]
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=timeout)
            for c in calls:
                try:
                    out.update(ray.get(c, timeout=0))
                except Exception:  # noqa: BLE001 - a slow player: no memory copies from its nodes
                    pass
        return out

    def sim_play(self, nodes: list[str], player) -> None:
        """``player`` (a NodeSim actor) answers plans for ``nodes``."""
        for n in nodes:
            self.sim_players[n] = player

    def alive_node_ids(self) -> set[str]:
        return super().alive_node_ids() | self.sim_nodes

    def sim_join(self, nodes: list[str]) -> None:
        self.sim_nodes.update(nodes)

    def sim_lose(self, node: str) -> None:
        self.sim_nodes.discard(node)

    def pid(self) -> int:
        return os.getpid()

    def sim_figures(self, generations: list[int]) -> dict:
        """The coordinator's own figures: objects known, held on a live node, held on two, and per generation
        its restorable ranges (memory + storage, storage alone), from its fresh views."""
        st = self.status()
        anywhere, durable = self._lineage(False), self._lineage(True)
        return {"objects": st["objects"], "memory_objects": st["memory_objects"],
                "replicated_objects": st["replicated_objects"],
                "streams": {g: {"anywhere": [list(r) for r in anywhere.reachable_ranges(g)],
                                "durable": [list(r) for r in durable.reachable_ranges(g)]} for g in generations}}


# -- the simulated nodes --------------------------------------------------------------------------------------
class NodeSim:
    """Plays a :class:`SimJob` slice (some nodes and their ranks) in real time against the coordinator: one
    thread, an event heap (chunks at ``steps_per_s / chunk_steps`` per rank, each node's report at its
    interval, each rank's control poll every ``CONTROL_S``). Ray actor."""

    job: SimJob | None = None

    def ready(self) -> bool:
        return True

    def holder_refs(self, ask: dict) -> dict:
        """``{node: {name: [ref]}}``: what the workers of the nodes this actor plays answer a plan (runs beside
        :meth:`run`: the actor has two threads)."""
        job = self.job
        if job is None:
            return {}
        return {node: {n: [r] for n in names if (r := job.ref_of(node, n)) is not None}
                for node, names in ask.items()}

    def run(self, coord, nodes: list[str], ranks: int, workload: str, mode: str, steps_per_s: float,
            seconds: float, warmup: float, chunk_steps: int, stream_offset: int, with_refs: bool = True,
            rank_controls: bool = True, fresh_starts: bool = True) -> dict:
        import ray
        refs = [ray.put(b"x" * 64) for _ in range(64)] if with_refs else [None]
        job = SimJob(nodes, ranks, workload=workload, chunk_steps=chunk_steps, refs=refs,
                     manifest_objects=mode != "legacy", held_refs=mode != "after",
                     started_fresh=mode == "after" and fresh_starts)
        gen_of = {s: job.generation(s) + stream_offset for s in job.streams}
        job.generation = lambda s: gen_of[s]                                 # generations unique across sims
        job.base = lambda s: (gen_of[s] - 1) * STEP_BASE
        self.job = job
        pack = mode != "legacy"
        relay = mode == "after" and workload == "ranks"   # one control_many per node (the worker host's relay)
        buf: dict[str, list] = {n: [] for n in nodes}
        interval = {n: BEFORE_INTERVAL_S for n in nodes}
        for node, msg in job.start():
            buf[node].append((msg, time.monotonic()))
        t0 = time.monotonic()
        t_end, t_meas = t0 + warmup + seconds, t0 + warmup
        chunk_dt = chunk_steps / steps_per_s
        ev: list = []
        for i, s in enumerate(job.streams):
            heapq.heappush(ev, (t0 + chunk_dt * i / len(job.streams), 0, s))
            if not relay:
                heapq.heappush(ev, (t0 + CONTROL_S * i / len(job.streams), 2, s))
        for i, n in enumerate(nodes):
            heapq.heappush(ev, (t0 + BEFORE_INTERVAL_S * i / len(nodes), 1, n))
            if relay:
                heapq.heappush(ev, (t0 + CONTROL_RELAY_S * i / len(nodes), 3, n))
        requests = {n: job.control_request(n) for n in nodes} if relay else {}
        inflight: dict = {}
        controls: dict = {}
        busy: set = set()                 # nodes whose last update call is unanswered
        one_in_flight = mode == "after"   # the worker sends no update while its last one is unanswered
        lags, ctl_lat, calls, msgs_sent, chunks, behind = [], [], 0, 0, 0, 0.0

        def reap(block: bool = False):
            for pool, is_ctl in ((inflight, False), (controls, True)):
                if not pool:
                    continue
                keys = list(pool)[:2000]
                ready, _ = ray.wait(keys, num_returns=len(keys), timeout=None if block else 0)
                now = time.monotonic()
                for r in ready:
                    info = pool.pop(r)
                    if is_ctl:
                        if info >= t_meas:
                            ctl_lat.append(now - info)
                        continue
                    node, oldest = info
                    busy.discard(node)
                    if oldest >= t_meas:
                        lags.append(now - oldest)
                    if pack:
                        interval[node] = _worker.answered_interval(r, interval[node])

        last_reap = 0.0
        while ev:
            t, kind, key = ev[0]
            now = time.monotonic()
            if t > now:
                if now - last_reap > 0.02:
                    reap()
                    last_reap = now
                time.sleep(min(t - now, 0.005))
                continue
            heapq.heappop(ev)
            if t >= t_meas:
                behind = max(behind, now - t)
            if kind == 0:
                if t >= t_end:
                    continue
                for node, msg in job.emit(key):
                    buf[node].append((msg, t))
                chunks += t >= t_meas
                heapq.heappush(ev, (t + chunk_dt, 0, key))
            elif kind == 1:
                msgs = buf[key]
                if msgs and one_in_flight and key in busy:   # the last call unanswered: the messages wait
                    msgs = []
                if msgs:
                    buf[key] = []
                    body = [m for m, _ in msgs]
                    ref = coord.update.remote(key, _worker.pack_reports(body) if pack else body)
                    inflight[ref] = (key, msgs[0][1])
                    busy.add(key)
                    calls += 1
                    msgs_sent += len(body)
                if t < t_end or buf[key]:
                    heapq.heappush(ev, (max(t + interval[key], time.monotonic() if t >= t_end else 0), 1, key))
            elif kind == 2:
                if t >= t_end:
                    continue
                if rank_controls and (workload == "ranks" or key == 0):
                    controls[coord.control.remote(gen_of[key])] = t
                heapq.heappush(ev, (t + CONTROL_S, 2, key))
            else:
                if t >= t_end:
                    continue
                if rank_controls and requests[key]:
                    controls[coord.control_many.remote(requests[key])] = t
                heapq.heappush(ev, (t + CONTROL_RELAY_S, 3, key))
        while inflight or controls:
            reap(block=True)
        return {"calls": calls, "messages": msgs_sent, "chunks": chunks, "lags": lags, "control": ctl_lat,
                "behind_s": behind, "seconds": seconds, "streams": len(job.streams),
                "intervals": sorted(set(round(v, 3) for v in interval.values()))}


# -- the cost model (docs/scale.md) ---------------------------------------------------------------------------
def chunk_steps_of(steps_per_s: float, batch_steps: int = 10, handoff_delay: float = 0.2) -> int:
    """Steps per hand-off: what arrives within ``handoff_delay`` (at least 1, at most ``batch_steps``)."""
    return int(min(batch_steps, max(1, round(steps_per_s * handoff_delay))))


def model_reports(nodes: int, ranks: int, workload: str, mode: str, *, steps_per_s: float, chunk_steps: int,
                  seconds: float, batch_steps: int = 10, full_every: int = 100, hold_chunks: int = 20) -> dict:
    """The cost model's coordinator traffic for a simulated run of ``seconds``: messages, update calls and control
    calls a second (docs/scale.md, "Messages to the coordinator"), counted as :class:`SimJob` defines the job."""
    streams = nodes * ranks if workload == "ranks" else 1
    n = seconds * steps_per_s / chunk_steps                  # chunks per stream
    fulls = seconds * steps_per_s / full_every
    held = 2 * (n + fulls) + 2                               # origin + peer, the attach full too
    durable = seconds * steps_per_s / batch_steps + fulls + 1
    release = 2 * max(0.0, n + fulls + 1 - hold_chunks)
    msgs = streams * (held + durable + release) + nodes
    reporting = nodes if workload == "ranks" else min(nodes, 2)
    per_node_events = (streams / reporting) * (steps_per_s / chunk_steps)   # chunk events per reporting node / s
    interval = BEFORE_INTERVAL_S if mode == "legacy" else max(BEFORE_INTERVAL_S, reporting / REPORT_CALLS_PER_S)
    calls = reporting * min(1 / interval, per_node_events) + (nodes - reporting) / seconds
    if workload == "ranks" and mode == "after":   # one relayed control_many per node
        controls = nodes / CONTROL_RELAY_S
    else:
        controls = (streams if workload == "ranks" else 1) / CONTROL_S
    return {"messages_per_s": msgs / seconds, "calls_per_s": calls, "controls_per_s": controls}


def fit_cpu(rows: list[dict]) -> list[float] | None:
    """Least squares of the coordinator's CPU (core-seconds a second) on its calls, messages and control calls a
    second: ``[per update call, per message, per control call, fixed]`` seconds."""
    import numpy as np
    if len(rows) < 4:
        return None
    a = np.array([[r["calls_per_s"], r["messages_per_s"], r["controls_per_s"], 1.0] for r in rows])
    y = np.array([r["coordinator_cpu"] for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [float(c) for c in coef]


def validate(rows: list[dict], fit_nodes: int) -> dict:
    """Model against simulation: each row's measured traffic against :func:`model_reports`, and its CPU against
    the per-call/per-message costs fitted on the rows of at most ``fit_nodes`` nodes (a prediction for the wider
    rows, not a fit of them)."""
    for r in rows:
        m = model_reports(r["nodes"], r["ranks"], r["workload"], r["mode"], steps_per_s=r["steps_per_s"],
                          chunk_steps=r["chunk_steps"], seconds=r["seconds"] + r["warmup"])
        r["model"] = m
        r["model_ratio"] = {k: (r[k] / m[k] if m[k] else None) for k in ("messages_per_s", "calls_per_s")}
    coef = fit_cpu([r for r in rows if r["nodes"] <= fit_nodes and not r["generator_short"]])
    if coef is not None:
        for r in rows:
            pred = sum(c * x for c, x in zip(coef, (r["calls_per_s"], r["messages_per_s"], r["controls_per_s"], 1)))
            r["model_cpu"] = pred
            r["model_ratio"]["coordinator_cpu"] = r["coordinator_cpu"] / pred if pred > 0 else None
    return {"fit_on_nodes_at_most": fit_nodes,
            "cpu_seconds_per": None if coef is None else dict(zip(("update_call", "message", "control_call",
                                                                   "fixed_per_s"), coef))}


S3_PUT_PER_1000 = 0.005      #: S3 Standard, PUT/COPY/POST/LIST, USD per 1,000 requests (aws.amazon.com/s3/pricing)
S3_PUT_PER_PREFIX = 3500     #: PUT/COPY/POST/DELETE per second per partitioned prefix (S3 user guide, performance)
MONTH_S = 30 * 86400


def job_costs(name: str, nodes: int, ranks: int, params: float, steps_per_s: float, *, sharded: bool,
              batch_steps: int = 10, full_every: int = 100, durable_delay: float = 2.0, handoff_delay: float = 0.2,
              diff_bytes_per_param: float = 4.0, full_bytes_per_param: float = 12.0) -> dict:
    """docs/scale.md's formulas for one job: coordinator traffic, object store / network / durable bytes, S3 PUTs
    a second and a month. ``diff_bytes_per_param``: 4 (dense fp32 gradient), 0.08 (top-k 1%: int32 + fp32 at 1%);
    ``full_bytes_per_param``: 12 (fp32 parameters + AdamW moments)."""
    world = nodes * ranks
    lineages = world if sharded else 1
    c = chunk_steps_of(steps_per_s, batch_steps, handoff_delay)
    c_d = min(batch_steps, max(c, steps_per_s * durable_delay))       # steps per durable diff object
    c_l = min(batch_steps, max(1, steps_per_s * 0.2))                  # steps per loop-state object (ranks > 0)
    r, fe = steps_per_s, full_every
    D, S = diff_bytes_per_param * params, full_bytes_per_param * params
    puts_lineage = lineages * (2 * r / c_d + 2 * r / fe)
    puts_loop = 0.0 if sharded else (world - 1) * (2 * r / c_l + 2 * r / fe)
    puts_lease = (lineages / 20.0)                                     # a heartbeat write every ttl/3 = 20 s
    puts = puts_lineage + puts_loop + puts_lease
    reporting_nodes = nodes if sharded else min(nodes, 2)
    msgs = lineages * (2 * r / c + 2 * r / c + r / c_d + 3 * r / fe)   # held x2, release x2, durable, full x3
    return {"job": name, "nodes": nodes, "ranks_per_node": ranks, "params": params, "steps_per_s": r,
            "sharded": sharded, "lineages": lineages, "chunk_steps": c, "durable_object_steps": c_d,
            "coordinator_messages_per_s": msgs,
            # a sharded job's ranks ask their node's worker, whose host asks the coordinator once per relay interval
            "control_calls_per_s": nodes / CONTROL_RELAY_S if sharded else lineages / CONTROL_S,
            "control_calls_per_s_before": lineages / CONTROL_S,
            "update_calls_per_s_before": reporting_nodes / BEFORE_INTERVAL_S,
            "update_calls_per_s_after": min(reporting_nodes / BEFORE_INTERVAL_S, REPORT_CALLS_PER_S),
            "object_store_bytes_per_s_per_origin_node": (D + S / fe) * r / (nodes if sharded else 1),
            "network_bytes_per_s": 2 * (D + S / fe) * r,              # peer copy + the state tier's replica
            "durable_bytes_per_s": (D + S / fe) * r,
            "s3_put_per_s": puts, "s3_put_per_s_lineages": puts_lineage, "s3_put_per_s_rank_loop": puts_loop,
            "s3_put_per_s_lease": puts_lease, "s3_put_per_month": puts * MONTH_S,
            "s3_put_usd_per_month": puts * MONTH_S / 1000 * S3_PUT_PER_1000,
            "share_of_one_prefix_put_limit": puts / S3_PUT_PER_PREFIX}


EXAMPLE_JOBS = [("8x8 1B", 8, 8, 1e9, False), ("32x8 8B", 32, 8, 8e9, False), ("128x8 70B sharded", 128, 8, 70e9, True)]


# -- the driver -----------------------------------------------------------------------------------------------
def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure_one(nodes: int, ranks: int, workload: str, mode: str, *, seconds: float, warmup: float,
                steps_per_s: float, chunk_steps: int, sims: int, tmp: str, with_refs: bool = True,
                rank_controls: bool = True, fresh_starts: bool = True) -> dict:
    """One configuration: a fresh coordinator actor, ``sims`` NodeSim actors sharing the nodes, the probes."""
    import ray
    from ray_ckpt.engine.lease import Lease
    from ray_ckpt.runtime import naming
    from ray_ckpt.storage import open_storage

    run = f"scale-{uuid.uuid4().hex[:8]}"
    storage = open_storage(os.path.join(tmp, run))
    Lease(storage, run=run).acquire()
    coord = ray.remote(SimCoordinator).options(name=naming.coordinator_name(run), namespace=naming.NAMESPACE,
                                               num_cpus=0, max_concurrency=1).remote(run, storage, _CONFIG)
    ids = node_ids(nodes)
    ray.get(coord.sim_join.remote(ids))
    pid = ray.get(coord.pid.remote())
    sim_cls = ray.remote(NodeSim).options(num_cpus=0, max_concurrency=2)
    actors = [sim_cls.remote() for _ in range(sims)]
    ray.get([a.ready.remote() for a in actors], timeout=300)   # started: their clock and the probes' agree
    share = [ids[i::sims] for i in range(sims)] if workload == "ranks" else [ids] + [[] for _ in range(sims - 1)]
    share = [sorted(s) for s in share if s]
    ray.get([coord.sim_play.remote(s, a) for a, s in zip(actors, share)])
    offsets, off = [], 0
    for s in share:
        offsets.append(off)
        off += len(s) * ranks if workload == "ranks" else 1
    cpu0, t0 = _proc_cpu(pid), time.monotonic()
    runs = [a.run.remote(coord, s, ranks, workload, mode, steps_per_s, seconds, warmup, chunk_steps, o, with_refs,
                         rank_controls, fresh_starts)
            for a, s, o in zip(actors, share, offsets)]
    # probes: a restore plan every 2 s and a control call every 0.25 s, as one more training process sees them
    plan_lat, probe_ctl = [], []
    stop = threading.Event()

    def probe():
        k = 0
        while not stop.is_set():
            t = time.monotonic()
            if t - t0 >= warmup:
                if k % 8 == 0:
                    ray.get(coord.plan.remote(None))
                    plan_lat.append(time.monotonic() - t)
                else:
                    ray.get(coord.control.remote(1))
                    probe_ctl.append(time.monotonic() - t)
                k += 1
            stop.wait(0.25)

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    time.sleep(warmup)
    cpu_w, t_w = _proc_cpu(pid), time.monotonic()
    time.sleep(seconds)
    cpu_m, t_m = _proc_cpu(pid), time.monotonic()
    rss = _rss(pid)
    outs = ray.get(runs, timeout=600)
    stop.set()
    th.join(60)
    drain_s = time.monotonic() - t_m
    cpu_drain = _proc_cpu(pid) - cpu_m
    # the CPU the measured window's work cost, wherever the coordinator got to run it (the messages sent in the
    # window are all applied by the end of the drain): robust on a loaded machine, where the share of a core
    # it got during the window says more about the other processes than about it
    # (from the start: the warm-up's messages are counted too, the backlog at any instant never misattributed)
    work_cpu = _proc_cpu(pid) - cpu0
    span = warmup + seconds
    st = ray.get(coord.status.remote())
    for a in actors:
        ray.kill(a)
    ray.kill(coord)
    lags = [x for o in outs for x in o["lags"]]
    ctl = [x for o in outs for x in o["control"]]
    streams = sum(o["streams"] for o in outs)
    target_chunks = streams * steps_per_s / chunk_steps * seconds
    row = {"nodes": nodes, "ranks": ranks, "workload": workload, "mode": mode, "streams": streams,
           "object_refs": with_refs, "rank_controls": rank_controls, "fresh_starts": fresh_starts,
           "seconds": seconds, "warmup": warmup,
           "controls_per_s": rank_controls * ((nodes / CONTROL_RELAY_S) if workload == "ranks" and mode == "after"
                                              else (streams if workload == "ranks" else 1) / CONTROL_S)
           + (1 - 1 / 8) / 0.25, "steps_per_s": steps_per_s, "chunk_steps": chunk_steps,
           "coordinator_cpu": work_cpu / span, "coordinator_cpu_window": (cpu_m - cpu_w) / (t_m - t_w),
           "coordinator_rss_mb": rss / 2 ** 20,
           "calls_per_s": sum(o["calls"] for o in outs) / span,
           "messages_per_s": sum(o["messages"] for o in outs) / span,
           "chunks_per_s": sum(o["chunks"] for o in outs) / seconds,
           "target_chunks_per_s": target_chunks / seconds,
           "generator_behind_s": max(o["behind_s"] for o in outs),
           "control_ms": {"p50": _ms(_pct(ctl, 0.5)), "p99": _ms(_pct(ctl, 0.99)), "n": len(ctl)},
           "probe_control_ms": {"p50": _ms(_pct(probe_ctl, 0.5)), "p99": _ms(_pct(probe_ctl, 0.99))},
           "plan_ms": {"p50": _ms(_pct(plan_lat, 0.5)), "max": _ms(max(plan_lat, default=None)),
                       "n": len(plan_lat)},
           "view_lag_ms": {"p50": _ms(_pct(lags, 0.5)), "p99": _ms(_pct(lags, 0.99)), "n": len(lags)},
           "drain_s": drain_s, "drain_cpu_s": cpu_drain, "objects": st["objects"],
           "report_intervals_s": sorted({v for o in outs for v in o["intervals"]})}
    row["cpu_ms_per_call"] = 1e3 * row["coordinator_cpu"] / max(row["calls_per_s"], 1e-9)
    row["cpu_us_per_message"] = 1e6 * row["coordinator_cpu"] / max(row["messages_per_s"], 1e-9)
    row["saturated"] = bool(row["coordinator_cpu"] > 0.85)
    row["generator_short"] = bool(row["chunks_per_s"] < 0.9 * row["target_chunks_per_s"])
    return row


def _ms(x):
    return None if x is None else round(1e3 * x, 2)


def knee(rows: list[dict], workload: str, mode: str) -> dict:
    """The widest configuration that held (the coordinator's CPU for the window's work below 85% of a core, the
    generator on rate) and the first that did not."""
    rs = sorted((r for r in rows if r["workload"] == workload and r["mode"] == mode and r["object_refs"]
                 and r["rank_controls"] and r.get("fresh_starts", True)), key=lambda r: r["nodes"])
    held = [r["nodes"] for r in rs if not r["saturated"] and not r["generator_short"]]
    failed = [r["nodes"] for r in rs if r["saturated"]]
    return {"holds_up_to_nodes": max(held, default=None), "saturates_at_nodes": min(failed, default=None)}


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Control plane against the job's width — {meta['date']}, {meta['machine']}", "",
             f"{meta['ranks']} ranks per node, {meta['steps_per_s']} steps/s, a chunk every {meta['chunk_steps']} "
             f"steps, {meta['seconds']} s measured per row after {meta['warmup']} s; `{meta['command']}`.", "",
             "| workload | mode | nodes | streams | msgs/s | calls/s | coord CPU % | RSS MB | control p50/p99 ms "
             "| plan p50 ms | view lag p50/p99 ms | on rate |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in result["rows"]:
        c, v = r["control_ms"], r["view_lag_ms"]
        lines.append(f"| {r['workload']} | {r['mode']}{'' if r['object_refs'] else ' (no refs)'}{'' if r['rank_controls'] else ' (no control polls)'}{'' if r.get('fresh_starts', True) else ' (full starts)'} | {r['nodes']} | {r['streams']} | {r['messages_per_s']:,.0f} | "
                     f"{r['calls_per_s']:,.0f} | {100 * r['coordinator_cpu']:.0f} | {r['coordinator_rss_mb']:.0f} | "
                     f"{c['p50']}/{c['p99']} | {r['plan_ms']['p50']} | {v['p50']}/{v['p99']} | "
                     f"{'no' if r['generator_short'] else 'yes'}{' (saturated)' if r['saturated'] else ''} |")
    lines += ["", "Knees: " + "; ".join(f"{k}: {v}" for k, v in result["knees"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    rows = result["rows"]
    fig, ax = report.pyplot().subplots(1, 3, figsize=(13, 3.6))
    def kind(r):
        return r["workload"], r["mode"], r["object_refs"], r["rank_controls"], r.get("fresh_starts", True)

    for (wl, mode, refs, ctl, fresh) in sorted({kind(r) for r in rows}):
        rs = sorted((r for r in rows if kind(r) == (wl, mode, refs, ctl, fresh)), key=lambda r: r["nodes"])
        xs = [r["nodes"] for r in rs]
        label = f"{wl}, {mode}" + ("" if refs else " (no refs)") + ("" if ctl else " (no control polls)") \
            + ("" if fresh else " (full starts)")
        ax[0].plot(xs, [100 * r["coordinator_cpu"] for r in rs], "o-", label=label)
        ax[1].plot(xs, [r["control_ms"]["p99"] or 0 for r in rs], "o-", label=label)
        ax[2].plot(xs, [r["view_lag_ms"]["p99"] or 0 for r in rs], "o-", label=label)
    for a, yl in zip(ax, ("coordinator CPU, % of a core", "control latency p99, ms", "view lag p99, ms")):
        a.set_xscale("log", base=2)
        a.set_xlabel(f"simulated nodes ({result['meta']['ranks']} ranks each)")
        a.set_ylabel(yl)
    ax[1].set_yscale("log")
    ax[2].set_yscale("log")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    report.save_figure(fig, path)


@contextlib.contextmanager
def _private_ray(tmp: str, attempts: int = 3):
    """:func:`benchmarks.harness.private_ray`, tried again when Ray's node does not come up (its raylet gets 30 s:
    on a loaded machine that is sometimes too little)."""
    for attempt in range(attempts):
        try:
            cm = harness.private_ray(os.path.join(tmp, f"ray{attempt}"), num_cpus=2, object_store_mb=256)
            host = cm.__enter__()
        except RuntimeError as e:
            if attempt == attempts - 1:
                raise
            print(f"[scale] Ray did not start ({str(e).splitlines()[0]}); trying again", flush=True)
            continue
        try:
            yield host
        finally:
            cm.__exit__(None, None, None)
        return


def _scaled(seconds: float, nodes: int, floor: float) -> float:
    """``seconds`` up to 32 nodes, shortened in proportion beyond (not below ``floor``)."""
    return max(floor, seconds * min(1.0, 32 / nodes))


def _echo(row: dict) -> None:
    print(f"[scale] {row['workload']} {row['mode']} {row['nodes']} nodes{'' if row['object_refs'] else ' (no refs)'}"
          f"{'' if row['rank_controls'] else ' (no control polls)'}"
          f"{'' if row.get('fresh_starts', True) else ' (full starts)'}: "
          f"{row['messages_per_s']:,.0f} msgs/s in {row['calls_per_s']:,.0f} calls/s, coordinator "
          f"{100 * row['coordinator_cpu']:.0f}% of a core, control p99 {row['control_ms']['p99']} ms, plan "
          f"{row['plan_ms']['p50']} ms, lag p99 {row['view_lag_ms']['p99']} ms"
          f"{' SATURATED' if row['saturated'] else ''}{' (generator short)' if row['generator_short'] else ''}",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 and 16 nodes, 3 s each")
    ap.add_argument("--nodes", default=None, help="simulated node counts (default 8,32,128,512)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--steps-per-s", type=float, default=10.0)
    ap.add_argument("--chunk-steps", type=int, default=2, help="steps per hand-off (handoff_delay x step rate)")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per row (default 8; quick 3)")
    ap.add_argument("--warmup", type=float, default=None)
    ap.add_argument("--sims", type=int, default=2, help="NodeSim processes")
    ap.add_argument("--workloads", default="ranks,ddp")
    ap.add_argument("--modes", default="before,after", help="report paths (legacy,before,after)")
    ap.add_argument("--out", default=harness.RESULTS)
    ap.add_argument("--no-refs-at", default="32,128", help="node counts at which the every-rank workload runs "
                    "once more, before, with None in place of object refs (what the refs cost the coordinator)")
    ap.add_argument("--no-control-at", default="", help="node counts at which the every-rank workload runs once "
                    "more, before, without the ranks' control polls (what they cost the coordinator)")
    ap.add_argument("--full-starts-at", default="", help="node counts at which the every-rank workload runs once "
                    "more, after, with each worker's 'started' not saying it is a first incarnation (what re-reading "
                    "the listing at every node's start costs the coordinator)")
    ap.add_argument("--ddp-nodes", default="", help="node counts of the data-parallel workload (default: --nodes)")
    ap.add_argument("--tag", default="", help="results as scale_<tag>.* (diagnostic runs)")
    ap.add_argument("--model", action="store_true", help="only write the cost model's example jobs "
                    "(scale_model.json)")
    a = ap.parse_args(argv)
    if a.model:
        for j in write_model(a.out)["jobs"]:
            print(f"[scale] {j['job']} at {j['steps_per_s']} steps/s, {j['diff']}: {j['s3_put_per_s']:,.0f} PUT/s "
                  f"(${j['s3_put_usd_per_month']:,.0f}/month), coordinator {j['coordinator_messages_per_s']:,.0f} "
                  f"msgs/s + {j['control_calls_per_s']:,.0f} control/s, network "
                  f"{j['network_bytes_per_s'] / 1e9:,.2f} GB/s", flush=True)
        return 0
    nodes = [int(x) for x in (a.nodes or ("4,16" if a.quick else "8,32,128,512")).split(",") if x.strip()]
    seconds = a.seconds or (3.0 if a.quick else 8.0)
    warmup = a.warmup if a.warmup is not None else (1.0 if a.quick else 3.0)
    if min(nodes) < 2 or a.ranks < 1 or seconds <= 0 or a.steps_per_s <= 0 or a.chunk_steps < 1 or a.sims < 1:
        ap.error("need nodes >= 2, ranks >= 1, seconds > 0, steps-per-s > 0, chunk-steps >= 1, sims >= 1")
    ddp_nodes = [int(x) for x in a.ddp_nodes.split(",") if x.strip()]
    workloads = [w for w in a.workloads.split(",") if w]
    modes = [m for m in a.modes.split(",") if m]
    if not set(workloads) <= {"ranks", "ddp"} or not set(modes) <= set(MODES):
        ap.error("workloads: ranks,ddp; modes: " + ",".join(MODES))
    import ray
    tmp = tempfile.mkdtemp(prefix="ray_ckpt-scale-", dir="/tmp")
    rows = []
    with _private_ray(tmp) as host:
        ray.init(address=host.address, namespace=harness.RAY_NAMESPACE, log_to_driver=False,
                 configure_logging=False)
        try:
            for wl in workloads:
                for n in (ddp_nodes if wl == "ddp" and ddp_nodes else nodes):
                    for mode in modes:
                        # wider rows run shorter (the figures are per message and per call; a saturated
                        # coordinator's backlog is drained after the window, on a loaded 2-core machine)
                        row = measure_one(n, a.ranks, wl, mode, seconds=_scaled(seconds, n, 2.0),
                                          warmup=_scaled(warmup, n, 1.0),
                                          steps_per_s=a.steps_per_s, chunk_steps=a.chunk_steps, sims=a.sims,
                                          tmp=tmp)
                        rows.append(row)
                        _echo(row)
                        with open(os.path.join(tmp, "rows.json"), "w") as f:   # a run cut short keeps its rows
                            json.dump(rows, f, default=str)
            # the diagnostic rows: one mechanism switched off (or back on) at a time, on the every-rank workload
            for at, mode, kw in ((a.no_refs_at, "before", {"with_refs": False}),
                                 (a.no_control_at, "before", {"rank_controls": False}),
                                 (a.full_starts_at, "after", {"fresh_starts": False})):
                for n in [int(x) for x in at.split(",") if x.strip()]:
                    if "ranks" in workloads and mode in modes:
                        row = measure_one(n, a.ranks, "ranks", mode, seconds=_scaled(seconds, n, 2.0),
                                          warmup=_scaled(warmup, n, 1.0), steps_per_s=a.steps_per_s,
                                          chunk_steps=a.chunk_steps, sims=a.sims, tmp=tmp, **kw)
                        rows.append(row)
                        _echo(row)
        finally:
            ray.shutdown()
    meta = {"date": report.now(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "ranks": a.ranks, "steps_per_s": a.steps_per_s,
            "chunk_steps": a.chunk_steps, "seconds": seconds, "warmup": warmup, "sims": a.sims,
            "command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:]),
            "load_avg_after": os.getloadavg()}
    knees = {f"{w}/{m}": knee(rows, w, m) for w in workloads for m in modes}
    fit = validate(rows, fit_nodes=sorted(set(nodes))[min(1, len(set(nodes)) - 1)])
    base = os.path.join(a.out, "scale_quick" if a.quick else "scale" + (f"_{a.tag}" if a.tag else ""))
    report.write_result(base, {"meta": meta, "rows": rows, "knees": knees, "cpu_fit": fit}, markdown, plot)
    return 0


def write_model(out: str) -> dict:
    """The example jobs of docs/scale.md through :func:`job_costs`, at their own step rate and at 10 steps/s, dense
    and top-k 1% diffs: ``scale_model.json``."""
    jobs = []
    for name, n, g, p, sharded in EXAMPLE_JOBS:
        own = {"8x8 1B": 1.0, "32x8 8B": 0.5, "128x8 70B sharded": 0.2}[name]
        for rate in (own, 10.0):
            for diff, dbytes in (("dense fp32", 4.0), ("top-k 1%", 0.08)):
                jobs.append({**job_costs(name, n, g, p, rate, sharded=sharded, diff_bytes_per_param=dbytes),
                             "diff": diff})
    result = {"meta": {"date": report.now(), "s3_put_usd_per_1000": S3_PUT_PER_1000,
                       "s3_put_per_s_per_prefix": S3_PUT_PER_PREFIX, "month_s": MONTH_S}, "jobs": jobs}
    report.write_result(os.path.join(out, "scale_model"), result, echo=False)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
