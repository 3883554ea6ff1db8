"""The local tiered store (``local://``): Alluxio-style tiered storage for one machine.

Layout
    Each file version is one object (a whole file, not fixed-size blocks -- Alluxio's
    "one block per file" case) named by a random version id, at
    ``<tier dir>/objects/<id[:2]>/<id>`` in exactly one tier: MEM (``/dev/shm``), SSD or HDD
    directories, fastest first, each with a capacity.  Writes are staged in
    ``<tier dir>/tmp/<pid>-<random>`` and become visible only when the catalog transaction
    that references them commits (see :mod:`adcloud.store._catalog`): readers always see one
    complete version and concurrent writers of one path from any number of processes
    resolve to the last committed one.  Every version carries a CRC-32 that tier moves and
    persists always verify, and reads verify as ``StoreSettings.verify_reads`` says (by
    default from SSD, HDD and the under-store; the size of every read is always checked).

Tiers
    New data goes to the fastest tier that can hold it; to make room, the least recently
    used unpinned files move one tier down, and out of the last tier only if they are
    persisted (their under-store copy remains).  Reads promote files back to the top tier.
    Pinned files are never evicted.  Data that cannot be placed anywhere raises
    :class:`~adcloud.store.errors.StoreFullError` naming every tier; nothing stored is
    touched.  A tier directory whose filesystem runs out of space (``ENOSPC``) spills the
    write to the next tier.

Write types (:class:`~adcloud.store.base.WriteType`)
    ``MUST_CACHE`` caches only; ``CACHE_THROUGH`` caches and persists before returning;
    ``THROUGH`` writes the under-store only; ``ASYNC_THROUGH`` records the pending persist
    in the catalog's journal in the same transaction that publishes the file, with the WAL
    fsynced, and only then returns -- a background thread (in this or any other process of
    the store, or the next one to open it) persists it, so a process killed after the
    acknowledgement loses nothing.  Cached bytes in MEM do not survive a reboot (as in
    Alluxio); after one, files that were never persisted are reported ``LOST``.

Coordination
    The catalog (SQLite, WAL) orders all metadata changes, and every transaction that adds
    bytes to a tier checks that tier's capacity itself, so capacities hold across processes
    without a lock on the common path.  A ``space`` lock (``flock``) serialises the writers
    that must evict to make room; 64 striped ``ufs`` locks serialise the under-store copies
    of one path.  Under-store changes that cannot be one step with their catalog change
    (``THROUGH`` writes, renames, deletes) are recorded in the catalog first: a process
    killed in between leaves the record, and the next one to open the store, sweep or touch
    the path finishes or undoes the change, so the two agree again.  Access times for LRU
    are buffered per process and flushed at least every second and before every eviction
    decision this process makes.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal, NamedTuple, cast

from adcloud._crc import crc32
from adcloud.config import settings_dict
from adcloud.store._catalog import Catalog, FileRow, Removing, Renaming, descendant_range
from adcloud.store._locks import LockFile
from adcloud.store._streams import WriteStream
from adcloud.store._tiers import (
    CHUNK,
    Staged,
    StagingFile,
    Tier,
    VerifyingReader,
    copy_file,
    crc_text,
    new_version_id,
    read_object,
    write_new,
)
from adcloud.store._understore import UfsStaging, UnderStore
from adcloud.store.base import (
    CAPABILITIES,
    BaseStore,
    FileStatus,
    PersistenceState,
    TtlAction,
    WriteType,
    check_ttl,
    check_ttl_change,
    format_size,
    join_path,
    normalize_path,
    parent_path,
)
from adcloud.store.errors import (
    InvalidPathError,
    StoreCorruptionError,
    StoreDataLostError,
    StoreError,
    StoreExistsError,
    StoreFullError,
    StoreNotFoundError,
    StorePreconditionError,
)
from adcloud.store.settings import TIER_NAMES, StoreSettings

__all__ = ["LocalStore", "TierUsage"]

log = logging.getLogger(__name__)

_UFS_STRIPES = 64
_CLAIM_STALE_NS = 600 * 10**9
_READ_RETRIES = 16
_PLACE_ATTEMPTS = 8
_FILE_COLUMNS = ", ".join("f." + name for name in FileRow._fields)
_FULL_HINT = (
    "raise the tier capacities (ADCLOUD_STORE_MEM_CAPACITY / _SSD_CAPACITY / _HDD_CAPACITY), "
    "unpin or delete data, persist MUST_CACHE data so it can be evicted, or write with "
    "write_type=THROUGH"
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


class TierUsage(NamedTuple):
    """Occupancy of one tier: bytes ``used`` of ``capacity``, of which ``pinned``."""

    name: str
    directory: str
    capacity: int
    used: int
    pinned: int
    files: int


class _LocalWriter(WriteStream):
    """The stream :meth:`LocalStore.open` returns for ``"wb"``: publishes on close."""

    def __init__(
        self,
        store: LocalStore,
        key: str,
        write_type: WriteType,
        ttl: float | None,
        pinned: bool | None,
        size: int | None = None,
    ) -> None:
        # the most a tier can hold: a file that outgrows it never fits (MUST_CACHE and
        # ASYNC_THROUGH fail at once, not once the whole input was read and copied;
        # CACHE_THROUGH goes on in the under-store, as put() does)
        self._largest = max(t.capacity for t in store._tiers)
        through = write_type is WriteType.THROUGH
        if size is not None and size > self._largest and not through:
            if write_type is not WriteType.CACHE_THROUGH:
                raise store._full_error(size, store._rel(key))
            through = True
        self._store = store
        self._key = key
        self._write_type = write_type
        self._ttl = ttl
        self._pinned = pinned
        super().__init__(key)
        self._cache: StagingFile | None = None
        self._ufs: UfsStaging | None = None
        if through:
            self._ufs = store._ufs.begin(key)
        else:
            self._cache = StagingFile(store._tiers, 0, store._describe_tiers, _FULL_HINT)

    def tell(self) -> int:
        return self._cache.size if self._cache is not None else self._ufs.size  # type: ignore[union-attr]

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError("write to a closed store stream")
        view = memoryview(data).cast("B")
        if self._cache is not None and self._cache.size + len(view) > self._largest:
            self._outgrow(self._cache.size + len(view))
        if self._cache is not None:
            self._cache.write(view)
        else:
            assert self._ufs is not None
            self._ufs.write(view)
        return len(view)

    def _outgrow(self, size: int) -> None:
        """The file grew past every tier (``size`` bytes so far): refuse it, or with
        CACHE_THROUGH move what was staged to the under-store and write on there."""
        assert self._cache is not None
        store = self._store
        if self._write_type is not WriteType.CACHE_THROUGH:
            self.abort()
            raise store._full_error(size, store._rel(self._key), at_least=True)
        log.info("%s outgrew every tier; writing it through", store._rel(self._key))
        staged = self._cache.finish()
        self._cache = None
        self._ufs = store._ufs.begin(self._key)
        try:
            with open(staged.path, "rb", buffering=0) as src:
                while chunk := src.read(CHUNK):
                    self._ufs.write(chunk)
        except BaseException:
            self.abort()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(staged.path)

    def abort(self) -> None:
        """Discard everything written; the path keeps its previous version."""
        if self._closed:
            return
        self._closed = True
        if self._cache is not None:
            self._cache.abort()
        if self._ufs is not None:
            self._ufs.discard()

    def close(self) -> None:
        """Publish the file (atomically); a no-op when already closed."""
        if self._closed:
            return
        self._closed = True
        if self._cache is not None:
            staged = self._cache.finish()
            self._store._commit_cached(self._key, staged, self._write_type, self._ttl, self._pinned)
        else:
            assert self._ufs is not None
            self._store._commit_through(
                self._key, self._ufs, self._ttl, self._pinned, write_type=self._write_type
            )

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            log.warning("a write stream to %s was never closed; discarding it", self._key)
            self.abort()


class LocalStore(BaseStore):
    """The local tiered store (see the module docstring), shared by all processes.

    ``uri`` is ``local://`` or ``local:///NAMESPACE`` (every path is then below
    ``/NAMESPACE``).  ``overrides`` are :class:`StoreSettings` fields (``root=``,
    ``mem_capacity="64MiB"``, ...) on top of ``ADCLOUD_STORE_*``; ``settings`` replaces the
    loaded settings entirely.  ``background=False`` starts no thread in this process:
    pending persists and TTL expiry then wait for another process, :meth:`flush` or
    :meth:`maintain`.
    """

    capabilities: ClassVar[frozenset[str]] = CAPABILITIES

    def __init__(
        self,
        uri: str = "local://",
        *,
        settings: StoreSettings | None = None,
        background: bool = True,
        **overrides: Any,
    ) -> None:
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme.lower() != "local" or parts.netloc or parts.query or parts.fragment:
            raise InvalidPathError(
                f"not a local store URI: {uri!r} (write local:// or local:///NAMESPACE)"
            )
        self._prefix = normalize_path(parts.path or "/")
        canonical = "local://" if self._prefix == "/" else f"local://{self._prefix}"
        if settings is not None:
            import dataclasses  # noqa: PLC0415

            settings = dataclasses.replace(settings, **overrides) if overrides else settings
            options: dict[str, Any] = {
                k: v for k, v in settings_dict(settings).items() if v is not None
            }
        else:
            settings = StoreSettings.load(**overrides)
            options = {k: str(v) if isinstance(v, Path) else v for k, v in overrides.items()}
        options["background"] = background
        super().__init__(canonical, options)
        self.settings = settings
        self._write_type = settings.default_write_type()
        self._tiers = [
            Tier(TIER_NAMES.index(spec.name), spec.directory, spec.capacity)
            for spec in settings.tiers()
        ]
        self._by_level = {t.level: t for t in self._tiers}
        meta = settings.metadata_dir()
        meta.mkdir(parents=True, exist_ok=True)
        self._cat = Catalog(meta / "catalog.sqlite")
        self._space = LockFile(meta / "locks" / "space.lock", 1)
        self._ufs_locks = LockFile(meta / "locks" / "ufs.lock", _UFS_STRIPES)
        self._ufs = UnderStore(settings.ufs_url(), staging_registry=meta / "ufs-staging")
        self._access: dict[int, int] = {}
        self._access_lock = threading.Lock()
        self._retry_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sweep = 0.0
        self._recover()
        if background:
            self._thread = threading.Thread(
                target=self._maintain_loop, name="adcloud-store-maintainer", daemon=True
            )
            self._thread.start()

    # -- paths ---------------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return normalize_path(path) if self._prefix == "/" else join_path(self._prefix, path)

    def _rel(self, key: str) -> str:
        if self._prefix == "/":
            return key
        return key[len(self._prefix) :] or "/"

    def _describe_tiers(self) -> str:
        usage = self._cat.usage()
        return ", ".join(
            f"{t.name} {format_size(usage.get(t.level, 0))} of {format_size(t.capacity)} "
            f"used ({t.dir})"
            for t in self._tiers
        )

    def _full_error(self, size: int, key: str, *, at_least: bool = False) -> StoreFullError:
        """``key`` of ``size`` bytes (``at_least``: a stream of unknown length, so far) fits
        in no tier."""
        largest = max(t.capacity for t in self._tiers)
        why = (
            f"it is larger than the largest tier ({format_size(largest)})"
            if size > largest
            else "the rest is pinned or not yet persisted"
        )
        old = self._cat.file(self._key(key))
        if size <= largest and old is not None and old.tier is not None:
            # a replaced file's old version stays readable until the new one is complete
            tier = next((t.name for t in self._tiers if t.level == old.tier), "a tier")
            why += (
                f"; the version of {key} being replaced holds {format_size(old.size)} of "
                f"{tier} until the new one is complete"
            )
        amount = f"over {format_size(largest)} so far" if at_least else format_size(size)
        return StoreFullError(
            f"cannot place {key} ({amount}) in any tier: "
            f"{self._describe_tiers()} -- {why}; {_FULL_HINT}"
        )

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Remove staging files of dead processes; reconcile after a reboot or a new layout."""
        for tier in self._tiers:
            for entry in tier.tmp.iterdir():
                pid_text = entry.name.split("-", 1)[0]
                if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                    with contextlib.suppress(OSError):
                        entry.unlink()
        removed = self._ufs.remove_abandoned_staging(_pid_alive)
        if removed:
            log.info("removed %d under-store staging files of writers that died", removed)
        try:
            self._finish_renames()
            self._finish_publishes()
            self._finish_removals()
        except StoreError as err:  # the under-store unreachable: the next sweep tries again
            log.warning("cannot finish the writes that dead processes left: %s", err)
        boot = _boot_id()
        layout = json.dumps({t.name: str(t.dir) for t in self._tiers}, sort_keys=True)
        if self._cat.meta("boot") == boot and self._cat.meta("layout") == layout:
            return
        with self._space.hold():
            known_boot, known_layout = self._cat.meta("boot"), self._cat.meta("layout")
            if known_boot == boot and known_layout == layout:
                return
            if known_layout not in (None, layout) and self._cat.cached_rows():
                raise StoreError(
                    f"the store catalog {self._cat.path} records the tiers {known_layout}, "
                    f"but this process opened it with {layout}; use the same tier directories "
                    "in every process of the store (ADCLOUD_STORE_*_DIR, ADCLOUD_STORE_ROOT), or "
                    "free or delete the cached data first"
                )
            self._reconcile()
            with self._cat.transaction(durable=True) as c:
                Catalog.set_meta(c, "boot", boot)
                Catalog.set_meta(c, "layout", layout)

    def _reconcile(self) -> None:
        """Make the catalog agree with the objects that exist (after a reboot, say)."""
        for row in self._cat.cached_rows():
            tier = self._by_level.get(row.tier) if row.tier is not None else None
            if tier is not None and os.path.exists(tier.object_path(row.object)):
                continue
            with self._cat.transaction(durable=True) as c:
                if row.persistence == PersistenceState.PERSISTED:
                    c.execute(
                        "UPDATE files SET tier = NULL WHERE id = ? AND object = ?",
                        (row.id, row.object),
                    )
                else:
                    log.error(
                        "%s: its cached copy is gone and it was never persisted "
                        "(write type %s); marking it LOST",
                        row.path,
                        row.write_type,
                    )
                    c.execute(
                        "UPDATE files SET tier = NULL, persistence = 'LOST' "
                        "WHERE id = ? AND object = ?",
                        (row.id, row.object),
                    )
                    self._cat.drop_entries(c, row.id)
        # Objects are renamed into place inside the transaction that references them, so
        # while this process holds the write lock every unreferenced object is an orphan.
        with self._cat.transaction():
            for tier in self._tiers:
                keep = self._cat.objects_in(tier.level)
                for sub in tier.objects.iterdir():
                    for obj in sub.iterdir() if sub.is_dir() else ():
                        if obj.name not in keep:
                            with contextlib.suppress(OSError):
                                obj.unlink()

    # -- status ----------------------------------------------------------------------------

    def _is_expired(self, row: FileRow, now_ns: int | None = None) -> bool:
        if row.expires_ns is None or row.ttl_action != TtlAction.DELETE:
            return False
        return row.expires_ns <= (now_ns or time.time_ns())

    def _status(self, row: FileRow) -> FileStatus:
        tier = self._by_level.get(row.tier) if row.tier is not None else None
        return FileStatus(
            path=self._rel(row.path),
            size=row.size,
            is_dir=False,
            mtime=row.mtime_ns / 1e9,
            tier=tier.name if tier is not None else None,
            pinned=bool(row.pinned),
            persistence=PersistenceState(row.persistence),
            ttl=None if row.ttl_ms is None else row.ttl_ms / 1000,
            ttl_action=TtlAction(row.ttl_action),
            checksum=row.checksum,
            write_type=WriteType(row.write_type),
        )

    def _dir_status(self, key: str, ctime_ns: int) -> FileStatus:
        return FileStatus(path=self._rel(key), size=0, is_dir=True, mtime=ctime_ns / 1e9)

    def _visible(self, key: str) -> FileRow:
        """The live file at ``key``; raises for directories and missing or expired files."""
        row = self._cat.file(key)
        if row is not None and self._is_expired(row):
            self._expire(row)
            row = None
        if row is None:
            if self._cat.dir_ctime(key) is not None:
                raise StorePreconditionError(f"{self._rel(key)} is a directory, not a file")
            raise StoreNotFoundError(f"{self._rel(key)} does not exist in {self.uri}")
        return row

    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""
        key = self._key(path)
        row = self._cat.file(key)
        if row is not None and not self._is_expired(row):
            return True
        return self._cat.dir_ctime(key) is not None

    def stat(self, path: str) -> FileStatus:
        """The status of ``path`` (``tier`` says which tier holds it)."""
        key = self._key(path)
        row = self._cat.file(key)
        if row is not None and not self._is_expired(row):
            return self._status(row)
        ctime = self._cat.dir_ctime(key)
        if ctime is None:
            raise StoreNotFoundError(f"{self._rel(key)} does not exist in {self.uri}")
        return self._dir_status(key, ctime)

    def list(self, path: str = "/", *, recursive: bool = False) -> list[FileStatus]:
        """Entries under directory ``path`` sorted by path (a file lists as itself)."""
        key = self._key(path)
        row = self._cat.file(key)
        now = time.time_ns()
        if row is not None and not self._is_expired(row, now):
            return [self._status(row)]
        if self._cat.dir_ctime(key) is None:
            raise StoreNotFoundError(f"{self._rel(key)} does not exist in {self.uri}")
        files, dirs = (self._cat.descendants if recursive else self._cat.children)(key)
        out = [self._status(r) for r in files if not self._is_expired(r, now)]
        out += [self._dir_status(p, ctime) for p, ctime in dirs]
        return sorted(out, key=lambda s: s.path)

    def usage(self) -> builtins.list[TierUsage]:
        """Occupancy of every enabled tier, fastest first."""
        stats = self._cat.tier_stats()
        out = []
        for tier in self._tiers:
            files, used, pinned = stats.get(tier.level, (0, 0, 0))
            out.append(TierUsage(tier.name, str(tier.dir), tier.capacity, used, pinned, files))
        return out

    @property
    def under_store(self) -> str:
        """The under-store URL persisted files go to."""
        return self._ufs.url

    def pending_persists(self) -> int:
        """Number of ``ASYNC_THROUGH`` files not yet in the under-store."""
        return self._cat.journal_size()

    # -- writing ---------------------------------------------------------------------------

    def put(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Store ``data`` at ``path`` (see :class:`~adcloud.store.base.Store`)."""
        key = self._key(path)
        self._check_file_key(key)
        check_ttl(ttl, path)
        wt = self._write_type if write_type is None else WriteType.parse(write_type)
        view = memoryview(data).cast("B")
        if wt is WriteType.THROUGH:
            staging = self._ufs.begin(key)
            staging.write(view)
            self._commit_through(key, staging, ttl, pinned)
            return
        start = next((i for i, t in enumerate(self._tiers) if t.capacity >= len(view)), None)
        if start is None:
            if wt is WriteType.CACHE_THROUGH:
                staging = self._ufs.begin(key)
                staging.write(view)
                self._commit_through(key, staging, ttl, pinned)
                return
            raise self._full_error(len(view), self._rel(key))
        staging_file = StagingFile(self._tiers, start, self._describe_tiers, _FULL_HINT)
        staging_file.write(view)
        self._commit_cached(key, staging_file.finish(), wt, ttl, pinned)

    def copy(
        self,
        src: str,
        dst: str,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Copy the file ``src`` to ``dst`` (see :class:`~adcloud.store.base.Store`).

        A source cached in a tier is not read: the copy is a hard link to its object in the
        same tier, published as a new version with the source's size and CRC-32, so the
        tier holds the bytes once.  Objects are never changed in place (every write, move
        and delete makes or unlinks a whole object), so neither file can change through the
        other.  The tier's capacity counts both, since either may later move or go alone.
        A source held only by the under-store, a ``THROUGH`` copy, or a tier whose file
        system has no hard links streams the bytes like :meth:`put`.
        """
        wt = self._write_type if write_type is None else WriteType.parse(write_type)
        dst_key = self._key(dst)
        self._check_file_key(dst_key)
        check_ttl(ttl, dst)
        src_key = self._key(src)
        if wt is not WriteType.THROUGH:
            for _ in range(_READ_RETRIES):
                row = self._visible(src_key)
                tier = self._by_level.get(row.tier) if row.tier is not None else None
                if tier is None:
                    break
                link = tier.temp_path()
                try:
                    os.link(tier.object_path(row.object), link)
                except FileNotFoundError:
                    self._forget_missing_copy(row)
                    continue  # moved or replaced meanwhile: read the catalog again
                except OSError as err:
                    log.debug("cannot link %s in %s (%s); copying it", row.path, tier.name, err)
                    break
                self._accessed(row.id)
                crc = int(row.checksum.removeprefix("crc32:"), 16)
                staged = Staged(self._tiers.index(tier), link, row.size, crc)
                self._commit_cached(dst_key, staged, wt, ttl, pinned)
                return
        super().copy(src, dst, write_type=wt, ttl=ttl, pinned=pinned)

    def open(
        self,
        path: str,
        mode: Literal["rb", "wb"] = "rb",
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
        size: int | None = None,
    ) -> BinaryIO:
        """A read stream (verified at EOF) or a write stream (published on close).

        ``size``: the bytes a write stream will get, where the caller knows it (a file's
        size): a file larger than every tier is then refused at once (``MUST_CACHE``,
        ``ASYNC_THROUGH``) or written to the under-store only (``CACHE_THROUGH``).  A
        stream of unknown size is refused as soon as it outgrows the largest tier.
        """
        key = self._key(path)
        if mode == "wb":
            self._check_file_key(key)
            if self._cat.dir_ctime(key) is not None:
                # the commit refuses it too, but only after the whole stream was written
                raise StorePreconditionError(f"{self._rel(key)} is a directory, not a file")
            check_ttl(ttl, path)
            wt = self._write_type if write_type is None else WriteType.parse(write_type)
            return cast(BinaryIO, _LocalWriter(self, key, wt, ttl, pinned, size))
        if mode != "rb":
            raise ValueError(f"mode must be 'rb' or 'wb', not {mode!r}")
        for _ in range(_READ_RETRIES):
            row = self._visible(key)
            if self.settings.promote_on_read and row.tier != self._tiers[0].level:
                self._promote(row)
                row = self._visible(key)
            tier = self._by_level.get(row.tier) if row.tier is not None else None
            if tier is None:
                stream = self._open_ufs(row)
                if stream is None:
                    continue  # replaced meanwhile: read the catalog again
                return stream
            try:
                raw = open(tier.object_path(row.object), "rb", buffering=0)  # noqa: SIM115
            except FileNotFoundError:
                self._forget_missing_copy(row)
                continue  # moved or replaced meanwhile: read the catalog again
            self._accessed(row.id)
            expect = row.checksum if self._verifies(tier.name) else None
            reader = VerifyingReader(cast(BinaryIO, raw), self._rel(key), row.size, expect)
            return cast(BinaryIO, io.BufferedReader(reader, buffer_size=1 << 20))
        raise StoreError(f"{self._rel(key)} kept changing while being opened; try again")

    def _open_ufs(self, row: FileRow) -> BinaryIO | None:
        """A verifying read stream of ``row``'s under-store copy (None: read the catalog
        again, see :meth:`_open_ufs_copy`)."""
        if row.persistence != PersistenceState.PERSISTED:
            raise self._lost(row)
        stream = self._open_ufs_copy(row)
        if stream is None:
            return None
        self._accessed(row.id)
        expect = row.checksum if self._verifies("UFS") else None
        raw = VerifyingReader(stream, self._rel(row.path), row.size, expect)
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=1 << 20))

    def _open_ufs_copy(self, row: FileRow) -> BinaryIO | None:
        """The under-store copy of the version ``row`` describes, or None when the file
        changed since ``row`` was read (the caller reads the catalog again).

        Opened under the path's stripe, which every publisher holds from moving a new copy
        into place until its row commits: without it a reader could open the new bytes
        while the catalog still described the old ones, and report them corrupt.  A local
        under-store's open file keeps the bytes it opened; a remote one's are checked by
        size and CRC-32 where reads are verified."""
        with self._ufs_stripe(row.path):
            abandoned = self._cat.publishing(row.path)
            if abandoned:  # its writer died between the copy and the catalog
                for entry in abandoned:
                    self._finish_publish_locked(entry.seq)
                return None
            now = self._cat.file_by_id(row.id)
            if now is None or now.path != row.path or now.object != row.object:
                return None
            return self._ufs.open(row.path)

    def _cached_tier(self, row: FileRow) -> Tier | None:
        """The tier holding ``row``'s bytes; None when only the under-store has them
        (:class:`StoreDataLostError` when nothing has: a cached copy lost unpersisted)."""
        tier = self._by_level.get(row.tier) if row.tier is not None else None
        if tier is None and row.persistence != PersistenceState.PERSISTED:
            raise self._lost(row)
        return tier

    def _lost(self, row: FileRow) -> StoreDataLostError:
        return StoreDataLostError(
            f"{self._rel(row.path)} is lost: it was written {row.write_type} and its cached "
            "copy is gone (a reboot clears the MEM tier) without ever being persisted"
        )

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from byte ``offset`` (fewer at its end), read where
        the file is -- its tier, or the under-store -- without reading the rest: positioned
        reads of large files, as a Spark task reads its byte range of a bag.

        Not checked against the recorded CRC-32, which covers the whole file (readers of
        ranges check what their format carries), and no promotion: a range does not bring
        the whole file up a tier.  A file replaced meanwhile is read whole from one version.
        The bytes are read straight into the object returned (no copy on the way out).
        """
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        key = self._key(path)
        for _ in range(_READ_RETRIES):
            row = self._visible(key)
            tier = self._cached_tier(row)
            want = max(0, min(length, row.size - offset))  # never allocate past the end
            if tier is None:
                src = self._open_ufs_copy(row)
                if src is None:
                    continue  # replaced meanwhile: read the catalog again
                with src as stream:
                    stream.seek(offset)
                    data = _read_full(stream, want)
                self._accessed(row.id)
                return data
            try:
                fd = os.open(tier.object_path(row.object), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                self._forget_missing_copy(row)
                continue  # moved or replaced meanwhile: read the catalog again
            try:
                data = _pread_full(fd, want, offset)
            finally:
                os.close(fd)
            self._accessed(row.id)
            return data
        raise StoreError(f"{self._rel(key)} kept changing while being opened; try again")

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        """Read bytes of ``path`` from ``offset`` into ``buffer`` until it is full or the
        file ends; how many were read.  :meth:`read_range` into a buffer the caller keeps
        (a reader refilling one window needs no fresh pages for every range)."""
        if offset < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {len(buffer)}")
        key = self._key(path)
        want = len(buffer)
        for _ in range(_READ_RETRIES):
            row = self._visible(key)
            tier = self._cached_tier(row)
            got = 0
            if tier is None:
                src = self._open_ufs_copy(row)
                if src is None:
                    continue  # replaced meanwhile: read the catalog again
                with src as stream:
                    stream.seek(offset)
                    raw = cast(io.RawIOBase, stream)  # files of fsspec and io have readinto
                    while got < want and (n := raw.readinto(buffer[got:])):
                        got += n
                self._accessed(row.id)
                return got
            try:
                fd = os.open(tier.object_path(row.object), os.O_RDONLY)
            except FileNotFoundError:
                self._forget_missing_copy(row)
                continue  # moved or replaced meanwhile: read the catalog again
            try:
                while got < want and (n := os.preadv(fd, [buffer[got:]], offset + got)):
                    got += n
            finally:
                os.close(fd)
            self._accessed(row.id)
            return got
        raise StoreError(f"{self._rel(key)} kept changing while being opened; try again")

    def get(self, path: str) -> bytes:
        """All bytes of ``path``, checked against the recorded CRC-32; promotes the file."""
        key = self._key(path)
        for _ in range(_READ_RETRIES):
            row = self._visible(key)
            tier = self._cached_tier(row)
            if tier is None:
                src = self._open_ufs_copy(row)
                if src is None:
                    continue  # replaced meanwhile: read the catalog again
                with src as stream:
                    data = stream.read()
                try:
                    self._verify(row, data, "UFS")
                except StoreCorruptionError:
                    # the under-store file is replaced in place when a new version is
                    # persisted: a mismatch then is that version, not damage
                    now = self._cat.file(key)
                    if now is not None and (now.id, now.object) != (row.id, row.object):
                        continue
                    raise
                self._accessed(row.id)
                if self.settings.promote_on_read:
                    self._cache_bytes(row, data)
                return data
            try:
                data = read_object(tier.object_path(row.object), row.size)
            except FileNotFoundError:
                self._forget_missing_copy(row)
                continue
            self._verify(row, data, tier.name)
            self._accessed(row.id)
            if self.settings.promote_on_read and tier is not self._tiers[0]:
                self._cache_bytes(row, data)
            return data
        raise StoreError(f"{self._rel(key)} kept changing while being read; try again")

    def _forget_missing_copy(self, row: FileRow) -> None:
        """Record that the cached copy of ``row`` is gone, if its object is missing while
        the catalog still places it in its tier: the tier directory was emptied without a
        reboot (systemd's ``RemoveIPC`` clears a user's ``/dev/shm`` at logout; a clean-up
        script), which the reconciliation at a new boot does not see.  As that
        reconciliation does, a persisted file is then read from the under-store and any
        other file is LOST.  A copy moved, evicted or replaced meanwhile changed its
        catalog row first, so it is left alone."""
        tier = self._by_level.get(row.tier) if row.tier is not None else None
        if tier is None:
            return
        lost = row.persistence != PersistenceState.PERSISTED
        # in the transaction: tier moves rename their new copy inside theirs, and unlink
        # the old one only after it committed
        with self._cat.transaction(durable=True) as c:
            if os.path.exists(tier.object_path(row.object)):
                return
            cur = c.execute(
                "UPDATE files SET tier = NULL"
                + (", persistence = 'LOST'" if lost else "")
                + " WHERE id = ? AND object = ? AND tier IS ?",
                (row.id, row.object, row.tier),
            )
            if cur.rowcount == 1 and lost:
                self._cat.drop_entries(c, row.id)
        if cur.rowcount == 1:
            log.error(
                "%s: its cached copy in %s (%s) is gone; %s",
                self._rel(row.path),
                tier.name,
                tier.dir,
                "it is marked LOST (never persisted)" if lost else "reading the under-store",
            )

    def _verifies(self, where: str) -> bool:
        """Whether reads from ``where`` (a tier name, or UFS) check the CRC-32."""
        mode = self.settings.verify_reads
        return mode == "all" or (mode == "disk" and where != "MEM")

    def _verify(self, row: FileRow, data: bytes, where: str) -> None:
        if len(data) != row.size or (
            self._verifies(where) and crc_text(crc32(data)) != row.checksum
        ):
            raise StoreCorruptionError(
                f"{self._rel(row.path)}: the copy in "
                f"{'the under-store' if where == 'UFS' else 'tier ' + where} ({len(data)} bytes, "
                f"{crc_text(crc32(data))}) does not match the catalog ({row.size} bytes, "
                f"{row.checksum})"
            )

    def _check_file_key(self, key: str) -> None:
        if key == "/":
            raise StorePreconditionError("/ is the root directory, not a file")

    def _check_target(self, c: sqlite3.Connection, key: str) -> FileRow | None:
        """Inside a transaction: ``key`` can hold a file; returns the version it replaces."""
        return self._probe(c, key, None)[0]

    def _probe(
        self, c: sqlite3.Connection, key: str, tier: int | None
    ) -> tuple[FileRow | None, bool, int]:
        """Inside a transaction: check that ``key`` can hold a file and return the version
        it replaces, whether its parent directory exists, and the bytes used in tier level
        ``tier`` (0 when ``None``).

        One statement when the parent directory exists (the common case): a directory row
        implies directory rows for all its ancestors, so no ancestor can be a file.
        """
        self._check_file_key(key)
        parent = parent_path(key)
        row = c.execute(
            "SELECT (SELECT used FROM tiers WHERE tier = ?), (SELECT 1 FROM dirs WHERE path = ?), "
            f"(SELECT 1 FROM dirs WHERE path = ?), {_FILE_COLUMNS} "
            "FROM (SELECT 1) LEFT JOIN files f ON f.path = ?",
            (tier, key, parent, key),
        ).fetchone()
        used, is_dir, parent_known = row[:3]
        if is_dir is not None:
            raise StorePreconditionError(f"{self._rel(key)} is a directory")
        if parent_known is None and parent != "/":
            ancestors = _ancestors(key)
            marks = ",".join("?" * len(ancestors))
            above = c.execute(
                f"SELECT path FROM files WHERE path IN ({marks}) LIMIT 1", ancestors
            ).fetchone()
            if above is not None:
                raise StorePreconditionError(
                    f"{self._rel(above[0])} is a file, so {self._rel(key)} cannot be created "
                    "below it"
                )
        old = None if row[3] is None else FileRow(*row[3:])
        return old, parent_known is not None or parent == "/", int(used or 0)

    def _ensure_dirs(
        self, c: sqlite3.Connection, key: str, now: int, *, itself: bool = False
    ) -> None:
        dirs = _ancestors(key) + ([key] if itself and key != "/" else [])
        c.executemany(
            "INSERT OR IGNORE INTO dirs(path, parent, ctime_ns) VALUES (?, ?, ?)",
            [(d, parent_path(d), now) for d in dirs],
        )

    def _upsert(
        self,
        c: sqlite3.Connection,
        key: str,
        old: FileRow | None,
        *,
        size: int,
        crc: int,
        obj: str,
        tier: int | None,
        write_type: WriteType,
        persistence: PersistenceState,
        in_ufs: bool,
        ttl: float | None,
        pinned: bool | None,
        now: int,
    ) -> int:
        ttl_ms = None if ttl is None else round(ttl * 1000)
        expires = None if ttl_ms is None else now + ttl_ms * 1_000_000
        pin = int(bool(old.pinned)) if pinned is None and old is not None else int(bool(pinned))
        values = (
            size,
            crc_text(crc),
            obj,
            tier,
            pin,
            str(write_type),
            str(persistence),
            int(in_ufs or (old is not None and bool(old.in_ufs))),
            ttl_ms,
            str(TtlAction.DELETE),
            expires,
            now,
            now,
            now,
        )
        if old is not None:
            c.execute(
                "UPDATE files SET size = ?, checksum = ?, object = ?, tier = ?, pinned = ?, "
                "write_type = ?, persistence = ?, in_ufs = ?, ttl_ms = ?, ttl_action = ?, "
                "expires_ns = ?, ctime_ns = ?, mtime_ns = ?, atime_ns = ? WHERE id = ?",
                (*values, old.id),
            )
            if old.persistence == PersistenceState.TO_BE_PERSISTED:
                self._cat.drop_entries(c, old.id)
            return old.id
        cur = c.execute(
            "INSERT INTO files(size, checksum, object, tier, pinned, write_type, persistence, "
            "in_ufs, ttl_ms, ttl_action, expires_ns, ctime_ns, mtime_ns, atime_ns, path, parent) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*values, key, parent_path(key)),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _unlink_object(self, row: FileRow | None) -> None:
        if row is None or row.tier is None:
            return
        tier = self._by_level.get(row.tier)
        if tier is not None:
            with contextlib.suppress(OSError):
                os.unlink(tier.object_path(row.object))

    def _commit_cached(
        self,
        key: str,
        staged: Staged,
        wt: WriteType,
        ttl: float | None,
        pinned: bool | None,
    ) -> None:
        """Place a staged file in a tier and publish it (one catalog transaction).

        Fast path: if the staging tier has room, one transaction checks the capacity and
        publishes (SQLite serialises it against every other writer).  Otherwise, under the
        space lock, make room by eviction and publish, again checking inside the transaction
        (a fast-path writer elsewhere may have taken the room meanwhile).
        """
        obj = new_version_id()
        path = staged.path
        done = self._publish(key, path, staged, staged.pos, obj, wt, ttl, pinned)
        if done is None:
            with self._space.hold():
                for _ in range(_PLACE_ATTEMPTS):
                    pos = self._place(staged.size, staged.pos)
                    if pos is None:
                        break
                    if pos != staged.pos:
                        path = self._copy_to_tier(path, pos, key, staged.size)
                        staged = staged._replace(pos=pos, path=path)
                    done = self._publish(key, path, staged, pos, obj, wt, ttl, pinned)
                    if done is not None:
                        break
            if done is None:
                if wt is not WriteType.CACHE_THROUGH:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise self._full_error(staged.size, self._rel(key))
                log.info("%s does not fit in any tier; writing it through", self._rel(key))
                staging = self._ufs.begin(key)
                try:
                    with open(path, "rb", buffering=0) as src:
                        while chunk := src.read(CHUNK):
                            staging.write(chunk)
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                self._commit_through(key, staging, ttl, pinned, write_type=wt)
                return
        fid, old = done
        if old is not None and old.object != obj:
            self._unlink_object(old)
        if wt is WriteType.ASYNC_THROUGH:
            self._wake.set()
        elif wt is WriteType.CACHE_THROUGH:
            self._persist_version(fid, obj)

    def _publish(
        self,
        key: str,
        path: str,
        staged: Staged,
        pos: int,
        obj: str,
        wt: WriteType,
        ttl: float | None,
        pinned: bool | None,
    ) -> tuple[int, FileRow | None] | None:
        """Publish ``path`` as version ``obj`` of ``key`` in tier ``pos`` if it has room.

        Returns ``(file id, replaced version)``, or ``None`` (nothing changed) when the
        tier is full.
        """
        tier = self._tiers[pos]
        dest = tier.new_object_path(obj)
        now = time.time_ns()
        moved = False
        try:
            with self._cat.transaction(durable=wt is not WriteType.MUST_CACHE) as c:
                old, parent_known, used = self._probe(c, key, tier.level)
                if used + staged.size > tier.capacity:
                    return None
                if not parent_known:  # a directory row implies rows for all its ancestors
                    self._ensure_dirs(c, key, now)
                os.rename(path, dest)
                moved = True
                fid = self._upsert(
                    c,
                    key,
                    old,
                    size=staged.size,
                    crc=staged.crc,
                    obj=obj,
                    tier=tier.level,
                    write_type=wt,
                    persistence=PersistenceState.NOT_PERSISTED
                    if wt is WriteType.MUST_CACHE
                    else PersistenceState.TO_BE_PERSISTED,
                    in_ufs=False,
                    ttl=ttl,
                    pinned=pinned,
                    now=now,
                )
                if wt is not WriteType.MUST_CACHE:
                    c.execute(
                        "INSERT INTO journal(file_id, object, created_ns) VALUES (?, ?, ?)",
                        (fid, obj, now),
                    )
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(dest if moved else path)
            raise
        return fid, old

    def _commit_through(
        self,
        key: str,
        staging: UfsStaging,
        ttl: float | None,
        pinned: bool | None,
        *,
        write_type: WriteType = WriteType.THROUGH,
    ) -> None:
        """Publish a file written to the under-store only."""
        try:
            staging.finish()
        except BaseException:
            staging.discard()
            raise
        now = time.time_ns()
        obj = new_version_id()
        try:
            with self._ufs_stripe(key):
                # Moving the copy into place replaces the previous version's bytes
                # before the row that describes the new ones commits: the record lets
                # the next process finish the row if this one dies in between (the old
                # row would describe bytes that are gone, and every read fail as corrupt).
                seq = self._cat.begin_publish(
                    key,
                    obj=obj,
                    size=staging.size,
                    checksum=crc_text(staging.crc),
                    write_type=str(write_type),
                    ttl_ms=None if ttl is None else round(ttl * 1000),
                    pinned=pinned,
                    now_ns=now,
                )
                try:
                    with self._cat.transaction(durable=True) as c:
                        old = self._check_target(c, key)
                        self._ensure_dirs(c, key, now)
                        Catalog.end_publish(c, seq)
                        staging.publish()
                        self._upsert(
                            c,
                            key,
                            old,
                            size=staging.size,
                            crc=staging.crc,
                            obj=obj,
                            tier=None,
                            write_type=write_type,
                            persistence=PersistenceState.PERSISTED,
                            in_ufs=True,
                            ttl=ttl,
                            pinned=pinned,
                            now=now,
                        )
                except BaseException:
                    if staging.published:
                        # the copy is in place but its row did not commit: finish it
                        # now, or leave the record to the next sweep
                        with contextlib.suppress(Exception):
                            self._finish_publish_locked(seq)
                    else:
                        staging.discard()
                        with contextlib.suppress(Exception), self._cat.transaction() as c:
                            Catalog.end_publish(c, seq)
                    raise
        except BaseException:
            staging.discard()  # nothing to do once the copy is in place
            raise
        self._unlink_object(old)

    def _finish_publishes(self, path: str | None = None) -> int:
        """Finish or drop the under-store publishes (of ``path``, when given) that their
        writers left between moving the copy into place and committing its row (a process
        killed there).  Returns how many were finished."""
        done = 0
        for entry in self._cat.publishing(path):
            # a writer holds its path's stripe from the record to its commit: once this
            # process holds it, a record still there is one its writer abandoned
            with self._ufs_stripe(entry.path):
                done += self._finish_publish_locked(entry.seq)
        return done

    def _finish_publish_locked(self, seq: int) -> int:
        """:meth:`_finish_publishes` for record ``seq``, the path's stripe held: the row of
        the new version is committed if the under-store holds its bytes and the file is
        still the version the writer replaced, and the record dropped either way (1 when
        the row was committed, else 0)."""
        entry = next((e for e in self._cat.publishing() if e.seq == seq), None)
        if entry is None:
            return 0
        in_place = self._ufs_holds(entry.path, entry.size, entry.checksum)
        old: FileRow | None = None
        with self._cat.transaction(durable=True) as c:
            if not Catalog.end_publish(c, seq):
                return 0
            current = self._cat.file(entry.path, c)
            if not in_place or (None if current is None else current.object) != entry.replaces:
                log.info(
                    "%s: a write through to the under-store (pid %d) did not finish; "
                    "the file stays as it is",
                    self._rel(entry.path),
                    entry.owner_pid,
                )
                return 0
            try:
                old = self._check_target(c, entry.path)
            except StorePreconditionError as err:
                log.warning(
                    "%s: not finishing the write of process %d: %s",
                    self._rel(entry.path),
                    entry.owner_pid,
                    err,
                )
                return 0
            self._ensure_dirs(c, entry.path, entry.created_ns)
            self._upsert(
                c,
                entry.path,
                old,
                size=entry.size,
                crc=int(entry.checksum.removeprefix("crc32:"), 16),
                obj=entry.object,
                tier=None,
                write_type=WriteType(entry.write_type),
                persistence=PersistenceState.PERSISTED,
                in_ufs=True,
                ttl=None if entry.ttl_ms is None else entry.ttl_ms / 1000,
                pinned=None if entry.pinned is None else bool(entry.pinned),
                now=entry.created_ns,
            )
        log.warning(
            "%s: finished a write through to the under-store that process %d left between "
            "the copy and the catalog",
            self._rel(entry.path),
            entry.owner_pid,
        )
        self._unlink_object(old)
        return 1

    def _ufs_holds(self, key: str, size: int, checksum: str) -> bool:
        """Whether the under-store copy of ``key`` has ``size`` bytes with ``checksum``."""
        try:
            with self._ufs.open(key) as src:
                crc = got = 0
                while chunk := src.read(CHUNK):
                    crc = crc32(chunk, crc)
                    got += len(chunk)
                    if got > size:
                        return False
        except StoreNotFoundError:
            return False
        return got == size and crc_text(crc) == checksum

    def _copy_to_tier(self, src: str, pos: int, key: str, size: int) -> str:
        """Copy a staged file into tier ``pos``'s tmp (placement chose a lower tier)."""
        dest = self._tiers[pos].temp_path()
        try:
            copy_file(src, dest)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(dest)
            with contextlib.suppress(OSError):
                os.unlink(src)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full_error(size, self._rel(key)) from err
            raise StoreError(
                f"copying {self._rel(key)} into {self._tiers[pos].name}: {err}"
            ) from err
        with contextlib.suppress(OSError):
            os.unlink(src)
        return dest

    # -- placement, eviction, promotion (under the space lock) ------------------------------

    def _place(self, size: int, start: int) -> int | None:
        """The first tier from ``start`` down that has (or can make) room for ``size`` bytes."""
        for pos in range(start, len(self._tiers)):
            if self._fit(pos, size):
                return pos
        return None

    def _fit(self, pos: int, size: int) -> bool:
        """Make ``size`` bytes free in tier ``pos`` by evicting LRU unpinned files."""
        tier = self._tiers[pos]
        if size > tier.capacity:
            return False
        self._flush_access()
        last = pos == len(self._tiers) - 1
        tried: set[int] = set()
        while True:
            used = self._cat.usage().get(tier.level, 0)
            if used + size <= tier.capacity:
                return True
            victims = self._cat.lru(tier.level, persisted_only=last, exclude=tried, limit=16)
            if not victims:
                return False
            for victim in victims:
                tried.add(victim.id)
                if self._evict(victim, pos):
                    break

    def _evict(self, row: FileRow, pos: int) -> bool:
        """Move ``row`` out of tier ``pos``: to a lower tier, or drop it if persisted."""
        for lower in range(pos + 1, len(self._tiers)):
            if self._fit(lower, row.size):
                return self._move(row, pos, lower, evicting=True)
        if row.persistence == PersistenceState.PERSISTED:
            return self._drop(row)
        return False

    def _move(self, row: FileRow, src_pos: int, dst_pos: int, *, evicting: bool = False) -> bool:
        """Move ``row``'s copy from tier ``src_pos`` to ``dst_pos`` if the row did not change
        (``evicting``: nor was pinned since it was chosen)."""
        src_tier, dst_tier = self._tiers[src_pos], self._tiers[dst_pos]
        tmp = dst_tier.temp_path()
        try:
            crc = copy_file(src_tier.object_path(row.object), tmp)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not isinstance(err, FileNotFoundError):
                log.warning("cannot move %s to %s: %s", row.path, dst_tier.name, err)
            return False
        if crc_text(crc) != row.checksum:
            os.unlink(tmp)
            log.error("%s: checksum mismatch in %s; not moving it", row.path, src_tier.name)
            return False
        dest = dst_tier.new_object_path(row.object)
        with self._cat.transaction() as c:
            cur = c.execute(
                "UPDATE files SET tier = ? WHERE id = ? AND object = ? AND tier = ? "
                + ("AND pinned = 0 " if evicting else "")
                + "AND (SELECT used FROM tiers WHERE tier = ?) + size <= ?",
                (
                    dst_tier.level,
                    row.id,
                    row.object,
                    src_tier.level,
                    dst_tier.level,
                    dst_tier.capacity,
                ),
            )
            if cur.rowcount == 1:
                os.rename(tmp, dest)
        if cur.rowcount != 1:
            os.unlink(tmp)
            return False
        with contextlib.suppress(OSError):
            os.unlink(src_tier.object_path(row.object))
        log.debug("moved %s from %s to %s", row.path, src_tier.name, dst_tier.name)
        return True

    def _drop(self, row: FileRow) -> bool:
        """Forget the cached copy of a persisted file, unless it changed or was pinned since
        ``row`` was read (eviction, ``free`` and TTL actions act on rows read earlier)."""
        with self._cat.transaction() as c:
            cur = c.execute(
                "UPDATE files SET tier = NULL WHERE id = ? AND object = ? AND tier IS ? "
                "AND persistence = 'PERSISTED' AND pinned = 0",
                (row.id, row.object, row.tier),
            )
        if cur.rowcount == 1:
            self._unlink_object(row)
            return True
        return False

    def _promote(self, row: FileRow) -> None:
        """Move a file to the top tier (or cache it from the under-store), if it fits."""
        top = self._tiers[0]
        if row.size > top.capacity:
            return
        with self._space.hold():
            cur = self._cat.file_by_id(row.id)
            if cur is None or cur.object != row.object or cur.tier == top.level:
                return
            if not self._fit(0, row.size):
                return
            if cur.tier is not None and cur.tier in self._by_level:
                pos = self._tiers.index(self._by_level[cur.tier])
                self._move(cur, pos, 0)
                return
            if cur.persistence != PersistenceState.PERSISTED:
                return
            tmp = top.temp_path()
            try:
                with self._ufs.open(cur.path) as src:
                    crc = write_new(tmp, iter(lambda: src.read(CHUNK), b""))
            except (OSError, StoreError) as err:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                log.warning("cannot cache %s from the under-store: %s", cur.path, err)
                return
            self._install(cur, tmp, crc, top)

    def _cache_bytes(self, row: FileRow, data: bytes) -> None:
        """Put bytes just read from a lower tier or the under-store into the top tier."""
        top = self._tiers[0]
        if row.size > top.capacity:
            return
        with self._space.hold():
            cur = self._cat.file_by_id(row.id)
            if cur is None or cur.object != row.object or cur.tier == top.level:
                return
            if not self._fit(0, row.size):
                return
            tmp = top.temp_path()
            try:
                write_new(tmp, [data])
            except OSError as err:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                log.warning("cannot promote %s: %s", row.path, err)
                return
            old_tier = cur.tier
            if self._install(cur, tmp, crc32(data), top) and old_tier is not None:
                old = self._by_level.get(old_tier)
                if old is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(old.object_path(cur.object))

    def _install(self, row: FileRow, tmp: str, crc: int, tier: Tier) -> bool:
        """Make ``tmp`` the cached copy of ``row`` in ``tier`` if the row did not change."""
        if crc_text(crc) != row.checksum or os.stat(tmp).st_size != row.size:
            os.unlink(tmp)
            log.error("%s: the copy read does not match its checksum; not caching it", row.path)
            return False
        dest = tier.new_object_path(row.object)
        with self._cat.transaction() as c:
            cur = c.execute(
                "UPDATE files SET tier = ? WHERE id = ? AND object = ? AND tier IS ? "
                "AND (SELECT used FROM tiers WHERE tier = ?) + size <= ?",
                (tier.level, row.id, row.object, row.tier, tier.level, tier.capacity),
            )
            if cur.rowcount == 1:
                os.rename(tmp, dest)
        if cur.rowcount != 1:
            os.unlink(tmp)
            return False
        return True

    # -- access times ----------------------------------------------------------------------

    def _accessed(self, file_id: int) -> None:
        with self._access_lock:
            self._access[file_id] = time.time_ns()

    def _flush_access(self) -> None:
        with self._access_lock:
            pending, self._access = self._access, {}
        if pending:
            self._cat.touch([(ns, fid) for fid, ns in pending.items()])

    # -- namespace operations ----------------------------------------------------------------

    def mkdir(self, path: str) -> None:
        """Create directory ``path`` and its parents (no error if it exists)."""
        key = self._key(path)
        if key == "/":
            return
        with self._cat.transaction() as c:
            if self._cat.file(key, c) is not None:
                raise StoreExistsError(f"{self._rel(key)} exists and is a file")
            ancestors = _ancestors(key)
            if ancestors:
                marks = ",".join("?" * len(ancestors))
                hit = c.execute(
                    f"SELECT path FROM files WHERE path IN ({marks}) LIMIT 1", ancestors
                ).fetchone()
                if hit is not None:
                    raise StorePreconditionError(f"{self._rel(hit[0])} is a file")
            self._ensure_dirs(c, key, time.time_ns(), itself=True)

    def _file_or_tree(self, key: str, *, recursive: bool, what: str) -> builtins.list[FileRow]:
        """The live file at ``key``, or every file below the directory ``key``."""
        row = self._cat.file(key)
        if row is not None and not self._is_expired(row):
            return [row]
        if self._cat.dir_ctime(key) is None:
            raise StoreNotFoundError(f"{self._rel(key)} does not exist in {self.uri}")
        files, _ = self._cat.descendants(key)
        if files and not recursive:
            raise StorePreconditionError(
                f"{self._rel(key)} is a non-empty directory; {what} it with recursive=True "
                "(-r on the command line)"
            )
        return files

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file or a directory (non-empty ones only with ``recursive``), everywhere."""
        key = self._key(path)
        row = self._cat.file(key)
        # A directory starts on the quick path too: _delete_rows sees what is under it.
        durable = row is not None and not _memory_only(row)
        while True:
            try:
                gone, tree, seq = self._delete_rows(key, recursive, durable)
                break
            except _DurableDeleteNeededError:
                durable = True  # not (or no longer) memory-only: delete durably
        for r in gone:
            self._unlink_object(r)
        if tree or gone[0].in_ufs:
            self._delete_ufs_copies(key, gone, tree=tree)
        if seq is not None:
            self._cat.end_remove(seq)

    def _delete_ufs_copies(
        self, key: str, gone: builtins.list[FileRow], *, tree: bool = False
    ) -> None:
        """Remove the under-store copies of files just deleted from the catalog: ``key``
        (a file, or with ``tree`` a directory and all below it), whose rows were ``gone``.

        A writer may have published a new file at one of those paths since the rows went
        (the catalog change and the under-store removal are not one step): its copy in
        the under-store is its own, and stays.  Under the stripe locks no persist or
        THROUGH write publishes meanwhile."""
        if not tree:
            with self._ufs_stripe(key):
                now = self._cat.file(key)
                if now is None or not now.in_ufs:
                    self._ufs.delete(key)
                else:
                    log.debug("%s was written again meanwhile; its under-store copy stays", key)
            return
        with self._ufs_locks.hold():
            self._finish_renames_locked()
            now = self._cat.file(key)
            if now is not None and now.in_ufs:
                return  # a file written through in the directory's place: the tree was gone
            files, _ = self._cat.descendants(key)
            kept = {f.path for f in files if f.in_ufs}
            if not kept:
                self._ufs.delete(key, recursive=True)
                return
            for row in gone:  # file by file, around the new ones
                if row.in_ufs and row.path not in kept:
                    self._ufs.delete(row.path)

    def _finish_removals(self) -> None:
        """Remove the under-store copies of deleted files that processes which died (or
        this one, on an error) left in the under-store after deleting them from the
        catalog."""
        for entry in self._cat.removing():
            if entry.owner_pid != os.getpid() and _pid_alive(entry.owner_pid):
                continue  # still on its way
            self._finish_removal(entry)

    def _finish_removal(self, entry: Removing) -> None:
        # a tree with files written through below it since keeps them, and (which ones
        # were deleted being no longer known) the deleted ones' copies too
        self._delete_ufs_copies(entry.path, [], tree=bool(entry.tree))
        self._cat.end_remove(entry.seq)
        if entry.owner_pid != os.getpid():
            log.info(
                "%s: removed the under-store copies that process %d deleted but left",
                self._rel(entry.path),
                entry.owner_pid,
            )

    def _delete_rows(
        self, key: str, recursive: bool, durable: bool
    ) -> tuple[builtins.list[FileRow], bool, int | None]:
        """The catalog half of :meth:`delete`: the rows removed, whether it was a tree, and
        the record of the under-store copies to remove (None: none to record).

        A file that lives only in the MEM tier, or a directory whose files all do, is deleted
        without waiting for the disk (``durable=False``; parameter servers delete a consumed
        version every step): if the machine loses power before the commit reaches the disk,
        the MEM tier (tmpfs) is gone as well and the files come back only as LOST entries --
        never as data. Anything else (an empty directory included) raises
        :class:`_DurableDeleteNeededError` on the quick path, for a durable retry.
        """
        gone: builtins.list[FileRow] = []
        tree = False
        with self._cat.transaction(durable=durable) as c:
            row = self._cat.file(key, c)
            if row is not None and not durable and not _memory_only(row):
                raise _DurableDeleteNeededError
            if row is not None:
                c.execute("DELETE FROM files WHERE id = ?", (row.id,))
                self._cat.drop_entries(c, row.id)
                gone.append(row)
            elif self._cat.dir_ctime(key, c) is not None:
                if not recursive and self._cat.has_descendants(key, c):
                    raise StorePreconditionError(
                        f"{self._rel(key)} is a non-empty directory; delete it with recursive=True "
                        "(-r on the command line)"
                    )
                files, _ = self._cat.descendants(key, c)
                if not durable and not (files and all(_memory_only(f) for f in files)):
                    raise _DurableDeleteNeededError
                lo, hi = _range(key)
                c.execute("DELETE FROM files WHERE path > ? AND path < ?", (lo, hi))
                c.execute("DELETE FROM dirs WHERE path > ? AND path < ?", (lo, hi))
                c.execute("DELETE FROM dirs WHERE path = ?", (key,))
                c.executemany("DELETE FROM journal WHERE file_id = ?", [(f.id,) for f in files])
                gone.extend(files)
                tree = True
            else:
                raise StoreNotFoundError(f"{self._rel(key)} does not exist in {self.uri}")
            seq = None
            if durable and (tree or gone[0].in_ufs):
                # removed from the under-store after the commit: a process killed before
                # then leaves the record for the next one to finish
                seq = Catalog.begin_remove(c, key, tree=tree, now_ns=time.time_ns())
        return gone, tree, seq

    def rename(self, src: str, dst: str) -> None:
        """Move a file or directory; ``dst`` must not exist (Alluxio semantics)."""
        s, d = self._key(src), self._key(dst)
        if s == "/" or d == "/":
            raise StorePreconditionError("the root directory cannot be renamed or replaced")
        if d.startswith(s + "/"):
            raise InvalidPathError(f"cannot move {src} into itself ({dst})")
        if s == d:
            self.stat(src)
            return
        now = time.time_ns()
        with self._ufs_locks.hold():
            # The under-store copy moves inside the catalog transaction, before it commits:
            # the record lets the next process move the copy back if this one dies in
            # between (the catalog would list the file where the under-store has nothing).
            self._finish_renames_locked()
            ident = self._ufs.identity(s)
            if ident is None:  # nothing to move in the under-store
                with self._cat.transaction(durable=True) as c:
                    self._rename_rows(c, s, d, now)
                return
            seq = self._cat.begin_rename(s, d, ident=ident, now_ns=now)
            entry = Renaming(seq, s, d, ident, os.getpid(), now)
            try:
                with self._cat.transaction(durable=True) as c:
                    if self._rename_rows(c, s, d, now):
                        self._ufs.rename(s, d)
                    Catalog.end_rename(c, seq)
            except BaseException:
                # the catalog change did not commit: the copy goes back where it lists it
                try:
                    self._undo_rename_locked(entry)
                except Exception as err:
                    log.warning(
                        "cannot undo the failed rename of %s to %s now (the next sweep "
                        "tries again): %s",
                        self._rel(s),
                        self._rel(d),
                        err,
                    )
                raise

    def _rename_rows(self, c: sqlite3.Connection, s: str, d: str, now: int) -> bool:
        """Inside a transaction: the catalog half of :meth:`rename`; whether the
        under-store copy moves too (a file's, if it has one; a directory's always)."""
        row = self._cat.file(s, c)
        is_dir = row is None and self._cat.dir_ctime(s, c) is not None
        if row is None and not is_dir:
            raise StoreNotFoundError(f"{self._rel(s)} does not exist in {self.uri}")
        if self._cat.file(d, c) is not None or self._cat.dir_ctime(d, c) is not None:
            raise StoreExistsError(f"{self._rel(d)} already exists")
        self._check_target(c, d)
        self._ensure_dirs(c, d, now)
        if row is not None:
            c.execute(
                "UPDATE files SET path = ?, parent = ?, mtime_ns = ? WHERE id = ?",
                (d, parent_path(d), now, row.id),
            )
            return bool(row.in_ufs)
        lo, hi = _range(s)
        n = len(s)
        for table in ("files", "dirs"):
            c.execute(
                f"UPDATE {table} SET path = ? || substr(path, ?), "
                "parent = ? || substr(parent, ?) WHERE path > ? AND path < ?",
                (d, n + 1, d, n + 1, lo, hi),
            )
        c.execute("UPDATE dirs SET path = ?, parent = ? WHERE path = ?", (d, parent_path(d), s))
        return True

    @contextlib.contextmanager
    def _ufs_stripe(self, key: str) -> Iterator[None]:
        """Hold ``key``'s under-store stripe, with no rename left half done (so the
        under-store has every file where the catalog lists it; see :meth:`rename`)."""
        while True:
            with self._ufs_locks.hold(_stripe(key)):
                if not self._cat.has_renaming():
                    yield
                    return
            self._finish_renames()

    def _finish_renames(self) -> None:
        """Undo the renames that processes killed mid-way left (see :meth:`rename`)."""
        if self._cat.has_renaming():
            with self._ufs_locks.hold():
                self._finish_renames_locked()

    def _finish_renames_locked(self) -> None:
        """:meth:`_finish_renames` with every stripe held.  A renamer holds them all from
        its record to its commit, which drops the record: one still there is of a rename
        that never committed, so the catalog has the file at its old path, and the
        under-store copy goes back there if it moved."""
        for entry in self._cat.renaming():
            self._undo_rename_locked(entry)

    def _undo_rename_locked(self, entry: Renaming) -> None:
        moved = self._ufs.undo_rename(entry.src, entry.dst, entry.ident)
        with self._cat.transaction(durable=True) as c:
            Catalog.end_rename(c, entry.seq)
        if moved:
            log.warning(
                "%s: moved its under-store copy back from %s, where a rename (pid %d) that "
                "did not finish had put it",
                self._rel(entry.src),
                self._rel(entry.dst),
                entry.owner_pid,
            )

    def _set(self, key: str, sql: str, params: tuple[object, ...]) -> None:
        """Run ``UPDATE files SET <sql>`` on the file ``key`` or every file below it."""
        with self._cat.transaction() as c:
            row = self._cat.file(key, c)
            if row is not None:
                c.execute(f"UPDATE files SET {sql} WHERE id = ?", (*params, row.id))
                return
            if self._cat.dir_ctime(key, c) is None:
                raise StoreNotFoundError(f"{self._rel(key)} does not exist in {self.uri}")
            lo, hi = _range(key)
            c.execute(
                f"UPDATE files SET {sql} WHERE path > ? AND path < ?",
                (*params, lo, hi),
            )

    def pin(self, path: str) -> None:
        """Never evict ``path`` (a file, or every file below a directory) from its tier."""
        self._set(self._key(path), "pinned = 1", ())

    def unpin(self, path: str) -> None:
        """Let ``path`` be evicted again."""
        self._set(self._key(path), "pinned = 0", ())

    def set_ttl(
        self, path: str, ttl: float | None, *, action: TtlAction | str = TtlAction.DELETE
    ) -> None:
        """Expire ``path`` ``ttl`` seconds after its creation (``None`` clears the TTL)."""
        act = TtlAction.parse(action)
        check_ttl_change(ttl, path)
        if ttl is None:
            self._set(self._key(path), "ttl_ms = NULL, expires_ns = NULL", ())
            return
        ms = round(ttl * 1000)
        self._set(
            self._key(path),
            "ttl_ms = ?, ttl_action = ?, expires_ns = ctime_ns + ?",
            (ms, str(act), ms * 1_000_000),
        )
        self._wake.set()

    def free(self, path: str, *, recursive: bool = False) -> None:
        """Drop cached copies; the files must be persisted and not pinned."""
        rows = self._file_or_tree(self._key(path), recursive=recursive, what="free")
        for row in rows:
            if row.tier is None:
                continue
            if row.pinned:
                raise StorePreconditionError(f"{self._rel(row.path)} is pinned; unpin it first")
            if row.persistence != PersistenceState.PERSISTED:
                raise StorePreconditionError(
                    f"{self._rel(row.path)} is {row.persistence}; freeing it would lose it -- "
                    "persist it first"
                )
        for row in rows:
            if row.tier is not None:
                self._drop(row)

    def persist(self, path: str) -> None:
        """Write ``path`` (or every file below it) to the under-store now."""
        for row in self._file_or_tree(self._key(path), recursive=True, what="persist"):
            if row.persistence == PersistenceState.PERSISTED:
                continue
            if row.persistence == PersistenceState.LOST or row.tier is None:
                raise self._lost(row)
            self._persist_version(row.id, row.object)

    # -- persisting ---------------------------------------------------------------------

    def _persist_version(self, file_id: int, obj: str) -> None:
        """Copy version ``obj`` of file ``file_id`` to the under-store (no-op if superseded)."""
        path = f"file {file_id}"
        for _ in range(_READ_RETRIES):
            row = self._cat.file_by_id(file_id)
            if row is None or row.object != obj or row.persistence == PersistenceState.PERSISTED:
                with self._cat.transaction() as c:
                    self._cat.drop_entries(c, file_id, obj)
                return
            path = self._rel(row.path)
            with self._ufs_stripe(row.path):
                again = self._cat.file_by_id(file_id)
                if again is None or again.path != row.path or again.object != obj:
                    continue
                tier = self._by_level.get(again.tier) if again.tier is not None else None
                if tier is None:
                    raise self._lost(again)
                staging = self._ufs.begin(again.path)
                try:
                    with open(tier.object_path(obj), "rb", buffering=0) as src:
                        while chunk := src.read(CHUNK):
                            staging.write(chunk)
                    staging.finish()
                except FileNotFoundError:
                    staging.discard()
                    self._forget_missing_copy(again)
                    continue  # evicted to another tier meanwhile
                except BaseException:
                    staging.discard()
                    raise
                if crc_text(staging.crc) != again.checksum or staging.size != again.size:
                    staging.discard()
                    raise StoreCorruptionError(
                        f"{self._rel(again.path)}: cached copy in {tier.name} does not match its "
                        "checksum; not persisting it"
                    )
                with self._cat.transaction(durable=True) as c:
                    cur = self._cat.file_by_id(file_id, c)
                    if cur is None or cur.path != again.path or cur.object != obj:
                        staging.discard()
                        continue
                    staging.publish()
                    c.execute(
                        "UPDATE files SET persistence = 'PERSISTED', in_ufs = 1 WHERE id = ?",
                        (file_id,),
                    )
                    self._cat.drop_entries(c, file_id, obj)
                log.debug("persisted %s", again.path)
                return
        raise StoreError(
            f"{path} in {self.uri} kept changing (moved or replaced) while being persisted; "
            "call persist again (a pending ASYNC_THROUGH persist is retried by itself)"
        )

    def _run_pending(self) -> int:
        """Persist journaled files this process can claim; returns how many were done."""
        pid = os.getpid()
        done = 0
        now_mono = time.monotonic()
        for entry in self._cat.pending_entries():
            if self._stop.is_set():
                break
            if entry.owner_pid is not None and entry.claimed_ns is not None:
                stale = time.time_ns() - entry.claimed_ns > _CLAIM_STALE_NS
                if entry.owner_pid != pid and _pid_alive(entry.owner_pid) and not stale:
                    continue
            if self._retry_at.get(entry.seq, 0.0) > now_mono:
                continue
            if not self._cat.claim(entry, pid, time.time_ns()):
                continue
            try:
                if entry.owner_pid is not None and entry.owner_pid != pid:
                    self._clean_after_crash(entry.file_id)
                self._persist_version(entry.file_id, entry.object)
                self._retry_at.pop(entry.seq, None)
                done += 1
            except Exception as err:  # recorded in the journal, retried later
                log.warning("persisting file %d failed (will retry): %s", entry.file_id, err)
                self._retry_at[entry.seq] = now_mono + self.settings.persist_retry_interval
                self._cat.release(entry.seq, str(err))
        return done

    def _clean_after_crash(self, file_id: int) -> None:
        """Remove under-store staging files that a persister killed mid-copy left behind."""
        row = self._cat.file_by_id(file_id)
        if row is not None:
            log.info("resuming the persist of %s after its previous owner died", row.path)
            self._ufs.remove_stale_staging(row.path, _pid_alive)

    def _expire(self, row: FileRow) -> None:
        """Carry out the TTL action of an expired file (if it did not change meanwhile)."""
        if row.ttl_action == TtlAction.FREE:
            if row.persistence == PersistenceState.TO_BE_PERSISTED:
                return  # freed once persisted; clearing the TTL now would keep it cached
            with self._cat.transaction() as c:
                cur = c.execute(
                    "UPDATE files SET ttl_ms = NULL, expires_ns = NULL "
                    "WHERE id = ? AND object = ? AND expires_ns IS ?",
                    (row.id, row.object, row.expires_ns),
                )
            if cur.rowcount != 1:
                return  # replaced, given a new TTL or handled by another process meanwhile
            if row.persistence == PersistenceState.PERSISTED and not row.pinned:
                self._drop(row)
            elif row.tier is not None:
                log.info(
                    "TTL expired: %s is not freed, it is %s",
                    self._rel(row.path),
                    "pinned" if row.pinned else "never persisted (MUST_CACHE)",
                )
            return
        seq: int | None = None
        with self._cat.transaction(durable=True) as c:
            # the row as it is now: moved to another tier or persisted since it was read
            gone = self._cat.file_by_id(row.id, c)
            if gone is None or gone.object != row.object or gone.expires_ns != row.expires_ns:
                return
            c.execute("DELETE FROM files WHERE id = ?", (row.id,))
            self._cat.drop_entries(c, row.id)
            if gone.in_ufs:
                seq = Catalog.begin_remove(c, gone.path, tree=False, now_ns=time.time_ns())
        log.info("TTL expired: deleted %s", gone.path)
        self._unlink_object(gone)
        if gone.in_ufs:
            self._delete_ufs_copies(gone.path, [gone])
        if seq is not None:
            self._cat.end_remove(seq)

    def _sweep(self) -> None:
        """Expire TTLs; remove under-store staging files of writers that died since, and
        finish the writes they left between the under-store and the catalog."""
        for row in self._cat.expired(time.time_ns()):
            self._expire(row)
        self._ufs.remove_abandoned_staging(_pid_alive)
        self._finish_renames()
        self._finish_publishes()
        self._finish_removals()

    def maintain(self) -> None:
        """One round of background work now: persist what is pending, expire TTLs, clean up
        after dead writers (staging files; writes left between the under-store and the
        catalog), flush LRU."""
        self._run_pending()
        self._sweep()
        self._flush_access()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pending ``ASYNC_THROUGH`` persist of the store is done.

        Raises :class:`StoreError` if ``timeout`` seconds pass first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._cat.journal_size():
            if self._thread is None or not self._thread.is_alive():
                self._retry_at.clear()
                self._run_pending()
            else:
                self._wake.set()
            if not self._cat.journal_size():
                break
            if deadline is not None and time.monotonic() > deadline:
                raise StoreError(
                    f"{self._cat.journal_size()} persist(s) still pending after {timeout} s; "
                    f"see the journal in {self._cat.path}"
                )
            time.sleep(0.02)
        self._flush_access()

    def _maintain_loop(self) -> None:
        interval = max(0.05, self.settings.ttl_check_interval)
        while not self._stop.is_set():
            try:
                self._run_pending()
                if time.monotonic() - self._last_sweep >= interval:
                    self._last_sweep = time.monotonic()
                    self._sweep()
                self._flush_access()
            except Exception:  # the loop must survive; the error is logged
                log.exception("store maintenance failed; retrying")
            self._wake.wait(timeout=min(interval, 1.0))
            self._wake.clear()

    def close(self) -> None:
        """Stop the background thread and release connections; pending persists stay journaled."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None
        with contextlib.suppress(Exception):
            self._flush_access()
        self._cat.close()
        self._space.close()
        self._ufs_locks.close()


