"""Storage layer: the same contract on the local and the S3 (moto over HTTP) backend.

Unit tests, no Ray. Backend-generic tests take ``storage_uri`` (see conftest) and run once per backend.
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from ray_ckpt.storage import ObjectNotFound, StorageBackend, StorageError, open_storage, validate_key
from ray_ckpt.storage.s3_options import resolve_s3_options

REPO = Path(__file__).resolve().parents[1]

BAD_KEYS = [
    "", "../x", "a/../../b", "a/..", "./a", "a/./b", "/etc/passwd", "a\\b", "a//b", "a/", "a\x00b",
    "a\nb", "a\x7fb", ".tmp-x", "a/.tmp-y/b", "x" * 1025, "é" * 513,
]
GOOD_KEYS = [
    "manifests/g000001-full-000000000025.json", "a", "a/b/c.bin", "..a", "a..b/c", ".hidden", "x" * 1024,
    "sp ace/percent%41/q?#&=+", "ünï/çødé",
]


def parent_target(target):
    """The folder/bucket one level above a test root, to check nothing is touched outside the root."""
    return open_storage(target.uri.rsplit("/", 1)[0], **target.options)


# ---------------------------------------------------------------------------------------------------------
# validate_key (pure)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_validate_key_refuses(key):
    with pytest.raises(StorageError) as ei:
        validate_key(key)
    if len(key) < 100:
        assert repr(key) in str(ei.value)


@pytest.mark.parametrize("key", GOOD_KEYS, ids=lambda k: repr(k[:40]))
def test_validate_key_accepts(key):
    assert validate_key(key) is key


def test_validate_key_refuses_non_str():
    with pytest.raises(StorageError):
        validate_key(b"a/b")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# The contract, on both backends
# ---------------------------------------------------------------------------------------------------------
def test_protocol_and_roundtrip(storage_uri):
    store = storage_uri.open()
    assert isinstance(store, StorageBackend)
    store.write("k/bytes", b"hello")
    store.write("k/view", memoryview(b"0123456789")[2:7])
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    parts = [b"ab", bytearray(b"cd"), memoryview(b"--ef--")[2:4], arr, b""]
    store.write("k/list", parts)
    store.write("k/empty", b"")
    store.write("k/empty-list", [])
    assert store.read("k/bytes") == b"hello"
    assert store.read("k/view") == b"23456"
    assert store.read("k/list") == b"abcdef" + arr.tobytes()
    assert store.read("k/empty") == b"" and store.read("k/empty-list") == b""
    assert store.size("k/list") == 6 + arr.nbytes
    assert store.size("k/empty") == 0
    assert isinstance(store.read("k/bytes"), bytes)


def test_write_refuses_non_bytes(storage_uri):
    store = storage_uri.open()
    for bad in ["text", ["ok", b"x"], 42, [b"ok", 3], np.arange(10)[::2]]:
        with pytest.raises(TypeError):
            store.write("bad", bad)
    assert store.list() == []


def test_size_exists_delete(storage_uri):
    store = storage_uri.open()
    assert not store.exists("a/b")
    store.write("a/b", b"xyz")
    assert store.exists("a/b") and store.size("a/b") == 3
    assert not store.exists("a")  # a folder-like prefix is not an object
    store.delete("a/b")
    assert not store.exists("a/b")
    assert store.list() == []
    store.delete("a/b")  # missing: fine
    store.delete("never/was")
    with pytest.raises(ObjectNotFound):
        store.size("a/b")


def test_list_prefix_sorted_recursive(storage_uri):
    store = storage_uri.open()
    keys = ["objects/x/y.bin", "manifests/b.json", "top", "manifests/a.json", "objects/z.bin",
            "manifests-old/c.json", "objects/x/w/v.bin"]
    for k in keys:
        store.write(k, k.encode())
    assert store.list() == sorted(keys)
    assert store.list("") == sorted(keys)
    assert store.list("manifests/") == ["manifests/a.json", "manifests/b.json"]
    assert store.list("objects/") == ["objects/x/w/v.bin", "objects/x/y.bin", "objects/z.bin"]
    assert store.list("objects/x/") == ["objects/x/w/v.bin", "objects/x/y.bin"]
    assert store.list("manifests/a") == ["manifests/a.json"]
    assert store.list("manifests") == ["manifests-old/c.json", "manifests/a.json", "manifests/b.json"]
    assert store.list("nothing/") == []
    assert store.list("top/") == []  # an object is not a folder
    store.delete("objects/x/y.bin")  # pyarrow leaves an "objects/x/" marker on S3; never listed
    store.delete("objects/x/w/v.bin")
    assert store.list("objects/") == ["objects/z.bin"]
    with pytest.raises(StorageError):
        store.list("../")


def test_list_on_missing_root(storage_uri):
    store = storage_uri.open()
    assert store.list() == [] and store.list("manifests/") == []


def test_overwrite_replaces_whole(storage_uri):
    store = storage_uri.open()
    store.write("obj", b"A" * 1000)
    store.write("obj", [b"B" * 10, b"C" * 5])
    assert store.read("obj") == b"B" * 10 + b"C" * 5
    assert store.size("obj") == 15
    assert store.list() == ["obj"]


def test_missing_object(storage_uri):
    store = storage_uri.open()
    for call in (store.read, store.size):
        with pytest.raises(ObjectNotFound) as ei:
            call("manifests/nope.json")
        assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, StorageError)
        assert "manifests/nope.json" in str(ei.value)
        assert store.describe().split("?")[0] in str(ei.value)  # the full URI of the key


def test_bad_keys_touch_nothing_outside_root(storage_uri):
    parent = parent_target(storage_uri)
    parent.write("outside.bin", b"keep")
    parent.write("x", b"keep-x")
    parent.write("b", b"keep-b")
    store = storage_uri.open()
    for key in ["../x", "a/../../b", "/etc/passwd", "a\\b", "a//b", "", "../store2/x", "../run2/x", "..", "."]:
        for call in (lambda: store.write(key, b"evil"), lambda: store.read(key), lambda: store.size(key),
                     lambda: store.exists(key), lambda: store.delete(key)):
            with pytest.raises(StorageError):
                call()
    assert parent.list() == ["b", "outside.bin", "x"]
    assert parent.read("x") == b"keep-x" and parent.read("b") == b"keep-b"
    assert store.list() == []


def test_concurrent_writers_are_atomic(storage_uri):
    """Readers racing writers of one key see only whole versions (each write has distinct bytes and length)."""
    store = storage_uri.open()
    n_writers, n_writes = 4, 4

    def payload(w, i):
        return f"<{w}:{i}>".encode() * (4000 + 7 * (w * n_writes + i))

    allowed = {payload(w, i) for w in range(n_writers) for i in range(n_writes)}
    allowed.add(b"initial")
    store.write("hot", b"initial")
    errors, reads = [], [0]

    def writer(w):
        try:
            for i in range(n_writes):
                p = payload(w, i)
                store.write("hot", [p[:100], memoryview(p)[100:]])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(n_writers)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        try:
            assert store.read("hot") in allowed
            reads[0] += 1
        except StorageError as e:  # S3: rewritten during every retry; an honest answer, never torn bytes
            assert "changed during" in str(e)
    for t in threads:
        t.join()
    assert not errors
    assert store.read("hot") in allowed
    assert store.list() == ["hot"]


def test_pickle_roundtrip(storage_uri, monkeypatch):
    store = storage_uri.open()
    store.write("a/b", b"before")
    if storage_uri.uri.startswith("s3://"):
        # Credentials are never pickled: without a secret channel (the Ray runtime's, tested with Ray in
        # test_runtime_ray.py) a backend holding them refuses; without credentials it pickles in the clear.
        from ray_ckpt.storage import s3 as s3mod
        monkeypatch.setattr(s3mod, "_SEAL", None)
        with pytest.raises(pickle.PicklingError, match="never pickled"):
            pickle.dumps(store)
        secret = storage_uri.options["secret_key"]
        monkeypatch.setattr(s3mod, "_SEAL", _InProcessSeal)
        blob = pickle.dumps(store)
        assert secret.encode() not in blob and b"secret_key" not in blob
    copy = pickle.loads(pickle.dumps(store))
    assert copy is not store
    assert copy.uri == store.uri and copy.describe() == store.describe()
    assert copy.read("a/b") == b"before"
    copy.write("a/c", b"from copy")
    assert store.read("a/c") == b"from copy"
    assert store.list() == copy.list() == ["a/b", "a/c"]


class _InProcessSeal:
    """A secret channel for one process (the Ray runtime's is tested with Ray): the secrets stay in a class-level
    dict; a pickled token is only its number."""
    held: dict = {}

    def __init__(self, secrets):
        self.token = len(self.held)
        self.held[self.token] = dict(secrets)

    def open(self):
        return dict(self.held[self.token])


# ---------------------------------------------------------------------------------------------------------
# URIs and options
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("uri", ["gs://bucket/x", "hdfs://nn/path", "HTTP://host/x", "s3a://b/x"])
def test_unknown_scheme(uri):
    with pytest.raises(StorageError) as ei:
        open_storage(uri)
    msg = str(ei.value)
    scheme = uri.split("://")[0].lower()
    assert repr(scheme) in msg and "s3://" in msg and "file://" in msg


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix", "s3://bucket/a/../b", "s3://bucket/a//b",
                                 "file://host/x", "file://relative", "file:///x?q=1"])
def test_malformed_uris(uri):
    with pytest.raises(StorageError):
        open_storage(uri)


def test_local_uri_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_path = open_storage(str(tmp_path / "ckpt"))
    by_rel = open_storage("ckpt")
    by_file = open_storage(f"file://{tmp_path}/ckpt/")
    assert by_path.uri == by_rel.uri == by_file.uri == f"file://{tmp_path}/ckpt"
    by_rel.write("x", b"1")
    assert by_file.read("x") == b"1"
    copy = pickle.loads(pickle.dumps(by_rel))
    monkeypatch.chdir("/")  # a relative root is resolved at open time, not in the unpickling process
    assert copy.read("x") == b"1"
    with pytest.raises(StorageError, match="takes no options"):
        open_storage(str(tmp_path), endpoint_override="x:1")


def test_local_temp_files_hidden_and_layout(tmp_path):
    store = open_storage(str(tmp_path / "root"))
    store.write("manifests/a.json", b"{}")
    (tmp_path / "root" / "manifests" / ".tmp-b.json.deadbeef").write_bytes(b"partial")
    (tmp_path / "root" / ".tmp-top").write_bytes(b"partial")
    assert store.list() == ["manifests/a.json"]
    assert store.list("manifests/") == ["manifests/a.json"]
    assert (tmp_path / "root" / "manifests" / "a.json").read_bytes() == b"{}"


@pytest.mark.s3
def test_s3_query_params(s3_server, s3_uri):
    base = s3_uri.uri
    query = f"{base}?endpoint_override={s3_server.endpoint}&scheme=http&region=us-east-1"
    store = open_storage(query, access_key="testing", secret_key="testing")
    store.write("q/x", b"via query")
    assert s3_uri.open().read("q/x") == b"via query"
    assert store.uri == query
    assert store.describe() == query
    # Keyword beats query: a bogus endpoint in the query is overridden.
    store2 = open_storage(f"{base}?endpoint_override=127.0.0.1:9&scheme=https", **s3_uri.options)
    assert store2.read("q/x") == b"via query"
    assert "127.0.0.1:9&" not in store2.describe() and s3_server.endpoint in store2.describe()
    # Query values are typed like S3FileSystem wants them.
    open_storage(f"{query}&allow_delayed_open=false&connect_timeout=2", access_key="a", secret_key="b")
    with pytest.raises(StorageError):
        open_storage(f"{query}&allow_delayed_open=maybe")
    with pytest.raises(StorageError, match="no_such_option"):
        open_storage(f"{query}&no_such_option=1")


@pytest.mark.s3
def test_s3_credentials_never_shown(s3_server, s3_uri):
    secret = "s3cr3t-Value-42"
    bucket_path = s3_uri.uri[len("s3://"):]
    uri = (f"s3://AKIDEXAMPLE:{secret}@{bucket_path}?endpoint_override={s3_server.endpoint}"
           f"&scheme=http&region=us-east-1")
    store = open_storage(uri)
    store.write("k", b"v")  # moto accepts any credentials
    kw = open_storage(s3_uri.uri, **{**s3_uri.options, "secret_key": secret})
    qs = open_storage(f"{s3_uri.uri}?secret_key={secret}&access_key=AKID", **{
        k: v for k, v in s3_uri.options.items() if k not in ("access_key", "secret_key")})
    for s in (store, kw, qs):
        for text in (s.uri, s.describe(), repr(s)):
            assert secret not in text and "AKIDEXAMPLE" not in text
    with pytest.raises(ObjectNotFound) as ei:
        store.read("missing")
    assert secret not in str(ei.value)
    with pytest.raises(StorageError) as ei:
        open_storage(f"gs://AKID:{secret}@b/x")
    assert secret not in str(ei.value)


@pytest.mark.s3
def test_s3_env_options(s3_server, s3_uri, monkeypatch):
    s3_uri.open().write("e/x", b"env")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    store = open_storage(s3_uri.uri)
    assert store.read("e/x") == b"env"
    assert store.describe() == f"{s3_uri.uri}?endpoint_override={s3_server.endpoint}&scheme=http&region=us-east-1"
    # Secrets resolved from the env travel only through the secret channel; the endpoint and region travel as
    # options (a process without the opener's env still reaches the same server).
    from ray_ckpt.storage import s3 as s3mod
    monkeypatch.setattr(s3mod, "_SEAL", _InProcessSeal)
    blob = pickle.dumps(store)
    assert b"testing" not in blob
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    assert pickle.loads(blob).read("e/x") == b"env"
    # Query beats env.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://127.0.0.1:9")
    q = open_storage(f"{s3_uri.uri}?endpoint_override={s3_server.endpoint}&scheme=http", **s3_uri.options)
    assert q.read("e/x") == b"env"


def test_resolve_s3_options_precedence():
    env = {"AWS_ENDPOINT_URL": "http://env:1", "AWS_ACCESS_KEY_ID": "ek", "AWS_SECRET_ACCESS_KEY": "es",
           "AWS_SESSION_TOKEN": "et", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert resolve_s3_options({}, {}, env) == {
        "endpoint_override": "env:1", "scheme": "http", "region": "eu-west-1",
        "access_key": "ek", "secret_key": "es", "session_token": "et"}
    got = resolve_s3_options({"endpoint_override": "q:2", "region": "q-r"}, {"region": "kw-r"}, env)
    assert got["endpoint_override"] == "q:2" and got["scheme"] == "http" and got["region"] == "kw-r"
    # Credentials are one group: a key from the keyword is never paired with the env's secret or token.
    got = resolve_s3_options({}, {"access_key": "kk", "secret_key": "ks"}, env)
    assert (got["access_key"], got["secret_key"], "session_token" in got) == ("kk", "ks", False)
    got = resolve_s3_options({}, {"anonymous": True}, env)
    assert "access_key" not in got and got["anonymous"] is True
    assert resolve_s3_options({}, {"region": None}, {}) == {}
    assert resolve_s3_options({}, {}, {"AWS_ENDPOINT_URL": "host:3", "AWS_REGION": "r1",
                                       "AWS_DEFAULT_REGION": "r2"}) == {"endpoint_override": "host:3",
                                                                        "region": "r1"}


def test_parse_s3_uri_resolves_without_pyarrow_and_shows_no_secret():
    """URI credentials, query and keyword options resolve in the opening process without pyarrow (the S3 client is
    built only by the backend); the parsed location's repr and URI hold no secret."""
    code = ("import sys\n"
            "from ray_ckpt.storage.s3_options import parse_s3_uri\n"
            "loc = parse_s3_uri('s3://KEY:SECRET1@b/run%20a/?region=q&session_token=SECRET2', {'region': 'kw'}, {})\n"
            "assert (loc.bucket, loc.prefix, loc.uri) == ('b', 'run a', 's3://b/run%20a?region=q'), loc\n"
            "assert loc.options == {'region': 'kw', 'access_key': 'KEY', 'secret_key': 'SECRET1',\n"
            "                       'session_token': 'SECRET2'}, loc.options\n"
            "assert 'SECRET' not in repr(loc), repr(loc)\n"
            "assert 'pyarrow' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.s3
def test_s3_options_the_writer_cannot_honour_are_refused(s3_uri):
    with pytest.raises(StorageError, match="role_arn.*AWS profile"):
        s3_uri.open(role_arn="arn:aws:iam::123456789012:role/x")
    store = s3_uri.open(background_writes=False)  # pyarrow-only: writes go through s3fs, so it is harmless
    store.write("k", b"v")
    assert store.read("k") == b"v"


@pytest.mark.s3
def test_s3_failed_multipart_upload_is_aborted(s3_uri):
    """A write that fails after some parts were uploaded leaves no visible object (the old one stays), no
    incomplete multipart upload on the server, and raises a StorageError naming the key."""
    store = s3_uri.open()
    store.write("big", b"old")
    store.part_size = 5 << 20
    fs = store._writer()
    real, calls = fs._call_s3, []

    async def flaky(method, *args, **kwargs):
        calls.append(method)
        if method == "upload_part" and calls.count("upload_part") == 2:
            raise ConnectionResetError("injected: connection reset during part 2")
        return await real(method, *args, **kwargs)

    fs._call_s3 = flaky
    payload = os.urandom(12 << 20)
    with pytest.raises(StorageError, match="cannot write .*big.*reset"):
        store.write("big", [payload[:1000], payload[1000:]])
    assert "create_multipart_upload" in calls and "abort_multipart_upload" in calls
    assert store.read("big") == b"old"
    client = store._list_client()
    bucket = s3_uri.uri[len("s3://"):].split("/")[0]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    fs._call_s3 = real
    store.write("big", payload)  # and a multipart write that succeeds is whole
    assert store.read("big") == payload


@pytest.mark.s3
def test_s3_no_compression_by_extension(s3_server, s3_uri):
    # pyarrow's open_output_stream would gzip a ".gz" key by default; the bytes must be stored as given.
    store = s3_uri.open()
    store.write("x.gz", b"plain bytes")
    store.write("y.zst", b"more")
    assert store.read("x.gz") == b"plain bytes" and store.size("x.gz") == 11
    bucket_path = s3_uri.uri[len("s3://"):]
    with s3_server.filesystem().open_input_file(f"{bucket_path}/x.gz") as f:
        assert f.read() == b"plain bytes"


@pytest.mark.s3
def test_s3_failed_write_publishes_nothing(s3_uri, monkeypatch):
    """A write that fails after some bytes went into the stream must not be committed by the stream's
    destructor (pyarrow closes, i.e. completes, a dropped S3 output stream)."""
    import ray_ckpt.storage.s3 as s3mod

    store = s3_uri.open()
    store.write("obj", b"old version")
    monkeypatch.setattr(s3mod, "as_buffers", lambda data: [memoryview(b"partial"), object()])
    with pytest.raises(TypeError):
        store.write("obj", b"ignored")
    with pytest.raises(TypeError):
        store.write("fresh", b"ignored")
    gc.collect()
    assert store.read("obj") == b"old version"
    assert not store.exists("fresh")
    assert store.list() == ["obj"]


# ---------------------------------------------------------------------------------------------------------
# Local crash consistency
# ---------------------------------------------------------------------------------------------------------
def test_local_write_failure_keeps_old_version(tmp_path, monkeypatch):
    import ray_ckpt.storage.local as local

    store = open_storage(str(tmp_path))
    store.write("d/obj", b"old")

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local.os, "replace", failing_replace)
    with pytest.raises(StorageError) as ei:
        store.write("d/obj", b"new" * 1000)
    assert isinstance(ei.value.__cause__, OSError) and "d/obj" in str(ei.value)
    with pytest.raises(StorageError):
        store.write("d/fresh", b"new")
    monkeypatch.undo()
    assert store.read("d/obj") == b"old"
    assert not store.exists("d/fresh")
    assert sorted(os.listdir(tmp_path / "d")) == ["obj"]  # temp files removed


def test_local_interrupt_mid_write_keeps_old_version(tmp_path, monkeypatch):
    import ray_ckpt.storage.local as local

    store = open_storage(str(tmp_path))
    store.write("obj", b"old")
    real_open = open

    class Interrupting:
        def __init__(self, f):
            self.f, self.n = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, b):
            self.n += 1
            if self.n == 2:
                raise KeyboardInterrupt  # e.g. ray.cancel() while writing
            return self.f.write(b)

    monkeypatch.setattr(local, "open", lambda *a, **k: Interrupting(real_open(*a, **k)), raising=False)
    with pytest.raises(KeyboardInterrupt):
        store.write("obj", [b"new-1", b"new-2", b"new-3"])
    monkeypatch.undo()
    assert store.read("obj") == b"old"
    assert os.listdir(tmp_path) == ["obj"]


