"""Property tests of the BinPipe codec: round trips, and hostile input fails cleanly.

Every input is either decoded or refused with :class:`BinpipeError`; nothing else may
escape (IndexError, ValueError, struct.error, OverflowError, MemoryError,
UnicodeDecodeError), and nothing may hang or allocate more than the block limit.
The tamper tests recompute the CRCs after changing a length or a table entry, so
what they reach is the structural validation behind the checksums.
"""

from __future__ import annotations

import io
import struct
import zlib
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adcloud.binpipe.codec import (
    BLOCK_HEADER_SIZE,
    STREAM_HEADER_SIZE,
    Block,
    StreamReader,
    StreamWriter,
    encode_end_block,
    encode_stream,
    iter_blocks,
    stream_header,
)
from adcloud.binpipe.errors import BinpipeError

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=300,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Readers in these tests get a small block limit so a tampered length cannot make
#: one example allocate the default gigabyte.
SMALL_LIMIT = 1 << 20

I64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
FIELDS = st.one_of(
    st.none(),
    st.binary(max_size=64),
    st.text(max_size=24),
    I64,
    st.floats(allow_nan=True, allow_infinity=True),
)
RECORDS = st.lists(st.lists(FIELDS, max_size=6).map(tuple), max_size=24)
BY_TAG = {
    "N": st.none(),
    "B": st.binary(max_size=16),
    "S": st.text(max_size=8),
    "I": I64,
    "F": st.floats(allow_nan=True, allow_infinity=True),
}
#: Blocks of many records that share one schema take the reader's columnar path.
UNIFORM = st.lists(st.sampled_from(list(BY_TAG)), max_size=5).flatmap(
    lambda tags: st.lists(st.tuples(*(BY_TAG[t] for t in tags)), min_size=60, max_size=150)
)


# ------------------------------------------------------------------ helpers
# (also used by test_format_c.py)


def canonical(value: object) -> tuple[str, object]:
    """A comparable form of a field: floats by bit pattern (NaN == NaN), views as bytes."""
    if value is None:
        return ("N", None)
    if isinstance(value, str):
        return ("S", value)
    if isinstance(value, int):
        return ("I", value)
    if isinstance(value, float):
        return ("F", struct.unpack("<Q", struct.pack("<d", value))[0])
    assert isinstance(value, bytes | bytearray | memoryview), type(value)
    return ("B", bytes(value))


def canonical_records(records: object) -> list[tuple[tuple[str, object], ...]]:
    """:func:`canonical` applied to every field of every record."""
    return [tuple(canonical(v) for v in rec) for rec in records]  # type: ignore[attr-defined]


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def block_offsets(stream: bytes | bytearray) -> list[int]:
    """Offsets of every block (END included) of a *valid* stream."""
    offsets = []
    pos = STREAM_HEADER_SIZE
    while pos < len(stream):
        offsets.append(pos)
        nrec, nfld, plen = struct.unpack_from("<IIQ", stream, pos + 8)
        pos += BLOCK_HEADER_SIZE + 8 * nfld + _pad8(4 * nrec) + _pad8(nfld) + _pad8(plen)
    assert pos == len(stream)
    return offsets


def reseal_block(buf: bytearray, pos: int) -> None:
    """Recompute the tables, payload and header CRCs of the block at ``pos``.

    Uses the lengths the (possibly tampered) header claims, clamped to the buffer,
    so only the structural checks can tell the block is wrong.
    """
    flags, nrec, nfld, plen = struct.unpack_from("<HIIQ", buf, pos + 6)
    t0 = pos + BLOCK_HEADER_SIZE
    t1 = t0 + 8 * nfld + _pad8(4 * nrec) + _pad8(nfld)
    struct.pack_into("<I", buf, pos + 24, zlib.crc32(buf[t0:t1]))
    if flags & 1:
        struct.pack_into("<I", buf, pos + 28, zlib.crc32(buf[t1 : t1 + plen]))
    struct.pack_into("<I", buf, pos + 36, zlib.crc32(buf[pos : pos + 36]))


