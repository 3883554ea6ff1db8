"""Stores on any fsspec filesystem: ``file://``, ``memory://``, ``hdfs://``, ``s3://``, ...

The URI's path is the store's root; store paths live below it.  Nothing is cached, so every
file is always persisted: ``pin``, ``unpin``, ``free`` and ``persist`` succeed without doing
anything, and ``tier`` is ``None``.  TTLs are not supported (nothing would expire them).

Writes are atomic: a ``file://`` store writes a hidden temporary file beside the target,
``fsync``\\ s it and renames it into place (then ``fsync``\\ s the directory), so it doubles as
the durable on-disk baseline the benchmarks compare against; other filesystems stage under a
temporary key and move it into place.  On ``file://`` every path is confined to the root
after resolving symlinks.

Object stores (``s3://``, ``gs://``, ...) hold keys, not a tree: a directory exists while a
file lies below it, so ``mkdir`` of a directory that stays empty leaves nothing behind, and
a file may be written below a key that is itself a file (the store does not look up every
parent of every write: that would be a request per level).  Renaming a directory there
copies its files (one fsspec call: concurrent requests) and then deletes them.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import re
from collections.abc import Iterator
from typing import Any, BinaryIO, Literal, cast

import fsspec

from adcloud.store._understore import (
    StagingWriter,
    UnderStore,
    has_glob,
    move_literal,
    remove_literal,
)
from adcloud.store.base import (
    BaseStore,
    FileStatus,
    PersistenceState,
    TtlAction,
    WriteType,
    install_hint,
    normalize_path,
)
from adcloud.store.errors import (
    StoreBackendMissingError,
    StoreError,
    StoreExistsError,
    StoreFullError,
    StoreNotFoundError,
    StorePreconditionError,
    StoreUnavailableError,
)

__all__ = ["FsspecStore"]

_TMP_MARK = ".adcloud-tmp-"
# what pyarrow's HDFS client says when the Hadoop/Java pieces it loads at runtime are missing
_CLIENT_MISSING = re.compile(r"libjvm|libhdfs|JAVA_HOME|CLASSPATH", re.IGNORECASE)


#: Keys of fsspec ``info`` dicts that name one version of an object, best first: the
#: entity tag (s3fs ``ETag``, gcsfs and adlfs ``etag``; in listings and lookups alike),
#: then version ids (versioned S3 buckets, GCS generations).
_VERSION_KEYS = (("etag", "etag"), ("versionid", "version"), ("generation", "version"))


def _version_tag(info: dict[str, Any]) -> str | None:
    """What tells this version of an object from the next (``FileStatus.checksum``):
    ``etag:<tag>`` or ``version:<id>`` where the filesystem reports one, else None.

    An object store keeps modification times in whole seconds, so a replacement of the
    same size within a second looks like the old version by size and time alone, and a
    reader that keeps a stream open would read on in the replaced bytes."""
    lowered = {str(k).lower(): v for k, v in info.items()}
    for key, kind in _VERSION_KEYS:
        value = lowered.get(key)
        if value not in (None, ""):
            return f"{kind}:{str(value).strip(chr(34))}"
    return None


class FsspecStore(BaseStore):
    """A store rooted at an fsspec URL; ``storage_options`` go to the filesystem."""

    def __init__(self, uri: str, **storage_options: Any) -> None:
        super().__init__(uri, storage_options)
        scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
        hint = install_hint(scheme)
        try:
            fs, root = fsspec.core.url_to_fs(uri, **storage_options)
        except ImportError as err:
            raise StoreBackendMissingError(
                f"{scheme}:// stores need a package that is not installed ({err}): "
                f"{hint or 'see the fsspec documentation for ' + scheme}"
            ) from err
        except Exception as err:
            text = str(err)
            if _CLIENT_MISSING.search(text):
                raise StoreBackendMissingError(
                    f"{uri}: the {scheme} client is not usable ({text}): {hint}"
                ) from err
            raise StoreUnavailableError(f"cannot open {uri}: {text}") from err
        self._fs: Any = fs
        self._root = str(root).rstrip("/")
        self._ufs = UnderStore(uri, **storage_options)
        self._local = self._ufs.local_root is not None
        # fsspec's memory filesystem hands every reader the same file object (one shared
        # position), so concurrent readers would tear each other's reads: copy instead
        self._shared_handles = type(fs).__name__ == "MemoryFileSystem"

    def _full(self, path: str) -> str:
        key = normalize_path(path)
        if self._local:
            return str(self._ufs.local_path(key))
        return (self._root + key) if key != "/" else (self._root or "/")

    def _rel(self, full: str) -> str:
        name = self._fs._strip_protocol(full).rstrip("/")
        if self._root and name.startswith(self._root):
            name = name[len(self._root) :]
        return normalize_path(name or "/")

    @contextlib.contextmanager
    def _errors(self, path: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except FileNotFoundError as err:
            raise StoreNotFoundError(f"{path} does not exist in {self.uri}") from err
        except FileExistsError as err:
            raise StoreExistsError(f"{path} already exists in {self.uri}") from err
        except (IsADirectoryError, NotADirectoryError) as err:
            raise StorePreconditionError(f"{path}: {err.strerror or err}") from err
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(f"{self.uri} is out of space writing {path}: {err}") from err
            raise StoreError(f"{self.uri}: {path}: {err}") from err

    def _info(self, path: str) -> dict[str, Any] | None:
        full = self._full(path)
        with self._errors(path):
            try:
                info: dict[str, Any] = self._fs.info(full)
            except FileNotFoundError:
                if normalize_path(path) == "/":  # the root always exists, if empty
                    return {"name": full, "type": "directory", "size": 0}
                return None
            return info

    def _status(self, info: dict[str, Any]) -> FileStatus:
        is_dir = info.get("type") == "directory"
        mtime = info.get("mtime", info.get("created", info.get("LastModified", 0.0)))
        if isinstance(mtime, datetime.datetime):
            mtime = mtime.timestamp()
        return FileStatus(
            path=self._rel(info["name"]),
            size=0 if is_dir else int(info.get("size") or 0),
            is_dir=is_dir,
            mtime=float(mtime or 0.0),
            tier=None,
            pinned=False,
            persistence=PersistenceState.PERSISTED,
            ttl=None,
            ttl_action=TtlAction.DELETE,
            checksum=None if is_dir else _version_tag(info),
            write_type=None if is_dir else WriteType.THROUGH,
        )

    def _writer(self, path: str) -> StagingWriter:
        key = normalize_path(path)
        if key == "/":
            raise StorePreconditionError("/ is the root directory, not a file")
        info = self._info(key)
        if info is not None and info.get("type") == "directory":
            raise StorePreconditionError(f"{key} is a directory")
        with self._errors(key):
            try:
                return StagingWriter(self._ufs.begin(key), key)
            except (StoreError, OSError):
                self._check_parents(key)
                raise

    def _check_parents(self, key: str) -> None:
        """Raise :class:`StorePreconditionError` if a file stands where a parent directory
        of ``key`` would be."""
        parts = key.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            above = "/" + "/".join(parts[: i + 1])
            found = self._info(above)
            if found is not None and found.get("type") != "directory":
                raise StorePreconditionError(
                    f"{above} is a file, so {key} cannot be created below it"
                ) from None

    def put(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Write ``data`` atomically (``write_type`` and ``pinned`` have no effect here)."""
        if write_type is not None:
            WriteType.parse(write_type)
        if ttl is not None:
            self.set_ttl(path, ttl)  # raises: this backend has no TTL
        writer = self._writer(path)
        try:
            with self._errors(path):
                writer.write(data)
                writer.close()
        finally:
            writer.abort()

    def open(
        self,
        path: str,
        mode: Literal["rb", "wb"] = "rb",
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> BinaryIO:
        """A read stream, or a write stream that publishes the file when closed."""
        if mode == "wb":
            if write_type is not None:
                WriteType.parse(write_type)
            if ttl is not None:
                self.set_ttl(path, ttl)
            return cast(BinaryIO, self._writer(path))
        if mode != "rb":
            raise ValueError(f"mode must be 'rb' or 'wb', not {mode!r}")
        key = normalize_path(path)
        info = self._info(key)
        if info is None:
            raise StoreNotFoundError(f"{key} does not exist in {self.uri}")
        if info.get("type") == "directory":
            raise StorePreconditionError(f"{key} is a directory, not a file")
        with self._errors(key):
            if self._shared_handles:
                return io.BytesIO(self._fs.cat_file(self._full(key)))
            return cast(BinaryIO, self._fs.open(self._full(key), "rb"))

    def get(self, path: str) -> bytes:
        """All bytes of ``path`` (one ``cat_file`` call)."""
        key = normalize_path(path)
        info = self._info(key)
        if info is None:
            raise StoreNotFoundError(f"{key} does not exist in {self.uri}")
        if info.get("type") == "directory":
            raise StorePreconditionError(f"{key} is a directory, not a file")
        with self._errors(key):
            return bytes(self._fs.cat_file(self._full(key)))

    def copy(
        self,
        src: str,
        dst: str,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Copy the file ``src`` to ``dst``.  Object stores copy it themselves (S3's
        CopyObject: atomic, and no bytes through this process); a ``file://`` store
        streams it through a staged, fsynced file like :meth:`put`."""
        if self._local:
            super().copy(src, dst, write_type=write_type, ttl=ttl, pinned=pinned)
            return
        if write_type is not None:
            WriteType.parse(write_type)
        if ttl is not None:
            self.set_ttl(dst, ttl)  # raises: this backend has no TTL
        s, d = normalize_path(src), normalize_path(dst)
        info = self._info(s)
        if info is None:
            raise StoreNotFoundError(f"{s} does not exist in {self.uri}")
        if info.get("type") == "directory":
            raise StorePreconditionError(f"{s} is a directory, not a file")
        if d == "/":
            raise StorePreconditionError("/ is the root directory, not a file")
        target = self._info(d)
        if target is not None and target.get("type") == "directory":
            raise StorePreconditionError(f"{d} is a directory")
        self._check_parents(d)
        if s == d:
            return  # onto itself: nothing changes (S3 refuses such a CopyObject)
        with self._errors(d):
            self._fs.makedirs(self._full(d.rsplit("/", 1)[0] or "/"), exist_ok=True)
            self._fs.cp_file(self._full(s), self._full(d))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return self._info(path) is not None

    def stat(self, path: str) -> FileStatus:
        """Status of ``path`` (always persisted, never tiered)."""
        info = self._info(path)
        if info is None:
            raise StoreNotFoundError(f"{normalize_path(path)} does not exist in {self.uri}")
        return self._status(info)

    def list(self, path: str = "/", *, recursive: bool = False) -> list[FileStatus]:
        """Entries below directory ``path`` (a file lists as itself), sorted by path."""
        key = normalize_path(path)
        info = self._info(key)
        if info is None:
            raise StoreNotFoundError(f"{key} does not exist in {self.uri}")
        if info.get("type") != "directory":
            return [self._status(info)]
        full = self._full(key)
        if key == "/" and not self._fs.exists(full):
            return []
        with self._errors(key):
            if recursive:
                found = self._fs.find(full, withdirs=True, detail=True)
                entries = list(found.values())
            else:
                entries = self._fs.ls(full, detail=True)
        out = [
            self._status(e)
            for e in entries
            if _TMP_MARK not in e["name"] and self._rel(e["name"]) != key
        ]
        return sorted(out, key=lambda s: s.path)

    def mkdir(self, path: str) -> None:
        """Create directory ``path`` and its parents."""
        key = normalize_path(path)
        info = self._info(key)
        if info is not None:
            if info.get("type") != "directory":
                raise StoreExistsError(f"{key} exists and is a file")
            return
        with self._errors(key):
            self._fs.makedirs(self._full(key), exist_ok=True)

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory (non-empty ones only with ``recursive``)."""
        key = normalize_path(path)
        info = self._info(key)
        if info is None:
            raise StoreNotFoundError(f"{key} does not exist in {self.uri}")
        full = self._full(key)
        with self._errors(key):
            if info.get("type") == "directory":
                if not recursive and self._fs.ls(full):
                    raise StorePreconditionError(
                        f"{key} is a non-empty directory; delete it with recursive=True"
                    )
                if key == "/":
                    for entry in self._fs.ls(full, detail=False):
                        remove_literal(self._fs, entry, recursive=True)
                    return
                remove_literal(self._fs, full, recursive=True)
            else:
                self._fs.rm_file(full)

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``; ``dst`` must not exist (checked, then moved: not atomic)."""
        s, d = normalize_path(src), normalize_path(dst)
        if self._info(s) is None:
            raise StoreNotFoundError(f"{s} does not exist in {self.uri}")
        if s == d:
            return
        if d.startswith(s + "/") or "/" in (s, d):
            raise StorePreconditionError(f"cannot move {s} to {d}")
        if self._info(d) is not None:
            raise StoreExistsError(f"{d} already exists in {self.uri}")
        with self._errors(s):
            parent = d.rsplit("/", 1)[0]
            if parent:
                self._fs.makedirs(self._full(parent), exist_ok=True)
            source = self._full(s)
            if self._local or (self._fs.isfile(source) and not has_glob(source)):
                self._fs.mv(source, self._full(d), recursive=True)
                return
            # fsspec's recursive mv copies the pseudo-directories of an object store as keys,
            # and it takes "*", "?" and "[" in a name for a pattern
            move_literal(self._fs, source, self._full(d))

    def _require(self, path: str) -> None:
        if self._info(path) is None:
            raise StoreNotFoundError(f"{normalize_path(path)} does not exist in {self.uri}")

    def pin(self, path: str) -> None:
        """Nothing is ever evicted from a plain filesystem: checks ``path`` exists."""
        self._require(path)

    def unpin(self, path: str) -> None:
        """See :meth:`pin`."""
        self._require(path)

    def free(self, path: str, *, recursive: bool = False) -> None:
        """Nothing is cached: checks ``path`` exists."""
        self._require(path)

    def persist(self, path: str) -> None:
        """Everything is already persisted: checks ``path`` exists."""
        self._require(path)
