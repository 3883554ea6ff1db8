"""What a map version keeps for the next build, and what a build carries over unchanged.

An incremental build merges the new drives' tile statistics into the previous version's.
A tile can change only where a new drive's sensor came within the grid's or the point-cloud
map's ``max_range`` of it (points farther away are not used); every other tile is *carried*:
its files go into the new version as they are (hard links on one file system, else copies;
on a map off the local filesystem, copies the storage makes at commit, see
:class:`VersionFiles`), without merging, finishing or writing it again. A nightly build's
tile work, and the disk a new version takes, therefore follow the new drives, not the size
of the map. The label stage reads again only the tiles along the roads within two tiles of
the new drives' reach; it still extracts the labels of the whole map again, on the driver.

A version keeps, per grid tile ``<x>_<y>``: ``grid/<x>_<y>.tif`` and its preview
``grid/preview/<x>_<y>.png``, and its statistics ``state/tiles/<x>_<y>.npz``; for a grid
tile along the roads, what the label stage made of it, ``state/labels/<x>_<y>.npz`` (its
paint cells and coarse copy, reused by the next build while neither the tile nor its
neighbours change); per point-cloud tile: ``pointcloud_map/<name>.pcd`` (listed in
``pointcloud_map_metadata.yaml``) and ``state/cloud/<x>_<y>.npz``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from adcloud.config import settings_dict
from adcloud.hdmap.errors import BuildError, MapFormatError
from adcloud.hdmap.geotiff import tile_file_name
from adcloud.hdmap.grid import GridSettings, TileKey
from adcloud.hdmap.mapdir import link_or_copy, missing_from_previous
from adcloud.hdmap.pcmap import (
    METADATA_FILE,
    TILE_DIR,
    PointCloudMapSettings,
    read_pointcloud_metadata,
)

__all__ = [
    "GRID_DIR",
    "STATE_CLOUD",
    "STATE_LABELS",
    "STATE_TILES",
    "TILE_FOLDERS",
    "TILE_SETTINGS",
    "KeptVersion",
    "LocalFiles",
    "VersionFiles",
    "check_tile_layout",
    "keys_within",
    "tile_settings",
]

log = logging.getLogger(__name__)

#: Where grid tiles (GeoTIFF) go in a map version.
GRID_DIR = "grid"
#: Where a map version keeps its merged tile statistics (for the next incremental build).
STATE_TILES = "state/tiles"
#: ... and its point-cloud tiles' voxel sums.
STATE_CLOUD = "state/cloud"
#: ... and what the label stage made of each grid tile along the roads.
STATE_LABELS = "state/labels"


def keys_within(xy: NDArray[np.float64], tile_size: float, reach: float) -> frozenset[TileKey]:
    """Keys of the ``tile_size`` tiles that hold a point within ``reach`` m (horizontally) of
    any of the map-frame positions ``xy`` (n, 2): every tile meeting the square of side
    ``2 * reach`` around one (a superset of the disk)."""
    pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    if not len(pts):
        return frozenset()
    lo = np.floor((pts - reach) / tile_size).astype(np.int64)
    hi = np.floor((pts + reach) / tile_size).astype(np.int64)
    span = int((hi - lo).max()) + 1
    steps = np.arange(span)
    keys: set[TileKey] = set()
    for dx in steps:
        for dy in steps:
            cand = lo + np.array([dx, dy])
            ok = (cand <= hi).all(axis=1)
            keys.update(map(tuple, np.unique(cand[ok], axis=0).tolist()))
    return frozenset(keys)


_TILE_STEM = re.compile(r"(-?[0-9]+)_(-?[0-9]+)")


def _key_of(stem: str, path: Path) -> TileKey:
    # a pattern, not int() of each half: int() takes "2_3" (digit grouping) and " 2"
    found = _TILE_STEM.fullmatch(stem)
    if found is None:
        raise MapFormatError(f"{path}: not a tile file name (<x>_<y>); the map version is damaged")
    return int(found[1]), int(found[2])


#: The settings the tiles of a version were finished with: a later build carries tiles only
#: when its own are the same.
TILE_SETTINGS = "state/tile_settings.json"


def tile_settings(grid: GridSettings, cloud: PointCloudMapSettings) -> dict[str, Any]:
    """The settings that shape finished tiles, as :data:`TILE_SETTINGS` keeps them."""
    return {"grid": settings_dict(grid), "cloud": settings_dict(cloud)}


#: The settings that say which cells and voxels a tile has. A version keeps its tiles'
#: statistics as sums over those cells, not the drives' points, so they cannot be merged
#: with, or turned into, tiles of another layout: a map keeps its first build's layout.
_LAYOUT = {
    "grid": ("resolution", "tile_cells", "patch_cells"),
    "cloud": ("tile_size", "voxel_size"),
}
_SECTION = {"grid": "hdmap_grid", "cloud": "hdmap_cloud"}


def check_tile_layout(
    kept: Mapping[str, Any], grid: GridSettings, cloud: PointCloudMapSettings, where: str
) -> None:
    """Raise :class:`BuildError` when ``grid`` and ``cloud`` lay tiles out otherwise than the
    settings ``kept`` (a version's :data:`TILE_SETTINGS`, read from ``where``) did: the
    message names the map's layout and the build's. Other settings may change (every
    tile is then merged again, see :meth:`KeptVersion.of`)."""

    def part(settings: Mapping[str, Any], name: str) -> Mapping[str, Any]:
        found = settings.get(name)
        return found if isinstance(found, dict) else {}

    wanted = json.loads(json.dumps(tile_settings(grid, cloud)))
    changed = []
    for section, names in _LAYOUT.items():
        old, new = part(kept, section), part(wanted, section)
        for name in names:
            if name in old and old[name] != new[name]:
                changed.append(f"{_SECTION[section]}.{name} {old[name]} (this build: {new[name]})")
    if not changed:
        return
    res, cells = part(kept, "grid").get("resolution"), part(kept, "grid").get("tile_cells")
    size = (
        f" (hdmap.resolution {res:g} m, hdmap.tile_m {res * cells:g} m)"
        if isinstance(res, (int, float)) and isinstance(cells, int)
        else ""
    )
    raise BuildError(
        f"{where}: the map's tiles are laid out with {', '.join(changed)}. A map keeps each "
        "tile's statistics on its own cells, not the drives' points, so an existing map "
        f"cannot change its tile layout: build it with its own settings{size}, or build a new "
        "map (another --map) from all the drives' bags with the new ones"
    )


#: The folders of a version that hold one file per tile. A build on a map that is not on a
#: local filesystem downloads from them only the files it merges or reads, and the new
#: version gets the others by copies on the map's own storage (:class:`VersionFiles`).
TILE_FOLDERS = (GRID_DIR, TILE_DIR, STATE_TILES, STATE_CLOUD, STATE_LABELS)


class VersionFiles(Protocol):
    """The previous version's files as a build reads and carries them. ``root``, a local
    directory, holds every file but, on a map off the local filesystem, the files of
    :data:`TILE_FOLDERS`, which :meth:`local` downloads when asked for."""

    root: Path

    def names(self, folder: str) -> list[str]:
        """The names of the files directly in ``folder`` (a ``/``-separated relative path)."""

    def local(self, rel: str) -> Path:
        """A local path holding the version's file ``rel``."""

    def fetch(self, rels: Sequence[str]) -> None:
        """Make the files ``rels`` local (:meth:`local`) in one batch: a map off the local
        filesystem downloads the missing ones together, not one round trip after another."""

    def carry(self, rel: str, out_dir: Path) -> None:
        """Give the version being built in ``out_dir`` the file ``rel`` as it is."""


class LocalFiles:
    """:class:`VersionFiles` of a version in a local directory: carried files are hard links
    (copies across file systems)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self, folder: str) -> list[str]:
        where = self.root / folder
        return sorted(p.name for p in where.iterdir() if p.is_file()) if where.is_dir() else []

    def local(self, rel: str) -> Path:
        path = self.root / rel
        if not path.is_file():
            raise missing_from_previous(str(path))
        return path

    def fetch(self, rels: Sequence[str]) -> None:
        for rel in rels:
            self.local(rel)

    def carry(self, rel: str, out_dir: Path) -> None:
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(self.local(rel), target)


@dataclass(frozen=True)
class KeptVersion:
    """The previous version of a map, in a local directory ``root`` (its own directory for
    a map on a local filesystem, a download otherwise, which ``files`` completes on demand).
    ``carry``: whether a build may carry its tiles (False: every tile is merged again)."""

    root: Path
    carry: bool = True
    files: VersionFiles | None = None

    @property
    def _files(self) -> VersionFiles:
        return self.files if self.files is not None else LocalFiles(self.root)

    @classmethod
    def of(
        cls,
        root: Path,
        grid: GridSettings,
        cloud: PointCloudMapSettings,
        *,
        carry: bool = True,
        files: VersionFiles | None = None,
    ) -> KeptVersion:
        """The version at ``root``, carrying tiles only if ``carry`` and its tiles were
        finished with the settings ``grid`` and ``cloud`` (read from :data:`TILE_SETTINGS`;
        a version written before it was kept carries nothing). ``files``: how its files are
        read and carried (default: all of them in ``root``). A ``grid`` or ``cloud`` that
        lays tiles out otherwise than the version's is a :class:`BuildError`
        (:func:`check_tile_layout`): its tiles cannot be merged with theirs."""
        path = root / TILE_SETTINGS
        try:
            kept = json.loads(path.read_text())
        except FileNotFoundError:
            log.info("%s: no record of the tiles' settings; every tile is merged again", root)
            return cls(root, carry=False, files=files)
        except ValueError as err:
            raise MapFormatError(f"{path}: not JSON ({err}); the map version is damaged") from err
        if not isinstance(kept, dict):
            raise MapFormatError(f"{path}: not a JSON object; the map version is damaged")
        check_tile_layout(kept, grid, cloud, str(path))
        if not carry:
            log.info("every tile is merged again (hdmap.carry_tiles is off)")
            return cls(root, carry=False, files=files)
        if kept != json.loads(json.dumps(tile_settings(grid, cloud))):
            log.warning(
                "the grid or point-cloud settings changed since %s: every tile is merged and "
                "written again with the new ones",
                root,
            )
            return cls(root, carry=False, files=files)
        return cls(root, files=files)

    def tile_state(self) -> dict[TileKey, str]:
        """Each grid tile's kept statistics file (relative to the version), by key."""
        return self._state(STATE_TILES)

    def cloud_state(self) -> dict[TileKey, str]:
        """Each point-cloud tile's kept voxel sums file (relative to the version), by key."""
        return self._state(STATE_CLOUD)

    def label_state(self) -> dict[TileKey, str]:
        """Each grid tile's kept label-stage result (relative to the version), by key."""
        return self._state(STATE_LABELS)

    def carry_labels(self, keys: Iterable[TileKey], out_dir: Path) -> None:
        """Give the version being built in ``out_dir`` the kept label-stage results of the
        grid tiles ``keys`` as they are."""
        for key in sorted(keys):
            self._files.carry(f"{STATE_LABELS}/{key[0]}_{key[1]}.npz", out_dir)

    def _state(self, folder: str) -> dict[TileKey, str]:
        out = {}
        for name in self._files.names(folder):
            if name.endswith(".npz"):
                out[_key_of(name[: -len(".npz")], self.root / folder / name)] = f"{folder}/{name}"
        return out

    def local(self, rel: str) -> Path:
        """A local path of the version's file ``rel`` (downloaded if it must be)."""
        return self._files.local(rel)

    def fetch(self, rels: Sequence[str]) -> None:
        """Make the version's files ``rels`` local together (see :meth:`VersionFiles.fetch`)."""
        self._files.fetch(rels)

    def fetch_grid(self, keys: Iterable[TileKey]) -> None:
        """:meth:`fetch` the GeoTIFFs of grid tiles ``keys``."""
        self.fetch([f"{GRID_DIR}/{tile_file_name(key)}" for key in keys])

    def grid_tile(self, key: TileKey) -> Path:
        """A local path of the GeoTIFF of grid tile ``key``."""
        return self.local(f"{GRID_DIR}/{tile_file_name(key)}")

    def carry_grid(self, keys: Iterable[TileKey], out_dir: Path) -> list[TileKey]:
        """Copy the files of grid tiles ``keys`` into the version being built in ``out_dir``;
        returns the keys carried (sorted)."""
        carried = sorted(keys)
        for key in carried:
            name = tile_file_name(key)
            preview = Path(name).with_suffix(".png").name
            for rel in (
                f"{GRID_DIR}/{name}",
                f"{GRID_DIR}/preview/{preview}",
                f"{STATE_TILES}/{key[0]}_{key[1]}.npz",
            ):
                self._files.carry(rel, out_dir)
        if carried:
            log.info("%d grid tiles out of the new drives' reach carried as they are", len(carried))
        return carried

    def carry_clouds(
        self, keys: Iterable[TileKey], tile_size: float, out_dir: Path
    ) -> list[tuple[str, tuple[float, float]]]:
        """Copy the files of point-cloud tiles ``keys`` (of ``tile_size`` m) into ``out_dir``;
        returns their metadata entries ``(file name, (x_min, y_min))``."""
        wanted = set(keys)
        if not wanted:
            return []
        meta_path = self.local(METADATA_FILE)
        meta = read_pointcloud_metadata(meta_path)
        if not math.isclose(meta.x_resolution, tile_size):
            raise MapFormatError(
                f"{meta_path}: point-cloud tiles of {meta.x_resolution:g} m, and this build's "
                f"are {tile_size:g} m; build the map again from its bags to change the size"
            )
        entries = []
        for name, (x_min, y_min) in meta.tiles.items():
            key = (math.floor(x_min / tile_size + 0.5), math.floor(y_min / tile_size + 0.5))
            if key in wanted:
                self._files.carry(f"{TILE_DIR}/{name}", out_dir)
                entries.append((name, (x_min, y_min)))
        for key in sorted(wanted):
            self._files.carry(f"{STATE_CLOUD}/{key[0]}_{key[1]}.npz", out_dir)
        log.info("%d point-cloud tiles out of the new drives' reach carried", len(wanted))
        return entries
