"""Segmentation scores: confusion matrix, IoU, mean IoU and the Lovasz-softmax loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adcloud.train.errors import TrainError
from adcloud.train.metrics import (
    confusion_matrix,
    iou_per_class,
    lovasz_softmax,
    mean_iou,
    segmentation_scores,
)


def _loop_confusion(truth: np.ndarray, pred: np.ndarray, k: int) -> np.ndarray:
    cm = np.zeros((k, k), dtype=np.int64)
    for t, p in zip(truth.ravel(), pred.ravel(), strict=True):
        cm[t, p] += 1
    return cm


def test_confusion_matrix_counts_truth_rows_prediction_columns() -> None:
    rng = np.random.default_rng(3)
    truth = rng.integers(0, 5, size=(7, 13))
    pred = rng.integers(0, 5, size=(7, 13))
    cm = confusion_matrix(truth, pred, 5)
    assert cm.dtype == np.int64
    np.testing.assert_array_equal(cm, _loop_confusion(truth, pred, 5))
    assert confusion_matrix([2], [4], 5)[2, 4] == 1


def test_iou_and_mean_leave_out_absent_and_ignored_classes() -> None:
    # class 0: ignored; class 1: 2 TP, 1 FN (predicted 3); class 2: 1 TP, 1 FP (a 1);
    # class 3: no ground truth but one false positive; class 4: absent everywhere.
    truth = np.array([0, 1, 1, 1, 2, 2])
    pred = np.array([1, 1, 1, 3, 2, 2])
    cm = confusion_matrix(truth, pred, 5)
    iou = iou_per_class(cm)
    assert iou[1] == pytest.approx(2 / 4)  # TP 2, FP 1 (the ignored 0 predicted 1), FN 1
    assert iou[2] == pytest.approx(1.0)
    assert np.isnan(iou[3]) and np.isnan(iou[4])
    # the ignored 0 predicted 1 is no false positive once 0 is ignored: class 1 is 2 / 3
    assert mean_iou(cm, ignore=(0,)) == pytest.approx((2 / 3 + 1.0) / 2)
    assert iou_per_class(cm, ignore=(0,))[1] == pytest.approx(2 / 3)
    assert np.isnan(iou_per_class(cm, ignore=(0,))[0])
    assert iou[0] == 0.0  # present, never predicted
    assert mean_iou(cm) == pytest.approx((0.0 + 0.5 + 1.0) / 3)
    assert np.isnan(mean_iou(np.zeros((3, 3), dtype=np.int64)))


def test_segmentation_scores_names_present_classes() -> None:
    truth = np.array([1, 1, 2, 2, 0])
    pred = np.array([1, 2, 2, 2, 1])
    scores = segmentation_scores(
        confusion_matrix(truth, pred, 4), {1: "road", 2: "curb"}, ignore=(0,)
    )
    assert set(scores) == {"miou", "accuracy", "iou_road", "iou_curb"}
    assert scores["accuracy"] == pytest.approx(3 / 4)  # the ignored point is not counted
    assert scores["iou_road"] == pytest.approx(1 / 2)  # the ignored point is no FP of road
    assert scores["iou_curb"] == pytest.approx(2 / 3)
    assert scores["miou"] == pytest.approx((1 / 2 + 2 / 3) / 2)


def _semantic_kitti_iou(truth: np.ndarray, pred: np.ndarray, k: int, ignore: list[int]) -> tuple:
    # the SemanticKITTI reference (semantic-kitti-api, auxiliary/np_ioueval.py): rows are
    # predictions, columns ground truth, and the columns of the ignored classes are zeroed
    conf = np.zeros((k, k), dtype=np.int64)
    np.add.at(conf, (pred, truth), 1)
    conf[:, ignore] = 0
    tp = np.diag(conf).astype(np.float64)
    fp = conf.sum(axis=1) - tp
    fn = conf.sum(axis=0) - tp
    include = [c for c in range(k) if c not in ignore and conf[:, c].sum() > 0]
    iou = tp / np.maximum(tp + fp + fn, 1e-15)
    return iou, float(iou[include].mean()), include


def test_scores_match_the_semantic_kitti_reference_with_unlabelled_points() -> None:
    rng = np.random.default_rng(3)
    k = 6
    truth = rng.integers(0, k, 2000)  # about a sixth unlabelled (0), predicted as anything
    pred = np.where(rng.random(2000) < 0.6, truth, rng.integers(0, k, 2000))
    iou, miou, include = _semantic_kitti_iou(truth, pred, k, [0])
    cm = confusion_matrix(truth, pred, k)
    scores = segmentation_scores(cm, {}, ignore=(0,))
    assert scores["miou"] == pytest.approx(miou)
    assert mean_iou(cm, ignore=(0,)) == pytest.approx(miou)
    for c in include:
        assert scores[f"iou_{c}"] == pytest.approx(iou[c])
    labelled = truth != 0
    assert scores["accuracy"] == pytest.approx(float((truth == pred)[labelled].mean()))


@pytest.mark.parametrize(
    ("truth", "pred", "k", "needle"),
    [
        (np.zeros(3, int), np.zeros(4, int), 3, "shape"),
        (np.array([0, 3]), np.array([0, 1]), 3, "truth labels must be in [0, 3)"),
        (np.array([0, 1]), np.array([-1, 1]), 3, "prediction labels"),
        (np.array([0.5]), np.array([0]), 3, "integers"),
    ],
)
def test_bad_labels_are_refused(truth: np.ndarray, pred: np.ndarray, k: int, needle: str) -> None:
    with pytest.raises(TrainError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        confusion_matrix(truth, pred, k)


def test_lovasz_of_hard_predictions_is_one_minus_iou() -> None:
    # For one-hot probabilities the Lovasz extension equals the Jaccard loss itself.
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 4, size=200)
    pred = np.where(rng.random(200) < 0.7, labels, rng.integers(0, 4, size=200))
    probs = torch.nn.functional.one_hot(torch.from_numpy(pred), 4).double()
    loss = lovasz_softmax(probs, torch.from_numpy(labels))
    iou = iou_per_class(confusion_matrix(labels, pred, 4))
    assert float(loss) == pytest.approx(float(np.mean(1 - iou[~np.isnan(iou)])))
    perfect = torch.nn.functional.one_hot(torch.from_numpy(labels), 4).double()
    assert float(lovasz_softmax(perfect, torch.from_numpy(labels))) == pytest.approx(0.0)


def _lovasz_reference(probs: np.ndarray, labels: np.ndarray) -> float:
    """The Lovasz-softmax loss class by class, written from the paper's Algorithm 1."""
    losses = []
    for c in np.unique(labels):
        fg = (labels == c).astype(np.float64)
        errors = np.abs(fg - probs[:, c])
        order = np.argsort(-errors, kind="stable")
        e, g = errors[order], fg[order]
        jaccard = 1.0 - (g.sum() - np.cumsum(g)) / (g.sum() + np.cumsum(1.0 - g))
        losses.append(float(np.dot(e, np.diff(jaccard, prepend=0.0))))
    return float(np.mean(losses))


