"""What a map version keeps for the next build: the tiles within a new drive's reach, and
the files of the others carried into a new version (the whole build:
``test_build.py::test_a_new_drive_rewrites_only_the_tiles_it_reaches``)."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from adcloud.hdmap.errors import BuildError, MapFormatError
from adcloud.hdmap.exchange import dump_items
from adcloud.hdmap.geotiff import write_grid_tile, write_preview
from adcloud.hdmap.grid import GridSettings, GridTile
from adcloud.hdmap.kept import (
    TILE_SETTINGS,
    KeptVersion,
    check_tile_layout,
    keys_within,
    tile_settings,
)
from adcloud.hdmap.pcmap import MapCloud, PointCloudMapSettings, write_pointcloud_map


def test_keys_within_reach_are_every_tile_the_square_around_a_point_meets() -> None:
    rng = np.random.default_rng(6)
    xy = rng.uniform(-100.0, 100.0, (40, 2))
    size, reach = 20.0, 31.0
    got = keys_within(xy, size, reach)
    expected = set()
    for kx in range(-10, 10):
        for ky in range(-10, 10):
            x0, y0 = kx * size, ky * size
            meets = (
                (xy[:, 0] + reach >= x0)
                & (xy[:, 0] - reach < x0 + size)
                & (xy[:, 1] + reach >= y0)
                & (xy[:, 1] - reach < y0 + size)
            )
            if meets.any():
                expected.add((kx, ky))
    assert got == expected
    assert keys_within(np.array([[10.0, 10.0]]), 20.0, 5.0) == {(0, 0)}
    assert keys_within(np.zeros((0, 2)), 20.0, 5.0) == frozenset()


def _version(root: Path) -> KeptVersion:
    """A version with two grid tiles and two point-cloud tiles (one without points)."""
    for key in ((0, 0), (3, -2)):
        name = f"{key[0]}_{key[1]}"
        for rel in (f"grid/{name}.tif", f"grid/preview/{name}.png", f"state/tiles/{name}.npz"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(f"{rel} of the old version".encode())
        (root / "state" / "cloud").mkdir(parents=True, exist_ok=True)
        (root / "state" / "cloud" / f"{name}.npz").write_bytes(b"voxel sums")
    clouds = {
        (0, 0): MapCloud((0, 0), np.ones((3, 3)), np.ones(3, np.float32)),
        (3, -2): MapCloud((3, -2), np.zeros((0, 3)), np.zeros(0, np.float32)),
    }
    write_pointcloud_map(clouds, root, PointCloudMapSettings())
    return KeptVersion(root)


def test_carried_tiles_are_copied_with_their_state(tmp_path: Path) -> None:
    kept = _version(tmp_path / "old")
    assert sorted(kept.tile_state()) == [(0, 0), (3, -2)]
    out = tmp_path / "new"
    assert kept.carry_grid([(3, -2)], out) == [(3, -2)]
    copied = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert copied == ["grid/3_-2.tif", "grid/preview/3_-2.png", "state/tiles/3_-2.npz"]
    assert (out / "grid" / "3_-2.tif").read_bytes() == b"grid/3_-2.tif of the old version"
    entries = kept.carry_clouds([(0, 0), (3, -2)], 20.0, out)
    assert entries == [("0_0.pcd", (0.0, 0.0))]  # the empty tile has state and no file
    assert (out / "pointcloud_map" / "0_0.pcd").is_file()
    assert (out / "state" / "cloud" / "3_-2.npz").read_bytes() == b"voxel sums"
    # on one file system the new version shares the old one's files instead of copying them
    for rel in (*copied, "pointcloud_map/0_0.pcd", "state/cloud/3_-2.npz"):
        assert (out / rel).samefile(tmp_path / "old" / rel), rel


def test_carried_tiles_are_copied_where_they_cannot_be_linked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = _version(tmp_path / "old")
    old = tmp_path / "old" / "grid" / "3_-2.tif"
    os.utime(old, (1_000_000_000, 1_000_000_000))

    def other_file_system(source: object, target: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", other_file_system)
    out = tmp_path / "new"
    kept.carry_grid([(3, -2)], out)
    new = out / "grid" / "3_-2.tif"
    assert not new.samefile(old) and new.read_bytes() == old.read_bytes()
    assert new.stat().st_mtime == old.stat().st_mtime  # a copy keeps its time stamps


def test_a_preview_written_over_a_carried_link_leaves_the_old_version_alone(
    tmp_path: Path,
) -> None:
    """Every tile writer writes beside and renames: writing a tile whose file is a link to
    the previous version's gives the new version a new file and the old one keeps its own."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    kept = _version(old_root)
    kept.carry_grid([(0, 0)], new_root)
    layer = np.arange(64, dtype=np.float32).reshape(8, 8)
    count = np.ones((8, 8), np.int32)
    tile = GridTile((0, 0), (0.0, 0.0), 0.05, layer, layer, layer, count, layer, count, layer)
    write_preview(tile, new_root / "grid" / "preview" / "0_0.png")
    write_grid_tile(tile, new_root / "grid" / "0_0.tif", (49.0, 8.4, 0.0))
    dump_items([], new_root / "state" / "tiles" / "0_0.npz")
    for rel in ("grid/preview/0_0.png", "grid/0_0.tif", "state/tiles/0_0.npz"):
        assert (old_root / rel).read_bytes() == f"{rel} of the old version".encode(), rel
        assert not (new_root / rel).samefile(old_root / rel)
    assert (new_root / "grid" / "preview" / "0_0.png").read_bytes().startswith(b"\x89PNG")
    assert not list(new_root.rglob(".*partial*"))


