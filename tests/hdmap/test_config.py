"""The settings of a map build (adcloud.hdmap.config): sensor mounts, tile carrying, hashing."""

from __future__ import annotations

import math
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from adcloud.cli import build_parser
from adcloud.config import load_settings
from adcloud.errors import ConfigError
from adcloud.hdmap.command import _settings
from adcloud.hdmap.config import HdmapSettings, parse_mounts


def _expected(xyz: list[float], rpy: list[float]) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = Rotation.from_euler("xyz", rpy, degrees=True).as_matrix()
    out[:3, 3] = xyz
    return out


def test_mount_entry_gives_the_base_link_transform() -> None:
    mounts = parse_mounts(["/lidar=1.2,0,1.9,10,-5,90", "gps = 0, 0, 1.75, 0, 0, 0"])
    assert sorted(mounts) == ["gps", "lidar"]
    np.testing.assert_allclose(mounts["lidar"], _expected([1.2, 0, 1.9], [10, -5, 90]))
    np.testing.assert_allclose(mounts["gps"], _expected([0, 0, 1.75], [0, 0, 0]))
    assert parse_mounts([]) == {}


@pytest.mark.parametrize(
    ("entry", "what"),
    [
        ("lidar 1,2,3,0,0,0", "has no '='"),
        ("lidar=1,2,3,0,0", "has 5 values; give 6"),
        ("lidar=1,2,3,0,0,0,7", "has 7 values; give 6"),
        ("lidar=1,two,3,0,0,0", "'two' is not a number"),
        ("lidar=1,2,3,0,0,nan", "must be finite"),
        ("=1,2,3,0,0,0", "names no frame"),
        ("base_link=1,2,3,0,0,0", "reference frame"),
    ],
)
def test_bad_mount_entries_are_named(entry: str, what: str) -> None:
    with pytest.raises(ConfigError, match=r"hdmap\.mounts: entry") as info:
        parse_mounts([entry])
    assert repr(entry) in str(info.value) and what in str(info.value)
    with pytest.raises(ConfigError, match=r"hdmap\.mounts"):
        HdmapSettings(mounts=(entry,))


def test_a_frame_mounted_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="'lidar' is mounted twice"):
        parse_mounts(["lidar=1,2,3,0,0,0", "lidar=0,0,0,0,0,0"])


def test_mounts_from_the_environment_and_a_file(tmp_path: Path) -> None:
    env = {"ADCLOUD_HDMAP_MOUNTS": "lidar=1.2,0,1.9,0,0,90,gps=0,0,1.75,0,0,0"}
    settings = load_settings(HdmapSettings, "hdmap", environ=env)
    assert settings.mounts == ("lidar=1.2,0,1.9,0,0,90", "gps=0,0,1.75,0,0,0")
    np.testing.assert_allclose(settings.extrinsics["lidar"], _expected([1.2, 0, 1.9], [0, 0, 90]))
    path = tmp_path / "build.yaml"
    path.write_text("hdmap:\n  mounts: ['lidar=1,2,3,0,0,0']\n")
    from_file = load_settings(HdmapSettings, "hdmap", file=path, environ={})
    assert from_file.mounts == ("lidar=1,2,3,0,0,0",)
    bad = {"ADCLOUD_HDMAP_MOUNTS": "lidar=1,x,3,0,0,0"}
    with pytest.raises(ConfigError, match=r"entry 'lidar=1,x,3,0,0,0': 'x' is not a number"):
        load_settings(HdmapSettings, "hdmap", environ=bad)
    assert pickle.loads(pickle.dumps(settings.extrinsics)).keys() == {"lidar", "gps"}


def test_default_has_no_mounts() -> None:
    assert HdmapSettings().mounts == () and HdmapSettings().extrinsics == {}


