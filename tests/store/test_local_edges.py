"""Edge cases of the local tiered store and its under-store: positioned reads, names at
the length limit, TTL actions racing the persister, deletes racing writers, and catalog
errors met while the store is open."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest

from adcloud.store import (
    PersistenceState,
    StoreCorruptionError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    WriteType,
    _catalog,
)
from adcloud.store.filesystem import StoreFileSystem
from tests.store.conftest import MakeStore


def test_read_range_returns_the_bytes_it_read_without_another_copy(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range came back as a bytearray, which ``StoreFileSystem.cat_file`` then copied
    into bytes: every range of a bag was copied twice on its way to the reader."""
    store = make_store(promote_on_read=False)
    data = os.urandom(10_000)
    store.put("/r", data, write_type=WriteType.CACHE_THROUGH)
    got = store.read_range("/r", 123, 4_000)
    assert type(got) is bytes and got == data[123:4123]
    assert store.read_range("/r", 9_000, 1 << 40) == data[9_000:]  # no terabyte allocated
    returned: list[bytes] = []
    read_range = store.read_range

    def spy(path: str, offset: int, length: int) -> bytes:
        returned.append(read_range(path, offset, length))
        return returned[-1]

    monkeypatch.setattr(store, "read_range", spy)
    fs = StoreFileSystem.over(store)
    try:
        out = fs.cat_file("/r", start=10, end=5_010)
    finally:
        fs.close()
    assert out == data[10:5010] and out is returned[0]
    store.free("/r")  # from the under-store too
    got = store.read_range("/r", 5, 20)
    assert type(got) is bytes and got == data[5:25]


