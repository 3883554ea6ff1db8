"""Grid tile GeoTIFFs written by hand-made tiles: the GeoKey directory as GeoTIFF 1.1 wants
it, the nodata value, and no torn file left where a write fails."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import tifffile

from adcloud.hdmap.errors import MapFormatError
from adcloud.hdmap.geotiff import read_grid_tile, write_grid_tile, write_preview
from adcloud.hdmap.grid import GridTile

ORIGIN = (48.1, 11.5, 520.0)
N = 40


def _tile(key: tuple[int, int]) -> GridTile:
    z = np.full((N, N), np.nan, np.float32)
    z[: N // 2] = np.linspace(0.0, 1.0, N, dtype=np.float32)
    seen = np.isfinite(z)
    return GridTile(
        key=key,
        origin=(key[0] * 2.0, key[1] * 2.0),
        resolution=0.05,
        elevation_mean=z,
        elevation_min=z,
        elevation_max=z,
        count=seen.astype(np.int32) * 4,
        reflectance_mean=np.where(seen, 0.2, np.nan).astype(np.float32),
        scans=seen.astype(np.int32),
        obstacle_top=np.full((N, N), np.nan, np.float32),
    )


def test_geokeys_nodata_and_north_up_rows(tmp_path: Path) -> None:
    tile = _tile((-3, 7))
    path = write_grid_tile(tile, tmp_path, ORIGIN)
    assert path.name == "-3_7.tif"
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        directory = list(page.tags[34735].value)
        nodata = page.tags[42113].value
        tie = page.tags[33922].value
        data = page.asarray()
    # header: version 1, revision 1.1, then the keys in ascending order (GeoTIFF 1.1, 7.1.3)
    assert directory[:3] == [1, 1, 1]
    keys = [directory[4 + 4 * k] for k in range(directory[3])]
    assert keys == sorted(keys) and len(keys) == len(set(keys))
    assert float(nodata) != float(nodata)  # "nan"
    # pixel (0, 0) is the north-west corner; row 0 the northern edge
    assert tie[:3] == (0.0, 0.0, 0.0) and tie[3:5] == (-6.0, 14.0 + N * 0.05)
    np.testing.assert_array_equal(data[0], np.flipud(tile.elevation_mean))
    back = read_grid_tile(path)
    assert back.origin == ORIGIN and back.tile.key == (-3, 7)
    np.testing.assert_allclose(back.tile.origin, tile.origin)
    np.testing.assert_array_equal(back.tile.elevation_mean, tile.elevation_mean)
    np.testing.assert_array_equal(back.tile.count, tile.count)


def test_a_failed_write_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tile or preview whose write fails half way (a full disk) left its hidden
    ``.<name>.partial`` file beside the finished ones, for ever."""
    tile = _tile((0, 0))
    write_grid_tile(tile, tmp_path / "0_0.tif", ORIGIN)
    before = (tmp_path / "0_0.tif").read_bytes()

    def full(self: tifffile.TiffWriter, *args: object, **kwargs: object) -> None:
        self._fh.write(b"II*\x00half a tile")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tifffile.TiffWriter, "write", full)
    with pytest.raises(OSError, match="No space"):
        write_grid_tile(tile, tmp_path / "0_0.tif", ORIGIN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0_0.tif"]
    assert (tmp_path / "0_0.tif").read_bytes() == before
    monkeypatch.undo()

    import matplotlib.image  # noqa: PLC0415

    def broken(fname: str, *args: object, **kwargs: object) -> None:
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.image, "imsave", broken)
    with pytest.raises(OSError, match="No space"):
        write_preview(tile, tmp_path / "preview" / "0_0.png")
    assert list((tmp_path / "preview").iterdir()) == []


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (b'"TILE_X">-3<', b'"TILE_X">x3<', "metadata item TILE_X is 'x3', not a int"),
        (b'"TILE_X">-3<', b'"TILE_Q">-3<', "metadata has no TILE_X"),
        (b'"ADCLOUD_VERSION">1<', b'"ADCLOUD_VERSION">?<', "item ADCLOUD_VERSION is '?'"),
    ],
)
def test_damaged_tile_metadata_is_named(tmp_path: Path, old: bytes, new: bytes, said: str) -> None:
    """A tile whose GDAL metadata was damaged raised a bare ValueError or KeyError
    ('TILE_X'), naming neither the file nor what is wrong with it."""
    path = write_grid_tile(_tile((-3, 7)), tmp_path, ORIGIN)
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    with pytest.raises(MapFormatError, match=said) as err:
        read_grid_tile(path)
    assert str(err.value).startswith(f"{path}: ")
