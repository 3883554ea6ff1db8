"""An fsspec filesystem over an adcloud store, so fsspec code reads and writes ``local://``
and ``alluxio://`` URLs.

fsspec knows neither scheme (its own ``local://`` means a plain local path), so
:class:`StoreFileSystem` is never registered with fsspec: :func:`store_filesystem` builds
it for a store URL, and callers that take "any fsspec URL" (BinPipe's bag reads and saves)
ask for it where the URL is a store's.  Paths of the filesystem are store paths
(``/drives/d1.bag``); :meth:`StoreFileSystem.unstrip_protocol` turns one back into the
full URL, ``alluxio://HOST:PORT`` included.

Whole-file reads (``cat_file`` without a range, ``open(..., "rb")``, ``get_file``) are
checked against the store's CRC-32 as every store read is.  Ranged reads serve readers
that take a byte range of a large file (a Spark task reading its chunks of a bag): a store
with positioned reads (``read_range``) answers them directly; otherwise the file is
streamed from its start, and a reader moving forward through one file keeps its stream
open between calls so that the file is read once, not once per range (a kept stream the
store dropped meanwhile is replaced by a new one).  A range is not
checked against the file's CRC, which covers the whole file.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import io
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from glob import has_magic
from pathlib import Path
from typing import IO, Any, BinaryIO, ParamSpec, TypeVar, cast

from fsspec.spec import AbstractFileSystem
from fsspec.utils import isfilelike, read_block

from adcloud.config import STORE_SCHEMES
from adcloud.store.base import FileStatus, Store, locate, split_url
from adcloud.store.errors import (
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    StorePreconditionError,
)

__all__ = ["StoreFileSystem", "store_filesystem"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_COPY_BYTES = 8 << 20
#: Forward read streams one filesystem keeps open (a task reads one bag at a time; a few
#: more serve readers of several files without holding a connection per file ever read).
_KEPT_STREAMS = 4


def _as_os_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Store errors as the ``OSError`` kinds fsspec callers handle: a missing path is a
    ``FileNotFoundError``, an existing one a ``FileExistsError``, the rest an ``OSError``
    carrying the store's message (the original is chained)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except StoreNotFoundError as err:
            raise FileNotFoundError(str(err)) from err
        except StoreExistsError as err:
            raise FileExistsError(str(err)) from err
        except StoreError as err:
            raise OSError(str(err)) from err

    return wrapper


def _entry(status: FileStatus) -> dict[str, Any]:
    return {
        "name": status.path,
        "size": 0 if status.is_dir else status.size,
        "type": "directory" if status.is_dir else "file",
        "mtime": status.mtime,
        "checksum": status.checksum,
        "tier": status.tier,
    }


def _version(status: FileStatus) -> tuple[int, float, str | None]:
    """What tells one version of a file from the next: a replacement of the same size
    can carry the same mtime (Alluxio's are in ms, S3's in s), but not the same checksum."""
    return status.size, status.mtime, status.checksum


class _Forward:
    """One open read stream of a file, the version it reads and the offset it stands at."""

    def __init__(self, stream: BinaryIO, status: FileStatus) -> None:
        self.stream, self.offset, self.size = stream, 0, status.size
        self.version = _version(status)

    def skip_to(self, offset: int) -> None:
        while self.offset < offset:
            got = self.stream.read(min(_COPY_BYTES, offset - self.offset))
            if not got:
                return
            self.offset += len(got)

    def read(self, length: int) -> bytes:
        data = self.stream.read(length)
        self.offset += len(data)
        return data


def _close_quietly(cur: _Forward) -> None:
    """Close a read stream whose bytes are no longer wanted (a proxy's stream may be gone
    already: that is no error of the read that drops it)."""
    with contextlib.suppress(OSError, StoreError):
        cur.stream.close()


def _read_at(cur: _Forward, lo: int, hi: int) -> bytes:
    """Bytes ``[lo, hi)`` from ``cur`` (at or before ``lo``); closes the stream when the
    read fails."""
    try:
        cur.skip_to(lo)
        return cur.read(hi - lo)
    except BaseException:
        _close_quietly(cur)
        raise


class _SeekableReader(io.RawIOBase):
    """A store read stream that also seeks: it reads the store's sequential (verified)
    stream while the reader does, and byte ranges (:meth:`StoreFileSystem.cat_file`) once
    it has moved elsewhere.  Ranges are not checked against the file's CRC."""

    def __init__(self, fs: StoreFileSystem, path: str, stream: BinaryIO, size: int) -> None:
        super().__init__()
        self._fs = fs
        self._stream: BinaryIO | None = stream
        self._pos = self._stream_pos = 0
        self.size = size
        self.name = path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"{self.name}: invalid whence {whence!r}")
        if base + offset < 0:
            raise ValueError(f"{self.name}: negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._stream is not None and self._stream_pos == self._pos:
            data = self._stream.read(len(view))
            self._stream_pos += len(data)
        else:
            self._drop_stream()
            data = self._fs.cat_file(self.name, start=self._pos, end=self._pos + len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _drop_stream(self) -> None:
        if self._stream is not None:
            with contextlib.suppress(OSError, StoreError):
                self._stream.close()
            self._stream = None

    def close(self) -> None:
        self._drop_stream()
        super().close()


class _SeekableFile(io.BufferedReader):
    """:class:`_SeekableReader` buffered, with the ``size`` fsspec files carry."""

    @property
    def size(self) -> int:
        return cast(_SeekableReader, self.raw).size


#: Read-ahead of a seekable reader: each refill after a seek is one ranged read.
_SEEK_BUFFER = 1 << 20


class StoreFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """fsspec's file-system interface over the store at ``store_uri`` (``local://``,
    ``local:///NAMESPACE/``, ``alluxio://HOST:PORT/``); ``options`` go to
    :func:`adcloud.store.open_store`."""

    # not "local": fsspec callers take that for the machine's own files
    protocol = ("adcloud-store",)
    root_marker = "/"
    # one instance per root and options, as fsspec caches filesystems; the store itself
    # (connections, catalog handles) is opened on first use in each process
    cachable = True

    def __init__(self, store_uri: str, /, **options: Any) -> None:
        super().__init__(store_uri, **options)
        self.store_uri = store_uri
        self.options = options
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._forward: dict[str, _Forward] = {}
        scheme, _, rest = store_uri.partition("://")
        #: what :meth:`unstrip_protocol` puts before a store path (``local://``,
        #: ``alluxio://HOST:PORT/NAMESPACE``, ``file://``)
        self._base = f"{scheme}://{rest.rstrip('/')}"
        # fsspec strips the URLs it is given with ``self._strip_protocol``: this instance
        # strips its own base, a namespace included, so that what unstrip_protocol gave
        # opens again (the classmethod knows no namespace: it serves fsspec's class calls)
        setattr(self, "_strip_protocol", self._strip_own_base)  # noqa: B010
        _LIVE[id(self)] = self

    @classmethod
    def over(cls, store: Store) -> StoreFileSystem:
        """The filesystem of an open ``store``, of any backend (``file://`` and object-store
        ones too: their paths are store paths as well)."""
        fs = cls(store.uri, **getattr(store, "options", {}))
        if fs._store is None:  # a new instance (fsspec hands out cached ones): use this one
            fs._store = store
        return fs

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = locate(self.store_uri, **self.options)[0]
        return self._store

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = str(path)
        if text.startswith(STORE_SCHEMES):
            text = "/" + text.split("://", 1)[1].partition("/")[2]
        return "/" + text.strip("/") if text.strip("/") else "/"

    def _strip_own_base(self, path: Any) -> Any:
        """The store path of ``path``: a store path, or a URL below this filesystem's
        store (its namespace taken off)."""
        if isinstance(path, list):
            return [self._strip_own_base(p) for p in path]
        text = str(path)
        if text == self._base or text.startswith(self._base + "/"):
            text = text[len(self._base) :]
            return "/" + text.strip("/") if text.strip("/") else "/"
        return type(self)._strip_protocol(text)

    def unstrip_protocol(self, name: str) -> str:
        """The full URL of the store path ``name``."""
        return self._base + "/" + str(name).lstrip("/")

    # -- reading the namespace ------------------------------------------------------------

    @_as_os_errors
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = [_entry(s) for s in self.store.list(self._strip_protocol(path))]
        return entries if detail else [e["name"] for e in entries]

    @_as_os_errors
    def exists(self, path: str, **kwargs: Any) -> bool:
        """Whether ``path`` exists; an unreachable store is an error, not a "no" (fsspec's
        own ``exists`` takes any failure for one)."""
        return self.store.exists(self._strip_protocol(path))

    @_as_os_errors
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return _entry(self.store.stat(self._strip_protocol(path)))

    # -- bytes --------------------------------------------------------------------------

    @_as_os_errors
    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        path = self._strip_protocol(path)
        if start is None and end is None:
            return self.store.get(path)
        try:
            status = self.store.stat(path)
        except StoreNotFoundError:
            # a stream kept for the deleted file would hold it open on the store's side
            # (its bytes stay in the tier) until evicted by other reads or the process ends
            with self._lock:
                gone = self._forward.pop(path, None)
            if gone is not None:
                _close_quietly(gone)
            raise
        size = status.size
        lo = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
        hi = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
        if hi <= lo:
            return b""
        read_range = getattr(self.store, "read_range", None)
        if read_range is not None:
            return bytes(read_range(path, lo, hi - lo))
        return self._forward_read(path, lo, hi, status)

    @_as_os_errors
    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        """Read bytes of ``path`` from ``offset`` into ``buffer`` until it is full or the
        file ends; how many were read.  Straight into the buffer where the store reads
        positioned (``local://``: no fresh pages for every range a reader refills its
        window with), else through :meth:`cat_file`."""
        path = self._strip_protocol(path)
        read_into = getattr(self.store, "read_into", None)
        if read_into is not None:
            return int(read_into(path, offset, buffer))
        data = self.cat_file(path, start=offset, end=offset + len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _forward_read(self, path: str, lo: int, hi: int, status: FileStatus) -> bytes:
        """Bytes ``[lo, hi)`` from a stream kept open while the reader moves forward."""
        with self._lock:
            cur = self._forward.pop(path, None)
            if cur is not None and (cur.offset > lo or cur.version != _version(status)):
                _close_quietly(cur)
                cur = None
            data = None
            if cur is not None:
                try:
                    data = _read_at(cur, lo, hi)
                except (OSError, StoreError):
                    # a kept stream is a cache: the store may have dropped it meanwhile (a
                    # proxy cuts a stream left idle past its socket timeout, e.g. while a
                    # Spark task worked through its previous block); read from a new one
                    log.debug("kept read stream of %s failed; opening a new one", path)
                    cur = None
            if cur is None:
                cur = _Forward(self.store.open(path), status)
                data = _read_at(cur, lo, hi)
            if cur.offset < cur.size:
                self._forward[path] = cur  # the newest last: the oldest goes first
                while len(self._forward) > _KEPT_STREAMS:
                    _close_quietly(self._forward.pop(next(iter(self._forward))))
            else:
                _close_quietly(cur)
            assert data is not None
            return data

    @_as_os_errors
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if mode == "create" and self.store.exists(path):
            raise FileExistsError(f"{self.unstrip_protocol(path)} exists")
        self.store.put(path, value)

    @_as_os_errors
    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> IO[bytes]:
        """A verified sequential read stream, or a write stream published on close (left
        by an exception, it is discarded: the path keeps its earlier version)."""
        path = self._strip_protocol(path)
        if mode not in ("rb", "wb"):
            raise ValueError(f"{self.unstrip_protocol(path)}: mode must be 'rb' or 'wb'")
        if mode == "wb":
            return self.store.open(path, "wb")
        stream = self.store.open(path, "rb")
        if stream.seekable():
            return stream
        # pyarrow and pandas seek (a Parquet file is read from its footer): a store whose
        # streams only go forward (alluxio://) is read in ranges once the reader seeks
        try:
            size = self.store.stat(path).size
        except BaseException:
            with contextlib.suppress(OSError, StoreError):
                stream.close()
            raise
        return _SeekableFile(_SeekableReader(self, path, stream, size), _SEEK_BUFFER)

    @_as_os_errors
    def read_block(
        self, fn: str, offset: int, length: int | None, delimiter: bytes | None = None
    ) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``fn``, moved to ``delimiter`` boundaries
        as :func:`fsspec.utils.read_block` does (fsspec's own reads the size off the open
        file, which a store stream does not carry)."""
        path = self._strip_protocol(fn)
        size = self.store.stat(path).size
        if length is None or offset + length > size:
            length = max(0, size - offset)
        with self._open(path, "rb") as stream:
            return bytes(read_block(stream, offset, length, delimiter))

    @_as_os_errors
    def get_file(
        self,
        rpath: str,
        lpath: Any,
        callback: Any = None,
        outfile: IO[bytes] | None = None,
        **kwargs: Any,
    ) -> None:
        """Copy the file ``rpath`` to the local path (or open binary file) ``lpath``; a
        directory ``rpath`` becomes a local directory, as fsspec's recursive ``get`` asks.

        A local path appears only once the whole file has arrived: a read that breaks off
        (a proxy gone, data failing verification) leaves neither a partial file nor a
        temporary one, and an earlier file at ``lpath`` stays as it was.
        """
        path = self._strip_protocol(rpath)
        if outfile is None and isfilelike(lpath):
            outfile = lpath
        if outfile is not None:
            with self.store.open(path) as src:
                shutil.copyfileobj(src, outfile, _COPY_BYTES)
            return
        target = Path(lpath)
        if self.store.stat(path).is_dir:
            target.mkdir(parents=True, exist_ok=True)
            return
        target.absolute().parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.absolute().parent)
        part = Path(name)
        try:
            with self.store.open(path) as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, _COPY_BYTES)
            part.replace(target)
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    @_as_os_errors
    def put_file(
        self,
        lpath: Any,
        rpath: str,
        callback: Any = None,
        mode: str = "overwrite",
        **kwargs: Any,
    ) -> None:
        """Copy the local file ``lpath`` to ``rpath`` (published whole, on completion); a
        local directory becomes a store directory, as fsspec's recursive ``put`` asks.
        ``mode="create"`` refuses an existing ``rpath``."""
        path = self._strip_protocol(rpath)
        if mode == "create" and self.store.exists(path):
            raise FileExistsError(f"{self.unstrip_protocol(path)} exists")
        if Path(lpath).is_dir():
            self.store.mkdir(path)
            return
        with open(lpath, "rb") as src, self.store.open(path, "wb") as dst:  # noqa: PTH123
            shutil.copyfileobj(src, dst, _COPY_BYTES)

    @_as_os_errors
    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy the file ``path1`` to ``path2`` inside the store (replacing ``path2``); a
        directory ``path1`` becomes a directory, as fsspec's recursive ``copy`` asks."""
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.store.stat(src).is_dir:
            self.store.mkdir(dst)
            return
        self.store.copy(src, dst)

    @_as_os_errors
    def modified(self, path: str) -> datetime.datetime:
        """When ``path`` was last modified (UTC)."""
        mtime = self.store.stat(self._strip_protocol(path)).mtime
        return datetime.datetime.fromtimestamp(mtime, tz=datetime.UTC)

    # -- changing the namespace ---------------------------------------------------------

    @_as_os_errors
    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.store.mkdir(self._strip_protocol(path))

    @_as_os_errors
    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        path = self._strip_protocol(path)
        if not exist_ok and self.store.exists(path):
            raise FileExistsError(f"{self.unstrip_protocol(path)} exists")
        self.store.mkdir(path)

    @_as_os_errors
    def mv(self, path1: Any, path2: Any, recursive: bool = False, **kwargs: Any) -> None:
        """Store renames (each atomic, refused when its target exists); lists of sources
        and targets move pairwise, as fsspec's batch form."""
        if isinstance(path1, list) != isinstance(path2, list) or (
            isinstance(path1, list) and len(path1) != len(path2)
        ):
            raise ValueError("mv: give one source and one target, or two lists of one length")
        pairs = zip(path1, path2, strict=True) if isinstance(path1, list) else [(path1, path2)]
        for src, dst in pairs:
            self.store.rename(self._strip_protocol(src), self._strip_protocol(dst))

    @_as_os_errors
    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Delete paths; one with glob characters (``*``, ``?``, ``[``) that names no
        existing path is a pattern, as in fsspec (``rm("/drives/*.bag")``), and a pattern
        that matches nothing is a ``FileNotFoundError``."""
        targets: list[str] = []
        for one in path if isinstance(path, list) else [path]:
            stripped = self._strip_protocol(one)
            if not has_magic(stripped) or self.store.exists(stripped):
                targets.append(stripped)
                continue
            matches = sorted(self.glob(stripped, maxdepth=maxdepth))
            if not matches:
                raise FileNotFoundError(f"{self.unstrip_protocol(stripped)}: no path matches")
            targets.extend(matches)
        gone: list[str] = []
        for target in targets:
            # a match inside a directory deleted before it went with that directory
            if any(target == g or target.startswith(g.rstrip("/") + "/") for g in gone):
                continue
            self.store.delete(target, recursive=recursive)
            gone.append(target)

    @_as_os_errors
    def rm_file(self, path: str) -> None:
        self.store.delete(self._strip_protocol(path))

    @_as_os_errors
    def rmdir(self, path: str) -> None:
        self.store.delete(self._strip_protocol(path))

    def close_kept_streams(self) -> None:
        """Close the streams kept open for forward reads."""
        with self._lock:
            streams = list(self._forward.values())
            self._forward.clear()
        for cur in streams:
            _close_quietly(cur)

    def close(self) -> None:
        """Close the streams kept for forward reads and the store's connections."""
        self.close_kept_streams()
        if self._store is not None:
            self._store.close()
            self._store = None


#: Every filesystem of this process: fsspec caches them for the life of the process, so
#: nothing else would close their kept streams, and a proxy holds each stream (one of its
#: ``max_streams``) until it idles out when its client leaves without closing it.
#: Keyed by ``id``: instances of one store compare (and hash) equal in fsspec.
_LIVE: weakref.WeakValueDictionary[int, StoreFileSystem] = weakref.WeakValueDictionary()


@atexit.register
def _close_kept_streams() -> None:
    for fs in list(_LIVE.values()):
        fs.close_kept_streams()


def store_filesystem(url: str, **options: Any) -> tuple[StoreFileSystem, str]:
    """The filesystem of the store that ``url`` (``local://...``, ``alluxio://...``) names
    and the store path in it; :class:`adcloud.store.StoreError` for a malformed URL."""
    if not url.startswith(STORE_SCHEMES):
        raise StorePreconditionError(f"{url} is not a store URL ({', '.join(STORE_SCHEMES)})")
    root, path = split_url(url)
    # fsspec hands out one instance per root and options: the store is opened once (a local
    # store's catalog, an Alluxio client), not on every call -- each task's reader asks
    fs = StoreFileSystem(root, **options)
    fs.store  # noqa: B018 - opened now: a malformed URL or bad option fails here
    return fs, path
