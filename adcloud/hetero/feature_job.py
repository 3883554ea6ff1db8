"""The image feature-extraction job: HOG descriptors of every camera image of some bags.

Spark partitions the bags (:class:`~adcloud.binpipe.BinPipeRDD`); each task decodes its
``sensor_msgs/Image`` messages, batches them by size, computes
:func:`~adcloud.hetero.features.hog_features` on the device Spark assigned to it (or the
policy's), and writes one ``.npz`` per partition and image size into the job's own
``_temporary/`` directory.  Once every partition is written the driver moves the files into
place and writes ``manifest.json`` and the effective settings (``settings.json``) beside
them: a failed job leaves the output directory as it was.

Output format ``adcloud-hog``, version 1 (one file per partition and image size,
``part-PPPPP-HxW.npz``, written to a temporary name and renamed, read with
``np.load(path, allow_pickle=False)``):

- ``timestamps`` int64 (n,): record time of each image, nanoseconds;
- ``features`` float32 (n, D): HOG descriptors in the layout of
  :mod:`adcloud.hetero.features`;
- ``shape`` int64 (2,): image height and width (pixels); ``params`` int64 (2,): cell
  size (pixels) and bins; ``version`` int64 (): 1.

History: version 1 is the first.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import posixpath
import re
import time
import uuid
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
from numpy.typing import NDArray

from adcloud._commit import TEMPORARY, JobOutput
from adcloud.config import settings_dict
from adcloud.hetero.devices import HeteroSettings, select_device, spark_assignment
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.features import _MAX_BINS, decode_image, hog_features, hog_size

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["FORMAT", "FORMAT_VERSION", "FeatureJobResult", "extract_features", "read_features"]

log = logging.getLogger(__name__)

FORMAT = "adcloud-hog"
FORMAT_VERSION = 1
_IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/Image")


@dataclass(frozen=True)
class FeatureJobResult:
    """What :func:`extract_features` did.

    ``images`` processed in ``seconds`` (wall time of the Spark job, s) over
    ``partitions``; ``devices`` maps each device address to the images it processed;
    ``files`` are the written ``.npz`` URLs; ``manifest`` the manifest's URL.
    """

    images: int
    partitions: int
    seconds: float
    devices: dict[str, int]
    files: list[str]
    out: str
    manifest: str

    @property
    def images_per_second(self) -> float:
        """Throughput of the job (images per second of wall time)."""
        return self.images / self.seconds if self.seconds > 0 else 0.0


def _absolute(url: str) -> str:
    """Local paths made absolute; URLs with a scheme unchanged.  Symlinks are kept (as
    BinPipe keeps them): errors name a bag as the user gave it, not its link target."""
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))  # noqa: PTH100, PTH111


#: What a feature job writes into its output directory (and may replace there).
_OUTPUT_NAME = re.compile(r"part-\d+-\d+x\d+\.npz|manifest\.json|settings\.json")


def _write_npz(
    url: str,
    timestamps: NDArray[np.int64],
    features: NDArray[np.float32],
    shape: tuple[int, int],
    params: tuple[int, int],
    storage_options: dict[str, Any],
) -> None:
    """Write one part file to any fsspec URL atomically (temporary name, then rename)."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        timestamps=timestamps,
        features=features,
        shape=np.array(shape, np.int64),
        params=np.array(params, np.int64),
        version=np.array(FORMAT_VERSION, np.int64),
    )
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    tmp = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.{uuid.uuid4().hex}")
    with fs.open(tmp, "wb") as out:
        out.write(buffer.getbuffer())
    fs.mv(tmp, path)


def _check_image_size(shape: tuple[int, int], cell: int, topic: str) -> None:
    """Raise :class:`HeteroError` when ``shape`` (pixels) holds fewer than the 2x2 cells of
    ``cell`` pixels that a HOG block needs: its descriptor would be empty."""
    height, width = shape
    if hog_size(height, width, cell=cell) > 0:
        return
    largest = min(height, width) // 2
    fix = (
        f"choose a smaller cell (--cell), at most {largest} pixels for these images"
        if largest >= 1
        else "no cell size fits them"
    )
    raise HeteroError(
        f"the {height}x{width} images on {topic} are smaller than 2x2 cells of {cell} pixels, "
        f"the least a HOG descriptor needs; {fix}"
    )


