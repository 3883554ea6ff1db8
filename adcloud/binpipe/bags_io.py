"""Byte access to bags through fsspec: ranged reads, bounded sequential readers, a local cache.

Every read of bag bytes in :mod:`adcloud.binpipe` goes through ``fs.cat_file(path,
start, end)`` of the filesystem fsspec picks for the URL, so the same code reads local
paths, ``file://``, ``memory://``, ``s3://``, HDFS and Alluxio, and never fetches a
byte outside the range it was asked for.  (:class:`WindowReader` reads local files
straight into its reusable buffer with ``readinto``; other filesystems still through
``cat_file``.)  sqlite3 storage needs a real local file:
:func:`local_copy` downloads non-local files once into a cache directory
(``$ADCLOUD_BINPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/adcloud/binpipe``, else
``~/.cache/adcloud/binpipe``), keyed by URL, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsspec

from adcloud.binpipe.errors import BagError
from adcloud.config import STORE_SCHEMES
from adcloud.errors import AdcloudError

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "RangeReader",
    "WindowReader",
    "cache_dir",
    "file_size",
    "file_version",
    "fingerprint",
    "is_local",
    "join_member",
    "local_copy",
    "open_fs",
    "options_tuple",
    "path_url",
    "read_range",
]

#: Bytes fetched per ranged read by :class:`RangeReader` (more when one record is larger).
DEFAULT_BLOCK_BYTES = 8 << 20

_TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created", "ETag", "etag")


def options_tuple(storage_options: Mapping[str, object] | None) -> tuple[tuple[str, object], ...]:
    """fsspec options as sorted key/value pairs: hashable-shaped and cheap to pickle."""
    if not storage_options:
        return ()
    return tuple(sorted(storage_options.items()))


def open_fs(uri: str, storage_options: tuple[tuple[str, object], ...] = ()) -> tuple[Any, str]:
    """The fsspec filesystem and in-filesystem path for ``uri``; :class:`BagError` naming
    ``uri`` when fsspec cannot open it (unknown scheme, missing driver package).

    ``local://`` and ``alluxio://`` URLs name adcloud stores, which fsspec does not know:
    they get :class:`adcloud.store.filesystem.StoreFileSystem`, whose paths are store paths
    (:func:`path_url` turns one back into a URL).
    """
    if uri.startswith(STORE_SCHEMES):
        # imported here: plain file and object-store reads never load the store package
        from adcloud.store.filesystem import store_filesystem  # noqa: PLC0415

        try:
            return store_filesystem(uri, **dict(storage_options))
        except (AdcloudError, TypeError, ValueError) as err:
            # a malformed URL (a port that is no number), an option the store does not
            # take (TypeError: "root" for an alluxio:// URL), a bad ADCLOUD_STORE_* setting
            raise BagError(f"{uri}: cannot open the store: {err}") from err
    try:
        fs, path = fsspec.core.url_to_fs(uri, **dict(storage_options))
    except (ValueError, ImportError, OSError) as err:
        raise BagError(f"{uri}: cannot open through fsspec: {err}") from err
    return fs, path


def path_url(fs: Any, given: str, path: str) -> str:
    """The URL of ``path``, a path of ``fs`` found under (or named by) the URL ``given``:
    the scheme ``given`` was written with and ``path``; a plain path when ``given`` was."""
    unstrip = getattr(fs, "unstrip_protocol", None)
    if given.startswith(STORE_SCHEMES) and unstrip is not None:
        return str(unstrip(path))
    return given.split("://", 1)[0] + "://" + path if "://" in given else path


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local filesystem (paths can be opened directly)."""
    protocol = fs.protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return "file" in protocols or "local" in protocols


def join_member(uri: str, member: str) -> str:
    """URL of ``member`` (a relative file name) inside the directory ``uri``."""
    if not member:
        return uri
    return uri.rstrip("/") + "/" + member


def file_size(fs: Any, path: str, uri: str) -> int:
    """Size of a file in bytes; :class:`BagError` naming ``uri`` when it is missing."""
    return int(_stat(fs, path, uri)["size"])


def read_range(fs: Any, path: str, start: int, end: int, *, uri: str, where: str) -> bytes:
    """Bytes ``[start, end)`` of a file in one ranged read; exactly that many or BagError."""
    if end <= start:
        return b""
    try:
        data = fs.cat_file(path, start=start, end=end)
    except FileNotFoundError as err:
        raise BagError(f"{uri}: no such file") from err
    except (OSError, ValueError) as err:
        raise BagError(f"{uri}: {where}: read of bytes [{start}, {end}) failed: {err}") from err
    if len(data) != end - start:
        raise BagError(
            f"{uri}: {where}: file is truncated: wanted bytes [{start}, {end}), "
            f"the file ends at byte offset {start + len(data)}"
        )
    return bytes(data)


