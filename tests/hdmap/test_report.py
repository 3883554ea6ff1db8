"""The HTML/PNG summary: files exist, the page references them, the pictures show things."""

from __future__ import annotations

import json
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.evaluate import (
    EvalResult,
    GridLayers,
    Metric,
    elevation_metrics,
    mosaic,
    polyline_metrics,
    sign_metrics,
)
from adcloud.hdmap.loops import DriveTies, LoneDrive, UnplacedDrive, UntiedDrives
from adcloud.hdmap.mapdir import Manifest, MapDir
from adcloud.hdmap.report import write_map_report, write_report
from adcloud.hdmap.trajectory import Trajectory, absolute_trajectory_error
from adcloud.synth import Raster

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ImgSources(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.srcs.append(dict(attrs)["src"] or "")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(page: Path) -> ImgSources:
    p = ImgSources()
    p.feed(page.read_text(encoding="utf-8"))
    return p


def circle_trajectory(radius: float = 20.0, n: int = 300, noise: float = 0.0) -> Trajectory:
    rng = np.random.default_rng(1)
    a = np.linspace(0, 2 * np.pi, n, endpoint=False)
    xyz = np.column_stack([radius * np.cos(a) + 25, radius * np.sin(a) + 15, np.zeros(n)])
    xyz += rng.normal(0, noise, xyz.shape)
    yaw = a + np.pi / 2
    quat = np.column_stack([np.zeros(n), np.zeros(n), np.sin(yaw / 2), np.cos(yaw / 2)])
    return Trajectory.from_xyz_quat(np.arange(n, dtype=np.int64) * 100_000_000 + 10**18, xyz, quat)


def sample_grid() -> GridLayers:
    h, w = 600, 1000  # 30 m x 50 m at 5 cm
    yy, xx = np.mgrid[0:h, 0:w]
    elev = (0.002 * xx + 0.1 * np.sin(yy / 40)).astype(np.float32) * 0.05
    refl = (0.1 + 0.6 * ((xx // 60) % 5 == 0)).astype(np.float32)
    elev[:, :80] = np.nan  # an unobserved strip
    return GridLayers(elevation=elev, origin=(0.0, 0.0), resolution=0.05, reflectance=refl)


def markings() -> list[np.ndarray]:
    a = np.linspace(0, 2 * np.pi, 200)
    return [np.column_stack([17.5 * np.cos(a) + 25, 17.5 * np.sin(a) + 15, np.zeros(200)])]


def make_eval(grid: GridLayers) -> EvalResult:
    truth = circle_trajectory()
    est = circle_trajectory(noise=0.02)
    ate = absolute_trajectory_error(est, truth)
    raster = Raster(
        elevation=np.nan_to_num(grid.elevation) - np.float32(0.01),
        reflectance=grid.reflectance,  # type: ignore[arg-type]
        label=np.ones(grid.elevation.shape, np.uint8),
        origin=grid.origin,
        resolution=grid.resolution,
    )
    elevation = elevation_metrics(grid, raster)
    lines = polyline_metrics(markings(), markings())
    signs = sign_metrics(np.array([[5.0, 5.0]]), np.array([[5.0, 5.1], [9.0, 9.0]]))
    metrics = (
        Metric("ate_rmse", ate.rmse, 0.05, "<=", "m"),
        Metric("elevation_rmse", elevation.rmse, 0.03, "<=", "m"),
        Metric("marking_recovered_fraction", lines.recovered_fraction, 0.95, ">=", ""),
        Metric("sign_recall", signs.recall, 0.9, ">=", ""),
    )
    return EvalResult(
        drive="circle",
        alignment=ate.alignment,
        ate=ate,
        ate_times_s=(est.t - est.t[0]) / 1e9,
        elevation=elevation,
        markings=lines,
        signs=signs,
        metrics=metrics,
        notes=("a note from the evaluation",),
        map_source="test",
        truth_dir="truth",
    )


def check_png(path: Path, min_colours: int = 8) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
    rgb = img[..., :3]
    assert float(rgb.std()) > 0.02  # not a constant image
    colours = np.unique((rgb.reshape(-1, 3) * 255).astype(np.uint8), axis=0)
    assert len(colours) >= min_colours
    return np.asarray(rgb)


def count_colour(rgb: np.ndarray, hex_colour: str, tol: float = 0.06) -> int:
    target = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int(np.sum(np.all(np.abs(rgb - target) < tol, axis=2)))


def test_report_with_grid_and_eval(tmp_path: Path) -> None:
    grid = sample_grid()
    result = make_eval(grid)
    page = write_report(
        tmp_path / "r",
        trajectories={"circle": circle_trajectory()},
        grid=grid,
        lane_markings=markings(),
        signs=np.array([[10.0, 10.0, 2.0], [40.0, 20.0, 2.0]]),
        eval_result=result,
        inputs={"map": "file:///maps/test", "version": "000004"},
        title="Test <map> & report",
    )
    assert page == tmp_path / "r" / "summary.html"
    parsed = parse(page)
    assert parsed.srcs == ["map_preview.png", "ate.png", "elevation_error.png"]
    for src in parsed.srcs:
        assert not Path(src).is_absolute()  # relative: the directory can move
        check_png(page.parent / src)
    preview = check_png(page.parent / "map_preview.png", min_colours=50)
    # the trajectory (tab10 blue), the lane marking (amber) and the signs (red) are drawn
    assert count_colour(preview, "#1f77b4") > 200
    assert count_colour(preview, "#ffb000") > 200
    assert count_colour(preview, "#d00000") > 20
    text = page.read_text()
    assert "Test &lt;map&gt; &amp; report" in text  # escaped
    body = " ".join(parsed.text)
    assert "000004" in body and "file:///maps/test" in body
    assert "ate rmse" in body and "elevation rmse" in body
    # ATE of 2 cm noise passes; the 1 cm elevation offset passes; sign recall 50 % fails
    assert f"{result.ate.rmse * 100:.2f} cm" in body
    assert "50.0 %" in body
    assert text.count('class="pass"') == 3 and text.count('class="fail"') == 2  # + verdict
    assert "a note from the evaluation" in body
    stored = json.loads((tmp_path / "r" / "eval.json").read_text())
    assert stored["drive"] == "circle" and stored["passed"] is False


def test_report_without_grid_or_truth(tmp_path: Path) -> None:
    page = write_report(tmp_path, trajectories=circle_trajectory(), lane_markings=markings())
    parsed = parse(page)
    assert parsed.srcs == ["map_preview.png"]
    rgb = check_png(tmp_path / "map_preview.png")
    assert count_colour(rgb, "#1f77b4") > 200
    assert not (tmp_path / "ate.png").exists() and not (tmp_path / "eval.json").exists()
    assert "Accuracy" not in page.read_text()


def test_report_lists_the_drive_ties(tmp_path: Path) -> None:
    """A build's drive ties: each pair of drives close but not tied and each tied drive's
    GPS offset is a note (a large offset singled out) and a record in drive_ties.json."""
    ties = DriveTies(
        (UntiedDrives(("monday", "tuesday"), 4, 2.5),),
        {"wednesday": (0.1, 1.4, -0.2), "thursday": (0.05, -0.2, 0.0)},
    )
    page = write_report(tmp_path, trajectories=circle_trajectory(), ties=ties)
    text = " ".join(page.read_text().split())
    notes = text[text.index("<h2>Notes</h2>") :]
    assert "drives monday and tuesday come within 2.5 m of each other (4 candidate" in notes
    assert "not tied, each is placed by its own GPS alone" in notes
    large = "LARGE GPS OFFSET: drive wednesday is tied by loop closures; its GPS reads 1.42 m"
    assert large in notes
    assert "(+0.10, +1.40, -0.20 m east, north, up)" in notes
    assert "drive thursday is tied by loop closures; its GPS reads 0.21 m" in notes
    assert "LARGE GPS OFFSET: drive thursday" not in notes
    stored = json.loads((tmp_path / "drive_ties.json").read_text())
    assert stored["untied"] == [
        {"drives": ["monday", "tuesday"], "candidates": 4, "closest_m": 2.5}
    ]
    assert stored["large_gps_offsets"] == ["wednesday"]
    assert DriveTies.read(tmp_path / "drive_ties.json") == ties
    assert DriveTies.read(tmp_path / "missing.json") == DriveTies()
    # a later build's record of a drive replaces the earlier one
    later = ties | DriveTies((), {"tuesday": (0.0, 0.3, 0.0)})
    assert later.untied == () and set(later.gps_offsets) == {"wednesday", "thursday", "tuesday"}
    (tmp_path / "drive_ties.json").write_text('{"format": 1, "untied": [{"drives": []}]}')
    with pytest.raises(MapFormatError, match=r"drive_ties\.json: not a record of drive ties"):
        DriveTies.read(tmp_path / "drive_ties.json")


def test_a_new_drive_left_untied_keeps_what_the_map_knew_of_the_old_drive() -> None:
    """The parent's ties of a map drive (its GPS offset, its own untied pairs) stay in the
    record when a new drive comes close to it without a tie: only the same pair or the
    same drive's offset is replaced."""
    parent = DriveTies(
        (UntiedDrives(("monday", "tuesday"), 4, 2.5),),
        {"monday": (0.1, 1.4, -0.2), "tuesday": (0.0, 0.2, 0.0)},
    )
    newer = DriveTies((UntiedDrives(("friday", "monday"), 2, 3.0),), {"friday": (0.0, 0.3, 0.0)})
    both = parent | newer
    assert both.untied == (
        UntiedDrives(("monday", "tuesday"), 4, 2.5),
        UntiedDrives(("friday", "monday"), 2, 3.0),
    )
    assert both.gps_offsets == {**parent.gps_offsets, "friday": (0.0, 0.3, 0.0)}
    assert [n for n in both.notes() if "LARGE GPS OFFSET: drive monday" in n]
    # the same pair found again replaces the earlier record of it
    again = both | DriveTies((UntiedDrives(("monday", "tuesday"), 1, 4.0),))
    assert again.untied == (
        UntiedDrives(("friday", "monday"), 2, 3.0),
        UntiedDrives(("monday", "tuesday"), 1, 4.0),
    )


def test_report_names_the_drives_joined_to_no_other(tmp_path: Path) -> None:
    """A drive that came within the search radius of no other drive is a note of the
    build's report and a record of drive_ties.json (since format 2; format 1 reads as
    none), until a later build finds it close to a drive or builds it again."""
    ties = DriveTies(alone=(LoneDrive("far", 8.0),))
    page = write_report(tmp_path, trajectories=circle_trajectory(), ties=ties)
    notes = " ".join(page.read_text().split())
    notes = notes[notes.index("<h2>Notes</h2>") :]
    assert "drive far is not joined to the map&#x27;s other drives" in notes
    assert "within 8 m (hdmap_loops.search_radius_m) of none of them" in notes
    stored = json.loads((tmp_path / "drive_ties.json").read_text())
    assert stored["format"] == 3 and stored["alone"] == [{"drive": "far", "search_radius_m": 8.0}]
    assert DriveTies.read(tmp_path / "drive_ties.json") == ties
    assert ties.concerns() == [LoneDrive("far", 8.0).note()]
    older = '{"format": 1, "untied": [], "gps_offsets_m": {"a": [0.1, 0, 0]}}'
    (tmp_path / "drive_ties.json").write_text(older)
    assert DriveTies.read(tmp_path / "drive_ties.json") == DriveTies((), {"a": (0.1, 0.0, 0.0)})
    # a later build that adds a drive elsewhere keeps the record
    assert (ties | DriveTies(alone=(LoneDrive("other", 8.0),))).alone == (
        LoneDrive("far", 8.0),
        LoneDrive("other", 8.0),
    )
    # one whose new drive comes close to it names the pair instead
    close = DriveTies((UntiedDrives(("far", "friday"), 2, 3.0),))
    assert (ties | close).alone == () and (ties | close).untied == close.untied
    # far built again, tied to the others this time
    assert (ties | DriveTies((), {"far": (0.0, 0.2, 0.0)})).alone == ()


def test_report_names_the_drives_no_gps_fix_places(tmp_path: Path) -> None:
    """A drive placed by no GPS fix (held with its start at the map origin) is the first
    note of the report and a record of drive_ties.json (format 3; formats 1 and 2 read as
    none), a concern ``hdmap info`` shows, until the drive is built again."""
    ties = DriveTies(
        alone=(LoneDrive("far", 8.0),),
        unplaced=(UnplacedDrive("blind", 0), UnplacedDrive("masked", 12)),
    )
    page = write_report(tmp_path, trajectories=circle_trajectory(), ties=ties)
    notes = " ".join(page.read_text().split())
    notes = notes[notes.index("<h2>Notes</h2>") :]
    assert notes.index("drive blind is not placed on the map: it has no GPS fix") < notes.index(
        "drive far is not joined"
    )
    assert "drive masked is not placed on the map: all 12 of its GPS fixes were rejected" in notes
    stored = json.loads((tmp_path / "drive_ties.json").read_text())
    assert stored["unplaced"] == [{"drive": "blind", "fixes": 0}, {"drive": "masked", "fixes": 12}]
    assert DriveTies.read(tmp_path / "drive_ties.json") == ties
    assert ties.concerns()[:2] == [u.note() for u in ties.unplaced]
    two = '{"format": 2, "untied": [], "gps_offsets_m": {}, "alone": []}'
    assert DriveTies.parse(two, "two.json") == DriveTies()
    with pytest.raises(MapFormatError, match=r"bad\.json: not a record of drive ties"):
        DriveTies.parse(
            '{"format": 3, "untied": [], "gps_offsets_m": {}, "unplaced": [{}]}', "bad.json"
        )
    # blind built again (with GPS this time, tied by closures): its note goes
    again = ties | DriveTies((), {"blind": (0.0, 0.1, 0.0)})
    assert again.unplaced == (UnplacedDrive("masked", 12),)
    assert (ties | DriveTies(unplaced=(UnplacedDrive("masked", 3),))).unplaced == (
        UnplacedDrive("blind", 0),
        UnplacedDrive("masked", 3),
    )
    assert ties.without({"masked"}).unplaced == (UnplacedDrive("blind", 0),)


def test_report_draws_lanes_and_connectors(tmp_path: Path) -> None:
    lane = np.column_stack([np.linspace(0, 40, 50), np.zeros(50), np.zeros(50)])
    bridge = np.column_stack([np.linspace(40, 55, 20), np.linspace(0, 5, 20), np.zeros(20)])
    plain = write_report(tmp_path / "a", trajectories=circle_trajectory())
    page = write_report(
        tmp_path / "b", trajectories=circle_trajectory(), lanes=[lane], connectors=[bridge]
    )
    assert "lanes and signs" in page.read_text() and "lanes" not in plain.read_text()
    green = count_colour(check_png(tmp_path / "b" / "map_preview.png"), "#2e9d4a")
    assert (
        green > 100 and count_colour(check_png(tmp_path / "a" / "map_preview.png"), "#2e9d4a") == 0
    )


def test_report_rejects_empty_and_bad_input(tmp_path: Path) -> None:
    with pytest.raises(HdmapError, match="nothing to draw"):
        write_report(tmp_path)
    with pytest.raises(HdmapError, match="signs must be"):
        write_report(tmp_path, trajectories=circle_trajectory(), signs=np.zeros((2, 1)))


def test_mosaic_places_tiles_and_averages_blocks() -> None:
    layer = np.array([[1.0, 3.0, np.nan], [np.nan, 5.0, np.nan], [7.0, 7.0, 7.0]], np.float32)
    one = mosaic([GridLayers(layer, (10.0, 20.0), 0.5, reflectance=layer * 2)], 2)
    assert one.elevation.shape == (2, 2) and one.resolution == 1.0 and one.origin == (10.0, 20.0)
    assert one.elevation[0, 0] == pytest.approx(3.0)  # mean of 1, 3, 5: NaN ignored
    assert np.isnan(one.elevation[0, 1])
    assert one.elevation[1, 0] == pytest.approx(7.0) and one.elevation[1, 1] == pytest.approx(7.0)
    assert one.reflectance is not None and one.reflectance[0, 0] == pytest.approx(6.0)
    # two 2x2 tiles, the second east of and above the first: placed by their origins
    a = GridLayers(np.full((2, 2), 1.0, np.float32), (0.0, 0.0), 0.5)
    b = GridLayers(np.full((2, 2), 2.0, np.float32), (1.0, 1.0), 0.5)
    both = mosaic([b, a])
    assert both.origin == (0.0, 0.0) and both.elevation.shape == (4, 4)
    assert np.all(both.elevation[:2, :2] == 1.0) and np.all(both.elevation[2:, 2:] == 2.0)
    assert np.all(np.isnan(both.elevation[:2, 2:])) and both.reflectance is None
    with pytest.raises(HdmapError, match="resolution"):
        mosaic([a, GridLayers(np.zeros((2, 2)), (0.0, 0.0), 0.1)])
    with pytest.raises(HdmapError, match="at least one"):
        mosaic([])


def test_large_grid_is_drawn_downsampled(tmp_path: Path) -> None:
    big = GridLayers(
        elevation=np.tile(np.linspace(0, 1, 4000, dtype=np.float32), (3000, 1)),
        origin=(-100.0, -75.0),
        resolution=0.05,
    )
    page = write_report(tmp_path, grid=big)
    rgb = check_png(tmp_path / "map_preview.png")
    assert rgb.shape[1] < 2000  # a picture for people, not a 4000-pixel dump
    text = page.read_text()
    assert "4000 x 3000 cells" in text and "drawn at 1:4" in text  # at most 1024 px


@dataclass(frozen=True)
class OtherGrid:
    """A grid from another stage with the same conventions (no reflectance here)."""

    origin: tuple[float, float]
    resolution: float
    elevation: np.ndarray


def test_report_accepts_grids_of_the_same_convention(tmp_path: Path) -> None:
    grid = sample_grid()
    page = write_report(tmp_path, grid=OtherGrid(grid.origin, 0.05, grid.elevation))
    assert "1000 x 600 cells" in page.read_text()
    check_png(tmp_path / "map_preview.png")
    with pytest.raises(HdmapError, match="grid must be"):
        write_report(tmp_path, grid=42)


def test_report_draws_tiles(tmp_path: Path) -> None:
    grid = sample_grid()  # cut into 4 tiles: the preview shows the same picture
    h, w = grid.elevation.shape
    tiles = [
        GridLayers(
            grid.elevation[r : r + h // 2, c : c + w // 2],
            (c * 0.05, r * 0.05),
            0.05,
            reflectance=grid.reflectance[r : r + h // 2, c : c + w // 2],  # type: ignore[index]
        )
        for r in (0, h // 2)
        for c in (0, w // 2)
    ]
    write_report(tmp_path / "whole", grid=grid)
    page = write_report(tmp_path / "tiles", grid=tiles)
    assert "4 tile(s), 1000 x 600 cells" in page.read_text()
    whole = mpimg.imread(tmp_path / "whole" / "map_preview.png")
    tiled = mpimg.imread(tmp_path / "tiles" / "map_preview.png")
    assert whole.shape == tiled.shape
    assert np.mean(np.abs(whole - tiled)) < 0.01


def test_report_of_a_stored_map_version(tmp_path: Path) -> None:
    md = MapDir(tmp_path / "map")
    with md.begin(None) as st:
        (st.path / "trajectory").mkdir()
        circle_trajectory().write_tum(st.path / "trajectory" / "loop.tum")
        features = [
            {
                "type": "Feature",
                "properties": {"kind": "lane_marking"},
                "geometry": {"type": "LineString", "coordinates": markings()[0].tolist()},
            },
            {
                "type": "Feature",
                "properties": {"kind": "traffic_sign", "type": "stop"},
                "geometry": {"type": "Point", "coordinates": [30.0, 15.0, 2.2]},
            },
        ]
        (st.path / "labels.geojson").write_text(
            json.dumps({"type": "FeatureCollection", "features": features})
        )
        st.commit(Manifest())
    page = write_map_report(str(tmp_path / "map"), tmp_path / "report")
    body = " ".join(parse(page).text)
    assert "000001" in body and "loop" in body
    assert "1 lane markings" in body and "1 signs" in body
    assert "the map has no grid tiles" in body
    rgb = check_png(tmp_path / "report" / "map_preview.png")
    assert count_colour(rgb, "#ffb000") > 100 and count_colour(rgb, "#d00000") > 10
