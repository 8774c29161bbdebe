"""The coordinator's parts (ray_ckpt/runtime/coordination/), each driven without Ray: the cluster's calls are
stand-ins, storage is a local directory. The Ray tests (test_runtime_ray.py, test_scale_sim.py, test_drain.py, ...)
drive them through the real actor."""
from __future__ import annotations

import json

import pytest

from ray_ckpt.engine.lease import LeaseLost
from ray_ckpt.lineage import Manifest, diff_name, full_name, object_key, retention
from ray_ckpt.lineage.layout import POLICY_REPORT_KEY
from ray_ckpt.policy import FixedFrequencyPolicy
from ray_ckpt.runtime.coordination import reporting
from ray_ckpt.runtime.coordination import state as state_mod
from ray_ckpt.runtime.coordination.clock import RunClock
from ray_ckpt.runtime.coordination.cluster import RayCluster
from ray_ckpt.runtime.coordination.collector import GarbageCollector
from ray_ckpt.runtime.coordination.drains import Drains
from ray_ckpt.runtime.coordination.healing import Healing
from ray_ckpt.runtime.coordination.planner import PLAN_REFS_PATIENCE_S, RestorePlanner
from ray_ckpt.runtime.coordination.replicas import ReplicaHealth
from ray_ckpt.runtime.coordination.state import LineageState, RunRef
from ray_ckpt.runtime.coordination.tuning import AdaptiveTuning
from ray_ckpt.storage import open_storage

A, B, C = "a" * 56, "b" * 56, "c" * 56   # node ids


def man(kind: str, first: int, last: int, gen: int = 1) -> Manifest:
    name = full_name(gen, last) if kind == "full" else diff_name(gen, first, last)
    return Manifest(kind=kind, generation=gen, first_step=first, last_step=last, object=object_key(name),
                    nbytes=1, crc32=0, strategy="lowdiff")


def commit(storage, m: Manifest) -> Manifest:
    storage.write(m.object, [b"x"])
    storage.write(m.key, m.to_json())
    return m


class FakeCluster:
    """What the parts ask of the cluster: alive nodes, peers asked to persist a lost node's objects."""

    def __init__(self, alive):
        self.nodes = set(alive)
        self.persisted: list[str] = []

    def alive(self, max_age: float = 0.0) -> set:
        return set(self.nodes)

    def persist_origin(self, lost: str) -> list:
        self.persisted.append(lost)
        return sorted(self.nodes - {lost})


@pytest.fixture
def storage(tmp_path):
    return open_storage(str(tmp_path / "ckpt"))


def _state(storage, cluster) -> LineageState:
    return LineageState(RunRef("r", storage), cluster.alive)


# -- LineageState --------------------------------------------------------------------------------------------------
def test_state_views_count_live_holders_and_forget_what_no_one_holds(storage):
    cluster = FakeCluster({A, B})
    st = _state(storage, cluster)
    st.add(man("full", 0, 0), None, None, True)
    st.add(man("diff", 1, 4), A, ["ref-a"], False, origin=A)
    st.add(man("diff", 1, 4), B, ["ref-b"], False)
    st.add(man("diff", 5, 8), B, ["ref-b2"], False, origin=A)
    assert st.lineage().head() == 8 and st.lineage(durable_only=True).head() == 0
    assert st.view_counts == (2, 1)                      # two held objects, one of them twice
    assert st.unpersisted(cluster.alive()) == {A: [diff_name(1, 1, 4)], B: [diff_name(1, 5, 8)]}
    assert st.known_on(A) and not st.known_on(C)
    cluster.nodes = {A}                                   # B died
    assert st.dead_holders(cluster.alive()) == {B}
    assert st.lineage().head() == 4                       # 5..8 was only on B
    assert st.drop_node(B) == [diff_name(1, 5, 8)]        # forgotten: neither durable nor held
    st.release(A, [diff_name(1, 1, 4)])
    assert list(st.entries) == [full_name(1, 0)]


