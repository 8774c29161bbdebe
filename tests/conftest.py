"""Shared pytest fixtures.

Storage (``s3_server``, ``s3_uri``, ``storage_uri``): a real moto S3 server over HTTP, started once per
session on a free loopback port, only when a test asks for it. A test that takes ``storage_uri`` runs once
per backend::

    def test_roundtrip(storage_uri):
        store = storage_uri.open()          # == open_storage(storage_uri.uri, **storage_uri.options)
        store.write("a/b", b"x")

Keep each group of fixtures in its own section; add new groups below.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.ray_cluster import close_leftovers, ray_cluster  # noqa: F401 - the session's multi-node Ray cluster

# The suite runs the defaults users get (the overhead budget, keep_fulls=2): a test that needs another setting
# (every step recorded, every step kept, a pinned granularity) sets it in its own code, never here.

# The suite's models are tiny: torch's intra-op threads (one per core by default) only contend with the writer
# threads and the Ray processes for the 2 cores of the test machine; a 60-step loop took 10-50x longer with 2
# threads than with 1 when the machine was busy. Set before torch is imported (by the test modules, collected
# after this file), so the test process and every subprocess of the session inherit it (Ray workers and the gloo
# ranks of tests._training.init_dist run with one thread already).
os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---------------------------------------------------------------------------------------------------------
# Long tests: `make test` skips them; `pytest --run-long` (or `make reliability`) runs them.
# ---------------------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--run-long", action="store_true", default=False,
                     help="also run tests marked `long` (soak, full-size fuzz, fault trials)")


def pytest_configure(config):
    config.addinivalue_line("markers", "fault: a fault trial of tests/reliability (set by conftest for every test "
                                       "there); `make test` runs them outside its pytest-xdist tier")


_RELIABILITY_DIR = Path(__file__).resolve().parent / "reliability"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A ``ray`` test that leaves a Checkpointer open (a failed assertion before ``close()``) must not leave its
    sender thread talking to the session's cluster into the next tests and past the session's Ray shutdown: what it
    opened and left open is closed right after it ran (before its fixtures' teardown, e.g. ``shutdown_run``, while
    the run's actors still answer) and named in a warning. Cheap: a set of weak references before and after."""
    if item.get_closest_marker("ray") is None:
        yield
        return
    import weakref
    from ray_ckpt.engine.attachment import open_attachments
    before = weakref.WeakSet(open_attachments())
    yield
    left = [a for a in open_attachments() if a not in before]
    if left:
        item.warn(pytest.PytestWarning(f"{item.nodeid} left {len(left)} Checkpointer(s) open; closed them: "
                                       f"{'; '.join(close_leftovers(left))}"))


