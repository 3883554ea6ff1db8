"""How the build's stages hand their intermediates to each other.

In ``memory`` mode (the default) a stage's output RDD is cached in executor memory and
the next stage reads it there: the whole build is one Spark application whose stages never
touch a disk. In ``files`` mode every intermediate is written out, fsync'ed, and read back
by the next stage -- what the same pipeline costs as separate jobs exchanging files
through an under-store; the benchmark compares the two.

Files hold no pickle: every item is written as a ``.npz`` of its arrays plus a JSON tree
of its structure (dataclasses by class path, tuples, lists, dicts, numbers, strings); only
classes under ``adcloud.`` are rebuilt on load.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import os
import shutil
import uuid
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pyspark import RDD, StorageLevel

from adcloud.hdmap.errors import MapFormatError

__all__ = ["Exchange", "dump_items", "load_items"]

_FORMAT = "adcloud-hdmap-exchange/1"


def _encode(obj: Any, arrays: list[np.ndarray[Any, Any]]) -> Any:
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return {"@nd": len(arrays) - 1}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        fields = {f.name: _encode(getattr(obj, f.name), arrays) for f in dataclasses.fields(obj)}
        return {"@dc": f"{cls.__module__}:{cls.__qualname__}", "f": fields}
    if isinstance(obj, tuple):
        return {"@t": [_encode(v, arrays) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, arrays) for v in obj]
    if isinstance(obj, dict):
        return {"@d": [[_encode(k, arrays), _encode(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in an exchange file")


def _class(path: str) -> Any:
    module, _, name = path.partition(":")
    if not module.startswith("adcloud."):
        raise MapFormatError(f"exchange file names class {path!r} outside adcloud")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _decode(tree: Any, arrays: Any) -> Any:
    if isinstance(tree, list):
        return [_decode(v, arrays) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "@nd" in tree:
        return arrays[f"a{tree['@nd']}"]
    if "@dc" in tree:
        fields = {k: _decode(v, arrays) for k, v in tree["f"].items()}
        return _class(tree["@dc"])(**fields)
    if "@t" in tree:
        return tuple(_decode(v, arrays) for v in tree["@t"])
    return {_decode(k, arrays): _decode(v, arrays) for k, v in tree["@d"]}


def dump_items(items: Iterable[Any], path: str | os.PathLike[str]) -> int:
    """Write ``items`` to one ``.npz`` file (atomically, fsync'ed); returns the count."""
    arrays: list[np.ndarray[Any, Any]] = []
    tree = [_encode(item, arrays) for item in items]
    header = json.dumps({"format": _FORMAT, "items": tree})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    buf = io.BytesIO()
    named: dict[str, Any] = {f"a{i}": a for i, a in enumerate(arrays)}
    named["header"] = np.frombuffer(header.encode(), np.uint8)
    np.savez(buf, **named)
    with tmp.open("wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return len(tree)


def load_items(path: str | os.PathLike[str]) -> list[Any]:
    """The items :func:`dump_items` wrote to ``path``."""
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            if header.get("format") != _FORMAT:
                raise MapFormatError(f"{path}: not an exchange file ({header.get('format')!r})")
            arrays = {k: z[k] for k in z.files if k != "header"}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise MapFormatError(f"{path}: cannot read exchange file: {err}") from err
    return [_decode(item, arrays) for item in header["items"]]


def _write_partition(
    index: int, items: Iterable[Any], root: str, gather: Callable[[Any], Iterable[Any]] | None
) -> Iterator[tuple[str, list[Any]]]:
    path = Path(root) / f"part-{index:05d}.npz"
    gathered: list[Any] = []

    def noting() -> Iterator[Any]:
        for item in items:
            if gather is not None:
                gathered.extend(gather(item))
            yield item

    dump_items(noting(), path)
    yield str(path), gathered


class Exchange:
    """Hands RDDs from one stage to the next (see the module docstring)."""

    def __init__(self, mode: str, root: str | os.PathLike[str] | None = None) -> None:
        if mode not in ("memory", "files"):
            raise ValueError(f"exchange mode {mode!r} is not memory or files")
        if mode == "files" and not root:
            raise ValueError("files mode needs a directory to exchange files in")
        self.mode = mode
        self.root = Path(root) if root else None
        self.cached: list[RDD[Any]] = []
        self.bytes_written = 0
        # files mode: the stage folders this exchange made, and the files it wrote into
        # folders that were there before (those folders may hold someone else's files)
        self._made: list[Path] = []
        self._written: list[Path] = []

    def hand_over(self, rdd: RDD[Any], name: str) -> RDD[Any]:
        """Materialise ``rdd`` as stage ``name``'s output and return what the next stage reads."""
        return self.hand_over_gathering(rdd, name, None)[0]

    def hand_over_gathering(
        self, rdd: RDD[Any], name: str, gather: Callable[[Any], Iterable[Any]] | None
    ) -> tuple[RDD[Any], list[Any]]:
        """:meth:`hand_over`, and what ``gather`` returns for each item of ``rdd`` (small
        things: a drive's low-rate streams beside its sweeps, a sweep's sign candidates),
        collected on the driver by the job that materialises the stage rather than by
        another pass over its output."""
        if self.mode == "memory":
            rdd = rdd.persist(StorageLevel.MEMORY_AND_DISK)
            # the stage runs now, as it would when its files were written
            gathered: list[Any] = []
            if gather is None:
                rdd.count()
            else:
                gathered = rdd.flatMap(gather).collect()
            self.cached.append(rdd)
            return rdd, gathered
        assert self.root is not None
        folder = self.root / name
        if not folder.is_dir():
            folder.mkdir(parents=True)
            self._made.append(folder)
        root = str(folder)
        written = rdd.mapPartitionsWithIndex(
            lambda i, it: _write_partition(i, it, root, gather)
        ).collect()
        paths = [path for path, _ in written]
        if folder not in self._made:
            self._written.extend(Path(p) for p in paths)
        self.bytes_written += sum(Path(p).stat().st_size for p in paths)
        context = rdd.context
        loaded = context.parallelize(paths, max(1, len(paths))).flatMap(load_items)
        return loaded, [item for _, items in written for item in items]

    def drop(self, rdd: RDD[Any]) -> None:
        """Free what memory mode cached for ``rdd`` once no later stage reads it: on a small
        executor the next stage's shuffle needs that heap (files mode keeps its files)."""
        if rdd in self.cached:
            self.cached.remove(rdd)
            rdd.unpersist()

    def release(self) -> None:
        """Drop what memory mode cached and delete what files mode wrote: the stage folders
        it made under the root (never the root itself), or its files in folders it found.
        Call it once no RDD it handed over is read any more."""
        for rdd in self.cached:
            rdd.unpersist()
        self.cached.clear()
        for folder in self._made:
            shutil.rmtree(folder, ignore_errors=True)
        for path in self._written:
            path.unlink(missing_ok=True)
        self._made.clear()
        self._written.clear()
