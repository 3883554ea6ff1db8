"""examples/hdmap_build.ipynb runs top to bottom with this interpreter's kernel, and what it
shows agrees with the map it built."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Any

import nbclient
import nbformat
import pytest

from adcloud.hdmap import MapDir, evaluate_map
from adcloud.hdmap.geotiff import read_grid_tile
from adcloud.hdmap.lanelet import load_lanelet2

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "hdmap_build.ipynb"

pytestmark = pytest.mark.spark


def _outputs(nb: Any) -> list[dict[str, Any]]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _text(nb: Any) -> str:
    """Printed text and the plain-text form of displayed values (tables)."""
    parts = []
    for o in _outputs(nb):
        parts.append(o.get("text", ""))
        parts.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_hdmap_notebook_builds_evaluates_and_shows_the_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADCLOUD_EXAMPLE_OUT", str(tmp_path))
    # The notebook starts its own local[2] session; a master from the environment must not
    # send it elsewhere.
    for key in [k for k in os.environ if k.startswith(("ADCLOUD_SPARK_", "PYSPARK_", "SPARK_"))]:
        monkeypatch.delenv(key)
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    # jupyter_client starts the "python3" kernel with sys.executable: this venv's Python.
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for o in _outputs(nb) if o.get("output_type") == "error"]
    assert not errors, errors
    text = _text(nb)

    # one version, and the second build wrote nothing
    mapdir = MapDir(str(tmp_path / "hdmap_map"))
    assert mapdir.versions() == ["000001"]
    assert "version 000001" in text and "(changed: True)" in text
    assert "second build changed: False; current version 000001" in text
    # the plan knows the drive; the export holds what Autoware reads, and only that
    assert "new drives: 0; known: ['hdmap_drive']" in text
    exported = tmp_path / "hdmap_for_autoware"
    shown_files = re.search(r"exported version 000001: (\d+) files for Autoware", text)
    assert shown_files, text
    assert int(shown_files.group(1)) == sum(1 for p in exported.rglob("*") if p.is_file())
    assert (exported / "lanelet2_map.osm").is_file() and not (exported / "state").exists()
    version = mapdir.current()
    assert version is not None and version.path is not None
    root = version.path

    # the ATE shown is the one an independent evaluation of the same map gives; the accuracy
    # targets themselves are test_build's business, here the map need only be roughly right
    shown = re.search(r"ATE RMSE: ([0-9.]+) cm over (\d+) poses", text)
    assert shown, text
    truth = tmp_path / "hdmap_drive.bag.truth"
    evaluation = evaluate_map(str(tmp_path / "hdmap_map"), truth)
    ate = evaluation.metric("ate_rmse").value
    assert ate is not None and ate < 0.05  # the target
    assert float(shown.group(1)) == pytest.approx(ate * 100, abs=0.006)
    assert int(shown.group(2)) == evaluation.ate.count
    for metric in evaluation.metrics:  # the metrics table lists every metric
        assert metric.name in text

    # the tile count shown is the number of GeoTIFF tiles in the version
    tiles = sorted((root / "grid").glob("*.tif"))
    assert tiles
    rows, cols = read_grid_tile(tiles[0]).tile.shape
    assert f"{len(tiles)} tiles of {rows} x {cols} cells of 5 cm" in text

    # the lanelet2 summary is what Lanelet2 reads from the version's map
    origin = json.loads((root / "state" / "origin.json").read_text())["origin"]
    lanelets = load_lanelet2(root / "lanelet2_map.osm", origin)
    assert len(lanelets.laneletLayer) >= 1
    assert (
        f"lanelet2 map: {len(lanelets.laneletLayer)} lanelets, "
        f"{len(lanelets.lineStringLayer)} line strings, "
        f"{len(lanelets.regulatoryElementLayer)} regulatory elements"
    ) in text

    # pictures: the report preview (the file's own bytes), the grid and the trajectory plots
    pngs = [o["data"]["image/png"] for o in _outputs(nb) if "image/png" in o.get("data", {})]
    assert len(pngs) >= 3
    preview = (root / "report" / "map_preview.png").read_bytes()
    assert any(base64.b64decode(p) == preview for p in pngs)
