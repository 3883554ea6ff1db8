"""DriveConfig: validation messages and layered overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adcloud.config import load_settings
from adcloud.errors import AdcloudError
from adcloud.synth import DriveConfig, DriveResult, SynthError
from tests.synth.conftest import SMALL


def test_defaults_are_valid() -> None:
    config = DriveConfig().validate()
    assert (config.lidar_beams, config.lidar_hz, config.imu_hz, config.odom_hz) == (
        32,
        10.0,
        100.0,
        50.0,
    )
    assert config.format == "ros1"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"lidar_beams": 8}, "lidar_beams must be between 16 and 128"),
        ({"lidar_beams": 256}, "lidar_beams must be between 16 and 128"),
        ({"format": "bag"}, "format must be one of ros1, ros2, mcap"),
        ({"compression": "zstd"}, "compression 'zstd' is not available for format 'ros1'"),
        ({"format": "ros2", "compression": "lz4"}, "not available for format 'ros2'"),
        ({"gps_hz": 20.0}, "gps_hz must be between 1 and 10"),
        ({"seconds": 0.0}, "seconds must be in"),
        ({"seconds": 1e-10}, "seconds must be at least 1e-9"),
        ({"imu_hz": 7.0}, "imu_hz must be in"),
        ({"camera_hz": 7.0}, "camera_hz=7.0 Hz has no whole-nanosecond period"),
        ({"gps_outage": (3.0, -1.0)}, "gps_outage"),
        ({"cameras": 0}, "cameras must be an integer in [1, 8], not 0"),
        ({"cameras": 4, "camera": False}, "cameras=4 with camera off records no camera"),
        ({"cameras": 9}, "cameras must be an integer in [1, 8], not 9"),
        ({"seed": -1}, "seed must be in [0, 2**63), not -1"),
    ],
)
def test_bad_settings_raise_synth_error(change: dict[str, object], words: str) -> None:
    with pytest.raises(SynthError, match="invalid synth settings") as info:
        DriveConfig(**change).validate()  # type: ignore[arg-type]
    assert words in str(info.value)
    assert isinstance(info.value, AdcloudError)


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("ADCLOUD_SYNTH_GPS_ORIGIN", "37.3875,-122.0575,nan", "gps_origin must be finite"),
        ("ADCLOUD_SYNTH_GPS_OUTAGE", "nan,5", "gps_outage must be finite"),
        ("ADCLOUD_SYNTH_GPS_OUTAGE", "0,inf", "gps_outage must be finite"),
    ],
)
def test_non_finite_values_inside_tuple_settings_are_refused(
    variable: str, value: str, words: str
) -> None:
    """A NaN origin height made every GPS fix NaN (latitude and longitude too) and a NaN
    outage start silently dropped the outage; both passed validation."""
    config = load_settings(DriveConfig, "synth", environ={variable: value})
    with pytest.raises(SynthError, match=words):
        config.validate()


def test_environment_and_file_override(tmp_path: Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("synth:\n  seconds: 12\n  lidar_beams: 64\n")
    env = {
        "ADCLOUD_SYNTH_LIDAR_BEAMS": "128",
        "ADCLOUD_SYNTH_GPS_OUTAGE": "5,2.5",
        "ADCLOUD_SYNTH_CAMERA": "off",
    }
    config = load_settings(DriveConfig, "synth", file=settings, environ=env, seed=9)
    assert config.seconds == 12.0
    assert config.lidar_beams == 128
    assert config.gps_outage == (5.0, 2.5)
    assert config.camera is False
    assert config.seed == 9
    config.validate()


def test_effective_config_is_written_next_to_the_drive(small_drive: DriveResult) -> None:
    written = json.loads((small_drive.truth / "config.json").read_text())["synth"]
    rebuilt = load_settings(DriveConfig, "synth", environ={}, **written)
    assert rebuilt == SMALL