def test_state_reuses_an_expensive_periodic_view_and_rebuilds_a_fresh_one(storage, monkeypatch):
    st = _state(storage, FakeCluster({A}))
    st.add(man("full", 0, 0), None, None, True)
    monkeypatch.setattr(state_mod, "CHEAP_S", -1.0)      # any view counts as expensive ...
    monkeypatch.setattr(state_mod, "COST_FACTOR", 1e9)   # ... and stays valid
    assert st.lineage(max_age=1.0).head() == 0
    st.add(man("diff", 1, 2), A, ["r"], False)
    assert st.lineage(max_age=1.0).head() == 0            # the periodic caller gets the cached view
    assert st.lineage().head() == 2                       # a plan or an explicit status: fresh


def test_state_reads_storage_and_knows_lazy_floors(storage):
    st = _state(storage, FakeCluster({A}))
    commit(storage, man("full", 0, 0, gen=2))
    st.refresh_durable()
    assert st.entries[full_name(2, 0)].durable and st.last_generation == 2
    assert st.durable_floor(2) is None                    # every diff is written: no floor
    lazy = man("diff", 1, 4, gen=2)
    lazy.info["durable_diffs"] = "fulls"
    st.add(lazy, A, ["r"], False)
    st.add(man("full", 4, 4, gen=2), None, None, True)
    assert st.durable_floor(2) == 4 and st.lazy_holders(2, 4, {A}) == {A}   # the full covers the diff on A
    m = man("diff", 5, 6, gen=2)
    assert st.manifest(m.to_json()) is st.manifest(m.to_json())   # the same bytes are parsed once


# -- Healing -------------------------------------------------------------------------------------------------------
def test_a_hole_past_its_grace_is_a_gap_and_asks_for_a_full(storage, monkeypatch):
    cluster = FakeCluster({A})
    st = _state(storage, cluster)
    h = Healing("r", st, cluster)
    h.gap_watch.grace_s = 0.0
    st.add(man("full", 0, 0), None, None, True)
    st.add(man("diff", 1, 2), A, ["r"], False)
    st.add(man("diff", 5, 6), A, ["r"], False)            # 3..4 held nowhere
    h.check_gaps(force=True)
    assert [(g["first"], g["last"]) for g in h.gap_watch.gaps] == [(3, 4)]
    assert h.take_want_full(1) and not h.take_want_full(1)   # asked once
    assert h.gap_watch.untold(1) == [(3, 4)] and h.gap_watch.untold(1) == []


def test_a_hole_committed_by_a_dead_worker_is_no_gap(storage):
    cluster = FakeCluster({A})
    st = _state(storage, cluster)
    h = Healing("r", st, cluster)
    h.gap_watch.grace_s = 0.0
    st.add(commit(storage, man("full", 0, 0)), None, None, True)
    st.add(man("diff", 5, 6), A, ["r"], False)
    commit(storage, man("diff", 1, 4))                    # committed, its report never sent
    h.check_gaps(force=False)                             # reads storage before declaring
    assert h.gap_watch.gaps == [] and not h.take_want_full(1)


def test_a_restarted_worker_is_healed_unless_a_first_incarnation_on_an_unknown_node(storage):
    cluster = FakeCluster({A, B})
    st = _state(storage, cluster)
    h = Healing("r", st, cluster)
    st.add(man("diff", 1, 2), A, ["r"], False, origin=A)
    st.add(man("diff", 1, 2), B, ["r"], False)
    h.worker_started(C, fresh=True)                       # a new node's first worker: nothing to heal
    assert cluster.persisted == []
    h.worker_started(A, fresh=True)                       # it held chunks: the peers persist them
    assert cluster.persisted == [A] and A not in st.entries[diff_name(1, 1, 2)].holders
    cluster.nodes = {A}
    h.forget_dead_nodes()                                 # B is gone: dropped and healed
    assert cluster.persisted == [A, B] and diff_name(1, 1, 2) not in st.entries


