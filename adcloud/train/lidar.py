"""LiDAR point segmentation: the ``lidar_seg`` task, its ETL and its model.

ETL: every ``sensor_msgs/PointCloud2`` of ``/lidar/points`` becomes one
:class:`~adcloud.train.task.PointCloudSample` (``x, y, z, intensity`` and the per-point
``label`` field of ``docs/synth-truth-format.md`` section 9), decoded with a NumPy structured
dtype built from the message's own ``fields``.

Model (:class:`PolarBevSegNet`, in the style of PointPillars / PolarNet, small): per-point
features (position, range, intensity and offsets from the statistics of the point's cell) go
through a point MLP; the point embeddings are max-pooled (``scatter_reduce``) into a polar
bird's-eye-view grid, beside per-cell statistics (``index_add_``: count, mean height and
intensity; ``scatter_reduce``: lowest and highest point) (azimuth x log-spaced range, which covers
the whole 100 m sweep with fine cells near the car and coarse ones far away); a 2D conv
encoder-decoder (circular padding in azimuth) adds context; the cell features are gathered back
to the points (``index_select``), concatenated with the point embedding, and a small MLP scores
every point over the label ids 0..10 (logit ``k`` is label ``k``; 0 never appears on points
and is ignored by the loss).

The network takes a padded batch ``points (B, N, 4)`` with a ``valid (B, N)`` mask and returns
``logits (B, N, 11)``; padded points fall into a spare cell that is dropped, so they never mix
with real ones. Nothing in it depends on the batch (GroupNorm, not BatchNorm), so a sweep's
logits do not depend on the other sweeps of its batch and data-parallel training matches
single-process training.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the usual spelling
from numpy.typing import NDArray
from torch import nn

from adcloud.binpipe import BinpipeError, pointcloud_array
from adcloud.synth.labels import Label
from adcloud.train.errors import DataError, TrainError
from adcloud.train.metrics import confusion_matrix, lovasz_softmax, segmentation_scores
from adcloud.train.task import (
    Batch,
    PointCloudSample,
    Sample,
    config_from_options,
    evaluating,
    expect_msgtype,
)

__all__ = [
    "NUM_CLASSES",
    "LidarConfig",
    "LidarSegTask",
    "PolarBevSegNet",
    "pointcloud2_array",
]

_log = logging.getLogger(__name__)

#: Logits per point: one per label id 0..10 (``adcloud.synth.Label``).
NUM_CLASSES = len(Label)
#: Label names for the scores (``iou_road``...).
_NAMES = {int(lab): lab.name.lower() for lab in Label}

# sensor_msgs/PointField datatypes -> NumPy kinds (the byte order comes from is_bigendian).


@dataclass(frozen=True)
class LidarConfig:
    """Settings of the ``lidar_seg`` task (data pipeline and network size).

    The defaults are the ``small`` preset (0.11 M parameters, 0.18 GMACs per 7k-point
    sweep): 300 steps of 2 sweeps (AdamW, one-cycle learning rate up to 6e-3) on a 20 s
    synthetic drive (16 beams x 512 columns) take about 20 s on one CPU thread and reach
    0.86 mIoU on a held-out drive of another seed (``tests/train/test_lidar.py``). ``full`` is
    :meth:`full`.
    """

    #: Topic of the ``sensor_msgs/PointCloud2`` sweeps.
    topic: str = "/lidar/points"
    #: Polar grid: azimuth cells over 360 degrees and log-spaced range cells between
    #: ``r_min_m`` and ``r_max_m`` (metres; nearer/farther points go to the first/last cell).
    azimuth_bins: int = 128
    radial_bins: int = 48
    r_min_m: float = 2.0
    r_max_m: float = 100.0
    #: Width of the point MLP.
    point_channels: int = 32
    #: Channels of the BEV encoder levels (each level halves both grid sizes).
    bev_channels: tuple[int, ...] = (16, 32, 64)
    #: GroupNorm groups in the BEV encoder-decoder.
    groups: int = 8
    #: Loss weight of each label id 0..10 (0 is ignored anyway): about 1/sqrt(frequency) of the
    #: labels in the synthetic drives, relative to ROAD, so that thin and rare classes (lane
    #: markings, poles, signs, vehicles) are learnt within a short training budget.
    class_weights: tuple[float, ...] = (0.0, 1.0, 4.9, 3.1, 1.5, 1.4, 1.1, 6.0, 9.7, 1.8, 8.5)
    #: Add the Lovasz-softmax loss (a convex surrogate of 1 - IoU, Berman et al. 2018, as
    #: PolarNet and Cylinder3D do) to the cross-entropy; it lifts the IoU of small classes.
    lovasz: bool = True
    #: Training augmentation: a random rotation about z and a random left-right mirror.
    augment: bool = True
    #: Sweeps per forward pass in :meth:`LidarSegTask.evaluate`.
    eval_batch: int = 4

    @classmethod
    def full(cls) -> LidarConfig:
        """The benchmark preset: a finer grid and a wider network (a GPU helps)."""
        return cls(
            azimuth_bins=256, radial_bins=64, point_channels=64, bev_channels=(64, 96, 128, 192)
        )

    def validate(self) -> LidarConfig:
        """Return ``self`` if usable, else raise :class:`TrainError` naming the setting."""
        levels = len(self.bev_channels)
        step = 2 ** (levels - 1)
        problems = []
        if levels < 1 or any(c < 1 for c in self.bev_channels):
            problems.append("bev_channels must be one or more positive channel counts")
        for name in ("azimuth_bins", "radial_bins"):
            value = getattr(self, name)
            if value < step or value % step:
                problems.append(f"{name} ({value}) must be a positive multiple of {step}")
        if not 0 < self.r_min_m < self.r_max_m:
            problems.append("0 < r_min_m < r_max_m must hold")
        if len(self.class_weights) != NUM_CLASSES or any(w < 0 for w in self.class_weights):
            problems.append(f"class_weights must be {NUM_CLASSES} weights >= 0 (label ids 0..10)")
        if self.point_channels < 1 or self.eval_batch < 1:
            problems.append("point_channels and eval_batch must be >= 1")
        if self.groups < 1 or any(c % self.groups for c in self.bev_channels):
            problems.append(f"every bev_channels entry must be a multiple of groups={self.groups}")
        if problems:
            raise TrainError("lidar_seg options: " + "; ".join(problems))
        return self


def pointcloud2_array(msg: Any, topic: str, need: Iterable[str] = ()) -> NDArray[np.void]:
    """The points of a decoded ``sensor_msgs/PointCloud2`` as a NumPy structured array.

    The dtype is built from the message's ``fields`` (names, offsets, datatypes, counts),
    ``point_step`` and ``is_bigendian``; organized clouds (``height > 1``) are flattened row by
    row, skipping row padding. The array is a view into ``msg.data`` where the layout allows.
    Raises :class:`DataError` naming ``topic`` and the field when a field of ``need`` is
    missing, a datatype is unknown or the data is shorter than the header says.
    """
    expect_msgtype(msg, topic, "sensor_msgs/msg/PointCloud2")
    need = tuple(need)
    try:
        return pointcloud_array(msg, topic=topic, require=need)
    except BinpipeError as err:
        hint = f"; this task needs {', '.join(need)}" if "has no field" in str(err) else ""
        raise DataError(f"{err}{hint}") from None


# --------------------------------------------------------------------------- network


class _AzimuthConv(nn.Module):
    """3x3 conv on a ``(B, C, azimuth, range)`` grid: circular in azimuth, zero-padded in range,
    then GroupNorm and ReLU."""

    def __init__(self, cin: int, cout: int, groups: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=(0, 1), bias=False)
        self.norm = nn.GroupNorm(min(groups, cout), cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 1, 1), mode="circular")
        return F.relu(self.norm(self.conv(x)))


class _BevUNet(nn.Module):
    """Encoder-decoder over the polar BEV grid: one conv at full resolution, a stride-2 conv and
    a conv per lower level, nearest-neighbour upsampling and one conv per level on the way up
    (the full-resolution convs dominate the cost, so they are kept to one each)."""

    def __init__(self, cin: int, channels: Sequence[int], groups: int) -> None:
        super().__init__()
        self.stem = _AzimuthConv(cin, channels[0], groups)
        self.down = nn.ModuleList()
        self.up = nn.ModuleList()
        for c_prev, c in itertools.pairwise(channels):
            self.down.append(
                nn.Sequential(_AzimuthConv(c_prev, c, groups, stride=2), _AzimuthConv(c, c, groups))
            )
        for c_skip, c in zip(channels[:-1][::-1], channels[1:][::-1], strict=True):
            self.up.append(_AzimuthConv(c + c_skip, c_skip, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = [x]
        for block in self.down:
            x = block(x)
            skips.append(x)
        skips.pop()
        for block in self.up:
            skip = skips.pop()
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skip], dim=1))
        return x


#: Per-point input features of the point MLP (see PolarBevSegNet._point_features).
_POINT_FEATURES = 12
#: Per-cell statistics added to the pooled embeddings in the BEV grid.
_CELL_FEATURES = 6


class PolarBevSegNet(nn.Module):
    """Point segmentation through a polar bird's-eye-view grid (see the module docstring).

    ``forward(points, valid)``: ``points`` float32 ``(B, N, 4)`` = ``x, y, z`` (m, sensor frame)
    and intensity (0..255); ``valid`` bool ``(B, N)`` (False on padding). Returns float32
    ``(B, N, NUM_CLASSES)`` logits, one per label id.
    """

    def __init__(self, config: LidarConfig | None = None) -> None:
        super().__init__()
        cfg = (config or LidarConfig()).validate()
        self.azimuth_bins = cfg.azimuth_bins
        self.radial_bins = cfg.radial_bins
        self.r_min = cfg.r_min_m
        self.log_span = math.log(cfg.r_max_m / cfg.r_min_m)
        c = cfg.point_channels
        self.point_mlp = nn.Sequential(
            nn.Linear(_POINT_FEATURES, c), nn.ReLU(), nn.Linear(c, c), nn.ReLU()
        )
        self.bev = _BevUNet(c + _CELL_FEATURES, cfg.bev_channels, cfg.groups)
        self.head = nn.Sequential(
            nn.Linear(c + cfg.bev_channels[0], c), nn.ReLU(), nn.Linear(c, NUM_CLASSES)
        )

    def _cells(self, points: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Flat cell index of every point in ``[0, B*A*R]``; padding goes to the spare cell
        ``B*A*R``."""
        b = points.shape[0]
        x, y = points[..., 0], points[..., 1]
        r = torch.sqrt(x * x + y * y).clamp_min(1e-3)
        a_idx = torch.floor((torch.atan2(y, x) + math.pi) * (self.azimuth_bins / (2 * math.pi)))
        r_idx = torch.floor(torch.log(r / self.r_min) * (self.radial_bins / self.log_span))
        a_idx = a_idx.clamp(0, self.azimuth_bins - 1).long()
        r_idx = r_idx.clamp(0, self.radial_bins - 1).long()
        per_sweep = self.azimuth_bins * self.radial_bins
        base = torch.arange(b, device=points.device).unsqueeze(1) * per_sweep
        cell = base + a_idx * self.radial_bins + r_idx
        return torch.where(valid, cell, torch.full_like(cell, b * per_sweep))

    def forward(self, points: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, N, NUM_CLASSES)`` of every point (see the class docstring)."""
        b, n, _ = points.shape
        cell = self._cells(points, valid).reshape(-1)
        n_cells = b * self.azimuth_bins * self.radial_bins + 1  # + the spare cell
        flat = points.reshape(-1, 4)
        x, y, z, inten = flat[:, 0], flat[:, 1], flat[:, 2], flat[:, 3] / 100.0

        # Cell statistics (scatter) and each point's offsets from them (gather).
        count = torch.zeros(n_cells, device=flat.device).index_add_(0, cell, torch.ones_like(x))
        sums = torch.zeros(n_cells, 4, device=flat.device).index_add_(
            0, cell, torch.stack([x, y, z, inten], dim=1)
        )
        mean = sums / count.clamp_min(1.0).unsqueeze(1)
        zmin = torch.zeros(n_cells, device=flat.device).scatter_reduce(
            0, cell, z, "amin", include_self=False
        )
        zmax = torch.zeros(n_cells, device=flat.device).scatter_reduce(
            0, cell, z, "amax", include_self=False
        )
        p_mean = mean.index_select(0, cell)
        p_zmin = zmin.index_select(0, cell)
        p_zmax = zmax.index_select(0, cell)
        r = torch.sqrt(x * x + y * y)
        feats = torch.stack(
            [
                x / 20.0,
                y / 20.0,
                z / 2.0,
                torch.log1p(r),
                inten,
                z - p_zmin,
                z - p_mean[:, 2],
                p_zmax - z,
                inten - p_mean[:, 3],
                x - p_mean[:, 0],
                y - p_mean[:, 1],
                torch.log1p(count.index_select(0, cell)) / 3.0,
            ],
            dim=1,
        )
        emb = self.point_mlp(feats)  # (B*N, C)

        # Pool the embeddings into the grid (max per cell, as PointPillars / PolarNet).
        c = emb.shape[1]
        pooled_max = torch.zeros(n_cells, c, device=flat.device).scatter_reduce(
            0, cell.unsqueeze(1).expand(-1, c), emb, "amax", include_self=False
        )
        stats = torch.stack(
            [
                torch.log1p(count) / 3.0,
                mean[:, 2] / 2.0,
                zmin / 2.0,
                zmax / 2.0,
                zmax - zmin,
                mean[:, 3],
            ],
            dim=1,
        )
        grid = torch.cat([pooled_max, stats], dim=1)[:-1]
        grid = grid.reshape(b, self.azimuth_bins, self.radial_bins, -1).permute(0, 3, 1, 2)

        bev: torch.Tensor = self.bev(grid.contiguous())  # (B, C0, A, R)
        cells_out = bev.permute(0, 2, 3, 1).reshape(-1, bev.shape[1])
        cells_out = torch.cat([cells_out, cells_out.new_zeros(1, cells_out.shape[1])], dim=0)
        back = cells_out.index_select(0, cell)  # de-voxelize
        logits: torch.Tensor = self.head(torch.cat([emb, back], dim=1))
        return logits.reshape(b, n, NUM_CLASSES)


# --------------------------------------------------------------------------- task


@dataclass
class LidarSegTask:
    """The ``lidar_seg`` task: per-point labels of LiDAR sweeps (see the module docstring).

    Implements :class:`~adcloud.train.task.Task`.
    """

    config: LidarConfig = field(default_factory=LidarConfig)
    name: str = "lidar_seg"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LidarSegTask:
        """A task from the task options: ``preset`` (``small``/``full``) and
        :class:`LidarConfig` fields; raises :class:`TrainError` naming an unknown option."""
        return cls(
            config_from_options(
                "lidar_seg",
                options,
                LidarConfig(),
                LidarConfig.full(),
                {"bev_channels": int, "class_weights": float},
            )
        )

    @property
    def class_names(self) -> tuple[str, ...]:
        """The name of every label id, by id (what :meth:`scores` calls ``iou_<name>``)."""
        return tuple(_NAMES.get(i, str(i)) for i in range(NUM_CLASSES))

    @property
    def topics(self) -> tuple[str, ...]:
        """The one topic this task reads."""
        return (self.config.topic,)

    def samples(self, topic: str, timestamp: int, decoded: Any) -> list[Sample]:
        """``[PointCloudSample]`` of one sweep (non-finite points dropped); ``[]`` for other
        topics."""
        if topic != self.config.topic:
            return []
        cloud = pointcloud2_array(decoded, topic, need=("x", "y", "z", "intensity", "label"))
        for name in ("x", "y", "z", "intensity", "label"):
            if cloud.dtype[name].shape:
                raise DataError(f"{topic}: PointCloud2 field {name!r} must have count 1")
        pts = np.stack([cloud[k].astype(np.float32) for k in ("x", "y", "z", "intensity")], axis=1)
        labels = cloud["label"]
        if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
            raise DataError(
                f"{topic}: PointCloud2 field 'label' holds ids {labels.min()}..{labels.max()}, "
                f"outside the label set 0..{NUM_CLASSES - 1} (docs/synth-truth-format.md §6)"
            )
        keep = np.isfinite(pts).all(axis=1)
        stamp = getattr(getattr(decoded, "header", None), "stamp", None)
        stamp_ns = timestamp if stamp is None else int(stamp.sec) * 10**9 + int(stamp.nanosec)
        return [
            PointCloudSample(
                stamp_ns=stamp_ns,
                points=np.ascontiguousarray(pts[keep]),
                labels=labels[keep].astype(np.uint8),
            )
        ]

    def build_model(self) -> PolarBevSegNet:
        """A fresh :class:`PolarBevSegNet` (seed with ``torch.manual_seed`` first)."""
        return PolarBevSegNet(self.config)

    @staticmethod
    def _pad(
        clouds: Sequence[NDArray[np.float32]], labels: Sequence[NDArray[np.uint8]] | None = None
    ) -> Batch:
        n = max(len(c) for c in clouds)
        points = torch.zeros(len(clouds), n, 4)
        valid = torch.zeros(len(clouds), n, dtype=torch.bool)
        out: Batch = {"points": points, "valid": valid}
        if labels is not None:
            out["labels"] = torch.zeros(len(clouds), n, dtype=torch.long)
        for i, c in enumerate(clouds):
            points[i, : len(c)] = torch.from_numpy(c)
            valid[i, : len(c)] = True
            if labels is not None:
                out["labels"][i, : len(c)] = torch.from_numpy(labels[i].astype(np.int64))
        return out

    def _points_of(self, samples: Sequence[Sample]) -> list[PointCloudSample]:
        out = []
        for s in samples:
            if not isinstance(s, PointCloudSample):
                raise TrainError(f"lidar_seg takes PointCloudSample, not {type(s).__name__}")
            out.append(s)
        return out

    def batches(
        self, samples: Sequence[Sample], batch_size: int, generator: torch.Generator
    ) -> Iterator[Batch]:
        """Shuffled padded batches (``points``, ``valid``, ``labels``); with ``augment``, each
        sweep is rotated about z by a random angle and mirrored left-right with p = 0.5."""
        if batch_size < 1:
            raise TrainError(f"batch_size must be >= 1, not {batch_size}")
        sweeps = self._points_of(samples)
        order = torch.randperm(len(sweeps), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            chosen = [sweeps[i] for i in order[start : start + batch_size]]
            clouds = []
            for s in chosen:
                pts = s.points
                if self.config.augment:
                    angle = float(torch.rand((), generator=generator)) * 2 * math.pi
                    mirror = bool(torch.rand((), generator=generator) < 0.5)
                    pts = _rotate(pts, angle, mirror)
                clouds.append(pts)
            yield self._pad(clouds, [s.labels for s in chosen])

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Cross-entropy over the labelled points of each sweep, averaged per sweep, then over
        the sweeps (label 0 and padding are ignored)."""
        logits: torch.Tensor = model(batch["points"], batch["valid"])
        labels = batch["labels"]
        weight = torch.tensor(self.config.class_weights, device=logits.device)
        per_point = F.cross_entropy(logits.transpose(1, 2), labels, weight=weight, reduction="none")
        mask = (labels > 0) & batch["valid"]
        per_sweep = (per_point * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)
        if self.config.lovasz:
            probs = logits.softmax(dim=2)
            per_sweep = per_sweep + torch.stack(
                [lovasz_softmax(probs[i][mask[i]], labels[i][mask[i]]) for i in range(len(mask))]
            )
        return per_sweep.mean()

    def predict(self, model: nn.Module, samples: Sequence[Sample]) -> list[NDArray[np.uint8]]:
        """Predicted label ids of every point of every sweep (evaluation mode, no gradients)."""
        sweeps = self._points_of(samples)
        if not sweeps:
            return []
        device = next(model.parameters()).device
        out: list[NDArray[np.uint8]] = []
        with evaluating(model):
            step = self.config.eval_batch
            for start in range(0, len(sweeps), step):
                chunk = sweeps[start : start + step]
                batch = self._pad([s.points for s in chunk])
                logits = model(batch["points"].to(device), batch["valid"].to(device))
                pred = logits.argmax(dim=2).cpu().numpy().astype(np.uint8)
                out.extend(pred[i, : len(s.points)] for i, s in enumerate(chunk))
        return out

    def eval_counts(self, model: nn.Module, samples: Sequence[Sample]) -> NDArray[np.int64]:
        """The confusion matrix (truth x prediction, ``NUM_CLASSES`` square) of every point of
        ``samples``: :meth:`scores` of a sum of these is the score of all their samples."""
        sweeps = self._points_of(samples)
        cm = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
        for s, pred in zip(sweeps, self.predict(model, sweeps), strict=True):
            cm += confusion_matrix(s.labels, pred, NUM_CLASSES)
        return cm

    def scores(self, counts: NDArray[Any]) -> dict[str, float]:
        """``miou`` and ``accuracy`` over the labelled points of confusion matrix ``counts``,
        and ``iou_<label>`` of every label present; labels absent (and UNLABELED) are left
        out of the mean."""
        return segmentation_scores(counts, _NAMES, ignore=(int(Label.UNLABELED),))

    def evaluate(self, model: nn.Module, samples: Sequence[Sample]) -> dict[str, float]:
        """:meth:`scores` of ``samples`` (see there)."""
        if not samples:
            raise TrainError("lidar_seg evaluate: no samples (is the held-out data empty?)")
        scores = self.scores(self.eval_counts(model, samples))
        _log.info("lidar_seg: mIoU %.3f over %d sweeps", scores["miou"], len(samples))
        return scores

    def example_inputs(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(points, valid)`` of the first two sweeps (two, so that the batch size is traced
        as a variable; one sweep is repeated when there is only one), sweeps of fewer than
        two points passed over while there are others, and padded to at least two points
        (``torch.export`` fixes a dimension traced at size 0 or 1: an empty sweep or two at
        the start of a drive would make the points per sweep a constant)."""
        given = self._points_of(samples)
        if not given:
            raise TrainError("lidar_seg example_inputs: need at least one sample")
        sweeps = [s for s in given if len(s.points) >= 2][:2] or given[:2]
        clouds = [s.points for s in sweeps]
        if len(clouds) == 1:
            clouds.append(clouds[0][: max(len(clouds[0]) // 2, 1)])
        batch = self._pad(clouds)
        points, valid = batch["points"], batch["valid"]
        short = 2 - points.shape[1]
        if short > 0:  # padding: points that are not valid
            points = F.pad(points, (0, 0, 0, short))
            valid = F.pad(valid, (0, short), value=False)
        return points, valid

    def dynamic_shapes(self) -> dict[str, dict[int, Any]]:
        """Sweeps per batch and points per sweep vary at inference."""
        sweeps = torch.export.Dim("sweeps", min=1, max=1024)
        points = torch.export.Dim("points", min=2, max=1 << 22)
        return {"points": {0: sweeps, 1: points}, "valid": {0: sweeps, 1: points}}


def _rotate(points: NDArray[np.float32], angle: float, mirror: bool) -> NDArray[np.float32]:
    """``points`` rotated by ``angle`` (rad) about z, then mirrored ``y -> -y`` if ``mirror``."""
    c, s = math.cos(angle), math.sin(angle)
    out = points.copy()
    out[:, 0] = c * points[:, 0] - s * points[:, 1]
    out[:, 1] = s * points[:, 0] + c * points[:, 1]
    if mirror:
        out[:, 1] = -out[:, 1]
    return out
