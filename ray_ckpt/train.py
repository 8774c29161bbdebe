"""Ray Train integration (public): ``attach`` inside ``train_loop_per_worker``, ``RayCkptCallback`` in
``RunConfig(callbacks=[...])``. See :mod:`ray_ckpt.integrations.ray_train` for the hooks used."""
from ray_ckpt.integrations.ray_train import (RayCkptCallback, RestoreError, TrainSession, agreed_restore, attach,
                                             flush_run, read_pointer)

__all__ = ["RayCkptCallback", "RestoreError", "TrainSession", "agreed_restore", "attach", "flush_run",
           "read_pointer"]
