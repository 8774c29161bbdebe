"""One config object: ``Checkpointer(config=CheckpointConfig(...))``, keyword overrides, the ``RAY_CKPT_*``
environment, the runtime choice, and an attach that releases what it took on every path. No Ray."""
from __future__ import annotations

import threading

import pytest

import ray_ckpt
from ray_ckpt import CheckpointConfig
from ray_ckpt.config import Runtime
from ray_ckpt.engine.attachment import Attachment
from ray_ckpt.engine.loopstate import ATTACHED_ATTR
from ray_ckpt.engine.lease import LEASE_KEY
from ray_ckpt.policy.adaptive import read_report
from tests import _training as T


def _model_opt():
    model = T.make_model("mlp")
    return model, T.make_optimizer("adamw", model)


def _train(ck, model, opt, steps):
    for s in range(steps):
        T.train_step("mlp", model, opt, None, s)


def _fulls(uri) -> list[int]:
    return sorted(int(p.stem.rsplit("-", 1)[1]) for p in (uri / "manifests").iterdir() if "-full-" in p.name)


def _diffs(uri) -> list[tuple[int, int]]:
    return sorted((int(a), int(b)) for a, b in (p.stem.split("-")[2:4] for p in (uri / "manifests").iterdir()
                                                if "-diff-" in p.name))


def _writer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ray_ckpt-writer")]


def test_a_config_object_takes_effect(tmp_path):
    model, opt = _model_opt()
    uri = tmp_path / "c"
    with ray_ckpt.Checkpointer(uri, model, opt, config=CheckpointConfig(full_every=5, batch_steps=5, keep_fulls=0, recovery_every=1)) as ck:
        _train(ck, model, opt, 10)
        stats = ck.stats()
        assert (stats["full_every"], stats["batch_steps"]) == (5, 5)
        assert ck.config.pinned == {"full_every", "batch_steps"}   # given: the adaptive policy keeps them
    assert _fulls(uri) == [0, 5, 10]
    assert _diffs(uri) == [(1, 5), (6, 10)]


def test_a_keyword_override_wins_over_the_config(tmp_path):
    model, opt = _model_opt()
    uri = tmp_path / "c"
    cfg = CheckpointConfig(full_every=5, batch_steps=5, policy="fixed", keep_fulls=0, recovery_every=1)
    with ray_ckpt.Checkpointer(uri, model, opt, config=cfg, full_every=4, batch_steps=None) as ck:
        _train(ck, model, opt, 9)
        assert (ck.config.full_every, ck.config.batch_steps, ck.config.policy) == (4, 5, "fixed")
    assert _fulls(uri) == [0, 4, 8]


def test_precedence_default_env_config_keyword(monkeypatch):
    monkeypatch.setenv("RAY_CKPT_FULL_EVERY", "3")
    monkeypatch.setenv("RAY_CKPT_BATCH_STEPS", "2")
    monkeypatch.setenv("RAY_CKPT_KEEP_FULLS", "")            # empty: not set
    r = CheckpointConfig.resolve()
    assert (r.full_every, r.batch_steps, r.keep_fulls) == (3, 2, 2)      # env over default
    assert r.pinned == {"full_every", "batch_steps"} and r.given == frozenset()
    r = CheckpointConfig.resolve(CheckpointConfig(full_every=7))
    assert (r.full_every, r.batch_steps) == (7, 2)                      # config over env, env for the rest
    r = CheckpointConfig.resolve(CheckpointConfig(full_every=100))
    assert r.full_every == 100                       # set explicitly, although it is the default value
    r = CheckpointConfig.resolve(CheckpointConfig(full_every=7), full_every=9, batch_steps=None)
    assert (r.full_every, r.batch_steps) == (9, 2)                      # keyword over config; None: not given
    assert r.given == {"full_every"}
    monkeypatch.delenv("RAY_CKPT_FULL_EVERY")
    monkeypatch.delenv("RAY_CKPT_BATCH_STEPS")
    assert CheckpointConfig.resolve(CheckpointConfig(keep_fulls=2)).pinned == frozenset()
    assert CheckpointConfig.resolve(CheckpointConfig(batch_steps=4)).pinned == {"batch_steps"}
    # the resolved config resolves to itself (the Checkpointer's config can be passed on)
    r = CheckpointConfig.resolve(CheckpointConfig(batch_steps=4), mtbf_hint=60.0)
    assert CheckpointConfig.resolve(r) == r


