"""Local (POSIX) filesystem backend: ``/abs/path``, ``relative/path`` or ``file:///abs/path``.

Implemented with ``os`` directly, because durability needs fsync (pyarrow's LocalFileSystem has none).
A write goes to ``<dir>/.tmp-<name>.<random>`` in the destination folder, is flushed and fsynced, renamed
over the destination with ``os.replace`` (atomic on POSIX), and the folder is fsynced. A writer killed
mid-write leaves only a ``.tmp-*`` file, which readers and ``list()`` ignore.

Once fsynced, the pages of an object of at least ``DROP_CACHE_MIN_BYTES`` are dropped from the page cache
(``POSIX_FADV_DONTNEED``): checkpoint bytes are read back only by a restore, and a run writing every step's
gradients (GBs an hour) would otherwise fill the page cache with them, evicting the pages training reads and
making the kernel allocate fresh memory for every write, many times the CPU of a write whose pages are dropped
(figures: docs/benchmark-log.md). A restore
then reads from the disk, as it would after any real failure.

Runs in any process; thread-safe (no shared mutable state; temp names are unique per write).
"""
from __future__ import annotations

import os
import uuid
from urllib.parse import quote

from .base import TMP_PREFIX, Data, ObjectNotFound, StorageError, as_buffers, validate_key, validate_prefix


#: objects at least this large leave the page cache once durable (see the module docstring)
DROP_CACHE_MIN_BYTES = 1 << 20


