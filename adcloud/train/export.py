"""Exported models: a ``torch.export`` program with the metadata that says what it is.

:func:`export_model` writes a directory with two files:

- ``model.pt2`` -- the model as a :class:`torch.export.ExportedProgram`
  (:func:`torch.export.save`; load it with :func:`load_exported` or :func:`torch.export.load`);
  input dimensions declared dynamic (e.g. the number of LiDAR points) stay variable;
- ``metadata.json`` -- a JSON object, format ``adcloud.train.export`` version 1 (below).

``metadata.json``, version 1 (keys in this order; the caller's keys first):

- what the caller passes in ``metadata``: by convention ``task``, ``config`` (the effective
  training config), ``data`` (the :func:`data_manifest` of the training and held-out bags) and
  ``metrics`` (held-out scores); any other JSON values are kept as given;
- ``format`` (``"adcloud.train.export"``) and ``version`` (1);
- ``code``: ``adcloud`` version and ``git_commit`` of the checkout (``"unknown"`` outside a git
  checkout);
- ``model``: the module's class, ``parameters`` (count), ``macs`` and ``flops`` of one forward
  pass on the example inputs (matrix products and convolutions, as
  :class:`torch.utils.flop_counter.FlopCounterMode` counts them; MACs = FLOPs / 2), the example
  ``inputs`` (shape, dtype) and the ``dynamic`` dimensions;
- ``latency_ms``: ``p50``, ``p99``, ``mean`` of the exported program on the example inputs,
  measured after ``warmup`` untimed runs over ``runs`` timed ones;
- ``runtime``: ``device`` (and its name), ``torch`` version, ``python`` version, CPU ``threads``;
- ``files``: ``model.pt2`` size and SHA-256 (checked by :func:`inspect_model`).

History: version 1 -- first version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import posixpath
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
from rich.table import Table
from torch.utils.flop_counter import FlopCounterMode

import adcloud
from adcloud._scratch import scratch_dir
from adcloud.train.errors import ExportError

__all__ = [
    "FORMAT",
    "METADATA_FILE",
    "PROGRAM_FILE",
    "VERSION",
    "ExportedModel",
    "code_version",
    "count_macs",
    "data_manifest",
    "export_model",
    "inspect_model",
    "inspection_table",
    "load_exported",
    "local_model",
    "measure_latency",
    "model_location",
    "sha256_file",
]

_log = logging.getLogger(__name__)

FORMAT = "adcloud.train.export"
VERSION = 1
PROGRAM_FILE = "model.pt2"
METADATA_FILE = "metadata.json"
_CHUNK = 1 << 20
_RESERVED = ("format", "version", "code", "model", "latency_ms", "runtime", "files")


@dataclass(frozen=True)
class ExportedModel:
    """An exported model directory: ``model.pt2`` and ``metadata.json`` (see the module)."""

    directory: Path
    metadata: Mapping[str, Any]

    @property
    def program_path(self) -> Path:
        """``<directory>/model.pt2``."""
        return self.directory / PROGRAM_FILE

    @property
    def metadata_path(self) -> Path:
        """``<directory>/metadata.json``."""
        return self.directory / METADATA_FILE

    def load(self) -> torch.export.ExportedProgram:
        """The exported program (call ``.module()`` on it to run it)."""
        return load_exported(self.directory)[0]


def sha256_file(path: str | os.PathLike[str], fs: Any = None) -> str:
    """Hex SHA-256 of the file at ``path`` (read in 1 MiB pieces), on filesystem ``fs``
    (an fsspec filesystem; the local one when None)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") if fs is None else fs.open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def data_manifest(bags: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """``[{"uri", "sha256", "bytes", "files"}]`` of every bag, in the given order.

    A bag is a file (ROS 1 ``.bag``, MCAP) or a directory (rosbag2: ``metadata.yaml`` and
    storage files); a directory's hash covers its files' relative paths and contents in
    sorted order.  Local paths and any fsspec URL (remote bags are read once more to hash
    them); raises :class:`ExportError` naming a missing bag.
    """
    out = []
    for bag in bags:
        uri = os.fspath(bag)
        fs, path = fsspec.core.url_to_fs(uri)
        if fs.isfile(path):
            out.append(
                {"uri": uri, "sha256": sha256_file(path, fs), "bytes": fs.size(path), "files": 1}
            )
        elif fs.isdir(path):
            digest = hashlib.sha256()
            size = count = 0
            root = path.rstrip("/")
            for member in sorted(fs.find(path)):
                rel = posixpath.relpath(member, root)
                digest.update(rel.encode() + b"\0" + bytes.fromhex(sha256_file(member, fs)))
                size += fs.size(member)
                count += 1
            out.append({"uri": uri, "sha256": digest.hexdigest(), "bytes": size, "files": count})
        else:
            raise ExportError(f"{uri}: no such bag file or directory to list in the data manifest")
    return out


def code_version() -> dict[str, str]:
    """``{"adcloud": version, "git_commit": sha or "unknown"}`` of the running code."""
    root = Path(adcloud.__file__).resolve().parent.parent
    commit = "unknown"
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],  # a read-only query
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if done.returncode == 0 and done.stdout.strip():
            commit = done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"adcloud": adcloud.__version__, "git_commit": commit}


def count_macs(model: torch.nn.Module, example_inputs: Sequence[Any]) -> int:
    """Multiply-accumulates of one forward pass (FLOPs / 2, as ``FlopCounterMode`` counts
    matrix products and convolutions; gathers, scatters and elementwise ops are not counted)."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*example_inputs)
    return int(counter.get_total_flops()) // 2