_CHILD_PRELUDE = textwrap.dedent("""
    import sys, types
    # Import the storage layer without ray_ckpt/__init__ (which pulls torch): fast, and it proves the
    # layer stands alone.
    pkg = types.ModuleType("ray_ckpt")
    pkg.__path__ = [{pkg_dir!r}]
    sys.modules["ray_ckpt"] = pkg
""")


def _run_child(code: str, *args: str, **kw) -> subprocess.Popen:
    prelude = _CHILD_PRELUDE.format(pkg_dir=str(REPO / "ray_ckpt"))
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_local_sigkill_mid_write(tmp_path):
    """A writer SIGKILLed halfway through an object's bytes leaves the old version and a hidden temp file."""
    root = tmp_path / "root"
    store = open_storage(str(root))
    old = b"old version"
    store.write("manifests/head.json", old)
    child = _run_child("""
        import time
        import ray_ckpt.storage.local as local
        from ray_ckpt.storage import open_storage
        real_open = open

        class Pausing:
            def __init__(self, f):
                self.f, self.n = f, 0
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                self.f.close()
            def write(self, b):
                self.n += 1
                if self.n == 2:  # half of the object is on disk: stop here and wait for the kill
                    self.f.flush()
                    print("MID-WRITE", flush=True)
                    time.sleep(60)
                return self.f.write(b)
            def flush(self):
                self.f.flush()
            def fileno(self):
                return self.f.fileno()

        local.open = lambda *a, **k: Pausing(real_open(*a, **k))
        store = open_storage(sys.argv[1])
        store.write("manifests/head.json", [b"N" * (1 << 20), b"M" * (1 << 20)])
        print("WROTE", flush=True)
    """, str(root))
    try:
        line = child.stdout.readline()
        assert line.strip() == "MID-WRITE", (line, child.stderr.read() if child.poll() is not None else "")
        temps = [p for p in (root / "manifests").iterdir() if p.name.startswith(".tmp-")]
        assert len(temps) == 1 and temps[0].stat().st_size == 1 << 20  # the torn half, under a temp name
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    assert store.read("manifests/head.json") == old
    assert store.list() == ["manifests/head.json"]
    assert store.list("manifests/") == ["manifests/head.json"]
    store.write("manifests/head.json", b"next")  # a later writer is not blocked by the leftover
    assert store.read("manifests/head.json") == b"next"


