"""A map build's summary for people: one HTML page with PNG pictures beside it.

:func:`write_report` writes into ``out_dir``:

- ``map_preview.png`` -- the grid mosaic (reflectance in grey, elevation in colour) with the
  trajectories, lane markings and signs drawn on top, in map-frame metres (x east, y north);
  without a grid, the trajectories and labels alone;
- with an :class:`~adcloud.hdmap.evaluate.EvalResult`: ``ate.png`` (position error over
  time after the alignment) and, when the grid was evaluated, ``elevation_error.png`` (the
  histogram of per-cell elevation errors), plus ``eval.json``;
- with a build's :class:`~adcloud.hdmap.loops.DriveTies`: ``drive_ties.json``, the drives
  that came close but were not tied by loop closures, those that came close to no other
  drive, and each tied drive's GPS offset, also listed as notes;
- ``summary.html`` -- the inputs, the accuracy table against the targets and the pictures,
  referenced by relative names: copy the directory anywhere and it still shows.

:func:`write_map_report` does the same for a map version (or map URI) read from storage.
Plots are drawn with matplotlib's object API on the Agg canvas (no pyplot, no global
backend state, no display): safe in build servers and Spark drivers alike.
"""

from __future__ import annotations

import datetime as dt
import html
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib as mpl
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from numpy.typing import NDArray

from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.evaluate import (
    EvalResult,
    GridLayers,
    GridReader,
    Metric,
    load_map_products,
    mosaic,
)
from adcloud.hdmap.geotiff import PNG_OPTIONS
from adcloud.hdmap.loops import DriveTies
from adcloud.hdmap.mapdir import MANIFEST_NAME, VERSIONS_DIR, MapDir, MapVersion, local_path
from adcloud.hdmap.trajectory import Trajectory

__all__ = ["write_map_report", "write_report"]

_LOG = logging.getLogger(__name__)

