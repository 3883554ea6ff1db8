"""Conformance of the Python codec with an independent C implementation of the spec.

``c/binpipe_ref.c`` was written from ``docs/binpipe-format.md`` alone (its own CRC-32,
no zlib).  Streams written by Python must decode identically in C, streams written
by C must decode identically in Python (and be byte-identical to what Python writes
for the same blocks), and both must refuse the same corrupt streams.
"""

from __future__ import annotations

import io
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from adcloud.binpipe.codec import (
    STREAM_HEADER_SIZE,
    BlockKind,
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
    block_offsets,
    canonical_records,
    huge_block_stream,
    reseal_block,
    tamper,
)

pytestmark = pytest.mark.timeout(300)

SOURCE = Path(__file__).parent / "c" / "binpipe_ref.c"


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C reference implementation, compiled with every warning as an error."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is not on PATH; it is part of the machine (apt-get install gcc)")
    exe = tmp_path_factory.mktemp("binpipe_ref") / "binpipe_ref"
    cmd = [
        gcc,
        "-std=c11",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Wpedantic",
        "-Wconversion",
        "-Werror",
        "-o",
        str(exe),
        str(SOURCE),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return exe


def c_decode(ref: Path, data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(ref), "decode", *args], input=data, capture_output=True, timeout=60, check=False
    )