def test_merge_all_tiles_turns_carrying_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--merge-all-tiles`` and ``ADCLOUD_HDMAP_CARRY_TILES`` both reach the setting."""
    monkeypatch.delenv("ADCLOUD_HDMAP_CARRY_TILES", raising=False)
    build = ["hdmap", "build", "--bags", "drives/", "--map", "maps/city"]
    assert _settings(build_parser().parse_args(build)).carry_tiles is True
    args = build_parser().parse_args([*build, "--merge-all-tiles"])
    assert _settings(args).carry_tiles is False
    monkeypatch.setenv("ADCLOUD_HDMAP_CARRY_TILES", "false")
    assert _settings(build_parser().parse_args(build)).carry_tiles is False


def test_hash_threads_reach_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ADCLOUD_HDMAP_HASH_THREADS`` decides how many bags ``adcloud hdmap build`` hashes
    at a time: 1 hashes on the main thread, 2 on the plan's hashing threads."""
    from adcloud.cli import main  # noqa: PLC0415
    from adcloud.hdmap import mapdir  # noqa: PLC0415

    bags = tmp_path / "bags"
    bags.mkdir()
    for i in range(3):
        (bags / f"d{i}.bag").write_bytes(bytes([i]) * 1000)
    real = mapdir._content_hash
    threads: list[str] = []

    def spy(files: object, path: str, chunk: int, control: object = None) -> tuple[str, int]:
        threads.append(threading.current_thread().name)
        return real(files, path, chunk, control)  # type: ignore[arg-type]

    monkeypatch.setattr(mapdir, "_content_hash", spy)
    build = ["hdmap", "build", "--bags", str(bags), "--map", str(tmp_path / "map"), "--dry-run"]
    build.append("--skip-bad-bags")  # the bags are not real bags: only their hashes matter
    monkeypatch.setenv("ADCLOUD_HDMAP_HASH_THREADS", "1")
    assert main(build) == 0
    assert threads == ["MainThread"] * 3
    threads.clear()
    monkeypatch.setenv("ADCLOUD_HDMAP_HASH_THREADS", "2")
    assert main(build) == 0
    assert len(threads) == 3 and all(name.startswith("hdmap-hash") for name in threads)
    monkeypatch.setenv("ADCLOUD_HDMAP_HASH_THREADS", "0")
    with pytest.raises(ConfigError, match=r"hdmap\.hash_threads: 0 must be >= 1"):
        load_settings(HdmapSettings, "hdmap")


@pytest.mark.parametrize("command", ["build", "info", "export", "eval", "diff", "rollback"])
def test_the_cli_refuses_a_map_in_memory(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # memory:// lives in one process: a map built there would be gone when the command exits
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["hdmap", command, "--map", "memory://m"])
    assert info.value.code == 2
    assert "memory:// lives inside one process" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("resolution", r"hdmap\.resolution: .* is outside"),
        ("tile_m", r"hdmap\.tile_m: .* must be a finite size of >= 10 cells"),
        ("segment_s", r"hdmap\.segment_s: .* must be finite and > 1 s"),
    ],
)
def test_sizes_must_be_finite(field: str, message: str, value: str) -> None:
    """A NaN or infinite size fails every range test (a comparison with NaN is False),
    not a build later (``round(nan)`` in the job)."""
    env = {f"ADCLOUD_HDMAP_{field.upper()}": value}
    with pytest.raises(ConfigError, match=message):
        load_settings(HdmapSettings, "hdmap", environ=env)


def test_the_origin_is_all_three_values_or_none() -> None:
    assert HdmapSettings().origin is None
    assert HdmapSettings(origin_lat=37.4, origin_lon=-122.1, origin_alt=0.0).origin == (
        37.4,
        -122.1,
        0.0,
    )
    with pytest.raises(ConfigError, match=r"hdmap\.origin: origin_alt missing \(origin_lat="):
        HdmapSettings(origin_lat=37.4, origin_lon=-122.1)
    with pytest.raises(ConfigError, match=r"origin_lat, origin_lon missing \(origin_alt=12"):
        load_settings(HdmapSettings, "hdmap", environ={"ADCLOUD_HDMAP_ORIGIN_ALT": "12"})