def test_a_damaged_previous_version_is_named(tmp_path: Path) -> None:
    kept = _version(tmp_path / "old")
    (tmp_path / "old" / "grid" / "preview" / "0_0.png").unlink()
    with pytest.raises(MapFormatError, match=r"preview/0_0\.png: missing from the previous"):
        kept.carry_grid([(0, 0)], tmp_path / "new")
    with pytest.raises(MapFormatError, match="point-cloud tiles of 20 m, and this build's are 25"):
        kept.carry_clouds([(0, 0)], 25.0, tmp_path / "new")
    (tmp_path / "old" / "state" / "tiles" / "x_y.npz").write_bytes(b"")
    with pytest.raises(MapFormatError, match=r"x_y\.npz: not a tile file name"):
        kept.tile_state()
    (tmp_path / "old" / "state" / "tiles" / "x_y.npz").unlink()
    # int() reads "2_3" as 23: the file 1_2_3.npz was taken for tile (1, 23)
    (tmp_path / "old" / "state" / "tiles" / "1_2_3.npz").write_bytes(b"")
    with pytest.raises(MapFormatError, match=r"1_2_3\.npz: not a tile file name"):
        kept.tile_state()
    (tmp_path / "old" / "state" / "tiles" / "1_2_3.npz").rename(
        tmp_path / "old" / "state" / "tiles" / "-1_-2.npz"
    )
    assert {(0, 0), (-1, -2)} <= set(kept.tile_state())


def test_tiles_are_carried_only_with_the_settings_they_were_finished_with(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grid, cloud = GridSettings(), PointCloudMapSettings()
    root = tmp_path / "old"
    assert not KeptVersion.of(root, grid, cloud).carry  # written before the record was kept
    (root / "state").mkdir(parents=True)
    (root / TILE_SETTINGS).write_text(json.dumps(tile_settings(grid, cloud)))
    assert KeptVersion.of(root, grid, cloud).carry
    assert not KeptVersion.of(root, grid, cloud, carry=False).carry
    with caplog.at_level(logging.WARNING, logger="adcloud.hdmap.kept"):
        assert not KeptVersion.of(root, dataclasses.replace(grid, max_spread=0.2), cloud).carry
    assert "every tile is merged and written again" in caplog.text
    (root / TILE_SETTINGS).write_text("{")
    with pytest.raises(MapFormatError, match=r"tile_settings\.json: not JSON"):
        KeptVersion.of(root, grid, cloud)


@pytest.mark.parametrize("carry", [True, False])
def test_a_tile_layout_the_kept_tiles_cannot_merge_with_is_refused(
    tmp_path: Path, carry: bool
) -> None:
    """A version keeps sums over its own cells: tiles of another size or resolution cannot
    be merged with them (once every Spark grid task failed on it, after ETL, poses and
    alignment ran), nor made from them. Refused when the previous version is opened,
    naming the map's layout and the build's; other settings only merge every tile again."""
    grid, cloud = GridSettings(), PointCloudMapSettings()
    root = tmp_path / "old"
    (root / "state").mkdir(parents=True)
    (root / TILE_SETTINGS).write_text(json.dumps(tile_settings(grid, cloud)))
    wider = dataclasses.replace(grid, tile_cells=800)  # ADCLOUD_HDMAP_TILE_M=40
    wider_cloud = dataclasses.replace(cloud, tile_size=40.0)
    with pytest.raises(
        BuildError,
        match=r"tile_settings\.json: the map's tiles are laid out with hdmap_grid\.tile_cells "
        r"400 \(this build: 800\), hdmap_cloud\.tile_size 20\.0 \(this build: 40\.0\)\. .* "
        r"build it with its own settings \(hdmap\.resolution 0\.05 m, hdmap\.tile_m 20 m\), or "
        r"build a new map",
    ):
        KeptVersion.of(root, wider, wider_cloud, carry=carry)
    finer = dataclasses.replace(grid, resolution=0.1, tile_cells=200)  # 20 m tiles of 10 cm
    with pytest.raises(BuildError, match=r"hdmap_grid\.resolution 0\.05 \(this build: 0\.1\)"):
        KeptVersion.of(root, finer, cloud, carry=carry)
    with pytest.raises(BuildError, match=r"hdmap_cloud\.voxel_size 0\.1 \(this build: 0\.2\)"):
        check_tile_layout(
            tile_settings(grid, cloud), grid, dataclasses.replace(cloud, voxel_size=0.2), "v1"
        )
    # a filter setting, or the same layout: the tiles merge (and are carried when allowed)
    check_tile_layout(tile_settings(grid, cloud), grid, cloud, "v1")
    loose = dataclasses.replace(grid, max_spread=0.2)
    assert not KeptVersion.of(root, loose, cloud, carry=carry).carry
