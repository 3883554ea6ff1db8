"""The truth directory: poses, map, raster, metadata."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adcloud.synth import (
    DriveConfig,
    DriveResult,
    Label,
    SynthError,
    World,
    generate_drive,
    read_map,
    read_poses,
    read_raster,
)
from adcloud.synth.gnss import enu_to_geodetic, geodetic_to_enu
from adcloud.synth.world import SIGN_TYPES
from tests.synth.conftest import SMALL

Reader = Callable[..., list[tuple[str, int, Any]]]


def test_truth_directory_contents(small_drive: DriveResult) -> None:
    names = {p.name for p in small_drive.truth.iterdir()}
    assert names == {
        "poses.txt",
        "map.geojson",
        "raster.npz",
        "world.json",
        "config.json",
        "imu_bias.csv",
        "odom_scale.csv",
        "gps.csv",
    }
    meta = json.loads((small_drive.truth / "world.json").read_text())
    assert meta["version"] == 1
    assert meta["seed"] == SMALL.seed
    assert meta["origin"] == {
        "latitude_deg": 37.3875,
        "longitude_deg": -122.0575,
        "height_m": 12.0,
        "datum": "WGS84",
    }
    assert meta["labels"]["lane_marking"] == Label.LANE_MARKING
    assert meta["messages"] == small_drive.messages
    assert meta["frames"]["lidar"]["parent"] == "base_link"


def test_poses_file_matches_the_ground_truth_topic(
    small_drive: DriveResult, read_bag: Reader
) -> None:
    t, xyz, quat = read_poses(small_drive.truth)
    msgs = read_bag(small_drive.bag, ["/ground_truth/odom"])
    assert len(msgs) == len(t) == SMALL.seconds * SMALL.truth_hz
    np.testing.assert_array_equal(t, [m[1] for m in msgs])
    bag_xyz = np.array(
        [[m.pose.pose.position.x, m.pose.pose.position.y, m.pose.pose.position.z] for *_, m in msgs]
    )
    bag_q = np.array(
        [
            [
                m.pose.pose.orientation.x,
                m.pose.pose.orientation.y,
                m.pose.pose.orientation.z,
                m.pose.pose.orientation.w,
            ]
            for *_, m in msgs
        ]
    )
    np.testing.assert_allclose(xyz, bag_xyz, atol=1e-6)
    np.testing.assert_allclose(quat, bag_q, atol=1e-8)
    np.testing.assert_allclose(np.linalg.norm(quat, axis=1), 1, atol=1e-8)


def test_map_has_lanes_of_both_types_signs_and_poles(
    small_drive: DriveResult, world: World
) -> None:
    data = read_map(small_drive.truth)
    assert data["type"] == "FeatureCollection"
    assert data["adcloud:frame"] == "map"
    kinds: dict[str, list[dict[str, Any]]] = {}
    for f in data["features"]:
        kinds.setdefault(f["properties"]["kind"], []).append(f)
    marks = kinds["lane_marking"]
    assert {m["properties"]["type"] for m in marks} == {"solid", "dashed"}
    assert all(m["geometry"]["type"] == "LineString" for m in marks)
    assert {"lane_centerline", "reference_line", "curb", "traffic_sign", "pole"} <= set(kinds)
    signs = kinds["traffic_sign"]
    assert len(signs) == len(world.signs)
    assert {s["properties"]["type"] for s in signs} <= set(SIGN_TYPES)
    assert all(1.9 < s["properties"]["height_m"] < 2.7 for s in signs)
    # every solid-line vertex is painted in the world (and the LiDAR sees it so)
    solid = np.array(
        [
            c
            for m in marks
            if m["properties"]["type"] == "solid"
            for c in m["geometry"]["coordinates"]
        ]
    )
    labels = world.ground_surface(solid[:, 0], solid[:, 1]).label
    assert (labels == Label.LANE_MARKING).mean() > 0.99
    np.testing.assert_allclose(
        solid[:, 2], world.terrain.height(solid[:, 0], solid[:, 1]), atol=1e-3
    )
    # dashed vertices are painted on 3 m of every 9 m
    dashed = np.array(
        [
            c
            for m in marks
            if m["properties"]["type"] == "dashed"
            for c in m["geometry"]["coordinates"]
        ]
    )
    frac = (world.ground_surface(dashed[:, 0], dashed[:, 1]).label == Label.LANE_MARKING).mean()
    assert frac == pytest.approx(1 / 3, abs=0.03)


def test_raster_is_a_5cm_grid_of_the_true_ground(small_drive: DriveResult, world: World) -> None:
    raster = read_raster(small_drive.truth)
    assert raster.resolution == 0.05
    assert raster.elevation.dtype == np.float32
    with np.load(small_drive.truth / "raster.npz", allow_pickle=False) as z:
        assert set(z.files) == {
            "elevation",
            "reflectance",
            "label",
            "origin",
            "resolution",
            "version",
        }
    # it covers the route with the margin
    _, xyz, _ = read_poses(small_drive.truth)
    x, y = raster.cell_centres()
    assert x[0] <= xyz[:, 0].min() - SMALL.truth_margin_m + 0.05
    assert y[-1] >= xyz[:, 1].max() + SMALL.truth_margin_m - 0.05
    rng = np.random.default_rng(0)
    i = rng.integers(0, len(y), 3000)
    j = rng.integers(0, len(x), 3000)
    sample = world.ground_surface(x[j], y[i])
    np.testing.assert_allclose(raster.elevation[i, j], sample.height, atol=1e-4)
    np.testing.assert_array_equal(raster.label[i, j], sample.label)
    np.testing.assert_allclose(raster.reflectance[i, j], sample.reflectance, atol=1 / 255)
    # elevation really varies and paint is bright in it
    assert raster.elevation.max() - raster.elevation.min() > 0.5
    paint = raster.reflectance[raster.label == Label.LANE_MARKING]
    road = raster.reflectance[raster.label == Label.ROAD]
    assert paint.min() > road.max()


def test_geodetic_round_trip() -> None:
    rng = np.random.default_rng(1)
    enu = rng.uniform(-5000, 5000, (100, 3))
    lat, lon, h = enu_to_geodetic(enu, SMALL.gps_origin)
    np.testing.assert_allclose(geodetic_to_enu(lat, lon, h, SMALL.gps_origin), enu, atol=1e-6)
    lat0, lon0, h0 = enu_to_geodetic(np.zeros((1, 3)), SMALL.gps_origin)
    assert (float(lat0[0]), float(lon0[0]), float(h0[0])) == pytest.approx(
        SMALL.gps_origin, abs=1e-9
    )
    # 1 km north is 1/111.0 degrees of latitude here
    lat1, _, _ = enu_to_geodetic(np.array([[0.0, 1000.0, 0.0]]), SMALL.gps_origin)
    assert float(lat1[0]) - SMALL.gps_origin[0] == pytest.approx(1000 / 110_990, rel=2e-3)


_KILLED = """
import sys
from adcloud.synth import DriveConfig, generate_drive
generate_drive(DriveConfig(seconds=600, lidar_beams=16, camera=False), sys.argv[1])
"""


def test_the_truth_of_a_killed_drive_is_not_read_as_whole(tmp_path: Path) -> None:
    """``kill -9`` mid-drive leaves poses.txt cut anywhere (possibly inside a number) and
    no map or world.json; the readers said nothing and returned the cut trajectory."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path / "cut.bag")])
    try:
        deadline = time.monotonic() + 120
        while True:  # the run writes its drive in a staging directory beside its name
            poses = list(tmp_path.glob(".cut.bag.part-*/cut.bag.truth/poses.txt"))
            if poses and poses[0].stat().st_size > 0:
                break
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "cut.bag.truth").exists()  # nothing under the drive's name
    truth = poses[0].parent
    for read in (read_poses, read_map, read_raster):
        with pytest.raises(SynthError, match=r"cut\.bag\.truth is an incomplete truth directory"):
            read(truth)


