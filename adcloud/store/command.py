"""``adcloud store``: look into and move data through any store from the shell.

``add_parser`` registers ``store`` and its subcommands (``ls``, ``cat``, ``put``, ``cp``,
``stat``, ``free``, ``persist``, ``serve``) on the main parser's subparsers; each sets
``func(args, console) -> int``.  Library code raises; only this module prints.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import posixpath
import shlex
import shutil
import stat
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from adcloud._argtypes import number, whole_number, written_url
from adcloud.store.base import (
    FileStatus,
    PersistenceState,
    Store,
    WriteType,
    format_size,
    join_path,
    locate,
    stream_copy,
)
from adcloud.store.errors import StoreError, StoreFullError, StoreNotFoundError
from adcloud.store.local import LocalStore

__all__ = ["add_parser"]

_URL_HELP = "store URL: local:///PATH, alluxio://HOST:PORT/PATH, file:///PATH, s3://..."
_EPILOG = """examples:
  adcloud store ls local:///drives -r
  adcloud store put params.bin local:///models/m1/params.bin --write-type CACHE_THROUGH --pin
  adcloud store cat alluxio://127.0.0.1:39999/models/m1/params.bin > params.bin
  adcloud store cp -r local:///maps/city/versions/000003 file:///backup/city-000003
  adcloud store stat local:///models/m1/params.bin
  adcloud store serve --port 39999 --token-file ~/.adcloud-token

