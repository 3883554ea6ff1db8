"""URIs, the backend registry and its install hints, store paths, sizes, and stores as
picklable descriptions (reopened in another process, as on a Spark executor)."""

from __future__ import annotations

import http.server
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from adcloud.errors import MissingComponentError
from adcloud.store import (
    AlluxioStore,
    FsspecStore,
    InvalidPathError,
    LocalStore,
    Store,
    StoreBackendMissingError,
    StoreError,
    StoreProtocolError,
    StoreUnavailableError,
    StoreUnsupportedError,
    WriteType,
    format_size,
    known_schemes,
    locate,
    normalize_path,
    open_store,
    parse_size,
    register_backend,
)
from tests.store.conftest import worker_env


def test_schemes_open_their_backends(tmp_path: Path) -> None:
    local = open_store("local://")
    assert isinstance(local, LocalStore) and isinstance(local, Store)
    local.close()
    remote = open_store("alluxio://proxy.example:39999/data")  # no connection until used
    assert isinstance(remote, AlluxioStore)
    assert remote.uri == "alluxio://proxy.example:39999/data"
    assert isinstance(open_store(f"file://{tmp_path}"), FsspecStore)
    assert isinstance(open_store("memory://"), FsspecStore)
    assert {"local", "alluxio", "file", "memory", "hdfs", "s3"} <= set(known_schemes())


def test_bad_uris() -> None:
    with pytest.raises(StoreError, match="not a store URI"):
        open_store("just/a/path")
    with pytest.raises(StoreError, match="no store backend for nope://"):
        open_store("nope://x")
    with pytest.raises(InvalidPathError, match="local:///NAMESPACE"):
        open_store("local://host/x")
    with pytest.raises(InvalidPathError, match="credentials"):
        open_store("alluxio://user:secret@host:39999/")
    for uri in ("alluxio://host:39999/ns#x", "alluxio://host:39999/ns?x=1"):
        with pytest.raises(InvalidPathError, match="not an Alluxio URI"):
            open_store(uri)  # was the namespace /ns, the rest dropped
    for port in ("abc", "99999"):  # a bare ValueError from urllib
        with pytest.raises(InvalidPathError, match=rf"the port '{port}' is no port number"):
            open_store(f"alluxio://host:{port}/")


def test_missing_optional_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    with pytest.raises(StoreBackendMissingError, match="pip install s3fs") as info:
        open_store("s3://bucket/prefix")
    assert isinstance(info.value, MissingComponentError)
    with pytest.raises(StoreBackendMissingError, match="paramiko"):
        open_store("sftp://host/x")  # an fsspec protocol adcloud does not list itself


