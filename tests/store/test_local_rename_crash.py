"""Renames of the local store killed between moving the under-store copy and committing
the catalog change: the catalog and the under-store must agree again (the rename rolled
back) for the next reader, writer or process."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from adcloud.store import LocalStore, StoreError, StoreNotFoundError, WriteType, _catalog
from tests.store._worker import payload
from tests.store.conftest import catalog_rows, kill_worker, start_worker, wait_for_line


def _killed_rename(src: str, dst: str, when: str) -> None:
    proc = start_worker("rename-stalled", src, dst, when)
    wait_for_line(proc, "stalled")
    kill_worker(proc)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_file_rename_killed_before_it_committed_leaves_the_file_readable(
    store_root: Path, when: str
) -> None:
    """The under-store copy moved inside the catalog transaction: a process killed after
    the move left the catalog listing /a while the under-store had /b, and every read of
    /a failed ("not in the under-store"), for good."""
    store = LocalStore("local://", background=False, promote_on_read=False)
    store.put("/ckpt/a.bin", payload(1, 3000), write_type=WriteType.THROUGH)
    _killed_rename("/ckpt/a.bin", "/ckpt/b.bin", when)
    try:
        # a process that was open all along reads the file where the catalog has it
        assert store.get("/ckpt/a.bin") == payload(1, 3000)
        with store.open("/ckpt/a.bin") as stream:
            assert stream.read() == payload(1, 3000)
        assert store.read_range("/ckpt/a.bin", 8, 4) == (3000).to_bytes(4, "little")
        assert not store.exists("/ckpt/b.bin")
        assert sorted(p.name for p in (store_root / "ufs/ckpt").iterdir()) == ["a.bin"]
        assert catalog_rows(store_root, "renaming") == 0
        store.rename("/ckpt/a.bin", "/ckpt/b.bin")  # and the rename can be done again
        assert store.get("/ckpt/b.bin") == payload(1, 3000)
        assert sorted(p.name for p in (store_root / "ufs/ckpt").iterdir()) == ["b.bin"]
    finally:
        store.close()


def test_a_directory_rename_killed_after_the_move_is_rolled_back_by_the_next_process(
    store_root: Path,
) -> None:
    store = LocalStore("local://", background=False)
    store.put("/run/x.bin", payload(1, 2000), write_type=WriteType.THROUGH)
    store.put("/run/sub/y.bin", payload(2, 1000), write_type=WriteType.THROUGH)
    store.put("/run/z.bin", payload(3, 500), write_type=WriteType.MUST_CACHE)
    store.close()
    _killed_rename("/run", "/done", "after")
    assert (store_root / "ufs/done/x.bin").exists()  # the tree had moved
    assert catalog_rows(store_root, "renaming") == 1
    store = LocalStore("local://", background=False)  # opening the store rolls it back
    try:
        assert catalog_rows(store_root, "renaming") == 0
        assert not (store_root / "ufs/done").exists()
        assert store.get("/run/x.bin") == payload(1, 2000)
        assert store.get("/run/sub/y.bin") == payload(2, 1000)
        assert store.get("/run/z.bin") == payload(3, 500)
        assert not store.exists("/done")
    finally:
        store.close()


def test_a_through_write_to_the_target_of_a_killed_rename_does_not_take_its_bytes(
    store_root: Path,
) -> None:
    """After the kill, the under-store copy of /a sat at /b: a THROUGH write of /b
    replaced it, and /a's bytes were gone."""
    store = LocalStore("local://", background=False, promote_on_read=False)
    store.put("/a", payload(1, 3000), write_type=WriteType.THROUGH)
    _killed_rename("/a", "/b", "after")
    try:
        store.put("/b", payload(2, 4000), write_type=WriteType.THROUGH)
        assert store.get("/b") == payload(2, 4000)
        assert store.get("/a") == payload(1, 3000)
        assert catalog_rows(store_root, "renaming") == 0
    finally:
        store.close()


