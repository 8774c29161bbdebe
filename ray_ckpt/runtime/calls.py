"""How the runtime's Ray-free parts look at the actor calls they made: :class:`Calls` says which call references
are answered (never waiting) and gets an answer. :data:`RAY` is Ray's; a unit test passes a fake whose references
are its own (futures, say). Any process.
"""
from __future__ import annotations

import ray


class Calls:
    """Ray's ``wait`` (with no timeout: it never waits) and ``get`` on the references a handle's ``.remote``
    returns."""

    def ready(self, refs: list) -> list:
        """The references among ``refs`` whose call has answered (in the order given); never waits."""
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        done = set(ready)
        return [r for r in refs if r in done]

    def get(self, ref, timeout: float | None = None):
        """The answer of the call ``ref`` (raises what the call raised)."""
        return ray.get(ref, timeout=timeout)


    def up(self) -> bool:
        """Whether this process is connected to Ray (a call now would not start another Ray instance)."""
        return ray.is_initialized()


RAY = Calls()
