"""The :class:`Store` interface, its records, store paths and the URI registry.

Every service writes ``store.put(path, data)`` and never cares where the bytes go: the
local tiered store (``local://``, the embedded default), an Alluxio cluster through its
REST proxy (``alluxio://host:39999/``) or any fsspec filesystem (``file://``, ``memory://``,
``hdfs://``, ``s3://``).  :func:`open_store` picks the backend from the URI scheme;
a scheme whose optional package is missing fails with the exact ``pip install`` line.

Store paths
    Keys are absolute, ``/``-separated paths (``/drives/d1/part-00000.binpipe``).
    :func:`normalize_path` collapses repeated slashes and rejects ``.``/``..`` segments,
    NUL and control characters, invalid UTF-8, and paths over 4096 bytes or segments over
    255 bytes, so a path can never name anything outside the store's namespace.

Pickling
    A store pickles as its description -- URI and options -- and reopens itself on
    unpickling (on a Spark executor), never as open handles.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
import re
import shutil
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, BinaryIO, ClassVar, Literal, Protocol, Self, runtime_checkable

from adcloud.store.errors import (
    InvalidPathError,
    StoreBackendMissingError,
    StoreError,
    StoreUnsupportedError,
)

__all__ = [
    "CAPABILITIES",
    "BackendSpec",
    "BaseStore",
    "FileStatus",
    "PersistenceState",
    "Store",
    "TtlAction",
    "WriteType",
    "check_ttl",
    "check_ttl_change",
    "format_size",
    "install_hint",
    "join_path",
    "known_schemes",
    "locate",
    "normalize_path",
    "open_store",
    "parse_size",
    "register_backend",
    "stream_copy",
]

MAX_PATH_BYTES = 4096
MAX_SEGMENT_BYTES = 255

#: Bytes per read and write of a copy that streams through this process.
_COPY_CHUNK = 8 << 20

CAPABILITIES = frozenset({"tiers", "pin", "free", "persist", "ttl"})
"""What a backend can do beyond plain bytes: ``tiers`` (data lives in MEM/SSD/HDD tiers and
``FileStatus.tier`` says where), ``pin`` (pinned data is never evicted), ``free`` (cached
copies can be dropped), ``persist`` (cached data is written to an under-store), ``ttl``
(files expire).  A backend without one still accepts the call where it is trivially true
(pin/free/persist on a plain filesystem, where nothing is cached or evicted) and raises
:class:`~adcloud.store.errors.StoreUnsupportedError` where it is not (TTL)."""


class WriteType(enum.StrEnum):
    """Where a write goes, as Alluxio's write types.

    - ``MUST_CACHE``: cache tiers only, never persisted (intermediate data; the local store
      never evicts it out of its last tier, so it is only lost with the machine);
    - ``CACHE_THROUGH``: cache and under-store, synchronously;
    - ``THROUGH``: under-store only;
    - ``ASYNC_THROUGH``: cache now, under-store in the background from a durable journal.
    """

    MUST_CACHE = "MUST_CACHE"
    CACHE_THROUGH = "CACHE_THROUGH"
    THROUGH = "THROUGH"
    ASYNC_THROUGH = "ASYNC_THROUGH"

    @classmethod
    def parse(cls, value: WriteType | str) -> WriteType:
        """``value`` as a write type; accepts any case and ``-`` for ``_``."""
        if isinstance(value, WriteType):
            return value
        text = str(value).strip().upper().replace("-", "_")
        try:
            return cls(text)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise StoreError(f"unknown write type {value!r}; known: {known}") from None


class PersistenceState(enum.StrEnum):
    """Whether a file's bytes are in the under-store (Alluxio's persistence states)."""

    NOT_PERSISTED = "NOT_PERSISTED"
    TO_BE_PERSISTED = "TO_BE_PERSISTED"
    PERSISTED = "PERSISTED"
    LOST = "LOST"


class TtlAction(enum.StrEnum):
    """What happens when a file's TTL expires: delete it, or only free its cached copies."""

    DELETE = "DELETE"
    FREE = "FREE"

    @classmethod
    def parse(cls, value: TtlAction | str) -> TtlAction:
        """``value`` as a TTL action (any case)."""
        if isinstance(value, TtlAction):
            return value
        try:
            return cls(str(value).strip().upper())
        except ValueError:
            raise StoreError(f"unknown TTL action {value!r}; known: DELETE, FREE") from None


