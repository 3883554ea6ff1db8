"""The local store's catalog: file metadata, directories, tier usage and the persist journal.

One SQLite database in WAL mode, shared by every process that opens the same store (Spark
executors are separate processes).  Each mutation is one short ``BEGIN IMMEDIATE``
transaction; SQLite serialises writers across processes and WAL lets readers proceed while
one writes.  The catalog is the single point of truth: a file version becomes visible
exactly when the transaction that references its object commits.

Format history (``meta.schema``):

- 1: files, dirs, tiers (usage kept by triggers), journal, meta.
- 2: adds ``publishing``: under-store copies about to replace a file's (``THROUGH`` writes),
  recorded before the copy is moved into place, so that one whose writer died before its
  catalog row committed is finished by the next process.  A format-1 catalog is upgraded
  in place when opened (the table is only added).
- 3: adds ``renaming``: renames about to move an under-store copy, recorded before the
  move, so that one whose process died before its catalog change committed is rolled back
  by the next process (the copy moved back to where the catalog has it); and ``removing``:
  under-store copies of files just deleted from the catalog, recorded in the transaction
  that deletes them, so that those a process killed before removing them are removed by
  the next one.  Format 1 and 2 catalogs are upgraded in place when opened (the tables are
  only added).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

from adcloud.store.errors import (
    StoreCorruptionError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)

__all__ = [
    "Catalog",
    "FileRow",
    "JournalEntry",
    "Publishing",
    "Removing",
    "Renaming",
    "descendant_range",
]

SCHEMA_VERSION = 3
#: Formats this version opens (and upgrades to :data:`SCHEMA_VERSION`).
_UPGRADABLE = (1, 2)

#: How long a statement waits for another connection's write transaction to end.
_BUSY_TIMEOUT_S = 60.0

# primary SQLite result codes (the low byte of an extended code)
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 5, 6, 11, 13, 26

P = ParamSpec("P")
R = TypeVar("R")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL UNIQUE,
    parent TEXT NOT NULL,
    size INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    object TEXT NOT NULL,
    tier INTEGER,
    pinned INTEGER NOT NULL DEFAULT 0,
    write_type TEXT NOT NULL,
    persistence TEXT NOT NULL,
    in_ufs INTEGER NOT NULL DEFAULT 0,
    ttl_ms INTEGER,
    ttl_action TEXT NOT NULL DEFAULT 'DELETE',
    expires_ns INTEGER,
    ctime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_parent ON files(parent);
CREATE INDEX IF NOT EXISTS files_lru ON files(tier, pinned, atime_ns);
CREATE INDEX IF NOT EXISTS files_expiry ON files(expires_ns) WHERE expires_ns IS NOT NULL;
CREATE TABLE IF NOT EXISTS dirs (
    path TEXT PRIMARY KEY,
    parent TEXT NOT NULL,
    ctime_ns INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS dirs_parent ON dirs(parent);
CREATE TABLE IF NOT EXISTS tiers (tier INTEGER PRIMARY KEY, used INTEGER NOT NULL DEFAULT 0);
INSERT OR IGNORE INTO tiers(tier, used) VALUES (0, 0), (1, 0), (2, 0);
CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    file_id INTEGER NOT NULL,
    object TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    owner_pid INTEGER,
    claimed_ns INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS journal_file ON journal(file_id);
CREATE TABLE IF NOT EXISTS publishing (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL,
    replaces TEXT,
    object TEXT NOT NULL,
    size INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    write_type TEXT NOT NULL,
    ttl_ms INTEGER,
    pinned INTEGER,
    owner_pid INTEGER NOT NULL,
    created_ns INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS publishing_path ON publishing(path);
CREATE TABLE IF NOT EXISTS renaming (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    src TEXT NOT NULL,
    dst TEXT NOT NULL,
    ident TEXT,
    owner_pid INTEGER NOT NULL,
    created_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS removing (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL,
    tree INTEGER NOT NULL,
    owner_pid INTEGER NOT NULL,
    created_ns INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS files_usage_insert AFTER INSERT ON files
WHEN NEW.tier IS NOT NULL BEGIN
    UPDATE tiers SET used = used + NEW.size WHERE tier = NEW.tier;
END;
CREATE TRIGGER IF NOT EXISTS files_usage_delete AFTER DELETE ON files
WHEN OLD.tier IS NOT NULL BEGIN
    UPDATE tiers SET used = used - OLD.size WHERE tier = OLD.tier;
END;
CREATE TRIGGER IF NOT EXISTS files_usage_update AFTER UPDATE OF tier, size ON files BEGIN
    UPDATE tiers SET used = used - OLD.size WHERE tier = OLD.tier;
    UPDATE tiers SET used = used + NEW.size WHERE tier = NEW.tier;
END;
"""

