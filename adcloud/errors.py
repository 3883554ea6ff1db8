"""The root of every error adcloud raises.

Each subpackage defines its own error class beneath :class:`AdcloudError` in its
``errors`` module; library code raises them and only the CLI turns them into
messages and exit codes.
"""

from __future__ import annotations

__all__ = ["AdcloudError", "ConfigError", "MissingComponentError"]


class AdcloudError(Exception):
    """Base of all adcloud errors."""


class ConfigError(AdcloudError):
    """A setting (file, environment variable or argument) has an invalid value."""


class MissingComponentError(AdcloudError):
    """A real component (Java, ROS, OpenCL, an optional package) is not installed.

    The message always says how to install it.
    """
