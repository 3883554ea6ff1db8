"""The BinPipe byte-stream format: uniform field encoding, blocks of records, streams.

A *field* is a string, a signed 64-bit integer, a 64-bit float, raw bytes or null;
every field is stored as a type tag plus a byte string.  A *record* is a tuple of
fields.  Records are packed into *blocks*: a 40-byte header, three small tables
(field end offsets, record end indexes, field type tags) and the concatenated field
bytes.  A *stream* is a 16-byte stream header, any number of blocks, and an END
block that carries the number of records before it, so truncation at a block
boundary is detected too.  ``docs/binpipe-format.md`` is the normative byte layout.

Decoding is zero-copy: a :class:`Block` parsed from a buffer keeps NumPy views of
its tables and hands out ``memoryview`` slices for BYTES fields.  Reading from a
file object is streaming: one block is held at a time, and every length is checked
against a CRC-protected header and a size limit before anything is allocated.

Format history:
    version 1 -- first version.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from enum import IntEnum, IntFlag
from typing import IO, BinaryIO, ClassVar, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from adcloud._crc import crc32
from adcloud.binpipe.errors import BinpipeError

__all__ = [
    "BLOCK_HEADER_SIZE",
    "FORMAT_VERSION",
    "STREAM_HEADER_SIZE",
    "STREAM_MAGIC",
    "Block",
    "BlockFlag",
    "BlockHeader",
    "BlockKind",
    "FieldType",
    "FieldValue",
    "Message",
    "Record",
    "StreamReader",
    "StreamWriter",
    "as_message",
    "encode_block",
    "encode_blocks",
    "encode_end_block",
    "encode_stream",
    "iter_blocks",
    "iter_records",
    "seal_block",
    "stream_header",
]

STREAM_MAGIC = b"\x89ADBP\r\n\x1a"
FORMAT_VERSION = 1
STREAM_HEADER_SIZE = 16
BLOCK_MAGIC = b"BPBK"
BLOCK_HEADER_SIZE = 40

#: Blocks larger than this are refused by readers unless told otherwise; it bounds
#: what a corrupt or hostile length can make a reader allocate.
DEFAULT_MAX_BLOCK_BYTES = 1 << 30
#: Writers close a block once its payload reaches this size.
DEFAULT_BLOCK_BYTES = 1 << 20
#: Readers grow a block's buffer at most this much before the bytes arrive.
_READ_STEP = 1 << 24
#: Blocks with at least this many records are decoded column by column.
_COLUMNAR_MIN_RECORDS = 64
#: Writers close a block once it holds this many records.
DEFAULT_BLOCK_RECORDS = 8192

_STREAM_HEADER = struct.Struct("<8sHHI")
_BLOCK_HEADER = struct.Struct("<4sHHIIQIIII")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class FieldType(IntEnum):
    """Type tag of one field."""

    NONE = 0
    BYTES = 1
    STR = 2
    INT = 3
    FLOAT = 4


class BlockKind(IntEnum):
    """What a block holds."""

    DATA = 0
    #: Side information for the data blocks after it, e.g. message definitions.
    META = 1
    #: Last block of a stream: one record with one INT field, the record count.
    END = 2


class BlockFlag(IntFlag):
    """Per-block flags."""

    NONE = 0
    #: ``payload_crc`` holds the CRC-32 of the payload and readers verify it.
    PAYLOAD_CRC = 1


FieldValue: TypeAlias = "bytes | bytearray | memoryview | str | int | float | None"
Record: TypeAlias = "tuple[FieldValue, ...]"


class Message(NamedTuple):
    """One ROS message as BinPipe carries it: four fields ``STR, INT, STR, BYTES``.

    ``timestamp`` is in nanoseconds since the Unix epoch; which clock (bag record
    time or header stamp) is chosen when the records are made.  ``data`` is the
    serialized message exactly as stored in the bag (ROS 1 or CDR), usually a
    zero-copy ``memoryview`` into the block that holds it.
    """

    topic: str
    timestamp: int
    msgtype: str
    data: bytes | bytearray | memoryview


def as_message(rec: Record) -> Record:
    """``rec`` as a :class:`Message` when it has the message shape, else unchanged."""
    if (
        len(rec) == 4
        and isinstance(rec[0], str)
        and isinstance(rec[1], int)
        and isinstance(rec[2], str)
        and isinstance(rec[3], memoryview)
    ):
        return Message(rec[0], rec[1], rec[2], rec[3])
    return rec


class BlockHeader(NamedTuple):
    """The fixed 40-byte header of a block (see ``docs/binpipe-format.md``)."""

    kind: int
    flags: int
    n_records: int
    n_fields: int
    payload_len: int
    tables_crc: int
    payload_crc: int

    @property
    def tables_size(self) -> int:
        """Bytes of the three tables, padding included."""
        return 8 * self.n_fields + _pad8(4 * self.n_records) + _pad8(self.n_fields)

    @property
    def block_size(self) -> int:
        """Bytes of the whole block, header and padding included."""
        return BLOCK_HEADER_SIZE + self.tables_size + _pad8(self.payload_len)


def write_all(sink: IO[bytes], data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data``, looping over partial writes of raw (unbuffered) files."""
    view = memoryview(data)
    while view:
        n = sink.write(view)
        if n is None:
            raise BinpipeError("the output would block; BinPipe needs a blocking file object")
        view = view[n:]


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def stream_header(version: int = FORMAT_VERSION) -> bytes:
    """The 16 bytes that open every stream."""
    head = _STREAM_HEADER.pack(STREAM_MAGIC, version, 0, 0)[:12]
    return head + struct.pack("<I", crc32(head))


