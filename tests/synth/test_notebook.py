"""The example notebook runs top to bottom (with the test interpreter's kernel)."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "synth_drive.ipynb"


def test_synth_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "examples"  # not there yet: the notebook makes it, as the others do
    monkeypatch.setenv("ADCLOUD_EXAMPLE_OUT", str(out))
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    # jupyter_client starts the "python3" kernel with sys.executable: this venv's Python
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert (out / "drive.bag").exists()
    assert (out / "drive.bag.truth" / "map.geojson").exists()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "median intensity: paint" in text