@pytest.mark.parametrize("classes", [1, 3, 10])
def test_lovasz_matches_a_per_class_reference(classes: int) -> None:
    rng = np.random.default_rng(classes)
    labels = rng.integers(0, classes, size=500)
    logits = torch.from_numpy(rng.normal(0, 2, size=(500, 11)))
    probs = logits.softmax(dim=1)
    expected = _lovasz_reference(probs.numpy(), labels)
    assert float(lovasz_softmax(probs, torch.from_numpy(labels))) == pytest.approx(expected)
    # ties (equal errors) do not change the value: quantised probabilities have many
    coarse = torch.round(probs * 4) / 4
    expected = _lovasz_reference(coarse.numpy(), labels)
    assert float(lovasz_softmax(coarse, torch.from_numpy(labels))) == pytest.approx(expected)


def test_lovasz_of_no_labelled_points_is_a_zero_with_a_gradient() -> None:
    logits = torch.zeros(0, 3, requires_grad=True)
    loss = lovasz_softmax(logits.softmax(dim=1), torch.zeros(0, dtype=torch.long))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert logits.grad is not None


def test_lovasz_gradient_moves_towards_the_labels() -> None:
    labels = torch.tensor([0, 0, 1, 1, 2])
    logits = torch.zeros(5, 3, requires_grad=True)
    lovasz_softmax(logits.softmax(dim=1), labels).backward()
    assert logits.grad is not None
    # Lowering the loss means raising each point's true-class logit.
    true_grad = logits.grad[torch.arange(5), labels]
    assert (true_grad < 0).all()
