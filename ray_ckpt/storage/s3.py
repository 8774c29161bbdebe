"""S3 backend on ``pyarrow.fs.S3FileSystem``: ``s3://bucket/prefix``.

Write path: s3fs (``pipe_file``): an object under ``2 * part_size`` (100 MiB) is a single PUT; a larger one is a
multipart upload that is completed only when every part succeeded and is *aborted* (``AbortMultipartUpload``)
on any failure. Both are atomic on S3: readers see no object, the old object, or the whole new one. Nothing is
left behind by a failed write, in storage or in this process (the joined bytes are released when ``write``
returns or raises). pyarrow's output stream is not used for writes: it has no Python ``abort()`` and its
destructor *completes* the upload, so a stream dropped after a partial write would publish a truncated object.
A request that fails transiently (5xx, throttling, connection reset) is retried by botocore's standard retry
mode (3 quick attempts, like pyarrow's client for reads); longer outages are the callers' retry policy
(:mod:`ray_ckpt.storage.retry`), under its time budget.

Reads use ``open_input_file`` (a HEAD, then one ranged GET for the whole object): ``open_input_stream``
is ~100x slower against S3 (many small range requests). The HEAD/GET pair is not atomic against a
concurrent overwrite (the GET may serve the new version cut to the old size), so ``read`` confirms
ETag and Last-Modified with a second HEAD: 3 requests per read (see ``S3Backend.read``).

Runs in any process; thread-safe (``S3FileSystem`` and s3fs are thread-safe; no other shared state).

Credentials never travel in a pickle. A pickled backend carries its non-secret options; its secrets
(:data:`~ray_ckpt.storage.s3_options.SECRET_OPTIONS` present in the resolved options) are handed to a *secret channel*
registered by a higher layer (the Ray runtime registers one: the secrets go into the Ray object store, owned by
the pickling process, and the pickle holds only the unguessable ObjectRef; see
:mod:`ray_ckpt.runtime.secrets`). Without a channel, pickling a backend that holds secrets raises
:class:`pickle.PicklingError`. An unpickled backend whose sealed secrets cannot be opened (their owner exited)
falls back to its own process's AWS environment and default credential chain (profile, instance role), with a
WARNING. A backend without explicit secrets (default chain) always resolves them in the process that uses it.
``uri`` and ``describe()`` never show secrets.
"""
from __future__ import annotations

import logging
import pickle
import random
import threading
import time
from urllib.parse import quote, urlencode

import pyarrow.fs as pafs

from .base import TMP_PREFIX, Data, ObjectNotFound, StorageError, as_buffers, validate_key, validate_prefix
from .s3_options import SECRET_OPTIONS, env_options

#: Options shown by ``describe()`` (enough to reopen the same endpoint, given credentials).
_DESCRIBED_OPTIONS = ("endpoint_override", "scheme", "region")
#: Our defaults on top of pyarrow's (an explicit option, query parameter or env setting wins).
DEFAULT_OPTIONS = {"allow_delayed_open": True}
#: pyarrow options that only shape pyarrow's own writes or bucket handling: accepted, unused by the s3fs writer.
_PYARROW_ONLY = frozenset({"allow_delayed_open", "background_writes", "allow_bucket_creation",
                           "allow_bucket_deletion", "check_directory_existence_before_creation"})
#: Options the s3fs writer maps; anything else is refused at open (it would silently not apply to writes).
_WRITER_OPTIONS = frozenset({"access_key", "secret_key", "session_token", "anonymous", "region", "endpoint_override",
                             "scheme", "connect_timeout", "request_timeout", "force_virtual_addressing"})
#: Objects of at least twice this size are written as multipart uploads of parts this large.
PART_SIZE = 50 << 20

log = logging.getLogger("ray_ckpt")

#: The secret channel: ``seal(secrets: dict) -> token``; ``token.open()`` returns the dict, or None when the
#: secrets are no longer reachable. Registered by the runtime layer (:func:`set_secret_channel`).
_SEAL = None


def set_secret_channel(seal) -> None:
    """Register how secrets of a pickled backend travel (``seal(dict) -> picklable token with open()``).

    Called once by :mod:`ray_ckpt.runtime.secrets` at import; any process."""
    global _SEAL
    _SEAL = seal