def measure_latency(
    fn: Any, inputs: Sequence[Any], *, warmup: int = 5, runs: int = 50
) -> dict[str, float]:
    """``p50``, ``p99``, ``mean`` wall time (ms) of ``fn(*inputs)`` over ``runs`` calls after
    ``warmup`` untimed ones; CUDA work is synchronized before each clock read."""
    if runs < 1 or warmup < 0:
        raise ExportError(f"latency needs runs >= 1 and warmup >= 0, not {runs} and {warmup}")
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
    times = []
    with torch.no_grad():
        for i in range(warmup + runs):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn(*inputs)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
    arr = np.asarray(times)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "mean": float(arr.mean()),
        "runs": float(runs),
        "warmup": float(warmup),
    }


def _describe(x: Any) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
    return {"type": type(x).__name__}


def _dynamic(spec: Any) -> Any:
    """``dynamic_shapes`` as JSON: each Dim as ``{"name", "min", "max"}``."""
    if isinstance(spec, Mapping):
        return {str(k): _dynamic(v) for k, v in spec.items()}
    if isinstance(spec, list | tuple):
        return [_dynamic(v) for v in spec]
    if spec is None:
        return None
    name = getattr(spec, "__name__", str(spec))
    return {
        "name": name,
        "min": _bound(getattr(spec, "min", None)),
        "max": _bound(getattr(spec, "max", None)),
    }


