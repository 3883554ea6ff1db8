"""Packed cell keys and the host-built hash table the kernels probe."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.hetero import HeteroError
from adcloud.hetero.lattice import (
    EMPTY_KEY,
    KEY_OFFSET,
    build_table,
    cell_indices,
    lattice_origin,
    local_float32,
    pack_keys,
    table_find,
    unpack_keys,
)


def test_keys_round_trip_and_sort_by_z_then_y_then_x() -> None:
    rng = np.random.default_rng(0)
    cells = rng.integers(-KEY_OFFSET, KEY_OFFSET, (10_000, 3))
    keys = pack_keys(cells)
    np.testing.assert_array_equal(unpack_keys(keys), cells)
    order = np.argsort(keys)
    np.testing.assert_array_equal(order, np.lexsort((cells[:, 0], cells[:, 1], cells[:, 2])))
    assert not (keys == EMPTY_KEY).any()


def test_table_finds_every_key_and_nothing_else() -> None:
    rng = np.random.default_rng(1)
    keys = np.unique(pack_keys(rng.integers(-50, 50, (20_000, 3))))
    table_keys, table_values, bits = build_table(keys)
    assert len(table_keys) == 1 << bits >= 2 * len(keys)
    np.testing.assert_array_equal(
        table_find(table_keys, table_values, bits, keys), np.arange(len(keys))
    )
    absent = pack_keys(rng.integers(1000, 2000, (500, 3)))
    assert (table_find(table_keys, table_values, bits, absent) == -1).all()
    single_keys, single_values, single_bits = build_table(keys[:1])
    assert table_find(single_keys, single_values, single_bits, keys[:2]).tolist() == [0, -1]


def test_cells_are_computed_in_float32_relative_to_a_lattice_origin() -> None:
    points = np.array([[10.26, -3.1, 0.0], [np.nan, 0, 0], [10.74, -2.9, 0.49]], np.float32)
    origin = lattice_origin(points, 0.5)
    np.testing.assert_allclose(origin, [10.0, -3.5, 0.0])
    cells, usable = cell_indices(points[:, :3] - origin.astype(np.float32), 0.5)
    assert usable.tolist() == [True, False, True]
    assert cells[0].tolist() == [0, 0, 0] and cells[2].tolist() == [1, 1, 0]
    with pytest.raises(HeteroError, match="2\\^21 cells"):
        cell_indices(np.array([[0, 0, 0], [1e7, 0, 0]], np.float32), 1.0)
    assert lattice_origin(np.full((3, 3), np.nan), 1.0).tolist() == [0.0, 0.0, 0.0]


def test_a_cloud_starting_at_one_end_of_its_extent_uses_the_whole_key_range() -> None:
    # 1.5e6 cells from the first point: out of reach of an origin there (2^20 cells), but
    # well within the 2^21 cells the keys hold about the cloud's middle
    points = np.array([[0.0, 0.0, 0.0], [1.5e6, -1.0, 2.0], [7.0, np.nan, 0.0]])
    origin = lattice_origin(points, 1.0)
    np.testing.assert_allclose(origin, [750_000.0, -1.0, 1.0])
    cells, usable = cell_indices(local_float32(points, origin), 1.0)
    assert usable.tolist() == [True, True, False]
    np.testing.assert_array_equal(cells[:2] + origin.astype(np.int64), [[0, 0, 0], [1.5e6, -1, 2]])
    # clouds that fit keep the first point's origin (results stay as they were)
    near = np.array([[10.26, -3.1, 0.0], [1e5, 0.0, 0.0]])
    np.testing.assert_allclose(lattice_origin(near, 0.5), [10.0, -3.5, 0.0])
    # a far outlier (a query at 1e30 m) moves no origin: the others keep their precision
    outlier = np.array([[0.1, 0.0, 0.0], [1e30, 0.0, 0.0], [0.9, 0.0, 0.0]])
    np.testing.assert_allclose(lattice_origin(outlier, 0.5), [0.0, 0.0, 0.0])
    # and a cloud that does not fit anywhere still says so
    with pytest.raises(HeteroError, match="2\\^21 cells"):
        far = np.array([[0.0, 0.0, 0.0], [2.2e6, 0.0, 0.0]])
        cell_indices(local_float32(far, lattice_origin(far, 1.0)), 1.0)
