"""NumPy views of decoded PointCloud2 and Image messages, and decoding bags in-process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from adcloud.binpipe import BinpipeError, image_array, pointcloud_array, read_messages
from adcloud.synth import DriveConfig, generate_drive


def _field(name: str, offset: int, datatype: int, count: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, offset=offset, datatype=datatype, count=count)


def _cloud(points: np.ndarray, *, height: int = 1, pad: int = 0) -> SimpleNamespace:
    """A PointCloud2-shaped object: float32 x, y at 0/4, uint16 label at 12, 16-byte points."""
    n = len(points)
    width = n // height
    raw = np.zeros((n, 16), np.uint8)
    raw[:, 0:8] = points[:, :2].astype("<f4").view(np.uint8).reshape(n, 8)
    raw[:, 12:14] = points[:, 2].astype("<u2").view(np.uint8).reshape(n, 2)
    rows = raw.reshape(height, width * 16)
    data = np.concatenate([rows, np.zeros((height, pad), np.uint8)], axis=1).tobytes()
    return SimpleNamespace(
        fields=[_field("x", 0, 7), _field("y", 4, 7), _field("label", 12, 4)],
        point_step=16,
        row_step=width * 16 + pad,
        width=width,
        height=height,
        is_bigendian=False,
        data=data,
    )


def test_points_decode_by_their_declared_layout() -> None:
    pts = np.array([[1.5, -2.0, 3], [0.25, 4.0, 7], [9.0, 8.0, 1], [-1.0, -1.0, 2]])
    flat = pointcloud_array(_cloud(pts), topic="/p", require=["x", "label"])
    np.testing.assert_array_equal(flat["x"], pts[:, 0].astype(np.float32))
    np.testing.assert_array_equal(flat["label"], pts[:, 2].astype(np.uint16))
    organized = pointcloud_array(_cloud(pts, height=2, pad=5), topic="/p")
    np.testing.assert_array_equal(organized["y"], pts[:, 1].astype(np.float32))


def test_bad_clouds_name_the_topic_and_field() -> None:
    pts = np.zeros((4, 3))
    with pytest.raises(BinpipeError, match=r"/p: PointCloud2 has no field 'z'"):
        pointcloud_array(_cloud(pts), topic="/p", require=["x", "z"])
    short = _cloud(pts)
    short.data = short.data[:40]
    with pytest.raises(BinpipeError, match=r"/p: PointCloud2 field 'data' holds 40 bytes"):
        pointcloud_array(short, topic="/p")
    with pytest.raises(BinpipeError, match=r"/p: expected sensor_msgs/PointCloud2"):
        pointcloud_array(SimpleNamespace(), topic="/p")


def test_images_skip_row_padding_and_check_sizes() -> None:
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    data = np.concatenate([pixels.reshape(2, 9), np.zeros((2, 3), np.uint8)], axis=1).tobytes()
    msg = SimpleNamespace(encoding="rgb8", height=2, width=3, step=12, is_bigendian=0, data=data)
    np.testing.assert_array_equal(image_array(msg, topic="/c"), pixels)
    msg.step = 5
    with pytest.raises(BinpipeError, match=r"/c: Image field 'step' \(5\)"):
        image_array(msg, topic="/c")
    msg.step, msg.encoding = 12, "yuv422"
    with pytest.raises(BinpipeError, match="encoding 'yuv422'"):
        image_array(msg, topic="/c")


def test_read_messages_decodes_a_bag_in_file_order(tmp_path: Path) -> None:
    cfg = DriveConfig(
        seconds=1, seed=2, lidar_beams=16, lidar_columns=128, camera=True, truth_raster=False
    )
    bag = generate_drive(cfg, tmp_path / "d.bag").bag
    items = list(read_messages(str(bag), topics=["/lidar/points", "/camera/labels"]))
    assert {m.topic for m, _ in items} == {"/lidar/points", "/camera/labels"}
    times = [m.timestamp for m, _ in items]
    assert times == sorted(times)
    cloud = next(d for m, d in items if m.topic == "/lidar/points")
    points = pointcloud_array(cloud, topic="/lidar/points", require=["x", "t", "label"])
    assert len(points) == cloud.width * cloud.height > 100
    labels = next(d for m, d in items if m.topic == "/camera/labels")
    assert image_array(labels, topic="/camera/labels").shape == (
        cfg.camera_height,
        cfg.camera_width,
    )


def test_damaged_cloud_layouts_name_the_field_at_fault() -> None:
    """A row_step shorter than a row was reported as 'data' being too short (it was not),
    and a point_step of 0 with no fields failed in NumPy ("When changing to a smaller
    dtype ...") instead of naming the cloud."""
    cloud = _cloud(np.zeros((4, 3)), height=2)
    cloud.row_step = 16
    with pytest.raises(BinpipeError, match=r"/p: PointCloud2 field 'row_step' \(16\) is less"):
        pointcloud_array(cloud, topic="/p")
    cloud = _cloud(np.zeros((4, 3)))
    cloud.fields, cloud.point_step, cloud.row_step = [], 0, 0
    with pytest.raises(BinpipeError, match=r"/p: PointCloud2 field 'point_step' is 0"):
        pointcloud_array(cloud, topic="/p")
