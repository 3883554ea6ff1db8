"""Offline model training: task data pipelines, models, metrics and model export.

A :class:`~adcloud.train.task.Task` turns decoded bag messages into samples and owns the model,
its loss and its evaluation (:func:`get_task` picks one by name: ``lidar_seg``, ``camera_seg``);
:func:`~adcloud.train.export.export_model` writes a ``torch.export`` program with its metadata
and :func:`~adcloud.train.export.inspect_model` reads it back;
:func:`~adcloud.train.evaluate.evaluate_model` scores an exported model on bags on Spark's
executors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adcloud._lazy import lazy_exports

if TYPE_CHECKING:
    from adcloud.train.errors import (
        CheckpointError,
        DataError,
        ExportError,
        StaleParametersError,
        TrainError,
    )
    from adcloud.train.evaluate import Evaluation, evaluate_model
    from adcloud.train.export import ExportedModel, export_model, inspect_model
    from adcloud.train.task import (
        Batch,
        CountingTask,
        ImageSample,
        PointCloudSample,
        Sample,
        Task,
        get_task,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "errors": (
            "CheckpointError",
            "DataError",
            "ExportError",
            "StaleParametersError",
            "TrainError",
        ),
        "evaluate": ("Evaluation", "evaluate_model"),
        "export": ("ExportedModel", "export_model", "inspect_model"),
        "task": (
            "Batch",
            "CountingTask",
            "ImageSample",
            "PointCloudSample",
            "Sample",
            "Task",
            "get_task",
        ),
    },
)

__all__ = [
    "Batch",
    "CheckpointError",
    "CountingTask",
    "DataError",
    "Evaluation",
    "ExportError",
    "ExportedModel",
    "ImageSample",
    "PointCloudSample",
    "Sample",
    "StaleParametersError",
    "Task",
    "TrainError",
    "evaluate_model",
    "export_model",
    "get_task",
    "inspect_model",
]