# -- ReplicaHealth -------------------------------------------------------------------------------------------------
def test_the_replica_is_usable_only_healthy_on_a_live_node_and_close_behind():
    restarted = []
    rh = ReplicaHealth("r", max_lag=10, ask=lambda: {"generation": 3, "step": 50, "node": A, "ok": True},
                       restart=lambda: restarted.append(1) or True)
    assert rh.known().step == 50                          # a restarted coordinator asks it
    alive = lambda: {A}  # noqa: E731
    assert rh.usable(3, alive, lambda: 60)
    assert not rh.usable(3, alive, lambda: 61)            # too far behind
    assert not rh.usable(2, alive, lambda: 55)            # another generation
    assert not rh.usable(3, lambda: {B}, lambda: 55)      # its node is gone
    assert rh.in_chain(40, 55) == {"step": 50, "node": A} and rh.in_chain(51, 60) is None
    rh.move_off({B: 0})
    assert restarted == []
    rh.move_off({A: 0})                                   # on a draining node: restarted, not usable meanwhile
    assert restarted == [1] and not rh.usable(3, alive, lambda: 50)
    rh.progress(3, 70, B, ok=True)
    assert rh.status(75) == {"generation": 3, "step": 70, "node": B, "ok": True, "reason": "", "lag": 5}


# -- RestorePlanner ------------------------------------------------------------------------------------------------
def _planner(storage, nodes, answers=None, replica=None):
    cluster = FakeCluster(nodes)
    st = _state(storage, cluster)
    asked = []

    def holder_refs(ask, timeout=5.0):
        asked.append((dict(ask), timeout))
        return {n: {name: [f"{n[:1]}:{name}"] for name in names} for n, names in ask.items()
                if answers is None or n in answers}

    rh = ReplicaHealth("r", 100, ask=lambda: replica, restart=lambda: False)
    return st, RestorePlanner(st, Healing("r", st, cluster), rh, cluster.alive, holder_refs), asked


def test_the_plan_prefers_a_chain_held_in_memory_from_an_equally_new_full(storage):
    st, planner, asked = _planner(storage, {A})
    for m in (man("full", 0, 0), man("diff", 1, 4)):
        st.add(commit(storage, m), None, None, True)
    st.add(man("full", 0, 0), A, [None], False)
    st.add(man("diff", 1, 4), A, [None], False)
    p = planner.plan(4)
    assert p["step"] == 4 and [o["refs"] for o in p["objects"]] == [[f"a:{full_name(1, 0)}"],
                                                                     [f"a:{diff_name(1, 1, 4)}"]]
    assert asked == [({A: [full_name(1, 0), diff_name(1, 1, 4)]}, 5.0)]   # one call per holder node


def test_the_plan_takes_a_newer_durable_full_over_a_longer_memory_chain(storage):
    st, planner, _ = _planner(storage, {A})
    st.add(man("full", 0, 0), A, ["ref0"], False)
    for a in range(1, 9, 2):
        st.add(man("diff", a, a + 1), A, [f"ref{a}"], False)
    st.add(commit(storage, man("full", 6, 6)), None, None, True)   # the replica wrote it straight to storage
    p = planner.plan(8)
    names = [Manifest.from_json(o["manifest"]).name for o in p["objects"]]
    assert names == [full_name(1, 6), diff_name(1, 7, 8)]
    assert p["objects"][0]["durable"] and p["objects"][1]["refs"] == ["ref7"]
    assert "error" in planner.plan(9) and planner.plan(9, at_or_before=True)["step"] == 8


def test_the_plan_asks_silent_holders_again_for_memory_only_objects_and_names_the_replica(storage):
    st, planner, asked = _planner(storage, {A, B}, answers={A}, replica={"generation": 1, "step": 3, "node": A,
                                                                         "ok": True})
    st.add(commit(storage, man("full", 0, 0)), None, None, True)
    st.add(man("diff", 1, 4), B, [None], False)           # only B holds it, and B does not answer
    p = planner.plan(4)
    assert p["objects"][1]["refs"] == [] and [t for _, t in asked] == [5.0, PLAN_REFS_PATIENCE_S]
    assert p["replica"] == {"step": 3, "node": A}


