"""Ray Train integration (public): ``attach`` inside ``train_loop_per_worker``, ``RayCkptCallback`` in
``RunConfig(callbacks=[...])``, ``ResumableLoader`` around the loop's ``DataLoader`` and ``ResumableShard`` around
a Ray Data shard (``ray.train.get_dataset_shard``): exact mid-epoch resumption, plain loops too. See
:mod:`ray_ckpt.integrations.train_callback` for the hooks used, :mod:`ray_ckpt.integrations.train_session` for the
worker side, :mod:`ray_ckpt.integrations.agreement` for how the ranks agree on the step they restore,
:mod:`ray_ckpt.integrations.loader` for the loader and :mod:`ray_ckpt.integrations.ray_data` for the shard."""
from ray_ckpt.integrations.agreement import RestoreError, agreed_restore
from ray_ckpt.integrations.loader import ResumableLoader
from ray_ckpt.integrations.ray_data import ResumableShard
from ray_ckpt.integrations.train_callback import RayCkptCallback, flush_run
from ray_ckpt.integrations.train_session import TrainSession, attach, read_pointer

__all__ = ["RayCkptCallback", "RestoreError", "ResumableLoader", "ResumableShard", "TrainSession", "agreed_restore", "attach",
           "flush_run", "read_pointer"]
