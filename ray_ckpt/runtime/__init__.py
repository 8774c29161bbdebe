"""The Ray runtime: coordinator, persistence workers, state-tier replica, the sink and client helpers.

Importing it registers the secret channel (:mod:`ray_ckpt.runtime.secrets`) through which S3 credentials
reach the run's actors.
"""
from ray_ckpt.runtime import secrets as _secrets  # noqa: F401 - registers the channel
