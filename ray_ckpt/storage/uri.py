"""``open_storage``: choose a backend by the URI's scheme (the table below) and hand it the URI's options.

Accepted URIs:

* a plain path, absolute (``/mnt/ckpt``), relative to the cwd at open time (``ckpt``), or ``~/ckpt``;
* ``file:///abs/path`` (host empty or ``localhost``; percent-escapes decoded);
* ``s3://bucket[/prefix][?option=value&...]``: its options, and how keyword arguments, query parameters and the
  ``AWS_*`` environment merge, are described in :mod:`ray_ckpt.storage.s3_options`.
"""
from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from .base import StorageBackend, StorageError
from .s3_options import parse_s3_uri, redact

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_storage(uri: str, **options) -> StorageBackend:
    """Open the storage rooted at ``uri``; see the module docstring for URIs and options.

    Runs in any process (driver, worker, actor, CLI); thread-safe. Creates nothing: folders and objects
    appear on the first ``write``. For S3 it builds pyarrow's client (without a region, the AWS SDK may try
    the EC2 metadata service once; set ``region`` or ``AWS_EC2_METADATA_DISABLED=true`` off EC2).

    Raises :class:`StorageError` for an unsupported scheme (naming it and the supported ones), a malformed
    URI, an option the backend does not take, or an invalid option value.
    """
    if not isinstance(uri, str) or not uri:
        raise StorageError(f"storage URI must be a non-empty str, got {uri!r}")
    m = _SCHEME_RE.match(uri)
    if m is None and uri[:5].lower() == "file:":
        scheme = "file"
    elif m is None:
        return _open_local(os.path.expanduser(uri), options, shown=uri)
    else:
        scheme = m.group(1).lower()
    opener = _OPENERS.get(scheme)
    if opener is not None:
        return opener(uri, options)
    supported = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise StorageError(
        f"unsupported storage scheme {scheme!r} in {redact(uri)}: supported are {supported} and plain paths"
    )


def _open_local(path: str, options: dict, shown: str) -> StorageBackend:
    from .local import LocalBackend

    given = sorted(k for k, v in options.items() if v is not None)
    if given:
        raise StorageError(f"local storage {shown} takes no options, got {given}")
    if "\x00" in path:
        raise StorageError(f"invalid local storage path {shown!r}: contains NUL")
    return LocalBackend(path)


def _open_file_uri(uri: str, options: dict) -> StorageBackend:
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise StorageError(f"file URI {uri!r} names host {parts.netloc!r}: use file:///absolute/path")
    if parts.query or parts.fragment:
        raise StorageError(f"file URI {uri!r} takes no query or fragment")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise StorageError(f"file URI {uri!r} must hold an absolute path: use file:///absolute/path")
    return _open_local(path, options, shown=uri)


def _open_s3(uri: str, options: dict) -> StorageBackend:
    loc = parse_s3_uri(uri, options)
    # imported here: pyarrow (and its S3 client) loads only when an S3 URI is opened
    from .s3 import S3Backend

    return S3Backend(loc.bucket, loc.prefix, loc.options, uri=loc.uri)


#: scheme -> opener ``(uri, options) -> backend``; plain paths open as local storage.
_OPENERS = {"file": _open_file_uri, "s3": _open_s3}

#: Schemes :func:`open_storage` understands (plus plain paths).
SUPPORTED_SCHEMES = tuple(_OPENERS)