def table_slots(stream: bytes | bytearray, pos: int) -> list[tuple[int, str]]:
    """(offset, struct format) of every header length and table entry of a block."""
    nrec, nfld = struct.unpack_from("<II", stream, pos + 8)
    slots = [
        (pos + 4, "<H"),
        (pos + 6, "<H"),
        (pos + 8, "<I"),
        (pos + 12, "<I"),
        (pos + 16, "<Q"),
        (pos + 32, "<I"),
    ]
    t0 = pos + BLOCK_HEADER_SIZE
    slots += [(t0 + 8 * j, "<Q") for j in range(nfld)]
    r0 = t0 + 8 * nfld
    slots += [(r0 + 4 * i, "<I") for i in range(nrec)]
    y0 = r0 + _pad8(4 * nrec)
    slots += [(y0 + j, "<B") for j in range(nfld)]
    return slots


def tamper(stream: bytes, block: int, slot: int, value: int) -> bytes:
    """The stream with one header field or table entry set to ``value``, CRCs resealed."""
    buf = bytearray(stream)
    offsets = block_offsets(buf)
    pos = offsets[block % len(offsets)]
    slots = table_slots(buf, pos)
    where, fmt = slots[slot % len(slots)]
    size = struct.calcsize(fmt)
    struct.pack_into(fmt, buf, where, value % (1 << (8 * size)))
    reseal_block(buf, pos)
    return bytes(buf)


def raw_block(
    field_ends: list[int],
    record_ends: list[int],
    field_types: list[int],
    payload: bytes,
    *,
    kind: int = 0,
) -> bytes:
    """A block built from explicit tables, valid CRCs and padding, whatever the tables say."""
    tables = struct.pack(f"<{len(field_ends)}Q{len(record_ends)}I", *field_ends, *record_ends)
    tables += bytes(_pad8(len(tables)) - len(tables)) + bytes(field_types)
    tables += bytes(_pad8(len(tables)) - len(tables))
    head = bytearray(
        struct.pack(
            "<4sHHIIQIIII",
            b"BPBK",
            kind,
            0,
            len(record_ends),
            len(field_types),
            len(payload),
            zlib.crc32(tables),
            0,
            0,
            0,
        )
    )
    struct.pack_into("<I", head, 36, zlib.crc32(head[:36]))
    return bytes(head) + tables + payload + bytes(_pad8(len(payload)) - len(payload))


#: Blocks whose CRCs and padding are right but whose tables contradict each other
#: on exactly one rule, with the message the Python reader gives; a stream made of
#: one of them and a correct END block of count 1 isolates that rule.
HAND_BUILT_INVALID = [
    ("payload without fields", raw_block([], [0], [], b"12345678"), "payload without fields"),
    ("fields without records", raw_block([0], [], [0], b""), "fields without records"),
    ("field ends short of payload", raw_block([3], [1], [1], b"abcd"), "field offsets end at 3"),
    ("field ends backwards", raw_block([4, 2, 4], [3], [1, 1, 1], b"abcd"), "go backwards"),
    ("record ends short", raw_block([1, 2], [1], [1, 1], b"ab"), "record table ends at 1"),
    ("record ends backwards", raw_block([1, 2, 3], [2, 1, 3], [1, 1, 1], b"abc"), "backwards"),
    ("unknown type", raw_block([1], [1], [5], b"a"), "unknown field type 5"),
    ("short INT", raw_block([4], [1], [3], b"abcd"), "numeric field not 8 bytes"),
    ("long FLOAT", raw_block([9], [1], [4], b"123456789"), "numeric field not 8 bytes"),
    ("NONE with bytes", raw_block([1], [1], [0], b"a"), "null field with bytes"),
    ("STR not UTF-8", raw_block([2], [1], [2], b"\xc3\x28"), "not valid UTF-8"),
]
#: The positive control: the same builder makes blocks that decode.
HAND_BUILT_VALID = raw_block([0, 2, 10, 10], [1, 1, 4], [0, 2, 3, 1], b"hi" + bytes(8))


