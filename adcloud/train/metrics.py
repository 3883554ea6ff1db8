"""Segmentation scores (confusion matrix, per-class IoU, mean IoU) and the Lovasz-softmax loss,
the differentiable surrogate of IoU that the segmentation tasks train with.

Conventions (those of the SemanticKITTI / nuScenes-lidarseg benchmarks):

- the confusion matrix ``cm[t, p]`` counts items of true class ``t`` predicted as ``p``;
- ``IoU_c = TP / (TP + FP + FN)``;
- a class with no ground-truth item in the evaluated data has no IoU (``NaN``) and is left out
  of the mean, as are the ``ignore`` classes (e.g. 0 = unlabelled for LiDAR);
- items whose ground truth is an ``ignore`` class are left out altogether: whatever they are
  predicted as is no false positive (their truth is unknown); an item of a scored class
  predicted as an ``ignore`` class is still a false negative of its true class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray

from adcloud.train.errors import TrainError

__all__ = [
    "confusion_matrix",
    "iou_per_class",
    "lovasz_softmax",
    "mean_iou",
    "segmentation_scores",
]


def confusion_matrix(truth: ArrayLike, pred: ArrayLike, num_classes: int) -> NDArray[np.int64]:
    """``int64 (num_classes, num_classes)`` counts of ``(truth, pred)`` label pairs.

    ``truth`` and ``pred`` are integer arrays of the same shape with ids in
    ``[0, num_classes)``; raises :class:`TrainError` otherwise.
    """
    t = np.asarray(truth)
    p = np.asarray(pred)
    if t.shape != p.shape:
        raise TrainError(f"truth shape {t.shape} and prediction shape {p.shape} differ")
    if num_classes < 1:
        raise TrainError(f"num_classes must be >= 1, not {num_classes}")
    if t.size and not (np.issubdtype(t.dtype, np.integer) and np.issubdtype(p.dtype, np.integer)):
        raise TrainError(f"labels must be integers, not {t.dtype} and {p.dtype}")
    t = t.astype(np.int64, copy=False).ravel()
    p = p.astype(np.int64, copy=False).ravel()
    for what, a in (("truth", t), ("prediction", p)):
        if a.size and (a.min() < 0 or a.max() >= num_classes):
            raise TrainError(
                f"{what} labels must be in [0, {num_classes}), found {a.min()}..{a.max()}"
            )
    counts = np.bincount(t * num_classes + p, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).astype(np.int64, copy=False)


def iou_per_class(cm: NDArray[np.int64], ignore: Iterable[int] = ()) -> NDArray[np.float64]:
    """IoU of every class from a confusion matrix; ``NaN`` where the class has no ground truth.

    The items of ground truth ``ignore`` are left out (their rows of ``cm``), so they are no
    false positive of the class they were predicted as; the ignored classes' IoU is ``NaN``.
    """
    cm = np.asarray(cm, dtype=np.int64)
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1]:
        raise TrainError(f"a confusion matrix must be square, not of shape {cm.shape}")
    ignored = [c for c in ignore if 0 <= c < cm.shape[0]]
    if ignored:
        cm = cm.copy()
        cm[ignored, :] = 0
    tp = np.diag(cm).astype(np.float64)
    truth = cm.sum(axis=1).astype(np.float64)
    union = truth + cm.sum(axis=0) - tp
    iou = np.full(cm.shape[0], np.nan)
    present = truth > 0
    iou[present] = tp[present] / union[present]
    return iou


def mean_iou(cm: NDArray[np.int64], ignore: Iterable[int] = ()) -> float:
    """Mean IoU over the classes present in the ground truth, leaving out ``ignore``.

    ``NaN`` when no class is left.
    """
    iou = iou_per_class(cm, ignore)
    keep = ~np.isnan(iou)
    return float(iou[keep].mean()) if keep.any() else float("nan")


def segmentation_scores(
    cm: NDArray[np.int64], names: Mapping[int, str], ignore: Iterable[int] = ()
) -> dict[str, float]:
    """``miou``, ``accuracy`` (over non-ignored ground truth) and ``iou_<name>`` per present class.

    ``names`` maps class ids to short lower-case names; classes without a name are scored under
    ``iou_<id>``.
    """
    ignored = set(ignore)
    iou = iou_per_class(cm, ignored)
    keep = [c for c in range(cm.shape[0]) if c not in ignored]
    total = int(cm[keep].sum())
    correct = int(sum(cm[c, c] for c in keep))
    scores: dict[str, float] = {
        "miou": mean_iou(cm, ignored),
        "accuracy": correct / total if total else float("nan"),
    }
    for c in keep:
        if not np.isnan(iou[c]):
            scores[f"iou_{names.get(c, str(c))}"] = float(iou[c])
    return scores


def lovasz_softmax(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Lovasz-softmax loss of one sample (Berman, Rannen Triki, Blaschko, CVPR 2018).

    ``probs`` ``(P, C)`` class probabilities and ``labels`` ``(P,)`` ids of the labelled points;
    the mean over the classes present in ``labels`` of the Lovasz extension of the Jaccard loss,
    a tight convex surrogate of ``1 - IoU`` computed from the sorted per-point errors.
    """
    classes = torch.unique(labels)
    if classes.numel() == 0:
        return probs.sum() * 0.0
    # All present classes at once, one column each: a single sort of a (P, K) matrix instead
    # of K sorts of P errors (each a kernel launch on a GPU, where they dominated the step).
    fg = (labels[:, None] == classes[None, :]).to(probs.dtype)
    errors = (fg - probs[:, classes]).abs()
    errors_sorted, perm = torch.sort(errors, dim=0, descending=True)
    fg_sorted = fg.gather(0, perm)
    total = fg_sorted.sum(dim=0)
    intersection = total - fg_sorted.cumsum(0)
    union = total + (1.0 - fg_sorted).cumsum(0)
    jaccard = 1.0 - intersection / union
    # The gradient of the Lovasz extension: the increments of the sorted Jaccard losses.
    grad = torch.cat([jaccard[:1], jaccard[1:] - jaccard[:-1]])
    return (errors_sorted * grad).sum(dim=0).mean()
