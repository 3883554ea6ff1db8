"""Races of the local store with real processes and threads: a THROUGH overwrite killed
between the under-store and the catalog, reads of the under-store while another process
replaces the file, and pins racing eviction and TTL actions."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from adcloud.store import LocalStore, PersistenceState, StoreError, WriteType, _catalog
from tests.store._worker import check_payload, payload
from tests.store.conftest import (
    MakeStore,
    catalog_rows,
    kill_worker,
    start_worker,
    wait_for_line,
)


@pytest.mark.parametrize("old_type", [WriteType.THROUGH, WriteType.CACHE_THROUGH])
def test_a_through_overwrite_killed_after_its_copy_replaced_the_old_one_is_finished(
    store_root: Path, old_type: WriteType
) -> None:
    """A THROUGH overwrite moves its copy over the under-store file, then commits the row:
    a writer killed in between left the old row describing bytes that were gone, and every
    read of the file failed as corrupt, for good."""
    store = LocalStore("local://", background=False, promote_on_read=False)
    store.put("/ckpt/m.bin", payload(1, 3000), write_type=old_type)
    proc = start_worker("through-stalled", "/ckpt/m.bin", "4000", "2", "after")
    wait_for_line(proc, "stalled")
    kill_worker(proc)
    try:
        ufs = store_root / "ufs/ckpt/m.bin"
        assert ufs.read_bytes() == payload(2, 4000)  # the copy was in place
        if old_type is WriteType.THROUGH:
            # a process that was open all along reads the finished version
            assert store.get("/ckpt/m.bin") == payload(2, 4000)
        store.maintain()
        status = store.stat("/ckpt/m.bin")
        assert (status.size, status.tier) == (len(payload(2, 4000)), None)
        assert status.persistence is PersistenceState.PERSISTED
        assert status.write_type is WriteType.THROUGH
        assert store.get("/ckpt/m.bin") == payload(2, 4000)
        with store.open("/ckpt/m.bin") as stream:
            assert stream.read() == payload(2, 4000)
        assert store.read_range("/ckpt/m.bin", 8, 4) == (4000).to_bytes(4, "little")
        # the old version's cached copy went with its row
        assert [t.used for t in store.usage()] == [0, 0, 0]
        assert [p for p in (store_root / "mem/objects").rglob("*") if p.is_file()] == []
        assert catalog_rows(store_root, "publishing") == 0
    finally:
        store.close()


def test_a_through_overwrite_killed_before_its_copy_moved_keeps_the_old_version(
    store_root: Path,
) -> None:
    store = LocalStore("local://", background=False)
    store.put("/ckpt/m.bin", payload(1, 3000), write_type=WriteType.THROUGH)
    store.close()
    proc = start_worker("through-stalled", "/ckpt/m.bin", "4000", "2", "before")
    wait_for_line(proc, "stalled")
    kill_worker(proc)
    assert catalog_rows(store_root, "publishing") == 1
    store = LocalStore("local://", background=False)  # a restart cleans up after it
    try:
        assert catalog_rows(store_root, "publishing") == 0
        assert store.get("/ckpt/m.bin") == payload(1, 3000)
        assert store.stat("/ckpt/m.bin").size == len(payload(1, 3000))
        assert [p.name for p in (store_root / "ufs/ckpt").iterdir()] == ["m.bin"]
    finally:
        store.close()


def test_a_newer_cached_version_is_not_replaced_by_a_dead_writers_copy(
    store_root: Path,
) -> None:
    """The record of a write killed after its copy moved is dropped, not finished, when
    the file was written again (cached only) since: the newer version stays."""
    store = LocalStore("local://", background=False)
    store.put("/m.bin", payload(1, 3000), write_type=WriteType.THROUGH)
    proc = start_worker("through-stalled", "/m.bin", "4000", "2", "after")
    wait_for_line(proc, "stalled")
    kill_worker(proc)
    try:
        store.put("/m.bin", payload(3, 5000), write_type=WriteType.MUST_CACHE)
        store.maintain()
        assert catalog_rows(store_root, "publishing") == 0
        assert store.get("/m.bin") == payload(3, 5000)
        assert store.stat("/m.bin").persistence is PersistenceState.NOT_PERSISTED
    finally:
        store.close()


def test_a_catalog_of_format_1_is_upgraded(store_root: Path) -> None:
    LocalStore("local://", background=False).close()
    with sqlite3.connect(store_root / "catalog.sqlite") as db:
        db.execute("DROP TABLE publishing")
        db.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")
    with LocalStore("local://", background=False) as store:
        store.put("/a", b"x", write_type=WriteType.THROUGH)
        assert store.get("/a") == b"x"
    with sqlite3.connect(store_root / "catalog.sqlite") as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    assert row == (str(_catalog.SCHEMA_VERSION),)


def test_reads_from_the_under_store_while_another_process_overwrites_the_file(
    store_root: Path,
) -> None:
    """A read opened the under-store file between the writer moving its new copy into
    place and committing its row: it read the new bytes against the old row, and a
    stream (or a get) reported the store corrupt, most of the time under steady writes."""
    store = LocalStore("local://", background=False, promote_on_read=False)
    store.put("/f.bin", payload(0, 256 << 10), write_type=WriteType.THROUGH)
    proc = start_worker("through-writer", "/f.bin", str(256 << 10), "4")
    reads = 0
    try:
        wait_for_line(proc, "writing")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if reads % 2:
                data = store.get("/f.bin")
            else:
                with store.open("/f.bin") as stream:
                    data = b"".join(iter(lambda: stream.read(64 << 10), b""))
            assert check_payload(data) is None
            reads += 1
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert int(out.split()[-1]) > 5  # the file was replaced many times meanwhile
    finally:
        if proc.poll() is None:
            kill_worker(proc)
        store.close()
    assert reads > 20


def test_eviction_never_moves_a_file_pinned_after_it_was_chosen(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eviction picked its victims from the least recently used unpinned files, then
    moved or dropped them: a file pinned in between (another process) was evicted."""
    store = make_store(mem_capacity="4KB", ssd_capacity="0", hdd_capacity="0")
    store.put("/keep", b"k" * 3000, write_type=WriteType.CACHE_THROUGH)
    lru = store._cat.lru

    def pinned_meanwhile(tier: int, **kwargs: object) -> list[_catalog.FileRow]:
        rows = lru(tier, **kwargs)  # type: ignore[arg-type]
        store.pin("/keep")
        return rows

    monkeypatch.setattr(store._cat, "lru", pinned_meanwhile)
    with pytest.raises(StoreError, match="cannot place /new"):
        store.put("/new", b"n" * 3000, write_type=WriteType.MUST_CACHE)
    status = store.stat("/keep")
    assert status.pinned and status.tier == "MEM"


def test_a_ttl_free_leaves_a_file_pinned_or_given_a_new_ttl_meanwhile(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FREE action acted on the row the sweep had read: a file pinned since was freed,
    and a TTL set since was cleared."""
    store = make_store()
    store.put("/p", b"p" * 100, write_type=WriteType.CACHE_THROUGH)
    store.put("/t", b"t" * 100, write_type=WriteType.CACHE_THROUGH)
    store.set_ttl("/p", 0, action="FREE")
    store.set_ttl("/t", 0, action="FREE")
    expired = store._cat.expired

    def changed_meanwhile(now_ns: int) -> list[_catalog.FileRow]:
        rows = expired(now_ns)
        store.pin("/p")
        store.set_ttl("/t", 3600, action="FREE")
        return rows

    monkeypatch.setattr(store._cat, "expired", changed_meanwhile)
    store._sweep()
    assert store.stat("/p").tier == "MEM" and store.stat("/p").pinned
    status = store.stat("/t")
    assert status.tier == "MEM" and status.ttl == 3600
