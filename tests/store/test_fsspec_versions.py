"""fsspec stores on object storage report the version of each object (ETag or version id)
as ``FileStatus.checksum``, so readers tell a same-size replacement from the old file."""

from __future__ import annotations

import dataclasses
import os

import pytest

from adcloud.store import FileStatus, FsspecStore, open_store
from adcloud.store.filesystem import StoreFileSystem

DATA = os.urandom(64 * 1024)


def test_an_s3_object_reports_its_etag_and_a_new_version_a_new_one(s3_bucket: str) -> None:
    store = open_store(f"{s3_bucket}/v")
    assert isinstance(store, FsspecStore)
    try:
        store.put("/d/x.bin", DATA)
        first = store.stat("/d/x.bin")
        assert first.checksum is not None and first.checksum.startswith("etag:")
        assert '"' not in first.checksum
        [listed] = store.list("/d")
        assert listed.checksum == first.checksum  # a listing and a lookup agree
        store.put("/d/x.bin", DATA[::-1])
        second = store.stat("/d/x.bin")
        assert second.size == first.size and second.checksum != first.checksum
        assert store.stat("/d").checksum is None
    finally:
        store.close()


def test_a_same_size_replacement_within_a_second_is_not_read_from_a_kept_stream(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 keeps modification times in whole seconds and the store reported no checksum,
    so a reader that kept its stream read on in the replaced object."""
    store = open_store(f"{s3_bucket}/kept")
    stat = store.stat

    def coarse(path: str) -> FileStatus:
        return dataclasses.replace(stat(path), mtime=1.0)  # both versions in one second

    monkeypatch.setattr(store, "stat", coarse)
    fs = StoreFileSystem.over(store)
    try:
        store.put("/r/x.bin", DATA)
        assert fs.cat_file("/r/x.bin", start=0, end=10) == DATA[:10]
        store.put("/r/x.bin", DATA[::-1])
        assert fs.cat_file("/r/x.bin", start=100, end=110) == DATA[::-1][100:110]
    finally:
        fs.close()
        store.close()


def test_filesystems_without_versions_report_none() -> None:
    store = open_store("memory://versions")
    try:
        store.put("/a", b"x")
        assert store.stat("/a").checksum is None
    finally:
        store.close()
