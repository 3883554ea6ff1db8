"""Dispatching kernels from Spark tasks: :func:`map_partitions`.

Each task gathers its partition into one NumPy array, opens the device Spark assigned to it
(``TaskContext.resources()``, by address; see :mod:`adcloud.hetero.devices`) or the one the
policy picks, runs the kernel there and yields NumPy results.  Nothing OpenCL crosses the
closure: it carries the kernel (a picklable function, e.g. a :func:`functools.partial` of
:func:`~adcloud.hetero.transform.transform_points`) and the frozen
:class:`~adcloud.hetero.devices.HeteroSettings`; contexts and programs are made in the
executor's Python worker and cached there.

Partition elements may be NumPy arrays of two or more dimensions (blocks of rows: one
element is used without a copy, several are concatenated along axis 0), Arrow record batches
or tables (a single fixed-size-list column such as ``xyz: fixed_size_list<float, 3>``
becomes an (N, 3) view without a copy; otherwise the selected columns are stacked), or
single rows: a 1-D NumPy array, a tuple or a list of numbers is one row, so
``sc.parallelize(cloud)`` of an (N, 3) ``cloud`` (whose elements are its 1-D rows) gives
(n, 3) partitions, as ``sc.parallelize(cloud.tolist())`` does.  Blocks and rows may be mixed
in one partition; their dtypes are promoted as :func:`numpy.concatenate` does.  Scalars
(one number per element) give a 1-D array.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.devices import ComputeDevice, HeteroSettings, select_device, spark_assignment
from adcloud.hetero.errors import HeteroError

if TYPE_CHECKING:
    from pyspark import RDD

__all__ = ["PartitionResult", "map_partitions", "partition_array"]

Kernel = Callable[..., Any]
"""``kernel(array, device=device)``: NumPy in, anything picklable (usually NumPy) out."""


class PartitionResult(NamedTuple):
    """What one task did, with ``map_partitions(..., with_info=True)``.

    ``address``/``device_name``: the device the kernel ran on; ``resource`` and
    ``assigned``: the Spark resource and the addresses Spark gave the task (empty outside
    resource scheduling); ``pid``: the Python worker; ``rows``: input rows; ``seconds``:
    device selection plus kernel time; ``value``: the kernel's result.
    """

    partition: int
    address: str
    device_name: str
    resource: str
    assigned: tuple[str, ...]
    pid: int
    rows: int
    seconds: float
    value: Any


def partition_array(items: Iterable[Any], columns: Sequence[str] | None = None) -> NDArray[Any]:
    """One array from a partition's elements (see the module docstring); (0,) when empty."""
    parts = [_as_array(item, columns) for item in items]
    if not parts:
        return np.empty((0,))
    if len(parts) == 1:
        # a lone scalar is a partition of one number, not a 0-d array (which kernels
        # cannot index and whose partition counted 0 rows)
        return parts[0].reshape(1) if parts[0].ndim == 0 else parts[0]
    try:
        if all(p.ndim >= 1 for p in parts):
            return np.concatenate(parts, axis=0)
        return np.asarray(parts)
    except ValueError as err:  # rows of different widths, scalars mixed with rows
        raise HeteroError(f"partition elements do not stack: {err}") from err


def _as_array(item: Any, columns: Sequence[str] | None) -> NDArray[Any]:
    """One element as an array: a block of rows, one row (1, C) or a scalar (0-d)."""
    if isinstance(item, np.ndarray):
        return item[None] if item.ndim == 1 else item
    module = type(item).__module__
    if module.startswith("pyarrow"):
        return _arrow_array(item, columns)
    try:
        array: NDArray[Any] = np.asarray(item)
    except ValueError as err:  # a ragged row
        raise HeteroError(f"a partition element is not a row of numbers: {err}") from err
    return array[None] if isinstance(item, list | tuple) and array.ndim == 1 else array


def _arrow_array(batch: Any, columns: Sequence[str] | None) -> NDArray[Any]:
    """Columns of an Arrow record batch / table as one array (zero-copy where possible)."""
    import pyarrow as pa  # noqa: PLC0415 - only when Arrow data arrives

    names = list(columns) if columns is not None else list(batch.schema.names)
    if len(names) == 1:
        column = batch.column(names[0])
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            width = column.type.list_size
            if column.null_count:
                msg = f"Arrow column {names[0]!r} has {column.null_count} null rows"
                raise HeteroError(msg)
            # flatten(), not .values: .values is the whole child array, also the rows
            # outside a slice (batch.slice(0, k) keeps offset 0 but not the length)
            flat_values = column.flatten()
            if flat_values.null_count == 0:
                values: NDArray[Any] = flat_values.to_numpy(zero_copy_only=True)
                return values.reshape(-1, width)
            return np.asarray(column.to_pylist(), dtype=np.float64)
        flat: NDArray[Any] = column.to_numpy(zero_copy_only=False)
        return flat
    arrays = [_arrow_array(batch, [name]) for name in names]
    return np.column_stack(arrays)


def _run_partition(
    index: int,
    items: Iterator[Any],
    *,
    kernel: Kernel,
    settings: HeteroSettings | None,
    columns: Sequence[str] | None,
    with_info: bool,
) -> Iterator[Any]:
    array = partition_array(items, columns)
    if array.size == 0 and not with_info:
        return
    started = time.perf_counter()
    device: ComputeDevice = select_device(settings)
    assignment = spark_assignment((settings or HeteroSettings.load()).resources)
    value = kernel(array, device=device) if array.size else None
    seconds = time.perf_counter() - started
    if not with_info:
        yield value
        return
    resource, assigned = (assignment[0], tuple(assignment[1])) if assignment else ("", ())
    yield PartitionResult(
        partition=index,
        address=device.info.address,
        device_name=device.info.name,
        resource=resource,
        assigned=assigned,
        pid=os.getpid(),
        rows=int(array.shape[0]) if array.ndim else 0,
        seconds=seconds,
        value=value,
    )


def map_partitions(
    rdd: RDD[Any],
    kernel: Kernel,
    *,
    settings: HeteroSettings | None = None,
    columns: Sequence[str] | None = None,
    with_info: bool = False,
) -> RDD[Any]:
    """Run ``kernel(partition_array, device=device)`` once per partition, on the task's device.

    Returns an RDD with one element per non-empty partition: the kernel's result, or with
    ``with_info`` a :class:`PartitionResult` for every partition (empty ones included, with
    ``value`` None).  ``settings`` (default: :meth:`HeteroSettings.load` on the executor)
    chooses the device where Spark assigned none; ``columns`` selects Arrow columns.
    """
    fn = functools.partial(
        _run_partition, kernel=kernel, settings=settings, columns=columns, with_info=with_info
    )
    return rdd.mapPartitionsWithIndex(fn)