def _drop_cached(fd: int) -> None:
    """Drop ``fd``'s clean pages from the page cache (a hint: no effect where unsupported)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBackend:
    """Objects are files below ``root`` (an absolute path); keys map to relative paths.

    Picklable: rebuilt from its absolute root, so a copy shipped to a Ray actor on the same machine (or on
    another node with a shared filesystem at the same path) sees the same objects regardless of its cwd.
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        #: Canonical root URI (``file://`` + absolute path, percent-encoded).
        self.uri = "file://" + quote(self.root, safe="/")

    # ---- pickling -------------------------------------------------------------------------------------
    def __reduce__(self):
        return (LocalBackend, (self.root,))

    def __repr__(self) -> str:
        return f"LocalBackend({self.uri!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, LocalBackend) and other.root == self.root

    def __hash__(self) -> int:
        return hash(("local", self.root))

    def describe(self) -> str:
        """The root URI (``file:///...``); local storage has no secrets. Runs anywhere."""
        return self.uri

    # ---- helpers --------------------------------------------------------------------------------------
    def key_uri(self, key: str) -> str:
        """Full URI of ``key`` (for messages)."""
        return f"{self.uri}/{quote(key, safe='/')}"

    def _path(self, key: str) -> str:
        validate_key(key)
        path = os.path.join(self.root, *key.split("/"))
        # Defense in depth: validate_key already excludes every way out of the root.
        if os.path.commonpath([self.root, path]) != self.root or path == self.root:
            raise StorageError(f"invalid storage key {key!r}: resolves outside {self.uri}")
        return path

    def _ensure_dir(self, d: str) -> None:
        """Create ``d`` and its missing parents, fsyncing each parent so the new entries are durable."""
        if os.path.isdir(d):
            return
        missing = []
        p = d
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        for m in reversed(missing):
            try:
                os.mkdir(m)
            except FileExistsError:
                if not os.path.isdir(m):
                    raise
                continue
            _fsync_dir(os.path.dirname(m))

    # ---- protocol -------------------------------------------------------------------------------------
    def write(self, key: str, data: Data) -> None:
        """Atomically store ``data`` at ``key`` (temp file, fsync, ``os.replace``, fsync folder); a large
        object's pages then leave the page cache.

        Runs in any process; thread-safe. Concurrent writers of one key: the last rename wins, whole.
        """
        path = self._path(key)
        buffers = as_buffers(data)
        folder, name = os.path.split(path)
        # The temp name must stay short enough for NAME_MAX (255) even for a long final name.
        tmp = os.path.join(folder, f"{TMP_PREFIX}{name[:200]}.{uuid.uuid4().hex[:12]}")
        try:
            self._ensure_dir(folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise StorageError(f"cannot write {self.key_uri(key)}: {e}") from e
        try:
            try:
                with open(fd, "wb", closefd=True) as f:
                    for buf in buffers:
                        f.write(buf)
                    f.flush()
                    os.fsync(f.fileno())
                    if f.tell() >= DROP_CACHE_MIN_BYTES:
                        _drop_cached(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            _fsync_dir(folder)
        except OSError as e:
            raise StorageError(f"cannot write {self.key_uri(key)}: {e}") from e

    # ---- conditional writes (the writer lease) ----------------------------------------------------------------
    def _locked(self, path: str):
        """An exclusive ``flock`` on ``<path>.lock``: conditional writes of one key exclude each other across
        processes on this file system."""
        import contextlib
        import fcntl

        @contextlib.contextmanager
        def cm():
            self._ensure_dir(os.path.dirname(path))
            fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock
        return cm()

    @staticmethod
    def _version(path: str) -> str:
        st = os.stat(path)
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def create(self, key: str, data: Data) -> bool:
        """Create ``key`` only if absent (under the key's lock). Any process; thread-safe."""
        path = self._path(key)
        try:
            with self._locked(path):
                if os.path.exists(path):
                    return False
                self.write(key, data)
                return True
        except OSError as e:
            raise StorageError(f"cannot create {self.key_uri(key)}: {e}") from e

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            with self._locked(path):
                return self.read(key), self._version(path)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {self.key_uri(key)}") from None
        except OSError as e:
            raise StorageError(f"cannot read {self.key_uri(key)}: {e}") from e

    def replace_if(self, key: str, data: Data, version: str) -> bool:
        """Replace ``key`` if it is still at ``version`` (under the key's lock). Any process; thread-safe."""
        path = self._path(key)
        try:
            with self._locked(path):
                try:
                    if self._version(path) != version:
                        return False
                except FileNotFoundError:
                    return False
                self.write(key, data)
                return True
        except OSError as e:
            raise StorageError(f"cannot replace {self.key_uri(key)}: {e}") from e

    def read(self, key: str) -> bytes:
        """Return the whole object. Runs in any process; thread-safe."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise ObjectNotFound(f"no object at {self.key_uri(key)}") from e
        except OSError as e:
            raise StorageError(f"cannot read {self.key_uri(key)}: {e}") from e

    def size(self, key: str) -> int:
        """Size in bytes of the object. Runs in any process; thread-safe."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ObjectNotFound(f"no object at {self.key_uri(key)}") from e
        except OSError as e:
            raise StorageError(f"cannot stat {self.key_uri(key)}: {e}") from e
        if not os.path.isfile(path):
            raise ObjectNotFound(f"no object at {self.key_uri(key)} (it is a folder)")
        return st.st_size

    def exists(self, key: str) -> bool:
        """Whether the object exists (a folder is not an object). Runs in any process; thread-safe."""
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, recursive, sorted; skips ``.tmp-*`` temp files and invalid names.

        Runs in any process; thread-safe. Does not follow symlinked folders.
        """
        validate_prefix(prefix)
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = os.path.join(self.root, *base_rel.split("/")) if base_rel else self.root
        keys = []

        def onerror(e: OSError) -> None:
            if not isinstance(e, (FileNotFoundError, NotADirectoryError)):
                raise StorageError(f"cannot list {self.uri}/{prefix}: {e}") from e

        for dirpath, dirnames, filenames in os.walk(base, onerror=onerror):
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                key = rel_dir + name
                if not key.startswith(prefix):
                    continue
                try:
                    validate_key(key)
                except StorageError:
                    continue  # not addressable through this API (e.g. a control character in the name)
                if os.path.isfile(os.path.join(dirpath, name)):
                    keys.append(key)
        keys.sort()
        return keys

    def delete(self, key: str) -> None:
        """Remove the object; a missing one (or a folder) is not an error. Runs in any process; thread-safe.

        Empty folders are left in place (removing them would race with concurrent writers).
        """
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except (IsADirectoryError, PermissionError) as e:
            if os.path.isdir(path):  # Linux reports EISDIR; macOS EPERM
                return
            raise StorageError(f"cannot delete {self.key_uri(key)}: {e}") from e
        except OSError as e:
            raise StorageError(f"cannot delete {self.key_uri(key)}: {e}") from e
