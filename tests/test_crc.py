"""adcloud's CRC-32 is zlib's: every file it checksums stays readable by any zlib."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from adcloud._crc import crc32


@given(st.binary(max_size=4096), st.integers(0, 2**32 - 1), st.integers(0, 64))
def test_the_same_value_as_zlib_for_any_bytes_start_and_offset(
    data: bytes, start: int, cut: int
) -> None:
    view = memoryview(data)[min(cut, len(data)) :]
    assert crc32(view, start) == zlib.crc32(view, start)
    assert crc32(data) == zlib.crc32(data)


def test_chunked_runs_continue_and_large_buffers_and_arrays_agree() -> None:
    data = np.random.default_rng(3).integers(0, 256, 5 << 20, dtype=np.uint8)
    running = 0
    for part in np.array_split(data, 7):
        running = crc32(part.data, running)
    assert running == zlib.crc32(data.tobytes()) == crc32(data)
    assert crc32(b"123456789") == 0xCBF43926  # the check value of CRC-32/ISO-HDLC
