"""Settings of one synthetic drive (:class:`DriveConfig`).

Build it directly, or with ``adcloud.config.load_settings(DriveConfig, "synth", ...)``
so that ``ADCLOUD_SYNTH_<FIELD>`` environment variables and a settings file's
``synth:`` section override the defaults.  :meth:`DriveConfig.validate` raises
:class:`~adcloud.synth.errors.SynthError` with a message naming the field; the
effective settings are written next to every drive (``<out>.truth/config.json``).

Units: seconds, metres, radians per second, metres per second squared, hertz.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

from adcloud.synth.errors import SynthError

__all__ = ["COMPRESSIONS", "FORMATS", "DriveConfig"]

#: Output formats: ROS 1 bag v2.0, ROS 2 bag with sqlite3 storage, ROS 2 bag with MCAP storage.
FORMATS = ("ros1", "ros2", "mcap")
#: Compressions each format accepts.
COMPRESSIONS = {"ros1": ("none", "bz2", "lz4"), "ros2": ("none",), "mcap": ("none", "zstd")}

_NS = 1_000_000_000


#: Sensor rates (Hz) whose period is a whole number of nanoseconds, offered in place of
#: one that has none (3 Hz: 333333333.3 ns).
_WHOLE_NS_RATES = (
    0.2,
    0.25,
    0.5,
    1,
    2,
    2.5,
    4,
    5,
    8,
    10,
    12.5,
    16,
    20,
    25,
    40,
    50,
    80,
    100,
    125,
    200,
    250,
    400,
    500,
    1000,
)


def _nearest_rates(hz: float) -> tuple[float, ...]:
    """The whole-nanosecond rates of :data:`_WHOLE_NS_RATES` just below and above ``hz``."""
    below = [r for r in _WHOLE_NS_RATES if r < hz]
    above = [r for r in _WHOLE_NS_RATES if r > hz]
    return tuple(v for v in (below[-1] if below else None, above[0] if above else None) if v)


def _type_problem(name: str, value: object, annotation: str) -> str | None:
    """Why ``value`` cannot be field ``name`` annotated ``annotation`` (``float``, ``int``,
    ``str``, ``bool`` or ``tuple[float, ...]``), or None.  A string where a number belongs
    made :meth:`DriveConfig.validate` fail with a ``TypeError``, a float where an integer
    belongs failed the drive half-way, and ``lidar="no"`` recorded the LiDAR."""

    def number(v: object, integer: bool) -> bool:
        if isinstance(v, (bool, np.bool_)):  # True is no count and no speed
            return False
        return isinstance(v, numbers.Integral if integer else numbers.Real)

    if annotation == "bool":
        ok, kind = isinstance(value, (bool, np.bool_)), "true or false"
    elif annotation == "int":
        ok, kind = number(value, True), "an integer"
    elif annotation == "float":
        ok, kind = number(value, False), "a number"
    elif annotation == "str":
        ok, kind = isinstance(value, str), "a string"
    elif annotation.startswith("tuple["):
        ok = isinstance(value, (tuple, list)) and all(number(v, False) for v in value)
        kind = "a tuple of numbers"
    else:
        return None
    return None if ok else f"{name} must be {kind}, not {value!r}"


@dataclass(frozen=True)
class DriveConfig:
    """Everything that decides the bytes of a synthetic drive (with the package versions).

    The same config gives the same bag, byte for byte (ROS 1, ROS 2 sqlite3 and MCAP) on
    the same platform; ``seed`` decides the world, the route start and every noise draw.
    """

    #: Simulated duration (s); every message has a record time in ``[0, seconds)`` after start.
    seconds: float = 60.0
    #: Seed of the world, the route and all noise.
    seed: int = 7
    #: ``ros1`` (.bag file), ``ros2`` (rosbag2 directory, sqlite3) or ``mcap`` (rosbag2, MCAP).
    format: str = "ros1"
    #: ``none``, ``bz2`` or ``lz4`` (ros1 chunks); ``none`` or ``zstd`` (mcap chunks).
    compression: str = "none"
    #: ROS 1 chunk size threshold (bytes); the writer holds at most about one chunk.
    chunk_bytes: int = 4 << 20
    #: Absolute time of the drive start (ns since the Unix epoch; default 2024-01-01T00:00Z).
    start_time_ns: int = 1_704_067_200 * _NS

    #: Cruise speed on straight roads (m/s); curves and stops slow the car down.
    speed_mps: float = 12.0
    #: Speed at the start of the drive (m/s).
    start_speed_mps: float = 8.0
    #: Longitudinal acceleration and braking limits (m/s^2), lateral acceleration limit.
    max_accel_mps2: float = 2.0
    max_decel_mps2: float = 3.0
    max_lateral_accel_mps2: float = 2.5
    #: Yaw-rate limit (rad/s).
    max_yaw_rate_rps: float = 0.6
    #: Stop for this long (s) at each stop sign on the route (0: drive through).
    stop_dwell_s: float = 1.5

    #: LiDAR on/off, beams (16..128), sweep rate (Hz), columns (firings) per sweep.
    lidar: bool = True
    lidar_beams: int = 32
    lidar_hz: float = 10.0
    lidar_columns: int = 1024
    #: Vertical field of view: elevation of the top and bottom beam (degrees).
    lidar_fov_up_deg: float = 15.0
    lidar_fov_down_deg: float = -25.0
    #: Maximum range (m), 1-sigma range noise (m), random dropout probability.
    lidar_max_range_m: float = 100.0
    lidar_range_noise_m: float = 0.02
    lidar_dropout: float = 0.01

    #: IMU rate (Hz), white noise per sample (1 sigma: m/s^2, rad/s), initial bias (1 sigma)
    #: and bias random walk (per sqrt(s)).
    imu_hz: float = 100.0
    imu_accel_noise: float = 0.02
    imu_gyro_noise: float = 0.002
    imu_accel_bias: float = 0.05
    imu_gyro_bias: float = 0.002
    imu_accel_bias_walk: float = 0.001
    imu_gyro_bias_walk: float = 1e-5

    #: Wheel odometry rate (Hz), speed and yaw-rate noise (1 sigma), initial scale error
    #: (fraction, e.g. 0.01 = wheel speeds 1 % too high) and scale drift (per sqrt(s)).
    odom_hz: float = 50.0
    odom_speed_noise: float = 0.02
    odom_yaw_rate_noise: float = 0.005
    odom_scale_error: float = 0.01
    odom_scale_drift: float = 0.002

    #: GPS rate (1..10 Hz), white horizontal noise per axis (m, 1 sigma; vertical 1.5x),
    #: slowly varying bias (m, 1 sigma, Gauss-Markov with ``gps_bias_tau_s``).
    gps_hz: float = 5.0
    gps_noise_m: float = 1.0
    gps_bias_m: float = 0.5
    gps_bias_tau_s: float = 60.0
    #: GPS outage: (start, duration) in s after the drive start; no fixes are published then.
    gps_outage: tuple[float, float] = (20.0, 10.0)
    #: Geographic origin of the map frame: latitude, longitude (degrees, WGS84), height (m).
    gps_origin: tuple[float, float, float] = (37.3875, -122.0575, 12.0)

    #: Camera on/off, image size (pixels), frame rate (Hz), horizontal field of view (degrees).
    camera: bool = True
    #: How many cameras, evenly spaced in yaw around the car from the front one; the first
    #: publishes on ``/camera/...``, camera ``k`` on ``/camera<k>/...`` (a rig for
    #: multi-camera perception replay).
    cameras: int = 1
    camera_width: int = 160
    camera_height: int = 120
    camera_hz: float = 5.0
    camera_hfov_deg: float = 90.0

    #: Rate (Hz) of the true poses (``/ground_truth/odom`` and ``poses.txt``).
    truth_hz: float = 100.0
    #: Write the 5 cm elevation/reflectance raster (``raster.npz``) around the driven route.
    truth_raster: bool = True
    truth_raster_res_m: float = 0.05
    #: The raster covers the driven route's bounding box grown by this margin (m).
    truth_margin_m: float = 25.0

    def __post_init__(self) -> None:
        # NumPy scalars (a seed from ``rng.integers``, a float32 duration) and lists as the
        # plain values they stand for: config.json could not hold them (the drive failed
        # at its very end), and ``np.int64(7) == 7`` gives the same drive anyway
        def plain(v: object) -> object:
            return v.item() if isinstance(v, np.generic) else v

        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, field.name, tuple(plain(v) for v in value))
            else:
                object.__setattr__(self, field.name, plain(value))

    def validate(self) -> DriveConfig:
        """Return ``self`` if every setting is usable, else raise :class:`SynthError`."""
        problems: list[str] = []

        def need(ok: bool, text: str) -> None:
            if not ok:
                problems.append(text)

        for field in fields(self):
            problem = _type_problem(field.name, getattr(self, field.name), str(field.type))
            if problem is not None:
                problems.append(problem)
        if problems:  # the range checks below compare numbers
            raise SynthError("invalid synth settings: " + "; ".join(problems))
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            # tuples too: a NaN origin height made every GPS fix NaN, a NaN outage start
            # dropped the outage; both passed into config.json as non-JSON NaN
            items = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in items):
                problems.append(f"{name} must be finite, not {value}")
        need(0 < self.seconds <= 1e6, f"seconds must be in (0, 1e6], not {self.seconds}")
        # time is kept in whole nanoseconds: a shorter drive would be an empty bag
        need(
            not 0 < self.seconds < 1e-9,
            f"seconds must be at least 1e-9 (one nanosecond), not {self.seconds}",
        )
        need(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), not {self.seed}")
        need(
            self.format in FORMATS,
            f"format must be one of {', '.join(FORMATS)}, not {self.format!r}",
        )
        allowed = COMPRESSIONS.get(self.format, ())
        need(
            self.format not in FORMATS or self.compression in allowed,
            f"compression {self.compression!r} is not available for format {self.format!r} "
            f"(choose from {', '.join(allowed)})",
        )
        need(self.chunk_bytes >= 4096, f"chunk_bytes must be >= 4096, not {self.chunk_bytes}")
        # ROS stamps hold seconds in 32 bits (int32 in ROS 2's builtin_interfaces/Time)
        last_s = (
            (self.start_time_ns + self.seconds * _NS) / _NS if math.isfinite(self.seconds) else 0
        )
        need(
            self.start_time_ns >= 0 and last_s < 2**31,
            f"start_time_ns must be >= 0 and the drive must end before 2038-01-19 "
            f"(ROS time stamps hold 32-bit seconds), not {self.start_time_ns}",
        )
        need(0 < self.speed_mps <= 40, f"speed_mps must be in (0, 40], not {self.speed_mps}")
        need(
            0 <= self.start_speed_mps <= 40,
            f"start_speed_mps must be in [0, 40], not {self.start_speed_mps}",
        )
        for name in ("max_accel_mps2", "max_decel_mps2", "max_lateral_accel_mps2"):
            value = getattr(self, name)
            need(0 < value <= 10, f"{name} must be in (0, 10], not {value}")
        need(
            0 < self.max_yaw_rate_rps <= 2,
            f"max_yaw_rate_rps must be in (0, 2], not {self.max_yaw_rate_rps}",
        )
        need(self.stop_dwell_s >= 0, f"stop_dwell_s must be >= 0, not {self.stop_dwell_s}")
        need(
            16 <= self.lidar_beams <= 128,
            f"lidar_beams must be between 16 and 128, not {self.lidar_beams}",
        )
        need(1 <= self.lidar_hz <= 20, f"lidar_hz must be in [1, 20], not {self.lidar_hz}")
        need(
            64 <= self.lidar_columns <= 4096,
            f"lidar_columns must be in [64, 4096], not {self.lidar_columns}",
        )
        need(
            -60 <= self.lidar_fov_down_deg < self.lidar_fov_up_deg <= 60,
            "lidar_fov_down_deg < lidar_fov_up_deg must hold, both in [-60, 60] degrees, not "
            f"lidar_fov_down_deg={self.lidar_fov_down_deg}, "
            f"lidar_fov_up_deg={self.lidar_fov_up_deg}",
        )
        need(
            5 <= self.lidar_max_range_m <= 300,
            f"lidar_max_range_m must be in [5, 300], not {self.lidar_max_range_m}",
        )
        need(
            self.lidar_range_noise_m >= 0,
            f"lidar_range_noise_m must be >= 0, not {self.lidar_range_noise_m}",
        )
        need(
            0 <= self.lidar_dropout < 1,
            f"lidar_dropout must be in [0, 1), not {self.lidar_dropout}",
        )
        need(10 <= self.imu_hz <= 1000, f"imu_hz must be in [10, 1000], not {self.imu_hz}")
        need(1 <= self.odom_hz <= 1000, f"odom_hz must be in [1, 1000], not {self.odom_hz}")
        need(1 <= self.gps_hz <= 10, f"gps_hz must be between 1 and 10, not {self.gps_hz}")
        need(1 <= self.truth_hz <= 1000, f"truth_hz must be in [1, 1000], not {self.truth_hz}")
        for name in (
            "imu_accel_noise",
            "imu_gyro_noise",
            "imu_accel_bias",
            "imu_gyro_bias",
            "imu_accel_bias_walk",
            "imu_gyro_bias_walk",
            "odom_speed_noise",
            "odom_yaw_rate_noise",
            "odom_scale_drift",
            "gps_noise_m",
            "gps_bias_m",
        ):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, not {getattr(self, name)}")
        need(
            abs(self.odom_scale_error) < 0.2,
            f"odom_scale_error must be within (-0.2, 0.2), not {self.odom_scale_error}",
        )
        need(self.gps_bias_tau_s > 0, f"gps_bias_tau_s must be > 0, not {self.gps_bias_tau_s}")
        need(
            len(self.gps_outage) == 2 and self.gps_outage[1] >= 0,
            f"gps_outage must be (start, duration) with duration >= 0, not {self.gps_outage}",
        )
        need(
            len(self.gps_origin) == 3
            and -85 <= self.gps_origin[0] <= 85
            and -180 <= self.gps_origin[1] <= 180,
            "gps_origin must be (latitude in [-85, 85], longitude in [-180, 180], height), "
            f"not {self.gps_origin}",
        )
        need(
            16 <= self.camera_width <= 1920,
            f"camera_width must be in [16, 1920] pixels, not {self.camera_width}",
        )
        need(
            16 <= self.camera_height <= 1080,
            f"camera_height must be in [16, 1080] pixels, not {self.camera_height}",
        )
        need(0.2 <= self.camera_hz <= 60, f"camera_hz must be in [0.2, 60], not {self.camera_hz}")
        need(
            isinstance(self.cameras, int) and 1 <= self.cameras <= 8,
            f"cameras must be an integer in [1, 8], not {self.cameras!r}",
        )
        need(
            self.camera or self.cameras == 1,
            f"cameras={self.cameras} with camera off records no camera at all; turn the "
            "camera on (drop --no-camera) or leave cameras out",
        )
        need(
            10 <= self.camera_hfov_deg <= 150,
            f"camera_hfov_deg must be in [10, 150], not {self.camera_hfov_deg}",
        )
        need(
            0.01 <= self.truth_raster_res_m <= 1,
            f"truth_raster_res_m must be in [0.01, 1], not {self.truth_raster_res_m}",
        )
        need(
            0 <= self.truth_margin_m <= 200,
            f"truth_margin_m must be in [0, 200], not {self.truth_margin_m}",
        )
        for name, hz in (
            ("lidar_hz", self.lidar_hz),
            ("imu_hz", self.imu_hz),
            ("odom_hz", self.odom_hz),
            ("gps_hz", self.gps_hz),
            ("camera_hz", self.camera_hz),
            ("truth_hz", self.truth_hz),
        ):
            if hz > 0 and abs(_NS / hz - round(_NS / hz)) > 1e-6:
                problems.append(
                    f"{name}={hz} Hz has no whole-nanosecond period; choose "
                    + " or ".join(f"{r:g}" for r in _nearest_rates(hz))
                    + " Hz instead"
                )
        if problems:
            raise SynthError("invalid synth settings: " + "; ".join(problems))
        return self

    def period_ns(self, hz: float) -> int:
        """The sample period (ns) of a sensor running at ``hz``."""
        return round(_NS / hz)

    @property
    def duration_ns(self) -> int:
        """The simulated duration in ns."""
        return round(self.seconds * _NS)
