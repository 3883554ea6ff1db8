"""The ``alluxio://`` backend: an Alluxio 2.x cluster through its REST proxy (port 39999).

It speaks the protocol of the ``alluxio`` 0.1.x Python client (``alluxio-py``; see
:mod:`adcloud.store._alluxio_wire`) with the standard library's ``http.client``, so it
needs no extra package: ``alluxio://HOST:PORT/[NAMESPACE]``.  The same URI reaches
``adcloud store serve``, which is what the test suite checks it against -- no Alluxio
server is installable where adcloud is built.

Against a real Alluxio 2.x proxy:

- ``put`` over an existing file retries ``create-file`` with ``overwrite`` (adcloud's
  server replaces atomically; Alluxio releases whose ``CreateFilePOptions`` lack the field
  reject it) and falls back to delete-then-create, which is not atomic;
- ``persist`` uses adcloud's ``paths/{path}/persist`` extension; the real proxy has no
  persist endpoint, so it raises :class:`~adcloud.store.errors.StoreUnsupportedError`
  (run ``alluxio fs persist`` there, or write with ``CACHE_THROUGH``/``ASYNC_THROUGH``);
- an aborted write stream is cancelled (adcloud extension) or, on a real proxy, closed
  and deleted.

A bearer token (``token=`` or ``ADCLOUD_STORE_TOKEN``) is sent as ``Authorization`` on
every request; it is never part of the URI, the ``repr`` or log messages.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import socket
import threading
import urllib.parse
from typing import Any, BinaryIO, ClassVar, Literal, cast

from adcloud.store._alluxio_wire import API_PREFIX, DEFAULT_PORT, status_from_info
from adcloud.store._streams import WriteStream
from adcloud.store.base import (
    CAPABILITIES,
    BaseStore,
    FileStatus,
    TtlAction,
    WriteType,
    check_ttl,
    check_ttl_change,
    join_path,
    normalize_path,
)
from adcloud.store.errors import (
    InvalidPathError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    StoreProtocolError,
    StoreUnavailableError,
    StoreUnsupportedError,
    error_for_status,
)
from adcloud.store.settings import StoreSettings

__all__ = ["AlluxioStore"]

log = logging.getLogger(__name__)

_RETRYABLE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class _Connection(http.client.HTTPConnection):
    """``HTTPConnection`` with ``TCP_NODELAY``: http.client sends headers and body in
    separate writes, which Nagle's algorithm and delayed ACKs would stall by ~40 ms."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class AlluxioStore(BaseStore):
    """A store on an Alluxio 2.x REST proxy (or ``adcloud store serve``).

    ``timeout`` is the socket timeout in seconds; ``chunk_size`` the bytes per
    ``streams/write`` request; ``write_type`` the default write type (``None``: the
    server's default).
    """

    capabilities: ClassVar[frozenset[str]] = CAPABILITIES

    def __init__(
        self,
        uri: str = f"alluxio://127.0.0.1:{DEFAULT_PORT}/",
        *,
        token: str | None = None,
        timeout: float = 60.0,
        chunk_size: int = 8 << 20,
        write_type: WriteType | str | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(uri)
        # a query or fragment would be dropped (the namespace cut short at "?" or "#")
        if parts.scheme.lower() != "alluxio" or not parts.hostname or parts.query or parts.fragment:
            raise InvalidPathError(f"not an Alluxio URI: {uri!r} (write alluxio://HOST:PORT/)")
        if parts.username or parts.password:
            raise InvalidPathError(
                "do not put credentials in alluxio:// URIs; pass token= or set ADCLOUD_STORE_TOKEN"
            )
        self._host = parts.hostname
        try:
            self._port = parts.port or DEFAULT_PORT
        except ValueError as err:  # ":abc", ":99999"
            raise InvalidPathError(
                f"not an Alluxio URI: {uri!r}: the port {parts.netloc.rpartition(':')[2]!r} is "
                "no port number (write alluxio://HOST:PORT/, PORT 1-65535)"
            ) from err
        self._prefix = normalize_path(parts.path or "/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        suffix = "/" if self._prefix == "/" else self._prefix
        options: dict[str, Any] = {"timeout": timeout, "chunk_size": chunk_size}
        if token is not None:
            options["token"] = token
        if write_type is not None:
            options["write_type"] = str(WriteType.parse(write_type))
        super().__init__(f"alluxio://{host}:{self._port}{suffix}", options)
        self._token = token if token is not None else StoreSettings.load().token
        self._timeout = timeout
        self._chunk = max(1, int(chunk_size))
        self._write_type = None if write_type is None else WriteType.parse(write_type)
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()

    # -- HTTP ------------------------------------------------------------------------------

    def _new_conn(self) -> http.client.HTTPConnection:
        conn = _Connection(self._host, self._port, timeout=self._timeout)
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _conn(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._new_conn()
            self._local.conn = conn
        return conn

    def _release(self, conn: http.client.HTTPConnection) -> None:
        """Close ``conn`` and forget it, so the list of open connections stays bounded."""
        conn.close()
        with self._conns_lock, contextlib.suppress(ValueError):
            self._conns.remove(conn)

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            self._release(conn)

    def _headers(self, content_type: str | None, length: int | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        if length is not None:
            headers["Content-Length"] = str(length)
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _send(
        self,
        url: str,
        body: bytes | memoryview,
        content_type: str,
        *,
        conn: http.client.HTTPConnection | None = None,
        retry: bool = True,
        what: str = "",
    ) -> http.client.HTTPResponse:
        """POST ``body`` to ``url``; retries once when a reused keep-alive connection turns
        out to have been closed by the server.  ``what`` (``"write /a/b"``) names the
        operation in the error when the proxy cannot be reached or goes away."""
        own = conn is None
        for attempt in (1, 2):
            c = self._conn() if own else conn
            assert c is not None
            reused = c.sock is not None
            try:
                try:
                    c.request(
                        "POST", url, body=body, headers=self._headers(content_type, len(body))
                    )
                except (BrokenPipeError, ConnectionResetError):
                    response = self._early_answer(c)
                    if response is None:
                        raise
                    return response
                return c.getresponse()
            except _RETRYABLE as err:
                if own:
                    self._drop_conn()
                if attempt == 2 or not (retry and reused and own):
                    raise self._unavailable(err, what) from err
            except (OSError, http.client.HTTPException) as err:
                if own:
                    self._drop_conn()
                raise self._unavailable(err, what) from err
        raise AssertionError("unreachable")

    @staticmethod
    def _early_answer(conn: http.client.HTTPConnection) -> http.client.HTTPResponse | None:
        """The response the server sent before it stopped reading the request, if any.

        A server that refuses a body part-way (over a size limit) answers and closes; the
        rest of the body then breaks the send with EPIPE or a reset, while the answer already
        waits in the socket's receive buffer.  ``None`` when there is none: the server is gone.
        """
        if conn.sock is None:
            return None
        try:
            return conn.getresponse()
        except (OSError, http.client.HTTPException):
            return None

    def _unavailable(self, err: BaseException, what: str = "") -> StoreUnavailableError:
        named = f"{what}: " if what else ""
        return StoreUnavailableError(
            f"{named}cannot reach the Alluxio REST proxy at {self._host}:{self._port} ({err}); "
            "start one with `adcloud store serve` or check the URI and that the proxy runs"
        )

    def _check(self, response: http.client.HTTPResponse, what: str) -> None:
        if response.status == 200:
            return
        body = response.read(1 << 16)
        try:
            error = json.loads(body)
            status, message = str(error["statusCode"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            raise StoreProtocolError(
                f"{what}: HTTP {response.status} from {self._host}:{self._port} that is not an "
                f"Alluxio error: {body[:200]!r}"
            ) from None
        raise error_for_status(status)(f"{what}: {message}")

    def _call(self, url: str, options: dict[str, Any] | None = None, what: str = "") -> Any:
        body = json.dumps(options or {}).encode()
        response = self._send(url, body, "application/json", retry=True, what=what or url)
        try:
            self._check(response, what or url)
            raw = response.read()
        except (OSError, http.client.HTTPException) as err:
            self._drop_conn()
            raise self._unavailable(err, what or url) from err
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as err:
            raise StoreProtocolError(f"{what or url}: answer is not JSON: {raw[:200]!r}") from err

    def _key(self, path: str) -> str:
        return join_path(self._prefix, path)

    def _rel(self, key: str) -> str:
        key = normalize_path(key)
        if self._prefix == "/":
            return key
        if key == self._prefix:
            return "/"
        if key.startswith(self._prefix + "/"):
            return key[len(self._prefix) :]
        return key

    def _paths(self, key: str, action: str, query: dict[str, str] | None = None) -> str:
        url = f"{API_PREFIX}/paths/{urllib.parse.quote(key)}/{action}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        return url

    def _path_call(
        self,
        path: str,
        action: str,
        options: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> Any:
        key = self._key(path)
        return self._call(self._paths(key, action, query), options, f"{action} {self._rel(key)}")

    @staticmethod
    def _stream_url(ident: int, action: str) -> str:
        return f"{API_PREFIX}/streams/{int(ident)}/{action}"

    def _stream_id(self, value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise StoreProtocolError(f"{what}: expected a stream id, got {value!r}")
        return value

    # -- Store -----------------------------------------------------------------------------

    def _create(self, path: str, options: dict[str, Any]) -> tuple[int, bool]:
        """A write stream for ``path``: its id, and whether it replaces an existing file."""
        try:
            return self._stream_id(self._path_call(path, "create-file", options), path), False
        except StoreExistsError:
            pass
        try:
            return self._stream_id(
                self._path_call(path, "create-file", {**options, "overwrite": True}), path
            ), True
        except StoreExistsError:
            log.debug("the proxy ignores 'overwrite'; replacing %s non-atomically", path)
        self.delete(path)
        return self._stream_id(self._path_call(path, "create-file", options), path), True

    def _create_options(
        self, write_type: WriteType | str | None, ttl: float | None
    ) -> dict[str, Any]:
        options: dict[str, Any] = {"recursive": True}
        wt = self._write_type if write_type is None else WriteType.parse(write_type)
        if wt is not None:
            options["writeType"] = str(wt)
        if ttl is not None:
            options["commonOptions"] = {"ttl": round(ttl * 1000), "ttlAction": "DELETE"}
        return options

    def open(
        self,
        path: str,
        mode: Literal["rb", "wb"] = "rb",
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> BinaryIO:
        """A read stream, or a write stream that completes the file on close."""
        if mode == "wb":
            check_ttl(ttl, path)
            ident, replaces = self._create(path, self._create_options(write_type, ttl))
            # the proxy keeps a replaced file's pin; pinned=False must drop it (a new file
            # is never pinned: no request for that)
            pin = None if pinned is False and not replaces else pinned
            return cast(BinaryIO, _AlluxioWriter(self, ident, path, pin))
        if mode != "rb":
            raise ValueError(f"mode must be 'rb' or 'wb', not {mode!r}")
        ident = self._stream_id(self._path_call(path, "open-file"), path)
        conn = self._new_conn()
        try:
            response = self._send(
                self._stream_url(ident, "read"),
                b"",
                "application/json",
                conn=conn,
                what=f"read {path}",
            )
            self._check(response, f"read {path}")
        except BaseException:
            self._release(conn)
            with contextlib.suppress(StoreError):
                self._call(self._stream_url(ident, "close"))
            raise
        raw = _ResponseReader(self, ident, conn, response, path)
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=1 << 20))

    def get(self, path: str) -> bytes:
        """All bytes of ``path`` (open-file, read, close)."""
        ident = self._stream_id(self._path_call(path, "open-file"), path)
        try:
            response = self._send(
                self._stream_url(ident, "read"), b"", "application/json", what=f"read {path}"
            )
            self._check(response, f"read {path}")
            try:
                data = response.read()
            except (OSError, http.client.HTTPException) as err:
                self._drop_conn()
                raise StoreError(f"reading {path} from the proxy broke off: {err}") from err
        except BaseException:
            # the error that ended the read is the one to report, not that the stream
            # cannot be closed on a proxy that has gone away
            with contextlib.suppress(StoreError):
                self._call(self._stream_url(ident, "close"))
            raise
        with contextlib.suppress(StoreNotFoundError):
            self._call(self._stream_url(ident, "close"), what=f"close {path}")
        return data

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return bool(self._path_call(path, "exists"))

    def stat(self, path: str) -> FileStatus:
        """Status of ``path`` (tier from the block locations)."""
        return self._status(self._path_call(path, "get-status"))

    def _status(self, info: Any) -> FileStatus:
        if not isinstance(info, dict):
            raise StoreProtocolError(f"expected a FileInfo object, got {type(info).__name__}")
        status = status_from_info(info)
        return _replace_path(status, self._rel(status.path))

    def list(self, path: str = "/", *, recursive: bool = False) -> list[FileStatus]:
        """Entries below ``path`` sorted by path."""
        infos = self._path_call(path, "list-status", {"recursive": recursive})
        if not isinstance(infos, list):
            raise StoreProtocolError("list-status did not answer a list")
        return sorted((self._status(i) for i in infos), key=lambda s: s.path)

    def mkdir(self, path: str) -> None:
        """Create directory ``path`` and its parents."""
        self._path_call(path, "create-directory", {"recursive": True, "allowExists": True})

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory (non-empty only with ``recursive``)."""
        self._path_call(path, "delete", {"recursive": recursive})

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (which must not exist)."""
        self._path_call(src, "rename", query={"dst": self._key(dst)})

    def pin(self, path: str) -> None:
        """Pin ``path`` (set-attribute ``pinned``)."""
        self._path_call(path, "set-attribute", {"pinned": True})

    def unpin(self, path: str) -> None:
        """Unpin ``path``."""
        self._path_call(path, "set-attribute", {"pinned": False})

    def free(self, path: str, *, recursive: bool = False) -> None:
        """Free the cached copies of ``path``."""
        self._path_call(path, "free", {"recursive": recursive})

    def persist(self, path: str) -> None:
        """Persist ``path`` now (adcloud's proxy extension; see the module docstring)."""
        try:
            self._path_call(path, "persist")
        except StoreProtocolError as err:
            raise StoreUnsupportedError(
                f"{self.uri}: the Alluxio REST proxy has no persist endpoint ({err}); run "
                f"`alluxio fs persist {self._key(path)}` on the cluster, or write with "
                "write_type=CACHE_THROUGH or ASYNC_THROUGH"
            ) from err

    def set_ttl(
        self, path: str, ttl: float | None, *, action: TtlAction | str = TtlAction.DELETE
    ) -> None:
        """Expire ``path`` ``ttl`` seconds after creation (``None`` clears it)."""
        act = TtlAction.parse(action)
        check_ttl_change(ttl, path)  # the proxy takes a negative TTL to mean none
        ms = -1 if ttl is None else round(ttl * 1000)
        self._path_call(
            path, "set-attribute", {"commonOptions": {"ttl": ms, "ttlAction": str(act)}}
        )

    def close(self) -> None:
        """Close every HTTP connection this store opened."""
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        self._local = threading.local()


def _replace_path(status: FileStatus, path: str) -> FileStatus:
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(status, path=path)


class _ResponseReader(io.RawIOBase):
    """The body of a ``streams/{id}/read`` response; closing it closes the stream."""

    def __init__(
        self,
        store: AlluxioStore,
        ident: int,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        path: str,
    ) -> None:
        super().__init__()
        self._store = store
        self._ident = ident
        self._conn = conn
        self._response = response
        self.name = path

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            n = self._response.readinto(buffer)
        except (OSError, http.client.HTTPException) as err:
            raise StoreError(f"reading {self.name} from the proxy broke off: {err}") from err
        if n == 0 and len(memoryview(buffer)) > 0 and self._response.length not in (None, 0):
            raise StoreError(f"reading {self.name}: the proxy closed the stream early")
        return n

    def close(self) -> None:
        if not self.closed:
            self._response.close()
            self._store._release(self._conn)
            with contextlib.suppress(StoreError):
                self._store._call(self._store._stream_url(self._ident, "close"))
        super().close()


class _AlluxioWriter(WriteStream):
    """A ``streams/{id}/write`` stream; buffers ``chunk_size`` bytes per request."""

    def __init__(self, store: AlluxioStore, ident: int, path: str, pinned: bool | None) -> None:
        """``pinned``: pin the file once complete (True), unpin it (False) or leave it."""
        super().__init__(path)
        self._store = store
        self._ident = ident
        self._buf = bytearray()
        self._size = 0
        self._pinned = pinned

    def tell(self) -> int:
        return self._size

    def _post(self, data: bytes | memoryview) -> None:
        url = self._store._stream_url(self._ident, "write")
        # a retry only happens on a reused keep-alive connection that the proxy had closed:
        # the request never reached it (a proxy that died mid-request lost the stream anyway)
        what = f"write {self.name}"
        response = self._store._send(url, data, "application/octet-stream", what=what)
        try:
            self._store._check(response, what)
            count = json.loads(response.read() or b"null")
        except (OSError, http.client.HTTPException) as err:  # the proxy went away
            self._store._drop_conn()
            raise self._store._unavailable(err, what) from err
        except ValueError as err:
            raise StoreProtocolError(f"{what}: answer is not JSON") from err
        if count != len(data):
            raise StoreProtocolError(
                f"write {self.name}: sent {len(data)} bytes, proxy took {count}"
            )

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError("write to a closed store stream")
        view = memoryview(data).cast("B")
        n = len(view)
        chunk = self._store._chunk
        try:
            if not self._buf and len(view) >= chunk:
                while len(view) >= chunk:
                    self._post(view[:chunk])
                    view = view[chunk:]
            self._buf += view
            while len(self._buf) >= chunk:
                self._post(memoryview(self._buf)[:chunk])
                del self._buf[:chunk]
        except BaseException:
            self.abort()
            raise
        self._size += n
        return n

    def abort(self) -> None:
        """Cancel the stream: the file does not appear (adcloud) or is deleted (Alluxio)."""
        if self._closed:
            return
        self._closed = True
        self._buf = bytearray()
        try:
            self._store._call(self._store._stream_url(self._ident, "cancel"))
        except StoreNotFoundError:
            pass  # the server already dropped the stream: nothing was published
        except StoreProtocolError:
            # a proxy without the cancel extension: completing then deleting is all it offers
            with contextlib.suppress(StoreError):
                self._store._call(self._store._stream_url(self._ident, "close"))
                self._store.delete(self.name)
        except StoreError as err:
            log.warning("could not cancel the write of %s: %s", self.name, err)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._buf:
                self._post(bytes(self._buf))
                self._buf = bytearray()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._store._call(self._store._stream_url(self._ident, "close"), what=f"close {self.name}")
        if self._pinned is True:
            self._store.pin(self.name)
        elif self._pinned is False:
            self._store.unpin(self.name)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.abort()