def test_a_restores_plan_asks_the_holders_only_for_the_records_after_the_replicas_state(storage):
    """On a live cluster the trainer's node and its peer hold every object of the chain: a restore that starts from
    the replica's state (``replica_first``) asks them only for the records after it — nothing when it is caught
    up; a plan without it (the replica's rebuild, a fall-back) gets every reference."""
    st, planner, asked = _planner(storage, {A, B}, replica={"generation": 1, "step": 6, "node": B, "ok": True})
    chain = [man("full", 0, 0), man("diff", 1, 4), man("diff", 5, 6), man("diff", 7, 8)]
    for m in chain:
        for node in (A, B):
            st.add(m, node, [None], False)
    p = planner.plan(8, replica_first=True)
    assert p["replica"] == {"step": 6, "node": B} and p["refs_after"] == 6
    assert [len(o["refs"]) for o in p["objects"]] == [0, 0, 0, 2]
    assert [o["holders"] for o in p["objects"]] == [2, 2, 2, 2]   # held on two nodes all the same (not "unsafe")
    assert asked == [({A: [diff_name(1, 7, 8)], B: [diff_name(1, 7, 8)]}, 5.0)]
    planner.replica.progress(1, 8, B, ok=True)                 # caught up: no holder is asked at all
    asked.clear()
    p = planner.plan(None, replica_first=True)
    assert p["step"] == 8 and p["refs_after"] == 8 and asked == []
    assert all(o["refs"] == [] for o in p["objects"])
    p = planner.plan(8)                                        # the whole chain
    assert "refs_after" not in p and [len(o["refs"]) for o in p["objects"]] == [2, 2, 2, 2]
    planner.replica.progress(1, 8, B, ok=False, reason="test")   # a replica that cannot serve: every reference
    p = planner.plan(8, replica_first=True)
    assert "replica" not in p and "refs_after" not in p and [len(o["refs"]) for o in p["objects"]] == [2, 2, 2, 2]


# -- GarbageCollector ----------------------------------------------------------------------------------------------
def test_gc_keeps_the_newest_fulls_chains_and_deletes_a_late_diff_of_collected_steps(storage):
    st = _state(storage, FakeCluster({A}))
    released = []
    gc = GarbageCollector(st, lambda nodes, names: released.append((nodes, names)))
    for f in (0, 10, 20):
        st.add(commit(storage, man("full", f, f)), None, None, True)
    st.add(commit(storage, man("diff", 1, 4)), A, ["r"], True)
    st.add(man("diff", 11, 14), A, ["r"], False)
    deleted = gc.gc(keep_fulls=2)
    assert sorted(deleted) == sorted([full_name(1, 0), diff_name(1, 1, 4)])
    assert not storage.exists(man("full", 0, 0).key) and storage.exists(man("full", 10, 10).key)
    assert released == [([A], [diff_name(1, 1, 4)])] and gc.floor == (1, 10)
    assert retention.read(storage).kept_from == 10
    late = commit(storage, man("diff", 5, 8))              # its write was in flight during GC
    assert gc.collected_already(late) and not storage.exists(late.key)
    assert not gc.collected_already(commit(storage, man("diff", 15, 18)))   # past the kept full
    # a copy of a collected object reported held after GC ran (a peer's copy, a hand-off in flight): stale, so the
    # coordinator lets it go instead of adding it back (a restore of a removed step found it in memory)
    assert gc.stale(man("full", 0, 0)) and gc.stale(man("diff", 5, 8))
    assert not gc.stale(man("full", 10, 10)) and not gc.stale(man("diff", 11, 14))
    assert not gc.stale(man("diff", 1, 4, gen=2))          # another generation: the next GC decides


# -- RunClock and AdaptiveTuning -----------------------------------------------------------------------------------
def test_mtbf_is_the_running_time_less_the_down_times_over_the_failures():
    clock = RunClock(started_at=1000.0)
    assert clock.granularity() is None
    clock.observe_trainer({"steps": 10, "wall_s": 1.0, "granularity": {"mode": "k"}}, now=1010.0)
    assert clock.running_since == 1000.0                  # its steps began a window (10 x 1 s) before
    clock.record_failure({"decision": "RETRY"}, now=1100.0)
    assert clock.granularity(now=1120.0) == {"mode": "k", "mtbf_s": 100.0}   # down 1100..1120 (the attach)
    clock.record_failure({}, now=1200.0)
    assert clock.granularity(now=1200.0)["mtbf_s"] == pytest.approx(180.0 / 2)


