"""The Ray sink's sender thread (in the training process) waits for the answers it has asked for instead of
spinning on them: a control ask the coordinator is slow to answer is looked for at the sender's reap cadence.
Spinning on ``ray.wait(timeout=0)`` for the whole of every control round trip cost a Ray Train worker's process
about 20 ms of CPU per 100 ms step (the overhead budget then recorded a full every k steps instead of every step)."""
from __future__ import annotations

import time
import uuid

import pytest
import ray
import torch

import ray_ckpt


@ray.remote(num_cpus=0)
class _SlowCoordinator:
    """Answers ``control`` as the coordinator does, 1.5 s late (a coordinator busy with a large job)."""

    def control(self, generation, report):
        time.sleep(1.5)
        return {"delegate": True, "want_full": False}


@pytest.mark.ray
def test_the_sender_does_not_spin_while_a_control_answer_is_outstanding(tmp_path, ray_cluster):  # noqa: F811
    from ray_ckpt.runtime.trainer import sink as sink_mod
    from ray_ckpt.runtime.coordinator import shutdown_run
    run = f"idle-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ck = ray_ckpt.Checkpointer(str(tmp_path / "ck"), model, opt, runtime="ray", run=run, replica=False)
        sink = ck._sink
        real = sink.control.coordinator
        slow = _SlowCoordinator.remote()
        calls = [0]
        housekeeping = sink._housekeeping

        def counted():
            calls[0] += 1
            return housekeeping()

        with sink._cv:   # the sender waits on this condition between rounds: swap in a slow coordinator
            sink._housekeeping = counted
            sink.control.coordinator, sink.control.relay = slow, False
            sink.control.ref, sink.control.via, sink.control.t = None, None, 0.0
            sink._cv.notify_all()
        deadline = time.monotonic() + 10
        while sink.control.ref is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.control.ref is not None      # the ask went to the slow coordinator and waits for its answer
        calls[0] = 0
        time.sleep(1.0)
        rounds = calls[0]
        # at the reap cadence about 1 / _REAP_S = 20 rounds; spinning made it thousands
        assert rounds <= 4 * 1.0 / sink_mod._REAP_S, rounds
        while not sink.control.state["delegate"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.control.state["delegate"]          # ... and its answer was collected once it came
        with sink._cv:
            sink.control.coordinator, sink.control.ref = real, None
        model(torch.ones(1, 8)).sum().backward()
        opt.step()                                 # the sink still works after the answer was dropped
        ck.close()
        assert ck.last_committed_step == 1
    finally:
        shutdown_run(run)