The local store's tiers come from ADCLOUD_STORE_* (ADCLOUD_STORE_ROOT moves them all);
alluxio:// clients send ADCLOUD_STORE_TOKEN as a bearer token.
"""


def _ttl(status: FileStatus) -> str:
    return "-" if status.ttl is None else f"{status.ttl:g} s ({status.ttl_action})"


def _where(status: FileStatus, ufs: str = "under-store") -> str:
    """Where a file's bytes are: its tier, the under-store (``ufs``), or nowhere when it
    is LOST (its cached copy is gone and it was never persisted)."""
    if status.tier:
        return status.tier
    return "lost" if status.persistence is PersistenceState.LOST else ufs


def _file_table(entries: list[FileStatus]) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for name, justify in (
        ("path", "left"),
        ("size", "right"),
        ("tier", "left"),
        ("pinned", "left"),
        ("persistence", "left"),
        ("ttl", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for s in entries:
        if s.is_dir:
            table.add_row(s.path + "/", "-", "-", "-", "-", "-")
        else:
            table.add_row(
                s.path,
                format_size(s.size),
                _where(s),
                "yes" if s.pinned else "",
                str(s.persistence),
                _ttl(s),
            )
    return table


def _per_tier(entries: list[FileStatus]) -> Table:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s in entries:
        if not s.is_dir:
            key = _where(s, "under-store only")
            totals[key][0] += 1
            totals[key][1] += s.size
    table = Table(title="listed files per tier", show_edge=False, pad_edge=False)
    table.add_column("tier")
    table.add_column("files", justify="right")
    table.add_column("size", justify="right")
    for name in sorted(
        totals, key=lambda n: ("MEM", "SSD", "HDD").index(n) if n in ("MEM", "SSD", "HDD") else 9
    ):
        files, size = totals[name]
        table.add_row(name, f"{files:,}", format_size(size))
    return table


def _usage_table(store: Store) -> Table | None:
    usage = getattr(store, "usage", None)
    if usage is None:
        return None
    table = Table(title=f"tiers of {store.uri}", show_edge=False, pad_edge=False)
    for name, justify in (
        ("tier", "left"),
        ("used", "right"),
        ("capacity", "right"),
        ("use", "right"),
        ("pinned", "right"),
        ("files", "right"),
        ("directory", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for t in usage():
        share = 100 * t.used / t.capacity if t.capacity else 0.0
        table.add_row(
            t.name,
            format_size(t.used),
            format_size(t.capacity),
            f"{share:.1f}%",
            format_size(t.pinned),
            f"{t.files:,}",
            t.directory,
        )
    return table


def _cmd_ls(args: argparse.Namespace, console: Console) -> int:
    store, path = locate(args.url)
    with _closing(store):
        entries = store.list(path, recursive=args.recursive)
        if args.json:
            console.print_json(json.dumps([e.to_dict() for e in entries]))
            return 0
        console.print(_file_table(entries))
        console.print(_per_tier(entries))
    return 0


def _write_type(text: str) -> WriteType:
    try:
        return WriteType.parse(text)
    except StoreError as err:  # argparse reports ArgumentTypeError as a usage error
        raise argparse.ArgumentTypeError(str(err)) from None


def _copy_to_file(stream: Any, target: Path) -> None:
    """Copy ``stream`` into ``target`` whole or not at all: into a temporary file beside it,
    renamed over it once complete, so a read that breaks off (or Ctrl-C) leaves an earlier
    ``target`` as it was and no half file."""
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        handle = tmp.open("wb")
    except OSError as err:  # named as the user named it, not by the temporary name
        raise OSError(err.errno, err.strerror, str(target)) from None
    try:
        with handle as out:
            shutil.copyfileobj(stream, out, 1 << 20)
        if target.exists():
            shutil.copymode(target, tmp)  # a replaced file keeps its permissions
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _cmd_cat(args: argparse.Namespace, console: Console) -> int:
    store, path = locate(args.url)
    with _closing(store), store.open(path, "rb") as stream:
        if args.output:
            _copy_to_file(stream, Path(args.output))
        else:
            shutil.copyfileobj(stream, sys.stdout.buffer, 1 << 20)
            sys.stdout.buffer.flush()
    return 0


def _into(store: Any, path: str, text: str, name: str) -> str:
    """As cp does: a target that ends with / or is a directory takes the file under its own
    ``name``."""
    if text.endswith("/") or (store.exists(path) and store.stat(path).is_dir):
        if not name:
            raise StoreError(f"{text} is a directory: give the file's name after it")
        return join_path(path, name)
    return path


def _cmd_put(args: argparse.Namespace, console: Console) -> int:
    if args.source != "-" and Path(args.source).is_dir():
        # a ROS 2 bag is a directory: say how to store one instead of "Is a directory"
        # store URLs take paths as written (no percent-encoding), shell-quoted to paste
        where = shlex.quote(f"file://{Path(args.source).resolve()}")
        raise StoreError(
            f"{args.source} is a directory; put stores one file. Copy a directory (a ROS 2 "
            f"bag) with: adcloud store cp -r {where} {shlex.quote(args.url)}"
        )
    store, path = locate(args.url)
    with _closing(store):
        path = _into(store, path, args.url, "" if args.source == "-" else Path(args.source).name)
        source: io.BufferedReader = (
            sys.stdin.buffer  # type: ignore[assignment]
            if args.source == "-"
            else Path(args.source).open("rb")  # noqa: SIM115
        )
        options: dict[str, Any] = {
            "write_type": args.write_type,
            "ttl": args.ttl,
            "pinned": args.pin or None,
        }
        if isinstance(store, LocalStore):
            # a file's size is known before a byte is read: one larger than every tier is
            # refused at once, not after all of it was copied into the store
            with contextlib.suppress(OSError, ValueError):  # a pipe or no descriptor: unknown
                info = os.fstat(source.fileno())
                options["size"] = info.st_size if stat.S_ISREG(info.st_mode) else None
        try:
            with store.open(path, "wb", **options) as stream:
                # read1: what a pipe holds now, not a wait for 8 MiB, so a stream that can
                # never fit is refused as it passes the limit
                while piece := source.read1(8 << 20):
                    stream.write(piece)
        except StoreFullError as err:
            name = "stdin" if args.source == "-" else args.source
            raise StoreFullError(f"{name}: {err}") from err
        finally:
            if source is not sys.stdin.buffer:
                source.close()
        if not args.no_wait:
            _wait_persisted(store, [path], args.wait_timeout)
        status = store.stat(path)
        base = store.uri if store.uri.endswith("://") else store.uri.removesuffix("/")
        where = base + path
    console.print(
        f"stored {format_size(status.size)} at {where} "
        f"(tier {status.tier or 'under-store'}, {status.persistence})"
    )
    return 0


def _cmd_cp(args: argparse.Namespace, console: Console) -> int:
    src_store, src = locate(args.source)
    dst_store, dst = locate(args.target)
    with _closing(src_store), _closing(dst_store):
        status = src_store.stat(src)
        if not status.is_dir:
            files = [status]
            dst = _into(dst_store, dst, args.target, posixpath.basename(src))
        elif args.recursive:
            files = [e for e in src_store.list(src, recursive=True) if not e.is_dir]
        else:
            raise StoreError(f"{args.source} is a directory; copy it with -r")
        # within one store the store copies (a local:// tier links the object, an object
        # store copies on its side); between stores the bytes stream through this process
        same = src_store.uri == dst_store.uri
        options: dict[str, Any] = {"write_type": args.write_type, "pinned": args.pin or None}
        targets = []
        for entry in _maybe_progress(files, args.quiet):
            target = dst if not status.is_dir else join_path(dst, entry.path[len(src) :] or "/")
            if same:
                dst_store.copy(entry.path, target, **options)
            else:
                stream_copy(src_store, entry.path, dst_store, target, **options)
            targets.append(target)
        if not args.no_wait:
            _wait_persisted(dst_store, targets, args.wait_timeout)
    total = sum(e.size for e in files)
    console.print(
        f"copied {len(files):,} file(s), {format_size(total)}, from {args.source} to {args.target}"
    )
    return 0


def _wait_persisted(store: Store, paths: list[str], timeout: float) -> None:
    """Wait until the files at ``paths`` that this command wrote ``ASYNC_THROUGH`` are in the
    under-store: only these, not every persist pending in a shared store (another process's
    backlog, or a persist that keeps failing, is not this command's to wait for)."""
    if getattr(store, "flush", None) is None:  # no background persists (not local://)
        return
    deadline = time.monotonic() + timeout
    pending = list(paths)
    while True:
        still = []
        for path in pending:
            try:
                if store.stat(path).persistence is PersistenceState.TO_BE_PERSISTED:
                    still.append(path)
            except StoreNotFoundError:
                pass  # deleted meanwhile: nothing left to wait for
        if not still:
            return
        if time.monotonic() > deadline:
            named = ", ".join(still[:5]) + (f" and {len(still) - 5} more" if len(still) > 5 else "")
            raise StoreError(
                f"{len(still)} file(s) written are still not persisted after {timeout:g} s: "
                f"{named}; they are stored and persist in the background (the store's log "
                "says why it is slow), or give a longer --wait-timeout"
            )
        pending = still
        time.sleep(0.02)


def _maybe_progress(files: list[FileStatus], quiet: bool) -> Any:
    """``files``, with a progress bar on stderr when there are many to copy."""
    if quiet or len(files) < 2:
        return files
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(files, desc="copying", unit="file", file=sys.stderr)


def _cmd_stat(args: argparse.Namespace, console: Console) -> int:
    store, path = locate(args.url)
    with _closing(store):
        status = store.stat(path)
        if args.json:
            console.print_json(json.dumps(status.to_dict()))
            return 0
        table = Table(show_header=False, show_edge=False, pad_edge=False)
        table.add_column("field", style="bold")
        table.add_column("value")
        rows: list[tuple[str, Any]] = [
            ("path", status.path),
            ("kind", "directory" if status.is_dir else "file"),
            ("size", f"{status.size:,} B ({format_size(status.size)})"),
            ("tier", "-" if status.is_dir else _where(status, "under-store only")),
            ("pinned", "yes" if status.pinned else "no"),
            ("persistence", str(status.persistence)),
            ("write type", str(status.write_type or "-")),
            ("ttl", _ttl(status)),
            ("checksum", status.checksum or "-"),
        ]
        for name, value in rows:
            table.add_row(name, str(value))
        console.print(table)
        usage = _usage_table(store)
        if usage is not None:
            console.print(usage)
    return 0


def _cmd_free(args: argparse.Namespace, console: Console) -> int:
    store, path = locate(args.url)
    with _closing(store):
        store.free(path, recursive=args.recursive)
    console.print(f"freed the cached copies of {args.url}")
    return 0


def _cmd_persist(args: argparse.Namespace, console: Console) -> int:
    store, path = locate(args.url)
    with _closing(store):
        store.persist(path)
    console.print(f"{args.url} is in the under-store")
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from adcloud.store.base import open_store  # noqa: PLC0415
    from adcloud.store.server import ServerLimits, StoreServer  # noqa: PLC0415
    from adcloud.store.settings import StoreSettings  # noqa: PLC0415

    token = args.token
    source, fix = "--token", "give a non-empty token, or leave out --token"
    if args.token_file:
        try:
            token = Path(args.token_file).expanduser().read_text().strip()
        except OSError as err:
            raise StoreError(f"cannot read the token file {args.token_file}: {err}") from err
        source = f"the token file {args.token_file}"
        fix = "write the token into it, or leave out --token-file"
    if token is None:
        token = StoreSettings.load().token
        source = "the store token setting (ADCLOUD_STORE_TOKEN or store.token)"
        fix = "set it to a non-empty token, or unset it"
    if token is not None and not token.strip():
        # an empty token must never quietly mean "no authentication"
        raise StoreError(f"{source} is empty; {fix} to serve without a token")
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_file_bytes=args.max_file_bytes,
        max_streams=args.max_streams,
        max_connections=args.max_connections,
        socket_timeout=args.socket_timeout,
        header_timeout=args.header_timeout,
        min_body_rate=args.min_rate,
    )
    store = open_store(args.store)
    try:
        server = StoreServer(store, host=args.host, port=args.port, token=token, limits=limits)
    except OSError as err:
        store.close()
        raise StoreError(
            f"cannot listen on {args.host}:{args.port}: {err.strerror or err}; "
            + (
                "another process holds that port: stop it, or give --port (0 picks a free one)"
                if err.errno == errno.EADDRINUSE
                else "check --host and --port"
            )
        ) from err
    console.print(
        f"serving {store.uri} as an Alluxio 2.x REST proxy at {server.uri} "
        f"({'token required' if token else 'no token'}); Ctrl-C stops"
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        store.close()
    return 0


class _closing:  # noqa: N801 - used like contextlib.closing
    def __init__(self, store: Store) -> None:
        self._store = store

    def __enter__(self) -> Store:
        return self._store

    def __exit__(self, *exc: object) -> None:
        self._store.close()


#: Seconds > 0 that a socket or a thread can wait (beyond ``threading.TIMEOUT_MAX``, 292
#: years, a server's connections fail as they are accepted).
_seconds = number("number of seconds", maximum=threading.TIMEOUT_MAX)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: a port is 0-65535 (0: any free one)")
    return value


def _positive_size(text: str) -> int:
    value = _size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size > 0, e.g. 64GiB")
    return value


def _rate(text: str) -> int:
    value = _size(text.removesuffix("/s"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rate > 0, e.g. 64KiB/s")
    return value


def _size(text: str) -> int:
    from adcloud.store.base import parse_size  # noqa: PLC0415

    try:
        return parse_size(text)
    except StoreError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(subparsers: Any) -> None:
    """Register ``store`` and its subcommands on ``subparsers`` (from ``add_subparsers``)."""
    store = subparsers.add_parser(
        "store",
        help="list, read, write, free and persist data in a store; serve one over HTTP",
        description="Work with the tiered store (local://), an Alluxio cluster (alluxio://) "
        "or any fsspec URL. Sizes are shown per tier (MEM, SSD, HDD, under-store).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = store.add_subparsers(dest="store_command", metavar="COMMAND", required=True)

    ls = sub.add_parser(
        "ls",
        help="list a directory with sizes, tiers and persistence",
        description="List a directory: size, tier (MEM/SSD/HDD or under-store), pin, "
        "persistence state and TTL of every entry, then the listed bytes per tier.",
    )
    ls.add_argument("url", nargs="?", default="local:///", help=_URL_HELP + " (default local:///)")
    ls.add_argument("-r", "--recursive", action="store_true", help="list everything below")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_cmd_ls)

    cat = sub.add_parser(
        "cat", help="write a file's bytes to stdout", description="Stream a file to stdout."
    )
    cat.add_argument("url", help=_URL_HELP)
    cat.add_argument("-o", "--output", help="write to this local file instead of stdout")
    cat.set_defaults(func=_cmd_cat)

    put = sub.add_parser(
        "put",
        help="store a local file (or stdin) at a store URL",
        description="Stream a local file (or - for stdin) into a store; the file appears "
        "atomically when complete. For the local store the command waits until "
        "ASYNC_THROUGH data is persisted unless --no-wait.",
    )
    put.add_argument("source", help="local file, or - for stdin")
    put.add_argument("url", type=written_url("the file"), help=_URL_HELP)
    put.add_argument(
        "--write-type",
        type=_write_type,
        help="MUST_CACHE, CACHE_THROUGH, THROUGH or ASYNC_THROUGH (default: the store's)",
    )
    put.add_argument(
        "--ttl", type=_seconds, help="delete the file this many seconds after creation (> 0)"
    )
    put.add_argument("--pin", action="store_true", help="never evict the file from its tier")
    put.add_argument("--no-wait", action="store_true", help="do not wait for async persists")
    put.add_argument(
        "--wait-timeout", type=_seconds, default=600.0, help="seconds to wait for persists"
    )
    put.set_defaults(func=_cmd_put)

    cp = sub.add_parser(
        "cp",
        help="copy a file (or a directory, with -r) within a store or between stores",
        description="Copy a file, or everything below a directory with -r. Within one "
        "store the store copies by itself where it can (local:// links the cached object "
        "in its tier, so the bytes are held once; object stores copy on their side); "
        "between stores the bytes stream through this process. Each file appears "
        "atomically; an existing target file is replaced.",
    )
    cp.add_argument("source", help=_URL_HELP)
    cp.add_argument("target", type=written_url("the copy"), help=_URL_HELP)
    cp.add_argument("-r", "--recursive", action="store_true", help="copy a whole directory")
    cp.add_argument(
        "--write-type",
        type=_write_type,
        help="MUST_CACHE, CACHE_THROUGH, THROUGH or ASYNC_THROUGH (default: the store's)",
    )
    cp.add_argument("--pin", action="store_true", help="never evict the copies from their tier")
    cp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    cp.add_argument("--no-wait", action="store_true", help="do not wait for async persists")
    cp.add_argument(
        "--wait-timeout", type=_seconds, default=600.0, help="seconds to wait for persists"
    )
    cp.set_defaults(func=_cmd_cp)

    stat = sub.add_parser(
        "stat",
        help="status of a file or directory, and the local store's tier usage",
        description="Show size, tier, pin, persistence, write type, TTL and checksum of a "
        "path; for local:// also every tier's used and pinned bytes against its capacity.",
    )
    stat.add_argument("url", help=_URL_HELP)
    stat.add_argument("--json", action="store_true", help="machine-readable output")
    stat.set_defaults(func=_cmd_stat)

    free = sub.add_parser(
        "free",
        help="drop cached copies of persisted data",
        description="Drop a file's (or a directory's, with -r) cached copies from every tier. "
        "Only persisted, unpinned data can be freed; the under-store keeps it.",
    )
    free.add_argument("url", help=_URL_HELP)
    free.add_argument("-r", "--recursive", action="store_true", help="free a whole directory")
    free.set_defaults(func=_cmd_free)

    persist = sub.add_parser(
        "persist",
        help="write cached data to the under-store now",
        description="Persist a file (or everything below a directory) to the under-store "
        "and wait until it is there.",
    )
    persist.add_argument("url", help=_URL_HELP)
    persist.set_defaults(func=_cmd_persist)

    serve = sub.add_parser(
        "serve",
        help="serve a store over the Alluxio 2.x REST proxy API",
        description="Expose a store (default: the local tiered store) through the Alluxio "
        "2.x REST proxy API, for alluxio:// clients and the alluxio Python client. Binds "
        "to 127.0.0.1 unless --host says otherwise; use a token on any other address.",
    )
    serve.add_argument("--store", default="local://", help="store to serve (default local://)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=39999, help="port (default 39999; 0: any)")
    # one source of the token: with both, one of them would be silently ignored
    token = serve.add_mutually_exclusive_group()
    token.add_argument("--token", help="require this bearer token (prefer --token-file)")
    token.add_argument("--token-file", help="read the bearer token from this file")
    serve.add_argument(
        "--max-request-bytes",
        type=_positive_size,
        default="256MiB",
        help="largest write request (256MiB)",
    )
    serve.add_argument(
        "--max-file-bytes", type=_positive_size, default="64GiB", help="largest file (64GiB)"
    )
    serve.add_argument(
        "--max-streams", type=whole_number(1), default=256, help="open streams at most"
    )
    serve.add_argument(
        "--max-connections", type=whole_number(1), default=64, help="connections at most"
    )
    serve.add_argument(
        "--socket-timeout",
        type=_seconds,
        default=60.0,
        help="seconds one wait for a client may take, an idle keep-alive included (60)",
    )
    serve.add_argument(
        "--header-timeout",
        type=_seconds,
        default=30.0,
        help="seconds from a request's first byte to the end of its headers (30)",
    )
    serve.add_argument(
        "--min-rate",
        type=_rate,
        default="64KiB/s",
        help="slowest average a request body or a response may move at, after "
        "--socket-timeout of grace; slower clients are cut off to free their slot "
        "(64KiB/s; lower it for clients on slow links)",
    )
    serve.set_defaults(func=_cmd_serve)
