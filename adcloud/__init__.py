"""adcloud: one Spark-based platform for autonomous-driving data.

Subpackages: :mod:`adcloud.binpipe` (ROS bags as binary Spark partitions) and the
Spark session and cluster helpers in :mod:`adcloud.spark`.
"""

from __future__ import annotations

from adcloud.errors import AdcloudError, ConfigError, MissingComponentError

__all__ = ["AdcloudError", "ConfigError", "MissingComponentError", "__version__"]

__version__ = "0.1.0"