F64 = NDArray[np.float64]
HTML_NAME = "summary.html"
PREVIEW_NAME = "map_preview.png"
ATE_NAME = "ate.png"
ELEVATION_NAME = "elevation_error.png"
EVAL_JSON_NAME = "eval.json"
TIES_JSON_NAME = "drive_ties.json"
# Longest side of a mosaic as drawn; larger grids are block-averaged (a panel is ~600 px
# wide on the page: more cells would only be dropped by matplotlib, unaveraged).
_MAX_PIXELS = 1024
_DPI = 110

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #176317; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
.na { color: #777; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
"""


def _as_grid(obj: Any) -> GridLayers:
    if isinstance(obj, GridLayers):
        return obj
    # any grid with the same conventions (e.g. adcloud.hdmap.labels.GridLayers)
    return GridLayers(
        elevation=obj.elevation,
        origin=tuple(obj.origin),
        resolution=float(obj.resolution),
        reflectance=getattr(obj, "reflectance", None),
    )


def _as_tiles(grid: Any) -> tuple[GridLayers, ...]:
    """``grid`` (None, one grid, or a sequence of tiles) as a tuple of :class:`GridLayers`."""
    if grid is None:
        return ()
    if hasattr(grid, "elevation"):
        return (_as_grid(grid),)
    try:
        return tuple(_as_grid(t) for t in grid)
    except (TypeError, AttributeError) as err:
        raise HdmapError(
            f"report: grid must be a GridLayers (elevation, origin, resolution) or a sequence "
            f"of them, got {type(grid).__name__}"
        ) from err


def _grid_span(tiles: Sequence[GridLayers]) -> tuple[int, int, tuple[float, float, float, float]]:
    """Cells (cols, rows) and extent (x_min, x_max, y_min, y_max) of the tiles' bounding box."""
    x0 = min(t.extent[0] for t in tiles)
    x1 = max(t.extent[1] for t in tiles)
    y0 = min(t.extent[2] for t in tiles)
    y1 = max(t.extent[3] for t in tiles)
    res = tiles[0].resolution
    return round((x1 - x0) / res), round((y1 - y0) / res), (x0, x1, y0, y1)


def _draw_factor(tiles: Sequence[GridLayers]) -> int:
    """Cells per drawn pixel (per side) so that the longest side has at most _MAX_PIXELS."""
    cols, rows, _ = _grid_span(tiles)
    return max(1, math.ceil(max(cols, rows) / _MAX_PIXELS))


def _limits(values: F64, lo: float = 2, hi: float = 98) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    a, b = np.percentile(finite, [lo, hi])
    return (float(a), float(b)) if b > a else (float(a) - 0.5, float(a) + 0.5)


@dataclass(frozen=True)
class _Overlays:
    """What is drawn over the map preview (all in the map frame)."""

    trajectories: Mapping[str, Trajectory]
    lane_markings: Sequence[F64]
    signs: F64
    lanes: Sequence[F64] = ()
    connectors: Sequence[F64] = ()

    def __bool__(self) -> bool:
        return bool(self.trajectories or len(self.lane_markings) or len(self.signs))


def _draw_overlays(ax: Axes, layers: _Overlays, *, legend: bool) -> None:
    for k, poly in enumerate(layers.lane_markings):
        p = np.asarray(poly)
        ax.plot(
            p[:, 0], p[:, 1], color="#ffb000", lw=1.0, label="lane markings" if k == 0 else None
        )
    for lines, style, label in (
        (layers.lanes, "-", "lanes (lanelet2)"),
        (layers.connectors, ":", "lane connectors"),
    ):
        for k, poly in enumerate(lines):
            p = np.asarray(poly)
            ax.plot(
                p[:, 0], p[:, 1], style, color="#2e9d4a", lw=0.8, label=label if k == 0 else None
            )
    colours = mpl.colormaps["tab10"]
    for k, (name, traj) in enumerate(sorted(layers.trajectories.items())):
        xyz = traj.xyz
        ax.plot(xyz[:, 0], xyz[:, 1], color=colours(k % 10), lw=1.4, label=f"trajectory {name}")
        ax.plot(xyz[:1, 0], xyz[:1, 1], "o", color=colours(k % 10), ms=4)
    signs = layers.signs
    if len(signs):
        ax.plot(signs[:, 0], signs[:, 1], "^", color="#d00000", mec="white", ms=8, label="signs")
    ax.set_xlabel("x east (m, map frame)")
    ax.set_ylabel("y north (m, map frame)")
    ax.set_aspect("equal")
    if legend and layers:
        ax.legend(loc="upper right", fontsize=8, framealpha=0.85)


def _preview(path: Path, tiles: Sequence[GridLayers], layers: _Overlays) -> None:
    if not tiles:
        fig = Figure(figsize=(8, 7))
        ax = fig.add_subplot(1, 1, 1)
        ax.set_facecolor("#f7f7f7")
        ax.grid(True, color="#ddd", lw=0.5)
        _draw_overlays(ax, layers, legend=True)
        ax.set_title("trajectories and labels (no grid)")
    else:
        factor = _draw_factor(tiles)
        # one array at the drawn resolution, never the full-resolution mosaic of a city
        grid = tiles[0] if len(tiles) == 1 and factor == 1 else mosaic(tiles, factor)
        panels: list[tuple[str, F64, str]] = []
        if grid.reflectance is not None:
            panels.append(("reflectance", np.asarray(grid.reflectance, np.float64), "gray"))
        panels.append(("elevation (m)", np.asarray(grid.elevation, np.float64), "viridis"))
        h, w = grid.elevation.shape
        aspect = h / max(w, 1)
        width = 7.5 * len(panels)
        fig = Figure(figsize=(width, min(max(3.5, 7.5 * aspect + 1.0), 14)))
        for k, (name, layer, cmap_name) in enumerate(panels):
            ax = fig.add_subplot(1, len(panels), k + 1)
            cmap = mpl.colormaps[cmap_name].with_extremes(bad="#f2efe9")
            vmin, vmax = _limits(layer)
            image = ax.imshow(
                np.ma.masked_invalid(layer),
                origin="lower",  # row 0 is the southern edge
                extent=grid.extent,
                cmap=cmap,
                vmin=vmin,
                vmax=vmax,
                interpolation="nearest",
            )
            fig.colorbar(image, ax=ax, shrink=0.8, label=name)
            _draw_overlays(ax, layers, legend=k == 0)
            ax.set_xlim(grid.extent[0], grid.extent[1])
            ax.set_ylim(grid.extent[2], grid.extent[3])
            ax.set_title(f"{name} ({tiles[0].resolution * 100:g} cm cells, drawn 1:{factor})")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, pil_kwargs=PNG_OPTIONS)


