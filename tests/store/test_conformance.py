"""The conformance suite against every backend: local tiered, Alluxio over HTTP, file, memory,
and S3 (s3fs against the S3 test server over HTTP)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from adcloud.store import (
    AlluxioStore,
    FsspecStore,
    LocalStore,
    Store,
    StoreExistsError,
    StorePreconditionError,
    StoreServer,
    open_store,
)
from tests.store.conformance import StoreConformance


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, store_root: Path) -> Iterator[Store]:
        s = open_store("local://", ttl_check_interval=0.05)
        assert isinstance(s, LocalStore)
        yield s
        s.close()


class TestLocalStoreNamespace(StoreConformance):
    """The same behaviour below a namespace prefix (``local:///tenant``)."""

    @pytest.fixture
    def store(self, store_root: Path) -> Iterator[Store]:
        s = open_store("local:///tenant/a", ttl_check_interval=0.05)
        yield s
        s.close()


class TestAlluxioOverHttp(StoreConformance):
    """The ``alluxio://`` backend against ``adcloud store serve``'s server, over real HTTP."""

    @pytest.fixture
    def store(self, store_root: Path) -> Iterator[Store]:
        backing = LocalStore("local://", ttl_check_interval=0.05)
        server = StoreServer(backing, port=0, token="conformance").start()
        s = open_store(server.uri, token="conformance", chunk_size=64 << 10)
        assert isinstance(s, AlluxioStore)
        yield s
        s.close()
        server.shutdown()
        backing.close()


class TestFileStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        s = open_store(f"file://{tmp_path}/fs-store")
        assert isinstance(s, FsspecStore)
        yield s
        s.close()


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        root = f"memory:///conformance-{uuid.uuid4().hex}"
        s = open_store(root)
        yield s
        if s.list("/"):
            s.delete("/", recursive=True)
        s.close()

    def test_pickles_as_description(self, store: Store) -> None:
        # memory:// lives in one process; the description still round-trips (same process)
        super().test_pickles_as_description(store)


class TestS3Store(StoreConformance):
    """``s3://BUCKET/PREFIX`` through s3fs, against a real S3-protocol server.  An object
    store holds keys, not a tree (see :mod:`adcloud.store.fsspec_store`): the two tests of
    empty directories and of files below files check that behaviour instead, and the others
    make a directory by putting a file below it."""

    @pytest.fixture
    def store(self, s3_bucket: str) -> Iterator[Store]:
        s = open_store(f"{s3_bucket}/conformance")
        assert isinstance(s, FsspecStore)
        yield s
        s.close()

    def test_mkdir(self, store: Store) -> None:
        store.mkdir("/m/n/o")  # succeeds, and leaves no key behind
        assert not store.exists("/m/n/o")
        store.put("/m/n/o/file", b"x")
        assert store.stat("/m/n/o").is_dir and store.stat("/m/n").is_dir
        store.mkdir("/m/n/o")  # exists: fine
        with pytest.raises(StoreExistsError):
            store.mkdir("/m/n/o/file")

    def test_file_and_directory_conflicts(self, store: Store) -> None:
        store.put("/c/dir/file", b"x")
        with pytest.raises(StorePreconditionError):
            store.put("/c/dir", b"y")
        with pytest.raises(StorePreconditionError):
            store.get("/c/dir")
        store.put("/c/file", b"x")
        store.put("/c/file/below", b"y")  # keys, not a tree: allowed
        assert store.get("/c/file") == b"x" and store.get("/c/file/below") == b"y"

    def make_directory(self, store: Store, path: str) -> None:
        store.put(f"{path}/inner", b"i")


class TestAlluxioNamespace(StoreConformance):
    """``alluxio://HOST:PORT/NAMESPACE`` against a server that itself serves a namespace."""

    @pytest.fixture
    def store(self, store_root: Path) -> Iterator[Store]:
        backing = LocalStore("local:///served", ttl_check_interval=0.05)
        server = StoreServer(backing, port=0).start()
        s = open_store(server.uri + "tenant")
        yield s
        s.close()
        server.shutdown()
        backing.close()
