"""RestorePlanner: the recovery plan for a step — the chain of objects to read, in order, and for each the object
references of its live holders (memory tier; none: read it from storage).

The chain starts from the newest full that reaches the step; a chain held wholly in memory is preferred among
equally short ones, and every held object is read from memory. When the state-tier replica is usable and its
state lies in the plan's chain, the plan names the replica's step: the restore then reads only the records after
it. A restore's plan (``replica_first``) then asks the holders only for the references of those records: on a live
cluster every object of the chain has live holders (the trainer's node among them), and asking them for references
the restore does not read was most of a plan's time (see docs/state-tier.md).

Runs in the coordinator actor's thread; no Ray: alive nodes and the holders' references come from callables the
coordinator passes in (``holder_refs`` is the coordinator's own method, which the scale benchmark's subclass
answers for its simulated nodes); tests pass stand-ins.
"""
from __future__ import annotations

from typing import Callable

from ray_ckpt.lineage import NoCheckpointError
from ray_ckpt.runtime.coordination.healing import Healing
from ray_ckpt.runtime.coordination.replicas import ReplicaHealth
from ray_ckpt.runtime.coordination.state import LineageState

#: how long a restore plan waits for the holders' object references (then once more, this long, for objects
#: held only in memory): held reports carry none (see RestorePlanner.refs)
PLAN_REFS_TIMEOUT_S = 5.0
PLAN_REFS_PATIENCE_S = 20.0


class RestorePlanner:
    """Plans restores of one run's lineage. Coordinator actor thread.

    ``alive()`` is the set of alive nodes (asked afresh); ``holder_refs(ask, timeout)`` answers
    ``{node: {name: [ref]}}`` for ``ask`` = ``{node: [names]}``."""

    def __init__(self, state: LineageState, healing: Healing, replica: ReplicaHealth,
                 alive: Callable[[], set], holder_refs: Callable[..., dict]):
        self.state = state
        self.healing = healing
        self.replica = replica
        self.alive = alive
        self.holder_refs = holder_refs

    def plan(self, step: int | None = None, at_or_before: bool = False, replica_first: bool = False) -> dict:
        """The recovery plan for ``step`` (None = latest recoverable; ``at_or_before``: the newest recoverable
        step at or before ``step``): ``{"step", "generation", "objects": [{"manifest", "durable", "refs",
        "holders" (live nodes holding it)}], "replica"?, "refs_after"?}``, or ``{"error": why}``. Dead nodes are
        forgotten (and healed) first; a step not found is looked for again after reading storage.

        ``replica_first`` (a restore that will ask the replica for its state): when the plan names the replica,
        only the objects after the replica's step get their holders' references (``refs_after``: that step; the
        others' ``refs`` are empty). A reader that cannot start from the replica's state asks again without it."""
        state = self.state
        self.healing.forget_dead_nodes()
        if at_or_before and step is not None:
            found = state.lineage().latest_at_or_before(step)
            if found is None:
                state.refresh_durable()
                found = state.lineage().latest_at_or_before(step)
            if found is None:
                return {"error": f"no step at or before {step} is recoverable on the current timeline"}
            step = found
        alive = self.alive()
        try:
            p = self.choose(state.held_lineage(alive), step)
        except NoCheckpointError as err:
            return {"error": str(err)}
        at = self._replica_at(p, alive)
        after = at["step"] if replica_first and at is not None else None
        refs = self.refs([state.entries[m.name] for m in p.objects if after is None or m.last_step > after], alive)
        out = {"step": p.step, "generation": p.generation, "objects": [
            {"manifest": m.to_json(), "durable": state.entries[m.name].durable, "refs": refs.get(m.name, []),
             "holders": sum(1 for node in state.entries[m.name].holders if node in alive)} for m in p.objects]}
        if at is not None:
            out["replica"] = at
        if after is not None:
            out["refs_after"] = after
        return out

    def _replica_at(self, p, alive: set) -> dict | None:
        """``{"step", "node"}`` of the replica when it serves plan ``p`` (usable, its state in ``p``'s chain)."""
        self.replica.known()
        if not self.replica.usable(p.generation, lambda: alive, lambda: self.state.lineage().head()):
            return None
        return self.replica.in_chain(p.full.last_step, p.step)

    def choose(self, memory, step: int | None):
        """The chain to ``step``: over everything held or durable, or over ``memory`` (the objects held on a live
        node) when that chain starts from a full as new as the best chain's (no more records to replay). A newer
        full that is only durable (the replica writes its fulls straight to storage) wins over a longer memory
        chain: one read of a full costs less than replaying the steps between them. Raises
        :class:`NoCheckpointError` when no chain reaches ``step`` (storage read once more first)."""
        try:
            mem_plan = memory.resolve(step)
        except NoCheckpointError:
            mem_plan = None
        try:
            p = self.state.lineage().resolve(step)
        except NoCheckpointError:
            self.state.refresh_durable()
            p = self.state.lineage().resolve(step)
        if (mem_plan is not None and mem_plan.step == p.step and mem_plan.generation == p.generation
                and mem_plan.full.last_step >= p.full.last_step):
            return mem_plan
        return p

    def refs(self, entries: list, alive: set[str]) -> dict:
        """``{name: [ObjectRef, ...]}``: for each of ``entries`` one reference per live holder. ``held`` reports
        carry none (a reference in every report cost the actor Ray's borrower bookkeeping per message, plans are
        rare): the holders are asked, one call per node; a reference that came with the entry (a rebuild's
        inventory, a ``persist`` announcement) is used as it is."""
        out: dict[str, list] = {}
        ask: dict[str, list[str]] = {}
        for e in entries:
            name = e.manifest.name
            for node, refs in e.holders.items():
                if node not in alive:
                    continue
                if refs and refs[0] is not None:
                    out.setdefault(name, []).append(refs[0])
                else:
                    ask.setdefault(node, []).append(name)
        got = self.holder_refs(ask) if ask else {}
        for node, names in ask.items():
            answer = got.get(node) or {}
            for name in names:
                out.setdefault(name, []).extend(answer.get(name, [])[:1])
        # an object held only in memory whose holders did not answer in time (a loaded node): ask those again,
        # longer — storage has no copy of it to fall back to
        late = {node: [n for n in names if n not in out or not out[n]]
                for node, names in ask.items() if node not in got}
        late = {node: names for node, names in late.items()
                if any(not self.state.entries[n].durable for n in names)}
        if late:
            for node, answer in self.holder_refs(late, timeout=PLAN_REFS_PATIENCE_S).items():
                for name, refs in answer.items():
                    out.setdefault(name, []).extend(refs[:1])
        return out
