"""The under-store: where the local store persists files (any fsspec URL).

Writes are staged and published in two steps so the catalog can decide, inside its own
transaction, whether a staged copy still belongs to the current version of the file:

- ``file://`` under-stores stage a hidden temporary file next to the target, ``fsync`` it,
  and publish with an atomic ``rename`` plus an ``fsync`` of the directory, so a crash never
  leaves half a file under the final name.  Every local path is checked to stay inside the
  under-store root after resolving symlinks.
- other filesystems (HDFS, S3, ...) stage under a temporary key and publish with the
  filesystem's move; object stores make the upload itself atomic.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import fsspec

from adcloud._crc import crc32
from adcloud.store._streams import WriteStream
from adcloud.store.errors import (
    InvalidPathError,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
)

__all__ = ["StagingWriter", "UfsStaging", "UnderStore"]

_TMP_MARK = ".adcloud-tmp-"
_GLOB_MAGIC = re.compile(r"([*?\[])")
#: Bytes a name may have on the file systems under-stores live on (ext4, xfs, tmpfs, HDFS).
_NAME_MAX = 255
#: The most a staging name adds to its file's name: ``.`` + mark + pid + ``-`` + 12 hex.
_TAG_MAX = 1 + len(_TMP_MARK) + 7 + 1 + 12


def staging_stem(name: str) -> str:
    """The part of a staging file's name that stands for the file ``name``: ``name`` itself,
    or for a name too long to carry the staging tag within the 255 bytes a name may have
    (store paths allow segments of 255 bytes), a digest of it.  Both halves of a staging
    name must fit: a name over the limit failed every persist and THROUGH write of the
    file with ENAMETOOLONG."""
    if len(name.encode("utf-8")) + _TAG_MAX <= _NAME_MAX:
        return name
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]


def has_glob(path: str) -> bool:
    """Whether fsspec would take ``path`` for a glob pattern (``*``, ``?`` or ``[``)."""
    return _GLOB_MAGIC.search(path) is not None


def remove_literal(fs: Any, path: str, *, recursive: bool = False) -> None:
    """``fs.rm(path, recursive=...)`` with ``path`` taken literally.

    Most fsspec filesystems (memory, s3fs, gcsfs, ...) take a path holding ``*``, ``?`` or
    ``[`` as a pattern, so removing ``f?.bin`` would remove ``f1.bin`` and ``f2.bin`` too;
    such a path is removed file by file (``rm_file`` never expands), then its directories.
    """
    if not has_glob(path):
        fs.rm(path, recursive=recursive)
        return
    if not fs.isdir(path):
        fs.rm_file(path)
        return
    entries = fs.find(path, withdirs=True, detail=True) if recursive else {}
    dirs = [path]
    for name, info in entries.items():
        if info.get("type") == "directory":
            dirs.append(name)
        else:
            fs.rm_file(name)
    for name in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
        with contextlib.suppress(OSError):  # object stores: no directory objects to remove
            fs.rmdir(name)


def move_literal(fs: Any, src: str, dst: str) -> None:
    """Move the file or tree ``src`` to ``dst`` on ``fs``, both names taken literally
    (fsspec never expands the names in lists of sources and targets; see
    :func:`remove_literal`)."""
    prefix = fs._strip_protocol(src).rstrip("/")
    files = [f for f in fs.find(src) if _TMP_MARK not in f]
    if files:
        fs.copy(files, [dst.rstrip("/") + f[len(prefix) :] for f in files])
    with contextlib.suppress(FileNotFoundError):
        remove_literal(fs, src, recursive=True)


def _local_root(url: str) -> Path | None:
    if "://" not in url:
        return Path(url).expanduser()
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in ("file", "local"):
        return None
    return Path(rest or "/").expanduser()


class UfsStaging:
    """A file being written to the under-store; invisible until :meth:`publish`."""

    def __init__(self, ufs: UnderStore, key: str) -> None:
        self._ufs = ufs
        self._key = key
        self.size = 0
        self.crc = 0
        self._published = False
        self._marker: Path | None = None
        if ufs.local_root is not None:
            final = ufs.local_path(key, create_parents=True)
            self._final: str = str(final)
            tag = f"{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}"
            self._tmp: str = str(final.parent / f".{staging_stem(final.name)}{tag}")
            self._marker = ufs.register_staging(self._tmp, key)
            try:
                fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as err:
                self._forget()
                raise ufs.error(err, key) from err
            self._file: BinaryIO = os.fdopen(fd, "wb", buffering=0)
        else:
            fs = cast(Any, ufs.fs)
            self._final = ufs.remote_path(key)
            head, _, name = self._final.rpartition("/")
            self._tmp = f"{head}/{_TMP_MARK}{uuid.uuid4().hex[:12]}-{staging_stem(name)}"
            self._marker = ufs.register_staging(self._tmp, key)
            with contextlib.suppress(Exception):
                fs.makedirs(head, exist_ok=True)
            try:
                self._file = fs.open(self._tmp, "wb")
            except BaseException:
                self._forget()
                raise

    @property
    def published(self) -> bool:
        """Whether :meth:`publish` moved the staged file to its final name."""
        return self._published

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` (CRC-32 and size are tracked)."""
        view = memoryview(data).cast("B")
        self.crc = crc32(view, self.crc)
        try:
            written = 0
            while written < len(view):
                n = self._file.write(view[written:])
                written += len(view) - written if n is None else n
        except OSError as err:
            self.discard()
            raise self._ufs.error(err, self._key) from err
        self.size += len(view)

    def finish(self) -> None:
        """Make the staged bytes durable (fsync for local under-stores) and close them."""
        try:
            if self._ufs.local_root is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
        except OSError as err:
            self.discard()
            raise self._ufs.error(err, self._key) from err

    def publish(self) -> None:
        """Move the staged file to its final name (atomic for local under-stores)."""
        try:
            if self._ufs.local_root is not None:
                Path(self._tmp).replace(self._final)
                _fsync_dir(str(Path(self._final).parent))
            else:
                fs = cast(Any, self._ufs.fs)
                if has_glob(self._tmp):
                    # lists: fsspec takes no name in them for a glob pattern
                    fs.copy([self._tmp], [self._final])
                    fs.rm_file(self._tmp)
                else:
                    fs.mv(self._tmp, self._final)
        except OSError as err:
            self.discard()
            raise self._ufs.error(err, self._key) from err
        self._published = True
        self._forget()

    def discard(self) -> None:
        """Drop the staged bytes (no error if they are already gone)."""
        with contextlib.suppress(Exception):
            self._file.close()
        if self._published:
            return
        with contextlib.suppress(Exception):
            if self._ufs.local_root is not None:
                Path(self._tmp).unlink()
            else:
                cast(Any, self._ufs.fs).rm_file(self._tmp)
        self._forget()

    def _forget(self) -> None:
        """The staged file is published or gone: drop its registry entry."""
        if self._marker is not None:
            with contextlib.suppress(OSError):
                self._marker.unlink()
            self._marker = None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class UnderStore:
    """The under file system at ``url``; keys are normalized store paths below its root."""

    def __init__(
        self, url: str, *, staging_registry: Path | None = None, **storage_options: Any
    ) -> None:
        self.url = url
        #: Where each staging file in progress is recorded (``<pid>-<random>``, holding the
        #: staging file's path) until it is published or discarded, so that the staging
        #: files of a writer killed mid-write can be found without listing the under-store.
        self.staging_registry = staging_registry
        if staging_registry is not None:
            staging_registry.mkdir(parents=True, exist_ok=True)
        self.local_root = _local_root(url) if not storage_options else None
        self.fs: object | None = None
        if self.local_root is not None:
            self.local_root.mkdir(parents=True, exist_ok=True)
            self._real_root = os.path.realpath(self.local_root)
        else:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
            self.fs = fs
            self._remote_root = str(root).rstrip("/")

    def error(self, err: OSError, key: str) -> StoreError:
        """A :class:`StoreError` for an I/O failure on ``key`` in the under-store."""
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFullError(
                f"under-store {self.url} is out of space writing {key}: {err}; free space "
                "there or point ADCLOUD_STORE_UFS at a larger store"
            )
        if isinstance(err, FileNotFoundError):
            return StoreNotFoundError(f"{key} is not in the under-store {self.url}")
        return StoreError(f"under-store {self.url}: {key}: {err}")

    def local_path(self, key: str, *, create_parents: bool = False) -> Path:
        """The local file for ``key``, refusing any path that resolves outside the root."""
        assert self.local_root is not None
        path = self.local_root / key.lstrip("/")
        if create_parents:
            self._make_parents(path, key)
        self._confine(path, key)
        return path

    def _make_parents(self, path: Path, key: str) -> None:
        """Create the missing directories above ``path`` one level at a time, each only once
        the level above it is known to resolve inside the root: ``mkdir(parents=True)``
        would follow a planted symlink and create directories outside before any check."""
        assert self.local_root is not None
        missing: list[Path] = []
        parent = path.parent
        while parent != self.local_root and not os.path.lexists(parent):
            missing.append(parent)
            parent = parent.parent
        try:
            if parent == self.local_root:
                parent.mkdir(parents=True, exist_ok=True)  # the configured root is trusted
            self._confine(parent, key)
            for level in reversed(missing):
                level.mkdir(exist_ok=True)
                self._confine(level, key)
        except OSError as err:
            raise self.error(err, key) from err

    def _confine(self, path: Path, key: str) -> None:
        """Refuse ``path`` (standing for ``key``) if it resolves outside the root."""
        real = os.path.realpath(path)
        inside = self._real_root if self._real_root.endswith(os.sep) else self._real_root + os.sep
        if real != self._real_root and not real.startswith(inside):
            raise InvalidPathError(
                f"{key} resolves outside the under-store root {self.local_root} (a symlink?); "
                "remove the symlink from the under-store or write to another path"
            )

    def remote_path(self, key: str) -> str:
        """The filesystem path of ``key`` on a remote under-store."""
        return f"{self._remote_root}/{key.lstrip('/')}"

    def register_staging(self, tmp: str, key: str) -> Path | None:
        """Record staging file ``tmp`` (of ``key``) before it is created; None without a
        registry."""
        if self.staging_registry is None:
            return None
        marker = self.staging_registry / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            marker.write_text(tmp)
        except OSError as err:
            raise self.error(err, key) from err
        return marker

    def remove_abandoned_staging(self, alive: Callable[[int], bool]) -> int:
        """Delete the staging files that writers which died mid-write left behind (found in
        the registry; a writer still alive keeps its own).  Returns how many were removed."""
        if self.staging_registry is None:
            return 0
        removed = 0
        for marker in self.staging_registry.iterdir():
            pid = marker.name.split("-", 1)[0]
            if not pid.isdigit() or alive(int(pid)):
                continue
            with contextlib.suppress(OSError, UnicodeDecodeError):
                tmp = marker.read_text()
                # Only ever a staging file: the registry is not trusted to name others.
                if _TMP_MARK in tmp.rpartition("/")[2]:
                    if self.local_root is not None:
                        Path(tmp).unlink(missing_ok=True)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            cast(Any, self.fs).rm_file(tmp)
                    removed += 1
                marker.unlink()
        return removed

    def remove_stale_staging(self, key: str, alive: Callable[[int], bool]) -> None:
        """Delete staging files of ``key`` left by dead processes (local under-stores)."""
        if self.local_root is None:
            return
        final = self.local_path(key)
        prefix = f".{staging_stem(final.name)}{_TMP_MARK}"
        with contextlib.suppress(OSError):
            for entry in final.parent.iterdir():
                pid = entry.name[len(prefix) :].split("-", 1)[0]
                if entry.name.startswith(prefix) and pid.isdigit() and not alive(int(pid)):
                    entry.unlink(missing_ok=True)

    def begin(self, key: str) -> UfsStaging:
        """Start writing ``key`` (see :class:`UfsStaging`)."""
        return UfsStaging(self, key)

    def open(self, key: str) -> BinaryIO:
        """Read ``key``."""
        try:
            if self.local_root is not None:
                return self.local_path(key).open("rb")
            return cast(BinaryIO, cast(Any, self.fs).open(self.remote_path(key), "rb"))
        except OSError as err:
            raise self.error(err, key) from err

    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Remove ``key`` (a file, or a tree with ``recursive``); missing is not an error."""
        try:
            if self.local_root is not None:
                path = self.local_path(key)
                if path.is_dir() and not path.is_symlink():
                    if recursive:
                        _rmtree(path)
                    return
                path.unlink(missing_ok=True)
            else:
                fs = cast(Any, self.fs)
                target = self.remote_path(key)
                if fs.exists(target):
                    remove_literal(fs, target, recursive=recursive)
        except OSError as err:
            raise self.error(err, key) from err

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` (file or tree) to ``dst``; nothing happens if ``src`` is absent."""
        try:
            if self.local_root is not None:
                source = self.local_path(src)
                if not source.exists():
                    return
                target = self.local_path(dst, create_parents=True)
                source.replace(target)
                _fsync_dir(str(target.parent))
            else:
                fs = cast(Any, self.fs)
                remote = self.remote_path(src)
                if fs.exists(remote) and has_glob(remote):
                    move_literal(fs, remote, self.remote_path(dst))
                elif fs.exists(remote):
                    fs.mv(remote, self.remote_path(dst), recursive=True)
        except OSError as err:
            raise self.error(err, src) from err

    def identity(self, key: str) -> str | None:
        """What is at ``key`` now (None: nothing): for local under-stores the device and
        inode, which a rename keeps, so :meth:`undo_rename` can tell a copy moved from one
        that never was; for others only that something is there."""
        try:
            if self.local_root is not None:
                st = os.lstat(self.local_path(key))
                return f"{st.st_dev}:{st.st_ino}"
            return "present" if cast(Any, self.fs).exists(self.remote_path(key)) else None
        except FileNotFoundError:
            return None
        except OSError as err:
            raise self.error(err, key) from err

    def undo_rename(self, src: str, dst: str, ident: str | None) -> bool:
        """Move back to ``src`` what a :meth:`rename` of ``src`` (then ``ident``, see
        :meth:`identity`) to ``dst`` moved, if it did; returns whether something moved.

        Local under-stores tell exactly (the inode moved with the name).  Elsewhere a move
        is taken as done when ``src`` is gone and ``dst`` is there; a tree that a move
        (copy, then delete) left half copied stays as it is."""
        if ident is None:
            return False
        if self.local_root is not None:
            if self.identity(dst) != ident:
                return False
            source = self.local_path(dst)
            try:
                target = self.local_path(src, create_parents=True)
                source.replace(target)
                _fsync_dir(str(target.parent))
            except OSError as err:
                raise StoreError(
                    f"under-store {self.url}: cannot move {dst} back to {src} after a rename "
                    f"that did not finish: {err}; move it back by hand"
                ) from err
            return True
        fs = cast(Any, self.fs)
        if fs.exists(self.remote_path(src)) or not fs.exists(self.remote_path(dst)):
            return False
        self.rename(dst, src)
        return True


def _rmtree(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            _rmtree(child)
        else:
            child.unlink(missing_ok=True)
    path.rmdir()


class StagingWriter(WriteStream):
    """A write stream over a :class:`UfsStaging`: publishes on close, discards on error."""

    def __init__(self, staging: UfsStaging, name: str) -> None:
        super().__init__(name)
        self._staging = staging

    def tell(self) -> int:
        """Bytes written so far."""
        return self._staging.size

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns its length."""
        if self._closed:
            raise ValueError("write to a closed store stream")
        view = memoryview(data).cast("B")
        self._staging.write(view)
        return len(view)

    def abort(self) -> None:
        """Discard what was written; the target keeps its previous content."""
        if not self._closed:
            self._closed = True
            self._staging.discard()

    def close(self) -> None:
        """Publish the file atomically (no-op if already closed)."""
        if self._closed:
            return
        self._closed = True
        self._staging.finish()
        self._staging.publish()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.abort()
