"""``adcloud hdmap build|eval|info|rollback|export``: nightly map builds from the command line.

``build`` runs :func:`~adcloud.hdmap.build.build_map` on the Spark session (``--master``,
``ADCLOUD_SPARK_MASTER`` or ``local[*,4]``; under ``spark-submit`` the submitted session);
``eval`` compares a map with a synthetic drive's truth; ``info`` lists a map's versions and
drives; ``rollback`` republishes an earlier version; ``export`` copies one out for a driving
stack. Only this module prints.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from adcloud._argtypes import local_path, whole_number, written_url

__all__ = ["add_parser"]

_EPILOG_BUILD = """\
examples:
  adcloud hdmap build --bags drives/ --map maps/city          # a directory of bags
  adcloud hdmap build --bags 's3://fleet/2026-11-20/*.bag' --map local:///maps/city
  adcloud hdmap build --bags d1.bag d2.bag --map maps/city --labels fixes.geojson
  adcloud submit --master spark://127.0.0.1:7077 -- hdmap build --bags drives/ --map maps/city

Re-running with the same bags changes nothing (drives are known by content hash); new bags
are processed alone and merged into the map's tiles, and tiles out of their reach are carried
as they are (hard links on disk; on an object store, copies the store makes, so a build
downloads only the tiles it merges or labels); a killed build leaves the previous version
current; `adcloud hdmap rollback` takes a bad build back. Settings: --config YAML
(section hdmap, and one per stage: hdmap_poses, hdmap_loops, hdmap_grid, hdmap_cloud,
hdmap_labels, hdmap_signs, hdmap_lanelet) or ADCLOUD_HDMAP_<FIELD> and
ADCLOUD_HDMAP_<STAGE>_<FIELD>.
"""

_EPILOG_ROLLBACK = """\
examples:
  adcloud hdmap rollback --map maps/city               # back to the version before this one
  adcloud hdmap rollback --map maps/city --to 000004   # back to a kept version
  adcloud hdmap build --bags drives/ --map maps/city --readmit 2026-11-24-drive3

A rollback writes a new version with the earlier version's map (hard links on disk, copies
the storage makes elsewhere; older versions are kept as hdmap.keep_versions says, and never
fewer than the map's builds keep), so it is atomic like a build and can itself be rolled
back. The drives it takes out of the map are held out: the nightly build skips their bags
(and says so) until `--readmit NAME` gives one back.
"""

_EPILOG_EVAL = """\
example:
  adcloud synth --seconds 60 --out drive.bag && adcloud hdmap build --bags drive.bag --map m
  adcloud hdmap eval --map m --truth drive.bag.truth --report m-eval