def _check_stream_header(data: bytes | memoryview, offset: int = 0) -> None:
    if len(data) < STREAM_HEADER_SIZE:
        raise BinpipeError(
            f"truncated stream at offset {offset}: {len(data)} of {STREAM_HEADER_SIZE} header bytes"
        )
    magic, version, flags, crc = _STREAM_HEADER.unpack_from(data, 0)
    if magic != STREAM_MAGIC:
        raise BinpipeError(
            f"not a BinPipe stream at offset {offset}: magic {bytes(magic)!r}, "
            f"expected {STREAM_MAGIC!r} (is the producer writing text or a different format?)"
        )
    if crc32(data[:12]) != crc:
        raise BinpipeError(f"corrupt stream header at offset {offset}: CRC mismatch")
    if version != FORMAT_VERSION:
        raise BinpipeError(
            f"unsupported BinPipe version {version} at offset {offset}; "
            f"this adcloud reads version {FORMAT_VERSION}"
        )
    if flags:
        raise BinpipeError(f"unsupported stream flags {flags:#x} at offset {offset}")


def _encode_field(value: object, types: bytearray, parts: list[bytes | memoryview]) -> int:
    """Append one field's tag and bytes; return its length."""
    if value is None:
        types.append(FieldType.NONE)
        return 0
    if isinstance(value, str):
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise BinpipeError(f"string field is not encodable as UTF-8: {err.reason}") from None
        types.append(FieldType.STR)
        parts.append(raw)
        return len(raw)
    if isinstance(value, bool | np.bool_):
        raise BinpipeError("bool fields are not supported; encode them as int 0/1")
    # NumPy scalars export a buffer, so without this they would silently become BYTES.
    if isinstance(value, np.integer):
        value = int(value)
    elif isinstance(value, np.floating):
        value = float(value)
    if isinstance(value, int):
        if not _I64_MIN <= value <= _I64_MAX:
            raise BinpipeError(f"integer field {value} does not fit a signed 64-bit integer")
        types.append(FieldType.INT)
        parts.append(_I64.pack(value))
        return 8
    if isinstance(value, float):
        types.append(FieldType.FLOAT)
        parts.append(_F64.pack(value))
        return 8
    if isinstance(value, bytes):
        types.append(FieldType.BYTES)
        parts.append(value)
        return len(value)
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise BinpipeError(
            f"cannot encode a field of type {type(value).__name__}; "
            "fields are str, int, float, bytes-like or None"
        ) from None
    if not view.c_contiguous:
        raise BinpipeError("bytes-like fields must be C-contiguous")
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    types.append(FieldType.BYTES)
    parts.append(view)
    return view.nbytes


