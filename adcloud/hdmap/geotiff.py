"""Grid tiles as GeoTIFF files, their PNG previews, and the reader that loads them back.

File layout, format version 1
    One GeoTIFF per tile, ``<tx>_<ty>.tif`` (the tile key), holding every layer of
    :data:`adcloud.hdmap.grid.LAYERS` as a float32 band in that order (planar configuration
    *separate*, zlib-compressed): ``elevation_mean``, ``elevation_min``, ``elevation_max``,
    ``count``, ``reflectance_mean``, ``scans``, ``obstacle_top``. One file per tile keeps a
    tile's layers together for the readers that want them all (QGIS, GDAL, the lanes
    stage); ``count`` and ``scans`` are integers stored exactly in float32 (up to 2^24).
    Rows are north-up (row 0 is the tile's northern edge) as GeoTIFF viewers expect --
    the flip of :class:`~adcloud.hdmap.grid.GridTile`'s south-up rows. NaN marks cells
    without data (``GDAL_NODATA`` is ``nan``; ``count`` and ``scans`` are 0 there).

Georeferencing
    The map frame is a local ENU tangent plane about a WGS84 origin (latitude, longitude,
    ellipsoidal height). The GeoKeys declare a *user-defined* projected CRS
    (``ProjectedCSTypeGeoKey`` = ``ProjectionGeoKey`` = 32767) in metres on the WGS84
    datum, whose coordinate transformation is the orthographic projection centred on the
    origin (``CT_Orthographic``, natural origin = the origin's latitude/longitude, false
    easting/northing 0). For ground near the origin's height the ellipsoidal orthographic
    projection and the ENU plane agree to millimetres over a few kilometres, so GIS tools
    place the tiles correctly; the exact definition is the ENU frame, spelled out with the
    origin in ``GTCitationGeoKey``/``PCSCitationGeoKey`` and in the GDAL metadata items
    ``ORIGIN_LAT_DEG``, ``ORIGIN_LON_DEG``, ``ORIGIN_HEIGHT_M``. ``ModelPixelScaleTag``
    (33550) holds the resolution, ``ModelTiepointTag`` (33922) ties pixel (0, 0)'s
    north-west corner to the tile's map-frame ``(x_min, y_max)``; raster type is
    PixelIsArea. Heights are map-frame z (m above the tangent plane's origin, which lies at
    ``ORIGIN_HEIGHT_M`` above the ellipsoid).

History
    - 1: first version.
"""

from __future__ import annotations

import io
import logging
import math
import os
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import tifffile
from numpy.typing import NDArray

from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.grid import LAYERS, GridTile, TileKey

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PNG_OPTIONS",
    "GeoTile",
    "MapOrigin",
    "read_grid_tile",
    "tile_file_name",
    "write_grid_tile",
    "write_mosaic",
    "write_preview",
]

log = logging.getLogger(__name__)

T = TypeVar("T", int, float)

FORMAT = "adcloud.hdmap.grid"
FORMAT_VERSION = 1

#: WGS84 latitude (deg), longitude (deg) and ellipsoidal height (m) of the map origin.
MapOrigin = tuple[float, float, float]

# TIFF/GeoTIFF tags and GeoKeys (GeoTIFF 1.1, OGC 19-008r4).
_PIXEL_SCALE, _TIEPOINT, _GEOKEYS, _GEODOUBLES, _GEOASCII = 33550, 33922, 34735, 34736, 34737
_GDAL_METADATA, _GDAL_NODATA = 42112, 42113
_USER_DEFINED = 32767
_INT_LAYERS = ("count", "scans")
_UNITS = {"elevation_mean": "m", "elevation_min": "m", "elevation_max": "m", "obstacle_top": "m"}


@dataclass(frozen=True)
class GeoTile:
    """A grid tile read back from a GeoTIFF, with the WGS84 origin of its map frame."""

    tile: GridTile
    origin: MapOrigin


def tile_file_name(key: TileKey) -> str:
    """The file name of tile ``key``: ``<tx>_<ty>.tif``."""
    return f"{key[0]}_{key[1]}.tif"


