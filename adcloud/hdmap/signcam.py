"""Stage 4, signs: their types read from camera images of the plates LiDAR found.

LiDAR measures a plate's size, which leaves most types ambiguous (many share one size); a
camera sees the printed face. For every camera image of a drive (``SignSettings.
camera_topic``, intrinsics from ``camera_info_topic``, the camera's mount from
``/tf_static``) and every sign :func:`~adcloud.hdmap.signs.detect_signs` found,
:func:`view_votes`:

1. puts the camera at the drive's solved pose at the image's stamp and projects the plate
   centre; a view counts when the plate is ``camera_min_distance_m`` ..
   ``camera_max_distance_m`` in front of the camera, inside the image, and the camera looks
   at its face (within ``camera_max_view_angle_deg`` of the plate normal);
2. takes the median colour of the pixels over the middle half of the projected plate (at
   least ``camera_min_pixels``), and its chromaticity (``rgb / (r + g + b)``, which shading
   and exposure leave alone);
3. votes for the catalogue type whose face colour (:attr:`SignShape.face`) has the nearest
   chromaticity, if it is within ``camera_max_chroma_distance`` (a grey back, a car in
   front of the plate or a colour no type has give no vote).

:func:`apply_camera_types` gives a sign the type most of its views voted for, once it has
``camera_min_views`` of them and that type has ``camera_min_share`` of its votes, and when
the LiDAR size fits that type (a plate size that rules the type out wins over the camera).
Votes are kept by map position (:class:`SignVote`), so a nightly build adds the new drives'
views to those of the drives before it without reading their images again.

The colour catalogue is a stand-in for a sign classifier: the default faces are the
synthetic drives' (one hue per type, ``adcloud.synth.world.SIGN_FACE_COLORS``); real signs
need a catalogue of their faces or a classifier in place of :func:`classify_face`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from scipy.spatial import cKDTree

from adcloud.binpipe import BinPipeRDD, decoded_messages, image_array, read_messages, summarize
from adcloud.hdmap.drive import stamp_ns
from adcloud.hdmap.errors import DriveDataError
from adcloud.hdmap.model import Extrinsics
from adcloud.hdmap.signs import SignSettings, TrafficSign
from adcloud.hdmap.trajectory import Trajectory

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "CameraIntrinsics",
    "SignVote",
    "apply_camera_types",
    "camera_sign_votes",
    "classify_face",
    "view_votes",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]


class SignVote(NamedTuple):
    """One camera view's vote: the plate centre it saw (map frame, m), the type, the pixels
    it read and the image's stamp (ns)."""

    x: float
    y: float
    z: float
    type: str
    pixels: int
    stamp: int


@dataclass(frozen=True)
class CameraIntrinsics:
    """A pinhole camera (``sensor_msgs/CameraInfo``'s ``K``, image size and frame)."""

    width: int
    height: int
    fx: float
    fy: float
    cx: float
    cy: float
    frame: str


def _chroma(rgb: F64) -> F64:
    rgb = np.asarray(rgb, dtype=np.float64).reshape(-1, 3)
    out: F64 = rgb / np.maximum(rgb.sum(axis=1, keepdims=True), 1e-9)
    return out


def classify_face(colour: Sequence[float] | F64, settings: SignSettings) -> str | None:
    """The catalogue type whose face colour is nearest ``colour`` (RGB, any scale) in
    chromaticity, or None when none is within ``camera_max_chroma_distance``."""
    faces = [(s.type, s.face) for s in settings.catalog if s.face is not None]
    if not faces or not np.all(np.isfinite(colour)) or float(np.sum(colour)) <= 0:
        return None
    chroma = _chroma(np.asarray(colour))[0]
    table = _chroma(np.asarray([f for _, f in faces]))
    dist = np.linalg.norm(table - chroma, axis=1)
    best = int(np.argmin(dist))
    return faces[best][0] if dist[best] <= settings.camera_max_chroma_distance else None


def _sign_arrays(signs: Sequence[TrafficSign]) -> tuple[F64, F64, F64]:
    """Centres (n, 3), unit normals (n, 3) and ``(width, height)`` (n, 2) of ``signs``."""
    if not signs:
        return np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 2))
    centres = np.array([s.position for s in signs], dtype=np.float64)
    yaw = np.array([s.facing_yaw for s in signs], dtype=np.float64)
    normals = np.column_stack([np.cos(yaw), np.sin(yaw), np.zeros_like(yaw)])
    sizes = np.array([[s.width_m, s.height_m] for s in signs], dtype=np.float64)
    return centres, normals, sizes


