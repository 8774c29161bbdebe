"""The save/restore path against both backends: local files and a real S3 endpoint (moto over HTTP)."""
from __future__ import annotations

import pytest

import ray_ckpt
from ray_ckpt.storage import open_storage
from tests import _training as T


def test_save_restore_bit_exact_on_each_backend(storage_uri):
    uri, options = storage_uri
    model = T.make_model("gpt")
    opt = T.make_optimizer("adamw", model)
    sch = T.make_scheduler(opt, total=30)
    live = {}
    with ray_ckpt.Checkpointer(uri, model, opt, scheduler=sch, full_every=10, batch_steps=4,
                               storage_options=options, recovery_every=1, keep_fulls=0):
        for s in range(23):
            T.train_step("gpt", model, opt, sch, s)
            live[s + 1] = T.snapshot(model, opt, sch)
    for s in (None, 4, 10, 17):
        m = T.make_model("gpt", seed=9)
        o = T.make_optimizer("adamw", m)
        sc = T.make_scheduler(o, total=30)
        got = ray_ckpt.restore(uri, m, o, scheduler=sc, step=s, storage_options=options)
        assert got == (23 if s is None else s)
        T.assert_same(live[got], T.snapshot(m, o, sc), f"{uri} step {got}")


def test_corruption_detected_on_each_backend(storage_uri):
    uri, options = storage_uri
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=10, batch_steps=4, storage_options=options, recovery_every=1, keep_fulls=0):
        for s in range(7):
            T.train_step("mlp", model, opt, None, s)
    store = open_storage(uri, **options)
    key = "objects/g000001-diff-000000000005-000000000007.rckpt"
    data = bytearray(store.read(key))
    data[100] ^= 0x55
    store.write(key, bytes(data))
    m, o = T.make_model("mlp", seed=2), None
    o = T.make_optimizer("adamw", m)
    with pytest.raises(ray_ckpt.CorruptObjectError, match="diff-000000000005-000000000007"):
        ray_ckpt.restore(uri, m, o, storage_options=options)
    assert ray_ckpt.restore(uri, m, o, storage_options=options, fallback=True) == 4