@dataclasses.dataclass(frozen=True)
class FileStatus:
    """What a store knows about one file or directory.

    ``size`` is in bytes (0 for directories); ``mtime`` in seconds since the epoch;
    ``tier`` is the cache tier holding the bytes (``"MEM"``, ``"SSD"``, ``"HDD"``) or
    ``None`` when they are only in the under-store or the backend has no tiers; ``ttl`` is
    in seconds from the file's creation, ``None`` for none; ``checksum`` is
    ``"crc32:<8 hex digits>"`` where the backend records one, or on object stores the
    version the store reports (``"etag:<tag>"``, ``"version:<id>"``): it changes with
    every new version of the file, even of the same size written within the same second.
    """

    path: str
    size: int
    is_dir: bool
    mtime: float
    tier: str | None = None
    pinned: bool = False
    persistence: PersistenceState = PersistenceState.PERSISTED
    ttl: float | None = None
    ttl_action: TtlAction = TtlAction.DELETE
    checksum: str | None = None
    write_type: WriteType | None = None

    @property
    def name(self) -> str:
        """The last path segment (``""`` for the root)."""
        return self.path.rsplit("/", 1)[-1]

    @property
    def persisted(self) -> bool:
        """Whether the bytes are in the under-store."""
        return self.persistence is PersistenceState.PERSISTED

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (enums as strings)."""
        out = dataclasses.asdict(self)
        for key in ("persistence", "ttl_action", "write_type"):
            value = out[key]
            out[key] = None if value is None else str(value)
        return out


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def normalize_path(path: str) -> str:
    """``path`` as a canonical store path: ``/`` + segments joined by ``/``.

    Raises :class:`InvalidPathError` for anything that could leave the namespace or is not
    text: ``.``/``..`` segments, NUL/control characters, invalid UTF-8, over-long paths.
    """
    if not isinstance(path, str):
        raise InvalidPathError(f"store paths are strings, got {type(path).__name__}")
    if _CONTROL.search(path):
        raise InvalidPathError(f"{path!r}: control characters are not allowed in store paths")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPathError(f"{path!r}: not valid UTF-8") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise InvalidPathError(f"store path longer than {MAX_PATH_BYTES} bytes: {path[:80]!r}...")
    parts = [p for p in path.split("/") if p]
    for part in parts:
        if part in (".", ".."):
            raise InvalidPathError(f"{path!r}: '.' and '..' segments are not allowed")
        if len(part.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise InvalidPathError(f"{path!r}: segment longer than {MAX_SEGMENT_BYTES} bytes")
    return "/" + "/".join(parts)


def join_path(prefix: str, path: str) -> str:
    """``path`` (normalized) below the namespace ``prefix`` (normalized)."""
    rel = normalize_path(path)
    base = normalize_path(prefix)
    if base == "/":
        return rel
    return base if rel == "/" else base + rel


def parent_path(path: str) -> str:
    """The parent of a normalized path (``/`` for top-level entries and the root)."""
    head = path.rsplit("/", 1)[0]
    return head or "/"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "ti": 1024**4,
}


#: The longest TTL in seconds (100 years): a file's expiry is kept in nanoseconds since the
#: epoch, and a 64-bit integer holds those only until the year 2262.
MAX_TTL = 100 * 365 * 86400


def check_ttl(ttl: float | None, path: str) -> None:
    """Refuse a TTL a new file cannot have: it expires ``ttl`` seconds after creation, so
    anything but a positive number up to :data:`MAX_TTL` (or None, never) would delete it
    as it is written -- and with it the file it replaced -- or overflow its expiry."""
    if ttl is not None and not (isinstance(ttl, (int, float)) and 0 < ttl <= MAX_TTL):
        raise StoreError(
            f"{path}: TTL must be a positive number of seconds after creation, at most "
            f"{MAX_TTL} (100 years), got {ttl!r} (leave it out for a file that never "
            "expires); nothing was written"
        )


def check_ttl_change(ttl: float | None, path: str) -> None:
    """Refuse a TTL that ``set_ttl`` cannot give an existing file: anything but None (clear
    it) or a number of seconds from 0 (expire it now) to :data:`MAX_TTL`."""
    if ttl is None:
        return
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise StoreError(f"{path}: TTL must be a number of seconds, got {ttl!r}")
    if ttl < 0:
        raise StoreError(
            f"{path}: TTL must not be negative, got {ttl} s; give the seconds after "
            "creation at which the file expires, or None to clear the TTL"
        )
    if not ttl <= MAX_TTL:  # also NaN
        raise StoreError(
            f"{path}: TTL must be at most {MAX_TTL} s (100 years), got {ttl!r}; give None "
            "for a file that never expires"
        )


def parse_size(text: str | int) -> int:
    """Bytes in a size like ``"64MiB"``, ``"1.5GB"``, ``"4096"`` (SI and binary units)."""
    if isinstance(text, int):
        if text < 0:
            raise StoreError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(text)
    unit = (match.group(2) or "").lower() if match else ""
    if match is None or unit not in _UNITS:
        raise StoreError(f"not a size: {text!r} (write e.g. 512MiB, 2GB or 4096)")
    size = float(match.group(1)) * _UNITS[unit]
    if 0 < size < 1:  # "0.5" meant 0.5 of some unit: 0 bytes would switch a tier off
        raise StoreError(f"size {text!r} is less than a byte; give a unit, e.g. {text}GiB")
    return int(size)


def format_size(size: int) -> str:
    """``size`` bytes for people: ``"1.5 MiB"``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@runtime_checkable
