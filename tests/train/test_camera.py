"""The ``camera_seg`` task: Image ETL and pairing, batching, the U-Net, training quality."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from rosbags.typesys import Stores, get_typestore

from adcloud.train.camera import NUM_CLASSES, CameraSegTask, image_array
from adcloud.train.errors import DataError, TrainError
from adcloud.train.task import ImageSample, Sample, get_task

_T = get_typestore(Stores.ROS2_HUMBLE).types
_log = logging.getLogger(__name__)
IMAGE, LABELS = "/camera/image_raw", "/camera/labels"


def image_msg(pixels: np.ndarray, encoding: str, stamp_ns: int, *, pad: int = 0) -> Any:
    """A ``sensor_msgs/msg/Image`` of ``pixels`` with ``pad`` bytes of padding per row."""
    h, w = pixels.shape[:2]
    rows = pixels.reshape(h, -1)
    data = np.concatenate([rows, np.full((h, pad), 77, np.uint8)], axis=1)
    header = _T["std_msgs/msg/Header"](
        stamp=_T["builtin_interfaces/msg/Time"](sec=stamp_ns // 10**9, nanosec=stamp_ns % 10**9),
        frame_id="camera_optical",
    )
    return _T["sensor_msgs/msg/Image"](
        header=header,
        height=h,
        width=w,
        encoding=encoding,
        is_bigendian=0,
        step=rows.shape[1] + pad,
        data=data.reshape(-1),
    )


def pair(rng: np.random.Generator, h: int = 8, w: int = 12) -> tuple[np.ndarray, np.ndarray]:
    rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    labels = rng.integers(0, NUM_CLASSES, (h, w), dtype=np.uint8)
    return rgb, labels


# --------------------------------------------------------------------------- ETL


def test_image_decoding_handles_padding_and_bgr() -> None:
    rgb, labels = pair(np.random.default_rng(0))
    np.testing.assert_array_equal(
        image_array(image_msg(rgb, "rgb8", 0, pad=5), IMAGE, ("rgb8",)), rgb
    )
    bgr = image_msg(np.ascontiguousarray(rgb[:, :, ::-1]), "bgr8", 0)
    np.testing.assert_array_equal(image_array(bgr, IMAGE, ("rgb8", "bgr8")), rgb)
    np.testing.assert_array_equal(
        image_array(image_msg(labels, "mono8", 0, pad=3), LABELS, ("mono8",)), labels
    )


def test_images_pair_with_labels_by_stamp_in_either_order() -> None:
    rng = np.random.default_rng(1)
    task = CameraSegTask()
    rgb1, lab1 = pair(rng)
    rgb2, lab2 = pair(rng)
    assert list(task.samples(IMAGE, 1, image_msg(rgb1, "rgb8", 100))) == []
    (first,) = task.samples(LABELS, 1, image_msg(lab1, "mono8", 100))
    assert isinstance(first, ImageSample) and first.stamp_ns == 100
    np.testing.assert_array_equal(first.image, rgb1)
    np.testing.assert_array_equal(first.labels, lab1)
    # Labels first, and an unpaired image (another stamp) in between is dropped.
    assert list(task.samples(IMAGE, 2, image_msg(rgb1, "rgb8", 150))) == []
    assert list(task.samples(LABELS, 2, image_msg(lab2, "mono8", 200))) == []
    (second,) = task.samples(IMAGE, 2, image_msg(rgb2, "rgb8", 200))
    assert isinstance(second, ImageSample) and second.stamp_ns == 200
    np.testing.assert_array_equal(second.image, rgb2)
    np.testing.assert_array_equal(second.labels, lab2)
    # Two images of one stamp never pair with each other.
    assert list(task.samples(IMAGE, 3, image_msg(rgb1, "rgb8", 300))) == []
    assert list(task.samples(IMAGE, 3, image_msg(rgb2, "rgb8", 300))) == []
    assert list(task.samples("/camera/camera_info", 3, object())) == []


def test_bad_images_name_topic_and_field() -> None:
    rng = np.random.default_rng(2)
    rgb, labels = pair(rng)
    task = CameraSegTask()
    with pytest.raises(DataError, match=r"/camera/image_raw: Image field 'encoding' is 'mono8'"):
        list(task.samples(IMAGE, 0, image_msg(labels, "mono8", 0)))
    with pytest.raises(DataError, match=r"/camera/labels: expected sensor_msgs/msg/Image .*got "):
        list(task.samples(LABELS, 0, _T["std_msgs/msg/String"](data="x")))
    short = image_msg(rgb, "rgb8", 0)
    short.data = short.data[:-10]
    with pytest.raises(DataError, match=r"/camera/image_raw: Image field 'data' holds 278 bytes"):
        list(task.samples(IMAGE, 0, short))
    thin = image_msg(rgb, "rgb8", 0)
    thin.step = 10
    with pytest.raises(DataError, match=r"field 'step' \(10\)"):
        list(task.samples(IMAGE, 0, thin))
    bad_labels = labels.copy()
    bad_labels[0, 0] = 200
    with pytest.raises(DataError, match="/camera/labels: Image field 'data' holds label id 200"):
        list(task.samples(LABELS, 0, image_msg(bad_labels, "mono8", 0)))
    list(task.samples(IMAGE, 0, image_msg(rgb, "rgb8", 5)))
    with pytest.raises(DataError, match="width/height"):
        list(task.samples(LABELS, 0, image_msg(labels[:, :6].copy(), "mono8", 5)))


def test_samples_from_a_synthetic_drive(camera_train: Sequence[Sample]) -> None:
    # 20 s at 5 Hz: every image has its label image.
    assert len(camera_train) == 100
    first = camera_train[0]
    assert isinstance(first, ImageSample)
    assert first.image.shape == (120, 160, 3) and first.labels.shape == (120, 160)
    labels = np.concatenate([s.labels.ravel() for s in camera_train])  # type: ignore[union-attr]
    assert set(np.unique(labels)) == set(range(11))  # sky (0) and all ten classes
    # The sky is at the top of the image, the road at the bottom.
    assert (first.labels[0] == 0).mean() > 0.5
    assert (first.labels[-1] == 1).mean() > 0.5
    task = get_task("camera_seg")
    assert pickle.loads(pickle.dumps(task)) == task


# --------------------------------------------------------------------------- batches, model


def test_batches_are_deterministic_and_flip_image_with_labels() -> None:
    rng = np.random.default_rng(3)
    samples: list[Sample] = []
    for i in range(5):
        rgb, _ = pair(rng)
        # Labels that are a function of the pixels: a flip must keep them in register.
        samples.append(ImageSample(i, rgb, (rgb[:, :, 0] % NUM_CLASSES).astype(np.uint8)))
    task = CameraSegTask()
    a = list(task.batches(samples, 2, torch.Generator().manual_seed(0)))
    b = list(task.batches(samples, 2, torch.Generator().manual_seed(0)))
    assert [len(x["images"]) for x in a] == [2, 2, 1]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["images"], y["images"]) and torch.equal(x["labels"], y["labels"])
    originals = {s.image.tobytes() for s in samples}  # type: ignore[union-attr]
    flipped = 0
    for batch in a:
        assert batch["images"].shape[1:] == (3, 8, 12)
        red = (batch["images"][:, 0] * 255).round().long()
        assert torch.equal(red % NUM_CLASSES, batch["labels"])
        for img in batch["images"]:
            hwc = (img.permute(1, 2, 0) * 255).round().byte().numpy()
            flipped += hwc.tobytes() not in originals
    assert 0 < flipped < 5


@pytest.mark.parametrize("per_batch", [1, 2])
def test_batches_refuse_images_of_two_sizes_before_the_first_batch(per_batch: int) -> None:
    """Bags of two camera sizes failed at whichever step first drew both sizes into one batch
    (here the third), with one image per batch never: the export then failed."""
    rng = np.random.default_rng(4)
    samples: list[Sample] = [ImageSample(i, *pair(rng)) for i in range(4)]
    samples.append(ImageSample(4, *pair(rng, h=6, w=10)))
    batches = CameraSegTask().batches(samples, per_batch, torch.Generator().manual_seed(0))
    with pytest.raises(TrainError, match=r"of 2 sizes: 12x8 \(4 images\), 10x6 \(1 images\)"):
        next(batches)


def test_net_shapes_and_batch_independence() -> None:
    torch.manual_seed(0)
    model = CameraSegTask().build_model().eval()
    images = torch.rand(3, 3, 120, 160)
    with torch.no_grad():
        out = model(images)
        one = model(images[1:2])
    assert out.shape == (3, NUM_CLASSES, 120, 160)
    torch.testing.assert_close(one[0], out[1], rtol=1e-4, atol=1e-4)


def test_options() -> None:
    task = get_task("camera_seg", {"channels": [8, 16], "groups": 4})
    assert isinstance(task, CameraSegTask) and task.config.channels == (8, 16)
    assert task.topics == (IMAGE, LABELS)
    with pytest.raises(TrainError, match="unknown camera_seg option 'size'"):
        get_task("camera_seg", {"size": 3})
    with pytest.raises(TrainError, match="multiples of groups=4"):
        get_task("camera_seg", {"channels": [6]})


# --------------------------------------------------------------------------- quality


def test_learns_to_segment_a_heldout_drive(
    camera_train: Sequence[Sample],
    camera_heldout: Sequence[Sample],
    fit_model: Callable[..., tuple[torch.nn.Module, list[float]]],
) -> None:
    task = get_task("camera_seg")
    torch.manual_seed(0)
    untrained = task.evaluate(task.build_model(), camera_heldout)
    model, losses = fit_model(task, camera_train, steps=120, batch_size=2, lr=1e-2)
    scores = task.evaluate(model, camera_heldout)
    _log.info("camera_seg: held-out %s", scores)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert scores["miou"] >= 0.6
    assert untrained["miou"] < 0.3
    assert scores["iou_sky"] > 0.9 and scores["iou_road"] > 0.9


# --------------------------------------------------------------------------- held-out sizes


def _small_camera_drive(where: Any, width: int, height: int, seed: int) -> str:
    from adcloud.synth import DriveConfig, generate_drive  # noqa: PLC0415

    cfg = DriveConfig(
        seconds=1,
        seed=seed,
        lidar=False,
        camera=True,
        truth_raster=False,
        camera_width=width,
        camera_height=height,
    )
    return str(generate_drive(cfg, where / f"cam{width}x{height}.bag").bag)


def _camera_config(tmp_path: Any, **kw: Any) -> Any:
    from adcloud.train.config import TrainConfig  # noqa: PLC0415

    base: dict[str, Any] = {
        "task": "camera_seg",
        "task_options": {"channels": [4, 8], "lovasz": False},
        "sync": "single",
        "steps": 2,
        "batch_size": 2,
        "checkpoint_every": 0,
        "store": "local:///camera-heldout-tests",
        "store_options": (f"root={tmp_path / 'store'}",),
        "threads": 1,
        "progress": False,
        "out": str(tmp_path / "out" / "{run}"),
    }
    base.update(kw)
    return TrainConfig(**base).validate()


@pytest.fixture(scope="module")
def camera_bags(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two 1 s drives: the training one with a 32x24 camera, the held-out one 48x32."""
    where = tmp_path_factory.mktemp("camera_sizes")
    return _small_camera_drive(where, 32, 24, 6), _small_camera_drive(where, 48, 32, 5)


