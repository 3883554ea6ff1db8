"""``adcloud hetero``: list OpenCL devices, run the image feature job, export kernel sources.

:func:`add_parser` registers the ``hetero`` command on the ``adcloud`` CLI's subparsers;
every subcommand sets ``func(args, console) -> exit code``.  Library errors propagate to the
CLI's handler.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adcloud._argtypes import local_path, whole_number, written_url

__all__ = ["add_parser"]

_EPILOG_FEATURES = """examples:
  adcloud hetero features drive.bag --out out/features
  adcloud hetero features 'drives/*.bag' --topic /camera/image_raw --out out/f --master spark://127.0.0.1:7077
  ADCLOUD_HETERO_DEVICE=0:1 adcloud hetero features drive.bag --out out/f   # pin a device
"""

_EPILOG_DEVICES = """examples:
  adcloud hetero devices                 # every OpenCL platform and device
  adcloud hetero devices --json
  adcloud hetero devices --discover gpu  # what deploy/discover_opencl.sh prints for Spark
"""


def _cmd_devices(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hetero.devices import (  # noqa: PLC0415 - keep --help fast
        HeteroSettings,
        discover,
        icd_registration,
        list_devices,
        opencl_status,
        select_device,
        unregistered_icds,
    )

    settings = (
        HeteroSettings.load(split=args.split) if args.split is not None else HeteroSettings.load()
    )
    if args.discover:
        console.print_json(json.dumps(discover(args.discover, settings)))
        return 0
    problem = opencl_status()
    devices = list_devices(split=settings.split) if problem is None else []
    hidden = unregistered_icds()
    if args.json:
        doc: dict[str, Any] = {
            "devices": [d.to_dict() for d in devices],
            "opencl": problem or "ok",
            "selected": select_device(settings).info.address,
            "unregistered_icds": [str(p) for p in hidden],
        }
        console.print_json(json.dumps(doc))
        return 0
    if problem is not None:
        console.print(
            f"[yellow]no OpenCL:[/yellow] {escape(str(problem))}", highlight=False, markup=True
        )
    for path in hidden:
        console.print(
            f"[yellow]unregistered OpenCL driver:[/yellow] {escape(str(path))} is here but no ICD "
            f"file names it, so its devices are not listed; register it with "
            f"`{escape(icd_registration(path))}` "
            "(or put that file in a folder named by OCL_ICD_VENDORS)",
            highlight=False,
            soft_wrap=True,  # the command stays on one line for copying
            markup=True,
        )
    table = Table(title="OpenCL devices")
    for column in ("address", "kind", "device", "platform", "CUs", "memory", "local", "OpenCL"):
        table.add_column(
            column, justify="right" if column in ("CUs", "memory", "local") else "left"
        )
    for d in devices:
        table.add_row(
            d.address,
            d.kind.value,
            d.name,
            d.platform,
            str(d.compute_units),
            f"{d.global_mem_bytes / 2**30:.1f} GiB",
            f"{d.local_mem_bytes // 1024} KiB",
            " ".join(d.version.split()[:2]),
        )
    console.print(table)
    chosen = select_device(settings).info
    console.print(
        "kernels outside Spark resource scheduling run on "
        f"[bold]{escape(chosen.describe())}[/bold] "
        f"(policy: {', '.join(settings.prefer)}; set ADCLOUD_HETERO_DEVICE to pin one)",
        highlight=False,
        markup=True,
    )
    return 0


def _cmd_features(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hetero.devices import HeteroSettings, select_device  # noqa: PLC0415
    from adcloud.hetero.errors import DeviceNotFoundError  # noqa: PLC0415
    from adcloud.hetero.feature_job import extract_features  # noqa: PLC0415
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415

    overrides = {"device": args.device} if args.device else {}
    settings = HeteroSettings.load(**overrides)
    # a pinned device that is not there fails before Spark starts
    if args.device:
        try:
            select_device(settings, address=args.device)
        except DeviceNotFoundError as err:
            raise DeviceNotFoundError(f"--device {args.device!r}: {err}") from err
    elif settings.device:
        select_device(settings)
    spark_settings = SparkSettings.load(master=args.master) if args.master else SparkSettings.load()
    spark = get_session(spark_settings, **{"spark.ui.showConsoleProgress": "false"})
    with console.status(f"extracting image features on {spark.sparkContext.master} ..."):
        result = extract_features(
            spark,
            args.bags,
            args.out,
            topic=args.topic,
            cell=args.cell,
            bins=args.bins,
            batch=args.batch,
            partitions_per_bag=args.partitions_per_bag,
            settings=settings,
            overwrite=args.overwrite,
            hint="pass --overwrite to replace it",
        )
    if not result.images:
        console.print(
            f"error: no image on {args.topic} in {', '.join(args.bags)} (adcloud bag info lists "
            f"the topics); {result.out} holds an empty result",
            highlight=False,
        )
        return 1
    devices = ", ".join(f"{address} ({n})" for address, n in sorted(result.devices.items()))
    console.print(
        f"HOG features of {result.images:,} images from {len(args.bags)} bag argument(s) in "
        f"{result.partitions} partitions: {result.seconds:.2f} s, "
        f"[bold]{result.images_per_second:,.1f} images/s[/bold]; devices: {escape(devices)}",
        highlight=False,
        markup=True,
    )
    console.print(f"outputs: {result.out}  (manifest.json, part-*.npz, settings.json)")
    return 0


def _cmd_kernels(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hetero._kernels import PROGRAMS, program_source  # noqa: PLC0415

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in PROGRAMS:
        (out / f"{name}.cl").write_text(program_source(name))
    console.print(
        f"wrote {len(PROGRAMS)} self-contained OpenCL sources to {out}; compile each for "
        "your FPGA into BINARY_DIR/IP_ID/NAME.aocx (or .xclbin) and set "
        "ADCLOUD_HETERO_BINARY_DIR=BINARY_DIR"
    )
    return 0


def _bins(text: str) -> int:
    """``--bins``: 1 up to what the kernels hold, checked before Spark starts."""
    from adcloud.hetero.features import _MAX_BINS  # noqa: PLC0415 - keep --help fast

    return whole_number(1, "bins", maximum=_MAX_BINS)(text)


def add_parser(subparsers: Any) -> None:
    """Register ``hetero`` (``devices``, ``features``, ``kernels``) on ``subparsers``."""
    hetero = subparsers.add_parser(
        "hetero",
        help="OpenCL devices and kernels (GPU, FPGA, PoCL on the CPU)",
        description="Heterogeneous compute: list the OpenCL devices Spark can schedule, "
        "run the image feature-extraction job on them, export kernel sources for FPGAs.",
    )
    sub = hetero.add_subparsers(dest="hetero_command", metavar="COMMAND", required=True)

    devices = sub.add_parser(
        "devices",
        help="every OpenCL platform and device (kind, memory, compute units)",
        description="List OpenCL platforms and devices with their addresses (the strings "
        "Spark resource scheduling and ADCLOUD_HETERO_DEVICE use), kinds (GPU, ACCELERATOR = "
        "FPGA, CPU), memory and compute units, and the device the policy picks.",
        epilog=_EPILOG_DEVICES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    devices.add_argument("--json", action="store_true", help="machine-readable output")
    devices.add_argument(
        "--split",
        type=whole_number(0),
        help="offer each device as N equal sub-devices (PoCL can; 0: whole devices)",
    )
    devices.add_argument(
        "--discover",
        choices=["gpu", "fpga"],
        help="print Spark's resource-discovery JSON for this resource, as the script does",
    )
    devices.set_defaults(func=_cmd_devices)

    features = sub.add_parser(
        "features",
        help="HOG image features of the camera images of bags (Spark job)",
        description="Decode every sensor_msgs/Image on --topic, compute gradients and "
        "HOG-style histograms on the device each Spark task was given (or the policy's), "
        "save one .npz per partition under --out and print the throughput.",
        epilog=_EPILOG_FEATURES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    features.add_argument(
        "bags", nargs="+", help="bag files, directories or globs (any fsspec URL)"
    )
    # the numbers are checked as they are parsed: the job checks them only once Spark runs
    features.add_argument(
        "--out", required=True, type=written_url("the features"), help="output directory or URL"
    )
    features.add_argument(
        "--topic", default="/camera/image_raw", help="image topic (default /camera/image_raw)"
    )
    features.add_argument(
        "--cell", type=whole_number(1, "pixels"), default=8, help="HOG cell size in pixels (8)"
    )
    features.add_argument("--bins", type=_bins, default=9, help="orientation bins, 1-32 (9)")
    features.add_argument(
        "--batch", type=whole_number(1, "images"), default=64, help="images per kernel launch (64)"
    )
    features.add_argument(
        "--partitions-per-bag",
        type=whole_number(1),
        help="split each bag into N partitions (default: about 16 MiB each)",
    )
    features.add_argument("--device", help="device address outside resource scheduling")
    features.add_argument("--overwrite", action="store_true", help="replace an existing output")
    features.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    features.set_defaults(func=_cmd_features)

    kernels = sub.add_parser(
        "kernels",
        help="write the OpenCL sources (for offline FPGA compilation)",
        description="Write every kernel program as one self-contained .cl file, ready for "
        "an FPGA vendor's offline compiler (aoc, v++).",
    )
    kernels.add_argument(
        "--out",
        required=True,
        type=local_path("the kernel sources"),
        help="local directory for the .cl files",
    )
    kernels.set_defaults(func=_cmd_kernels)