def _bound(value: Any) -> int | None:
    """A Dim's bound as a JSON number; None where it has none: ``Dim("n")`` without ``max``
    carries torch's own infinity (``int_oo``, a sympy number JSON cannot hold)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) else None


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def export_model(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    out_dir: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    *,
    dynamic_shapes: Any = None,
    warmup: int = 5,
    runs: int = 50,
) -> ExportedModel:
    """Export ``model`` with :func:`torch.export.export` and write ``out_dir`` (see the module).

    ``example_inputs`` are positional inputs on the model's device; ``dynamic_shapes`` declares
    the dimensions that vary (``Task.dynamic_shapes()``). ``metadata`` holds the caller's JSON
    values (``task``, ``config``, ``data``, ``metrics``...). The model is exported and measured
    in evaluation mode and its mode is restored afterwards. Raises :class:`ExportError` when the
    model cannot be exported, a metadata value is not JSON, or a file cannot be written.
    """
    clash = [k for k in metadata if k in _RESERVED]
    if clash:
        raise ExportError(
            f"metadata key {clash[0]!r} is written by export_model itself; "
            f"rename it (reserved: {', '.join(_RESERVED)})"
        )
    directory = Path(out_dir)
    # the caller's values are checked before the (slow) export, and before anything is
    # written: a NaN metric found after model.pt2 was written left a directory without
    # metadata.json (or a new program beside an older export's metadata)
    try:
        json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ExportError(
            f"{directory / METADATA_FILE}: metadata is not plain JSON ({err}); pass numbers, "
            "strings, lists and dicts (NaN is not allowed: write null for a missing score)"
        ) from err
    was_training = model.training
    model.eval()
    try:
        try:
            program = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
        except Exception as err:
            raise ExportError(
                f"torch.export cannot export {type(model).__name__}: {err} "
                "(check dynamic_shapes against the example inputs)"
            ) from err
        macs = count_macs(model, example_inputs)
        params = sum(p.numel() for p in model.parameters())
        latency = measure_latency(program.module(), example_inputs, warmup=warmup, runs=runs)
        device = _device_of(model)
    finally:
        model.train(was_training)

    program_path = directory / PROGRAM_FILE
    meta_path = directory / METADATA_FILE
    # Both files are written beside their final names and renamed into place once both are
    # complete: an export that fails half-way leaves an earlier export in out_dir as it was.
    program_tmp = directory / f".partial-{PROGRAM_FILE}"  # torch.export.save wants .pt2
    meta_tmp = directory / f".partial-{METADATA_FILE}"
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            torch.export.save(program, program_tmp)
        except (OSError, RuntimeError) as err:
            raise ExportError(f"{program_path}: cannot write the program: {err}") from err

        runtime = {
            "device": str(device),
            "device_name": (
                torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor()
            ),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
        }
        meta: dict[str, Any] = {
            **metadata,
            "format": FORMAT,
            "version": VERSION,
            "code": code_version(),
            "model": {
                "class": f"{type(model).__module__}.{type(model).__qualname__}",
                "parameters": int(params),
                "macs": int(macs),
                "flops": int(2 * macs),
                "inputs": [_describe(x) for x in example_inputs],
                "dynamic": _dynamic(dynamic_shapes),
            },
            "latency_ms": latency,
            "runtime": runtime,
            "files": {
                PROGRAM_FILE: {
                    "bytes": program_tmp.stat().st_size,
                    "sha256": sha256_file(program_tmp),
                }
            },
        }
        try:
            text = json.dumps(meta, indent=2, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ExportError(
                f"{meta_path}: metadata is not plain JSON ({err}); pass numbers, strings, "
                "lists and dicts (NaN is not allowed)"
            ) from err
        try:
            meta_tmp.write_text(text + "\n", encoding="utf-8")
            program_tmp.replace(program_path)
            meta_tmp.replace(meta_path)
        except OSError as err:
            raise ExportError(f"{meta_path}: cannot write the metadata: {err}") from err
    finally:
        for tmp in (program_tmp, meta_tmp):
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    _log.info(
        "exported %s to %s: %d parameters, %.1f MMACs, p50 %.2f ms",
        type(model).__name__,
        directory,
        params,
        macs / 1e6,
        latency["p50"],
    )
    return ExportedModel(directory, meta)


def _directory(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.parent if p.name in (PROGRAM_FILE, METADATA_FILE) else p


def _read_metadata(directory: Path) -> dict[str, Any]:
    meta_path = directory / METADATA_FILE
    try:
        text = meta_path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise ExportError(
            f"{meta_path}: not found; is {directory} a directory written by export_model?"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ExportError(f"{meta_path}: cannot read: {err}") from err
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise ExportError(
            f"{meta_path}: corrupt JSON at line {err.lineno} column {err.colno}: {err.msg}; "
            "export the model again"
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ExportError(f"{meta_path}: not an {FORMAT} metadata file (no matching 'format')")
    if meta.get("version") != VERSION:
        raise ExportError(
            f"{meta_path}: format version {meta.get('version')!r} is not supported "
            f"(this adcloud reads version {VERSION})"
        )
    for key in ("model", "latency_ms", "runtime", "files", "code"):
        if not isinstance(meta.get(key), dict):
            raise ExportError(f"{meta_path}: field {key!r} is missing or not an object")
    if not isinstance(meta["files"].get(PROGRAM_FILE), dict):
        raise ExportError(
            f"{meta_path}: field 'files.{PROGRAM_FILE}' (its size and SHA-256) is missing or "
            "not an object; export the model again"
        )
    return meta


def _check_program(directory: Path, meta: Mapping[str, Any]) -> None:
    program_path = directory / PROGRAM_FILE
    entry = meta["files"].get(PROGRAM_FILE, {})
    if not program_path.is_file():
        raise ExportError(f"{program_path}: missing (metadata.json lists it)")
    size = program_path.stat().st_size
    if entry.get("bytes") != size or entry.get("sha256") != sha256_file(program_path):
        raise ExportError(
            f"{program_path}: corrupt: size/SHA-256 differ from {directory / METADATA_FILE} "
            f"({size} bytes, expected {entry.get('bytes')}); export the model again"
        )


def _url_directory(url: str) -> str:
    """The URL of the export directory that ``url`` (it, or one of its files) names."""
    where = url.rstrip("/")
    if posixpath.basename(where) in (PROGRAM_FILE, METADATA_FILE):
        where = posixpath.dirname(where)
    return where


def model_location(path: str | os.PathLike[str]) -> str:
    """Where the export that ``path`` names lives, as people should see it: its local
    directory, or the URL of its directory."""
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        return str(_directory(text.removeprefix("file://")))
    return _url_directory(text)


@contextlib.contextmanager
def local_model(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A local directory holding the export at ``path``: a directory or one of its two
    files, local or at an fsspec URL (``s3://``, ``memory://``...), whose two files are then
    downloaded into a temporary directory that goes away with the context."""
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        yield _directory(text.removeprefix("file://"))
        return
    where = _url_directory(text)
    try:
        fs, root = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as err:  # an unknown protocol, a missing fsspec backend
        raise ExportError(f"{where}: cannot open the model's location: {err}") from err
    if posixpath.basename(root) in (PROGRAM_FILE, METADATA_FILE):
        root = posixpath.dirname(root)
    with scratch_dir("adcloud-model-") as tmp:
        for name in (METADATA_FILE, PROGRAM_FILE):
            try:
                fs.get_file(posixpath.join(root, name), str(tmp / name))
            except FileNotFoundError as err:
                raise ExportError(
                    f"{where}/{name}: not found; is {where} a directory written by "
                    "export_model (a run's model/)?"
                ) from err
            except Exception as err:  # the backend's own: aiohttp's, botocore's, OSError
                raise ExportError(
                    f"{where}/{name}: cannot read it ({type(err).__name__}: {err}); check "
                    "that the server or store is up and the URL is right"
                ) from err
        try:
            yield tmp
        except ExportError as err:  # name the model where it lives, not the download
            raise ExportError(str(err).replace(str(tmp), where)) from err


