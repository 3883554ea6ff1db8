"""Map directories: versioned HD maps that nightly builds extend incrementally and atomically.

A map URI names a directory: a local path, any fsspec URL (``file://``, ``memory://``,
``s3://``, ``hdfs://``...) or an adcloud store path (``local:///maps/city``,
``alluxio://host:39999/maps/city``).  Its layout::

    <map>/CURRENT                         the current version id, one line ("000007\\n")
    <map>/build.lock                      present while a build runs (JSON: pid, host, start)
    <map>/versions/000007/                one complete map: every file the build writes
    <map>/versions/000007/manifest.json   what that version was built from (below)
    <map>/versions/.staging-000008/       a build in progress (local maps only); never read

Guarantees
    *Atomic*: a build writes a new version directory beside the old ones and only then
    replaces ``CURRENT`` (write a temporary file, fsync, rename over it, fsync the
    directory).  Readers resolve ``CURRENT`` first, so a build killed at any point -- even
    by SIGKILL or a power cut -- leaves the previous version current, complete and readable.
    *Incremental*: :meth:`MapDir.plan` identifies drives by the SHA-256 of their bytes, not
    by name, and compares them with the current manifest: only new content is processed
    (a bag renamed or moved is recognised; a bag rewritten under the same name is new).
    *Idempotent*: :meth:`MapDir.update` writes nothing at all -- not even the lock -- when
    the plan has no new drive.
    *Reversible*: :meth:`MapDir.roll_back` publishes an earlier version's map again as a new
    version (``adcloud hdmap rollback``); the drives it takes out are *held out*: later
    builds skip their bytes until a build readmits them by name.
    *Exclusive*: one build at a time holds ``build.lock``.  On a local filesystem the lock is
    an ``flock`` held for the whole build, which the kernel drops when the process dies; the
    JSON inside names the holder, so the next build logs that it takes over a stale lock
    from a dead process.  On other backends the lock file is created exclusively and a lock
    whose process is gone (same host, and an earlier boot or a process id that no longer
    names the process that started then) is taken over; a lock held from another host must
    be removed by hand once that build is known to be dead.
    *Tidy*: a map off the local filesystem is staged in a local directory (``staging_dir``)
    with an owner file beside it; a build killed outright leaves it behind, and the next
    build on that host removes it (:mod:`adcloud._scratch`).

Bag hashing
    A bag file hashes as ``sha256(file bytes)`` (the same digest as ``sha256sum``).  A
    directory (a rosbag2 bag: ``metadata.yaml`` and its storage files) hashes as the SHA-256
    of, for every regular file in sorted relative-path order, its size as 8 little-endian
    bytes followed by its bytes.  Files are streamed, never read whole.  A plan hashes the
    bags it must read ``hash_threads`` at a time (SHA-256 is serial within a bag, and
    hashlib releases the GIL while it hashes, so bags on a local disk hash on as many cores
    and bags in object storage over as many streams).

Manifest format (``manifest.json``), version 3
    ``{"format": "adcloud.hdmap.manifest", "format_version": 3, "version": "000007",
    "parent": "000006" | null, "created_at": ISO-8601 UTC, "adcloud_version": "0.1.0",
    "settings": {...effective build settings...}, "drives": [{"name", "uri", "sha256",
    "size", "mtime", "processed_at", "added_in"}, ...], "held_out": [drive, ...],
    "restores": "000005" | null, "labels": "/abs/fixes.geojson" | null}``.  ``drives``
    lists every drive the version contains; ``added_in`` is the version that first
    processed it.  ``held_out``: drives a rollback took out of the map, which builds skip
    until readmitted (same fields); ``restores``: the version whose map a rollback version
    republishes; ``labels``: the label file the build of this version imported (a URL, or
    an absolute local path), with or without new drives.  A manifest is written in the
    lowest version that holds what it has -- 1 without the three fields, 2 with a rollback's
    two, 3 with ``labels`` -- so maps that never used a field stay readable by older readers.

History
    - Version 1: first version.
    - Version 2: ``held_out`` and ``restores`` (rollbacks).
    - Version 3: ``labels`` (label imports).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import errno
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from adcloud import __version__
from adcloud._commit import _owner_gone, _this_owner, process_umask
from adcloud._scratch import make_scratch, remove_scratch
from adcloud.errors import AdcloudError
from adcloud.hdmap.drive import drive_name
from adcloud.hdmap.errors import BuildError, HdmapError, MapFormatError

__all__ = [
    "CURRENT_NAME",
    "LOCK_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "VERSIONS_DIR",
    "BuildLock",
    "BuildPlan",
    "BuildResult",
    "DriveRecord",
    "LockInfo",
    "Manifest",
    "MapDir",
    "MapDirSettings",
    "MapVersion",
    "Staging",
    "StoredParent",
    "bag_changed",
    "bag_uri",
    "content_hash",
    "drive_name",
    "find_bags",
    "lies_below",
    "link_or_copy",
    "local_path",
    "missing_from_previous",
    "version_name",
]

_LOG = logging.getLogger(__name__)

CURRENT_NAME = "CURRENT"
LOCK_NAME = "build.lock"
VERSIONS_DIR = "versions"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "adcloud.hdmap.manifest"
MANIFEST_VERSION = 3
_STAGING_PREFIX = ".staging-"
#: Prefixes of the local directories that versions of maps off the local filesystem are
#: staged in and downloaded to: the same for every build, so that the next one removes what
#: a killed one left (:mod:`adcloud._scratch`).
_LOCAL_STAGING_PREFIX = "hdmap-staging-"
_DOWNLOAD_PREFIX = "hdmap-version-"
_VERSION_RE = re.compile(r"^\d{6,}$")


def version_name(version_id: str) -> str:
    """A version id as the map directory names it: ``"3"`` is ``"000003"``."""
    return version_id.zfill(6) if version_id.isdigit() else version_id


_BAG_SUFFIXES = (".bag", ".mcap")
_ROSBAG2_METADATA = "metadata.yaml"
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class MapDirSettings:
    """How a map directory is maintained.

    ``keep_versions``: after each commit, versions beyond the newest ``keep_versions`` (the
    current one always included) are deleted; 0 keeps everything.  ``fsync``: flush files
    and directories to stable storage before switching ``CURRENT`` (only switch it off on
    scratch maps).  ``hash_chunk_bytes``: read size when hashing bags; ``hash_threads``:
    how many bags are hashed at a time.  ``staging_dir``:
    where versions of maps that are not on a local filesystem are written before the upload,
    and their parent version is downloaded to (empty: the system's temporary directory); it
    needs room for two whole versions.
    """

    keep_versions: int = 5
    fsync: bool = True
    hash_chunk_bytes: int = 8 << 20
    hash_threads: int = 4
    staging_dir: str = ""

    def __post_init__(self) -> None:
        for name in ("keep_versions", "hash_chunk_bytes", "hash_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise BuildError(f"hdmap.{name} must be a whole number (an int), got {value!r}")
        if not isinstance(self.fsync, bool):
            raise BuildError(f"MapDirSettings.fsync must be True or False, got {self.fsync!r}")
        if not isinstance(self.staging_dir, str):
            raise BuildError(
                f"MapDirSettings.staging_dir must be a string, got {self.staging_dir!r}"
            )
        if self.keep_versions < 0:
            raise BuildError(f"hdmap.keep_versions must be >= 0, got {self.keep_versions}")
        if self.hash_chunk_bytes <= 0:
            raise BuildError(f"hdmap.hash_chunk_bytes must be > 0, got {self.hash_chunk_bytes}")
        if self.hash_threads < 1:
            raise BuildError(f"hdmap.hash_threads must be >= 1, got {self.hash_threads}")


def _now_text() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- file backends


class _Files(abc.ABC):
    """The few file operations a map directory needs, on one backend.

    Paths are the backend's absolute ``/``-separated paths; a missing file or directory
    raises :class:`FileNotFoundError`.
    """

    #: the local directory root of the backend when paths are local paths, else None
    local = False

    @abc.abstractmethod
    def describe(self, path: str) -> str:
        """``path`` as a URI for messages and manifests."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def size_mtime(self, path: str) -> tuple[int, float | None]:
        """Size in bytes and modification time (s since the epoch, None if unknown)."""

    @abc.abstractmethod
    def open_read(self, path: str) -> IO[bytes]: ...

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data``: readers see the old or the new bytes, never a mix."""

    @abc.abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists (then return False)."""

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names of the entries of directory ``path`` (empty if it does not exist)."""

    @abc.abstractmethod
    def find(self, path: str) -> list[tuple[str, int]]:
        """``(relative posix path, size)`` of every regular file below ``path``, sorted."""

    @abc.abstractmethod
    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file or a directory tree; a missing path is not an error."""

    def glob(self, pattern: str) -> list[str]:
        """Paths matching a glob ``pattern``, sorted."""
        raise HdmapError(
            f"{self.describe(pattern)}: this storage cannot expand glob patterns; name a bag "
            "or a directory of bags"
        )

    @abc.abstractmethod
    def put_tree(self, local_dir: Path, path: str, *, last: str | None = None) -> None:
        """Copy the files below ``local_dir`` to ``path``; the file ``last`` goes last."""

    @abc.abstractmethod
    def get_file(self, path: str, local: Path) -> None:
        """Copy the file ``path`` to the local path ``local`` (its folder exists)."""

    def get_files(self, pairs: Sequence[tuple[str, Path]]) -> None:
        """:meth:`get_file` every ``(path, local)``."""
        for path, local in pairs:
            self.get_file(path, local)

    def get_tree(self, path: str, local_dir: Path, *, skip: Sequence[str] = ()) -> None:
        """Copy the files below ``path`` into ``local_dir``, but those below the relative
        folders ``skip``."""
        rels = [rel for rel, _ in self.find(path) if not lies_below(rel, skip)]
        for folder in sorted({(local_dir / rel).parent for rel in rels}):
            folder.mkdir(parents=True, exist_ok=True)
        self.get_files([(posixpath.join(path, rel), local_dir / rel) for rel in rels])

    def copy(self, source: str, target: str) -> None:
        """Copy one file on the backend (through this process unless the backend can)."""
        self.write_atomic(target, self.read_bytes(source))

    def copy_many(self, pairs: Sequence[tuple[str, str]]) -> None:
        """:meth:`copy` every ``(source, target)``."""
        for source, target in pairs:
            self.copy(source, target)

    def close(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release connections and threads (nothing by default)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        # some filesystems (e.g. certain FUSE/network mounts) do not support fsync on
        # directories; the rename is still atomic there, only its durability is weaker
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` where both lie on one file system, else a copy
    (with its time stamps).

    For the files a new map version carries unchanged from its parent (tiles out of the new
    drives' reach, the keyframes of old drives): a nightly build then neither copies nor
    stores the parts of the map it did not change.  It is safe because no version's file is
    rewritten in place -- every writer writes beside and renames over (a new inode), and
    versions, once committed, are only read and deleted."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def lies_below(rel: str, folders: Sequence[str]) -> bool:
    """Whether the relative path ``rel`` lies below one of ``folders``."""
    return any(rel.startswith(folder.rstrip("/") + "/") for folder in folders)


def missing_from_previous(where: str) -> MapFormatError:
    """The error for a file that the previous map version lists or needs but lacks."""
    return MapFormatError(
        f"{where}: missing from the previous version; the map version is damaged "
        "(build the map again from its bags)"
    )


class _LocalFiles(_Files):
    """Local paths (``/data/maps/x`` or ``file:///data/maps/x``)."""

    local = True

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    def describe(self, path: str) -> str:
        return path

    def exists(self, path: str) -> bool:
        return Path(path).exists()

    def isdir(self, path: str) -> bool:
        return Path(path).is_dir()

    def size_mtime(self, path: str) -> tuple[int, float | None]:
        p = Path(path)
        if p.is_dir():
            files = self.find(path)
            mtimes = [p.stat().st_mtime] + [(p / rel).stat().st_mtime for rel, _ in files]
            return sum(size for _, size in files), max(mtimes)
        st = p.stat()
        return st.st_size, st.st_mtime

    def open_read(self, path: str) -> IO[bytes]:
        return Path(path).open("rb")

    def write_atomic(self, path: str, data: bytes) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        tmp.replace(target)
        if self.fsync:
            _fsync_path(target.parent, directory=True)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(p.name for p in Path(path).iterdir())
        except FileNotFoundError:
            return []

    def find(self, path: str) -> list[tuple[str, int]]:
        root = Path(path)
        if root.is_file():
            return [("", root.stat().st_size)]
        out = []
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                if p.is_file():
                    out.append((p.relative_to(root).as_posix(), p.stat().st_size))
        return sorted(out)

    def glob(self, pattern: str) -> list[str]:
        parts = Path(pattern).parts
        first = next(k for k, part in enumerate(parts) if _GLOB.search(part))
        return sorted(str(p) for p in Path(*parts[:first]).glob("/".join(parts[first:])))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            if recursive:
                shutil.rmtree(p, ignore_errors=False)
            else:
                p.rmdir()
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def put_tree(self, local_dir: Path, path: str, *, last: str | None = None) -> None:
        shutil.copytree(local_dir, path, dirs_exist_ok=True)

    def get_file(self, path: str, local: Path) -> None:
        shutil.copy2(path, local)


class _FsspecFiles(_Files):
    """Any fsspec filesystem (object stores, HDFS, ``memory://``)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def describe(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def size_mtime(self, path: str) -> tuple[int, float | None]:
        if self.isdir(path):
            return sum(size for _, size in self.find(path)), None
        info = self.fs.info(path)
        mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
        if isinstance(mtime, dt.datetime):
            stamp: float | None = mtime.timestamp()
        elif isinstance(mtime, int | float):
            stamp = float(mtime)
        else:
            stamp = None
        return int(info.get("size") or 0), stamp

    def open_read(self, path: str) -> IO[bytes]:
        f: IO[bytes] = self.fs.open(path, "rb")
        return f

    def write_atomic(self, path: str, data: bytes) -> None:
        # object stores publish a PUT atomically; the temporary name + move also makes
        # rename-based filesystems (HDFS) atomic
        tmp = f"{path}.tmp-{os.getpid()}"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError):
            # no exclusive create on this backend: check-then-write is the best it offers
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
        return True

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        base = path.rstrip("/")
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries if str(e) != base}
        return sorted(n for n in names if n)

    def find(self, path: str) -> list[tuple[str, int]]:
        if not self.isdir(path):
            return [("", int(self.fs.info(path)["size"]))]
        found = self.fs.find(path, detail=True)
        base = path.rstrip("/") + "/"
        out = []
        for name, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = str(name)[len(base) :] if str(name).startswith(base) else str(name)
            out.append((rel.lstrip("/"), int(info.get("size") or 0)))
        return sorted(out)

    def glob(self, pattern: str) -> list[str]:
        return sorted(str(p) for p in self.fs.glob(pattern))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=recursive)

    # A version is thousands of small files: the tree and copy methods hand fsspec whole
    # lists, which an asynchronous filesystem (s3fs, gcsfs, adlfs) sends as concurrent
    # requests, where one call per file waits out one round trip after another.

    def _makedirs(self, targets: Iterable[str]) -> None:
        for folder in sorted({posixpath.dirname(t) for t in targets}):
            self.fs.makedirs(folder, exist_ok=True)

    def put_tree(self, local_dir: Path, path: str, *, last: str | None = None) -> None:
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        rels = [p.relative_to(local_dir).as_posix() for p in files]
        targets = [posixpath.join(path, rel) for rel in rels]
        self._makedirs(targets)
        first = [(str(p), t) for p, rel, t in zip(files, rels, targets, strict=True) if rel != last]
        if first:
            self.fs.put([lp for lp, _ in first], [t for _, t in first])
        if last is not None and last in rels:  # only once every other file is there
            self.fs.put_file(str(local_dir / last), posixpath.join(path, last))

    def get_file(self, path: str, local: Path) -> None:
        self.fs.get_file(path, str(local))

    def get_files(self, pairs: Sequence[tuple[str, Path]]) -> None:
        if pairs:
            self.fs.get([path for path, _ in pairs], [str(local) for _, local in pairs])

    def copy(self, source: str, target: str) -> None:
        self.copy_many([(source, target)])

    def copy_many(self, pairs: Sequence[tuple[str, str]]) -> None:
        # on object stores copies made by the store itself (S3 CopyObject): no bytes here
        if not pairs:
            return
        self._makedirs(target for _, target in pairs)
        self.fs.copy([source for source, _ in pairs], [target for _, target in pairs])


def _close_stores(stores: list[Any]) -> None:
    """Close and forget the stores of ``stores`` (the open one of a :class:`_StoreFiles`)."""
    closing, stores[:] = list(stores), []
    for store in closing:
        store.close()


class _StoreFiles(_Files):
    """An adcloud store (``local://`` tiered store, ``alluxio://``).

    The store holds threads, files and connections: :meth:`close` closes it.  What still
    reads through these files afterwards -- a version or a plan that a closed
    :class:`MapDir` returned -- opens the store again, and the store opened so is closed
    when the last of them is gone (or when the process exits)."""

    def __init__(self, store: Any) -> None:
        self._uri = str(store.uri)
        self._guard = threading.Lock()
        self._open: list[Any] = [store]  # the store, while it is open
        weakref.finalize(self, _close_stores, self._open)

    @property
    def store(self) -> Any:
        with self._guard:
            if not self._open:
                from adcloud.store import open_store  # noqa: PLC0415 - store URIs only

                self._open.append(open_store(self._uri))
            return self._open[0]

    def describe(self, path: str) -> str:
        base = self._uri
        return base + path if base.endswith("://") else base.rstrip("/") + path

    def exists(self, path: str) -> bool:
        return bool(self.store.exists(path))

    def isdir(self, path: str) -> bool:
        return self.exists(path) and bool(self.store.stat(path).is_dir)

    def size_mtime(self, path: str) -> tuple[int, float | None]:
        from adcloud.store import StoreNotFoundError  # noqa: PLC0415 - 0.15 s; store URIs only

        try:
            st = self.store.stat(path)
        except StoreNotFoundError as err:
            raise FileNotFoundError(self.describe(path)) from err
        if st.is_dir:
            return sum(size for _, size in self.find(path)), None
        return int(st.size), float(st.mtime)

    def open_read(self, path: str) -> IO[bytes]:
        from adcloud.store import StoreNotFoundError  # noqa: PLC0415

        try:
            f: IO[bytes] = self.store.open(path, "rb")
        except StoreNotFoundError as err:
            raise FileNotFoundError(self.describe(path)) from err
        return f

    def write_atomic(self, path: str, data: bytes) -> None:
        self.store.put(path, data)  # a store publishes each put atomically

    def create_exclusive(self, path: str, data: bytes) -> bool:
        from adcloud.store import StoreExistsError  # noqa: PLC0415

        if self.store.exists(path):
            return False
        # rename refuses an existing destination, atomically: the exclusive step
        tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
        self.store.put(tmp, data)
        try:
            self.store.rename(tmp, path)
        except StoreExistsError:
            self.store.delete(tmp)
            return False
        return True

    def listdir(self, path: str) -> list[str]:
        from adcloud.store import StoreNotFoundError  # noqa: PLC0415

        try:
            return sorted(s.name for s in self.store.list(path) if s.path != path)
        except StoreNotFoundError:
            return []

    def find(self, path: str) -> list[tuple[str, int]]:
        st = self.store.stat(path)
        if not st.is_dir:
            return [("", int(st.size))]
        base = path.rstrip("/") + "/"
        return sorted(
            (s.path[len(base) :], int(s.size))
            for s in self.store.list(path, recursive=True)
            if not s.is_dir
        )

    def remove(self, path: str, *, recursive: bool = False) -> None:
        if self.store.exists(path):
            self.store.delete(path, recursive=recursive)

    def put_tree(self, local_dir: Path, path: str, *, last: str | None = None) -> None:
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.relative_to(local_dir).as_posix() == last)
        for p in files:
            with (
                p.open("rb") as src,
                self.store.open(
                    posixpath.join(path, p.relative_to(local_dir).as_posix()), "wb"
                ) as dst,
            ):
                shutil.copyfileobj(src, dst, 8 << 20)

    def get_file(self, path: str, local: Path) -> None:
        with self.store.open(path, "rb") as src, local.open("wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    def copy(self, source: str, target: str) -> None:
        # the store copies by itself where it can (a local:// tier links the object)
        self.store.copy(source, target)

    def close(self) -> None:
        with self._guard:
            _close_stores(self._open)


def _locate(uri: str | os.PathLike[str], *, fsync: bool = True) -> tuple[_Files, str]:
    """The backend holding ``uri`` and the path inside it."""
    text = os.fspath(uri)
    if "://" not in text:
        return _LocalFiles(fsync), str(Path(text).expanduser().absolute())
    scheme, rest = text.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        import fsspec  # noqa: PLC0415

        _fs, path = fsspec.core.url_to_fs(f"file://{rest}")  # FILE:// too: fsspec wants it lower
        return _LocalFiles(fsync), str(Path(path).absolute())
    try:
        if scheme in ("local", "alluxio"):
            # adcloud's own stores: fsspec's "local" protocol would be a plain local path
            from adcloud.store import locate  # noqa: PLC0415

            store, path = locate(text)
            return _StoreFiles(store), path.rstrip("/") or "/"
        import fsspec  # noqa: PLC0415

        fs, path = fsspec.core.url_to_fs(text)
    except AdcloudError:
        raise
    except (ImportError, ValueError) as err:
        raise HdmapError(
            f"cannot open {text!r}: {err}; use a local path, file://, memory://, s3://, "
            "hdfs://, local:// or alluxio:// (install the fsspec backend the scheme needs)"
        ) from err
    except OSError as err:  # a backend that connects as it opens (HDFS needs a JVM, libhdfs)
        raise HdmapError(
            f"cannot open {text!r}: {err}; check that its storage is reachable from here and "
            "its client is set up"
        ) from err
    return _FsspecFiles(fs), str(path).rstrip("/") or "/"


# --------------------------------------------------------------------------- bags and hashes


def _described(raw: str | os.PathLike[str], files: _Files, path: str) -> str:
    """How a manifest names the bag ``raw`` (an absolute path for local files)."""
    text = os.fspath(raw)
    return files.describe(path) if "://" not in text or files.local else text.rstrip("/")


def bag_uri(raw: str | os.PathLike[str]) -> str:
    """The URI a build plan and the manifest give the bag ``raw`` (see :meth:`MapDir.plan`)."""
    files, path = _locate(raw)
    with files:
        return _described(raw, files, path)


def local_path(dest: str | os.PathLike[str], what: str) -> Path:
    """``dest``, where a command writes ``what`` (an export, a report) on the local disk, as
    a path: a path, or a ``file://`` URL.  Any other URL is a :class:`HdmapError`: taken as
    a path, ``s3://b/x`` would be written below ``./s3:/b/x`` of the working directory."""
    text = os.fspath(dest)
    if "://" not in text:
        return Path(text).expanduser()
    scheme, rest = text.split("://", 1)
    if scheme.lower() == "file":
        import fsspec  # noqa: PLC0415

        return Path(fsspec.core.url_to_fs(f"file://{rest}")[1])
    raise HdmapError(
        f"{text}: {what} is written to the local disk; give a local path or a file:// URL "
        "(copy it to object storage afterwards)"
    )


class _HashCancelledError(Exception):
    """A bag's hashing stopped because another bag of the same plan failed."""


#: ``progress(bytes hashed, bytes to hash)`` of a plan's hashing.
HashProgress = Callable[[int, int], None]


class _HashControl:
    """Shared by the bags one plan hashes: ``stop`` ends them all at their next chunk, and
    :meth:`advance` reports the bytes hashed to ``progress`` (at most every 0.2 s, and once
    at the end)."""

    def __init__(self, total: int, progress: HashProgress | None) -> None:
        self.stop = threading.Event()
        self._total = total
        self._progress = progress
        self._done = 0
        self._told = 0.0
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        if self._progress is None:
            return
        with self._lock:
            self._done += n
            now = time.monotonic()
            if now - self._told < 0.2 and self._done < self._total:
                return
            self._told = now
            self._progress(min(self._done, self._total), self._total)


def _hash_stream(h: Any, f: IO[bytes], chunk: int, control: _HashControl | None) -> None:
    while True:
        if control is not None and control.stop.is_set():
            raise _HashCancelledError
        block = f.read(chunk)
        if not block:
            return
        h.update(block)
        if control is not None:
            control.advance(len(block))


def _content_hash(
    files: _Files, path: str, chunk: int, control: _HashControl | None = None
) -> tuple[str, int]:
    h = hashlib.sha256()
    total = 0
    if not files.isdir(path):
        with files.open_read(path) as f:
            _hash_stream(h, f, chunk, control)
        return h.hexdigest(), files.size_mtime(path)[0]
    for rel, size in files.find(path):
        h.update(int(size).to_bytes(8, "little"))
        with files.open_read(posixpath.join(path, rel)) as f:
            _hash_stream(h, f, chunk, control)
        total += size
    return h.hexdigest(), total


def _hash_bag(
    raw: str | os.PathLike[str], uri: str, size: int, chunk: int, control: _HashControl
) -> tuple[str, int]:
    _LOG.info("hashing %s (%d bytes)", uri, size)
    files, path = _locate(raw)
    try:
        with files:
            return _content_hash(files, path, chunk, control)
    except FileNotFoundError as err:
        raise HdmapError(f"{uri}: no such bag file or directory") from err
    except OSError as err:
        raise HdmapError(f"{uri}: cannot read the bag: {err}") from err


def _hash_bags(
    bags: Sequence[tuple[str | os.PathLike[str], str, int]],
    chunk: int,
    threads: int,
    progress: HashProgress | None = None,
) -> list[tuple[str, int]]:
    """``(sha256, size)`` of every ``(raw, uri, size)`` bag, in order, ``threads`` bags at a
    time.  The first bag (in order) that cannot be read raises; then the other bags stop
    being read at their next chunk."""
    control = _HashControl(sum(size for *_, size in bags), progress)
    if len(bags) <= 1 or threads == 1:
        return [_hash_bag(raw, uri, size, chunk, control) for raw, uri, size in bags]
    pool = concurrent.futures.ThreadPoolExecutor(
        min(threads, len(bags)), thread_name_prefix="hdmap-hash"
    )
    try:
        futures = [
            pool.submit(_hash_bag, raw, uri, size, chunk, control) for raw, uri, size in bags
        ]
        return [future.result() for future in futures]
    finally:
        control.stop.set()  # a no-op once every bag is hashed
        pool.shutdown(wait=True, cancel_futures=True)


def content_hash(uri: str | os.PathLike[str], *, chunk_bytes: int = 8 << 20) -> tuple[str, int]:
    """``(sha256 hex digest, size in bytes)`` of a bag file or rosbag2 directory (the rule
    is in the module docstring).  Raises :class:`~adcloud.hdmap.errors.HdmapError` naming
    the URI when it cannot be read."""
    files, path = _locate(uri)
    try:
        with files:
            return _content_hash(files, path, chunk_bytes)
    except FileNotFoundError as err:
        raise HdmapError(f"{os.fspath(uri)}: no such bag file or directory") from err
    except OSError as err:
        raise HdmapError(f"{os.fspath(uri)}: cannot read the bag to hash it: {err}") from err


def bag_changed(drive: DriveRecord) -> str | None:
    """Why the bag of ``drive`` (a new drive of a plan) is no longer the bag the plan
    hashed -- its size or modification time moved since, as a copy or a recording still
    being written does -- or None when it is the same.  A build reads the bag after planning
    (and Spark long after): the map would record the hash of bytes it did not build, and
    the next build would take the finished bag for a new drive and build it again."""
    files, path = _locate(drive.uri)
    try:
        with files:
            size, mtime = files.size_mtime(path)
    except FileNotFoundError:
        return f"drive {drive.uri}: gone since it was hashed (moved or deleted)"
    except OSError as err:
        return f"drive {drive.uri}: cannot read it again after hashing it: {err}"
    if (size, mtime) == (drive.size, drive.mtime):
        return None
    return (
        f"drive {drive.uri}: changed since it was hashed ({drive.size:,} -> {size:,} bytes"
        + ("" if mtime == drive.mtime else ", modified again")
        + "): a copy or recording still being written? It is built once it stops changing"
    )


def find_bags(uri: str | os.PathLike[str]) -> list[str]:
    """The bags a ``--bags`` URI names, sorted: the URI itself when it is a bag file or a
    rosbag2 directory (one with ``metadata.yaml``); otherwise every ``*.bag``/``*.mcap``
    file and rosbag2 directory below it (hidden entries and ``*.truth`` directories are
    skipped).  A URI with glob characters (``*``, ``?``, ``[``) that names no existing
    entry is a pattern and names every match (``s3://fleet/2026-11-20/*.bag``); one that
    exists (``drive [2].bag``) is taken literally.  Raises
    :class:`~adcloud.hdmap.errors.HdmapError` if there is nothing."""
    files, path = _locate(uri)
    with files:
        return _find_bags(files, path, os.fspath(uri))


def _find_bags(files: _Files, path: str, text: str) -> list[str]:
    # An existing name is never a pattern: "drive [2].bag" as a glob would match only
    # "drive 2.bag", so a bag with brackets in its name could not be named at all.
    if _GLOB.search(path) and not files.exists(path):
        matches = files.glob(path)
        if not matches:
            raise HdmapError(f"{text}: the pattern matches nothing")
        out: set[str] = set()
        for match in matches:
            name = posixpath.basename(match.rstrip("/"))
            if name.startswith(".") or name.endswith(".truth"):
                continue  # the same entries a directory search skips
            try:
                out.update(find_bags(match if files.local else files.describe(match)))
            except HdmapError:
                continue  # a directory without bags among the matches
        if not out:
            raise HdmapError(f"{text}: the pattern matches no bag")
        return sorted(out)
    prefix = text.rstrip("/") if "://" in text else path
    if not files.exists(path):
        raise HdmapError(f"{text}: no such file or directory; pass a bag or a directory of bags")
    if not files.isdir(path):
        return [prefix]
    rels = [rel for rel, _ in files.find(path)]
    if _ROSBAG2_METADATA in rels:
        return [prefix]
    rosbag2_dirs = sorted(
        {posixpath.dirname(r) for r in rels if posixpath.basename(r) == _ROSBAG2_METADATA}
    )

    def skipped(rel: str) -> bool:
        parts = rel.split("/")
        return any(p.startswith(".") or p.endswith(".truth") for p in parts)

    found = [d for d in rosbag2_dirs if not skipped(d)]
    for rel in rels:
        if skipped(rel) or not rel.lower().endswith(_BAG_SUFFIXES):
            continue
        if any(rel.startswith(d + "/") for d in rosbag2_dirs):
            continue  # an MCAP file inside a rosbag2 directory belongs to that bag
        found.append(rel)
    if not found:
        raise HdmapError(
            f"{text}: no bags found (looked for *.bag, *.mcap and rosbag2 directories with "
            "metadata.yaml)"
        )
    return sorted(f"{prefix}/{rel}" for rel in found)


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class DriveRecord:
    """One drive (bag) of a map: ``name`` (unique in the map; products are named after it),
    ``uri`` where it was read, ``sha256``/``size`` of its bytes, ``mtime`` (s, None when the
    backend has none), ``processed_at`` (ISO-8601 UTC; None until processed) and
    ``added_in`` (the map version that first processed it)."""

    name: str
    uri: str
    sha256: str
    size: int
    mtime: float | None = None
    processed_at: str | None = None
    added_in: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)

    def looks_unchanged(self, size: int, mtime: float | None) -> bool:
        """Whether a file of ``size`` and ``mtime`` at this drive's URI passes rsync's quick
        check against it (a file without a modification time never does)."""
        return mtime is not None and (self.size, self.mtime) == (size, mtime)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> DriveRecord:
        """Parse one ``drives`` entry; ``where`` names the file and index for errors."""
        try:
            rec = cls(
                name=str(data["name"]),
                uri=str(data["uri"]),
                sha256=str(data["sha256"]),
                size=int(data["size"]),
                mtime=None if data.get("mtime") is None else float(data["mtime"]),
                processed_at=data.get("processed_at"),
                added_in=data.get("added_in"),
            )
        except KeyError as err:
            raise MapFormatError(f"{where}: missing field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise MapFormatError(f"{where}: {err}") from None
        if not re.fullmatch(r"[0-9a-f]{64}", rec.sha256):
            raise MapFormatError(f"{where}: sha256 {rec.sha256!r} is not 64 hex digits")
        return rec


@dataclass(frozen=True)
class Manifest:
    """What one map version was built from (``manifest.json``, format in the module doc).

    ``version`` and ``parent`` are stamped by :meth:`Staging.commit`; ``settings`` is the
    effective build configuration (JSON-ready)."""

    drives: tuple[DriveRecord, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    version: str = ""
    parent: str | None = None
    created_at: str = ""
    adcloud_version: str = __version__
    held_out: tuple[DriveRecord, ...] = ()
    restores: str | None = None
    labels: str | None = None

    def by_hash(self) -> dict[str, DriveRecord]:
        """The drives keyed by content hash."""
        return {d.sha256: d for d in self.drives}

    def drive(self, name: str) -> DriveRecord:
        """The drive called ``name`` (KeyError if the map has none)."""
        for d in self.drives:
            if d.name == name:
                return d
        raise KeyError(name)

    def to_json(self) -> str:
        """The ``manifest.json`` text."""
        rolled = bool(self.held_out) or self.restores is not None
        version = 3 if self.labels is not None else 2 if rolled else 1
        data: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "format_version": version,
            "version": self.version,
            "parent": self.parent,
            "created_at": self.created_at,
            "adcloud_version": self.adcloud_version,
            "settings": dict(self.settings),
            "drives": [d.to_dict() for d in self.drives],
        }
        if version >= 2:
            data["held_out"] = [d.to_dict() for d in self.held_out]
            data["restores"] = self.restores
        if version >= 3:
            data["labels"] = self.labels
        return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse ``manifest.json``; ``where`` names the file in errors."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as err:
            raise MapFormatError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise MapFormatError(f"{where}: not an hdmap manifest (format != {MANIFEST_FORMAT!r})")
        if data.get("format_version") not in range(1, MANIFEST_VERSION + 1):
            raise MapFormatError(
                f"{where}: manifest format_version {data.get('format_version')!r} is not "
                f"1 to {MANIFEST_VERSION}; upgrade adcloud to read it"
            )
        drives = data.get("drives")
        if not isinstance(drives, list):
            raise MapFormatError(f"{where}: field 'drives' must be a list")
        held = data.get("held_out", [])
        if not isinstance(held, list):
            raise MapFormatError(f"{where}: field 'held_out' must be a list")
        restores = data.get("restores")
        if restores is not None and not _VERSION_RE.match(str(restores)):
            raise MapFormatError(f"{where}: field 'restores' ({restores!r}) is not a version id")
        settings = data.get("settings") or {}
        if not isinstance(settings, dict):
            raise MapFormatError(f"{where}: field 'settings' must be an object")
        labels = data.get("labels")
        if labels is not None and not isinstance(labels, str):
            raise MapFormatError(f"{where}: field 'labels' ({labels!r}) is not a file name")
        return cls(
            drives=tuple(
                DriveRecord.from_dict(d, f"{where}: drives[{i}]") for i, d in enumerate(drives)
            ),
            settings=settings,
            version=str(data.get("version") or ""),
            parent=data.get("parent"),
            created_at=str(data.get("created_at") or ""),
            adcloud_version=str(data.get("adcloud_version") or ""),
            held_out=tuple(
                DriveRecord.from_dict(d, f"{where}: held_out[{i}]") for i, d in enumerate(held)
            ),
            restores=None if restores is None else str(restores),
            labels=labels,
        )


def _settings_json(settings: object) -> dict[str, Any]:
    if settings is None:
        return {}
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        from adcloud.config import settings_dict  # noqa: PLC0415

        return settings_dict(settings)
    if isinstance(settings, Mapping):
        out: dict[str, Any] = json.loads(json.dumps(dict(settings), default=_json_default))
        return out
    raise TypeError(f"settings must be a dataclass or a mapping, got {type(settings).__name__}")


def _json_default(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _settings_json(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


# --------------------------------------------------------------------------- versions


@dataclass(frozen=True)
class MapVersion:
    """One committed version of a map: ``id`` (``"000007"``), ``uri`` of its directory,
    its ``manifest`` and, for maps on a local filesystem, ``path`` (its local directory)."""

    id: str
    uri: str
    manifest: Manifest
    path: Path | None
    _files: _Files = field(repr=False, compare=False)
    _root: str = field(repr=False, compare=False)

    def files(self) -> list[str]:
        """Relative paths of the version's files, sorted."""
        return [rel for rel, _ in self._files.find(self._root)]

    def read_bytes(self, relpath: str) -> bytes:
        """The bytes of one file of the version (``relpath`` is ``/``-separated)."""
        try:
            return self._files.read_bytes(posixpath.join(self._root, relpath))
        except FileNotFoundError as err:
            raise MapFormatError(f"{self.uri}/{relpath}: no such file in map version") from err

    def export(self, dest: str | os.PathLike[str], include: Callable[[str], bool]) -> list[str]:
        """Copy the version's files that ``include(relpath)`` accepts into the new local
        directory ``dest`` and return their relative paths.  Copies, never links, so the
        export may be edited without touching the map.  ``dest`` appears whole or not at
        all (written beside it, then renamed; the next export to ``dest`` removes what a
        killed one left there); an existing non-empty ``dest`` is refused."""
        target = local_path(dest, "an export").absolute()
        if target.is_symlink() and target.is_dir():
            # a link to the directory (``/data/map -> /mnt/ssd/map``): the export replaces
            # the directory it names, and the link keeps naming it
            target = target.resolve()
        if target.exists() and not target.is_dir():
            raise HdmapError(
                f"{target}: is a file, not a directory; give a new (or empty) directory to "
                "export into"
            )
        if target.exists() and any(target.iterdir()):
            raise HdmapError(f"{target}: exists and is not an empty directory; choose another")
        target.parent.mkdir(parents=True, exist_ok=True)
        names = [rel for rel in self.files() if include(rel)]
        partial = make_scratch(f".{target.name}.partial-", target.parent)
        try:
            for rel in names:
                (partial / rel).parent.mkdir(parents=True, exist_ok=True)
                if self.path is not None:
                    shutil.copy2(self.path / rel, partial / rel)
            if self.path is None:  # one batch download (concurrent on object stores)
                self._files.get_files(
                    [(posixpath.join(self._root, rel), partial / rel) for rel in names]
                )
            # mkdtemp made it 0700: open it as a directory made here would be (the car's
            # driving stack runs as another user), or as the empty one it replaces was
            partial.chmod(
                stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o777 & ~process_umask()
            )
            if target.exists():
                target.rmdir()  # empty: checked above
            partial.rename(target)
        except BaseException:
            remove_scratch(partial)
            raise
        remove_scratch(partial)  # its owner file, now that the directory is the export
        return names

    def download(self, relpaths: Sequence[str], into: Path) -> None:
        """Download the version's files ``relpaths`` to ``into/relpath`` in one batch (each
        written beside its place and renamed, so a failed download leaves no torn file)."""
        pairs = []
        for rel in relpaths:
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.partial")
            pairs.append((posixpath.join(self._root, rel), partial))
        try:
            self._files.get_files(pairs)
        except FileNotFoundError as err:
            raise MapFormatError(f"{self.uri}: a file is missing from the version: {err}") from err
        for rel, (_, partial) in zip(relpaths, pairs, strict=True):
            partial.replace(into / rel)

    def fetch(
        self, dest: str | os.PathLike[str] | None = None, *, skip: Sequence[str] = ()
    ) -> Path:
        """A local directory with the version's files: the version's own directory for local
        maps, else a copy downloaded into ``dest`` (if None, a new temporary directory that
        the caller removes with :func:`adcloud._scratch.remove_scratch`; one a killed process
        left is removed by the next download), without the files below the relative
        folders ``skip``."""
        if self.path is not None:
            return self.path
        target = Path(dest) if dest is not None else make_scratch(_DOWNLOAD_PREFIX)
        try:
            target.mkdir(parents=True, exist_ok=True)
            self._files.get_tree(self._root, target, skip=skip)
        except BaseException:
            if dest is None:  # a part of a map version, that no caller would remove
                remove_scratch(target)
            raise
        return target


@dataclass(frozen=True)
class BuildPlan:
    """What a build has to do, from comparing the input bags with the current manifest.

    ``new_drives``: content the map does not have (to process; ``processed_at`` None);
    ``known_drives``: inputs already in the map (their manifest records); ``removed``:
    drives of the map not among the inputs -- builds only add, so the map keeps them;
    ``renamed``: ``(uri in the manifest, uri now)`` for known content met under a new URI;
    ``duplicates``: input URIs skipped because another input has the same bytes;
    ``held_out``: the drives a rollback took out that the new version still holds out
    (the parent's, less those readmitted); ``skipped``: input URIs skipped because their
    bytes are held out.
    """

    parent: MapVersion | None
    new_drives: tuple[DriveRecord, ...]
    known_drives: tuple[DriveRecord, ...]
    removed: tuple[DriveRecord, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()
    duplicates: tuple[str, ...] = ()
    held_out: tuple[DriveRecord, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def up_to_date(self) -> bool:
        """True when there is nothing new to process (an idempotent re-run)."""
        return not self.new_drives

    def manifest(
        self,
        settings: object = None,
        *,
        processed_at: str | None = None,
        labels: str | None = None,
    ) -> Manifest:
        """The manifest of the version this plan builds: every drive of the parent plus the
        new ones stamped ``processed_at`` (now by default); ``settings`` is the effective
        build configuration (a settings dataclass or a mapping); ``labels`` the label file
        the build imports (None: none)."""
        stamp = processed_at or _now_text()
        old = self.parent.manifest.drives if self.parent is not None else ()
        new = tuple(dataclasses.replace(d, processed_at=stamp) for d in self.new_drives)
        return Manifest(
            drives=old + new,
            settings=_settings_json(settings),
            parent=self.parent.id if self.parent is not None else None,
            held_out=self.held_out,
            labels=labels,
        )


@dataclass(frozen=True)
class BuildResult:
    """What :meth:`MapDir.update` did: the ``plan``, the ``version`` now current (None for an
    empty map) and whether a new version was written (``changed``)."""

    plan: BuildPlan
    version: MapVersion | None
    changed: bool


# --------------------------------------------------------------------------- lock


@dataclass(frozen=True)
class LockInfo:
    """Who holds a map's build lock: ``pid`` on ``host`` since ``started`` (ISO-8601 UTC).

    ``boot`` (the host's boot id) and ``start`` (the process's start, clock ticks since
    boot) tell a dead holder from a process that got its id since: a restarted container
    keeps its host name and gives its new build the pid of the one killed there. Locks
    written before these fields (empty) are judged by the pid alone."""

    pid: int
    host: str
    started: str
    map_uri: str = ""
    boot: str = ""
    start: str = ""

    def to_json(self) -> bytes:
        """The lock file's content."""
        return (json.dumps(dataclasses.asdict(self)) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes) -> LockInfo | None:
        """The holder in a lock file's content (None when empty or unreadable)."""
        try:
            obj = json.loads(data.decode())
            return cls(
                int(obj["pid"]),
                str(obj["host"]),
                str(obj["started"]),
                str(obj["map_uri"]),
                str(obj.get("boot", "")),
                str(obj.get("start", "")),
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
            return None

    def gone(self) -> bool:
        """Whether the holder is known to be dead: only a holder on this host can be checked."""
        if self.host != socket.gethostname():
            return False
        if self.boot and self.start:
            owner = {"host": self.host, "boot": self.boot, "pid": self.pid, "start": self.start}
            return _owner_gone(owner)
        return not _pid_alive(self.pid)

    def describe(self) -> str:
        """``pid N on HOST since T`` for messages."""
        return f"pid {self.pid} on {self.host} since {self.started}"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie -- dead, not yet reaped -- does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    return True


def _build_running(where: str, holder: LockInfo | None) -> BuildError:
    """The error for a build refused because another build of the map runs."""
    who = holder.describe() if holder else "another process"
    return BuildError(
        f"{where}: another build of this map is running ({who}); wait for it to finish "
        "(builds of one map run one at a time)"
    )


class BuildLock:
    """The exclusive right to change one map directory (``<map>/build.lock``).

    Use as a context manager or call :meth:`acquire`/:meth:`release`.  ``taken_over`` is
    the holder of a stale lock this one replaced (None when the lock was free).  Acquiring
    a lock that a running build holds raises :class:`~adcloud.hdmap.errors.BuildError`
    naming the holder.
    """

    def __init__(self, files: _Files, path: str, map_uri: str) -> None:
        self._files = files
        self._path = path
        self._map_uri = map_uri
        self._fd: int | None = None
        self._info: LockInfo | None = None
        self.taken_over: LockInfo | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._info is not None

    def _stale_message(self, old: LockInfo) -> str:
        return (
            f"{self._files.describe(self._path)}: taking over the build lock left by "
            f"{old.describe()}: that process is no longer running (killed or crashed); its "
            "partial output is discarded"
        )

    def acquire(self) -> Self:
        """Take the lock (see the class doc); returns self."""
        if self.held:
            raise BuildError(f"{self._files.describe(self._path)}: this build holds it already")
        me = _this_owner()
        info = LockInfo(
            os.getpid(),
            socket.gethostname(),
            _now_text(),
            self._map_uri,
            str(me["boot"]),
            str(me["start"]),
        )
        if self._files.local:
            self._acquire_local(info)
        else:
            self._acquire_exclusive(info)
        self._info = info
        return self

    def _acquire_local(self, info: LockInfo) -> None:
        path = Path(self._path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(20):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = LockInfo.parse(os.pread(fd, 4096, 0))
                os.close(fd)
                raise _build_running(str(path), holder) from None
            # the previous holder may have unlinked the file between our open and flock: a
            # lock on a deleted inode protects nothing, so retry on the new file
            try:
                same = os.fstat(fd).st_ino == path.stat().st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise BuildError(f"{path}: the lock file keeps being replaced; is something looping?")
        old = LockInfo.parse(os.pread(fd, 4096, 0))
        if old is not None:
            # a holder that exits cleanly deletes the file, so content here means it died
            self.taken_over = old
            _LOG.warning("%s", self._stale_message(old))
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.to_json(), 0)
        os.fsync(fd)
        self._fd = fd

    def _acquire_exclusive(self, info: LockInfo) -> None:
        where = self._files.describe(self._path)
        for _attempt in range(2):
            if self._files.create_exclusive(self._path, info.to_json()):
                return
            try:
                holder = LockInfo.parse(self._files.read_bytes(self._path))
            except FileNotFoundError:
                continue  # released in between: try again
            if holder is None:
                raise BuildError(
                    f"{where}: unreadable build lock; if no build of this map is running, "
                    "delete it and retry"
                )
            if holder.gone():
                self.taken_over = holder
                _LOG.warning("%s", self._stale_message(holder))
                self._files.remove(self._path)
                continue
            hint = (
                "wait for it to finish"
                if holder.host == socket.gethostname()
                else f"if no build runs on {holder.host} any more, delete {where} and retry"
            )
            raise BuildError(
                f"{where}: another build of this map holds the lock ({holder.describe()}); {hint}"
            )
        raise BuildError(f"{where}: could not take the build lock (another build raced us)")

    def release(self) -> None:
        """Give the lock back (deletes the lock file); a no-op when not held."""
        if self._info is None:
            return
        try:
            if self._fd is not None:
                path = Path(self._path)
                with contextlib.suppress(FileNotFoundError):
                    if os.fstat(self._fd).st_ino == path.stat().st_ino:
                        path.unlink()
                os.close(self._fd)
            else:
                with contextlib.suppress(FileNotFoundError):
                    if LockInfo.parse(self._files.read_bytes(self._path)) == self._info:
                        self._files.remove(self._path)
        finally:
            self._fd = None
            self._info = None

    def __enter__(self) -> Self:
        return self.acquire() if not self.held else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# --------------------------------------------------------------------------- staging


class Staging:
    """A new map version being written: write the version's files below :attr:`path` (a
    local directory), then :meth:`commit` -- or :meth:`abort`.  As a context manager,
    leaving the block without a commit aborts.

    For maps on a local filesystem ``path`` is ``<map>/versions/.staging-<id>`` and commit is
    a rename (the next build removes one a killed build left); for other backends it is a
    local directory ``hdmap-staging-*`` (in ``staging_dir``, or the temporary directory)
    uploaded at commit, which the next staging on that host removes if the process that
    made it was killed."""

    def __init__(
        self,
        mapdir: MapDir,
        version_id: str,
        parent: MapVersion | None,
        lock: BuildLock,
        owns_lock: bool,
    ) -> None:
        self._mapdir = mapdir
        self.version_id = version_id
        self.parent = parent
        self._lock = lock
        self._owns_lock = owns_lock
        self._done = False
        # files the new version gets by a copy on the map's storage: path -> the root of the
        # version it comes from (the parent's, or an earlier one's for a rollback)
        self._carried: dict[str, str] = {}
        files = mapdir._files
        if files.local:
            self.path = Path(mapdir._path(VERSIONS_DIR, f"{_STAGING_PREFIX}{version_id}"))
            self.path.mkdir(parents=True)
        else:
            where = mapdir.settings.staging_dir or None
            if where is not None:
                Path(where).mkdir(parents=True, exist_ok=True)
            self.path = make_scratch(_LOCAL_STAGING_PREFIX, where)

    @property
    def done(self) -> bool:
        """Whether the staging was committed or aborted."""
        return self._done

    def copy_from_parent(self, *relpaths: str, local: Path | None = None) -> list[str]:
        """Copy files of the parent version into the staging directory (all of them when no
        path is given) and return their relative paths.  Copies, never links: the build may
        rewrite them in place without touching the parent.  ``local``: a local copy of the
        parent (what :meth:`MapVersion.fetch` downloaded) to copy from, so a parent on a
        store is not downloaded twice."""
        if self.parent is None:
            return []
        names = list(relpaths) or [rel for rel in self.parent.files() if rel != MANIFEST_NAME]
        source = local if local is not None else self.parent.path
        if source is not None:
            missing = [rel for rel in names if not (source / rel).is_file()]
            if missing:
                raise MapFormatError(
                    f"{self.parent.uri}: no file(s) {', '.join(sorted(missing))} in the parent "
                    "version"
                )
        for rel in names:
            target = self.path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if source is not None:
                shutil.copy2(source / rel, target)
            else:
                target.write_bytes(self.parent.read_bytes(rel))
        return names

    def restore_files(self, version: MapVersion) -> list[str]:
        """Give the new version every file of the committed ``version`` (but its manifest)
        and return their relative paths: hard links on a local disk (see
        :func:`link_or_copy`), copies the storage makes at commit elsewhere."""
        self._check_open()
        names = [rel for rel in version.files() if rel != MANIFEST_NAME]
        for rel in names:
            if version.path is not None:
                target = self.path / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                link_or_copy(version.path / rel, target)
            else:
                self._carried[rel] = version._root
        return names

    def parent_files(self, root: Path) -> StoredParent:
        """The parent version's files for a map off the local filesystem, ``root`` being
        where :meth:`MapVersion.fetch` downloaded it (see :class:`StoredParent`)."""
        if self.parent is None or self.parent.path is not None:
            raise HdmapError("internal: parent_files is for a parent version off the local disk")
        return StoredParent(self, root)

    def commit(self, manifest: Manifest, *, keep: int | None = None) -> MapVersion:
        """Write ``manifest.json`` (stamped with this version id, the parent id and the time),
        flush everything, and make this version current in one atomic step; then delete
        old versions beyond ``keep`` (default: the map directory's settings; 0 keeps all)."""
        self._check_open()
        md = self._mapdir
        current = md._current_id()
        expected = self.parent.id if self.parent is not None else None
        if current != expected:
            raise BuildError(
                f"{md.uri}: CURRENT changed during the build (now {current}, the build started "
                f"from {expected}); the version is discarded -- run the build again"
            )
        stamped = dataclasses.replace(
            manifest,
            version=self.version_id,
            parent=expected,
            created_at=manifest.created_at or _now_text(),
            drives=tuple(
                d if d.added_in else dataclasses.replace(d, added_in=self.version_id)
                for d in manifest.drives
            ),
        )
        final = md._path(VERSIONS_DIR, self.version_id)
        written = [rel for rel in sorted(self._carried) if (self.path / rel).exists()]
        if written:
            raise BuildError(
                f"{md.uri}: {', '.join(written[:5])} were both written and carried from the "
                "parent version; the version is discarded"
            )
        if md._files.local:
            (self.path / MANIFEST_NAME).write_text(stamped.to_json(), encoding="utf-8")
            if md.settings.fsync:
                for dirpath, _dirs, names in os.walk(self.path):
                    for name in names:
                        _fsync_path(Path(dirpath) / name)
                    _fsync_path(Path(dirpath), directory=True)
            self.path.rename(final)
            if md.settings.fsync:
                _fsync_path(Path(final).parent, directory=True)
        else:
            # the manifest goes last: a version directory without it is an interrupted upload
            md._files.put_tree(self.path, final)
            md._files.copy_many(
                [
                    (posixpath.join(source, rel), posixpath.join(final, rel))
                    for rel, source in sorted(self._carried.items())
                ]
            )
            md._files.write_atomic(posixpath.join(final, MANIFEST_NAME), stamped.to_json().encode())
            self._discard()
        md._files.write_atomic(md._path(CURRENT_NAME), f"{self.version_id}\n".encode())
        self._done = True
        _LOG.info(
            "%s: version %s is current (%d drives)", md.uri, self.version_id, len(stamped.drives)
        )
        keep = md.settings.keep_versions if keep is None else keep
        try:
            if keep:
                md.gc(keep)
        except Exception as err:
            # The new version is committed: whatever goes wrong now must not make the
            # caller take a build that succeeded for a failed one. Old versions are only
            # left for the next build's gc.
            _LOG.warning("%s: could not remove old versions: %s", md.uri, err)
        finally:
            self._finish()
        return md.version(self.version_id)

    def abort(self) -> None:
        """Discard the staging directory; the current version is untouched."""
        if self._done:
            return
        self._done = True
        try:
            self._discard()
        finally:
            self._finish()

    def _discard(self) -> None:
        if self._mapdir._files.local:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            remove_scratch(self.path)

    def _check_open(self) -> None:
        if self._done:
            raise BuildError(f"{self._mapdir.uri}: staging {self.version_id} is already finished")

    def _finish(self) -> None:
        if self._owns_lock:
            self._lock.release()
            self._mapdir._held = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._done:
            self.abort()


class StoredParent:
    """A build's parent version on a map off the local filesystem (an object store, HDFS, an
    adcloud store), as :class:`adcloud.hdmap.kept.VersionFiles`: ``root`` holds what
    :meth:`MapVersion.fetch` downloaded; the files it left out are downloaded into it when
    :meth:`local` asks for one, and a file the new version carries unchanged is copied on the
    storage when the version is committed, never downloaded and uploaded again."""

    def __init__(self, staging: Staging, root: Path) -> None:
        assert staging.parent is not None
        self.root = root
        self._staging = staging
        self._parent = staging.parent
        self._listing = frozenset(staging.parent.files())

    def names(self, folder: str) -> list[str]:
        prefix = folder.rstrip("/") + "/"
        return sorted(
            rel[len(prefix) :]
            for rel in self._listing
            if rel.startswith(prefix) and "/" not in rel[len(prefix) :]
        )

    def local(self, rel: str) -> Path:
        self.fetch([rel])
        return self.root / rel

    def fetch(self, rels: Sequence[str]) -> None:
        missing = sorted({rel for rel in rels if not (self.root / rel).is_file()})
        for rel in missing:
            self._check(rel)
        if missing:
            self._parent.download(missing, self.root)

    def carry(self, rel: str, out_dir: Path) -> None:
        if out_dir.resolve() != self._staging.path.resolve():
            raise HdmapError(f"internal: {out_dir} is not the staging {self._staging.path}")
        self._check(rel)
        self._staging._carried[rel] = self._parent._root

    def _check(self, rel: str) -> None:
        if rel not in self._listing:
            raise missing_from_previous(f"{self._parent.uri}/{rel}")


# --------------------------------------------------------------------------- map directory


class MapDir:
    """A versioned map directory (layout and guarantees in the module docstring).

    ``MapDir(uri)`` reads nothing eagerly; every method reads the directory afresh, so one
    object may be kept across builds.  It pickles as its URI and settings.  On an adcloud
    store (``local://``, ``alluxio://``) it opens the store, which holds threads, files and
    connections: use it in a ``with`` block (or :meth:`close` it).
    """

    def __init__(self, uri: str | os.PathLike[str], settings: MapDirSettings | None = None) -> None:
        self.settings = settings or MapDirSettings()
        self._uri_text = os.fspath(uri)
        self._files, self._root = _locate(self._uri_text, fsync=self.settings.fsync)
        self.uri = self._files.describe(self._root)
        if self._files.local and Path(self._root).is_file():
            raise HdmapError(
                f"{self._uri_text} is a file, not a map directory; give --map the directory "
                "a build made (it holds CURRENT and versions/), or a new one"
            )
        self._held: BuildLock | None = None
        self._active: Staging | None = None

    def __reduce__(self) -> tuple[Callable[..., MapDir], tuple[str, MapDirSettings]]:
        return (MapDir, (self._uri_text, self.settings))

    def __repr__(self) -> str:
        return f"MapDir({self.uri!r})"

    def close(self) -> None:
        """Release the backend's connections (a store's threads); the object stays usable
        for nothing after that.  The versions and plans it returned stay readable: a store
        is opened again for what reads them, and closed once they are gone."""
        self._files.close()

    def adopt(self, plan: BuildPlan) -> BuildPlan:
        """``plan``, made by :meth:`plan` of another :class:`MapDir` of this map (perhaps
        closed since), with its parent version read through this one: a build that is given
        a plan reads the parent through the map it commits to, and what it opened is closed
        with it.  A plan of another map is a :class:`HdmapError`."""
        parent = plan.parent
        if parent is None:
            return plan
        root = self._path(VERSIONS_DIR, parent.id)
        if parent.uri != self._files.describe(root):
            raise HdmapError(
                f"the plan builds on {parent.uri}, a version of another map than {self.uri}; "
                "plan the build for this map"
            )
        return dataclasses.replace(plan, parent=dataclasses.replace(parent, _files=self._files))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _path(self, *parts: str) -> str:
        return posixpath.join(self._root, *parts)

    # -- reading -----------------------------------------------------------------------------

    def _current_id(self) -> str | None:
        path = self._path(CURRENT_NAME)
        try:
            text = self._files.read_bytes(path).decode("ascii", "replace").strip()
        except FileNotFoundError:
            committed = self.versions()
            if committed:
                raise self._no_current(path, committed) from None
            return None
        if not _VERSION_RE.match(text):
            raise MapFormatError(
                f"{self._files.describe(path)}: {text[:40]!r} is not a version id; write the id "
                f"of a directory under {self.uri}/{VERSIONS_DIR} into it"
            )
        return text

    def _no_current(self, path: str, committed: Sequence[str]) -> MapFormatError:
        """The error for a map whose ``CURRENT`` is missing beside committed versions: a map
        damaged by hand (or its first build killed between publishing its version and
        writing ``CURRENT``). Taken for an empty map, a build would start a new map over
        the old one -- another origin, no parent -- and its gc delete old versions."""
        holder = self.lock_holder()
        # a build publishing the map's first version renames it into place, then writes
        # CURRENT: a reader in between sees this (a lock left by a dead build says nothing)
        live = holder is not None and not holder.gone()
        busy = (
            f"; if the build holding the lock ({holder.describe()}) is publishing the map's "
            "first version, try again in a moment"
            if holder is not None and live
            else ""
        )
        return MapFormatError(
            f"{self._files.describe(path)}: missing, but the map holds committed versions "
            f"{', '.join(committed)}: the map is damaged (CURRENT names the version readers "
            "and builds use). Write the id of the version to use into it -- e.g. "
            f'{committed[-1]}, the newest, as one line "{committed[-1]}" -- and run the '
            f"command again (adcloud hdmap rollback --to VERSION then switches versions){busy}"
        )

    def current(self) -> MapVersion | None:
        """The current version, or None for a map that has none yet (a map whose
        ``CURRENT`` is missing beside committed versions is a :class:`MapFormatError`)."""
        vid = self._current_id()
        return None if vid is None else self.version(vid)

    def no_version_text(self) -> str:
        """Why :meth:`current` is None, for a message: nothing at all at the map's URI (a
        mistyped path?), or a map directory no build has committed to yet."""
        if not self._files.exists(self._root):
            return (
                f"{self._uri_text}: no map there (nothing at that path); check the path, or "
                "build one with adcloud hdmap build"
            )
        return f"{self._uri_text}: no version yet (build it with adcloud hdmap build)"

    def version(self, version_id: str) -> MapVersion:
        """The committed version ``version_id`` (``"000003"``, or ``"3"``); MapFormatError if
        it is missing or broken."""
        version_id = version_name(version_id)
        if not _VERSION_RE.match(version_id):  # "../../other/versions/000001" read elsewhere
            kept = ", ".join(self.versions()) or "none"
            raise MapFormatError(
                f"{version_id!r} is not a version id of {self.uri}: ids are numbers (the "
                f"versions kept: {kept}; adcloud hdmap info lists them)"
            )
        root = self._path(VERSIONS_DIR, version_id)
        where = self._files.describe(posixpath.join(root, MANIFEST_NAME))
        try:
            text = self._files.read_bytes(posixpath.join(root, MANIFEST_NAME))
        except FileNotFoundError:
            kept = ", ".join(self.versions()) or "none"
            raise MapFormatError(
                f"{where}: missing; version {version_id} of {self.uri} does not exist or was "
                f"never committed (the versions kept: {kept}; adcloud hdmap info lists them)"
            ) from None
        manifest = Manifest.from_json(text, where)
        return MapVersion(
            id=version_id,
            uri=self._files.describe(root),
            manifest=manifest,
            path=Path(root) if self._files.local else None,
            _files=self._files,
            _root=root,
        )

    def versions(self) -> list[str]:
        """Ids of the committed versions (those with a manifest), oldest first."""
        out = []
        for name in self._files.listdir(self._path(VERSIONS_DIR)):
            if _VERSION_RE.match(name) and self._files.exists(
                self._path(VERSIONS_DIR, name, MANIFEST_NAME)
            ):
                out.append(name)
        return sorted(out, key=int)

    def lock_holder(self) -> LockInfo | None:
        """Who holds the build lock as recorded in ``build.lock`` (None when there is none;
        the holder may be a dead process whose lock the next build takes over)."""
        try:
            return LockInfo.parse(self._files.read_bytes(self._path(LOCK_NAME)))
        except FileNotFoundError:
            return None

    def refuse_if_building(self) -> None:
        """Raise :class:`~adcloud.hdmap.errors.BuildError` when a build on this host holds
        the lock now: a check before work that would end at the lock (a build's Spark
        session).  A lock of another host or of a dead build is left to the lock itself."""
        holder = self.lock_holder()
        if holder is not None and holder.host == socket.gethostname() and not holder.gone():
            raise _build_running(self.uri, holder)

    # -- planning ----------------------------------------------------------------------------

    def plan(
        self,
        bag_uris: Iterable[str | os.PathLike[str]],
        *,
        trust_mtime: bool = False,
        readmit: Collection[str] = (),
        progress: HashProgress | None = None,
    ) -> BuildPlan:
        """Compare the bags with the current manifest by content hash (see
        :class:`BuildPlan`).  ``progress(bytes hashed, bytes to hash)`` follows the hashing
        (from the hashing threads, a few times a second).  ``trust_mtime`` reuses the
        recorded hash of a bag whose URI, size and mtime are unchanged instead of reading it
        (rsync's quick check: a nightly build then reads only new bags; a bag without a
        modification time is hashed).
        Bags whose bytes a rollback held out are skipped, unless ``readmit`` names them (by
        drive name or a prefix of at least 8 digits of their SHA-256): then they are new
        drives, and their bags must be among ``bag_uris``.  Reads the bags; writes nothing."""
        parent = self.current()
        drives = parent.manifest.drives if parent is not None else ()
        held = parent.manifest.held_out if parent is not None else ()
        readmitted = _held_drives(held, readmit, self.uri)
        held_hash = {d.sha256 for d in held} - {d.sha256 for d in readmitted}
        known_hash = {d.sha256: d for d in drives}
        known_uri = {d.uri: d for d in (*held, *drives)}
        # a held-out drive keeps its name: a new drive of other bytes named like it would be
        # taken for it (in info, by diff, which compares drives by name)
        used_names = {d.name for d in drives} | {d.name for d in held if d not in readmitted}
        seen: set[str] = set()
        new: list[DriveRecord] = []
        known: list[DriveRecord] = []
        renamed: list[tuple[str, str]] = []
        duplicates: list[str] = []
        skipped: list[str] = []
        stated: list[tuple[str | os.PathLike[str], str, int, float | None, str | None]] = []
        for raw in bag_uris:
            files, path = _locate(raw)
            uri = _described(raw, files, path)
            try:
                with files:
                    size, mtime = files.size_mtime(path)
            except FileNotFoundError as err:
                raise HdmapError(f"{uri}: no such bag file or directory") from err
            except OSError as err:
                raise HdmapError(f"{uri}: cannot read the bag: {err}") from err
            prev = known_uri.get(uri)
            trusted = trust_mtime and prev is not None and prev.looks_unchanged(size, mtime)
            stated.append((raw, uri, size, mtime, prev.sha256 if trusted and prev else None))
        unread = [(raw, uri, size) for raw, uri, size, _, digest in stated if digest is None]
        settings = self.settings
        hashed = iter(
            _hash_bags(unread, settings.hash_chunk_bytes, settings.hash_threads, progress)
        )
        for _, uri, stat_size, mtime, known_digest in stated:
            # the size stated before hashing: a bag that grew while it was hashed (a copy
            # still being written) is then told by bag_changed() from the bytes hashed
            digest, size = known_digest or next(hashed)[0], stat_size
            if digest in seen:
                _LOG.info("%s: same bytes as another input; skipped", uri)
                duplicates.append(uri)
                continue
            seen.add(digest)
            if digest in held_hash:
                _LOG.info("%s: held out of %s by a rollback; skipped", uri, self.uri)
                skipped.append(uri)
                continue
            if digest in known_hash:
                rec = known_hash[digest]
                known.append(rec)
                if rec.uri != uri:
                    renamed.append((rec.uri, uri))
                continue
            name = drive_name(uri)
            if name in used_names:  # same name, other bytes: a new drive needs its own name
                name = f"{name}-{digest[:8]}"
            used_names.add(name)
            new.append(DriveRecord(name=name, uri=uri, sha256=digest, size=size, mtime=mtime))
        absent = [d.name for d in readmitted if d.sha256 not in seen]
        if absent:
            raise HdmapError(
                f"{self.uri}: readmitted drive(s) {', '.join(absent)} are not among the bags "
                "given; give their bags too"
            )
        removed = tuple(d for d in drives if d.sha256 not in seen)
        return BuildPlan(
            parent=parent,
            new_drives=tuple(new),
            known_drives=tuple(known),
            removed=removed,
            renamed=tuple(renamed),
            duplicates=tuple(duplicates),
            held_out=tuple(d for d in held if d.sha256 in held_hash),
            skipped=tuple(skipped),
        )

    # -- writing -----------------------------------------------------------------------------

    def lock(self) -> BuildLock:
        """A (not yet acquired) build lock of this map; ``with md.lock(): ...``."""
        return _MapDirLock(self)

    def _cleanup(self) -> None:
        """Remove what interrupted builds left (under the lock): staging directories and
        version directories without a manifest (an interrupted upload)."""
        versions = self._path(VERSIONS_DIR)
        for name in self._files.listdir(versions):
            path = posixpath.join(versions, name)
            partial = _VERSION_RE.match(name) and not self._files.exists(
                posixpath.join(path, MANIFEST_NAME)
            )
            if name.startswith(_STAGING_PREFIX) or partial or ".tmp-" in name:
                _LOG.warning("%s: removing %s left by an interrupted build", self.uri, name)
                self._files.remove(path, recursive=True)
        for name in self._files.listdir(self._root):
            if ".tmp-" in name:
                self._files.remove(self._path(name))

    def _next_id(self) -> str:
        ids = [0]
        for name in self._files.listdir(self._path(VERSIONS_DIR)):
            digits = name.removeprefix(_STAGING_PREFIX)
            if _VERSION_RE.match(digits):
                ids.append(int(digits))
        current = self._current_id()
        if current is not None:
            ids.append(int(current))
        return f"{max(ids) + 1:06d}"

    def begin(self, parent: MapVersion | None) -> Staging:
        """Start writing a new version on top of ``parent`` (normally :meth:`current`).

        Takes the build lock unless this object holds it already (then the caller releases
        it), removes leftovers of interrupted builds and returns the :class:`Staging`."""
        cur = self._current_id()
        expected = parent.id if parent is not None else None
        if cur != expected:
            raise BuildError(
                f"{self.uri}: the parent version {expected} is not current (CURRENT is {cur}); "
                "plan again from `current()`"
            )
        if self._active is not None and not self._active.done:
            raise BuildError(
                f"{self.uri}: version {self._active.version_id} is still being written by this "
                "process; commit or abort it first"
            )
        owns = self._held is None
        lock = self._held or BuildLock(self._files, self._path(LOCK_NAME), self.uri).acquire()
        try:
            self._cleanup()
            staging = Staging(self, self._next_id(), parent, lock, owns)
        except BaseException:
            if owns:
                lock.release()
            raise
        if owns:
            self._held = lock
        self._active = staging
        return staging

    def gc(self, keep: int | None = None) -> list[str]:
        """Delete old versions, keeping the current one and the ``keep - 1`` versions just
        before it (``keep`` defaults to the settings); versions newer than the current one
        (a commit interrupted before switching CURRENT, or a rolled-back version) are
        deleted too.  Takes the build lock unless this object holds it (BuildError while
        another build runs).  Returns the deleted ids."""
        keep = self.settings.keep_versions if keep is None else keep
        if keep < 1:
            raise BuildError(f"{self.uri}: gc must keep at least 1 version, got {keep}")
        if self._held is None:
            # under the lock: a build between renaming its version into place and switching
            # CURRENT must not see that version deleted as "newer than current"
            with self.lock():
                return self._gc(keep)
        return self._gc(keep)

    def _gc(self, keep: int) -> list[str]:
        current = self._current_id()
        if current is None:
            return []
        older = [v for v in self.versions() if int(v) <= int(current)]
        kept = set(older[-keep:]) | {current}
        removed = []
        for vid in self.versions():
            if vid not in kept:
                self._files.remove(self._path(VERSIONS_DIR, vid), recursive=True)
                removed.append(vid)
        if removed:
            _LOG.info("%s: removed old versions %s", self.uri, ", ".join(removed))
        return removed

    def update(
        self,
        bag_uris: Sequence[str | os.PathLike[str]],
        build: Callable[[BuildPlan, Staging], None],
        *,
        settings: object = None,
        trust_mtime: bool = False,
        plan: BuildPlan | None = None,
        force: bool = False,
        readmit: Collection[str] = (),
        labels: str | None = None,
    ) -> BuildResult:
        """One incremental, idempotent, atomic build step.

        Plans (or takes ``plan``, made by :meth:`plan` for the same bags, so that they are
        not hashed twice); when nothing is new returns at once having written nothing --
        unless ``force`` (a version of the map that changes other than by drives: labels),
        when ``build`` is called with a plan that has no new drives.
        Otherwise takes the lock, plans again if another build committed meanwhile, begins
        a staging version, calls ``build(plan, staging)`` -- which writes the version's
        files under ``staging.path``, merging the new drives into the parent's products --
        and commits with the plan's manifest (``settings`` recorded in it).  If ``build``
        raises, the staging is discarded and the error propagates; the current version is
        untouched.  ``readmit``: held-out drives to take back (see :meth:`plan`);
        ``labels``: the label file ``build`` imports, recorded in the manifest.
        """
        if plan is None:
            plan = self.plan(bag_uris, trust_mtime=trust_mtime, readmit=readmit)
        if plan.up_to_date and not force:
            _LOG.info("%s: up to date (%d drives known)", self.uri, len(plan.known_drives))
            return BuildResult(plan, plan.parent, changed=False)
        with self.lock():
            current = self._current_id()
            if current != (plan.parent.id if plan.parent is not None else None):
                plan = self.plan(bag_uris, trust_mtime=trust_mtime, readmit=readmit)
                if plan.up_to_date and not force:
                    return BuildResult(plan, plan.parent, changed=False)
            with self.begin(plan.parent) as staging:
                _LOG.info(
                    "%s: building version %s from %d new drive(s) on top of %s",
                    self.uri,
                    staging.version_id,
                    len(plan.new_drives),
                    plan.parent.id if plan.parent is not None else "an empty map",
                )
                build(plan, staging)
                version = staging.commit(plan.manifest(settings, labels=labels))
        return BuildResult(plan, version, changed=True)

    def roll_back(self, to: str | None = None) -> MapVersion:
        """Publish the map of the kept version ``to`` (default: the version the current one
        was built on) as a new version, and return it.  No version is changed: the new one
        gets ``to``'s files (hard links on a local disk, copies the storage makes elsewhere)
        and its manifest, with ``restores`` set; the drives of the current version that
        ``to`` lacks are *held out*, so that the next nightly build does not add them again
        (``adcloud hdmap build --readmit NAME`` takes one back).  Rolling back a rollback
        undoes it.  Atomic and exclusive like a build; its gc keeps at least the versions
        the map's builds keep (``keep_versions`` recorded in the current version)."""
        if self.current() is None:  # before the lock, which would make a mistyped map's folder
            raise HdmapError(f"no version to roll back: {self.no_version_text()}")
        with self.lock():
            current = self.current()
            if current is None:
                raise HdmapError(f"{self.uri}: no version to roll back")
            target_id = version_name(to) if to is not None else current.manifest.parent
            if target_id is None:
                raise HdmapError(
                    f"{self.uri}: version {current.id} is the first version; there is none "
                    "to roll back to"
                )
            if target_id == current.id:
                raise HdmapError(f"{self.uri}: version {current.id} is current already")
            if target_id not in self.versions():
                raise HdmapError(
                    f"{self.uri}: no version {target_id} to roll back to; the versions kept "
                    f"are {', '.join(self.versions())} (hdmap.keep_versions sets how many)"
                )
            target = self.version(target_id)
            there = {d.sha256 for d in target.manifest.drives}
            held: dict[str, DriveRecord] = {}
            for d in (
                *current.manifest.held_out,
                *target.manifest.held_out,
                *current.manifest.drives,
            ):
                if d.sha256 not in there:
                    held.setdefault(d.sha256, d)
            with self.begin(current) as staging:
                staging.restore_files(target)
                version = staging.commit(
                    dataclasses.replace(
                        target.manifest,
                        version="",
                        parent=None,
                        created_at="",
                        adcloud_version=__version__,
                        held_out=tuple(held.values()),
                        restores=target.id,
                        labels=None,  # imports no labels: it republishes target's
                    ),
                    keep=self._rollback_keep(current),
                )
        _LOG.info(
            "%s: version %s restores %s; %d drive(s) held out",
            self.uri,
            version.id,
            target.id,
            len(held),
        )
        return version

    def _rollback_keep(self, current: MapVersion) -> int:
        """How many versions a rollback keeps: the settings' count, but never fewer than the
        map's builds keep (``keep_versions`` recorded in the current version). A rollback
        undoes a bad night; run without the build's settings file, the default of 5 would
        delete versions that the nightly build, configured to keep more, keeps."""
        keep = self.settings.keep_versions
        built = current.manifest.settings.get("keep_versions")
        if keep == 0 or isinstance(built, bool) or not isinstance(built, int) or built < 0:
            return keep
        return 0 if built == 0 else max(keep, built)


def _held_drives(
    held: Sequence[DriveRecord], names: Collection[str], where: str
) -> list[DriveRecord]:
    """The held-out drives that ``names`` name (a drive name, or 8 or more leading digits of
    its SHA-256); HdmapError for a name that names none of them."""
    out: list[DriveRecord] = []
    for name in names:
        found = [
            d for d in held if name == d.name or (len(name) >= 8 and d.sha256.startswith(name))
        ]
        if not found:
            have = ", ".join(d.name for d in held) or "none"
            raise HdmapError(
                f"{where}: no held-out drive is called {name!r} (held out: {have}; "
                "`adcloud hdmap info` lists them)"
            )
        out += [d for d in found if d not in out]
    return out


class _MapDirLock(BuildLock):
    """A :class:`BuildLock` that registers itself with its :class:`MapDir`, so that
    :meth:`MapDir.begin` inside the ``with`` block uses it."""

    def __init__(self, mapdir: MapDir) -> None:
        super().__init__(mapdir._files, mapdir._path(LOCK_NAME), mapdir.uri)
        self._mapdir = mapdir

    def acquire(self) -> Self:
        if self._mapdir._held is not None:
            raise BuildError(f"{self._mapdir.uri}: this process already holds the build lock")
        super().acquire()
        self._mapdir._held = self
        return self

    def release(self) -> None:
        try:
            super().release()
        finally:
            if self._mapdir._held is self:
                self._mapdir._held = None
