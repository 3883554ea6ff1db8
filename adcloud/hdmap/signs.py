"""Stage 4, signs: traffic signs from map-frame LiDAR points.

Sign plates are retro-reflective: their returns are far brighter than anything else standing
beside a road (in the synthetic drives, plate points reach 150-255 while buildings, cars,
poles and paint stay below 150). :func:`detect_signs`:

1. keeps points at or above ``min_intensity``;
2. clusters them by single linkage (points closer than ``cluster_radius_m``; SciPy's
   ``cKDTree`` and connected components) and drops clusters of fewer than ``min_points``;
3. fits a plane to each cluster (SVD): a plate is thin (``max_thickness_m``), vertical
   (normal within ``max_normal_tilt_deg`` of horizontal) and small (``max_extent_m``), and
   its centre stands ``min_height_m``..``max_height_m`` above the ground (the 5th
   percentile of the points within ``ground_radius_m``, else the grid's elevation);
4. takes the plate centre as the middle of the plate points' in-plane extent, and its
   width and height from that extent (0.5th to 99.5th percentile);
5. turns the plane normal towards the traffic the sign serves: the post stands behind the
   plate, so the normal points away from the post points found under the plate. Where no
   post is seen and the drive's trajectory is given, the traffic rule decides (with
   ``right_hand_traffic``, a plate on the right of the drive faces against it, one on its
   left faces along it; confidence x 0.75), and for a plate across the drive's road (a
   cross street's) the face towards the drive, which is the face that returns bright on
   real signs (the synthetic plates are bright on both faces; confidence halved); without
   a trajectory the normal is left as fitted and the confidence halved;
6. types the plate (when it has ``min_type_points`` points) by its size from ``catalog``
   (plate sizes are standardised: e.g. the US MUTCD's 30 x 30 in stop sign and 24 x 30 in
   speed-limit sign). When several types share the measured size the type is ``unknown``
   and ``candidates`` lists them. LiDAR cannot see what is printed on a plate; the camera
   can: :mod:`adcloud.hdmap.signcam` types the plates found here from a drive's images.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.spatial import cKDTree

from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.labels import GridLookup
from adcloud.hdmap.trajectory import Trajectory

__all__ = [
    "DEFAULT_SIGN_CATALOG",
    "SignSettings",
    "SignShape",
    "TrafficSign",
    "detect_signs",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class SignShape:
    """A sign type, its plate size (m) and the colour of its face (RGB 0..1, for the camera
    pass of :mod:`adcloud.hdmap.signcam`; None: the camera cannot tell it)."""

    type: str
    width_m: float
    height_m: float
    face: tuple[float, float, float] | None = None


#: The plate sizes (US MUTCD-like) and face colours of the sign set the synthetic worlds
#: use (``adcloud.synth.world.SIGN_FACE_COLORS``: one hue per type).
DEFAULT_SIGN_CATALOG: tuple[SignShape, ...] = (
    SignShape("stop", 0.75, 0.75, (0.85, 0.12, 0.12)),
    SignShape("yield", 0.75, 0.75, (0.90, 0.80, 0.10)),
    SignShape("speed_limit_30", 0.75, 0.75, (0.80, 0.15, 0.80)),
    SignShape("speed_limit_50", 0.6, 0.8, (0.10, 0.75, 0.80)),
    SignShape("no_parking", 0.75, 0.75, (0.12, 0.25, 0.85)),
    SignShape("pedestrian_crossing", 0.75, 0.75, (0.15, 0.70, 0.20)),
)


@dataclass(frozen=True)
class SignSettings:
    """How signs are found (metres, intensity in the LiDAR's unit; see the module doc).

    ``size_tolerance_m``: how far a measured width/height may be from a catalogue size to
    match it (the height may also be short of it: a plate's top or bottom is often missed);
    plates with fewer than ``min_type_points`` points are too thinly sampled to measure and
    get no type candidates. ``right_hand_traffic`` orients plates without a visible post
    (step 5). The ``camera_*`` settings are those of :mod:`adcloud.hdmap.signcam`, which
    types the plates from camera images (``camera_topic`` empty: LiDAR only).
    """

    min_intensity: float = 160.0
    cluster_radius_m: float = 0.3
    min_points: int = 15
    max_thickness_m: float = 0.1
    max_normal_tilt_deg: float = 20.0
    max_extent_m: float = 1.6
    min_height_m: float = 1.2
    max_height_m: float = 4.5
    ground_radius_m: float = 1.0
    post_radius_m: float = 0.3
    post_depth_m: float = 1.0
    size_tolerance_m: float = 0.06
    min_type_points: int = 60
    right_hand_traffic: bool = True
    catalog: tuple[SignShape, ...] = DEFAULT_SIGN_CATALOG
    camera_topic: str = "/camera/image_raw"
    camera_info_topic: str = "/camera/camera_info"
    camera_min_distance_m: float = 2.0
    camera_max_distance_m: float = 25.0
    camera_max_view_angle_deg: float = 60.0
    camera_min_pixels: int = 4
    camera_max_chroma_distance: float = 0.15
    camera_min_views: int = 2
    camera_min_share: float = 0.6
    camera_match_m: float = 0.75

    def __post_init__(self) -> None:
        positive = {
            "cluster_radius_m": self.cluster_radius_m,
            "max_thickness_m": self.max_thickness_m,
            "max_normal_tilt_deg": self.max_normal_tilt_deg,
            "max_extent_m": self.max_extent_m,
            "ground_radius_m": self.ground_radius_m,
            "post_radius_m": self.post_radius_m,
            "post_depth_m": self.post_depth_m,
            "size_tolerance_m": self.size_tolerance_m,
            "camera_min_distance_m": self.camera_min_distance_m,
            "camera_max_distance_m": self.camera_max_distance_m,
            "camera_max_view_angle_deg": self.camera_max_view_angle_deg,
            "camera_max_chroma_distance": self.camera_max_chroma_distance,
            "camera_match_m": self.camera_match_m,
        }
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise HdmapError(f"SignSettings.{name} must be a positive number, got {value!r}")
        if self.min_points < 3:
            raise HdmapError(f"SignSettings.min_points must be >= 3, got {self.min_points}")
        if not self.min_height_m < self.max_height_m:
            raise HdmapError("SignSettings.min_height_m must be below max_height_m")
        if not self.camera_min_distance_m < self.camera_max_distance_m:
            raise HdmapError(
                "SignSettings.camera_min_distance_m must be below camera_max_distance_m"
            )
        if not 0 < self.camera_min_share <= 1:
            raise HdmapError(
                f"SignSettings.camera_min_share must be in (0, 1], got {self.camera_min_share}"
            )


@dataclass(frozen=True)
class TrafficSign:
    """A traffic sign: ``position`` (3,) the plate centre in the map frame (m);
    ``facing_yaw`` the direction of the plate normal towards the traffic it serves (rad,
    ENU, counter-clockwise from east); ``width_m``/``height_m`` the plate size;
    ``height_above_ground_m`` of the plate centre (NaN if unknown); ``type`` (``unknown``
    when the data cannot tell) and ``candidates`` (the types the size fits);
    ``confidence`` 0-1; ``point_count`` the LiDAR points on the plate; ``source``, ``id``
    and ``attributes`` as for the other semantic features."""

    position: F64
    facing_yaw: float
    width_m: float
    height_m: float
    height_above_ground_m: float = float("nan")
    type: str = "unknown"
    candidates: tuple[str, ...] = ()
    confidence: float = 1.0
    point_count: int = 0
    source: str = "auto"
    id: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pos = np.asarray(self.position, dtype=np.float64).reshape(-1)
        if pos.shape != (3,) or not np.isfinite(pos).all():
            raise HdmapError(
                f"traffic sign {self.id!r}: position must be 3 finite numbers, got {pos}"
            )
        object.__setattr__(self, "position", pos)


def _check_points(points: Any, intensity: Any) -> tuple[F64, NDArray[np.float32]]:
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise HdmapError(f"detect_signs: points must be an (n, 3) map-frame array, got {pts.shape}")
    inten = np.asarray(intensity, dtype=np.float32).reshape(-1)
    if inten.shape[0] != pts.shape[0]:
        raise HdmapError(
            f"detect_signs: {pts.shape[0]} points but {inten.shape[0]} intensities; give one "
            "intensity per point"
        )
    return pts, inten


def _clusters(xyz: F64, radius: float) -> list[NDArray[np.int64]]:
    """The connected components of the graph joining points at most ``radius`` apart, each
    as ascending point indices, ordered by their first point.

    A plate seen by many sweeps is thousands of points, each within ``radius`` of hundreds:
    listing every pair (tens of millions on a one-minute 32-beam drive) took seconds. The
    points of one cube of edge ``radius / sqrt(3)`` are all within ``radius`` of each other,
    so the cubes are joined instead: two neighbouring cubes when their closest points are
    within ``radius`` (the same components, exactly)."""
    n = len(xyz)
    if n == 0:
        return []
    edge = radius / math.sqrt(3.0) * (1.0 - 1e-9)  # half-open cubes: diagonal below radius
    cubes, of_point = np.unique(np.floor(xyz / edge).astype(np.int64), axis=0, return_inverse=True)
    of_point = of_point.ravel()
    by_cube = np.argsort(of_point, kind="stable")
    starts = np.searchsorted(of_point[by_cube], np.arange(len(cubes) + 1))
    members = [by_cube[starts[i] : starts[i + 1]] for i in range(len(cubes))]
    index = {tuple(c): i for i, c in enumerate(cubes.tolist())}
    reach = math.ceil(radius / edge)
    steps = range(-reach, reach + 1)
    # neighbour offsets (each pair of cubes once) whose cubes can hold points within radius
    offsets = [
        (dx, dy, dz)
        for dx in steps
        for dy in steps
        for dz in steps
        if (dx, dy, dz) > (0, 0, 0)
        and sum((max(abs(d) - 1, 0) * edge) ** 2 for d in (dx, dy, dz)) <= radius**2
    ]
    parent = list(range(len(cubes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    trees: dict[int, cKDTree] = {}
    for i, cube in enumerate(cubes.tolist()):
        for dx, dy, dz in offsets:
            j = index.get((cube[0] + dx, cube[1] + dy, cube[2] + dz))
            if j is None or root(i) == root(j):
                continue
            if i not in trees:
                trees[i] = cKDTree(xyz[members[i]])
            dist, _ = trees[i].query(xyz[members[j]], k=1)
            if float(np.min(dist)) <= radius:
                parent[root(j)] = root(i)
    label = np.array([root(i) for i in range(len(cubes))])[of_point]
    # components in the order of their first point, as a graph search from point 0 gives
    first = np.full(len(cubes), n, np.int64)
    np.minimum.at(first, label, np.arange(n))
    order = np.lexsort((np.arange(n), first[label]))
    bounds = np.flatnonzero(np.diff(first[label][order])) + 1
    return [np.asarray(g, dtype=np.int64) for g in np.split(order, bounds)]


def _extent(values: F64) -> tuple[float, float]:
    lo, hi = np.percentile(values, [0.5, 99.5])
    return float(lo), float(hi)


def _classify(width: float, height: float, settings: SignSettings) -> tuple[str, tuple[str, ...]]:
    """``(type, candidates)``: the catalogue types the measured plate fits (width within the
    tolerance, height not above it), and the type if exactly one fits in both dimensions."""
    tol = settings.size_tolerance_m
    fits = [
        s for s in settings.catalog if abs(width - s.width_m) <= tol and height <= s.height_m + tol
    ]
    candidates = tuple(dict.fromkeys(s.type for s in fits))
    if len(candidates) == 1 and all(abs(height - s.height_m) <= tol for s in fits):
        return candidates[0], candidates
    return "unknown", candidates


def detect_signs(
    points: F64,
    intensity: NDArray[np.floating[Any]],
    ground: GridLookup | None = None,
    settings: SignSettings | None = None,
    *,
    trajectory: Trajectory | None = None,
) -> list[TrafficSign]:
    """Traffic signs in a map-frame point cloud (see the module docstring).

    ``points`` (n, 3) float64 map-frame metres, ``intensity`` (n,) in the LiDAR's unit (the
    synthetic drives' 0-255); ``ground`` the grid layers, used for the ground height where
    the points themselves show no ground near a sign; ``trajectory`` the drive, which
    orients plates whose post is not seen (step 5). Ids are ``sign-<n>``.
    """
    settings = settings or SignSettings()
    pts, inten = _check_points(points, intensity)
    path = _PathLookup(trajectory) if trajectory is not None and len(trajectory) >= 2 else None
    bright = np.flatnonzero(inten >= settings.min_intensity)
    log.info(
        "signs: %d of %d points at intensity >= %g", len(bright), len(pts), settings.min_intensity
    )
    if not len(bright):
        return []
    around = _near_cells(pts[:, :2], pts[bright, :2], settings.ground_radius_m + 0.5)
    near = pts[around]
    near_dim = inten[around] < settings.min_intensity
    column_tree = cKDTree(near[:, :2])
    tilt = math.sin(math.radians(settings.max_normal_tilt_deg))
    out: list[TrafficSign] = []
    rejected: dict[str, int] = {}

    def reject(why: str) -> None:
        rejected[why] = rejected.get(why, 0) + 1

    for group in _clusters(pts[bright], settings.cluster_radius_m):
        if len(group) < settings.min_points:
            reject("few points")
            continue
        plate = pts[bright[group]]
        centroid = plate.mean(axis=0)
        _, sv, vt = np.linalg.svd(plate - centroid, full_matrices=False)
        normal = vt[2]
        thickness = float(sv[2] / math.sqrt(len(plate)))
        if thickness > settings.max_thickness_m:
            reject("not flat")
            continue
        if abs(float(normal[2])) > tilt:
            reject("not vertical")
            continue
        horizontal = np.array([-normal[1], normal[0], 0.0])
        horizontal /= float(np.linalg.norm(horizontal))
        u_lo, u_hi = _extent((plate - centroid) @ horizontal)
        z_lo, z_hi = _extent(plate[:, 2])
        width, height = u_hi - u_lo, z_hi - z_lo
        if max(width, height) > settings.max_extent_m:
            reject("too large")
            continue
        centre = centroid + horizontal * (u_lo + u_hi) / 2
        centre[2] = (z_lo + z_hi) / 2
        ground_z = _ground_height(near, column_tree, centre, z_lo, ground, settings)
        above = centre[2] - ground_z if math.isfinite(ground_z) else float("nan")
        if math.isfinite(above) and not settings.min_height_m <= above <= settings.max_height_m:
            reject("height")
            continue
        n2 = np.array([normal[0], normal[1]]) / float(np.linalg.norm(normal[:2]))
        side = _post_side(near, near_dim, column_tree, centre, n2, settings)
        confidence = min(1.0, len(plate) / 100.0)
        if side == 0 and path is not None:
            side = path.facing_side(centre, n2, settings.right_hand_traffic)
            confidence *= 0.75
            if side == 0:
                side = path.seen_side(centre, n2)
                confidence *= 2 / 3
        elif side == 0:
            confidence *= 0.5
        if side > 0:
            n2 = -n2  # the post is in front of the fitted normal: flip it
        kind, candidates = (
            _classify(width, height, settings)
            if len(plate) >= settings.min_type_points
            else ("unknown", ())
        )
        out.append(
            TrafficSign(
                position=centre,
                facing_yaw=float(math.atan2(n2[1], n2[0])),
                width_m=round(width, 3),
                height_m=round(height, 3),
                height_above_ground_m=round(above, 3) if math.isfinite(above) else above,
                type=kind,
                candidates=candidates,
                confidence=round(confidence, 3),
                point_count=len(plate),
                source="auto",
                id=f"sign-{len(out)}",
            )
        )
    log.info("signs: %d signs; clusters left out: %s", len(out), rejected or "none")
    return out


def _near_cells(xy: F64, anchors: F64, radius: float) -> NDArray[np.bool_]:
    """Which of ``xy`` lie in the ``radius``-sized cells at or next to an anchor's cell (a
    cheap superset of the points within ``radius`` of an anchor)."""
    cell = np.floor(xy / radius).astype(np.int64)
    anchor = np.floor(anchors / radius).astype(np.int64)
    shifts = np.array([[dx, dy] for dx in (-1, 0, 1) for dy in (-1, 0, 1)])
    around = (anchor[:, None, :] + shifts[None, :, :]).reshape(-1, 2)
    # one int64 key per cell (the offset keeps keys positive for any map within 10^7 cells)
    span = np.int64(1 << 24)
    keys = np.unique((around[:, 0] + span) * (2 * span) + (around[:, 1] + span))
    return np.isin((cell[:, 0] + span) * (2 * span) + (cell[:, 1] + span), keys)


def _ground_height(
    pts: F64,
    tree: cKDTree,
    centre: F64,
    plate_bottom: float,
    ground: GridLookup | None,
    settings: SignSettings,
) -> float:
    """Ground height under a plate: the 5th percentile of the points around it that lie
    below the plate, else the grid's elevation nearby; NaN when neither shows it."""
    idx = np.asarray(tree.query_ball_point(centre[:2], settings.ground_radius_m), dtype=np.int64)
    if len(idx):
        z = pts[idx, 2]
        z = z[z < plate_bottom - 0.3]
        if len(z) >= 10:
            return float(np.percentile(z, 5))
    if ground is not None:
        r = settings.ground_radius_m
        offsets = np.array([[dx, dy] for dx in (-r, 0.0, r) for dy in (-r, 0.0, r)])
        elev = ground.elevation_at(centre[:2] + offsets)
        elev = elev[np.isfinite(elev)]
        if len(elev):
            return float(np.min(elev))
    return float("nan")


class _PathLookup:
    """The driven path for the traffic-side rule of :func:`detect_signs`."""

    def __init__(self, trajectory: Trajectory) -> None:
        xy = trajectory.xyz[:, :2]
        step = np.gradient(xy, axis=0)
        norm = np.linalg.norm(step, axis=1)
        moving = norm > 1e-6
        self.xy = xy[moving]
        self.heading = step[moving] / norm[moving, None]
        self.tree = cKDTree(self.xy) if len(self.xy) else None

    def facing_side(self, centre: F64, normal: F64, right_hand: bool) -> int:
        """+1 if ``normal`` should be flipped, -1 if kept, 0 if the road does not tell: a
        sign on the right of the drive serves it and faces against it (right-hand
        traffic), one on the left serves the opposite traffic and faces along it."""
        if self.tree is None:
            return 0
        _, k = self.tree.query(centre[:2])
        h = self.heading[k]
        rel = centre[:2] - self.xy[k]
        lateral = float(h[0] * rel[1] - h[1] * rel[0])  # left positive
        along = float(normal @ h)
        if abs(along) < 0.5 or abs(lateral) < 1.0:
            return 0  # a plate across the drive's road (a cross street's) or on it
        wanted = 1.0 if (lateral > 0) == right_hand else -1.0  # sign of normal . heading
        return -1 if along * wanted > 0 else 1

    def seen_side(self, centre: F64, normal: F64) -> int:
        """+1 if ``normal`` points away from the nearest point of the drive (flip it): a
        retro-reflective face is the one the sensor sees bright."""
        if self.tree is None:
            return 0
        _, k = self.tree.query(centre[:2])
        return 1 if float((self.xy[k] - centre[:2]) @ normal) < 0 else -1


def _post_side(
    pts: F64,
    dim: NDArray[np.bool_],
    tree: cKDTree,
    centre: F64,
    normal: F64,
    settings: SignSettings,
) -> int:
    """+1 if the post under the plate stands on the side ``normal`` points to, -1 if
    behind it, 0 if no post is seen.

    Post points are the points that are not retro-reflective (``dim``), lie under the
    plate's centre (within 0.08 m of its vertical centre line, below its centre, down to
    ``post_depth_m`` under its lowest possible edge) and off its plane (2-15 cm: the plate's
    own points lie within its thickness and the range noise)."""
    idx = np.asarray(tree.query_ball_point(centre[:2], settings.post_radius_m), dtype=np.int64)
    if not len(idx):
        return 0
    tallest = max((s.height_m for s in settings.catalog), default=0.8)
    rel = pts[idx, :2] - centre[:2]
    off = rel @ normal
    along_plate = np.abs(rel @ np.array([-normal[1], normal[0]]))
    z = pts[idx, 2]
    post = (
        dim[idx]
        & (along_plate <= 0.08)
        & (np.abs(off) >= 0.02)
        & (np.abs(off) <= 0.15)
        & (z < centre[2])
        & (z > centre[2] - tallest / 2 - settings.post_depth_m)
    )
    if post.sum() < 3:
        return 0
    offset = float(np.median(off[post]))
    return 1 if offset > 0 else -1