def view_votes(
    rgb: NDArray[np.uint8],
    stamp: int,
    camera_pose: F64,
    camera: CameraIntrinsics,
    signs: tuple[F64, F64, F64],
    settings: SignSettings,
) -> list[SignVote]:
    """The votes of one image ``rgb`` (H, W, 3) taken at ``stamp`` by ``camera`` at
    ``camera_pose`` (4x4 ``map <- camera optical frame``) for ``signs`` (centres, normals,
    sizes as :func:`_sign_arrays` gives them); see the module docstring."""
    centres, normals, sizes = signs
    if len(centres) == 0:
        return []
    eye = camera_pose[:3, 3]
    local = (centres - eye) @ camera_pose[:3, :3]  # optical frame: z forward, y down
    depth = local[:, 2]
    to_eye = eye - centres
    dist = np.linalg.norm(to_eye, axis=1)
    facing = np.einsum("ij,ij->i", normals, to_eye) / np.maximum(dist, 1e-9)
    max_angle = math.radians(settings.camera_max_view_angle_deg)
    usable = (
        (depth >= settings.camera_min_distance_m)
        & (dist <= settings.camera_max_distance_m)
        & (facing >= math.cos(max_angle))
    )
    votes: list[SignVote] = []
    h, w = rgb.shape[:2]
    for i in np.flatnonzero(usable):
        u = camera.fx * local[i, 0] / depth[i] + camera.cx
        v = camera.fy * local[i, 1] / depth[i] + camera.cy
        # a quarter of the plate's smaller side, projected: the patch is the face's middle
        r = 0.25 * float(np.min(sizes[i])) * camera.fx / depth[i]
        u0, u1 = math.floor(u - r), math.ceil(u + r)
        v0, v1 = math.floor(v - r), math.ceil(v + r)
        if u0 < 0 or v0 < 0 or u1 > w or v1 > h:
            continue
        patch = rgb[v0:v1, u0:u1].reshape(-1, rgb.shape[2])[:, :3]
        if len(patch) < settings.camera_min_pixels:
            continue
        kind = classify_face(np.median(patch.astype(np.float64), axis=0), settings)
        if kind is not None:
            c = centres[i]
            votes.append(SignVote(float(c[0]), float(c[1]), float(c[2]), kind, len(patch), stamp))
    return votes


_IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/Image")
_INFO_TYPES = ("sensor_msgs/msg/CameraInfo", "sensor_msgs/CameraInfo")


def _has_camera(uri: str, settings: SignSettings) -> bool:
    """Whether the bag's index lists the camera topics with the types the pass reads; a
    topic of another type is reported (the map is built, its signs typed by LiDAR)."""
    types = {t.topic: t.msgtype for t in summarize(uri).topics}
    for topic, wanted in (
        (settings.camera_topic, _IMAGE_TYPES),
        (settings.camera_info_topic, _INFO_TYPES),
    ):
        if topic not in types:
            log.info("%s: no %s; its signs are typed by LiDAR alone", uri, topic)
            return False
        if types[topic] not in wanted:
            log.warning(
                "%s: %s carries %s, not %s: its images cannot type signs (set "
                'hdmap_signs.camera_topic and camera_info_topic, or camera_topic="" to '
                "type signs by LiDAR alone)",
                uri,
                topic,
                types[topic],
                wanted[0],
            )
            return False
    return True


def _camera_info(uri: str, settings: SignSettings) -> CameraIntrinsics | None:
    """The first ``camera_info_topic`` message of the bag at ``uri``, or None."""
    try:
        for _message, info in read_messages(uri, topics=[settings.camera_info_topic]):
            k = [float(v) for v in (info.K if hasattr(info, "K") else info.k)]  # ROS 1 / 2
            frame = str(info.header.frame_id).lstrip("/")
            return CameraIntrinsics(
                int(info.width), int(info.height), k[0], k[4], k[2], k[5], frame
            )
    except (AttributeError, IndexError, TypeError) as err:
        raise DriveDataError(
            f"drive {uri}: {settings.camera_info_topic} is not sensor_msgs/CameraInfo ({err}); "
            "set hdmap_signs.camera_info_topic"
        ) from err
    return None


def _rgb(msg: Any, topic: str) -> NDArray[np.uint8] | None:
    """The image as RGB8, or None for encodings that carry no colour."""
    encoding = str(msg.encoding).lower()
    if encoding not in ("rgb8", "bgr8", "rgba8", "bgra8"):
        return None
    pixels = image_array(msg, topic=topic)
    if encoding.startswith("bgr"):
        pixels = pixels[..., [2, 1, 0]]
    return np.ascontiguousarray(pixels[..., :3], dtype=np.uint8)


