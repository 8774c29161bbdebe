"""The persistence worker's memory budget is capped to a share of its node's object store (no Ray started: the
node's capacity is given)."""
from __future__ import annotations

import logging

from ray_ckpt.runtime import worker


def test_memory_budget_is_capped_to_the_share_of_the_object_store(monkeypatch, caplog):
    monkeypatch.setattr(worker, "object_store_capacity", lambda node_id: 200 << 20)
    with caplog.at_level(logging.WARNING, logger="ray_ckpt"):
        got = worker._fit_object_store(2 << 30, "n" * 56)
    # held chunks leave room for the copies pulled for the peer and the replica: a full store makes Ray spill and
    # ask every worker for a garbage collection
    assert got == int((200 << 20) * worker.OBJECT_STORE_SHARE) and worker.OBJECT_STORE_SHARE <= 0.3
    assert "exceeds" in caplog.text and "object_store_memory" in caplog.text


def test_a_budget_inside_the_share_is_kept(monkeypatch, caplog):
    monkeypatch.setattr(worker, "object_store_capacity", lambda node_id: 4 << 30)
    with caplog.at_level(logging.WARNING, logger="ray_ckpt"):
        assert worker._fit_object_store(512 << 20, "n" * 56) == 512 << 20
    assert not caplog.text
    monkeypatch.setattr(worker, "object_store_capacity", lambda node_id: 0)   # unknown: the budget as given
    assert worker._fit_object_store(2 << 30, "n" * 56) == 2 << 30
