"""``adcloud synth``: generate a synthetic drive with ground truth from the command line.

:func:`add_parser` registers the sub-command on the ``adcloud`` parser; :func:`run` is
its entry point and :func:`run_demo` the part of ``adcloud demo`` that makes a sample
drive.  Only this module prints; the library raises
:class:`~adcloud.synth.errors.SynthError`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adcloud._argtypes import local_path
from adcloud.config import load_settings
from adcloud.synth.config import COMPRESSIONS, FORMATS, DriveConfig
from adcloud.synth.drive import DriveResult, generate_drive

__all__ = ["add_parser", "run", "run_demo"]

_NS = 1_000_000_000

_EPILOG = """\
examples:
  adcloud synth --seconds 60 --seed 7 --format ros1 --out drive.bag
  adcloud synth --seconds 5 --beams 16 --no-camera --format mcap --out drive_mcap
  adcloud synth --seconds 10 --no-lidar --cameras 4 --out rig.bag
  adcloud synth --seconds 600 --compression lz4 --out long.bag --overwrite
  ADCLOUD_SYNTH_GPS_NOISE_M=3 adcloud synth --seconds 30 --out noisy.bag

Writes the bag (a .bag file for ros1; a rosbag2 directory for ros2/mcap: --out drive_mcap
writes drive_mcap/drive_mcap.mcap and drive_mcap/metadata.yaml, so a name ending in
.mcap, .db3 or .bag is refused for them) and its
ground truth in <out>.truth/ (poses.txt, map.geojson, raster.npz, world.json,
config.json, and the sensors' errors: gps.csv, imu_bias.csv, odom_scale.csv; see
docs/synth-truth-format.md).  The same settings give the same bytes.
Any DriveConfig field can also be set with ADCLOUD_SYNTH_<FIELD> or a --config file's
'synth:' section.
"""


def add_parser(subparsers: Any) -> None:
    """Register ``synth`` on an ``argparse`` sub-parsers object (sets ``func=run``)."""
    p = subparsers.add_parser(
        "synth",
        help="generate a synthetic drive (ROS bag + ground truth) of any length",
        description="Drive a car through a procedural world (roads with lanes and an "
        "intersection loop, curbs, hilly terrain, poles, signs, buildings, trees, other cars) "
        "and record LiDAR, IMU, wheel odometry, GPS, a camera and TF into a ROS bag, with the "
        "true poses, the true map and a 5 cm elevation/reflectance raster beside it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        type=local_path("the drive"),
        help="bag file (ros1: drive.bag) or bag directory (ros2, mcap: drive/ holding "
        "drive/drive.db3 or drive/drive.mcap and metadata.yaml): a local path or file:// URL",
    )
    p.add_argument(
        "--seconds", type=float, metavar="S", help="simulated duration in s (default 60)"
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="seed of the world, the route and the noise (default 7)",
    )
    p.add_argument("--format", choices=FORMATS, help="ros1 (default), ros2 (sqlite3) or mcap")
    compressions = sorted({c for cs in COMPRESSIONS.values() for c in cs})
    p.add_argument(
        "--compression", choices=compressions, help="ros1: none, bz2, lz4; mcap: none, zstd"
    )
    p.add_argument(
        "--beams",
        type=int,
        dest="lidar_beams",
        metavar="N",
        help="LiDAR beams, 16..128 (default 32)",
    )
    p.add_argument(
        "--columns",
        type=int,
        dest="lidar_columns",
        metavar="N",
        help="LiDAR firings per sweep (default 1024)",
    )
    p.add_argument(
        "--gps-hz",
        type=float,
        dest="gps_hz",
        metavar="HZ",
        # "1..10" promised 3, 6, 7 and 9, which have no whole-nanosecond period and are refused
        help="GPS rate in Hz: 1, 2, 2.5, 4, 5, 8 or 10 (1..10 with a whole-nanosecond "
        "period; default 5)",
    )
    p.add_argument(
        "--speed",
        type=float,
        dest="speed_mps",
        metavar="M_S",
        help="cruise speed in m/s (default 12)",
    )
    p.add_argument(
        "--lidar",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="record the LiDAR (default on)",
    )
    p.add_argument(
        "--camera",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="record the camera (default on)",
    )
    p.add_argument(
        "--cameras",
        type=int,
        help="cameras evenly spaced in yaw around the car (1-8, default 1): the first on "
        "/camera/..., camera k on /camera<k>/... (a multi-camera perception rig)",
    )
    p.add_argument(
        "--no-raster",
        dest="truth_raster",
        action="store_const",
        const=False,
        help="skip raster.npz",
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML/JSON settings file with a 'synth:' section"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing bag and truth directory"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


_FIELDS = (
    "seconds",
    "seed",
    "format",
    "compression",
    "lidar_beams",
    "lidar_columns",
    "gps_hz",
    "speed_mps",
    "lidar",
    "camera",
    "cameras",
    "truth_raster",
)


def _progress_bar(total_ns: int, quiet: bool) -> tuple[Any, Any]:
    """A bar over the simulated time and the ``progress`` callback that moves it.

    The bar counts whole nanoseconds (shown as seconds), the drive's own unit: a float
    total rounded to 1 ms (0.123 of a 0.1234 s drive) was overrun by the last window, and
    tqdm warned "clamping frac" and showed a negative time left."""
    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(
        total=total_ns,
        unit="s",
        unit_scale=1 / _NS,
        desc="simulated",
        disable=quiet,
        bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s [{elapsed}<{remaining}]",
    )
    done = [0]

    def update(t: float) -> None:
        now = min(round(t * _NS), total_ns)
        bar.update(now - done[0])
        done[0] = now

    return bar, update


def _report(result: DriveResult, console: Console) -> None:
    table = Table(title=f"{result.bag} ({result.format}, {result.bytes / 1e6:.1f} MB)")
    table.add_column("topic")
    table.add_column("messages", justify="right")
    for topic, count in result.messages.items():
        table.add_row(topic, f"{count:,}")
    console.print(table)
    ratio = result.seconds / result.wall_s if result.wall_s > 0 else float("inf")
    console.print(
        f"simulated {result.seconds:g} s in {result.wall_s:.1f} s wall ({ratio:.2f}x real time)"
    )
    console.print(f"bag:   [bold]{escape(str(result.bag))}[/bold]", markup=True)
    written = ", ".join(sorted(p.name for p in Path(result.truth).iterdir()))
    console.print(
        f"truth: [bold]{escape(str(result.truth))}[/bold]  ({escape(written)})", markup=True
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """Entry point of ``adcloud synth``; returns the exit code."""
    overrides = {name: getattr(args, name, None) for name in _FIELDS}
    config = load_settings(DriveConfig, "synth", file=args.config, **overrides).validate()
    bar, update = _progress_bar(config.duration_ns, args.quiet)
    try:
        # the text as given: a trailing "/" (a directory, not a ros1 file) is refused
        result = generate_drive(config, args.out, overwrite=args.overwrite, progress=update)
    finally:
        bar.close()
    _report(result, console)
    return 0


def run_demo(
    out_dir: Path, console: Console, *, seconds: float = 5.0, quiet: bool = False
) -> DriveResult:
    """The synthetic part of ``adcloud demo``: a short 32-beam drive under ``out_dir/synth``.

    Writes ``out_dir/synth/drive.bag`` (``drive/`` where ``ADCLOUD_SYNTH_FORMAT`` picks a
    rosbag2 format; replacing an earlier one) and its truth, prints
    a summary and where the outputs are, and returns the result (e.g. to ingest the
    bag with BinPipe next).
    """
    target = Path(out_dir) / "synth"
    target.mkdir(parents=True, exist_ok=True)
    config = load_settings(DriveConfig, "synth", seconds=seconds).validate()
    console.rule("adcloud synth: a synthetic drive with ground truth")
    bar, update = _progress_bar(config.duration_ns, quiet)
    try:
        name = "drive.bag" if config.format == "ros1" else "drive"
        result = generate_drive(config, target / name, overwrite=True, progress=update)
    finally:
        bar.close()
    _report(result, console)
    return result