def _ancestors(key: str) -> list[str]:
    """Directories above ``key``, outermost first, without the root."""
    parts = key.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _read_full(stream: BinaryIO, want: int) -> bytes:
    """``want`` bytes from ``stream`` (fewer at its end), in as few reads as it takes."""
    data = stream.read(want)
    if len(data) >= want or not data:
        return data
    parts = [data]
    got = len(data)
    while got < want and (more := stream.read(want - got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pread_full(fd: int, want: int, offset: int) -> bytes:
    """``want`` bytes of file ``fd`` from ``offset`` (fewer at its end).  One ``pread``
    usually returns them all, into the bytes object returned; a short one (Linux returns
    at most 2 GiB - 4 KiB per call) is followed by more, whose results are joined."""
    data = os.pread(fd, want, offset)
    if len(data) >= want or not data:
        return data
    parts = [data]
    got = len(data)
    while got < want and (more := os.pread(fd, want - got, offset + got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _range(key: str) -> tuple[str, str]:
    return descendant_range(key)


def _stripe(key: str) -> int:
    return crc32(key.encode("utf-8")) % _UFS_STRIPES


class _DurableDeleteNeededError(Exception):
    """Raised inside a non-durable delete whose file turned out to need a durable one."""


def _memory_only(row: FileRow | None) -> bool:
    """Whether ``row`` is a file whose only copy is in the MEM tier (never persisted)."""
    return (
        row is not None
        and row.tier == 0
        and not row.in_ufs
        and row.persistence == PersistenceState.NOT_PERSISTED
    )