def _partition_votes(
    blocks: Iterable[bytes | bytearray],
    *,
    camera: CameraIntrinsics,
    mount: F64,
    trajectory: Trajectory,
    signs: tuple[F64, F64, F64],
    settings: SignSettings,
) -> Iterator[SignVote]:
    """Executor: the votes of one partition's camera images."""
    for message, decoded in decoded_messages(blocks, topics=[settings.camera_topic]):
        rgb = _rgb(decoded, message.topic)
        if rgb is None:
            continue
        stamp = stamp_ns(decoded.header)
        if not trajectory.t[0] <= stamp <= trajectory.t[-1]:
            continue  # no solved pose there
        # interpolate between the neighbouring poses only (at() over a whole long drive
        # would build its rotation interpolator from every pose, for every image)
        i = int(np.searchsorted(trajectory.t, stamp))
        near = slice(max(i - 2, 0), min(i + 2, len(trajectory)))
        pose = Trajectory(trajectory.t[near], trajectory.matrices[near]).at(stamp)[0] @ mount
        yield from view_votes(rgb, stamp, pose, camera, signs, settings)


def camera_sign_votes(
    spark: SparkSession,
    drives: Mapping[str, tuple[str, Extrinsics]],
    trajectories: Mapping[str, Trajectory],
    signs: Sequence[TrafficSign],
    settings: SignSettings,
) -> list[SignVote]:
    """The votes of every camera image of ``drives`` (name: ``(bag URI, its mounts)``) for
    ``signs``: one Spark job reading only the camera topic's byte ranges. Drives without
    ``camera_info_topic``, or whose camera frame has no mount, give none."""
    if not signs or not settings.camera_topic:
        return []
    arrays = _sign_arrays(signs)
    rdds = []
    for name, (uri, extrinsics) in sorted(drives.items()):
        if name not in trajectories:
            continue
        camera = _camera_info(uri, settings) if _has_camera(uri, settings) else None
        if camera is None:
            continue
        try:
            mount = extrinsics.get(camera.frame)
        except KeyError:
            log.warning(
                "%s: the camera frame %r has no mount on /tf_static (or in hdmap.mounts); "
                "its images cannot type signs",
                uri,
                camera.frame,
            )
            continue
        pipe = BinPipeRDD.from_bags(spark, uri, topics=[settings.camera_topic])
        part = functools.partial(
            _partition_votes,
            camera=camera,
            mount=mount,
            trajectory=trajectories[name],
            signs=arrays,
            settings=settings,
        )
        rdds.append(pipe.rdd.mapPartitions(part))
    if not rdds:
        return []
    union = spark.sparkContext.union(rdds) if len(rdds) > 1 else rdds[0]
    return [SignVote(*v) for v in union.collect()]


def apply_camera_types(
    signs: Sequence[TrafficSign], votes: Sequence[SignVote], settings: SignSettings
) -> list[TrafficSign]:
    """``signs`` with the types their camera views agree on (see the module docstring);
    a typed sign's attributes say ``type_from: camera`` and how many views voted."""
    if not signs or not votes:
        return list(signs)
    centres, _, _ = _sign_arrays(signs)
    points = np.array([[v.x, v.y, v.z] for v in votes], dtype=np.float64)
    dist, owner = cKDTree(centres).query(points, distance_upper_bound=settings.camera_match_m)
    tallies: list[dict[str, int]] = [{} for _ in signs]
    for vote, d, i in zip(votes, dist, owner, strict=True):
        if np.isfinite(d):
            tallies[int(i)][vote.type] = tallies[int(i)].get(vote.type, 0) + 1
    out = []
    for sign, tally in zip(signs, tallies, strict=True):
        views = sum(tally.values())
        if views < settings.camera_min_views:
            out.append(sign)
            continue
        kind, count = max(tally.items(), key=lambda kv: (kv[1], kv[0]))
        sized = not sign.candidates or kind in sign.candidates
        if count / views < settings.camera_min_share or not sized:
            out.append(sign)
            continue
        attributes = {**sign.attributes, "type_from": "camera", "camera_views": views}
        out.append(replace(sign, type=kind, candidates=(kind,), attributes=attributes))
    typed = sum(s.attributes.get("type_from") == "camera" for s in out)
    log.info("signs: %d of %d typed from %d camera views", typed, len(out), len(votes))
    return out