def _ate_plot(path: Path, result: EvalResult) -> None:
    fig = Figure(figsize=(9, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    err_cm = result.ate.errors * 100
    t = result.ate_times_s if len(result.ate_times_s) == len(err_cm) else np.arange(len(err_cm))
    ax.plot(t, err_cm, lw=1.0, color="#1f5fa8", label="position error")
    ax.axhline(result.ate.rmse * 100, color="#1f5fa8", ls="--", lw=1, label="RMSE")
    target = result.metric("ate_rmse").target * 100
    ax.axhline(target, color="#b00020", ls=":", lw=1.2, label=f"target RMSE {target:g} cm")
    ax.set_xlabel("time since the drive start (s)")
    ax.set_ylabel("error (cm)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"trajectory error of drive {result.drive} after alignment (ATE)")
    ax.grid(True, color="#ddd", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, pil_kwargs=PNG_OPTIONS)


def _elevation_plot(path: Path, result: EvalResult) -> None:
    assert result.elevation is not None
    err_cm = result.elevation.errors * 100
    fig = Figure(figsize=(9, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    lo, hi = _limits(err_cm, 0.5, 99.5)
    target = result.metric("elevation_rmse").target * 100
    span = max(abs(lo), abs(hi), 1.25 * target, 1.0)
    outside = int(np.sum(np.abs(err_cm) > span))
    ax.hist(err_cm, bins=80, range=(-span, span), color="#4a8f4a")
    for sign in (-1, 1):
        ax.axvline(sign * target, color="#b00020", ls=":", lw=1.2)
    ax.set_xlabel(
        "estimated minus true elevation (cm)"
        + (f"; {outside} cells beyond +/-{span:.1f} cm not shown" if outside else "")
    )
    ax.set_ylabel("cells")
    ax.set_title(
        f"elevation error over {result.elevation.count} observed cells: RMSE "
        f"{result.elevation.rmse * 100:.2f} cm (target {target:g} cm, dotted)"
    )
    ax.grid(True, color="#ddd", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, pil_kwargs=PNG_OPTIONS)


def _format_value(metric: Metric) -> str:
    if metric.value is None or not math.isfinite(metric.value):
        return "not evaluated"
    if metric.unit == "m":
        return f"{metric.value * 100:.2f} cm"
    return f"{metric.value * 100:.1f} %"


def _format_target(metric: Metric) -> str:
    op = "&le;" if metric.op == "<=" else "&ge;"
    value = f"{metric.target * 100:g} cm" if metric.unit == "m" else f"{metric.target * 100:g} %"
    return f"{op} {value}"


def _verdict(passed: bool | None) -> str:
    if passed is None:
        return '<span class="na">&ndash;</span>'
    return '<span class="pass">pass</span>' if passed else '<span class="fail">FAIL</span>'


def _table(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _metrics_table(result: EvalResult) -> str:
    head = "<tr><th>metric</th><th>value</th><th>target</th><th>result</th><th>note</th></tr>"
    body = "".join(
        f"<tr><td>{html.escape(m.name.replace('_', ' '))}</td>"
        f'<td class="num">{_format_value(m)}</td><td class="num">{_format_target(m)}</td>'
        f"<td>{_verdict(m.passed)}</td><td>{html.escape(m.note)}</td></tr>"
        for m in result.metrics
    )
    return f"<table>{head}{body}</table>"


def _details(result: EvalResult) -> list[tuple[str, str]]:
    a = result.alignment
    yaw = math.degrees(math.atan2(a[1, 0], a[0, 0]))
    rows = [
        ("drive compared", result.drive),
        ("truth", result.truth_dir),
        (
            "alignment map -> truth",
            f"offset ({a[0, 3]:+.3f}, {a[1, 3]:+.3f}, {a[2, 3]:+.3f}) m, yaw {yaw:+.3f} deg",
        ),
        (
            "ATE",
            f"RMSE {result.ate.rmse * 100:.2f} cm, max {result.ate.max * 100:.2f} cm "
            f"over {result.ate.count} poses",
        ),
    ]
    if result.markings is not None:
        m = result.markings
        rows.append(
            (
                "lane markings",
                f"{m.recovered_length_m:.1f} of {m.truth_length_m:.1f} m of observable paint "
                f"recovered; {m.estimate_length_m:.1f} m mapped, {m.false_length_m:.1f} m "
                "far from any true stripe",
            )
        )
    if result.signs is not None:
        s = result.signs
        rows.append(
            (
                "signs",
                f"{s.matched} matched of {s.estimated} mapped; {s.true} true signs passed",
            )
        )
    return rows


def _check_outside_versions(out: Path) -> None:
    """Refuse a report directory inside a committed map version: its files are often hard
    links that earlier versions share (a rollback links them all), so writing there would
    change those versions too -- and a version is never changed after its commit."""
    for folder in (out.absolute(), *out.absolute().parents):
        if (
            folder.parent.name == VERSIONS_DIR
            and folder.name.isdigit()
            and (folder / MANIFEST_NAME).is_file()
        ):
            raise HdmapError(
                f"{out}: lies inside the committed map version {folder}; a map version is "
                "never changed after its build (its files may be shared with other "
                "versions): write the report outside the map directory"
            )


def write_report(
    out_dir: str | os.PathLike[str],
    *,
    trajectories: Mapping[str, Trajectory] | Trajectory | None = None,
    grid: GridLayers | Sequence[GridLayers] | Any = None,
    lane_markings: Sequence[F64] = (),
    signs: F64 | None = None,
    lanes: Sequence[F64] = (),
    connectors: Sequence[F64] = (),
    eval_result: EvalResult | None = None,
    inputs: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
    title: str = "HD map summary",
    grid_text: str | None = None,
    ties: DriveTies | None = None,
) -> Path:
    """Write ``summary.html`` and its PNGs into ``out_dir`` (created) and return the HTML path.

    ``trajectories`` by drive name (or one), ``grid`` (a mosaic or the map's tiles: any
    object with ``elevation``, ``origin``, ``resolution`` and optionally ``reflectance`` in
    the :class:`~adcloud.hdmap.evaluate.GridLayers` convention; drawn block-averaged to at
    most 1600 pixels a side), ``lane_markings`` polylines and
    ``signs`` (n, 2|3), ``lanes`` (the lanes' centre lines) and ``connectors`` (the
    lanelet2 connectors' centre lines) are all in the map frame (m).  ``eval_result`` adds
    the accuracy table and the error plots; ``inputs`` are rows for the inputs table (map
    URI, version, drives...); ``notes`` are listed at the end, with those of ``ties`` (a
    build's, also written as ``drive_ties.json``).  ``grid_text`` describes the grid in
    place of the figures of ``grid``, where that is a part of it (coarse copies of some of
    the map's tiles)."""
    out = local_path(out_dir, "a report")
    _check_outside_versions(out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(trajectories, Trajectory):
        trajectories = {"drive": trajectories}
    trajs = dict(trajectories or {})
    sign_arr = np.zeros((0, 3)) if signs is None else np.asarray(signs, dtype=np.float64)
    if sign_arr.ndim != 2 or (len(sign_arr) and sign_arr.shape[1] < 2):
        raise HdmapError(f"report: signs must be (n, 2) or (n, 3) positions, got {sign_arr.shape}")
    tiles = _as_tiles(grid)
    if not tiles and not trajs and not lane_markings and not len(sign_arr):
        raise HdmapError(
            f"report for {out}: nothing to draw (no grid, trajectory, marking or sign); "
            "pass at least one"
        )
    layers = _Overlays(trajs, lane_markings, sign_arr, lanes, connectors)
    _preview(out / PREVIEW_NAME, tiles, layers)
    what = (
        "trajectories, lane markings, lanes and signs"
        if lanes
        else "trajectories, lane markings and signs"
    )
    images = [(PREVIEW_NAME, f"map preview: mosaic with {what}")]
    if eval_result is not None:
        _ate_plot(out / ATE_NAME, eval_result)
        images.append((ATE_NAME, "trajectory error over time"))
        if eval_result.elevation is not None and eval_result.elevation.count:
            _elevation_plot(out / ELEVATION_NAME, eval_result)
            images.append((ELEVATION_NAME, "elevation error histogram"))
        (out / EVAL_JSON_NAME).write_text(eval_result.to_json(), encoding="utf-8")
    if ties is not None:
        (out / TIES_JSON_NAME).write_text(ties.to_json() + "\n", encoding="utf-8")

    rows = list((inputs or {}).items())
    rows.append(("drives", ", ".join(sorted(trajs)) or "none"))
    if grid_text is not None:
        rows.append(("grid", grid_text))
    elif tiles:
        w, h, (x0, x1, y0, y1) = _grid_span(tiles)
        res = tiles[0].resolution
        observed = sum(int(t.observed.sum()) for t in tiles)
        rows.append(
            (
                "grid",
                f"{len(tiles)} tile(s), {w} x {h} cells of {res * 100:g} cm, "
                f"x {x0:.1f}..{x1:.1f} m, y {y0:.1f}..{y1:.1f} m, {observed} observed "
                f"({observed * res**2:.0f} m\N{SUPERSCRIPT TWO}); drawn at "
                f"1:{_draw_factor(tiles)}",
            )
        )
    marking_len = sum(
        float(np.linalg.norm(np.diff(np.asarray(p)[:, :2], axis=0), axis=1).sum())
        for p in lane_markings
    )
    rows.append(
        (
            "labels",
            f"{len(lane_markings)} lane markings ({marking_len:.1f} m), {len(sign_arr)} signs",
        )
    )
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Written {now}.",
    ]
    if eval_result is not None:
        parts.append(f" Accuracy against ground truth: {_verdict(eval_result.passed)}.")
    parts.append("</p><h2>Inputs</h2>" + _table(rows))
    if eval_result is not None:
        parts.append("<h2>Accuracy</h2>" + _metrics_table(eval_result))
        parts.append(_table(_details(eval_result)))
        parts.append(
            "<p>Map products are compared after the rigid alignment that best maps the "
            "estimated trajectory onto the true one (the constant GPS bias of a drive is not "
            "observable); the same transform is applied to the grid, markings and signs.</p>"
        )
    for name, alt in images:
        section = "Map" if name == PREVIEW_NAME else "Errors"
        if name in (PREVIEW_NAME, ATE_NAME):
            parts.append(f"<h2>{section}</h2>")
        parts.append(f'<img src="{html.escape(name)}" alt="{html.escape(alt)}">')
    all_notes = [
        *(ties.notes() if ties is not None else []),
        *notes,
        *(eval_result.notes if eval_result is not None else []),
    ]
    if all_notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in all_notes)
        parts.append(f"<h2>Notes</h2><ul>{items}</ul>")
    parts.append("</body></html>\n")
    page = out / HTML_NAME
    page.write_text("\n".join(parts), encoding="utf-8")
    _LOG.info("report written to %s", page)
    return page


def write_map_report(
    source: MapVersion | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    eval_result: EvalResult | None = None,
    grid_reader: GridReader | None = None,
    title: str | None = None,
) -> Path:
    """:func:`write_report` for a stored map: ``source`` is a :class:`MapVersion`, a map URI
    (its current version) or a version directory."""
    if not isinstance(source, MapVersion):
        text = os.fspath(source)
        if "://" in text or (Path(text) / "CURRENT").is_file():
            # opened here, so closed here: a store's map holds connections and files
            with MapDir(text) as mapdir:
                current = mapdir.current()
                if current is not None:
                    return _write_map_report(current, out_dir, eval_result, grid_reader, title)
    return _write_map_report(source, out_dir, eval_result, grid_reader, title)


def _write_map_report(
    source: MapVersion | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    eval_result: EvalResult | None,
    grid_reader: GridReader | None,
    title: str | None,
) -> Path:
    products = load_map_products(source, grid_reader=grid_reader)
    inputs = {"map": products.source}
    if isinstance(source, MapVersion):
        inputs["version"] = source.id
        inputs["built"] = source.manifest.created_at
        inputs["drives in manifest"] = ", ".join(
            f"{d.name} ({d.sha256[:12]})" for d in source.manifest.drives
        )
    return write_report(
        out_dir,
        trajectories=products.trajectories,
        grid=products.grid,
        lane_markings=products.lane_markings,
        signs=products.signs,
        eval_result=eval_result,
        inputs=inputs,
        notes=products.notes,
        title=title or f"HD map {products.source}",
    )
