"""The local tiered store: placement, eviction, promotion, pinning, TTL, write types,
checksums and recovery, with tiny capacities so every rule is exercised."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from adcloud.store import (
    LocalStore,
    PersistenceState,
    StoreCorruptionError,
    StoreDataLostError,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
    StorePreconditionError,
    StoreSettings,
    WriteType,
    _tiers,
)
from tests.store.conftest import MakeStore

KB = 1000


def tiers(store: LocalStore, *paths: str) -> list[str | None]:
    return [store.stat(p).tier for p in paths]


def used(store: LocalStore) -> dict[str, int]:
    return {t.name: t.used for t in store.usage()}


def blob(tag: int, size: int = 1500) -> bytes:
    return bytes([tag % 256]) * size


SMALL = {"mem_capacity": "4KB", "ssd_capacity": "8KB", "hdd_capacity": "64KB"}


def test_new_data_goes_to_mem(make_store: MakeStore, store_root: Path) -> None:
    store = make_store(**SMALL)
    store.put("/a", blob(1), write_type=WriteType.MUST_CACHE)
    assert tiers(store, "/a") == ["MEM"]
    assert used(store) == {"MEM": 1500, "SSD": 0, "HDD": 0}
    objects = list((store_root / "mem" / "objects").rglob("*"))
    assert sum(p.stat().st_size for p in objects if p.is_file()) == 1500


def test_lru_evicts_down_one_tier(make_store: MakeStore) -> None:
    store = make_store(**SMALL)
    store.put("/a", blob(1), write_type=WriteType.MUST_CACHE)
    store.put("/b", blob(2), write_type=WriteType.MUST_CACHE)
    store.get("/a")  # /b is now the least recently used
    store.put("/c", blob(3), write_type=WriteType.MUST_CACHE)
    assert tiers(store, "/a", "/b", "/c") == ["MEM", "SSD", "MEM"]
    assert used(store) == {"MEM": 3000, "SSD": 1500, "HDD": 0}
    for i, p in enumerate(["/a", "/b", "/c"], start=1):
        assert store.get(p) == blob(i)


def test_eviction_cascades_to_the_last_tier(make_store: MakeStore) -> None:
    store = make_store(**SMALL, promote_on_read=False)
    for i in range(10):
        store.put(f"/f{i}", blob(i), write_type=WriteType.MUST_CACHE)
    placed = tiers(store, *(f"/f{i}" for i in range(10)))
    assert placed == ["HDD"] * 3 + ["SSD"] * 5 + ["MEM"] * 2
    assert used(store) == {"MEM": 3000, "SSD": 7500, "HDD": 4500}
    for i in range(10):
        assert store.get(f"/f{i}") == blob(i)


def test_reads_promote_to_mem(make_store: MakeStore) -> None:
    store = make_store(**SMALL)
    for i in range(5):
        store.put(f"/f{i}", blob(i), write_type=WriteType.MUST_CACHE)
    assert tiers(store, "/f0") == ["SSD"]
    assert store.get("/f0") == blob(0)
    assert tiers(store, "/f0") == ["MEM"]
    # the stream path promotes too
    assert tiers(store, "/f1") == ["SSD"]
    with store.open("/f1") as stream:
        assert stream.read() == blob(1)
    assert tiers(store, "/f1") == ["MEM"]
    assert used(store)["MEM"] <= 4 * KB
    assert sum(used(store).values()) == 5 * 1500


def test_promotion_can_be_switched_off(make_store: MakeStore) -> None:
    store = make_store(**SMALL, promote_on_read=False)
    for i in range(3):
        store.put(f"/f{i}", blob(i), write_type=WriteType.MUST_CACHE)
    store.get("/f0")
    assert tiers(store, "/f0") == ["SSD"]


def test_pinned_data_survives_pressure(make_store: MakeStore) -> None:
    store = make_store(**SMALL)
    store.put("/pinned", blob(9), write_type=WriteType.MUST_CACHE, pinned=True)
    for i in range(20):
        store.put(f"/churn/{i}", blob(i), write_type=WriteType.CACHE_THROUGH)
    assert tiers(store, "/pinned") == ["MEM"]
    assert store.stat("/pinned").pinned
    assert store.get("/pinned") == blob(9)
    # the rest stays within capacity: the oldest persisted files left the cache entirely
    usage = used(store)
    assert usage["MEM"] <= 4 * KB and usage["SSD"] <= 8 * KB and usage["HDD"] <= 64 * KB
    # unpin: now it can go
    store.unpin("/pinned")
    for i in range(20, 30):
        store.put(f"/churn/{i}", blob(i), write_type=WriteType.CACHE_THROUGH)
    assert tiers(store, "/pinned") != ["MEM"]
    assert store.get("/pinned") == blob(9)


def test_pin_keeps_its_flag_across_overwrites(make_store: MakeStore) -> None:
    store = make_store()
    store.put("/p", b"1", pinned=True)
    store.put("/p", b"2")
    assert store.stat("/p").pinned
    store.put("/p", b"3", pinned=False)
    assert not store.stat("/p").pinned


def test_full_of_pinned_data_is_a_clear_error(make_store: MakeStore, store_root: Path) -> None:
    store = make_store(mem_capacity="4KB", ssd_capacity="0", hdd_capacity="0")
    store.put("/p1", blob(1), pinned=True, write_type=WriteType.MUST_CACHE)
    store.put("/p2", blob(2), pinned=True, write_type=WriteType.MUST_CACHE)
    with pytest.raises(StoreFullError) as info:
        store.put("/p3", blob(3), write_type=WriteType.MUST_CACHE)
    message = str(info.value)
    assert "MEM" in message and "pinned" in message and "ADCLOUD_STORE_MEM_CAPACITY" in message
    assert store.get("/p1") == blob(1) and store.get("/p2") == blob(2)
    assert not store.exists("/p3")
    assert used(store) == {"MEM": 3000}
    assert list((store_root / "mem" / "tmp").iterdir()) == []
    # a file no tier could ever hold says so, not that the tiers are full of pinned data
    with pytest.raises(StoreFullError, match=r"larger than the largest tier \(3\.9 KiB\)"):
        store.put("/huge", bytes(8000), write_type=WriteType.MUST_CACHE)


def test_replacing_a_file_that_only_fits_once_says_the_old_version_holds_the_space(
    make_store: MakeStore,
) -> None:
    store = make_store(mem_capacity="4KB", ssd_capacity="0", hdd_capacity="0")
    store.put("/m", bytes(2500), write_type=WriteType.MUST_CACHE)
    with pytest.raises(StoreFullError, match=r"the version of /m being replaced holds 2\.4 KiB"):
        store.put("/m", bytes(2500), write_type=WriteType.MUST_CACHE)
    assert store.get("/m") == bytes(2500)  # the old version stays whole
    with pytest.raises(StoreFullError) as info:  # another file: no such words
        store.put("/n", bytes(2500), write_type=WriteType.MUST_CACHE)
    assert "being replaced" not in str(info.value)


def test_unpersisted_data_never_leaves_the_last_tier(make_store: MakeStore) -> None:
    store = make_store(mem_capacity="4KB", ssd_capacity="0", hdd_capacity="0")
    store.put("/m1", blob(1), write_type=WriteType.MUST_CACHE)
    store.put("/m2", blob(2), write_type=WriteType.MUST_CACHE)
    with pytest.raises(StoreFullError):
        store.put("/m3", blob(3), write_type=WriteType.MUST_CACHE)
    assert store.get("/m1") == blob(1) and store.get("/m2") == blob(2)


def test_persisted_data_is_dropped_from_the_last_tier(make_store: MakeStore) -> None:
    store = make_store(mem_capacity="4KB", ssd_capacity="0", hdd_capacity="0")
    store.put("/c1", blob(1), write_type=WriteType.CACHE_THROUGH)
    store.put("/c2", blob(2), write_type=WriteType.CACHE_THROUGH)
    store.put("/c3", blob(3), write_type=WriteType.CACHE_THROUGH)
    assert tiers(store, "/c1", "/c2", "/c3") == [None, "MEM", "MEM"]
    status = store.stat("/c1")
    assert status.persistence is PersistenceState.PERSISTED
    assert store.get("/c1") == blob(1)  # from the under-store, cached again
    assert tiers(store, "/c1") == ["MEM"]


def test_data_larger_than_mem_goes_to_a_lower_tier(make_store: MakeStore) -> None:
    store = make_store(**SMALL)
    store.put("/big", blob(7, 6000), write_type=WriteType.MUST_CACHE)
    assert tiers(store, "/big") == ["SSD"]
    with store.open("/big-stream", "wb", write_type=WriteType.MUST_CACHE) as stream:
        stream.write(blob(8, 6000))
    assert tiers(store, "/big-stream") == ["SSD"]
    assert store.get("/big-stream") == blob(8, 6000)


def test_a_stream_never_grows_a_tier_past_its_capacity(
    make_store: MakeStore, store_root: Path
) -> None:
    store = make_store(**SMALL)

    def staged(tier: str) -> list[int]:
        return [p.stat().st_size for p in (store_root / tier / "tmp").iterdir()]

    with store.open("/s", "wb", write_type=WriteType.MUST_CACHE) as stream:
        for i in range(6):
            stream.write(blob(i, 1000))
            assert sum(staged("mem")) <= 4 * KB  # past 4 KB the bytes are staged in SSD
        assert staged("mem") == [] and staged("ssd") == [6000]
    assert tiers(store, "/s") == ["SSD"]
    assert store.get("/s") == b"".join(blob(i, 1000) for i in range(6))


def test_data_larger_than_every_tier(make_store: MakeStore) -> None:
    store = make_store(**SMALL)
    with pytest.raises(StoreFullError):
        store.put("/huge", blob(1, 100 * KB), write_type=WriteType.MUST_CACHE)
    store.put("/huge", blob(1, 100 * KB), write_type=WriteType.CACHE_THROUGH)
    status = store.stat("/huge")
    assert status.tier is None and status.persisted
    assert store.get("/huge") == blob(1, 100 * KB)
    with store.open("/huge2", "wb", write_type=WriteType.CACHE_THROUGH) as stream:
        stream.write(blob(2, 100 * KB))
    assert store.get("/huge2") == blob(2, 100 * KB)


def test_write_types(make_store: MakeStore, store_root: Path) -> None:
    store = make_store()
    ufs = store_root / "ufs"
    store.put("/wt/must", b"m", write_type=WriteType.MUST_CACHE)
    store.put("/wt/cache", b"c", write_type=WriteType.CACHE_THROUGH)
    store.put("/wt/through", b"t", write_type=WriteType.THROUGH)
    store.put("/wt/async", b"a", write_type=WriteType.ASYNC_THROUGH)
    assert not (ufs / "wt/must").exists()
    assert (ufs / "wt/cache").read_bytes() == b"c"
    assert (ufs / "wt/through").read_bytes() == b"t"
    assert store.stat("/wt/through").tier is None
    assert store.stat("/wt/cache").tier == "MEM"
    # ASYNC_THROUGH: acknowledged from the cache, journaled, persisted by maintenance
    assert store.stat("/wt/async").persistence is PersistenceState.TO_BE_PERSISTED
    assert store.pending_persists() == 1
    assert not (ufs / "wt/async").exists()
    store.maintain()
    assert (ufs / "wt/async").read_bytes() == b"a"
    assert store.stat("/wt/async").persistence is PersistenceState.PERSISTED
    assert store.pending_persists() == 0
    assert store.stat("/wt/must").persistence is PersistenceState.NOT_PERSISTED


def test_background_thread_persists(make_store: MakeStore, store_root: Path) -> None:
    store = make_store(background=True)
    store.put("/bg/x", b"payload" * 1000, write_type=WriteType.ASYNC_THROUGH)
    store.flush(timeout=10)
    assert (store_root / "ufs/bg/x").read_bytes() == b"payload" * 1000


def test_overwrite_supersedes_pending_persist(make_store: MakeStore, store_root: Path) -> None:
    store = make_store()
    store.put("/o", b"first", write_type=WriteType.ASYNC_THROUGH)
    store.put("/o", b"second", write_type=WriteType.MUST_CACHE)
    store.maintain()
    assert not (store_root / "ufs/o").exists()
    assert store.pending_persists() == 0
    store.put("/o", b"third", write_type=WriteType.ASYNC_THROUGH)
    store.rename("/o", "/moved")
    store.maintain()
    assert (store_root / "ufs/moved").read_bytes() == b"third"
    store.delete("/moved")
    assert not (store_root / "ufs/moved").exists()


def test_ttl_delete_and_free(make_store: MakeStore, store_root: Path) -> None:
    store = make_store(background=True, ttl_check_interval=0.05)
    store.put("/ttl/gone", b"x", write_type=WriteType.CACHE_THROUGH, ttl=0.2)
    store.put("/ttl/freed", b"y", write_type=WriteType.CACHE_THROUGH)
    store.set_ttl("/ttl/freed", 0.2, action="FREE")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        store.exists("/ttl/gone") or store.stat("/ttl/freed").tier is not None
    ):
        time.sleep(0.05)
    assert not store.exists("/ttl/gone")
    assert not (store_root / "ufs/ttl/gone").exists()
    freed = store.stat("/ttl/freed")
    assert freed.tier is None and freed.ttl is None
    assert store.get("/ttl/freed") == b"y"


def test_ttl_counts_from_creation(make_store: MakeStore) -> None:
    store = make_store()
    store.put("/old", b"x")
    time.sleep(0.3)
    store.set_ttl("/old", 0.1)  # created 0.3 s ago: already expired (Alluxio semantics)
    assert not store.exists("/old")


def test_expired_file_is_invisible_before_the_sweep(make_store: MakeStore) -> None:
    store = make_store(background=False)
    store.put("/e", b"x", ttl=0.05)
    time.sleep(0.1)
    assert not store.exists("/e")
    assert [s.path for s in store.list("/")] == []


def test_free_rules(make_store: MakeStore) -> None:
    store = make_store()
    store.put("/f/must", b"m", write_type=WriteType.MUST_CACHE)
    store.put("/f/pinned", b"p", write_type=WriteType.CACHE_THROUGH, pinned=True)
    store.put("/f/ok", b"o", write_type=WriteType.CACHE_THROUGH)
    with pytest.raises(StorePreconditionError, match="persist it first"):
        store.free("/f/must")
    with pytest.raises(StorePreconditionError, match="pinned"):
        store.free("/f/pinned")
    with pytest.raises(StorePreconditionError, match="recursive"):
        store.free("/f")
    store.free("/f/ok")
    assert store.stat("/f/ok").tier is None
    assert store.stat("/f/must").tier == "MEM"


def test_corruption_is_detected(make_store: MakeStore, store_root: Path) -> None:
    store = make_store(verify_reads="all")
    store.put("/c", b"0123456789" * 100, write_type=WriteType.MUST_CACHE)
    (obj,) = [p for p in (store_root / "mem/objects").rglob("*") if p.is_file()]
    raw = bytearray(obj.read_bytes())
    raw[500] ^= 0xFF
    obj.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptionError, match="does not match"):
        store.get("/c")
    with pytest.raises(StoreCorruptionError), store.open("/c") as stream:
        stream.read()
    with pytest.raises(StoreCorruptionError):
        store.persist("/c")


def test_default_verification_covers_disk_tiers_and_sizes(
    make_store: MakeStore, store_root: Path
) -> None:
    store = make_store(**SMALL, promote_on_read=False)
    store.put("/on-ssd", b"s" * 6000, write_type=WriteType.MUST_CACHE)  # too big for MEM
    (obj,) = [p for p in (store_root / "ssd/objects").rglob("*") if p.is_file()]
    obj.write_bytes(b"S" * 6000)
    with pytest.raises(StoreCorruptionError, match="tier SSD"):
        store.get("/on-ssd")
    store.put("/in-mem", b"m" * 100, write_type=WriteType.MUST_CACHE)
    (obj,) = [p for p in (store_root / "mem/objects").rglob("*") if p.is_file()]
    obj.write_bytes(b"m" * 99)  # a truncated copy is caught whatever verify_reads says
    with pytest.raises(StoreCorruptionError, match="tier MEM"):
        store.get("/in-mem")
    obj.write_bytes(b"m" * 101)  # and so is a copy that grew
    with pytest.raises(StoreCorruptionError, match=r"tier MEM \(101 bytes"):
        store.get("/in-mem")


def test_ufs_copy_verified_on_read(make_store: MakeStore, store_root: Path) -> None:
    store = make_store()
    store.put("/u", b"abc" * 100, write_type=WriteType.THROUGH)
    (store_root / "ufs/u").write_bytes(b"xyz" * 100)
    with pytest.raises(StoreCorruptionError, match="under-store"):
        store.get("/u")


def test_reboot_loses_only_unpersisted_mem_data(store_root: Path) -> None:
    store = LocalStore("local://", background=False)
    store.put("/keep", b"persisted", write_type=WriteType.CACHE_THROUGH)
    store.put("/lose", b"memory only", write_type=WriteType.MUST_CACHE)
    store.put("/ssd", b"on disk", write_type=WriteType.MUST_CACHE)
    store.close()
    # a reboot: /dev/shm is empty and the boot id changed
    for obj in (store_root / "mem/objects").rglob("*"):
        if obj.is_file():
            obj.unlink()
    import sqlite3  # noqa: PLC0415

    with sqlite3.connect(store_root / "catalog.sqlite") as db:
        db.execute("UPDATE meta SET value = 'previous-boot' WHERE key = 'boot'")
    store = LocalStore("local://", background=False)
    try:
        assert store.get("/keep") == b"persisted"
        assert store.stat("/lose").persistence is PersistenceState.LOST
        with pytest.raises(StoreDataLostError, match="MUST_CACHE"):
            store.get("/lose")
    finally:
        store.close()


def test_tier_layout_must_match(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store()
    store.put("/x", b"x", write_type=WriteType.MUST_CACHE)
    with pytest.raises(StoreError, match="same tier directories"):
        LocalStore("local://", mem_dir=str(tmp_path / "elsewhere"), background=False)


def test_staging_files_of_dead_processes_are_removed(
    make_store: MakeStore, store_root: Path
) -> None:
    make_store().close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    stale = store_root / "mem/tmp" / f"{int(dead.stdout)}-deadbeef"
    stale.write_bytes(b"half a write")
    mine = store_root / "mem/tmp" / f"{os.getpid()}-cafe"
    mine.write_bytes(b"in flight")
    make_store()
    assert not stale.exists()
    assert mine.exists()
    mine.unlink()


def test_enospc_on_a_tier_spills_to_the_next(
    make_store: MakeStore, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    store.put("/before", b"b" * 5000, write_type=WriteType.MUST_CACHE)
    mem = str(store_root / "mem")
    real_write = os.write

    def full(fd: int, data: bytes | memoryview) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(mem):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    store.put("/spilled", b"s" * 5000, write_type=WriteType.MUST_CACHE)
    monkeypatch.undo()
    assert store.stat("/spilled").tier == "SSD"
    assert store.get("/spilled") == b"s" * 5000
    assert store.get("/before") == b"b" * 5000


def test_usage_matches_the_files(make_store: MakeStore) -> None:
    store = make_store(**SMALL)
    for i in range(30):
        store.put(f"/u/{i % 7}", blob(i, 500 + 97 * i), write_type=WriteType.CACHE_THROUGH)
        if i % 5 == 0:
            store.get(f"/u/{(i * 3) % 7}")
        if i % 11 == 0:
            store.delete(f"/u/{i % 7}")
    files = [s for s in store.list("/", recursive=True) if not s.is_dir]
    expected = {"MEM": 0, "SSD": 0, "HDD": 0}
    for s in files:
        if s.tier is not None:
            expected[s.tier] += s.size
    assert used(store) == expected


def test_namespaces_are_isolated(store_root: Path) -> None:
    a = LocalStore("local:///team-a", background=False)
    b = LocalStore("local:///team-b", background=False)
    try:
        a.put("/k", b"a")
        b.put("/k", b"b")
        assert a.get("/k") == b"a" and b.get("/k") == b"b"
        assert [s.path for s in a.list("/")] == ["/k"]
        root = LocalStore("local://", background=False)
        assert sorted(s.path for s in root.list("/", recursive=True) if not s.is_dir) == [
            "/team-a/k",
            "/team-b/k",
        ]
        root.close()
    finally:
        a.close()
        b.close()


def test_settings_from_environment(store_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADCLOUD_STORE_MEM_CAPACITY", "64MiB")
    monkeypatch.setenv("ADCLOUD_STORE_HDD_CAPACITY", "0")
    settings = StoreSettings.load()
    specs = settings.tiers()
    assert [(t.name, t.capacity) for t in specs] == [("MEM", 64 << 20), ("SSD", 50 * 1024**3)]
    assert [t.directory for t in specs] == [store_root / "mem", store_root / "ssd"]
    assert settings.ufs_url() == f"file://{store_root / 'ufs'}"
    monkeypatch.setenv("ADCLOUD_STORE_MEM_CAPACITY", "lots")
    from adcloud.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="mem_capacity"):
        StoreSettings.load()


@pytest.mark.parametrize("ufs", ["ufs-here", "file://ufs-here", "local://ufs-here"])
def test_a_relative_under_store_is_refused(
    ufs: str, store_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each process would persist below its own working directory: a file another process
    # persisted would be missing
    from adcloud.errors import ConfigError  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ADCLOUD_STORE_UFS", ufs)
    with pytest.raises(ConfigError, match=r"store\.ufs: .* is a relative path"):
        LocalStore("local://", background=False)
    assert not (tmp_path / "ufs-here").exists()


@pytest.mark.parametrize("name", ["ROOT", "MEM_DIR", "SSD_DIR", "HDD_DIR", "META_DIR"])
def test_a_relative_store_directory_is_refused(
    name: str, store_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a Spark executor runs in its own work directory: each process would open a store of
    # its own there instead of the one shared by the machine
    from adcloud.errors import ConfigError  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(f"ADCLOUD_STORE_{name}", "tiers-here")
    with pytest.raises(ConfigError, match=rf"store\.{name.lower()}: .* is a relative path"):
        LocalStore("local://", background=False)
    assert not (tmp_path / "tiers-here").exists()


def test_an_absolute_under_store_path_is_taken(
    make_store: MakeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for ufs, where in ((str(tmp_path / "u1"), tmp_path / "u1"), ("~/u2", tmp_path / "u2")):
        store = make_store(ufs=ufs)
        store.put("/f", b"x", write_type=WriteType.CACHE_THROUGH)
        assert (where / "f").read_bytes() == b"x"


def test_a_seek_past_the_end_of_a_verified_file_reads_nothing(make_store: MakeStore) -> None:
    # every read is checked, so the seek past the end was taken for a short file
    store = make_store(verify_reads="all")
    store.put("/f", b"0123456789")
    with store.open("/f") as stream:
        stream.seek(50)
        assert stream.read() == b""
        stream.seek(0)
        assert stream.read() == b"0123456789"


def test_default_tiers_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADCLOUD_STORE_ROOT")
    specs = StoreSettings.load().tiers()
    assert str(specs[0].directory).startswith(("/dev/shm/adcloud-", "/tmp/adcloud-"))
    assert specs[1].directory == Path("~/.cache/adcloud/store/ssd").expanduser()


def test_any_fsspec_url_as_under_store(make_store: MakeStore) -> None:
    import uuid  # noqa: PLC0415

    import fsspec  # noqa: PLC0415

    root = f"/ufs-{uuid.uuid4().hex}"
    store = make_store(ufs=f"memory://{root}")
    memfs = fsspec.filesystem("memory")
    store.put("/u/through", b"t", write_type=WriteType.THROUGH)
    store.put("/u/cache", b"c", write_type=WriteType.CACHE_THROUGH)
    store.put("/u/async", b"a", write_type=WriteType.ASYNC_THROUGH)
    store.maintain()
    assert memfs.cat_file(f"{root}/u/through") == b"t"
    assert memfs.cat_file(f"{root}/u/cache") == b"c"
    assert memfs.cat_file(f"{root}/u/async") == b"a"
    assert not [p for p in memfs.find(root) if "adcloud-tmp" in p]
    store.free("/u/cache")
    assert store.get("/u/cache") == b"c"
    store.rename("/u/cache", "/v/cache")
    assert memfs.cat_file(f"{root}/v/cache") == b"c"
    store.delete("/u", recursive=True)
    assert not memfs.exists(f"{root}/u/through")
    memfs.rm(root, recursive=True)


def test_deleting_a_memory_only_file_does_not_wait_for_the_disk(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A parameter server deletes a consumed version every step: when the file's only copy
    # is in the MEM tier the catalog commit is not fsynced; anything else still is.  A
    # directory goes the quick way when every file under it is memory-only; otherwise the
    # quick attempt finds out inside its transaction, changes nothing and retries durably.
    # A delete that removes under-store copies then drops its record of them (no fsync).
    store = make_store(mem_capacity="16KB", ssd_capacity="64KB", hdd_capacity="128KB")
    store.put("/mem", blob(1), write_type="MUST_CACHE")
    store.put("/ssd", blob(2, 20 * KB), write_type="MUST_CACHE")  # too big for MEM
    store.put("/through", blob(3), write_type="CACHE_THROUGH")
    store.put("/dir/a", blob(4), write_type="MUST_CACHE")
    store.put("/dir/sub/b", blob(5), write_type="MUST_CACHE")
    store.put("/mixed/a", blob(6), write_type="MUST_CACHE")
    store.put("/mixed/sub/b", blob(7), write_type="CACHE_THROUGH")
    store.mkdir("/empty")
    assert tiers(store, "/mem", "/ssd") == ["MEM", "SSD"]
    seen: list[bool] = []
    transaction = store._cat.transaction

    def spy(*, durable: bool = False):  # type: ignore[no-untyped-def]
        seen.append(durable)
        return transaction(durable=durable)

    monkeypatch.setattr(store._cat, "transaction", spy)
    for path, durable in (("/mem", [False]), ("/ssd", [True]), ("/through", [True, False])):
        seen.clear()
        store.delete(path)
        assert seen == durable, path
        assert not store.exists(path)
    for path, durable_tries in (
        ("/dir", [False]),
        ("/mixed", [False, True, False]),
        ("/empty", [False, True, False]),
    ):
        seen.clear()
        store.delete(path, recursive=True)
        assert seen == durable_tries, path
        assert not store.exists(path)
    assert store.list("/") == []
    with pytest.raises(StoreNotFoundError):
        store.delete("/dir", recursive=True)
    assert all(u.used == 0 and u.files == 0 for u in store.usage())


def test_a_file_replaced_before_its_quick_delete_is_deleted_durably(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    store.put("/f", blob(1), write_type="MUST_CACHE")
    lookup = store._cat.file
    calls = 0

    def racing(key: str, conn=None):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:  # between delete's first look and its transaction, another
            row = lookup(key, conn)  # writer replaces the file with a persisted one
            store.put("/f", blob(2), write_type="CACHE_THROUGH")
            return row
        return lookup(key, conn)

    monkeypatch.setattr(store._cat, "file", racing)
    seen: list[bool] = []
    transaction = store._cat.transaction

    def spy(*, durable: bool = False):  # type: ignore[no-untyped-def]
        seen.append(durable)
        return transaction(durable=durable)

    monkeypatch.setattr(store._cat, "transaction", spy)
    store.delete("/f")
    assert seen[-3:] == [False, True, False]  # quick, durable, the under-store record dropped
    assert not store.exists("/f")
    monkeypatch.undo()
    assert store.list("/") == []


@pytest.mark.parametrize("one_read_max", [1 << 30, 64], ids=["os.read", "file object"])
def test_read_object_returns_what_the_file_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_read_max: int
) -> None:
    """A get reads an object with one ``os.read`` of its catalog size plus a byte (large
    objects through the file object); either way a file that is shorter or longer than the
    catalog says comes back as it is, for the size check to catch."""
    monkeypatch.setattr(_tiers, "_ONE_READ_MAX", one_read_max)
    obj = tmp_path / "obj"
    payload = bytes(range(256)) * 4
    obj.write_bytes(payload)
    assert _tiers.read_object(str(obj), len(payload)) == payload
    assert _tiers.read_object(str(obj), len(payload) - 1) == payload  # longer than recorded
    assert _tiers.read_object(str(obj), len(payload) + 10) == payload  # shorter
    with pytest.raises(FileNotFoundError):
        _tiers.read_object(str(tmp_path / "gone"), 1)


def test_errors_name_the_path(make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()
    store.put("/named/f", b"x", write_type=WriteType.MUST_CACHE)
    with pytest.raises(StoreError, match="/named/f: TTL must not be negative"):
        store.set_ttl("/named/f", -1)
    with pytest.raises(StoreError, match="/named/f is a file, so /named/f/a/b cannot be created"):
        store.put("/named/f/a/b", b"y")
    by_id = store._cat.file_by_id
    calls = iter(range(10**6))

    def moving(file_id: int, conn: object = None) -> object:
        row = by_id(file_id, conn)  # type: ignore[arg-type]
        # every second look finds the file under another name: it never holds still
        return row if next(calls) % 2 == 0 or row is None else row._replace(path="/elsewhere")

    monkeypatch.setattr(store._cat, "file_by_id", moving)
    with pytest.raises(StoreError, match="/named/f in local:// kept changing"):
        store.persist("/named/f")


def test_a_tier_directory_another_user_owns_is_refused(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """The MEM tier's default directory has a predictable name under the world-writable
    /dev/shm: one another user made first must not be used."""
    if os.geteuid() == 0:
        planted = tmp_path / "planted"
        planted.mkdir(mode=0o777)
        other = 4242
        os.chown(planted, other, -1)
    else:  # without root: a directory root owns stands in for another user's
        planted, other = Path(tempfile.gettempdir()), Path(tempfile.gettempdir()).stat().st_uid
        assert other != os.geteuid()
    with pytest.raises(StoreError, match=rf"tier MEM directory {planted} belongs to uid {other}"):
        make_store(mem_dir=str(planted))
    assert not (planted / "objects").exists()  # nothing created inside it
    if os.geteuid() == 0:
        os.chown(planted, 0, -1)
        store = make_store(mem_dir=str(planted))
        store.put("/x", b"ok")
        assert store.stat("/x").tier == "MEM"
        assert (planted.stat().st_mode & 0o777) == 0o700  # made private once it is ours


def objects(root: Path, tier: str) -> list[os.stat_result]:
    return [p.stat() for p in (root / tier / "objects").rglob("*") if p.is_file()]


def test_a_copy_in_a_tier_links_the_object(make_store: MakeStore, store_root: Path) -> None:
    """A cached source is copied by a hard link in its tier: the bytes are there once,
    the copy is a version of its own, and the source may change or go without it."""
    store = make_store(
        mem_capacity="4KB", ssd_capacity="16KB", promote_on_read=False, verify_reads="all"
    )
    store.put("/in-mem", blob(1), write_type=WriteType.MUST_CACHE)
    store.put("/on-ssd", blob(2, 6000), write_type=WriteType.MUST_CACHE)  # too big for MEM
    store.copy("/in-mem", "/copies/mem")
    store.copy("/on-ssd", "/copies/ssd", write_type=WriteType.MUST_CACHE)
    (mem,) = {(s.st_ino, s.st_nlink) for s in objects(store_root, "mem")}
    assert mem[1] == 2  # one object, two names
    (ssd,) = {(s.st_ino, s.st_nlink) for s in objects(store_root, "ssd")}
    assert ssd[1] == 2
    assert tiers(store, "/copies/mem", "/copies/ssd") == ["MEM", "SSD"]
    for src, dst in (("/in-mem", "/copies/mem"), ("/on-ssd", "/copies/ssd")):
        assert store.stat(dst).checksum == store.stat(src).checksum
        assert store.get(dst) == store.get(src)  # verified against the catalog's CRC
    # the tiers count both files: either may later move or go alone
    assert used(store) == {"MEM": 1500 * 2, "SSD": 6000 * 2, "HDD": 0}
    store.put("/in-mem", blob(3), write_type=WriteType.MUST_CACHE)
    store.delete("/on-ssd")
    assert store.get("/copies/mem") == blob(1)
    assert store.get("/copies/ssd") == blob(2, 6000)
    assert all(s.st_nlink == 1 for s in objects(store_root, "mem") + objects(store_root, "ssd"))


def test_a_copy_follows_its_write_type(make_store: MakeStore, store_root: Path) -> None:
    store = make_store()
    store.put("/src", blob(4), write_type=WriteType.MUST_CACHE)
    store.copy("/src", "/through", write_type=WriteType.CACHE_THROUGH)
    status = store.stat("/through")
    assert (status.tier, status.persistence) == ("MEM", PersistenceState.PERSISTED)
    assert (store_root / "ufs/through").read_bytes() == blob(4)
    store.copy("/src", "/ufs-only", write_type=WriteType.THROUGH)
    assert store.stat("/ufs-only").tier is None
    assert (store_root / "ufs/ufs-only").read_bytes() == blob(4)
    # a source only the under-store holds is streamed from it
    store.free("/through")
    assert store.stat("/through").tier is None
    store.copy("/through", "/from-ufs", write_type=WriteType.MUST_CACHE, pinned=True)
    status = store.stat("/from-ufs")
    assert (status.tier, status.pinned) == ("MEM", True)
    assert store.get("/from-ufs") == blob(4)


def test_a_copy_that_does_not_fit_leaves_the_target_alone(
    make_store: MakeStore, store_root: Path
) -> None:
    store = make_store(mem_capacity="4KB", ssd_capacity="0", hdd_capacity="0")
    store.put("/a", blob(5, 2000), write_type=WriteType.MUST_CACHE, pinned=True)
    store.put("/b", b"old b", write_type=WriteType.MUST_CACHE, pinned=True)
    with pytest.raises(StoreFullError):
        store.copy("/a", "/b2", write_type=WriteType.MUST_CACHE)
    store.put("/b2", b"kept", write_type=WriteType.MUST_CACHE)
    with pytest.raises(StoreFullError):
        store.copy("/a", "/b2", write_type=WriteType.MUST_CACHE)
    assert store.get("/b2") == b"kept"
    assert not list((store_root / "mem/tmp").iterdir())  # no link left behind
    assert [s.st_nlink for s in objects(store_root, "mem")] == [1, 1, 1]


def test_a_tier_emptied_without_a_reboot_serves_the_under_store_or_says_lost(
    make_store: MakeStore, store_root: Path
) -> None:
    """A MEM tier emptied while the machine runs (systemd's RemoveIPC clears a user's
    /dev/shm at logout; a clean-up script) left the catalog naming objects that were gone:
    every read failed with "kept changing while being read; try again" -- persisted files
    whose under-store copy was whole included -- and retrying never helped."""
    store = make_store()
    store.put("/ct", b"persisted", write_type=WriteType.CACHE_THROUGH)
    store.put("/ct2", b"persisted too", write_type=WriteType.CACHE_THROUGH)
    store.put("/src", b"copied", write_type=WriteType.CACHE_THROUGH)
    store.put("/mc", b"cache only", write_type=WriteType.MUST_CACHE)
    store.put("/at", b"not yet persisted", write_type=WriteType.ASYNC_THROUGH)
    for obj in (store_root / "mem" / "objects").rglob("*"):
        if obj.is_file():
            obj.unlink()
    assert store.get("/ct") == b"persisted"
    with store.open("/ct2") as stream:
        assert stream.read() == b"persisted too"
    store.copy("/src", "/dst", write_type=WriteType.MUST_CACHE)
    assert store.get("/dst") == b"copied"
    with pytest.raises(StoreDataLostError, match="/mc is lost"):
        store.get("/mc")
    assert store.stat("/mc").persistence is PersistenceState.LOST
    with pytest.raises(StoreDataLostError, match="/at is lost"):
        store.persist("/at")
    assert store.stat("/at").persistence is PersistenceState.LOST
    assert store.pending_persists() == 0
    # another process sees the same
    with LocalStore("local://", background=False) as other:
        assert other.get("/ct") == b"persisted"
        with pytest.raises(StoreDataLostError):
            other.get("/mc")


def test_glob_characters_reach_an_object_under_store_literally(
    make_store: MakeStore, tmp_path: Path
) -> None:
    # the under-store's rm took "f?.bin" for a pattern: deleting it also deleted the
    # persisted copies of f1.bin and f2.bin, which the catalog still called PERSISTED
    ufs = f"memory:///ufs-{tmp_path.name}"
    store = make_store(ufs=ufs)
    for name in ("f1.bin", "f2.bin", "f?.bin", "[f]1.bin"):
        store.put(f"/g/{name}", name.encode(), write_type=WriteType.CACHE_THROUGH)
    store.delete("/g/f?.bin")
    store.rename("/g/[f]1.bin", "/g/h*.bin")
    store.free("/g", recursive=True)
    assert store.get("/g/f1.bin") == b"f1.bin"
    assert store.get("/g/f2.bin") == b"f2.bin"
    assert store.get("/g/h*.bin") == b"[f]1.bin"


def test_a_stream_larger_than_every_tier_is_refused_as_it_passes_the_limit(
    make_store: MakeStore, store_root: Path
) -> None:
    """A MUST_CACHE stream of unknown length was refused only at close, after every byte
    had been read and staged (the last tier's staging file grew far past its capacity);
    now the write that passes the largest tier raises, naming the path and that tier."""
    store = make_store(**SMALL)
    stream = store.open("/huge", "wb", write_type=WriteType.MUST_CACHE)
    for i in range(6):  # 60 KB: still fits the 64 KB HDD tier
        stream.write(blob(i, 10 * KB))
    with pytest.raises(StoreFullError, match=r"/huge \(over 62\.5 KiB so far\).*largest tier"):
        stream.write(blob(6, 10 * KB))
    assert stream.closed and not store.exists("/huge")
    assert [p for t in ("mem", "ssd", "hdd") for p in (store_root / t / "tmp").iterdir()] == []


def test_a_sized_write_larger_than_every_tier_is_refused_before_any_byte(
    make_store: MakeStore, store_root: Path
) -> None:
    """``open(..., size=N)`` (``adcloud store put FILE``): a file larger than every tier is
    refused at once; with CACHE_THROUGH it goes straight to the under-store, and a
    CACHE_THROUGH stream that outgrows the tiers moves there instead of overfilling HDD."""
    store = make_store(**SMALL)
    with pytest.raises(StoreFullError, match=r"/sized \(97\.7 KiB\).*largest tier \(62\.5 KiB\)"):
        store.open("/sized", "wb", write_type=WriteType.ASYNC_THROUGH, size=100 * KB)
    with store.open("/ct", "wb", write_type=WriteType.CACHE_THROUGH, size=100 * KB) as stream:
        assert not list((store_root / "mem" / "tmp").iterdir())
        stream.write(blob(3, 100 * KB))
    with store.open("/ct2", "wb", write_type=WriteType.CACHE_THROUGH) as stream:
        for i in range(10):
            stream.write(blob(i, 10 * KB))
            staged = [p.stat().st_size for p in (store_root / "hdd" / "tmp").iterdir()]
            assert sum(staged) <= 64 * KB
    for path, data in (
        ("/ct", blob(3, 100 * KB)),
        ("/ct2", b"".join(blob(i, 10 * KB) for i in range(10))),
    ):
        status = store.stat(path)
        assert status.tier is None and status.persisted and status.size == 100 * KB
        assert store.get(path) == data


def test_read_range_reads_a_range_where_the_file_is(
    make_store: MakeStore, store_root: Path
) -> None:
    """Positioned reads (a Spark task's byte range of a bag in the store): from the MEM tier,
    a lower tier after eviction, and the under-store once the cached copy is freed; a
    file only the lost cache held is LOST, not empty."""
    store = make_store(**SMALL, promote_on_read=False)
    data = bytes(range(256)) * 6  # 1,536 bytes
    store.put("/r", data, write_type=WriteType.CACHE_THROUGH)
    assert tiers(store, "/r") == ["MEM"]
    assert store.read_range("/r", 100, 50) == data[100:150]
    assert store.read_range("/r", 1500, 100) == data[1500:]  # cut at the end
    assert store.read_range("/r", 4000, 10) == b""
    assert store.read_range("/r", 7, 0) == b""
    for i in range(3):  # push it down a tier
        store.put(f"/churn/{i}", blob(i), write_type=WriteType.MUST_CACHE)
    assert tiers(store, "/r") == ["SSD"]
    assert store.read_range("/r", 1000, 300) == data[1000:1300]
    assert tiers(store, "/r") == ["SSD"]  # a range does not promote the file
    store.free("/r")
    assert store.stat("/r").tier is None
    assert store.read_range("/r", 3, 5) == data[3:8]
    with pytest.raises(ValueError, match="offset and length must be >= 0"):
        store.read_range("/r", -1, 5)
    with pytest.raises(StoreNotFoundError):
        store.read_range("/nope", 0, 1)
    store.put("/m", data, write_type=WriteType.MUST_CACHE)
    for level in ("mem", "ssd", "hdd"):  # the tiers emptied behind the store's back
        for obj in (store_root / level / "objects").rglob("*"):
            if obj.is_file():
                obj.unlink()
    with pytest.raises(StoreDataLostError, match="/m is lost"):
        store.read_range("/m", 0, 10)


def test_a_write_stream_onto_a_directory_is_refused_at_open(make_store: MakeStore) -> None:
    """Refused only when the stream closed, after every byte was staged in a tier (through
    ``adcloud store serve``, after the whole body was sent)."""
    store = make_store(**SMALL)
    store.mkdir("/d")
    with pytest.raises(StorePreconditionError, match=r"/d is a directory, not a file"):
        store.open("/d", "wb")
    assert store.stat("/d").is_dir


def test_read_into_fills_a_buffer_from_the_tier_or_the_under_store(
    make_store: MakeStore,
) -> None:
    store = make_store(**SMALL, promote_on_read=False)
    data = bytes(range(256)) * 6
    store.put("/r", data, write_type=WriteType.CACHE_THROUGH)
    buffer = bytearray(b"\xff" * 2000)
    assert store.read_into("/r", 1000, memoryview(buffer)[:300]) == 300
    assert buffer[:300] == data[1000:1300] and buffer[300:] == b"\xff" * 1700
    assert store.read_into("/r", 1400, memoryview(buffer)) == len(data) - 1400  # the end
    assert buffer[: len(data) - 1400] == data[1400:]
    store.free("/r")
    assert store.stat("/r").tier is None
    assert store.read_into("/r", 5, memoryview(buffer)[:10]) == 10
    assert buffer[:10] == data[5:15]
