"""One error base: every exception class defined in ray_ckpt derives from ``ray_ckpt.RayCkptError`` and keeps its
builtin base; the public ones are exported. Storage faults while the writer lease is renewed surface (and are
logged) as storage errors. No Ray."""
from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil

import pytest

import ray_ckpt
from ray_ckpt.engine.lease import LEASE_KEY, Lease
from ray_ckpt.storage import StorageError, open_storage

PUBLIC = {"NoCheckpointError": LookupError, "CorruptObjectError": ValueError, "ManifestError": ValueError,
          "WriterError": RuntimeError, "LeaseError": RuntimeError, "LeaseLost": RuntimeError,
          "RestoreError": RuntimeError, "StorageError": Exception, "ObjectNotFound": FileNotFoundError,
          "ExportError": ValueError, "CompressionExchangeError": RuntimeError}


def _exception_classes() -> list[type]:
    """Every BaseException subclass defined in a ray_ckpt module (each module imported)."""
    found = {}
    for info in pkgutil.walk_packages(ray_ckpt.__path__, "ray_ckpt."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("ray_ckpt"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_exception_class_derives_from_the_exported_base():
    classes = _exception_classes()
    assert len(classes) >= len(PUBLIC) + 1, classes
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, ray_ckpt.RayCkptError))
    assert not outside, f"not derived from ray_ckpt.RayCkptError: {outside}"


def test_the_public_errors_are_exported_and_keep_their_builtin_bases():
    assert "RayCkptError" in ray_ckpt.__all__ and ray_ckpt.RayCkptError.__module__ == "ray_ckpt.errors"
    for name, builtin in PUBLIC.items():
        cls = getattr(ray_ckpt, name)
        assert name in ray_ckpt.__all__ and cls.__name__ == name
        assert issubclass(cls, ray_ckpt.RayCkptError) and issubclass(cls, builtin), name
    assert importlib.import_module("ray_ckpt.train").RestoreError is ray_ckpt.RestoreError
    assert importlib.import_module("ray_ckpt.compression").CompressionExchangeError is ray_ckpt.CompressionExchangeError
    with pytest.raises(ValueError):   # an old ``except ValueError`` still catches it
        raise ray_ckpt.CorruptObjectError("x", "bad magic")


class _Outage:
    """A lineage's storage with conditional writes whose lease calls fail as ``mode`` says, once ``down`` is set:
    ``"raise"`` (a backend's own exception type), ``"none"`` (it answers nothing), ``"storage"`` (a StorageError)."""

    def __init__(self, inner, mode: str):
        self.inner, self.mode, self.down = inner, mode, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _fail(self):
        if self.mode == "raise":
            raise TimeoutError("read timed out")
        if self.mode == "storage":
            raise StorageError("cannot read lease.json: connection refused")
        return None

    def read_versioned(self, key):
        return self._fail() if self.down else self.inner.read_versioned(key)

    def replace_if(self, key, data, version):
        return self._fail() if self.down else self.inner.replace_if(key, data, version)


@pytest.mark.parametrize("mode", ["raise", "none", "storage"])
def test_storage_faults_while_renewing_the_lease_are_storage_errors(tmp_path, mode):
    storage = _Outage(open_storage(str(tmp_path / "ckpt")), mode)
    lease = Lease(storage, run="r")
    lease.acquire()
    storage.down = True
    with pytest.raises(StorageError, match="lease"):
        lease.renew(force=True)
    storage.down = False
    lease.renew(force=True)   # the outage is over: renewed, still ours
    assert storage.inner.read(LEASE_KEY)


def test_the_coordinator_logs_a_failed_renewal_as_a_storage_error_and_retries(tmp_path, caplog):
    """The coordinator's lease renewal (:class:`~ray_ckpt.runtime.coordination.reporting.LeaseKeeper`, no Ray): a
    storage error is logged as one (WARNING once, then INFO), never as an AttributeError, and the lease is not
    declared lost."""
    from ray_ckpt.runtime.coordination.reporting import LeaseKeeper
    storage = _Outage(open_storage(str(tmp_path / "ckpt")), "none")
    keeper = LeaseKeeper(Lease(storage, run="r"))
    keeper.lease.acquire()
    keeper.lease._renewed = -1e9   # due: each renewal reads and writes
    storage.down = True
    with caplog.at_level(logging.INFO, logger="ray_ckpt"):
        keeper.renew()
        keeper.renew()
    assert keeper.lost is None
    failed = [r for r in caplog.records if "renewing the writer lease" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.WARNING, logging.INFO], caplog.text
    assert "AttributeError" not in caplog.text and "NoneType" not in caplog.text
    storage.down = False
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ray_ckpt"):
        keeper.renew()
    assert "renewed again" in caplog.text and not keeper._failing


def test_an_s3_timeout_without_a_response_is_a_storage_error():
    """botocore's connection errors and timeouts carry ``response=None``: reading the lease during an S3 outage
    raised AttributeError ('NoneType' object has no attribute 'get') instead of a StorageError."""
    botocore = pytest.importorskip("botocore.exceptions")
    from ray_ckpt.storage import s3

    class Client:
        def get_object(self, **kw):
            raise botocore.ReadTimeoutError(endpoint_url="http://127.0.0.1:9")

        put_object = get_object

    backend = object.__new__(s3.S3Backend)
    backend.bucket, backend.prefix, backend.base_uri = "b", "", "s3://b"
    backend._conditional_client = Client
    assert s3._error_code(botocore.ReadTimeoutError(endpoint_url="x")) is None
    with pytest.raises(StorageError, match="cannot read s3://b/lease.json"):
        backend.read_versioned(LEASE_KEY)
    with pytest.raises(StorageError, match="cannot replace"):
        backend.replace_if(LEASE_KEY, b"{}", '"etag"')