def _partition_features(
    index: int,
    blocks: Iterable[bytes | bytearray],
    *,
    out: str,
    topic: str,
    cell: int,
    bins: int,
    batch: int,
    settings: HeteroSettings,
    storage_options: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    """Executor side: decode the partition's images, HOG them on the task's device, save."""
    from adcloud.binpipe import Block, BlockKind, ConnectionInfo, MessageDecoder  # noqa: PLC0415

    started = time.perf_counter()
    device = select_device(settings)
    assignment = spark_assignment(settings.resources)
    decoder = MessageDecoder()
    # batched by the images' whole shape: a topic may switch between mono and colour
    # encodings of one size, whose pixels do not stack (they are saved together by size)
    pending: dict[tuple[int, ...], list[tuple[int, NDArray[np.uint8]]]] = defaultdict(list)
    done: dict[tuple[int, int], list[tuple[NDArray[np.int64], NDArray[np.float32]]]] = defaultdict(
        list
    )
    kernel_seconds = 0.0

    def flush(batch_shape: tuple[int, ...]) -> None:
        nonlocal kernel_seconds
        items = pending.pop(batch_shape, [])
        if not items:
            return
        stamps = np.array([t for t, _ in items], np.int64)
        images = np.stack([image for _, image in items])
        tick = time.perf_counter()
        features = hog_features(images, cell=cell, bins=bins, device=device)
        done[(batch_shape[0], batch_shape[1])].append((stamps, features))
        kernel_seconds += time.perf_counter() - tick

    for raw in blocks:
        block = Block.parse(memoryview(raw))
        if block.kind == BlockKind.META:
            for record in block:
                decoder.add(ConnectionInfo.from_record(record, "a META block of the partition"))
            continue
        for message in block.messages():
            if message.topic != topic:
                continue
            if message.msgtype not in _IMAGE_TYPES:
                raise HeteroError(f"{topic} carries {message.msgtype}, not sensor_msgs/Image")
            msg = decoder.decode(message)
            try:
                image = decode_image(msg.height, msg.width, msg.encoding, msg.step, msg.data)
            except HeteroError as err:
                raise HeteroError(f"{topic} message at {message.timestamp} ns: {err}") from err
            if image.ndim == 3:
                image = image[:, :, :3]
            shape = (int(msg.height), int(msg.width))
            _check_image_size(shape, cell, topic)  # before its empty descriptors are saved
            pending[image.shape].append((message.timestamp, image))
            if len(pending[image.shape]) >= batch:
                flush(image.shape)
    for batch_shape in list(pending):
        flush(batch_shape)
    files = []
    count = 0
    for (height, width), parts in sorted(done.items()):
        stamps = np.concatenate([s for s, _ in parts])
        features = np.concatenate([f for _, f in parts])
        order = np.argsort(stamps, kind="stable")  # batches of both encodings interleave
        stamps, features = stamps[order], features[order]
        name = f"part-{index:05d}-{height}x{width}.npz"
        # into the job's staging directory: the driver moves the files into place once
        # every partition is written (see extract_features)
        url = posixpath.join(out, name)
        _write_npz(url, stamps, features, (height, width), (cell, bins), storage_options)
        files.append(name)
        count += len(stamps)
    yield {
        "partition": index,
        "images": count,
        "files": files,
        "address": device.info.address,
        "device": device.info.name,
        "resource": assignment[0] if assignment else "",
        "assigned": assignment[1] if assignment else [],
        "pid": os.getpid(),
        "kernel_seconds": kernel_seconds,
        "seconds": time.perf_counter() - started,
    }


def extract_features(
    spark: SparkSession,
    bags: str | Sequence[str],
    out: str,
    *,
    topic: str = "/camera/image_raw",
    cell: int = 8,
    bins: int = 9,
    batch: int = 64,
    partitions_per_bag: int | None = None,
    partition_mb: float = 16.0,
    settings: HeteroSettings | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    hint: str = "pass overwrite=True to replace it",
) -> FeatureJobResult:
    """HOG descriptors of every image on ``topic`` of ``bags``, saved under ``out``.

    ``bags``: bag files, directories or globs (any fsspec URL).  ``out``: a directory or
    URL that every executor can write (the same machine, or a shared store).  ``batch``:
    images per kernel launch.  ``partitions_per_bag`` / ``partition_mb``: how finely Spark
    splits each bag (default: partitions of about 16 MB, at least one per core; 0 MB: one
    per chunk).  Raises :class:`HeteroError` when ``out`` exists and is not empty (unless
    ``overwrite``; ``hint`` says how to overwrite in the message), and for bad
    ``cell``/``bins``/``batch``/``partition_mb``, a pinned device that is not there, a
    ``topic`` no bag has or one a bag records as anything but ``sensor_msgs/Image`` (naming
    the bag, the type and its image topics), before any task runs.  Images smaller than 2x2
    cells are only seen by the tasks: the job fails with a :class:`HeteroError` naming their
    size.
    """
    from adcloud.binpipe import BinPipeRDD  # noqa: PLC0415 - pyspark is heavy

    # checked here, before any task: in a task they would fail every attempt
    for name, value in (("cell", cell), ("bins", bins), ("batch", batch)):
        if value < 1:
            raise HeteroError(f"{name} must be >= 1, got {value}")
    if bins > _MAX_BINS:  # the kernels' limit (hog_features checks it again)
        raise HeteroError(f"bins must be <= {_MAX_BINS}, got {bins}")
    if partitions_per_bag is not None and partitions_per_bag < 1:
        raise HeteroError(f"partitions_per_bag must be >= 1, got {partitions_per_bag}")
    if not partition_mb >= 0:  # NaN too: it failed converting to bytes, -1 was taken as 0
        raise HeteroError(
            f"partition_mb must be >= 0 (0: one partition per chunk), got {partition_mb}"
        )
    settings = HeteroSettings.load() if settings is None else settings
    if settings.device:
        select_device(settings)  # a pinned device that is not there fails now
    options = dict(storage_options or {})
    # Executors run in other working directories: local paths must be absolute.
    out = _absolute(out)
    bags = [_absolute(b) for b in ([bags] if isinstance(bags, str) else bags)]
    fs, root = fsspec.core.url_to_fs(out, **options)
    output = JobOutput(
        fs,
        root,
        out,
        overwrite=overwrite,
        ours=lambda name: bool(_OUTPUT_NAME.fullmatch(name)),
        error=HeteroError,
        what="a feature job",
        hint=hint,
    )
    rdd = BinPipeRDD.from_bags(
        spark,
        bags,
        topics=[topic],
        partitions_per_bag=partitions_per_bag,
        partition_bytes=int(partition_mb * 2**20) or None,
        storage_options=options or None,
    )
    # from the indexes, before an overwrite replaces an earlier output and before any task
    _check_topic(rdd.lineage, topic, options)
    output.start()  # after the bags were found: a missing bag leaves no directory behind
    job = functools.partial(
        _partition_features,
        out=posixpath.join(out, TEMPORARY, output.job),  # the staging directory, as a URL
        topic=topic,
        cell=cell,
        bins=bins,
        batch=batch,
        settings=settings,
        storage_options=options,
    )
    started = time.perf_counter()
    try:
        reports = rdd.rdd.mapPartitionsWithIndex(job).collect()
    except BaseException:
        output.abort()  # an earlier job's features stay whole
        raise
    seconds = time.perf_counter() - started
    names = [name for report in reports for name in report["files"]]
    for report in reports:
        report["files"] = [posixpath.join(out, name) for name in report["files"]]
    devices: dict[str, int] = defaultdict(int)
    for report in reports:
        devices[report["address"]] += report["images"]
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "topic": topic,
        "cell": cell,
        "bins": bins,
        "bags": bags,
        "images": sum(r["images"] for r in reports),
        "seconds": seconds,
        "partitions": sorted(reports, key=lambda r: r["partition"]),
    }
    # staged with the features, so that a commit a killed driver left is finished whole;
    # the manifest goes first and comes back last: read_features starts from it
    staged = {
        "settings.json": json.dumps({"hetero": settings_dict(settings)}, indent=2) + "\n",
        "manifest.json": json.dumps(manifest, indent=2) + "\n",
    }
    try:
        for name, text in staged.items():
            fs.pipe_file(posixpath.join(output.staging, name), text.encode())
    except BaseException:
        output.abort()
        raise
    output.commit(
        [(posixpath.join(output.staging, name), name) for name in [*names, *staged]],
        first=("manifest.json",),
    )
    manifest_url = posixpath.join(out, "manifest.json")
    files = sorted(f for r in reports for f in r["files"])
    log.info("features of %d images in %.2f s", manifest["images"], seconds)
    return FeatureJobResult(
        images=int(manifest["images"]),
        partitions=len(reports),
        seconds=seconds,
        devices=dict(devices),
        files=files,
        out=out,
        manifest=manifest_url,
    )


