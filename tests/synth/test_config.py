"""DriveConfig: validation messages and layered overrides."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adcloud.config import load_settings
from adcloud.errors import AdcloudError
from adcloud.synth import DriveConfig, DriveResult, SynthError, generate_drive
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
    ("name", "value"),
    [
        ("camera_width", 8),
        ("camera_height", 4000),
        ("max_yaw_rate_rps", 3.0),
        ("stop_dwell_s", -1.0),
        ("lidar_max_range_m", 1000.0),
        ("lidar_range_noise_m", -0.5),
        ("lidar_dropout", 1.5),
        ("imu_gyro_noise", -0.25),
        ("odom_scale_error", 0.5),
        ("gps_bias_tau_s", -2.0),
        ("gps_outage", (3.0, -1.0)),
        ("gps_origin", (95.0, 0.0, 0.0)),
        ("camera_hz", 0.1),
        ("camera_hfov_deg", 170.0),
        ("truth_raster_res_m", 2.0),
        ("truth_margin_m", 500.0),
        ("lidar_fov_up_deg", -30.0),
    ],
)
def test_a_bad_setting_is_named_with_the_value_given(name: str, value: object) -> None:
    """``camera_width=8`` said "camera size must be within 16x16 .. 1920x1080 pixels" (no
    field to set, in an ADCLOUD_SYNTH_* variable or a settings file) and most range errors
    left out the value that was refused."""
    with pytest.raises(SynthError) as info:
        DriveConfig(**{name: value}).validate()  # type: ignore[arg-type]
    text = str(info.value)
    assert f"{name}" in text and str(value) in text, text


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


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"lidar": "no"}, "lidar must be true or false, not 'no'"),
        ({"seconds": "5"}, "seconds must be a number, not '5'"),
        ({"lidar_beams": 16.5}, "lidar_beams must be an integer, not 16.5"),
        ({"seed": 7.5}, "seed must be an integer, not 7.5"),
        ({"cameras": True}, "cameras must be an integer, not True"),
        ({"gps_outage": 5}, "gps_outage must be a tuple of numbers, not 5"),
        ({"gps_outage": (None, 1.0)}, "gps_outage must be a tuple of numbers"),
    ],
)
def test_settings_of_the_wrong_type_are_refused_before_anything_is_written(
    change: dict[str, object], words: str, tmp_path: Path
) -> None:
    """A notebook's ``DriveConfig(lidar="no")`` recorded the LiDAR (and config.json said
    ``"no"``, which reads back as off); ``seconds="5"`` failed with a bare ``TypeError``;
    ``lidar_beams=16.5`` or ``seed=7.5`` passed validation and failed the drive half-way."""
    config = DriveConfig(**{"seconds": 0.2, **change})  # type: ignore[arg-type]
    with pytest.raises(SynthError, match="invalid synth settings") as info:
        config.validate()
    assert words in str(info.value)
    with pytest.raises(SynthError, match="invalid synth settings"):
        generate_drive(config, tmp_path / "typed.bag")
    assert list(tmp_path.iterdir()) == []


def test_numpy_scalars_make_the_drive_their_plain_values_make(tmp_path: Path) -> None:
    """A seed from ``rng.integers`` or a float32 duration passed validation, and the whole
    drive was computed before config.json failed on them ("Object of type int64 is not JSON
    serializable"), leaving nothing."""
    config = DriveConfig(
        seconds=np.float32(0.25),  # type: ignore[arg-type]
        seed=np.int64(4),  # type: ignore[arg-type]
        lidar=np.bool_(False),  # type: ignore[arg-type]
        camera=False,
        truth_raster=False,
        gps_outage=[np.float64(0.1), 0.05],  # type: ignore[arg-type]
    )
    assert config == DriveConfig(
        seconds=float(np.float32(0.25)),
        seed=4,
        lidar=False,
        camera=False,
        truth_raster=False,
        gps_outage=(0.1, 0.05),
    )
    drive = generate_drive(config, tmp_path / "numpy.bag")
    written = json.loads((drive.truth / "config.json").read_text())["synth"]
    assert load_settings(DriveConfig, "synth", environ={}, **written) == config


@pytest.mark.parametrize(
    ("change", "offered"),
    [
        ({"gps_hz": 3}, "gps_hz=3 Hz has no whole-nanosecond period; choose 2.5 or 4 Hz"),
        ({"imu_hz": 333.3}, "imu_hz=333.3 Hz has no whole-nanosecond period; choose 250 or 400"),
        ({"camera_hz": 0.3}, "camera_hz=0.3 Hz has no whole-nanosecond period; choose 0.25 or"),
    ],
)
def test_a_rate_without_a_whole_nanosecond_period_is_offered_ones_that_have_one(
    change: dict[str, object], offered: str
) -> None:
    """The message said only what was wrong with the rate, not which rates work."""
    with pytest.raises(SynthError) as info:
        DriveConfig(**change).validate()  # type: ignore[arg-type]
    assert offered in str(info.value)
    rate = float(str(info.value).split("choose ")[1].split(" ")[0])
    DriveConfig(**{next(iter(change)): rate}).validate()  # type: ignore[arg-type]
