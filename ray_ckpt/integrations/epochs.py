"""The epoch loop shared by the resumable data wrappers (:class:`~ray_ckpt.integrations.loader.ResumableLoader`,
:class:`~ray_ckpt.integrations.ray_data.ResumableShard`): ``for epoch in data.epochs(n, start_step=...)``, which
after a restore starts at the interrupted epoch. Training process."""
from __future__ import annotations

from typing import Iterator


class EpochLoop:
    """Mixin. The wrapper sets ``_restored`` (a checkpointed position was loaded into it) and ``_planned`` (the
    epoch its next pass belongs to), and defines ``_check_own_state()`` (raises when the wrapper was swapped) and
    ``_next_epoch()`` (the interrupted epoch after a restore, else the one after the last pass).
    ``_CHECKPOINTED`` completes "so that ... with every step" in the error of an unrestored resume."""

    _CHECKPOINTED = "its position is checkpointed"
    _restored: bool
    _planned: int | None

    def epochs(self, num_epochs: int, *, start_step: int | None = None) -> Iterator[int]:
        """The epochs left to train, ``range(first, num_epochs)``: after a restore ``first`` is the interrupted
        epoch (mid-way) or the one after it; iterate the wrapper once inside each. ``start_step`` (e.g.
        ``session.start_step``): when it is > 0 the wrapper must have been restored, otherwise RuntimeError (it
        was not given to ``extra_state``, and the epoch could not be resumed exactly)."""
        self._check_own_state()
        if start_step and not self._restored:
            raise RuntimeError(f"the run resumes at step {start_step} but this {type(self).__name__} was not "
                               f"restored: give it to extra_state (attach/Checkpointer/restore) so that "
                               f"{self._CHECKPOINTED} with every step")
        epoch = self._next_epoch()
        while epoch < num_epochs:
            self._planned = epoch
            yield epoch
            epoch += 1

    def _check_own_state(self) -> None:
        raise NotImplementedError

    def _next_epoch(self) -> int:
        raise NotImplementedError
