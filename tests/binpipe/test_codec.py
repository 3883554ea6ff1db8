"""Tests of the BinPipe codec: round trips, zero copy, streaming, and every refusal."""

from __future__ import annotations

import io
import os
import re
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from adcloud.binpipe.codec import (
    BLOCK_HEADER_SIZE,
    FORMAT_VERSION,
    STREAM_HEADER_SIZE,
    STREAM_MAGIC,
    Block,
    BlockFlag,
    BlockKind,
    FieldType,
    Message,
    StreamReader,
    StreamWriter,
    encode_block,
    encode_end_block,
    encode_stream,
    iter_blocks,
    iter_records,
    stream_header,
)
from adcloud.binpipe.errors import BinpipeError

from .test_codec_fuzz import (
    HAND_BUILT_INVALID,
    HAND_BUILT_VALID,
    CountingReader,
    block_offsets,
    canonical_records,
    reseal_block,
)

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).parents[2] / "docs" / "binpipe-format.md"


def read_streaming(data: bytes, **kwargs: object) -> list[tuple[object, ...]]:
    return [rec for block in StreamReader(io.BytesIO(data), **kwargs) for rec in block]  # type: ignore[arg-type]


def roundtrip(records: list[tuple[object, ...]], **kwargs: object) -> list[tuple[object, ...]]:
    """Encode, decode both ways, check the two readers agree, return the records."""
    data = encode_stream(records, **kwargs)  # type: ignore[arg-type]
    in_memory = list(iter_records(data))
    assert canonical_records(read_streaming(data)) == canonical_records(in_memory)
    return in_memory


# ------------------------------------------------------------------ layout


def test_stream_header_bytes():
    head = stream_header()
    assert head[:8] == STREAM_MAGIC == bytes.fromhex("89 41 44 42 50 0d 0a 1a")
    assert head[8:12] == b"\x01\x00\x00\x00"
    assert head[12:] == struct.pack("<I", zlib.crc32(head[:12]))
    assert len(head) == STREAM_HEADER_SIZE == 16
    assert FORMAT_VERSION == 1


def test_empty_stream_is_header_plus_end_block():
    data = encode_stream([])
    assert data == stream_header() + encode_end_block(0)
    assert len(data) == 16 + 40 + 8 + 8 + 8 + 8
    assert list(iter_records(data)) == []
    assert read_streaming(data) == []


def test_block_layout_offsets_and_crcs():
    block = encode_block([("ab", 7), (None,), (b"xyz",)], checksum=True)
    magic, kind, flags, nrec, nfld, plen, tcrc, pcrc, reserved, hcrc = struct.unpack_from(
        "<4sHHIIQIIII", block
    )
    assert (magic, kind, flags, nrec, nfld, plen, reserved) == (b"BPBK", 0, 1, 3, 4, 13, 0)
    assert hcrc == zlib.crc32(block[:36])
    tables = block[40 : 40 + 32 + 16 + 8]
    assert tcrc == zlib.crc32(tables)
    assert struct.unpack_from("<4Q", tables) == (2, 10, 10, 13)  # field_ends
    assert struct.unpack_from("<3I", tables, 32) == (2, 3, 4)  # record_ends
    assert tables[44:48] == bytes(4)  # zero padding to 8
    assert tables[48:] == bytes([2, 3, 0, 1]) + bytes(4)  # field_types, padded
    payload = block[96 : 96 + 13]
    assert payload == b"ab" + struct.pack("<q", 7) + b"xyz"
    assert pcrc == zlib.crc32(payload)
    assert block[109:] == bytes(3)
    assert len(block) == Block.parse(block).header.block_size == 112


def test_doc_worked_example_matches_the_code():
    """The annotated hexdump in docs/binpipe-format.md is what the code writes."""
    text = DOC.read_text(encoding="utf-8")
    dump = text.split("<!-- example-hex-begin -->")[1].split("<!-- example-hex-end -->")[0]
    doc_bytes = bytearray()
    for line in dump.splitlines():
        m = re.match(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} ?)+)", line)
        if m:
            assert int(m.group(1), 16) == len(doc_bytes), line
            doc_bytes += bytes.fromhex(m.group(2))
    out = io.BytesIO()
    with StreamWriter(out, checksum=True) as writer:
        writer.write_meta(
            [
                (
                    "/chatter",
                    "std_msgs/String",
                    "ros1msg",
                    "string data",
                    "992ce8a1687cec8c8bd883ec73ca41d1",
                    "ros1",
                )
            ]
        )
        writer.write(("/chatter", 1_700_000_000_000_000_000, "std_msgs/String", b"\x02\0\0\0hi"))
    assert bytes(doc_bytes) == out.getvalue()