def test_a_heldout_bag_of_another_image_size_is_refused_before_training(
    spark: Any, camera_bags: tuple[str, str], tmp_path: Any
) -> None:
    """Held-out images of another size than the training images were scored during and
    after training (the U-Net runs on any size), while ``adcloud train eval`` refuses them
    for the exported model: now the run refuses them before its first step."""
    from adcloud.train.job import run_training  # noqa: PLC0415

    train_bag, held_bag = camera_bags
    for eval_every in (0, 1):
        cfg = _camera_config(
            tmp_path, bags=(train_bag,), heldout_bags=(held_bag,), eval_every=eval_every
        )
        with pytest.raises(TrainError) as refused:
            run_training(spark, cfg, task=CameraSegTask.from_options(cfg.task_options))
        said = str(refused.value)
        assert said.startswith(
            f"train.heldout_bags: {held_bag} gives the model's input images of size 3x32x48 "
            f"per sample (topic {IMAGE}), but the training bags give 3x24x32 ({train_bag})"
        ), said
        assert "adcloud train eval refuses such a bag" in said
        assert not (tmp_path / "out").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("eval_every", [0, 1])
def test_heldout_samples_of_another_image_size_are_never_scored(
    spark: Any, camera_bags: tuple[str, str], tmp_path: Any, eval_every: int
) -> None:
    """A run given its training samples (no bags to compare with before Spark) still
    never scores held-out images of another size: with eval_every it refuses them before
    the first step; without, the final scoring fails naming the bag and both sizes."""
    from adcloud.train.job import local_samples, run_training  # noqa: PLC0415

    train_bag, held_bag = camera_bags
    cfg = _camera_config(tmp_path, heldout_bags=(held_bag,), eval_every=eval_every)
    task = CameraSegTask.from_options(cfg.task_options)
    samples = local_samples(task, [train_bag])
    keyed = spark.sparkContext.parallelize([((0, i), s) for i, s in enumerate(samples)], 1)
    with pytest.raises(TrainError, match=r"size 3x32x48 per sample.* 3x24x32") as refused:
        run_training(spark, cfg, task=task, keyed=keyed)
    assert held_bag in str(refused.value)
    assert not (tmp_path / "out").exists()
