"""Map evaluation: metric functions on hand-made cases with known answers, and whole maps
against a real synthetic truth directory."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from scipy.spatial import cKDTree
from scipy.spatial.transform import Rotation

from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.evaluate import (
    EvalSettings,
    GridLayers,
    MapProducts,
    Metric,
    apply_alignment,
    elevation_errors,
    elevation_rmse,
    evaluate_map,
    features_from_geojson,
    load_map_products,
    load_truth,
    painted_marking_polylines,
    polyline_metrics,
    read_grid_tiles,
    sign_metrics,
)
from adcloud.hdmap.geotiff import write_grid_tile
from adcloud.hdmap.grid import GridTile
from adcloud.hdmap.mapdir import Manifest, MapDir
from adcloud.hdmap.trajectory import Trajectory
from adcloud.synth import DriveConfig, Raster, generate_drive

# --------------------------------------------------------------------------- polylines


def line(x0: float, x1: float, y: float = 0.0, n: int = 2) -> np.ndarray:
    xs = np.linspace(x0, x1, n)
    return np.column_stack([xs, np.full(n, y)])


def test_polyline_shifted_by_5cm_gives_5cm_and_full_recovery() -> None:
    m = polyline_metrics([line(0, 10, 0.05)], [line(0, 10)])
    assert m.mean_distance_m == pytest.approx(0.05, abs=1e-9)
    assert m.recovered_fraction == pytest.approx(1.0, abs=1e-9)
    assert m.truth_length_m == pytest.approx(10.0)
    assert m.false_length_m == 0.0


def test_polyline_half_missing_gives_half_recovered() -> None:
    m = polyline_metrics([line(0, 5)], [line(0, 10)])
    assert m.recovered_fraction == pytest.approx(0.5, abs=1e-9)
    assert m.mean_distance_m == pytest.approx(0.0, abs=1e-12)


def test_polyline_distance_is_exact_between_sparse_vertices() -> None:
    # a true line with vertices 10 m apart: sampling it would overestimate the distance
    truth = [np.array([[0.0, 0.0], [10.0, 0.0], [20.0, 0.0]])]
    est = [np.array([[3.0, 0.07], [7.0, 0.07]])]
    m = polyline_metrics(est, truth)
    assert m.mean_distance_m == pytest.approx(0.07, abs=1e-9)
    assert m.recovered_fraction == pytest.approx(4.0 / 20.0, abs=1e-9)


def test_polyline_far_detection_is_false_not_distance() -> None:
    est = [line(0, 10, 0.02), line(0, 4, 3.0)]  # the second is 3 m away from any truth
    m = polyline_metrics(est, [line(0, 10)], gate=1.0)
    assert m.mean_distance_m == pytest.approx(0.02, abs=1e-9)
    assert m.false_length_m == pytest.approx(4.0, abs=1e-9)
    assert m.estimate_length_m == pytest.approx(14.0, abs=1e-9)


def test_polyline_beyond_match_radius_recovers_nothing() -> None:
    m = polyline_metrics([line(0, 10, 0.5)], [line(0, 10)], match_radius=0.3, gate=1.0)
    assert m.recovered_fraction == 0.0
    assert m.mean_distance_m == pytest.approx(0.5)


def test_polyline_recovery_on_a_curve_and_two_lines() -> None:
    theta = np.linspace(0, np.pi / 2, 200)
    arc = np.column_stack([20 * np.cos(theta), 20 * np.sin(theta)])
    inner = np.column_stack([19.96 * np.cos(theta), 19.96 * np.sin(theta)])  # 4 cm inside
    straight = line(100, 110)
    m = polyline_metrics([inner], [arc, straight])
    assert m.mean_distance_m == pytest.approx(0.04, abs=2e-4)  # chord error of the arc
    arc_len = 20 * np.pi / 2
    assert m.recovered_fraction == pytest.approx(arc_len / (arc_len + 10), abs=2e-3)


def test_polyline_empty_cases() -> None:
    m = polyline_metrics([], [line(0, 10)])
    assert m.recovered_fraction == 0.0 and math.isnan(m.mean_distance_m)
    m = polyline_metrics([line(0, 1)], [])
    assert math.isnan(m.recovered_fraction) and m.false_length_m == pytest.approx(1.0)


# --------------------------------------------------------------------------- signs


def test_sign_metrics_counts_one_to_one_matches() -> None:
    truth = np.array([[0.0, 0.0, 2.0], [10.0, 0.0, 2.0], [20.0, 0.0, 2.0], [30.0, 0, 2.0]])
    est = np.array(
        [
            [0.1, 0.0, 2.0],  # match 10 cm
            [0.15, 0.1, 2.0],  # a second detection of the same sign: not a second match
            [10.0, 0.2, 2.1],  # match, sqrt(0.05) = 22 cm
            [20.5, 0.0, 2.0],  # 50 cm: too far
        ]
    )
    m = sign_metrics(est, truth, radius=0.3)
    assert m.matched == 2
    assert m.recall == pytest.approx(2 / 4)
    assert m.precision == pytest.approx(2 / 4)
    assert m.mean_error_m == pytest.approx((0.1 + math.sqrt(0.05)) / 2)


def test_sign_metrics_assignment_maximises_matches() -> None:
    # greedy nearest-first would pair est[0] with truth[1] and leave truth[0] unmatched
    truth = np.array([[0.0, 0.0], [0.25, 0.0]])
    est = np.array([[0.2, 0.0], [0.45, 0.0]])
    m = sign_metrics(est, truth, radius=0.3)
    assert m.matched == 2 and m.recall == 1.0 and m.precision == 1.0


def test_sign_metrics_types_and_empty() -> None:
    truth = np.array([[0.0, 0.0], [5.0, 0.0]])
    m = sign_metrics(
        truth + 0.01, truth, estimate_types=["stop", "yield"], truth_types=["stop", "stop"]
    )
    assert m.type_accuracy == pytest.approx(0.5)
    empty = sign_metrics(np.zeros((0, 2)), truth)
    assert empty.recall == 0.0 and math.isnan(empty.precision)
    with pytest.raises(HdmapError, match="dimension"):
        sign_metrics(np.zeros((1, 3)), truth)


# --------------------------------------------------------------------------- elevation


def plane_raster(slope: float = 0.1) -> Raster:
    res = 0.05
    h, w = 200, 400  # 10 m x 20 m from (0, 0)
    xs = (np.arange(w) + 0.5) * res
    elev = np.tile(slope * xs, (h, 1)).astype(np.float32)
    return Raster(
        elevation=elev,
        reflectance=np.zeros((h, w), np.float32),
        label=np.ones((h, w), np.uint8),
        origin=(0.0, 0.0),
        resolution=res,
    )


def test_elevation_rmse_of_a_constant_offset() -> None:
    truth = plane_raster()
    elev = truth.elevation[50:150, 100:300] + np.float32(0.02)
    elev[:10] = np.nan  # unobserved cells do not count
    grid = GridLayers(elevation=elev, origin=(5.0, 2.5), resolution=0.05)
    err = elevation_errors(grid, truth)
    assert err.size == 90 * 200
    assert elevation_rmse(grid, truth) == pytest.approx(0.02, abs=1e-6)


def test_elevation_uses_the_alignment() -> None:
    truth = plane_raster()
    # the map frame is the truth frame shifted by (+1 m, -0.5 m, +0.3 m)
    elev = truth.elevation[50:150, 100:300] + np.float32(0.3)
    grid = GridLayers(elevation=elev, origin=(5.0 + 1.0, 2.5 - 0.5), resolution=0.05)
    align = np.eye(4)
    align[:3, 3] = [-1.0, 0.5, -0.3]
    assert elevation_rmse(grid, truth, align) == pytest.approx(0.0, abs=1e-6)
    # without the alignment the same grid is 10 cm (slope x 1 m) + 30 cm off
    assert elevation_rmse(grid, truth) == pytest.approx(0.2, abs=1e-5)


def test_elevation_outside_raster_is_left_out_and_bad_grid_rejected() -> None:
    truth = plane_raster()
    grid = GridLayers(
        elevation=np.zeros((4, 4), np.float32), origin=(100.0, 100.0), resolution=0.05
    )
    assert elevation_errors(grid, truth).size == 0
    assert math.isnan(elevation_rmse(grid, truth))
    with pytest.raises(MapFormatError, match="2-D"):
        GridLayers(elevation=np.zeros(4, np.float32), origin=(0.0, 0.0), resolution=0.05)
    with pytest.raises(MapFormatError, match="reflectance shape"):
        GridLayers(np.zeros((2, 2)), (0.0, 0.0), 0.05, reflectance=np.zeros((3, 3)))


def test_apply_alignment_keeps_missing_heights() -> None:
    a = np.eye(4)
    a[:3, 3] = [1.0, 2.0, 3.0]
    out = apply_alignment(np.array([[0.0, 0.0, np.nan], [1.0, 1.0, 1.0]]), a)
    assert np.allclose(out[0, :2], [1.0, 2.0]) and np.isnan(out[0, 2])
    assert np.allclose(out[1], [2.0, 3.0, 4.0])


def test_metric_pass_fail() -> None:
    assert Metric("a", 0.04, 0.05, "<=", "m").passed is True
    assert Metric("a", 0.06, 0.05, "<=", "m").passed is False
    assert Metric("b", 0.96, 0.95, ">=", "").passed is True
    assert Metric("b", None, 0.95, ">=", "").passed is None
    assert Metric("b", float("nan"), 0.95, ">=", "").passed is None
    with pytest.raises(HdmapError, match="sign_match_radius_m"):
        EvalSettings(sign_match_radius_m=-1)


def test_features_reject_other_frames() -> None:
    with pytest.raises(MapFormatError, match="frame"):
        features_from_geojson(
            {"type": "FeatureCollection", "adcloud:frame": "wgs84", "features": []}
        )
    with pytest.raises(MapFormatError, match="FeatureCollection"):
        features_from_geojson({"type": "Feature"})
    bad = {
        "type": "FeatureCollection",
        "features": [
            {
                "properties": {"kind": "lane_marking"},
                "geometry": {"type": "Polygon", "coordinates": []},
            }
        ],
    }
    with pytest.raises(MapFormatError, match=r"features\[0\].*Polygon"):
        features_from_geojson(bad, "x.geojson")


# --------------------------------------------------------------------------- real truth


@pytest.fixture(scope="module")
def truth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the truth directory is what matters here; no LiDAR keeps generation to about a second
    res = generate_drive(
        DriveConfig(seconds=10, seed=11, lidar=False, camera=False),
        tmp_path_factory.mktemp("drive") / "t.bag",
    )
    return Path(res.truth)


def test_dashed_markings_are_cut_to_paint(truth_dir: Path) -> None:
    truth = load_truth(truth_dir)
    raster = truth.raster
    assert raster is not None
    pts = np.vstack(truth.lane_markings)[:, :2]
    j = np.floor((pts[:, 0] - raster.origin[0]) / raster.resolution).astype(int)
    i = np.floor((pts[:, 1] - raster.origin[1]) / raster.resolution).astype(int)
    inside = (i >= 0) & (i < raster.label.shape[0]) & (j >= 0) & (j < raster.label.shape[1])
    assert inside.sum() > 1000
    # the true raster labels paint: the painted polylines lie on it (cell edges aside)
    assert np.mean(raster.label[i[inside], j[inside]] == 2) > 0.98
    geo = json.loads((truth_dir / "map.geojson").read_text())
    dashed = [
        f
        for f in geo["features"]
        if f["properties"].get("kind") == "lane_marking" and f["properties"]["type"] == "dashed"
    ]
    assert dashed
    only = {**geo, "features": dashed}
    pieces = painted_marking_polylines(only)
    lengths = [np.linalg.norm(np.diff(p[:, :2], axis=0), axis=1).sum() for p in pieces]
    # dashes are 3 m of paint (shorter only where a line starts or ends mid-dash)
    assert np.median(lengths) == pytest.approx(3.0, abs=0.1)
    assert max(lengths) < 3.1


def map_frame() -> np.ndarray:
    """A GPS-biased map frame: truth -> map is yaw 0.4 deg and (0.6, -0.4, 0.25) m."""
    b = np.eye(4)
    b[:3, :3] = Rotation.from_euler("z", 0.4, degrees=True).as_matrix()
    b[:3, 3] = [0.6, -0.4, 0.25]
    return b


def fake_map(truth_dir: Path, noise_m: float = 0.01) -> MapProducts:
    """A map 'built' from the truth in the biased frame, with known errors: 1 cm position
    noise, 1 cm elevation noise, markings 4 cm off, one false sign."""
    rng = np.random.default_rng(3)
    truth = load_truth(truth_dir)
    b = map_frame()
    traj = truth.trajectory.transformed(b)
    m = traj.matrices.copy()
    m[:, :3, 3] += rng.normal(0, noise_m, size=(len(m), 3))
    traj = Trajectory(traj.t, m)
    # grid: map-frame cells over the route; ground height from the truth under each cell
    raster = truth.raster
    assert raster is not None
    xy_t = truth.trajectory.xyz[:, :2]
    xy_m = apply_alignment(np.column_stack([xy_t, np.zeros(len(xy_t))]), b)[:, :2]
    lo, hi = xy_m.min(axis=0) - 5, xy_m.max(axis=0) + 5
    res = 0.05
    x0, y0 = np.floor(lo / res) * res
    w, h = int((hi[0] - x0) / res), int((hi[1] - y0) / res)
    xs = x0 + (np.arange(w) + 0.5) * res
    ys = y0 + (np.arange(h) + 0.5) * res
    gx, gy = np.meshgrid(xs, ys)
    inv = np.linalg.inv(b)
    cell_t = np.column_stack([gx.ravel(), gy.ravel()]) @ inv[:2, :2].T + inv[:2, 3]
    j = np.floor((cell_t[:, 0] - raster.origin[0]) / raster.resolution).astype(int)
    i = np.floor((cell_t[:, 1] - raster.origin[1]) / raster.resolution).astype(int)
    elev = raster.elevation[i, j].astype(np.float64) + b[2, 3]  # yaw only: z shifts only
    elev += rng.normal(0, noise_m, size=elev.shape)
    # observed: within 5 m of the route
    d, _ = cKDTree(xy_t).query(cell_t)
    elev[d > 5] = np.nan
    grid = GridLayers(
        elevation=elev.reshape(h, w).astype(np.float32),
        origin=(float(x0), float(y0)),
        resolution=res,
        reflectance=raster.reflectance[i, j].reshape(h, w),
    )
    # markings near the route, moved 4 cm sideways (in y) and into the map frame
    route = cKDTree(xy_t)
    near = [p for p in truth.lane_markings if route.query(p[:, :2])[0].min() < 8]
    lines = tuple(apply_alignment(p + np.array([0.0, 0.04, 0.0]), b) for p in near)
    signs_t = truth.signs[route.query(truth.signs[:, :2])[0] < 15]
    signs_t = np.vstack([signs_t, [[signs_t[0, 0] + 5.0, signs_t[0, 1], signs_t[0, 2]]]])
    return MapProducts(
        trajectories={"t": traj},
        grid=(grid,),
        lane_markings=lines,
        signs=apply_alignment(signs_t, b),
        sign_types=tuple(["stop"] * len(signs_t)),
        semantic=True,
        source="fake",
    )


@pytest.fixture(scope="module")
def products(truth_dir: Path) -> MapProducts:
    return fake_map(truth_dir)


def test_evaluate_map_recovers_known_errors(truth_dir: Path, products: MapProducts) -> None:
    result = evaluate_map(products, truth_dir)
    assert result.drive == "t"
    # the alignment undoes the bias
    assert np.allclose(result.alignment, np.linalg.inv(map_frame()), atol=5e-3)
    assert result.ate.rmse == pytest.approx(0.01 * math.sqrt(3), rel=0.1)
    assert result.elevation is not None
    assert result.elevation.rmse == pytest.approx(0.01, rel=0.15)
    assert result.elevation.count > 10_000
    assert result.markings is not None
    # a marking shifted 4 cm in y: 4 cm from a stripe running along x, less on others
    assert 0.01 < result.markings.mean_distance_m <= 0.041
    assert result.markings.recovered_fraction > 0.97
    assert result.signs is not None
    n_true = result.signs.true
    assert n_true >= 1
    assert result.signs.recall == 1.0
    assert result.signs.precision == pytest.approx(n_true / (n_true + 1))
    assert result.metric("ate_rmse").passed is True
    assert result.metric("elevation_rmse").passed is True
    data = result.as_dict()
    json.dumps(data)  # JSON-ready
    assert data["metrics"]["marking_recovered_fraction"]["passed"] is True
    assert data["alignment"]["offset_m"][2] == pytest.approx(-0.25, abs=0.01)


def every_other_metre(poly: np.ndarray) -> list[np.ndarray]:
    """The pieces of ``poly`` over arclength [0, 1], [2, 3], [4, 5]... m."""
    s = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(poly[:, :2], axis=0), axis=1))])
    pieces = []
    for start in np.arange(0.0, s[-1], 2.0):
        u = np.linspace(start, min(start + 1.0, s[-1]), 11)
        pieces.append(np.column_stack([np.interp(u, s, poly[:, k]) for k in range(3)]))
    return pieces


def test_evaluate_map_fails_targets_on_a_bad_map(truth_dir: Path, products: MapProducts) -> None:
    good = products
    half = tuple(q for p in good.lane_markings for q in every_other_metre(p))
    bad = MapProducts(
        trajectories={"t": good.trajectories["t"]},
        grid=(
            GridLayers(
                elevation=good.grid[0].elevation + np.float32(0.08),
                origin=good.grid[0].origin,
                resolution=0.05,
            ),
        ),
        lane_markings=half,
        signs=np.zeros((0, 3)),
        semantic=True,
        source="bad",
    )
    result = evaluate_map(bad, truth_dir)
    assert not result.passed
    assert result.metric("ate_rmse").passed is True
    # 8 cm bias and 1 cm noise
    assert result.metric("elevation_rmse").value == pytest.approx(math.hypot(0.08, 0.01), abs=1e-3)
    assert result.metric("elevation_rmse").passed is False
    assert result.metric("marking_recovered_fraction").value == pytest.approx(0.5, abs=0.05)
    assert result.metric("marking_recovered_fraction").passed is False
    assert result.metric("sign_recall").value == 0.0
    assert result.metric("sign_precision").passed is None  # nothing mapped: undefined


def test_evaluate_map_without_semantics_or_grid(truth_dir: Path, products: MapProducts) -> None:
    """A map with only trajectories does not pass: its grid and semantic targets cannot be
    shown to be met. ``failures`` names each metric and why it was not evaluated."""
    good = products
    only_traj = MapProducts(trajectories=dict(good.trajectories), source="traj-only")
    result = evaluate_map(only_traj, truth_dir)
    assert not result.passed
    assert result.metric("ate_rmse").passed is True
    assert result.metric("elevation_rmse").passed is None
    assert result.metric("elevation_rmse").note == "no grid"
    assert result.metric("sign_recall").note == "no semantic layer"
    assert result.elevation is None and result.markings is None
    failures = result.failures
    assert [f.split(":")[0] for f in failures] == [m.name for m in result.metrics][1:]
    assert "elevation_rmse: not evaluated (no grid); target <= 0.03 m" in failures
    assert "sign_recall: not evaluated (no semantic layer); target >= 0.9" in failures
    assert result.as_dict()["failures"] == list(failures)


def test_eval_command_fails_on_targets_it_cannot_evaluate(
    truth_dir: Path, tmp_path: Path, products: MapProducts, capsys: pytest.CaptureFixture[str]
) -> None:
    from adcloud.cli import main  # noqa: PLC0415

    md = MapDir(tmp_path / "map")
    with md.begin(None) as st:
        (st.path / "trajectory").mkdir()
        products.trajectories["t"].write_tum(st.path / "trajectory" / "t.tum")
        st.commit(Manifest())
    code = main(["hdmap", "eval", "--map", str(tmp_path / "map"), "--truth", str(truth_dir)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1
    assert "not passed: elevation_rmse: not evaluated (no grid)" in out
    assert "not passed: marking_mean_distance: not evaluated (no semantic layer)" in out


def write_version(md: MapDir, products: MapProducts, grid_path: str = "grid.npz") -> None:
    with md.begin(md.current()) as st:
        (st.path / "trajectory").mkdir()
        for name, traj in products.trajectories.items():
            traj.write_tum(st.path / "trajectory" / f"{name}.tum")
        features = [
            {
                "type": "Feature",
                "properties": {"kind": "lane_marking"},
                "geometry": {"type": "LineString", "coordinates": p.tolist()},
            }
            for p in products.lane_markings
        ] + [
            {
                "type": "Feature",
                "properties": {"kind": "traffic_sign", "type": t},
                "geometry": {"type": "Point", "coordinates": s.tolist()},
            }
            for s, t in zip(products.signs, products.sign_types, strict=True)
        ]
        (st.path / "semantic").mkdir()
        (st.path / "semantic" / "labels.geojson").write_text(
            json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": features})
        )
        (g,) = products.grid
        np.savez(
            st.path / grid_path, elevation=g.elevation, origin=np.array(g.origin), res=g.resolution
        )
        st.commit(Manifest())


def npz_grid(version_dir: Path) -> tuple[GridLayers, ...]:
    path = version_dir / "grid.npz"
    if not path.exists():
        return ()
    with np.load(path) as z:
        return (GridLayers(z["elevation"], tuple(z["origin"]), float(z["res"])),)


def test_evaluate_map_reads_a_stored_map_version(
    truth_dir: Path, tmp_path: Path, products: MapProducts
) -> None:
    md = MapDir(tmp_path / "map")
    write_version(md, products)
    loaded = load_map_products(str(tmp_path / "map"), grid_reader=npz_grid)
    assert set(loaded.trajectories) == {"t"}
    assert len(loaded.lane_markings) == len(products.lane_markings)
    assert loaded.signs.shape == products.signs.shape
    from_disk = evaluate_map(md.current(), truth_dir, grid_reader=npz_grid)  # type: ignore[arg-type]
    in_memory = evaluate_map(products, truth_dir)
    # TUM keeps 1 um: the same numbers from the stored map as from memory
    assert from_disk.ate.rmse == pytest.approx(in_memory.ate.rmse, abs=1e-5)
    assert from_disk.elevation.rmse == pytest.approx(in_memory.elevation.rmse, abs=1e-5)  # type: ignore[union-attr]
    assert from_disk.markings.recovered_fraction == pytest.approx(  # type: ignore[union-attr]
        in_memory.markings.recovered_fraction,
        abs=1e-4,  # type: ignore[union-attr]
    )
    assert from_disk.map_source.endswith("versions/000001")


def test_a_map_version_off_the_local_disk_is_read_without_leaving_its_copy(
    tmp_path: Path, products: MapProducts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a map on an object store downloads its version; the copy (a whole map
    version) is removed once the products are in memory, not left in the temporary
    directory for ever."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    uri = f"memory://hdmap-eval-{os.getpid()}-{time.monotonic_ns()}/map"
    write_version(MapDir(uri), products)
    for source in (uri, MapDir(uri).current()):
        assert source is not None
        loaded = load_map_products(source, grid_reader=npz_grid)
        assert set(loaded.trajectories) == {"t"} and len(loaded.grid) == 1
        assert loaded.source.endswith("versions/000001")
        assert list(temp.iterdir()) == []


def test_a_download_cut_off_leaves_no_part_of_the_map_version(
    tmp_path: Path, products: MapProducts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection lost while a version off the local disk is downloaded fails the read
    and removes what had come, before the next try downloads it all again (a notebook
    retrying kept one partial copy of the map version per try)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    uri = f"memory://hdmap-eval-{os.getpid()}-{time.monotonic_ns()}/map"
    write_version(MapDir(uri), products)
    served = MemoryFileSystem._open

    def cut_off(self: MemoryFileSystem, path: str, *args: Any, **kwargs: Any) -> Any:
        if "/trajectory/" in path:
            raise ConnectionResetError(f"{path}: connection reset by peer")
        return served(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "_open", cut_off)
    with pytest.raises(ConnectionResetError):
        load_map_products(uri, grid_reader=npz_grid)
    assert list(temp.iterdir()) == []


def test_evaluate_map_bad_inputs(truth_dir: Path, tmp_path: Path, products: MapProducts) -> None:
    good = products
    with pytest.raises(HdmapError, match="not a truth directory"):
        evaluate_map(good, tmp_path)
    two = MapProducts(trajectories={"a": good.trajectories["t"], "b": good.trajectories["t"]})
    with pytest.raises(
        HdmapError, match=r"name it \(adcloud hdmap eval --drive NAME, or drive=NAME\)"
    ):
        evaluate_map(two, truth_dir)
    assert evaluate_map(two, truth_dir, drive="b").drive == "b"
    with pytest.raises(MapFormatError, match="no trajectory"):
        evaluate_map(MapProducts(trajectories={}, source="empty"), truth_dir)
    far = good.trajectories["t"]
    shifted = Trajectory(far.t + 3600 * 10**9, far.matrices)
    with pytest.raises(HdmapError, match="is this the truth of that drive"):
        evaluate_map(MapProducts(trajectories={"t": shifted}), truth_dir)
    # a mistyped path is not taken for a map to build first
    with pytest.raises(MapFormatError, match="no map there"):
        load_map_products(f"file://{tmp_path / 'nothing'}")
    (tmp_path / "new-map").mkdir()
    with pytest.raises(MapFormatError, match="no version yet"):
        load_map_products(f"file://{tmp_path / 'new-map'}")


def test_a_truth_whose_poses_file_was_emptied_is_named(
    truth_dir: Path, tmp_path: Path, products: MapProducts
) -> None:
    """An emptied poses.txt raised a raw IndexError out of the trajectory alignment."""
    cut = tmp_path / "d1.bag.truth"
    shutil.copytree(truth_dir, cut)
    lines = (cut / "poses.txt").read_text().splitlines(keepends=True)
    (cut / "poses.txt").write_text("".join(lines[:1]))  # the header alone
    with pytest.raises(HdmapError, match=r"poses\.txt: 0 pose\(s\); the truth needs"):
        evaluate_map(products, cut)


def test_eval_command_refuses_outputs_it_cannot_write_before_evaluating(
    truth_dir: Path, tmp_path: Path, products: MapProducts, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--report`` naming a file or ``--out`` naming a directory (or a missing folder)
    failed only after the whole evaluation, with a bare "File exists"/"Is a directory"."""
    from adcloud.cli import main  # noqa: PLC0415

    md = MapDir(tmp_path / "map")
    write_version(md, products)
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    base = ["hdmap", "eval", "--map", str(tmp_path / "map"), "--truth", str(truth_dir)]
    for extra, said in [
        (["--report", str(afile)], "notes.txt: is a file; --report names a directory"),
        (["--out", str(tmp_path)], "is a directory; --out names the file to write the metrics"),
        (["--out", str(tmp_path / "no" / "m.json")], "no directory"),
    ]:
        assert main([*base, *extra]) == 2
        captured = capsys.readouterr()
        assert said in " ".join(captured.err.split())
        assert "metric" not in captured.out  # refused before the evaluation ran
    assert afile.read_text() == "mine"