class CountingReader(io.RawIOBase):
    """A binary file object that returns at most ``chunk`` bytes per call and counts them."""

    def __init__(self, data: bytes, chunk: int = 1 << 30) -> None:
        self._src = io.BytesIO(data)
        self._chunk = chunk
        self.bytes_read = 0
        self.calls = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        self.calls += 1
        view = memoryview(b).cast("B")
        n = self._src.readinto(view[: min(len(view), self._chunk)])
        self.bytes_read += n
        return n


def decode_memory(data: bytes) -> list[tuple[tuple[str, object], ...]]:
    """Every record (META included), touching every field, through ``iter_blocks``."""
    out = []
    for block in iter_blocks(data, max_block_bytes=SMALL_LIMIT):
        out += canonical_records(block)
        block.schema()
    return out


def decode_streaming(data: bytes) -> list[tuple[tuple[str, object], ...]]:
    """The same through :class:`StreamReader` on a reader that returns short reads."""
    out = []
    for block in StreamReader(CountingReader(data, chunk=7), max_block_bytes=SMALL_LIMIT):
        out += canonical_records(block)
    return out


def outcome(decode: object, data: bytes) -> object:
    """The decoded records, or the string "error" for a BinpipeError; others propagate."""
    try:
        return decode(data)  # type: ignore[operator]
    except BinpipeError:
        return "error"


# ------------------------------------------------------------ round trips


@FUZZ
@given(records=RECORDS, checksum=st.booleans(), block_bytes=st.integers(1, 256))
def test_random_records_round_trip(records, checksum, block_bytes):
    data = encode_stream(records, checksum=checksum, block_bytes=block_bytes)
    expected = canonical_records(records)
    assert decode_memory(data) == expected
    assert decode_streaming(data) == expected


@FUZZ
@given(records=UNIFORM, checksum=st.booleans())
def test_uniform_records_round_trip(records, checksum):
    data = encode_stream(records, checksum=checksum)
    expected = canonical_records(records)
    assert decode_memory(data) == expected
    assert decode_streaming(data) == expected
    # Random access decodes field by field; it must agree with iteration.
    (block,) = iter_blocks(data)
    assert canonical_records(block.record(i) for i in range(len(block))) == expected


@FUZZ
@given(records=RECORDS, meta=RECORDS, block_records=st.integers(1, 5))
def test_meta_and_data_interleaved_round_trip(records, meta, block_records):
    out = io.BytesIO()
    with StreamWriter(out, block_records=block_records, checksum=True) as writer:
        half = len(records) // 2
        for rec in records[:half]:
            writer.write(rec)
        writer.write_meta(meta)
        for rec in records[half:]:
            writer.write(rec)
    expected = canonical_records(records[:half] + meta + records[half:])
    assert decode_memory(out.getvalue()) == expected
    assert decode_streaming(out.getvalue()) == expected


# ---------------------------------------------------------- hostile input


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_fail_cleanly(data):
    assert outcome(decode_memory, data) == "error" or data.startswith(stream_header())
    outcome(decode_streaming, data)


@FUZZ
@given(tail=st.binary(max_size=512))
def test_random_bytes_after_a_valid_header_fail_cleanly(tail):
    # Random blocks can't pass the header CRC, so this exercises the early checks only.
    data = stream_header() + b"BPBK" + tail
    assert outcome(decode_memory, data) == "error"
    assert outcome(decode_streaming, data) == "error"


MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 9)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
)


def mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, where, arg in mutations:
        at = where % (len(buf) + 1)
        if op == "flip" and at < len(buf):
            buf[at] ^= 1 << arg
        elif op == "insert":
            buf[at:at] = bytes([arg])
        elif op == "delete":
            del buf[at : at + arg]
        elif op == "truncate":
            del buf[at:]
    return bytes(buf)


