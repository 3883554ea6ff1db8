"""Model export: torch.export program + metadata, loading, inspection, corrupt files."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from rich.console import Console

import adcloud
from adcloud.train.errors import ExportError
from adcloud.train.export import (
    ExportedModel,
    data_manifest,
    export_model,
    inspect_model,
    inspection_table,
    load_exported,
    sha256_file,
)
from adcloud.train.lidar import NUM_CLASSES, LidarSegTask
from adcloud.train.task import ImageSample, PointCloudSample, Sample, get_task


def sweeps(sizes: list[int], seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    for n in sizes:
        pts = np.column_stack(
            [rng.normal(0, 15, (n, 2)), rng.normal(-1, 1, n), rng.uniform(0, 255, n)]
        ).astype(np.float32)
        out.append(PointCloudSample(0, pts, rng.integers(1, NUM_CLASSES, n).astype(np.uint8)))
    return out


def linear_conv_macs(model: torch.nn.Module, inputs: tuple[Any, ...]) -> int:
    """MACs of every Linear and Conv2d, counted from their output shapes by forward hooks."""
    total = 0

    def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(mod, torch.nn.Linear):
            total += out.numel() * mod.in_features
        elif isinstance(mod, torch.nn.Conv2d):
            kh, kw = mod.kernel_size
            total += out.numel() * (mod.in_channels // mod.groups) * kh * kw

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)
    ]
    with torch.no_grad():
        model(*inputs)
    for h in handles:
        h.remove()
    return total


@pytest.fixture(scope="module")
def lidar_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[ExportedModel, Any, Any]:
    task = get_task("lidar_seg")
    torch.manual_seed(0)
    model = task.build_model()
    bag = tmp_path_factory.mktemp("bags") / "a.bag"
    bag.write_bytes(b"not really a bag, but bytes to hash" * 100)
    meta = {
        "task": "lidar_seg",
        "config": {"steps": 3, "lr": 0.01},
        "data": {"train": data_manifest([bag])},
        "metrics": {"miou": 0.5, "accuracy": 0.75},
    }
    examples = task.example_inputs(sweeps([900, 700], seed=0))
    exported = export_model(
        model,
        examples,
        tmp_path_factory.mktemp("export") / "lidar",
        meta,
        dynamic_shapes=task.dynamic_shapes(),
        warmup=2,
        runs=12,
    )
    return exported, model, examples


def test_exported_lidar_program_matches_the_eager_model_on_other_point_counts(
    lidar_export: tuple[ExportedModel, Any, Any],
) -> None:
    exported, model, _ = lidar_export
    assert exported.program_path.is_file() and exported.metadata_path.is_file()
    program = torch.export.load(exported.program_path)
    task = LidarSegTask()
    for sizes in ([1234, 400, 77], [5000]):  # other sweep and point counts than the example
        batch = task._pad([s.points for s in sweeps(sizes, seed=len(sizes))])  # type: ignore[union-attr]
        with torch.no_grad():
            want = model(batch["points"], batch["valid"])
            got = program.module()(batch["points"], batch["valid"])
        assert got.shape == (len(sizes), max(sizes), NUM_CLASSES)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first", [[0, 0], [1], [0], [0, 1, 800]])
def test_a_drive_starting_with_empty_sweeps_exports_a_dynamic_program(
    first: list[int], tmp_path: Path
) -> None:
    # a LiDAR driver that publishes empty clouds while it spins up: the run's first sweeps
    # are what the export traces with, and a points dimension of 0 or 1 would be fixed
    task = LidarSegTask()
    torch.manual_seed(0)
    model = task.build_model()
    examples = task.example_inputs(sweeps(first, seed=1))
    assert examples[0].shape[1] >= 2 and examples[1].dtype == torch.bool
    exported = export_model(
        model, examples, tmp_path / "m", {}, dynamic_shapes=task.dynamic_shapes(), runs=1
    )
    batch = task._pad([s.points for s in sweeps([640, 77], seed=2)])  # type: ignore[union-attr]
    with torch.no_grad():
        want = model(batch["points"], batch["valid"])
        got = exported.load().module()(batch["points"], batch["valid"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_metadata_fields_are_present_and_sane(
    lidar_export: tuple[ExportedModel, Any, Any],
) -> None:
    exported, model, examples = lidar_export
    meta = json.loads(exported.metadata_path.read_text())
    assert meta == json.loads(json.dumps(exported.metadata))
    assert meta["format"] == "adcloud.train.export" and meta["version"] == 1
    assert meta["task"] == "lidar_seg" and meta["metrics"]["miou"] == 0.5
    assert meta["config"] == {"steps": 3, "lr": 0.01}
    (bag,) = meta["data"]["train"]
    assert bag["sha256"] == hashlib.sha256(Path(bag["uri"]).read_bytes()).hexdigest()
    assert meta["code"]["adcloud"] == adcloud.__version__
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", meta["code"]["git_commit"])
    m = meta["model"]
    assert m["class"] == "adcloud.train.lidar.PolarBevSegNet"
    assert m["parameters"] == sum(p.numel() for p in model.parameters())
    assert m["macs"] == linear_conv_macs(model, examples)
    assert m["flops"] == 2 * m["macs"]
    assert m["inputs"] == [
        {"shape": [2, 900, 4], "dtype": "float32"},
        {"shape": [2, 900], "dtype": "bool"},
    ]
    assert m["dynamic"]["points"]["1"]["name"] == "points"
    lat = meta["latency_ms"]
    assert 0 < lat["p50"] <= lat["p99"] < 60_000 and lat["runs"] == 12
    assert meta["runtime"]["device"] == "cpu" and meta["runtime"]["torch"] == torch.__version__
    program = meta["files"]["model.pt2"]
    assert program["sha256"] == sha256_file(exported.program_path)
    assert program["bytes"] == exported.program_path.stat().st_size


def test_inspect_and_render(lidar_export: tuple[ExportedModel, Any, Any]) -> None:
    exported, _, _ = lidar_export
    info = inspect_model(exported.directory)
    assert info["path"] == str(exported.directory)
    assert info["model"]["parameters"] == exported.metadata["model"]["parameters"]
    assert inspect_model(exported.metadata_path)["files"] == info["files"]
    console = Console(record=True, width=200)
    console.print(inspection_table(info))
    text = console.export_text()
    assert "PolarBevSegNet" in text and "p50" in text and "metric miou" in text
    assert f"{info['model']['parameters'] / 1e3:.2f} k" in text
    program, meta = load_exported(exported.directory)
    assert meta["version"] == 1 and isinstance(program, torch.export.ExportedProgram)


def _copy(exported: ExportedModel, dest: Path) -> Path:
    dest.mkdir()
    for name in ("model.pt2", "metadata.json"):
        (dest / name).write_bytes((exported.directory / name).read_bytes())
    return dest


def test_corrupt_metadata_is_refused_naming_the_file(
    lidar_export: tuple[ExportedModel, Any, Any], tmp_path: Path
) -> None:
    exported, _, _ = lidar_export
    d = _copy(exported, tmp_path / "m")
    meta_path = d / "metadata.json"
    meta_path.write_text(meta_path.read_text()[:-40])
    with pytest.raises(ExportError, match=re.escape(str(meta_path)) + ": corrupt JSON"):
        inspect_model(d)
    meta_path.write_text(json.dumps({"format": "adcloud.train.export", "version": 99}))
    with pytest.raises(ExportError, match="version 99 is not supported"):
        load_exported(d)
    meta_path.unlink()
    with pytest.raises(ExportError, match=re.escape(str(meta_path)) + ": not found"):
        inspect_model(d)


def test_corrupt_program_is_refused_naming_the_file(
    lidar_export: tuple[ExportedModel, Any, Any], tmp_path: Path
) -> None:
    exported, _, _ = lidar_export
    d = _copy(exported, tmp_path / "p")
    program = d / "model.pt2"
    raw = bytearray(program.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    program.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match=re.escape(str(program)) + ": corrupt"):
        inspect_model(d)
    # A program that is not a torch.export archive at all, with metadata that matches it.
    program.write_bytes(b"garbage" * 10)
    meta = json.loads((d / "metadata.json").read_text())
    meta["files"]["model.pt2"] = {"bytes": 70, "sha256": sha256_file(program)}
    (d / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=re.escape(str(program)) + ": torch.export.load failed"):
        load_exported(d)
    program.unlink()
    with pytest.raises(ExportError, match=r"model\.pt2: missing"):
        inspect_model(d)


def test_metadata_damaged_by_hand_is_named_or_shown_as_it_is(
    lidar_export: tuple[ExportedModel, Any, Any], tmp_path: Path
) -> None:
    """A metadata.json edited by hand (or by another tool): the program's entry that is no
    object is refused naming the field, not an AttributeError; fields the table shows that
    hold other types are shown as they are (nan, ?), not a ValueError or TypeError."""
    exported, _, _ = lidar_export
    d = _copy(exported, tmp_path / "m")
    meta_path = d / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for entry in ("?", None):
        meta_path.write_text(json.dumps({**meta, "files": {"model.pt2": entry}}))
        with pytest.raises(
            ExportError, match=re.escape(str(meta_path)) + r": field 'files\.model\.pt2'"
        ):
            inspect_model(d)
    odd = json.loads(json.dumps(meta))
    odd["model"].update(parameters="many", macs=None, inputs=[1, {"dtype": "uint8"}])
    odd["latency_ms"].update(p50=None, p99="fast", runs="50")
    odd["training"] = {"validation": ["?", {"step": 3, "miou": 0.5}]}
    meta_path.write_text(json.dumps(odd))
    console = Console(record=True, width=200)
    console.print(inspection_table(inspect_model(d)))
    text = console.export_text()
    assert "p50 nan, p99 nan (nan runs)" in text
    assert "?, uint8" in text and "held-out miou by step │ 3: 0.5" in text
    odd["model"]["inputs"] = "points"
    console.print(inspection_table({**odd, "path": str(d)}))
    assert "PolarBevSegNet" in console.export_text()


def test_bad_metadata_is_refused_before_writing(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    x = (torch.randn(2, 3),)
    with pytest.raises(ExportError, match="metadata key 'model' is written by export_model"):
        export_model(model, x, tmp_path / "a", {"model": "mine"})
    with pytest.raises(ExportError, match=r"metadata\.json: metadata is not plain JSON"):
        export_model(model, x, tmp_path / "b", {"metrics": {"miou": float("nan")}}, runs=1)
    assert not (tmp_path / "b" / "metadata.json").exists()
    assert model.training  # the mode is restored


def test_exported_camera_model_has_a_dynamic_batch(tmp_path: Path) -> None:
    task = get_task("camera_seg", {"channels": [8, 16]})
    torch.manual_seed(0)
    model = task.build_model()
    rng = np.random.default_rng(0)
    frames = [
        ImageSample(
            i, rng.integers(0, 256, (120, 160, 3), dtype=np.uint8), np.zeros((120, 160), np.uint8)
        )
        for i in range(2)
    ]
    exported = export_model(
        model,
        task.example_inputs(frames),
        tmp_path / "cam",
        {"task": "camera_seg"},
        dynamic_shapes=task.dynamic_shapes(),
        warmup=1,
        runs=3,
    )
    program, meta = load_exported(exported.directory)
    images = torch.rand(3, 3, 120, 160)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(images), model(images), rtol=1e-5, atol=1e-5)
    assert meta["model"]["macs"] == linear_conv_macs(model, (images[:2],))


def test_data_manifest_hashes_files_and_directories(tmp_path: Path) -> None:
    bag = tmp_path / "x.bag"
    bag.write_bytes(b"abc")
    ros2 = tmp_path / "ros2"
    (ros2 / "sub").mkdir(parents=True)
    (ros2 / "metadata.yaml").write_text("a: 1\n")
    (ros2 / "sub" / "d.db3").write_bytes(b"\x00" * 10)
    first = data_manifest([bag, f"file://{ros2}"])
    assert first[0] == {
        "uri": str(bag),
        "sha256": hashlib.sha256(b"abc").hexdigest(),
        "bytes": 3,
        "files": 1,
    }
    assert first[1]["files"] == 2 and first[1]["bytes"] == 15
    assert data_manifest([f"file://{ros2}"])[0] == first[1]
    (ros2 / "sub" / "d.db3").write_bytes(b"\x01" * 10)
    assert data_manifest([ros2])[0]["sha256"] != first[1]["sha256"]
    with pytest.raises(ExportError, match=r"nope\.bag: no such bag"):
        data_manifest([tmp_path / "nope.bag"])
    # any fsspec URL: a bag in memory:// is read through fsspec
    with fsspec.open("memory://manifest-test/m.bag", "wb") as fh:
        fh.write(b"xyz" * 1000)
    (remote,) = data_manifest(["memory://manifest-test/m.bag"])
    assert remote["sha256"] == hashlib.sha256(b"xyz" * 1000).hexdigest()
    assert (remote["bytes"], remote["files"]) == (3000, 1)


def test_a_model_url_that_cannot_be_reached_is_named() -> None:
    """A server that is down: an ExportError naming the URL, not aiohttp's traceback."""
    with pytest.raises(
        ExportError,
        match=r"http://127.0.0.1:1/model/metadata.json: cannot read it \(.*\); check that the "
        "server or store is up",
    ):
        inspect_model("http://127.0.0.1:1/model")
    with pytest.raises(ExportError, match=r"nosuch://m/model: cannot open the model's location"):
        inspect_model("nosuch://m/model")


