"""Camera semantic segmentation: the ``camera_seg`` task, its ETL and its model.

ETL: ``/camera/image_raw`` (``sensor_msgs/Image``, ``rgb8`` or ``bgr8``) and ``/camera/labels``
(``mono8`` label ids, 0 = sky; ``docs/synth-truth-format.md`` sections 6 and 8) are paired by
header stamp into :class:`~adcloud.train.task.ImageSample` records. The task buffers the one
message whose partner has not arrived yet (the two share their stamp and record time, so they are
neighbours in the bag); a message whose partner never comes is dropped when the next one arrives,
and a pair split across two Spark partitions is lost.

Model (:class:`CameraSegNet`): a small U-Net (two 3x3 convs per level, stride-2 downsampling,
nearest-neighbour upsampling with skip connections, GroupNorm) that scores every pixel over the
label ids 0..10 (sky included). Input ``float32 (B, 3, H, W)`` RGB in ``[0, 1]``; output
``(B, 11, H, W)`` logits. Sized for the synthetic drives' 160x120 images.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the usual spelling
from numpy.typing import NDArray
from torch import nn

from adcloud.binpipe import BinpipeError
from adcloud.binpipe import image_array as image_array_of
from adcloud.synth.labels import Label
from adcloud.train.errors import DataError, TrainError
from adcloud.train.metrics import confusion_matrix, lovasz_softmax, segmentation_scores
from adcloud.train.task import (
    Batch,
    ImageSample,
    Sample,
    config_from_options,
    evaluating,
    expect_msgtype,
)

__all__ = ["NUM_CLASSES", "CameraConfig", "CameraSegNet", "CameraSegTask", "image_array"]

_log = logging.getLogger(__name__)

#: Logits per pixel: one per label id 0..10 (0 = sky is a class of its own here).
NUM_CLASSES = len(Label)
_NAMES = {int(lab): ("sky" if lab == Label.UNLABELED else lab.name.lower()) for lab in Label}
_CHANNELS = {"rgb8": 3, "bgr8": 3, "mono8": 1}


@dataclass(frozen=True)
class CameraConfig:
    """Settings of the ``camera_seg`` task (topics and network size)."""

    #: Topics of the RGB image and of the label image.
    image_topic: str = "/camera/image_raw"
    label_topic: str = "/camera/labels"
    #: Channels of the U-Net levels (each level halves the image).
    channels: tuple[int, ...] = (16, 32, 48)
    #: GroupNorm groups.
    groups: int = 4
    #: Loss weight of each label id 0..10: about 1/sqrt(pixel frequency) in the synthetic
    #: drives relative to ROAD, capped at 10 (signs cover 0.05 % of the pixels).
    class_weights: tuple[float, ...] = (1.0, 1.0, 5.0, 4.0, 2.7, 2.7, 2.0, 10.0, 10.0, 3.5, 7.5)
    #: Add the Lovasz-softmax loss (a surrogate of 1 - IoU) to the cross-entropy.
    lovasz: bool = True
    #: Training augmentation: a random left-right mirror of image and labels.
    augment: bool = True
    #: Images per forward pass in :meth:`CameraSegTask.evaluate`.
    eval_batch: int = 16

    @classmethod
    def full(cls) -> CameraConfig:
        """The benchmark preset: a wider, deeper U-Net."""
        return cls(channels=(32, 64, 128, 256), groups=8)

    def validate(self) -> CameraConfig:
        """Return ``self`` if usable, else raise :class:`TrainError` naming the setting."""
        if (
            self.groups < 1
            or not self.channels
            or any(c < 1 or c % self.groups for c in self.channels)
        ):
            raise TrainError(
                f"camera_seg option channels {self.channels} must be positive multiples of "
                f"groups={self.groups}"
            )
        if len(self.class_weights) != NUM_CLASSES or any(w < 0 for w in self.class_weights):
            raise TrainError(
                f"camera_seg option class_weights must be {NUM_CLASSES} weights >= 0 (ids 0..10)"
            )
        if self.eval_batch < 1:
            raise TrainError("camera_seg option eval_batch must be >= 1")
        return self


def image_array(msg: Any, topic: str, encodings: Sequence[str]) -> NDArray[np.uint8]:
    """The pixels of a decoded ``sensor_msgs/Image`` as ``uint8 (H, W, 3)`` RGB or ``(H, W)``.

    ``encodings`` lists the accepted encodings (``rgb8``, ``bgr8``, ``mono8``; ``bgr8`` is
    returned as RGB). Row padding (``step`` larger than a row) is skipped. Raises
    :class:`DataError` naming ``topic`` and the field (``encoding``, ``step``, ``data``).
    """
    expect_msgtype(msg, topic, "sensor_msgs/msg/Image")
    enc = str(msg.encoding)
    if enc not in encodings or enc not in _CHANNELS:
        raise DataError(
            f"{topic}: Image field 'encoding' is {enc!r}; this task reads {', '.join(encodings)}"
        )
    try:
        img = image_array_of(msg, topic=topic)
    except BinpipeError as err:
        raise DataError(str(err)) from None
    if enc == "bgr8":
        img = img[:, :, ::-1]
    return img.copy()  # own the pixels: samples outlive the message they came from


def _stamp_ns(msg: Any, timestamp: int) -> int:
    stamp = getattr(getattr(msg, "header", None), "stamp", None)
    return timestamp if stamp is None else int(stamp.sec) * 10**9 + int(stamp.nanosec)


# --------------------------------------------------------------------------- network


class _ConvBlock(nn.Sequential):
    """Two 3x3 convs with GroupNorm and ReLU; the first may stride."""

    def __init__(self, cin: int, cout: int, groups: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.GroupNorm(groups, cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.GroupNorm(groups, cout),
            nn.ReLU(),
        )


class CameraSegNet(nn.Module):
    """Per-pixel label scores of RGB images (see the module docstring).

    ``forward(images)``: ``float32 (B, 3, H, W)`` in ``[0, 1]`` -> ``(B, NUM_CLASSES, H, W)``.
    """

    def __init__(self, config: CameraConfig | None = None) -> None:
        super().__init__()
        cfg = (config or CameraConfig()).validate()
        ch = cfg.channels
        self.stem = _ConvBlock(3, ch[0], cfg.groups)
        self.down = nn.ModuleList(
            _ConvBlock(a, b, cfg.groups, stride=2) for a, b in itertools.pairwise(ch)
        )
        self.up = nn.ModuleList(
            _ConvBlock(b + a, a, cfg.groups)
            for a, b in zip(ch[:-1][::-1], ch[1:][::-1], strict=True)
        )
        self.head = nn.Conv2d(ch[0], NUM_CLASSES, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, NUM_CLASSES, H, W)``."""
        x = self.stem((images - 0.5) * 4.0)
        skips = [x]
        for block in self.down:
            x = block(x)
            skips.append(x)
        skips.pop()
        for block in self.up:
            skip = skips.pop()
            x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
            x = block(torch.cat([x, skip], dim=1))
        logits: torch.Tensor = self.head(x)
        return logits


