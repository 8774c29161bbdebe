"""The capture's per-step gradient buffer (one buffer, the container's layout) and the shared memory the Ray
runtime hands it over in: the stored bytes are those of separate tensors, and the worker reads exactly what the
trainer wrote. No Ray."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_ckpt.engine.capture import PackedLayout, PackedPool
from ray_ckpt.format.records import GradEntry, StepRecord, decode_steps, encode_steps
from ray_ckpt.runtime.shared import SharedMemoryUnavailable, resolve
from ray_ckpt.runtime.trainer.arena import SharedArena


def _records(params, steps, pool=None, zero=None):
    out = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
        if zero is not None and step == zero[0]:
            grads[zero[1]].zero_()
        if pool is None:
            out.append(StepRecord(step=step, grads=[GradEntry(tuple(x.shape), x) for x in grads],
                                  hparams=[{"lr": 0.1}], loop={"n": step}))
        else:
            b = pool.take()
            torch._foreach_copy_(b.views, grads)
            rec = StepRecord(step=step, grads=list(b.entries), hparams=[{"lr": 0.1}], loop={"n": step})
            rec.packed = b
            out.append(rec)
    return out


def _joined(bufs) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in bufs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_step_is_stored_as_its_separate_tensors(dtype):
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False)).to(dtype)
    params = list(m.parameters())
    pool = PackedPool(PackedLayout(params))
    packed, separate = _records(params, 3, pool), _records(params, 3)
    assert _joined(encode_steps(packed, max_density=0.0)) == _joined(encode_steps(separate, max_density=0.0))
    assert _joined(encode_steps(packed, max_density=0.5)) == _joined(encode_steps(separate, max_density=0.5))
    for r, s in zip(decode_steps(_joined(encode_steps(packed)), "x"), separate):
        assert all(torch.equal(a.to_dense(), b.values) for a, b in zip(r.grads, s.grads))


def test_a_sparse_gradient_in_a_packed_batch_decodes_exactly():
    """The sparsity test is taken once per batch: a gradient that turns all-zero later in the batch is stored
    dense (bytes), one that is zero in the first record sends the batch down the per-tensor path; both exact."""
    params = list(torch.nn.Linear(6, 4).parameters())
    for zero in ((2, 0), (1, 1)):
        pool = PackedPool(PackedLayout(params))
        packed, separate = _records(params, 3, pool, zero), _records(params, 3, zero=zero)
        got = decode_steps(_joined(encode_steps(packed, max_density=0.5)), "x")
        for r, s in zip(got, separate):
            assert all(torch.equal(a.to_dense(), b.values) for a, b in zip(r.grads, s.grads))


def test_the_worker_reads_the_trainers_shared_memory_and_refuses_a_stale_one():
    arena = SharedArena(1 << 20)
    pool = PackedPool(PackedLayout(list(torch.nn.Linear(9, 3).parameters())), allocate=arena.allocate)
    b = pool.take()
    d = arena.describe(b.array)
    assert d is not None and not b.flat.any()                 # fresh shared memory: zero padding
    b.flat[:] = torch.arange(b.nbytes) % 251
    head, view = resolve([b"head", d])
    assert head == b"head" and np.array_equal(view, b.array) and not view.flags.writeable
    stale = d[:3] + (d[3] + 1,) + d[4:]
    with pytest.raises(SharedMemoryUnavailable):
        resolve([stale])
    pool.give([b])
    assert pool.take() is b                                    # recycled, not allocated again
    arena.close()
    assert arena.allocate(64) is None                          # a closed arena: heap memory from then on
    assert arena.describe(pool.take().array) is None        # (heap memory is not the arena's)