_COLUMNS = (
    "id, path, parent, size, checksum, object, tier, pinned, write_type, persistence, in_ufs, "
    "ttl_ms, ttl_action, expires_ns, ctime_ns, mtime_ns, atime_ns"
)


class FileRow(NamedTuple):
    """One file version as the catalog records it (times in ns since the epoch)."""

    id: int
    path: str
    parent: str
    size: int
    checksum: str
    object: str
    tier: int | None
    pinned: int
    write_type: str
    persistence: str
    in_ufs: int
    ttl_ms: int | None
    ttl_action: str
    expires_ns: int | None
    ctime_ns: int
    mtime_ns: int
    atime_ns: int


class JournalEntry(NamedTuple):
    """A pending persist: write version ``object`` of file ``file_id`` to the under-store."""

    seq: int
    file_id: int
    object: str
    owner_pid: int | None
    claimed_ns: int | None
    attempts: int


class Publishing(NamedTuple):
    """An under-store copy about to become version ``object`` of ``path``.

    ``replaces`` is the version the catalog held when it was recorded (None: no file);
    ``pinned`` None keeps the replaced version's pin.  What the catalog records once the
    copy is in place: ``size``, ``checksum``, ``write_type``, ``ttl_ms`` (from
    ``created_ns``)."""

    seq: int
    path: str
    replaces: str | None
    object: str
    size: int
    checksum: str
    write_type: str
    ttl_ms: int | None
    pinned: int | None
    owner_pid: int
    created_ns: int


_PUBLISHING_COLUMNS = ", ".join(Publishing._fields)


class Renaming(NamedTuple):
    """A rename of ``src`` to ``dst`` about to move the under-store copy (a file or tree).

    ``ident`` is what the under-store had at ``src`` when it was recorded (see
    ``UnderStore.identity``; None: nothing).  The record is dropped in the transaction
    that commits the rename, so one still there means the catalog has the file (or tree)
    at ``src``."""

    seq: int
    src: str
    dst: str
    ident: str | None
    owner_pid: int
    created_ns: int


_RENAMING_COLUMNS = ", ".join(Renaming._fields)


class Removing(NamedTuple):
    """Under-store copies to remove: of the file ``path``, or with ``tree`` of the
    directory ``path`` and everything below it, deleted from the catalog."""

    seq: int
    path: str
    tree: int
    owner_pid: int
    created_ns: int


_REMOVING_COLUMNS = ", ".join(Removing._fields)


def descendant_range(path: str) -> tuple[str, str]:
    """Bounds ``(lo, hi)`` with ``lo < p < hi`` exactly for the paths strictly below ``path``."""
    if path == "/":
        return "/", "0"
    return path + "/", path + "0"  # '0' is the character after '/'


def damaged_message(path: Path, err: BaseException) -> str:
    """What to say about a catalog that is not (or no longer) a readable database."""
    return (
        f"the store catalog {path} is damaged ({err}); move it and its -wal "
        "and -shm files away: the store then starts empty "
        "(files in the under-store stay there, but are no longer listed)"
    )