# --------------------------------------------------------------------------- task


@dataclass
class CameraSegTask:
    """The ``camera_seg`` task: per-pixel labels of camera images (see the module docstring).

    Implements :class:`~adcloud.train.task.Task`. Holds at most one buffered message.
    """

    config: CameraConfig = field(default_factory=CameraConfig)
    name: str = "camera_seg"
    _pending: tuple[str, int, NDArray[np.uint8]] | None = field(default=None, repr=False)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> CameraSegTask:
        """A task from the task options: ``preset`` (``small``/``full``) and
        :class:`CameraConfig` fields; raises :class:`TrainError` naming an unknown option."""
        return cls(
            config_from_options(
                "camera_seg",
                options,
                CameraConfig(),
                CameraConfig.full(),
                {"channels": int, "class_weights": float},
            )
        )

    @property
    def class_names(self) -> tuple[str, ...]:
        """The name of every label id, by id (what :meth:`scores` calls ``iou_<name>``)."""
        return tuple(_NAMES.get(i, str(i)) for i in range(NUM_CLASSES))

    @property
    def topics(self) -> tuple[str, ...]:
        """The image and label topics."""
        return (self.config.image_topic, self.config.label_topic)

    def samples(self, topic: str, timestamp: int, decoded: Any) -> list[Sample]:
        """``[ImageSample]`` when ``decoded`` completes a pair with the buffered message (same
        header stamp); otherwise ``[]`` and the message is buffered (replacing an unpaired
        one). Other topics give ``[]``."""
        cfg = self.config
        if topic == cfg.image_topic:
            kind, arr = "image", image_array(decoded, topic, ("rgb8", "bgr8"))
        elif topic == cfg.label_topic:
            kind, arr = "labels", image_array(decoded, topic, ("mono8",))
            if arr.size and arr.max() >= NUM_CLASSES:
                raise DataError(
                    f"{topic}: Image field 'data' holds label id {arr.max()}, outside the label "
                    f"set 0..{NUM_CLASSES - 1} (docs/synth-truth-format.md §6)"
                )
        else:
            return []
        stamp = _stamp_ns(decoded, timestamp)
        pending = self._pending
        if pending is None or pending[0] == kind or pending[1] != stamp:
            if pending is not None and pending[0] != kind:
                _log.debug("camera_seg: dropping an unpaired %s at %d", pending[0], pending[1])
            self._pending = (kind, stamp, arr)
            return []
        self._pending = None
        image, labels = (arr, pending[2]) if kind == "image" else (pending[2], arr)
        if image.shape[:2] != labels.shape:
            raise DataError(
                f"{cfg.image_topic} is {image.shape[1]}x{image.shape[0]} but {cfg.label_topic} "
                f"is {labels.shape[1]}x{labels.shape[0]} at stamp {stamp} (fields width/height "
                "must match)"
            )
        return [ImageSample(stamp_ns=stamp, image=image, labels=labels)]

    def build_model(self) -> CameraSegNet:
        """A fresh :class:`CameraSegNet` (seed with ``torch.manual_seed`` first)."""
        return CameraSegNet(self.config)

    @staticmethod
    def _images(samples: Sequence[Sample]) -> list[ImageSample]:
        out = []
        for s in samples:
            if not isinstance(s, ImageSample):
                raise TrainError(f"camera_seg takes ImageSample, not {type(s).__name__}")
            out.append(s)
        return out

    @staticmethod
    def _stack(images: Sequence[NDArray[np.uint8]]) -> torch.Tensor:
        shapes = {img.shape for img in images}
        if len(shapes) != 1:
            raise TrainError(f"camera_seg: images of different sizes in one batch: {shapes}")
        arr = np.stack(images).astype(np.float32) / 255.0
        return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()

    def batches(
        self, samples: Sequence[Sample], batch_size: int, generator: torch.Generator
    ) -> Iterator[Batch]:
        """Shuffled batches (``images`` float ``(B, 3, H, W)``, ``labels`` long ``(B, H, W)``);
        with ``augment``, each image is mirrored left-right with p = 0.5."""
        if batch_size < 1:
            raise TrainError(f"batch_size must be >= 1, not {batch_size}")
        frames = self._images(samples)
        # one size for the whole shard, checked before the first batch: mixed sizes failed
        # at whichever step first drew two of them into one batch (never, with one image per
        # batch, and then the export of a model for one size failed after the last step)
        sizes: dict[tuple[int, ...], int] = {}
        for frame in frames:
            sizes[frame.image.shape[:2]] = sizes.get(frame.image.shape[:2], 0) + 1
        if len(sizes) > 1:
            shown = ", ".join(f"{w}x{h} ({n} images)" for (h, w), n in sizes.items())
            raise TrainError(
                f"camera_seg: the training images are of {len(sizes)} sizes: {shown}; the "
                "model is trained and exported for one size: train on bags whose camera "
                "images are all of one size (or set task_options image_topic to one camera)"
            )
        order = torch.randperm(len(frames), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            images, labels = [], []
            for i in order[start : start + batch_size]:
                img, lab = frames[i].image, frames[i].labels
                if self.config.augment and bool(torch.rand((), generator=generator) < 0.5):
                    img, lab = img[:, ::-1], lab[:, ::-1]
                images.append(img)
                labels.append(lab)
            yield {
                "images": self._stack(images),
                "labels": torch.from_numpy(np.stack(labels).astype(np.int64)),
            }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Per-image cross-entropy (plus Lovasz-softmax), averaged over the images."""
        logits: torch.Tensor = model(batch["images"])
        labels = batch["labels"]
        weight = torch.tensor(self.config.class_weights, device=logits.device)
        per_pixel = F.cross_entropy(logits, labels, weight=weight, reduction="none")
        per_image = per_pixel.flatten(1).mean(dim=1)
        if self.config.lovasz:
            probs = logits.softmax(dim=1).flatten(2).transpose(1, 2)  # (B, H*W, C)
            per_image = per_image + torch.stack(
                [lovasz_softmax(probs[i], labels[i].flatten()) for i in range(len(labels))]
            )
        return per_image.mean()

    def predict(self, model: nn.Module, samples: Sequence[Sample]) -> list[NDArray[np.uint8]]:
        """Predicted label image ``uint8 (H, W)`` of every sample (evaluation mode)."""
        frames = self._images(samples)
        if not frames:
            return []
        device = next(model.parameters()).device
        out: list[NDArray[np.uint8]] = []
        with evaluating(model):
            step = self.config.eval_batch
            for start in range(0, len(frames), step):
                images = self._stack([f.image for f in frames[start : start + step]])
                pred = model(images.to(device)).argmax(dim=1).cpu().numpy()
                out.extend(pred.astype(np.uint8))
        return out

    def eval_counts(self, model: nn.Module, samples: Sequence[Sample]) -> NDArray[np.int64]:
        """The confusion matrix (truth x prediction, ``NUM_CLASSES`` square) of every pixel
        of ``samples``: :meth:`scores` of a sum of these is the score of all their samples."""
        frames = self._images(samples)
        cm = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
        for f, pred in zip(frames, self.predict(model, frames), strict=True):
            cm += confusion_matrix(f.labels, pred, NUM_CLASSES)
        return cm

    def scores(self, counts: NDArray[Any]) -> dict[str, float]:
        """``miou``, pixel ``accuracy`` and ``iou_<label>`` (``iou_sky`` for 0) of every label
        present in confusion matrix ``counts``; absent labels are left out of the mean."""
        return segmentation_scores(counts, _NAMES)

    def evaluate(self, model: nn.Module, samples: Sequence[Sample]) -> dict[str, float]:
        """:meth:`scores` of ``samples`` (see there)."""
        if not samples:
            raise TrainError("camera_seg evaluate: no samples (is the held-out data empty?)")
        scores = self.scores(self.eval_counts(model, samples))
        _log.info("camera_seg: mIoU %.3f over %d images", scores["miou"], len(samples))
        return scores

    def example_inputs(self, samples: Sequence[Sample]) -> tuple[torch.Tensor]:
        """``(images,)`` of the first two samples (two, so the batch size is traced as a
        variable; the one image is repeated when there is only one)."""
        frames = self._images(samples)[:2]
        if not frames:
            raise TrainError("camera_seg example_inputs: need at least one sample")
        images = [f.image for f in frames]
        if len(images) == 1:
            images.append(images[0][:, ::-1])
        return (self._stack(images),)

    def dynamic_shapes(self) -> dict[str, dict[int, Any]]:
        """The batch size varies at inference; the image size is fixed by the camera."""
        return {"images": {0: torch.export.Dim("images", min=1, max=1024)}}