def _endpoint_url(options: dict) -> str:
    """``endpoint_override`` as the URL botocore and s3fs take (pyarrow's ``scheme`` option, https by default)."""
    ep = str(options["endpoint_override"])
    return ep if "://" in ep else f"{options.get('scheme') or 'https'}://{ep}"


def _s3fs_kwargs(options: dict) -> dict:
    """Keyword arguments for ``s3fs.S3FileSystem`` equivalent to the pyarrow options (credentials, endpoint,
    region, timeouts, addressing); botocore's standard retry mode, s3fs's own retry loop off."""
    o = options
    kw: dict = {"skip_instance_cache": True, "use_listings_cache": False}
    if o.get("anonymous"):
        kw["anon"] = True
    else:
        for ours, theirs in (("access_key", "key"), ("secret_key", "secret"), ("session_token", "token")):
            if o.get(ours):
                kw[theirs] = o[ours]
    if o.get("endpoint_override"):
        kw["endpoint_url"] = _endpoint_url(o)
    if o.get("region"):
        kw["client_kwargs"] = {"region_name": o["region"]}
    virtual = bool(o.get("force_virtual_addressing")) or not o.get("endpoint_override")
    kw["config_kwargs"] = {"connect_timeout": float(o.get("connect_timeout") or 10),
                           "read_timeout": float(o.get("request_timeout") or 30),
                           # botocore's standard mode: up to 3 quick attempts on 5xx/throttling/resets, as
                           # pyarrow's AWS SDK client does for reads; longer outages are the RetryPolicy's
                           "retries": {"mode": "standard", "max_attempts": 3},
                           "s3": {"addressing_style": "virtual" if virtual else "path"}}
    return kw


def _rebuild(bucket: str, prefix: str, public: dict, uri: str, sealed) -> "S3Backend":
    """Unpickle: the public options plus the secrets opened from ``sealed`` (or this process's own)."""
    options = dict(public)
    if sealed is not None:
        secrets = sealed.open()
        if secrets is None:
            env = {k: v for k, v in env_options().items() if k in SECRET_OPTIONS}
            log.warning("ray_ckpt: the S3 credentials for %s were sealed by a process that has exited; using "
                        "this process's %s", uri, "AWS_* environment" if env else
                        "default AWS credential chain (profile, instance role)")
            secrets = env
        options.update(secrets)
    return S3Backend(bucket, prefix, options, uri=uri)


#: Reads of an object that keeps being overwritten are retried this many times.
_READ_ATTEMPTS = 8


