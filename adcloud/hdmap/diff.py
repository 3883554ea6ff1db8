"""What changed between two versions of a map: drives, grid tiles, lane markings and signs.

A nightly build publishes a new version that vehicles will load; before they do, someone
wants to know what the night changed, and a rollback (``adcloud hdmap rollback``) needs a
reason. :func:`diff_versions` (``adcloud hdmap diff``) compares two committed versions of one
map -- by default the current one and the version it was built on (the map's first version
with an empty map: everything in it is added):

- **drives** added and taken out (a rollback holds drives out);
- **grid tiles** added, removed, changed or the same. A tile whose file is the same (a carried
  tile: the same hard link on a local disk, or the same bytes) is the same without being
  decoded; the others are compared cell by cell on their elevation layer: cells observed
  only after (new ground), only before (lost), and the RMS and largest height change over
  the cells both observe;
- **lane markings**, as lines: the length of the new version's markings farther than
  ``tolerance_m`` from every marking of the old one is *added*, and the other way round
  *removed* (so a marking that is only extended counts its extension);
- **traffic signs**, matched nearest first within ``match_m``: added, removed, moved (by more
  than ``tolerance_m``) and retyped.

:meth:`MapDiff.plot` draws it on one picture: the tiles coloured by change, the markings
added and removed, the signs, and the new drives' trajectories.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from rich.table import Table
from scipy.spatial import cKDTree

from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.evaluate import SEMANTIC_NAME, densify, features_from_geojson
from adcloud.hdmap.mapdir import MapDir, MapVersion, version_name

__all__ = [
    "PLOT_FORMATS",
    "DiffSettings",
    "MapDiff",
    "SignChange",
    "TileChange",
    "check_plot_path",
    "diff_versions",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]

_GRID_DIR = "grid"
_STEP_M = 0.05  # markings are compared at this spacing (the grid's resolution)
_NO_SIGNS = np.zeros((0, 3))

#: The picture formats :meth:`MapDiff.plot` writes, by the file name's extension.
PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "tif", "tiff", "eps")


def check_plot_path(path: str | os.PathLike[str]) -> None:
    """Raise :class:`HdmapError` unless :meth:`MapDiff.plot` can write ``path``: its
    extension is one of :data:`PLOT_FORMATS` and its directory exists (checked before any
    version is read, so that a typo does not cost the comparison)."""
    text = os.fspath(path)
    suffix = Path(text).suffix.lstrip(".").lower()
    if suffix not in PLOT_FORMATS:
        given = f"the extension .{suffix}" if suffix else "no extension"
        raise HdmapError(
            f"{text}: {given}; the picture is written as PNG, SVG, PDF, JPEG, TIFF or EPS, "
            f"chosen by the extension: name a file ending in "
            f"{', '.join('.' + f for f in PLOT_FORMATS)}"
        )
    folder = Path(text).absolute().parent
    if not folder.is_dir():
        raise HdmapError(f"{text}: no directory {folder} to write the picture in; make it first")


@dataclass(frozen=True)
class DiffSettings:
    """``tolerance_m``: a marking point this close to the other version's markings, or a
    sign that moved this little, is unchanged; ``match_m``: signs this close are the same
    sign (moved, if farther than ``tolerance_m``)."""

    tolerance_m: float = 0.3
    match_m: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.tolerance_m <= self.match_m:
            raise HdmapError(
                f"diff settings: need 0 < tolerance_m ({self.tolerance_m}) <= match_m "
                f"({self.match_m})"
            )


@dataclass(frozen=True)
class TileChange:
    """One grid tile: ``status`` ``added``, ``removed``, ``changed`` or ``same``; cells with
    ground before and after; ``cells_new`` observed only after, ``cells_lost`` only before;
    ``dz_rms_m`` / ``dz_max_m`` the height change over the cells both observe (NaN where
    none). A tile that is the same is not decoded: its counts are 0."""

    key: tuple[int, int]
    status: str
    cells_before: int = 0
    cells_after: int = 0
    cells_new: int = 0
    cells_lost: int = 0
    dz_rms_m: float = math.nan
    dz_max_m: float = math.nan


@dataclass(frozen=True)
class SignChange:
    """One sign that changed: ``status`` ``added``, ``removed``, ``moved`` or ``retyped``
    (a moved sign may be retyped too: ``type_before`` / ``type_after`` say); positions in
    map-frame metres; ``moved_m`` the horizontal distance between them."""

    status: str
    before: tuple[float, float, float] | None
    after: tuple[float, float, float] | None
    type_before: str = ""
    type_after: str = ""
    moved_m: float = math.nan


@dataclass(frozen=True)
class MapDiff:
    """What changed from version ``before`` to version ``after`` of map ``map`` (see the
    module docstring); ``before`` is None when ``after`` is the map's first version, which
    is compared with an empty map (everything in it is added)."""

    map: str
    before: str | None
    after: str
    drives_added: tuple[str, ...]
    drives_removed: tuple[str, ...]
    tiles: tuple[TileChange, ...]
    tile_m: float
    markings_before_m: float
    markings_after_m: float
    markings_added_m: float
    markings_removed_m: float
    signs_before: int
    signs_after: int
    signs: tuple[SignChange, ...]
    #: Drawing material for :meth:`plot`: the after version's markings, the marking points
    #: added and removed, the new drives' trajectories (x, y).
    _markings: tuple[F64, ...] = field(default=(), repr=False, compare=False)
    _added_points: F64 = field(default_factory=lambda: np.zeros((0, 2)), repr=False)
    _removed_points: F64 = field(default_factory=lambda: np.zeros((0, 2)), repr=False)
    _trajectories: Mapping[str, F64] = field(default_factory=dict, repr=False, compare=False)

    @property
    def _before_text(self) -> str:
        return self.before if self.before is not None else "none (an empty map)"

    def tile_counts(self) -> dict[str, int]:
        """Tiles per status (``added``, ``removed``, ``changed``, ``same``)."""
        out = dict.fromkeys(("added", "removed", "changed", "same"), 0)
        for tile in self.tiles:
            out[tile.status] += 1
        return out

    def sign_counts(self) -> dict[str, int]:
        """Sign changes per status."""
        out = dict.fromkeys(("added", "removed", "moved", "retyped"), 0)
        for sign in self.signs:
            out[sign.status] += 1
        return out

    @property
    def unchanged(self) -> bool:
        """True when nothing a vehicle loads differs (no drive, tile, marking or sign)."""
        return (
            not self.drives_added
            and not self.drives_removed
            and all(t.status == "same" for t in self.tiles)
            and self.markings_added_m == 0.0
            and self.markings_removed_m == 0.0
            and not self.signs
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN as null)."""

        def num(value: float) -> float | None:
            return value if math.isfinite(value) else None

        return {
            "map": self.map,
            "before": self.before,
            "after": self.after,
            "drives_added": list(self.drives_added),
            "drives_removed": list(self.drives_removed),
            "tiles": self.tile_counts(),
            "tile_changes": [
                {
                    "key": list(t.key),
                    "status": t.status,
                    "cells_before": t.cells_before,
                    "cells_after": t.cells_after,
                    "cells_new": t.cells_new,
                    "cells_lost": t.cells_lost,
                    "dz_rms_m": num(t.dz_rms_m),
                    "dz_max_m": num(t.dz_max_m),
                }
                for t in self.tiles
                if t.status != "same"
            ],
            "markings_m": {
                "before": self.markings_before_m,
                "after": self.markings_after_m,
                "added": self.markings_added_m,
                "removed": self.markings_removed_m,
            },
            "signs": {"before": self.signs_before, "after": self.signs_after},
            "sign_changes": [
                {
                    "status": s.status,
                    "before": list(s.before) if s.before else None,
                    "after": list(s.after) if s.after else None,
                    "type_before": s.type_before,
                    "type_after": s.type_after,
                    "moved_m": num(s.moved_m),
                }
                for s in self.signs
            ],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def table(self) -> Table:
        """The summary: one row per kind of content."""
        table = Table(title=f"{self.map}: version {self._before_text} -> {self.after}")
        table.add_column("what")
        table.add_column("before", justify="right")
        table.add_column("after", justify="right")
        table.add_column("change")
        drives = [f"+ {name}" for name in self.drives_added]
        drives += [f"- {name}" for name in self.drives_removed]
        table.add_row("drives", "", "", ", ".join(drives) or "none added or taken out")
        tiles = self.tile_counts()
        before = sum(1 for t in self.tiles if t.status != "added")
        after = sum(1 for t in self.tiles if t.status != "removed")
        table.add_row(
            "grid tiles",
            str(before),
            str(after),
            f"{tiles['added']} added, {tiles['changed']} changed, {tiles['removed']} removed, "
            f"{tiles['same']} the same",
        )
        changed = [t for t in self.tiles if t.status == "changed"]
        new_cells = sum(t.cells_new for t in self.tiles)
        lost_cells = sum(t.cells_lost for t in self.tiles)
        both = [t for t in changed if math.isfinite(t.dz_rms_m)]
        heights = (
            f"height change RMS up to {max(t.dz_rms_m for t in both) * 100:.1f} cm, largest "
            f"{max(t.dz_max_m for t in both) * 100:.1f} cm"
            if both
            else "no height change"
        )
        table.add_row(
            "ground cells", "", "", f"{new_cells:,} new, {lost_cells:,} no longer; {heights}"
        )
        table.add_row(
            "lane markings (m)",
            f"{self.markings_before_m:.1f}",
            f"{self.markings_after_m:.1f}",
            f"+{self.markings_added_m:.1f} / -{self.markings_removed_m:.1f}",
        )
        signs = self.sign_counts()
        table.add_row(
            "traffic signs",
            str(self.signs_before),
            str(self.signs_after),
            ", ".join(f"{n} {k}" for k, n in signs.items() if n) or "none changed",
        )
        return table

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw the change to ``path`` (PNG): tiles (green added, orange changed -- darker
        for a larger height change --, grey the same, red outline removed), the after
        version's markings (black) with the stretches added (green) and removed (red), the
        signs added (green triangles), removed (red crosses) and moved (blue arrows), and
        the new drives' trajectories (blue). The extension of ``path`` chooses the format
        (:data:`PLOT_FORMATS`; :func:`check_plot_path`)."""
        check_plot_path(path)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
        from matplotlib.patches import Rectangle  # noqa: PLC0415

        fig = Figure(figsize=(9, 8), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        size = self.tile_m
        worst = max((t.dz_rms_m for t in self.tiles if math.isfinite(t.dz_rms_m)), default=0.0)
        for tile in self.tiles:
            x0, y0 = tile.key[0] * size, tile.key[1] * size
            if tile.status == "removed":
                patch = Rectangle((x0, y0), size, size, fill=False, ec="tab:red", lw=1.2)
            else:
                if tile.status == "added":
                    colour: Any = (0.55, 0.85, 0.55)
                elif tile.status == "changed":
                    share = (
                        tile.dz_rms_m / worst if worst > 0 and math.isfinite(tile.dz_rms_m) else 0
                    )
                    colour = (1.0, 0.8 - 0.45 * share, 0.45 - 0.35 * share)
                else:
                    colour = (0.88, 0.88, 0.88)
                patch = Rectangle((x0, y0), size, size, fc=colour, ec="white", lw=0.5)
            ax.add_patch(patch)
        for line in self._markings:
            ax.plot(line[:, 0], line[:, 1], color="black", lw=0.6)
        for pts, colour, label in (
            (self._added_points, "tab:green", "markings added"),
            (self._removed_points, "tab:red", "markings removed"),
        ):
            if len(pts):
                ax.scatter(pts[:, 0], pts[:, 1], s=1.5, color=colour, label=label)
        for name, xy in self._trajectories.items():
            ax.plot(xy[:, 0], xy[:, 1], color="tab:blue", lw=1.0, alpha=0.7, label=f"drive {name}")
        for sign in self.signs:
            if sign.status == "added" and sign.after:
                ax.scatter(*sign.after[:2], marker="^", s=40, color="tab:green", zorder=5)
            elif sign.status == "removed" and sign.before:
                ax.scatter(*sign.before[:2], marker="x", s=40, color="tab:red", zorder=5)
            elif sign.status == "retyped" and sign.after:
                ax.scatter(*sign.after[:2], marker="o", s=40, fc="none", ec="tab:blue", zorder=5)
            elif sign.before and sign.after:
                bx, by = sign.before[:2]
                ax.annotate(
                    "",
                    xy=sign.after[:2],
                    xytext=(bx, by),
                    arrowprops={"arrowstyle": "->", "color": "tab:blue"},
                )
        if self.tiles:
            xs = [t.key[0] * size for t in self.tiles]
            ys = [t.key[1] * size for t in self.tiles]
            ax.set_xlim(min(xs) - size, max(xs) + 2 * size)
            ax.set_ylim(min(ys) - size, max(ys) + 2 * size)
        ax.set_aspect("equal")
        ax.set_xlabel("x (m, map frame)")
        ax.set_ylabel("y (m)")
        tiles = self.tile_counts()
        ax.set_title(
            f"version {self._before_text} -> {self.after}: {tiles['added']} tiles added, "
            f"{tiles['changed']} changed; markings +{self.markings_added_m:.0f} / "
            f"-{self.markings_removed_m:.0f} m",
            fontsize=10,
        )
        handles, labels = ax.get_legend_handles_labels()
        for colour, label in (
            ((0.55, 0.85, 0.55), "tile added"),
            ((1.0, 0.45, 0.1), f"tile changed (darkest: {worst * 100:.1f} cm RMS height change)"),
            ((0.88, 0.88, 0.88), "tile the same"),
        ):
            handles.append(Rectangle((0, 0), 1, 1, fc=colour))
            labels.append(label)
        ax.legend(handles, labels, loc="upper right", fontsize=7, markerscale=4)
        fig.tight_layout()
        fig.savefig(os.fspath(path))


# -- comparing -----------------------------------------------------------------------------------


def _tile_names(version: MapVersion) -> dict[tuple[int, int], str]:
    out = {}
    for rel in version.files():
        head, _, name = rel.rpartition("/")
        if head != _GRID_DIR or not name.endswith(".tif"):
            continue
        try:
            tx, ty = (int(v) for v in name.removesuffix(".tif").split("_"))
        except ValueError:
            continue
        out[(tx, ty)] = rel
    return out


def _same_file(a: MapVersion, b: MapVersion, rel: str) -> bool | None:
    """True/False where the files' identity decides without reading them (local maps:
    the same inode); None where their bytes must tell."""
    if a.path is None or b.path is None:
        return None
    first, second = a.path / rel, b.path / rel
    if first.samefile(second):
        return True
    return None if first.stat().st_size == second.stat().st_size else False


def _elevation(version: MapVersion, rel: str, data: bytes | None = None) -> NDArray[np.float32]:
    from adcloud.hdmap.geotiff import read_grid_tile  # noqa: PLC0415 - pulls in the grid stage

    raw = data if data is not None else version.read_bytes(rel)
    try:
        return read_grid_tile(raw).tile.elevation_mean
    except MapFormatError as err:
        raise MapFormatError(f"{version.uri}/{rel}: {err}") from err


def _compare_tile(
    key: tuple[int, int], rel: str, before: MapVersion, after: MapVersion
) -> TileChange:
    same = _same_file(before, after, rel)
    old_bytes = new_bytes = None
    if same is None:
        old_bytes, new_bytes = before.read_bytes(rel), after.read_bytes(rel)
        same = old_bytes == new_bytes
    if same:
        return TileChange(key, "same")
    old = _elevation(before, rel, old_bytes)
    new = _elevation(after, rel, new_bytes)
    seen_old, seen_new = np.isfinite(old), np.isfinite(new)
    both = seen_old & seen_new
    dz = (new[both] - old[both]).astype(np.float64)
    return TileChange(
        key,
        "changed",
        cells_before=int(seen_old.sum()),
        cells_after=int(seen_new.sum()),
        cells_new=int((seen_new & ~seen_old).sum()),
        cells_lost=int((seen_old & ~seen_new).sum()),
        dz_rms_m=float(np.sqrt(np.mean(dz**2))) if dz.size else math.nan,
        dz_max_m=float(np.abs(dz).max()) if dz.size else math.nan,
    )


def _one_sided(key: tuple[int, int], rel: str, version: MapVersion, status: str) -> TileChange:
    cells = int(np.isfinite(_elevation(version, rel)).sum())
    if status == "added":
        return TileChange(key, status, cells_after=cells, cells_new=cells)
    return TileChange(key, status, cells_before=cells, cells_lost=cells)


def _semantic(version: MapVersion) -> tuple[list[F64], F64, list[str]]:
    if SEMANTIC_NAME not in version.files():
        return [], np.zeros((0, 3)), []
    where = f"{version.uri}/{SEMANTIC_NAME}"
    try:
        data = json.loads(version.read_bytes(SEMANTIC_NAME))
    except ValueError as err:
        raise MapFormatError(f"{where}: not valid JSON ({err})") from None
    return features_from_geojson(data, where)


def _dense(lines: Sequence[F64]) -> tuple[F64, F64]:
    """The markings' points, at most ``_STEP_M`` apart, and the length (m) each stands for:
    half of the segment on either side of it, so that a line's points add up to its length
    (counting ``_STEP_M`` a point counted the shorter segments densify leaves at every
    vertex in full: a first version's markings came out longer than they are)."""
    parts: list[F64] = []
    shares: list[F64] = []
    for line in lines:
        if len(line) < 2:
            continue
        pts = densify(np.asarray(line, np.float64)[:, :2], _STEP_M)
        seg = np.linalg.norm(np.diff(pts, axis=0), axis=1)
        share = np.zeros(len(pts))
        share[:-1] += seg / 2
        share[1:] += seg / 2
        parts.append(pts)
        shares.append(share)
    if not parts:
        return np.zeros((0, 2)), np.zeros(0)
    return np.vstack(parts), np.concatenate(shares)


def _length(lines: Sequence[F64]) -> float:
    return float(
        sum(
            np.linalg.norm(np.diff(np.asarray(line)[:, :2], axis=0), axis=1).sum() for line in lines
        )
    )


def _unmatched(points: F64, other: F64, tolerance: float) -> NDArray[np.bool_]:
    """Which of ``points`` lie farther than ``tolerance`` from every point of ``other``."""
    if not len(points):
        return np.zeros(0, dtype=bool)
    if not len(other):
        return np.ones(len(points), dtype=bool)
    dist, _ = cKDTree(other).query(points, distance_upper_bound=tolerance)
    return np.asarray(~np.isfinite(dist))


def _sign_changes(
    old: F64, old_types: Sequence[str], new: F64, new_types: Sequence[str], s: DiffSettings
) -> list[SignChange]:
    """Signs matched one to one, nearest pairs first (horizontal distance), within
    ``match_m``; the rest are added or removed."""
    pairs: list[tuple[float, int, int]] = []
    if len(old) and len(new):
        dist = np.linalg.norm(old[:, None, :2] - new[None, :, :2], axis=2)
        for i, j in zip(*np.nonzero(dist <= s.match_m), strict=True):
            pairs.append((float(dist[i, j]), int(i), int(j)))
    pairs.sort()
    used_old: set[int] = set()
    used_new: set[int] = set()
    out: list[SignChange] = []

    def pos(p: F64) -> tuple[float, float, float]:
        return (float(p[0]), float(p[1]), float(p[2]))

    for d, i, j in pairs:
        if i in used_old or j in used_new:
            continue
        used_old.add(i)
        used_new.add(j)
        moved = d > s.tolerance_m
        retyped = old_types[i] != new_types[j]
        if moved or retyped:
            out.append(
                SignChange(
                    "moved" if moved else "retyped",
                    pos(old[i]),
                    pos(new[j]),
                    old_types[i],
                    new_types[j],
                    d,
                )
            )
    out += [
        SignChange("removed", pos(old[i]), None, type_before=old_types[i])
        for i in range(len(old))
        if i not in used_old
    ]
    out += [
        SignChange("added", None, pos(new[j]), type_after=new_types[j])
        for j in range(len(new))
        if j not in used_new
    ]
    return out


def _trajectory_xy(version: MapVersion, name: str) -> F64 | None:
    from adcloud.hdmap.trajectory import Trajectory  # noqa: PLC0415

    rel = f"trajectory/{name}.tum"
    if rel not in version.files():
        return None
    with tempfile.NamedTemporaryFile(suffix=".tum") as handle:
        handle.write(version.read_bytes(rel))
        handle.flush()
        return np.asarray(Trajectory.read_tum(handle.name).matrices[:, :2, 3], np.float64)


def _resolve(
    mapdir: MapDir, before: str | None, after: str | None
) -> tuple[MapVersion | None, MapVersion]:
    """The versions to compare: ``before`` None where ``after`` is the map's first version
    (built on an empty map, which it is compared with)."""
    versions = mapdir.versions()
    if not versions:
        raise HdmapError(mapdir.no_version_text())  # a mistyped path, or an empty map

    def pick(vid: str) -> MapVersion:
        padded = version_name(vid)
        if padded not in versions:
            raise HdmapError(
                f"{mapdir.uri}: no version {vid}; the versions kept are {', '.join(versions)} "
                "(adcloud hdmap info lists them)"
            )
        return mapdir.version(padded)

    new = pick(after) if after is not None else mapdir.current()
    if new is None:
        raise HdmapError(f"{mapdir.uri}: the map has no current version")
    if before is not None:
        return pick(before), new
    parent = new.manifest.parent
    if parent is None:  # the first version: what its build added to an empty map
        return None, new
    if parent not in versions:
        raise HdmapError(
            f"{mapdir.uri}: version {new.id} has no kept parent to compare with; name the "
            "one to compare with (adcloud hdmap diff --from VERSION, or before=VERSION; the "
            "versions kept: " + ", ".join(versions) + ")"
        )
    return mapdir.version(parent), new


def diff_versions(
    map_uri: str,
    before: str | None = None,
    after: str | None = None,
    settings: DiffSettings | None = None,
) -> MapDiff:
    """Compare versions ``before`` and ``after`` of the map at ``map_uri`` (ids such as
    ``"3"`` or ``"000003"``; ``after`` defaults to the current version, ``before`` to the
    version ``after`` was built on: for the map's first version, an empty map). Reads both
    versions' tiles and semantic layers, nothing else; a local map's carried tiles are not
    even read. Raises :class:`HdmapError` naming the versions kept when one is missing."""
    s = settings or DiffSettings()
    # closed when done: a store's map (local://, alluxio://) holds connections and files
    with MapDir(map_uri) as mapdir:
        return _diff(mapdir, map_uri, before, after, s)


def _diff(
    mapdir: MapDir, map_uri: str, before: str | None, after: str | None, s: DiffSettings
) -> MapDiff:
    old, new = _resolve(mapdir, before, after)
    old_drives = {d.name for d in old.manifest.drives} if old is not None else set()
    new_drives = {d.name for d in new.manifest.drives}
    old_tiles = _tile_names(old) if old is not None else {}
    new_tiles = _tile_names(new)
    tiles: list[TileChange] = []
    for key in sorted(set(old_tiles) | set(new_tiles)):
        if old is not None and key in old_tiles and key in new_tiles:
            tiles.append(_compare_tile(key, new_tiles[key], old, new))
        elif key in new_tiles:
            tiles.append(_one_sided(key, new_tiles[key], new, "added"))
        else:
            assert old is not None  # old_tiles is empty without it
            tiles.append(_one_sided(key, old_tiles[key], old, "removed"))
    old_lines, old_signs, old_types = _semantic(old) if old is not None else ([], _NO_SIGNS, [])
    new_lines, new_signs, new_types = _semantic(new)
    (old_pts, old_share), (new_pts, new_share) = _dense(old_lines), _dense(new_lines)
    is_added = _unmatched(new_pts, old_pts, s.tolerance_m)
    is_removed = _unmatched(old_pts, new_pts, s.tolerance_m)
    added, removed = new_pts[is_added], old_pts[is_removed]
    trajectories = {
        name: xy
        for name in sorted(new_drives - old_drives)
        if (xy := _trajectory_xy(new, name)) is not None
    }
    tile_m = float(new.manifest.settings.get("tile_m", 20.0))
    return MapDiff(
        map=map_uri,
        before=old.id if old is not None else None,
        after=new.id,
        drives_added=tuple(sorted(new_drives - old_drives)),
        drives_removed=tuple(sorted(old_drives - new_drives)),
        tiles=tuple(tiles),
        tile_m=tile_m,
        markings_before_m=_length(old_lines),
        markings_after_m=_length(new_lines),
        markings_added_m=float(new_share[is_added].sum()),
        markings_removed_m=float(old_share[is_removed].sum()),
        signs_before=len(old_signs),
        signs_after=len(new_signs),
        signs=tuple(_sign_changes(old_signs, old_types, new_signs, new_types, s)),
        _markings=tuple(np.asarray(line, np.float64)[:, :2] for line in new_lines),
        _added_points=added,
        _removed_points=removed,
        _trajectories=trajectories,
    )
