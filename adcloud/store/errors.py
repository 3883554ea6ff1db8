"""Errors of the storage layer.

Every error a store raises is a :class:`StoreError`.  The subclasses say what went wrong in
terms a caller can act on; each maps to one Alluxio status code (``alluxio_status``) so the
REST proxy server and the Alluxio backend translate errors both ways without losing meaning.
"""

from __future__ import annotations

from adcloud.errors import AdcloudError, MissingComponentError

__all__ = [
    "InvalidPathError",
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
    "StoreUnavailableError",
    "StoreUnsupportedError",
    "error_for_status",
]


class StoreError(AdcloudError):
    """A store operation failed; the message names the store path and what to do."""

    alluxio_status = "UNKNOWN"


class StoreNotFoundError(StoreError):
    """The path does not exist (or its TTL expired)."""

    alluxio_status = "NOT_FOUND"


class StoreExistsError(StoreError):
    """The destination already exists (``rename`` onto an existing path, ``mkdir`` of a file)."""

    alluxio_status = "ALREADY_EXISTS"


class InvalidPathError(StoreError):
    """A path is not a valid store path: ``..``/``.`` segments, NUL or control characters,
    invalid UTF-8, or longer than the limits (4096 bytes, 255 bytes per segment)."""

    alluxio_status = "INVALID_ARGUMENT"


class StorePreconditionError(StoreError):
    """The operation does not apply in the path's current state: a directory where a file is
    needed (or the reverse), a non-empty directory without ``recursive``, freeing data that
    is pinned or not yet persisted."""

    alluxio_status = "FAILED_PRECONDITION"


class StoreFullError(StoreError):
    """No tier can hold the data: every tier is full of pinned or not-yet-persisted data, or
    the filesystem under a tier ran out of space.  Nothing already stored was lost."""

    alluxio_status = "RESOURCE_EXHAUSTED"


class StoreCorruptionError(StoreError):
    """Stored bytes do not match their recorded checksum."""

    alluxio_status = "DATA_LOSS"


class StoreDataLostError(StoreError):
    """A file's only copy is gone: it was cached without persistence (``MUST_CACHE``) in a
    memory tier that did not survive a reboot."""

    alluxio_status = "DATA_LOSS"


class StoreUnsupportedError(StoreError):
    """The backend cannot do this (for example TTL on a plain ``file://`` store)."""

    alluxio_status = "UNIMPLEMENTED"


class StoreAuthError(StoreError):
    """The store server refused the request's credentials (missing or wrong token)."""

    alluxio_status = "UNAUTHENTICATED"


class StoreUnavailableError(StoreError):
    """The store server cannot be reached, or it is overloaded; retrying later may work."""

    alluxio_status = "UNAVAILABLE"


class StoreProtocolError(StoreError):
    """A store server answered something that is not the Alluxio REST protocol."""

    alluxio_status = "INTERNAL"


class StoreBackendMissingError(StoreError, MissingComponentError):
    """The optional package a URI scheme needs is not installed; the message says how."""

    alluxio_status = "UNIMPLEMENTED"


_BY_STATUS: dict[str, type[StoreError]] = {
    "NOT_FOUND": StoreNotFoundError,
    "ALREADY_EXISTS": StoreExistsError,
    "INVALID_ARGUMENT": InvalidPathError,
    "FAILED_PRECONDITION": StorePreconditionError,
    "RESOURCE_EXHAUSTED": StoreFullError,
    "DATA_LOSS": StoreCorruptionError,
    "UNIMPLEMENTED": StoreUnsupportedError,
    "UNAUTHENTICATED": StoreAuthError,
    "PERMISSION_DENIED": StoreAuthError,
    "UNAVAILABLE": StoreUnavailableError,
}


def error_for_status(status: str) -> type[StoreError]:
    """The :class:`StoreError` subclass for an Alluxio status code (``StoreError`` if unknown)."""
    return _BY_STATUS.get(status, StoreError)