def test_read_range_reads_on_after_a_short_read(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux returns at most 2 GiB - 4 KiB per read: a short read is followed by more."""
    store = make_store(promote_on_read=False)
    data = os.urandom(5_000)
    store.put("/r", data, write_type=WriteType.MUST_CACHE)
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: pread(fd, min(n, 700), off))
    assert store.read_range("/r", 100, 4_000) == data[100:4100]


@pytest.mark.parametrize("write_type", [WriteType.ASYNC_THROUGH, WriteType.THROUGH])
def test_a_name_at_the_length_limit_is_persisted(
    make_store: MakeStore, store_root: Path, write_type: WriteType
) -> None:
    """Store paths allow segments of 255 bytes, but the under-store's staging file added
    its tag to the name: past ~220 bytes every persist failed with ENAMETOOLONG and an
    ASYNC_THROUGH file was retried forever, never persisted."""
    store = make_store()
    name = "é" * 120 + ".bin"  # 244 bytes
    path = f"/long dir/{name}"
    store.put(path, b"payload", write_type=write_type)
    store.flush(timeout=10)
    status = store.stat(path)
    assert status.persistence is PersistenceState.PERSISTED
    assert (store_root / "ufs" / "long dir" / name).read_bytes() == b"payload"
    assert [p.name for p in (store_root / "ufs" / "long dir").iterdir()] == [name]
    store.free(path)
    assert store.get(path) == b"payload"


def test_a_ttl_free_waits_for_the_pending_persist(make_store: MakeStore) -> None:
    """An ASYNC_THROUGH file whose FREE TTL ran out before its persist lost the TTL and
    stayed cached for good once persisted."""
    store = make_store()
    store.put("/a", b"x" * 100, write_type=WriteType.ASYNC_THROUGH)
    store.set_ttl("/a", 0, action="FREE")
    store._sweep()  # the sweep comes before the persister got to the file
    status = store.stat("/a")
    assert status.tier == "MEM" and status.ttl == 0
    store.maintain()  # persists, then expires
    status = store.stat("/a")
    assert status.persistence is PersistenceState.PERSISTED
    assert status.tier is None and status.ttl is None
    assert store.get("/a") == b"x" * 100


def test_a_ttl_delete_removes_the_copies_made_after_the_sweep_read_the_file(
    make_store: MakeStore, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep deleted the file as it had read it: a copy persisted or moved down a tier
    in between stayed behind, in the under-store and in the tier, listed nowhere."""
    store = make_store(mem_capacity="4KB", ssd_capacity="8KB", hdd_capacity="0")
    store.put("/t/moved", b"m" * 1500, write_type=WriteType.MUST_CACHE)
    store.put("/t/persisted", b"p" * 1500, write_type=WriteType.ASYNC_THROUGH)
    store.set_ttl("/t", 0)
    expired = store._cat.expired

    def racing(now_ns: int) -> list[_catalog.FileRow]:
        rows = expired(now_ns)
        [pending] = [r for r in rows if r.path == "/t/persisted"]
        store._persist_version(pending.id, pending.object)  # the persister, meanwhile
        store.put("/churn", b"c" * 3000, write_type=WriteType.MUST_CACHE)  # evicts /t/moved
        return rows

    monkeypatch.setattr(store._cat, "expired", racing)
    store._sweep()
    assert not store.exists("/t/moved") and not store.exists("/t/persisted")
    churn = store._cat.file("/churn")
    assert churn is not None
    left = [p for t in ("mem", "ssd") for p in (store_root / t / "objects").rglob("*")]
    assert [p.name for p in left if p.is_file()] == [churn.object]
    assert list((store_root / "ufs" / "t").iterdir()) == []


def test_a_file_written_through_while_its_path_was_deleted_keeps_its_bytes(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete removed the under-store copy after the catalog row: a THROUGH write of the
    same path in between lost its bytes (listed, but unreadable)."""
    store = make_store()
    for path in ("/f", "/tree/a", "/tree/b"):
        store.put(path, b"old", write_type=WriteType.THROUGH)
    delete_rows = store._delete_rows

    def racing(key: str, recursive: bool, durable: bool) -> object:
        out = delete_rows(key, recursive, durable)
        again = "/tree/b" if key == "/tree" else key
        store.put(again, b"new", write_type=WriteType.THROUGH)  # another writer, meanwhile
        return out

    monkeypatch.setattr(store, "_delete_rows", racing)
    store.delete("/f")
    store.delete("/tree", recursive=True)
    assert store.get("/f") == b"new" and store.get("/tree/b") == b"new"
    assert not store.exists("/tree/a")
    store.free("/f")
    store.free("/tree/b")  # read back from the under-store
    assert store.get("/f") == b"new" and store.get("/tree/b") == b"new"


def test_a_catalog_locked_past_the_timeout_is_an_error_naming_it(
    make_store: MakeStore, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding a write transaction on the catalog (an sqlite3 shell, a
    hung process) failed every write with sqlite3's bare "database is locked"."""
    monkeypatch.setattr(_catalog, "_BUSY_TIMEOUT_S", 0.2)
    store = make_store()
    store.put("/a", b"x", write_type=WriteType.MUST_CACHE)
    catalog = store_root / "catalog.sqlite"
    blocker = sqlite3.connect(catalog, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailableError, match=f"catalog {catalog} stayed locked"):
            store.put("/b", b"y", write_type=WriteType.MUST_CACHE)
        with pytest.raises(StoreUnavailableError, match="end it, then try again"):
            store.delete("/a")
        assert store.get("/a") == b"x"  # reads go on meanwhile
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert list((store_root / "mem" / "tmp").iterdir()) == []  # the staged copy went
    store.put("/b", b"y", write_type=WriteType.MUST_CACHE)
    assert store.get("/b") == b"y"


def test_a_full_disk_under_the_catalog_is_an_error_and_the_next_write_works(
    make_store: MakeStore, store_root: Path
) -> None:
    """ "database or disk is full" came as sqlite3's bare error, naming nothing."""
    store = make_store()
    store.put("/a", b"x", write_type=WriteType.MUST_CACHE)
    conn = store._cat.conn()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here on
    catalog = store_root / "catalog.sqlite"
    with pytest.raises(StoreFullError, match=f"catalog {catalog} cannot grow"):
        for i in range(200):
            store.put(f"/d{i}/" + "n" * 200, b"y", write_type=WriteType.ASYNC_THROUGH)
    conn.execute("PRAGMA max_page_count = 1000000000")  # space freed
    store.put("/b", b"z", write_type=WriteType.MUST_CACHE)
    assert store.get("/b") == b"z" and store.get("/a") == b"x"


class _FailingCommit:
    """A catalog connection whose next COMMIT fails as on a disk gone bad."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.armed = True

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql == "COMMIT" and self.armed:
            self.armed = False
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)


def test_a_failed_commit_leaves_no_transaction_open(
    make_store: MakeStore, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A COMMIT that failed left the thread's connection inside the transaction: every
    later operation of that thread failed with "cannot start a transaction within a
    transaction", and its write lock blocked every other process."""
    store = make_store()
    store.put("/a", b"x", write_type=WriteType.MUST_CACHE)
    connect = store._cat._connect
    failing: list[_FailingCommit] = []

    def wrapped() -> sqlite3.Connection:
        failing.append(_FailingCommit(connect()))
        return failing[-1]  # type: ignore[return-value]

    monkeypatch.setattr(store._cat, "_connect", wrapped)
    store._cat._local = threading.local()  # this thread connects again
    with pytest.raises(StoreError, match=f"catalog {store_root / 'catalog.sqlite'}: disk I/O"):
        store.put("/b", b"y", write_type=WriteType.MUST_CACHE)
    assert not store.exists("/b")
    store.put("/b", b"y", write_type=WriteType.MUST_CACHE)
    assert store.get("/b") == b"y"
    other = sqlite3.connect(store_root / "catalog.sqlite", isolation_level=None, timeout=1)
    try:
        other.execute("BEGIN IMMEDIATE")  # no write lock left behind
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_a_catalog_damaged_while_open_is_an_error_naming_it(
    make_store: MakeStore, store_root: Path
) -> None:
    store = make_store()
    store.put("/a", b"x", write_type=WriteType.MUST_CACHE)
    store.close()
    catalog = store_root / "catalog.sqlite"
    with sqlite3.connect(catalog) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store = make_store()
    assert store.exists("/a")
    data = bytearray(catalog.read_bytes())
    data[1024:] = b"\xa5" * (len(data) - 1024)  # every page past the first
    catalog.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptionError, match=f"catalog {catalog} is damaged"):
        for i in range(3):
            store.stat("/a")
            store.put(f"/x{i}", b"y", write_type=WriteType.MUST_CACHE)


def test_a_version_persisted_while_the_old_one_is_read_from_the_under_store_is_no_corruption(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get of a file held only by the under-store read the catalog, then the file; a new
    version persisted in between replaced the file there, and the get reported the
    store corrupt (size and CRC-32 of the new bytes against the old row)."""
    store = make_store(promote_on_read=False)
    store.put("/a", b"old" * 100, write_type=WriteType.CACHE_THROUGH)
    store.free("/a")
    open_copy = store._open_ufs_copy
    raced: list[str] = []

    def racing(row: _catalog.FileRow) -> object:
        if not raced:
            raced.append(row.path)
            store.put("/a", b"new!" * 100, write_type=WriteType.CACHE_THROUGH)
        return open_copy(row)

    monkeypatch.setattr(store, "_open_ufs_copy", racing)
    assert store.get("/a") == b"new!" * 100
    assert raced == ["/a"]


def test_a_stream_rewound_to_its_start_is_still_verified(
    make_store: MakeStore, store_root: Path
) -> None:
    """Any seek switched the stream's CRC-32 check off, a seek back to the start too
    (readers that rewind before or after peeking at a header): damaged bytes were read
    without an error."""
    store = make_store(mem_capacity="0")  # SSD: verified by default
    data = bytes(range(256)) * (12 << 10)  # 3 MiB: past the stream's buffer
    store.put("/ckpt.pt", data, write_type=WriteType.MUST_CACHE)
    (obj,) = [p for p in (store_root / "ssd/objects").rglob("*") if p.is_file()]
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF
    obj.write_bytes(damaged)
    for peek in (0, 2 << 20):
        with store.open("/ckpt.pt") as stream:
            assert len(stream.read(peek)) == peek
            stream.seek(0)
            with pytest.raises(StoreCorruptionError, match=r"/ckpt\.pt: read"):
                stream.read()
    with store.open("/ckpt.pt") as stream:  # random access: the size is still checked
        stream.seek(100)
        assert stream.read() == damaged[100:]