"""


#: ``--map``: a path or URL, not memory:// (gone, the map with it, when the command exits).
_map_uri = written_url("the map")


def _tolerance(text: str) -> float:
    """``--tolerance``: metres, above 0 and at most the distance within which two signs
    are the same sign (``DiffSettings.match_m``, which the command line does not set)."""
    from adcloud.hdmap.diff import DiffSettings  # noqa: PLC0415

    most = DiffSettings().match_m
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of metres") from None
    if not 0 < value <= most:
        raise argparse.ArgumentTypeError(
            f"{text} m: give a distance above 0 and at most {most:g} m (signs within {most:g} m "
            "of each other are one sign, moved when farther apart than --tolerance)"
        )
    return value


def _plot_path(text: str) -> str:
    """``--plot``: a picture file :meth:`MapDiff.plot` can write, checked before any work."""
    from adcloud.hdmap.diff import check_plot_path  # noqa: PLC0415
    from adcloud.hdmap.errors import HdmapError  # noqa: PLC0415

    try:
        check_plot_path(text)
    except HdmapError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _settings(args: argparse.Namespace) -> Any:
    from adcloud.config import load_settings  # noqa: PLC0415
    from adcloud.hdmap.config import HdmapSettings  # noqa: PLC0415

    overrides: dict[str, Any] = {}
    if args.mode:
        overrides["mode"] = args.mode
    if args.device:
        overrides["device"] = args.device
    if getattr(args, "merge_all_tiles", False):
        overrides["carry_tiles"] = False
    return load_settings(HdmapSettings, "hdmap", file=args.config, **overrides)


def _spark_settings(args: argparse.Namespace) -> Any:
    """Spark's settings: the ``spark`` section of ``--config`` (beside ``hdmap``), then
    ``ADCLOUD_SPARK_*``, then ``--master``."""
    from adcloud.spark import SparkSettings  # noqa: PLC0415

    overrides = {"master": args.master} if args.master else {}
    return SparkSettings.load(file=getattr(args, "config", None), **overrides)


def _session(args: argparse.Namespace) -> Any:
    from adcloud.spark import get_session  # noqa: PLC0415

    return get_session(_spark_settings(args), **{"spark.ui.showConsoleProgress": "false"})


def _cmd_build(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hdmap.build import (  # noqa: PLC0415
        build_map,
        check_layout,
        labels_would_change,
        plan_build,
        unmappable,
    )
    from adcloud.hdmap.job import StageSettings  # noqa: PLC0415
    from adcloud.hdmap.mapdir import MapDir  # noqa: PLC0415

    settings = _settings(args)
    stages = StageSettings.load(settings, file=args.config)
    planning = f"planning {args.map}: hashing the bags the map does not know"
    with console.status(f"{planning} ...") as status:

        def hashed(done: int, total: int) -> None:
            status.update(f"{planning}: {done / 1e9:.2f} of {total / 1e9:.2f} GB")

        plan = plan_build(
            args.bags,
            args.map,
            readmit=args.readmit,
            trust_mtime=args.trust_mtime,
            settings=settings,
            progress=hashed,
        )
    for uri in plan.skipped:
        console.print(
            f"skipped {uri}: a rollback held its drive out of the map (--readmit NAME takes "
            "it back; adcloud hdmap info lists the held-out drives)",
            highlight=False,
        )
    # build_map checks the new bags again; here a bad one fails before Spark starts, and
    # with --skip-bad-bags this tells whether there is anything to start Spark for (a map's
    # versions keep the origin its first build set)
    origin_known = settings.origin is not None or plan.parent is not None
    bad = unmappable(plan.new_drives, settings, origin_known=origin_known)
    # what the build refuses after Spark started is refused before (and by a dry run):
    # new drives for tiles of another layout, labels of another map frame
    if any(d.uri not in bad for d in plan.new_drives):
        check_layout(plan, stages)
    relabel = bool(args.labels) and labels_would_change(
        plan, args.labels, settings=settings, stages=stages
    )
    if args.dry_run:
        return _dry_run(args, plan, bad, relabel, console)
    if bad and not args.skip_bad_bags:
        for why in bad.values():
            console.print(f"error: {why}", highlight=False)
        console.print(
            f"{args.map}: nothing built (--skip-bad-bags builds the other new bags)",
            highlight=False,
        )
        return 1
    nothing_new = all(d.uri in bad for d in plan.new_drives)
    if nothing_new and plan.parent is not None and not args.labels:
        _print_skipped(bad, console)
        console.print(
            f"{args.map}: up to date (version {plan.parent.id}, {_in_map(plan)} drive(s) in "
            "the map); nothing written"
        )
        return 0
    # labels merged into a map with no new drive need no Spark
    if not nothing_new:
        with MapDir(args.map) as mapdir:
            mapdir.refuse_if_building()  # before Spark starts, not at the lock
    spark = None if nothing_new else _session(args)
    with console.status("building the map ...") as status:
        summary = build_map(
            spark,
            args.bags,
            args.map,
            settings,
            labels=args.labels,
            stages=stages,
            progress=status.update,
            plan=plan,
            readmit=args.readmit,
            skip_bad_bags=args.skip_bad_bags,
            trust_mtime=args.trust_mtime,
        )
    _print_skipped(summary.skipped, console)
    result = summary.result
    if not summary.changed and result.version is None and args.labels:
        # labels go into a version of the map's drives: with none mapped, there is none
        console.print(
            f"{args.map}: nothing written: the map has no version yet and no new drive was "
            f"built; the labels of {args.labels} go into its first version, with its drives",
            highlight=False,
        )
        return 0
    if not summary.changed:
        version = result.version.id if result.version else "none"
        console.print(
            f"{args.map}: up to date (version {version}, {_in_map(result.plan)} drive(s) in "
            "the map"
            + ("; the labels are in it already" if args.labels else "")
            + "); nothing written"
        )
        return 0
    assert result.version is not None
    table = Table(title=f"map {args.map} version {result.version.id}")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    for stage, seconds in summary.timings.items():
        table.add_row(stage, f"{seconds:.1f}")
    console.print(table)
    counts = ", ".join(f"{k} {v}" for k, v in summary.counts.items())
    for note in summary.notes:  # also in the report; a nightly log shows them too
        console.print(f"note: {note}", highlight=False)
    console.print(f"{counts}\noutputs: {result.version.uri}", highlight=False)
    return 0


def _print_skipped(skipped: dict[str, str], console: Console) -> None:
    for why in skipped.values():
        console.print(f"skipped (--skip-bad-bags; tried again next build): {why}", highlight=False)


def _dry_run(
    args: argparse.Namespace, plan: Any, bad: dict[str, str], relabel: bool, console: Console
) -> int:
    """What ``build`` would do, with ``bad``: the new bags that lack what mapping needs, and
    ``relabel``: whether ``--labels`` changes the labels the map keeps."""
    parent = plan.parent
    on = f"version {parent.id}" if parent is not None else "an empty map"
    table = Table(title=f"{args.map}: a build now would add to {on}")
    for col in ("drive", "bag", "size", "what"):
        table.add_column(col)
    fate = "skipped" if args.skip_bad_bags else "fails the build"
    for d in plan.new_drives:
        what = (
            Text(f"new: cannot be mapped, {fate} (below)", "red") if d.uri in bad else "new: built"
        )
        table.add_row(d.name, d.uri, f"{d.size:,}", what)
    for d in plan.known_drives:
        table.add_row(d.name, d.uri, f"{d.size:,}", f"in the map since {d.added_in}")
    for old, new in plan.renamed:
        table.add_row("", new, "", f"known content, was {old}")
    for uri in plan.duplicates:
        table.add_row("", uri, "", "same bytes as another bag: skipped")
    for uri in plan.skipped:
        table.add_row("", uri, "", "held out by a rollback: skipped")
    console.print(table)
    # what the build would fail on is an error; what it would skip says so, as the build does
    said = "skipped (--skip-bad-bags; tried again next build)" if args.skip_bad_bags else "error"
    for text in bad.values():
        console.print(f"{said}: {text}", highlight=False)
    good = len(plan.new_drives) - len(bad)
    if bad and not args.skip_bad_bags:
        verdict = f"the build would fail on {len(bad)} bag(s) (--skip-bad-bags leaves them out)"
    elif good:
        verdict = f"{good} new drive(s) to build" + (
            f", with the labels of {args.labels}" if relabel else ""
        )
    elif relabel and parent is None:  # labels go into a version of the map's drives
        verdict = (
            f"the map has no version yet and no new drive would be built; the labels of "
            f"{args.labels} go into its first version, with its drives"
        )
    elif relabel:
        verdict = f"a new version with the labels of {args.labels} (no new drive: no Spark)"
    else:
        verdict = "up to date: nothing would be written" + (
            f" (the labels of {args.labels} are in the map already)" if args.labels else ""
        )
    console.print(f"dry run, nothing written: {verdict}", highlight=False)
    return 1 if bad and not args.skip_bad_bags else 0


def _in_map(plan: Any) -> int:
    """How many drives the map holds: those among the given bags and the others (a nightly
    build's ``--bags incoming/`` names only the new ones)."""
    return len(plan.known_drives) + len(plan.removed)


def _local(text: str) -> Path:
    """A local path option as the library writes it (``~`` is the home directory, as
    :func:`adcloud.hdmap.mapdir.local_path` reads it): quoted, or as ``--out=~/x``, the
    shell leaves the ``~`` in."""
    return Path(text).expanduser()


def _check_eval_outputs(report: str | None, out: str | None) -> None:
    """Refuse a ``--report`` or ``--out`` that cannot be written before the evaluation
    runs, not after it (the report and the metrics are written last)."""
    from adcloud.hdmap.errors import HdmapError  # noqa: PLC0415

    if report and _local(report).exists() and not _local(report).is_dir():
        raise HdmapError(
            f"{report}: is a file; --report names a directory to write summary.html into"
        )
    if out:
        if _local(out).is_dir():
            raise HdmapError(
                f"{out}: is a directory; --out names the file to write the metrics (JSON) to"
            )
        folder = _local(out).absolute().parent
        if not folder.is_dir():
            raise HdmapError(f"{out}: no directory {folder} to write the metrics in; make it first")


def _cmd_eval(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hdmap.evaluate import evaluate_map  # noqa: PLC0415
    from adcloud.hdmap.report import write_map_report  # noqa: PLC0415

    _check_eval_outputs(args.report, args.out)
    result = evaluate_map(args.map, args.truth, drive=args.drive)
    if args.json:
        console.print_json(result.to_json())
    else:
        table = Table(title=f"{args.map} vs {args.truth}")
        for col in ("metric", "value", "target", "pass"):
            table.add_column(col)
        for m in result.metrics:
            value = "n/a" if m.value is None else f"{m.value:.4g} {m.unit}"
            mark = (
                Text("-")
                if m.passed is None
                else Text(*(("no", "red"), ("yes", "green"))[m.passed])
            )
            table.add_row(m.name, value, f"{m.op} {m.target:g} {m.unit}", mark)
        console.print(table)
        for note in result.notes:
            console.print(f"note: {note}")
        for failure in result.failures:
            console.print(f"not passed: {failure}", highlight=False)
    if args.report:
        html = write_map_report(args.map, args.report, eval_result=result)
        # with --json, stdout holds the JSON alone
        where = Console(stderr=True, markup=False) if args.json else console
        where.print(f"report: {html}", highlight=False, soft_wrap=True)
    if args.out:
        _local(args.out).write_text(result.to_json())
    return 0 if result.passed else 1


def _cmd_info(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hdmap.mapdir import MapDir  # noqa: PLC0415

    with MapDir(args.map) as mapdir:
        return _show_info(args, console, mapdir)


def _show_info(args: argparse.Namespace, console: Console, mapdir: Any) -> int:
    from adcloud.hdmap.errors import HdmapError  # noqa: PLC0415

    current = mapdir.current()
    if current is None:  # an error, on stderr: with --json, stdout holds JSON or nothing
        raise HdmapError(mapdir.no_version_text())
    history = [_history_row(mapdir, vid) for vid in mapdir.versions()]
    notes = _tie_concerns(current)
    if args.json:
        manifest = json.loads(current.manifest.to_json())
        # manifest.json leaves out the fields its format version predates (a version without
        # a rollback or a label import is written as version 1, for older readers); a script
        # reading info --json finds every field on every map
        manifest.setdefault("held_out", [])
        manifest.setdefault("restores", None)
        manifest.setdefault("labels", None)
        console.print_json(
            json.dumps(
                {
                    "current": current.id,
                    "versions": mapdir.versions(),
                    "history": history,
                    "manifest": manifest,
                    "notes": notes,
                }
            )
        )
        return 0
    restores = current.manifest.restores
    console.print(
        f"{args.map}: current version {current.id}"
        + (f" (a rollback to {restores})" if restores else ""),
        highlight=False,
    )
    table = Table(title="versions kept (adcloud hdmap rollback --to VERSION restores one)")
    for col in ("version", "created", "built on", "drives", "change"):
        table.add_column(col)
    for row in history:
        mark = " *" if row["version"] == current.id else ""
        table.add_row(
            f"{row['version']}{mark}",
            str(row["created_at"])[:19].replace("T", " "),
            str(row["parent"] or ""),
            str(row["drives"]),
            str(row["change"]),
        )
    console.print(table)
    console.print(_drive_table("drives", current.manifest.drives))
    if current.manifest.held_out:
        title = "held out by a rollback (--readmit NAME takes one back)"
        console.print(_drive_table(title, current.manifest.held_out))
    for note in notes:
        console.print(f"note: {note}", highlight=False)
    return 0


def _tie_concerns(version: Any) -> list[str]:
    """The notes on how the drives of ``version`` hold together that ask for a look
    (drives not tied to the others, large GPS offsets), from its build report's record."""
    from adcloud.hdmap.errors import MapFormatError  # noqa: PLC0415
    from adcloud.hdmap.loops import DriveTies  # noqa: PLC0415
    from adcloud.hdmap.report import TIES_JSON_NAME  # noqa: PLC0415

    rel = f"report/{TIES_JSON_NAME}"
    try:
        text = version.read_bytes(rel)
    except MapFormatError:  # a version without a build report's record of ties
        return []
    concerns: list[str] = DriveTies.parse(text, f"{version.uri}/{rel}").concerns()
    return concerns


def _history_row(mapdir: Any, vid: str) -> dict[str, Any]:
    """One version of ``hdmap info``'s table: when, on what, how many drives, what changed
    (drives added, a label import and its file, a rollback)."""
    man = mapdir.version(vid).manifest
    added = [d.name for d in man.drives if d.added_in == vid]
    parts = []
    if man.restores:
        parts.append(f"rollback to {man.restores}")
    if added:
        parts.append("+ " + ", ".join(added))
    if man.labels:
        parts.append(f"labels imported from {man.labels}")
    elif not parts and man.parent is not None:
        # built on a version with no new drive: a label import whose file was not recorded
        parts.append("labels imported (file not recorded)")
    return {
        "version": vid,
        "created_at": man.created_at,
        "parent": man.parent,
        "drives": len(man.drives),
        "added": added,
        "restores": man.restores,
        "labels": man.labels,
        "change": "; ".join(parts),
    }


def _drive_table(title: str, drives: Any) -> Table:
    table = Table(title=title)
    for col in ("name", "sha256", "size", "added in", "processed"):
        table.add_column(col)
    for d in drives:
        table.add_row(d.name, d.sha256[:12], f"{d.size:,}", d.added_in or "", d.processed_at or "")
    return table


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hdmap.build import export_map  # noqa: PLC0415

    version, names = export_map(args.map, args.out, version=args.version, autoware=args.autoware)
    out = _local(args.out).absolute()  # where the export went: "~/maps" in the home directory
    size = sum((out / rel).stat().st_size for rel in names)
    console.print(
        f"version {version.id} of {args.map}: {len(names)} files ({size / 1e6:,.1f} MB) "
        f"copied to {out}",
        highlight=False,
    )
    if any(rel.startswith("pointcloud_map/") for rel in names):
        console.print(f"Autoware loads it with map_path:={out}", highlight=False)
    return 0


def _cmd_diff(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hdmap.diff import DiffSettings, diff_versions  # noqa: PLC0415

    change = diff_versions(
        args.map, args.from_version, args.to_version, DiffSettings(tolerance_m=args.tolerance)
    )
    if args.plot:
        change.plot(args.plot)
    if args.json:
        console.print_json(change.to_json())
        return 0
    console.print(change.table())
    tiles = sorted(
        (t for t in change.tiles if t.status == "changed"),
        key=lambda t: -(t.cells_new + t.cells_lost),
    )[: args.top]
    if tiles:
        table = Table(title=f"tiles changed most (of {change.tile_counts()['changed']})")
        for col in ("tile", "cells new", "no longer", "height RMS (cm)", "largest (cm)"):
            table.add_column(col, justify="right")
        for t in tiles:
            shared = math.isfinite(t.dz_rms_m)  # no cell observed in both: no height change
            table.add_row(
                f"{t.key[0]}_{t.key[1]}",
                f"{t.cells_new:,}",
                f"{t.cells_lost:,}",
                f"{t.dz_rms_m * 100:.2f}" if shared else "no cell in both",
                f"{t.dz_max_m * 100:.1f}" if shared else "",
            )
        console.print(table)
    for sign in change.signs:
        where = sign.after or sign.before
        assert where is not None
        what = {
            "added": f"added ({sign.type_after})",
            "removed": f"removed ({sign.type_before})",
            "moved": f"moved {sign.moved_m:.2f} m"
            + (
                f", retyped {sign.type_before} -> {sign.type_after}"
                if sign.type_before != sign.type_after
                else ""
            ),
            "retyped": f"retyped {sign.type_before} -> {sign.type_after}",
        }[sign.status]
        console.print(f"sign at ({where[0]:.1f}, {where[1]:.1f}): {what}", highlight=False)
    if change.unchanged:
        console.print("the two versions hold the same map", highlight=False)
    if args.plot:
        console.print(f"picture: {args.plot}", highlight=False)
    return 0


def _cmd_rollback(args: argparse.Namespace, console: Console) -> int:
    from adcloud.hdmap.mapdir import MapDir, MapDirSettings  # noqa: PLC0415

    settings = _settings(args)
    with MapDir(args.map, MapDirSettings(keep_versions=settings.keep_versions)) as mapdir:
        before = mapdir.current()
        version = mapdir.roll_back(args.to)
    console.print(
        f"{args.map}: version {version.id} is current: the map of version "
        f"{version.manifest.restores}" + (f" (was {before.id})" if before is not None else ""),
        highlight=False,
    )
    if version.manifest.held_out:
        names = ", ".join(d.name for d in version.manifest.held_out)
        console.print(
            f"held out of later builds: {names} (adcloud hdmap build ... --readmit NAME takes "
            "one back)",
            highlight=False,
        )
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``hdmap`` (``build``, ``eval``, ``info``, ``diff``, ``rollback``, ``export``)."""
    hdmap = subparsers.add_parser(
        "hdmap",
        help="HD maps: nightly incremental builds, evaluation",
        description="Build HD maps from drives (poses with GTSAM, ICP on OpenCL, a 5 cm grid, "
        "lanes and signs; Autoware and Lanelet2 outputs) and evaluate them.",
    )
    sub = hdmap.add_subparsers(dest="hdmap_command", metavar="COMMAND", required=True)
    build = sub.add_parser(
        "build",
        help="build or extend a map from bags (incremental, idempotent, atomic)",
        description="Process the drives the map does not have yet and publish a new map "
        "version: trajectories, GeoTIFF grid tiles, point-cloud tiles, lanelet2_map.osm, "
        "semantic.geojson and a report.",
        epilog=_EPILOG_BUILD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument(
        "--bags", nargs="+", required=True, help="bags, directories or globs (any URL)"
    )
    build.add_argument("--map", required=True, type=_map_uri, help="map directory: a path or URL")
    build.add_argument(
        "--labels",
        help="GeoJSON of human/external labels to keep in the map (every later version keeps "
        "them); with no new drive, a version with just these labels merged in is written",
    )
    build.add_argument(
        "--readmit",
        action="append",
        default=[],
        metavar="NAME",
        help="build a drive that a rollback held out (its name or 8+ digits of its SHA-256, "
        "as `adcloud hdmap info` shows; its bag must be among --bags); repeatable",
    )
    build.add_argument(
        "--skip-bad-bags",
        action="store_true",
        help="leave out of this build the new bags that lack a topic mapping needs or have "
        "no readable index (cut off, or still being copied), and build the others (they are "
        "named, not recorded: the next build tries them again); without it such a bag fails "
        "the build",
    )
    build.add_argument(
        "--trust-mtime",
        action="store_true",
        help="do not read a bag again to hash it when its URI, size and modification time "
        "are those the map recorded (rsync's quick check; new bags are always hashed): a "
        "nightly build over a large bag directory then reads only the new bags",
    )
    build.add_argument(
        "--dry-run",
        action="store_true",
        help="show what the build would do (new, known, renamed and skipped bags) and check "
        "that the new bags have the topics mapping needs; no Spark, nothing written (exit "
        "status 1 when a new bag cannot be mapped)",
    )
    build.add_argument("--mode", choices=["memory", "files"], help="stage hand-over (memory)")
    build.add_argument("--device", help="OpenCL device address for ICP and rasterizing")
    build.add_argument(
        "--config", help="YAML/JSON settings file (section hdmap; Spark's in section spark)"
    )
    build.add_argument(
        "--merge-all-tiles",
        action="store_true",
        help="merge and write every tile again, not only those the new drives reach "
        "(hdmap.carry_tiles=false; done by itself when the grid or point-cloud settings "
        "changed since the previous version, but for the tile layout -- hdmap.resolution, "
        "hdmap.tile_m, the patch and voxel sizes --, which a map keeps from its first build: "
        "a build with another layout is refused)",
    )
    build.add_argument(
        "--master", help="Spark master URL (default: local[*,4] or ADCLOUD_SPARK_MASTER)"
    )
    build.set_defaults(func=_cmd_build)

    ev = sub.add_parser(
        "eval",
        help="compare a map with a synthetic drive's ground truth",
        description="Align the map to the truth frame by its trajectory, then report ATE, "
        "elevation RMSE, lane-marking distance and recovered length, sign recall and "
        "precision against their targets (exit status 1 when a target is missed or a metric "
        "cannot be evaluated, e.g. on a map without a grid or semantic layer).",
        epilog=_EPILOG_EVAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument(
        "--map",
        required=True,
        type=_map_uri,
        help="map directory or URL (its current version)",
    )
    ev.add_argument("--truth", required=True, help="the drive's truth directory (<bag>.truth)")
    ev.add_argument("--drive", help="which of the map's drives the truth belongs to")
    ev.add_argument(
        "--report",
        type=local_path("the report"),
        help="write summary.html with error plots here (a local directory)",
    )
    ev.add_argument(
        "--out",
        type=local_path("the metrics"),
        help="write the metrics as JSON here (a local file)",
    )
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ev.set_defaults(func=_cmd_eval)

    info = sub.add_parser(
        "info",
        help="a map's versions and drives",
        description="Show the current version, the versions kept and the "
        "drives (by content hash) the map was built from.",
    )
    info.add_argument("--map", required=True, type=_map_uri, help="map directory or URL")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)

    export = sub.add_parser(
        "export",
        help="copy a version out of the map, for a vehicle or a driving stack",
        description="Copy the current (or a given) version's files into a new local directory: "
        "everything but state/ (the tile statistics only the next build reads), or with "
        "--autoware only what Autoware's map loader reads (pointcloud_map/, "
        "pointcloud_map_metadata.yaml, lanelet2_map.osm, map_projector_info.yaml). Copies, "
        "never links: the export can be edited without touching the map.",
    )
    export.add_argument("--map", required=True, type=_map_uri, help="map directory or URL")
    export.add_argument(
        "--out",
        required=True,
        type=local_path("an export"),
        help="a new (or empty) local directory",
    )
    export.add_argument("--version", help="the version to copy (default: the current one)")
    export.add_argument(
        "--autoware", action="store_true", help="only the files Autoware's map loader reads"
    )
    export.set_defaults(func=_cmd_export)

    diff = sub.add_parser(
        "diff",
        help="what changed between two versions (drives, tiles, markings, signs)",
        description="Compare two versions of a map -- by default the current one and the "
        "version it was built on: drives added and taken out; grid tiles added, removed, "
        "changed (ground cells new and no longer observed, height change) or the same "
        "(carried tiles are not read); lane-marking length added and removed; signs added, "
        "removed, moved and retyped. Nothing is written unless --plot is given.",
        epilog="examples:\n"
        "  adcloud hdmap diff --map maps/town                   # last night's change\n"
        "  adcloud hdmap diff --map maps/town --from 3 --to 5 --plot diff.png\n"
        "  adcloud hdmap diff --map s3://maps/town --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("--map", required=True, type=_map_uri, help="map directory or URL")
    diff.add_argument(
        "--from",
        dest="from_version",
        metavar="VERSION",
        help="the older version (default: the one --to was built on; for the map's first "
        "version, an empty map)",
    )
    diff.add_argument(
        "--to", dest="to_version", metavar="VERSION", help="the newer version (default: current)"
    )
    diff.add_argument(
        "--tolerance",
        type=_tolerance,
        default=0.3,
        metavar="M",
        help="markings and signs closer than this are unchanged (default 0.3 m, at most 2 m)",
    )
    diff.add_argument(
        "--plot",
        metavar="PNG",
        type=_plot_path,
        help="draw the change to this picture (.png; also .svg, .pdf, .jpg, .tif, .eps)",
    )
    diff.add_argument(
        "--top",
        type=whole_number(0, "rows"),
        default=10,
        help="list this many changed tiles (10; 0: none)",
    )
    diff.add_argument("--json", action="store_true", help="machine-readable output")
    diff.set_defaults(func=_cmd_diff)

    rollback = sub.add_parser(
        "rollback",
        help="make an earlier version's map current again (as a new version)",
        description="Publish the map of an earlier kept version as a new version and hold "
        "the drives it lacks out of later builds.",
        epilog=_EPILOG_ROLLBACK,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rollback.add_argument("--map", required=True, type=_map_uri, help="map directory or URL")
    rollback.add_argument(
        "--to",
        metavar="VERSION",
        help="the kept version to restore (default: the one the current version was built on)",
    )
    rollback.add_argument("--config", help="YAML/JSON settings file (section hdmap)")
    rollback.set_defaults(func=_cmd_rollback, mode=None, device=None)


def run_demo(spark: Any, bag: str | None, out_dir: str, console: Console) -> Path:
    """The HD-map part of ``adcloud demo``: build a map of ``bag`` (None: a 30 s synthetic
    drive made for it, long enough for lanes, signs and a GPS outage) under
    ``out_dir/hdmap``, evaluate it against the drive's truth (when the bag has one) and
    print where it is."""
    from adcloud.hdmap.build import build_map  # noqa: PLC0415
    from adcloud.hdmap.evaluate import evaluate_map  # noqa: PLC0415
    from adcloud.synth import DriveConfig, generate_drive, truth_dir_for  # noqa: PLC0415

    console.rule("adcloud hdmap: poses, ICP, 5 cm grid, lanes and signs in one Spark job")
    if bag is None:
        config = DriveConfig(seconds=30, seed=7, lidar_beams=16, lidar_columns=512)
        folder = Path(out_dir) / "hdmap-drive"
        folder.mkdir(parents=True, exist_ok=True)
        with console.status("generating a 30 s drive for the map ..."):
            bag = str(generate_drive(config, folder / "drive.bag", overwrite=True).bag)
        console.print(f"drive: {bag} (30 s, 16 beams, a camera, GPS outage from 20 s)")
    map_uri = str(Path(out_dir) / "hdmap")
    with console.status("building the map ...") as status:
        summary = build_map(spark, bag, map_uri, progress=status.update)
    version = summary.result.version
    assert version is not None
    if summary.changed:
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in summary.timings.items())
        counts = ", ".join(f"{k} {v}" for k, v in summary.counts.items())
        console.print(f"version {version.id}: {stages}\n{counts}", highlight=False)
    else:
        console.print(f"version {version.id} already holds this drive: nothing to do")
    truth = truth_dir_for(Path(bag))
    if truth.is_dir():
        result = evaluate_map(map_uri, truth)
        figures = []
        for m in result.metrics:
            if m.value is not None:
                figures.append(f"{m.name} {m.value:.3g} {m.unit}".rstrip())
        console.print("against the truth: " + "; ".join(figures), highlight=False)
    console.print(
        f"map: [bold]{escape(version.uri)}[/bold] (report/summary.html, lanelet2_map.osm)",
        markup=True,
    )
    return Path(version.uri.removeprefix("file://"))