def test_a_delete_of_a_file_whose_rename_was_killed_removes_its_copy(store_root: Path) -> None:
    store = LocalStore("local://", background=False)
    store.put("/a", payload(1, 3000), write_type=WriteType.THROUGH)
    _killed_rename("/a", "/b", "after")
    try:
        store.delete("/a")
        assert not store.exists("/a")
        assert [p.name for p in (store_root / "ufs").iterdir() if not p.name.startswith(".")] == []
    finally:
        store.close()


def test_a_rename_whose_commit_fails_after_the_move_is_undone(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog transaction rolled back but the under-store copy stayed moved."""
    store = LocalStore("local://", background=False)
    store.put("/a", payload(1, 3000), write_type=WriteType.THROUGH)

    def failing(conn: sqlite3.Connection, seq: int) -> bool:
        raise StoreError("the catalog cannot grow (simulated)")

    monkeypatch.setattr(_catalog.Catalog, "end_rename", staticmethod(failing))
    try:
        with pytest.raises(StoreError, match="simulated"):
            store.rename("/a", "/b")
        monkeypatch.undo()
        assert store.get("/a") == payload(1, 3000)
        with pytest.raises(StoreNotFoundError):
            store.stat("/b")
        assert (store_root / "ufs/a").exists() and not (store_root / "ufs/b").exists()
        assert catalog_rows(store_root, "renaming") == 0
    finally:
        store.close()


def _removing(store_root: Path) -> int:
    with sqlite3.connect(store_root / "catalog.sqlite") as db:
        return int(db.execute("SELECT COUNT(*) FROM removing").fetchone()[0])


def test_a_delete_killed_before_removing_the_under_store_copy_is_finished(
    store_root: Path,
) -> None:
    """The catalog row went first, the under-store copy after: a process killed in
    between left the copy there for good, unlisted."""
    with LocalStore("local://", background=False) as store:
        store.put("/f.bin", payload(1, 3000), write_type=WriteType.THROUGH)
    proc = start_worker("delete-stalled", "/f.bin", "file")
    wait_for_line(proc, "stalled")
    kill_worker(proc)
    assert (store_root / "ufs/f.bin").exists()
    with LocalStore("local://", background=False) as store:
        assert not (store_root / "ufs/f.bin").exists()
        assert not store.exists("/f.bin")
        assert _removing(store_root) == 0


def test_a_tree_delete_killed_before_the_under_store_leaves_no_tree_to_block_a_rename(
    store_root: Path,
) -> None:
    """The deleted tree stayed in the under-store: renaming another directory to its name
    then failed ("Directory not empty") however often it was tried."""
    store = LocalStore("local://", background=False)
    store.put("/d/x.bin", payload(1, 2000), write_type=WriteType.THROUGH)
    store.put("/d/sub/y.bin", payload(2, 1000), write_type=WriteType.THROUGH)
    store.put("/g/z.bin", payload(3, 500), write_type=WriteType.THROUGH)
    proc = start_worker("delete-stalled", "/d", "recursive")
    wait_for_line(proc, "stalled")
    kill_worker(proc)
    try:
        assert not store.exists("/d")
        store.maintain()  # a process that was open all along finishes it
        assert not (store_root / "ufs/d").exists()
        assert _removing(store_root) == 0
        store.rename("/g", "/d")
        assert store.get("/d/z.bin") == payload(3, 500)
        assert sorted(p.name for p in (store_root / "ufs/d").iterdir()) == ["z.bin"]
    finally:
        store.close()


def test_a_delete_killed_does_not_remove_a_copy_written_there_since(store_root: Path) -> None:
    store = LocalStore("local://", background=False)
    store.put("/f.bin", payload(1, 3000), write_type=WriteType.THROUGH)
    proc = start_worker("delete-stalled", "/f.bin", "file")
    wait_for_line(proc, "stalled")
    kill_worker(proc)
    try:
        store.put("/f.bin", payload(2, 4000), write_type=WriteType.THROUGH)
        store.maintain()
        assert _removing(store_root) == 0
        assert store.get("/f.bin") == payload(2, 4000)
        assert (store_root / "ufs/f.bin").read_bytes() == payload(2, 4000)
    finally:
        store.close()
