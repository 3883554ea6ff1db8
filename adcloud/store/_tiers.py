"""Tier directories and the files in them: staging, objects, verified reads.

A tier directory holds ``objects/<id[:2]>/<id>`` (one published file version each, named by
its random version id) and ``tmp/<pid>-<random>`` (writes in progress, removed by the next
process to open the store once their writer is dead).  Nothing here touches the catalog:
:mod:`adcloud.store.local` decides what a file means.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from adcloud._crc import crc32
from adcloud.store.errors import StoreCorruptionError, StoreError, StoreFullError
from adcloud.store.settings import TIER_NAMES

__all__ = [
    "CHUNK",
    "Staged",
    "StagingFile",
    "Tier",
    "VerifyingReader",
    "copy_file",
    "crc_text",
    "new_version_id",
    "read_object",
    "write_new",
]

log = logging.getLogger("adcloud.store.local")

CHUNK = 4 << 20
"""Bytes per read or write call when copying between files."""


def new_version_id() -> str:
    """A random 128-bit version id in hex (what ``uuid4().hex`` gives, at a fifth of the cost)."""
    return os.urandom(16).hex()


def crc_text(crc: int) -> str:
    """The checksum text the catalog records: ``crc32:<8 hex digits>``."""
    return f"crc32:{crc:08x}"


def _check_private(path: Path, tier: str) -> None:
    """Refuse a tier directory that another user owns.

    The MEM tier's default directory has a predictable name under the world-writable
    ``/dev/shm``; a directory another user created there first would let them read and
    replace everything stored in it.
    """
    info = path.stat()
    uid = os.geteuid()
    if info.st_uid != uid:
        raise StoreError(
            f"tier {tier} directory {path} belongs to uid {info.st_uid}, not to this user "
            f"(uid {uid}): its owner could read or replace the stored data. Remove it, or "
            f"point the tier at a directory of your own (ADCLOUD_STORE_{tier}_DIR or "
            "ADCLOUD_STORE_ROOT)"
        )


class Tier:
    """One enabled tier: its level (0 MEM, 1 SSD, 2 HDD), directory and capacity."""

    def __init__(self, level: int, directory: Path, capacity: int) -> None:
        self.level = level
        self.name = TIER_NAMES[level]
        self.dir = directory
        self.capacity = capacity
        self.objects = directory / "objects"
        self.tmp = directory / "tmp"
        for path in (directory, self.objects, self.tmp):
            path.mkdir(parents=True, exist_ok=True)
            _check_private(path, self.name)
            with contextlib.suppress(OSError):
                path.chmod(0o700)
        self._objects = str(self.objects)
        self._tmp = str(self.tmp)
        # object names are hex version ids, spread over one subdirectory per first byte;
        # a subdirectory is made on first use and remembered by this process
        self._made: set[str] = set()

    # Paths in this class and below are plain strings, not ``Path`` objects: a small put or
    # get handles three or four of them, and building ``Path`` objects cost ~10% of its time.

    def object_path(self, obj: str) -> str:
        """Where version ``obj`` lives in this tier."""
        return f"{self._objects}/{obj[:2]}/{obj}"

    def new_object_path(self, obj: str) -> str:
        """:meth:`object_path`, with its subdirectory made if needed (to publish into)."""
        sub = obj[:2]
        if sub not in self._made:
            with contextlib.suppress(FileExistsError):
                os.mkdir(f"{self._objects}/{sub}")
            self._made.add(sub)
        return f"{self._objects}/{sub}/{obj}"

    def temp_path(self) -> str:
        """A fresh staging path in this tier, tagged with this process's id."""
        return f"{self._tmp}/{os.getpid()}-{new_version_id()}"


class Staged(NamedTuple):
    """A finished staging file: tier position, path, size and CRC-32."""

    pos: int
    path: str
    size: int
    crc: int