def test_curbs_stop_at_a_crossing_roads_carriageway(world: World) -> None:
    """docs/synth-truth-format.md section 4: curbs are cut where another road's carriageway
    crosses: no curb vertex lies inside it, and no curb stubs are left in intersections (the
    cut measured, inside the crossing road, the way back to the curb's own road: 4.0 m, right
    at the limit, so rounding kept stubs)."""
    from adcloud.synth.roads import PAVED_HALF_WIDTH_M  # noqa: PLC0415
    from adcloud.synth.truth import map_geojson  # noqa: PLC0415

    roads = world.roads
    curbs = [
        f
        for f in map_geojson(world, DriveConfig(seed=7))["features"]
        if f["properties"]["kind"] == "curb"
    ]
    assert curbs
    for feature in curbs:
        road = feature["properties"]["road"]
        xy = np.array(feature["geometry"]["coordinates"])[:, :2]
        assert len(xy) > 10, f"a {len(xy)}-vertex curb stub on road {road}: {xy.tolist()}"
        for other in range(roads.road_count):
            if other == road:
                continue
            ox, oy, _ = roads.point_at(other, np.linspace(0, roads.lengths[other], 8000))
            d = np.hypot(xy[:, :1] - ox[None], xy[:, 1:] - oy[None]).min(axis=1)
            assert d.min() > PAVED_HALF_WIDTH_M - 0.05, (road, xy[d.argmin()].tolist(), d.min())


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ("1704067200.010000000 1.0 2.0 3.0 0 0 0\n", "a value missing"),
        ("1704067200.010000000 1.0 2.0 3.0 0 0 0 1 9\n", "a value too many"),
        ("1.704067200e9 1.0 2.0 3.0 0 0 0 1\n", "a time in exponent form"),
        ("1704067200.01 1.0 two 3.0 0 0 0 1\n", "a word for a number"),
    ],
)
def test_a_bad_pose_row_is_named_by_its_line(
    small_drive: DriveResult, tmp_path: Path, row: str, why: str
) -> None:
    """A poses.txt row of the wrong shape failed with NumPy's "cannot reshape array of size
    ..." or Python's "invalid literal for int()", naming no file and no line ({why})."""
    truth = tmp_path / "edited.bag.truth"
    truth.mkdir()
    (truth / "world.json").write_bytes((small_drive.truth / "world.json").read_bytes())
    lines = (small_drive.truth / "poses.txt").read_text().splitlines(keepends=True)
    (truth / "poses.txt").write_text("".join([*lines[:3], row, *lines[3:6]]))
    assert len(read_poses(small_drive.truth)[0]) > 5  # the drive's own file reads
    with pytest.raises(SynthError, match=r"poses\.txt:4: not a pose row") as info:
        read_poses(truth)
    assert row.split()[1] in str(info.value), why