def load_exported(
    path: str | os.PathLike[str],
) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """``(program, metadata)`` of an export directory (or of its ``model.pt2`` /
    ``metadata.json``; local or an fsspec URL), after checking the program's size and
    SHA-256 against the metadata.

    Raises :class:`ExportError` naming the file that is missing or corrupt.
    """
    with local_model(path) as directory:
        meta = _read_metadata(directory)
        _check_program(directory, meta)
        program_path = directory / PROGRAM_FILE
        try:
            program = torch.export.load(program_path)
        except Exception as err:
            raise ExportError(f"{program_path}: torch.export.load failed: {err}") from err
    return program, meta


def inspect_model(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of an exported model (see the module; local or at an fsspec URL), with
    the program file checked against it; adds ``path`` (the directory). Raises
    :class:`ExportError` naming a missing or corrupt file. Does not load the program (that
    is :func:`load_exported`)."""
    with local_model(path) as directory:
        meta = _read_metadata(directory)
        _check_program(directory, meta)
    return {"path": model_location(path), **meta}


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g}"


def _number(value: Any) -> float:
    """``value`` as a float, NaN where it is no number (a metadata.json edited by hand, or
    written by another tool): the table shows what is there instead of failing on it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return float("nan")
    return float(value)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _manifest_rows(data: Any) -> list[tuple[str, str]]:
    """``data`` is a manifest list or a mapping of role (``train``, ``heldout``) to lists."""
    groups = data.items() if isinstance(data, Mapping) else [("", data)]
    rows = []
    for role, bags in groups:
        for bag in bags if isinstance(bags, list) else []:
            if isinstance(bag, Mapping):
                label = f"data {role}".strip()
                rows.append((label, f"{bag.get('uri')} sha256 {str(bag.get('sha256', ''))[:16]}"))
    return rows


def inspection_table(info: Mapping[str, Any]) -> Table:
    """A rich table of :func:`inspect_model`'s result, for people (``adcloud train inspect``)."""
    table = Table(title=f"exported model {info.get('path', '')}")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    model, latency, runtime, code = (
        value if isinstance(value := info.get(key), Mapping) else {}
        for key in ("model", "latency_ms", "runtime", "code")
    )
    rows: list[tuple[str, str]] = []
    if "task" in info:
        rows.append(("task", _short(info["task"])))
    listed = model.get("inputs")
    inputs = ", ".join(
        f"{i.get('dtype', '?')}{i.get('shape', '')}" if isinstance(i, Mapping) else "?"
        for i in (listed if isinstance(listed, list) else [])
    )
    rows += [
        ("model", str(model.get("class", "?"))),
        ("parameters", _si(_number(model.get("parameters")))),
        ("MACs / forward", _si(_number(model.get("macs")))),
        ("inputs", inputs),
        (
            "latency (ms)",
            f"p50 {_number(latency.get('p50')):.3f}, p99 {_number(latency.get('p99')):.3f}"
            f" ({_number(latency.get('runs')):.0f} runs)",
        ),
        ("device", f"{runtime.get('device', '?')} {runtime.get('device_name', '')}".strip()),
        ("torch", str(runtime.get("torch", "?"))),
        ("code", f"adcloud {code.get('adcloud', '?')}, commit {code.get('git_commit', '?')}"),
    ]
    metrics = info.get("metrics", {})
    if isinstance(metrics, Mapping):
        rows += [(f"metric {k}", _short(v)) for k, v in sorted(metrics.items())]
    training = info.get("training", {})
    curve = training.get("validation") if isinstance(training, Mapping) else None
    points = [v for v in curve if isinstance(v, Mapping)] if isinstance(curve, list) else []
    if points:
        name = "miou" if "miou" in points[-1] else next((k for k in points[-1] if k != "step"), "")
        rows.append(
            (
                f"held-out {name} by step",
                "  ".join(f"{v.get('step')}: {_short(v.get(name))}" for v in points),
            )
        )
    rows += _manifest_rows(info.get("data", []))
    if "config" in info:
        rows.append(("config", _short(info["config"])))
    for name, value in rows:
        table.add_row(name, value)
    return table