def _check_origin(origin: MapOrigin) -> MapOrigin:
    try:
        lat, lon, alt = (float(v) for v in origin)
    except (TypeError, ValueError) as err:
        raise HdmapError(f"origin must be (lat_deg, lon_deg, height_m), got {origin!r}") from err
    if not (-90 <= lat <= 90 and -180 <= lon <= 180 and math.isfinite(alt)):
        raise HdmapError(f"origin {origin!r} is not a WGS84 latitude, longitude and height")
    return lat, lon, alt


def _geokeys(origin: MapOrigin, citation: str) -> tuple[list[int], list[float], str]:
    """The GeoKeyDirectory (SHORTs), GeoDoubleParams and GeoAsciiParams of the map frame."""
    lat, lon, _ = origin
    ascii_params = f"{citation}|{citation}|"
    doubles = [lon, lat, 0.0, 0.0]
    keys = [
        (1024, 0, 1, 1),  # GTModelTypeGeoKey: projected
        (1025, 0, 1, 1),  # GTRasterTypeGeoKey: PixelIsArea
        (1026, _GEOASCII, len(citation) + 1, 0),  # GTCitationGeoKey
        (2048, 0, 1, 4326),  # GeographicTypeGeoKey: WGS 84
        (2054, 0, 1, 9102),  # GeogAngularUnitsGeoKey: degree
        (3072, 0, 1, _USER_DEFINED),  # ProjectedCSTypeGeoKey
        (3073, _GEOASCII, len(citation) + 1, len(citation) + 1),  # PCSCitationGeoKey
        (3074, 0, 1, _USER_DEFINED),  # ProjectionGeoKey
        (3075, 0, 1, 21),  # ProjCoordTransGeoKey: CT_Orthographic
        (3076, 0, 1, 9001),  # ProjLinearUnitsGeoKey: metre
        (3080, _GEODOUBLES, 1, 0),  # ProjNatOriginLongGeoKey
        (3081, _GEODOUBLES, 1, 1),  # ProjNatOriginLatGeoKey
        (3082, _GEODOUBLES, 1, 2),  # ProjFalseEastingGeoKey
        (3083, _GEODOUBLES, 1, 3),  # ProjFalseNorthingGeoKey
        (4099, 0, 1, 9001),  # VerticalUnitsGeoKey: metre
    ]
    directory = [1, 1, 1, len(keys)]
    for key in keys:
        directory.extend(key)
    return directory, doubles, ascii_params


def _gdal_metadata(tile: GridTile, origin: MapOrigin) -> str:
    root = ET.Element("GDALMetadata")
    items = {
        "ADCLOUD_FORMAT": FORMAT,
        "ADCLOUD_VERSION": str(FORMAT_VERSION),
        "TILE_X": str(tile.key[0]),
        "TILE_Y": str(tile.key[1]),
        "RESOLUTION_M": repr(float(tile.resolution)),
        "ORIGIN_LAT_DEG": repr(origin[0]),
        "ORIGIN_LON_DEG": repr(origin[1]),
        "ORIGIN_HEIGHT_M": repr(origin[2]),
        "MAP_FRAME": "ENU tangent plane at the origin (x east, y north, z up; m)",
    }
    for name, value in items.items():
        ET.SubElement(root, "Item", name=name).text = value
    for band, layer in enumerate(LAYERS):
        ET.SubElement(
            root, "Item", name="DESCRIPTION", sample=str(band), role="description"
        ).text = layer
        if layer in _UNITS:
            ET.SubElement(
                root, "Item", name="UNITTYPE", sample=str(band), role="unittype"
            ).text = _UNITS[layer]
    return ET.tostring(root, encoding="unicode")