def test_an_unbounded_dim_exports_with_no_max(tmp_path: Path) -> None:
    # Dim("n") without max carries torch's int_oo, which JSON cannot hold: the export failed
    # blaming the caller's metadata, and left model.pt2 without metadata.json
    model = torch.nn.Linear(4, 2)
    exported = export_model(
        model,
        (torch.randn(3, 4),),
        tmp_path / "a model",
        {"task": "x"},
        dynamic_shapes=({0: torch.export.Dim("n")},),
        warmup=0,
        runs=1,
    )
    dim = exported.metadata["model"]["dynamic"][0]["0"]
    assert dim == {"name": "n", "min": 0, "max": None}
    assert json.loads(exported.metadata_path.read_text())["model"]["dynamic"][0]["0"] == dim
    program, _ = load_exported(tmp_path / "a model")
    assert program.module()(torch.randn(7, 4)).shape == (7, 2)


def test_metadata_that_is_no_json_leaves_an_earlier_export_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "model"
    first = export_model(torch.nn.Linear(4, 2), (torch.randn(2, 4),), out, {}, warmup=0, runs=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ExportError, match=r"metadata.json: metadata is not plain JSON"):
        export_model(
            torch.nn.Linear(4, 3),
            (torch.randn(2, 4),),
            out,
            {"metrics": {"miou": float("nan")}},
            warmup=0,
            runs=1,
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    load_exported(first.directory)  # still intact
    with pytest.raises(ExportError, match=r"not plain JSON"):
        export_model(
            torch.nn.Linear(4, 2),
            (torch.randn(2, 4),),
            tmp_path / "new",
            {"loss": float("inf")},
            warmup=0,
            runs=1,
        )
    assert not (tmp_path / "new").exists()


def test_a_failed_write_leaves_no_partial_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model"
    export_model(torch.nn.Linear(4, 2), (torch.randn(2, 4),), out, {}, warmup=0, runs=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(self: Path, *args: Any, **kwargs: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", fail)
    with pytest.raises(ExportError, match=r"metadata.json: cannot write the metadata"):
        export_model(torch.nn.Linear(4, 3), (torch.randn(2, 4),), out, {}, warmup=0, runs=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
