"""Memory-speed shared storage: one :class:`Store` interface over tiered memory and disks.

- :func:`open_store` -- a store from a URI: ``local://`` (:class:`LocalStore`, the embedded
  tiered store shared by every process on the machine), ``alluxio://HOST:PORT/``
  (:class:`AlluxioStore`, an Alluxio 2.x REST proxy or ``adcloud store serve``) or any fsspec
  URL (:class:`FsspecStore`: ``file://``, ``memory://``, ``hdfs://``, ``s3://``);
- :class:`WriteType` -- Alluxio's write types (``MUST_CACHE``, ``CACHE_THROUGH``,
  ``THROUGH``, ``ASYNC_THROUGH``);
- :class:`StoreServer` -- serves a store over the Alluxio REST proxy API;
- :class:`StoreSettings` -- tier directories and capacities (``ADCLOUD_STORE_*``).

Stores pickle as their URI and options, so they cross Spark closures cheaply and reopen
on the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adcloud.store.alluxio import AlluxioStore
from adcloud.store.base import (
    CAPABILITIES,
    BackendSpec,
    FileStatus,
    PersistenceState,
    Store,
    TtlAction,
    WriteType,
    format_size,
    known_schemes,
    locate,
    normalize_path,
    open_store,
    parse_size,
    register_backend,
)
from adcloud.store.errors import (
    InvalidPathError,
    StoreAuthError,
    StoreBackendMissingError,
    StoreCorruptionError,
    StoreDataLostError,
    StoreError,
    StoreExistsError,
    StoreFullError,
    StoreNotFoundError,
    StorePreconditionError,
    StoreProtocolError,
    StoreUnavailableError,
    StoreUnsupportedError,
)
from adcloud.store.fsspec_store import FsspecStore
from adcloud.store.local import LocalStore, TierUsage
from adcloud.store.server import ServerLimits, StoreServer
from adcloud.store.settings import StoreSettings

if TYPE_CHECKING:  # mypy proves every backend implements the whole Store protocol
    _BACKENDS: tuple[type[Store], ...] = (LocalStore, AlluxioStore, FsspecStore)

__all__ = [
    "CAPABILITIES",
    "AlluxioStore",
    "BackendSpec",
    "FileStatus",
    "FsspecStore",
    "InvalidPathError",
    "LocalStore",
    "PersistenceState",
    "ServerLimits",
    "Store",
    "StoreAuthError",
    "StoreBackendMissingError",
    "StoreCorruptionError",
    "StoreDataLostError",
    "StoreError",
    "StoreExistsError",
    "StoreFullError",
    "StoreNotFoundError",
    "StorePreconditionError",
    "StoreProtocolError",
    "StoreServer",
    "StoreSettings",
    "StoreUnavailableError",
    "StoreUnsupportedError",
    "TierUsage",
    "TtlAction",
    "WriteType",
    "format_size",
    "known_schemes",
    "locate",
    "normalize_path",
    "open_store",
    "parse_size",
    "register_backend",
]
