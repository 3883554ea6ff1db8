"""Loop closures: keyframes that revisit a place, within one drive or across drives.

A drive that comes back to where it was (or two drives of the same area) sees the same
buildings, poles and curbs twice. :func:`find_loop_closures` proposes pairs of keyframes
whose current position estimates are close (:func:`loop_candidates`) although the car has
travelled far or a long time has passed between them -- otherwise the pair is just two
neighbours of the odometry chain -- and verifies each with point-to-plane ICP
(:func:`adcloud.hetero.align`): a pair becomes a :class:`LoopClosure` only when the
registration converges with enough overlap (fitness), a small residual and a correction
within what the position estimates can be wrong by. The accepted closures enter the
pose graph of :func:`adcloud.hdmap.poses.join_segments` as relative-pose constraints with
a robust noise model, so one wrong closure that slips through cannot tear the map.

Keys are ``(drive, stamp)``: keyframes of several drives are searched together, which
ties drives of the same area into one globally consistent map. An incremental build ties
its new drives to the map built before in the same way: the earlier builds' keyframes are
kept in a :class:`KeyframeArchive` and take part as *fixed* keyframes (their poses are the
map's and do not move; only closures that involve a new keyframe are looked for).

Frames: a :class:`Keyframe` cloud is in ``base_link`` at the keyframe's stamp (motion
de-skewed), ``pose`` maps ``base_link`` into ``map``; ``LoopClosure.relative`` maps the
second keyframe's ``base_link`` into the first's.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from scipy.spatial import cKDTree

from adcloud.config import load_settings
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.exchange import dump_items, load_items
from adcloud.hdmap.mapdir import link_or_copy
from adcloud.hetero import HeteroError, align
from adcloud.hetero.devices import ComputeDevice, as_device

__all__ = [
    "DriveTies",
    "Keyframe",
    "KeyframeArchive",
    "LoneDrive",
    "LoopClosure",
    "LoopSearch",
    "LoopSettings",
    "UnplacedDrive",
    "UntiedDrives",
    "find_loop_closures",
    "local_keyframe",
    "loop_candidates",
    "verify_loop",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class LoopSettings:
    """How loop closures are proposed and accepted (section ``hdmap_loops``, env
    ``ADCLOUD_HDMAP_LOOPS_*``).

    Candidates: keyframes of the same drive closer than ``search_radius_m`` whose
    separation along the drive is at least ``min_travel_m`` and ``min_interval_s``
    (keyframes of different drives always qualify); at most ``max_per_keyframe`` nearest
    candidates per keyframe and, along a revisit, one pair per ``stride`` keyframes.
    Verification registers the sweeps of ``map_keyframes`` neighbours on each side of one
    keyframe (placed by their pose estimates) onto those around the other: single sparse
    sweeps sample surfaces too thinly for reliable normals. ICP runs coarse
    (``coarse_voxel_m``, matching within ``coarse_distance_m``) then fine (``voxel_m``,
    ``max_distance_m``); a closure is accepted with fitness at least ``min_fitness``,
    point-to-plane RMSE at most ``max_rmse_m`` and a correction of the initial guess no
    larger than ``max_correction_m`` / ``max_correction_rad``.
    ``sigma_translation_m`` / ``sigma_rotation_rad`` and a Cauchy kernel of ``robust_k``
    (in sigmas) weight an accepted closure in the pose graph.
    """

    search_radius_m: float = 8.0
    map_keyframes: int = 2
    min_travel_m: float = 60.0
    min_interval_s: float = 15.0
    max_per_keyframe: int = 1
    stride: int = 3
    coarse_voxel_m: float = 1.0
    coarse_distance_m: float = 3.0
    voxel_m: float = 0.4
    max_distance_m: float = 1.0
    iterations: int = 30
    min_fitness: float = 0.45
    max_rmse_m: float = 0.1
    max_correction_m: float = 3.0
    max_correction_rad: float = 0.3
    sigma_translation_m: float = 0.03
    sigma_rotation_rad: float = 0.002
    robust_k: float = 3.0

    def __post_init__(self) -> None:
        positive = (
            "search_radius_m",
            "coarse_voxel_m",
            "coarse_distance_m",
            "voxel_m",
            "max_distance_m",
            "max_rmse_m",
            "sigma_translation_m",
            "sigma_rotation_rad",
            "robust_k",
        )
        for name in positive:
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise HdmapError(f"loop settings: {name} must be > 0, got {value!r}")
        if self.map_keyframes < 0:
            raise HdmapError(f"loop settings: map_keyframes must be >= 0, got {self.map_keyframes}")
        if self.max_per_keyframe < 1 or self.stride < 1 or self.iterations < 1:
            raise HdmapError(
                "loop settings: max_per_keyframe, stride and iterations must be >= 1, got "
                f"{self.max_per_keyframe}, {self.stride}, {self.iterations}"
            )
        if not 0 < self.min_fitness <= 1:
            raise HdmapError(
                f"loop settings: min_fitness must be in (0, 1], got {self.min_fitness}"
            )

    @classmethod
    def load(
        cls,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> LoopSettings:
        """Defaults, then the ``hdmap_loops`` section of ``file``, then
        ``ADCLOUD_HDMAP_LOOPS_*``, then ``overrides``."""
        return load_settings(cls, "hdmap_loops", file=file, environ=environ, **overrides)


@dataclass(frozen=True, eq=False)
class Keyframe:
    """A keyframe: drive, ``stamp`` (ns), current ``pose`` estimate (4x4 ``map <- base_link``),
    ``travel_m`` (distance driven since the drive's start, m) and ``cloud`` (N, 3) float32,
    the de-skewed, voxel-downsampled sweep in ``base_link`` at ``stamp``."""

    drive: str
    stamp: int
    pose: F64
    travel_m: float
    cloud: NDArray[np.float32]

    @property
    def key(self) -> tuple[str, int]:
        """``(drive, stamp)``: the keyframe's node in the global pose graph."""
        return (self.drive, self.stamp)


@dataclass(frozen=True, eq=False)
class LoopClosure:
    """A verified revisit: ``relative`` (4x4) maps keyframe ``b``'s ``base_link`` into
    keyframe ``a``'s; ``fitness`` and ``rmse_m`` are ICP's; ``correction_m`` how far it
    moved ``b`` from where the pose estimates had put it."""

    a: tuple[str, int]
    b: tuple[str, int]
    relative: F64
    fitness: float
    rmse_m: float
    correction_m: float


@dataclass(frozen=True)
class UntiedDrives:
    """Two drives that came close -- ``candidates`` keyframe pairs of them within the
    search radius, the closest ``closest_m`` apart by their pose estimates (m, ``map``)
    -- but that no loop closure ties: each is placed by its own GPS alone, which can be a
    metre or two from the other (two days' receiver biases), and the map may show their
    common road twice. ``drives`` are in name order."""

    drives: tuple[str, str]
    candidates: int
    closest_m: float

    def note(self) -> str:
        """The line a person reads in the build's report."""
        a, b = self.drives
        return (
            f"drives {a} and {b} come within {self.closest_m:.1f} m of each other "
            f"({self.candidates} candidate keyframe pair(s)) but no loop closure between "
            "them passed verification: they are not tied, each is placed by its own GPS "
            "alone and they may lie a metre or two apart"
        )


@dataclass(frozen=True)
class LoneDrive:
    """A drive of a map of several drives that, when it was built, came within
    ``search_radius_m`` (m, ``map``; :attr:`LoopSettings.search_radius_m`) of no keyframe of
    any other drive: no loop closure could even be proposed, so nothing joins it to the
    other drives and its poses rest on its own GPS alone. Right for a drive of another
    area; for one of the same roads, its GPS (or the others') is off by more than the
    radius."""

    drive: str
    search_radius_m: float

    def note(self) -> str:
        """The line a person reads in the build's report."""
        return (
            f"drive {self.drive} is not joined to the map's other drives: when it was built "
            f"it came within {self.search_radius_m:g} m (hdmap_loops.search_radius_m) of none "
            "of them, so no loop closure was looked for and its poses rest on its own GPS "
            "alone; if it drove the same roads as they did, its GPS is off by more than that: "
            "raise hdmap_loops.search_radius_m (ADCLOUD_HDMAP_LOOPS_SEARCH_RADIUS_M) above "
            "the GPS error and build it again (rollback, then --readmit)"
        )


@dataclass(frozen=True)
class UnplacedDrive:
    """A drive that no GPS fix places in ``map``: none of its own was used (it has
    ``fixes``, all of them rejected as outliers, or none) and no loop closure ties it, through
    other drives, to one whose fixes were or to the map's earlier drives. Pose recovery holds
    its start where its odometry starts -- the map origin, heading east -- which is right
    only if the drive did start there; its keyframes are then too far from where it drove
    for a loop closure to be even proposed."""

    drive: str
    fixes: int

    def note(self) -> str:
        """The line a person reads in the build's report."""
        had = (
            f"all {self.fixes} of its GPS fixes were rejected as outliers"
            if self.fixes
            else "it has no GPS fix"
        )
        return (
            f"drive {self.drive} is not placed on the map: {had} and no loop closure ties it "
            "to a drive that has them, so it was put with its start at the map origin, "
            "heading east, which is right only if it started there; check its GPS topic "
            "(hdmap.gps_topic, ADCLOUD_HDMAP_GPS_TOPIC) and receiver, then build it again "
            "(rollback, then --readmit)"
        )


class LoopSearch(NamedTuple):
    """What :func:`find_loop_closures` found: the verified ``closures``, the pairs of
    drives that came close but were not ``untied`` by any of them, and the drives that came
    close to no other drive at all (``alone``)."""

    closures: list[LoopClosure]
    untied: list[UntiedDrives]
    alone: Sequence[LoneDrive] = ()


@dataclass(frozen=True)
class DriveTies:
    """How a map's drives hold together, as pose recovery found it: the pairs of drives
    that came close but that no loop closure tied (:class:`UntiedDrives`;
    each is placed by its own GPS alone), per drive tied by closures, how far its GPS
    fixes read from where the closures put it (x, y, z in m, ``map`` ENU; fix minus pose,
    see :class:`~adcloud.hdmap.poses.JoinedPoses`), and the drives that came close to no
    other drive (:class:`LoneDrive`), and those that no GPS fix places (:class:`UnplacedDrive`).
    An offset beyond ``LARGE_GPS_OFFSET_M`` is singled out in the notes.

    Stored as ``drive_ties.json`` beside a build's ``report/summary.html``
    (:func:`~adcloud.hdmap.report.write_report`). Format history: 1, the first; 2 adds
    ``alone`` (``[{"drive", "search_radius_m"}]``; read as none from format 1); 3 adds
    ``unplaced`` (``[{"drive", "fixes"}]``; read as none from formats 1 and 2).
    """

    untied: tuple[UntiedDrives, ...] = ()
    gps_offsets: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    alone: tuple[LoneDrive, ...] = ()
    unplaced: tuple[UnplacedDrive, ...] = ()

    FORMAT = 3
    #: More than a day's receiver bias (a few decimetres): another day's far off the map's,
    #: or a wrong antenna lever arm.
    LARGE_GPS_OFFSET_M = 1.0

    def __bool__(self) -> bool:
        return bool(self.untied or self.gps_offsets or self.alone or self.unplaced)

    def notes(self) -> list[str]:
        """One line per drive not placed, per untied pair, per drive joined to no other and
        per tied drive, for the report's notes."""
        out = [drive.note() for drive in self.unplaced]
        out += [pair.note() for pair in self.untied]
        out += [lone.note() for lone in self.alone]
        for drive, (x, y, z) in sorted(self.gps_offsets.items()):
            size = math.sqrt(x * x + y * y + z * z)
            text = (
                f"drive {drive} is tied by loop closures; its GPS reads {size:.2f} m off where "
                f"they put it ({x:+.2f}, {y:+.2f}, {z:+.2f} m east, north, up)"
            )
            if size > self.LARGE_GPS_OFFSET_M:
                text = (
                    f"LARGE GPS OFFSET: {text}, more than {self.LARGE_GPS_OFFSET_M:g} m: "
                    "another day's receiver bias, or a wrong GPS antenna lever arm (check "
                    "the drive's extrinsics)"
                )
            out.append(text)
        return out

    def concerns(self) -> list[str]:
        """The notes that ask for a look (``adcloud hdmap info`` shows them): drives not
        placed or not tied to the others, and large GPS offsets; not the offsets that are as
        expected."""
        large = DriveTies(
            gps_offsets={
                d: v
                for d, v in self.gps_offsets.items()
                if math.hypot(*v) > self.LARGE_GPS_OFFSET_M
            }
        )
        return (
            DriveTies(self.untied, alone=self.alone, unplaced=self.unplaced).notes() + large.notes()
        )

    def without(self, drives: set[str]) -> DriveTies:
        """These ties less every entry that names one of ``drives`` (built again)."""
        return DriveTies(
            tuple(p for p in self.untied if not drives & set(p.drives)),
            {d: v for d, v in self.gps_offsets.items() if d not in drives},
            tuple(a for a in self.alone if a.drive not in drives),
            tuple(u for u in self.unplaced if u.drive not in drives),
        )

    def __or__(self, newer: DriveTies) -> DriveTies:
        """Both, ``newer``'s entries replacing those of the same drives: every entry of a
        drive ``newer`` has a GPS offset of or finds alone, and an untied pair ``newer``
        names again. A new drive that came close to a drive of the map without a tie says
        nothing new of that drive's ties: its own entries are kept -- but for its being
        alone, which ``newer``'s note of the pair replaces."""
        pairs = {p.drives for p in newer.untied}
        named = {d for p in newer.untied for d in p.drives}
        kept = self.without(
            {
                *newer.gps_offsets,
                *(a.drive for a in newer.alone),
                *(u.drive for u in newer.unplaced),
            }
        )
        untied = tuple(p for p in kept.untied if p.drives not in pairs)
        alone = tuple(a for a in kept.alone if a.drive not in named)
        return DriveTies(
            (*untied, *newer.untied),
            {**kept.gps_offsets, **newer.gps_offsets},
            (*alone, *newer.alone),
            (*kept.unplaced, *newer.unplaced),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": self.FORMAT,
                "untied": [
                    {"drives": list(p.drives), "candidates": p.candidates, "closest_m": p.closest_m}
                    for p in self.untied
                ],
                "gps_offsets_m": {d: list(v) for d, v in sorted(self.gps_offsets.items())},
                "large_gps_offsets": sorted(
                    d
                    for d, v in self.gps_offsets.items()
                    if math.hypot(*v) > self.LARGE_GPS_OFFSET_M
                ),
                "alone": [
                    {"drive": a.drive, "search_radius_m": a.search_radius_m} for a in self.alone
                ],
                "unplaced": [{"drive": u.drive, "fixes": u.fixes} for u in self.unplaced],
            },
            indent=1,
        )

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> DriveTies:
        """The ties stored at ``path``; none where there is no file (a report written
        before they were kept)."""
        where = Path(path)
        if not where.is_file():
            return cls()
        return cls.parse(where.read_bytes(), str(where))

    @classmethod
    def parse(cls, text: str | bytes, where: str) -> DriveTies:
        """The ties of a ``drive_ties.json``'s text; ``where`` names it in errors."""
        try:
            raw = json.loads(text)
            if raw["format"] not in range(1, cls.FORMAT + 1):
                raise ValueError(f"format {raw['format']!r}, this version reads 1 to {cls.FORMAT}")
            untied = tuple(
                UntiedDrives(
                    (str(p["drives"][0]), str(p["drives"][1])),
                    int(p["candidates"]),
                    float(p["closest_m"]),
                )
                for p in raw["untied"]
            )
            offsets = {
                str(d): (float(x), float(y), float(z))
                for d, (x, y, z) in raw["gps_offsets_m"].items()
            }
            alone = tuple(
                LoneDrive(str(a["drive"]), float(a["search_radius_m"]))
                for a in raw.get("alone", [])
            )
            unplaced = tuple(
                UnplacedDrive(str(u["drive"]), int(u["fixes"])) for u in raw.get("unplaced", [])
            )
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise MapFormatError(f"{where}: not a record of drive ties ({err})") from err
        return cls(untied, offsets, alone, unplaced)