@pytest.mark.parametrize(
    "origin",
    [
        (95.0, 10.0, 0.0),
        (-90.5, 10.0, 0.0),
        (37.0, 500.0, 0.0),
        (37.0, -181.0, 0.0),
        (37.0, 10.0, math.inf),
        (math.inf, 10.0, 0.0),
        (37.0, -math.inf, 0.0),
    ],
)
def test_an_impossible_origin_is_refused_before_the_build(
    origin: tuple[float, float, float],
) -> None:
    """Refused by the settings, in the wording the build's Spark tasks would fail with."""
    lat, lon, alt = origin
    with pytest.raises(
        ConfigError,
        match=rf"hdmap\.origin: origin \({lat}, {lon}, {alt}\) is not a WGS84 latitude, "
        "longitude and height",
    ):
        HdmapSettings(origin_lat=lat, origin_lon=lon, origin_alt=alt)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("resolution", "0.05", r"hdmap\.resolution must be a number, got '0\.05' \(str\)"),
        ("origin_lat", None, r"hdmap\.origin_lat must be a number, got None"),
        ("keep_versions", 2.5, r"hdmap\.keep_versions must be a whole number \(an int\), got 2\.5"),
        (
            "keep_versions",
            True,
            r"hdmap\.keep_versions must be a whole number .* got True \(bool\)",
        ),
        ("hash_threads", 2.5, r"hdmap\.hash_threads must be a whole number .* got 2\.5"),
        ("segment_s", False, r"hdmap\.segment_s must be a number, got False \(bool\)"),
        ("carry_tiles", "false", r"hdmap\.carry_tiles must be True or False, got 'false'"),
        ("lidar_topic", 7, r"hdmap\.lidar_topic must be a string, got 7 \(int\)"),
        ("mounts", [("lidar", 1)], r"hdmap\.mounts must be a list of strings"),
    ],
)
def test_the_python_api_gets_the_types_checked(field: str, value: object, message: str) -> None:
    """The file and environment loader converts text; a notebook's ``HdmapSettings(...)``
    is checked here: ``resolution="0.05"`` was a raw TypeError, and ``keep_versions=2.5``
    was taken -- to fail after the build had committed its version."""
    with pytest.raises(ConfigError, match=message):
        HdmapSettings(**{field: value})  # type: ignore[arg-type]


def test_numbers_of_other_types_are_taken_as_the_field_says() -> None:
    settings = HdmapSettings(
        resolution=np.float32(0.1),  # type: ignore[arg-type]
        tile_m=40,
        keep_versions=np.int64(3),  # type: ignore[arg-type]
        mounts=["lidar=1,0,2,0,0,0"],  # type: ignore[arg-type]
    )
    assert type(settings.resolution) is float and settings.resolution == pytest.approx(0.1)
    assert type(settings.tile_m) is float and settings.tile_m == 40.0
    assert type(settings.keep_versions) is int and settings.keep_versions == 3
    assert settings.mounts == ("lidar=1,0,2,0,0,0",)


def test_a_typo_in_a_stage_name_of_a_variable_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``ADCLOUD_HDMAP_LANLET_CONNECT_GAP_M=25`` was ignored without a word: each section's
    check sees only the names under its own prefix. The real variables of every stage are
    not mistaken for typos of each other (grid and cloud both have max_range)."""
    from adcloud.hdmap.config import HdmapSettings  # noqa: PLC0415
    from adcloud.hdmap.job import StageSettings  # noqa: PLC0415

    environ = {
        "ADCLOUD_HDMAP_LANLET_CONNECT_GAP_M": "25",
        "ADCLOUD_HDMAP_GIRD_MIN_POINTS": "3",
        "ADCLOUD_HDMAP_GRID_MAX_RANGE": "20",
        "ADCLOUD_HDMAP_CLOUD_MAX_RANGE": "25",
        "ADCLOUD_HDMAP_LANELET_CONNECT_GAP_M": "30",
    }
    with caplog.at_level("WARNING", logger="adcloud.config"):
        stages = StageSettings.load(HdmapSettings(), environ=environ)
    said = [r.getMessage() for r in caplog.records]
    assert (stages.grid.max_range, stages.lanelet.connect_gap_m) == (20.0, 30.0)
    assert said == [
        "ADCLOUD_HDMAP_LANLET_CONNECT_GAP_M is not a setting: did you mean "
        "ADCLOUD_HDMAP_LANELET_CONNECT_GAP_M?",
        "ADCLOUD_HDMAP_GIRD_MIN_POINTS is not a setting: did you mean "
        "ADCLOUD_HDMAP_GRID_MIN_POINTS?",
    ]


def test_keep_versions_zero_keeps_every_version_as_the_map_directory_does() -> None:
    """MapDirSettings took 0 (keep all) while the build's settings refused it."""
    assert HdmapSettings(keep_versions=0).keep_versions == 0
    with pytest.raises(ConfigError, match=r"keep_versions: give 1 or more .* or 0 .* not -1"):
        HdmapSettings(keep_versions=-1)