def c_encode(ref: Path, text: str) -> bytes:
    res = subprocess.run(
        [str(ref), "encode"], input=text.encode(), capture_output=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout


# ------------------------------------------------------------ text form


def field_line(value: object) -> str:
    """One field in the reference program's text form."""
    if value is None:
        return "N"
    if isinstance(value, str):
        return "S " + (value.encode("utf-8").hex() or "-")
    if isinstance(value, int):
        return f"I {value}"
    if isinstance(value, float):
        return "F {:016x}".format(*struct.unpack("<Q", struct.pack("<d", value)))
    return "B " + (bytes(value).hex() or "-")  # type: ignore[arg-type]


def block_text(kind: str, flags: int, records: list[tuple[object, ...]]) -> list[str]:
    lines = [f"BLOCK {kind} {len(records)} {flags}"]
    for rec in records:
        lines.append(f"R {len(rec)}")
        lines.extend(field_line(v) for v in rec)
    return lines


def python_text(data: bytes) -> str:
    """How the Python codec decodes ``data``, in the reference text form."""
    lines: list[str] = []
    count = 0
    for block in iter_blocks(data):
        lines += block_text(block.kind.name, block.header.flags, list(block))
        count += block.n_records
    return "\n".join([*lines, f"END {count}", ""])


def python_text_streaming(data: bytes) -> str:
    """The same through :class:`StreamReader`."""
    lines: list[str] = []
    reader = StreamReader(io.BytesIO(data))
    for block in reader:
        lines += block_text(block.kind.name, block.header.flags, list(block))
    return "\n".join([*lines, f"END {reader.record_count}", ""])


def record_lines(text: str) -> list[str]:
    """The R and field lines only (block boundaries are the writer's choice)."""
    return [ln for ln in text.splitlines() if not ln.startswith(("BLOCK", "END"))]


# ------------------------------------------------------------- test data

STRINGS = [
    "",
    "a",
    "/camera/front/image_raw",
    "héllo wörld",
    "日本語のトピック",
    "emoji 🚗💨",
    "nul\0inside",
    "tab\tand\nnewline",
    "\U0010ffff",
    "é" * 300,
]
FLOATS = [
    0.0,
    -0.0,
    1.5,
    -2.25e-308,
    5e-324,
    1.7976931348623157e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    -float("nan"),
    struct.unpack("<d", b"\1\0\0\0\0\0\xf0\x7f")[0],
]
INTS = [0, 1, -1, 42, -(1 << 63), (1 << 63) - 1, 1_700_000_000_123_456_789, -(1 << 31)]


def random_field(rng: random.Random) -> object:
    kind = rng.randrange(7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice(STRINGS)
    if kind == 2:
        return rng.choice(INTS) if rng.random() < 0.5 else rng.randrange(-(1 << 63), 1 << 63)
    if kind == 3:
        return rng.choice(FLOATS) if rng.random() < 0.5 else rng.uniform(-1e9, 1e9)
    if kind == 4:
        return b""
    if kind == 5 and rng.random() < 0.05:
        return rng.randbytes(rng.randrange(100_000, 400_000))
    return rng.randbytes(rng.randrange(0, 40))


def random_records(rng: random.Random, n: int) -> list[tuple[object, ...]]:
    return [tuple(random_field(rng) for _ in range(rng.randrange(0, 7))) for _ in range(n)]


META = [
    (
        "/imu",
        "sensor_msgs/Imu",
        "ros1msg",
        "Header header\nfloat64[9] orientation_covariance",
        "6a62c6daae103f4ff57a132d6f95cec2",
        "ros1",
    ),
    ("/scan", "sensor_msgs/msg/LaserScan", "ros2msg", "float32 angle_min", "", "cdr"),
]


def write_python_stream(seed: int, checksum: bool) -> tuple[bytes, list[tuple[object, ...]]]:
    """A stream with several DATA blocks and two META blocks; returns it and its records."""
    rng = random.Random(seed)
    out = io.BytesIO()
    everything: list[tuple[object, ...]] = []
    with StreamWriter(out, checksum=checksum, block_bytes=512, block_records=17) as writer:
        writer.write_meta(META[:1])
        everything += META[:1]
        for i, rec in enumerate(random_records(rng, 150)):
            writer.write(rec)
            everything.append(rec)
            if i == 70:
                writer.write_meta(META)
                everything += META
            if i == 100:
                big = ("/points", -1, rng.randbytes(300_000), "", b"")
                writer.write(big)
                everything.append(big)
    return out.getvalue(), everything


# -------------------------------------------------------- Python -> C


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_python_streams_decode_identically_in_c(ref, seed, checksum):
    data, records = write_python_stream(seed, checksum)
    res = c_decode(ref, data)
    assert res.returncode == 0, res.stderr.decode()
    text = res.stdout.decode()
    # Same blocks, flags and records as the Python reader sees ...
    assert text == python_text(data) == python_text_streaming(data)
    # ... and the records are the ones written, compared without the Python reader.
    expected = [ln for rec in records for ln in [f"R {len(rec)}", *map(field_line, rec)]]
    assert record_lines(text) == expected
    kinds = [ln.split()[1] for ln in text.splitlines() if ln.startswith("BLOCK")]
    assert kinds.count("META") == 2 and kinds.count("DATA") > 5
    flags = {ln.split()[3] for ln in text.splitlines() if ln.startswith("BLOCK")}
    assert flags == {"1" if checksum else "0"}
    assert text.endswith(f"END {len(records)}\n")


def test_uniform_python_blocks_decode_identically_in_c(ref):
    # Blocks of many same-shaped records are decoded column by column in Python.
    rng = random.Random(5)
    records = [
        (
            "/imu",
            rng.randrange(-(1 << 63), 1 << 63),
            "sensor_msgs/Imu",
            rng.randbytes(9),
            rng.choice(FLOATS),
            None,
        )
        for _ in range(500)
    ]
    data = encode_stream(records, checksum=True)
    res = c_decode(ref, data)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode() == python_text(data) == python_text_streaming(data)
    expected = [ln for rec in records for ln in [f"R {len(rec)}", *map(field_line, rec)]]
    assert record_lines(res.stdout.decode()) == expected


def test_empty_python_stream_decodes_in_c(ref):
    buf = io.BytesIO()
    StreamWriter(buf).close()
    res = c_decode(ref, buf.getvalue())
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == b"END 0\n"


# -------------------------------------------------------- C -> Python


def random_spec(rng: random.Random) -> tuple[str, list[tuple[str, int, list[tuple[object, ...]]]]]:
    blocks = []
    for _ in range(rng.randrange(0, 6)):
        kind = "META" if rng.random() < 0.25 else "DATA"
        blocks.append((kind, rng.randrange(2), random_records(rng, rng.randrange(0, 30))))
    count = sum(len(recs) for _, _, recs in blocks)
    lines = [ln for kind, flags, recs in blocks for ln in block_text(kind, flags, recs)]
    return "\n".join([*lines, f"END {count}", ""]), blocks


@pytest.mark.parametrize("seed", range(8))
def test_c_streams_decode_identically_in_python(ref, seed):
    text, blocks = random_spec(random.Random(1000 + seed))
    data = c_encode(ref, text)
    # Python reads back exactly the text the C writer was given ...
    assert python_text(data) == text
    assert python_text_streaming(data) == text
    everything = [rec for _, _, recs in blocks for rec in recs]
    data_only = [rec for kind, _, recs in blocks if kind == "DATA" for rec in recs]
    assert canonical_records(iter_records(data, include_meta=True)) == canonical_records(everything)
    assert canonical_records(iter_records(data)) == canonical_records(data_only)
    # ... and writes the same bytes for the same blocks: the layout has no free choices.
    python_bytes = (
        stream_header()
        + b"".join(
            encode_block(recs, kind=BlockKind[kind], checksum=bool(flags))
            for kind, flags, recs in blocks
        )
        + encode_end_block(len(everything))
    )
    assert data == python_bytes
    # The C reader accepts what the C writer wrote, too.
    assert c_decode(ref, data).stdout.decode() == text


def test_c_writes_signalling_nan_bit_patterns_that_python_keeps(ref):
    text = (
        "BLOCK DATA 1 1\nR 3\nF 7ff0000000000001\nF fff8000000000000\nF 8000000000000000\nEND 1\n"
    )
    data = c_encode(ref, text)
    assert python_text(data) == text


# ------------------------------------------------------ corrupt streams


def both_verdicts(ref: Path, data: bytes) -> tuple[str | None, str | None]:
    """(Python, C) decodings in text form, None for a refused stream."""
    try:
        py: str | None = python_text(data)
    except BinpipeError:
        py = None
    try:
        assert python_text_streaming(data) == py
    except BinpipeError:
        assert py is None
    res = c_decode(ref, data)
    if res.returncode == 0:
        return py, res.stdout.decode()
    assert res.returncode == 1, res.stderr.decode()
    assert res.stderr.startswith(b"binpipe_ref: ") and b" at offset " in res.stderr
    return py, None


def small_stream(checksum: bool) -> bytes:
    out = io.BytesIO()
    with StreamWriter(out, checksum=checksum, block_records=2) as writer:
        writer.write_meta([("/t", "std_msgs/String", "ros1msg", "string data", "", "ros1")])
        writer.write(("/t", 5, "std_msgs/String", b"\x05\0\0\0hello"))
        writer.write((None, 1.5, "", b""))
        writer.write((-7,))
    return out.getvalue()


@pytest.mark.parametrize("checksum", [False, True])
def test_truncations_are_refused_by_both(ref, checksum):
    data = small_stream(checksum)
    for cut in range(len(data)):
        assert both_verdicts(ref, data[:cut]) == (None, None), cut


@pytest.mark.parametrize("checksum", [False, True])
def test_bit_flips_are_judged_alike(ref, checksum):
    data = small_stream(checksum)
    rng = random.Random(7)
    positions = range(len(data)) if checksum else rng.sample(range(len(data)), 120)
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        py, c = both_verdicts(ref, bytes(bad))
        assert py == c, pos
        if checksum:
            # Every byte is under a CRC or the zero-padding rule.
            assert py is None, pos


def test_structural_tampering_with_valid_crcs_is_judged_alike(ref):
    data = small_stream(checksum=True)
    rng = random.Random(11)
    values = [0, 1, 2, 3, 4, 5, 8, 9, 0xFF, 0xFFFF, 0xFFFFFFFF, 1 << 32, 1 << 60, (1 << 64) - 1]
    refused = 0
    for block in range(len(block_offsets(data))):
        for slot in range(40):
            for value in rng.sample(values, 4):
                bad = tamper(data, block, slot, value)
                py, c = both_verdicts(ref, bad)
                assert py == c, (block, slot, value)
                refused += py is None
    assert refused > 300


@pytest.mark.parametrize(
    ("name", "mutate"),
    [
        ("trailing byte", lambda d: d + b"\0"),
        ("second stream appended", lambda d: d + d),
        ("END block dropped", lambda d: d[: block_offsets(d)[-1]]),
        ("block duplicated", lambda d: d[: block_offsets(d)[-1]] + d[block_offsets(d)[-2] :]),
        ("bad magic", lambda d: b"\x89ADBQ" + d[5:]),
        ("text input", lambda d: b"hello world\n" * 4),
        ("empty input", lambda d: b""),
        ("version 2", lambda d: stream_header(2) + d[STREAM_HEADER_SIZE:]),
    ],
)
def test_named_corruptions_are_refused_by_both(ref, name, mutate):
    assert both_verdicts(ref, mutate(small_stream(checksum=False))) == (None, None), name


def test_huge_claimed_block_is_refused_by_c_too(ref):
    res = c_decode(ref, huge_block_stream((1 << 64) - 1))
    assert res.returncode == 1
    assert b"claims more than" in res.stderr
    res = c_decode(ref, huge_block_stream(1 << 20), "65536")
    assert res.returncode == 1
    assert b"claims more than 65536 bytes at offset 16" in res.stderr


def test_invalid_utf8_is_refused_by_both(ref):
    # "h" followed by an encoded surrogate (U+D800), which UTF-8 forbids.
    data = c_encode(ref, "BLOCK DATA 1 0\nR 1\nS 68eda080\nEND 1\n")
    assert both_verdicts(ref, data) == (None, None)


def test_each_table_rule_is_enforced_by_c_too(ref):
    py, c = both_verdicts(ref, stream_header() + HAND_BUILT_VALID + encode_end_block(3))
    assert py == c == "BLOCK DATA 3 0\nR 1\nN\nR 0\nR 3\nS 6869\nI 0\nB -\nEND 3\n"
    for name, block, _message in HAND_BUILT_INVALID:
        n = struct.unpack_from("<I", block, 8)[0]
        data = stream_header() + block + encode_end_block(n)
        assert both_verdicts(ref, data) == (None, None), name


def padding_positions(stream: bytes, pos: int) -> list[int]:
    """Stream offsets of every padding byte of the block at ``pos``."""
    nrec, nfld, plen = struct.unpack_from("<IIQ", stream, pos + 8)
    r1 = pos + 40 + 8 * nfld + 4 * nrec
    y0 = pos + 40 + 8 * nfld + ((4 * nrec + 7) & ~7)
    p0 = y0 + ((nfld + 7) & ~7)
    p1 = p0 + ((plen + 7) & ~7)
    return [*range(r1, y0), *range(y0 + nfld, p0), *range(p0 + plen, p1)]


@pytest.mark.parametrize("checksum", [False, True])
def test_nonzero_padding_is_refused_by_both(ref, checksum):
    data = small_stream(checksum)
    tried = 0
    for pos in block_offsets(data):
        for where in padding_positions(data, pos):
            bad = bytearray(data)
            bad[where] = 0x01
            reseal_block(bad, pos)
            assert both_verdicts(ref, bytes(bad)) == (None, None), (pos, where)
            tried += 1
    assert tried > 20
