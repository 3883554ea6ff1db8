"""The conformance suite against every backend: local tiered, Alluxio over HTTP, file, memory."""

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