def catalog_error(path: Path, err: sqlite3.Error) -> StoreError:
    """The :class:`StoreError` for an SQLite failure on the catalog at ``path``: which
    file, what happened and what to do, instead of sqlite3's bare message."""
    code = getattr(err, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return StoreUnavailableError(
            f"the store catalog {path} stayed locked for {_BUSY_TIMEOUT_S:g} s ({err}): "
            "another process holds a write transaction on it (a hung adcloud process, or "
            "an sqlite3 shell with a transaction open); end it, then try again"
        )
    if primary == _SQLITE_FULL:
        return StoreFullError(
            f"the store catalog {path} cannot grow ({err}): the file system holding it is "
            f"full; free space in {path.parent} or move the store's metadata elsewhere "
            "(ADCLOUD_STORE_META_DIR); nothing of this operation was recorded"
        )
    if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or type(err) is sqlite3.DatabaseError:
        return StoreCorruptionError(damaged_message(path, err))
    return StoreError(
        f"the store catalog {path}: {err}; check the disk and the permissions of {path.parent}"
    )


def _translated(
    method: Callable[Concatenate[Catalog, P], R],
) -> Callable[Concatenate[Catalog, P], R]:
    """``method`` raising :func:`catalog_error` for the SQLite errors that the disk, other
    processes or a damaged file cause (not for misuse, which stays a bug to see)."""

    @functools.wraps(method)
    def wrapper(self: Catalog, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.errors():
            return method(self, *args, **kwargs)

    return wrapper


class Catalog:
    """The SQLite catalog at ``db_path`` (created on first use, shared across processes).

    Every method raises :class:`StoreError` subclasses that name the catalog file for
    failures of SQLite itself (locked past the timeout, disk full, damaged file)."""

    def __init__(self, db_path: Path) -> None:
        self._path = db_path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._init_schema()
        except StoreError:
            self.close()
            raise
        except sqlite3.OperationalError as err:  # locked past the timeout, unreadable, ...
            self.close()
            raise StoreError(f"cannot open the store catalog {db_path}: {err}") from err
        except sqlite3.DatabaseError as err:  # damaged: "not a database", "malformed"
            self.close()
            raise StoreCorruptionError(damaged_message(db_path, err)) from err

    @property
    def path(self) -> Path:
        """Where the database file is."""
        return self._path

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """Raise :func:`catalog_error` for SQLite failures inside the block."""
        try:
            yield
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as err:
            if isinstance(err, (sqlite3.IntegrityError, sqlite3.ProgrammingError)):
                raise
            raise catalog_error(self._path, err) from err

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA temp_store = MEMORY")
        return conn

    def conn(self) -> sqlite3.Connection:
        """This thread's connection (reopened after ``fork``)."""
        pid = os.getpid()
        local = self._local
        if getattr(local, "pid", None) != pid:
            local.conn = self._connect()
            local.pid = pid
            with self._all_lock:
                self._all.append(local.conn)
        conn: sqlite3.Connection = local.conn
        return conn

    def _init_schema(self) -> None:
        conn = self.conn()
        # small pages: a commit writes every B-tree page it touched to the WAL, and a put
        # touches ~6 of them (a new database only; existing ones keep their page size)
        conn.execute("PRAGMA page_size = 1024")
        deadline = time.monotonic() + 60
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        with self.transaction() as c:
            for statement in _split_script(_SCHEMA):
                c.execute(statement)
            row = c.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                c.execute(
                    "INSERT INTO meta(key, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),)
                )
            elif int(row[0]) in _UPGRADABLE:
                self.set_meta(c, "schema", str(SCHEMA_VERSION))  # the script added the tables
            elif int(row[0]) != SCHEMA_VERSION:
                raise StoreError(
                    f"{self._path}: catalog format {row[0]} is not the supported "
                    f"{SCHEMA_VERSION}; use the adcloud version that wrote it or move the "
                    "store directory away"
                )

    @contextlib.contextmanager
    def transaction(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``); ``durable`` fsyncs the WAL at commit.

        Whatever fails -- the block, or the commit itself (a full disk) -- the transaction
        is rolled back, so this thread's next transaction starts clean."""
        with self.errors():
            conn = self.conn()
            if durable:
                conn.execute("PRAGMA synchronous = FULL")
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    self._roll_back(conn)
                    raise
            finally:
                if durable:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("PRAGMA synchronous = NORMAL")

    def _roll_back(self, conn: sqlite3.Connection) -> None:
        """Roll back ``conn``'s open transaction, if SQLite did not already (it does after
        some errors, and a ROLLBACK then fails and would hide the error); a connection
        that cannot be rolled back is dropped, and the thread gets a new one."""
        if not conn.in_transaction:
            return
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            self._local.pid = None

    def close(self) -> None:
        """Close every connection this process opened."""
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()

    # -- reads -------------------------------------------------------------------------

    @_translated
    def file(self, path: str, conn: sqlite3.Connection | None = None) -> FileRow | None:
        """The file at ``path``, if any (expired ones included)."""
        row = (
            (conn or self.conn())
            .execute(f"SELECT {_COLUMNS} FROM files WHERE path = ?", (path,))
            .fetchone()
        )
        return None if row is None else FileRow(*row)

    @_translated
    def file_by_id(self, file_id: int, conn: sqlite3.Connection | None = None) -> FileRow | None:
        """The file with catalog id ``file_id``, if it still exists."""
        row = (
            (conn or self.conn())
            .execute(f"SELECT {_COLUMNS} FROM files WHERE id = ?", (file_id,))
            .fetchone()
        )
        return None if row is None else FileRow(*row)

    @_translated
    def dir_ctime(self, path: str, conn: sqlite3.Connection | None = None) -> int | None:
        """Creation time of directory ``path`` (0 for the root), ``None`` if it is no directory."""
        if path == "/":
            return 0
        row = (
            (conn or self.conn())
            .execute("SELECT ctime_ns FROM dirs WHERE path = ?", (path,))
            .fetchone()
        )
        return None if row is None else int(row[0])

    @_translated
    def children(
        self, path: str, conn: sqlite3.Connection | None = None
    ) -> tuple[list[FileRow], list[tuple[str, int]]]:
        """Files and directories (path, ctime) directly inside directory ``path``."""
        c = conn or self.conn()
        files = [
            FileRow(*r)
            for r in c.execute(f"SELECT {_COLUMNS} FROM files WHERE parent = ?", (path,))
        ]
        dirs = [
            (r[0], int(r[1]))
            for r in c.execute("SELECT path, ctime_ns FROM dirs WHERE parent = ?", (path,))
        ]
        return files, dirs

    @_translated
    def descendants(
        self, path: str, conn: sqlite3.Connection | None = None
    ) -> tuple[list[FileRow], list[tuple[str, int]]]:
        """Every file and directory strictly below directory ``path``."""
        c = conn or self.conn()
        lo, hi = descendant_range(path)
        files = [
            FileRow(*r)
            for r in c.execute(
                f"SELECT {_COLUMNS} FROM files WHERE path > ? AND path < ?", (lo, hi)
            )
        ]
        dirs = [
            (r[0], int(r[1]))
            for r in c.execute(
                "SELECT path, ctime_ns FROM dirs WHERE path > ? AND path < ?", (lo, hi)
            )
        ]
        return files, dirs

    @_translated
    def has_descendants(self, path: str, conn: sqlite3.Connection | None = None) -> bool:
        """Whether anything lies below ``path``."""
        c = conn or self.conn()
        lo, hi = descendant_range(path)
        for table in ("files", "dirs"):
            hit = c.execute(
                f"SELECT 1 FROM {table} WHERE path > ? AND path < ? LIMIT 1", (lo, hi)
            ).fetchone()
            if hit is not None:
                return True
        return False

    @_translated
    def usage(self, conn: sqlite3.Connection | None = None) -> dict[int, int]:
        """Bytes cached per tier level."""
        rows = (conn or self.conn()).execute("SELECT tier, used FROM tiers").fetchall()
        return {int(t): int(u) for t, u in rows}

    @_translated
    def tier_stats(self) -> dict[int, tuple[int, int, int]]:
        """Per tier level: (files, bytes, pinned bytes)."""
        rows = (
            self.conn()
            .execute(
                "SELECT tier, COUNT(*), COALESCE(SUM(size), 0), "
                "COALESCE(SUM(CASE WHEN pinned THEN size ELSE 0 END), 0) "
                "FROM files WHERE tier IS NOT NULL GROUP BY tier"
            )
            .fetchall()
        )
        return {int(t): (int(n), int(b), int(p)) for t, n, b, p in rows}

    @_translated
    def lru(
        self,
        tier: int,
        *,
        persisted_only: bool,
        exclude: Iterable[int] = (),
        limit: int = 32,
    ) -> list[FileRow]:
        """Least recently used unpinned files of ``tier`` (eviction candidates)."""
        skip = list(exclude)
        sql = f"SELECT {_COLUMNS} FROM files WHERE tier = ? AND pinned = 0"
        params: list[object] = [tier]
        if persisted_only:
            sql += " AND persistence = 'PERSISTED'"
        if skip:
            sql += f" AND id NOT IN ({','.join('?' * len(skip))})"
            params.extend(skip)
        sql += " ORDER BY atime_ns LIMIT ?"
        params.append(limit)
        return [FileRow(*r) for r in self.conn().execute(sql, params)]

    @_translated
    def expired(self, now_ns: int) -> list[FileRow]:
        """Files whose TTL has run out."""
        return [
            FileRow(*r)
            for r in self.conn().execute(
                f"SELECT {_COLUMNS} FROM files WHERE expires_ns IS NOT NULL AND expires_ns <= ?",
                (now_ns,),
            )
        ]

    @_translated
    def cached_rows(self) -> list[FileRow]:
        """Every file that claims a cached copy (used to reconcile after a reboot)."""
        return [
            FileRow(*r)
            for r in self.conn().execute(f"SELECT {_COLUMNS} FROM files WHERE tier IS NOT NULL")
        ]

    @_translated
    def objects_in(self, tier: int) -> set[str]:
        """Object names the catalog places in ``tier``."""
        return {
            r[0] for r in self.conn().execute("SELECT object FROM files WHERE tier = ?", (tier,))
        }

    # -- journal -----------------------------------------------------------------------

    @_translated
    def pending(self, limit: int = 64) -> list[JournalEntry]:
        """Pending persists, oldest first."""
        rows = (
            self.conn()
            .execute(
                "SELECT seq, file_id, object, owner_pid, claimed_ns, attempts FROM journal "
                "ORDER BY seq LIMIT ?",
                (limit,),
            )
            .fetchall()
        )
        return [JournalEntry(*r) for r in rows]

    def pending_entries(self, page: int = 256) -> Iterator[JournalEntry]:
        """Every pending persist, oldest first, read a page at a time."""
        after = 0
        while True:
            with self.errors():
                rows = (
                    self.conn()
                    .execute(
                        "SELECT seq, file_id, object, owner_pid, claimed_ns, attempts "
                        "FROM journal WHERE seq > ? ORDER BY seq LIMIT ?",
                        (after, page),
                    )
                    .fetchall()
                )
            if not rows:
                return
            for row in rows:
                yield JournalEntry(*row)
            after = int(rows[-1][0])

    @_translated
    def journal_size(self) -> int:
        """Number of pending persists."""
        return int(self.conn().execute("SELECT COUNT(*) FROM journal").fetchone()[0])

    @_translated
    def claim(self, entry: JournalEntry, pid: int, now_ns: int) -> bool:
        """Take ``entry`` for process ``pid`` unless someone else took it since it was read."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE journal SET owner_pid = ?, claimed_ns = ?, attempts = attempts + 1 "
                "WHERE seq = ? AND owner_pid IS ? AND claimed_ns IS ?",
                (pid, now_ns, entry.seq, entry.owner_pid, entry.claimed_ns),
            )
            return cur.rowcount == 1

    @_translated
    def release(self, seq: int, error: str) -> None:
        """Give a claimed entry back after a failed attempt, recording why."""
        with self.transaction() as c:
            c.execute(
                "UPDATE journal SET owner_pid = NULL, claimed_ns = NULL, last_error = ? "
                "WHERE seq = ?",
                (error[:500], seq),
            )

    def drop_entries(self, conn: sqlite3.Connection, file_id: int, obj: str | None = None) -> None:
        """Forget pending persists of ``file_id`` (only of version ``obj`` when given)."""
        if obj is None:
            conn.execute("DELETE FROM journal WHERE file_id = ?", (file_id,))
        else:
            conn.execute("DELETE FROM journal WHERE file_id = ? AND object = ?", (file_id, obj))

    # -- under-store copies being published ---------------------------------------------

    @_translated
    def begin_publish(
        self,
        path: str,
        *,
        obj: str,
        size: int,
        checksum: str,
        write_type: str,
        ttl_ms: int | None,
        pinned: bool | None,
        now_ns: int,
    ) -> int:
        """Record (durably) that an under-store copy is about to become version ``obj`` of
        ``path``; returns the record's number for :meth:`end_publish`."""
        with self.transaction(durable=True) as c:
            row = c.execute("SELECT object FROM files WHERE path = ?", (path,)).fetchone()
            cur = c.execute(
                "INSERT INTO publishing(path, replaces, object, size, checksum, write_type, "
                "ttl_ms, pinned, owner_pid, created_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    path,
                    None if row is None else row[0],
                    obj,
                    size,
                    checksum,
                    write_type,
                    ttl_ms,
                    None if pinned is None else int(pinned),
                    os.getpid(),
                    now_ns,
                ),
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

    @staticmethod
    def end_publish(conn: sqlite3.Connection, seq: int) -> bool:
        """Inside a transaction: drop record ``seq``; whether it was still there."""
        return conn.execute("DELETE FROM publishing WHERE seq = ?", (seq,)).rowcount == 1

    @_translated
    def publishing(self, path: str | None = None) -> list[Publishing]:
        """The recorded publishes (of ``path`` only, when given), oldest first."""
        sql = f"SELECT {_PUBLISHING_COLUMNS} FROM publishing"
        params: tuple[str, ...] = ()
        if path is not None:
            sql += " WHERE path = ?"
            params = (path,)
        return [Publishing(*r) for r in self.conn().execute(sql + " ORDER BY seq", params)]

    # -- renames moving under-store copies ----------------------------------------------

    @_translated
    def begin_rename(self, src: str, dst: str, *, ident: str | None, now_ns: int) -> int:
        """Record (durably) that a rename of ``src`` to ``dst`` is about to move the
        under-store copy ``ident``; returns the record's number for :meth:`end_rename`."""
        with self.transaction(durable=True) as c:
            cur = c.execute(
                "INSERT INTO renaming(src, dst, ident, owner_pid, created_ns) "
                "VALUES (?, ?, ?, ?, ?)",
                (src, dst, ident, os.getpid(), now_ns),
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

    @staticmethod
    def end_rename(conn: sqlite3.Connection, seq: int) -> bool:
        """Inside a transaction: drop record ``seq``; whether it was still there."""
        return conn.execute("DELETE FROM renaming WHERE seq = ?", (seq,)).rowcount == 1

    @_translated
    def renaming(self) -> list[Renaming]:
        """The recorded renames, oldest first."""
        sql = f"SELECT {_RENAMING_COLUMNS} FROM renaming ORDER BY seq"
        return [Renaming(*r) for r in self.conn().execute(sql)]

    @_translated
    def has_renaming(self) -> bool:
        """Whether any rename is recorded (one statement on a table that is almost always
        empty)."""
        return self.conn().execute("SELECT 1 FROM renaming LIMIT 1").fetchone() is not None

    # -- under-store copies of deleted files --------------------------------------------

    @staticmethod
    def begin_remove(conn: sqlite3.Connection, path: str, *, tree: bool, now_ns: int) -> int:
        """Inside the transaction that deletes ``path``: record that its under-store copies
        are to be removed; returns the record's number for :meth:`end_remove`."""
        cur = conn.execute(
            "INSERT INTO removing(path, tree, owner_pid, created_ns) VALUES (?, ?, ?, ?)",
            (path, int(tree), os.getpid(), now_ns),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @_translated
    def end_remove(self, seq: int) -> None:
        """Drop record ``seq``: its copies are gone."""
        with self.transaction() as c:
            c.execute("DELETE FROM removing WHERE seq = ?", (seq,))

    @_translated
    def removing(self) -> list[Removing]:
        """The recorded removals, oldest first."""
        sql = f"SELECT {_REMOVING_COLUMNS} FROM removing ORDER BY seq"
        return [Removing(*r) for r in self.conn().execute(sql)]

    # -- writes (inside a transaction) -------------------------------------------------

    @_translated
    def touch(self, accesses: Sequence[tuple[int, int]]) -> None:
        """Record access times ``(ns, file_id)`` (they only move forward)."""
        if not accesses:
            return
        with self.transaction() as c:
            c.executemany(
                "UPDATE files SET atime_ns = MAX(atime_ns, ?) WHERE id = ?", list(accesses)
            )

    @_translated
    def meta(self, key: str) -> str | None:
        """A value of the ``meta`` table."""
        row = self.conn().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
        """Set a value of the ``meta`` table."""
        conn.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )


def _split_script(script: str) -> list[str]:
    """Statements of ``script`` (triggers contain ``;`` inside BEGIN ... END)."""
    out: list[str] = []
    buf: list[str] = []
    in_trigger = False
    for line in script.strip().splitlines():
        buf.append(line)
        stripped = line.strip().upper()
        if stripped.startswith("CREATE TRIGGER"):
            in_trigger = True
        if (in_trigger and stripped == "END;") or (not in_trigger and stripped.endswith(";")):
            out.append("\n".join(buf))
            buf = []
            in_trigger = False
    if buf:
        out.append("\n".join(buf))
    return out