def test_tuning_ignores_a_malformed_trainer_report_and_publishes_at_a_failure(storage):
    t = AdaptiveTuning(RunRef("r", storage), 100, 10, started_at=0.0, options={"pinned": frozenset()})
    assert isinstance(t.policy(), FixedFrequencyPolicy)
    t.observe_trainer({"steps": "many"})                  # TypeError inside: ignored
    t.observe_trainer({"steps": 10, "step_s": 0.1, "capture_s": 0.001, "optimizer_s": 0.01,
                       "other_cpu_s": 0.0, "granularity": {"mode": "k"}})
    assert not storage.exists(POLICY_REPORT_KEY) or json.loads(storage.read(POLICY_REPORT_KEY))
    t.observe_failure(50.0)
    assert "full_every" in json.dumps(json.loads(storage.read(POLICY_REPORT_KEY)))


# -- reporting: pacing, metrics, lease -----------------------------------------------------------------------------
def test_the_report_interval_grows_with_the_reporting_nodes_and_forgets_quiet_ones():
    p = reporting.ReportPacing()
    assert p.interval("n0", now=10.0) == reporting.MIN_REPORT_INTERVAL_S
    for i in range(400):
        p.interval(f"n{i}", now=10.0)
    assert p.interval(now=10.5) == pytest.approx(400 / reporting.REPORT_CALLS_PER_S)
    assert p.interval("n0", now=20.0) == reporting.MIN_REPORT_INTERVAL_S   # the others fell silent


def test_metrics_are_computed_after_changes_or_when_quiet_for_long():
    gate, calls = reporting.MetricsGate("r"), []
    status = lambda: calls.append(1) or {}  # noqa: E731
    assert gate.publish(status, now=1.0) and calls == [1]
    assert not gate.publish(status, now=2.0)
    gate.changed()
    assert gate.publish(status, now=3.0)
    assert gate.publish(status, now=3.0 + reporting._METRICS_QUIET_S)
    assert len(calls) == 3


def test_a_lease_taken_over_is_kept_lost_and_not_renewed_again():
    class Lease:
        n = 0

        def renew(self):
            self.n += 1
            raise LeaseLost("job B took run r over")

    keeper = reporting.LeaseKeeper(Lease())
    keeper.renew()
    keeper.renew()
    assert keeper.lost == "job B took run r over" and keeper.lease.n == 1


# -- Drains (the record's continuation is in test_drain.py) --------------------------------------------------------
def test_a_drain_accounts_for_what_the_node_holds_and_settles_once_it_is_gone(storage):
    cluster = FakeCluster({A, B})
    st = _state(storage, cluster)
    st.add(commit(storage, man("full", 0, 0)), None, None, True)
    st.add(man("diff", 1, 4), A, ["r"], False, origin=A)
    st.add(man("diff", 1, 4), B, ["r"], False)
    st.add(man("diff", 5, 8), A, ["r"], False, origin=A)   # on A alone
    forgot = []
    d = Drains(st, cluster.alive, notify=lambda draining: None, move_replica=lambda draining: None,
               forget_dead=lambda: forgot.append(1))
    d.changed({A: 0})
    rec = d.status()[A]
    assert (rec["status"], rec["peer"], rec["unsafe"]) == ("draining", [[1, 4]], [[5, 8]])
    st.add(commit(storage, man("diff", 5, 8)), None, None, True)
    assert d.progress() and d.status()[A]["status"] == "safe"
    cluster.nodes = {B}                                   # the node is gone: B's copy keeps it open
    st.drop_node(A)
    assert d.progress() and forgot == [1] and d.status()[A]["status"] == "node gone"
    st.add(commit(storage, man("diff", 1, 4)), None, None, True)
    assert not d.progress()                               # nothing only a peer holds now: settled
    assert d.status()[A]["settled"] and d.status()[A]["durable"] == [[1, 8]]


# -- RayCluster's node cache (no Ray call: the node list is a stand-in) ---------------------------------------------
def test_the_alive_nodes_are_cached_only_for_callers_that_accept_an_old_answer():
    asks = []
    cluster = RayCluster("r", lambda: asks.append(1) or {A})
    assert cluster.alive(1.0) == {A} and cluster.alive(1.0) == {A} and len(asks) == 1
    cluster.alive()
    assert len(asks) == 2