def write_grid_tile(tile: GridTile, path: str | os.PathLike[str], origin: MapOrigin) -> Path:
    """Write ``tile`` as a GeoTIFF (see the module docstring); returns the path.

    ``origin`` is the WGS84 ``(lat_deg, lon_deg, height_m)`` of the map frame. A ``path``
    that is a directory or has no ``.tif``/``.tiff`` suffix is a directory (created if
    needed) and the file in it is :func:`tile_file_name`. The file is written beside and
    renamed into place, so readers never see half a tile.
    """
    origin = _check_origin(origin)
    path = Path(path)
    if path.is_dir() or path.suffix.lower() not in (".tif", ".tiff"):
        path = path / tile_file_name(tile.key)
    rows, cols = tile.shape
    bands = np.stack([np.flipud(tile.layer(name)).astype(np.float32) for name in LAYERS])
    x_min, y_min = tile.origin
    y_max = y_min + rows * tile.resolution
    lat, lon, alt = origin
    citation = (
        f"adcloud map frame: local ENU tangent plane at WGS84 lat {lat:.9f} deg, "
        f"lon {lon:.9f} deg, h {alt:.3f} m"
    )
    directory, doubles, ascii_params = _geokeys(origin, citation)
    extratags: list[tuple[int, int, int, Any, bool]] = [
        (_PIXEL_SCALE, 12, 3, (tile.resolution, tile.resolution, 0.0), True),
        (_TIEPOINT, 12, 6, (0.0, 0.0, 0.0, x_min, y_max, 0.0), True),
        (_GEOKEYS, 3, len(directory), tuple(directory), True),
        (_GEODOUBLES, 12, len(doubles), tuple(doubles), True),
        (_GEOASCII, 2, 0, ascii_params, True),
        (_GDAL_METADATA, 2, 0, _gdal_metadata(tile, origin), True),
        (_GDAL_NODATA, 2, 0, "nan", True),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        tifffile.imwrite(
            partial,
            bands,
            photometric="minisblack",
            planarconfig="separate",
            # zlib level 1: on the loop drive's tiles 48 ms a tile against 111 ms at zlib's
            # default 6, for files ~10% larger (0.97 vs 0.88 MB); any reader inflates either
            compression="zlib",
            compressionargs={"level": 1},
            metadata=None,
            extratags=extratags,
        )
        partial.replace(path)
    except BaseException:
        # a full disk or an interrupt mid-write: no torn tile beside the finished ones
        partial.unlink(missing_ok=True)
        raise
    log.debug("grid tile %s -> %s (%d x %d)", tile.key, path, rows, cols)
    return path


def _items(xml: str, path: Path) -> tuple[dict[str, str], dict[int, str]]:
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as err:
        raise MapFormatError(f"{path}: unreadable GDAL metadata: {err}") from err
    items: dict[str, str] = {}
    bands: dict[int, str] = {}
    for item in root.iter("Item"):
        name, text = item.get("name", ""), item.text or ""
        if name == "DESCRIPTION" and item.get("sample") is not None:
            bands[int(item.get("sample", "0"))] = text
        elif item.get("sample") is None:
            items[name] = text
    return items, bands


def read_grid_tile(path: str | os.PathLike[str] | bytes) -> GeoTile:
    """Load a tile written by :func:`write_grid_tile` (layers back to south-up rows), from
    its file or the file's bytes."""
    source: Any = io.BytesIO(path) if isinstance(path, bytes) else Path(path)
    path = Path("<bytes>") if isinstance(path, bytes) else Path(path)
    try:
        with tifffile.TiffFile(source) as tif:
            page = tif.pages.first
            tags = {tag.code: tag.value for tag in page.tags.values()}
            data = page.asarray()
    except (tifffile.TiffFileError, OSError, ValueError, zlib.error) as err:
        # zlib.error: a tile cut off inside its compressed strips
        raise MapFormatError(
            f"{path}: not a readable TIFF ({err}); expected a grid tile written by "
            "adcloud.hdmap.geotiff.write_grid_tile"
        ) from err
    missing = [code for code in (_PIXEL_SCALE, _TIEPOINT, _GEOKEYS) if code not in tags]
    if missing:
        raise MapFormatError(
            f"{path}: a TIFF without the GeoTIFF tags {missing} (ModelPixelScale 33550, "
            "ModelTiepoint 33922, GeoKeyDirectory 34735); it is not a grid tile"
        )
    items, bands = _items(str(tags.get(_GDAL_METADATA, "<GDALMetadata/>")), path)
    if items.get("ADCLOUD_FORMAT") != FORMAT:
        raise MapFormatError(f"{path}: a GeoTIFF but not an adcloud grid tile (no ADCLOUD_FORMAT)")
    version = _metadata(items, "ADCLOUD_VERSION", int, path, "0")
    if version != FORMAT_VERSION:
        raise MapFormatError(
            f"{path}: grid tile format version {version}; this reader knows {FORMAT_VERSION}"
        )
    names = [bands.get(i, "") for i in range(len(bands))]
    if tuple(names) != LAYERS or data.ndim != 3 or data.shape[0] != len(LAYERS):
        raise MapFormatError(
            f"{path}: bands {names} (shape {data.shape}) are not the layers {list(LAYERS)}"
        )
    scale = tags[_PIXEL_SCALE]
    tie = tags[_TIEPOINT]
    resolution = float(scale[0])
    rows = data.shape[1]
    origin_xy = (float(tie[3]), float(tie[4]) - rows * resolution)

    def band(name: str) -> NDArray[np.float32]:
        return np.ascontiguousarray(np.flipud(data[LAYERS.index(name)]), np.float32)

    def counts(name: str) -> NDArray[np.int32]:
        return np.rint(band(name)).astype(np.int32)

    tile = GridTile(
        key=(_metadata(items, "TILE_X", int, path), _metadata(items, "TILE_Y", int, path)),
        origin=origin_xy,
        resolution=resolution,
        elevation_mean=band("elevation_mean"),
        elevation_min=band("elevation_min"),
        elevation_max=band("elevation_max"),
        count=counts("count"),
        reflectance_mean=band("reflectance_mean"),
        scans=counts("scans"),
        obstacle_top=band("obstacle_top"),
    )
    origin = (
        _metadata(items, "ORIGIN_LAT_DEG", float, path),
        _metadata(items, "ORIGIN_LON_DEG", float, path),
        _metadata(items, "ORIGIN_HEIGHT_M", float, path),
    )
    return GeoTile(tile, origin)


def _metadata(
    items: dict[str, str],
    name: str,
    kind: Callable[[str], T],
    path: Path,
    default: str | None = None,
) -> T:
    """The tile's GDAL metadata item ``name`` read as ``kind``; a :class:`MapFormatError`
    naming the file and the item where it is missing or not a ``kind``."""
    text = items.get(name, default)
    if text is None:
        raise MapFormatError(f"{path}: the grid tile's metadata has no {name}; the tile is damaged")
    try:
        return kind(text)
    except ValueError:
        raise MapFormatError(
            f"{path}: the grid tile's metadata item {name} is {text!r}, not a "
            f"{kind.__name__}; the tile is damaged"
        ) from None


# -- previews ---------------------------------------------------------------------------------

#: Pillow's options for adcloud's PNGs: zlib level 1 instead of 6 encodes a tile preview in
#: half the time (200 x 200: 11.8 -> 5.9 ms) for files ~25 % larger.
PNG_OPTIONS = {"compress_level": 1}

_CMAPS = {
    "elevation_mean": "viridis",
    "elevation_min": "viridis",
    "elevation_max": "viridis",
    "count": "magma",
    "reflectance_mean": "gray",
    "scans": "magma",
    "obstacle_top": "inferno",
}


def _limits(values: NDArray[Any], vmin: float | None, vmax: float | None) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    lo = float(np.percentile(finite, 2)) if vmin is None and finite.size else (vmin or 0.0)
    hi = float(np.percentile(finite, 98)) if vmax is None and finite.size else (vmax or 1.0)
    return lo, hi if hi > lo else lo + 1.0


def _block_mean(values: NDArray[Any], factor: int) -> NDArray[np.float64]:
    """NaN-aware mean over ``factor`` x ``factor`` blocks (edges padded with NaN)."""
    rows, cols = values.shape
    r, c = -(-rows // factor) * factor, -(-cols // factor) * factor
    padded = np.full((r, c), np.nan)
    padded[:rows, :cols] = values
    blocks = padded.reshape(r // factor, factor, c // factor, factor)
    finite = np.isfinite(blocks)
    total = np.where(finite, blocks, 0.0).sum(axis=(1, 3))
    n = finite.sum(axis=(1, 3))
    with np.errstate(invalid="ignore", divide="ignore"):
        out: NDArray[np.float64] = np.where(n > 0, total / np.maximum(n, 1), np.nan)
    return out


def _layer_values(tile: GridTile, layer: str) -> NDArray[np.float64]:
    values = tile.layer(layer).astype(np.float64)
    if layer in _INT_LAYERS:
        values[values == 0] = np.nan
    return values


def write_preview(
    tile: GridTile,
    path: str | os.PathLike[str],
    layer: str = "elevation_mean",
    *,
    vmin: float | None = None,
    vmax: float | None = None,
    max_pixels: int = 256,
) -> Path:
    """A small colormapped PNG of one layer of one tile, north up, no colorbar or axes.

    Empty cells are transparent. The image is block-averaged down to at most
    ``max_pixels`` on a side; colours span ``vmin``..``vmax`` (default: the layer's 2nd to
    98th percentile), so pass common limits to make neighbouring tiles comparable.
    """
    import matplotlib as mpl  # noqa: PLC0415 - plotting only here
    from matplotlib.image import imsave  # noqa: PLC0415

    values = _layer_values(tile, layer)
    factor = max(1, -(-max(values.shape) // max(1, max_pixels)))
    small = _block_mean(values, factor) if factor > 1 else values
    lo, hi = _limits(small, vmin, vmax)
    cmap = mpl.colormaps[_CMAPS[layer]].with_extremes(bad=(0, 0, 0, 0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed into place, as the tiles are: a carried preview is a hard
    # link to the previous version's file, which must never be rewritten through it.
    partial = path.with_name(f".{path.name}.partial")
    try:
        imsave(
            partial,
            np.ma.masked_invalid(np.flipud(small)),
            cmap=cmap,
            vmin=lo,
            vmax=hi,
            format="png",
            pil_kwargs=PNG_OPTIONS,
        )
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def write_mosaic(
    tiles: Mapping[TileKey, GridTile] | Sequence[GridTile],
    path: str | os.PathLike[str],
    layer: str = "elevation_mean",
    *,
    max_pixels: int = 1024,
    title: str | None = None,
) -> Path:
    """One PNG of ``layer`` over all ``tiles`` (north up, axes in map-frame metres, with a
    colorbar), block-averaged so its larger side is at most ``max_pixels`` cells (the
    figure is 960 pixels wide: finer cells would be dropped unaveraged)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    items = list(tiles.values()) if isinstance(tiles, Mapping) else list(tiles)
    if not items:
        raise HdmapError("write_mosaic needs at least one tile")
    res = items[0].resolution
    rows, cols = items[0].shape
    if any(t.resolution != res or t.shape != (rows, cols) for t in items):
        raise HdmapError("write_mosaic: tiles differ in resolution or size; mosaic one build")
    kx = [t.key[0] for t in items]
    ky = [t.key[1] for t in items]
    span_x, span_y = (max(kx) - min(kx) + 1) * cols, (max(ky) - min(ky) + 1) * rows
    factor = max(1, -(-max(span_x, span_y) // max(1, max_pixels)))
    while cols % factor and factor > 1:
        factor -= 1  # whole tiles must map to whole output pixels
    canvas = np.full((span_y // factor, span_x // factor), np.nan)
    for t in items:
        small = (
            _block_mean(_layer_values(t, layer), factor) if factor > 1 else _layer_values(t, layer)
        )
        r0 = (t.key[1] - min(ky)) * rows // factor
        c0 = (t.key[0] - min(kx)) * cols // factor
        canvas[r0 : r0 + small.shape[0], c0 : c0 + small.shape[1]] = small
    lo, hi = _limits(canvas, None, None)
    x0, y0 = (
        items[0].origin[0] - (items[0].key[0] - min(kx)) * cols * res,
        items[0].origin[1] - (items[0].key[1] - min(ky)) * rows * res,
    )
    fig = Figure(figsize=(8, 8 * canvas.shape[0] / max(canvas.shape[1], 1) + 0.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(
        np.ma.masked_invalid(canvas),
        origin="lower",
        extent=(x0, x0 + span_x * res, y0, y0 + span_y * res),
        cmap=_CMAPS[layer],
        vmin=lo,
        vmax=hi,
        interpolation="nearest",
    )
    fig.colorbar(image, ax=ax, label=f"{layer} ({_UNITS.get(layer, '')})".replace(" ()", ""))
    ax.set_xlabel("x east (m)")
    ax.set_ylabel("y north (m)")
    ax.set_title(title or f"{layer}, {len(items)} tiles at {res} m")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, pil_kwargs=PNG_OPTIONS)
    return path