@FUZZ
@given(
    records=st.one_of(RECORDS, UNIFORM),
    checksum=st.booleans(),
    mutations=st.lists(MUTATION, min_size=1, max_size=4),
    block_bytes=st.sampled_from([64, 1 << 20]),
)
def test_mutated_streams_decode_or_raise_binpipe_error(records, checksum, mutations, block_bytes):
    data = encode_stream(records, checksum=checksum, block_bytes=block_bytes)
    bad = mutate(data, mutations)
    got = outcome(decode_memory, bad)
    # Both readers apply the same rules, so they agree on every input.
    assert outcome(decode_streaming, bad) == got
    if checksum and bad != data:
        # With payload CRCs every byte is covered by a CRC, a length or a zero-padding rule.
        assert got == "error"


SPECIAL = st.sampled_from(
    [
        0,
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        9,
        0xFF,
        0xFFFF,
        0x7FFFFFFF,
        0xFFFFFFFF,
        1 << 32,
        1 << 60,
        (1 << 63) - 1,
        (1 << 64) - 1,
    ]
)


@FUZZ
@given(
    records=RECORDS,
    checksum=st.booleans(),
    block=st.integers(0, 64),
    slot=st.integers(0, 1 << 16),
    value=st.one_of(SPECIAL, st.integers(0, 300), st.integers(0, (1 << 64) - 1)),
)
def test_tampered_lengths_with_valid_crcs_raise_binpipe_error(
    records, checksum, block, slot, value
):
    data = encode_stream(records, checksum=checksum, block_bytes=48)
    bad = tamper(data, block, slot, value)
    got = outcome(decode_memory, bad)
    assert outcome(decode_streaming, bad) == got
    # Many tampers leave a valid stream (DATA <-> META, INT <-> FLOAT tags, moved record
    # boundaries, the PAYLOAD_CRC flag toggled and resealed); these three never do: a new
    # payload length disagrees with the field table, a new record count with END, and
    # the reserved word must stay zero.
    pos = block_offsets(data)[block % len(block_offsets(data))]
    n_slots = len(table_slots(data, pos))
    if slot % n_slots in (2, 4, 5) and bad != data:
        assert got == "error"


@st.composite
def random_tables(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], bytes]:
    """Tables and payload: consistent ones with one entry perturbed, or arbitrary ones."""
    nfld = draw(st.integers(0, 8))
    nrec = draw(st.integers(0, 6))
    if draw(st.booleans()):
        payload = draw(st.binary(max_size=80))
        field_ends = draw(st.lists(st.integers(0, 90), min_size=nfld, max_size=nfld))
        record_ends = draw(st.lists(st.integers(0, 10), min_size=nrec, max_size=nrec))
        types = draw(st.lists(st.integers(0, 6), min_size=nfld, max_size=nfld))
        return field_ends, record_ends, types, payload
    nrec = max(nrec, 1 if nfld else 0)
    lengths = draw(st.lists(st.sampled_from([0, 0, 1, 3, 8, 8, 12]), min_size=nfld, max_size=nfld))
    field_ends = [sum(lengths[: j + 1]) for j in range(nfld)]
    payload = draw(st.binary(min_size=sum(lengths), max_size=sum(lengths)))
    choices = {0: [0, 1, 2], 8: [1, 2, 3, 4]}
    types = [draw(st.sampled_from(choices.get(n, [1, 2]))) for n in lengths]
    cuts = sorted(
        draw(st.lists(st.integers(0, nfld), min_size=max(nrec - 1, 0), max_size=max(nrec - 1, 0)))
    )
    record_ends = [*cuts, nfld] if nrec else []
    table = draw(st.sampled_from(["none", "field_ends", "record_ends", "types"]))
    target = {"field_ends": field_ends, "record_ends": record_ends, "types": types}.get(table)
    if target:
        target[draw(st.integers(0, len(target) - 1))] = draw(st.integers(0, 12))
    return field_ends, record_ends, types, payload