def _check_topic(lineage: dict[str, Any], topic: str, storage_options: dict[str, Any]) -> None:
    """Refuse a ``topic`` that no bag has (a typo would commit an empty result, and with
    ``overwrite`` replace a good one) or that a bag records as anything but a
    ``sensor_msgs/Image`` (every task would fail, each attempt retried), from the bags'
    indexes.  A topic with no message in the bags stays empty."""
    from adcloud.binpipe import summarize  # noqa: PLC0415 - pyspark is heavy

    have: set[str] = set()
    for bag in lineage.get("bags", []):
        summary = summarize(bag["uri"], storage_options=storage_options)
        types = {t.topic: t.msgtype for t in summary.topics}
        have.update(types)
        msgtype = types.get(topic)
        if msgtype is not None and msgtype not in _IMAGE_TYPES:
            images = sorted(t for t, typ in types.items() if typ in _IMAGE_TYPES)
            listed = (
                f"its image topics are {', '.join(images)}"
                if images
                else "it has no sensor_msgs/Image topic"
            )
            raise HeteroError(
                f"{bag.get('reindexed_from') or bag['uri']}: {topic} carries {msgtype}, "
                f"not sensor_msgs/Image; {listed} (adcloud bag info lists them). "
                "Nothing was written"
            )
    if topic not in have:
        raise HeteroError(
            f"no bag has the topic {topic}; they have {', '.join(sorted(have)) or 'no topic'} "
            "(adcloud bag info lists them). Nothing was written"
        )