def loop_candidates(
    keyframes: Sequence[Keyframe], settings: LoopSettings | None = None
) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` (``i`` earlier, or of another drive) of keyframes worth
    verifying: close in ``map`` yet far apart along the drive (see :class:`LoopSettings`).

    Each keyframe keeps its ``max_per_keyframe`` nearest partners; along one revisit only
    every ``stride``-th keyframe is kept, since neighbouring closures say nearly the same.
    """
    cfg = settings or LoopSettings()
    if len(keyframes) < 2:
        return []
    xyz = np.array([k.pose[:3, 3] for k in keyframes])
    travel = np.array([k.travel_m for k in keyframes])
    stamp = np.array([k.stamp for k in keyframes], np.int64)
    drives = [k.drive for k in keyframes]
    tree = cKDTree(xyz)
    pairs: list[tuple[int, int]] = []
    chosen: set[tuple[int, int]] = set()
    for j in range(len(keyframes)):
        near = tree.query_ball_point(xyz[j], cfg.search_radius_m)
        found: list[tuple[float, int]] = []
        for i in near:
            if i == j:
                continue
            if drives[i] == drives[j]:
                if stamp[i] >= stamp[j]:
                    continue
                far = travel[j] - travel[i] >= cfg.min_travel_m
                late = (stamp[j] - stamp[i]) / 1e9 >= cfg.min_interval_s
                if not (far and late):
                    continue
            elif (drives[i], stamp[i]) > (drives[j], stamp[j]):
                continue
            found.append((float(np.linalg.norm(xyz[i] - xyz[j])), i))
        for _, i in sorted(found)[: cfg.max_per_keyframe]:
            chosen.add((i, j))
    # Thin each revisit: keep a pair unless one of the stride - 1 keyframes before j
    # already closes to a neighbour of i.
    kept: set[tuple[int, int]] = set()
    for i, j in sorted(chosen, key=lambda p: (p[1], p[0])):
        redundant = any(
            (i2, j2) in kept
            for j2 in range(j - cfg.stride + 1, j)
            for i2 in range(i - 2 * cfg.stride, i + 2 * cfg.stride + 1)
            if j2 >= 0 and drives[j2] == drives[j]
        )
        if not redundant:
            kept.add((i, j))
            pairs.append((i, j))
    return pairs


def local_keyframe(keyframes: Sequence[Keyframe], index: int, neighbors: int) -> Keyframe:
    """Keyframe ``index`` with the clouds of up to ``neighbors`` keyframes of the same drive
    on each side (by stamp) merged into its cloud, placed by the pose estimates."""
    centre = keyframes[index]
    same = sorted((k for k in keyframes if k.drive == centre.drive), key=lambda k: k.stamp)
    at = next(i for i, k in enumerate(same) if k.stamp == centre.stamp)
    to_centre = np.linalg.inv(centre.pose)
    parts = []
    for k in same[max(0, at - neighbors) : at + neighbors + 1]:
        rel = to_centre @ k.pose
        parts.append(k.cloud.astype(np.float64) @ rel[:3, :3].T + rel[:3, 3])
    return replace(centre, cloud=np.concatenate(parts).astype(np.float32))


def _rotation_angle(matrix: F64) -> float:
    cos = (np.trace(matrix[:3, :3]) - 1.0) / 2.0
    return float(np.arccos(np.clip(cos, -1.0, 1.0)))


def verify_loop(
    a: Keyframe,
    b: Keyframe,
    settings: LoopSettings | None = None,
    *,
    device: ComputeDevice | str | None = None,
) -> LoopClosure | None:
    """Register ``b``'s cloud onto ``a``'s from the pose estimates' relative pose; the
    :class:`LoopClosure` when it passes the checks of :class:`LoopSettings`, else None."""
    cfg = settings or LoopSettings()
    guess = np.linalg.inv(a.pose) @ b.pose
    try:
        coarse = align(
            b.cloud,
            a.cloud,
            guess,
            voxel_size=cfg.coarse_voxel_m,
            max_distance=cfg.coarse_distance_m,
            iterations=cfg.iterations,
            huber=0.3,
            tolerance=1e-4,
            device=device,
        )
        fine = align(
            b.cloud,
            a.cloud,
            coarse.transform,
            voxel_size=cfg.voxel_m,
            max_distance=cfg.max_distance_m,
            iterations=cfg.iterations,
            tolerance=1e-4,
            device=device,
        )
    except HeteroError as err:
        log.debug("loop %s-%s: ICP failed: %s", a.key, b.key, err)
        return None
    change = np.linalg.inv(guess) @ fine.transform
    moved = float(np.linalg.norm(fine.transform[:3, 3] - guess[:3, 3]))
    ok = (
        fine.fitness >= cfg.min_fitness
        and fine.rmse <= cfg.max_rmse_m
        and moved <= cfg.max_correction_m
        and _rotation_angle(change) <= cfg.max_correction_rad
    )
    log.debug(
        "loop %s-%s: fitness %.2f rmse %.3f m moved %.2f m -> %s",
        a.key,
        b.key,
        fine.fitness,
        fine.rmse,
        moved,
        "accepted" if ok else "rejected",
    )
    if not ok:
        return None
    return LoopClosure(a.key, b.key, fine.transform, fine.fitness, fine.rmse, moved)


def find_loop_closures(
    keyframes: Sequence[Keyframe],
    settings: LoopSettings | None = None,
    *,
    device: ComputeDevice | str | None = None,
    fixed: Sequence[Keyframe] = (),
    map_drives: Collection[str] = (),
) -> LoopSearch:
    """Verified loop closures among ``keyframes`` (one drive or several of the same area),
    and between them and the ``fixed`` keyframes of drives mapped before (those of a drive
    also in ``keyframes`` are ignored); with them, the drives that came close (candidate
    pairs between them) but that no closure ties (:class:`UntiedDrives`), and the drives
    of ``keyframes`` that came within the search radius of no other drive
    (:class:`LoneDrive`), for the build's report. ``map_drives``: the drives of the map
    built before, those whose keyframes were too far to be passed as ``fixed`` included (a
    new drive is alone only in a map of several drives).

    Candidates come from :func:`loop_candidates`; each is checked by :func:`verify_loop`
    on the merged sweeps around both keyframes (:func:`local_keyframe`). The keyframes'
    poses must already be in one ``map`` frame (GPS-anchored) and good to a few metres.
    """
    cfg = settings or LoopSettings()
    moving = {k.drive for k in keyframes}
    anchors = [k for k in fixed if k.drive not in moving]
    everything = [*keyframes, *anchors]
    # pairs of two fixed keyframes were looked at when their map was built
    pairs = [(i, j) for i, j in loop_candidates(everything, cfg) if min(i, j) < len(keyframes)]
    dev = as_device(device) if pairs else None
    closures = [
        c
        for i, j in pairs
        if (
            c := verify_loop(
                local_keyframe(everything, i, cfg.map_keyframes),
                local_keyframe(everything, j, cfg.map_keyframes),
                cfg,
                device=dev,
            )
        )
        is not None
    ]
    untied = _untied(everything, pairs, closures)
    for pair in untied:
        log.warning("loop closures: %s", pair.note())
    alone = []
    if len(moving | {k.drive for k in anchors} | set(map_drives)) > 1:  # a map of several
        alone = [LoneDrive(d, cfg.search_radius_m) for d in _alone(everything, moving, cfg)]
    for lone in alone:
        log.warning("loop closures: %s", lone.note())
    log.info(
        "loop closures: %d of %d candidates accepted among %d keyframes (%d fixed)",
        len(closures),
        len(pairs),
        len(everything),
        len(anchors),
    )
    return LoopSearch(closures, untied, alone)


def _alone(keyframes: Sequence[Keyframe], drives: Collection[str], cfg: LoopSettings) -> list[str]:
    """The ``drives`` none of whose keyframes lies within ``search_radius_m`` of a keyframe
    of another drive (the distance :func:`loop_candidates` proposes pairs within, before
    it keeps the nearest ones), in name order."""
    xyz = np.array([k.pose[:3, 3] for k in keyframes]).reshape(-1, 3)
    names = np.array([k.drive for k in keyframes])
    out = []
    for drive in sorted(drives):
        mine = names == drive
        if mine.all():
            out.append(drive)
            continue
        dist, _ = cKDTree(xyz[~mine]).query(xyz[mine], distance_upper_bound=cfg.search_radius_m)
        if not np.isfinite(dist).any():
            out.append(drive)
    return out


def _drive_pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def _untied(
    keyframes: Sequence[Keyframe], pairs: Sequence[tuple[int, int]], closures: Sequence[LoopClosure]
) -> list[UntiedDrives]:
    """Each two drives that come close (candidates between them) but that no closure ties,
    directly or through other drives (a tied to c and c to b holds a and b together)."""
    near: dict[tuple[str, str], list[float]] = {}
    for i, j in pairs:
        a, b = keyframes[i], keyframes[j]
        if a.drive != b.drive:
            gap = float(np.linalg.norm(a.pose[:3, 3] - b.pose[:3, 3]))
            near.setdefault(_drive_pair(a.drive, b.drive), []).append(gap)
    group: dict[str, str] = {}

    def root(drive: str) -> str:
        while group.get(drive, drive) != drive:
            drive = group[drive]
        return drive

    for c in closures:
        group[root(c.a[0])] = root(c.b[0])
    return [
        UntiedDrives(drives, len(gaps), min(gaps))
        for drives, gaps in sorted(near.items())
        if root(drives[0]) != root(drives[1])
    ]


class KeyframeArchive:
    """The keyframes of a map's drives, kept in its version for the next incremental build:
    ``<drive>.npz`` per drive (:func:`~adcloud.hdmap.exchange.dump_items`) and
    ``index.json`` with each drive's keyframe bounds in ``map`` (so a build loads only
    the drives near its new ones)."""

    INDEX = "index.json"

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        index = self.folder / self.INDEX
        self.bounds: dict[str, tuple[float, float, float, float]] = {}
        if index.is_file():
            self.bounds = self.parse_index(index.read_bytes(), str(index))

    @staticmethod
    def parse_index(text: str | bytes, where: str) -> dict[str, tuple[float, float, float, float]]:
        """Each drive's keyframe bounds ``(x0, y0, x1, y1)`` (``map``, m) from the text of
        an ``index.json``; ``where`` names it in errors."""
        try:
            raw = json.loads(text)
            return {
                str(drive): (float(x0), float(y0), float(x1), float(y1))
                for drive, (x0, y0, x1, y1) in raw["drives"].items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise MapFormatError(f"{where}: not a keyframe index ({err})") from err

    def near(self, xy: F64, radius_m: float, exclude: Collection[str] = ()) -> list[Keyframe]:
        """The archived keyframes of every drive (not in ``exclude``) whose bounds come
        within ``radius_m`` of one of the positions ``xy`` (N, 2)."""
        xy = np.asarray(xy, np.float64).reshape(-1, 2)
        out: list[Keyframe] = []
        for drive, (x0, y0, x1, y1) in sorted(self.bounds.items()):
            if drive in exclude or not len(xy):
                continue
            dx = np.maximum(np.maximum(x0 - xy[:, 0], xy[:, 0] - x1), 0.0)
            dy = np.maximum(np.maximum(y0 - xy[:, 1], xy[:, 1] - y1), 0.0)
            if float(np.min(np.hypot(dx, dy))) <= radius_m:
                out.extend(self.load(drive))
        return out

    def load(self, drive: str) -> list[Keyframe]:
        path = self.folder / f"{drive}.npz"
        items = load_items(path)
        if not all(isinstance(k, Keyframe) and k.drive == drive for k in items):
            raise MapFormatError(f"{path}: holds something other than keyframes of {drive!r}")
        return items

    @classmethod
    def write(
        cls,
        folder: str | os.PathLike[str],
        keyframes: Sequence[Keyframe],
        carry: KeyframeArchive | None = None,
    ) -> KeyframeArchive:
        """Write ``keyframes`` (grouped by drive) under ``folder``, with the drives of
        ``carry`` (an earlier version's archive) copied along; returns the new archive."""
        root = Path(folder)
        root.mkdir(parents=True, exist_ok=True)
        by_drive: dict[str, list[Keyframe]] = {}
        for k in keyframes:
            by_drive.setdefault(k.drive, []).append(k)
        bounds: dict[str, list[float]] = {}
        if carry is not None:
            for drive, b in carry.bounds.items():
                if drive not in by_drive:
                    link_or_copy(carry.folder / f"{drive}.npz", root / f"{drive}.npz")
                    bounds[drive] = list(b)
        for drive, frames in sorted(by_drive.items()):
            frames.sort(key=lambda k: k.stamp)
            dump_items(frames, root / f"{drive}.npz")
            xy = np.array([k.pose[:2, 3] for k in frames])
            bounds[drive] = [*map(float, xy.min(axis=0)), *map(float, xy.max(axis=0))]
        tmp = root / f".{cls.INDEX}.tmp"
        tmp.write_text(json.dumps({"drives": bounds}, indent=1, sort_keys=True))
        tmp.replace(root / cls.INDEX)
        return cls(root)
