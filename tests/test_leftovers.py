"""What a test leaves open can be found and closed: every attach of this process not released yet is listed (weakly)
with its owner, and the suite's Ray fixture and per-test check (tests/ray_cluster.py, tests/conftest.py) close them
so that no sender thread outlives its test. runtime="local": no Ray."""
from __future__ import annotations

import gc

import ray_ckpt
from ray_ckpt.engine.attachment import open_attachments
from tests import _training as T
from tests.ray_cluster import close_leftovers


def _checkpointer(uri):
    model = T.make_model("mlp")
    opt = T.make_optimizer("adamw", model)
    ck = ray_ckpt.Checkpointer(uri, model, opt, full_every=5)
    for s in range(3):
        T.train_step("mlp", model, opt, None, s)
    return ck, opt


def test_an_open_checkpointer_is_listed_with_its_owner_and_closed_by_the_harness(tmp_path):
    ck, opt = _checkpointer(tmp_path / "left")
    done, _ = _checkpointer(tmp_path / "closed")
    done.close()
    att = ck._att
    open_now = open_attachments()
    assert att in open_now and done._att not in open_now
    assert att.owner == f"Checkpointer of {ck.uri} (runtime=local)"
    thread = att.sink._thread
    assert thread.is_alive()
    assert close_leftovers([att]) == [att.owner]
    assert att not in open_attachments() and not thread.is_alive()
    assert getattr(opt, "_ray_ckpt_capture", None) is None    # the hooks came off the optimizer
    ck.close()                                       # closing again does nothing


def test_a_checkpointer_the_test_no_longer_references_is_still_found(tmp_path):
    """Dropping the Checkpointer does not stop it: its hooks on the live optimizer keep it (and its writer thread)
    alive, so only the list finds it."""
    ck, opt = _checkpointer(tmp_path / "dropped")
    att, thread = ck._att, ck._att.sink._thread
    del ck
    gc.collect()
    assert att in open_attachments() and thread.is_alive()
    close_leftovers([att])
    assert att.closed and not thread.is_alive() and getattr(opt, "_ray_ckpt_capture", None) is None
