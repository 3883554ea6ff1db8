"""The fsspec calls users make on :class:`~adcloud.store.filesystem.StoreFileSystem` beyond
plain reads and writes: seeking (pyarrow, pandas), ``read_block``, recursive ``get``/``put``/
``copy``, ``rm`` of a pattern, ``modified``; on ``local://`` and through an Alluxio proxy."""

from __future__ import annotations

import datetime
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from adcloud.store import LocalStore, StoreServer, open_store
from adcloud.store.errors import StoreCorruptionError
from adcloud.store.filesystem import StoreFileSystem, store_filesystem

DATA = bytes(range(256)) * 4096  # 1 MiB
NAME = "/d/a b#1?ü.bin"


@pytest.fixture(params=["local", "alluxio"])
def fs(request: pytest.FixtureRequest, store_root: Path) -> Iterator[StoreFileSystem]:
    """The filesystem of a local store, or of an Alluxio proxy serving one."""
    backing = LocalStore("local://")
    server = StoreServer(backing, port=0).start() if request.param == "alluxio" else None
    url = server.uri if server is not None else "local:///"
    filesystem, _ = store_filesystem(url, **({} if server else {"root": str(store_root)}))
    try:
        yield filesystem
    finally:
        filesystem.close()
        if server is not None:
            server.shutdown()
        backing.close()


def test_an_open_file_seeks_and_has_a_size(fs: StoreFileSystem) -> None:
    fs.pipe_file(NAME, DATA)
    with fs.open(NAME, "rb") as f:
        assert f.seekable()
        assert f.read(10) == DATA[:10]
        assert f.seek(-100, io.SEEK_END) == len(DATA) - 100
        assert f.read() == DATA[-100:]
        f.seek(5)
        assert f.read(3) == DATA[5:8] and f.tell() == 8
        f.seek(700_000)
        assert f.read(10) == DATA[700_000:700_010]
    with fs.open(NAME, "rb") as f:
        assert f.read() == DATA


def test_read_block_with_and_without_a_delimiter(fs: StoreFileSystem) -> None:
    fs.pipe_file("/t.csv", b"a,1\nbb,2\nccc,3\n")
    assert fs.read_block("/t.csv", 2, 3) == b"1\nb"
    assert fs.read_block("/t.csv", 1, 5, delimiter=b"\n") == b"bb,2\n"
    assert fs.read_block("/t.csv", 4, None) == b"bb,2\nccc,3\n"
    assert fs.read_block("/t.csv", 10, 100) == b"cc,3\n"


def test_pandas_reads_parquet_through_the_filesystem(fs: StoreFileSystem) -> None:
    pd = pytest.importorskip("pandas")
    pq = pytest.importorskip("pyarrow.parquet")
    frame = pd.DataFrame({"a": range(5000), "b": [f"x{i}" for i in range(5000)]})
    with fs.open("/p/x.parquet", "wb") as f:
        frame.to_parquet(f)
    with fs.open("/p/x.parquet", "rb") as f:
        assert pd.read_parquet(f).equals(frame)
    assert pq.read_table("/p/x.parquet", filesystem=fs).num_rows == 5000


def test_recursive_get_put_and_copy_keep_the_tree(fs: StoreFileSystem, tmp_path: Path) -> None:
    fs.pipe_file("/src/a.bin", b"a")
    fs.pipe_file("/src/sub dir/b#.bin", b"bb")
    fs.get("/src", str(tmp_path / "out"), recursive=True)
    assert (tmp_path / "out" / "a.bin").read_bytes() == b"a"
    assert (tmp_path / "out" / "sub dir" / "b#.bin").read_bytes() == b"bb"

    fs.put(str(tmp_path / "out"), "/back", recursive=True)
    assert sorted(fs.find("/back")) == ["/back/a.bin", "/back/sub dir/b#.bin"]

    fs.copy("/src", "/copy", recursive=True)
    assert fs.cat_file("/copy/sub dir/b#.bin") == b"bb"
    fs.copy("/src/a.bin", "/one.bin")
    assert fs.cat_file("/one.bin") == b"a"

    buffer = io.BytesIO()
    fs.get_file("/src/a.bin", buffer)
    assert buffer.getvalue() == b"a"


def test_a_download_that_breaks_off_leaves_no_partial_file(
    fs: StoreFileSystem, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs.pipe_file(NAME, DATA)
    target = tmp_path / "dl" / "got.bin"
    target.parent.mkdir()
    target.write_bytes(b"earlier")
    real_open = fs.store.open

    class Broken(io.RawIOBase):
        def __init__(self) -> None:
            self.left = 3

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
            self.left -= 1
            if not self.left:
                raise StoreCorruptionError(f"{NAME}: checksum mismatch")
            buffer[:10] = b"x" * 10
            return 10

    monkeypatch.setattr(
        fs.store, "open", lambda p, mode="rb", **kw: Broken() if mode == "rb" else real_open(p)
    )
    with pytest.raises(OSError, match="checksum mismatch"):
        fs.get_file(NAME, str(target))
    assert target.read_bytes() == b"earlier"
    assert [p.name for p in target.parent.iterdir()] == ["got.bin"]


def test_rm_of_a_pattern_deletes_what_it_matches(fs: StoreFileSystem) -> None:
    for name in ("/g/a.bag", "/g/b.bag", "/g/c.txt", "/g/s/d.bag"):
        fs.pipe_file(name, b"x")
    fs.rm("/g/*.bag")
    assert sorted(fs.find("/g")) == ["/g/c.txt", "/g/s/d.bag"]
    fs.pipe_file("/g/lit[1].bin", b"x")  # a name with glob characters is itself
    fs.rm("/g/lit[1].bin")
    assert not fs.exists("/g/lit[1].bin")
    with pytest.raises(FileNotFoundError, match="no path matches"):
        fs.rm("/g/*.nothing")


def test_modified_is_the_files_mtime_in_utc(fs: StoreFileSystem) -> None:
    fs.pipe_file(NAME, b"x")
    when = fs.modified(NAME)
    assert when.tzinfo is datetime.UTC
    assert when.timestamp() == pytest.approx(fs.info(NAME)["mtime"], abs=1e-3)


def test_the_urls_of_a_namespaced_store_open_again(store_root: Path, tmp_path: Path) -> None:
    """``unstrip_protocol`` names a path by its full URL, the store's namespace (or root
    directory) included; the filesystem takes that URL back to the same file."""
    backing = LocalStore("local://")
    server = StoreServer(backing, port=0).start()
    try:
        namespaced = [
            open_store(server.uri + "ns"),
            LocalStore("local:///ns2"),
            open_store("file:///"),
        ]
        for store in namespaced:
            fs = StoreFileSystem.over(store)
            path = f"{tmp_path}/d/f b#.bin" if store.uri.startswith("file") else "/d/f b#.bin"
            fs.pipe_file(path, b"abc")
            url = fs.unstrip_protocol(path)
            assert url.startswith(store.uri.rstrip("/") + "/")
            assert fs.cat_file(url) == b"abc"
            assert fs.ls(url.rsplit("/", 1)[0], detail=False) == [path]
            assert fs.glob(url.rsplit("/", 1)[0] + "/*") == [path]
            fs.close()
    finally:
        server.shutdown()
        backing.close()
