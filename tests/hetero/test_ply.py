"""read_ply on the real scan pair and on broken copies of it: errors name the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from adcloud.hetero import HeteroError
from adcloud.hetero._ply import read_ply

from .conftest import SCAN_PAIR


@pytest.fixture
def ply_bytes(shared_data: Path) -> bytes:
    return (shared_data / SCAN_PAIR / "small_gicp_source.ply").read_bytes()


def test_the_real_scan_reads_whole(shared_data: Path) -> None:
    points, names = read_ply(shared_data / SCAN_PAIR / "small_gicp_source.ply")
    assert names == ["x", "y", "z", "scalar_intensity"]
    assert points.shape == (69_792, 4)


def test_a_truncated_file_is_an_error_naming_it(ply_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "cut.ply"
    path.write_bytes(ply_bytes[: len(ply_bytes) // 2])
    with pytest.raises(HeteroError, match=r"cut\.ply: truncated: 69792 vertices"):
        read_ply(path)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (b"element vertex many\nproperty float x\n", "bad vertex element line"),
        (b"element vertex 1\n", "no vertex properties"),
    ],
)
def test_a_bad_header_is_an_error_naming_the_file(
    header: bytes, problem: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.ply"
    path.write_bytes(b"ply\nformat binary_little_endian 1.0\n" + header + b"end_header\n")
    with pytest.raises(HeteroError, match=rf"bad\.ply: {problem}"):
        read_ply(path)