def test_the_raster_covers_the_whole_route_at_a_low_truth_rate(tmp_path: Path) -> None:
    """The raster's bounds came from the poses at ``truth_hz`` only: at 1 Hz a 0.9 s drive
    had one pose, and the raster (1 m margin) missed the 7 m the car drove after it."""
    config = DriveConfig(
        seconds=0.9,
        seed=4,
        lidar=False,
        camera=False,
        truth_hz=1,
        gps_hz=10,
        gps_noise_m=0,
        gps_bias_m=0,
        truth_margin_m=1.0,
        truth_raster_res_m=0.1,
    )
    result = generate_drive(config, tmp_path / "slow.bag")
    assert len(read_poses(result.truth)[0]) == 1
    raster = read_raster(result.truth)
    rows = np.loadtxt(result.truth / "gps.csv", delimiter=",", skiprows=1)
    antenna = rows[:, 2:4]  # true_e, true_n: the antenna above base_link, all along the route
    assert np.ptp(antenna[:, 0]) + np.ptp(antenna[:, 1]) > 4.0  # the car moved
    h, w = raster.elevation.shape
    x0, y0 = raster.origin
    inside = (
        (antenna[:, 0] >= x0)
        & (antenna[:, 0] <= x0 + w * raster.resolution)
        & (antenna[:, 1] >= y0)
        & (antenna[:, 1] <= y0 + h * raster.resolution)
    )
    assert inside.all(), antenna[~inside]


def test_reading_the_raster_of_a_drive_without_one_says_why_it_is_missing(
    tmp_path: Path,
) -> None:
    """``truth_raster=False`` writes no raster.npz; ``read_raster`` raised a bare
    FileNotFoundError, as if the drive were damaged."""
    config = DriveConfig(seconds=0.3, lidar=False, camera=False, truth_raster=False)
    result = generate_drive(config, tmp_path / "plain.bag")
    assert len(read_poses(result.truth)[0]) == 30
    with pytest.raises(SynthError, match=r"plain\.bag\.truth has no raster\.npz: .*--no-raster"):
        read_raster(result.truth)
