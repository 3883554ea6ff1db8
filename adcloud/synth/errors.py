"""Errors raised by :mod:`adcloud.synth`."""

from __future__ import annotations

from adcloud.errors import AdcloudError

__all__ = ["SynthError"]


class SynthError(AdcloudError):
    """Invalid drive settings, or a drive that cannot be written where it was asked to go."""