# -------------------------------------------------------------- round trips

VALUES = {
    "none": (None, FieldType.NONE),
    "bytes": (b"\x00\xffraw", FieldType.BYTES),
    "empty bytes": (b"", FieldType.BYTES),
    "bytearray": (bytearray(b"abc"), FieldType.BYTES),
    "memoryview": (memoryview(b"0123456789")[2:5], FieldType.BYTES),
    "numpy float32 array": (np.arange(3, dtype=np.float32), FieldType.BYTES),
    "numpy 2-d array": (np.arange(6, dtype=np.uint16).reshape(2, 3), FieldType.BYTES),
    "str": ("/velodyne_points", FieldType.STR),
    "empty str": ("", FieldType.STR),
    "unicode str": ("Straße 🚗 道路", FieldType.STR),
    "nul in str": ("a\0b", FieldType.STR),
    "int 0": (0, FieldType.INT),
    "int min": (-(1 << 63), FieldType.INT),
    "int max": ((1 << 63) - 1, FieldType.INT),
    "negative int": (-1_700_000_000, FieldType.INT),
    "numpy int64": (np.int64(-5), FieldType.INT),
    "numpy uint32": (np.uint32(4_000_000_000), FieldType.INT),
    "float": (3.25, FieldType.FLOAT),
    "negative zero": (-0.0, FieldType.FLOAT),
    "inf": (float("inf"), FieldType.FLOAT),
    "-inf": (float("-inf"), FieldType.FLOAT),
    "nan": (float("nan"), FieldType.FLOAT),
    "subnormal": (5e-324, FieldType.FLOAT),
    "numpy float32": (np.float32(1.5), FieldType.FLOAT),
}


