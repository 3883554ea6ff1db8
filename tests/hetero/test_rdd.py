"""map_partitions on local Spark: partitions become arrays, kernels run in the executors."""

from __future__ import annotations

import functools
import os

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from adcloud.hetero import (
    GridSpec,
    HeteroSettings,
    PartitionResult,
    map_partitions,
    rasterize,
    transform_points,
    voxel_downsample,
)
from adcloud.hetero.devices import ComputeDevice
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.rdd import partition_array

pytestmark = pytest.mark.opencl


def moved_with_device(array: np.ndarray, *, device: ComputeDevice) -> tuple[str, np.ndarray]:
    matrix = np.eye(4)
    matrix[:3, 3] = [1.0, 2.0, 3.0]
    return device.info.address, transform_points(array, matrix, device=device)


def test_kernels_run_per_partition_in_the_executors(spark: SparkSession) -> None:
    clouds = [np.random.default_rng(i).normal(0, 5, (1000, 4)).astype(np.float32) for i in range(6)]
    rdd = spark.sparkContext.parallelize(clouds, 3)
    results = map_partitions(rdd, moved_with_device, with_info=True).collect()
    assert len(results) == 3
    assert all(isinstance(r, PartitionResult) for r in results)
    assert {r.pid for r in results}.isdisjoint({os.getpid()})  # ran in Python workers
    everything = np.concatenate([r.value[1] for r in sorted(results, key=lambda r: r.partition)])
    expected = np.concatenate(clouds)[:, :3] + [1.0, 2.0, 3.0]
    np.testing.assert_allclose(everything, expected, atol=1e-5)
    for result in results:
        assert result.rows == 2000
        assert result.value[0] == result.address != ""
        assert result.resource == "" and result.assigned == ()  # local mode: no resources


def test_a_public_kernel_as_a_partial(spark: SparkSession) -> None:
    points = np.random.default_rng(3).uniform(0, 10, (20_000, 3)).astype(np.float32)
    rdd = spark.sparkContext.parallelize(np.array_split(points, 4), 4)
    parts = map_partitions(rdd, functools.partial(voxel_downsample, voxel_size=1.0)).collect()
    assert sum(int(p.counts.sum()) for p in parts) == 20_000
    settings = HeteroSettings(backend="numpy")
    raster = functools.partial(rasterize, grid=GridSpec(0, 0, 1, 10, 10))
    layers = map_partitions(rdd, raster, settings=settings, with_info=True).collect()
    assert {r.address for r in layers} == {"numpy"}
    assert sum(int(r.value.count.sum()) for r in layers) == 20_000


def test_empty_partitions_are_skipped_or_reported(spark: SparkSession) -> None:
    rdd = spark.sparkContext.parallelize([np.ones((5, 3), np.float32)], 3)
    assert len(map_partitions(rdd, moved_with_device).collect()) == 1
    info = map_partitions(rdd, moved_with_device, with_info=True).collect()
    assert len(info) == 3
    assert sorted(r.rows for r in info) == [0, 0, 5]
    assert [r.value for r in info if r.rows == 0] == [None, None]


def test_partition_arrays_from_numpy_arrow_and_rows() -> None:
    single = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert partition_array([single]) is single  # no copy
    both = partition_array([single, single])
    assert both.shape == (8, 3)
    xyz = pa.array(np.arange(12, dtype=np.float32)).to_numpy()
    column = pa.FixedSizeListArray.from_arrays(pa.array(xyz), 3)
    batch = pa.RecordBatch.from_arrays([column], names=["xyz"])
    view = partition_array([batch])
    assert view.shape == (4, 3)
    np.testing.assert_array_equal(view, single)
    assert not view.flags.owndata  # a view of Arrow's buffer
    table = pa.table({"x": [1.0, 2.0], "y": [3.0, 4.0], "z": [5.0, 6.0], "name": ["a", "b"]})
    np.testing.assert_array_equal(
        partition_array([table], columns=["x", "y", "z"]), [[1, 3, 5], [2, 4, 6]]
    )
    assert partition_array([(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]).shape == (2, 3)
    assert partition_array([]).size == 0


def test_a_sliced_arrow_batch_gives_only_its_own_rows() -> None:
    column = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.float32)), 3)
    batch = pa.RecordBatch.from_arrays([column], names=["xyz"])
    head = partition_array([batch.slice(0, 2)])  # offset 0, but only 2 of the 4 rows
    np.testing.assert_array_equal(head, [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(partition_array([batch.slice(3, 1)]), [[9, 10, 11]])
    assert np.shares_memory(head, partition_array([batch]))  # still without a copy


def test_null_rows_of_an_arrow_column_are_an_error_naming_it() -> None:
    column = pa.array([[1.0, 2.0, 3.0], None], type=pa.list_(pa.float32(), 3))
    batch = pa.RecordBatch.from_arrays([column], names=["xyz"])
    with pytest.raises(HeteroError, match="'xyz' has 1 null rows"):
        partition_array([batch])


def test_rows_of_every_kind_become_rows() -> None:
    # 1-D NumPy rows were joined into one flat (3N,) array while tuples became (N, 3) rows
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    for items in (list(rows), [tuple(r) for r in rows], [list(r) for r in rows]):
        np.testing.assert_array_equal(partition_array(items), rows)
    np.testing.assert_array_equal(partition_array([rows[0]]), rows[:1])
    mixed = partition_array([rows[0], (3, 4, 5), np.ones((2, 3), np.float64)])
    assert mixed.shape == (4, 3) and mixed.dtype == np.float64
    np.testing.assert_array_equal(partition_array([1.0, 2.0]), [1.0, 2.0])  # scalars
    # one scalar alone is a 1-D partition of one number too (it was a 0-d array)
    for single in ([7.0], [np.float32(7.0)], [np.array(7.0)]):
        assert partition_array(single).shape == (1,)
        assert partition_array(single).tolist() == [7.0]
    with pytest.raises(HeteroError, match="do not stack"):
        partition_array([1.0, (1.0, 2.0, 3.0)])
    with pytest.raises(HeteroError, match="not a row of numbers"):
        partition_array([(1.0, (2.0, 3.0))])


def test_a_parallelized_cloud_gives_partitions_of_its_rows(spark: SparkSession) -> None:
    cloud = np.random.default_rng(8).normal(0, 5, (10, 3)).astype(np.float32)
    rdd = spark.sparkContext.parallelize(cloud, 4)  # elements: the cloud's 1-D rows
    info = map_partitions(rdd, moved_with_device, with_info=True).collect()
    assert sum(r.rows for r in info) == 10
    moved = np.concatenate([r.value[1] for r in sorted(info, key=lambda r: r.partition)])
    np.testing.assert_allclose(moved, cloud + np.array([1.0, 2.0, 3.0]), atol=1e-5)
