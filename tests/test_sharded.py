"""Sharded training state (FSDP2 fully_shard, DTensor shards, gloo on CPU): every rank checkpoints its shard;
restores are bitwise at the saved world size, and resharded to 1 and 3 ranks (uneven shards) bitwise against the
gathered state of the uninterrupted 2-rank run; a step one rank lacks is never restored (issue #15)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ray_ckpt.engine import shard_layout, sharded
from ray_ckpt.storage import open_storage
from tests import _fsdp_worker as W, _training as T


def _ls(path, capsys) -> dict:
    from ray_ckpt.cli.main import main as cli_main
    capsys.readouterr()
    assert cli_main(["ls", "--json", path]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.procs
def test_fsdp2_shards_restore_bitwise_at_any_world_size(tmp_path, capsys):
    uri, out = str(tmp_path / "ckpt"), str(tmp_path)
    T.spawn(W.train_and_restore, args=(2, T.free_port(), uri, out), nprocs=2)
    storage = open_storage(uri)
    assert shard_layout.saved_worlds(storage) == [2]
    assert storage.list("shards/w00002/r00001/manifests/")          # rank 1 wrote its own lineage
    listed = _ls(uri, capsys)["sharded"]
    assert [(w["world"], w["latest"], [r["head"] for r in w["ranks"]]) for w in listed] == [(2, W.STEPS, [W.STEPS] * 2)]
    # reshard: 2 -> 1 and 2 -> 3 (TinyGPT's 32-wide tensors split 11/11/10)
    T.spawn(W.restore_at_world, args=(1, T.free_port(), uri, out, [W.STEPS, 6, 13]), nprocs=1)
    T.spawn(W.restore_at_world, args=(3, T.free_port(), uri, out, [W.STEPS, 5]), nprocs=3)

    # rank 1 never committed its newest diff (it crashed first): that step is not recoverable for the group
    lost = tmp_path / "lost"
    shutil.copytree(uri, lost)
    s2 = open_storage(str(lost))
    keys = sorted(k for k in s2.list("shards/w00002/r00001/manifests/") if "-diff-" in k)
    newest = keys[-1]
    s2.delete(newest)
    expect = int(newest.rsplit("-", 2)[-2]) - 1   # the step before the deleted diff's first step
    assert expect < W.STEPS
    assert _ls(str(lost), capsys)["sharded"][0]["latest"] == expect     # ray-ckpt ls says so too
    T.spawn(W.missing_shard, args=(2, T.free_port(), str(lost), out, expect), nprocs=2)

    # rank 1's newest diff object is corrupt (its manifest is there): restores with fallback agree on the step
    # before it on both ranks (Ray Train's attach does this)
    bad = tmp_path / "bad"
    shutil.copytree(uri, bad)
    s3 = open_storage(str(bad))
    obj = newest.replace("manifests/", "objects/").replace(".json", ".rckpt")
    data = bytearray(s3.read(obj))
    data[len(data) // 2] ^= 0xFF
    s3.write(obj, bytes(data))
    T.spawn(W.corrupt_shard_agreement, args=(2, T.free_port(), str(bad), out, expect), nprocs=2)


def test_fsdp2_unsupported_combinations_are_refused_before_writing(tmp_path):
    T.spawn(W.refused, args=(1, T.free_port(), str(tmp_path / "ckpt"), str(tmp_path)), nprocs=1)


def test_reshard_reads_only_the_saved_shards_that_overlap():
    """The chunk arithmetic of resharding matches torch.chunk (Shard(d)'s placement) for every length and world
    size, and a rank reads exactly the saved shards that hold part of its new chunk."""
    import torch
    for length in range(0, 23):
        t = torch.arange(length)
        for world in range(1, 6):
            parts = torch.chunk(t, world) if length else ()
            for rank in range(world):
                a, b = shard_layout.chunk_span(length, world, rank)
                want = parts[rank].tolist() if rank < len(parts) else []
                assert t[a:b].tolist() == want, (length, world, rank)
            for new_world in range(1, 6):
                for rank in range(new_world):
                    a, b = shard_layout.chunk_span(length, new_world, rank)
                    held = shard_layout.saved_ranks(length, world, new_world, rank)
                    covered = [i for r in held for i in range(*shard_layout.chunk_span(length, world, r))]
                    assert set(range(a, b)) <= set(covered), (length, world, new_world, rank)
                    assert all(set(range(*shard_layout.chunk_span(length, world, r))) & set(range(a, b)) for r in held)
    spec = shard_layout.ShardSpec(world=3, rank=0, shapes=((32, 4), (7,)), dims=(0, 0))
    assert sharded._overlapping(spec, 2) == [0]            # [0, 11) and [0, 3) lie in saved shard 0
    spec = shard_layout.ShardSpec(world=3, rank=2, shapes=((32, 4),), dims=(0,))
    assert sharded._overlapping(spec, 2) == [0, 1]         # [22, 32) in shard 1; rank 0 for the loop state


def test_shard_runs_are_found_by_their_actor_names():
    """runtime="ray": Ray Train's callback finds the shard runs of a run (to flush and stop them) by the names of
    their actors; another run whose name starts alike is not one of them."""
    from ray_ckpt.runtime import naming
    names = [naming.coordinator_name(shard_layout.shard_run("exp", 2, 0)),
             naming.replica_name(shard_layout.shard_run("exp", 2, 1)),
             naming.worker_name(shard_layout.shard_run("exp", 2, 1), "node1"), naming.coordinator_name("exp"),
             naming.coordinator_name(shard_layout.shard_run("exp2", 2, 0))]
    assert naming.shard_runs("exp", names) == [shard_layout.shard_run("exp", 2, r) for r in range(2)]
    assert shard_layout.shard_run(None, 2, 0) is None   # unnamed: the Checkpointer names it after the root


def test_shard_run_names_lead_to_their_job_and_lineage(tmp_path):
    """runtime="ray": a shard run's name says its job (whose hosts serve it) and its lineage's storage below the
    job's root, so a restarted host reopens a lineage from its name alone; an unnamed job's shard runs are named
    after the root's default run."""
    import pickle

    from ray_ckpt.runtime import lineages, naming
    from ray_ckpt.runtime.trainer.client import shard_lineage_run
    from ray_ckpt.storage import open_storage
    root = open_storage(str(tmp_path))
    run = shard_layout.shard_run("exp", 3, 2)
    assert lineages.is_shard_run(run) and not lineages.is_shard_run("exp")
    assert lineages.job_of(run) == "exp" and lineages.job_of("exp") == "exp"
    assert lineages.shard_of(run) == (3, 2)
    assert lineages.shard_prefix(run) == shard_layout.shard_prefix(3, 2)
    view = shard_layout.shard_storage(root, 3, 2)
    assert lineages.root_storage(view, run) is root
    assert lineages.lineage_storage(root, run).describe() == view.describe()
    with pytest.raises(ValueError, match="must be its view"):
        lineages.root_storage(shard_layout.shard_storage(root, 3, 1), run)
    with pytest.raises(ValueError, match="not the name of a shard run"):
        lineages.shard_of("exp")
    assert shard_lineage_run(root, None, 2, 1) == shard_layout.shard_run(naming.default_run_name(root.describe()), 2, 1)
    assert shard_lineage_run(root, "exp", 2, 1) == shard_layout.shard_run("exp", 2, 1)
    # the job's hosts, and none of another job whose name starts alike
    names = [lineages.coordinator_host_name("exp"), lineages.worker_host_name("exp", "n1"),
             lineages.replica_host_name("exp", "n1"), lineages.coordinator_host_name("exp2"),
             naming.coordinator_name("exp")]
    assert lineages.host_names("exp", names) == sorted(names[:3])
    handle = pickle.loads(pickle.dumps(lineages.LineageHandle("host", run)))
    assert (handle.host, handle.run) == ("host", run)


def test_attach_refuses_an_unknown_sharded_runtime_before_creating_anything():
    from ray_ckpt.integrations.train_session import attach
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sharded_runtime must be 'ray' or 'local'"):
        attach(model, opt, sharded_runtime="threads")   # outside Ray Train: refused before its context is read


def test_cli_lease_of_a_sharded_root_lists_every_rank_lineage(tmp_path, capsys):
    """`ray-ckpt lease` on a sharded root shows the lease of each rank lineage of each saved world size (a job
    with runtime="ray" holds one per shard run), and --release frees them all."""
    from ray_ckpt.cli.main import main as cli_main
    from ray_ckpt.engine.lease import Lease, read_lease
    from ray_ckpt.storage import open_storage
    root = open_storage(str(tmp_path))
    spec = shard_layout.ShardSpec(world=2, rank=0, shapes=((4,),), dims=(0,))
    shard_layout.mark_world(root, spec)
    Lease(shard_layout.shard_storage(root, 2, 0), run=shard_layout.shard_run("exp", 2, 0)).acquire()
    capsys.readouterr()
    assert cli_main(["lease", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "world 2 rank 0: held by" in text and "exp:shard-w00002-r00000" in text, text
    assert "world 2 rank 1: no writer" in text, text
    assert cli_main(["lease", str(tmp_path), "--json", "--release"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(s["world"], s["rank"], s["lease"] is not None) for s in got["shards"]] == [(2, 0, True), (2, 1, False)]
    assert got["lease"] is None and read_lease(shard_layout.shard_storage(root, 2, 0)) is None


def test_lineage_host_routes_opens_and_answers_for_absent_lineages():
    """A job's host routes each call to the lineage it names: methods that may open a lineage open it (from its
    name: a restarted host), others answer "nothing here" or raise UnknownLineage (a ValueError); lineages of
    another job, or names that are not shard runs, are refused."""
    from ray_ckpt.runtime import lineages

    class Lin:
        def __init__(self, run):
            self.run, self.calls = run, []

        def submit(self, x, y=0):
            self.calls.append((x, y))
            return len(self.calls)

    class Host(lineages.LineageHost):
        OPENING = frozenset({"submit"})
        ABSENT = {"inventory": list}

        def __init__(self):
            self._host_init("exp")

        def _open(self, run):
            return Lin(run)

    h = Host()
    r0, r1 = shard_layout.shard_run("exp", 2, 0), shard_layout.shard_run("exp", 2, 1)
    assert h.lineage_call(r0, "submit", (5,), {"y": 1}) == 1 and h.lineage_call(r0, "submit", (6,)) == 2
    assert h.lineages() == [r0] and h._lineages[r0].calls == [(5, 1), (6, 0)]
    assert h.lineage_call(r1, "inventory") == [] and h.lineages() == [r0]    # answered, not opened
    with pytest.raises(lineages.UnknownLineage):
        h.lineage_call(r1, "calls")
    with pytest.raises(lineages.UnknownLineage, match="not of job"):
        h.lineage_call(shard_layout.shard_run("exp2", 2, 0), "submit", (1,))
    with pytest.raises(ValueError, match="not the name of a shard run"):
        h.lineage_call("exp:shard-x", "submit", (1,))
    assert h.drop_lineage(r0) and h.lineages() == []