def test_storage_layer_imports_no_torch_or_ray():
    child = _run_child("""
        import ray_ckpt.storage, ray_ckpt.storage.local, ray_ckpt.storage.s3
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray")))
    """)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.strip() == "[]"


def _resident_pages(path: str) -> tuple[int, int]:
    """``(resident, total)`` pages of ``path`` in the page cache (Linux ``mincore`` on a read-only mapping)."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
                    reason="page-cache residency is read with Linux mincore")
def test_large_local_objects_leave_the_page_cache_once_durable(tmp_path):
    """A checkpoint object of at least DROP_CACHE_MIN_BYTES is not left in the page cache after its fsync
    (issue #11: a long dense run otherwise fills the page cache and every write takes fresh memory); a small one
    (manifests) stays. Both read back byte for byte."""
    from ray_ckpt.storage.local import DROP_CACHE_MIN_BYTES
    b = open_storage(str(tmp_path / "store"))
    big = np.random.default_rng(0).integers(0, 255, size=8 * DROP_CACHE_MIN_BYTES, dtype=np.uint8)
    b.write("objects/big", [big[: len(big) // 2], big[len(big) // 2:]])
    b.write("manifests/small", b"x" * 4096)
    resident, pages = _resident_pages(str(tmp_path / "store" / "objects" / "big"))
    assert pages >= 2048 and resident <= pages // 10, (resident, pages)
    small_resident, small_pages = _resident_pages(str(tmp_path / "store" / "manifests" / "small"))
    assert small_resident == small_pages == 1
    assert b.read("objects/big") == big.tobytes() and b.read("manifests/small") == b"x" * 4096