class _BlockBuilder:
    """Accumulates records into one block's tables and payload parts."""

    __slots__ = ("field_ends", "parts", "payload_len", "record_ends", "types")

    #: Type tags of a :class:`Message` record: STR, INT, STR, BYTES.
    _MESSAGE_TAGS: ClassVar[bytes] = bytes(
        (FieldType.STR, FieldType.INT, FieldType.STR, FieldType.BYTES)
    )
    #: UTF-8 of the topics and type names of :class:`Message` records seen lately.
    _utf8: ClassVar[dict[str, bytes]] = {}

    def __init__(self) -> None:
        self.types = bytearray()
        self.field_ends: list[int] = []
        self.record_ends: list[int] = []
        self.parts: list[bytes | memoryview] = []
        self.payload_len = 0

    def add(self, record: Iterable[object]) -> None:
        if type(record) is Message and self._add_message(record):
            return
        n_fields, n_parts, payload_len = len(self.types), len(self.parts), self.payload_len
        try:
            for value in record:
                self.payload_len += _encode_field(value, self.types, self.parts)
                self.field_ends.append(self.payload_len)
        except BaseException:
            # A record is added whole or not at all: fields left behind by a refused
            # one would be taken into the next record a caller writes after the error.
            del self.types[n_fields:], self.field_ends[n_fields:], self.parts[n_parts:]
            self.payload_len = payload_len
            raise
        self.record_ends.append(len(self.types))

    def _add_message(self, msg: Message) -> bool:
        """Add a :class:`Message` of plain field types, as :meth:`add` would; else False."""
        topic, stamp, msgtype, data = msg
        if type(stamp) is not int or not _I64_MIN <= stamp <= _I64_MAX:
            return False
        if type(data) is memoryview:
            if not (data.c_contiguous and data.ndim == 1 and data.format == "B"):
                return False
        elif type(data) is not bytes:
            return False
        utf8 = self._utf8
        topic_raw = utf8.get(topic) if type(topic) is str else None
        type_raw = utf8.get(msgtype) if type(msgtype) is str else None
        if topic_raw is None or type_raw is None:
            if type(topic) is not str or type(msgtype) is not str:
                return False
            try:
                topic_raw, type_raw = topic.encode("utf-8"), msgtype.encode("utf-8")
            except UnicodeEncodeError:
                return False  # the general path raises the error
            if len(utf8) >= 4096:
                utf8.clear()
            utf8[topic] = topic_raw
            utf8[msgtype] = type_raw
        end_topic = self.payload_len + len(topic_raw)
        end_type = end_topic + 8 + len(type_raw)
        self.payload_len = end_type + len(data)
        self.field_ends += (end_topic, end_topic + 8, end_type, self.payload_len)
        self.parts += (topic_raw, _I64.pack(stamp), type_raw, data)
        self.types += self._MESSAGE_TAGS
        self.record_ends.append(len(self.types))
        return True

    def fill(
        self, records: Iterator[Iterable[object]], block_bytes: int, block_records: int
    ) -> bool:
        """Add records until the block is full (``block_bytes`` of payload or
        ``block_records`` records, checked after each record); True if ``records``
        ran out first.

        The same as calling :meth:`add` per record, with :class:`Message` records of
        plain field types added inline (the hot path of bag ingestion).
        """
        types, field_ends, record_ends, parts = (
            self.types,
            self.field_ends,
            self.record_ends,
            self.parts,
        )
        utf8, tags, pack = self._utf8, self._MESSAGE_TAGS, _I64.pack
        payload = self.payload_len
        for record in records:
            if type(record) is Message:
                topic, stamp, msgtype, data = record
                if (
                    type(stamp) is int
                    and _I64_MIN <= stamp <= _I64_MAX
                    and type(topic) is str
                    and type(msgtype) is str
                    and (
                        type(data) is bytes
                        or (
                            type(data) is memoryview
                            and data.c_contiguous
                            and data.ndim == 1
                            and data.format == "B"
                        )
                    )
                    and (topic_raw := utf8.get(topic)) is not None
                    and (type_raw := utf8.get(msgtype)) is not None
                ):
                    end_topic = payload + len(topic_raw)
                    end_type = end_topic + 8 + len(type_raw)
                    payload = end_type + len(data)
                    field_ends += (end_topic, end_topic + 8, end_type, payload)
                    parts += (topic_raw, pack(stamp), type_raw, data)
                    types += tags
                    record_ends.append(len(types))
                    if payload >= block_bytes or len(record_ends) >= block_records:
                        self.payload_len = payload
                        return False
                    continue
            self.payload_len = payload
            self.add(record)  # also fills the UTF-8 cache for the next Message
            payload = self.payload_len
            if payload >= block_bytes or len(record_ends) >= block_records:
                return False
        self.payload_len = payload
        return True

    def __len__(self) -> int:
        return len(self.record_ends)

    def chunks(self, kind: BlockKind, checksum: bool) -> list[bytes | memoryview]:
        """The encoded block as a list of byte strings to write in order."""
        n_fields = len(self.types)
        n_records = len(self.record_ends)
        if n_records > 0xFFFFFFFF or n_fields > 0xFFFFFFFF:
            raise BinpipeError("a block holds at most 2**32-1 records and fields")
        # The three tables, each padded to 8 bytes, built in one copy.
        field_ends = np.asarray(self.field_ends, dtype="<u8")
        record_ends = np.asarray(self.record_ends, dtype="<u4")
        tables = b"".join(
            (
                field_ends.data,
                record_ends.data,
                bytes(_pad8(record_ends.nbytes) - record_ends.nbytes),
                self.types,
                bytes(_pad8(n_fields) - n_fields),
            )
        )
        payload_crc = 0
        flags = BlockFlag.NONE
        if checksum:
            flags |= BlockFlag.PAYLOAD_CRC
            for part in self.parts:
                payload_crc = crc32(part, payload_crc)
        head = _BLOCK_HEADER.pack(
            BLOCK_MAGIC,
            kind,
            flags,
            n_records,
            n_fields,
            self.payload_len,
            crc32(tables),
            payload_crc,
            0,
            0,
        )[:36]
        head += struct.pack("<I", crc32(head))
        tail = bytes(_pad8(self.payload_len) - self.payload_len)
        return [head, tables, *self.parts, tail]


def encode_block(
    records: Iterable[Iterable[object]],
    *,
    kind: BlockKind = BlockKind.DATA,
    checksum: bool = False,
) -> bytes:
    """Encode records into one block (header, tables, payload) and return its bytes."""
    builder = _BlockBuilder()
    for record in records:
        builder.add(record)
    return b"".join(builder.chunks(kind, checksum))