def _error_code(e: BaseException) -> str | None:
    """The S3 error code of a botocore error (``"NoSuchKey"``, ``"PreconditionFailed"``...), or None: a connection
    error or timeout (an outage) carries no response (botocore's ``HTTPClientError`` sets ``response=None``)."""
    response = getattr(e, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return error.get("Code") if isinstance(error, dict) else None


def _version(f) -> tuple | None:
    """(ETag, Last-Modified) from the HEAD that opened ``f``, or ``None`` if the server sends no ETag."""
    meta = f.metadata()
    etag = meta.get("ETag")
    return (etag, meta.get("Last-Modified")) if etag else None


class S3Backend:
    """Objects under ``s3://<bucket>/<prefix>/``; keys map to ``<prefix>/<key>``.

    Built by :func:`ray_ckpt.storage.open_storage`, which resolves ``options`` (keyword > URI query > env).
    """

    def __init__(self, bucket: str, prefix: str, options: dict, uri: str | None = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = dict(options)
        unknown = set(self.options) - _WRITER_OPTIONS - _PYARROW_ONLY
        if unknown:
            raise StorageError(
                f"S3 option(s) {sorted(unknown)} are not supported for {uri or bucket}: writes go through s3fs, which "
                f"takes {sorted(_WRITER_OPTIONS)} (for an assumed role, use an AWS profile with role_arn and "
                "AWS_PROFILE, or the instance role)")
        self._root = f"{bucket}/{self.prefix}" if self.prefix else bucket
        #: Root without query: full key URIs are ``base_uri + "/" + key``.
        self.base_uri = f"s3://{bucket}" + (f"/{quote(self.prefix, safe='/')}" if self.prefix else "")
        #: The root URI it was opened with, credentials removed.
        self.uri = uri or self.base_uri
        self._fs = self._make_fs()
        self._lock = threading.Lock()
        self._writer_fs = None   # s3fs, built on the first write
        self._sealed = None      # the secret channel's token, built on the first pickle
        #: multipart threshold / part size of writes (tests lower it)
        self.part_size = PART_SIZE

    def _make_fs(self) -> pafs.S3FileSystem:
        kwargs = {**DEFAULT_OPTIONS, **self.options}
        try:
            return pafs.S3FileSystem(**kwargs)
        except TypeError as e:
            raise StorageError(f"unsupported S3 option for {self.uri}: {e}") from e
        except (ValueError, OSError) as e:  # ArrowInvalid is a ValueError
            raise StorageError(f"invalid S3 options for {self.uri}: {e}") from e

    # ---- pickling -------------------------------------------------------------------------------------
    def __reduce__(self):
        """Non-secret options in the clear; secrets only as the secret channel's token (see the module doc)."""
        public = {k: v for k, v in self.options.items() if k not in SECRET_OPTIONS}
        secrets = {k: v for k, v in self.options.items() if k in SECRET_OPTIONS}
        if not secrets:
            return (_rebuild, (self.bucket, self.prefix, public, self.uri, None))
        with self._lock:
            if self._sealed is None:
                if _SEAL is None:
                    raise pickle.PicklingError(
                        f"the S3 backend for {self.uri} holds credentials and no secret channel is available to "
                        "carry them (credentials are never pickled): use it in a process connected to Ray with "
                        "ray_ckpt's runtime imported, or let each process resolve credentials itself (AWS_* "
                        "environment, profile, instance role)")
                self._sealed = _SEAL(secrets)
            sealed = self._sealed
        return (_rebuild, (self.bucket, self.prefix, public, self.uri, sealed))

    def __repr__(self) -> str:
        return f"S3Backend({self.describe()!r})"

    def describe(self) -> str:
        """Root URI plus the connection options needed to reach it (endpoint, scheme, region), no secrets.

        Runs anywhere. The result is a URI that :func:`open_storage` accepts (credentials then come from
        keyword options or the environment).
        """
        shown = {k: self.options[k] for k in _DESCRIBED_OPTIONS if self.options.get(k) not in (None, "")}
        return self.base_uri + ("?" + urlencode(shown, safe=":/") if shown else "")

    # ---- helpers --------------------------------------------------------------------------------------
    def key_uri(self, key: str) -> str:
        """Full URI of ``key`` (for messages)."""
        return f"{self.base_uri}/{quote(key, safe='/')}"

    def _path(self, key: str) -> str:
        return f"{self._root}/{validate_key(key)}"

    def _writer(self):
        with self._lock:
            if self._writer_fs is None:
                import s3fs
                fs = s3fs.S3FileSystem(**_s3fs_kwargs(self.options))
                fs.retries = 1  # s3fs's own retry loop: off (botocore's and the caller's RetryPolicy suffice)
                self._writer_fs = fs
            return self._writer_fs

    # ---- protocol -------------------------------------------------------------------------------------
    def write(self, key: str, data: Data) -> None:
        """Atomically store ``data`` at ``key``: one PUT, or a multipart upload completed only on success and
        aborted on failure (nothing visible, nothing billed, no buffer kept).

        Runs in any process; thread-safe. Concurrent writers of one key: the last completed upload wins, whole.
        """
        path = self._path(key)
        buffers = as_buffers(data)  # before any request: a bad element must not start an upload
        body = b"".join(buffers)   # one copy: botocore takes bytes
        try:
            self._writer().pipe_file(path, body, chunksize=self.part_size)
        except FileNotFoundError as e:  # s3fs's translation of NoSuchBucket (a write needs no other object)
            raise StorageError(f"cannot write {self.key_uri(key)}: NoSuchBucket: {e}") from e
        except Exception as e:  # noqa: BLE001 - botocore/aiohttp/s3fs errors: reported as ours, cause chained
            raise StorageError(f"cannot write {self.key_uri(key)}: {type(e).__name__}: {e}") from e
        finally:
            del body  # a raised error keeps this frame alive (traceback): do not keep the bytes with it

    def read(self, key: str) -> bytes:
        """Return the whole object, one version of it. Runs in any process; thread-safe.

        ``open_input_file`` sizes the read with a HEAD and then GETs that byte range; an overwrite in
        between would yield the new version cut to the old length (a torn read). So the ETag and
        Last-Modified of that HEAD are checked against a second HEAD after the GET (one extra request),
        retrying with a short backoff; a key rewritten faster than it can be read raises
        :class:`StorageError` ("changed during each of N reads") rather than return torn bytes.
        Not caught: the object is overwritten and then rewritten with the *same* bytes within the same
        second, all during one read (keys here are written once, or rewritten with identical bytes by a
        retry, which cannot tear).
        """
        path = self._path(key)
        try:
            for attempt in range(_READ_ATTEMPTS):
                if attempt:
                    time.sleep(random.uniform(0.5, 1.0) * min(0.2, 0.005 * 2**attempt))
                with self._fs.open_input_file(path) as f:
                    version = _version(f)
                    size = f.size()
                    data = f.read()
                if len(data) != size:
                    continue
                if version is None:  # an S3 implementation without ETags: nothing to check against
                    return data
                with self._fs.open_input_file(path) as f:
                    if _version(f) == version:
                        return data
        except FileNotFoundError as e:
            raise ObjectNotFound(f"no object at {self.key_uri(key)}") from e
        except OSError as e:
            raise StorageError(f"cannot read {self.key_uri(key)}: {e}") from e
        raise StorageError(f"cannot read {self.key_uri(key)}: it changed during each of {_READ_ATTEMPTS} reads")

    def _info(self, key: str, action: str) -> pafs.FileInfo:
        path = self._path(key)
        try:
            return self._fs.get_file_info(path)
        except OSError as e:
            raise StorageError(f"cannot {action} {self.key_uri(key)}: {e}") from e

    def size(self, key: str) -> int:
        """Size in bytes of the object. Runs in any process; thread-safe."""
        info = self._info(key, "stat")
        if info.type != pafs.FileType.File:
            raise ObjectNotFound(f"no object at {self.key_uri(key)}")
        return info.size

    def exists(self, key: str) -> bool:
        """Whether the object exists (a folder-like prefix is not an object). Runs in any process; thread-safe."""
        return self._info(key, "stat").type == pafs.FileType.File

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, recursive, sorted; skips folder markers and invalid names.

        Runs in any process; thread-safe.
        """
        validate_prefix(prefix)
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self._root}/{base_rel}" if base_rel else self._root
        try:
            infos = self._fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StorageError(f"cannot list {self.base_uri}/{prefix}: {e}") from e
        cut = len(self._root) + 1
        keys = []
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            key = info.path[cut:]
            if not key.startswith(prefix) or any(s.startswith(TMP_PREFIX) for s in key.split("/")):
                continue
            try:
                validate_key(key)
            except StorageError:
                continue
            keys.append(key)
        keys.sort()
        return keys

    def list_after(self, prefix: str, start_after: str = "") -> list[str]:
        """Keys starting with ``prefix`` that sort after ``start_after``, sorted: ListObjectsV2 with StartAfter,
        so one request per 1000 keys *returned* (``list`` pages through everything under the folder). Skips
        temp and invalid names. Runs in any process; thread-safe (a botocore client per backend object)."""
        validate_prefix(prefix)
        client = self._list_client()
        if client is None:
            return [k for k in self.list(prefix) if k > start_after]
        root = f"{self.prefix}/" if self.prefix else ""
        kwargs = {"Bucket": self.bucket, "Prefix": root + prefix}
        if start_after:
            kwargs["StartAfter"] = root + start_after
        keys = []
        try:
            while True:
                resp = client.list_objects_v2(**kwargs)
                for obj in resp.get("Contents", []):
                    key = obj["Key"][len(root):]
                    if any(s.startswith(TMP_PREFIX) for s in key.split("/")) or key.endswith("/"):
                        continue
                    try:
                        validate_key(key)
                    except StorageError:
                        continue
                    keys.append(key)
                if not resp.get("IsTruncated"):
                    break
                kwargs["ContinuationToken"] = resp["NextContinuationToken"]
        except Exception as e:  # noqa: BLE001 - botocore's errors: report as ours
            if type(e).__name__ == "NoSuchBucket":
                return []
            raise StorageError(f"cannot list {self.base_uri}/{prefix} after {start_after!r}: {e}") from e
        return sorted(keys)

    def _list_client(self):
        """A botocore S3 client on the same endpoint and credentials (None: botocore missing or options it
        cannot express; callers then list and filter)."""
        client = getattr(self, "_botocore", False)
        if client is not False:
            return client
        try:
            import botocore.config
            import botocore.session
        except ImportError:
            self._botocore = None
            return None
        o = self.options
        unsupported = set(o) - {"endpoint_override", "scheme", "access_key", "secret_key", "session_token",
                                "region", "allow_delayed_open", "connect_timeout", "request_timeout"}
        if unsupported:
            self._botocore = None
            return None
        endpoint = _endpoint_url(o) if o.get("endpoint_override") else None
        session = botocore.session.get_session()
        self._botocore = session.create_client(
            "s3", region_name=o.get("region") or "us-east-1", endpoint_url=endpoint,
            aws_access_key_id=o.get("access_key"), aws_secret_access_key=o.get("secret_key"),
            aws_session_token=o.get("session_token"),
            config=botocore.config.Config(s3={"addressing_style": "path"} if endpoint else {},
                                          proxies={}, retries={"max_attempts": 3},
                                          # the same timeouts as the pyarrow filesystem (botocore's default
                                          # 60 s would hold a lease check that long during an outage)
                                          connect_timeout=float(o.get("connect_timeout") or 10),
                                          read_timeout=float(o.get("request_timeout") or 30)))
        return self._botocore

    # ---- conditional writes (the writer lease): S3's If-None-Match / If-Match on PutObject -----------------------
    def _conditional_client(self):
        client = self._list_client()
        if client is None:
            raise StorageError(f"conditional writes on {self.uri} need botocore and plain endpoint/credential "
                               f"options (used for the writer lease)")
        return client

    def _put_if(self, key: str, data, what: str, **cond) -> bool:
        client = self._conditional_client()
        root = f"{self.prefix}/" if self.prefix else ""
        body = b"".join(bytes(b) for b in as_buffers(data))
        try:
            client.put_object(Bucket=self.bucket, Key=root + validate_key(key), Body=body, **cond)
            return True
        except Exception as e:  # noqa: BLE001 - botocore's errors
            if _error_code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise StorageError(f"cannot {what} {self.key_uri(key)}: {e}") from e

    def create(self, key: str, data: Data) -> bool:
        """PutObject with ``If-None-Match: *``: only if absent. Any process; thread-safe."""
        return self._put_if(key, data, "create", IfNoneMatch="*")

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """GetObject: the bytes and the ETag. Any process; thread-safe."""
        client = self._conditional_client()
        root = f"{self.prefix}/" if self.prefix else ""
        try:
            resp = client.get_object(Bucket=self.bucket, Key=root + validate_key(key))
            return resp["Body"].read(), resp["ETag"]
        except Exception as e:  # noqa: BLE001
            if _error_code(e) in ("NoSuchKey", "404"):
                raise ObjectNotFound(f"no object {self.key_uri(key)}") from None
            raise StorageError(f"cannot read {self.key_uri(key)}: {e}") from e

    def replace_if(self, key: str, data: Data, version: str) -> bool:
        """PutObject with ``If-Match: <ETag>``: compare-and-swap. Any process; thread-safe."""
        return self._put_if(key, data, "replace", IfMatch=version)

    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error. Runs in any process; thread-safe.

        pyarrow then re-creates an empty ``<parent>/`` folder marker object; ``list()`` ignores it.
        """
        path = self._path(key)
        try:
            self._fs.delete_file(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot delete {self.key_uri(key)}: {e}") from e
