"""Parsing JSON read from storage (object and segment headers) with limits. The lineage layer may not import
this one, so manifests and the lineage index apply the same rule in :mod:`ray_ckpt.lineage` themselves.

Checksums prove that bytes are what a writer wrote, not that the writer was sane: a buggy or hostile writer can
checksum a header nested ten thousand levels deep or a manifest of a gigabyte. :func:`loads` turns every such
input into a ``ValueError`` (which the callers map to ``CorruptObjectError``) instead of a ``RecursionError`` or an unbounded allocation. Runs in any process that reads.
"""
from __future__ import annotations

import json
from typing import Any

from ray_ckpt.errors import RayCkptError

#: the largest JSON header accepted (container headers are also bounded by MAX_HEADER_BYTES before parsing)
MAX_JSON_BYTES = 256 << 20


class JSONLimitError(RayCkptError, ValueError):
    """Malformed, oversized or too deeply nested JSON."""


def loads(data: bytes | bytearray | memoryview | str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``json.loads`` of ``data`` that raises only :class:`JSONLimitError` on bad input."""
    n = len(data)
    if n > max_bytes:
        raise JSONLimitError(f"{n} bytes of JSON exceed the {max_bytes}-byte limit")
    try:
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
    except RecursionError:
        raise JSONLimitError("JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise JSONLimitError(f"not valid JSON: {e}") from None