class RangeReader:
    """Sequential, bounded reads of bytes ``[start, end)`` of one file.

    Fetches blocks of :data:`DEFAULT_BLOCK_BYTES` (or one record's size, if larger)
    with ranged reads and never past ``end``.  Reads return ``memoryview`` slices of
    immutable fetched blocks, so they stay valid after later reads.  Every overrun
    (a length pointing past ``end``, a file shorter than expected) is a
    :class:`BagError` naming the file, ``where`` (e.g. the partition) and the offset.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        start: int,
        end: int,
        *,
        uri: str,
        where: str,
        block_bytes: int | None = None,
    ) -> None:
        self._fs = fs
        self._path = path
        self.start = start
        self.end = end
        self.uri = uri
        self.where = where
        self._block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
        self._pos = start
        self._buf = memoryview(b"")
        self._buf_start = start

    @property
    def pos(self) -> int:
        """Absolute file offset of the next read."""
        return self._pos

    @property
    def remaining(self) -> int:
        """Bytes left before ``end``."""
        return self.end - self._pos

    def error(self, offset: int, what: str) -> BagError:
        """A :class:`BagError` for a problem at absolute ``offset``."""
        return BagError(f"{self.uri}: {self.where}: byte offset {offset}: {what}")

    def _fetch(self, offset: int, n: int) -> memoryview:
        end = min(self.end, offset + max(n, self._block_bytes))
        data = read_range(self._fs, self._path, offset, end, uri=self.uri, where=self.where)
        return memoryview(data)

    def read_at(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at absolute ``offset`` (inside the range), without moving ``pos``."""
        if n < 0 or offset < self.start or offset + n > self.end:
            raise self.error(
                offset, f"a length of {n} bytes runs past the end of the range at {self.end}"
            )
        rel = offset - self._buf_start
        if rel >= 0 and rel + n <= len(self._buf):
            return self._buf[rel : rel + n]
        if n >= self._block_bytes:
            return memoryview(
                read_range(self._fs, self._path, offset, offset + n, uri=self.uri, where=self.where)
            )
        self._buf = self._fetch(offset, n)
        self._buf_start = offset
        return self._buf[:n]

    def read(self, n: int) -> memoryview:
        """The next ``n`` bytes; BagError if they run past ``end`` or the file."""
        data = self.read_at(self._pos, n)
        self._pos += n
        return data

    def skip(self, n: int) -> None:
        """Move ``n`` bytes forward without fetching them."""
        if n < 0 or self._pos + n > self.end:
            raise self.error(
                self._pos, f"a length of {n} bytes runs past the end of the range at {self.end}"
            )
        self._pos += n


