"""Obstacles in labelled point clouds: the reference clustering behind detection truth.

The synthetic drives label every LiDAR point (:class:`adcloud.synth.Label`).  An
*obstacle* is a connected group of points of the obstacle classes (poles, signs,
vehicles by default) on a 2D grid of ``cell_m`` cells (8-neighbourhood) within
``max_range_m`` of the sensor, with at least ``min_points`` points; it is reported as the
centroid of its points (metres, in the cloud's frame).  The ``detections`` evaluator
uses this as ground truth; the example pipe node uses it as its detector.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["DEFAULT_CLASSES", "cloud_points", "cluster_obstacles"]

#: Label ids of obstacle classes: POLE, SIGN, VEHICLE (see :class:`adcloud.synth.Label`).
DEFAULT_CLASSES = (7, 8, 10)

_NUMPY_TYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 8: "f8"}


def cloud_points(cloud: Any) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """``(xyz (n, 3), labels (n,))`` of a decoded ``sensor_msgs/PointCloud2``.

    Clouds without a ``label`` field get label -1 for every point.
    """
    names, formats, offsets = [], [], []
    for f in cloud.fields:
        if f.count == 1 and f.datatype in _NUMPY_TYPES:
            names.append(f.name)
            order = ">" if cloud.is_bigendian else "<"
            formats.append(order + _NUMPY_TYPES[f.datatype])
            offsets.append(f.offset)
    dtype = np.dtype(
        {"names": names, "formats": formats, "offsets": offsets, "itemsize": cloud.point_step}
    )
    n = cloud.width * cloud.height
    raw = np.asarray(cloud.data, dtype=np.uint8)
    pts = np.frombuffer(raw.tobytes()[: n * cloud.point_step], dtype=dtype, count=n)
    xyz = np.stack([pts["x"], pts["y"], pts["z"]], axis=1).astype(np.float64)
    labels = pts["label"].astype(np.int64) if "label" in names else np.full(n, -1, np.int64)
    return xyz, labels


def cluster_obstacles(
    xyz: NDArray[np.float64],
    labels: NDArray[np.int64],
    *,
    classes: tuple[int, ...] = DEFAULT_CLASSES,
    cell_m: float = 1.0,
    min_points: int = 5,
    max_range_m: float = 40.0,
) -> NDArray[np.float64]:
    """Centroids ``(k, 3)`` of the obstacles in one cloud, sorted by x then y."""
    keep = np.isin(labels, classes) & (np.hypot(xyz[:, 0], xyz[:, 1]) <= max_range_m)
    pts = xyz[keep]
    if not len(pts):
        return np.zeros((0, 3))
    cells = np.floor(pts[:, :2] / cell_m).astype(np.int64)
    uniq, inverse = np.unique(cells, axis=0, return_inverse=True)
    index = {(int(a), int(b)): i for i, (a, b) in enumerate(uniq)}
    parent = list(range(len(uniq)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (a, b) in enumerate(uniq):
        for da in (-1, 0, 1):
            for db in (-1, 0, 1):
                j = index.get((int(a) + da, int(b) + db))
                if j is not None:
                    ri, rj = find(i), find(j)
                    if ri != rj:
                        parent[max(ri, rj)] = min(ri, rj)
    roots = np.array([find(i) for i in range(len(uniq))])[inverse.ravel()]
    out = []
    for root in np.unique(roots):
        members = pts[roots == root]
        if len(members) >= min_points:
            out.append(members.mean(axis=0))
    if not out:
        return np.zeros((0, 3))
    arr = np.array(out)
    return arr[np.lexsort((arr[:, 1], arr[:, 0]))]
