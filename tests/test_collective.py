"""The collective of rank agreement: a function runs on every rank (or on one), and when any rank's call
raised, every rank raises the same RestoreError naming each failed rank and its error. Without Ray: a world of
one (no process group), then two real gloo ranks on CPU."""
from __future__ import annotations

import json
import traceback

import pytest
import torch.distributed as dist

from ray_ckpt.integrations.agreement import Collective, RestoreError, distributed
from tests import _training as T


def _fail(message):
    raise ValueError(message)


def test_a_world_of_one_needs_no_process_group():
    assert not distributed()
    group = Collective()
    assert (group.rank, group.world) == (0, 1)
    assert group.all_gather("count", lambda: 7) == [7]
    assert group.broadcast("decide", lambda: {"step": 3}) == {"step": 3}
    with pytest.raises(RestoreError, match=r"^rank\(s\) \[0\] could not count: rank 0: ValueError: no disk$"):
        group.all_gather("count", lambda: _fail("no disk"))
    with pytest.raises(RestoreError, match=r"^rank 0 could not decide: ValueError: no lineage$"):
        group.broadcast("decide", lambda: _fail("no lineage"))


def _outcome(call):
    try:
        return {"value": call()}
    except RestoreError as e:
        return {"error": str(e)}


def _worker(rank, world, port, out):
    """Each case in turn, in one process group; every rank writes what each call returned or raised."""
    res = []
    crashed = False
    try:
        T.init_dist(rank, world, port)
        group = Collective()
        res.append((group.rank, group.world))
        res.append(_outcome(lambda: group.all_gather("gather", lambda: rank * 10)))
        res.append(_outcome(lambda: group.all_gather(
            "restore step 4", lambda: _fail(f"corrupt object on rank {rank}") if rank == 1 else rank)))
        res.append(_outcome(lambda: group.all_gather("restore step 4", lambda: _fail(f"bad shard {rank}"))))
        res.append(_outcome(lambda: group.broadcast("resolve", lambda: ("step", 9) if rank == 0 else "not rank 0")))
        res.append(_outcome(lambda: group.broadcast("resolve", lambda: _fail("unreadable manifests"))))
        res.append(_outcome(lambda: group.broadcast("resolve", lambda: _fail(f"rank {rank} failed"), src=1)))
        res.append(_outcome(lambda: group.all_gather("gather", lambda: rank)))   # the group still works
    except Exception:  # noqa: BLE001
        res.append({"crash": traceback.format_exc()})
        crashed = True
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    # a process that exits with gloo's threads alive may abort ("terminate called without an active exception");
    # after a crash the peer may wait in another collective: leave at once
    if dist.is_initialized():
        T.close_dist(together=not crashed)


@pytest.mark.procs
def test_two_gloo_ranks_raise_the_same_error_on_every_rank(tmp_path):
    out = str(tmp_path / "res")
    T.spawn(_worker, args=(2, T.free_port(), out), nprocs=2)
    per_rank = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert not any("crash" in case for r in per_rank for case in r), per_rank
    assert [r[0] for r in per_rank] == [[0, 2], [1, 2]]
    cases = list(zip(*(r[1:] for r in per_rank)))          # per case: (rank 0's outcome, rank 1's outcome)
    ok, one_failed, both_failed, decided, src_failed, other_src_failed, after = cases
    assert ok == ({"value": [0, 10]},) * 2
    # only rank 1's call raised: rank 0 raises too, with the same message naming rank 1 and its error
    assert one_failed[0] == one_failed[1] == {
        "error": "rank(s) [1] could not restore step 4: rank 1: ValueError: corrupt object on rank 1"}
    assert both_failed[0] == both_failed[1] == {
        "error": "rank(s) [0, 1] could not restore step 4: rank 0: ValueError: bad shard 0; "
                 "rank 1: ValueError: bad shard 1"}
    assert decided == ({"value": ["step", 9]},) * 2          # rank 0's value, not rank 1's own call
    assert src_failed[0] == src_failed[1] == {"error": "rank 0 could not resolve: ValueError: unreadable manifests"}
    assert other_src_failed[0] == other_src_failed[1] == {"error": "rank 1 could not resolve: ValueError: rank 1 "
                                                                   "failed"}
    assert after == ({"value": [0, 1]},) * 2
