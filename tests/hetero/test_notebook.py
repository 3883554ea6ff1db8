"""examples/hetero_kernels.ipynb runs top to bottom with this interpreter's kernel."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "examples" / "hetero_kernels.ipynb"

pytestmark = [pytest.mark.opencl, pytest.mark.spark]


def test_the_example_notebook_runs(shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The "python3" kernel is started with this interpreter (jupyter_client replaces a bare
    # `python` in the kernel spec by sys.executable), so it sees adcloud and the venv.
    monkeypatch.setenv("ADCLOUD_SHARED_DATA", str(shared_data))
    for key in [k for k in os.environ if k.startswith(("ADCLOUD_SPARK_", "PYSPARK_", "SPARK_"))]:
        monkeypatch.delenv(key)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=180,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    outputs = "".join(
        out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", [])
    )
    assert "kernels run on" in outputs
    assert "iterations" in outputs and "error" in outputs
    assert "cells of 10 cm" in outputs
    assert "partition 3" in outputs