def expected_value(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tobytes()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


@pytest.mark.parametrize("name", list(VALUES))
def test_every_field_type_round_trips(name):
    value, ftype = VALUES[name]
    for checksum in (False, True):
        (rec,) = roundtrip([(value,)], checksum=checksum)
        assert canonical_records([rec]) == canonical_records([(expected_value(value),)])
        block = next(iter_blocks(encode_stream([(value,)], checksum=checksum)))
        assert block.schema() == (ftype,)
        if ftype == FieldType.BYTES:
            assert isinstance(rec[0], memoryview)
        elif ftype == FieldType.INT:
            assert type(rec[0]) is int
        elif ftype == FieldType.FLOAT:
            assert type(rec[0]) is float


def test_mixed_records_including_empty_ones():
    records = [(), ("a", 1, None, b"", 2.5), (), (None,), ("", b"", None), ()]
    assert canonical_records(roundtrip(records)) == canonical_records(records)
    assert canonical_records(roundtrip(records, checksum=True, block_bytes=1)) == canonical_records(
        records
    )


def test_only_empty_records():
    data = encode_stream([()] * 5)
    (block,) = iter_blocks(data)
    assert (block.n_records, block.header.n_fields, block.header.payload_len) == (5, 0, 0)
    assert list(block) == [()] * 5
    assert block.schema() == ()


def test_many_records_fill_several_blocks():
    records = [("/t", i, "m", i.to_bytes(4, "little")) for i in range(20_000)]
    data = encode_stream(records)
    sizes = [len(b) for b in iter_blocks(data)]
    assert sizes == [8192, 8192, 3616]
    assert [r[1] for r in iter_records(data)] == list(range(20_000))
    assert len(read_streaming(data)) == 20_000


def test_block_records_and_block_bytes_bound_blocks():
    out = io.BytesIO()
    with StreamWriter(out, block_records=3) as writer:
        for i in range(10):
            writer.write((i,))
    assert [len(b) for b in iter_blocks(out.getvalue())] == [3, 3, 3, 1]
    # A block closes once its payload reaches block_bytes: 4 records of 8 bytes per 32.
    data = encode_stream([(i,) for i in range(10)], block_bytes=32)
    assert [len(b) for b in iter_blocks(data)] == [4, 4, 2]
    assert [r[0] for r in iter_records(data)] == list(range(10))


def uniform_records(n: int) -> list[tuple[object, ...]]:
    rng = np.random.default_rng(1)
    return [
        (f"/topic/{i % 3}", i * 1000 - 50_000, "é" * (i % 4), rng.bytes(i % 17), i / 3, None)
        for i in range(n)
    ]


def test_uniform_blocks_decode_like_mixed_ones():
    # Many records of one schema take the reader's column-by-column path.
    records = uniform_records(300)
    src = bytearray(encode_stream(records))
    (block,) = iter_blocks(src)
    assert block.schema() == (
        FieldType.STR,
        FieldType.INT,
        FieldType.STR,
        FieldType.BYTES,
        FieldType.FLOAT,
        FieldType.NONE,
    )
    got = list(block)
    assert canonical_records(got) == canonical_records(records)
    assert canonical_records(block.record(i) for i in range(300)) == canonical_records(records)
    assert all(type(r[1]) is int and type(r[4]) is float for r in got)
    assert all(isinstance(r[3], memoryview) and r[3].obj is src for r in got)
    assert canonical_records(read_streaming(bytes(src))) == canonical_records(records)


@pytest.mark.parametrize("drain", ["memory", "streaming"])
def test_invalid_utf8_in_a_uniform_block(drain):
    data = bytearray(encode_stream(uniform_records(200)))
    pos = bytes(data).rindex("ééé".encode())  # the start of the last such field
    data[pos + 1] = 0x28
    drain = drain_memory if drain == "memory" else drain_streaming
    with pytest.raises(BinpipeError, match=rf"field \d+ at offset {pos} is not valid UTF-8"):
        drain(data)


def test_field_larger_than_the_block_size_gets_a_block_of_its_own():
    big = np.random.default_rng(0).bytes(3 << 20)
    data = encode_stream([("a", b"x"), ("big", big), ("c", b"")], block_bytes=1 << 20)
    blocks = list(iter_blocks(data))
    assert [len(b) for b in blocks] == [2, 1]
    recs = [r for b in blocks for r in b]
    assert bytes(recs[1][1]) == big
    assert canonical_records(read_streaming(data)) == canonical_records(recs)


def test_meta_blocks_are_kept_apart_from_data():
    meta = [("/imu", "sensor_msgs/Imu", "ros1msg", "Header header", "6a62c6da", "ros1")]
    out = io.BytesIO()
    with StreamWriter(out) as writer:
        writer.write(("/imu", 1, "sensor_msgs/Imu", b"a"))
        writer.write_meta(meta)
        writer.write(("/imu", 2, "sensor_msgs/Imu", b"b"))
        assert writer.record_count == 3
    data = out.getvalue()
    assert [b.kind for b in iter_blocks(data)] == [BlockKind.DATA, BlockKind.META, BlockKind.DATA]
    assert [r[1] for r in iter_records(data)] == [1, 2]
    assert list(iter_records(data, include_meta=True))[1] == meta[0]
    # The END count covers META records too.
    assert struct.unpack("<q", data[-8:])[0] == 3


@pytest.mark.parametrize("checksum", [False, True])
def test_checksum_flag_and_field(checksum):
    data = encode_stream([("x", b"payload")], checksum=checksum)
    (block,) = iter_blocks(data)
    assert bool(block.header.flags & BlockFlag.PAYLOAD_CRC) is checksum
    assert block.header.payload_crc == (zlib.crc32(b"xpayload") if checksum else 0)


# --------------------------------------------------------------- zero copy


def test_bytes_fields_are_views_into_the_source_buffer():
    src = bytearray(encode_stream([("t", b"A" * 100), ("u", b"B" * 50)]))
    recs = list(iter_records(src))
    for rec in recs:
        assert isinstance(rec[1], memoryview)
        assert rec[1].obj is src
        assert np.shares_memory(np.frombuffer(rec[1], np.uint8), np.frombuffer(src, np.uint8))
    # A view, not a copy: changing the source shows through.
    pos = bytes(src).index(b"A" * 100)
    src[pos] = ord("Z")
    assert bytes(recs[0][1][:2]) == b"ZA"


def test_block_parse_of_bytes_hands_out_views():
    raw = encode_block([("/t", 1, "m", b"data")])
    block = Block.parse(raw)
    (msg,) = block.messages()
    assert isinstance(msg.data, memoryview) and msg.data.obj is raw
    assert block.record(0)[3].obj is raw


def test_stream_reader_fields_are_views_into_one_block_buffer():
    data = encode_stream([(b"a" * 10, b"b" * 20)] * 3)
    for block in StreamReader(io.BytesIO(data)):
        whole = np.frombuffer(block.raw, np.uint8)
        for rec in block:
            for field in rec:
                assert np.shares_memory(np.frombuffer(field, np.uint8), whole)


def test_writer_passes_large_buffers_through_without_copying():
    class Recorder(io.RawIOBase):
        def __init__(self) -> None:
            self.chunks: list[object] = []

        def writable(self) -> bool:
            return True

        def write(self, b):  # type: ignore[override]
            self.chunks.append(b)
            return len(b)

    big = bytes(1 << 17)
    arr = np.ones(1 << 15, dtype=np.float64)
    rec = Recorder()
    with StreamWriter(rec) as writer:
        writer.write(("big", big, arr))
    assert any(isinstance(c, memoryview) and c.obj is big for c in rec.chunks)
    assert any(isinstance(c, memoryview) and c.obj is arr for c in rec.chunks)


# --------------------------------------------------------------- streaming


@pytest.mark.parametrize("chunk", [1, 3, 7, 41, 1 << 20])
def test_stream_reader_handles_short_reads(chunk):
    records = [("/t", i, "m", bytes([i]) * i) for i in range(50)]
    data = encode_stream(records, checksum=True, block_bytes=100)
    src = CountingReader(data, chunk=chunk)
    reader = StreamReader(src)
    got = [r for b in reader for r in b]
    assert canonical_records(got) == canonical_records(records)
    assert reader.record_count == 50 and reader.offset == len(data)
    assert src.bytes_read == len(data)


def test_stream_reader_over_a_real_pipe():
    records = [("/cam", i, "sensor_msgs/Image", os.urandom(5000)) for i in range(200)]
    data = encode_stream(records, block_bytes=32 << 10)
    rfd, wfd = os.pipe()

    def produce() -> None:
        with open(wfd, "wb", buffering=0) as w:
            for i in range(0, len(data), 4093):
                w.write(data[i : i + 4093])

    producer = threading.Thread(target=produce)
    producer.start()
    with open(rfd, "rb", buffering=0) as r:
        got = [rec for block in StreamReader(r) for rec in block]
    producer.join()
    assert canonical_records(got) == canonical_records(records)


def test_stream_writer_to_pipe_and_back_through_stdin_like_objects():
    rfd, wfd = os.pipe()
    records = [(str(i), i, float(i), b"\x00" * i) for i in range(300)]

    def produce() -> None:
        with open(wfd, "wb") as w, StreamWriter(w, block_records=64) as writer:
            for rec in records:
                writer.write(rec)

    producer = threading.Thread(target=produce)
    producer.start()
    with open(rfd, "rb") as r:
        got = [rec for block in StreamReader(r) for rec in block]
    producer.join()
    assert canonical_records(got) == canonical_records(records)


# ------------------------------------------------------ truncation and ends


def small_stream(checksum: bool = False) -> bytes:
    out = io.BytesIO()
    with StreamWriter(out, checksum=checksum, block_records=2) as writer:
        writer.write_meta([("/t", "std_msgs/String", "ros1msg", "string data", "", "ros1")])
        writer.write(("/t", 5, "std_msgs/String", b"\x05\0\0\0hello"))
        writer.write((None, 1.5, "", b""))
        writer.write((-7,))
    return out.getvalue()


def drain_memory(data: bytes | bytearray) -> None:
    for block in iter_blocks(data):
        list(block)


def drain_streaming(data: bytes | bytearray, **kwargs: object) -> None:
    for block in StreamReader(CountingReader(bytes(data), chunk=5), **kwargs):  # type: ignore[arg-type]
        list(block)


DRAINS = [drain_memory, drain_streaming]


@pytest.mark.parametrize("drain", DRAINS)
@pytest.mark.parametrize("checksum", [False, True])
def test_truncation_at_every_offset_raises_binpipe_error_with_offset(drain, checksum):
    data = small_stream(checksum)
    for cut in range(len(data)):
        with pytest.raises(BinpipeError, match=r"offset \d+") as err:
            drain(data[:cut])
        assert "truncated" in str(err.value) or "empty input" in str(err.value), cut


@pytest.mark.parametrize("drain", DRAINS)
def test_stream_cut_at_a_block_boundary_is_missing_its_end(drain):
    data = small_stream()
    offsets = block_offsets(data)
    for boundary in [STREAM_HEADER_SIZE, *offsets]:
        with pytest.raises(BinpipeError, match=rf"truncated.* at offset {boundary}"):
            drain(data[:boundary])


def test_empty_input_messages():
    with pytest.raises(BinpipeError, match="empty input"):
        drain_streaming(b"")
    with pytest.raises(BinpipeError, match=r"truncated stream at offset 0: 0 of 16"):
        drain_memory(b"")


@pytest.mark.parametrize("drain", DRAINS)
def test_end_count_mismatch(drain):
    body = encode_block([(1,), (2,)])
    for declared in (1, 3, 0, -2):
        data = stream_header() + body + encode_end_block(declared)
        with pytest.raises(BinpipeError, match=rf"declares {declared} records, the stream held 2"):
            drain(data)
    drain(stream_header() + body + encode_end_block(2))


@pytest.mark.parametrize("drain", DRAINS)
def test_trailing_bytes_after_end(drain):
    data = small_stream()
    with pytest.raises(
        BinpipeError, match=rf"trailing bytes after the END block at offset {len(data)}"
    ):
        drain(data + b"\0")
    with pytest.raises(BinpipeError, match="trailing bytes"):
        drain(data + data)


@pytest.mark.parametrize("drain", DRAINS)
def test_end_block_must_hold_one_int(drain):
    bad_end = encode_block([("3",)], kind=BlockKind.END)
    with pytest.raises(BinpipeError, match="corrupt END block"):
        drain(stream_header() + bad_end)
    two = encode_block([(0,), (0,)], kind=BlockKind.END)
    with pytest.raises(BinpipeError, match="corrupt END block"):
        drain(stream_header() + two)


# ------------------------------------------------------------- bad headers


@pytest.mark.parametrize("drain", DRAINS)
def test_bad_magic_says_what_it_saw(drain):
    with pytest.raises(BinpipeError, match=r"not a BinPipe stream at offset 0: magic b'hello wo'"):
        drain(b"hello world, this is text\n")
    with pytest.raises(BinpipeError, match="writing text or a different format"):
        drain(b"PK\x03\x04" + bytes(40))


@pytest.mark.parametrize("drain", DRAINS)
def test_unsupported_version(drain):
    data = stream_header(2) + small_stream()[STREAM_HEADER_SIZE:]
    with pytest.raises(BinpipeError, match=r"unsupported BinPipe version 2 .*reads version 1"):
        drain(data)


@pytest.mark.parametrize("drain", DRAINS)
def test_stream_header_crc_and_flags(drain):
    data = bytearray(small_stream())
    data[10] = 1  # flags, CRC left stale
    with pytest.raises(BinpipeError, match="corrupt stream header at offset 0: CRC mismatch"):
        drain(data)
    struct.pack_into("<I", data, 12, zlib.crc32(data[:12]))
    with pytest.raises(BinpipeError, match="unsupported stream flags 0x1 at offset 0"):
        drain(data)


@pytest.mark.parametrize("drain", DRAINS)
def test_block_header_checks(drain):
    data = small_stream()
    pos = block_offsets(data)[1]

    def patched(offset: int, fmt: str, value: int, reseal: bool = True) -> bytearray:
        buf = bytearray(data)
        struct.pack_into(fmt, buf, pos + offset, value)
        if reseal:
            reseal_block(buf, pos)
        return buf

    with pytest.raises(BinpipeError, match=r"block magic b'BPBX', expected b'BPBK'"):
        drain(patched(3, "<B", ord("X"), reseal=False))
    with pytest.raises(BinpipeError, match=rf"corrupt block header at offset {pos}: CRC mismatch"):
        drain(patched(8, "<I", 3, reseal=False))
    with pytest.raises(BinpipeError, match=rf"block at offset {pos}: unknown kind 3"):
        drain(patched(4, "<H", 3))
    with pytest.raises(BinpipeError, match=rf"block at offset {pos}: unknown flags 0x2"):
        drain(patched(6, "<H", 2))
    with pytest.raises(BinpipeError, match=rf"block at offset {pos}: reserved word is 0x1"):
        drain(patched(32, "<I", 1))
    with pytest.raises(BinpipeError, match=rf"corrupt block tables at offset {pos + 40}"):
        drain(patched(40, "<B", data[pos + 40] ^ 1, reseal=False))


@pytest.mark.parametrize("drain", DRAINS)
def test_structural_checks_behind_valid_crcs(drain):
    data = small_stream()
    pos = block_offsets(data)[1]  # the DATA block: records of 4 and 4 fields
    nrec, nfld = struct.unpack_from("<II", data, pos + 8)
    t0 = pos + 40
    r0 = t0 + 8 * nfld
    y0 = r0 + ((4 * nrec + 7) & ~7)

    def tampered(where: int, fmt: str, value: int) -> bytearray:
        buf = bytearray(data)
        struct.pack_into(fmt, buf, where, value)
        reseal_block(buf, pos)
        return buf

    plen = struct.unpack_from("<Q", data, pos + 16)[0]
    cases = [
        (tampered(pos + 16, "<Q", plen + 1), "field offsets end at"),
        (tampered(t0, "<Q", 1000), "field offsets go backwards"),
        (tampered(y0 + 1, "<B", 9), "unknown field type 9"),
        (tampered(y0, "<B", FieldType.FLOAT), "numeric field not 8 bytes long"),
        (tampered(y0, "<B", FieldType.NONE), "null field with bytes"),
        (tampered(r0, "<I", 9), "record table goes backwards"),
        (tampered(r0 + 4 * nrec - 4, "<I", nfld - 1), "record table ends at 7"),
    ]
    for buf, message in cases:
        with pytest.raises(BinpipeError, match=rf"corrupt block at offset {pos}: ({message})"):
            drain(buf)


def test_hand_built_block_decodes():
    data = stream_header() + HAND_BUILT_VALID + encode_end_block(3)
    assert canonical_records(iter_records(data)) == canonical_records([(None,), (), ("hi", 0, b"")])


@pytest.mark.parametrize("drain", DRAINS)
@pytest.mark.parametrize(
    ("name", "block", "message"), HAND_BUILT_INVALID, ids=[c[0] for c in HAND_BUILT_INVALID]
)
def test_each_table_rule_is_enforced_on_its_own(drain, name, block, message):
    n = struct.unpack_from("<I", block, 8)[0]
    data = stream_header() + block + encode_end_block(n)
    with pytest.raises(BinpipeError, match=rf"offset \d+.*{message}"):
        drain(data)


@pytest.mark.parametrize("drain", DRAINS)
def test_nonzero_padding_is_refused(drain):
    data = small_stream()
    pos = block_offsets(data)[-2]  # the last DATA block: one record, one INT field
    buf = bytearray(data)
    # record_ends padding: 1 record -> 4 bytes of padding after it.
    buf[pos + 40 + 8 + 4] = 1
    reseal_block(buf, pos)
    with pytest.raises(BinpipeError, match=rf"block at offset {pos}: non-zero padding"):
        drain(buf)
    # Payload padding is outside every CRC; only this rule sees a flip there.
    data = encode_stream([(b"abc",)], checksum=True)
    pos = block_offsets(data)[0]
    buf = bytearray(data)
    buf[block_offsets(data)[1] - 1] = 0x80
    with pytest.raises(BinpipeError, match=rf"block at offset {pos}: non-zero padding"):
        drain(buf)


@pytest.mark.parametrize("drain", DRAINS)
def test_invalid_utf8_in_a_str_field(drain):
    data = bytearray(encode_stream([("ok", "é")]))
    pos = bytes(data).index("é".encode())
    data[pos + 1] = 0x28  # a lead byte followed by a non-continuation byte
    reseal_block(data, STREAM_HEADER_SIZE)
    with pytest.raises(BinpipeError, match=rf"field 1 at offset {pos} is not valid UTF-8"):
        drain(data)


def test_reader_name_prefixes_its_messages():
    with pytest.raises(BinpipeError, match=r"^part-00003: truncated"):
        list(StreamReader(io.BytesIO(small_stream()[:-3]), name="part-00003"))
    with pytest.raises(BinpipeError, match=r"^part-7: .*no END block"):
        list(iter_blocks(small_stream()[:16], name="part-7"))


# --------------------------------------------------------------- checksums


def test_payload_crc_catches_a_flipped_payload_bit():
    records = [("/t", 1, "m", b"sensor bytes " * 10)]
    for checksum in (True, False):
        data = bytearray(encode_stream(records, checksum=checksum))
        pos = bytes(data).index(b"sensor bytes")
        data[pos] ^= 0x04
        if checksum:
            with pytest.raises(BinpipeError, match=r"corrupt block payload at offset \d+: CRC"):
                drain_memory(data)
            with pytest.raises(BinpipeError, match=r"payload .*CRC mismatch"):
                drain_streaming(data)
            # verify_payload=False skips it (for trusted local pipes).
            (rec,) = [r for b in iter_blocks(data, verify_payload=False) for r in b]
            assert bytes(rec[3]).startswith(b"wensor bytes")
        else:
            # Without the flag a payload flip goes unnoticed: the trade-off is the caller's.
            (rec,) = list(iter_records(data))
            assert bytes(rec[3]).startswith(b"wensor bytes")


# ---------------------------------------------------------------- limits


def test_max_block_bytes_refuses_before_allocating():
    data = encode_stream([(b"x" * 10_000,)])
    src = CountingReader(data)
    with pytest.raises(BinpipeError, match=r"offset 16 claims 10064 bytes, over the limit of 4096"):
        list(StreamReader(src, max_block_bytes=4096))
    assert src.bytes_read == STREAM_HEADER_SIZE + BLOCK_HEADER_SIZE
    with pytest.raises(BinpipeError, match="over the limit of 4096"):
        list(iter_blocks(data, max_block_bytes=4096))
    assert len(list(iter_blocks(data, max_block_bytes=10064))) == 1
    assert len(read_streaming(data, max_block_bytes=10064)) == 1


def test_claimed_exabyte_payload_is_refused_by_the_streaming_reader():
    head = bytearray(struct.pack("<4sHHIIQIIII", b"BPBK", 0, 0, 0, 0, 1 << 62, 0, 0, 0, 0))
    struct.pack_into("<I", head, 36, zlib.crc32(head[:36]))
    src = CountingReader(stream_header() + bytes(head) + bytes(1000))
    with pytest.raises(BinpipeError, match="over the limit"):
        list(StreamReader(src, max_block_bytes=1 << 16))
    assert src.bytes_read == 56


# ------------------------------------------------------------------ Block


def message_block() -> Block:
    return Block.parse(
        encode_block(
            [
                ("/imu", 10, "sensor_msgs/Imu", b"a"),
                ("/gps", 20, "sensor_msgs/NavSatFix", b"bcd"),
                ("/imu", -30, "sensor_msgs/Imu", b""),
            ]
        )
    )


def test_schema_uniform_mixed_and_empty():
    assert message_block().schema() == (
        FieldType.STR,
        FieldType.INT,
        FieldType.STR,
        FieldType.BYTES,
    )
    assert Block.parse(encode_block([(1,), ("a",)])).schema() is None
    assert Block.parse(encode_block([(1, 2), (3,)])).schema() is None
    assert Block.parse(encode_block([])).schema() == ()
    assert Block.parse(encode_block([(), ()])).schema() == ()


def test_column_spans():
    block = message_block()
    starts, ends = block.column_spans(3)
    payload = bytes(block.payload)
    assert [payload[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)] == [
        b"a",
        b"bcd",
        b"",
    ]
    starts, ends = block.column_spans(0)
    assert (ends - starts).tolist() == [4, 4, 4]
    with pytest.raises(IndexError):
        block.column_spans(4)
    with pytest.raises(BinpipeError, match="no uniform schema"):
        Block.parse(encode_block([(1,), ("a",)])).column_spans(0)


def test_int_column():
    block = message_block()
    col = block.int_column(1)
    assert col.dtype == np.int64 and col.tolist() == [10, 20, -30]
    floats = Block.parse(encode_block([(1.5, 2), (float("-inf"), 3)]))
    assert floats.int_column(0).tolist() == [1.5, float("-inf")]
    assert floats.int_column(1).tolist() == [2, 3]
    with pytest.raises(BinpipeError, match=r"column 0 .* is not numeric"):
        block.int_column(0)


def test_messages():
    msgs = list(message_block().messages())
    assert msgs[1] == Message("/gps", 20, "sensor_msgs/NavSatFix", msgs[1].data)
    assert bytes(msgs[1].data) == b"bcd"
    assert all(isinstance(m.data, memoryview) for m in msgs)
    for bad in [
        ("/t", 1, "m"),
        ("/t", "1", "m", b""),
        ("/t", 1, "m", "not bytes"),
        (1, 1, "m", b""),
    ]:
        with pytest.raises(BinpipeError, match="record 0 of the block at offset 0"):
            list(Block.parse(encode_block([bad])).messages())


def test_record_random_access_matches_iteration():
    block = Block.parse(encode_block([(1, "a"), (), (None, b"x", 2.0)]))
    assert canonical_records(block.record(i) for i in range(3)) == canonical_records(block)
    assert len(block) == block.n_records == 3
    with pytest.raises(IndexError):
        block.record(3)
    with pytest.raises(IndexError):
        block.record(-1)


# ------------------------------------------------------------- StreamWriter


def test_write_block_appends_validated_blocks():
    out = io.BytesIO()
    with StreamWriter(out) as writer:
        writer.write(("first",))
        writer.write_block(encode_block([("b1",), ("b2",)], checksum=True))
        writer.write_block(encode_block([("m",)], kind=BlockKind.META))
        assert writer.record_count == 4
        with pytest.raises(BinpipeError, match="END blocks are written by close"):
            writer.write_block(encode_end_block(0))
        with pytest.raises(BinpipeError, match="exactly one block"):
            writer.write_block(encode_block([("x",)]) + encode_block([("y",)]))
        with pytest.raises(BinpipeError, match="truncated block"):
            writer.write_block(encode_block([("x",)])[:-8])
    assert [r[0] for r in iter_records(out.getvalue(), include_meta=True)] == [
        "first",
        "b1",
        "b2",
        "m",
    ]


def test_closed_writer_refuses_writes_and_close_is_idempotent():
    out = io.BytesIO()
    writer = StreamWriter(out)
    writer.write((1,))
    writer.close()
    size = len(out.getvalue())
    writer.close()
    assert len(out.getvalue()) == size
    for call in (
        lambda: writer.write((2,)),
        lambda: writer.write_meta([(1,)]),
        lambda: writer.write_block(encode_block([(3,)])),
    ):
        with pytest.raises(BinpipeError, match="closed"):
            call()
    assert len(out.getvalue()) == size
    assert list(iter_records(out.getvalue())) == [(1,)]


def test_writer_leaves_no_end_block_after_an_exception():
    out = io.BytesIO()
    with pytest.raises(RuntimeError), StreamWriter(out) as writer:
        writer.write((1,))
        writer.flush_block()
        raise RuntimeError("producer crashed")
    with pytest.raises(BinpipeError, match="no END block"):
        drain_memory(out.getvalue())


def test_bytes_written_counts_everything():
    out = io.BytesIO()
    with StreamWriter(out) as writer:
        writer.write((b"x" * 100_000,))
        writer.write(("small",))
    assert writer.bytes_written == len(out.getvalue())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "bool fields are not supported"),
        (np.bool_(False), "bool fields are not supported"),
        (1 << 63, "does not fit a signed 64-bit integer"),
        (-(1 << 63) - 1, "does not fit a signed 64-bit integer"),
        (object(), "cannot encode a field of type object"),
        ([1, 2], "cannot encode a field of type list"),
        ({"a": 1}, "cannot encode a field of type dict"),
        (np.arange(10)[::2], "must be C-contiguous"),
        ("lone \ud800 surrogate", "not encodable as UTF-8"),
    ],
)
def test_encode_errors(value, message):
    with pytest.raises(BinpipeError, match=message):
        encode_block([("ok", value)])
    with pytest.raises(BinpipeError, match=message):
        encode_stream([(value,)])