def test_a_runs_explicit_fields_sit_between_the_environment_and_the_config(monkeypatch):
    """What a Ray Train worker resolves: its env < the callback's explicit fields (``base``, from the run's
    coordinator) < its own config < its overrides; only explicit fields travel (:attr:`explicit`)."""
    monkeypatch.setenv("RAY_CKPT_KEEP_FULLS", "5")
    monkeypatch.setenv("RAY_CKPT_HANDOFF_DELAY", "0.5")
    run = CheckpointConfig.resolve(CheckpointConfig(keep_fulls=3, overhead_budget=0.02))
    assert run.explicit == {"keep_fulls": 3, "overhead_budget": 0.02}   # the env's handoff_delay does not travel
    r = CheckpointConfig.resolve(CheckpointConfig(overhead_budget=0.1), base=run.explicit, recovery_every=2)
    assert (r.keep_fulls, r.overhead_budget, r.handoff_delay, r.recovery_every) == (3, 0.1, 0.5, 2)
    assert r.given == {"keep_fulls", "overhead_budget", "recovery_every"}
    assert CheckpointConfig.resolve(base={}).keep_fulls == 5
    with pytest.raises(TypeError, match="did you mean 'keep_fulls'"):
        CheckpointConfig.resolve(base={"keep_full": 1})
    # a coordinator adopting a trainer's explicit fields keeps every other value as it was resolved
    adopted = run.with_given({"keep_fulls": 4, "full_every": 7})
    assert (adopted.keep_fulls, adopted.full_every, adopted.overhead_budget) == (4, 7, 0.02)
    assert adopted.given == {"keep_fulls", "full_every", "overhead_budget"} and adopted.pinned == {"full_every"}
    assert adopted.as_dict()["keep_fulls"] == 4 and adopted.as_dict()["pinned"] == ["full_every"]


def test_the_ray_train_callback_takes_the_checkpointers_knobs():
    """``RayCkptCallback(config=..., **overrides)`` resolves as a Checkpointer does (driver side; no Ray call)."""
    from ray_ckpt.train import RayCkptCallback
    cb = RayCkptCallback(config=CheckpointConfig(keep_fulls=3, overhead_budget=0.02), full_every=40, mtbf_hint=60.0)
    assert (cb.config.keep_fulls, cb.config.overhead_budget, cb.config.full_every, cb.config.mtbf_hint) == \
        (3, 0.02, 40, 60.0)
    assert cb.config.explicit == {"full_every": 40, "keep_fulls": 3, "mtbf_hint": 60.0, "overhead_budget": 0.02}
    with pytest.raises(TypeError, match="did you mean 'overhead_budget'"):
        RayCkptCallback(overhead_budgett=0.1)


