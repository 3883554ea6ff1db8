"""Decoding serialized ROS messages on executors, from the definitions in META blocks.

Every partition built from a bag starts with a META block whose records describe the
connections: ``(topic, msgtype, msgdef_format, msgdef, md5sum, serialization)``.
:class:`MessageDecoder` registers those definitions in a private rosbags type store,
so an executor decodes messages without ROS installed and without the message
packages of the robot that recorded them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from rosbags.typesys import (
    Stores,
    TypesysError,
    get_types_from_idl,
    get_types_from_msg,
    get_typestore,
)
from rosbags.typesys.store import Typestore

from adcloud.binpipe.codec import Block, BlockKind, Message, as_message, encode_block
from adcloud.binpipe.errors import BinpipeError

__all__ = [
    "ConnectionInfo",
    "MessageDecoder",
    "decoded_messages",
    "meta_block",
    "read_messages",
    "standard_typestore",
]


class ConnectionInfo(NamedTuple):
    """One META record: how the messages of one topic are typed and serialized.

    ``msgdef_format`` is ``ros1msg``, ``ros2msg``, ``ros2idl`` or empty (unknown);
    ``serialization`` is ``ros1`` or ``cdr``.
    """

    topic: str
    msgtype: str
    msgdef_format: str
    msgdef: str
    md5sum: str
    serialization: str

    @classmethod
    def from_record(cls, rec: Sequence[object], where: str = "a META block") -> ConnectionInfo:
        """The connection a META record describes; a :class:`BinpipeError` naming ``where``
        and what is wrong when the record is not six STR fields."""
        if len(rec) == len(cls._fields) and all(isinstance(value, str) for value in rec):
            return cls(*rec)  # type: ignore[arg-type]
        kinds = ", ".join(type(value).__name__ for value in rec) or "none"
        raise BinpipeError(
            f"a record in {where} is not a message definition: it has fields of type "
            f"({kinds}), expected {len(cls._fields)} str ({', '.join(cls._fields)}); "
            "META blocks carry message definitions (docs/binpipe-format.md, section 9.2)"
        )


def meta_block(connections: Iterable[ConnectionInfo]) -> bytes:
    """Encode connection descriptions as one META block."""
    return encode_block((tuple(c) for c in connections), kind=BlockKind.META)


@functools.cache
def standard_typestore(serialization: str) -> Typestore:
    """rosbags' bundled standard types: ROS 1 Noetic for ``"ros1"`` serialization, ROS 2
    Humble otherwise.  Built once per process and shared (read-only): each takes ~60 ms,
    which a pipe node would otherwise pay at every start."""
    return get_typestore(Stores.ROS1_NOETIC if serialization == "ros1" else Stores.ROS2_HUMBLE)


#: The line that separates the sections of a ``ros2idl`` definition in rosbag2 and MCAP
#: files: the type's own IDL and then each type it uses, each section headed
#: ``IDL: pkg/msg/Type``.
_IDL_SEPARATOR = "=" * 80 + "\n"


def types_from_idl(msgdef: str) -> dict[str, Any]:
    """The types of a ``ros2idl`` definition: one IDL text, or the sectioned form rosbag2
    and MCAP store (rosbags' parser takes one IDL text at a time)."""
    if not msgdef.startswith(_IDL_SEPARATOR + "IDL: "):
        return dict(get_types_from_idl(msgdef))
    types: dict[str, Any] = {}
    for section in msgdef.split(_IDL_SEPARATOR)[1:]:
        _header, _, idl = section.partition("\n")
        types.update(get_types_from_idl(idl))
    return types


class MessageDecoder:
    """Turns :class:`Message` bytes into rosbags message objects.

    Definitions are registered lazily per message type, in a type store of their own for
    each serialization (a ROS 2 ``std_msgs/Header`` has no ``seq``, a ROS 1 one has: the
    two cannot share one), so a bag is decoded with the exact layouts it was written with,
    also beside messages of the other serialization.  Types with no
    definition in the META records fall back to the standard types bundled with
    rosbags (ROS 1 Noetic for ROS 1 serialization, ROS 2 Humble for CDR).

    A later connection replaces an earlier one for the messages decoded after it, as a
    later META record does in a stream (docs/binpipe-format.md, section 9.2): the topic's
    serialization, and the definition of its message type (unless it carries none).
    """

    def __init__(self, connections: Iterable[ConnectionInfo] = ()) -> None:
        # serialization -> the type store new definitions are registered in
        self._stores: dict[str, Typestore] = {}
        # (msgtype, serialization) -> the store its messages decode with now
        self._store_of: dict[tuple[str, str], Typestore] = {}
        self._serialization: dict[str, str] = {}
        self._defs: dict[tuple[str, str], ConnectionInfo] = {}
        # (msgtype, serialization, msgdef_format, msgdef) -> the store it is registered in:
        # a definition that comes back (two bags' META alternating) is not registered again
        self._registered: dict[tuple[str, str, str, str], Typestore] = {}
        for conn in connections:
            self.add(conn)

    def add(self, conn: ConnectionInfo) -> None:
        """Learn one connection's definition: it replaces what an earlier connection said
        of the topic's serialization and of the type's definition, for the messages decoded
        after it (one without a definition keeps the known one)."""
        self._serialization[conn.topic] = conn.serialization
        self._serialization[conn.msgtype] = conn.serialization
        key = (conn.msgtype, conn.serialization)
        known = self._defs.get(key)
        if known is not None and (
            not conn.msgdef
            or (known.msgdef == conn.msgdef and known.msgdef_format == conn.msgdef_format)
        ):
            return
        self._defs[key] = conn
        self._store_of.pop(key, None)  # registered again, with this definition, on next use

    def _register(self, msgtype: str, serialization: str, topic: str) -> None:
        if serialization not in ("ros1", "cdr"):
            # an MCAP channel of JSON, protobuf, flatbuffer ... messages: not ROS at all
            raise BinpipeError(
                f"cannot decode the messages on {topic} (type {msgtype or '?'}): their "
                f"encoding is {serialization!r}; only ROS 1 and CDR (ROS 2) messages decode"
            )
        conn = self._defs.get((msgtype, serialization))
        if conn is not None and conn.msgdef:
            self._store_of[msgtype, serialization] = self._own_store(conn)
        else:
            store = standard_typestore(serialization)
            if msgtype not in store.fielddefs:
                raise BinpipeError(
                    f"no definition for message type {msgtype or '(none)'} (topic {topic}): the "
                    "partition carries none and it is not a standard ROS type bundled with rosbags"
                )
            self._store_of[msgtype, serialization] = store

    def _own_store(self, conn: ConnectionInfo) -> Typestore:
        """The type store holding ``conn``'s definition, registered there if it is new."""
        key = (conn.msgtype, conn.serialization, conn.msgdef_format, conn.msgdef)
        store = self._registered.get(key)
        if store is not None:
            return store
        what = (
            f"the {conn.msgdef_format or 'msg'} definition of {conn.msgtype} (topic {conn.topic})"
        )
        try:
            if conn.msgdef_format == "ros2idl":
                types = types_from_idl(conn.msgdef)
            else:
                types = get_types_from_msg(conn.msgdef, conn.msgtype)
        except Exception as err:
            raise BinpipeError(f"cannot parse {what}: {err}") from err
        store = self._stores.get(conn.serialization)
        if store is not None:
            try:
                store.register(types)
            except TypesysError:
                # The store holds another definition of this type or of one it uses (a
                # META record that changed it mid-stream, or two bags' types of one name):
                # a store refuses to redefine a type, so this definition and those after it
                # go in a fresh one; the types decoded so far keep the store they had.
                store = None
            except Exception as err:
                raise BinpipeError(f"cannot register {what}: {err}") from err
        if store is None:
            store = get_typestore(Stores.EMPTY)
            try:
                store.register(types)
            except Exception as err:
                raise BinpipeError(f"cannot register {what}: {err}") from err
            self._stores[conn.serialization] = store
        self._registered[key] = store
        return store

    def decode(self, message: Message) -> Any:
        """Deserialize one message; raises BinpipeError naming topic and type on failure."""
        msgtype = message.msgtype
        serialization = self._serialization.get(
            message.topic, self._serialization.get(msgtype, "cdr")
        )
        if (msgtype, serialization) not in self._store_of:
            self._register(msgtype, serialization, message.topic)
        store = self._store_of[msgtype, serialization]
        try:
            if serialization == "ros1":
                return store.deserialize_ros1(bytes(message.data), msgtype)
            return store.deserialize_cdr(bytes(message.data), msgtype)
        except Exception as err:
            hint = ""
            if message.topic not in self._serialization and msgtype not in self._serialization:
                # nothing said how it is serialized: CDR was a guess
                hint = (
                    "; no message definition (META block) for it reached this partition, so "
                    "CDR was assumed: a pipe command must pass META blocks on (run_node does)"
                )
            raise BinpipeError(
                f"cannot decode a {msgtype} message on {message.topic} at t={message.timestamp} "
                f"({serialization} serialization): {err}{hint}"
            ) from err


def decoded_messages(
    blocks: Iterable[bytes | bytearray], *, topics: Iterable[str] | None = None
) -> Iterator[tuple[Message, Any]]:
    """``(message, decoded)`` for every message record of a partition's blocks.

    The executor-side loop of every service that consumes bags: META blocks register their
    definitions, DATA blocks are decoded record by record (``topics`` limits which are
    decoded; others are skipped undecoded).  ``message.data`` is a zero-copy view valid
    until the next item.
    """
    wanted = None if topics is None else frozenset(topics)
    decoder = MessageDecoder()
    for index, raw in enumerate(blocks):
        block = Block.parse(memoryview(raw))
        if block.kind == BlockKind.META:
            for rec in block:
                decoder.add(
                    ConnectionInfo.from_record(
                        rec, f"the META block at index {index} of the partition"
                    )
                )
            continue
        if block.kind != BlockKind.DATA:
            continue
        for rec in block:
            item = as_message(rec)
            if not isinstance(item, Message):
                kinds = ", ".join(type(value).__name__ for value in rec) or "none"
                raise BinpipeError(
                    f"the DATA block at index {index} of the partition holds a record of "
                    f"({kinds}), not a message (topic str, timestamp int, msgtype str, data "
                    "bytes): only blocks of bag messages decode (docs/binpipe-format.md, "
                    "section 9.1)"
                )
            if wanted is None or item.topic in wanted:
                yield item, decoder.decode(item)


def read_messages(
    uri: str,
    *,
    topics: Iterable[str] | None = None,
    storage_options: Mapping[str, object] | None = None,
) -> Iterator[tuple[Message, Any]]:
    """``(message, decoded)`` for the messages of one bag read in this process, in file order
    (for notebooks, tests and small drives; jobs use :class:`~adcloud.binpipe.BinPipeRDD`)."""
    # imported here: pipe nodes import this module, and the bag readers (fsspec, MCAP,
    # compression) would add a tenth of a second to every node start
    from adcloud.binpipe.bags import plan_partitions, read_partition  # noqa: PLC0415

    parts = plan_partitions(
        uri, topics=None if topics is None else tuple(topics), storage_options=storage_options
    )
    for part in parts:
        decoder = MessageDecoder(
            ConnectionInfo(c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization)
            for c in part.connections
        )
        for message in read_partition(part):
            yield message, decoder.decode(message)