class WindowReader:
    """Sequential reads of bytes ``[start, end)`` of one file through one window.

    The window holds at least ``block_bytes`` (:data:`DEFAULT_BLOCK_BYTES`) at a time,
    never past ``end``.  For local files it is one ``bytearray`` refilled in place with
    ``readinto`` (no fresh pages to fault in), so callers must copy what they keep
    (e.g. by decompressing it) before the next :meth:`window` call; other fsspec
    filesystems fill it from ``fs.cat_file``.  Every overrun is a :class:`BagError`
    naming the file, ``where`` and the offset, worded as :class:`RangeReader`'s.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        start: int,
        end: int,
        *,
        uri: str,
        where: str,
        block_bytes: int | None = None,
    ) -> None:
        self._fs = fs
        self._path = path
        self._local = is_local(fs)
        # a filesystem that reads positioned into a buffer (adcloud's local:// store)
        self._into = None if self._local else getattr(fs, "read_into", None)
        self.start = start
        self.end = end
        self.uri = uri
        self.where = where
        self._block_bytes = max(1, DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes)
        #: The window: ``buf[i]`` is the byte at file offset ``base + i``, for
        #: ``i < filled``.  Valid until the next :meth:`window` call that refills it.
        self.buf: bytes | bytearray = b""
        self.base = start
        self.filled = 0

    def error(self, offset: int, what: str) -> BagError:
        """A :class:`BagError` for a problem at absolute ``offset``."""
        return BagError(f"{self.uri}: {self.where}: byte offset {offset}: {what}")

    def window(self, offset: int, n: int, keep: int | None = None) -> int:
        """Make bytes ``[offset, offset + n)`` resident; return where they start in ``buf``.

        ``keep`` (an offset at or below ``offset``) asks to retain the bytes from
        there on too, if they are in the window now.  BagError if the bytes run
        past ``end`` (or past the end of the file).
        """
        rel = offset - self.base
        if rel >= 0 and n >= 0 and rel + n <= self.filled:
            return rel
        if n < 0 or offset < self.start or offset + n > self.end:
            raise self.error(
                offset, f"a length of {n} bytes runs past the end of the range at {self.end}"
            )
        lo = offset if keep is None or keep > offset or keep < self.base else keep
        self._refill(lo, offset + n)
        return offset - self.base

    def _refill(self, lo: int, hi: int) -> None:
        """Make the window start at ``lo`` and hold at least up to ``hi``."""
        cur_end = self.base + self.filled
        kept = cur_end - lo if self.base <= lo < cur_end else 0
        at = lo - self.base
        # Read ahead past hi too when a big record is asked for: the records after
        # it (index data) then need no refill that would move the big one again.
        want = min(self.end, max(lo + self._block_bytes, hi + self._block_bytes // 2))
        buf = self.buf
        if not (self._local or self._into):
            data = read_range(self._fs, self._path, lo + kept, want, uri=self.uri, where=self.where)
            self.buf = b"".join((memoryview(buf)[at : at + kept], data)) if kept else data
        else:
            if not isinstance(buf, bytearray) or len(buf) < want - lo:
                buf = bytearray(want - lo)
                if kept:
                    buf[:kept] = memoryview(self.buf)[at : at + kept]
            elif kept and at:
                view = memoryview(buf)
                view[:kept] = view[at : at + kept]  # memmove
                view.release()
            self._read_local(lo + kept, want, memoryview(buf)[kept : want - lo])
            self.buf = buf
        self.base = lo
        self.filled = want - lo

    def _read_local(self, lo: int, hi: int, into: memoryview) -> None:
        """Read file bytes ``[lo, hi)`` into ``into`` (a local file, with ``readinto``; a
        filesystem with ``read_into``)."""
        got = 0
        try:
            if self._into is not None:
                got = self._into(self._path, lo, into[: hi - lo])
            else:
                with Path(self._path).open("rb", buffering=0) as f:
                    f.seek(lo)
                    while got < hi - lo:
                        n = f.readinto(into[got:])
                        if not n:
                            break
                        got += n
        except FileNotFoundError as err:
            raise BagError(f"{self.uri}: no such file") from err
        except (OSError, ValueError) as err:
            raise BagError(
                f"{self.uri}: {self.where}: read of bytes [{lo}, {hi}) failed: {err}"
            ) from err
        finally:
            into.release()
        if got != hi - lo:
            raise BagError(
                f"{self.uri}: {self.where}: file is truncated: wanted bytes [{lo}, {hi}), "
                f"the file ends at byte offset {lo + got}"
            )


def cache_dir() -> Path:
    """Directory for local copies of non-local sqlite3 storage files (created on use)."""
    env = os.environ.get("ADCLOUD_BINPIPE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "adcloud" / "binpipe"


def _stat(fs: Any, path: str, uri: str) -> dict[str, Any]:
    """``fs.info(path)``; :class:`BagError` naming ``uri`` when it fails."""
    try:
        return dict(fs.info(path))
    except FileNotFoundError as err:
        raise BagError(f"{uri}: no such file") from err
    except OSError as err:
        raise BagError(f"{uri}: cannot stat: {err}") from err


def file_version(fs: Any, path: str, uri: str) -> str:
    """What tells one version of a file from the next, as its filesystem reports it: the
    size and the modification stamps (mtime, ETag, ...), as text for messages;
    :class:`BagError` naming ``uri`` when the file is missing."""
    info = _stat(fs, path, uri)
    # not "created": for local files that is st_ctime, which a chmod or a rename changes
    stamps = [
        f"{key} {info[key]}" for key in _TIME_KEYS if key != "created" and info.get(key) is not None
    ]
    return ", ".join([f"size {info.get('size')}", *stamps])


def fingerprint(fs: Any, path: str, uri: str) -> str:
    """A short hex key for the content of a file: URL + size + mtime/ETag.

    Falls back to a SHA-256 of the content when the filesystem reports no
    modification time or ETag.
    """
    info = _stat(fs, path, uri)
    digest = hashlib.sha256()
    digest.update(uri.encode())
    digest.update(str(info.get("size")).encode())
    stamps = [str(info[key]) for key in _TIME_KEYS if info.get(key) is not None]
    if stamps:
        for stamp in stamps:
            digest.update(b"\0" + stamp.encode())
    else:
        size = int(info.get("size") or 0)
        for offset in range(0, size, DEFAULT_BLOCK_BYTES):
            end = min(size, offset + DEFAULT_BLOCK_BYTES)
            digest.update(read_range(fs, path, offset, end, uri=uri, where="hashing"))
    return digest.hexdigest()[:20]


def local_copy(fs: Any, path: str, uri: str) -> Path:
    """A local path holding the file: the file itself if local, else a cached download.

    The download lands in :func:`cache_dir` under a name keyed by :func:`fingerprint`,
    written to a temporary name and renamed, so concurrent executors on one machine
    never see a partial file and later calls reuse it.
    """
    if is_local(fs):
        return Path(path)
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = Path(path).name or "storage"
    target = directory / f"{fingerprint(fs, path, uri)}-{name}"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".download-")
    os.close(fd)
    try:
        fs.get_file(path, tmp)
        Path(tmp).replace(target)
    except FileNotFoundError as err:
        Path(tmp).unlink(missing_ok=True)
        raise BagError(f"{uri}: no such file") from err
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise BagError(f"{uri}: download to {directory} failed: {err}") from err
    return target