def encode_end_block(record_count: int) -> bytes:
    """The END block that closes a stream of ``record_count`` records."""
    return encode_block([(record_count,)], kind=BlockKind.END)


def encode_stream(
    records: Iterable[Iterable[object]],
    *,
    checksum: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> bytes:
    """Encode records into a whole stream held in memory (for small data and tests)."""
    import io  # noqa: PLC0415 - only this convenience needs it

    out = io.BytesIO()
    with StreamWriter(out, checksum=checksum, block_bytes=block_bytes) as writer:
        for record in records:
            writer.write(record)
    return out.getvalue()


class StreamWriter:
    """Writes records to a binary file object as one BinPipe stream.

    Memory is bounded by one block (``block_bytes`` of payload or ``block_records``
    records).  Large BYTES fields are written from the caller's buffer without a copy.
    :meth:`close` writes the END block; a stream without it reads as truncated.
    """

    def __init__(
        self,
        fileobj: BinaryIO,
        *,
        checksum: bool = False,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        block_records: int = DEFAULT_BLOCK_RECORDS,
    ) -> None:
        self._out = fileobj
        self._checksum = checksum
        self._block_bytes = block_bytes
        self._block_records = block_records
        self._builder = _BlockBuilder()
        self._count = 0
        self._closed = False
        self.bytes_written = 0
        self._emit([stream_header()])

    def _emit(self, chunks: Sequence[bytes | memoryview]) -> None:
        if all(len(c) < 65536 for c in chunks):
            chunks = [b"".join(chunks)]
        for chunk in chunks:
            write_all(self._out, chunk)
            self.bytes_written += len(chunk)

    def write(self, record: Iterable[object]) -> None:
        """Append one record (a tuple of field values)."""
        if self._closed:
            raise BinpipeError("write to a closed BinPipe stream")
        self._builder.add(record)
        if (
            self._builder.payload_len >= self._block_bytes
            or len(self._builder) >= self._block_records
        ):
            self.flush_block()

    def write_meta(self, records: Iterable[Iterable[object]]) -> None:
        """Write a META block (e.g. message definitions) after flushing pending records."""
        if self._closed:
            raise BinpipeError("write to a closed BinPipe stream")
        self.flush_block()
        builder = _BlockBuilder()
        for record in records:
            builder.add(record)
        self._count += len(builder)
        self._emit(builder.chunks(BlockKind.META, self._checksum))

    def write_block(self, block: bytes | bytearray | memoryview) -> None:
        """Append an already encoded DATA or META block, validating its tables."""
        if self._closed:
            raise BinpipeError("write to a closed BinPipe stream")
        self.flush_block()
        view = memoryview(block)
        parsed = Block.parse(view, verify_payload=False)
        if parsed.kind == BlockKind.END:
            raise BinpipeError("END blocks are written by close(), not write_block()")
        if parsed.nbytes != view.nbytes:
            raise BinpipeError(
                f"write_block() takes exactly one block: got {view.nbytes} bytes, "
                f"the block is {parsed.nbytes}"
            )
        self._count += parsed.n_records
        self._emit([parsed.raw])

    def flush_block(self) -> None:
        """Close the current block, if it holds any record, and write it."""
        if len(self._builder):
            self._count += len(self._builder)
            self._emit(self._builder.chunks(BlockKind.DATA, self._checksum))
            self._builder = _BlockBuilder()

    @property
    def record_count(self) -> int:
        """Records written so far, flushed or pending."""
        return self._count + len(self._builder)

    def close(self) -> None:
        """Flush and write the END block.  The file object is not closed."""
        if self._closed:
            return
        self.flush_block()
        self._emit([encode_end_block(self._count)])
        self._closed = True

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # On an exception the END block is deliberately not written: a reader then
        # sees a truncated stream rather than a complete-looking partial one.
        if exc_type is None:
            self.close()


class Block:
    """A parsed, validated block: zero-copy views into the buffer it came from.

    ``offset`` is where the block starts in its stream, for error messages.
    The buffer must stay alive and unchanged while the block and the memoryviews
    it handed out are in use.
    """

    __slots__ = (
        "_field_ends",
        "_field_types",
        "_payload",
        "_record_ends",
        "_schema",
        "_schema_known",
        "header",
        "offset",
        "raw",
    )

    def __init__(
        self,
        raw: memoryview,
        header: BlockHeader,
        field_ends: npt.NDArray[np.uint64],
        record_ends: npt.NDArray[np.uint32],
        field_types: npt.NDArray[np.uint8],
        payload: memoryview,
        offset: int,
    ) -> None:
        self.raw = raw
        self.header = header
        self._field_ends = field_ends
        self._record_ends = record_ends
        self._field_types = field_types
        self._payload = payload
        self.offset = offset
        self._schema: tuple[FieldType, ...] | None = None
        self._schema_known = False

    @staticmethod
    def read_header(data: bytes | bytearray | memoryview, offset: int = 0) -> BlockHeader:
        """Parse and check the 40-byte header at the start of ``data``."""
        if len(data) < BLOCK_HEADER_SIZE:
            raise BinpipeError(
                f"truncated block at offset {offset}: {len(data)} of "
                f"{BLOCK_HEADER_SIZE} header bytes"
            )
        fields = _BLOCK_HEADER.unpack_from(data, 0)
        magic, kind, flags, nrec, nfld, plen, tcrc, pcrc, reserved, hcrc = fields
        if magic != BLOCK_MAGIC:
            raise BinpipeError(
                f"corrupt stream at offset {offset}: block magic {bytes(magic)!r}, "
                f"expected {BLOCK_MAGIC!r}"
            )
        if crc32(memoryview(data)[:36]) != hcrc:
            raise BinpipeError(f"corrupt block header at offset {offset}: CRC mismatch")
        if kind not in BlockKind._value2member_map_:
            raise BinpipeError(f"corrupt block at offset {offset}: unknown kind {kind}")
        if flags & ~int(BlockFlag.PAYLOAD_CRC):
            raise BinpipeError(f"corrupt block at offset {offset}: unknown flags {flags:#x}")
        if reserved:
            raise BinpipeError(f"corrupt block at offset {offset}: reserved word is {reserved:#x}")
        return BlockHeader(kind, flags, nrec, nfld, plen, tcrc, pcrc)

    @classmethod
    def parse(
        cls,
        data: bytes | bytearray | memoryview,
        offset: int = 0,
        *,
        verify_payload: bool = True,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    ) -> Block:
        """Parse the block at the start of ``data`` (which may extend past it)."""
        # Slicing bytes would copy and BYTES fields would come back as bytes, not views.
        data = memoryview(data)
        header = cls.read_header(data, offset)
        size = header.block_size
        if size > max_block_bytes:
            raise BinpipeError(
                f"block at offset {offset} claims {size} bytes, over the limit of "
                f"{max_block_bytes}; raise max_block_bytes if this is intended"
            )
        if len(data) < size:
            raise BinpipeError(
                f"truncated block at offset {offset}: {len(data)} of {size} bytes present"
            )
        raw = data[:size]
        nrec, nfld, plen = header.n_records, header.n_fields, header.payload_len
        t0 = BLOCK_HEADER_SIZE
        tables = raw[t0 : t0 + header.tables_size]
        if crc32(tables) != header.tables_crc:
            raise BinpipeError(f"corrupt block tables at offset {offset + t0}: CRC mismatch")
        field_ends = np.frombuffer(tables, dtype="<u8", count=nfld)
        r0 = 8 * nfld
        record_ends = np.frombuffer(tables, dtype="<u4", count=nrec, offset=r0)
        y0 = r0 + _pad8(4 * nrec)
        field_types = np.frombuffer(tables, dtype="u1", count=nfld, offset=y0)
        p0 = t0 + header.tables_size
        payload = raw[p0 : p0 + plen]
        _validate_tables(header, field_ends, record_ends, field_types, offset)
        checked = verify_payload and header.flags & BlockFlag.PAYLOAD_CRC
        if checked and crc32(payload) != header.payload_crc:
            raise BinpipeError(f"corrupt block payload at offset {offset + p0}: CRC mismatch")
        # Padding is outside the payload CRC; requiring zeros catches flips there too.
        if any(tables[r0 + 4 * nrec : y0]) or any(tables[y0 + nfld :]) or any(raw[p0 + plen :]):
            raise BinpipeError(f"corrupt block at offset {offset}: non-zero padding")
        if header.kind == BlockKind.END and (nrec != 1 or nfld != 1 or field_types[0] != 3):
            raise BinpipeError(f"corrupt END block at offset {offset}: expected one INT record")
        return cls(raw, header, field_ends, record_ends, field_types, payload, offset)

    @property
    def kind(self) -> BlockKind:
        """DATA, META or END."""
        return BlockKind(self.header.kind)

    @property
    def n_records(self) -> int:
        """Number of records in the block."""
        return self.header.n_records

    def __len__(self) -> int:
        return self.header.n_records

    @property
    def nbytes(self) -> int:
        """Size of the encoded block."""
        return len(self.raw)

    def _value(self, index: int, start: int, end: int, typ: int) -> FieldValue:
        if typ == FieldType.BYTES:
            return self._payload[start:end]
        if typ == FieldType.STR:
            try:
                return str(self._payload[start:end], "utf-8")
            except UnicodeDecodeError as err:
                where = self.offset + BLOCK_HEADER_SIZE + self.header.tables_size + start
                raise BinpipeError(
                    f"field {index} at offset {where} is not valid UTF-8: {err.reason}"
                ) from None
        if typ == FieldType.INT:
            return _I64.unpack_from(self._payload, start)[0]  # type: ignore[no-any-return]
        if typ == FieldType.FLOAT:
            return _F64.unpack_from(self._payload, start)[0]  # type: ignore[no-any-return]
        return None

    def record(self, i: int) -> Record:
        """Record ``i`` as a tuple; BYTES fields are zero-copy memoryviews."""
        if not 0 <= i < self.n_records:
            raise IndexError(i)
        first = int(self._record_ends[i - 1]) if i else 0
        last = int(self._record_ends[i])
        ends = self._field_ends
        return tuple(
            self._value(j, int(ends[j - 1]) if j else 0, int(ends[j]), int(self._field_types[j]))
            for j in range(first, last)
        )

    def __iter__(self) -> Iterator[Record]:
        schema = self.schema() if self.n_records >= _COLUMNAR_MIN_RECORDS else None
        if schema:
            # Uniform blocks (the common case: every message record has the same four
            # fields) are decoded column by column, with the loops inside NumPy and
            # list comprehensions instead of one Python call per field.
            yield from zip(*(self._column_values(j, t) for j, t in enumerate(schema)), strict=True)
            return
        ends = self._field_ends.tolist()
        types = self._field_types.tolist()
        value = self._value
        start = 0
        first = 0
        for last in self._record_ends.tolist():
            fields = []
            for j in range(first, last):
                end = ends[j]
                fields.append(value(j, start, end, types[j]))
                start = end
            first = last
            yield tuple(fields)

    def _column_values(self, j: int, typ: FieldType) -> list[FieldValue]:
        if typ in (FieldType.INT, FieldType.FLOAT):
            return self.int_column(j).tolist()  # type: ignore[no-any-return]
        if typ == FieldType.NONE:
            return [None] * self.n_records
        starts, ends = self.column_spans(j)
        payload = self._payload
        spans = zip(starts.tolist(), ends.tolist(), strict=True)
        if typ == FieldType.BYTES:
            return [payload[a:b] for a, b in spans]
        try:
            # Topics and type names repeat: decode each distinct byte string once.
            # Slicing one bytes copy of the payload is cheaper than a memoryview slice
            # plus a decode per field.
            cache: dict[bytes, str] = {}
            raw = payload.tobytes()
            return [
                cache.get(key) or cache.setdefault(key, key.decode("utf-8"))
                for key in (raw[a:b] for a, b in spans)
            ]
        except UnicodeDecodeError:
            # Re-walk record by record to name the offending field's offset.
            for i in range(self.n_records):
                self.record(i)
            raise

    def messages(self) -> Iterator[Message]:
        """The records as :class:`Message` tuples; every record must have that shape."""
        for i, rec in enumerate(self):
            if len(rec) != 4 or not (
                isinstance(rec[0], str) and isinstance(rec[1], int) and isinstance(rec[2], str)
            ):
                raise BinpipeError(
                    f"record {i} of the block at offset {self.offset} is not a message "
                    "(expected fields STR topic, INT timestamp, STR msgtype, BYTES data)"
                )
            data = rec[3]
            if not isinstance(data, memoryview):
                raise BinpipeError(
                    f"record {i} of the block at offset {self.offset}: data field is not BYTES"
                )
            yield Message(rec[0], rec[1], rec[2], data)

    def schema(self) -> tuple[FieldType, ...] | None:
        """The field types shared by every record, or None if records differ."""
        if not self._schema_known:
            self._schema = self._find_schema()
            self._schema_known = True
        return self._schema

    def _find_schema(self) -> tuple[FieldType, ...] | None:
        nrec = self.n_records
        if nrec == 0:
            return ()
        width = int(self._record_ends[0])
        expected = np.arange(1, nrec + 1, dtype=np.uint64) * np.uint64(width)
        if not np.array_equal(self._record_ends, expected):
            return None
        if width == 0:
            return ()
        types = self._field_types.reshape(nrec, width)
        if not (types == types[0]).all():
            return None
        return tuple(FieldType(int(t)) for t in types[0])

    def column_spans(self, j: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Start and end offsets into :attr:`payload` of field ``j`` of every record.

        Requires a uniform schema (see :meth:`schema`).  Offsets are NumPy arrays, so
        a column can be gathered, measured or handed to Arrow without a Python loop.
        """
        schema = self.schema()
        if schema is None:
            raise BinpipeError(f"block at offset {self.offset} has no uniform schema")
        width = len(schema)
        if not 0 <= j < width:
            raise IndexError(j)
        ends = self._field_ends.reshape(-1, width)[:, j]
        starts = ends - np.diff(self._field_ends, prepend=np.uint64(0)).reshape(-1, width)[:, j]
        return starts, ends

    def int_column(self, j: int) -> npt.NDArray[np.int64]:
        """INT (or FLOAT, as float64) column ``j`` as a NumPy array (one vectorized gather)."""
        starts, _ends = self.column_spans(j)
        schema = self.schema()
        assert schema is not None
        if schema[j] not in (FieldType.INT, FieldType.FLOAT):
            raise BinpipeError(f"column {j} of the block at offset {self.offset} is not numeric")
        windows = np.lib.stride_tricks.sliding_window_view(
            np.frombuffer(self._payload, dtype=np.uint8), 8
        )
        dtype = "<i8" if schema[j] == FieldType.INT else "<f8"
        values: npt.NDArray[np.int64] = windows[starts.astype(np.intp)].view(dtype).reshape(-1)
        return values

    @property
    def payload(self) -> memoryview:
        """The concatenated field bytes (zero-copy)."""
        return self._payload


def _validate_tables(
    header: BlockHeader,
    field_ends: npt.NDArray[np.uint64],
    record_ends: npt.NDArray[np.uint32],
    field_types: npt.NDArray[np.uint8],
    offset: int,
) -> None:
    """Structural checks, vectorized: a stream that passes cannot index out of bounds."""
    nrec, nfld, plen = header.n_records, header.n_fields, header.payload_len
    where = f"block at offset {offset}"
    if nfld == 0:
        if plen != 0:
            raise BinpipeError(f"corrupt {where}: payload without fields")
    else:
        if int(field_ends[-1]) != plen:
            raise BinpipeError(
                f"corrupt {where}: field offsets end at {int(field_ends[-1])}, "
                f"payload has {plen} bytes"
            )
        lengths = np.diff(field_ends, prepend=np.uint64(0)).astype(np.int64)
        if nfld > 1 and bool((field_ends[1:] < field_ends[:-1]).any()):
            raise BinpipeError(f"corrupt {where}: field offsets go backwards")
        if int(field_types.max()) > FieldType.FLOAT:
            raise BinpipeError(f"corrupt {where}: unknown field type {int(field_types.max())}")
        fixed = (field_types == FieldType.INT) | (field_types == FieldType.FLOAT)
        if bool((lengths[fixed] != 8).any()):
            raise BinpipeError(f"corrupt {where}: numeric field not 8 bytes long")
        if bool((lengths[field_types == FieldType.NONE] != 0).any()):
            raise BinpipeError(f"corrupt {where}: null field with bytes")
    if nrec == 0:
        if nfld != 0:
            raise BinpipeError(f"corrupt {where}: fields without records")
    else:
        if int(record_ends[-1]) != nfld:
            raise BinpipeError(
                f"corrupt {where}: record table ends at {int(record_ends[-1])}, "
                f"block has {nfld} fields"
            )
        if nrec > 1 and bool((record_ends[1:] < record_ends[:-1]).any()):
            raise BinpipeError(f"corrupt {where}: record table goes backwards")


class StreamReader:
    """Reads a stream from a binary file object one block at a time.

    Memory is bounded by the largest block (and by ``max_block_bytes``).  Iterating
    yields DATA and META blocks; the END block's count is checked and a stream that
    ends without one raises :class:`BinpipeError` naming the offset.  After END the
    reader makes sure nothing follows, reading to the end of input, unless
    ``check_trailing`` is false (a pipe whose writer's helpers may hold it open: the
    caller checks once the writer has exited).
    """

    def __init__(
        self,
        fileobj: IO[bytes],
        *,
        verify_payload: bool = True,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        name: str = "stream",
        check_trailing: bool = True,
    ) -> None:
        self._in = fileobj
        self._verify = verify_payload
        self._max = max_block_bytes
        self._name = name
        self._check_trailing = check_trailing
        self.offset = 0
        self.record_count = 0

    def _read_exact(self, n: int, what: str) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._in.readinto(view[got:])  # type: ignore[attr-defined]
            if not k and not got and what == "block header":  # ended between blocks
                raise BinpipeError(
                    f"{self._name}: truncated stream at offset {self.offset}: no END block"
                )
            if not k:
                raise BinpipeError(
                    f"{self._name}: truncated {what} at offset {self.offset}: "
                    f"{got} of {n} bytes before end of input"
                )
            got += k
        return buf

    def _read_body(self, head: bytearray, size: int) -> bytearray:
        """Read a whole block of ``size`` bytes whose 40-byte header is ``head``.

        Blocks over 16 MiB grow their buffer with the data that actually arrives, so
        a header that lies about its size cannot make the reader allocate much more
        than it is sent.
        """
        if size <= _READ_STEP:
            buf = bytearray(size)
            buf[:BLOCK_HEADER_SIZE] = head
        else:
            buf = bytearray(head)
        filled = BLOCK_HEADER_SIZE
        while filled < size:
            end = min(size, filled + _READ_STEP)
            if len(buf) < end:
                buf.extend(bytes(end - len(buf)))
            view = memoryview(buf)
            try:
                while filled < end:
                    k = self._in.readinto(view[filled:end])  # type: ignore[attr-defined]
                    if not k:
                        raise BinpipeError(
                            f"{self._name}: truncated block at offset {self.offset}: "
                            f"{filled} of {size} bytes before end of input"
                        )
                    filled += k
            finally:
                view.release()
        return buf

    def __iter__(self) -> Iterator[Block]:
        # Pipes and sockets may return fewer bytes than asked; only b"" means end of input.
        head = b""
        while len(head) < STREAM_HEADER_SIZE:
            chunk = self._in.read(STREAM_HEADER_SIZE - len(head))
            if not chunk:
                break
            head += chunk
        if not head:
            raise BinpipeError(
                f"{self._name}: empty input at offset 0, expected a BinPipe stream header"
            )
        try:
            _check_stream_header(head, 0)
        except BinpipeError as err:
            raise BinpipeError(f"{self._name}: {err}") from None
        self.offset = STREAM_HEADER_SIZE
        while True:
            hbuf = self._read_exact(BLOCK_HEADER_SIZE, "block header")
            try:
                header = Block.read_header(hbuf, self.offset)
                size = header.block_size
                if size > self._max:
                    raise BinpipeError(
                        f"block at offset {self.offset} claims {size} bytes, over the limit of "
                        f"{self._max}; raise max_block_bytes if this is intended"
                    )
            except BinpipeError as err:
                raise BinpipeError(f"{self._name}: {err}") from None
            buf = self._read_body(hbuf, size)
            view = memoryview(buf)
            try:
                block = Block.parse(
                    view, self.offset, verify_payload=self._verify, max_block_bytes=self._max
                )
            except BinpipeError as err:
                raise BinpipeError(f"{self._name}: {err}") from None
            if block.kind == BlockKind.END:
                _check_end(block, self.record_count, self._name)
                if self._check_trailing and self._in.read(1):
                    raise BinpipeError(
                        f"{self._name}: trailing bytes after the END block at offset "
                        f"{self.offset + size}"
                    )
                self.offset += size
                return
            self.record_count += block.n_records
            self.offset += size
            yield block


def _check_end(block: Block, count: int, name: str) -> None:
    declared = block.record(0)[0]
    if declared != count:
        raise BinpipeError(
            f"{name}: END block at offset {block.offset} declares {declared!r} records, "
            f"the stream held {count} (records were lost or duplicated)"
        )


def iter_blocks(
    data: bytes | bytearray | memoryview,
    *,
    verify_payload: bool = True,
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    name: str = "stream",
) -> Iterator[Block]:
    """Zero-copy iteration over the DATA and META blocks of a stream held in memory."""
    view = memoryview(data)
    try:
        _check_stream_header(view[:STREAM_HEADER_SIZE], 0)
    except BinpipeError as err:
        raise BinpipeError(f"{name}: {err}") from None
    pos = STREAM_HEADER_SIZE
    count = 0
    while True:
        if pos >= len(view):
            raise BinpipeError(f"{name}: truncated stream at offset {pos}: no END block")
        try:
            block = Block.parse(
                view[pos:], pos, verify_payload=verify_payload, max_block_bytes=max_block_bytes
            )
        except BinpipeError as err:
            raise BinpipeError(f"{name}: {err}") from None
        pos += block.nbytes
        if block.kind == BlockKind.END:
            _check_end(block, count, name)
            if pos != len(view):
                raise BinpipeError(f"{name}: trailing bytes after the END block at offset {pos}")
            return
        count += block.n_records
        yield block


def iter_records(
    data: bytes | bytearray | memoryview, *, include_meta: bool = False
) -> Iterator[Record]:
    """Every record of an in-memory stream, in order (META records only if asked)."""
    for block in iter_blocks(data):
        if block.kind == BlockKind.DATA or include_meta:
            yield from block


def encode_blocks(
    records: Iterable[Iterable[object]],
    *,
    kind: BlockKind = BlockKind.DATA,
    checksum: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_records: int = DEFAULT_BLOCK_RECORDS,
) -> Iterator[bytes]:
    """Encode records lazily into a sequence of blocks of bounded size (no stream framing)."""
    it = iter(records)
    done = False
    while not done:
        builder = _BlockBuilder()
        done = builder.fill(it, block_bytes, block_records)
        if len(builder):
            yield b"".join(builder.chunks(kind, checksum))


def seal_block(raw: bytes | bytearray | memoryview) -> bytes:
    """Return the block with its payload CRC computed and the PAYLOAD_CRC flag set.

    Used when blocks leave memory for storage, where silent bit rot must be caught.
    """
    view = memoryview(raw)
    block = Block.parse(view, verify_payload=True)
    if block.header.flags & BlockFlag.PAYLOAD_CRC:
        return bytes(view)
    head = bytearray(view[:BLOCK_HEADER_SIZE])
    struct.pack_into("<H", head, 6, block.header.flags | BlockFlag.PAYLOAD_CRC)
    struct.pack_into("<I", head, 28, crc32(block.payload))
    struct.pack_into("<I", head, 36, crc32(head[:36]))
    return bytes(head) + bytes(view[BLOCK_HEADER_SIZE:])