def test_env_overrides_fields_a_config_leaves_unset_in_a_checkpointer(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_CKPT_FULL_EVERY", "3")
    model, opt = _model_opt()
    with ray_ckpt.Checkpointer(tmp_path / "a", model, opt, config=CheckpointConfig(batch_steps=1, keep_fulls=0, recovery_every=1)) as ck:
        _train(ck, model, opt, 6)
    assert _fulls(tmp_path / "a") == [0, 3, 6]
    model, opt = _model_opt()
    with ray_ckpt.Checkpointer(tmp_path / "b", model, opt, config=CheckpointConfig(full_every=4, keep_fulls=0, recovery_every=1)) as ck:
        _train(ck, model, opt, 6)
    assert _fulls(tmp_path / "b") == [0, 4]


def test_unknown_knobs_and_bad_values_are_refused_before_anything_is_held(tmp_path):
    model, opt = _model_opt()
    with pytest.raises(TypeError, match=r"unknown checkpoint option 'full_evry' \(did you mean 'full_every'\?\)"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, full_evry=5)
    with pytest.raises(TypeError, match="unknown checkpoint option 'colour'; the options are full_every, "):
        ray_ckpt.Checkpointer(tmp_path, model, opt, colour="red")
    with pytest.raises(TypeError, match="'pinned'"):                 # derived, not a knob
        ray_ckpt.Checkpointer(tmp_path, model, opt, pinned=frozenset())
    with pytest.raises(TypeError, match="config must be a CheckpointConfig, got dict"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, config={"full_every": 5})
    with pytest.raises(ValueError, match="full_every must be >= 1"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, config=CheckpointConfig(full_every=2), full_every=0)
    with pytest.raises(ValueError, match="durable_diffs='fulls' needs runtime='ray'"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, config=CheckpointConfig(durable_diffs="fulls"))
    with pytest.raises(ValueError, match="needs runtime='ray'"):
        ray_ckpt.Checkpointer(tmp_path, model, opt, durable_diffs=ray_ckpt.Amber())
    assert getattr(opt, ATTACHED_ATTR, None) is None and not (tmp_path / LEASE_KEY).exists()


def test_a_bad_runtime_says_what_is_accepted(tmp_path):
    model, opt = _model_opt()
    accepted = r"runtime must be 'local' \(.*\) or 'ray' \(.*\), got 'rya'"
    with pytest.raises(ValueError, match=accepted):
        ray_ckpt.Checkpointer(tmp_path, model, opt, runtime="rya")
    with pytest.raises(ValueError, match=accepted):
        ray_ckpt.restore(tmp_path, model, opt, runtime="rya")
    assert Runtime.of("ray") is Runtime.RAY and Runtime.of(Runtime.LOCAL) == "local"
    with ray_ckpt.Checkpointer(tmp_path, model, opt, runtime=Runtime.LOCAL, full_every=2) as ck:
        _train(ck, model, opt, 2)
        assert ck.runtime == "local"
    model2, opt2 = _model_opt()
    assert ray_ckpt.restore(tmp_path, model2, opt2, runtime=Runtime.LOCAL) == 2


def test_the_local_adaptive_policy_is_fed_by_the_commits(tmp_path):
    model, opt = _model_opt()
    uri = tmp_path / "c"
    with ray_ckpt.Checkpointer(uri, model, opt, config=CheckpointConfig(full_every=5, batch_steps=1, keep_fulls=0, recovery_every=1)) as ck:
        _train(ck, model, opt, 10)
        ck.flush()
        report = ck.policy_report()
    assert report["pinned"] == ["batch_steps", "full_every"]
    assert not report["reason"].startswith("defaults until")          # decided from observed commits
    published = read_report(ray_ckpt.api.open_uri(uri))
    assert published is not None and published["pinned"] == ["batch_steps", "full_every"]
    assert _fulls(uri) == [0, 5, 10]                                   # pinned values stay in force
    model, opt = _model_opt()
    with ray_ckpt.Checkpointer(tmp_path / "f", model, opt, policy="fixed") as ck:
        assert ck.policy_report() is None


class _ListFails:
    """A storage whose listing fails: the attach fails after it took the writer lease."""

    def __init__(self, inner):
        self.inner = inner
        self.created: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create(self, key, data):
        self.created.append(key)
        return self.inner.create(key, data)

    def list(self, prefix=""):
        raise OSError("listing failed")


class _Unreadable:
    """Extra state whose ``state_dict`` fails: the attach fails in its first snapshot, after the lease, the writer
    thread and the capture's hooks were taken."""

    def state_dict(self):
        raise RuntimeError("extra state unreadable")

    def load_state_dict(self, d):
        pass


@pytest.mark.parametrize("where", ["lineage", "snapshot"])
def test_an_attach_failing_halfway_releases_everything(tmp_path, where):
    model, opt = _model_opt()
    uri = tmp_path / "c"
    storage = ray_ckpt.api.open_uri(uri)
    threads = _writer_threads()
    # the error's traceback keeps the half-built Checkpointer alive: its __del__ does not do the releasing
    if where == "lineage":
        failing = _ListFails(storage)
        with pytest.raises(OSError, match="listing failed") as failed:
            ray_ckpt.Checkpointer(failing, model, opt)
        assert failing.created == [LEASE_KEY]                 # the lease was taken ...
    else:
        with pytest.raises(RuntimeError, match="extra state unreadable") as failed:
            ray_ckpt.Checkpointer(storage, model, opt, extra_state=_Unreadable())
    assert failed.tb is not None
    assert not storage.exists(LEASE_KEY)                      # ... and released
    assert getattr(opt, ATTACHED_ATTR, None) is None          # no hooks left on the optimizer
    assert _writer_threads() == threads                       # no writer thread left
    with ray_ckpt.Checkpointer(uri, model, opt, full_every=3) as ck:   # same optimizer, same URI: attaches
        _train(ck, model, opt, 3)
    assert _fulls(uri) == [0, 3]
    assert not storage.exists(LEASE_KEY) and getattr(opt, ATTACHED_ATTR, None) is None


def test_a_rank_loop_recorder_failing_halfway_releases_everything(tmp_path):
    from ray_ckpt.engine.rankloop import RankLoopRecorder
    model, opt = _model_opt()
    storage = ray_ckpt.api.open_uri(tmp_path / "c")
    threads = _writer_threads()
    with pytest.raises(RuntimeError, match="extra state unreadable") as failed:
        RankLoopRecorder(storage, 1, model, opt, main_generation=1, start_step=0, extra_state=_Unreadable())
    assert getattr(opt, ATTACHED_ATTR, None) is None and _writer_threads() == threads
    rec = RankLoopRecorder(storage, 1, model, opt, main_generation=1, start_step=0, full_every=4, batch_steps=2)
    _train(rec, model, opt, 4)
    rec.close()
    rec.close()                                               # idempotent
    assert getattr(opt, ATTACHED_ATTR, None) is None and _writer_threads() == threads
    assert rec.step == 4


class _Part:
    """A test double for each part an attachment holds (lease, sink, capture)."""

    failed = False   # (as a sink: see ray_ckpt.engine.sink.Sink.failed)

    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def _done(self, what):
        self.log.append(f"{self.name}.{what}")
        if self.fail:
            raise RuntimeError(f"{self.name} failed")

    def acquire(self, takeover=False):
        self.log.append(f"{self.name}.acquire")

    def release(self):
        self._done("release")

    def close(self, timeout=None):
        self._done(f"close({timeout})")

    def detach(self):
        self._done("detach")

    def flush_pending(self):
        self.log.append(f"{self.name}.flush_pending")


@pytest.mark.parametrize("failing", [None, "sink", "capture"])
def test_an_attachment_releases_newest_first_even_when_a_step_fails(failing):
    log: list[str] = []
    att = Attachment()
    att.take_lease(_Part(log, "lease"))
    att.hold_sink(_Part(log, "sink", fail=failing == "sink"))
    att.hold_capture(_Part(log, "capture", fail=failing == "capture"))
    if failing:
        with pytest.raises(RuntimeError, match=f"{failing} failed"):
            att.close(timeout=7)
    else:
        att.close(timeout=7)
    assert log == ["lease.acquire", "capture.flush_pending", "capture.detach", "sink.close(7)", "lease.release"]
    att.close()
    att.release()
    assert len(log) == 5                                      # released once


def test_an_attachment_keeps_the_error_of_a_failed_attach():
    log: list[str] = []
    att = Attachment()
    with pytest.raises(ValueError, match="bad argument"):
        with att.releasing_on_error():
            att.take_lease(_Part(log, "lease"))
            att.hold_sink(_Part(log, "sink", fail=True))     # its close fails too: logged, not raised
            raise ValueError("bad argument")
    assert log == ["lease.acquire", "sink.close(None)", "lease.release"] and att.closed
