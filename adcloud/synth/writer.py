"""Bag writers for synthetic drives: ROS 1, ROS 2 (sqlite3) and ROS 2 (MCAP), streaming.

All three go through rosbags' writers, which hold at most one chunk in memory (ROS 1:
``chunk_bytes``; MCAP: 1 MiB) or write rows straight to sqlite.  Messages must arrive
in time order.  :data:`WRITERS` maps a format name to its factory.

Determinism: none of these writers stores a wall-clock time, a host name or a random
id, so the same messages give the same bytes.  The MCAP header names the rosbags
version (``rosbags-<version>``) and the sqlite3 file the SQLite library's version, so
the bytes are reproducible for the same package versions.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol

import lz4.frame
from rosbags.interfaces import (
    Qos,
    QosDurability,
    QosHistory,
    QosLiveliness,
    QosReliability,
    QosTime,
)
from rosbags.rosbag1 import Writer as Ros1Writer
from rosbags.rosbag1 import WriterError
from rosbags.rosbag2 import StoragePlugin
from rosbags.rosbag2 import Writer as Ros2Writer
from rosbags.rosbag2 import WriterError as Ros2WriterError
from rosbags.rosbag2.enums import CompressionFormat, CompressionMode
from rosbags.typesys.store import Typestore

from adcloud.synth.config import DriveConfig
from adcloud.synth.errors import SynthError

__all__ = ["WRITERS", "BagWriter", "open_writer"]

_CALLER = "/adcloud_synth"
# rosbag2 format 8 (Iron): QoS profiles stored as a YAML string with numeric policies, as
# Humble reads them (``offered_qos_profiles.as<std::string>()``, then integers).  Format 9
# (Jazzy) stores them as a YAML list with named policies ("keep_last"), so ``ros2 bag
# info`` / ``play`` on Humble -- whose message definitions the bag uses -- could not open
# the drive; Jazzy and later read format 8 as well.
_ROS2_VERSION: Final = 8


class BagWriter(Protocol):
    """Where a drive's serialized messages go, in time order."""

    def add_topic(self, topic: str, msgtype: str, *, latched: bool = False) -> None:
        """Declare ``topic`` (type like ``sensor_msgs/msg/Imu``) before writing to it."""

    def write(self, topic: str, t_ns: int, data: bytes) -> None:
        """Append one serialized message with record time ``t_ns`` (ns since the epoch)."""

    def close(self) -> None:
        """Write indexes and metadata; the bag is complete afterwards."""

    def abort(self) -> None:
        """Release the output after a failure (the partial bag is then removed)."""


def _roslz4_frame(data: bytes) -> bytes:
    """An LZ4 frame as ROS 1's ``roslz4`` writes and reads it.

    ``roslz4`` only decodes frames of independent 1 MiB blocks with a content checksum
    and no stored content size; rosbags' default LZ4 frames (linked 64 KiB blocks, with
    the size) read fine in rosbags but fail in ROS 1 with "malformed data".
    """
    return bytes(
        lz4.frame.compress(
            data,
            compression_level=0,
            block_size=lz4.frame.BLOCKSIZE_MAX1MB,
            block_linked=False,
            content_checksum=True,
            store_size=False,
        )
    )


class _Ros1(BagWriter):
    def __init__(self, path: Path, config: DriveConfig, store: Typestore) -> None:
        self.store = store
        self.writer = Ros1Writer(path)
        if config.compression != "none":
            self.writer.set_compression(Ros1Writer.CompressionFormat[config.compression.upper()])
        if config.compression == "lz4":
            self.writer.compressor = _roslz4_frame
        self.writer.chunk_threshold = config.chunk_bytes
        self.writer.open()
        self.conns: dict[str, object] = {}

    def add_topic(self, topic: str, msgtype: str, *, latched: bool = False) -> None:
        self.conns[topic] = self.writer.add_connection(
            topic, msgtype, typestore=self.store, callerid=_CALLER, latching=1 if latched else None
        )

    def write(self, topic: str, t_ns: int, data: bytes) -> None:
        self.writer.write(self.conns[topic], t_ns, data)  # type: ignore[arg-type]

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        if self.writer.bio is not None:
            self.writer.bio.close()


def _qos(latched: bool) -> list[Qos]:
    zero = QosTime(0, 0)
    never = QosTime(2147483647, 4294967295)
    return [
        Qos(
            QosHistory.KEEP_LAST if latched else QosHistory.UNKNOWN,
            1 if latched else 0,
            QosReliability.RELIABLE,
            QosDurability.TRANSIENT_LOCAL if latched else QosDurability.VOLATILE,
            never if latched else zero,
            never if latched else zero,
            QosLiveliness.AUTOMATIC,
            never if latched else zero,
            False,
        )
    ]


class _Ros2(BagWriter):
    def __init__(
        self, path: Path, config: DriveConfig, store: Typestore, plugin: StoragePlugin
    ) -> None:
        self.store = store
        self.writer = Ros2Writer(path, version=_ROS2_VERSION, storage_plugin=plugin)
        if config.compression == "zstd":
            self.writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        self.writer.open()
        self.conns: dict[str, object] = {}

    def add_topic(self, topic: str, msgtype: str, *, latched: bool = False) -> None:
        self.conns[topic] = self.writer.add_connection(
            topic, msgtype, typestore=self.store, offered_qos_profiles=_qos(latched)
        )

    def write(self, topic: str, t_ns: int, data: bytes) -> None:
        self.writer.write(self.conns[topic], t_ns, data)  # type: ignore[arg-type]

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


#: Factories ``(path, config, typestore) -> BagWriter`` per format.
WRITERS: dict[str, Callable[[Path, DriveConfig, Typestore], BagWriter]] = {
    "ros1": _Ros1,
    "ros2": lambda p, c, s: _Ros2(p, c, s, StoragePlugin.SQLITE3),
    "mcap": lambda p, c, s: _Ros2(p, c, s, StoragePlugin.MCAP),
}


def open_writer(path: Path, config: DriveConfig, store: Typestore) -> BagWriter:
    """A writer for ``config.format`` creating ``path`` (which must not exist)."""
    try:
        factory = WRITERS[config.format]
    except KeyError:
        raise SynthError(
            f"unknown bag format {config.format!r}; choose from {', '.join(WRITERS)}"
        ) from None
    if path.exists():
        raise SynthError(f"{path} exists already; remove it or pass overwrite=True (--overwrite)")
    try:
        return factory(path, config, store)
    except (OSError, WriterError, Ros2WriterError) as err:
        if isinstance(err.__context__, FileExistsError):  # rosbags' atomic create lost a race
            raise SynthError(
                f"{path} exists already (another run created it); remove it or pass "
                "overwrite=True (--overwrite)"
            ) from err
        _remove_partial(path)  # ours: the writer created it before failing
        raise SynthError(f"cannot create the bag {path}: {err}") from err


def _remove_partial(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)
