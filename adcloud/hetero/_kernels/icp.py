"""Launch code of ``icp.cl``: grid buffers kept on the device across ICP iterations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyopencl as cl
from numpy.typing import NDArray

from adcloud.hetero._kernels import from_device, launch, launching, scratch, to_device

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice
    from adcloud.hetero.icp import PointGrid

ICP_SUMS = 29
_SYSTEM_GROUP = 64


class GridOnDevice:
    """A :class:`~adcloud.hetero.icp.PointGrid` (and optionally its normals) in device buffers.

    Host arrays backing zero-copy buffers are kept referenced here for as long as the
    buffers live.
    """

    def __init__(
        self,
        device: OpenCLDevice,
        grid: PointGrid,
        normals: NDArray[np.float32] | None = None,
    ) -> None:
        self.device = device
        self.grid = grid
        self._keep: list[NDArray[Any]] = []
        self.points = self._upload(_as_float4(grid.points))
        self.cell_start = self._upload(grid.cell_start)
        self.cell_count = self._upload(grid.cell_count)
        self.table_keys = self._upload(grid.table_keys)
        self.table_values = self._upload(grid.table_values)
        self.mask = np.uint32((1 << grid.table_bits) - 1)
        self.shift = np.uint32(64 - grid.table_bits)
        self.inv = np.float32(1.0) / np.float32(grid.cell)
        self.normals = None if normals is None else self._upload(_as_float4(normals))

    def set_normals(self, normals: NDArray[np.float32]) -> None:
        """Upload the (M, 3) normals of the grid's points (sorted order) for matching."""
        self.normals = self._upload(_as_float4(normals))

    def _upload(self, array: NDArray[Any]) -> cl.Buffer:
        array = np.ascontiguousarray(array)
        self._keep.append(array)
        return to_device(self.device, array, f"the grid of {len(self.grid.points):,} points")

    def grid_args(self) -> list[Any]:
        """The grid arguments every kernel takes, in order."""
        return [
            self.points,
            self.cell_start,
            self.cell_count,
            self.table_keys,
            self.table_values,
            self.mask,
            self.shift,
        ]

    def normals_of_grid(self, radius: float, min_neighbors: int) -> NDArray[np.float32]:
        """(M, 3) normals of the grid's own points (sorted order); NaN rows where too few."""
        m = len(self.grid.points)
        out = scratch(self.device, m * 16)
        launch(
            self.device, "icp", "grid_normals", m, None,
            np.int32(m), self.inv, np.float32(radius) ** 2, np.int32(min_neighbors),
            *self.grid_args(), out,
        )  # fmt: skip
        return from_device(self.device, out, (m, 4), np.float32)[:, :3]


def _as_float4(xyz: NDArray[np.float32]) -> NDArray[np.float32]:
    rows = np.zeros((len(xyz), 4), np.float32)
    rows[:, :3] = xyz
    return rows


class MatchOnDevice:
    """Source points on the device and their matches, for repeated ICP iterations."""

    def __init__(self, grid: GridOnDevice, source: NDArray[np.float32]) -> None:
        self.grid = grid
        self.device = grid.device
        self.source_host = np.ascontiguousarray(source, np.float32)
        self.n, self.stride = self.source_host.shape
        self.source = to_device(self.device, self.source_host, f"{self.n:,} source points")
        self.rt = scratch(self.device, 12 * 4)
        self.index = scratch(self.device, self.n * 4)
        self.d2 = scratch(self.device, self.n * 4)
        self.groups = max(1, min(-(-self.n // _SYSTEM_GROUP), 8 * self.device.info.compute_units))
        self.partials = scratch(self.device, self.groups * ICP_SUMS * 4)

    def set_transform(self, rt: NDArray[np.float32]) -> None:
        """Upload R (row-major) then t, mapping source rows into the grid frame."""
        with launching(self.device, "transform upload"):
            cl.enqueue_copy(self.device.queue, self.rt, np.ascontiguousarray(rt, np.float32))

    def nearest(self, max_distance: float) -> None:
        """Match every source point to its nearest grid point within ``max_distance``."""
        launch(
            self.device, "icp", "grid_nearest", self.n, None,
            self.source, np.int32(self.stride), np.int32(self.n), self.rt,
            self.grid.inv, np.float32(max_distance) ** 2, *self.grid.grid_args(),
            self.index, self.d2,
        )  # fmt: skip

    def matches(self) -> tuple[NDArray[np.int32], NDArray[np.float32]]:
        """(sorted grid index or -1, squared distance or inf) of every source point."""
        return (
            from_device(self.device, self.index, (self.n,), np.int32),
            from_device(self.device, self.d2, (self.n,), np.float32),
        )

    def set_matches(self, index: NDArray[np.int32]) -> None:
        """Use caller-given matches (sorted grid indices, -1 for none)."""
        with launching(self.device, "match upload"):
            cl.enqueue_copy(self.device.queue, self.index, np.ascontiguousarray(index, np.int32))

    def system(self, huber: float) -> NDArray[np.float64]:
        """The ICP_SUMS point-to-plane sums over the current matches (float64 on the host)."""
        assert self.grid.normals is not None
        local = cl.LocalMemory(_SYSTEM_GROUP * ICP_SUMS * 4)
        launch(
            self.device, "icp", "plane_system", self.groups * _SYSTEM_GROUP, _SYSTEM_GROUP,
            self.source, np.int32(self.stride), np.int32(self.n), self.rt, self.index,
            self.grid.points, self.grid.normals, np.float32(huber), local, self.partials,
        )  # fmt: skip
        partials = from_device(self.device, self.partials, (self.groups, ICP_SUMS), np.float32)
        sums: NDArray[np.float64] = partials.astype(np.float64).sum(axis=0)
        return sums
