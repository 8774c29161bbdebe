"""Compression hooks on a broken exchange: a peer SIGKILLed or stopped mid-step, a corrupted payload.

Each multi-process test starts 2 gloo processes (torch.multiprocessing, file:// rendezvous) training the MLP of
tests/test_compression.py under DDP with a compression hook on a group with a short timeout. A fault is injected
on rank 1 at a chosen step, from inside its hook (so mid-exchange: the step's first bucket was launched, its
second is the one that breaks); every rank writes what it saw to a JSON file the test reads.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ray_ckpt
from ray_ckpt import compression
from ray_ckpt.compression import CompressionExchangeError, Int8State, TopKState, int8_hook, topk_hook
from ray_ckpt.engine import grad_support as support
from ray_ckpt.integrations import compression as hooks
from ray_ckpt.integrations.grad_exchange import HEADER_BYTES

RATIO = 0.05
BUCKET_CAP_MB = 0.005  # ~1.3k floats: four buckets for the MLP below (after DDP's rebuild at step 1)
FAULT_STEP = 4         # the step whose exchange breaks (0-based; the hook state's backward pass of that step)
FAULT_BUCKET = 1       # rank 1 breaks the exchange of this bucket, after launching bucket 0's
GROUP_TIMEOUT_S = 5    # the training group's timeout: a stopped peer is declared gone after this
SLACK_S = 60           # start-up and a loaded 2-core machine


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _make(hook_name: str, group):
    if hook_name == "topk":
        return TopKState(group, ratio=RATIO, sample_size=256), topk_hook
    return Int8State(group), int8_hook


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _train(rank: int, group, hook_name: str, steps: int, fault=None, ck_uri: str | None = None) -> dict:
    """Train ``steps`` steps; ``fault(rank, step, bucket)`` runs in the hook before the real one. On the error
    from ``backward()``: record it, then do what a careless loop would (``optimizer.step()`` anyway) and record
    that too. Returns what this rank saw."""
    model = _mlp()
    ddp = DDP(model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
    state, real_hook = _make(hook_name, group)
    current = {"step": -1}
    futures: list = []

    def hook(st, bucket):
        if fault is not None:
            fault(rank, current["step"], bucket.index())
        fut = real_hook(st, bucket)
        futures.append(fut)
        return fut

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ck = ray_ckpt.Checkpointer(ck_uri, ddp, opt, full_every=1000, batch_steps=1) if ck_uri else None
    support.clear()
    seen: dict = {"completed": 0, "error": None}
    try:
        for step in range(steps):
            current["step"] = step
            x, y = _batch(step, rank)
            futures.clear()
            t0 = time.monotonic()
            try:
                nn.functional.cross_entropy(ddp(x), y).backward()
            except RuntimeError as e:
                seen.update(error=str(e), error_step=step, error_seconds=time.monotonic() - t0)
                for fut in futures:  # backward() raised at the first failed bucket: let the others settle
                    try:
                        fut.wait()
                    except RuntimeError:
                        pass
                failure = state.failure
                seen["failure"] = None if failure is None else {
                    "type": type(failure).__name__, "rank": failure.rank, "world": failure.world,
                    "backward_pass": failure.backward_pass, "bucket": failure.bucket, "peers": list(failure.peers),
                    "reason": failure.reason}
                taken = []
                for p in model.parameters():
                    try:
                        taken.append(repr(support.take(p)))
                    except CompressionExchangeError as marked:
                        taken.append("failed" if marked is failure else "another error")
                seen["take"] = taken
                if ck is not None:  # the loop goes on anyway: the capture refuses the step
                    try:
                        opt.step()
                        seen["step_anyway"] = "stepped"
                    except CompressionExchangeError as refused:
                        seen["step_anyway"] = "refused" if refused is failure else "another error"
                break
            opt.step()
            opt.zero_grad()
            seen["completed"] = step + 1
    finally:
        if ck is not None:
            ck.close()
            seen["captured_step"] = ck.step
    return seen


def _save(out_dir: str, rank: int, results: dict) -> None:
    tmp = Path(out_dir) / f".rank{rank}.json"
    tmp.write_text(json.dumps(results))
    tmp.replace(Path(out_dir) / f"rank{rank}.json")


def _worker(rank: int, init_file: str, out_dir: str, plan: list) -> None:
    """Run each ``(name, hook, fault, steps)`` of ``plan`` in turn; results to ``out_dir/rank<r>.json``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=SLACK_S))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    results: dict = {}
    original_gather = hooks.gather_bytes
    for name, hook_name, fault_name, steps in plan:
        fault = _FAULTS.get(fault_name)
        sent: dict = {}
        if fault_name in _PAYLOAD_FAULTS:
            hooks.gather_bytes = _corrupting_gather(original_gather, rank, fault_name, sent)
        ck_uri = os.path.join(out_dir, f"ck-{name}") if rank == 0 and fault_name == "flip" else None
        results[name] = _train(rank, group, hook_name, steps, fault=fault, ck_uri=ck_uri)
        if ck_uri is not None:
            m2 = _mlp()
            results[name]["restored_step"] = ray_ckpt.restore(ck_uri, m2, torch.optim.SGD(m2.parameters(), lr=0.05))
        hooks.gather_bytes = original_gather
        _save(out_dir, rank, results)
    os._exit(0)  # no destroy_process_group: a peer may be gone