def grid_tile(key: tuple[int, int], elevation: np.ndarray, reflectance: np.ndarray) -> GridTile:
    n = elevation.shape[0]
    res = 0.05
    count = np.where(np.isfinite(elevation), 3, 0).astype(np.int32)
    return GridTile(
        key=key,
        origin=(key[0] * n * res, key[1] * n * res),
        resolution=res,
        elevation_mean=elevation,
        elevation_min=elevation,
        elevation_max=elevation,
        count=count,
        reflectance_mean=reflectance,
        scans=count,
        obstacle_top=np.full_like(elevation, np.nan),
    )


def test_grid_tiles_are_read_from_geotiffs(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    tiles = {}
    (tmp_path / "v" / "grid").mkdir(parents=True)
    for key in [(0, 0), (1, 0), (-1, 2)]:
        elev = rng.normal(0, 0.1, (40, 40)).astype(np.float32)
        elev[:5] = np.nan  # unobserved rows (south edge)
        tiles[key] = grid_tile(key, elev, rng.uniform(0, 255, (40, 40)).astype(np.float32))
        write_grid_tile(tiles[key], tmp_path / "v" / "grid", (37.3875, -122.0575, 12.0))
    (tmp_path / "v" / "grid" / "preview.tif").write_bytes(b"not a tile name: ignored")
    read = read_grid_tiles(tmp_path / "v")
    assert len(read) == 3
    by_origin = {g.origin: g for g in read}
    for tile in tiles.values():
        g = by_origin[tile.origin]
        # rows come back south-up, NaN where unobserved
        assert np.array_equal(g.elevation, tile.elevation_mean, equal_nan=True)
        assert np.array_equal(g.reflectance, tile.reflectance_mean)  # type: ignore[arg-type]
        assert g.resolution == pytest.approx(0.05)
    products = load_map_products(tmp_path / "v")  # default reader: the GeoTIFF tiles
    assert len(products.grid) == 3
    # errors over tiles: each tile against a flat zero raster under all of them
    flat = Raster(
        elevation=np.zeros((200, 200), np.float32),
        reflectance=np.zeros((200, 200), np.float32),
        label=np.ones((200, 200), np.uint8),
        origin=(-5.0, -1.0),
        resolution=0.05,
    )
    err = elevation_errors(products.grid, flat)
    expected = np.concatenate(
        [t.elevation_mean[np.isfinite(t.elevation_mean)] for t in tiles.values()]
    )
    assert err.size == expected.size
    assert np.sqrt(np.mean(err**2)) == pytest.approx(np.sqrt(np.mean(expected**2)), rel=1e-6)


def test_the_truth_of_another_name_than_the_only_drive_is_compared_with_a_warning(
    truth_dir: Path, products: MapProducts, caplog: pytest.LogCaptureFixture
) -> None:
    """A map of one drive and the truth of another (d3.bag.truth against a map of d1) was
    compared without a word: metres of "error" that are no error of the map. The warning
    is a note of the result too (its JSON and the eval command's output), where a nightly
    run's reader sees it."""
    other = MapProducts(trajectories={"d1": products.trajectories["t"]}, source="m")
    with caplog.at_level(logging.WARNING, logger="adcloud.hdmap.evaluate"):
        result = evaluate_map(other, truth_dir)
    assert result.drive == "d1"
    said = "the truth 't' is not named after the map's only drive 'd1'"
    assert said in caplog.text
    assert [n for n in result.notes if said in n] and said in result.to_json()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adcloud.hdmap.evaluate"):
        named = evaluate_map(other, truth_dir, drive="d1")
        same = evaluate_map(products, truth_dir)
    assert "not named after" not in caplog.text
    assert not [n for n in (*named.notes, *same.notes) if "not named after" in n]
