"""Crashes with real processes: SIGKILL mid-write, after an ASYNC_THROUGH acknowledgement and
mid-persist; a full filesystem under a tier; a killed lock holder."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from adcloud.store import (
    AlluxioStore,
    LocalStore,
    PersistenceState,
    StoreCorruptionError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    WriteType,
)
from tests.store._worker import check_payload, payload
from tests.store.conftest import kill_worker, start_worker, wait_for_line, worker_env


def test_sigkill_mid_write_publishes_nothing(store_root: Path) -> None:
    store = LocalStore("local://", background=False)
    store.put("/ckpt/model", b"version 1", write_type=WriteType.MUST_CACHE)
    store.close()
    for key in ("/ckpt/model", "/ckpt/new"):
        proc = start_worker("slow-write", key)
        wait_for_line(proc, "writing")
        staging = list((store_root / "mem/tmp").iterdir())
        assert len(staging) == 1 and staging[0].stat().st_size >= 4 * (256 << 10)
        kill_worker(proc)
    store = LocalStore("local://", background=False)
    try:
        assert store.get("/ckpt/model") == b"version 1"
        assert not store.exists("/ckpt/new")
        assert list((store_root / "mem/tmp").iterdir()) == []  # dead writers' staging removed
        assert sum(t.used for t in store.usage()) == len(b"version 1")
    finally:
        store.close()


def test_sigkill_mid_through_write_leaves_no_staging_file_in_the_under_store(
    store_root: Path,
) -> None:
    LocalStore("local://", background=False).close()
    registry = store_root / "ufs-staging"
    proc = start_worker("slow-write", "/logs/run.bin", "THROUGH")
    wait_for_line(proc, "writing")
    (staging,) = (store_root / "ufs/logs").iterdir()
    assert "adcloud-tmp" in staging.name and staging.stat().st_size >= 4 * (256 << 10)
    assert [m.read_text() for m in registry.iterdir()] == [str(staging)]
    # another process opening or maintaining the store leaves a live writer's staging alone
    other = LocalStore("local://", background=False)
    other.maintain()
    assert staging.exists()
    kill_worker(proc)
    other.maintain()  # a long-lived process finds it without reopening the store
    other.close()
    assert not staging.exists()
    store = LocalStore("local://", background=False)
    try:
        assert not store.exists("/logs/run.bin")
        assert list((store_root / "ufs/logs").iterdir()) == []
        assert list(registry.iterdir()) == []
        store.put("/logs/run.bin", b"complete", write_type=WriteType.THROUGH)
        assert (store_root / "ufs/logs/run.bin").read_bytes() == b"complete"
        assert list(registry.iterdir()) == []  # a finished write leaves no entry
    finally:
        store.close()


def test_the_staging_registry_never_deletes_anything_but_staging_files(
    store_root: Path,
) -> None:
    LocalStore("local://", background=False).close()
    precious = store_root / "ufs/precious.bin"
    precious.parent.mkdir(parents=True, exist_ok=True)
    precious.write_bytes(b"keep")
    # an entry of a dead writer (no pid is that large) naming a file that is no staging file
    (store_root / "ufs-staging" / "999999999-forged").write_text(str(precious))
    LocalStore("local://", background=False).close()
    assert precious.read_bytes() == b"keep"
    assert not (store_root / "ufs-staging" / "999999999-forged").exists()


def test_sigkill_after_async_ack_loses_nothing(store_root: Path) -> None:
    proc = start_worker("async-put", "/ckpt/params.bin", str(2 << 20), "7")
    wait_for_line(proc, "acked")
    kill_worker(proc)
    ufs_file = store_root / "ufs/ckpt/params.bin"
    assert not ufs_file.exists()  # the killed writer had no persister thread
    store = LocalStore("local://")  # a restart: the maintainer replays the journal
    try:
        store.flush(timeout=30)
        expected = payload(7, 2 << 20)
        assert ufs_file.read_bytes() == expected
        status = store.stat("/ckpt/params.bin")
        assert status.persistence is PersistenceState.PERSISTED
        assert status.checksum == f"crc32:{zlib.crc32(expected):08x}"
        assert store.get("/ckpt/params.bin") == expected
    finally:
        store.close()


def test_sigkill_mid_persist_is_finished_by_the_next_process(store_root: Path) -> None:
    proc = start_worker("slow-persist", "/ckpt/slow.bin", str(1 << 20), "11")
    wait_for_line(proc, "persisting")
    leftovers = [p for p in (store_root / "ufs/ckpt").iterdir() if "adcloud-tmp" in p.name]
    assert len(leftovers) == 1
    kill_worker(proc)
    store = LocalStore("local://", background=False)
    try:
        assert store.pending_persists() == 1
        store.flush(timeout=30)
        assert (store_root / "ufs/ckpt/slow.bin").read_bytes() == payload(11, 1 << 20)
        assert [p.name for p in (store_root / "ufs/ckpt").iterdir()] == ["slow.bin"]
    finally:
        store.close()


def test_a_killed_lock_holder_does_not_wedge_the_store(store_root: Path) -> None:
    LocalStore("local://", background=False).close()
    proc = start_worker("hold-space-lock")
    wait_for_line(proc, "locked")
    kill_worker(proc)
    store = LocalStore("local://", background=False)
    try:
        store.put("/after", b"fine", write_type=WriteType.MUST_CACHE)
        assert store.get("/after") == b"fine"
    finally:
        store.close()


@contextlib.contextmanager
def tiny_tmpfs(*dirs: Path, size: str = "1m") -> Iterator[bool]:
    """Mount a ``size`` tmpfs on each of ``dirs``; yields False if mounting is not permitted."""
    mounted: list[Path] = []
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                capture_output=True,
                check=False,
            )
            if done.returncode != 0:
                yield False
                return
            mounted.append(d)
        yield True
    finally:
        for d in reversed(mounted):
            subprocess.run(["umount", "-l", str(d)], check=False, capture_output=True)


def _fill_until_full(store: LocalStore, size: int) -> dict[str, bytes]:
    stored: dict[str, bytes] = {}
    for i in range(100):
        key = f"/full/{i}"
        data = payload(1000 + i, size)
        try:
            store.put(key, data, write_type=WriteType.MUST_CACHE)
        except StoreFullError as err:
            message = str(err)
            assert "No space left" in message or "no space left" in message
            assert "MEM" in message and "SSD" in message
            return stored
        stored[key] = data
    raise AssertionError("the tiny filesystems never filled up")


def test_full_tier_on_a_real_tiny_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(root))
    with tiny_tmpfs(root / "mem", root / "ssd") as ok:
        if not ok:
            pytest.skip("this sandbox does not permit mounting a tmpfs; see the injected test")
        # capacities larger than the filesystems: the kernel's ENOSPC is what stops writes
        store = LocalStore(
            "local://",
            mem_capacity="64MiB",
            ssd_capacity="64MiB",
            hdd_capacity="0",
            background=False,
        )
        try:
            stored = _fill_until_full(store, 300_000)
            assert len(stored) >= 4  # ~3 fit per 1 MiB tier: MEM first, then spilled to SSD
            assert {store.stat(k).tier for k in stored} == {"MEM", "SSD"}
            for key, data in stored.items():  # nothing previously stored was lost
                assert check_payload(store.get(key)) is None
                assert store.get(key) == data
            assert list((root / "mem/tmp").iterdir()) == []
            assert list((root / "ssd/tmp").iterdir()) == []
        finally:
            store.close()


def test_full_tier_injected_enospc_in_a_real_process(store_root: Path) -> None:
    store = LocalStore("local://", background=False)
    store.put("/before", payload(1, 50_000), write_type=WriteType.MUST_CACHE)
    store.close()
    full = [str(store_root / "mem"), str(store_root / "ssd")]
    proc = start_worker("enospc-put", "/spill", "80000", "2", full[0])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "stored SSD"  # ENOSPC in MEM: the write spilled to SSD
    proc = start_worker("enospc-put", "/nowhere", "80000", "3", *full, str(store_root / "hdd"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "StoreFullError" in out and "no space left" in out.lower()
    store = LocalStore("local://", background=False)
    try:
        assert store.get("/before") == payload(1, 50_000)
        assert store.get("/spill") == payload(2, 80_000)
        assert not store.exists("/nowhere")
        for tier in ("mem", "ssd", "hdd"):
            assert list((store_root / tier / "tmp").iterdir()) == []
        assert os.listdir(store_root / "ufs") == []
    finally:
        store.close()


def test_a_damaged_catalog_is_one_error_naming_it(store_root: Path) -> None:
    """A catalog file that is not (or no longer) a SQLite database -- a disk that lost
    its pages, a file copied over it -- failed every command with sqlite3's traceback
    ("file is not a database") that named no file."""
    with LocalStore("local://", background=False) as store:
        store.put("/a", b"x", write_type=WriteType.CACHE_THROUGH)
    catalog = store_root / "catalog.sqlite"
    for damage in (b"not a database at all\n", catalog.read_bytes()[:3000]):
        catalog.write_bytes(damage)
        for leftover in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
            (store_root / leftover).unlink(missing_ok=True)
        with pytest.raises(StoreCorruptionError, match=f"{catalog} is damaged"):
            LocalStore("local://", background=False)
        done = subprocess.run(
            [sys.executable, "-m", "adcloud.cli", "store", "ls", "local:///"],
            capture_output=True,
            text=True,
            env=worker_env(),
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.startswith(f"error: the store catalog {catalog} is damaged")


def _serve(port: int) -> subprocess.Popen[str]:
    """``adcloud store serve`` on ``port`` as its own process, once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "adcloud.cli", "store", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )
    probe = AlluxioStore(f"alluxio://127.0.0.1:{port}/", timeout=5)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                probe.exists("/")
            except StoreUnavailableError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    kill_worker(proc)
                    pytest.fail("adcloud store serve did not start")
                time.sleep(0.1)
            else:
                return proc
    finally:
        probe.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_proxy_killed_mid_write_is_an_error_naming_the_path(store_root: Path) -> None:
    """``adcloud store serve`` killed while a client streams a file into it: the client's
    error said only "cannot reach the Alluxio REST proxy at HOST:PORT", not which file's
    write broke off.  A server restarted over the store has none of it, and serves on."""
    port = _free_port()
    proc = _serve(port)
    client = AlluxioStore(f"alluxio://127.0.0.1:{port}/", timeout=5, chunk_size=64 << 10)
    path = "/runs/day 1/ünï.bin"
    try:
        client.put("/kept.bin", b"kept")
        stream = client.open(path, "wb")
        stream.write(b"x" * (64 << 10))  # one write request went through
        kill_worker(proc)
        with pytest.raises(StoreUnavailableError, match=re.escape(f"write {path}: cannot reach")):
            stream.write(b"y" * (64 << 10))
        with pytest.raises(StoreUnavailableError, match=re.escape("get-status /kept.bin")):
            client.stat("/kept.bin")
        proc = _serve(port)
        assert client.get("/kept.bin") == b"kept" and not client.exists(path)
        client.put(path, b"whole")
        assert client.get(path) == b"whole"
    finally:
        client.close()
        if proc.poll() is None:
            kill_worker(proc)
    assert list((store_root / "mem/tmp").iterdir()) == []  # the killed server's staging


def test_a_read_cut_off_by_a_dying_proxy_reports_the_read(store_root: Path) -> None:
    """A proxy that dies mid-answer to ``get``: the error that ended the read ("reading
    PATH from the proxy broke off") was replaced by the failure to close the stream on the
    dead proxy ("cannot reach ..." naming no file).  The proxy here is a socket that
    answers as the real one does, then drops the connection and stops listening."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def proxy() -> None:
        conn, _ = listener.accept()
        with conn:
            for answer in (b"7", None):  # open-file, then the read cut short
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(65536)
                if answer is not None:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1\r\n\r\n" + answer
                    )
                else:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"10000\r\n" + b"z" * 1000
                    )
            listener.close()  # the proxy is gone: the stream's close is refused

    thread = threading.Thread(target=proxy, daemon=True)
    thread.start()
    client = AlluxioStore(f"alluxio://127.0.0.1:{port}/", timeout=5)
    try:
        with pytest.raises(StoreError, match=re.escape("reading /drives/a b.bag from the proxy")):
            client.get("/drives/a b.bag")
    finally:
        client.close()
        thread.join(timeout=10)
