"""``adcloud hdmap diff``: two versions of a map written with known changes -- a carried
tile, a tile raised and grown, a new tile, a marking extended and one removed, signs moved,
retyped, added and removed -- compared on a local disk and on fsspec's in-memory store."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adcloud.cli import main
from adcloud.hdmap.diff import PLOT_FORMATS, DiffSettings, check_plot_path, diff_versions
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.geotiff import write_grid_tile
from adcloud.hdmap.grid import GridTile
from adcloud.hdmap.mapdir import BuildPlan, MapDir, MapVersion, Staging

N = 400  # cells per tile side at 5 cm: 20 m tiles
ORIGIN = (48.0, 11.0, 500.0)


def tile(key: tuple[int, int], rows: dict[tuple[int, int], float]) -> GridTile:
    """A tile whose ground is ``height`` on row ranges ``(start, stop)`` and unobserved
    elsewhere."""
    z = np.full((N, N), np.nan, np.float32)
    for (start, stop), height in rows.items():
        z[start:stop] = height
    seen = np.isfinite(z)
    return GridTile(
        key=key,
        origin=(key[0] * 20.0, key[1] * 20.0),
        resolution=0.05,
        elevation_mean=z,
        elevation_min=z,
        elevation_max=z,
        count=seen.astype(np.int32) * 3,
        reflectance_mean=np.where(seen, 0.1, np.nan).astype(np.float32),
        scans=seen.astype(np.int32),
        obstacle_top=np.full((N, N), np.nan, np.float32),
    )


def semantic(lines: list[list[tuple[float, float]]], signs: list[tuple[float, float, str]]) -> str:
    features: list[dict[str, Any]] = [
        {
            "type": "Feature",
            "geometry": {"type": "LineString", "coordinates": [[x, y, 0.0] for x, y in line]},
            "properties": {"kind": "lane_marking", "type": "solid"},
        }
        for line in lines
    ]
    features += [
        {
            "type": "Feature",
            "geometry": {"type": "Point", "coordinates": [x, y, 2.0]},
            "properties": {"kind": "traffic_sign", "type": kind},
        }
        for x, y, kind in signs
    ]
    return json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": features})


def version_one(plan: BuildPlan, staging: Staging) -> None:
    grid = staging.path / "grid"
    grid.mkdir()
    write_grid_tile(tile((0, 0), {(0, N): 1.0}), grid / "0_0.tif", ORIGIN)
    write_grid_tile(tile((1, 0), {(0, 200): 1.0}), grid / "1_0.tif", ORIGIN)
    (staging.path / "semantic.geojson").write_text(
        semantic(
            [[(0, 1), (10, 1)], [(0, 6), (10, 6)]],
            [(5, 3, "stop"), (8, -3, "unknown"), (30, 15, "yield")],
        )
    )


def version_two(old: dict[str, bytes]) -> Any:
    def build(plan: BuildPlan, staging: Staging) -> None:
        grid = staging.path / "grid"
        grid.mkdir()
        parent = plan.parent.path if plan.parent is not None else None
        if parent is not None:  # carried as a build carries it: a hard link on a local disk
            os.link(parent / "grid" / "0_0.tif", grid / "0_0.tif")
        else:  # elsewhere a copy of the same bytes
            (grid / "0_0.tif").write_bytes(old["grid/0_0.tif"])
        raised = {(0, 100): 1.0, (100, 200): 1.02, (200, 300): 1.0}
        write_grid_tile(tile((1, 0), raised), grid / "1_0.tif", ORIGIN)
        write_grid_tile(tile((2, 0), {(0, N): 0.5}), grid / "2_0.tif", ORIGIN)
        (staging.path / "trajectory").mkdir()
        (staging.path / "trajectory" / "d1.tum").write_text(
            "# t x y z qx qy qz qw\n0.0 0 0 0 0 0 0 1\n1.0 10 0 0 0 0 0 1\n"
        )
        (staging.path / "semantic.geojson").write_text(
            semantic(
                [[(0, 1), (15, 1)]],
                [(5.5, 3, "stop"), (8, -3, "yield"), (12, 3, "stop")],
            )
        )

    return build


def make_map(uri: str, tmp_path: Path) -> None:
    bags = []
    for i in range(2):
        path = tmp_path / "bags" / f"d{i}.bag"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(random.Random(i).randbytes(2048))
        bags.append(path)
    with MapDir(uri) as md:
        v1 = md.update(bags[:1], version_one, settings={"tile_m": 20.0}).version
        assert v1 is not None
        old = {rel: v1.read_bytes(rel) for rel in v1.files()}
        md.update(bags, version_two(old), settings={"tile_m": 20.0})


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_diff_finds_every_kind_of_change(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = (
        str(tmp_path / "map")
        if backend == "local"
        else f"memory://hdmap-diff-{os.getpid()}-{time.monotonic_ns()}/map"
    )
    make_map(uri, tmp_path)
    read: list[str] = []
    reading = MapVersion.read_bytes

    def spy(self: MapVersion, relpath: str) -> bytes:
        read.append(relpath)
        return reading(self, relpath)

    monkeypatch.setattr(MapVersion, "read_bytes", spy)
    change = diff_versions(uri)  # the current version against the one it was built on
    # a carried tile is not read where it is the same file (a local disk's hard link)
    assert ("grid/0_0.tif" in read) == (backend == "memory")
    monkeypatch.undo()
    assert (change.before, change.after) == ("000001", "000002")
    assert change.drives_added == ("d1",) and change.drives_removed == ()
    tiles = {t.key: t for t in change.tiles}
    assert change.tile_counts() == {"added": 1, "removed": 0, "changed": 1, "same": 1}
    assert tiles[(0, 0)].status == "same"
    raised = tiles[(1, 0)]
    assert raised.status == "changed"
    assert (raised.cells_before, raised.cells_after) == (200 * N, 300 * N)
    assert (raised.cells_new, raised.cells_lost) == (100 * N, 0)
    # half the cells both versions see rose by 2 cm
    assert raised.dz_rms_m == pytest.approx(0.02 / np.sqrt(2), rel=1e-4)
    assert raised.dz_max_m == pytest.approx(0.02, rel=1e-4)
    assert tiles[(2, 0)].status == "added" and tiles[(2, 0)].cells_new == N * N

    # the first marking grew from 10 to 15 m (its last 0.3 m were there already); the
    # second, 10 m, is gone
    assert change.markings_before_m == pytest.approx(20.0)
    assert change.markings_after_m == pytest.approx(15.0)
    assert change.markings_added_m == pytest.approx(4.7, abs=0.06)
    assert change.markings_removed_m == pytest.approx(10.0, abs=0.06)

    signs = {s.status: s for s in change.signs}
    assert change.sign_counts() == {"added": 1, "removed": 1, "moved": 1, "retyped": 1}
    assert signs["moved"].moved_m == pytest.approx(0.5) and signs["moved"].after == (5.5, 3, 2)
    assert (signs["retyped"].type_before, signs["retyped"].type_after) == ("unknown", "yield")
    assert signs["added"].after == (12, 3, 2) and signs["removed"].before == (30, 15, 2)
    assert not change.unchanged

    # backwards, everything turns round
    back = diff_versions(uri, "2", "1")
    assert back.drives_removed == ("d1",)
    assert {t.key: t.status for t in back.tiles}[(2, 0)] == "removed"
    assert back.markings_added_m == pytest.approx(change.markings_removed_m)
    # a version against itself: nothing
    assert diff_versions(uri, "2", "2").unchanged
    # with a looser tolerance the moved sign is the same sign
    loose = diff_versions(uri, settings=DiffSettings(tolerance_m=0.6))
    assert loose.sign_counts()["moved"] == 0

    picture = tmp_path / "diff.png"
    change.plot(picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(change.to_json())
    assert data["tiles"] == change.tile_counts()
    assert [t["key"] for t in data["tile_changes"]] == [[1, 0], [2, 0]]


def test_cli_prints_the_change_and_names_missing_versions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    uri = str(tmp_path / "map")
    make_map(uri, tmp_path)
    assert main(["hdmap", "diff", "--map", uri, "--plot", str(tmp_path / "d.png")]) == 0
    text = capsys.readouterr().out
    assert "version 000001 -> 000002" in text and "+ d1" in text
    assert "1 added, 1 changed, 0 removed, 1 the same" in text
    assert "200,000 new, 0 no longer" in text  # the raised tile's 40,000 and the new tile
    assert "sign at (8.0, -3.0): retyped unknown -> yield" in text
    assert "sign at (5.5, 3.0): moved 0.50 m" in text
    assert (tmp_path / "d.png").stat().st_size > 1000
    assert main(["hdmap", "diff", "--map", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drives_added"] == ["d1"]

    assert main(["hdmap", "diff", "--map", uri, "--from", "9"]) == 2
    assert "no version 9; the versions kept are 000001, 000002" in capsys.readouterr().err
    # the map's first version was built on an empty map: everything in it is added
    first = diff_versions(uri, after="1")
    assert first.before is None and first.drives_added == ("d0",)
    assert first.tile_counts() == {"added": 2, "removed": 0, "changed": 0, "same": 0}
    # every point of a marking counts the length it stands for: 20 m, not 20.1 (402 points
    # of 5 cm) -- on a real map 226.4 m of markings "added" to a map holding 224.3 m
    assert first.markings_added_m == pytest.approx(first.markings_after_m, abs=1e-9)
    assert first.markings_after_m == pytest.approx(20.0)
    assert first.sign_counts()["added"] == 3 and json.loads(first.to_json())["before"] is None
    # a version whose parent is no longer kept names the versions that are
    MapDir(uri).gc(keep=1)
    with pytest.raises(HdmapError, match="version 000002 has no kept parent"):
        diff_versions(uri)
    with pytest.raises(HdmapError, match="tolerance_m"):
        DiffSettings(tolerance_m=0.0)


@pytest.mark.parametrize(
    ("option", "said"),
    [
        # once a matplotlib traceback after the comparison
        (["--plot", "d.txt"], "d.txt: the extension .txt; the picture is written as PNG"),
        (["--plot", "d"], "d: no extension; the picture is written as PNG"),
        (["--plot", "no/such/dir/d.png"], "no directory"),
        # once an error naming match_m, which the command line does not set
        (
            ["--tolerance", "3"],
            "argument --tolerance: 3 m: give a distance above 0 and at most 2 m",
        ),
        (["--tolerance", "nan"], "argument --tolerance: nan m: give a distance above 0"),
        # once accepted, dropping the last 3 rows
        (["--top", "-3"], "argument --top: -3: give 0 or more rows"),
    ],
)
def test_cli_options_are_checked_before_the_versions_are_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    option: list[str],
    said: str,
) -> None:
    import adcloud.hdmap.diff as diff_module  # noqa: PLC0415

    def no_diff(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the versions were read")

    monkeypatch.setattr(diff_module, "diff_versions", no_diff)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["hdmap", "diff", "--map", str(tmp_path / "map"), *option])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert said in err and "match_m" not in err and "Traceback" not in err


def test_diff_of_a_map_of_one_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``adcloud hdmap diff`` after a map's first nightly build failed (exit 2): "version
    000001 has no kept parent to compare with; name the one to compare with (... the
    versions kept: 000001)" -- there was none to name, and a nightly script diffing every
    build failed on its first night. The first version is compared with an empty map."""
    monkeypatch.setenv("COLUMNS", "160")
    bag = tmp_path / "d0.bag"
    bag.write_bytes(random.Random(0).randbytes(2048))
    uri = str(tmp_path / "map")
    MapDir(uri).update([bag], version_one, settings={"tile_m": 20.0})
    picture = tmp_path / "first.png"
    assert main(["hdmap", "diff", "--map", uri, "--plot", str(picture)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "version none (an empty map) -> 000001" in text and "+ d0" in text
    assert "2 added, 0 changed, 0 removed, 0 the same" in text
    assert "sign at (30.0, 15.0): added (yield)" in text
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["hdmap", "diff", "--map", uri, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["before"], data["after"]) == (None, "000001")
    assert data["tiles"] == {"added": 2, "removed": 0, "changed": 0, "same": 0}


def test_cli_says_a_moved_sign_was_retyped_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sign that moved and changed type was printed as "moved 0.50 m" alone: the new
    type, which the vehicle reads, was left out (the JSON had it)."""
    bags = [make_bag_file(tmp_path / f"d{i}.bag", i) for i in range(2)]

    def with_sign(x: float, kind: str) -> Any:
        def build(plan: BuildPlan, staging: Staging) -> None:
            (staging.path / "semantic.geojson").write_text(semantic([], [(x, 3, kind)]))

        return build

    uri = str(tmp_path / "map")
    with MapDir(uri) as md:
        md.update(bags[:1], with_sign(5.0, "unknown"))
        md.update(bags, with_sign(5.5, "stop"))
    assert main(["hdmap", "diff", "--map", uri]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "sign at (5.5, 3.0): moved 0.50 m, retyped unknown -> stop" in said


def make_bag_file(path: Path, seed: int) -> Path:
    path.write_bytes(random.Random(seed).randbytes(2048))
    return path


def test_the_picture_formats(tmp_path: Path) -> None:
    uri = str(tmp_path / "map")
    make_map(uri, tmp_path)
    change = diff_versions(uri)
    with pytest.raises(HdmapError, match=r"d\.txt: the extension \.txt; .* \.png, \.svg, \.pdf"):
        change.plot(tmp_path / "d.txt")
    assert not (tmp_path / "d.txt").exists()
    change.plot(tmp_path / "d.SVG")
    assert (tmp_path / "d.SVG").read_text().lstrip().startswith("<?xml")
    for extension in PLOT_FORMATS:
        check_plot_path(tmp_path / f"d.{extension}")


def test_a_damaged_tile_is_named(tmp_path: Path) -> None:
    uri = str(tmp_path / "map")
    make_map(uri, tmp_path)
    tile_path = tmp_path / "map" / "versions" / "000002" / "grid" / "1_0.tif"
    tile_path.write_bytes(tile_path.read_bytes()[:500])  # cut off
    with pytest.raises(MapFormatError, match=r"versions/000002/grid/1_0\.tif: .*not a readable"):
        diff_versions(uri)
    semantic_path = tile_path.parents[1] / "semantic.geojson"
    tile_path.unlink()
    semantic_path.write_text("{not json")
    with pytest.raises(MapFormatError, match=r"000002/semantic\.geojson: not valid JSON"):
        diff_versions(uri)


def test_a_changed_tile_with_no_cell_in_both_versions_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table of tiles changed most printed "nan" heights for a tile whose old and new
    ground share no cell."""
    monkeypatch.setenv("COLUMNS", "160")

    def rows(observed: tuple[int, int]) -> Any:
        def build(plan: BuildPlan, staging: Staging) -> None:
            (staging.path / "grid").mkdir()
            write_grid_tile(tile((1, 0), {observed: 1.0}), staging.path / "grid/1_0.tif", ORIGIN)
            (staging.path / "semantic.geojson").write_text(semantic([], []))

        return build

    bags = []
    for i in range(2):
        bags.append(tmp_path / f"d{i}.bag")
        bags[-1].write_bytes(random.Random(i).randbytes(2048))
    uri = str(tmp_path / "map")
    with MapDir(uri) as md:
        md.update(bags[:1], rows((0, 100)), settings={"tile_m": 20.0})
        md.update(bags, rows((200, 300)), settings={"tile_m": 20.0})
    assert main(["hdmap", "diff", "--map", uri]) == 0
    text = capsys.readouterr().out
    assert "no cell in both" in text and "nan" not in text


def test_a_diff_closes_the_map_it_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A map on an adcloud store holds database connections and lock files; each diff
    (a notebook comparing every night's version) left its own open."""
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(tmp_path / "store"))
    uri = "local:///maps/city"
    make_map(uri, tmp_path)
    diff_versions(uri)  # the store's first use opens what stays open for the process
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        assert diff_versions(uri).after == "000002"
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_the_products_and_report_of_a_stored_map_close_the_map_they_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a diff: reading a store map's products (eval) or writing its report opened the
    map for its current version and left its connections and files open."""
    from adcloud.hdmap.evaluate import load_map_products  # noqa: PLC0415
    from adcloud.hdmap.report import write_map_report  # noqa: PLC0415

    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(tmp_path / "store"))
    uri = "local:///maps/city"
    make_map(uri, tmp_path)
    assert load_map_products(uri).source.endswith("000002")
    write_map_report(uri, tmp_path / "report")
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        assert load_map_products(uri).source.endswith("000002")
        write_map_report(uri, tmp_path / f"report{i}")
    assert len(os.listdir("/proc/self/fd")) <= fds