class StagingFile:
    """Bytes being written into a tier's ``tmp`` directory.

    The file moves down a tier when it outgrows its tier's capacity (a stream of unknown
    length starts in the top tier) or when the tier's filesystem is full (ENOSPC).
    """

    def __init__(
        self, tiers: Sequence[Tier], pos: int, describe: Callable[[], str], hint: str
    ) -> None:
        self._tiers = tiers
        self._describe = describe
        self._hint = hint
        self.pos = pos
        self.size = 0
        self.crc = 0
        self.path = tiers[pos].temp_path()
        self._fd = self._create(self.path)

    def _create(self, path: str) -> int:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise StoreError(
                f"cannot create a staging file in {os.path.dirname(path)}: {err}"
            ) from err

    def write(self, view: memoryview) -> None:
        """Append ``view``; outgrowing the tier or filling its filesystem moves the file
        down a tier (a full filesystem in the last tier raises)."""
        if self.size + len(view) > self._tiers[self.pos].capacity:
            self._outgrow(self.size + len(view))
        self.crc = crc32(view, self.crc)
        off = 0
        while off < len(view):
            try:
                off += os.write(self._fd, view[off : off + CHUNK])
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    self.abort()
                    raise StoreError(f"writing {self.path}: {err}") from err
                self._spill(self.pos + 1, err)
        self.size += len(view)

    def _outgrow(self, size: int) -> None:
        """Move to the first lower tier whose capacity holds ``size`` bytes (or the last
        tier): writing on until ENOSPC would fill a MEM tier's RAM far past its capacity."""
        lower = range(self.pos + 1, len(self._tiers))
        if lower:
            self._spill(next((i for i in lower if self._tiers[i].capacity >= size), lower[-1]))

    def _spill(self, first: int, cause: OSError | None = None) -> None:
        """Move what was written so far to tier ``first`` (or, when that filesystem is full,
        a lower one) and continue there; ``cause`` is the ENOSPC that made it necessary."""
        tiers = self._tiers
        written = os.lseek(self._fd, 0, os.SEEK_CUR)
        for nxt in range(first, len(tiers)):
            if cause is None:
                log.debug(
                    "a write outgrew tier %s (capacity %d B); moving it to %s",
                    tiers[self.pos].name,
                    tiers[self.pos].capacity,
                    tiers[nxt].name,
                )
            else:
                log.warning(
                    "tier %s ran out of space (%s); spilling the write to %s",
                    tiers[self.pos].name,
                    cause,
                    tiers[nxt].name,
                )
            new_path = tiers[nxt].temp_path()
            new_fd = self._create(new_path)
            try:
                with open(self.path, "rb", buffering=0) as src:
                    remaining = written
                    while remaining:
                        chunk = src.read(min(CHUNK, remaining))
                        if not chunk:
                            break
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(new_fd, view) :]
                        remaining -= len(chunk)
            except OSError as err:
                os.close(new_fd)
                with contextlib.suppress(OSError):
                    os.unlink(new_path)
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    cause = err
                    continue
                self.abort()
                raise StoreError(f"spilling a write to {tiers[nxt].name}: {err}") from err
            self._close_and_unlink()
            self.pos, self.path, self._fd = nxt, new_path, new_fd
            return
        self.abort()
        raise StoreFullError(
            f"no space left on the filesystem of any tier ({cause}); tiers: "
            f"{self._describe()}; {self._hint}"
        ) from cause

    def _close_and_unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def finish(self) -> Staged:
        """Close the staging file; it stays in ``tmp`` until published."""
        os.close(self._fd)
        self._fd = -1
        return Staged(self.pos, self.path, self.size, self.crc)

    def abort(self) -> None:
        """Delete the staging file."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class VerifyingReader(io.RawIOBase):
    """Reads an object file and checks size and CRC-32 when a sequential read hits EOF.

    A seek back to the start begins the check again (readers that peek at a header and
    rewind, as ``torch.load`` and ``numpy.load`` do, are still verified); a seek elsewhere
    ends it for the rest of the stream, whose size is still checked at EOF."""

    def __init__(self, raw: BinaryIO, key: str, size: int, crc: str | None) -> None:
        super().__init__()
        self._raw = raw
        self._key = key
        self._size = size
        self._recorded = crc
        self._expect = crc
        self._crc = 0
        self._pos = 0
        self._checked = False
        self._past_end = False
        self.name = key

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._past_end:
            return 0  # sought past the end, which reads nothing (and is no short file)
        got_n = self._raw.readinto(buffer)  # type: ignore[attr-defined]
        n = 0 if got_n is None else int(got_n)
        if n and self._expect is not None:
            self._crc = crc32(memoryview(buffer)[:n], self._crc)
        elif not n and not self._checked and len(memoryview(buffer)) > 0:
            self._checked = True
            got = crc_text(self._crc) if self._expect is not None else None
            if self._pos != self._size or got != self._expect:
                raise StoreCorruptionError(
                    f"{self._key}: read {self._pos} bytes ({got or 'checksum not checked'}), "
                    f"expected {self._size} bytes ({self._expect or 'checksum not checked'})"
                )
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = self._raw.seek(offset, whence)
        if pos == 0:  # a fresh sequential read: check it from the start
            self._expect, self._crc, self._checked = self._recorded, 0, False
        elif pos != self._pos:
            self._expect = None  # random access: the running checksum no longer applies
        self._pos = pos
        self._past_end = self._pos > self._size
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.close()
        super().close()


#: Objects from this size on are read by the file object (see :func:`read_object`).
_ONE_READ_MAX = 1 << 30


def read_object(path: str, size: int) -> bytes:
    """The bytes of the object file ``path``, which the catalog says holds ``size``.

    Reads up to one byte past ``size`` so that a longer file shows up as a size mismatch,
    with bare ``os`` calls: a 1 KB get spent as long in ``Path.open`` and the file object
    as in reading.  Raises ``FileNotFoundError`` as ``open`` does.
    """
    if size >= _ONE_READ_MAX:  # one read() returns at most ~2 GiB: the file object loops
        with open(path, "rb", buffering=0) as stream:
            return stream.read()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, size + 1)
        if len(data) >= size:
            return data
        parts = [data]
        got = len(data)
        while got <= size and (more := os.read(fd, size + 1 - got)):
            parts.append(more)
            got += len(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def write_new(dst: str, chunks: Iterable[bytes]) -> int:
    """Write ``chunks`` to the new file ``dst`` (short writes retried, ENOSPC raised);
    returns their CRC-32."""
    crc = 0
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        for chunk in chunks:
            crc = crc32(chunk, crc)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view[:CHUNK]) :]
    finally:
        os.close(fd)
    return crc


def copy_file(src: str, dst: str) -> int:
    """Copy ``src`` to a new file ``dst``; returns the CRC-32 of the bytes copied."""
    with open(src, "rb", buffering=0) as fin:
        return write_new(dst, iter(lambda: fin.read(CHUNK), b""))