def pytest_collection_modifyitems(config, items):
    # the fast tier (`make test-fast`, `-m "not ray and not procs"`) must not start Ray by an omitted marker:
    # whatever takes the session's Ray cluster is a `ray` test
    for item in items:
        if _RELIABILITY_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.fault)
        if "ray_cluster" in getattr(item, "fixturenames", ()) and "ray" not in item.keywords:
            item.add_marker(pytest.mark.ray)
        # under pytest-xdist (`pytest -n 2 --dist loadgroup`) every Ray test runs in one worker, one after
        # another, on that worker's one session cluster; the other worker takes everything else
        if "ray" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("ray"))
    if config.getoption("--run-long"):
        return
    skip = pytest.mark.skip(reason="long test: run with --run-long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------------------
# Storage targets
# ---------------------------------------------------------------------------------------------------------
class StorageTarget(NamedTuple):
    """A storage root and the keyword options to open it with; unpacks as ``uri, options = target``."""

    uri: str
    options: dict

    def open(self, **overrides):
        """``open_storage(uri, **options, **overrides)``."""
        from ray_ckpt.storage import open_storage

        return open_storage(self.uri, **{**self.options, **overrides})


MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"
MOTO_REGION = "us-east-1"
_MOTO_START_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command(port: int) -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    if found:
        return [found, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via HTTP(S)_PROXY


def _answers_http(url: str) -> bool:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class MotoS3Server:
    """A moto S3 server subprocess on ``127.0.0.1:<port>`` (see the ``s3_server`` fixture)."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        #: ``host:port``, as pyarrow's ``endpoint_override`` takes it.
        self.endpoint = f"127.0.0.1:{port}"
        #: ``http://host:port``, as boto3 / ``AWS_ENDPOINT_URL`` take it.
        self.url = f"http://{self.endpoint}"
        #: Keyword options for ``open_storage`` (and ``pyarrow.fs.S3FileSystem``).
        self.options = {
            "endpoint_override": self.endpoint,
            "scheme": "http",
            "access_key": MOTO_ACCESS_KEY,
            "secret_key": MOTO_SECRET_KEY,
            "region": MOTO_REGION,
        }
        self._fs = None

    def filesystem(self):
        """A ``pyarrow.fs.S3FileSystem`` on this server that may create buckets (for test setup)."""
        if self._fs is None:
            import pyarrow.fs as pafs

            self._fs = pafs.S3FileSystem(allow_bucket_creation=True, **self.options)
        return self._fs

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (3-63 chars: lowercase letters, digits, '-') and return ``"s3://name"``."""
        self.filesystem().create_dir(name)
        return f"s3://{name}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Session-wide moto S3 server over real HTTP: ``.endpoint``, ``.options``, ``.make_bucket(name)``.

    The AWS variables it needs are set in the server's environment only. For the test process this sets
    ``AWS_EC2_METADATA_DISABLED=true`` for the session (the AWS SDK in pyarrow otherwise may probe the EC2
    metadata service), restored at the end. Fails (not skips) when moto cannot start: it is a test extra.
    """
    log_dir = tmp_path_factory.mktemp("moto")
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": MOTO_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": MOTO_SECRET_KEY,
        "AWS_DEFAULT_REGION": MOTO_REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    errors = []
    for attempt in range(3):  # the free port may be taken between probing and binding: retry
        port = _free_port()
        log_path = log_dir / f"moto-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(_moto_command(port), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        server = MotoS3Server(proc, port, log_path)
        deadline = time.monotonic() + _MOTO_START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not _answers_http(server.url + "/"):
            time.sleep(0.1)
        if proc.poll() is None and _answers_http(server.url + "/"):
            break
        _stop(proc)
        errors.append(f"attempt {attempt + 1} (port {port}, rc={proc.returncode}):\n{server.log_tail()}")
    else:
        pytest.fail("moto S3 server did not start:\n" + "\n".join(errors), pytrace=False)

    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    try:
        yield server
    finally:
        server._fs = None
        mp.undo()
        _stop(proc)


_bucket_counter = itertools.count()


def _bucket_name(test_name: str) -> str:
    """A fresh, valid bucket name that says which test made it."""
    stem = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:40].strip("-") or "t"
    return f"{stem}-{next(_bucket_counter)}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_uri(s3_server, request) -> StorageTarget:
    """A fresh bucket per test: ``StorageTarget("s3://<bucket>/run", <options for open_storage>)``."""
    bucket = s3_server.make_bucket(_bucket_name(request.node.name))
    return StorageTarget(f"{bucket}/run", dict(s3_server.options))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def storage_uri(request, tmp_path) -> StorageTarget:
    """Each backend in turn, as a ``StorageTarget(uri, options)``: local (under tmp_path), then S3 (moto).

    The moto server is started only when an S3 case runs (deselect with ``-m "not s3"``).
    """
    if request.param == "local":
        return StorageTarget(str(tmp_path / "store"), {})
    return request.getfixturevalue("s3_uri")


# ---------------------------------------------------------------------------------------------------------
# The reliability table: rows recorded by a test travel on its report (so they reach the controller process
# under pytest-xdist) and are printed once at the end
# ---------------------------------------------------------------------------------------------------------
_RELIABILITY_KEY = "reliability_rows"
_reported_rows: list[dict] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    from tests.reliability import ROWS
    outcome = yield
    if ROWS:   # recorded during this phase of this test
        outcome.get_result().user_properties.append((_RELIABILITY_KEY, list(ROWS)))
        ROWS.clear()


def pytest_runtest_logreport(report):
    for key, rows in report.user_properties:
        if key == _RELIABILITY_KEY:
            _reported_rows.extend(rows)


def pytest_terminal_summary(terminalreporter):
    """The reliability table (tests/reliability), when any fault trials ran in this session."""
    from tests.reliability import table
    if _reported_rows:
        terminalreporter.write_sep("=", "reliability: faults injected, outcomes")
        terminalreporter.write_line(table(_reported_rows))