def test_hdfs_without_a_hadoop_client_says_what_to_install() -> None:
    code = (
        "from adcloud.store import open_store, StoreBackendMissingError\n"
        "try:\n    open_store('hdfs://namenode:8020/drives')\n"
        "except StoreBackendMissingError as err:\n    print('HINT', err)\n"
    )
    env = worker_env()
    env.pop("JAVA_HOME", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert "HINT" in done.stdout, done.stderr[-2000:]
    assert "libhdfs" in done.stdout and "CLASSPATH" in done.stdout


def test_register_backend() -> None:
    register_backend("unittest-mem", "adcloud.store.fsspec_store:FsspecStore", hint="nothing")
    with pytest.raises(StoreError, match="already registered"):
        register_backend("unittest-mem", "x:y")
    register_backend("unittest-mem", "adcloud.store.fsspec_store:FsspecStore", clobber=True)


def test_locate() -> None:
    store, path = locate("local:///drives/d1/part-00000.binpipe")
    assert (store.uri, path) == ("local://", "/drives/d1/part-00000.binpipe")
    store.close()
    store, path = locate("alluxio://h:39999/a/b")
    assert (store.uri, path) == ("alluxio://h:39999/", "/a/b")
    store, path = locate("file:///tmp/x/y")
    assert (store.uri, path) == ("file:///", "/tmp/x/y")
    store, path = locate("memory://bucket/k")
    assert path == "/bucket/k"


@pytest.mark.parametrize(
    "url", ["local:///d/a#1.txt", "local:///d/a?v=2", "file:///tmp/d/a#1", "memory://d/a?x#y"]
)
def test_locate_keeps_question_marks_and_hashes_in_paths(url: str) -> None:
    # file names may hold them; dropping the rest as a URL query or fragment named another
    # file (/d/a), which a put then overwrote
    store, path = locate(url)
    store.close()
    assert path == "/" + url.split("://", 1)[1].lstrip("/")


@pytest.mark.parametrize(
    ("given", "expected"),
    [("a/b", "/a/b"), ("//a///b/", "/a/b"), ("/", "/"), ("", "/"), ("/ü/x y", "/ü/x y")],
)
def test_normalize_path(given: str, expected: str) -> None:
    assert normalize_path(given) == expected


@pytest.mark.parametrize(
    "bad", ["/a/..", "/./a", "a\x00", "/a\x7fb", "/" + "x" * 256, "/x" * 2100, "\udcff"]
)
def test_normalize_path_rejects(bad: str) -> None:
    with pytest.raises(InvalidPathError):
        normalize_path(bad)


def test_sizes() -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("4 KiB") == 4096
    with pytest.raises(StoreError, match="not a size"):
        parse_size("lots")
    # a capacity of "0.5" (no unit) was 0 bytes: the tier silently off
    with pytest.raises(StoreError, match=r"'0.5' is less than a byte; give a unit, e.g. 0.5GiB"):
        parse_size("0.5")
    assert parse_size("0") == 0
    assert format_size(1536) == "1.5 KiB"
    assert format_size(12) == "12 B"


def test_write_type_parsing() -> None:
    assert WriteType.parse("async-through") is WriteType.ASYNC_THROUGH
    assert WriteType.parse(WriteType.THROUGH) is WriteType.THROUGH
    with pytest.raises(StoreError, match="known: MUST_CACHE"):
        WriteType.parse("sometimes")


def test_local_store_reopens_in_another_process(store_root: Path) -> None:
    store = LocalStore("local:///ns", mem_capacity="1MiB")
    store.put("/x", b"shared by every process on the machine")
    blob = pickle.dumps(store)
    assert b"LocalStore" not in blob  # a description, not the object
    store.close()
    code = (
        "import pickle, sys\n"
        "store = pickle.loads(sys.stdin.buffer.read())\n"
        "print(store.uri, store.settings.mem_capacity, store.get('/x').decode())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=blob,
        capture_output=True,
        env=worker_env(),
        timeout=60,
        check=True,
    )
    assert done.stdout.decode().strip() == "local:///ns 1MiB shared by every process on the machine"


def test_alluxio_description_carries_no_secret_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADCLOUD_STORE_TOKEN", "from-env-secret")
    store = AlluxioStore("alluxio://h:39999/")
    assert b"from-env-secret" not in pickle.dumps(store)
    assert "secret" not in repr(store) and "secret" not in store.uri
    explicit = AlluxioStore("alluxio://h:39999/", token="explicit-token")
    assert pickle.loads(pickle.dumps(explicit)).options["token"] == "explicit-token"


def test_unreachable_proxy() -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = AlluxioStore(f"alluxio://127.0.0.1:{port}/", timeout=2)
    with pytest.raises(StoreUnavailableError, match="adcloud store serve"):
        store.exists("/x")


class _NotAlluxio(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"<h1>?</h1>"[:9])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def not_alluxio() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAlluxio)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_server_that_is_not_alluxio(not_alluxio: int) -> None:
    store = AlluxioStore(f"alluxio://127.0.0.1:{not_alluxio}/")
    with pytest.raises(StoreProtocolError, match="not an Alluxio error"):
        store.exists("/x")
    # what a real Alluxio 2.x proxy answers for adcloud's persist extension
    with pytest.raises(StoreUnsupportedError, match="alluxio fs persist"):
        store.persist("/x")
    store.close()


def test_store_env_isolated(store_root: Path) -> None:
    assert os.environ["ADCLOUD_STORE_ROOT"] == str(store_root)
