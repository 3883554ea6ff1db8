"""The shell every store write stream shares: file-object manners and context handling.

A write stream publishes its file atomically on :meth:`close` and discards it on
:meth:`abort`; leaving a ``with`` block by an exception aborts.  Subclasses supply
``write``, ``tell``, ``abort`` and ``close``.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["WriteStream"]


class WriteStream(abc.ABC):
    """Base of the append-only write streams of the store backends."""

    def __init__(self, name: str) -> None:
        self._closed = False
        self.name = name

    @property
    def closed(self) -> bool:
        """Whether the stream was published or aborted."""
        return self._closed

    def readable(self) -> bool:
        """Write streams are not readable."""
        return False

    def writable(self) -> bool:
        """True until the stream is closed."""
        return not self._closed

    def seekable(self) -> bool:
        """Write streams only append."""
        return False

    def flush(self) -> None:  # noqa: B027 - a deliberate no-op shared by every backend
        """Nothing to flush: each backend sends or stages bytes as they are written."""

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns its length."""

    @abc.abstractmethod
    def tell(self) -> int:
        """Bytes written so far."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written; the path keeps its previous version."""

    @abc.abstractmethod
    def close(self) -> None:
        """Publish the file atomically; a no-op when already closed."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
