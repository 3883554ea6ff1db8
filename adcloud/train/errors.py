"""Errors raised by :mod:`adcloud.train`."""

from __future__ import annotations

from adcloud.errors import AdcloudError

__all__ = [
    "CheckpointError",
    "DataError",
    "ExportError",
    "StaleParametersError",
    "TrainError",
]


class TrainError(AdcloudError):
    """Root of the training service's errors."""


class CheckpointError(TrainError):
    """A checkpoint that cannot be written or read back (missing, truncated, wrong version or
    checksum); the message names the store URI and what to do next."""


class StaleParametersError(TrainError):
    """A trainer was handed a parameter version older than (or missing from) the one it must use
    for this iteration; stale parameters are never used for training."""


class ExportError(TrainError):
    """An exported model directory whose ``model.pt2`` or ``metadata.json`` cannot be written or
    read back; the message names the file."""


class DataError(TrainError):
    """A bag message a task cannot turn into samples: wrong message type on a topic, a missing
    or mistyped ``PointCloud2`` field, mismatched image sizes; the message names the topic and
    field."""
