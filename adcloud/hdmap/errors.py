"""Errors raised by :mod:`adcloud.hdmap`."""

from __future__ import annotations

from adcloud.errors import AdcloudError

__all__ = ["BuildError", "DriveDataError", "HdmapError", "MapFormatError"]


class HdmapError(AdcloudError):
    """Root of the HD-map service's errors."""


class DriveDataError(HdmapError):
    """A drive lacks what mapping needs (a topic, a message field, a static transform), or
    carries a message of the wrong type; the message names the bag, topic and field."""


class MapFormatError(HdmapError):
    """A map directory, manifest, tile or label file that cannot be read (names the file)."""


class BuildError(HdmapError):
    """A map build that cannot proceed (another build holds the lock, a stage failed)."""
