"""``adcloud store serve``: the Alluxio REST protocol (checked with the real ``alluxio`` 0.1.x
client), and the server as a network service: token, loopback, path confinement, bounds,
malformed and hostile requests (a fuzzing client)."""

from __future__ import annotations

import http.client
import json
import random
import re
import select
import socket
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from adcloud.store import (
    AlluxioStore,
    LocalStore,
    ServerLimits,
    StoreAuthError,
    StoreError,
    StoreExistsError,
    StoreFullError,
    StoreNotFoundError,
    StoreServer,
    WriteType,
    open_store,
)


def raw(
    address: tuple[str, int],
    data: bytes,
    *,
    half_close: bool = True,
    timeout: float = 5.0,
) -> bytes:
    """Send raw bytes to the server and return everything it answers until it closes."""
    with socket.create_connection(address, timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        chunks = []
        try:
            while True:
                piece = sock.recv(65536)
                if not piece:
                    break
                chunks.append(piece)
        except (TimeoutError, OSError):
            pass
    return b"".join(chunks)


def request(
    method: str,
    target: str,
    body: bytes = b"",
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(answer: bytes) -> tuple[int, dict[str, object] | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    code = int(head.split(b" ", 2)[1])
    try:
        return code, json.loads(body)
    except ValueError:
        return code, None


@pytest.fixture
def small_server(store_root: Path) -> Iterator[tuple[StoreServer, LocalStore]]:
    store = LocalStore("local://")
    limits = ServerLimits(
        max_json_bytes=1024,
        max_request_bytes=64 << 10,
        max_file_bytes=100 << 10,
        max_streams=4,
        max_connections=3,
        stream_idle_timeout=0.4,
        socket_timeout=0.5,
    )
    server = StoreServer(store, port=0, token="tok", limits=limits).start()
    yield server, store
    server.shutdown()
    store.close()


# -- the protocol, as the alluxio 0.1.x client speaks it --------------------------------------


def test_alluxio_py_client_against_the_server(served: tuple[StoreServer, str]) -> None:
    import alluxio  # noqa: PLC0415 - a dev dependency (pyproject [dev]); never skipped
    from alluxio import exceptions, option, wire  # noqa: PLC0415

    server, token = served
    client = alluxio.Client(*server.address)
    client.session.headers["Authorization"] = f"Bearer {token}"

    opt = option.CreateFile(write_type=wire.WRITE_TYPE_CACHE_THROUGH, ttl=3_600_000)
    with client.open("/alx/data.bin", "w", opt) as writer:
        assert writer.write(b"0123456789" * 1000) == 10_000
    with client.open("/alx/data.bin", "r") as reader:
        assert reader.read(10) == b"0123456789"
    with client.open("/alx/data.bin", "r") as reader:
        assert reader.read() == b"0123456789" * 1000

    status = client.get_status("/alx/data.bin")
    assert (status.path, status.name, status.length, status.folder) == (
        "/alx/data.bin",
        "data.bin",
        10_000,
        False,
    )
    assert status.persisted and status.persistence_state.name == "PERSISTED"
    assert status.ttl == 3_600_000 and status.ttl_action.name == "DELETE"
    assert status.in_memory_percentage == 100
    assert status.file_block_infos[0].block_info.locations[0].tier_alias == "MEM"

    client.create_directory("/alx/dir", option.CreateDirectory(recursive=True))
    with pytest.raises(exceptions.AlreadyExistsError):
        client.create_directory("/alx/dir")
    assert client.ls("/alx") == ["data.bin", "dir"]
    assert client.exists("/alx/data.bin") and not client.exists("/alx/none")
    with pytest.raises(exceptions.NotFoundError):
        client.get_status("/alx/none")

    client.set_attribute("/alx/data.bin", option.SetAttribute(pinned=True))
    assert client.get_status("/alx/data.bin").pinned
    with pytest.raises(exceptions.FailedPreconditionError):
        client.free("/alx/data.bin")  # pinned
    client.set_attribute("/alx/data.bin", option.SetAttribute(pinned=False, ttl=-1))
    assert client.get_status("/alx/data.bin").ttl == -1
    client.free("/alx/data.bin")
    assert client.get_status("/alx/data.bin").in_memory_percentage == 0

    with client.open(
        "/alx/must", "w", option.CreateFile(write_type=wire.WRITE_TYPE_MUST_CACHE)
    ) as w:
        w.write(b"m")
    assert not client.get_status("/alx/must").persisted
    with pytest.raises(exceptions.AlreadyExistsError):
        client.create_file("/alx/must")

    client.rename("/alx/data.bin", "/alx/dir/moved.bin")
    assert [s.name for s in client.list_status("/alx/dir")] == ["moved.bin"]
    with client.open("/alx/dir/moved.bin", "r") as reader:
        assert reader.read() == b"0123456789" * 1000  # from the under-store
    client.delete("/alx", option.Delete(recursive=True))
    assert not client.exists("/alx")


def test_backend_and_client_interoperate(served: tuple[StoreServer, str]) -> None:
    import alluxio  # noqa: PLC0415 - a dev dependency (pyproject [dev]); never skipped

    server, token = served
    store = AlluxioStore(server.uri, token=token)
    store.put("/x/from-backend", b"adcloud", write_type=WriteType.ASYNC_THROUGH, pinned=True)
    client = alluxio.Client(*server.address)
    client.session.headers["Authorization"] = f"Bearer {token}"
    with client.open("/x/from-backend", "r") as reader:
        assert reader.read() == b"adcloud"
    assert client.get_status("/x/from-backend").pinned
    with client.open("/x/from-client", "w") as writer:
        writer.write(b"alluxio-py")
    assert store.get("/x/from-client") == b"alluxio-py"
    # a missing file is named as the client's user sees the store, not by the served one
    with pytest.raises(StoreNotFoundError) as missing:
        store.get("/x/nope")
    assert "/x/nope does not exist" in str(missing.value)
    assert server.store.uri not in str(missing.value)
    store.close()


def test_download_file(served: tuple[StoreServer, str]) -> None:
    server, token = served
    server.store.put("/dl/f", b"bytes to download")
    answer = raw(server.address, request("GET", "/api/v1/paths//dl/f/download-file", token=token))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    assert body == b"11\r\nbytes to download\r\n0\r\n\r\n"
    old_client = request("GET", "/api/v1/paths//dl/f/download-file", token=token)
    answer = raw(server.address, old_client.replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    assert answer.partition(b"\r\n\r\n")[2] == b"bytes to download"  # ends with the connection


def test_corrupt_data_never_reaches_a_client_as_a_short_file(store_root: Path) -> None:
    store = LocalStore("local://", verify_reads="all")
    store.put("/c", b"x" * 3_000_000, write_type=WriteType.MUST_CACHE)
    (obj,) = [p for p in (store_root / "mem/objects").rglob("*") if p.is_file()]
    obj.write_bytes(b"y" * 3_000_000)
    with StoreServer(store, port=0).start() as server:
        client = AlluxioStore(server.uri)
        with pytest.raises(StoreError):
            client.get("/c")
        with pytest.raises(StoreError), client.open("/c") as stream:
            stream.read()
        client.close()
    store.close()


# -- a network service ---------------------------------------------------------------------


def test_binds_loopback_by_default(local_store: LocalStore) -> None:
    with StoreServer(local_store, port=0) as server:
        assert server.address[0] == "127.0.0.1"


def test_token_is_required(served: tuple[StoreServer, str]) -> None:
    server, token = served
    server.store.put("/secret", b"s")
    for auth in (None, "wrong", token + "x", ""):
        answer = raw(
            server.address, request("POST", "/api/v1/paths//secret/get-status", token=auth)
        )
        code, body = status_of(answer)
        assert code == 401 and body == {"statusCode": "UNAUTHENTICATED", "message": body["message"]}  # type: ignore[index]
    answer = raw(
        server.address,
        request(
            "POST", "/api/v1/paths//secret/get-status", headers={"Authorization": f"Basic {token}"}
        ),
    )
    assert status_of(answer)[0] == 401
    with pytest.raises(StoreAuthError):
        AlluxioStore(server.uri, token="wrong").exists("/secret")
    assert (
        status_of(
            raw(server.address, request("POST", "/api/v1/paths//secret/get-status", token=token))
        )[0]
        == 200
    )


def test_paths_are_confined(
    served: tuple[StoreServer, str], store_root: Path, tmp_path: Path
) -> None:
    server, token = served
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not read")
    for target in (
        "/api/v1/paths//../../etc/passwd/get-status",
        "/api/v1/paths//a/%2e%2e/%2e%2e/etc/create-file",
        "/api/v1/paths/%2F..%2F..%2Fetc/exists",
        "/api/v1/paths//a/%00/create-file",
        "/api/v1/paths//a%0d%0aInjected:%20x/create-file",
        "/api/v1/paths//ok/rename?dst=/../../escape",
    ):
        code, body = status_of(raw(server.address, request("POST", target, b"{}", token=token)))
        assert (
            code == 500
            and body is not None
            and body["statusCode"]
            in (
                "INVALID_ARGUMENT",
                "NOT_FOUND",
            )
        ), (target, body)
    # a symlink planted inside the under-store cannot lead a write out of it
    ufs = store_root / "ufs"
    (ufs / "link").symlink_to(outside, target_is_directory=True)
    backend = AlluxioStore(server.uri, token=token)
    with pytest.raises(Exception, match="outside"):
        backend.put("/link/new", b"escape", write_type=WriteType.THROUGH)
    # a deep key: the directories below the link are not made before the check either
    with pytest.raises(Exception, match="outside"):
        backend.put("/link/made/by/client/f", b"escape", write_type=WriteType.THROUGH)
    with pytest.raises(Exception, match="does not exist"):
        backend.get("/link/secret")
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert not (tmp_path / "escape").exists()
    backend.close()


def test_an_empty_token_is_refused(local_store: LocalStore) -> None:
    for token in ("", " \n"):
        with pytest.raises(StoreError, match=r"token is empty.*token=None"):
            StoreServer(local_store, port=0, token=token)


def test_options_must_be_json_booleans(served: tuple[StoreServer, str]) -> None:
    server, token = served
    store = server.store
    store.put("/opt/d/f", b"keep me")

    def call(path: str, action: str, options: object) -> tuple[int, dict[str, object] | None]:
        body = json.dumps(options).encode()
        target = f"/api/v1/paths/{path}/{action}"
        return status_of(raw(server.address, request("POST", target, body, token=token)))

    for path, action, name, value in (
        ("/opt", "delete", "recursive", "false"),
        ("/opt", "delete", "recursive", 1),
        ("/opt/d/f", "set-attribute", "pinned", "x"),
        ("/opt/d/f", "set-attribute", "persisted", "true"),
        ("/opt/d/f", "free", "forced", "no"),
        ("/opt", "list-status", "recursive", [True]),
        ("/opt/d/f", "create-file", "overwrite", "yes"),
        ("/opt/d", "create-directory", "allowExists", 0),
    ):
        code, body = call(path, action, {name: value})
        assert code == 400, (action, name, value, body)
        assert body is not None and body["statusCode"] == "INVALID_ARGUMENT"
        assert repr(name) in str(body["message"])
    assert store.get("/opt/d/f") == b"keep me"
    assert not store.stat("/opt/d/f").pinned
    # null and absent mean the default; real booleans work
    code, body = call("/opt", "delete", {"recursive": None})
    assert code == 500 and body is not None and body["statusCode"] == "FAILED_PRECONDITION"
    assert call("/opt/d/f", "set-attribute", {"pinned": True})[0] == 200
    assert store.stat("/opt/d/f").pinned
    assert call("/opt", "delete", {"recursive": True})[0] == 200
    assert not store.exists("/opt")


def test_a_body_on_a_get_is_never_read_as_a_request(served: tuple[StoreServer, str]) -> None:
    server, token = served
    server.store.put("/dl/f", b"data")
    smuggled = request("POST", "/api/v1/paths//smuggled/create-directory", b"{}", token=token)
    head = (
        "GET /api/v1/paths//dl/f/download-file HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {len(smuggled)}\r\n\r\n"
    )
    answer = raw(server.address, head.encode() + smuggled)  # keep-alive, then half-closed
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 200")
    assert answer.endswith(b"4\r\ndata\r\n0\r\n\r\n")
    assert not server.store.exists("/smuggled")
    # a body over the JSON bound is refused (and the connection closed) before it is read
    big = head.replace(f"Content-Length: {len(smuggled)}", "Content-Length: 2000000")
    assert status_of(raw(server.address, big.encode()))[0] == 413


def test_closed_readers_release_their_connections(served: tuple[StoreServer, str]) -> None:
    server, token = served
    backend = AlluxioStore(server.uri, token=token)
    backend.put("/r/f", b"read me")
    for _ in range(50):
        with backend.open("/r/f") as stream:
            assert stream.read() == b"read me"
    assert len(backend._conns) <= 1  # the thread's keep-alive connection at most
    backend.close()


def _open_streams_drop_to_zero(server: StoreServer, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while server._streams and time.monotonic() < deadline:
        time.sleep(0.02)
    return not server._streams


def test_read_streams_end_when_their_readers_close_them(store_root: Path) -> None:
    """A reader's close can reach the server while its read's request still holds the
    stream (the body sent, the request not yet finished), and a reader that stops early cuts
    its body off: either way the stream ends now, not after it idles out, so a few readers
    cannot use up max_streams."""
    store = LocalStore("local://")
    limits = ServerLimits(max_streams=4)
    server = StoreServer(store, port=0, token="tok", limits=limits).start()
    backend = AlluxioStore(server.uri, token="tok")
    try:
        store.put("/small", b"read me whole")
        big = bytes(range(256)) * (128 << 10)  # 32 MiB: more than the socket buffers hold
        store.put("/big", big)
        for _ in range(200):
            with backend.open("/small") as stream:
                assert stream.read() == b"read me whole"
        assert _open_streams_drop_to_zero(server), [s.path for s in server._streams.values()]
        for _ in range(8):
            with backend.open("/big") as stream:
                assert stream.read(10) == big[:10]
            assert _open_streams_drop_to_zero(server), "a reader that stopped early"
        assert backend.get("/big") == big  # the stream it read went on from its start
    finally:
        backend.close()
        server.shutdown()
        store.close()


def test_the_close_of_a_stream_whose_read_broke_off_succeeds(store_root: Path) -> None:
    """The alluxio-py client reads 10 bytes of a streamed body, drops the connection and
    closes the stream: when the server had found the body cut off first (and ended the
    stream), that close failed with NOT_FOUND "stream ... does not exist" -- now and then,
    as the two requests raced."""
    store = LocalStore("local://")
    server = StoreServer(store, port=0, token="tok").start()
    backend = AlluxioStore(server.uri, token="tok")
    try:
        store.put("/big", bytes(range(256)) * (128 << 10))  # 32 MiB: beyond socket buffers
        ident = backend._path_call("/big", "open-file", {})
        conn = http.client.HTTPConnection(*server.address, timeout=10)
        conn.request(
            "POST", f"/api/v1/streams/{ident}/read", headers={"Authorization": "Bearer tok"}
        )
        response = conn.getresponse()
        assert response.status == 200 and response.read(10) == bytes(range(10))
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert _open_streams_drop_to_zero(server), "the server never found the body cut off"
        backend._call(f"/api/v1/streams/{ident}/close")  # what the client meant: no error
        with pytest.raises(StoreNotFoundError, match=f"stream {ident} does not exist"):
            backend._call(f"/api/v1/streams/{ident}/close")  # but only once
    finally:
        backend.close()
        server.shutdown()
        store.close()


def test_errors_do_not_show_the_servers_directories(store_root: Path) -> None:
    store = LocalStore("local://", mem_capacity="1KiB", ssd_capacity="1KiB", hdd_capacity="1KiB")
    with StoreServer(store, port=0).start() as server:
        client = AlluxioStore(server.uri)
        with pytest.raises(StoreFullError) as caught:
            client.put("/a b/ü.bin", bytes(5000), write_type=WriteType.MUST_CACHE)
        said = str(caught.value)
        assert "cannot place /a b/ü.bin" in said  # the client's own path, as it gave it
        assert "MEM 0 B of 1.0 KiB used (<MEM tier>)" in said
        assert str(store_root) not in said and "/mem" not in said
        client.close()
    store.close()


def test_a_path_being_written_cannot_be_created_again_without_overwrite(
    served: tuple[StoreServer, str],
) -> None:
    """As Alluxio: a create-file without overwrite of a file still being written is refused
    (both writers succeeding, the later close silently replacing the earlier file, was)."""
    server, token = served
    client = AlluxioStore(server.uri, token=token)
    first = client._path_call("/w/x", "create-file", {})
    with pytest.raises(StoreExistsError, match=r"/w/x is being written by another stream"):
        client._path_call("/w/x", "create-file", {})
    second = client._path_call("/w/x", "create-file", {"overwrite": True})
    client._call(f"/api/v1/streams/{first}/cancel")
    client._call(f"/api/v1/streams/{second}/cancel")
    third = client._path_call("/w/x", "create-file", {})  # no writer left
    client._call(f"/api/v1/streams/{third}/cancel")
    # the backend's put replaces (with overwrite): concurrent puts all succeed, one wins whole
    payloads = [bytes([i]) * 100_000 for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda data: client.put("/w/y", data), payloads))
    assert client.get("/w/y") in payloads
    client.close()


def test_sizes_are_bounded(small_server: tuple[StoreServer, LocalStore]) -> None:
    server, store = small_server
    addr = server.address
    big_json = json.dumps({"x": "y" * 2000}).encode()
    code, body = status_of(
        raw(addr, request("POST", "/api/v1/paths//j/create-file", big_json, token="tok"))
    )
    assert code == 413 and body is not None and body["statusCode"] == "RESOURCE_EXHAUSTED"
    huge = request("POST", "/api/v1/paths//j/exists", token="tok").replace(
        b"Content-Length: 0", b"Content-Length: 999999999999999"
    )
    assert status_of(raw(addr, huge))[0] == 413

    backend = AlluxioStore(server.uri, token="tok", chunk_size=32 << 10)
    backend.put("/ok", b"x" * (90 << 10))  # several write requests under both bounds
    assert store.get("/ok") == b"x" * (90 << 10)
    with pytest.raises(Exception, match="over"):
        backend.put("/too-big-file", b"x" * (120 << 10))
    assert not store.exists("/too-big-file")
    one_request = AlluxioStore(server.uri, token="tok", chunk_size=1 << 20)
    with pytest.raises(Exception, match="over"):
        one_request.put("/too-big-request", b"x" * (80 << 10))
    assert not store.exists("/too-big-request")

    streams = [backend.open(f"/s{i}", "wb") for i in range(4)]
    with pytest.raises(StoreFullError, match=r"4 streams already open .*--max-streams"):
        backend.open("/s5", "wb")
    for s in streams:
        s.close()
    backend.close()
    one_request.close()


def test_a_write_refused_mid_body_reports_the_servers_answer(store_root: Path) -> None:
    # The bodies are far bigger than the socket buffers, so the server answers and closes
    # while the client is still sending: the client's send breaks (EPIPE or reset), and the
    # answer already sent must be what it reports, every time -- not "cannot reach".
    store = LocalStore("local://")
    limits = ServerLimits(max_request_bytes=16 << 20, max_file_bytes=1 << 20)
    server = StoreServer(store, port=0, token="tok", limits=limits).start()
    backend = AlluxioStore(server.uri, token="tok", chunk_size=4 << 20)
    try:
        backend.put("/f", b"kept")
        for _ in range(5):
            with pytest.raises(StoreFullError, match=f"write /f: file over {1 << 20} bytes"):
                backend.put("/f", bytes(6 << 20))
            assert store.get("/f") == b"kept"
        one_request = AlluxioStore(server.uri, token="tok", chunk_size=32 << 20)
        try:
            for _ in range(5):
                with pytest.raises(StoreFullError, match=f"request body over {16 << 20} bytes"):
                    one_request.put("/f", bytes(20 << 20))
                assert store.get("/f") == b"kept"
        finally:
            one_request.close()
    finally:
        backend.close()
        server.shutdown()
        store.close()


def test_idle_and_interrupted_streams_are_never_published(
    small_server: tuple[StoreServer, LocalStore],
) -> None:
    server, store = small_server
    backend = AlluxioStore(server.uri, token="tok")
    idle = backend.open("/idle", "wb")
    idle.write(b"abandoned")
    time.sleep(1.5)
    with pytest.raises(Exception, match="does not exist"):
        idle.close()
    assert not store.exists("/idle")

    ident = backend._path_call("/cut", "create-file", {})
    cut = request("POST", f"/api/v1/streams/{ident}/write", b"only ten b", token="tok").replace(
        b"Content-Length: 10", b"Content-Length: 1000"
    )
    raw(server.address, cut)  # the body stops after 10 of 1000 bytes
    with pytest.raises(Exception, match="does not exist"):
        backend._call(f"/api/v1/streams/{ident}/close")
    assert not store.exists("/cut")
    backend.close()


def test_malformed_framing(small_server: tuple[StoreServer, LocalStore]) -> None:
    server, _ = small_server
    addr = server.address
    smuggle = (
        b"POST /api/v1/paths//a/exists HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    assert status_of(raw(addr, smuggle))[0] == 400
    bad_chunk = (
        b"POST /api/v1/paths//a/exists HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    )
    assert status_of(raw(addr, bad_chunk))[0] == 400
    good_chunk = (
        b"POST /api/v1/paths//a/exists HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    assert status_of(raw(addr, good_chunk)) == (200, False)
    assert (
        status_of(raw(addr, request("POST", "/api/v1/paths//a/exists", b"[1]", token="tok")))[0]
        == 400
    )
    assert (
        status_of(raw(addr, request("POST", "/api/v1/paths//a/exists", b"{bad", token="tok")))[0]
        == 400
    )
    assert status_of(raw(addr, request("POST", "/api/v1/nothing", token="tok")))[0] == 404
    assert status_of(raw(addr, request("PUT", "/api/v1/paths//a/exists", token="tok")))[0] == 405
    assert status_of(raw(addr, request("POST", "/api/v1/streams/abc/read", token="tok")))[0] == 400
    assert raw(addr, b"\x00\xff garbage\r\n\r\n").startswith(b"HTTP/1.")
    long_header = request(
        "POST", "/api/v1/paths//a/exists", token="tok", headers={"X": "y" * 70000}
    )
    assert status_of(raw(addr, long_header))[0] in (400, 431)


def test_connection_limit(small_server: tuple[StoreServer, LocalStore]) -> None:
    server, _ = small_server
    idle = [socket.create_connection(server.address) for _ in range(3)]
    try:
        time.sleep(0.1)
        answer = raw(server.address, request("POST", "/api/v1/paths//a/exists", token="tok"))
        assert status_of(answer)[0] == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        answer = raw(server.address, request("POST", "/api/v1/paths//a/exists", token="tok"))
        if status_of(answer)[0] == 200:
            break
        time.sleep(0.1)
    assert status_of(answer) == (200, False)


def test_serves_any_store(store_root: Path) -> None:
    memory = open_store("memory:///served-by-proxy")
    with StoreServer(memory, port=0).start() as server:
        backend = AlluxioStore(server.uri)
        backend.put("/m/x", b"in memory")
        assert backend.get("/m/x") == b"in memory"
        assert backend.stat("/m/x").tier is None
        backend.close()
    memory.delete("/", recursive=True)


# -- a fuzzing client ---------------------------------------------------------------------------

_SEGMENTS = ["a", "b", "fz", "x y", "ü", "~", "*", "%41", "a" * 300]
_BAD_SEGMENTS = ["..", ".", "%2e%2e", "%00", "%zz", "", "%0a", "\\"]


def _segment(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return rng.choice(_BAD_SEGMENTS)
    segment = rng.choice(_SEGMENTS)
    return urllib.parse.quote(segment) if rng.random() < 0.9 else segment


_ACTIONS = [
    "create-file",
    "open-file",
    "create-directory",
    "delete",
    "exists",
    "free",
    "get-status",
    "list-status",
    "rename",
    "set-attribute",
    "persist",
    "mount",
    "download-file",
    "",
    "nope",
]
_METHODS = ["POST"] * 8 + ["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "FOO", "", "POST /x"]


def _fuzz_target(rng: random.Random, streams: list[int]) -> str:
    kind = rng.random()
    if kind < 0.6:
        path = "/".join(_segment(rng) for _ in range(rng.randint(0, 4)))
        target = f"/api/v1/paths//fz/{path}/{rng.choice(_ACTIONS)}"
        if rng.random() < 0.2:
            target += "?dst=/fz/" + _segment(rng) + "&dst=" + _segment(rng)
        return target
    if kind < 0.85:
        ident = rng.choice(streams) if streams and rng.random() < 0.6 else rng.randint(-5, 2**40)
        action = rng.choice(["write", "read", "close", "cancel", "x", ""])
        return f"/api/v1/streams/{ident}/{action}"
    return rng.choice(
        [
            "/",
            "*",
            "/api/v1",
            "/api/v1/paths",
            "/api/v1/paths/",
            "/%",
            "/api/v1/proxy/info",
            "x" * 5000,
        ]
    )


def _fuzz_body(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.3:
        return b""
    if kind < 0.8:
        value = rng.choice(
            [
                {"writeType": rng.choice(["MUST_CACHE", "THROUGH", "bogus", 7, None])},
                {"recursive": rng.choice([True, "yes", 1])},
                {
                    "ttl": rng.choice([1, -1, "x", 10**30, 0.5]),
                    "ttlAction": rng.choice(["FREE", 3]),
                },
                {"commonOptions": rng.choice([{"ttl": 5}, [], "x"])},
                {"pinned": rng.choice([True, False, "x"]), "persisted": rng.choice([True, 1])},
                {"overwrite": True},
                [1, 2],
                "string",
                None,
            ]
        )
        return json.dumps(value).encode()
    return rng.randbytes(rng.randint(1, 3000))


def _plausible_request(rng: random.Random, token: str, streams: list[int]) -> bytes:
    """A well-framed request with a valid path and options, to reach the store itself."""
    path = "/fz/" + "/".join(rng.choice(["a", "b", "c"]) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.7:
        action = rng.choice(_ACTIONS[:11])
        target = f"/api/v1/paths/{path}/{action}"
        if action == "rename":
            target += f"?dst=/fz/{rng.choice(['a', 'b', 'c', 'd'])}"
        body = _fuzz_body(rng) if rng.random() < 0.3 else b"{}"
    else:
        action = rng.choice(["write", "read", "close", "cancel"])
        target = f"/api/v1/streams/{rng.choice(streams)}/{action}"
        body = rng.randbytes(rng.randint(0, 5000)) if action == "write" else b""
    return request("POST", target, body, token=token)


def _fuzz_request(rng: random.Random, token: str, streams: list[int]) -> tuple[bytes, bool]:
    if rng.random() < 0.25:
        return _plausible_request(rng, token, streams), False
    method = rng.choice(_METHODS)
    target = _fuzz_target(rng, streams)
    body = _fuzz_body(rng)
    headers = [f"{method} {target} HTTP/1.{rng.choice([0, 1, 1, 1])}", "Host: fuzz"]
    if rng.random() < 0.85:
        headers.append(f"Authorization: Bearer {token}")
    framing = rng.random()
    truncated = False
    if framing < 0.55:
        headers.append(f"Content-Length: {len(body)}")
    elif framing < 0.65:
        headers.append(f"Content-Length: {len(body) + rng.randint(1, 10_000)}")  # truncated
        truncated = True
    elif framing < 0.72:
        headers.append(
            f"Content-Length: {rng.choice(['-1', 'abc', '1e9', '99999999999999999999', ' 12'])}"
        )
    elif framing < 0.82:
        headers.append("Transfer-Encoding: chunked")
        if rng.random() < 0.5:
            body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        else:
            body = rng.choice([b"zz\r\n", b"ffffffffffffffffff\r\n", b"5\r\nab", body])
    elif framing < 0.87:
        headers.append(f"Content-Length: {len(body)}")
        headers.append("Transfer-Encoding: chunked")
    for _ in range(rng.randint(0, 3)):
        headers.append(
            rng.choice(
                [
                    "X-Junk: \x01\x02",
                    "Expect: 100-continue",
                    "Connection: keep-alive",
                    ": empty",
                    "NoColon",
                ]
            )
        )
    head = "\r\n".join(headers).encode("utf-8", "surrogatepass") + b"\r\n\r\n"
    if rng.random() < 0.05:
        head = rng.randbytes(rng.randint(1, 200))
    return head + body, truncated


@pytest.fixture
def fuzz_server(store_root: Path) -> Iterator[tuple[StoreServer, LocalStore]]:
    store = LocalStore("local://")
    limits = ServerLimits(
        max_json_bytes=1024,
        max_request_bytes=64 << 10,
        max_file_bytes=100 << 10,
        max_streams=8,
        max_connections=16,
        stream_idle_timeout=2.0,
        socket_timeout=0.5,
    )
    server = StoreServer(store, port=0, token="tok", limits=limits).start()
    yield server, store
    server.shutdown()
    store.close()


def test_fuzzing_client_cannot_hurt_stored_data(
    fuzz_server: tuple[StoreServer, LocalStore],
) -> None:
    server, store = fuzz_server
    backend = AlluxioStore(server.uri, token="tok", chunk_size=16 << 10)
    rng = random.Random(20261121)
    protected = {}
    for i, wt in enumerate(WriteType):
        data = rng.randbytes(20_000 + i)
        backend.put(f"/keep/{wt.value.lower()}.bin", data, write_type=wt)
        protected[f"/keep/{wt.value.lower()}.bin"] = zlib.crc32(data)
    backend.put("/keep/pinned.bin", b"pinned", pinned=True)
    protected["/keep/pinned.bin"] = zlib.crc32(b"pinned")
    streams = [int(backend._path_call(f"/fz/s{i}", "create-file", {})) for i in range(2)]
    lock = threading.Lock()
    answered = {"n": 0}

    def one(seed: int) -> int:
        local = random.Random(seed)
        data, truncated = _fuzz_request(local, "tok", streams)
        answer = raw(
            server.address, data, half_close=not truncated or local.random() < 0.5, timeout=3
        )
        if not answer:
            return 0
        with lock:
            answered["n"] += 1
        found = [int(c) for c in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer) if c != b"100"]
        return found[0] if found else -1

    with ThreadPoolExecutor(max_workers=3) as pool:
        codes = list(pool.map(one, [rng.randrange(2**32) for _ in range(600)]))
    assert answered["n"] > 300
    # the storm reached the store operations, not only the HTTP parser
    assert codes.count(200) >= 25 and codes.count(500) >= 20 and codes.count(400) >= 40

    # still serving, and nothing stored before the storm changed
    info = raw(server.address, request("GET", "/api/v1/proxy/info", token="tok"))
    assert status_of(info)[0] == 200
    # streams the storm left open are reaped when idle; then reads through the proxy work
    deadline = time.monotonic() + 15
    while True:
        try:
            first = backend.get("/keep/pinned.bin")
            break
        except StoreFullError:
            assert time.monotonic() < deadline, "idle streams were never reaped"
            time.sleep(0.2)
    assert first == b"pinned"
    for path, crc in protected.items():
        assert zlib.crc32(backend.get(path)) == crc, path
        assert zlib.crc32(store.get(path)) == crc, path
    assert store.stat("/keep/pinned.bin").pinned
    assert {s.path for s in store.list("/keep")} == set(protected)
    backend.close()


def test_http_client_keepalive_survives_server_errors(served: tuple[StoreServer, str]) -> None:
    server, token = served
    conn = http.client.HTTPConnection(*server.address, timeout=5)
    headers = {"Authorization": f"Bearer {token}"}
    for _ in range(3):
        conn.request("POST", "/api/v1/paths//none/get-status", body=b"{}", headers=headers)
        response = conn.getresponse()
        assert response.status == 500
        assert json.loads(response.read())["statusCode"] == "NOT_FOUND"
    conn.request("POST", "/api/v1/paths///exists", body=b"", headers=headers)
    assert json.loads(conn.getresponse().read()) is True
    conn.close()


def test_a_served_namespace_is_all_a_client_can_reach(store_root: Path) -> None:
    outer = LocalStore("local://")
    outer.put("/private/secret", b"not for clients")
    served = LocalStore("local:///shared")
    with StoreServer(served, port=0).start() as server:
        client = AlluxioStore(server.uri)
        client.put("/x", b"in the namespace")
        assert outer.get("/shared/x") == b"in the namespace"
        assert [s.path for s in client.list("/")] == ["/x"]
        for target in (
            "/api/v1/paths//..%2Fprivate%2Fsecret/get-status",
            "/api/v1/paths//../private/secret/open-file",
            "/api/v1/paths//x/rename?dst=/../private/stolen",
        ):
            code, body = status_of(raw(server.address, request("POST", target)))
            assert code == 500 and body is not None and body["statusCode"] == "INVALID_ARGUMENT"
        assert not client.exists("/private/secret")
        client.close()
    assert outer.get("/private/secret") == b"not for clients"
    assert not outer.exists("/private/stolen")
    served.close()
    outer.close()


def _trickle(sock: socket.socket, data: bytes, every: float, limit: float) -> float:
    """Send ``data`` a byte every ``every`` s until the server closes the connection or
    ``limit`` s pass; the seconds until it closed (``limit`` when it never did)."""
    began = time.monotonic()
    for byte in data:
        if time.monotonic() - began > limit:
            break
        try:
            sock.sendall(bytes([byte]))
            readable, _, _ = select.select([sock], [], [], every)
            if readable and not sock.recv(65536):
                return time.monotonic() - began
        except OSError:
            return time.monotonic() - began
    return limit


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_client_trickling_its_request_is_cut_off(store_root: Path, part: str) -> None:
    """A request that arrives a byte at a time -- each byte well within the socket timeout
    -- holds a connection slot only until its deadline, and is never acted on."""
    store = LocalStore("local://")
    limits = ServerLimits(
        max_connections=2, socket_timeout=1.0, header_timeout=1.5, min_body_rate=1000.0
    )
    server = StoreServer(store, port=0, token="tok", limits=limits).start()
    try:
        store.put("/keep/a.bin", b"precious")
        body = json.dumps({"recursive": True}).encode() + b" " * 200
        data = request("POST", "/api/v1/paths/keep/delete", body, token="tok")
        split = len(data) - len(body) if part == "body" else 0
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(data[:split])  # the body case: every header at once
            took = _trickle(sock, data[split:], 0.3, 20)
        assert took < 6, f"the server kept a trickling request for {took:.1f} s"
        assert store.get("/keep/a.bin") == b"precious"  # the cut request did nothing
        # the slot is free again: a normal client is served
        answer = raw(server.address, request("GET", "/api/v1/proxy/info", token="tok"))
        assert status_of(answer)[0] == 200
    finally:
        server.shutdown()
        store.close()


def test_a_client_reading_a_response_too_slowly_is_cut_off(store_root: Path) -> None:
    """A download read at ~0.5 MB/s -- fast enough that no single write hits the socket
    timeout -- against a minimum rate of 2 MB/s: the server ends the response and frees
    the slot; a client reading at full speed under the same limits gets every byte."""
    store = LocalStore("local://")
    limits = ServerLimits(max_connections=1, socket_timeout=3.0, min_body_rate=2e6)
    server = StoreServer(store, port=0, token="tok", limits=limits).start()
    payload = random.Random(5).randbytes(48 << 20)
    get = request("GET", "/api/v1/paths//big/f/download-file", token="tok")
    stop = threading.Event()
    got = [0]

    def slow_reader() -> None:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
            sock.settimeout(30)
            sock.connect(server.address)
            sock.sendall(get)
            while not stop.is_set():
                try:
                    piece = sock.recv(32 << 10)
                except OSError:
                    return
                if not piece:
                    return
                got[0] += len(piece)
                time.sleep(0.064)

    try:
        store.put("/big/f", payload)
        reader = threading.Thread(target=slow_reader, daemon=True)
        began = time.monotonic()
        reader.start()
        time.sleep(0.5)
        # the slow reader holds the only slot; its deadline must give it back
        while time.monotonic() - began < 25:
            answer = raw(
                server.address, request("POST", "/api/v1/paths//big/f/exists", token="tok")
            )
            if status_of(answer)[0] == 200:
                break
            time.sleep(0.25)
        took = time.monotonic() - began
        assert status_of(answer) == (200, True), f"slot still held after {took:.0f} s"
        assert took < 20 and got[0] < len(payload)
        stop.set()
        reader.join(30)
        # a reader at full speed is well inside the same limits
        conn = http.client.HTTPConnection(*server.address, timeout=30)
        try:
            conn.request(
                "GET", "/api/v1/paths//big/f/download-file", headers={"Authorization": "Bearer tok"}
            )
            response = conn.getresponse()
            assert response.status == 200 and response.read() == payload
        finally:
            conn.close()
    finally:
        stop.set()
        server.shutdown()
        store.close()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"socket_timeout": 1e300}, "socket_timeout must be a number > 0 and at most"),
        ({"socket_timeout": float("nan")}, "socket_timeout must be a number > 0"),
        ({"header_timeout": 0}, "header_timeout must be a number > 0"),
        ({"max_connections": 0}, "max_connections must be a whole number >= 1"),
        ({"max_streams": 2.5}, "max_streams must be a whole number >= 1"),
    ],
)
def test_limits_a_socket_cannot_take_are_refused(change: dict[str, float], says: str) -> None:
    """A socket_timeout of 1e300 made every connection fail as it was accepted, unlogged."""
    with pytest.raises(StoreError, match=says):
        ServerLimits(**change)  # type: ignore[arg-type]
