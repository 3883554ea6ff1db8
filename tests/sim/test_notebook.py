"""The replay example notebook runs top to bottom (with the test interpreter's kernel)."""

from __future__ import annotations

import json
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "sim_replay.ipynb"


@pytest.mark.spark
def test_sim_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADCLOUD_EXAMPLE_OUT", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    # jupyter_client starts the "python3" kernel with sys.executable: this venv's Python;
    # the notebook starts its own SparkSession in that kernel process.
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "all passed: True" in text
    lines = (tmp_path / "replay_report" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["passed"] for line in lines)
