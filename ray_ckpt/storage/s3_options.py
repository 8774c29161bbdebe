"""S3 options and URIs, resolved without pyarrow: what :func:`ray_ckpt.storage.open_storage` hands to the S3 backend.

``s3://bucket[/prefix][?option=value&...]`` -- options as ``pyarrow.fs.S3FileSystem`` takes them
(``endpoint_override``, ``scheme``, ``region``, ``allow_delayed_open``, ...), also as the query parameters
``pyarrow.fs.FileSystem.from_uri`` accepts; ``s3://KEY:SECRET@bucket/...`` is accepted too.

S3 options are merged per option: keyword argument > URI query parameter > environment
(``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` -> ``endpoint_override`` + ``scheme``; ``AWS_REGION``/
``AWS_DEFAULT_REGION`` -> ``region``; ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``
-> credentials). Credentials are taken as a group from the highest source that names an access key, so a key
from one source is never paired with a secret from another. A keyword option set to ``None`` counts as unset.
The environment is read once, at open time, in the opening process: a pickled backend carries the resolved
non-secret options, and its credentials only through the secret channel (see :mod:`ray_ckpt.storage.s3`).

Pure functions of their arguments and the environment: no pyarrow, no I/O. Run in any process; thread-safe.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from .base import StorageError, validate_key

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CREDENTIALS = ("access_key", "secret_key", "session_token")
#: Options that may hold secrets: never shown in a backend's ``uri``, ``describe()`` or in messages.
SECRET_OPTIONS = frozenset({*_CREDENTIALS, "proxy_options", "external_id"})
_BOOL_OPTIONS = frozenset({
    "anonymous", "background_writes", "allow_delayed_open", "allow_bucket_creation",
    "allow_bucket_deletion", "check_directory_existence_before_creation", "force_virtual_addressing",
})
_FLOAT_OPTIONS = frozenset({"request_timeout", "connect_timeout"})
_INT_OPTIONS = frozenset({"load_frequency"})


def redact(uri: str) -> str:
    """``uri`` with any ``user:password@`` and secret query values removed (for messages)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparsable URI>"
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = parts.query
    if query:
        try:
            items = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, "***" if k in SECRET_OPTIONS else v) for k, v in items])
        except ValueError:
            query = "***"
    text = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else parts.path
    return text + (f"?{query}" if query else "")


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise StorageError(f"S3 option {name}={value!r} is not a boolean")


def _typed(name: str, value):
    """Convert a query/env string to the type ``S3FileSystem`` expects for ``name``."""
    if not isinstance(value, str):
        return value
    try:
        if name in _BOOL_OPTIONS:
            return _parse_bool(name, value)
        if name in _FLOAT_OPTIONS:
            return float(value)
        if name in _INT_OPTIONS:
            return int(value)
    except ValueError:
        raise StorageError(f"S3 option {name}={value!r} is not a number") from None
    return value


def env_options(environ=None) -> dict:
    """The S3 options the ``AWS_*`` environment sets (``environ``, default ``os.environ``): endpoint and scheme,
    region, and the credentials when both an access key and a secret are set."""
    env = os.environ if environ is None else environ
    out: dict = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        if "://" in endpoint:
            p = urlsplit(endpoint)
            out["endpoint_override"] = p.netloc + (p.path.rstrip("/") if p.path not in ("", "/") else "")
            out["scheme"] = p.scheme
        else:
            out["endpoint_override"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        out["region"] = region
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        out["access_key"] = env["AWS_ACCESS_KEY_ID"]
        out["secret_key"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            out["session_token"] = env["AWS_SESSION_TOKEN"]
    return out


def resolve_s3_options(query: dict, keyword: dict, environ=None) -> dict:
    """Merge S3 options: keyword > query > env, credentials as one group. Pure apart from reading env."""
    sources = [env_options(environ), query, {k: v for k, v in keyword.items() if v is not None}]
    merged: dict = {}
    for src in sources:
        merged.update({k: v for k, v in src.items() if k not in _CREDENTIALS})
    # Credentials: from the highest source that names any of them (or asks for anonymous/role access).
    for src in reversed(sources):
        if any(k in src for k in _CREDENTIALS) or src.get("anonymous") or src.get("role_arn"):
            merged.update({k: src[k] for k in _CREDENTIALS if k in src})
            break
    return merged


@dataclass(frozen=True)
class S3Location:
    """An opened ``s3://`` URI: where the objects live and the resolved options to reach them."""

    bucket: str
    prefix: str     #: without leading or trailing ``/``; validated as a key
    uri: str        #: the root URI, credentials and secret query parameters removed
    #: resolved (:func:`resolve_s3_options`), typed, secrets included (so never in the repr)
    options: dict = field(repr=False)


def parse_s3_uri(uri: str, options: dict, environ=None) -> S3Location:
    """Parse an ``s3://`` URI and resolve its options with the keyword ``options`` and the environment.

    Raises :class:`StorageError` for a malformed URI (no bucket, a fragment, a repeated or malformed query
    parameter, an invalid prefix) or an option value of the wrong type; messages never show secrets.
    """
    try:
        parts = urlsplit(uri)
    except ValueError as e:
        raise StorageError(f"malformed S3 URI {redact(uri)}: {e}") from None
    if parts.fragment:
        raise StorageError(f"S3 URI {redact(uri)} takes no fragment ('#')")
    userinfo, _, bucket = parts.netloc.rpartition("@")
    if not bucket or not _BUCKET_RE.match(bucket):
        raise StorageError(f"S3 URI {redact(uri)} needs a bucket name: s3://bucket[/prefix]")
    prefix = unquote(parts.path).strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except StorageError as e:
            raise StorageError(f"invalid prefix in S3 URI {redact(uri)}: {e}") from None

    query: dict = {}
    shown_query = []
    try:
        items = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as e:
        raise StorageError(f"malformed query in S3 URI {redact(uri)}: {e}") from None
    for k, v in items:
        if k in query:
            raise StorageError(f"S3 URI {redact(uri)} repeats query parameter {k!r}")
        query[k] = _typed(k, v)
        if k not in SECRET_OPTIONS:
            shown_query.append((k, v))
    if userinfo:
        user, _, password = userinfo.partition(":")
        query.setdefault("access_key", unquote(user))
        query.setdefault("secret_key", unquote(password))

    resolved = resolve_s3_options(query, {k: _typed(k, v) for k, v in options.items()}, environ)
    clean_uri = f"s3://{bucket}" + (f"/{quote(prefix, safe='/')}" if prefix else "")
    if shown_query:
        clean_uri += "?" + urlencode(shown_query, safe=":/")
    return S3Location(bucket, prefix, clean_uri, resolved)
