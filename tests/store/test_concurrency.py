"""Several processes writing and reading the same keys of one local store at once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from adcloud.store import LocalStore, PersistenceState
from tests.store._worker import check_payload
from tests.store.conftest import start_worker

WRITERS, ROUNDS, KEYS, SIZE = 4, 60, 6, 3000
READERS, READS = 2, 400


def test_processes_share_keys_without_tearing(store_root: Path) -> None:
    # tiny tiers so that eviction and promotion run concurrently with the writes and reads
    env = {
        "ADCLOUD_STORE_MEM_CAPACITY": "16KB",
        "ADCLOUD_STORE_SSD_CAPACITY": "32KB",
        "ADCLOUD_STORE_HDD_CAPACITY": "10MB",
    }
    procs = [
        start_worker("writer", str(i), str(ROUNDS), str(KEYS), str(SIZE), **env)
        for i in range(WRITERS)
    ]
    procs += [start_worker("reader", str(READS), str(KEYS), **env) for _ in range(READERS)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        outputs.append(out)
        assert proc.returncode == 0, f"{out}\n{err[-3000:]}"
    assert all(out.startswith("done") for out in outputs)
    assert sum(int(out.split()[1]) for out in outputs[WRITERS:]) > 0  # readers saw data

    store = LocalStore(
        "local://", mem_capacity="16KB", ssd_capacity="32KB", hdd_capacity="10MB", background=False
    )
    try:
        store.flush(timeout=60)
        files = [s for s in store.list("/shared") if not s.is_dir]
        assert len(files) == KEYS
        for status in files:
            data = store.get(status.path)
            assert check_payload(data) is None
            assert len(data) == status.size
            if status.persistence is PersistenceState.PERSISTED:
                ufs = store_root / "ufs" / status.path.lstrip("/")
                assert ufs.read_bytes() == data
        # the capacity accounting equals the files, and every object belongs to one
        usage = {t.name: t.used for t in store.usage()}
        expected = {"MEM": 0, "SSD": 0, "HDD": 0}
        for status in store.list("/shared"):
            if status.tier is not None:
                expected[status.tier] += status.size
        assert usage == expected
        assert usage["MEM"] <= 16_000 and usage["SSD"] <= 32_000
        objects = [
            p
            for t in ("mem", "ssd", "hdd")
            for p in (store_root / t / "objects").rglob("*")
            if p.is_file()
        ]
        with sqlite3.connect(store_root / "catalog.sqlite") as db:
            cached = db.execute("SELECT COUNT(*) FROM files WHERE tier IS NOT NULL").fetchone()[0]
        assert len(objects) == cached
        for tier in ("mem", "ssd", "hdd"):
            assert list((store_root / tier / "tmp").iterdir()) == []
    finally:
        store.close()
