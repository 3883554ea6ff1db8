"""Synthetic drives for the training tests, generated once per test session.

- ``train_drive``: 20 s, seed 6 -- the training data;
- ``heldout_drive``: 10 s, seed 5 -- a different world, route and noise, for held-out scores.

Both have a 16-beam x 512-column LiDAR and the 160x120 camera; both contain all ten LiDAR
classes (vehicles included). Samples are made by the tasks' own ETL from messages read with
adcloud.binpipe and decoded with its MessageDecoder, as the Spark job does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from adcloud.binpipe import ConnectionInfo, MessageDecoder, plan_partitions, read_partition
from adcloud.synth import DriveConfig, DriveResult
from adcloud.train.config import TrainConfig
from adcloud.train.loop import train
from adcloud.train.task import Sample, Task, get_task
from tests.drives import shared_drive

# (no truth raster: training reads the labels the bags carry)
TRAIN_DRIVE = DriveConfig(
    seconds=20, seed=6, lidar_beams=16, lidar_columns=512, camera=True, truth_raster=False
)
HELDOUT_DRIVE = DriveConfig(
    seconds=10, seed=5, lidar_beams=16, lidar_columns=512, camera=True, truth_raster=False
)


def decoded_messages(bag: str | Path, topics: Sequence[str]) -> Iterator[tuple[str, int, Any]]:
    """``(topic, record time ns, decoded message)`` of ``topics`` in bag order."""
    for part in plan_partitions(str(bag), topics=topics):
        decoder = MessageDecoder(
            ConnectionInfo(c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization)
            for c in part.connections
        )
        for msg in read_partition(part):
            yield msg.topic, msg.timestamp, decoder.decode(msg)


def task_samples(task: Task, bag: str | Path) -> list[Sample]:
    """All samples the task's ETL makes from ``bag``."""
    return [
        s
        for topic, t, msg in decoded_messages(bag, task.topics)
        for s in task.samples(topic, t, msg)
    ]


def fit(
    task: Task,
    samples: Sequence[Sample],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    **settings: Any,
) -> tuple[torch.nn.Module, list[float]]:
    """Train a fresh model with the product loop (:func:`adcloud.train.loop.train`, one
    trainer, AdamW; ``settings`` are further :class:`TrainConfig` fields); returns the
    trained model and the losses.

    Runs on one thread: with other test processes on the same two cores, two threads spend
    most of their time waiting for each other.
    """
    threads = torch.get_num_threads()
    config = TrainConfig(
        task=task.name,
        sync="single",
        workers=1,
        steps=steps,
        batch_size=batch_size,
        optimizer="adamw",
        lr=lr,
        weight_decay=1e-4,
        seed=seed,
        checkpoint_every=0,
        threads=1,
        progress=False,
        **settings,
    ).validate()
    try:
        result = train(task, samples, config)
    finally:
        torch.set_num_threads(threads)
    model = task.build_model()
    model.load_state_dict(result.state_dict())
    return model, list(result.losses)


@pytest.fixture(scope="session")
def train_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """The 20 s training drive (seed 6)."""
    out = tmp_path_factory.mktemp("train_drive") / "train.bag"
    return shared_drive(TRAIN_DRIVE, out, tmp_path_factory)


@pytest.fixture(scope="session")
def heldout_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """The 10 s held-out drive (seed 5)."""
    out = tmp_path_factory.mktemp("heldout_drive") / "heldout.bag"
    return shared_drive(HELDOUT_DRIVE, out, tmp_path_factory)


@pytest.fixture(scope="session")
def lidar_train(train_drive: DriveResult) -> list[Sample]:
    """LiDAR samples of the training drive."""
    return task_samples(get_task("lidar_seg"), train_drive.bag)


@pytest.fixture(scope="session")
def lidar_heldout(heldout_drive: DriveResult) -> list[Sample]:
    """LiDAR samples of the held-out drive."""
    return task_samples(get_task("lidar_seg"), heldout_drive.bag)


@pytest.fixture(scope="session")
def camera_train(train_drive: DriveResult) -> list[Sample]:
    """Camera samples of the training drive."""
    return task_samples(get_task("camera_seg"), train_drive.bag)


@pytest.fixture(scope="session")
def camera_heldout(heldout_drive: DriveResult) -> list[Sample]:
    """Camera samples of the held-out drive."""
    return task_samples(get_task("camera_seg"), heldout_drive.bag)


@pytest.fixture(scope="session")
def fit_model() -> Callable[..., tuple[torch.nn.Module, list[float]]]:
    """:func:`fit`, for tests that train."""
    return fit