def _kill_self(rank, step, bucket):
    if rank == 1 and step == FAULT_STEP and bucket == FAULT_BUCKET:
        os.kill(os.getpid(), signal.SIGKILL)


def _stop_self(rank, step, bucket):
    if rank == 1 and step == FAULT_STEP and bucket == FAULT_BUCKET:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: the survivor's exchange times out


_FAULTS = {"kill": _kill_self, "stop": _stop_self}
_PAYLOAD_FAULTS = ("flip", "truncate", "stale", "index", "received")


def _corrupting_gather(original, rank: int, fault: str, sent: dict):
    """The hooks' ``gather_bytes``, breaking bucket ``FAULT_BUCKET``'s exchange at backward pass ``FAULT_STEP``:
    rank 1's payload as every rank receives it (``received``: as rank 0 alone receives it)."""

    def gather(payload, world, group):
        words = payload[:HEADER_BYTES].view(torch.int64)
        backward_pass, bucket = int(words[3]), int(words[4])
        hit = backward_pass == FAULT_STEP and bucket == FAULT_BUCKET
        if rank == 1 and hit and fault == "flip":
            payload = payload.clone()
            payload[HEADER_BYTES + 3] ^= 0x10  # one bit of the first value
        elif rank == 1 and hit and fault == "truncate":  # the first 8 bytes lost, the buffer's tail unwritten
            payload = torch.cat([payload[8:], torch.zeros(8, dtype=torch.uint8)])
        elif rank == 1 and hit and fault == "stale":  # the previous pass's payload of this bucket, resent
            payload = sent[bucket]
        elif rank == 1 and hit and fault == "index":  # a valid-looking payload (checksum redone) with a bad index
            payload = payload.clone()
            payload[-4:].view(torch.int32)[0] = -7
            torch.sum(payload[HEADER_BYTES :].view(torch.int64), dim=0, keepdim=True,
                      out=payload[:HEADER_BYTES].view(torch.int64)[7:])
        sent[bucket] = payload.clone()
        out, fut = original(payload, world, group)
        if rank == 0 and hit and fault == "received":
            def corrupt(f):
                f.value()
                out[1, HEADER_BYTES + 3] ^= 0x10
                return out
            fut = fut.then(corrupt)
        return out, fut

    return gather


