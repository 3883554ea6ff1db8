"""``adcloud store serve``: a store behind the Alluxio 2.x REST proxy API.

No Alluxio server can be installed where adcloud is built, so the local tiered store speaks
the proxy protocol itself (:mod:`adcloud.store._alluxio_wire`): the ``alluxio://`` backend
and the ``alluxio`` 0.1.x Python client both talk to it over real HTTP.

It is a network service and is built as one:

- it binds to ``127.0.0.1`` unless told otherwise;
- with a token, every request must carry ``Authorization: Bearer <token>`` (compared in
  constant time); without one it only warns when bound to a non-loopback address;
- every path goes through :func:`~adcloud.store.base.normalize_path` and the store's own
  namespace, so ``..``, encoded ``%2e%2e`` or control characters are rejected and symlinks
  cannot lead out of the under-store (the local store checks real paths);
- sizes are bounded (:class:`ServerLimits`): JSON bodies, each write request, each stream's
  total, the number of open streams and connections; idle streams are reaped (writes are
  discarded, never published half-done) and slow clients time out;
- a malformed request (bad JSON, bad chunked encoding, truncated body, both
  ``Content-Length`` and ``Transfer-Encoding``, unknown endpoint) gets a 4xx answer and
  never touches stored data; an interrupted write stream is discarded.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, Self

from adcloud.store._alluxio_wire import API_PREFIX, DEFAULT_PORT, error_body, file_info, ttl_option
from adcloud.store.base import Store, TtlAction, WriteType, normalize_path
from adcloud.store.errors import (
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
)
from adcloud.store.settings import StoreSettings

__all__ = ["ServerLimits", "StoreServer"]

log = logging.getLogger(__name__)

_IO_CHUNK = 1 << 20
#: Read streams ended because their read broke off, remembered for their clients' close.
_CUT_SHORT_KEPT = 1024
_WRITE_TYPES = {"TRY_CACHE": WriteType.MUST_CACHE, **{w.value: w for w in WriteType}}
_HTTP_STATUS = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    414: "RESOURCE_EXHAUSTED",
    431: "RESOURCE_EXHAUSTED",
    501: "UNIMPLEMENTED",
    505: "UNIMPLEMENTED",
}


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep one client from exhausting the server.

    Sizes in bytes, times in seconds.  ``max_request_bytes`` bounds one ``streams/write``
    body (clients send bigger files as several writes); ``max_file_bytes`` bounds the total
    of one write stream.  ``socket_timeout`` bounds each wait for the client (also an idle
    keep-alive connection's wait for its next request); ``header_timeout`` the time from a
    request's first byte to the end of its headers, and a body must arrive at
    ``min_body_rate`` bytes/s on average (after ``socket_timeout`` of grace), so a client
    that trickles its request holds one of ``max_connections`` for a bounded time.  The same
    rate bounds a response: a client that reads it more slowly (but never slowly enough for
    one write to hit ``socket_timeout``) is cut off, not left holding its slot for hours.
    """

    max_json_bytes: int = 1 << 20
    max_request_bytes: int = 256 << 20
    max_file_bytes: int = 64 << 30
    max_streams: int = 256
    max_connections: int = 64
    stream_idle_timeout: float = 300.0
    socket_timeout: float = 60.0
    header_timeout: float = 30.0
    min_body_rate: float = 64 << 10

    def __post_init__(self) -> None:
        # a limit a socket cannot take fails each connection as it is accepted, unlogged
        whole = ("max_json_bytes", "max_request_bytes", "max_file_bytes", "max_streams")
        for name in (*whole, "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StoreError(f"server limit {name} must be a whole number >= 1, not {value!r}")
        for name in ("stream_idle_timeout", "socket_timeout", "header_timeout", "min_body_rate"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and 0 < value <= threading.TIMEOUT_MAX):
                raise StoreError(
                    f"server limit {name} must be a number > 0 and at most "
                    f"{threading.TIMEOUT_MAX:.0f}, not {value!r}"
                )


class _HTTPError(Exception):
    """A transport-level failure answered with ``code`` and an Alluxio status."""

    def __init__(self, code: int, status: str, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.close = close


def _bool_option(options: dict[str, Any], name: str) -> bool | None:
    """The JSON boolean option ``name`` (``None`` when absent or null).

    Only ``true`` and ``false`` count: a string such as ``"false"`` is truthy in Python and
    would turn a plain delete into a recursive one.
    """
    value = options.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _HTTPError(
        400,
        "INVALID_ARGUMENT",
        f"option {name!r} must be the JSON boolean true or false, not {json.dumps(value)[:60]}",
    )


def _flag(options: dict[str, Any], name: str) -> bool:
    """A JSON boolean option that defaults to false."""
    return _bool_option(options, name) is True


class _Stream:
    """An open read or write stream of the proxy (``streams/{id}``)."""

    def __init__(self, kind: str, handle: BinaryIO, path: str) -> None:
        self.kind = kind
        self.handle = handle
        self.path = path
        self.pos = 0  # bytes written so far (write streams)
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.after_close: tuple[float, str] | None = None
        # closed by its client while a request still held it: that request ends it
        self.ended = False

    def discard(self) -> None:
        """End the stream without publishing anything."""
        abort = getattr(self.handle, "abort", None)
        with contextlib.suppress(Exception):
            if abort is not None:
                abort()
            else:
                self.handle.close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, app: StoreServer, address: tuple[str, int]) -> None:
        self.app = app
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        self._slots = threading.BoundedSemaphore(app.limits.max_connections)
        # connection -> when its request must be in; the watchdog shuts down the late ones
        self._deadlines: dict[socket.socket, float] = {}
        self._late: set[socket.socket] = set()
        self._deadline_lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(address, _Handler)
        threading.Thread(target=self._watch, name="adcloud-store-deadlines", daemon=True).start()

    def arm(self, connection: socket.socket, deadline: float) -> None:
        """``connection``'s request must be in by ``deadline`` (``time.monotonic``)."""
        with self._deadline_lock:
            self._deadlines[connection] = deadline

    def disarm(self, connection: socket.socket) -> bool:
        """No deadline for ``connection`` any more; whether it had passed (the connection
        was shut down and what was read of the request is not to be acted on)."""
        with self._deadline_lock:
            self._deadlines.pop(connection, None)
            late = connection in self._late
            self._late.discard(connection)
            return late

    def is_late(self, connection: socket.socket) -> bool:
        """Whether ``connection`` was shut down for missing its deadline."""
        with self._deadline_lock:
            return connection in self._late

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            with self._deadline_lock:
                late = [c for c, d in self._deadlines.items() if d <= now]
                for connection in late:
                    del self._deadlines[connection]
                    self._late.add(connection)
            for connection in late:
                log.info(
                    "closing a connection that missed its deadline: its request came in, or "
                    "its response was read, too slowly"
                )
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                body = error_body("UNAVAILABLE", "too many connections; retry later")
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "adcloud-store"
    sys_version = ""
    server: _Server
    _consumed = False
    _body_started = 0.0
    # headers and bodies go out in separate writes: without TCP_NODELAY, Nagle's algorithm
    # and delayed ACKs stall every request-response by ~40 ms
    disable_nagle_algorithm = True

    def setup(self) -> None:
        # StreamRequestHandler applies ``timeout`` to the connection's socket in setup()
        self.timeout = self.server.app.limits.socket_timeout  # type: ignore[misc]
        super().setup()

    def handle_one_request(self) -> None:
        # An idle keep-alive connection waits for its next request's first byte as long as
        # the socket timeout allows; from that byte on, the request runs against deadlines.
        try:
            if not self.rfile.peek(1):  # type: ignore[attr-defined]
                self.close_connection = True
                return
        except OSError:
            self.close_connection = True
            return
        limits = self.server.app.limits
        self.server.arm(self.connection, time.monotonic() + limits.header_timeout)
        try:
            super().handle_one_request()
        finally:
            if self.server.disarm(self.connection):
                self.close_connection = True

    def _body_progress(self, received: int) -> None:
        """Move the body's deadline on: ``received`` bytes are in."""
        limits = self.server.app.limits
        deadline = self._body_started + limits.socket_timeout + received / limits.min_body_rate
        self.server.arm(self.connection, deadline)

    def _send_deadline(self, started: float, sent: int) -> None:
        """The response must have ``sent`` bytes out by ``socket_timeout`` plus their time at
        ``min_body_rate`` after ``started``."""
        limits = self.server.app.limits
        self.server.arm(
            self.connection, started + limits.socket_timeout + sent / limits.min_body_rate
        )

    def _body_done(self) -> None:
        self._consumed = True
        self.server.disarm(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # -- plumbing --------------------------------------------------------------------------

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors found by http.server itself (bad request line, huge headers, ...): answer
        them like every other error, as HTTP/1.x with a JSON body, and close."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # never answer without a status line
        self.close_connection = True
        status = _HTTP_STATUS.get(code, "UNKNOWN")
        reason = message or self.responses.get(code, ("error",))[0]
        with contextlib.suppress(OSError):
            self._send(code, error_body(status, reason))

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self._send_deadline(time.monotonic(), len(body))
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, value: Any) -> None:
        body = b"" if value is None else json.dumps(value).encode()
        self._send(200, body)

    def _fail(self, code: int, status: str, message: str) -> None:
        with contextlib.suppress(OSError):
            self._send(code, error_body(status, message))

    def _authorized(self) -> bool:
        token = self.server.app.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode(), token.encode()
        )

    def _body_chunks(self, limit: int) -> Iterator[bytes]:
        """The request body in pieces, enforcing ``limit`` bytes in total."""
        length = self.headers.get("Content-Length")
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if length is not None and chunked:
            raise _HTTPError(
                400, "INVALID_ARGUMENT", "Content-Length with Transfer-Encoding", close=True
            )
        if chunked:
            yield from self._chunked(limit)
            return
        if length is None:
            return
        if not length.strip().isdigit():
            raise _HTTPError(400, "INVALID_ARGUMENT", "bad Content-Length", close=True)
        remaining = int(length)
        if remaining > limit:
            raise _HTTPError(
                413, "RESOURCE_EXHAUSTED", f"request body over {limit} bytes", close=True
            )
        received = 0
        while remaining:
            piece = self.rfile.read(min(_IO_CHUNK, remaining))
            if not piece:
                raise _HTTPError(400, "INVALID_ARGUMENT", "truncated request body", close=True)
            remaining -= len(piece)
            received += len(piece)
            self._body_progress(received)
            yield piece
        self._body_done()

    def _chunked(self, limit: int) -> Iterator[bytes]:
        total = received = 0
        while True:
            line = self.rfile.readline(1026)
            if not line.endswith(b"\n"):
                raise _HTTPError(400, "INVALID_ARGUMENT", "bad chunk header", close=True)
            text = line.split(b";", 1)[0].strip()
            try:
                size = int(text, 16)
            except ValueError:
                raise _HTTPError(400, "INVALID_ARGUMENT", "bad chunk size", close=True) from None
            if size < 0 or len(text) > 16:
                raise _HTTPError(400, "INVALID_ARGUMENT", "bad chunk size", close=True)
            if size == 0:
                for _ in range(64):  # trailers, up to the empty line
                    if self.rfile.readline(1026) in (b"\r\n", b"\n", b""):
                        self._body_done()
                        return
                raise _HTTPError(400, "INVALID_ARGUMENT", "too many trailers", close=True)
            total += size
            if total > limit:
                raise _HTTPError(
                    413, "RESOURCE_EXHAUSTED", f"request body over {limit} bytes", close=True
                )
            while size:
                piece = self.rfile.read(min(_IO_CHUNK, size))
                if not piece:
                    raise _HTTPError(400, "INVALID_ARGUMENT", "truncated chunk", close=True)
                size -= len(piece)
                received += len(piece)
                self._body_progress(received)
                yield piece
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise _HTTPError(400, "INVALID_ARGUMENT", "bad chunk terminator", close=True)

    def _options(self) -> dict[str, Any]:
        raw = b"".join(self._body_chunks(self.server.app.limits.max_json_bytes))
        if not raw.strip():
            return {}
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _HTTPError(400, "INVALID_ARGUMENT", "options are not JSON") from None
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise _HTTPError(400, "INVALID_ARGUMENT", "options must be a JSON object")
        return value

    def _drain(self) -> None:
        """Read and drop a body the endpoint has no use for (bounded like JSON options), so
        it can never be parsed as the next request on the connection."""
        for _ in self._body_chunks(self.server.app.limits.max_json_bytes):
            pass

    # -- dispatch -------------------------------------------------------------------------

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def _not_allowed(self) -> None:
        self.close_connection = True
        self._fail(405, "UNIMPLEMENTED", f"method {self.command} is not supported")

    do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        if self.server.is_late(self.connection):
            # the headers were cut short by the deadline: not a request to act on
            self.close_connection = True
            return
        length = self.headers.get("Content-Length", "0").strip()
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        self._consumed = length == "0" and not chunked
        self._body_started = time.monotonic()
        if self._consumed:
            self.server.disarm(self.connection)
        else:
            self._body_progress(0)
        try:
            if not self._authorized():
                self.close_connection = True
                raise _HTTPError(401, "UNAUTHENTICATED", "missing or wrong bearer token")
            parts = urllib.parse.urlsplit(self.path)
            route = parts.path
            query = urllib.parse.parse_qs(parts.query, max_num_fields=16)
            if route.rstrip("/") == f"{API_PREFIX}/proxy/info" and method == "GET":
                self._options()
                self._send_json({"version": "adcloud", "startTimeMs": app.started_ms})
            elif route.startswith(f"{API_PREFIX}/paths/"):
                self._paths(method, route[len(API_PREFIX) + len("/paths/") :], query)
            elif route.startswith(f"{API_PREFIX}/streams/") and method == "POST":
                self._streams(route[len(API_PREFIX) + len("/streams/") :])
            else:
                raise _HTTPError(404, "NOT_FOUND", f"no endpoint {method} {route[:200]}")
            if not self._consumed:
                # whatever of the body is left would be read as the next request
                self.close_connection = True
        except _HTTPError as err:
            self.close_connection = self.close_connection or err.close or not self._consumed
            self._fail(err.code, err.status, str(err))
        except StoreError as err:
            self.close_connection = self.close_connection or not self._consumed
            # the client names the store as its user does (alluxio://HOST:PORT): the store
            # behind this server, which it cannot reach, is not part of the message
            said = str(err).replace(f" in {self.server.app.store.uri}", "")
            log.debug("answering %s %s with: %s", method, self.path[:200], err)
            self._fail(500, err.alluxio_status, app.public(said))
        except (ValueError, TypeError, UnicodeError) as err:
            self.close_connection = self.close_connection or not self._consumed
            self._fail(500, "INVALID_ARGUMENT", app.public(str(err)))
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            raise
        except Exception as err:
            log.exception("internal error answering %s %s", method, self.path[:200])
            self.close_connection = True
            self._fail(500, "INTERNAL", f"internal error: {type(err).__name__}")

    def _paths(self, method: str, rest: str, query: dict[str, list[str]]) -> None:
        rest = rest.rstrip("/")
        raw_path, _, action = rest.rpartition("/")
        path = normalize_path(urllib.parse.unquote(raw_path, errors="strict"))
        app = self.server.app
        store = app.store
        if method == "GET":
            self._drain()
            if action != "download-file":
                raise _HTTPError(
                    405, "UNIMPLEMENTED", f"GET is only for download-file, not {action}"
                )
            self._download(path)
            return
        options = self._options()
        if action == "create-file":
            self._send_json(app.create_file(path, options))
        elif action == "open-file":
            self._send_json(app.open_file(path))
        elif action == "create-directory":
            if not _flag(options, "allowExists") and store.exists(path):
                raise StoreExistsError(f"{path} already exists")
            store.mkdir(path)
            self._send_json(None)
        elif action == "delete":
            store.delete(path, recursive=_flag(options, "recursive"))
            self._send_json(None)
        elif action == "exists":
            self._send_json(store.exists(path))
        elif action == "free":
            app.free(path, recursive=_flag(options, "recursive"), forced=_flag(options, "forced"))
            self._send_json(None)
        elif action == "get-status":
            self._send_json(app.info(store.stat(path)))
        elif action == "list-status":
            entries = store.list(path, recursive=_flag(options, "recursive"))
            self._send_json([app.info(s) for s in entries])
        elif action == "rename":
            dst = query.get("dst", [None])[0]
            if not dst:
                raise _HTTPError(400, "INVALID_ARGUMENT", "required 'dst' parameter is missing")
            store.rename(path, normalize_path(dst))
            self._send_json(None)
        elif action == "set-attribute":
            app.set_attribute(path, options)
            self._send_json(None)
        elif action == "persist":
            store.persist(path)
            self._send_json(None)
        elif action in ("mount", "unmount"):
            raise _HTTPError(500, "UNIMPLEMENTED", f"{action} is not supported by adcloud's proxy")
        else:
            raise _HTTPError(404, "NOT_FOUND", f"no path action {action[:100]!r}")

    def _download(self, path: str) -> None:
        with self.server.app.store.open(path, "rb") as stream:
            self._send_stream(stream)

    def _send_stream(self, stream: BinaryIO) -> bool:
        """Send the rest of ``stream`` as the response body; whether all of it went out
        (``False``: the stored data failed verification and the body was cut short).

        The length is not announced: the bytes come from the one version the stream opened,
        whatever replaced the path since.  HTTP/1.1 bodies are chunked, so a body that
        breaks off (stored data failing verification at EOF, say) ends without the final
        chunk and the client sees an error, never a short file; HTTP/1.0 bodies end with
        the connection.
        """
        chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        started, sent = time.monotonic(), 0
        self._send_deadline(started, 0)
        self.end_headers()
        try:
            while piece := stream.read(_IO_CHUNK):
                sent += len(piece)
                self._send_deadline(started, sent)
                if chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    self.wfile.write(piece)
        except StoreError:
            log.exception("aborting a read: the stored data failed verification")
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return False
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        return True

    def _streams(self, rest: str) -> None:
        ident, _, action = rest.rstrip("/").partition("/")
        app = self.server.app
        if not ident.isdigit() or len(ident) > 10:
            raise _HTTPError(400, "INVALID_ARGUMENT", "stream ids are integers")
        try:
            stream = app.stream(int(ident))
        except StoreNotFoundError:
            if action in ("close", "cancel") and app.read_cut_short(int(ident)):
                # its read broke off (the client stopped reading the body and then closes
                # the stream, as it should): the server ended it already, and the close is
                # what the client meant to do anyway
                self._options()
                self._send_json(None)
                return
            raise
        if not stream.lock.acquire(blocking=False):
            if stream.kind == "r" and action in ("close", "cancel"):
                # a client that has read what it wanted closes the stream while its read's
                # request may still hold it (the end of the body sent, the request not yet
                # finished; or a body it stopped reading, not yet found cut off): a refusal
                # would leave the stream open until it idles out, holding one of max_streams
                self._options()
                app.end_read_stream(int(ident))
                self._send_json(None)
                return
            raise _HTTPError(409, "FAILED_PRECONDITION", "the stream is busy with another request")
        try:
            stream.last_used = time.monotonic()
            if action == "write":
                self._stream_write(int(ident), stream)
            elif action == "read":
                self._options()
                if stream.kind != "r":
                    raise _HTTPError(400, "INVALID_ARGUMENT", "not a read stream")
                complete = False
                try:
                    complete = self._send_stream(stream.handle)
                finally:
                    if not complete:
                        # the handle stands past what the client got (its connection broke,
                        # or it stopped reading and closed it): no read can go on from there
                        with contextlib.suppress(StoreNotFoundError):
                            app.close_stream(int(ident), publish=False)
                        app.note_cut_short(int(ident))
            elif action in ("close", "cancel"):
                self._options()
                app.close_stream(int(ident), publish=action == "close")
                self._send_json(None)
            else:
                raise _HTTPError(404, "NOT_FOUND", f"no stream action {action[:100]!r}")
        finally:
            stream.last_used = time.monotonic()
            stream.lock.release()
            if stream.ended and stream.lock.acquire(blocking=False):
                try:
                    stream.discard()
                finally:
                    stream.lock.release()

    def _stream_write(self, ident: int, stream: _Stream) -> None:
        app = self.server.app
        if stream.kind != "w":
            self._options()
            raise _HTTPError(400, "INVALID_ARGUMENT", "not a write stream")
        written = 0
        over = False
        try:
            for piece in self._body_chunks(app.limits.max_request_bytes):
                # past the limit, read the rest of the body (max_request_bytes at most) and
                # drop it: an answer sent while the client is still sending is lost to it
                # when its send breaks on the closed connection
                over = over or stream.pos + len(piece) > app.limits.max_file_bytes
                if over:
                    continue
                stream.handle.write(piece)
                stream.pos += len(piece)
                written += len(piece)
            if over:
                raise _HTTPError(
                    413, "RESOURCE_EXHAUSTED", f"file over {app.limits.max_file_bytes} bytes"
                )
        except BaseException:
            # a write that did not arrive whole must not become part of any file
            app.close_stream(ident, publish=False)
            raise
        self._send_json(written)


