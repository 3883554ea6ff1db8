"""examples/train_lidar.ipynb runs top to bottom with this interpreter's kernel, and what it
shows agrees with the run's outputs on disk."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import nbclient
import nbformat
import pytest
from rosbags.rosbag1 import Reader

from adcloud.train.export import inspect_model

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "train_lidar.ipynb"

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


def test_train_notebook_trains_exports_and_runs_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADCLOUD_EXAMPLE_OUT", str(tmp_path))
    # The notebook starts its own local[2] session and sets its own training config; settings
    # from the environment must not change either.
    prefixes = ("ADCLOUD_SPARK_", "ADCLOUD_TRAIN_", "PYSPARK_", "SPARK_")
    for key in [k for k in os.environ if k.startswith(prefixes)]:
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

    # the run's own record: all steps on two all-reduce trainers, a falling loss
    run = json.loads((tmp_path / "train_run" / "result.json").read_text())
    # the name the notebook shows is the run's real one (its data identity included)
    assert re.search(r"run: lidar_seg-[0-9a-f]{12}\n", text)
    assert f"run: {run['run']}\n" in text
    assert (run["steps"], run["world"], run["mode"]) == (80, 2, "allreduce")
    losses = run["losses"]
    assert len(losses) == 80 and losses[-1] < 0.5 * losses[0]
    assert f"80 steps on 2 trainers (allreduce): loss {losses[0]:.3f} -> {losses[-1]:.3f}" in text

    # the validation curve: the held-out drive scored every 20 steps, ending with the final
    # scores, and shown as recorded
    curve = run["validation"]
    assert [v["step"] for v in curve] == [20, 40, 60, 80]
    assert curve[-1]["miou"] == pytest.approx(run["metrics"]["miou"])
    assert curve[-1]["miou"] > curve[0]["miou"]
    shown_curve = ", ".join(f"step {v['step']}: {v['miou']:.3f}" for v in curve)
    assert f"validation: {shown_curve}" in text

    # the held-out score shown is the recorded one, and the short run already learned
    miou = run["metrics"]["miou"]
    assert miou > 0.5
    assert f"held-out mIoU: {miou:.3f}" in text
    assert f"{run['metrics']['iou_road']:.3f}" in text  # the per-class table

    # the exported model's metadata as the notebook showed it
    info = inspect_model(tmp_path / "train_run" / "model")
    assert info["metrics"]["miou"] == pytest.approx(miou)
    assert f"{info['model']['parameters']:,} parameters" in text
    assert "exported model" in text and "latency (ms)" in text  # the inspection table

    # the exported program labels a held-out sweep as the eager model does, and mostly right
    shown = re.search(
        r"(\d+) held-out sweeps; sweep of [\d,]+ points: accuracy ([0-9.]+), "
        r"agreement with the eager model ([0-9.]+)",
        text,
    )
    assert shown, text
    with Reader(tmp_path / "heldout_drive.bag") as bag:  # one sample per recorded sweep
        sweeps = sum(c.msgcount for c in bag.connections if c.topic == "/lidar/points")
    assert sweeps > 0 and int(shown.group(1)) == sweeps
    assert float(shown.group(2)) > 0.7
    assert float(shown.group(3)) >= 0.99

    # the run wrote its held-out scores; the notebook scored the model on both drives
    heldout = json.loads((tmp_path / "train_run" / "eval.json").read_text())
    assert heldout["scores"]["miou"] == pytest.approx(miou)
    assert (tmp_path / "train_run" / "confusion.png").stat().st_size > 1000
    both = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert both["bags"][0]["samples"] == sweeps
    assert both["bags"][0]["scores"]["miou"] == pytest.approx(miou, abs=2e-3)
    assert f"mIoU {both['scores']['miou']:.3f} over both drives" in text
    assert "all bags" in text  # the scores table

    # pictures: the loss curve, the two labelled sweeps and the confusion matrix
    pngs = [o for o in _outputs(nb) if "image/png" in o.get("data", {})]
    assert len(pngs) >= 3