def read_features(out: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a job's output: ``{"HxW": (timestamps, features)}`` sorted by time, per size.

    Reads the part files the manifest lists (by name, in ``out``: the directory may have
    been moved), never a glob of ``out``, whose name may hold glob characters.  A listed
    file that is missing raises :class:`HeteroError`.
    """
    options = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(out, **options)
    try:
        with fs.open(posixpath.join(root, "manifest.json")) as handle:
            manifest = json.load(handle)
    except FileNotFoundError as err:
        raise HeteroError(f"{out} has no manifest.json: not a feature job's output") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise HeteroError(f"{out}/manifest.json is not valid JSON: {err}") from err
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("version") != FORMAT_VERSION
    ):
        raise HeteroError(f"{out} is not an {FORMAT} v{FORMAT_VERSION} output")
    groups: dict[str, list[tuple[NDArray[np.int64], NDArray[np.float32]]]] = defaultdict(list)
    try:
        names = sorted(
            posixpath.basename(url) for part in manifest["partitions"] for url in part["files"]
        )
    except (KeyError, TypeError) as err:  # a manifest cut short or edited by hand
        msg = f"{out}/manifest.json does not list its part files (partitions[].files): {err!r}"
        raise HeteroError(msg) from err
    for name in names:
        try:
            with fs.open(posixpath.join(root, name), "rb") as handle:
                raw = handle.read()
        except FileNotFoundError as err:
            raise HeteroError(
                f"{out} is incomplete: its manifest lists {name}, which is missing"
            ) from err
        try:
            with np.load(io.BytesIO(raw), allow_pickle=False) as data:
                height, width = (int(v) for v in data["shape"])
                groups[f"{height}x{width}"].append((data["timestamps"], data["features"]))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            raise HeteroError(f"{out}/{name} is not a readable {FORMAT} part: {err}") from err
    result: dict[str, Any] = {}
    for key, parts in groups.items():
        stamps = np.concatenate([s for s, _ in parts])
        features = np.concatenate([f for _, f in parts])
        order = np.argsort(stamps, kind="stable")
        result[key] = (stamps[order], features[order])
    return result