@pytest.mark.parametrize("reader", ["memory", "stream"])
def test_a_stream_cut_at_a_block_boundary_says_no_end_block(reader: str) -> None:
    """A producer that died between blocks: the streaming reader said "truncated block
    header ... 0 of 40 bytes", where the in-memory reader (and the format's check B1) say
    that the END block is missing."""
    data = encode_stream([("a",)])
    cut = data[: len(data) - len(encode_end_block(1))]
    with pytest.raises(BinpipeError, match=rf"offset {len(cut)}\b.*no END block"):
        list(iter_blocks(cut) if reader == "memory" else StreamReader(io.BytesIO(cut)))


@pytest.mark.parametrize(
    "bad",
    [
        ("b", True),  # refused after a good field
        Message("/t", 1 << 63, "std_msgs/msg/String", b"x"),  # the general path, as a Message
        ("b", 2, "lone \ud800 surrogate"),
    ],
)
def test_a_refused_record_leaves_nothing_in_the_block(bad):
    """A caller that logs a refused record and goes on: the fields encoded before the bad
    one stayed in the block, and the next record written took them as its own."""
    out = io.BytesIO()
    writer = StreamWriter(out)
    writer.write(("a", 1))
    with pytest.raises(BinpipeError):
        writer.write(bad)
    writer.write(("c", 3))
    assert writer.record_count == 2
    writer.close()
    assert list(iter_records(out.getvalue())) == [("a", 1), ("c", 3)]

    # and the same for a generator that fails while a record is being taken apart
    def fields():
        yield "d"
        raise RuntimeError("source failed")

    block = io.BytesIO()
    writer = StreamWriter(block)
    with pytest.raises(RuntimeError):
        writer.write(fields())
    writer.write((4,))
    writer.close()
    assert list(iter_records(block.getvalue())) == [(4,)]