def _run_ranks(plan: list, stop_survivor_s: float | None = None) -> tuple[list[dict], list[int | None], float]:
    """Start both ranks on ``plan``; wait for rank 0 (then kill a stopped rank 1). Returns each rank's results,
    exit codes and rank 0's wall time."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "rendezvous"), tmp, plan)) for r in range(2)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        try:
            procs[0].join(SLACK_S + 60)
            elapsed = time.monotonic() - t0
            procs[1].join(5 if stop_survivor_s is None else 0.1)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(10)
        results = []
        for r in range(2):
            path = Path(tmp) / f"rank{r}.json"
            results.append(json.loads(path.read_text()) if path.exists() else {})
        return results, [p.exitcode for p in procs], elapsed


def _assert_failed_at(seen: dict, step: int, *, peers: list[int] | None, rank: int = 0) -> None:
    """This rank stopped at ``step``: no optimizer step past it, the error from backward() names the exchange,
    every parameter is marked failed for the capture."""
    assert seen["completed"] == step, seen
    assert seen["error_step"] == step
    assert "CompressionExchangeError" in seen["error"] and f"backward pass {step}" in seen["error"], seen["error"]
    failure = seen["failure"]
    assert failure["type"] == "CompressionExchangeError"
    assert (failure["rank"], failure["world"], failure["backward_pass"]) == (rank, 2, step)
    assert 0 <= failure["bucket"] < 4  # a peer gone breaks its unfinished exchanges (the first one kept)
    if peers is not None:
        assert failure["peers"] == peers
    assert seen["take"] == ["failed"] * len(seen["take"]), "a support of the broken pass could be captured"


@pytest.mark.procs
@pytest.mark.parametrize("hook_name", ["topk", "int8"])
def test_peer_killed_mid_exchange(hook_name):
    """Rank 1 is SIGKILLed inside its hook at FAULT_STEP: rank 0 raises CompressionExchangeError from backward()
    at that step (the process group's error: the peer is gone), promptly, with no optimizer step past it; its
    capture refuses the step if the loop goes on anyway."""
    (survivor, _), codes, _ = _run_ranks([("kill", hook_name, "kill", FAULT_STEP + 4)])
    assert codes[1] == -signal.SIGKILL and codes[0] == 0
    _assert_failed_at(survivor["kill"], FAULT_STEP, peers=[])
    assert "all_gather failed" in survivor["kill"]["failure"]["reason"]
    assert survivor["kill"]["error_seconds"] < GROUP_TIMEOUT_S + SLACK_S


@pytest.mark.procs
def test_peer_stopped_times_out():
    """Rank 1 stops (SIGSTOP) inside its hook: rank 0's exchange times out after the group's timeout and raises
    the same error at that step."""
    (survivor, _), _, _ = _run_ranks([("stop", "topk", "stop", FAULT_STEP + 4)], stop_survivor_s=0)
    seen = survivor["stop"]
    _assert_failed_at(seen, FAULT_STEP, peers=[])
    assert GROUP_TIMEOUT_S * 0.8 <= seen["error_seconds"] < GROUP_TIMEOUT_S + SLACK_S


@pytest.mark.procs
def test_corrupted_payloads_raise_on_every_rank():
    """Rank 1's payload of one bucket reaches every rank flipped, truncated, stale or with an index out of range:
    both ranks raise at that step naming rank 1, nothing of the step is published for the capture, and a
    checkpointed run keeps the steps before it only. Last, a payload corrupted as rank 0 alone receives it: rank 0
    raises at that step; rank 1, whose exchange was intact, applies that step and fails at the next exchange
    (its peer gone)."""
    steps = FAULT_STEP + 3
    plan = [("flip", "topk", "flip", steps), ("truncate", "topk", "truncate", steps),
            ("stale", "topk", "stale", steps), ("index", "topk", "index", steps),
            ("int8_flip", "int8", "flip", steps), ("int8_stale", "int8", "stale", steps),
            ("received", "topk", "received", steps)]
    results, codes, _ = _run_ranks(plan)
    assert codes == [0, 0]
    reasons = {"flip": "fails its checksum", "truncate": "no valid header", "stale": "backward pass 3, expected 4",
               "index": "outside [0,", "int8_flip": "fails its checksum", "int8_stale": "backward pass 3, expected 4"}
    for name, reason in reasons.items():
        for rank in range(2):
            seen = results[rank][name]
            _assert_failed_at(seen, FAULT_STEP, peers=[1], rank=rank)
            assert seen["failure"]["bucket"] == FAULT_BUCKET
            assert reason in seen["failure"]["reason"], (name, seen["failure"]["reason"])
            assert "rank 1's payload" in seen["failure"]["reason"]
    flip = results[0]["flip"]
    assert flip["step_anyway"] == "refused"
    assert flip["captured_step"] == FAULT_STEP and flip["restored_step"] == FAULT_STEP
    _assert_failed_at(results[0]["received"], FAULT_STEP, peers=[1])
    late = results[1]["received"]
    assert late["completed"] == FAULT_STEP + 1 and late["failure"]["backward_pass"] == FAULT_STEP + 1
    assert "all_gather failed" in late["failure"]["reason"]


def test_failure_marks_block_the_capture_until_replaced():
    """grad_support: a parameter marked failed raises on every take() until the next publish or withdraw."""
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    error = CompressionExchangeError("test", rank=0, world=2, backward_pass=3, bucket=1, peers=(1,))
    support.clear()
    support.publish(q, torch.tensor([1, 2]))
    support.withdraw([p, q], error)
    for _ in range(2):
        with pytest.raises(CompressionExchangeError, match="backward pass 3 \\(bucket 1\\) failed on rank 0 of 2"):
            support.take(p)
    support.publish(p, torch.tensor([0]))
    assert support.take(p).tolist() == [0] and support.take(p) is None
    support.withdraw([q])
    assert support.take(q) is None
    assert compression.CompressionExchangeError is CompressionExchangeError
    assert issubclass(CompressionExchangeError, RuntimeError)