@FUZZ
@given(
    tables=random_tables(),
    kind=st.integers(0, 2),
    end_count=st.one_of(st.none(), st.integers(-1, 7)),
)
def test_random_tables_behind_valid_crcs_decode_or_raise(tables, kind, end_count):
    _field_ends, record_ends, types, payload = tables
    if end_count is None:
        end_count = len(record_ends)  # the right count half the time, so the tables decide
    data = stream_header() + raw_block(*tables, kind=kind) + encode_end_block(end_count)
    got = outcome(decode_memory, data)
    assert outcome(decode_streaming, data) == got
    if got != "error":
        # Whatever was accepted is self-consistent: every field is accounted for.
        assert isinstance(got, list)
        assert len(got) == len(record_ends) == end_count
        assert sum(len(rec) for rec in got) == len(types)
        assert sum(len(v) for rec in got for t, v in rec if t in "BS" and v) <= len(payload)


# ---------------------------------------------------- bounded allocation


def huge_block_stream(payload_len: int) -> bytes:
    """A stream whose first block claims ``payload_len`` payload bytes, all CRCs valid."""
    head = bytearray(struct.pack("<4sHHIIQIIII", b"BPBK", 0, 0, 1, 1, payload_len, 0, 0, 0, 0))
    tables = struct.pack("<QI4xB7x", payload_len, 1, 1)
    struct.pack_into("<I", head, 24, zlib.crc32(tables))
    struct.pack_into("<I", head, 36, zlib.crc32(head[:36]))
    return stream_header() + bytes(head) + tables + b"\0" * 4096


@pytest.mark.parametrize("payload_len", [1 << 60, (1 << 64) - 1, (1 << 30) + 1])
def test_huge_claimed_payload_is_refused_before_reading_it(payload_len):
    data = huge_block_stream(payload_len)
    src = CountingReader(data)
    with pytest.raises(BinpipeError, match=r"offset 16 claims \d+ bytes, over the limit of 65536"):
        list(StreamReader(src, max_block_bytes=1 << 16))
    # The stream header and the block header, nothing of the claimed payload.
    assert src.bytes_read == STREAM_HEADER_SIZE + BLOCK_HEADER_SIZE
    with pytest.raises(BinpipeError, match="over the limit"):
        list(iter_blocks(data, max_block_bytes=1 << 16))
    with pytest.raises(BinpipeError, match="over the limit"):
        Block.parse(data[STREAM_HEADER_SIZE:], max_block_bytes=1 << 16)


def test_huge_claimed_payload_is_refused_under_the_default_limit():
    src = CountingReader(huge_block_stream(1 << 60))
    with pytest.raises(BinpipeError, match="over the limit of 1073741824"):
        list(StreamReader(src))
    assert src.bytes_read == STREAM_HEADER_SIZE + BLOCK_HEADER_SIZE


@FUZZ
@given(
    nrec=st.integers(0, (1 << 32) - 1),
    nfld=st.integers(0, (1 << 32) - 1),
    plen=st.integers(0, (1 << 64) - 1),
)
def test_any_claimed_size_is_bounded_by_the_limit(nrec, nfld, plen):
    head = bytearray(struct.pack("<4sHHIIQIIII", b"BPBK", 0, 0, nrec, nfld, plen, 0, 0, 0, 0))
    struct.pack_into("<I", head, 36, zlib.crc32(head[:36]))
    src = CountingReader(stream_header() + bytes(head) + b"\0" * 256)
    with pytest.raises(BinpipeError):
        list(StreamReader(src, max_block_bytes=512))
    # Nothing beyond the 256 bytes that are there can ever be read, and only when the
    # claimed block fits the limit.
    claimed = 40 + 8 * nfld + _pad8(4 * nrec) + _pad8(nfld) + _pad8(plen)
    if claimed > 512:
        assert src.bytes_read == STREAM_HEADER_SIZE + BLOCK_HEADER_SIZE