class Store(Protocol):
    """One interface to bytes at memory speed or in durable storage.

    Paths are store paths (see :func:`normalize_path`).  ``put`` overwrites: the last
    writer wins atomically and readers always see one complete version.  ``write_type``
    (:class:`WriteType`) and ``ttl`` (seconds from creation) default to the store's
    settings; ``pinned=None`` keeps the pin state of the file being overwritten.
    """

    @property
    def uri(self) -> str:
        """The URI this store was opened from (no credentials)."""
        ...

    @property
    def capabilities(self) -> frozenset[str]:
        """The subset of :data:`CAPABILITIES` this backend implements."""
        ...

    def put(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Store ``data`` at ``path`` (creating parent directories)."""
        ...

    def get(self, path: str) -> bytes:
        """All bytes of the file at ``path``."""
        ...

    def open(
        self,
        path: str,
        mode: Literal["rb", "wb"] = "rb",
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> BinaryIO:
        """A stream to read (``"rb"``) or write (``"wb"``) ``path``.

        A write stream publishes the file when it is closed without error; leaving its
        ``with`` block by an exception discards it, so nobody ever sees half a file.
        """
        ...

    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""
        ...

    def stat(self, path: str) -> FileStatus:
        """The status of the file or directory at ``path``."""
        ...

    def list(self, path: str = "/", *, recursive: bool = False) -> list[FileStatus]:
        """Entries under the directory ``path`` sorted by path (a file lists as itself)."""
        ...

    def mkdir(self, path: str) -> None:
        """Create the directory ``path`` and its parents (no error if it exists)."""
        ...

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory (non-empty ones only with ``recursive``)."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``; ``dst`` must not exist."""
        ...

    def copy(
        self,
        src: str,
        dst: str,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Copy the file ``src`` to ``dst``, as a ``put`` of its bytes would (``dst`` is
        overwritten atomically; its write type, TTL and pin as ``put`` takes them)."""
        ...

    def pin(self, path: str) -> None:
        """Keep ``path`` (a file, or every file below a directory) in its cache tier."""
        ...

    def unpin(self, path: str) -> None:
        """Let ``path`` be evicted again."""
        ...

    def free(self, path: str, *, recursive: bool = False) -> None:
        """Drop the cached copies of persisted data (the under-store keeps it)."""
        ...

    def persist(self, path: str) -> None:
        """Write ``path`` to the under-store now and wait until it is there."""
        ...

    def set_ttl(
        self, path: str, ttl: float | None, *, action: TtlAction | str = TtlAction.DELETE
    ) -> None:
        """Expire ``path`` ``ttl`` seconds after its creation (``None`` clears it)."""
        ...

    def close(self) -> None:
        """Release connections and background threads (the store can be reopened)."""
        ...


class BaseStore(abc.ABC):
    """Shared machinery of the backends: description, pickling, context manager.

    Subclasses call ``super().__init__(uri, options)`` with the canonical URI and the
    plain (picklable) options they were opened with; unpickling calls
    :func:`open_store` with both, on whatever machine unpickles.
    """

    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, uri: str, options: Mapping[str, Any]) -> None:
        self._uri = uri
        self._options = dict(options)

    @property
    def uri(self) -> str:
        """The URI this store was opened from (no credentials)."""
        return self._uri

    @property
    def options(self) -> dict[str, Any]:
        """The options this store was opened with (a copy)."""
        return dict(self._options)

    def __reduce__(self) -> tuple[Callable[..., Store], tuple[str, dict[str, Any]]]:
        return (_reopen, (self._uri, dict(self._options)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._uri!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def get(self, path: str) -> bytes:
        """All bytes of the file at ``path``."""
        with self.open(path, "rb") as stream:
            return stream.read()

    def put(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Store ``data`` at ``path``."""
        with self.open(path, "wb", write_type=write_type, ttl=ttl, pinned=pinned) as stream:
            stream.write(data)

    @abc.abstractmethod
    def open(
        self,
        path: str,
        mode: Literal["rb", "wb"] = "rb",
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> BinaryIO:
        """A stream to read or write ``path`` (see :class:`Store`)."""

    def copy(
        self,
        src: str,
        dst: str,
        *,
        write_type: WriteType | str | None = None,
        ttl: float | None = None,
        pinned: bool | None = None,
    ) -> None:
        """Copy the file ``src`` to ``dst`` by streaming its bytes through this process;
        backends that can copy without moving the bytes here override it."""
        stream_copy(self, src, self, dst, write_type=write_type, ttl=ttl, pinned=pinned)

    def set_ttl(
        self, path: str, ttl: float | None, *, action: TtlAction | str = TtlAction.DELETE
    ) -> None:
        """Expire ``path`` ``ttl`` seconds after creation; unsupported unless overridden."""
        raise StoreUnsupportedError(
            f"{self._uri}: this backend cannot expire files (TTL); use a local:// or "
            "alluxio:// store"
        )

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release resources (nothing to release by default)."""


def stream_copy(
    source: Store | BaseStore,
    src: str,
    target: Store | BaseStore,
    dst: str,
    *,
    write_type: WriteType | str | None = None,
    ttl: float | None = None,
    pinned: bool | None = None,
) -> None:
    """Copy the file ``src`` of ``source`` to ``dst`` of ``target`` (any two stores, or the
    same one) through this process; ``dst`` appears when complete, as a ``put`` would."""
    with (
        source.open(src, "rb") as reader,
        target.open(dst, "wb", write_type=write_type, ttl=ttl, pinned=pinned) as writer,
    ):
        shutil.copyfileobj(reader, writer, _COPY_CHUNK)


def _reopen(uri: str, options: dict[str, Any]) -> Store:
    return open_store(uri, **options)


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """How to open stores of one URI scheme.

    ``target`` is ``"module:Class"``; the class is called ``Class(uri, **options)``.
    ``requires`` are the importable modules it needs and ``hint`` how to install them.
    """

    scheme: str
    target: str
    requires: tuple[str, ...] = ()
    hint: str = ""


_FSSPEC = "adcloud.store.fsspec_store:FsspecStore"
_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(
    scheme: str,
    target: str,
    *,
    requires: tuple[str, ...] = (),
    hint: str = "",
    clobber: bool = False,
) -> None:
    """Make ``scheme://`` URIs open with ``target`` (``"module:Class"``)."""
    scheme = scheme.lower()
    if scheme in _REGISTRY and not clobber:
        raise StoreError(f"a backend for {scheme}:// is already registered")
    _REGISTRY[scheme] = BackendSpec(scheme, target, requires, hint)


for _scheme, _target, _requires, _hint in (
    ("local", "adcloud.store.local:LocalStore", (), ""),
    ("alluxio", "adcloud.store.alluxio:AlluxioStore", (), ""),
    ("file", _FSSPEC, (), ""),
    ("memory", _FSSPEC, (), ""),
    (
        "hdfs",
        _FSSPEC,
        ("pyarrow",),
        "pip install pyarrow, and install a Hadoop client: libhdfs.so on "
        "ARROW_LIBHDFS_DIR/LD_LIBRARY_PATH and the Hadoop jars on CLASSPATH "
        "(`export CLASSPATH=$(hadoop classpath --glob)`)",
    ),
    ("s3", _FSSPEC, ("s3fs",), "pip install s3fs"),
    ("s3a", _FSSPEC, ("s3fs",), "pip install s3fs"),
    ("gs", _FSSPEC, ("gcsfs",), "pip install gcsfs"),
    ("gcs", _FSSPEC, ("gcsfs",), "pip install gcsfs"),
    ("abfs", _FSSPEC, ("adlfs",), "pip install adlfs"),
    ("az", _FSSPEC, ("adlfs",), "pip install adlfs"),
):
    register_backend(_scheme, _target, requires=_requires, hint=_hint)


def known_schemes() -> list[str]:
    """URI schemes with a registered backend (fsspec may open more)."""
    return sorted(_REGISTRY)


def _spec_for(scheme: str) -> BackendSpec:
    spec = _REGISTRY.get(scheme)
    if spec is not None:
        return spec
    # the module, not the ``fsspec.registry`` mapping that fsspec's __init__ exports
    fsspec_registry = importlib.import_module("fsspec.registry")
    known = fsspec_registry.known_implementations.get(scheme)
    if known is None and scheme not in fsspec_registry.registry:
        raise StoreError(
            f"no store backend for {scheme}:// URIs; known: {', '.join(known_schemes())} "
            "and the fsspec protocols"
        )
    hint = known.get("err", "") if known else ""
    return BackendSpec(scheme, _FSSPEC, (), hint)


def install_hint(scheme: str) -> str:
    """How to install what ``scheme://`` stores need (empty if nothing is known)."""
    try:
        return _spec_for(scheme.lower()).hint
    except StoreError:
        return ""


def _load(spec: BackendSpec) -> Callable[..., Store]:
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise StoreBackendMissingError(
                f"{spec.scheme}:// stores need the {module!r} package, which is not "
                f"installed: {spec.hint or 'pip install ' + module}"
            ) from err
    module_name, _, attr = spec.target.partition(":")
    factory: Callable[..., Store] = getattr(importlib.import_module(module_name), attr)
    return factory


def _scheme_of(uri: str) -> str:
    if "://" not in uri:
        raise StoreError(
            f"not a store URI: {uri!r}; write local://, alluxio://HOST:PORT/, file:///DIR, "
            "memory://, hdfs://..., s3://BUCKET/..."
        )
    return uri.split("://", 1)[0].lower()


def open_store(uri: str, **options: Any) -> Store:
    """The store that ``uri`` names, opened with backend ``options``.

    ``local://`` (or ``local:///NAMESPACE``) is the local tiered store; ``alluxio://HOST:PORT/``
    an Alluxio 2.x REST proxy (or ``adcloud store serve``); anything else an fsspec
    filesystem rooted at the URI's path.
    """
    spec = _spec_for(_scheme_of(uri))
    return _load(spec)(uri, **options)


def locate(url: str, **options: Any) -> tuple[Store, str]:
    """Split a full URL into the store at its scheme's root and the path inside it.

    ``local:///drives/d1/x`` -> (``local://`` store, ``/drives/d1/x``);
    ``alluxio://h:39999/a/b`` -> (store for ``alluxio://h:39999/``, ``/a/b``);
    ``file:///tmp/x`` -> (``file:///`` store, ``/tmp/x``); ``s3://bucket/k`` -> (``s3://``
    store, ``/bucket/k``).  The path is taken as written: ``?`` and ``#`` are characters of
    store paths (a file may be named ``a#1``), never a query or a fragment to drop.
    """
    root, path = split_url(url)
    return open_store(root, **options), path


def split_url(url: str) -> tuple[str, str]:
    """The store root and the store path of a full URL, as :func:`locate` splits it,
    without opening the store."""
    scheme = _scheme_of(url)
    netloc, slash, rest = url.split("://", 1)[1].partition("/")
    if scheme in ("local", "alluxio"):
        root = f"{scheme}://{netloc}/" if netloc else f"{scheme}://"
        path = slash + rest or "/"
    elif scheme == "file":
        root, path = "file:///", slash + rest or "/"
    else:
        root, path = f"{scheme}://", "/" + netloc + slash + rest
    return root, normalize_path(path)
