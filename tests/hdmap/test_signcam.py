"""Sign types from camera images: the face colour read per view, the votes of a whole bag
through Spark, and how votes decide a sign's type."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import SparkSession

from adcloud.hdmap import HdmapSettings, build_map
from adcloud.hdmap.drive import read_drive
from adcloud.hdmap.semantic import read_geojson
from adcloud.hdmap.signcam import (
    CameraIntrinsics,
    SignVote,
    apply_camera_types,
    camera_sign_votes,
    classify_face,
    view_votes,
)
from adcloud.hdmap.signs import SignSettings, TrafficSign
from adcloud.hdmap.trajectory import Trajectory
from adcloud.synth import DriveConfig, DriveResult, World, build_world, generate_drive, read_poses
from adcloud.synth.camera import CameraModel
from adcloud.synth.world import SIGN_TYPES
from tests.camera_poses import FixedPose, looking_at

SETTINGS = SignSettings()


@pytest.fixture(scope="module")
def world() -> World:
    return build_world(7)


def _truth_signs(world: World) -> list[TrafficSign]:
    """The world's plates as the LiDAR stage reports them: square plates have the five
    square types as candidates and no type; the tall one is typed by its size."""
    out = []
    for k, s in enumerate(world.signs):
        kind = SIGN_TYPES[int(s[6])]
        square = kind != "speed_limit_50"
        candidates = tuple(t for t in SIGN_TYPES if t != "speed_limit_50") if square else (kind,)
        out.append(
            TrafficSign(
                s[:3],
                float(s[3]),
                float(s[4]),
                float(s[5]),
                type="unknown" if square else kind,
                candidates=candidates,
                id=f"sign-{k}",
            )
        )
    return out


def test_a_view_of_a_plate_votes_for_the_type_of_its_face_and_a_view_of_its_back_does_not(
    world: World,
) -> None:
    camera = CameraModel.from_config(DriveConfig())
    intrinsics = CameraIntrinsics(
        camera.width, camera.height, camera.fx, camera.fy, camera.cx, camera.cy, "camera_optical"
    )
    signs = _truth_signs(world)
    arrays = (
        np.array([s.position for s in signs]),
        np.array([[np.cos(s.facing_yaw), np.sin(s.facing_yaw), 0.0] for s in signs]),
        np.array([[s.width_m, s.height_m] for s in signs]),
    )
    right = wrong = 0
    for sign, row in zip(signs, world.signs, strict=True):
        normal = np.array([np.cos(sign.facing_yaw), np.sin(sign.facing_yaw), 0.0])
        for side in (1.0, -1.0):
            eye = sign.position + side * 8.0 * normal - np.array([0.0, 0.0, 0.8])
            pose = looking_at(eye, sign.position)
            rgb, _ = camera.render(world, FixedPose(pose), 0.0, np.random.default_rng(1))
            votes = [
                v
                for v in view_votes(rgb, 0, pose, intrinsics, arrays, SETTINGS)
                if np.allclose([v.x, v.y], sign.position[:2])
            ]
            if side < 0:
                assert votes == [], "the back of a plate voted"
                continue
            for vote in votes:
                if vote.type == SIGN_TYPES[int(row[6])]:
                    right += 1
                else:
                    wrong += 1
    assert wrong == 0
    assert right >= 0.6 * len(signs)


def test_a_colour_no_face_has_gives_no_type() -> None:
    assert classify_face([200, 30, 30], SETTINGS) == "stop"
    assert classify_face([30, 160, 40], SETTINGS) == "pedestrian_crossing"
    assert classify_face([120, 120, 120], SETTINGS) is None  # a grey back
    assert classify_face([0, 0, 0], SETTINGS) is None


def _vote(sign: TrafficSign, kind: str, offset: float = 0.0) -> SignVote:
    x, y, z = sign.position
    return SignVote(x + offset, y, z, kind, 9, 0)


def test_votes_decide_a_type_only_when_enough_views_agree_and_the_size_fits() -> None:
    square = ("stop", "yield", "no_parking")
    a, b, c, d, e = (
        TrafficSign(np.array([10.0 * k, 0.0, 2.0]), 0.0, 0.75, 0.75, candidates=square)
        for k in range(5)
    )
    tall = TrafficSign(np.array([60.0, 0.0, 2.0]), 0.0, 0.6, 0.8, "speed_limit_50")
    tall = TrafficSign(tall.position, 0.0, 0.6, 0.8, type="speed_limit_50", candidates=(tall.type,))
    votes = [
        *(_vote(a, "yield") for _ in range(3)),  # three views agree
        _vote(a, "stop"),
        _vote(b, "stop"),  # one view is not enough
        *(_vote(c, "stop") for _ in range(2)),  # two against two: no majority
        *(_vote(c, "no_parking") for _ in range(2)),
        *(_vote(d, "speed_limit_30") for _ in range(4)),  # the size rules it out
        *(_vote(e, "stop", offset=2.0) for _ in range(4)),  # too far from the plate
        *(_vote(tall, "stop") for _ in range(3)),  # a car in front of the plate
    ]
    out = apply_camera_types([a, b, c, d, e, tall], votes, SETTINGS)
    assert [s.type for s in out] == [
        "yield",
        "unknown",
        "unknown",
        "unknown",
        "unknown",
        "speed_limit_50",
    ]
    assert out[0].candidates == ("yield",)
    assert out[0].attributes == {"type_from": "camera", "camera_views": 4}
    assert apply_camera_types([a], [], SETTINGS) == [a]


#: 30 s of the seed-7 world with the camera on: the drive sees the faces of two plates (a
#: pedestrian crossing and the tall speed limit) and the backs of others.
CAMERA_DRIVE = DriveConfig(
    seconds=30, seed=7, lidar_beams=16, lidar_columns=512, truth_raster=False
)


@pytest.fixture(scope="module")
def camera_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    return generate_drive(CAMERA_DRIVE, tmp_path_factory.mktemp("cam") / "cam.bag")


@pytest.mark.spark
def test_the_camera_images_of_a_bag_type_the_signs_the_drive_passes(
    spark: SparkSession,
    camera_drive: DriveResult,
    world: World,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri = str(camera_drive.bag)
    drive = read_drive(uri, with_scans=False)
    t, xyz, quat = read_poses(camera_drive.truth)
    trajectory = Trajectory.from_xyz_quat(t, xyz, quat)
    signs = _truth_signs(world)
    votes = camera_sign_votes(
        spark, {"cam": (uri, drive.extrinsics)}, {"cam": trajectory}, signs, SETTINGS
    )
    assert votes, "no camera view of any sign"
    typed = apply_camera_types(signs, votes, SETTINGS)
    by_camera = [
        (s.type, SIGN_TYPES[int(row[6])])
        for s, row in zip(typed, world.signs, strict=True)
        if s.attributes.get("type_from") == "camera"
    ]
    assert len(by_camera) >= 2
    assert all(got == truth for got, truth in by_camera), by_camera
    # A bag without the camera topics, or with another type on them, gives no votes (the
    # map is still built, typed by LiDAR); the wrong type is reported with what to set.
    caplog.set_level(logging.INFO, logger="adcloud.hdmap.signcam")
    for settings, said in (
        (SignSettings(camera_info_topic="/no/such/topic"), "no /no/such/topic"),
        (SignSettings(camera_topic="/imu/data"), "/imu/data carries sensor_msgs/msg/Imu"),
    ):
        caplog.clear()
        cameras = {"cam": (uri, drive.extrinsics)}
        assert camera_sign_votes(spark, cameras, {"cam": trajectory}, signs, settings) == []
        assert said in caplog.text


@pytest.mark.spark
def test_a_map_build_types_signs_from_the_camera_and_later_builds_keep_the_votes(
    spark: SparkSession, camera_drive: DriveResult, world: World, tmp_path: Path
) -> None:
    lat, lon, alt = CAMERA_DRIVE.gps_origin  # the truth's frame: map signs sit on true ones
    settings = HdmapSettings(origin_lat=lat, origin_lon=lon, origin_alt=alt)
    map_uri = str(tmp_path / "map")
    first = build_map(spark, str(camera_drive.bag), map_uri, settings)
    v1 = first.result.version
    assert v1 is not None and v1.path is not None
    votes = json.loads((v1.path / "state" / "sign_votes.json").read_text())["votes"]
    assert votes

    def camera_typed(root: Path) -> dict[str, str]:
        """Each camera-typed sign of the published map: its type and the true one there."""
        out = {}
        for sign in read_geojson(root / "semantic.geojson").signs:
            if sign.attributes.get("type_from") != "camera":
                continue
            d = np.linalg.norm(world.signs[:, :2] - sign.position[:2], axis=1)
            assert d.min() < 1.0, sign.position
            out[sign.type] = SIGN_TYPES[int(world.signs[int(np.argmin(d)), 6])]
        return out

    typed = camera_typed(v1.path)
    assert "pedestrian_crossing" in typed, typed  # a square plate: LiDAR cannot type it
    assert all(got == truth for got, truth in typed.items()), typed
    assert first.counts["signs_typed_by_camera"] == len(typed)
    # A later build adds a drive without a camera: the signs keep the types the first
    # drive's images gave, from the votes kept in the map.
    later = DriveConfig(
        seconds=8, seed=7, lidar_beams=16, lidar_columns=512, camera=False, truth_raster=False
    )
    second = generate_drive(later, tmp_path / "second.bag")
    v2 = build_map(spark, [str(camera_drive.bag), str(second.bag)], map_uri, settings)
    assert v2.counts["drives_new"] == 1
    root = v2.result.version.path if v2.result.version else None
    assert root is not None
    assert json.loads((root / "state" / "sign_votes.json").read_text())["votes"] == votes
    assert camera_typed(root) == typed


def test_unreadable_kept_votes_are_reported_with_the_file(tmp_path: Path) -> None:
    from adcloud.hdmap.build import _load_votes  # noqa: PLC0415
    from adcloud.hdmap.errors import HdmapError  # noqa: PLC0415

    path = tmp_path / "sign_votes.json"
    assert _load_votes(path) == []  # a version written before votes were kept
    path.write_text('{"votes": [[1.0, 2.0]]}')  # a row cut short
    with pytest.raises(HdmapError, match=f"{path}: unreadable sign votes .*delete the file"):
        _load_votes(path)
    path.write_text("{not json")
    with pytest.raises(HdmapError, match="unreadable sign votes"):
        _load_votes(path)