class StoreServer:
    """Serves ``store`` over the Alluxio 2.x REST proxy API on ``host:port``.

    ``port=0`` picks a free port (see :attr:`address`).  Use :meth:`start` to serve from a
    background thread, :meth:`serve_forever` to serve from the calling one.  ``token=None``
    serves without authentication; an empty ``token`` is refused rather than taken for that.
    """

    def __init__(
        self,
        store: Store,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: str | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        if token is not None and not token.strip():
            raise StoreError(
                "the server token is empty, so every client would be let in; pass a "
                "non-empty token, or token=None to serve without authentication"
            )
        self.store = store
        self.token = token
        self.limits = limits or ServerLimits()
        self.started_ms = int(time.time() * 1000)
        self._streams: dict[int, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._cut_short: dict[int, None] = {}  # insertion-ordered: the oldest go first
        self._create_lock = threading.Lock()
        self._stop = threading.Event()
        self._hidden = _hidden_locations(store)
        self._http = _Server(self, (host, port))
        self._thread: threading.Thread | None = None
        self._reaper = threading.Thread(target=self._reap, name="adcloud-store-reaper", daemon=True)
        self._reaper.start()
        if self.token is None and not _is_loopback(host):
            log.warning(
                "serving %s on %s without a token: anyone who can reach this address can "
                "read and write the store (pass --token)",
                store.uri,
                host,
            )

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``."""
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    @property
    def uri(self) -> str:
        """The ``alluxio://`` URI clients open to reach this server."""
        host, port = self.address
        return f"alluxio://{host}:{port}/"

    # -- operations -----------------------------------------------------------------------

    def public(self, message: str) -> str:
        """``message`` as a client may read it: the server machine's directories behind the
        store (tiers, catalog, under-store) named by their role, not by their path."""
        for pattern, name in self._hidden:
            message = pattern.sub(name, message)
        return message

    def info(self, status: Any) -> dict[str, Any]:
        """The ``FileInfo`` JSON for a status."""
        host, port = self.address
        return file_info(status, host=host, port=port)

    def _register(self, stream: _Stream) -> int:
        with self._streams_lock:
            if len(self._streams) >= self.limits.max_streams:
                stream.discard()
                raise _HTTPError(
                    500,
                    "RESOURCE_EXHAUSTED",
                    f"{self.limits.max_streams} streams already open on this server; close "
                    "the streams you are done with, or retry once others end (unclosed "
                    f"ones end after {self.limits.stream_idle_timeout:g} s idle; "
                    "`adcloud store serve --max-streams` raises the bound)",
                )
            while True:
                ident = secrets.randbelow(2**31 - 1) + 1
                if ident not in self._streams:
                    self._streams[ident] = stream
                    return ident

    def stream(self, ident: int) -> _Stream:
        """The open stream ``ident``."""
        with self._streams_lock:
            stream = self._streams.get(ident)
        if stream is None:
            raise StoreNotFoundError(f"stream {ident} does not exist")
        return stream

    def close_stream(self, ident: int, *, publish: bool) -> None:
        """End a stream: publish a write stream (or discard it when ``publish`` is false)."""
        with self._streams_lock:
            stream = self._streams.pop(ident, None)
        if stream is None:
            raise StoreNotFoundError(f"stream {ident} does not exist")
        if not publish:
            stream.discard()
            return
        stream.handle.close()
        if stream.after_close is not None:
            ttl, action = stream.after_close
            self.store.set_ttl(stream.path, ttl, action=action)

    def note_cut_short(self, ident: int) -> None:
        """Remember that read stream ``ident`` was ended because its read broke off, so that
        its client's close still succeeds (the newest ``_CUT_SHORT_KEPT`` are kept)."""
        with self._streams_lock:
            self._cut_short[ident] = None
            while len(self._cut_short) > _CUT_SHORT_KEPT:
                del self._cut_short[next(iter(self._cut_short))]

    def read_cut_short(self, ident: int) -> bool:
        """Whether read stream ``ident`` was ended by :meth:`note_cut_short` (once)."""
        with self._streams_lock:
            return self._cut_short.pop(ident, False) is None

    def end_read_stream(self, ident: int) -> None:
        """Close read stream ``ident``, now or, while a request holds it, as that request
        finishes."""
        with self._streams_lock:
            stream = self._streams.pop(ident, None)
        if stream is None:
            raise StoreNotFoundError(f"stream {ident} does not exist")
        stream.ended = True
        if stream.lock.acquire(blocking=False):
            try:
                stream.discard()
            finally:
                stream.lock.release()

    def create_file(self, path: str, options: dict[str, Any]) -> int:
        """``create-file``: a write stream id (the file appears when the stream closes).

        Without ``overwrite`` it is refused while the path exists or another stream writes
        it, as Alluxio refuses it for a file still being written: two such writers would
        otherwise both succeed, and the later close silently replace the earlier file.
        """
        overwrite = _flag(options, "overwrite")
        write_type = options.get("writeType")
        if write_type is not None:
            if not isinstance(write_type, str) or write_type.upper() not in _WRITE_TYPES:
                raise ValueError(f"unknown writeType {write_type!r}")
            write_type = _WRITE_TYPES[write_type.upper()]
        ttl_ms, action = ttl_option(options)
        ttl = None if ttl_ms is None or ttl_ms < 0 else ttl_ms / 1000
        act = TtlAction.parse(action or "DELETE")
        # the check and the stream's registration are one step for concurrent requests
        with self._create_lock:
            if not overwrite:
                if self.store.exists(path):
                    raise StoreExistsError(f"{path} already exists")
                if self._writing(path):
                    raise StoreExistsError(
                        f"{path} is being written by another stream; create it with "
                        "overwrite to replace it when this write completes, or wait for it"
                    )
            handle = self.store.open(
                path, "wb", write_type=write_type, ttl=ttl if act is TtlAction.DELETE else None
            )
            stream = _Stream("w", handle, path)
            if ttl is not None and act is TtlAction.FREE:
                stream.after_close = (ttl, str(act))
            return self._register(stream)

    def _writing(self, path: str) -> bool:
        """Whether an open write stream writes ``path``."""
        with self._streams_lock:
            return any(s.kind == "w" and s.path == path for s in self._streams.values())

    def open_file(self, path: str) -> int:
        """``open-file``: a read stream id (directories are refused by ``open``)."""
        return self._register(_Stream("r", self.store.open(path, "rb"), path))

    def free(self, path: str, *, recursive: bool, forced: bool) -> None:
        """``free``; ``forced`` also frees pinned files (they stay pinned)."""
        if not forced:
            self.store.free(path, recursive=recursive)
            return
        pinned = [s.path for s in self.store.list(path, recursive=True) if s.pinned]
        for p in pinned:
            self.store.unpin(p)
        try:
            self.store.free(path, recursive=recursive)
        finally:
            for p in pinned:
                self.store.pin(p)

    def set_attribute(self, path: str, options: dict[str, Any]) -> None:
        """``set-attribute``: pinned, TTL and persisted (which persists now)."""
        unsupported = sorted({"owner", "group", "mode", "acl"} & set(options))
        if unsupported:
            raise _HTTPError(
                500, "UNIMPLEMENTED", f"adcloud's proxy has no {', '.join(unsupported)}"
            )
        # every option is checked before any of them changes the file
        pinned = _bool_option(options, "pinned")
        persisted = _flag(options, "persisted")
        ttl_ms, action = ttl_option(options)
        if not self.store.exists(path):
            raise StoreNotFoundError(f"{path} does not exist")
        if pinned is not None:
            (self.store.pin if pinned else self.store.unpin)(path)
        if ttl_ms is not None:
            ttl = None if ttl_ms < 0 else ttl_ms / 1000
            self.store.set_ttl(path, ttl, action=action or "DELETE")
        if persisted:
            self.store.persist(path)

    def _reap(self) -> None:
        while not self._stop.wait(min(5.0, self.limits.stream_idle_timeout / 2)):
            cutoff = time.monotonic() - self.limits.stream_idle_timeout
            with self._streams_lock:
                idle = [
                    i
                    for i, s in self._streams.items()
                    if s.last_used < cutoff and not s.lock.locked()
                ]
                streams = [self._streams.pop(i) for i in idle]
            for stream in streams:
                log.info("discarding idle %s stream of %s", stream.kind, stream.path)
                stream.discard()

    # -- lifecycle --------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (from another thread) or KeyboardInterrupt."""
        log.info("serving %s as an Alluxio REST proxy on %s", self.store.uri, self.uri)
        self._http.serve_forever(poll_interval=0.05)

    def start(self) -> Self:
        """Serve from a background thread; returns self."""
        self._thread = threading.Thread(
            target=self.serve_forever, name="adcloud-store-server", daemon=True
        )
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving and discard every open stream (unfinished writes are not published)."""
        self._stop.set()
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._http.server_close()
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.discard()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def _hidden_locations(store: Store) -> list[tuple[re.Pattern[str], str]]:
    """Patterns of the local directories and under-store URL behind ``store``, longest
    first (a tier directory inside the store root is named as the tier), each with the
    name an answer gives it instead."""
    found: dict[str, str] = {}

    def add(where: str | os.PathLike[str], name: str) -> None:
        text = str(where).rstrip("/")
        for form in {text, os.path.realpath(text) if text.startswith("/") else text}:
            if len(form) > 1:
                found.setdefault(form, name)

    settings = getattr(store, "settings", None)
    if isinstance(settings, StoreSettings):
        for spec in settings.tiers():
            add(spec.directory, f"<{spec.name} tier>")
        ufs = settings.ufs_url()
        add(ufs, "<under-store>")
        if ufs.startswith("file://"):
            add(ufs.removeprefix("file://"), "<under-store>")
        add(settings.metadata_dir(), "<store metadata>")
        if settings.root is not None:
            add(settings.root, "<store root>")
    if store.uri.startswith("file://"):
        add(store.uri.removeprefix("file://"), "<store root>")
    # a whole directory name only: /data/mem hides in /data/mem/x, not in /data/memo
    return [
        (re.compile(re.escape(where) + r"(?![^/\s'\"(),:;\]])"), name)
        for where, name in sorted(found.items(), key=lambda item: -len(item[0]))
    ]


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
